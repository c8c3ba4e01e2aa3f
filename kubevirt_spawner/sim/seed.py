"""The default cluster: the node pools, storage and golden image of the design document."""

from __future__ import annotations

import copy
import os
import uuid

from .machines import DISK_IMAGE
from .qemu import sparse_copy
from .resources import BY_KIND, CRD_GROUPS, RESOURCE_TYPES
from .timeutil import now_iso

GOLDEN_NAMESPACE = "vm-images"
GOLDEN_PVC = "ubuntu-24-04-cuda-golden"
GPU_DEVICE = "nvidia.com/A100-PCIE-40GB"

OS_RELEASE = """PRETTY_NAME="Ubuntu 24.04.1 LTS"
NAME="Ubuntu"
VERSION_ID="24.04"
VERSION="24.04.1 LTS (Noble Numbat)"
VERSION_CODENAME=noble
ID=ubuntu
ID_LIKE=debian
"""


VIRT_HANDLER_POOLS = ("vm-cpu", "vm-gpu-pci")  # where KubeVirt's CR places virt-handler
# The workstation pool's label and taint (deploy/settings.env's KUBEVIRT_NODE_LABEL; what
# deploy/host/label-nodes.sh puts on a pool's nodes).
POOL_LABEL = "workload.example.com/kubevirt"
POOL_TAINT = {"key": POOL_LABEL, "value": "true", "effect": "NoSchedule"}


def virt_handler_runs_on(node: dict) -> bool:
    return (node["metadata"].get("labels") or {}).get("workload.example.com/pool") in VIRT_HANDLER_POOLS


def label_virt_handler_nodes(store):
    """virt-handler marks the nodes it runs on `kubevirt.io/schedulable=true`; launcher pods
    select that. (Also brings a cluster saved by an older simulator up to date.)"""
    node_rt = BY_KIND["Node"]
    for node in store.list(node_rt):
        if virt_handler_runs_on(node) and "kubevirt.io/schedulable" not in (node["metadata"].get("labels") or {}):
            new = copy.deepcopy(node)
            new["metadata"].setdefault("labels", {})["kubevirt.io/schedulable"] = "true"
            store.update(node_rt, new, check_rv=False)


def put_cpu_nodes_in_pool(store):
    """The vm-cpu nodes put in the workstation pool as `deploy/host/label-nodes.sh --pool vm-cpu`
    leaves them: the pool label (the profiles select it) and its NoSchedule taint (containers stay
    off). The plain seed leaves them out, so that a VM without the pool's placement, as most tests
    make, still lands there; the demo's cluster is set up like a platform team's. (Also brings a
    demo cluster saved by an older simulator up to date.)"""
    node_rt = BY_KIND["Node"]
    for node in store.list(node_rt):
        labels = node["metadata"].get("labels") or {}
        if labels.get("workload.example.com/pool") != "vm-cpu" or labels.get(POOL_LABEL) == "true":
            continue
        new = copy.deepcopy(node)
        new["metadata"].setdefault("labels", {})[POOL_LABEL] = "true"
        taints = new.setdefault("spec", {}).setdefault("taints", [])
        if not any(t.get("key") == POOL_LABEL for t in taints):
            taints.append(dict(POOL_TAINT))
        store.update(node_rt, new, check_rv=False)


def _node(name: str, labels: dict, cpu: str, memory: str, extra: dict | None = None, taints=None) -> dict:
    allocatable = {"cpu": cpu, "memory": memory, "pods": "110", "ephemeral-storage": "500Gi", **(extra or {})}
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                                                  "kubernetes.io/arch": "amd64", **labels}},
            "spec": {"taints": taints or []},
            "status": {"capacity": dict(allocatable), "allocatable": allocatable,
                       "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                                       "message": "kubelet is posting ready status",
                                       "lastHeartbeatTime": now_iso(), "lastTransitionTime": now_iso()}],
                       "nodeInfo": {"kubeletVersion": "v1.32.0", "kubeProxyVersion": "v1.32.0",
                                    "bootID": str(uuid.uuid5(uuid.NAMESPACE_DNS, name + "-boot")),
                                    "machineID": uuid.uuid5(uuid.NAMESPACE_DNS, name).hex,
                                    "systemUUID": str(uuid.uuid5(uuid.NAMESPACE_DNS, name + "-system")), "osImage": "Ubuntu 24.04.1 LTS",
                                    "containerRuntimeVersion": "containerd://1.7.22", "architecture": "amd64",
                                    "operatingSystem": "linux", "kernelVersion": "6.8.0-45-generic"}}}


# The cluster as deploy/README.md leaves it (deploy/settings.env's defaults): Ceph's cluster and
# pool, and where ceph-csi keeps its credentials.
CEPH_CLUSTER_ID = "b9127830-b0cc-4e34-aa47-9d1a2e9949a8"
CEPH_SECRET = {"name": "csi-rbd-secret", "namespace": "ceph-csi-rbd"}
GOLDEN_IMAGE_URL = "https://images.example.com/kubevirt-spawner/ubuntu-24-04-cuda-golden.qcow2"


