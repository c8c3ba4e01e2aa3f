"""KubeVirt's snapshot controller: VirtualMachineSnapshot -> VirtualMachineSnapshotContent +
VolumeSnapshots, and VirtualMachineRestore."""

from __future__ import annotations

import asyncio
import copy
import logging
import os

from ..objects import field_value
from ..quantity import parse_quantity
from . import errors
from .admission import admit
from .conditions import condition, get_condition, set_condition
from .instances import VM, VMI, claim_names, run_strategy
from .machines import QemuGuest
from .qemu import AgentError
from .resources import BY_KIND
from .storage import POPULATED_FOR, PRE_POPULATED, copy_tree, replace_tree
from .timeutil import now_iso, seconds_since

log = logging.getLogger(__name__)

SNAP = BY_KIND["VirtualMachineSnapshot"]
CONTENT = BY_KIND["VirtualMachineSnapshotContent"]
RESTORE = BY_KIND["VirtualMachineRestore"]
VS = BY_KIND["VolumeSnapshot"]
PVC = BY_KIND["PersistentVolumeClaim"]
VSCLASS = BY_KIND["VolumeSnapshotClass"]
SC = BY_KIND["StorageClass"]
DV = BY_KIND["DataVolume"]
LAST_RESTORE = "restore.kubevirt.io/lastRestoreUID"
RESTORE_FINALIZER = "snapshot.kubevirt.io/vmrestore-protection"  # restore.go vmRestoreFinalizer
# What a restored claim does not copy from its source (CreateRestorePVCDef).
DROPPED_ANNOTATIONS = ("pv.kubernetes.io", "volume.beta.kubernetes.io", "cdi.kubevirt.io", "volume.kubernetes.io",
                       "k8s.io/CloneRequest", "k8s.io/CloneOf")


def snapshot_volumes(store, ns: str, spec: dict) -> list[tuple[str, str]]:
    """(volume, claim) of the VM's volumes a snapshot takes: its claim volumes, but those without a
    StorageClass or whose StorageClass has no VolumeSnapshotClass of its driver (KubeVirt's VM controller marks them
    `enabled: false`, "No VolumeSnapshotClass: Volume snapshots are not configured for this
    StorageClass", in status.volumeSnapshotStatuses, and the snapshot leaves them out:
    pkg/virt-controller/watch/vm.go, pkg/storage/snapshot/source.go)."""
    out = []
    for volume, claim in claim_names(spec):
        pvc = store.get(PVC, ns, claim)
        if pvc is not None:  # (a missing claim: the snapshot waits for it, source.go's verifyVolumes)
            sc = store.get(SC, "", field_value(pvc, "spec.storageClassName") or "")
            if sc is None or not any(c.get("driver") == sc.get("provisioner") for c in store.list(VSCLASS)):
                continue  # (no StorageClass, as a static volume's claim: none either, getSnapshotPVC)
        out.append((volume, claim))
    return out


