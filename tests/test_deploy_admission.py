"""The hub's ValidatingAdmissionPolicy (deploy/guardrails/hub-admission-policy.yaml), evaluated
with Google's CEL runtime the way kube-apiserver evaluates it
(staging/src/k8s.io/apiserver/pkg/admission/plugin/policy/validating/validator.go), by the
simulator's evaluator (kubevirt_spawner/sim/policies.py): the request must match a resource rule
and every matchCondition; then every validation must be true, and an expression that errors
counts as a refusal under failurePolicy Fail. Here each case is one request on an object as the
cluster would hold it; tests/test_sim_admission_chain.py sends the spawner's own writes through
the simulator, where KubeVirt's mutators change them first."""

from __future__ import annotations

import copy
import dataclasses
import pathlib
import subprocess

import pytest
import yaml

from kubevirt_spawner import manifests as m
from kubevirt_spawner import names
from kubevirt_spawner.sim.policies import Policy, Verdict

REPO = pathlib.Path(__file__).resolve().parent.parent
HUB = "system:serviceaccount:jupyterhub:hub"
IDENT = names.identity("Alice.Smith", "gpu")  # names as the spawner makes them, for a named server
SPEC = m.MachineSpec(workspace_disk_size="10Gi", extra_labels={"hub.jupyter.org/network-access-hub": "true"})
MANAGED_NS = m.namespace(IDENT)
FOREIGN_NS = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "payroll", "labels": {
    "kubernetes.io/metadata.name": "payroll"}}}
RESOURCES = {"Namespace": ("", "v1", "namespaces"), "Secret": ("", "v1", "secrets"),
             "Service": ("", "v1", "services"), "PersistentVolumeClaim": ("", "v1", "persistentvolumeclaims"),
             "VirtualMachine": ("kubevirt.io", "v1", "virtualmachines"),
             "DataVolume": ("cdi.kubevirt.io", "v1beta1", "datavolumes"),
             "VirtualMachineSnapshot": ("snapshot.kubevirt.io", "v1beta1", "virtualmachinesnapshots"),
             "VirtualMachineRestore": ("snapshot.kubevirt.io", "v1beta1", "virtualmachinerestores"),
             "Pod": ("", "v1", "pods"), "ResourceQuota": ("", "v1", "resourcequotas"),
             "LimitRange": ("", "v1", "limitranges"),
             "NetworkPolicy": ("networking.k8s.io", "v1", "networkpolicies"),
             "PersistentVolume": ("", "v1", "persistentvolumes"),
             "RoleBinding": ("rbac.authorization.k8s.io", "v1", "rolebindings")}


def rendered_policy(out, settings=None) -> Policy:
    extra = ["--settings", str(settings)] if settings else []
    subprocess.run(["bash", str(REPO / "deploy" / "render.sh"), "--out", str(out), *extra], check=True,
                   capture_output=True)
    return Policy(list(yaml.safe_load_all((out / "guardrails" / "hub-admission-policy.yaml").read_text()))[0])


@pytest.fixture(scope="module")
def policy(tmp_path_factory) -> Policy:
    out = tmp_path_factory.mktemp("rendered")
    subprocess.run(["bash", str(REPO / "deploy" / "render.sh"), "--out", str(out)], check=True, capture_output=True)
    docs = list(yaml.safe_load_all((out / "guardrails" / "hub-admission-policy.yaml").read_text()))
    assert docs[1]["spec"] == {"policyName": docs[0]["metadata"]["name"], "validationActions": ["Deny"]}
    assert docs[0]["spec"]["failurePolicy"] == "Fail"
    return Policy(docs[0])


def request(operation: str, obj: dict, user: str = HUB) -> dict:
    group, version, resource = RESOURCES[obj["kind"]]
    return {"operation": operation, "userInfo": {"username": user, "groups": ["system:serviceaccounts"]},
            "namespace": obj["metadata"].get("namespace", ""), "name": obj["metadata"]["name"],
            "resource": {"group": group, "version": version, "resource": resource}, "subResource": "",
            "kind": {"group": group, "version": version, "kind": obj["kind"]}, "dryRun": False}


