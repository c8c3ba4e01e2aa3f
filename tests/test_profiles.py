"""Profiles: choice, refusal of unknown or tampered options, the options form, config checks."""

import pytest
from traitlets import TraitError
from traitlets.config import Config

from kubevirt_spawner import profiles as prof
from kubevirt_spawner.spawner import KubeVirtSpawner

PROFILES = [
    {"display_name": "CPU", "slug": "cpu", "default": True, "kubevirt_override": {"cpu_guarantee": 2}},
    {"display_name": "GPU <A100>", "kubevirt_override": {"gpus": {"nvidia.com/A100-PCIE-40GB": 1}}, "version": "7"},
]


def test_normalise_fills_slug_and_version():
    ps = prof.normalise(PROFILES)
    assert [p["slug"] for p in ps] == ["cpu", "gpu-a100"]
    assert ps[1]["version"] == "7"
    assert ps[0]["version"] == prof.content_version({"cpu_guarantee": 2})
    changed = prof.normalise([{**PROFILES[0], "kubevirt_override": {"cpu_guarantee": 4}}])
    assert changed[0]["version"] != ps[0]["version"]


def test_choose_default_known_unknown_and_tampered():
    ps = prof.normalise(PROFILES)
    assert prof.choose(ps, {})["slug"] == "cpu"
    assert prof.choose(ps, {"profile": "gpu-a100"})["slug"] == "gpu-a100"
    assert prof.choose(ps, {"profile": ["gpu-a100"]})["slug"] == "gpu-a100"
    with pytest.raises(prof.ProfileError, match="Unknown profile 'tpu'. Choose one of: cpu, gpu-a100"):
        prof.choose(ps, {"profile": "tpu"})
    with pytest.raises(prof.ProfileError, match="Unsupported option.*cpu_guarantee"):
        prof.choose(ps, {"profile": "cpu", "cpu_guarantee": 64})
    with pytest.raises(prof.ProfileError, match="single name"):
        prof.choose(ps, {"profile": {"slug": "cpu"}})
    assert prof.choose([], {}) is None
    with pytest.raises(prof.ProfileError, match="no profiles"):
        prof.choose([], {"profile": "cpu"})


def test_options_form_escapes_and_marks_the_choice():
    ps = prof.normalise(PROFILES)
    form = prof.options_form(ps)
    assert 'value="cpu" checked' in form and "GPU &lt;A100&gt;" in form
    assert 'value="gpu-a100" checked' in prof.options_form(ps, "gpu-a100")
    assert prof.options_from_form({"profile": ["gpu-a100"]}) == {"profile": "gpu-a100"}


@pytest.mark.parametrize("bad,message", [
    ([{"slug": "x"}], "needs a display_name"),
    ([{"display_name": "A", "slug": "a"}, {"display_name": "B", "slug": "a"}], "two profiles with the slug 'a'"),
    ([{"display_name": "A", "kubevirt_override": {"cmd": ["sh"]}}], "cannot set cmd"),
    ([{"display_name": "A", "default": True}, {"display_name": "B", "default": True}], "more than one"),
])
def test_bad_profile_lists_fail_at_start_up_naming_the_setting(bad, message):
    c = Config()
    c.KubeVirtSpawner.profile_list = bad
    with pytest.raises(TraitError, match="KubeVirtSpawner.profile_list.*" + message):
        KubeVirtSpawner(config=c)


@pytest.mark.parametrize("setting,value,message", [
    ("golden_image", "just-a-name", "golden_image = 'just-a-name'"),
    ("firmware", "uefi", "firmware"),
    ("root_disk_size", "big", "root_disk_size = 'big'"),
    ("vm_name_template", "{user_server}_vm", "vm_name_template"),
    ("service_name_template", "{nope}", "service_name_template"),
    ("url_mode", "ingress", "url_mode"),
    ("gpus", {"A100": 1}, "gpus"),
    ("max_concurrent_clones", 0, "max_concurrent_clones"),
    ("network_policy_ingress_from", [{"pods": "hub"}], "network_policy_ingress_from.*not a NetworkPolicy peer"),
    ("namespace_resource_quota", {"requests.cpu": "lots"}, "namespace_resource_quota: requests.cpu = 'lots'"),
    ("namespace_limit_range", [{"max": {"storage": "1Ti"}}], "namespace_limit_range.*needs the type"),
    # the VM's launcher pod would get them: a default memory limit OOM-kills the guest
    ("namespace_limit_range", [{"type": "Container", "default": {"memory": "4Gi"}}],
     "a Container limit would apply to the VM's launcher pod"),
    ("namespace_limit_range", [{"type": "Pod", "max": {"memory": "8Gi"}}], "a Pod limit would apply"),
    ("namespace_limit_range", [{"type": "PersistentVolumeClaim", "max": {"storage": "huge"}}],
     "namespace_limit_range: max storage = 'huge'"),
])
def test_bad_settings_fail_naming_the_setting(setting, value, message):
    c = Config()
    setattr(c.KubeVirtSpawner, setting, value)
    with pytest.raises(TraitError, match=message):
        KubeVirtSpawner(config=c)


