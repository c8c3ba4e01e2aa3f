"""Small builders for the objects tests create."""

from __future__ import annotations

GOLDEN = {"namespace": "vm-images", "name": "ubuntu-24-04-cuda-golden"}
KV = ("kubevirt.io", "v1")
CDI = ("cdi.kubevirt.io", "v1beta1")
SNAP = ("snapshot.kubevirt.io", "v1beta1")


def clone_dv(name: str, size: str = "60Gi") -> dict:  # not smaller than the golden image
    return {"apiVersion": "cdi.kubevirt.io/v1beta1", "kind": "DataVolume", "metadata": {"name": name},
            "spec": {"source": {"pvc": dict(GOLDEN)},
                     "storage": {"storageClassName": "ceph-rbd", "accessModes": ["ReadWriteOnce"],
                                 "volumeMode": "Block", "resources": {"requests": {"storage": size}}}}}


def vm(name: str, claim: str, gpu: bool = False, run_strategy: str = "Halted", cpu: str = "2",
       memory: str = "4Gi", labels: dict | None = None, secret: str | None = None,
       eviction_strategy: str | None = None, node: str | None = None) -> dict:
    spec = {"terminationGracePeriodSeconds": 5,
            "domain": {"resources": {"requests": {"cpu": cpu, "memory": memory}},
                       "devices": {"disks": [{"name": "rootdisk", "disk": {"bus": "virtio"}}],
                                   "interfaces": [{"name": "default", "masquerade": {}}]}},
            "networks": [{"name": "default", "pod": {}}],
            "volumes": [{"name": "rootdisk", "persistentVolumeClaim": {"claimName": claim}}]}
    if gpu:
        spec["nodeSelector"] = {"workload.example.com/kubevirt": "true", "accelerator.example.com/mode": "vfio"}
        spec["tolerations"] = [{"key": "workload.example.com/kubevirt", "operator": "Equal", "value": "true",
                                "effect": "NoSchedule"}]
        spec["domain"]["devices"]["gpus"] = [{"name": "gpu0", "deviceName": "nvidia.com/A100-PCIE-40GB"}]
    if eviction_strategy:
        spec["evictionStrategy"] = eviction_strategy
    if node:
        spec.setdefault("nodeSelector", {})["kubernetes.io/hostname"] = node
    if secret:
        spec["domain"]["devices"]["disks"].append({"name": "hubenv", "disk": {"bus": "virtio"}})
        spec["volumes"].append({"name": "hubenv", "secret": {"secretName": secret}})
    return {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "metadata": {"name": name},
            "spec": {"runStrategy": run_strategy,
                     "template": {"metadata": {"labels": {"app": name, **(labels or {})}}, "spec": spec}}}
