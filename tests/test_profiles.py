"""Profiles: choice, refusal of unknown or tampered options, the options form, config checks."""

import json
import re
import types
from pathlib import Path

import pytest
from traitlets import TraitError
from traitlets.config import Config

from kubevirt_spawner import manifests as m
from kubevirt_spawner import profiles as prof
from kubevirt_spawner.objects import merge_patch
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
    assert prof.choose(ps, {}).slug == "cpu"
    assert prof.choose(ps, {"profile": "gpu-a100"}).slug == "gpu-a100"
    assert prof.choose(ps, {"profile": ["gpu-a100"]}).slug == "gpu-a100"
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
    assert re.search(r'value="cpu"\s+checked', form) and "GPU &lt;A100&gt;" in form
    assert re.search(r'value="gpu-a100"\s+checked', prof.options_form(ps, {"profile": "gpu-a100"}))
    assert prof.options_from_form({"profile": ["gpu-a100"]}) == {"profile": "gpu-a100"}


# Zero-to-JupyterHub's values carry KubeSpawner's shape (kubespawner/spawner.py, profile_list's
# help): a dict of profiles by key, options with choices and an unlisted_choice.
Z2JH = {
    "b-gpu": {
        "display_name": "GPU machine", "description": "One or two A100s",
        "kubevirt_override": {"cpu_guarantee": 8, "node_selector": {"gpu": "a100"}},
        "profile_options": {
            "gpus": {"display_name": "GPUs", "choices": {
                "one": {"display_name": "One A100", "kubevirt_override": {"gpus": {"nvidia.com/A100": 1}}},
                "two": {"display_name": "Two A100s", "default": True,
                        "kubevirt_override": {"gpus": {"nvidia.com/A100": 2}, "node_selector": {"big": "yes"}}}}},
            "image": {"display_name": "System image", "choices": {
                "cuda": {"display_name": "CUDA 12", "kubevirt_override": {"golden_image": "vm-images/cuda"}}},
                "unlisted_choice": {"enabled": True, "display_name": "Image in vm-images",
                                    "validation_regex": "^[a-z0-9-]+$",
                                    "validation_message": "A name in vm-images: lowercase letters, digits and -.",
                                    "kubevirt_override": {"golden_image": "vm-images/{value}",
                                                          "extra_labels": {"image": "{value}"}}}},
        },
        "allowed_groups": ["gpu-users"],
    },
    "a-cpu": {"display_name": "CPU machine", "default": True},
}


def test_a_dict_profile_list_is_its_values_in_the_order_of_its_keys():
    ps = prof.normalise(Z2JH)
    assert [p["slug"] for p in ps] == ["cpu-machine", "gpu-machine"]
    gpu = ps[1]
    assert [c for c, v in gpu["profile_options"]["image"]["choices"].items() if v["default"]] == ["cuda"]
    assert gpu["profile_options"]["image"]["unlisted_choice"]["display_name_in_choices"] == "Other..."
    assert gpu["allowed_groups"] == ("gpu-users",) and gpu["allowed_users"] is None


def test_choices_and_a_value_of_ones_own_apply_in_order():
    """KubeSpawner's order (kubespawner/spawner.py _load_profile): the profile's override, then
    each option's, a dict merging into the setting and None removing a key."""
    ps = prof.normalise(Z2JH)
    chosen = prof.choose(ps, {"profile": "gpu-machine"}, "ann", ["gpu-users"])
    assert chosen.options == {"gpus": "two", "image": "cuda"}  # the defaults, recorded as chosen
    assert prof.overrides(chosen)[1:] == [{"gpus": {"nvidia.com/A100": 2}, "node_selector": {"big": "yes"}},
                                          {"golden_image": "vm-images/cuda"}]
    own = prof.choose(ps, {"profile": "gpu-machine", "gpus": "one", "image--unlisted-choice": "rocky-9"},
                      "ann", ["gpu-users"])
    assert own.options == {"gpus": "one", "image--unlisted-choice": "rocky-9"}
    # an empty value of one's own beside a listed choice is no value (KubeSpawner's reading)
    assert prof.choose(ps, {"profile": "gpu-machine", "image": "cuda", "image--unlisted-choice": ""},
                       "ann", ["gpu-users"]).options["image"] == "cuda"
    assert prof.overrides(own)[2] == {"golden_image": "vm-images/rocky-9", "extra_labels": {"image": "rocky-9"}}
    assert merge_patch({"a": 1, "b": {"c": 2, "d": 3}}, {"b": {"c": None, "e": 4}, "f": [1]}) == \
        {"a": 1, "b": {"d": 3, "e": 4}, "f": [1]}
    assert merge_patch([1, 2], [3]) == [3]  # lists replace
    assert merge_patch({}, {"a": {"b": None, "c": 1}}) == {"a": {"c": 1}}  # (no null reaches the cluster)


