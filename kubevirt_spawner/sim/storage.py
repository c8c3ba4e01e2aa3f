"""The storage side: PVC binding and expansion (the Ceph RBD CSI driver), and CDI's DataVolume
controller (clones between PVCs, blank disks)."""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import shutil

from ..objects import field_value
from ..quantity import parse_quantity
from . import errors
from .admission import admit
from .conditions import condition, set_condition
from .resources import BY_KIND

log = logging.getLogger(__name__)

PVC = BY_KIND["PersistentVolumeClaim"]
DV = BY_KIND["DataVolume"]
SC = BY_KIND["StorageClass"]
PVC_PROTECTION = "kubernetes.io/pvc-protection"


def default_storage_class(store) -> dict | None:
    for sc in store.list(SC):
        if (sc["metadata"].get("annotations") or {}).get("storageclass.kubernetes.io/is-default-class") == "true":
            return sc
    return None


class Storage:
    def __init__(self, cluster):
        self.c = cluster
        self.store = cluster.store

    # ================= PersistentVolumeClaims
    async def reconcile_pvc(self, key):
        ns, name = key
        pvc = self.store.get(PVC, ns, name)
        if pvc is None:
            return
        meta = pvc["metadata"]
        if meta.get("deletionTimestamp"):
            if PVC_PROTECTION in (meta.get("finalizers") or []) and not self.c.compute.attachments(ns, name):
                new = copy.deepcopy(pvc)
                new["metadata"]["finalizers"] = [f for f in meta["finalizers"] if f != PVC_PROTECTION]
                self.store.update(PVC, new, check_rv=False)
            return
        phase = field_value(pvc, "status.phase")
        if phase != "Bound":
            sc_name = field_value(pvc, "spec.storageClassName")
            sc = self.store.get(SC, "", sc_name) if sc_name else None
            if sc is None:
                self.c.events.record(pvc, "Warning", "ProvisioningFailed",
                                     f'storageclass.storage.k8s.io "{sc_name}" not found',
                                     "persistentvolume-controller")
                return
            if sc.get("volumeBindingMode") == "WaitForFirstConsumer" and not self._has_consumer(pvc):
                self.c.events.record(pvc, "Normal", "WaitForFirstConsumer",
                                     "waiting for first consumer to be created before binding",
                                     "persistentvolume-controller")
                return
            if self.c.step_due(self.c.pvc_queue, key, "bind"):
                self._bind(pvc, sc)
            return
        requested = parse_quantity(field_value(pvc, "spec.resources.requests.storage") or 0)
        capacity = parse_quantity(field_value(pvc, "status.capacity.storage") or 0)
        if requested > capacity:
            new = copy.deepcopy(pvc)
            new["status"]["capacity"]["storage"] = field_value(pvc, "spec.resources.requests.storage")
            new["status"].pop("conditions", None)
            self.store.update(PVC, new, subresource="status", check_rv=False)
            self.c.events.record(pvc, "Normal", "FileSystemResizeSuccessful",
                                 f"MountVolume.NodeExpandVolume succeeded for volume \"{field_value(pvc, 'spec.volumeName')}\"",
                                 "kubelet")

    def _has_consumer(self, pvc: dict) -> bool:
        from .compute import VMI, claim_names
        ns, name = pvc["metadata"]["namespace"], pvc["metadata"]["name"]
        return any(name in (c for _, c in claim_names(v.get("spec") or {})) for v in self.store.list(VMI, ns))

    def _bind(self, pvc: dict, sc: dict):
        new = copy.deepcopy(pvc)
        volume = new["spec"].get("volumeName") or f"pvc-{pvc['metadata']['uid']}"
        new["spec"]["volumeName"] = volume
        new["metadata"].setdefault("annotations", {})["pv.kubernetes.io/bind-completed"] = "yes"
        new["metadata"]["annotations"]["volume.kubernetes.io/storage-provisioner"] = sc.get("provisioner", "")
        os.makedirs(self.c.volume_dir(new), exist_ok=True)
        new = self.store.update(PVC, new, check_rv=False)
        status = {"phase": "Bound", "accessModes": list(field_value(pvc, "spec.accessModes") or ["ReadWriteOnce"]),
                  "capacity": {"storage": field_value(pvc, "spec.resources.requests.storage") or "1Gi"}}
        new = copy.deepcopy(new)
        new["status"] = status
        self.store.update(PVC, new, subresource="status", check_rv=False)
        self.c.events.record(pvc, "Normal", "ProvisioningSucceeded",
                             f"Successfully provisioned volume {volume}", sc.get("provisioner", "csi"))

    def pvc_deleted(self, pvc: dict):
        path = self.c.volume_dir(pvc)
        if path and os.path.isdir(path):
            asyncio.get_running_loop().run_in_executor(None, shutil.rmtree, path, True)

    # ================= CDI DataVolumes
    async def reconcile_dv(self, key):
        ns, name = key
        dv = self.store.get(DV, ns, name)
        if dv is None or dv["metadata"].get("deletionTimestamp"):
            return
        phase = field_value(dv, "status.phase")
        if phase in ("Succeeded", "Failed"):
            return
        spec = dv.get("spec") or {}
        source = spec.get("source") or {}
        pvc = self.store.get(PVC, ns, name)
        if pvc is None:
            if "pvc" in source:
                src_ns = source["pvc"].get("namespace") or ns
                src = self.store.get(PVC, src_ns, source["pvc"]["name"])
                if src is None:
                    return self._dv_status(dv, "Pending", "N/A", bound=("False", "CloneWithoutSource",
                                           f"The source pvc {src_ns}/{source['pvc']['name']} doesn't exist"),
                                           event=("Warning", "CloneWithoutSource",
                                                  f"The source PVC {src_ns}/{source['pvc']['name']} doesn't exist"),
                                           retry=True)
            try:
                claim = self._pvc_for(dv)
                admit(self.store, PVC, claim, None)  # CDI's create goes through quota admission too
                pvc = self.store.create(PVC, claim)
            except errors.ApiError as err:
                reason = "ErrExceededQuota" if err.code == 403 else "ErrClaimNotValid"
                return self._dv_status(dv, "Pending", "N/A", bound=("False", reason, err.message),
                                       event=("Warning", reason, err.message), retry=True)
            return self._dv_status(dv, "Pending", "N/A", bound=("False", "Pending", "PVC Pending"))
        if field_value(pvc, "status.phase") != "Bound":
            return self._dv_status(dv, "Pending", "N/A", bound=("False", "Pending", "PVC Pending"))
        clone = "pvc" in source
        scheduled, in_progress = ("CloneScheduled", "CloneInProgress") if clone else ("ImportScheduled",
                                                                                     "ImportInProgress")
        if phase in (None, "", "Pending"):
            if clone:
                src = source["pvc"]
                self.c.events.record(dv, "Normal", "CloneScheduled", f"Cloning from {src.get('namespace') or ns}/"
                                     f"{src['name']} into {ns}/{name} scheduled", "datavolume-pvc-clone-controller")
            self.c.step_due(self.c.dv_queue, key, "clone_schedule")
            return self._dv_status(dv, scheduled, "N/A", bound=("True", "Bound", "PVC " + name + " Bound"))
        if phase == scheduled:
            if not self.c.step_due(self.c.dv_queue, key, "clone_schedule"):
                return
            if self.c.faults.take_clone_failure():
                msg = "clone failed: the source volume could not be read (injected by the simulator)"
                return self._dv_status(dv, "Failed", "N/A", running=("False", "Error", msg),
                                       event=("Warning", "CloneFailed" if clone else "ImportFailed", msg))
            self._dv_status(dv, in_progress, "0.00%", running=("True", "Pod is running", ""),
                            event=("Normal", "CloneInProgress" if clone else "ImportInProgress",
                                   f"Cloning from {source['pvc'].get('namespace') or ns}/{source['pvc']['name']} "
                                   f"into {ns}/{name} in progress" if clone else "Import into " + name + " started"))
            if clone:
                src_pvc = self.store.get(PVC, source["pvc"].get("namespace") or ns, source["pvc"]["name"])
                if src_pvc is not None:
                    await asyncio.get_running_loop().run_in_executor(
                        None, copy_tree, self.c.volume_dir(src_pvc), self.c.volume_dir(pvc))
            self.c.step_due(self.c.dv_queue, key, "clone-step", self.c.t("clone") / 10)
            return
        if phase == in_progress:
            self._progress(dv)

    def _progress(self, dv: dict):
        """Ten progress updates over the clone time, then Succeeded."""
        ns, name = dv["metadata"]["namespace"], dv["metadata"]["name"]
        if not self.c.step_due(self.c.dv_queue, (ns, name), "clone-step", self.c.t("clone") / 10):
            return
        try:
            step = int(float((field_value(dv, "status.progress") or "0").rstrip("%")) // 10) + 1
        except ValueError:
            step = 1
        if step >= 10:
            src = (field_value(dv, "spec.source.pvc") or {})
            self._dv_status(dv, "Succeeded", "100.0%", running=("False", "Completed", ""), ready=True,
                            event=("Normal", "CloneSucceeded" if src else "ImportSucceeded",
                                   f"Successfully cloned from {src.get('namespace') or ns}/{src.get('name')} into "
                                   f"{ns}/{name}" if src else "Import Successful"))
            return
        self._dv_status(dv, field_value(dv, "status.phase"), f"{step * 10:.2f}%")
        self.c.step_due(self.c.dv_queue, (ns, name), "clone-step", self.c.t("clone") / 10)

    def _pvc_for(self, dv: dict) -> dict:
        spec = dv.get("spec") or {}
        base = copy.deepcopy(spec.get("pvc") or spec.get("storage") or {})
        sc_name = base.get("storageClassName")
        if not sc_name:
            sc = default_storage_class(self.store)
            sc_name = sc["metadata"]["name"] if sc else None
        sc = self.store.get(SC, "", sc_name) if sc_name else None
        profile = ((sc or {}).get("metadata", {}).get("annotations") or {})
        pvc_spec = {"accessModes": base.get("accessModes") or
                    [profile.get("sim.kubevirt.io/access-mode", "ReadWriteOnce")],
                    "volumeMode": base.get("volumeMode") or profile.get("sim.kubevirt.io/volume-mode", "Filesystem"),
                    "resources": base.get("resources") or {"requests": {"storage": "1Gi"}},
                    "storageClassName": sc_name}
        meta = dv["metadata"]
        return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                "metadata": {"name": meta["name"], "namespace": meta["namespace"],
                             "labels": {**(meta.get("labels") or {}), "app": "containerized-data-importer",
                                        "app.kubernetes.io/component": "storage",
                                        "app.kubernetes.io/managed-by": "cdi-controller"},
                             "annotations": {"cdi.kubevirt.io/storage.contentType": "kubevirt",
                                             "cdi.kubevirt.io/createdForDataVolume": meta["uid"]},
                             "ownerReferences": [self.c.owner_ref(dv)],
                             "finalizers": [PVC_PROTECTION]},
                "spec": pvc_spec, "status": {"phase": "Pending"}}

    def _dv_status(self, dv, phase, progress, bound=None, running=None, ready=False, event=None, retry=False):
        status = copy.deepcopy(dv.get("status") or {})
        status["phase"] = phase
        status["progress"] = progress
        status.setdefault("restartCount", 0)
        if bound:
            set_condition(status, condition("Bound", bound[0], bound[1], bound[2]))
        else:
            status.setdefault("conditions", [])
        if running:
            set_condition(status, condition("Running", running[0], running[1], running[2]))
        set_condition(status, condition("Ready", "True" if ready else "False"))
        if phase == "Succeeded" and not bound:
            set_condition(status, condition("Bound", "True", "Bound", f"PVC {dv['metadata']['name']} Bound"))
        for c in status["conditions"]:
            c.pop("lastProbeTime", None)
            c["lastHeartbeatTime"] = c.get("lastTransitionTime")
        if status != dv.get("status"):
            new = copy.deepcopy(dv)
            new["status"] = status
            self.store.update(DV, new, subresource="status", check_rv=False)
        if event:
            self.c.events.record(dv, event[0], event[1], event[2], "datavolume-controller")
        if retry:
            self.c.dv_queue.add((dv["metadata"]["namespace"], dv["metadata"]["name"]), self.c.t("schedule_retry"))


def copy_tree(src: str, dst: str):
    """Copy a volume's contents into another volume (what a CSI clone does)."""
    os.makedirs(dst, exist_ok=True)
    if src and os.path.isdir(src):
        shutil.copytree(src, dst, dirs_exist_ok=True, symlinks=True)


def replace_tree(src: str, dst: str):
    """Make `dst` an exact copy of `src` (what restoring a volume from a snapshot does)."""
    if os.path.isdir(dst):
        shutil.rmtree(dst)
    copy_tree(src, dst)
