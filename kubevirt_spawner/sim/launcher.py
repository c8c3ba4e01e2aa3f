"""virt-launcher pods: the Pod behind every VMI, as virt-controller renders it
(pkg/virt-controller/services/template.go, renderLaunchManifest) and as the kubelet and the
scheduler move it. Scheduling and attach failures are Events on the Pod, as on a real cluster."""

from __future__ import annotations

import copy
import random
import string
from typing import Any

from ..objects import field_value
from .conditions import condition, set_condition
from .resources import BY_KIND
from .timeutil import now_iso

POD = BY_KIND["Pod"]
LAUNCHER_LABEL = "kubevirt.io"
SCHEDULABLE_LABEL = "kubevirt.io/schedulable"  # set by virt-handler on its nodes
LAUNCHER_IMAGE = "quay.io/kubevirt/virt-launcher:v1.9.0"
# (pkg/virt-controller/services/rendervolumes.go: the launcher's own emptyDirs)
LAUNCHER_EMPTY_DIRS = ("private", "public", "sockets", "virt-bin-share-dir", "libvirt-runtime", "ephemeral-disks")


def pod_ready(pod: dict | None) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in field_value(pod, "status.conditions") or [])


class Launchers:
    def __init__(self, cluster):
        self.c = cluster
        self.store = cluster.store

    def of(self, vmi: dict) -> dict | None:
        """The VMI's launcher pod (found by the created-by label, as virt-controller does)."""
        uid = vmi["metadata"]["uid"]
        for pod in self.store.list(POD, vmi["metadata"]["namespace"]):
            if (pod["metadata"].get("labels") or {}).get("kubevirt.io/created-by") == uid:
                return pod
        return None

    def on_node(self, node: str) -> list[dict]:
        return [p for p in self.store.list(POD) if field_value(p, "spec.nodeName") == node
                and (p["metadata"].get("labels") or {}).get(LAUNCHER_LABEL) == "virt-launcher"]

    def create(self, vmi: dict) -> dict:
        meta, spec = vmi["metadata"], vmi.get("spec") or {}
        name = meta["name"]
        suffix = "".join(random.choices(string.ascii_lowercase + string.digits, k=5))
        grace = spec.get("terminationGracePeriodSeconds")
        requests = dict(field_value(vmi, "spec.domain.resources.requests") or {})
        limits = dict(field_value(vmi, "spec.domain.resources.limits") or {})
        for gpu in field_value(vmi, "spec.domain.devices.gpus") or []:
            requests[gpu["deviceName"]] = str(int(requests.get(gpu["deviceName"], 0)) + 1)
            limits[gpu["deviceName"]] = requests[gpu["deviceName"]]
        pod: dict[str, Any] = {"apiVersion": "v1", "kind": "Pod", "metadata": {
            "name": f"virt-launcher-{name}-{suffix}", "generateName": f"virt-launcher-{name}-",
            "namespace": meta["namespace"],
            "labels": {**(meta.get("labels") or {}), LAUNCHER_LABEL: "virt-launcher",
                       "kubevirt.io/created-by": meta["uid"], "vm.kubevirt.io/name": name.split(".")[0][:63]},
            "annotations": {"kubevirt.io/domain": name},
            "ownerReferences": [self.c.owner_ref(vmi)]},
            "spec": {"nodeSelector": {**(spec.get("nodeSelector") or {}), SCHEDULABLE_LABEL: "true"},
                     "tolerations": copy.deepcopy(spec.get("tolerations") or []),
                     "terminationGracePeriodSeconds": (30 if grace is None else grace) + 30,
                     "restartPolicy": "Never",
                     "containers": [{"name": "compute", "image": LAUNCHER_IMAGE,
                                     "resources": {"requests": requests, **({"limits": limits} if limits else {})}}],
                     # virt-launcher's own scratch space: why `kubectl drain` needs
                     # --delete-emptydir-data on a VM node
                     "volumes": [{"name": v, "emptyDir": {}} for v in LAUNCHER_EMPTY_DIRS]},
            "status": {"phase": "Pending", "qosClass": "Burstable"}}
        if spec.get("affinity"):
            pod["spec"]["affinity"] = copy.deepcopy(spec["affinity"])
        return self.store.create(POD, pod)

    def update_status(self, pod: dict, change) -> dict:
        """Apply `change(status)` to the pod's status and write it when it changed."""
        status = copy.deepcopy(pod.get("status") or {})
        change(status)
        if status == pod.get("status"):
            return pod
        new = copy.deepcopy(pod)
        new["status"] = status
        return self.store.update(POD, new, subresource="status", check_rv=False)

    def bind(self, pod: dict, node: str) -> dict:
        """The scheduler's binding."""
        new = copy.deepcopy(pod)
        new["spec"]["nodeName"] = node
        pod = self.store.update(POD, new, check_rv=False)
        return self.update_status(pod, lambda s: set_condition(s, condition("PodScheduled", "True")))

    def running(self, pod: dict, ip: str) -> dict:
        def change(status):
            status.update({"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}], "hostIP": ip,
                           "startTime": status.get("startTime") or now_iso(),
                           "containerStatuses": [{"name": "compute", "ready": True, "restartCount": 0,
                                                  "image": LAUNCHER_IMAGE, "imageID": LAUNCHER_IMAGE,
                                                  "started": True, "state": {"running": {"startedAt": now_iso()}}}]})
            set_condition(status, condition("Initialized", "True"))
            set_condition(status, condition("ContainersReady", "True"))
            set_condition(status, condition("Ready", "True"))
        return self.update_status(pod, change)

    def set_ready(self, pod: dict, ready: bool, reason: str = "", message: str = "") -> dict:
        return self.update_status(pod, lambda s: set_condition(
            s, condition("Ready", "True" if ready else "False", reason, message)))

    def remove(self, pod: dict):
        """The kubelet's (or podgc's) last word: the pod is gone."""
        if self.store.get(POD, pod["metadata"]["namespace"], pod["metadata"]["name"]) is not None:
            self.store.delete(POD, pod["metadata"]["namespace"], pod["metadata"]["name"], grace_period=0)