def _ceph_secret_parameters(*uses: str) -> dict:
    out = {}
    for use in uses:
        out[f"csi.storage.k8s.io/{use}-secret-name"] = CEPH_SECRET["name"]
        out[f"csi.storage.k8s.io/{use}-secret-namespace"] = CEPH_SECRET["namespace"]
    return out


def seed_objects() -> list[dict]:
    objects: list[dict] = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": n}} for n in
        ("default", "kube-system", GOLDEN_NAMESPACE)
    ]
    # What the KubeVirt and CDI operators' release manifests make before their CRs are applied
    # (KubeVirt's manifests/release/kubevirt-operator.yaml.in, CDI's cdi-operator.yaml.in).
    objects += [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "kubevirt", "labels": {
            "kubevirt.io": "", "pod-security.kubernetes.io/enforce": "privileged"}}},
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "cdi", "labels": {"cdi.kubevirt.io": ""}}},
        # ceph-csi's RBD driver (deploy/rbd/kubernetes/csidriver.yaml), with the API server's defaults
        {"apiVersion": "storage.k8s.io/v1", "kind": "CSIDriver", "metadata": {"name": "rbd.csi.ceph.com"},
         "spec": {"attachRequired": True, "podInfoOnMount": False, "seLinuxMount": True, "fsGroupPolicy": "File",
                  "requiresRepublish": False, "storageCapacity": False, "volumeLifecycleModes": ["Persistent"]}},
    ]
    objects += [
        _node("vm-cpu-1", {"node-role.kubernetes.io/worker": "", "workload.example.com/pool": "vm-cpu"},
              "32", "128Gi"),
        _node("vm-cpu-2", {"node-role.kubernetes.io/worker": "", "workload.example.com/pool": "vm-cpu"},
              "32", "128Gi"),
        _node("vm-gpu-pci-1", {"node-role.kubernetes.io/worker": "", "workload.example.com/pool": "vm-gpu-pci",
                               POOL_LABEL: "true", "accelerator.example.com/mode": "vfio",
                               "nvidia.com/gpu.product": "A100-PCIE-40GB"},
              "64", "512Gi", {GPU_DEVICE: "2"}, [dict(POOL_TAINT)]),
        _node("container-gpu-1", {"node-role.kubernetes.io/worker": "", "workload.example.com/pool": "container-gpu",
                                  "accelerator.example.com/mode": "container", "nvidia.com/gpu.product": "L4"},
              "32", "256Gi", {"nvidia.com/gpu": "4"},
              [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]),
        {"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass",
         "metadata": {"name": "ceph-rbd", "annotations": {"storageclass.kubernetes.io/is-default-class": "true"}},
         "provisioner": "rbd.csi.ceph.com", "reclaimPolicy": "Retain", "allowVolumeExpansion": True,
         "volumeBindingMode": "Immediate",
         "parameters": {"clusterID": CEPH_CLUSTER_ID, "pool": "kubevirt-rbd", "imageFeatures": "layering",
                        **_ceph_secret_parameters("provisioner", "controller-expand", "node-stage")}},
        {"apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshotClass",
         "metadata": {"name": "ceph-rbd-snapclass", "annotations": {
             "snapshot.storage.kubernetes.io/is-default-class": "true"}},
         "driver": "rbd.csi.ceph.com", "deletionPolicy": "Delete",
         "parameters": {"clusterID": CEPH_CLUSTER_ID, **_ceph_secret_parameters("snapshotter")}},
    ]
    return objects


def golden_tree(root: str):
    """A small directory tree that looks like an Ubuntu root filesystem."""
    for d in ("etc", "opt", "usr/local/bin", "var/lib", "var/log", "home", "root", "tmp"):
        os.makedirs(os.path.join(root, d), exist_ok=True)
    files = {"etc/os-release": OS_RELEASE, "etc/machine-id": "uninitialized\n", "etc/hostname": "ubuntu\n",
             "etc/golden-image": "ubuntu-24-04-cuda-golden built 2026-11-01, CUDA 12.6, driver 560\n",
             "usr/local/bin/README": "tools installed by the golden image build\n"}
    for rel, text in files.items():
        with open(os.path.join(root, rel), "w") as f:
            f.write(text)


