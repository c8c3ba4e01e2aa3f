"""The hub-wide clone queue: how many golden-image clones may run at once, by how they clone.

CDI clones a PVC one of three ways, chosen from the StorageProfile of the target's StorageClass
(`status.cloneStrategy`; pkg/controller/storageprofile-controller.go): `copy` (host-assisted: a
source and a target pod stream every byte, the load worth throttling), `csi-clone` and `snapshot`
(copy-on-write inside the storage, seconds on Ceph RBD). So copy clones have a limit
(`copy_limit`, 4 by default) and CSI/snapshot clones their own (`csi_limit`, 0 = unlimited).

The counts are kept from DataVolume events, one constant-time update each; a queued start waits
on its own future and is woken only when a slot of its kind frees (or the queue ahead of it moves).
"""

from __future__ import annotations

import asyncio
import collections
from typing import Callable

from .objects import FINAL_PHASES, field_value

COPY, CSI = "copy", "csi"
# The DataVolume phase tells how CDI is cloning once it has started (CDI's populator phase map).
PHASE_KIND = {"CloneInProgress": COPY, "CSICloneInProgress": CSI, "SnapshotForSmartCloneInProgress": CSI,
              "SmartClonePVCInProgress": CSI, "CloneFromSnapshotSourceInProgress": CSI}

Key = tuple[str, str]
Report = Callable[[int, str], None]


def strategy_kind(clone_strategy: str | None) -> str:
    """What a StorageProfile's clone strategy costs: unknown counts as a copy (the safe side)."""
    return CSI if clone_strategy in ("csi-clone", "snapshot") else COPY


def is_clone(dv: dict) -> bool:
    return "pvc" in (field_value(dv, "spec.source") or {})


def _key(dv: dict) -> Key:
    return dv["metadata"]["namespace"], dv["metadata"]["name"]


class _Waiter:
    def __init__(self, key: Key):
        self.key = key
        self.wake = asyncio.Event()
        self.admitted = False


class CloneGate:
    def __init__(self, copy_limit: int = 4, csi_limit: int = 0):
        self.limits = {COPY: copy_limit, CSI: csi_limit}
        self.running: dict[Key, str] = {}  # clones under way in the cluster, and their kind
        self.admitted: dict[Key, str] = {}  # let through, their DataVolume not seen yet
        self.stalled: set[Key] = set()  # clones a start gave up on: they take no place
        self.queues: dict[str, collections.deque[_Waiter]] = {COPY: collections.deque(), CSI: collections.deque()}
        self._counts: collections.Counter = collections.Counter()  # running + admitted, by kind
        self._kind_of_class: Callable[[str], str] = lambda storage_class: COPY
        self._caches = None
        self.operations = 0  # DataVolume events handled and queued starts woken: counted in tests

    # ------------------------------------------------------------ counts, from DataVolume events
    def attach(self, caches):
        """Follow the DataVolumes of these caches (reflector.Caches), and tell a clone's kind before
        it starts from the StorageProfile of its class. Once per set of caches."""
        if self._caches is caches:
            return
        self._caches = caches
        caches.dvs.on_object.append(self.on_datavolume)
        caches.dvs.on_reset.append(self.on_relist)
        self._kind_of_class = lambda storage_class: strategy_kind(caches.clone_strategy(storage_class))
        if caches.dvs.synced:
            self.on_relist(caches.dvs.values())

    def kind_of(self, dv: dict) -> str:
        phase_kind = PHASE_KIND.get(field_value(dv, "status.phase") or "")
        if phase_kind:
            return phase_kind
        storage_class = field_value(dv, "spec.storage.storageClassName") or field_value(
            dv, "spec.pvc.storageClassName") or ""
        return self._kind_of_class(storage_class)

    def _track(self, table: dict[Key, str], key: Key, kind: str | None) -> str | None:
        """Set (or with None, drop) the key's kind in `running` or `admitted`, keeping the counts."""
        before = table.pop(key, None)
        if before is not None:
            self._counts[before] -= 1
        if kind is not None:
            table[key] = kind
            self._counts[kind] += 1
        return before

    def on_datavolume(self, dv: dict | None, key: Key):
        """One DataVolume added, changed (dv) or deleted (None): constant work."""
        self.operations += 1
        cloning = (dv is not None and is_clone(dv) and field_value(dv, "status.phase") not in FINAL_PHASES
                   and key not in self.stalled)
        before = self._track(self.running, key, self.kind_of(dv) if cloning and dv is not None else None)
        if dv is not None:
            before = self._track(self.admitted, key, None) or before  # counted from the cluster from now on
        if before is not None and self.running.get(key) != before:
            self._advance(before)

    def on_relist(self, dvs, namespace: str | None = None):
        """The DataVolume cache (of one namespace; None: all of them) was filled anew (at start, or
        a watch that had to start over)."""
        for key in list(self.running):
            if namespace is None or key[0] == namespace:
                self._track(self.running, key, None)
        for dv in dvs:
            self.on_datavolume(dv, _key(dv))
        for kind in self.queues:
            self._advance(kind)

    def count(self, kind: str) -> int:
        return self._counts[kind]

    def _free(self, kind: str) -> bool:
        limit = self.limits[kind]
        return limit <= 0 or self._counts[kind] < limit

    # ------------------------------------------------------------ the queue
    def _advance(self, kind: str):
        """A slot of this kind may be free: let the head of its queue go, and tell the rest their
        new place. Nothing happens when no one leaves the queue."""
        queue = self.queues[kind]
        moved = False
        while queue and self._free(kind):
            waiter = queue.popleft()
            waiter.admitted = True
            self._track(self.admitted, waiter.key, kind)
            waiter.wake.set()
            moved = True
        if moved:
            for waiter in queue:
                self.operations += 1
                waiter.wake.set()

    async def admit(self, key: Key, storage_class: str, report: Report):
        """Return when this clone may start; until then report the place in the queue."""
        kind = self._kind_of_class(storage_class)
        queue = self.queues[kind]
        self.stalled.discard(key)  # a new clone of that disk (a stuck one was removed)
        if not queue and self._free(kind):
            self._track(self.admitted, key, kind)
            return
        waiter = _Waiter(key)
        queue.append(waiter)
        try:
            while not waiter.admitted:
                ahead = queue.index(waiter)
                running, limit = self._counts[kind], self.limits[kind]
                report(5, f"Queued for disk clone: {ahead + max(0, running - limit + 1)} ahead "
                          f"({running} of {limit} clones running)")
                waiter.wake.clear()
                await waiter.wake.wait()
        except BaseException:
            if waiter.admitted:
                self.release(key)  # let through just as it was cancelled: give the place back
            else:
                queue.remove(waiter)
            raise

    def release(self, key: Key):
        """The start that was let through is over; a clone that never appeared frees its place."""
        kind = self._track(self.admitted, key, None)
        if kind is not None:
            self._advance(kind)

    def give_up(self, key: Key):
        """A start gave up on this stuck clone: it no longer takes a place."""
        self.stalled.add(key)
        kind = self._track(self.running, key, None)
        if kind is not None:
            self._advance(kind)