def create(policy, obj, namespace=MANAGED_NS, user=HUB) -> Verdict:
    return policy.admit(request("CREATE", obj, user), obj, None, None if obj["kind"] == "Namespace" else namespace)


def update(policy, old, new, namespace=MANAGED_NS) -> Verdict:
    return policy.admit(request("UPDATE", new), new, old, namespace)


def delete(policy, old, namespace=MANAGED_NS) -> Verdict:
    return policy.admit(request("DELETE", old), None, old, namespace)


def spawner_objects() -> list[dict]:
    return [m.env_secret(IDENT, {"JUPYTERHUB_API_TOKEN": "t"}, []), m.service(IDENT, SPEC),
            m.root_datavolume(IDENT, SPEC), m.workspace_datavolume(IDENT, SPEC), m.virtual_machine(IDENT, SPEC),
            m.virtual_machine_snapshot(IDENT, "before-cuda"),
            m.virtual_machine_restore(IDENT, m.snapshot_object_name(IDENT, "before-cuda"), "restore-1"),
            m.network_policy(IDENT, SPEC.ports, [{"namespaceSelector": {}}]),
            m.resource_quota(IDENT, {"requests.storage": "1Ti"}),
            m.limit_range(IDENT, [{"type": "PersistentVolumeClaim", "max": {"storage": "500Gi"}}]),
            m.hub_role_binding(IDENT.namespace, HUB)]


def test_everything_the_spawner_does_passes(policy):
    assert create(policy, MANAGED_NS) == Verdict(True, True)
    for obj in spawner_objects():
        assert create(policy, obj) == Verdict(True, True), obj["kind"]
        if obj["kind"] != "RoleBinding":  # the hub never deletes its binding
            assert delete(policy, obj) == Verdict(True, True), obj["kind"]
    # the disk CDI made from the DataVolume carries its labels, but CDI's own managed-by (CDI's
    # pkg/controller/datavolume/controller-base.go newPersistentVolumeClaim, then
    # pkg/util/util.go SetRecommendedLabels, whose static labels win); the hub marks it retained,
    # then deletes it
    meta = copy.deepcopy(m.root_datavolume(IDENT, SPEC)["metadata"])
    meta["labels"].update({"app": "containerized-data-importer", "app.kubernetes.io/component": "storage",
                           "app.kubernetes.io/managed-by": "cdi-controller"})
    pvc = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta, "spec": {}}
    retained = copy.deepcopy(pvc)
    retained["metadata"]["labels"].update(m.retained_patch("2027-01-01T00:00:00Z")["metadata"]["labels"])
    assert update(policy, pvc, retained) == Verdict(True, True)
    assert delete(policy, retained) == Verdict(True, True)


def test_others_are_not_matched(policy):
    """The policy fences the hub only: CDI making an unlabelled PVC, a user's own objects elsewhere."""
    pvc = {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
           "metadata": {"name": "scratch", "namespace": "payroll"}, "spec": {}}
    assert create(policy, pvc, FOREIGN_NS, user="system:serviceaccount:cdi:cdi-sa") == Verdict(True, False)
    assert create(policy, pvc, FOREIGN_NS, user="bob@example.com") == Verdict(True, False)
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "payroll"}}
    assert create(policy, pod, FOREIGN_NS) == Verdict(True, False)  # a kind the hub cannot write anyway