def custom_resource_definitions() -> list[dict]:
    """The CRDs of the kinds the simulator serves from CRD groups, Established as the API server's
    establishing controller marks them (staging/src/k8s.io/apiextensions-apiserver/pkg/controller/
    establish/establishing_controller.go), so that `kubectl wait crd/... --for=condition=Established`
    answers as on a cluster where the operators installed them."""
    now = now_iso()
    out = []
    for rt in RESOURCE_TYPES:
        if rt.group not in CRD_GROUPS:
            continue
        names = {"plural": rt.plural, "singular": rt.kind.lower(), "kind": rt.kind, "listKind": f"{rt.kind}List",
                 **({"shortNames": list(rt.short_names)} if rt.short_names else {}),
                 **({"categories": list(rt.categories)} if rt.categories else {})}
        out.append({
            "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": f"{rt.plural}.{rt.group}"},
            "spec": {"group": rt.group, "names": names, "scope": "Namespaced" if rt.namespaced else "Cluster",
                     "versions": [{"name": v, "served": True, "storage": i == 0,
                                   "schema": {"openAPIV3Schema": {"type": "object",
                                                                  "x-kubernetes-preserve-unknown-fields": True}}}
                                  for i, v in enumerate(rt.versions)]},
            "status": {"acceptedNames": names, "storedVersions": [rt.versions[0]], "conditions": [
                {"type": "NamesAccepted", "status": "True", "reason": "NoConflicts",
                 "message": "no conflicts found", "lastTransitionTime": now},
                {"type": "Established", "status": "True", "reason": "InitialNamesAccepted",
                 "message": "the initial names have been accepted", "lastTransitionTime": now}]}})
    return out


def seed_cluster(cluster):
    store = cluster.store
    for obj in [*custom_resource_definitions(), *seed_objects()]:
        rt = BY_KIND[obj["kind"]]
        cluster.defaults(rt, obj)
        store.create(rt, obj)
    pvc_rt = BY_KIND["PersistentVolumeClaim"]
    # The golden PVC holds the built image's disk where guests boot it, sized to it (rounded up to
    # GiB), else a small directory tree as large as the design document's image.
    size = f"{-(-os.path.getsize(cluster.golden.disk) // 2**30)}Gi" if cluster.golden is not None else "60Gi"
    pvc = store.create(pvc_rt, {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {"name": GOLDEN_PVC, "namespace": GOLDEN_NAMESPACE,
                     "labels": {"platform.example.com/golden-image": "true"},
                     "finalizers": ["kubernetes.io/pvc-protection"]},
        "spec": {"accessModes": ["ReadWriteOnce"], "volumeMode": "Block", "storageClassName": "ceph-rbd",
                 "resources": {"requests": {"storage": size}}, "volumeName": "pvc-golden-ubuntu-24-04-cuda"},
    })
    pvc = dict(pvc)
    pvc["status"] = {"phase": "Bound", "accessModes": ["ReadWriteOnce"], "capacity": {"storage": size}}
    store.update(pvc_rt, pvc, subresource="status", check_rv=False)
    _seed_golden_import(cluster, pvc, size)
    if cluster.golden is not None:
        os.makedirs(cluster.volume_dir(pvc), exist_ok=True)
        sparse_copy(cluster.golden.disk, os.path.join(cluster.volume_dir(pvc), DISK_IMAGE))
    else:
        golden_tree(cluster.volume_dir(pvc))


def _seed_golden_import(cluster, pvc: dict, size: str):
    """The DataVolume that imported the golden image (deploy/cluster/golden-image.yaml), done, and
    owning its claim as CDI's import leaves it."""
    store, dv_rt, pvc_rt = cluster.store, BY_KIND["DataVolume"], BY_KIND["PersistentVolumeClaim"]
    dv = store.create(dv_rt, {
        "apiVersion": "cdi.kubevirt.io/v1beta1", "kind": "DataVolume",
        "metadata": {"name": GOLDEN_PVC, "namespace": GOLDEN_NAMESPACE,
                     "labels": {"platform.example.com/golden-image": "true"}},
        "spec": {"source": {"http": {"url": GOLDEN_IMAGE_URL}},
                 "storage": {"storageClassName": "ceph-rbd", "accessModes": ["ReadWriteOnce"], "volumeMode": "Block",
                             "resources": {"requests": {"storage": size}}}}})
    done = copy.deepcopy(dv)
    stamp = now_iso()
    done["status"] = {"phase": "Succeeded", "progress": "100.0%", "claimName": GOLDEN_PVC, "conditions": [
        {"type": "Bound", "status": "True", "reason": "Bound", "message": f"PVC {GOLDEN_PVC} Bound",
         "lastHeartbeatTime": stamp, "lastTransitionTime": stamp},
        {"type": "Ready", "status": "True", "lastHeartbeatTime": stamp, "lastTransitionTime": stamp},
        {"type": "Running", "status": "False", "reason": "Completed", "lastHeartbeatTime": stamp,
         "lastTransitionTime": stamp}]}
    store.update(dv_rt, done, subresource="status", check_rv=False)
    owned = copy.deepcopy(store.get(pvc_rt, GOLDEN_NAMESPACE, GOLDEN_PVC))
    owned["metadata"]["ownerReferences"] = [cluster.owner_ref(dv)]
    store.update(pvc_rt, owned, check_rv=False)