@pytest.mark.parametrize("options,message", [
    ({"gpus": "eight"}, r"Unknown choice 'eight' for GPUs \(gpus\) in the profile 'gpu-machine'. "
                        r"Choose one of: one, two."),
    ({"image--unlisted-choice": "Rocky 9"}, r"The value 'Rocky 9' for System image \(image\) .* is not accepted: "
                                            r"A name in vm-images: lowercase letters, digits and -."),
    ({"image--unlisted-choice": "rocky/../../kube-system/x"}, "is not accepted"),
    ({"image--unlisted-choice": "r" * 300}, "at most 256 printable characters"),
    ({"image--unlisted-choice": "rocky\x1b[2J"}, "printable"),
    ({"image--unlisted-choice": ""}, "is empty: type a value of your own, or pick one of the listed choices"),
    # its value becomes a label: "ab-" matches the admin's regex, but no label ends in "-"
    ({"image--unlisted-choice": "rocky-"}, "cannot be used: it goes into a Kubernetes label"),
    ({"gpus--unlisted-choice": "4"}, r"Unsupported option\(s\) gpus--unlisted-choice for the profile 'gpu-machine'"),
    ({"cpu_guarantee": 64}, r"Unsupported option\(s\) cpu_guarantee .* it offers gpus, image, "
                            r"image--unlisted-choice"),
    ({"gpus": ["one", "two"]}, "The option 'gpus' must be given as a single name."),
    ({"gpus": 1}, "The option 'gpus' must be given as a single name."),
])
def test_anything_a_profile_does_not_offer_is_refused_naming_it(options, message):
    ps = prof.normalise(Z2JH)
    with pytest.raises(prof.ProfileError, match=message):
        prof.choose(ps, {"profile": "gpu-machine", **options}, "ann", ["gpu-users"])


def test_the_whole_value_must_match_the_regex():
    """KubeSpawner checks with re.match, which anchors only the start: a regex without `$` takes
    any tail. Here the whole value must match."""
    ps = prof.normalise([{"display_name": "A", "profile_options": {"tag": {"unlisted_choice": {
        "enabled": True, "validation_regex": "[a-z]+", "kubevirt_override": {"extra_labels": {"t": "{value}"}}}}}}])
    assert re.match("[a-z]+", "abc/../x")  # what KubeSpawner would let through
    with pytest.raises(prof.ProfileError, match="must match"):
        prof.choose(ps, {"tag--unlisted-choice": "abc/../x"})
    assert prof.choose(ps, {"tag--unlisted-choice": "abc"}).options == {"tag--unlisted-choice": "abc"}
    with pytest.raises(prof.ProfileError, match="The option tag in the profile 'a' needs a value"):
        prof.choose(ps, {})


