"""A workstation's disks beyond a start: grown to its profile, their reclaim policy, the root disk
deleted and cloned again (a reset), and retirement (kept, labelled, until a date)."""

from __future__ import annotations

import asyncio

from .. import kube as k
from .. import manifests as m
from ..objects import field_value
from ..quantity import parse_quantity
from ..reasons import Reason
from .base import (
    SNAPSHOT,
    WAITING_FOR_CONSUMER,
    Report,
    WorkstationBase,
    WorkstationError,
    refusals_explained,
    wait_synced,
)


class Disks(WorkstationBase):
    """Resize, reclaim policy, reset of the root disk and retirement."""

    async def _resize_disks(self, report: Report):
        """A profile's disk sizes are minimums: a smaller disk grows, a larger one stays as it is
        (disks never shrink, and the disk is the user's whatever machine size they pick)."""
        disks = [(self.ident.rootdisk, self.spec.root_disk_size, "system disk"),
                 (self.ident.workspace, self.spec.workspace_disk_size, "workspace disk")]
        disks += [(m.extra_disk_claim(self.ident, d), d.size, f"extra disk {d.name}") for d in self.spec.extra_disks]
        for name, wanted, what in disks:
            pvc = self.caches.pvcs.get(self.ident.namespace, name)
            current = field_value(pvc, "spec.resources.requests.storage")
            if not (wanted and current) or parse_quantity(wanted) == parse_quantity(current):
                continue
            if parse_quantity(wanted) < parse_quantity(current):
                report(4, f"Keeping your {current} {what} (the profile asks for at least {wanted})")
                continue
            await self.kube.patch(k.PVC, self.ident.namespace, name,
                                  {"spec": {"resources": {"requests": {"storage": wanted}}}})
            report(4, f"Growing your {what} from {current} to {wanted}")
            self.log.info("expanding %s from %s to %s", name, current, wanted)

    async def set_reclaim_policy(self, claims: list[dict], policy: str = "Delete"):
        """Set the reclaim policy of the volumes bound to `claims`: Delete before the hub deletes
        them on purpose (a reset, a purge, a restore in place), so that their RBD images go too
        instead of staying Released under the storage class's Retain."""
        for claim in claims:
            volume = field_value(claim, "spec.volumeName")
            if not volume:
                continue  # never bound: no volume holds data
            try:
                await self.kube.patch(k.PV, None, volume, m.reclaim_patch(policy))
            except k.KubeError as err:
                if not err.not_found:
                    raise
            else:
                self.log.info("volume %s of %s: reclaim policy %s", volume, claim["metadata"]["name"], policy)

    async def delete_root_disk(self, timeout: float = 300.0):
        """Delete the system disk (its DataVolume and PVC) of a stopped machine and wait until both are
        gone. Only a system reset does this; the workspace disk is never touched."""
        with refusals_explained(self.log, "delete its system disk"):
            await wait_synced(self.caches, self.log, timeout, self.ident.namespace)
            self._refuse_foreign()
            if self.attached_elsewhere() or self.status() != "stopped":
                raise WorkstationError("Your workstation must be stopped before its system disk is replaced.",
                                       reason=Reason.RUNNING, status_code=409)
            ident = self.ident
            if self.rootdisk_pvc is not None:
                await self.set_reclaim_policy([self.rootdisk_pvc])
            for kind in (k.DV, k.PVC):
                if await self.kube.delete(kind, ident.namespace, ident.rootdisk):
                    self.log.info("deleted %s %s", kind.kind, ident.rootdisk)
            try:
                await self.caches.wait_for(lambda: self.rootdisk is None and self.rootdisk_pvc is None, timeout,
                                           ident.namespace)
            except asyncio.TimeoutError:
                raise WorkstationError(f"The old system disk was not gone within {timeout:.0f} seconds; ask your "
                                       f"administrator to look at PersistentVolumeClaim {ident.namespace}/"
                                       f"{ident.rootdisk}.", reason=Reason.TIMEOUT, status_code=504) from None

    async def clone_root_disk(self, timeout: float = 900.0) -> dict:
        """A new system disk cloned from the golden image of the current settings (a reset), once
        cloned; the machine boots from it at its next start."""
        with refusals_explained(self.log, "get a new system disk"):
            self._refuse_foreign()
            await self._ensure(k.DV, m.root_datavolume(self.ident, self.spec), self.caches.dvs)
            self.log.info("cloning a new system disk from %s", self.spec.golden_image)

            def cloned() -> dict | None:
                current = self.rootdisk
                phase = field_value(current, "status.phase")
                return current if phase == "Succeeded" or phase in WAITING_FOR_CONSUMER else None
            try:
                return await self.caches.wait_for(cloned, timeout, self.ident.namespace)
            except asyncio.TimeoutError:
                raise WorkstationError(f"The new system disk was not cloned within {timeout:.0f} seconds; it may "
                                       "still be. Start your workstation later, or ask your administrator.",
                                       reason=Reason.TIMEOUT, status_code=504) from None

    def disks_and_snapshots(self) -> list[tuple[k.Kind, dict]]:
        """This workstation's DataVolumes, PVCs and snapshots as the caches have them."""
        return [(kind, obj) for kind, cache in ((k.DV, self.caches.dvs), (k.PVC, self.caches.pvcs),
                                                (SNAPSHOT, self.caches.snapshots))
                for obj in cache.values() if obj["metadata"]["namespace"] == self.ident.namespace and self._mine(obj)]

    # ------------------------------------------------------------ retire