def test_the_hub_cannot_act_in_someone_elses_namespace(policy):
    for obj in spawner_objects():
        foreign = copy.deepcopy(obj)
        foreign["metadata"]["namespace"] = "payroll"
        verdict = create(policy, foreign, FOREIGN_NS)
        assert not verdict.allowed and "only act in namespaces labelled" in verdict.message, obj["kind"]
    unlabelled = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "notebook-eve"}}
    verdict = create(policy, unlabelled)
    assert not verdict.allowed and "may only create namespaces of kubevirt-spawner" in verdict.message
    # nor one that is not a user's, even labelled as the hub labels its own
    system = copy.deepcopy(MANAGED_NS)
    system["metadata"]["name"] = system["metadata"]["labels"]["kubernetes.io/metadata.name"] = "kube-system"
    verdict = create(policy, system)
    assert not verdict.allowed and "only make namespaces named notebook-..., not kube-system" in verdict.message


def test_the_hub_cannot_touch_objects_that_are_not_its_own(policy):
    foreign_secret = {"apiVersion": "v1", "kind": "Secret",
                      "metadata": {"name": "db-credentials", "namespace": IDENT.namespace}}
    for verdict in (delete(policy, foreign_secret), create(policy, foreign_secret)):
        assert not verdict.allowed and "db-credentials is not" in verdict.message
    # a disk CDI made for someone else (its managed-by label, no workstation label)
    other = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {
        "name": "data", "namespace": IDENT.namespace, "labels": {"app.kubernetes.io/managed-by": "cdi-controller"}}}
    assert not delete(policy, other).allowed
    # nor make one its own by labelling it
    stolen = copy.deepcopy(foreign_secret)
    stolen["metadata"]["labels"] = {"app.kubernetes.io/managed-by": "kubevirt-spawner"}
    assert not update(policy, foreign_secret, stolen).allowed


@pytest.mark.parametrize("volume", [
    {"name": "db", "secret": {"secretName": "db-credentials"}},
    {"name": "sa", "serviceAccount": {"serviceAccountName": "default"}},
    {"name": "cm", "configMap": {"name": "kube-root-ca.crt"}},
    {"name": "host", "hostDisk": {"path": "/etc/kubernetes/admin.conf", "type": "Disk"}},
    {"name": "ci", "cloudInitNoCloud": {"secretRef": {"name": "db-credentials"}}},
    {"name": "bob", "secret": {"secretName": "bob-hub-env"}},  # another workstation's token
])
def test_a_vm_of_the_hub_mounts_no_foreign_secret_or_host_file(policy, volume):
    vm = m.virtual_machine(IDENT, SPEC)
    vm["spec"]["template"]["spec"]["volumes"].append(volume)
    verdict = create(policy, vm)
    assert not verdict.allowed and \
        f"may mount claims, blank scratch disks (emptyDisk), inline cloud-init and its own environment Secret {IDENT.secret} only" in verdict.message
    assert not update(policy, m.virtual_machine(IDENT, SPEC), vm).allowed


@pytest.mark.parametrize("change", [
    {"source": {"pvc": {"namespace": "notebook-bob", "name": "bob-rootdisk"}}},
    {"source": {"snapshot": {"namespace": "notebook-bob", "name": "bob-snap"}}},
    {"source": {"http": {"url": "https://example.com/evil.qcow2"}}},
    {"source": None, "sourceRef": {"kind": "DataSource", "namespace": "notebook-bob", "name": "bob"}},
    {"sourceRef": {"kind": "DataSource", "namespace": "vm-images", "name": "golden"}},
    {"source": None},
])
def test_a_disk_of_the_hub_is_blank_or_a_golden_image(policy, change):
    """Every DataVolume source but blank and a PVC of the golden images' namespace is refused: a
    snapshot, another user's disk, a URL, a DataSource (CDI's DataVolumeSpec: source, sourceRef)."""
    dv = m.root_datavolume(IDENT, SPEC)
    for key, value in change.items():
        if value is None:
            dv["spec"].pop(key)
        else:
            dv["spec"][key] = value
    verdict = create(policy, dv)
    assert not verdict.allowed and "blank or cloned from the golden images' namespace vm-images" in verdict.message