def test_a_profile_limited_to_groups_or_users_is_refused_to_others_and_not_offered():
    ps = prof.normalise({**Z2JH, "c-mine": {"display_name": "Mine", "allowed_users": ["bob"]}})
    with pytest.raises(prof.ProfileError, match="The profile 'gpu-machine' is not open to eve: its administrator "
                                                "limits it to some users or groups. Profiles you may use: cpu-machine."):
        prof.choose(ps, {"profile": "gpu-machine"}, "eve", ["students"])
    assert prof.choose(ps, {"profile": "gpu-machine"}, "ann", ["gpu-users"]).slug == "gpu-machine"
    assert prof.choose(ps, {"profile": "mine"}, "bob", []).slug == "mine"
    assert [p["slug"] for p in prof.usable(ps, "eve", ["students"])] == ["cpu-machine"]
    form = prof.options_form(prof.usable(ps, "eve", ["students"]))
    assert "gpu-machine" not in form and "Mine" not in form
    only = prof.normalise([{"display_name": "GPU", "allowed_groups": ["gpu-users"]}])
    with pytest.raises(prof.ProfileError, match="No profile of this hub is open to eve"):
        prof.choose(only, {}, "eve", [])
    # the workstations service acts on a machine its owner already has
    assert prof.choose(only, {}, None, [], check_access=False).slug == "gpu"


def test_the_form_has_kubespawners_fields_and_reads_back_without_script():
    """kubespawner/templates/form.html's field names: `profile`, `profile-option-SLUG--OPTION`
    and `...--unlisted-choice`; without script both of an option's fields arrive and the select
    says which counts (its "unlisted-choice" entry)."""
    ps = prof.normalise(Z2JH)
    form = prof.options_form(ps, {"profile": "gpu-machine", "image--unlisted-choice": "<rocky>"})
    assert 'name="profile-option-gpu-machine--gpus"' in form
    assert 'name="profile-option-gpu-machine--image--unlisted-choice"' in form
    assert 'value="&lt;rocky&gt;"' in form and "<rocky>" not in form  # the user's last value, escaped
    assert re.search(r'<option value="unlisted-choice"\s+selected>Other...</option>', form)
    assert re.search(r'<option value="two"\s+selected>', form)  # the default choice
    assert re.search(r'value="gpu-machine"\s+checked', form)
    form_data = {"profile": ["gpu-machine"], "profile-option-gpu-machine--gpus": ["one"],
                 "profile-option-gpu-machine--image": ["cuda"],
                 "profile-option-gpu-machine--image--unlisted-choice": ["typed but not chosen"],
                 "profile-option-cpu-machine--gpus": ["two"]}  # another profile's fields count for nothing
    assert prof.options_from_form(form_data) == {"profile": "gpu-machine", "gpus": "one", "image": "cuda"}
    form_data["profile-option-gpu-machine--image"] = ["unlisted-choice"]
    form_data["profile-option-gpu-machine--image--unlisted-choice"] = ["rocky-9"]
    assert prof.options_from_form(form_data)["image--unlisted-choice"] == "rocky-9"
    del form_data["profile-option-gpu-machine--image"]  # (KubeSpawner's script drops the select's name)
    assert prof.options_from_form(form_data)["image--unlisted-choice"] == "rocky-9"


def test_an_admins_form_template_gets_the_profiles_and_escapes():
    ps = prof.normalise(Z2JH)
    template = ('{% for p in profile_list %}<b>{{ p.display_name }}</b>'
                '{% endfor %}<i>{{ user_options.profile }}</i>')
    assert prof.options_form(ps, {"profile": "<x>"}, template) == \
        "<b>CPU machine</b><b>GPU machine</b><i>cpu-machine</i>"
    assert "&lt;script&gt;" in prof.options_form(prof.normalise([{"display_name": "<script>"}]), {}, template)


