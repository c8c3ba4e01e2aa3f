"""KubeVirt's restore controller (pkg/storage/snapshot/restore.go): a VirtualMachineRestore puts
a snapshot back into its VM: claims restored from the VolumeSnapshots, the VM's spec from the
snapshot's content, while the VM is locked (status.restoreInProgress)."""

from __future__ import annotations

import asyncio
import copy
import os

from ..objects import field_value
from ..quantity import parse_quantity
from . import errors
from .admission import admit
from .conditions import condition, get_condition, set_condition
from .instances import PVC, VM, VMI, run_strategy
from .resources import BY_KIND
from .snapshots import CONTENT, SNAP, VS, set_progress, snapshot_dir, write_status
from .storage import DV, POPULATED_FOR, PRE_POPULATED, replace_tree
from .timeutil import now_iso, seconds_since

RESTORE = BY_KIND["VirtualMachineRestore"]
LAST_RESTORE = "restore.kubevirt.io/lastRestoreUID"
RESTORE_FINALIZER = "snapshot.kubevirt.io/vmrestore-protection"  # restore.go vmRestoreFinalizer
# What a restored claim does not copy from its source (CreateRestorePVCDef).
DROPPED_ANNOTATIONS = ("pv.kubernetes.io", "volume.beta.kubernetes.io", "cdi.kubevirt.io", "volume.kubernetes.io",
                       "k8s.io/CloneRequest", "k8s.io/CloneOf")


class RestoreError(Exception):
    """An error restore.go's reconcile returns (and doUpdateError reports, without Failure)."""


class Restores:
    def __init__(self, cluster):
        self.c = cluster
        self.store = cluster.store

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
            set_progress(status, ("False", message, ""), ("False", message, ""))
            write_status(self.store, RESTORE, restore, status)
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
            set_progress(status, ("False", retry, ""), ("False", retry, ""))
            write_status(self.store, RESTORE, restore, status)
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
            set_progress(status, ("False", f"vm restore {holder} in progress", ""), ("False", "Not ready", ""))
            write_status(self.store, RESTORE, restore, status)
            self.c.restore_queue.add(key, self.c.t("schedule_retry"))
            return
        restore = self._add_finalizer(restore)
        if not holder:
            write_status(self.store, VM, vm, {**(vm.get("status") or {}), "restoreInProgress": name})
        if not status.get("restores"):
            status["restores"] = self._planned_restores(restore, vm, content)
        set_progress(status, ("True", "Creating new PVCs", ""), ("False", "Waiting for new PVCs", ""))
        try:
            volumes_ready = await self._restore_volumes(restore, vm, content, status["restores"])
        except (errors.ApiError, RestoreError) as err:
            # doUpdateError: a refused claim (a quota), a missing VolumeSnapshot: no Failure, tried again
            message = err.message if isinstance(err, errors.ApiError) else str(err)
            set_progress(status, ("False", message, ""), ("False", message, ""))
            write_status(self.store, RESTORE, restore, status)
            self.c.events.record(restore, "Warning", "VirtualMachineRestoreError",
                                 f"VirtualMachineRestore encountered error {message}", "restore-controller")
            self.c.restore_queue.add(key, self.c.t("schedule_retry"))
            return
        if not volumes_ready:
            write_status(self.store, RESTORE, restore, status)
            self.c.restore_queue.add(key, self.c.t("schedule_retry"))
            return
        if not self.c.step_due(self.c.restore_queue, key, "restore"):
            write_status(self.store, RESTORE, restore, status)
            return
        vm = self._rewrite_vm(restore, self.store.get(VM, ns, vm["metadata"]["name"]) or vm, content,
                              status["restores"])
        vm_status = dict(vm.get("status") or {})
        vm_status.pop("restoreInProgress", None)
        write_status(self.store, VM, vm, vm_status)
        status.update({"complete": True, "restoreTime": now_iso()})
        set_progress(status, ("False", "Operation complete", ""), ("True", "Operation complete", ""))
        write_status(self.store, RESTORE, restore, status)
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
            write_status(self.store, VM, vm, vm_status)
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
            set_progress(status, ("False", failure, ""), ("False", failure, ""))
            write_status(self.store, RESTORE, restore, status)
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
        set_progress(status, ("False", message, ""), ("False", message, ""))
        write_status(self.store, RESTORE, restore, status)
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
                await asyncio.get_running_loop().run_in_executor(None, replace_tree, snapshot_dir(self.c.state_dir, vs),
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