@pytest.mark.parametrize("change", [
    {"dataVolumeTemplates": [{"metadata": {"name": "x"}, "spec": {"source": {"pvc": {"namespace": "notebook-bob",
                                                                                    "name": "bob-rootdisk"}}}}]},
    {"template.accessCredentials": [{"sshPublicKey": {"source": {"secret": {"secretName": "db-credentials"}},
                                                      "propagationMethod": {"qemuGuestAgent": {"users": ["root"]}}}}]},
])
def test_a_vm_of_the_hub_brings_no_disks_or_credentials_of_its_own(policy, change):
    vm = m.virtual_machine(IDENT, SPEC)
    [(key, value)] = change.items()
    if key.startswith("template."):
        vm["spec"]["template"]["spec"][key.split(".")[1]] = value
    else:
        vm["spec"][key] = value
    verdict = create(policy, vm)
    assert not verdict.allowed and "no dataVolumeTemplates and no accessCredentials" in verdict.message


def test_a_request_the_policy_cannot_read_is_refused(policy):
    """failurePolicy Fail: an expression that errors (a namespace object missing) refuses."""
    secret = m.env_secret(IDENT, {}, [])
    verdict = policy.admit(request("CREATE", secret), secret, None, None)
    assert not verdict.allowed


def volume(namespace: str, policy: str = "Retain") -> dict:
    """A volume as the CSI external-provisioner makes it for a claim (cluster-scoped, unlabelled)."""
    return {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": "pvc-1234"},
            "spec": {"capacity": {"storage": "150Gi"}, "accessModes": ["ReadWriteOnce"], "storageClassName": "ceph-rbd",
                     "persistentVolumeReclaimPolicy": policy, "volumeMode": "Block",
                     "claimRef": {"kind": "PersistentVolumeClaim", "namespace": namespace, "name": "alice-rootdisk",
                                  "uid": "u1"},
                     "csi": {"driver": "rbd.csi.ceph.com", "volumeHandle": "0001-x"}}}


def test_the_hub_changes_only_the_reclaim_policy_of_users_volumes(policy):
    """Before deleting a disk on purpose the hub sets its volume to Delete (and back to Retain after
    a failed restore); nothing else of a volume, no volume of another namespace, no new volume."""
    mine = volume(IDENT.namespace)
    for old, new in ((mine, volume(IDENT.namespace, "Delete")), (volume(IDENT.namespace, "Delete"), mine)):
        assert policy.admit(request("UPDATE", new), new, old, None) == Verdict(True, True)
    foreign = volume("payroll")
    rebound = copy.deepcopy(mine)
    rebound["spec"]["claimRef"] = {**rebound["spec"]["claimRef"], "namespace": "notebook-eve", "name": "stolen"}
    grown = volume(IDENT.namespace, "Delete")
    grown["spec"]["capacity"] = {"storage": "1Ti"}
    for old, new in ((foreign, volume("payroll", "Delete")), (mine, rebound), (mine, grown)):
        verdict = policy.admit(request("UPDATE", new), new, old, None)
        assert not verdict.allowed and "only change the reclaim policy" in verdict.message, new["spec"]["claimRef"]
    assert not policy.admit(request("CREATE", mine), mine, None, None).allowed
    assert not policy.admit(request("DELETE", mine), None, mine, None).allowed


@pytest.mark.parametrize("change", [
    {"spec.type": "NodePort"}, {"spec.type": "LoadBalancer"}, {"spec.externalIPs": ["203.0.113.7"]},
])
def test_a_service_of_the_hub_stays_inside_the_cluster(policy, change):
    """No NodePort, LoadBalancer or externalIPs (the CVE-2020-8554 kind): the proxy is the way in."""
    svc = m.service(IDENT, SPEC)
    [(path, value)] = change.items()
    svc["spec"][path.split(".")[1]] = value
    verdict = create(policy, svc)
    assert not verdict.allowed and "type ClusterIP, without externalIPs" in verdict.message


