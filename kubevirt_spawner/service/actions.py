"""What callers do to a workstation: snapshots, restores and resets (operations that go on in the
background), stops through the hub, and an administrator's purge of a deleted workstation's
kept disks. Each passes its checks, then the one audited path (`Audit.audited`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from .. import kube as k
from .. import manifests as m
from ..operations import STEP_LABELS, Operation, Operations, delete_requested
from ..workstation import Workstation, WorkstationError, refusals_explained
from . import times
from .access import Access, Caller, ServiceError, workstation_path
from .hub import Hub, HubError, HubServer

if TYPE_CHECKING:
    from .activity import Activity
    from .audit import Audit
    from .hubsettings import HubSettings
    from .metrics import ServiceMetrics
    from .settings import WorkstationsSettings


class Actions:
    """The actions, with what they share per workstation (user, server): a lock, the background
    work under way (an operation or a stop), and the snapshots being made."""

    def __init__(self, settings: WorkstationsSettings, hub: Hub, hub_settings: HubSettings, access: Access,
                 audit: Audit, metrics: ServiceMetrics, activity: Activity,
                 log: logging.Logger | logging.LoggerAdapter):
        self.settings = settings
        self.hub = hub
        self.hub_settings = hub_settings
        self.access = access
        self.audit = audit
        self.metrics = metrics
        self.activity = activity
        self.log = log
        self.tasks: dict[tuple[str, str], asyncio.Task] = {}
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._snapshots_in_flight: dict[str, set[tuple[str, str]]] = {}  # user: (namespace, name) being made

    def lock(self, user: str, server: str) -> asyncio.Lock:
        return self._locks.setdefault((user, server), asyncio.Lock())

    def _refuse_during_operation(self, ws: Workstation) -> None:
        op = Operation.from_vm(ws.vm)
        if op is not None and op.state == "running":
            raise ServiceError(409, f"The workstation is {op.describe()}; wait until it is done.")
        task = self.tasks.get((ws.ident.user, ws.ident.server))
        if task is not None and not task.done():
            raise ServiceError(409, "The workstation is busy (stopping); wait until it is done.")

    # ---------------------------------------------------------------- snapshots
    def user_snapshot_count(self, user: str) -> int:
        """The user's snapshots: those the cache has, and those being made that it may not have yet."""
        have = {(s["metadata"]["namespace"], s["metadata"]["name"])
                for s in self.hub_settings.caches.snapshots.values()
                if (s["metadata"].get("annotations") or {}).get(m.ANNOTATION_USERNAME) == user
                and not s["metadata"].get("deletionTimestamp")}
        return len(have | self._snapshots_in_flight.get(user, set()))

    def _check_snapshot_limit(self, user: str, why: str = "") -> None:
        limit = self.settings.snapshot_limit
        if limit and self.user_snapshot_count(user) >= limit:
            raise ServiceError(409, f"{user} has {limit} snapshots, the most allowed; delete one "
                                    f"before taking another{why}.")

    async def snapshots(self, caller: Caller, user: str, server: str) -> list[dict]:
        ws = await self.access.existing(caller, user, server)
        return [{key: s[key] for key in ("name", "note", "created", "consistency", "ready", "phase", "error")}
                for s in ws.snapshots()]

    async def take_snapshot(self, caller: Caller, user: str, server: str, name, note) -> dict:
        ws = await self.access.existing(caller, user, server)
        if note is not None and not isinstance(note, str):
            raise ServiceError(400, '"note" must be a string.')
        note = note or ""
        name = name or f"snapshot-{times.now().strftime('%Y%m%d-%H%M%S')}"
        try:
            m.virtual_machine_snapshot(ws.ident, name, note)
        except ValueError as exc:
            raise ServiceError(400, str(exc)) from None
        key = (ws.ident.namespace, m.snapshot_object_name(ws.ident, name))
        # Counted and reserved in one step (nothing awaited in between: the loop runs nothing else), so
        # concurrent requests cannot all pass a limit that none of their snapshots has reached yet.
        self._check_snapshot_limit(user)
        reserved = self._snapshots_in_flight.setdefault(user, set())
        reserved.add(key)
        try:
            async with self.lock(user, server):
                self._refuse_during_operation(ws)
                return await self.audit.audited(caller, "snapshot", ws, ws.take_snapshot(
                    name, note, self.settings.operation_timeout), detail=name)
        finally:
            reserved.discard(key)  # made (the cache counts it) or not made

    async def delete_snapshot(self, caller: Caller, user: str, server: str, name: str) -> None:
        ws = await self.access.existing(caller, user, server)
        self.access.refuse_server_token(caller, "delete-snapshot")
        async with self.lock(user, server):
            op = Operation.from_vm(ws.vm)
            if op is not None and op.state == "running" and name in (op.snapshot, op.safety):
                raise ServiceError(409, f"The snapshot {name} is in use by the {op.kind} under way.")
            await self.audit.audited(caller, "delete-snapshot", ws, ws.delete_snapshot(name), detail=name)

    # ---------------------------------------------------------------- operations
    def operations(self, ws: Workstation) -> Operations:
        return Operations(ws, HubServer(self.hub, ws.ident.user, ws.ident.server, ws.settings.stop_timeout + 60),
                          safety_snapshot=self.settings.safety_snapshot, timeout=self.settings.operation_timeout)

    async def restore(self, caller: Caller, user: str, server: str, snapshot, confirm) -> dict:
        ws = await self.access.existing(caller, user, server)
        self.access.refuse_server_token(caller, "restore")
        if confirm is not True:
            raise ServiceError(400, 'Confirm the restore with "confirm": true: the workstation is stopped and its '
                                    "disks are put back as they were in the snapshot.")
        if not isinstance(snapshot, str) or not snapshot or len(snapshot) > m.SNAPSHOT_NAME_MAX:
            raise ServiceError(400, f'Name the snapshot to restore ("snapshot", at most {m.SNAPSHOT_NAME_MAX} '
                                    "characters).")
        return await self._begin(caller, ws, "restore", lambda ops: ops.begin_restore(snapshot, caller.name),
                                 detail=snapshot, safety_why=" (a restore takes a safety snapshot first)")

    async def reset(self, caller: Caller, user: str, server: str, confirm) -> dict:
        ws = await self.access.existing(caller, user, server)
        self.access.refuse_server_token(caller, "reset")
        expected = workstation_path(user, server)
        if confirm != expected:
            raise ServiceError(400, f'Type the workstation\'s name to confirm the reset ("confirm": "{expected}"): '
                                    "its system disk is replaced by a fresh copy of the golden image; the workspace "
                                    "disk is kept and a snapshot is taken first.")
        return await self._begin(caller, ws, "reset", lambda ops: ops.begin_reset(caller.name),
                                 safety_why=" (a reset takes a safety snapshot first)")

    async def _begin(self, caller: Caller, ws: Workstation, kind: str,
                     begin: Callable[[Operations], Awaitable[Operation]], detail: str = "",
                     safety_why: str = "") -> dict:
        """Begin the operation, its safety snapshot counted against the user's limit from now on
        (reserved as take_snapshot reserves one, then by its name, until the operation ends)."""
        reserved = self._snapshots_in_flight.setdefault(ws.ident.user, set())
        placeholder = (ws.ident.namespace, f"the safety snapshot of {workstation_path(ws.ident.user, ws.ident.server)}")
        if self.settings.safety_snapshot:
            self._check_snapshot_limit(ws.ident.user, safety_why)
            reserved.add(placeholder)
        try:
            op = await self._begin_locked(caller, ws, kind, begin, detail)
        finally:
            reserved.discard(placeholder)
        if self.settings.safety_snapshot and op.safety_object:
            safety = (ws.ident.namespace, op.safety_object)
            reserved.add(safety)
            self.tasks[(ws.ident.user, ws.ident.server)].add_done_callback(lambda _: reserved.discard(safety))
        return operation_view(op) or {}

    async def _begin_locked(self, caller: Caller, ws: Workstation, kind: str,
                            begin: Callable[[Operations], Awaitable[Operation]], detail: str) -> Operation:
        key = (ws.ident.user, ws.ident.server)
        async with self.lock(*key):
            ops = self.operations(ws)
            running = self.tasks.get(key)
            if running is not None and not running.done():
                op = ops.operation
                raise ServiceError(409, f"The workstation is {op.describe() if op else 'busy (stopping)'}; "
                                        "wait until it is done.")
            try:
                op = await begin(ops)
            except WorkstationError as err:
                self.audit.of(caller, kind, ws, f"refused: {err.jupyterhub_message}", detail)
                raise ServiceError(err.status_code, err.jupyterhub_message or str(err)) from None
            self.audit.of(caller, kind, ws, "started", detail)
            self.tasks[key] = asyncio.ensure_future(self._run(caller.name, ops, op, detail))
            return op

    async def _run(self, by: str, ops: Operations, op: Operation, detail: str = "") -> None:
        """An operation in the background; its record on the VM says how it went."""
        began = asyncio.get_running_loop().time()
        result = "failed"
        try:
            await ops.run(op)
            result = "succeeded"
        except (WorkstationError, k.KubeError, HubError) as err:
            ops.ws.log.warning("%s failed: %s", op.kind, getattr(err, "jupyterhub_message", None) or err)
        except Exception:  # recorded on the VM by run(); the details are for the admin
            ops.ws.log.exception("%s failed", op.kind)
        finally:
            self.metrics.operations.labels(op.kind, result).inc()
            self.metrics.durations.labels(op.kind).observe(asyncio.get_running_loop().time() - began)
            self.audit.line(by, op.kind, workstation_path(ops.ws.ident.user, ops.ws.ident.server), result, detail)

    async def resume_interrupted(self) -> None:
        """At start-up: operations a previous run of the service left under way go on."""
        caches = self.hub_settings.caches
        delay = 5.0
        while True:  # nothing can be decided before the caches have the cluster's state
            try:
                await caches.wait_synced(60)
                break
            except (asyncio.TimeoutError, k.KubeError) as err:
                # (a refused cache fails at once: wait before asking again, the cache retries itself)
                self.log.warning("the caches are not synced yet (%s); operations left under way wait: %s",
                                 caches.unsynced(), err or "timeout")
                await asyncio.sleep(delay)
                delay = min(delay * 2, 300.0)
        for user, server in self.hub_settings.all_workstations():
            ws = await self.hub_settings.workstation(user, server)
            op = Operation.from_vm(ws.vm)
            if op is not None and op.state == "running":
                ws.log.info("going on with the %s %s asked for (%s)", op.kind, op.by, op.describe())
                self.tasks[(user, server)] = asyncio.ensure_future(self._run(op.by, self.operations(ws), op,
                                                                             op.snapshot))
            elif op is not None and delete_requested(ws.vm, op):
                # Ended (done, or failed) before the deletion asked while it ran was carried out.
                ws.log.info("deleting the workstation as asked while its %s ran", op.kind)
                ops = self.operations(ws)
                finish = ops.delete_as_asked(op) if op.state == "done" else ops.retire_if_asked(op)
                self.tasks[(user, server)] = asyncio.ensure_future(finish)

    # ---------------------------------------------------------------- stop
    async def stop(self, caller: Caller, user: str, server: str, wait=True) -> dict:
        """Stop through the hub. `wait=False` answers once the stop is under way: a caller on the
        machine itself (the Lab panel) would otherwise lose its answer with the machine."""
        if not isinstance(wait, bool):
            raise ServiceError(400, '"wait" must be true or false.')
        ws = await self.access.existing(caller, user, server)
        key = (user, server)
        async with self.lock(*key):
            self._refuse_during_operation(ws)
            if not await self.hub.running(user, server) and ws.stopped:
                return {"stopped": True, "changed": False}
            if wait:
                await self.stop_through_hub(caller, ws)
                return {"stopped": True, "changed": True}
            # Marked busy before the lock is let go: a restore or reset asked meanwhile is refused.
            self.tasks[key] = asyncio.ensure_future(self._stop_in_background(caller, ws))
        return {"stopped": False, "stopping": True, "changed": True}

    async def stop_through_hub(self, caller: Caller, ws: Workstation) -> None:
        """The hub stops the server (so its view stays true); call it holding the workstation's lock."""
        user, server = ws.ident.user, ws.ident.server
        await self.audit.audited(caller, "stop", ws, self.hub.stop(user, server, ws.settings.stop_timeout + 60))
        self.activity.forget(user, server)

    async def _stop_in_background(self, caller: Caller, ws: Workstation) -> None:
        try:
            await self.stop_through_hub(caller, ws)
        except ServiceError as err:  # audited
            self.log.warning("stop of %s failed: %s", workstation_path(ws.ident.user, ws.ident.server), err.message)
        except Exception:
            self.audit.of(caller, "stop", ws, "failed (see the traceback)")
            self.log.exception("stop of %s failed", workstation_path(ws.ident.user, ws.ident.server))

    # ---------------------------------------------------------------- purge
    async def purge(self, caller: Caller, user: str, server: str, confirm) -> dict:
        """Delete the retained disks and snapshots of a deleted workstation, once their retention
        has ended and the admin typed the user's name."""
        if not caller.admin:
            raise ServiceError(403, "Only administrators may purge retained disks.")
        if confirm != user:
            raise ServiceError(400, f'Type the user\'s name to confirm the purge ("confirm": "{user}"): their kept '
                                    "disks and snapshots are deleted for good.")
        ws = await self.hub_settings.workstation(user, server)
        if ws.vm is not None:
            raise ServiceError(409, f"{workstation_path(user, server)} still has its workstation; only the disks of a "
                                    "deleted workstation are purged.")
        kept = ws.disks_and_snapshots()
        if not kept:
            raise ServiceError(404, f"{workstation_path(user, server)} has no retained disks.")
        now = times.iso(times.now())
        early = [obj["metadata"]["name"] for _, obj in kept
                 if (obj["metadata"].get("annotations") or {}).get(m.ANNOTATION_RETAIN_UNTIL, "9999") > now]
        if early:
            until = max((obj["metadata"].get("annotations") or {}).get(m.ANNOTATION_RETAIN_UNTIL, "never")
                        for _, obj in kept)
            raise ServiceError(409, f"The disks of {workstation_path(user, server)} are kept until {until}; they can "
                                    "be purged after that.")
        deleted = await self.audit.audited(caller, "purge", ws, self._delete_kept(ws, kept),
                                           done=lambda names: "deleted " + ", ".join(names))
        return {"deleted": deleted}

    @staticmethod
    async def _delete_kept(ws: Workstation, kept: list) -> list[str]:
        # Their volumes go with them, RBD images included (the class keeps volumes, Retain, against
        # mistakes: a purge is no mistake).
        with refusals_explained(ws.log, "have its disks purged"):
            await ws.set_reclaim_policy([obj for kind, obj in kept if kind is k.PVC])
        deleted = []
        for kind, obj in kept:
            if await ws.kube.delete(kind, ws.ident.namespace, obj["metadata"]["name"]):
                deleted.append(f"{kind.kind}/{obj['metadata']['name']}")
        return deleted


def operation_view(op: Operation | None) -> dict | None:
    if op is None:
        return None
    return {"id": op.id, "kind": op.kind, "state": op.state, "step": op.step + 1, "steps": len(op.steps),
            "step_labels": [STEP_LABELS.get(name, name) for name in op.steps],
            "step_name": op.current, "description": op.describe(), "by": op.by, "started": op.started,
            "updated": op.updated, "snapshot": op.snapshot or None, "safety_snapshot": op.safety or None,
            "error": op.error or None}
