"""A workstation's snapshots and their restore, with the live disks' reclaim policy guarded while a
restore may replace them."""

from __future__ import annotations

import asyncio
import time

from .. import kube as k
from .. import manifests as m
from ..objects import condition, field_value
from ..quantity import parse_quantity
from ..reasons import Reason
from .base import (
    ANNOTATION_SPEC_HASH,
    SNAPSHOT,
    WorkstationError,
    refusals_explained,
    wait_synced,
)
from .lifecycle import Lifecycle


class Snapshots(Lifecycle):
    """Snapshots taken, listed, measured, deleted and restored."""

    # ------------------------------------------------------------ snapshots
    def _own(self, obj: dict) -> bool:
        return self._mine(obj) is not None

    def snapshots(self) -> list[dict]:
        """This workstation's snapshots as its user sees them, oldest first."""
        out = []
        for snap in self.caches.snapshots.values():
            if snap["metadata"].get("namespace") != self.ident.namespace or not self._own(snap) \
                    or snap["metadata"].get("deletionTimestamp"):
                continue  # (a deleted one waits for KubeVirt's vmsnapshot-protection finalizer: gone already)
            meta, status = snap["metadata"], snap.get("status") or {}
            out.append({"name": (meta.get("annotations") or {}).get(m.ANNOTATION_SNAPSHOT_NAME, meta["name"]),
                        "object": meta["name"], "note": (meta.get("annotations") or {}).get(m.ANNOTATION_NOTE, ""),
                        "created": status.get("creationTime") or meta.get("creationTimestamp"),
                        "phase": status.get("phase") or "Pending", "ready": bool(status.get("readyToUse")),
                        "consistency": m.snapshot_consistency(snap),
                        "error": field_value(status, "error.message") or "",
                        "volumes": list(field_value(status, "snapshotVolumes.includedVolumes") or [])})
        return sorted(out, key=lambda s: (s["created"] or "", s["name"]))

    def _snapshot(self, name: str) -> dict | None:
        return next((s for s in self.snapshots() if s["name"] == name), None)

    async def take_snapshot(self, name: str, note: str = "", timeout: float = 300.0, again: bool = False) -> dict:
        """Snapshot every disk of the machine, running or stopped; return it once KubeVirt has
        finished (Succeeded) or say why it failed. `again`: a snapshot of that name that exists
        already is the one asked for (an operation picking up where it was interrupted)."""
        with refusals_explained(self.log, "take a snapshot"):
            await wait_synced(self.caches, self.log, timeout, self.ident.namespace)
            self._refuse_foreign()
            self._need(self.caches.snapshots)
            try:
                obj = m.virtual_machine_snapshot(self.ident, name, note)
            except ValueError as exc:
                raise WorkstationError(str(exc), reason=Reason.BAD_INPUT, status_code=400) from None
            if self.vm is None:
                raise WorkstationError("Your workstation has no machine yet: start it once, then take snapshots.",
                                       reason=Reason.NO_MACHINE, status_code=409)
            if not (again and self._snapshot(name)):
                try:
                    await self.kube.create(SNAPSHOT, obj)
                    self.log.info("snapshot %s requested", name)
                except k.KubeError as err:
                    if not (err.status == 409 and err.reason == "AlreadyExists"):
                        raise
                    if not again:
                        raise WorkstationError(f"A snapshot named {name} exists already; choose another name.",
                                               reason=Reason.SNAPSHOT_EXISTS, status_code=409) from None
                    # an interrupted operation's snapshot: it must be this workstation's, or the
                    # operation would wait for it in vain
                    await self._existing_own(SNAPSHOT, obj, self.caches.snapshots)

            def finished() -> dict | None:
                # Done, and the VM unlocked: KubeVirt refuses a stop or start while a snapshot holds
                # it (status.snapshotInProgress; pkg/storage/admitters/vm-storage-status.go), and
                # lets go a moment after the snapshot succeeded.
                snap = self._snapshot(name)
                locked = field_value(self.vm, "status.snapshotInProgress") == (snap or {}).get("object")
                return snap if snap and snap["phase"] in ("Succeeded", "Failed") and not locked else None
            try:
                done = await self.caches.wait_for(finished, timeout, self.ident.namespace)
            except asyncio.TimeoutError:
                raise WorkstationError(f"The snapshot {name} did not finish within {timeout:.0f} seconds; it may still. "
                                       "Look at your snapshots again in a minute.", reason=Reason.TIMEOUT,
                                       status_code=504) from None
            if done["phase"] == "Failed":
                raise WorkstationError(f"The snapshot {name} failed ({done['error'] or 'no reason given'}).",
                                       reason=Reason.SNAPSHOT_FAILED, status_code=500)
            self.log.info("snapshot %s done (%s)", name, done["consistency"])
            return done

    async def snapshots_size(self) -> float | None:
        """Bytes the snapshots' disks add up to: each VolumeSnapshot's restoreSize, the size of the
        disk it restores (Ceph keeps only the changed blocks). None when they cannot be read."""
        with refusals_explained(self.log, "count its snapshots' size"):
            try:
                listing = await self.kube.list(k.VOLUME_SNAPSHOT, self.ident.namespace,
                                               f"snapshot.kubevirt.io/source-vm-name={self.ident.vm}")
            except k.KubeError as err:
                if err.permission_denied:
                    raise
                self.log.debug("cannot list volume snapshots: %s", err)  # (no CSI snapshot API here)
                return None
        return float(sum(parse_quantity(field_value(vs, "status.restoreSize") or "0")
                         for vs in listing.get("items") or []))

    async def quotas(self) -> list[dict]:
        """The namespace's ResourceQuotas, each one's hard limits beside what is used (their
        status, which Kubernetes' quota controller keeps)."""
        with refusals_explained(self.log, "read its namespace's quotas"):
            listing = await self.kube.list(k.RESOURCE_QUOTA, self.ident.namespace)
        return [{"name": q["metadata"]["name"], "hard": dict(field_value(q, "status.hard") or {}),
                 "used": dict(field_value(q, "status.used") or {})} for q in listing.get("items") or []]

    async def filesystems(self) -> list[dict] | None:
        """The guest agent's filesystem list (mount point, used and total bytes, disk serials) of the
        running machine; None when it is not running or the agent does not answer."""
        if self.status() != "running" or condition(self.vmi, "AgentConnected").get("status") != "True":
            return None  # (virt-api answers 500 without an agent: nothing to ask, nothing to retry)
        with refusals_explained(self.log, "report its disk usage"):
            try:
                # one attempt: a 500 means the agent went meanwhile (a reboot), and the status waits for it
                answer = await self.kube.call("GET", k.VMI_SUBRESOURCES.path(self.ident.namespace, self.ident.vm,
                                                                             "filesystemlist"), repeatable=False)
            except k.KubeError as err:
                if err.permission_denied:
                    raise
                self.log.debug("no filesystem list from the guest agent: %s", err)  # (409: no agent yet)
                return None
        return (answer or {}).get("items") or []

    def snapshot_for_restore(self, name: str) -> dict:
        """The user's snapshot `name`, ready to be restored, or the sentence why not."""
        self._need(self.caches.snapshots)
        snap = self._snapshot(name)
        if snap is None:
            raise WorkstationError(f"There is no snapshot named {name}.", reason=Reason.NO_SNAPSHOT, status_code=404)
        if not snap["ready"]:
            raise WorkstationError(f"The snapshot {name} is not ready yet; try again when it is.",
                                   reason=Reason.SNAPSHOT_NOT_READY, status_code=409)
        # An in-place restore puts back every volume the snapshot holds: shared data among them
        # would go back in time for everyone who uses it (KubeVirt snapshots a claim whose
        # StorageClass has a VolumeSnapshotClass).
        shared = sorted(v for v in set(snap["volumes"]) - set(m.OWN_VOLUMES) if not v.startswith(m.EXTRA_DISK_PREFIX))
        if shared:
            raise WorkstationError(
                f"The snapshot {name} also holds the shared data {', '.join(shared)}, which a restore would put back "
                "as it was for everyone who uses it, so nothing was restored. Ask your administrator: shared data "
                "belongs on a StorageClass without a VolumeSnapshotClass.", reason=Reason.SNAPSHOT_HOLDS_SHARED_DATA,
                status_code=409)
        return snap

    async def restore_snapshot(self, name: str, restore_name: str, timeout: float = 600.0) -> dict:
        """Put the stopped machine's disks back as they were in snapshot `name`, in place and owned
        by nobody, with a VirtualMachineRestore called `restore_name` (made unless it exists: an
        interrupted operation follows the one it made). Returns the finished restore."""
        with refusals_explained(self.log, "be restored"):
            await wait_synced(self.caches, self.log, timeout, self.ident.namespace)
            self._refuse_foreign()
            snap = self.snapshot_for_restore(name)
            if self.status() != "stopped":
                raise WorkstationError("Your workstation must be stopped to be restored; stop it first.",
                                       reason=Reason.RUNNING, status_code=409)
            # In place, KubeVirt deletes the disks it replaces (pkg/storage/snapshot/restore.go):
            # their volumes go with them, so they are marked Delete first. From here every way out
            # (done, failed, timed out, refused, cancelled) gives the claims that are still there
            # Retain back: the `finally`. A crash of the service in between is the operation's to
            # finish: its resumed run comes back here with the same restore.
            replaced = self._claims()
            try:
                # Made once: KubeVirt's webhook refuses a second restore of the VM while one is not
                # complete (pkg/storage/admitters/vmrestore.go), even one of the same name, before
                # the API server could say it exists.
                if not await self._restore_object(restore_name):
                    await self.set_reclaim_policy(replaced)
                    await self.kube.create(k.RESTORE, m.virtual_machine_restore(self.ident, snap["object"],
                                                                                restore_name))
                    self.log.info("restoring snapshot %s (%s)", name, restore_name)
                return await self._wait_restored(name, restore_name, replaced, timeout)
            finally:
                await asyncio.shield(self._keep_surviving(replaced))

    async def _wait_restored(self, name: str, restore_name: str, replaced: list[dict], timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:  # restores are rare and have no cache: one list a second by name
            current = await self._restore_object(restore_name)
            status = (current or {}).get("status") or {}
            if status.get("complete"):
                self.log.info("restored snapshot %s", name)
                await self._restored(restore_name)
                return current or {}
            failure = condition(current or {}, "Failure")
            if current is None:
                why = f"VirtualMachineRestore {self.ident.namespace}/{restore_name} was deleted before it finished"
            elif failure.get("status") == "True":
                why = failure.get("message") or failure.get("reason") or "no reason given"
            elif time.monotonic() > deadline:
                # restore.go's errors (a missing VolumeSnapshot, a quota refusing a claim, a lost
                # claim) only say so in Ready's reason and are tried again without end: no Failure
                ready = condition(current, "Ready")
                why = (f"not finished within {timeout:.0f} seconds: "
                       f"{ready.get('message') or ready.get('reason') or 'no reason given'}")
            else:
                await asyncio.sleep(1.0)
                continue
            raise await self._abandon_restore(name, restore_name, replaced, why, failed=current is None or
                                              failure.get("status") == "True")

    async def _abandon_restore(self, name: str, restore_name: str, replaced: list[dict], why: str,
                               failed: bool) -> WorkstationError:
        """A restore that will not finish by itself. One that replaced no disk yet goes (KubeVirt's
        finalizer unlocks the VM: restore.go handleVMRestoreDeletion): the workstation is as it
        was. One that replaced a disk stays if KubeVirt still tries it (fixing the cause lets it
        finish), and the sentence names it; a failed one goes, and a new restore finishes the job."""
        ns = self.ident.namespace
        if not failed and not await self._replaced_any(replaced):
            await self.kube.delete(k.RESTORE, ns, restore_name)
            if not await self._replaced_any(replaced):  # (KubeVirt may have gone on meanwhile)
                return WorkstationError(f"Restoring the snapshot {name} did not work ({why}). It was cancelled before "
                                        "any disk was replaced: your workstation is as it was. Try again later; if it "
                                        "fails again, ask your administrator.", reason=Reason.RESTORE_FAILED,
                                        status_code=500)
            failed = True
        if failed:
            if await self._restore_object(restore_name):
                await self.kube.delete(k.RESTORE, ns, restore_name)
            if not await self._replaced_any(replaced):
                return WorkstationError(f"Restoring the snapshot {name} failed ({why}); no disk was replaced: your "
                                        "workstation is as it was.", reason=Reason.RESTORE_FAILED, status_code=500)
            return WorkstationError(f"Restoring the snapshot {name} failed ({why}) after some of your disks were "
                                    f"replaced; restore the snapshot {name} again to finish it before you start your "
                                    "workstation.", reason=Reason.RESTORE_FAILED, status_code=500)
        return WorkstationError(
            f"Restoring the snapshot {name} stopped half-way ({why}). Your workstation cannot start until an "
            f"administrator fixes that so that VirtualMachineRestore {ns}/{restore_name} can finish (kubectl -n {ns} "
            f"describe virtualmachinerestore {restore_name}), or deletes it and restores the snapshot again.",
            reason=Reason.RESTORE_STUCK, status_code=500)

    async def _replaced_any(self, claims: list[dict]) -> bool:
        """Whether any of `claims` (as they were before the restore) is gone or going: read from the
        API server, not the cache, since this decides whether a restore may be cancelled."""
        if not claims:
            return False
        # (a list, as the caches read claims: the hub's RBAC grants no get of one)
        found = await self.kube.list(k.PVC, self.ident.namespace)
        now = {c["metadata"]["name"]: c for c in found.get("items") or []}
        for claim in claims:
            meta = claim["metadata"]
            current = now.get(meta["name"])
            if current is None or current["metadata"]["uid"] != meta["uid"] or \
                    current["metadata"].get("deletionTimestamp"):
                return True
        return False

    async def _keep_surviving(self, replaced: list[dict], tries: int = 5):
        """The claims a restore did not replace (after all) keep their volumes against mistakes
        again. The API server may refuse for a while (a burst of errors): tried again, and if it
        still refuses, the sentence says which volumes an admin must set back."""
        uids = {c["metadata"]["uid"] for c in replaced}
        delay = 1.0
        for attempt in range(tries):
            surviving = [c for c in self._claims() if c["metadata"]["uid"] in uids]
            try:
                await self.set_reclaim_policy(surviving, "Retain")
                return
            except k.KubeError as err:
                if err.permission_denied:
                    raise  # no retry mends that: the hub's RBAC, explained as any refusal
                if attempt == tries - 1:
                    volumes = ", ".join(field_value(c, "spec.volumeName") or "?" for c in surviving)
                    self.log.error("could not set the reclaim policy of %s back to Retain: %s", volumes, err.message)
                    raise WorkstationError(
                        f"The volumes of your disks could not be set back to keep their data if their claims are "
                        f"deleted ({err.for_users}); ask your administrator to set persistentVolumeReclaimPolicy "
                        f"to Retain on PersistentVolume {volumes}.", reason=Reason.RECLAIM_POLICY, status_code=500) from err
                await asyncio.sleep(delay)
                delay *= 2

    async def _restored(self, restore_name: str):
        """After a restore: the VM has the snapshot's spec but still the current spec's hash, so
        the hash goes and the next start applies the current profile; the restore object goes too
        (the operation's record and the log keep what happened)."""
        await self.kube.patch(k.VM, self.ident.namespace, self.ident.vm,
                              {"metadata": {"annotations": {ANNOTATION_SPEC_HASH: None}}})
        await self.kube.delete(k.RESTORE, self.ident.namespace, restore_name)

    async def _restore_object(self, name: str) -> dict | None:
        found = await self.kube.list(k.RESTORE, self.ident.namespace, field_selector=f"metadata.name={name}")
        return next(iter(found.get("items") or []), None)

    def _claims(self) -> list[dict]:
        """The machine's disks' claims (system, workspace and extra disks, those it has)."""
        names_ = (self.ident.rootdisk, self.ident.workspace, *self.extra_claims)
        return [c for c in (self.caches.pvcs.get(self.ident.namespace, n) for n in names_) if c is not None]

    async def delete_snapshot(self, name: str):
        with refusals_explained(self.log, "delete a snapshot"):
            await wait_synced(self.caches, self.log, self.settings.stop_timeout, self.ident.namespace)
            self._refuse_foreign()
            self._need(self.caches.snapshots)
            snap = self._snapshot(name)
            if snap is None or not await self.kube.delete(SNAPSHOT, self.ident.namespace, snap["object"]):
                raise WorkstationError(f"There is no snapshot named {name}.", reason=Reason.NO_SNAPSHOT, status_code=404)
            # Until the cache has seen the deletion, counts and listings would still show it.
            try:
                await self.caches.wait_for(lambda: self._snapshot(name) is None, self.settings.stop_timeout,
                                           self.ident.namespace)
            except asyncio.TimeoutError:
                self.log.warning("snapshot %s deleted, but the hub's cache has not seen it yet", name)
            self.log.info("snapshot %s deleted", name)
