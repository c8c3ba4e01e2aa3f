"""Every object the spawner builds validates against the upstream schemas and says whose it is."""

import base64
import dataclasses
import json
import re

import pytest
import yaml
from kubernetes import client

from kubevirt_spawner import manifests as m

IDENT = m.Identity(user="Alice.Smith", server="gpu", slug="alice-smith---1234abcd--gpu", user_slug="alice-smith---1234abcd",
                   server_slug="gpu", namespace="notebook-alice-smith---1234abcd",
                   vm="alice-smith---1234abcd--gpu-workstation", rootdisk="alice-smith---1234abcd--gpu-rootdisk",
                   workspace="alice-smith---1234abcd--gpu-workspace", secret="alice-smith---1234abcd--gpu-hub-env",
                   service="alice-smith---1234abcd--gpu-notebook")
GPU_SPEC = m.MachineSpec(
    cpu="8", memory="64Gi", memory_guest="64Gi", gpus=(("nvidia.com/A100-PCIE-40GB", 2),),
    node_selector={"workload.example.com/kubevirt": "true"},
    tolerations=({"key": "workload.example.com/kubevirt", "operator": "Equal", "value": "true",
                  "effect": "NoSchedule"},),
    affinity={"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "accelerator.example.com/mode", "operator": "In", "values": ["vfio"]}]}]}}},
    root_disk_size="150Gi", workspace_disk_size="100Gi", profile="gpu-a100-2", profile_version="3")
ENV = {"JUPYTERHUB_API_TOKEN": "secret-token-123", "JUPYTERHUB_USER": "Alice.Smith"}


def all_objects():
    return {"vm": m.virtual_machine(IDENT, GPU_SPEC), "rootdisk": m.root_datavolume(IDENT, GPU_SPEC),
            "workspace": m.workspace_datavolume(IDENT, GPU_SPEC), "service": m.service(IDENT, GPU_SPEC),
            "secret": m.env_secret(IDENT, ENV, ["--debug"]), "namespace": m.namespace(IDENT)}


@pytest.mark.parametrize("which", ["vm", "rootdisk", "workspace"])
def test_kubevirt_and_cdi_objects_validate_against_upstream_schemas(schemas, which):
    obj = all_objects()[which]
    schema = schemas.for_kind(obj["kind"])
    assert schema.errors(obj) == []
    assert schema.unknown_fields(obj) == []


@pytest.mark.parametrize("which,model", [("service", client.V1Service), ("secret", client.V1Secret),
                                         ("namespace", client.V1Namespace)])
def test_core_objects_are_valid_kubernetes_models(which, model):
    obj = all_objects()[which]
    parsed = model.from_dict(obj)  # refuses wrong types
    # A round trip drops fields the model does not know: nothing may get lost.
    assert client.ApiClient().sanitize_for_serialization(parsed) == obj


def test_every_object_carries_owner_labels_and_raw_names():
    for which, obj in all_objects().items():
        meta = obj["metadata"]
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "kubevirt-spawner"
        assert meta["labels"][m.LABEL_USER] == IDENT.user_slug
        assert meta["annotations"][m.ANNOTATION_USERNAME] == "Alice.Smith"
        if which != "namespace":
            assert meta["labels"][m.LABEL_WORKSTATION] == IDENT.slug
            assert meta["annotations"][m.ANNOTATION_SERVERNAME] == "gpu"


def test_root_disk_is_a_standalone_block_clone_of_the_golden_image():
    dv = m.root_datavolume(IDENT, GPU_SPEC)
    assert dv["spec"]["source"] == {"pvc": {"namespace": "vm-images", "name": "ubuntu-24-04-cuda-golden"}}
    assert dv["spec"]["storage"] == {"storageClassName": "ceph-rbd", "accessModes": ["ReadWriteOnce"],
                                     "volumeMode": "Block", "resources": {"requests": {"storage": "150Gi"}}}
    assert "ownerReferences" not in dv["metadata"]
    assert "dataVolumeTemplates" not in m.virtual_machine(IDENT, GPU_SPEC)["spec"]


def test_vm_shape():
    vm = m.virtual_machine(IDENT, GPU_SPEC)
    assert vm["spec"]["runStrategy"] == "Halted"
    t = vm["spec"]["template"]
    spec = t["spec"]
    assert t["metadata"]["labels"][m.LABEL_WORKSTATION] == IDENT.slug
    assert spec["terminationGracePeriodSeconds"] == 120
    assert spec["nodeSelector"] == {"workload.example.com/kubevirt": "true"}
    assert spec["tolerations"][0]["key"] == "workload.example.com/kubevirt"
    assert spec["affinity"]["nodeAffinity"]
    dom = spec["domain"]
    assert dom["memory"]["guest"] == "64Gi" and dom["resources"]["requests"] == {"cpu": "8", "memory": "64Gi"}
    assert dom["devices"]["autoattachGraphicsDevice"] is False
    assert [g["deviceName"] for g in dom["devices"]["gpus"]] == ["nvidia.com/A100-PCIE-40GB"] * 2
    assert all(d["disk"]["bus"] == "virtio" for d in dom["devices"]["disks"])
    iface = dom["devices"]["interfaces"][0]
    assert "masquerade" in iface and {p["port"] for p in iface["ports"]} == {22, 8080, 8888}
    vols = {v["name"]: v for v in spec["volumes"]}
    assert vols["rootdisk"]["persistentVolumeClaim"]["claimName"] == IDENT.rootdisk
    assert vols["workspace"]["persistentVolumeClaim"]["claimName"] == IDENT.workspace
    ci = vols["cloudinit"]["cloudInitNoCloud"]
    # no network data: the image configures any NIC (KubeVirt would write it verbatim,
    # pkg/cloud-init/cloud-init.go, and a NIC name in it may not be the guest's)
    assert ci == {"secretRef": {"name": IDENT.secret}}
    assert dom["firmware"] == {"bootloader": {"bios": {}}}
    assert vols["hubenv"]["secret"]["secretName"] == IDENT.secret
    assert vm["metadata"]["annotations"][m.ANNOTATION_PROFILE] == "gpu-a100-2"
    assert vm["metadata"]["annotations"][m.ANNOTATION_PROFILE_VERSION] == "3"


def test_token_lives_in_the_secret_never_in_the_vm():
    assert "secret-token-123" not in json.dumps(m.virtual_machine(IDENT, GPU_SPEC))
    secret = m.env_secret(IDENT, ENV, ["--debug"])
    data = {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}
    assert data["JUPYTERHUB_API_TOKEN"] == "secret-token-123"
    assert json.loads(data["args.json"]) == ["--debug"]
    assert data["userdata"].startswith("#cloud-config")


def test_the_user_data_installs_nothing():
    """Nothing comes from a package mirror at boot: a cluster without egress to one starts the
    same. The golden image has the guest agent (build.sh's packages; verify-clone.sh checks it)."""
    config = yaml.safe_load(m.user_data(IDENT))
    assert config == {"hostname": IDENT.vm}
    for key in ("packages", "package_update", "package_upgrade", "runcmd", "bootcmd", "apt"):
        assert key not in config


@pytest.mark.parametrize("kind,expected", [
    ("bios", {"bootloader": {"bios": {}}}),
    # KubeVirt's default for efi: {} is Secure Boot on (virtwrap/manager.go), which the unsigned
    # GRUB of the project's image does not pass: it is said off
    ("efi", {"bootloader": {"efi": {"secureBoot": False}}}),
])
def test_the_vm_boots_with_the_firmware_it_is_given(kind, expected):
    vm = m.virtual_machine(IDENT, dataclasses.replace(GPU_SPEC, firmware=kind))
    assert vm["spec"]["template"]["spec"]["domain"]["firmware"] == expected


def test_an_unknown_firmware_is_refused():
    with pytest.raises(ValueError, match="bios or efi, not 'uefi'"):
        m.virtual_machine(IDENT, dataclasses.replace(GPU_SPEC, firmware="uefi"))


def test_service_selects_only_the_running_machine():
    svc = m.service(IDENT, GPU_SPEC)
    assert svc["spec"]["selector"] == {m.LABEL_WORKSTATION: IDENT.slug, m.LABEL_COMPONENT: "workstation"}
    vm_labels = m.virtual_machine(IDENT, GPU_SPEC)["spec"]["template"]["metadata"]["labels"]
    assert all(vm_labels[k] == v for k, v in svc["spec"]["selector"].items())
    dv_labels = m.root_datavolume(IDENT, GPU_SPEC)["metadata"]["labels"]
    assert not all(dv_labels.get(k) == v for k, v in svc["spec"]["selector"].items())
    assert {p["port"] for p in svc["spec"]["ports"]} == {22, 8080, 8888}


def test_bad_environment_names_are_refused():
    with pytest.raises(ValueError, match="BAD-NAME"):
        m.env_secret(IDENT, {"BAD-NAME": "x"}, [])


def test_an_admins_extra_specs_and_priority_class_merge_into_the_vm():
    """KubeSpawner's merge rule (extra_pod_config): maps merge, lists replace, None removes."""
    spec = dataclasses.replace(
        GPU_SPEC, priority_class="gpu-interactive",
        extra_template_spec={"dnsConfig": {"nameservers": ["10.0.0.10"]},
                             "tolerations": [{"key": "example.com/pool", "operator": "Exists"}],
                             "domain": {"cpu": {"dedicatedCpuPlacement": True}}, "affinity": None},
        extra_spec={"template": {"metadata": {"annotations": {"example.com/note": "from extra_vm_spec"}}}})
    vm = m.virtual_machine(IDENT, spec)
    template = vm["spec"]["template"]
    assert template["spec"]["priorityClassName"] == "gpu-interactive"
    assert template["spec"]["dnsConfig"] == {"nameservers": ["10.0.0.10"]}
    assert template["spec"]["tolerations"] == [{"key": "example.com/pool", "operator": "Exists"}]  # replaced
    assert template["spec"]["domain"]["cpu"] == {"dedicatedCpuPlacement": True}
    assert template["spec"]["domain"]["devices"]["gpus"]  # (the rest of the domain kept)
    assert "affinity" not in template["spec"]
    assert template["metadata"]["annotations"]["example.com/note"] == "from extra_vm_spec"
    assert template["metadata"]["annotations"].keys() > {"example.com/note"}  # the hub's kept
    assert vm["spec"]["runStrategy"] == "Halted"
    assert m.virtual_machine(IDENT, GPU_SPEC) == m.virtual_machine(IDENT, dataclasses.replace(GPU_SPEC))


SHARED = m.shared_data([{"claim": "datasets", "mount_path": "/data/datasets", "read_only": True},
                        {"name": "team", "claim": "physics-team-share", "mount_path": "/data/team"}])


def test_shared_data_and_scratch_in_the_vm(schemas):
    """Issue 26. A share is a virtiofs filesystem and a claim volume of one name (KubeVirt v1.9
    api/core/v1/schema.go: Filesystem{Name, Virtiofs}; the name is the guest's mount tag), read-only
    through the claim volume's readOnly (pkg/virt-controller/services/rendervolumes.go); the
    scratch disk an emptyDisk of its capacity with the serial the image's fstab mounts."""
    spec = dataclasses.replace(GPU_SPEC, shared_data=SHARED, scratch_disk_size="200Gi")
    vm = m.virtual_machine(IDENT, spec)
    tspec = vm["spec"]["template"]["spec"]
    assert tspec["domain"]["devices"]["filesystems"] == [{"name": "datasets", "virtiofs": {}},
                                                         {"name": "team", "virtiofs": {}}]
    volumes = {v["name"]: v for v in tspec["volumes"]}
    assert volumes["datasets"] == {"name": "datasets", "persistentVolumeClaim": {"claimName": "datasets",
                                                                                "readOnly": True}}
    assert volumes["team"] == {"name": "team", "persistentVolumeClaim": {"claimName": "physics-team-share"}}
    assert volumes["scratch"] == {"name": "scratch", "emptyDisk": {"capacity": "200Gi"}}
    # (its room on the node's disk is requested: the domain's requests are the compute container's)
    assert tspec["domain"]["resources"]["requests"]["ephemeral-storage"] == "200Gi"
    assert {"name": "scratch", "serial": "scratch", "disk": {"bus": "virtio"}} in tspec["domain"]["devices"]["disks"]
    schema = schemas.for_kind("VirtualMachine")
    assert schema.errors(vm) == [] and schema.unknown_fields(vm) == []
    assert json.loads(m.guest_env(spec)["KUBEVIRT_SHARED_DATA"]) == [
        {"tag": "datasets", "path": "/data/datasets", "readOnly": True},
        {"tag": "team", "path": "/data/team", "readOnly": False}]
    assert m.guest_env(m.MachineSpec(ssh_enabled=False)) == {"KUBEVIRT_SSH_ENABLED": "0"}
    plain = m.virtual_machine(IDENT, GPU_SPEC)["spec"]["template"]["spec"]
    assert "filesystems" not in plain["domain"]["devices"] and "scratch" not in {v["name"] for v in plain["volumes"]}
    assert "ephemeral-storage" not in plain["domain"]["resources"]["requests"]


def test_extra_disks_in_the_vm_and_as_datavolumes(schemas):
    """Issue 26. An extra disk is a DataVolume of the workstation's own (blank, or a clone of a
    claim: CDI's DataVolumeSource pvc) and a claim volume whose disk serial, disk-NAME, the guest
    finds it by (KubeVirt v1.9 api/core/v1/schema.go Disk.Serial; the launcher mounts it at the
    path KUBEVIRT_EXTRA_DISKS gives)."""
    disks = m.extra_disks([{"name": "models", "size": "200Gi", "mount_path": "/data/models"},
                           {"name": "ref", "size": "60Gi", "mount_path": "/data/ref", "storage_class": "ceph-rbd-ssd",
                            "clone_from": "vm-images/reference-data"}])
    spec = dataclasses.replace(GPU_SPEC, extra_disks=disks)
    vm = m.virtual_machine(IDENT, spec)
    tspec = vm["spec"]["template"]["spec"]
    claim = f"{IDENT.workspace}-models"
    assert {"name": "disk-models", "serial": "disk-models", "disk": {"bus": "virtio"}} in tspec["domain"]["devices"][
        "disks"]
    assert {"name": "disk-models", "persistentVolumeClaim": {"claimName": claim}} in tspec["volumes"]
    schema = schemas.for_kind("VirtualMachine")
    assert schema.errors(vm) == [] and schema.unknown_fields(vm) == []
    blank = m.extra_disk_datavolume(IDENT, spec, disks[0])
    assert blank["metadata"]["name"] == claim and blank["spec"]["source"] == {"blank": {}}
    assert blank["spec"]["storage"]["storageClassName"] == spec.storage_class
    assert blank["spec"]["storage"]["resources"]["requests"]["storage"] == "200Gi"
    assert blank["metadata"]["labels"][m.LABEL_WORKSTATION] == IDENT.slug  # (retire and purge find it so)
    clone = m.extra_disk_datavolume(IDENT, spec, disks[1])
    assert clone["spec"]["source"] == {"pvc": {"namespace": "vm-images", "name": "reference-data"}}
    assert clone["spec"]["storage"]["storageClassName"] == "ceph-rbd-ssd"
    dv_schema = schemas.for_kind("DataVolume")
    assert dv_schema.errors(clone) == [] and dv_schema.errors(blank) == []
    assert json.loads(m.guest_env(spec)["KUBEVIRT_EXTRA_DISKS"]) == [
        {"serial": "disk-models", "path": "/data/models"}, {"serial": "disk-ref", "path": "/data/ref"}]
    with pytest.raises(ValueError, match="the shared data datasets at /data/datasets and the extra disk d at /data"):
        m.check_data_paths(SHARED, m.extra_disks([{"name": "d", "size": "1Gi", "mount_path": "/data"}]))


@pytest.mark.parametrize("items,says", [
    ([{"name": "models", "size": "1Gi"}], "is not a mount point"),
    ([{"name": "models", "size": "1Gi", "mount_path": "/opt/models"}], "inside /opt"),
    ([{"name": "a" * 16, "size": "1Gi", "mount_path": "/data"}], "1 to 15 lower-case letters"),
    ([{"name": "Models", "size": "1Gi", "mount_path": "/data"}], "1 to 15 lower-case letters"),
    ([{"name": "models", "size": "lots", "mount_path": "/data"}], "size must be a Kubernetes quantity"),
    ([{"name": "models", "size": "0", "mount_path": "/data"}], "size must be a Kubernetes quantity"),
    ([{"name": "models", "size": "1Gi", "mount_path": "/data", "clone_from": "reference"}], "NAMESPACE/NAME"),
    ([{"name": "models", "size": "1Gi", "mount_path": "/data", "storage_class": "Fast SSD"}], "storage_class"),
    ([{"name": "models", "size": "1Gi", "mount_path": "/data", "mountPath": "/x"}], "unknown keys mountPath"),
    ([{"name": "a", "size": "1Gi", "mount_path": "/data"}, {"name": "b", "size": "1Gi", "mount_path": "/data/b"}],
     "overlap"),
    ([{"name": "a", "size": "1Gi", "mount_path": "/data/a"}, {"name": "a", "size": "1Gi", "mount_path": "/data/b"}],
     "two extra disks are named a"),
])
def test_extra_disks_that_cannot_be_are_refused_with_a_sentence(items, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        m.extra_disks(items)


@pytest.mark.parametrize("items,says", [
    ([{"claim": "datasets"}], "is not a mount point"),
    ([{"claim": "datasets", "mount_path": "/usr/share/data"}], "inside /usr"),
    ([{"claim": "datasets", "mount_path": "/home/data"}], "inside /home"),
    ([{"claim": "datasets", "mount_path": "data"}], "is not a mount point"),
    ([{"claim": "Data_Sets", "mount_path": "/data"}], "claim must be the name of a PersistentVolumeClaim"),
    ([{"claim": "a" * 40, "mount_path": "/data"}], "at most 36"),
    ([{"claim": "rootdisk", "mount_path": "/data"}], "one of the workstation's own volumes"),
    ([{"claim": "disk-models", "mount_path": "/data"}], "starts disk-, as its extra disks do"),
    ([{"claim": "datasets", "mount_path": "/data", "read_only": "yes"}], "read_only is true or false"),
    ([{"claim": "datasets", "mount_path": "/data", "readOnly": True}], "unknown keys readOnly"),
    ([{"claim": "a", "mount_path": "/data"}, {"claim": "b", "mount_path": "/data/b"}], "overlap"),
    ([{"claim": "a", "mount_path": "/data/a"}, {"claim": "b", "name": "a", "mount_path": "/data/b"}],
     "two shared data entries are named a"),
    (["datasets"], "is not a dict"),
])
def test_shared_data_that_cannot_be_is_refused_with_a_sentence(items, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        m.shared_data(items)
