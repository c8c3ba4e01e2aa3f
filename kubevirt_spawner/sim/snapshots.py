"""KubeVirt's snapshot controller: VirtualMachineSnapshot -> VirtualMachineSnapshotContent +
VolumeSnapshots, and VirtualMachineRestore."""

from __future__ import annotations

import asyncio
import copy
import logging
import os

from ..objects import field_value
from .compute import VM, VMI, claim_names, run_strategy
from .conditions import condition, set_condition
from .resources import BY_KIND
from .storage import copy_tree, replace_tree
from .timeutil import now_iso, seconds_since

log = logging.getLogger(__name__)

SNAP = BY_KIND["VirtualMachineSnapshot"]
CONTENT = BY_KIND["VirtualMachineSnapshotContent"]
RESTORE = BY_KIND["VirtualMachineRestore"]
VS = BY_KIND["VolumeSnapshot"]
PVC = BY_KIND["PersistentVolumeClaim"]
VSCLASS = BY_KIND["VolumeSnapshotClass"]


def _conds(status: dict, progressing: tuple, ready: tuple):
    set_condition(status, condition("Progressing", *progressing))
    set_condition(status, condition("Ready", *ready))
    for c in status["conditions"]:
        c.pop("lastProbeTime", None)


# What a snapshot of a running VM says of its consistency (pkg/storage/snapshot/snapshot.go).
INDICATION_MESSAGES = {
    "Online": "Snapshot taken while the VM was running. Consistency depends on guest-agent quiescing.",
    "GuestAgent": "Guest agent was active and attempted to quiesce the filesystem for application consistency.",
    "NoGuestAgent": "Guest agent was not available. Snapshot is crash-consistent and may not be "
                    "application-consistent.",
    "Paused": "Snapshot taken while the VM was paused. Snapshot is crash-consistent and may not be "
              "application-consistent.",
}


def source_indications(vmi: dict, agent_connected: bool) -> list[str]:
    """Online, and Paused, GuestAgent (the agent froze the filesystems) or NoGuestAgent; sorted, as
    KubeVirt keeps them."""
    paused = any(c.get("type") == "Paused" and c.get("status") == "True"
                 for c in field_value(vmi, "status.conditions") or [])
    third = "Paused" if paused else "GuestAgent" if agent_connected else "NoGuestAgent"
    return sorted(["Online", third])