class RestoreError(Exception):
    """An error restore.go's reconcile returns (and doUpdateError reports, without Failure)."""


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
            included = [v for v, _ in snapshot_volumes(self.store, ns, spec)]
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
            # The source is locked while the snapshot runs (pkg/storage/snapshot/source.go).
            self._write(VM, vm, {**(vm.get("status") or {}), "snapshotInProgress": name})
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
        # Unlocked after the phase is Succeeded (upstream: on the next reconcile).
        vm = self.store.get(VM, ns, field_value(snap, "spec.source.name") or "")
        if vm is not None and field_value(vm, "status.snapshotInProgress") == name:
            vm_status = dict(vm.get("status") or {})
            vm_status.pop("snapshotInProgress", None)
            self._write(VM, vm, vm_status)
        self.c.events.record(snap, "Normal", "SuccessfulVirtualMachineSnapshot",
                             f"Successfully completed VirtualMachineSnapshot {name}", "snapshot-controller")

    async def _take(self, snap: dict, vm: dict):
        """Copy every disk of the VM into VolumeSnapshots; a QEMU guest's filesystems frozen by its
        agent meanwhile, as virt-handler freezes them for an online snapshot with a connected agent
        (pkg/storage/snapshot/source.go Freeze/Unfreeze; the VMI's status.fsFreezeStatus says
        "frozen" while they are)."""
        vmi = self.store.get(VMI, snap["metadata"]["namespace"], vm["metadata"]["name"])
        guest = self.c.compute.guests.get((snap["metadata"]["namespace"], vm["metadata"]["name"]))
        frozen = False
        if isinstance(guest, QemuGuest) and vmi is not None and self.c.compute.agent_connected(vmi):
            try:
                await guest.freeze()
                frozen = True
                self._freeze_status(vmi, "frozen")
            except AgentError as err:  # then it is only crash-consistent, and says so
                self.c.events.record(snap, "Warning", "FreezeFailed", str(err), "snapshot-controller")
                self._not_quiesced(snap)
        try:
            await self._copy_volumes(snap, vm)
        finally:
            if frozen:
                try:
                    await guest.thaw()
                except AgentError as err:  # (qemu-ga never thaws by itself: the guest stays frozen)
                    self.c.events.record(snap, "Warning", "ThawFailed", str(err), "snapshot-controller")
                self._freeze_status(vmi, None)

    def _not_quiesced(self, snap: dict):
        current = self.store.get(SNAP, snap["metadata"]["namespace"], snap["metadata"]["name"])
        if current is None:
            return
        status = copy.deepcopy(current.get("status") or {})
        indications = sorted(["Online", "NoGuestAgent"])
        status["indications"] = indications
        status["sourceIndications"] = [{"indication": i, "message": INDICATION_MESSAGES[i]} for i in indications]
        self._write(SNAP, current, status)

    def _freeze_status(self, vmi: dict, value: str | None):
        current = self.store.get(VMI, vmi["metadata"]["namespace"], vmi["metadata"]["name"])
        if current is None or current["metadata"]["uid"] != vmi["metadata"]["uid"]:
            return
        status = copy.deepcopy(current.get("status") or {})
        if value:
            status["fsFreezeStatus"] = value
        else:
            status.pop("fsFreezeStatus", None)
        self._write(VMI, current, status)

    async def _copy_volumes(self, snap: dict, vm: dict):
        ns = snap["metadata"]["namespace"]
        uid = snap["metadata"]["uid"]
        spec = field_value(vm, "spec.template.spec") or {}
        vsclass = next(iter(self.store.list(VSCLASS)), None)
        backups = []
        for volume, claim in snapshot_volumes(self.store, ns, spec):
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
                # the claim's metadata whole but its managed fields (getSimplifiedMetaObject in
                # KubeVirt's pkg/storage/snapshot/util.go); a restore copies the annotations back
                "metadata": {"name": claim, "namespace": ns, "labels": pvc["metadata"].get("labels") or {},
                             "annotations": dict(pvc["metadata"].get("annotations") or {})},
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

    # ================= VirtualMachineRestore (pkg/storage/snapshot/restore.go)
    async def reconcile_restore(self, key):
        ns, name = key
        restore = self.store.get(RESTORE, ns, name)
        if restore is None:
            return
        if restore["metadata"].get("deletionTimestamp"):
            return self._restore_deleted(restore)
        status = copy.deepcopy(restore.get("status") or {})
        if status.get("complete") or (get_condition({"status": status}, "Failure") or {}).get("status") == "True":
            return
        status.setdefault("complete", False)
        if self.c.faults.restore_error:  # the simulator's fault: an error restore.go reports, not Failure
            message = self.c.faults.restore_error
            _conds(status, ("False", message, ""), ("False", message, ""))
            self._write(RESTORE, restore, status)
            self.c.restore_queue.add(key, self.c.t("schedule_retry"))
            return
        vm = self.store.get(VM, ns, field_value(restore, "spec.target.name") or "")
        snap_name = field_value(restore, "spec.virtualMachineSnapshotName") or ""
        snap = self.store.get(SNAP, ns, snap_name)
        retry = None
        if snap is None:
            retry = f"VMSnapshot {ns}/{snap_name} does not exist"
        elif field_value(snap, "status.phase") == "Failed":
            retry = f"VMSnapshot {ns}/{snap_name} failed and is invalid to use"
        elif not field_value(snap, "status.readyToUse"):
            retry = f"VMSnapshot {ns}/{snap_name} not ready"
        elif vm is None:
            retry = "Target VM does not exist"
        if retry:  # doUpdateError: not fatal, tried again
            _conds(status, ("False", retry, ""), ("False", retry, ""))
            self._write(RESTORE, restore, status)
            self.c.restore_queue.add(key, self.c.t("schedule_retry"))
            return
        vmi = self.store.get(VMI, ns, vm["metadata"]["name"])
        if vmi is not None:
            return self._target_not_ready(restore, status, vm, vmi)
        content = self.store.get(CONTENT, ns, field_value(snap, "status.virtualMachineSnapshotContentName") or "")
        if content is None:
            self.c.restore_queue.add(key, self.c.t("schedule_retry"))
            return
        holder = field_value(vm, "status.restoreInProgress")
        if holder and holder != name:
            _conds(status, ("False", f"vm restore {holder} in progress", ""), ("False", "Not ready", ""))
            self._write(RESTORE, restore, status)
            self.c.restore_queue.add(key, self.c.t("schedule_retry"))
            return
        restore = self._add_finalizer(restore)
        if not holder:
            self._write(VM, vm, {**(vm.get("status") or {}), "restoreInProgress": name})
        if not status.get("restores"):
            status["restores"] = self._planned_restores(restore, vm, content)
        _conds(status, ("True", "Creating new PVCs", ""), ("False", "Waiting for new PVCs", ""))
        try:
            volumes_ready = await self._restore_volumes(restore, vm, content, status["restores"])
        except (errors.ApiError, RestoreError) as err:
            # doUpdateError: a refused claim (a quota), a missing VolumeSnapshot: no Failure, tried again
            message = err.message if isinstance(err, errors.ApiError) else str(err)
            _conds(status, ("False", message, ""), ("False", message, ""))
            self._write(RESTORE, restore, status)
            self.c.events.record(restore, "Warning", "VirtualMachineRestoreError",
                                 f"VirtualMachineRestore encountered error {message}", "restore-controller")
            self.c.restore_queue.add(key, self.c.t("schedule_retry"))
            return
        if not volumes_ready:
            self._write(RESTORE, restore, status)
            self.c.restore_queue.add(key, self.c.t("schedule_retry"))
            return
        if not self.c.step_due(self.c.restore_queue, key, "restore"):
            self._write(RESTORE, restore, status)
            return
        vm = self._rewrite_vm(restore, self.store.get(VM, ns, vm["metadata"]["name"]) or vm, content,
                              status["restores"])
        vm_status = dict(vm.get("status") or {})
        vm_status.pop("restoreInProgress", None)
        self._write(VM, vm, vm_status)
        status.update({"complete": True, "restoreTime": now_iso()})
        _conds(status, ("False", "Operation complete", ""), ("True", "Operation complete", ""))
        self._write(RESTORE, restore, status)
        self.c.events.record(restore, "Normal", "VirtualMachineRestoreComplete",
                             f"Successfully completed VirtualMachineRestore {name}", "restore-controller")

    def _add_finalizer(self, restore: dict) -> dict:
        """The controller's finalizer, before it locks the VM: a deleted restore unlocks it."""
        if RESTORE_FINALIZER in (restore["metadata"].get("finalizers") or []):
            return restore
        new = copy.deepcopy(restore)
        new["metadata"]["finalizers"] = [*(new["metadata"].get("finalizers") or []), RESTORE_FINALIZER]
        return self.store.update(RESTORE, new, check_rv=False)

    def _restore_deleted(self, restore: dict):
        """handleVMRestoreDeletion: the VM this restore locks is unlocked (UpdateDoneRestore), the
        claims made so far stay, then the finalizer goes and the restore with it."""
        finalizers = restore["metadata"].get("finalizers") or []
        if RESTORE_FINALIZER not in finalizers:
            return
        ns, name = restore["metadata"]["namespace"], restore["metadata"]["name"]
        vm = self.store.get(VM, ns, field_value(restore, "spec.target.name") or "")
        if vm is not None and field_value(vm, "status.restoreInProgress") == name:
            vm_status = dict(vm.get("status") or {})
            vm_status.pop("restoreInProgress", None)
            self._write(VM, vm, vm_status)
        new = copy.deepcopy(restore)
        new["metadata"]["finalizers"] = [f for f in finalizers if f != RESTORE_FINALIZER]
        self.store.update(RESTORE, new, check_rv=False)

    def _target_not_ready(self, restore: dict, status: dict, vm: dict, vmi: dict):
        """The target still runs: wait, stop it, or fail, as targetReadinessPolicy says."""
        ns, name = restore["metadata"]["namespace"], restore["metadata"]["name"]
        policy = field_value(restore, "spec.targetReadinessPolicy") or "WaitGracePeriod"
        age = seconds_since(restore["metadata"]["creationTimestamp"])
        failure = None
        if policy == "FailImmediate":
            failure = "Restore target VMI must be powered off before restore operation"
        elif policy == "WaitGracePeriod" and age > 300 / self.c.speed:
            failure = ("Restore target failed to be ready within 5m0s. Please power off the target VM before "
                       "attempting restore")
        if failure:
            set_condition(status, condition("Failure", "True", failure, ""))
            _conds(status, ("False", failure, ""), ("False", failure, ""))
            self._write(RESTORE, restore, status)
            self.c.events.record(restore, "Warning", "VirtualMachineRestoreError", failure, "restore-controller")
            return
        if policy == "StopTarget":
            if run_strategy(vm) != "Halted" and not vmi["metadata"].get("deletionTimestamp"):
                self.c.compute.vm_action(ns, vm["metadata"]["name"], "stop", {})
            message = "Automatically stopping restore target for restore operation"
        elif policy == "WaitEventually":
            message = "Waiting for target VM to be powered off. Please stop the restore target to proceed with restore"
        else:
            message = ("Waiting for target VM to be powered off. Please stop the restore target to proceed with "
                       "restore, or the operation will fail after 5m0s")
        _conds(status, ("False", message, ""), ("False", message, ""))
        self._write(RESTORE, restore, status)
        self.c.events.record(restore, "Normal", "RestoreTargetNotReady", message, "restore-controller")
        self.c.restore_queue.add((ns, name), self.c.t("schedule_retry"))

    def _planned_restores(self, restore: dict, vm: dict, content: dict) -> list[dict]:
        """status.restores: which claim each volume is restored into (restoreVolumeName), and the
        DataVolume that owns an in-place claim (it adopts the new one)."""
        ns = restore["metadata"]["namespace"]
        policy = field_value(restore, "spec.volumeRestorePolicy") or "RandomizeNames"
        out = []
        for b in field_value(content, "spec.volumeBackups") or []:
            original = b["persistentVolumeClaim"]["metadata"]["name"]
            claim = (original if policy == "InPlace"
                     else f"{vm['metadata']['name']}-{b['volumeName']}"[:63] if policy == "PrefixTargetName"
                     else f"restore-{restore['metadata']['uid']}-{b['volumeName']}")
            entry = {"volumeName": b["volumeName"], "persistentVolumeClaim": claim,
                     "volumeSnapshotName": b["volumeSnapshotName"]}
            current = self.store.get(PVC, ns, claim) if policy == "InPlace" else None
            owner = next((r for r in (current or {}).get("metadata", {}).get("ownerReferences") or []
                          if r.get("kind") == "DataVolume" and r.get("controller")), None)
            if owner is not None:
                entry["dataVolumeName"] = owner["name"]
            out.append(entry)
        return out

    async def _restore_volumes(self, restore: dict, vm: dict, content: dict, restores: list[dict]) -> bool:
        """Make each restored claim; True once all are there. In place, the old claim goes first:
        its DataVolume is told the new one is pre-populated, the claim is deleted, and only when it
        is gone is the new one made under the same name."""
        ns = restore["metadata"]["namespace"]
        owned = (field_value(restore, "spec.volumeOwnershipPolicy") or "Vm") == "Vm"
        restore_uid = f"{restore['metadata']['name']}-{restore['metadata']['uid']}"
        backups = {b["volumeName"]: b for b in field_value(content, "spec.volumeBackups") or []}
        ready = True
        for entry in restores:
            backup = backups.get(entry["volumeName"])
            vs = self.store.get(VS, ns, entry["volumeSnapshotName"])
            if backup is None:
                continue
            pvc = self.store.get(PVC, ns, entry["persistentVolumeClaim"])
            if pvc is not None and ((pvc["metadata"].get("annotations") or {}).get(LAST_RESTORE) != restore_uid):
                ready = False
                if pvc["metadata"].get("deletionTimestamp"):
                    continue  # still going
                dv_name = entry.get("dataVolumeName")
                dv = self.store.get(DV, ns, dv_name) if dv_name else None
                if dv is not None:
                    new = copy.deepcopy(dv)
                    new["metadata"].setdefault("annotations", {}).update(
                        {"restore.kubevirt.io/name": restore["metadata"]["name"], PRE_POPULATED: dv_name})
                    self.store.update(DV, new, check_rv=False)
                self.store.delete(PVC, ns, pvc["metadata"]["name"])
                continue
            if pvc is None:
                ready = False
                if vs is None:  # createRestorePVC: found only now, when the claim it replaces is gone
                    raise RestoreError(f"missing volumeSnapshot {entry['volumeSnapshotName']}")
                pvc = self._create_pvc(backup, entry["persistentVolumeClaim"], restore, vm,
                                       owned and not entry.get("dataVolumeName"), entry.get("dataVolumeName"),
                                       field_value(vs, "status.restoreSize"))
                await asyncio.get_running_loop().run_in_executor(None, replace_tree, self.snapshot_dir(vs),
                                                                 self.c.volume_dir(pvc))
                if entry.get("dataVolumeName"):
                    self.c.dv_queue.add((ns, entry["dataVolumeName"]))  # CDI adopts it
        return ready

    def _create_pvc(self, backup: dict, claim: str, restore: dict, vm: dict, owned: bool, data_volume: str | None,
                    restore_size: str | None) -> dict:
        """A claim provisioned from the VolumeSnapshot (CreateRestorePVCDef), bound at once: the
        source's labels and annotations without the provisioning ones, the restore's marks, and the
        larger of the source's size and the snapshot's restoreSize."""
        ns = restore["metadata"]["namespace"]
        source = backup["persistentVolumeClaim"]
        spec = {k: copy.deepcopy(v) for k, v in (source.get("spec") or {}).items()
                if k in ("accessModes", "resources", "storageClassName", "volumeMode")}
        requested = field_value(spec, "resources.requests.storage")
        if restore_size and (not requested or parse_quantity(restore_size) > parse_quantity(requested)):
            spec.setdefault("resources", {}).setdefault("requests", {})["storage"] = restore_size
        spec["dataSource"] = {"apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot",
                              "name": backup["volumeSnapshotName"]}
        spec["dataSourceRef"] = dict(spec["dataSource"])
        annotations = {k: v for k, v in (source["metadata"].get("annotations") or {}).items()
                       if not k.startswith(DROPPED_ANNOTATIONS) or k == "cdi.kubevirt.io/storage.contentType"}
        annotations.update({"restore.kubevirt.io/name": restore["metadata"]["name"],
                            LAST_RESTORE: f"{restore['metadata']['name']}-{restore['metadata']['uid']}"})
        if data_volume:
            annotations[POPULATED_FOR] = data_volume
        meta = {"name": claim, "namespace": ns, "annotations": annotations,
                "labels": {**(source["metadata"].get("labels") or {}),
                           "restore.kubevirt.io/source-vm-name": vm["metadata"]["name"],
                           "restore.kubevirt.io/source-vm-namespace": ns},
                "finalizers": ["kubernetes.io/pvc-protection"]}
        if owned:
            meta["ownerReferences"] = [self.c.owner_ref(vm)]
        claim_obj = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta, "spec": spec,
                     "status": {"phase": "Pending"}}
        admit(self.store, PVC, claim_obj, None)  # the controller's create goes through quota admission
        pvc = self.store.create(PVC, claim_obj)
        new = copy.deepcopy(pvc)
        new["spec"]["volumeName"] = f"pvc-{pvc['metadata']['uid']}"
        pvc = self.store.update(PVC, new, check_rv=False)
        new = copy.deepcopy(pvc)
        new["status"] = {"phase": "Bound", "accessModes": spec.get("accessModes") or ["ReadWriteOnce"],
                         "capacity": {"storage": field_value(spec, "resources.requests.storage")}}
        os.makedirs(self.c.volume_dir(new), exist_ok=True)
        return self.store.update(PVC, new, subresource="status", check_rv=False)

    def _rewrite_vm(self, restore: dict, vm: dict, content: dict, restores: list[dict]) -> dict:
        """The VM gets the snapshot's spec back (its runStrategy stays), its volumes pointing at the
        restored claims; a standalone DataVolume volume becomes a claim volume."""
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
        new["metadata"].setdefault("annotations", {})[LAST_RESTORE] = \
            f"{restore['metadata']['name']}-{restore['metadata']['uid']}"
        return self.store.update(VM, new, check_rv=False)

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