@pytest.mark.parametrize("quota,profile_root,message", [
    ({"requests.storage": "399Gi"}, None, r"requests.storage = 399Gi cannot hold one workstation while it is cloned.*"
                                          r"need 400Gi"),
    ({"ceph-rbd.storageclass.storage.k8s.io/requests.storage": "300Gi"}, None, "need 400Gi"),
    ({"requests.storage": "400Gi"}, "200Gi", r"workstation \(profile big\) while it is cloned.*need 500Gi"),
])
def test_a_storage_quota_that_cannot_hold_a_clone_is_refused(quota, profile_root, message):
    """While a system disk is cloned, CDI's clone populator keeps a temporary claim of the target's
    size in the same namespace (pkg/controller/populators/populator-base.go, the prime PVC): a
    quota must hold both disks and that copy, for every profile, or the clone waits on
    ErrExceededQuota until the start times out."""
    c = Config()
    c.JupyterHub.subdomain_host = "https://jupyter.example.org"
    c.KubeVirtSpawner.root_disk_size = "150Gi"
    c.KubeVirtSpawner.workspace_disk_size = "100Gi"
    c.KubeVirtSpawner.storage_class = "ceph-rbd"
    c.KubeVirtSpawner.namespace_resource_quota = quota
    if profile_root:
        c.KubeVirtSpawner.profile_list = [{"display_name": "Big", "slug": "big",
                                           "kubevirt_override": {"root_disk_size": profile_root}}]
    with pytest.raises(TraitError, match=message):
        KubeVirtSpawner.validate_config(c)
    c.KubeVirtSpawner.namespace_resource_quota = {k: "1Ti" for k in quota}
    KubeVirtSpawner.validate_config(c)  # room enough


def test_profile_override_values_are_validated_like_settings():
    c = Config()
    c.KubeVirtSpawner.profile_list = [{"display_name": "Bad", "kubevirt_override": {"mem_guarantee": "lots"}}]
    spawner = KubeVirtSpawner(config=c)
    from kubevirt_spawner.workstation import WorkstationError
    with pytest.raises(WorkstationError, match="invalid mem_guarantee") as caught:
        spawner._machine_spec(prof.normalise(c.KubeVirtSpawner.profile_list)[0])
    assert caught.value.reason == "profile"


def test_a_profile_chooses_the_firmware_of_its_golden_image():
    """A profile with another golden image may boot it through other firmware; a value KubeVirt's
    bootloader field has no kind for is refused with the profile's name."""
    from kubevirt_spawner.workstation import WorkstationError
    spawner = KubeVirtSpawner(config=Config())
    assert spawner._machine_spec({"slug": "plain"}).firmware == "bios"
    efi = {"slug": "efi-image", "kubevirt_override": {"golden_image": "vm-images/efi-only", "firmware": "efi"}}
    assert spawner._machine_spec(efi).firmware == "efi"
    bad = {"slug": "odd", "kubevirt_override": {"firmware": "coreboot"}}
    with pytest.raises(WorkstationError, match="Profile 'odd' has an invalid firmware"):
        spawner._machine_spec(bad)


def test_a_hub_without_subdomains_is_refused_unless_an_admin_opts_out():
    """Issue 30, item 1. Without c.JupyterHub.subdomain_host every user's pages are on the hub's
    origin (JupyterHub's own security docs: never serve users' HTML there without subdomains)."""
    c = Config()
    with pytest.raises(TraitError, match="c.JupyterHub.subdomain_host is not set"):
        KubeVirtSpawner.validate_config(c)
    c.KubeVirtSpawner.allow_shared_origin = True  # the documented opt-out
    KubeVirtSpawner.validate_config(c)
    subdomains = Config()
    subdomains.JupyterHub.subdomain_host = "https://jupyter.example.org"
    KubeVirtSpawner.validate_config(subdomains)


def test_ssh_is_on_unless_the_hub_or_a_profile_turns_it_off():
    """c.KubeVirtSpawner.ssh_enabled (default on) and a profile's override decide whether the
    guest's tunnel opens (the spawner passes it as KUBEVIRT_SSH_ENABLED, read by guest.proxy)."""
    from kubevirt_spawner.workstation import WorkstationError
    assert KubeVirtSpawner(config=Config())._machine_spec(None).ssh_enabled is True
    c = Config()
    c.KubeVirtSpawner.ssh_enabled = False
    spawner = KubeVirtSpawner(config=c)
    assert spawner._machine_spec({"slug": "plain"}).ssh_enabled is False
    assert spawner._machine_spec({"slug": "dev", "kubevirt_override": {"ssh_enabled": True}}).ssh_enabled is True
    with pytest.raises(WorkstationError, match="Profile 'odd' has an invalid ssh_enabled"):
        spawner._machine_spec({"slug": "odd", "kubevirt_override": {"ssh_enabled": "sometimes"}})