def test_a_secret_of_the_hub_is_a_plain_one(policy):
    secret = m.env_secret(IDENT, {"JUPYTERHUB_API_TOKEN": "t"}, [])
    secret["type"] = "kubernetes.io/service-account-token"
    secret["metadata"]["annotations"] = {"kubernetes.io/service-account.name": "default"}
    verdict = create(policy, secret)
    assert not verdict.allowed and "of type Opaque" in verdict.message


def test_a_gpu_vm_of_the_spawner_passes(policy):
    """GPUs of the resource names deploy/settings.env's GPU_DEVICES configures pass."""
    gpu = dataclasses.replace(SPEC, gpus=(("nvidia.com/A100-PCIE-40GB", 1),))
    assert create(policy, m.virtual_machine(IDENT, gpu)) == Verdict(True, True)


def _networks(vm, value):
    vm["spec"]["template"]["spec"]["networks"] = value


def _interfaces(vm, value):
    vm["spec"]["template"]["spec"]["domain"]["devices"]["interfaces"] = value


def _devices(key):
    def change(vm, value):
        vm["spec"]["template"]["spec"]["domain"]["devices"][key] = value
    return change


@pytest.mark.parametrize("change,value,words", [
    # another namespace's NetworkAttachmentDefinition (Multus), beside or instead of the pod network
    (_networks, [{"name": "default", "pod": {}}, {"name": "finance", "multus": {"networkName": "payroll/net"}}],
     "pod network only"),
    (_networks, [{"name": "default", "multus": {"networkName": "payroll/net", "default": True}}], "pod network only"),
    (_interfaces, [{"name": "default", "bridge": {}}], "pod network only"),
    (_interfaces, [{"name": "default", "sriov": {}}], "pod network only"),
    (_interfaces, [{"name": "default", "binding": {"name": "passt"}}], "pod network only"),
    (_devices("hostDevices"), [{"name": "nic", "deviceName": "intel.com/E810"}], "no host devices"),
    (_devices("gpus"), [{"name": "gpu0", "deviceName": "nvidia.com/H100"}], "GPUs only of the resource names"),
], ids=["multus-beside", "multus-default", "bridge", "sriov", "binding-plugin", "host-device", "other-gpu"])
def test_a_vm_of_the_hub_keeps_to_the_pod_network_and_the_configured_gpus(policy, change, value, words):
    """What a compromised hub could give a root user's VM otherwise: a leg on another namespace's
    Multus network, a bridge or SR-IOV NIC, a host device, a GPU model it was not given (KubeVirt
    v1.9 staging/src/kubevirt.io/api/core/v1/schema.go: Network, Interface, Devices)."""
    vm = m.virtual_machine(IDENT, SPEC)
    change(vm, value)
    verdict = create(policy, vm)
    assert not verdict.allowed and words in verdict.message, verdict
    assert not update(policy, m.virtual_machine(IDENT, SPEC), vm).allowed


def _restore(**spec):
    restore = m.virtual_machine_restore(IDENT, m.snapshot_object_name(IDENT, "before-cuda"), "restore-1")
    for key, value in spec.items():
        if value is None:
            restore["spec"].pop(key)
        else:
            restore["spec"][key] = value
    return restore


OTHER = names.identity("Alice.Smith")  # the same user's default server: another workstation