class Snapshots:
    def __init__(self, cluster):
        self.c = cluster
        self.store = cluster.store

    def snapshot_dir(self, vs: dict) -> str:
        return os.path.join(self.c.state_dir, "snapshots", vs["metadata"]["uid"])

    # ================= VirtualMachineSnapshot
    async def reconcile_snapshot(self, key):
        ns, name = key
        snap = self.store.get(SNAP, ns, name)
        if snap is None or snap["metadata"].get("deletionTimestamp"):
            return
        status = copy.deepcopy(snap.get("status") or {})
        if status.get("phase") in ("Succeeded", "Failed"):
            return
        vm = self.store.get(VM, ns, field_value(snap, "spec.source.name") or "")
        if vm is None:
            deadline = field_value(snap, "spec.failureDeadline") or "5m"
            age = seconds_since(snap["metadata"]["creationTimestamp"])
            if age > _duration(deadline) / self.c.speed:
                status["phase"] = "Failed"
                _conds(status, ("False", "Failed", "snapshot deadline exceeded"), ("False", "Failed", "Source does not exist"))
            else:
                status["phase"] = "InProgress"
                _conds(status, ("False", "SourceDoesNotExist", "Source does not exist"),
                       ("False", "SourceDoesNotExist", "Source does not exist"))
                self.c.snapshot_queue.add(key, self.c.t("schedule_retry"))
            return self._write(SNAP, snap, status)
        if not status.get("phase"):
            vmi = self.store.get(VMI, ns, vm["metadata"]["name"])
            running = vmi is not None and field_value(vmi, "status.phase") == "Running"
            spec = field_value(vm, "spec.template.spec") or {}
            included = [v for v, _ in claim_names(spec)]
            excluded = [v["name"] for v in spec.get("volumes") or [] if v["name"] not in included]
            status.update({"phase": "InProgress", "sourceUID": vm["metadata"]["uid"], "readyToUse": False,
                           "snapshotVolumes": {"includedVolumes": included, "excludedVolumes": excluded}})
            if running:  # a stopped VM's snapshot has no indications at all
                indications = source_indications(vmi, self.c.compute.agent_connected(vmi))
                status["indications"] = indications
                status["sourceIndications"] = [{"indication": i, "message": INDICATION_MESSAGES[i]}
                                               for i in indications]
            _conds(status, ("True", "Operation in progress", "Source locked and operation in progress"),
                   ("False", "Operation in progress", "Not ready"))
            self._write(SNAP, snap, status)
            await self._take(snap, vm)
            self.c.step_due(self.c.snapshot_queue, key, "snapshot")
            return
        if not self.c.step_due(self.c.snapshot_queue, key, "snapshot"):
            return
        content = self.store.get(CONTENT, ns, f"vmsnapshot-content-{snap['metadata']['uid']}")
        if content is None:
            return
        status.update({"phase": "Succeeded", "readyToUse": True, "creationTime": now_iso(),
                       "virtualMachineSnapshotContentName": content["metadata"]["name"]})
        _conds(status, ("False", "Operation complete", "Operation complete"),
               ("True", "Operation complete", "Operation complete"))
        cstatus = copy.deepcopy(content.get("status") or {})
        cstatus.update({"readyToUse": True, "creationTime": now_iso(),
                        "volumeSnapshotStatus": [{"volumeSnapshotName": b["volumeSnapshotName"], "readyToUse": True,
                                                  "creationTime": now_iso()}
                                                 for b in field_value(content, "spec.volumeBackups") or []]})
        self._write(CONTENT, content, cstatus)
        for b in field_value(content, "spec.volumeBackups") or []:
            vs = self.store.get(VS, ns, b["volumeSnapshotName"])
            if vs is not None:
                self._write(VS, vs, {**(vs.get("status") or {}), "readyToUse": True, "creationTime": now_iso()})
        self._write(SNAP, snap, status)
        self.c.events.record(snap, "Normal", "SuccessfulVirtualMachineSnapshot",
                             f"Successfully completed VirtualMachineSnapshot {name}", "snapshot-controller")

    async def _take(self, snap: dict, vm: dict):
        """Copy every disk of the VM, crash-consistently, into VolumeSnapshots."""
        ns = snap["metadata"]["namespace"]
        uid = snap["metadata"]["uid"]
        spec = field_value(vm, "spec.template.spec") or {}
        vsclass = next(iter(self.store.list(VSCLASS)), None)
        backups = []
        for volume, claim in claim_names(spec):
            pvc = self.store.get(PVC, ns, claim)
            if pvc is None:
                continue
            vs_name = f"vmsnapshot-{uid}-volume-{volume}"
            vs = self.store.create(VS, {
                "apiVersion": "snapshot.storage.k8s.io/v1", "kind": "VolumeSnapshot",
                "metadata": {"name": vs_name, "namespace": ns,
                             "labels": {"snapshot.kubevirt.io/source-vm-name": vm["metadata"]["name"]}},
                "spec": {"source": {"persistentVolumeClaimName": claim},
                         "volumeSnapshotClassName": vsclass["metadata"]["name"] if vsclass else None},
                "status": {"readyToUse": False, "restoreSize": field_value(pvc, "status.capacity.storage")}})
            await asyncio.get_running_loop().run_in_executor(None, copy_tree, self.c.volume_dir(pvc),
                                                             self.snapshot_dir(vs))
            backups.append({"volumeName": volume, "volumeSnapshotName": vs_name, "persistentVolumeClaim": {
                "metadata": {"name": claim, "namespace": ns, "labels": pvc["metadata"].get("labels") or {},
                             "annotations": {}},
                "spec": copy.deepcopy(pvc.get("spec") or {})}})
        content_meta = {"name": f"vmsnapshot-content-{uid}", "namespace": ns, "finalizers": []}
        if (field_value(snap, "spec.deletionPolicy") or "Delete") == "Delete":
            content_meta["ownerReferences"] = [self.c.owner_ref(snap)]
        source_vm = {"metadata": {"name": vm["metadata"]["name"], "namespace": ns,
                                  "labels": vm["metadata"].get("labels") or {},
                                  "annotations": vm["metadata"].get("annotations") or {}},
                     "spec": copy.deepcopy(vm.get("spec") or {})}
        content = self.store.create(CONTENT, {
            "apiVersion": "snapshot.kubevirt.io/v1beta1", "kind": "VirtualMachineSnapshotContent",
            "metadata": content_meta,
            "spec": {"source": {"virtualMachine": source_vm}, "virtualMachineSnapshotName": snap["metadata"]["name"],
                     "volumeBackups": backups},
            "status": {"readyToUse": False}})
        for b in backups:
            vs = self.store.get(VS, ns, b["volumeSnapshotName"])
            new = copy.deepcopy(vs)
            new["metadata"]["ownerReferences"] = [self.c.owner_ref(content)]
            self.store.update(VS, new, check_rv=False)

    def volume_snapshot_deleted(self, vs: dict):
        path = self.snapshot_dir(vs)
        if os.path.isdir(path):
            import shutil
            asyncio.get_running_loop().run_in_executor(None, shutil.rmtree, path, True)

    # ================= VirtualMachineRestore
    async def reconcile_restore(self, key):
        ns, name = key
        restore = self.store.get(RESTORE, ns, name)
        if restore is None or restore["metadata"].get("deletionTimestamp"):
            return
        status = copy.deepcopy(restore.get("status") or {})
        if status.get("complete"):
            return
        if status.get("phase") == "Failed":
            return
        vm = self.store.get(VM, ns, field_value(restore, "spec.target.name") or "")
        snap = self.store.get(SNAP, ns, field_value(restore, "spec.virtualMachineSnapshotName") or "")
        status.setdefault("complete", False)
        if snap is None or not field_value(snap, "status.readyToUse"):
            _conds(status, ("False", "VMSnapshot not ready", f"VMSnapshot {field_value(restore, 'spec.virtualMachineSnapshotName')} not ready"),
                   ("False", "VMSnapshot not ready", "Not ready"))
            self._write(RESTORE, restore, status)
            self.c.restore_queue.add(key, self.c.t("schedule_retry"))
            return
        if vm is None:
            _conds(status, ("False", "Target does not exist", "Target VM does not exist"),
                   ("False", "Target does not exist", "Not ready"))
            self._write(RESTORE, restore, status)
            self.c.restore_queue.add(key, self.c.t("schedule_retry"))
            return
        vmi = self.store.get(VMI, ns, vm["metadata"]["name"])
        if vmi is not None:
            policy = field_value(restore, "spec.targetReadinessPolicy") or "WaitGracePeriod"
            age = seconds_since(restore["metadata"]["creationTimestamp"])
            if policy == "StopTarget":
                if run_strategy(vm) != "Halted" and not vmi["metadata"].get("deletionTimestamp"):
                    self.c.compute.vm_action(ns, vm["metadata"]["name"], "stop", {})
                message = "Waiting for target to be stopped"
            elif policy == "FailImmediate" or (policy == "WaitGracePeriod" and age > 300 / self.c.speed):
                status["phase"] = "Failed"
                _conds(status, ("False", "Failed", "Target VM is running"),
                       ("False", "Failed", "restore failed: target VM is not ready (VMI exists)"))
                self._write(RESTORE, restore, status)
                self.c.events.record(restore, "Warning", "VirtualMachineRestoreError",
                                     "Restore failed: the target VM is running", "restore-controller")
                return
            else:
                message = "Waiting for target to be ready"
            _conds(status, ("True", "Waiting", message), ("False", "Waiting", "Not ready"))
            self._write(RESTORE, restore, status)
            self.c.restore_queue.add(key, self.c.t("schedule_retry"))
            return
        content = self.store.get(CONTENT, ns, field_value(snap, "status.virtualMachineSnapshotContentName") or "")
        if content is None:
            self.c.restore_queue.add(key, self.c.t("schedule_retry"))
            return
        if not status.get("restores"):
            _conds(status, ("True", "Creating new PVCs", "Creating new PVCs"), ("False", "Waiting", "Not ready"))
            status["restores"] = await self._restore_volumes(restore, vm, content)
            self._write(RESTORE, restore, status)
            self.c.step_due(self.c.restore_queue, key, "restore")
            return
        if not self.c.step_due(self.c.restore_queue, key, "restore"):
            return
        self._rewrite_vm(restore, vm, content, status["restores"])
        status.update({"complete": True, "restoreTime": now_iso()})
        _conds(status, ("False", "Operation complete", "Operation complete"),
               ("True", "Operation complete", "Operation complete"))
        self._write(RESTORE, restore, status)
        self.c.events.record(restore, "Normal", "VirtualMachineRestoreComplete",
                             f"Successfully completed VirtualMachineRestore {name}", "restore-controller")

    async def _restore_volumes(self, restore: dict, vm: dict, content: dict) -> list[dict]:
        ns = restore["metadata"]["namespace"]
        in_place = field_value(restore, "spec.volumeRestorePolicy") == "InPlace"
        owned = (field_value(restore, "spec.volumeOwnershipPolicy") or "Vm") == "Vm"
        restores = []
        loop = asyncio.get_running_loop()
        for b in field_value(content, "spec.volumeBackups") or []:
            vs = self.store.get(VS, ns, b["volumeSnapshotName"])
            if vs is None:
                continue
            source = self.snapshot_dir(vs)
            if in_place:
                pvc = self.store.get(PVC, ns, b["persistentVolumeClaim"]["metadata"]["name"])
                if pvc is None:
                    pvc = self._create_pvc(b, b["persistentVolumeClaim"]["metadata"]["name"], restore, vm, owned)
                await loop.run_in_executor(None, replace_tree, source, self.c.volume_dir(pvc))
                claim = pvc["metadata"]["name"]
            else:
                claim = f"restore-{restore['metadata']['uid']}-{b['volumeName']}"
                pvc = self.store.get(PVC, ns, claim) or self._create_pvc(b, claim, restore, vm, owned)
                await loop.run_in_executor(None, replace_tree, source, self.c.volume_dir(pvc))
            restores.append({"volumeName": b["volumeName"], "persistentVolumeClaim": claim,
                             "volumeSnapshotName": b["volumeSnapshotName"]})
        return restores

    def _create_pvc(self, backup: dict, claim: str, restore: dict, vm: dict, owned: bool) -> dict:
        """A restored PVC is provisioned from the VolumeSnapshot, so it is bound at once."""
        ns = restore["metadata"]["namespace"]
        spec = copy.deepcopy(backup["persistentVolumeClaim"]["spec"])
        spec.pop("volumeName", None)
        spec["dataSource"] = {"apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot",
                              "name": backup["volumeSnapshotName"]}
        meta = {"name": claim, "namespace": ns,
                "labels": {**(backup["persistentVolumeClaim"]["metadata"].get("labels") or {}),
                           "restore.kubevirt.io/source-vm-name": vm["metadata"]["name"]},
                "annotations": {"restore.kubevirt.io/name": restore["metadata"]["name"]},
                "finalizers": ["kubernetes.io/pvc-protection"]}
        if owned:
            meta["ownerReferences"] = [self.c.owner_ref(vm)]
        pvc = self.store.create(PVC, {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta,
                                      "spec": spec, "status": {"phase": "Pending"}})
        new = copy.deepcopy(pvc)
        new["spec"]["volumeName"] = f"pvc-{pvc['metadata']['uid']}"
        pvc = self.store.update(PVC, new, check_rv=False)
        new = copy.deepcopy(pvc)
        new["status"] = {"phase": "Bound", "accessModes": spec.get("accessModes") or ["ReadWriteOnce"],
                         "capacity": {"storage": field_value(spec, "resources.requests.storage")}}
        os.makedirs(self.c.volume_dir(new), exist_ok=True)
        return self.store.update(PVC, new, subresource="status", check_rv=False)

    def _rewrite_vm(self, restore: dict, vm: dict, content: dict, restores: list[dict]):
        """The VM gets the snapshot's spec back, its volumes pointing at the restored claims."""
        by_volume = {r["volumeName"]: r["persistentVolumeClaim"] for r in restores}
        spec = copy.deepcopy(field_value(content, "spec.source.virtualMachine.spec") or vm.get("spec") or {})
        spec["runStrategy" if "runStrategy" in (vm.get("spec") or {}) else "running"] = \
            vm["spec"].get("runStrategy", vm["spec"].get("running"))
        for v in field_value(spec, "template.spec.volumes") or []:
            if v["name"] in by_volume:
                v.pop("dataVolume", None)
                v["persistentVolumeClaim"] = {"claimName": by_volume[v["name"]]}
        new = copy.deepcopy(vm)
        new["spec"] = spec
        new["metadata"].setdefault("annotations", {})["restore.kubevirt.io/lastRestoreUID"] = \
            f"{restore['metadata']['name']}-{restore['metadata']['uid']}"
        self.store.update(VM, new, check_rv=False)

    def _write(self, rt, obj: dict, status: dict):
        if status != obj.get("status"):
            new = copy.deepcopy(obj)
            new["status"] = status
            self.store.update(rt, new, subresource="status", check_rv=False)


def _duration(text: str) -> float:
    total, num = 0.0, ""
    units = {"h": 3600, "m": 60, "s": 1}
    for ch in str(text):
        if ch.isdigit() or ch == ".":
            num += ch
        elif ch in units and num:
            total += float(num) * units[ch]
            num = ""
    return total or 300.0
