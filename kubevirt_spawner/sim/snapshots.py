"""KubeVirt's snapshot controller (pkg/storage/snapshot/snapshot.go): VirtualMachineSnapshot ->
VirtualMachineSnapshotContent + VolumeSnapshots. Restores are restores.py's."""

from __future__ import annotations

import asyncio
import copy
import logging
import os

from ..objects import field_value
from .conditions import condition, set_condition
from .instances import VM, VMI, claim_names
from .machines import QemuGuest
from .qemu import AgentError
from .resources import BY_KIND
from .storage import copy_tree
from .timeutil import now_iso, seconds_since

log = logging.getLogger(__name__)

SNAP = BY_KIND["VirtualMachineSnapshot"]
CONTENT = BY_KIND["VirtualMachineSnapshotContent"]
VS = BY_KIND["VolumeSnapshot"]
PVC = BY_KIND["PersistentVolumeClaim"]
VSCLASS = BY_KIND["VolumeSnapshotClass"]
SC = BY_KIND["StorageClass"]


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


def snapshot_dir(state_dir: str, vs: dict) -> str:
    """Where a VolumeSnapshot's copy of its claim's files is kept."""
    return os.path.join(state_dir, "snapshots", vs["metadata"]["uid"])


def set_progress(status: dict, progressing: tuple, ready: tuple):
    """The Progressing and Ready conditions of a snapshot or restore, each (status, reason, message)."""
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
                set_progress(status, ("False", "Failed", "snapshot deadline exceeded"), ("False", "Failed", "Source does not exist"))
            else:
                status["phase"] = "InProgress"
                set_progress(status, ("False", "SourceDoesNotExist", "Source does not exist"),
                             ("False", "SourceDoesNotExist", "Source does not exist"))
                self.c.snapshot_queue.add(key, self.c.t("schedule_retry"))
            return write_status(self.store, SNAP, snap, status)
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
            set_progress(status, ("True", "Operation in progress", "Source locked and operation in progress"),
                         ("False", "Operation in progress", "Not ready"))
            write_status(self.store, SNAP, snap, status)
            # The source is locked while the snapshot runs (pkg/storage/snapshot/source.go).
            write_status(self.store, VM, vm, {**(vm.get("status") or {}), "snapshotInProgress": name})
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
        set_progress(status, ("False", "Operation complete", "Operation complete"),
                     ("True", "Operation complete", "Operation complete"))
        cstatus = copy.deepcopy(content.get("status") or {})
        cstatus.update({"readyToUse": True, "creationTime": now_iso(),
                        "volumeSnapshotStatus": [{"volumeSnapshotName": b["volumeSnapshotName"], "readyToUse": True,
                                                  "creationTime": now_iso()}
                                                 for b in field_value(content, "spec.volumeBackups") or []]})
        write_status(self.store, CONTENT, content, cstatus)
        for b in field_value(content, "spec.volumeBackups") or []:
            vs = self.store.get(VS, ns, b["volumeSnapshotName"])
            if vs is not None:
                write_status(self.store, VS, vs, {**(vs.get("status") or {}), "readyToUse": True, "creationTime": now_iso()})
        write_status(self.store, SNAP, snap, status)
        # Unlocked after the phase is Succeeded (upstream: on the next reconcile).
        vm = self.store.get(VM, ns, field_value(snap, "spec.source.name") or "")
        if vm is not None and field_value(vm, "status.snapshotInProgress") == name:
            vm_status = dict(vm.get("status") or {})
            vm_status.pop("snapshotInProgress", None)
            write_status(self.store, VM, vm, vm_status)
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
        write_status(self.store, SNAP, current, status)

    def _freeze_status(self, vmi: dict, value: str | None):
        current = self.store.get(VMI, vmi["metadata"]["namespace"], vmi["metadata"]["name"])
        if current is None or current["metadata"]["uid"] != vmi["metadata"]["uid"]:
            return
        status = copy.deepcopy(current.get("status") or {})
        if value:
            status["fsFreezeStatus"] = value
        else:
            status.pop("fsFreezeStatus", None)
        write_status(self.store, VMI, current, status)

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
                                                             snapshot_dir(self.c.state_dir, vs))
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
        path = snapshot_dir(self.c.state_dir, vs)
        if os.path.isdir(path):
            import shutil
            asyncio.get_running_loop().run_in_executor(None, shutil.rmtree, path, True)


def write_status(store, rt, obj: dict, status: dict):
    if status != obj.get("status"):
        new = copy.deepcopy(obj)
        new["status"] = status
        store.update(rt, new, subresource="status", check_rv=False)


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