@pytest.mark.parametrize("restore", [
    # KubeVirt v1.9 creates a missing target and applies the patches to it as virt-controller
    # (pkg/storage/snapshot/restore.go; pkg/storage/admitters/vmrestore.go only checks /spec/ paths)
    _restore(target={"apiGroup": "kubevirt.io", "kind": "VirtualMachine", "name": "new-vm"},
             patches=['{"op": "replace", "path": "/spec/template/spec/volumes/0", "value": '
                      '{"name": "sa", "serviceAccount": {"serviceAccountName": "default"}}}']),
    _restore(patches=['{"op": "add", "path": "/spec/template/spec/domain/devices/hostDevices", "value": []}']),
    _restore(volumeRestoreOverrides=[{"volumeName": "rootdisk", "restoreName": "payroll-db"}]),
    _restore(volumeRestorePolicy=None),
    _restore(volumeRestorePolicy="RandomizeNames"),
    _restore(target={"apiGroup": "kubevirt.io", "kind": "VirtualMachine", "name": OTHER.vm}),
    _restore(target={"kind": "VirtualMachine", "name": IDENT.vm}),
    _restore(virtualMachineSnapshotName=m.snapshot_object_name(OTHER, "before-cuda")),
    # a neighbour in a shared namespace, bob-x's "y", is no old-style snapshot of bob's
    _restore(virtualMachineSnapshotName=f"{IDENT.slug}-x.y"),
], ids=["patches-new-target", "patches", "volume-overrides", "no-policy", "not-in-place", "another-vm",
        "no-api-group", "another-workstations-snapshot", "a-neighbours-snapshot"])
def test_a_restore_of_the_hub_puts_its_own_vm_back_in_place_and_nothing_else(policy, restore):
    """Issue 30, item 3: the policy checked a restore's labels and namespace only."""
    verdict = create(policy, restore)
    assert not verdict.allowed and f"puts the VM of its own workstation, {IDENT.vm}, back" in verdict.message, verdict


def _template(key):
    def change(vm, value):
        vm["spec"]["template"].setdefault("metadata", {}).setdefault(key, {}).update(value)
    return change


def _template_spec(key):
    def change(vm, value):
        vm["spec"]["template"]["spec"][key] = value
    return change


def _spec(key):
    def change(vm, value):
        vm["spec"][key] = value
    return change


def _kernel_boot(vm, value):
    vm["spec"]["template"]["spec"]["domain"]["firmware"]["kernelBoot"] = value


def _container_disk(vm, value):
    vm["spec"]["template"]["spec"]["volumes"][0] = value


@pytest.mark.parametrize("change,value,words", [
    # copied to the virt-launcher pod: a hook sidecar runs any image beside QEMU; a Multus network
    (_template("annotations"), {"hooks.kubevirt.io/hookSidecars": '[{"image": "evil/sidecar"}]'},
     "and VM_EXTRA_ANNOTATION_PREFIXES [] only"),
    (_template("annotations"), {"k8s.v1.cni.cncf.io/networks": "payroll/net"}, "annotations of kubevirt-spawner.io/"),
    # KubeVirt's own keys pass only as KubeVirt writes them (test_kubevirts_template_annotations_pass)
    (_template("annotations"), {"kubevirt.io/pci-topology-version": "v3; x"}, "pci-topology-version v2 or v3"),
    (_template("annotations"), {"kubevirt.io/pci-interface-slot-count": "-1"}, "pci-topology-version v2 or v3"),
    (_template("annotations"), {"kubevirt.io/allow-pod-bridge-network-live-migration": "true"},
     "annotations of kubevirt-spawner.io/"),
    (_template("labels"), {"role": "payroll-db-client"}, "labels of kubevirt-spawner.io/"),
    (_template_spec("tolerations"), [{"key": "node-role.kubernetes.io/control-plane", "operator": "Exists",
                                       "effect": "NoSchedule"}], "tolerates the taints workload.example.com/kubevirt and VM_EXTRA_TOLERATION_KEYS [] only"),
    (_template_spec("tolerations"), [{"operator": "Exists"}], "tolerates the taints workload.example.com/kubevirt and VM_EXTRA_TOLERATION_KEYS [] only"),
    (_template_spec("priorityClassName"), "system-node-critical", "no priority class but VM_PRIORITY_CLASSES []"),
    (_spec("instancetype"), {"kind": "VirtualMachineClusterInstancetype", "name": "gpu-passthrough"},
     "instancetype or preference"),
    (_kernel_boot, {"container": {"image": "evil/kernel", "kernelPath": "/vmlinuz"}}, "no kernelBoot"),
    (_container_disk, {"name": "rootdisk", "containerDisk": {"image": "evil/rootfs"}}, "may mount claims"),
], ids=["hook-sidecar", "multus-annotation", "pci-version-not-kubevirts", "pci-slots-not-a-count",
        "other-kubevirt-annotation", "foreign-label", "control-plane-toleration", "tolerate-all",
        "priority-class", "instancetype", "kernel-boot-container", "container-disk-boot"])