@pytest.mark.parametrize("bad,message", [
    ([{"slug": "x"}], "needs a display_name"),
    ([{"display_name": "A", "slug": "a"}, {"display_name": "B", "slug": "a"}], "two profiles with the slug 'a'"),
    ([{"display_name": "A", "kubevirt_override": {"cmd": ["sh"]}}], "cannot set cmd"),
    ([{"display_name": "A", "default": True}, {"display_name": "B", "default": True}], "more than one"),
    ([{"display_name": "A", "profile_options": {"size": {"choices": {}}}}], "neither choices nor an enabled"),
    ([{"display_name": "A", "profile_options": {"a--b": {"choices": {"x": {}}}}}], "option name 'a--b'"),
    ([{"display_name": "A", "profile_options": {"s": {"choices": {"x": {"kubevirt_override": {"cmd": 1}}}}}}],
     "option s choice x: kubevirt_override cannot set cmd"),
    ([{"display_name": "A", "profile_options": {"s": {"unlisted_choice": {"enabled": True,
                                                                          "validation_regex": "("}}}}],
     "validation_regex does not compile"),
    ([{"display_name": "A", "allowed_groups": "staff"}], "allowed_groups must be a list of names"),
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


def user(name: str, *groups: str):
    return types.SimpleNamespace(name=name, url=f"/user/{name}/",
                                 groups=[types.SimpleNamespace(name=g) for g in groups])


async def test_a_choice_reaches_the_machine_through_callables_and_merges():
    """Override values may be callables taking the spawner, sync or async (KubeSpawner's
    _apply_overrides and its choices' callables); a dict merges into the setting, and the user's
    choices are recorded for the workstations service."""
    async def memory(spawner):
        return "24G" if spawner.user.name == "ann" else "8G"

    profiles = {**Z2JH, "b-gpu": {**Z2JH["b-gpu"],
                                  "kubevirt_override": {**Z2JH["b-gpu"]["kubevirt_override"],
                                                        "mem_guarantee": memory,
                                                        "cpu_limit": lambda spawner: 12}}}
    c = Config()
    c.KubeVirtSpawner.profile_list = profiles
    c.KubeVirtSpawner.node_selector = {"zone": "a"}
    spawner = KubeVirtSpawner(config=c, user=user("ann", "gpu-users"),
                              user_options={"profile": "gpu-machine", "gpus": "one",
                                            "image--unlisted-choice": "rocky-9"})
    spec = await spawner._spec_for(await spawner._selection(spawner.user_options))
    assert spec.gpus == (("nvidia.com/A100", 1),) and spec.golden_image == "vm-images/rocky-9"
    assert spec.node_selector == {"zone": "a", "gpu": "a100"}  # the base's, merge_patch with the profile's
    assert (spec.memory, spec.cpu_limit, spec.cpu, spec.extra_labels) == ("24Gi", "12", "8", {"image": "rocky-9"})
    assert json.loads(spec.profile_options) == {"gpus": "one", "image--unlisted-choice": "rocky-9"}
    default = await spawner._spec_for(await spawner._selection({"profile": "gpu-machine"}))
    assert default.node_selector == {"zone": "a", "gpu": "a100", "big": "yes"}
    assert json.loads(default.profile_options) == {"gpus": "two", "image": "cuda"}
    assert spawner.node_selector == {"zone": "a"}  # the setting itself is left as it was


async def test_a_start_outside_a_profiles_groups_is_refused_before_anything_is_made():
    from kubevirt_spawner.workstation import WorkstationError
    c = Config()
    c.KubeVirtSpawner.profile_list = Z2JH
    spawner = KubeVirtSpawner(config=c, user=user("eve", "students"), user_options={"profile": "gpu-machine"})
    spawner._wake_progress = lambda: None  # (no cluster here, so no progress stream to wake)
    with pytest.raises(WorkstationError, match="The profile 'gpu-machine' is not open to eve") as caught:
        await spawner.start()  # (no cluster here: it stops before any request)
    assert caught.value.reason == "profile"
    form = await spawner._render_options_form(spawner)
    assert "cpu-machine" in form and "gpu-machine" not in form


async def test_a_callable_profile_list_may_be_async_and_its_errors_are_a_sentence():
    from kubevirt_spawner.workstation import WorkstationError

    async def profiles(spawner):
        return {"mine": {"display_name": f"{spawner.user.name}'s machine"}}

    c = Config()
    c.KubeVirtSpawner.profile_list = profiles
    spawner = KubeVirtSpawner(config=c, user=user("ann"))
    assert "ann&#39;s machine" in await spawner._render_options_form(spawner)
    assert (await spawner._selection({})).slug == "ann-s-machine"
    c.KubeVirtSpawner.profile_list = lambda spawner: [{"slug": "nameless"}]
    spawner = KubeVirtSpawner(config=c, user=user("ann"))
    with pytest.raises(WorkstationError, match=r"This hub's profile list cannot be used \(profile_list\[0\] needs "
                                               r"a display_name\)\. Tell your administrator\."):
        await spawner._selection({})


def test_the_storage_quota_check_covers_every_listed_choice():
    c = Config()
    c.KubeVirtSpawner.root_disk_size = "50Gi"
    c.KubeVirtSpawner.namespace_resource_quota = {"requests.storage": "200Gi"}
    c.KubeVirtSpawner.allow_shared_origin = True
    c.KubeVirtSpawner.profile_list = [{"display_name": "A", "profile_options": {"disk": {"choices": {
        "small": {"kubevirt_override": {"root_disk_size": "60Gi"}},
        "big": {"kubevirt_override": {"root_disk_size": "150Gi"}}}}}}]
    with pytest.raises(TraitError, match=r"\(profile a\) while it is cloned.*need 300Gi"):
        KubeVirtSpawner.validate_config(c)


# Every configurable setting of KubeSpawner 7.1 (kubespawner/spawner.py): what an admin may carry over.
KUBESPAWNER_7_1 = """
k8s_api_verify_ssl k8s_api_ssl_ca_cert k8s_api_host k8s_api_threadpool_workers k8s_api_request_timeout
k8s_api_request_retry_timeout events_enabled enable_user_namespaces slug_scheme user_namespace_labels
user_namespace_annotations user_namespace_template namespace services_enabled ip cmd working_dir service_account
automount_service_account_token dns_name_template pod_name_template pod_connect_ip storage_pvc_ensure delete_pvc
pvc_name_template remember_pvc_name component_label secret_name_template secret_mount_path hub_connect_ip
hub_connect_port common_labels extra_labels extra_annotations image image_pull_policy image_pull_secrets
node_selector uid gid fs_gid supplemental_gids privileged allow_privilege_escalation container_security_context
pod_security_context modify_pod_hook after_pod_created_hook volumes volume_mounts storage_capacity
storage_extra_annotations storage_extra_labels storage_class storage_access_modes storage_selector lifecycle_hooks
init_containers extra_container_config extra_pod_config extra_containers handle_legacy_names scheduler_name
tolerations node_affinity_preferred node_affinity_required pod_affinity_preferred pod_affinity_required
pod_anti_affinity_preferred pod_anti_affinity_required extra_resource_guarantees extra_resource_limits
delete_stopped_pods additional_profile_form_template_paths profile_form_template profile_list priority_class_name
delete_grace_period slow_spawn_message_threshold slow_spawn_message_frequency slow_spawn_message get_pod_url
""".split()


def test_the_readmes_kubespawner_table_covers_every_setting_and_names_real_ones():
    """docs/admin/profiles.md "Coming from KubeSpawner": each KubeSpawner 7.1 setting has a row, and every setting
    a row names here exists (a config trait of KubeVirtSpawner, JupyterHub's own included)."""
    readme = (Path(__file__).resolve().parents[1] / "docs" / "admin" / "profiles.md").read_text()
    table = readme.split("<!-- kubespawner-migration: checked by tests/test_profiles.py -->\n", 1)[1].split("\n\n")[0]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in table.splitlines()[2:]]
    assert rows and all(len(row) == 3 for row in rows), table
    covered = {name for theirs, _, _ in rows for name in re.findall(r"`([a-z_0-9]+)`", theirs)}
    assert sorted(set(KUBESPAWNER_7_1) - covered) == [] and sorted(covered - set(KUBESPAWNER_7_1)) == []
    ours = set(KubeVirtSpawner.class_traits(config=True))
    for _, here, why in rows:
        named = re.findall(r"`([a-z_0-9]+)`", here)
        assert named or (here == "none" and why), (here, why)
        assert set(named) <= ours, sorted(set(named) - ours)
    assert "notebook_dir" in ours and "kubevirt_override" not in ours  # (JupyterHub's own count; profile keys not)


async def test_a_failing_callable_or_stale_saved_options_are_a_sentence_not_a_traceback(caplog):
    """A callable override or profile_list that raises is one sentence for the user and the error in
    the hub's log; options saved from an earlier request that no longer fit (or never did: the REST
    API saves what it is sent) leave the form with its defaults."""
    from kubevirt_spawner.workstation import WorkstationError
    c = Config()
    c.KubeVirtSpawner.profile_list = [{"display_name": "A", "kubevirt_override": {"cpu_limit": lambda s: 1 / 0}}]
    spawner = KubeVirtSpawner(config=c, user=user("ann"))
    # (the log is the hub's: once any module made a JupyterHub app, traitlets hands out its logger,
    # which does not propagate to the root logger caplog listens on)
    spawner.log.addHandler(caplog.handler)
    try:
        with pytest.raises(WorkstationError, match="The profile 'a' could not work out its cpu_limit. Tell your "
                                                   "administrator; the hub's log has the error.") as caught:
            await spawner._spec_for(await spawner._selection({}))
    finally:
        spawner.log.removeHandler(caplog.handler)
    assert caught.value.reason == "profile" and "ZeroDivisionError" in caplog.text

    def broken(spawner):
        raise ConnectionError("the group service is down")
    c.KubeVirtSpawner.profile_list = broken
    with pytest.raises(WorkstationError, match="This hub's profile list failed"):
        await KubeVirtSpawner(config=c, user=user("ann"))._selection({})

    c.KubeVirtSpawner.profile_list = Z2JH
    spawner = KubeVirtSpawner(config=c, user=user("ann", "gpu-users"),
                              user_options={"profile": "gpu-machine", "image": ["a", "b"]})
    form = await spawner._render_options_form(spawner)
    assert re.search(r'value="cpu-machine"\s+checked', form)  # the defaults


async def test_the_service_never_falls_back_to_another_profile():
    """The workstations service makes the machine of the profile and choices the VM records; with
    that profile gone it uses the hub's own settings, never the list's default (which may be some
    group's)."""
    c = Config()
    c.KubeVirtSpawner.profile_list = [{"display_name": "GPU", "default": True, "allowed_groups": ["gpu-users"],
                                       "kubevirt_override": {"root_disk_size": "500Gi"}},
                                      {"display_name": "Small", "kubevirt_override": {"root_disk_size": "70Gi"}}]
    spawner = KubeVirtSpawner(config=c, user=user("eve"))
    spawner._workstation = _spec_of  # (no cluster here: the spec is what matters)
    assert (await spawner.workstation("small", {"gpus": "eight"})).root_disk_size == "70Gi"  # stale choices
    assert (await spawner.workstation("renamed")).root_disk_size == "60Gi"  # the hub's own
    assert (await spawner.workstation(None)).root_disk_size == "60Gi"  # a machine from before profiles


async def _spec_of(spec, for_start=False):
    return spec


def test_shared_data_and_scratch_are_settings_a_profile_may_change():
    """Issue 26: c.KubeVirtSpawner.shared_data and scratch_disk_size, checked when set, replaced
    by a profile's override (a list replaces: a profile names all its shares)."""
    from kubevirt_spawner.workstation import WorkstationError
    c = Config()
    c.KubeVirtSpawner.shared_data = [{"claim": "datasets", "mount_path": "/data/datasets", "read_only": True}]
    c.KubeVirtSpawner.scratch_disk_size = "100Gi"
    spawner = KubeVirtSpawner(config=c)
    plain = spawner._machine_spec(None)
    assert plain.shared_data == (m.SharedData("datasets", "datasets", "/data/datasets", True),)
    assert plain.scratch_disk_size == "100Gi"
    team = {"slug": "team", "kubevirt_override": {"scratch_disk_size": "", "shared_data": [
        {"name": "team", "claim": "physics-share", "mount_path": "/data/team"}]}}
    spec = spawner._machine_spec(team)
    assert spec.shared_data == (m.SharedData("team", "physics-share", "/data/team", False),)
    assert spec.scratch_disk_size is None
    bad = {"slug": "odd", "kubevirt_override": {"shared_data": [{"claim": "x", "mount_path": "/etc/x"}]}}
    with pytest.raises(WorkstationError, match="Profile 'odd' has an invalid shared_data.*inside /etc"):
        spawner._machine_spec(bad)
    with pytest.raises(TraitError, match="KubeVirtSpawner.shared_data: .*inside /usr"):
        KubeVirtSpawner(config=Config()).shared_data = [{"claim": "x", "mount_path": "/usr/x"}]
    with pytest.raises(TraitError, match="scratch_disk_size = 'big' is not a Kubernetes quantity"):
        KubeVirtSpawner(config=Config()).scratch_disk_size = "big"


def test_extra_disks_are_a_setting_a_profile_may_change_and_count_in_the_storage_quota():
    """Issue 26: c.KubeVirtSpawner.extra_disks, checked when set, replaced by a profile's
    override; a clone from outside the golden image's namespace (which the admission policy
    refuses) or a disk on a share's path is refused with a sentence; the namespace's storage
    quota must hold the extra disks too."""
    from kubevirt_spawner.workstation import WorkstationError
    c = Config()
    c.KubeVirtSpawner.extra_disks = [{"name": "models", "size": "100Gi", "mount_path": "/data/models"}]
    spawner = KubeVirtSpawner(config=c)
    assert spawner._machine_spec(None).extra_disks == (m.ExtraDisk("models", "100Gi", "/data/models"),)
    ref = {"slug": "ref", "kubevirt_override": {"extra_disks": [
        {"name": "ref", "size": "60Gi", "mount_path": "/data/ref", "clone_from": "vm-images/reference"}]}}
    assert [d.name for d in spawner._machine_spec(ref).extra_disks] == ["ref"]
    elsewhere = {"slug": "odd", "kubevirt_override": {"extra_disks": [
        {"name": "ref", "size": "60Gi", "mount_path": "/data/ref", "clone_from": "team-data/reference"}]}}
    with pytest.raises(WorkstationError, match="Profile 'odd' has invalid shared data or extra disks: the extra disk "
                                               "ref is cloned from team-data/reference, outside the golden image's "
                                               "namespace vm-images"):
        spawner._machine_spec(elsewhere)
    clash = {"slug": "clash", "kubevirt_override": {"shared_data": [
        {"claim": "datasets", "mount_path": "/data/models/datasets"}]}}
    with pytest.raises(WorkstationError, match="overlap"):
        spawner._machine_spec(clash)
    with pytest.raises(TraitError, match="KubeVirtSpawner.extra_disks: .*inside /etc"):
        KubeVirtSpawner(config=Config()).extra_disks = [{"name": "x", "size": "1Gi", "mount_path": "/etc/x"}]
    c.KubeVirtSpawner.namespace_resource_quota = {"requests.storage": "200Gi"}
    with pytest.raises(TraitError, match=r"its extra disks \(100Gi\)"):
        KubeVirtSpawner(config=c)._check_storage_quota()
    c.KubeVirtSpawner.namespace_resource_quota = {"requests.storage": "220Gi"}
    KubeVirtSpawner(config=c)._check_storage_quota()


@pytest.mark.parametrize("setting,value,message", [
    ("namespace_labels", {"example.com/team": "{username}"}, "not a template of {user} only"),
    ("namespace_labels", {"example.com/team": "a b"}, "not a label value"),
    ("namespace_labels", {"example.com/team": "x" * 40 + "-{user}"}, "not a label value"),
    ("namespace_labels", {"kubevirt-spawner.io/user": "x"}, "kubevirt-spawner's own"),
    ("namespace_labels", {"kubernetes.io/metadata.name": "x"}, "not a key of one's own"),
    ("namespace_annotations", {"a" * 254 + ".com/x": "y"}, "not a key of one's own"),
    ("namespace_annotations", {"bad key!": "x"}, "not a key of one's own"),
])
def test_namespace_labels_and_annotations_are_checked_when_set(setting, value, message):
    with pytest.raises(TraitError, match=f"KubeVirtSpawner.{setting}: .*" + re.escape(message)):
        setattr(KubeVirtSpawner(config=Config()), setting, value)
    KubeVirtSpawner(config=Config()).namespace_annotations = {"example.com/note": "owned by {user}, ask first"}