def test_a_vm_template_gives_the_launcher_pod_nothing_but_the_spawners(policy, change, value, words):
    """Issue 30, item 3: the template's metadata (virt-controller copies it to the launcher pod),
    tolerations and boot sources were not checked."""
    vm = m.virtual_machine(IDENT, SPEC)
    change(vm, value)
    verdict = create(policy, vm)
    assert not verdict.allowed and words in verdict.message, verdict
    assert not update(policy, m.virtual_machine(IDENT, SPEC), vm).allowed


def test_a_snapshot_named_before_the_dot_is_restored(policy):
    assert create(policy, _restore(virtualMachineSnapshotName=f"{IDENT.slug}-before-cuda")) == Verdict(True, True)


def test_the_spawners_placement_passes(policy):
    """The profile placement the project documents (the workstation nodes' taint) passes."""
    placed = dataclasses.replace(SPEC, node_selector={"workload.example.com/kubevirt": "true"},
                                 tolerations=({"key": "workload.example.com/kubevirt", "operator": "Exists",
                                               "effect": "NoSchedule"},),
                                 extra_annotations={"kubevirt-spawner.io/cost-centre": "physics"})
    assert create(policy, m.virtual_machine(IDENT, placed)) == Verdict(True, True)


def test_shared_data_and_a_scratch_disk_pass(policy):
    """Issue 26: virtiofs shares of the namespace's claims and an emptyDisk on /scratch are volume
    kinds the policy lets a VM of the hub have (KubeVirt v1.9 schema: Filesystem, EmptyDiskSource)."""
    shared = dataclasses.replace(SPEC, scratch_disk_size="20Gi", shared_data=m.shared_data(
        [{"claim": "datasets", "mount_path": "/data/datasets", "read_only": True}]))
    assert create(policy, m.virtual_machine(IDENT, shared)) == Verdict(True, True)


def test_a_sites_own_labels_annotations_and_taints_pass_once_listed(tmp_path, policy):
    """Profiles may add labels, annotations and tolerations (extra_labels, extra_annotations,
    tolerations, priority_class_name): the policy refuses them until deploy/settings.env lists them."""
    site = dataclasses.replace(SPEC, extra_labels={"example.com/team": "physics"},
                               extra_annotations={"example.com/cost-centre": "42"},
                               tolerations=({"key": "example.com/gpu-pool", "operator": "Exists"},),
                               priority_class="gpu-interactive")
    assert not create(policy, m.virtual_machine(IDENT, site)).allowed
    settings = tmp_path / "site.env"
    text = (REPO / "deploy" / "settings.env").read_text()
    for name, value in (("VM_EXTRA_LABEL_PREFIXES", "example.com/"), ("VM_EXTRA_ANNOTATION_PREFIXES", "example.com/"),
                        ("VM_EXTRA_TOLERATION_KEYS", "example.com/gpu-pool"),
                        ("VM_PRIORITY_CLASSES", "gpu-interactive batch-low")):
        text = text.replace(f'{name}=""', f'{name}="{value}"')
    settings.write_text(text)
    listed = rendered_policy(tmp_path / "out", settings)
    assert create(listed, m.virtual_machine(IDENT, site)) == Verdict(True, True)


def _binding(**changes) -> dict:
    binding = m.hub_role_binding(IDENT.namespace, HUB)
    binding.update(copy.deepcopy(changes))
    return binding


@pytest.mark.parametrize("binding,why", [
    (_binding(roleRef={"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"}),
     "another role"),
    (_binding(roleRef={"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": m.HUB_NAMESPACED_ROLE}),
     "a Role of the namespace by that name"),
    (_binding(subjects=[{"kind": "ServiceAccount", "name": "default", "namespace": IDENT.namespace}]),
     "the user's ServiceAccount"),
    (_binding(subjects=[m.rbac_subject(HUB), {"kind": "Group", "apiGroup": "rbac.authorization.k8s.io",
                                              "name": "system:authenticated"}]), "everyone besides"),
    (_binding(subjects=[{"kind": "User", "apiGroup": "rbac.authorization.k8s.io", "name": HUB}]),
     "a user of the hub's name"),
    (_binding(subjects=[]), "no one"),
])
def test_the_hub_binds_only_its_own_role_to_itself(policy, binding, why):
    """Its rights in a namespace come from the RoleBinding it makes (deploy/rbac/): RBAC lets it
    bind its namespaced role (`bind`), the policy lets it bind nothing else and to no one else."""
    verdict = create(policy, binding)
    assert not verdict.allowed and "may only bind ClusterRole kubevirt-spawner-hub-namespaced to itself" in \
        verdict.message, why


def test_the_hub_binds_itself_only_in_users_namespaces_and_changes_no_binding(policy):
    foreign = m.hub_role_binding("payroll", HUB)
    verdict = create(policy, foreign, FOREIGN_NS)
    assert not verdict.allowed and "only act in namespaces labelled" in verdict.message
    # a namespace labelled as the hub labels its own, but not a user's (USER_NAMESPACE_PREFIX)
    system = copy.deepcopy(MANAGED_NS)
    system["metadata"]["name"] = "kube-system"
    verdict = create(policy, m.hub_role_binding("kube-system", HUB), system)
    assert not verdict.allowed and "in users' namespaces (notebook-...)" in verdict.message
    own = m.hub_role_binding(IDENT.namespace, HUB)
    wider = copy.deepcopy(own)
    wider["subjects"].append({"kind": "Group", "apiGroup": "rbac.authorization.k8s.io", "name": "system:authenticated"})
    for verdict in (update(policy, own, wider), update(policy, own, own), delete(policy, own)):
        assert not verdict.allowed and "change no binding" in verdict.message


def test_a_namespace_of_the_hub_has_the_sites_labels_only_once_listed(tmp_path, policy):
    """Issue 26: namespace_labels and namespace_annotations (KubeSpawner's user_namespace_labels).
    A namespace's labels decide which NetworkPolicies elsewhere admit its machines (their
    namespaceSelector) and its pod-security level: the policy refuses the site's until
    deploy/settings.env lists their prefixes, and a pod-security label unless listed too."""
    labelled = m.namespace(IDENT, {"example.com/team": "physics-{user}"}, {"example.com/owner": "{user}"})
    assert labelled["metadata"]["labels"]["example.com/team"] == f"physics-{IDENT.user_slug}"
    assert create(policy, m.namespace(IDENT)) == Verdict(True, True)
    verdict = create(policy, labelled)
    assert not verdict.allowed and "labels of kubevirt-spawner.io/, app.kubernetes.io/managed-by and " \
        "NAMESPACE_EXTRA_LABEL_PREFIXES [] only" in verdict.message
    privileged = m.namespace(IDENT, {"pod-security.kubernetes.io/enforce": "privileged"})
    assert not create(policy, privileged).allowed
    settings = tmp_path / "site.env"
    text = (REPO / "deploy" / "settings.env").read_text()
    for name in ("NAMESPACE_EXTRA_LABEL_PREFIXES", "NAMESPACE_EXTRA_ANNOTATION_PREFIXES"):
        text = text.replace(f'{name}=""', f'{name}="example.com/"')
    settings.write_text(text)
    listed = rendered_policy(tmp_path / "out", settings)
    assert create(listed, labelled) == Verdict(True, True)
    assert not create(listed, privileged).allowed
