"""Operations on a workstation beyond start and stop: restore a snapshot, reset the system disk.

Each runs in steps (a safety snapshot, stop, the change, start again), and its record (kind, steps,
current step, state, who asked) is kept on the VM as an annotation, so that a restarted service
picks it up where it stopped, the spawner refuses a start while it runs, and anyone reading the
cluster sees what is happening. Stopping and starting go through the hub (`Server`), so the hub's
view of the server stays true. Nothing here deletes anything but the system disk of a reset.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Literal, Protocol

from . import kube as k
from . import manifests as m
from .reasons import Reason
from .workstation import Workstation, WorkstationError

ANNOTATION_OPERATION = m.LABEL_PREFIX + "operation"

STEP_LABELS = {
    "snapshot": "taking a safety snapshot",
    "stop": "stopping the workstation",
    "restore": "restoring the snapshot",
    "delete-disk": "deleting the old system disk",
    "clone-disk": "cloning a new system disk from the golden image",
    "start": "starting the workstation",
}
KIND_LABELS = {"restore": "being restored", "reset": "being reset to the golden image"}

# A failure the cluster would not record at once is written again after this many seconds, then
# twice as long each time, at most a minute apart, until it is.
RECORD_RETRY_SECONDS = 5.0
# The tasks that write those records (kept, so that they are not collected while they wait).
_pending_records: set[asyncio.Task] = set()


class Server(Protocol):
    """The workstation's server as the hub knows it."""

    async def running(self) -> bool: ...
    async def stop(self) -> None: ...
    async def start(self) -> None: ...


OperationKind = Literal["restore", "reset"]
OperationState = Literal["running", "failed", "done"]


@dataclass
class Operation:
    kind: OperationKind
    steps: list[str]
    by: str
    step: int = 0  # index into steps of the step under way
    state: OperationState = "running"
    started: str = field(default_factory=lambda: _now())
    step_began: str = field(default_factory=lambda: _now())  # when the step under way began
    updated: str = ""
    snapshot: str = ""  # restore: the snapshot restored
    safety: str = ""  # the safety snapshot's name
    safety_object: str = ""  # and its object's (manifests.snapshot_object_name), for an administrator
    restore: str = ""  # the VirtualMachineRestore's name
    was_running: bool = False
    error: str = ""
    revision: int = 0  # counts the saves: a reader knows whether it sees the latest
    id: str = field(default_factory=lambda: secrets.token_hex(6))  # this operation, not an earlier one

    @property
    def current(self) -> str:
        return self.steps[min(self.step, len(self.steps) - 1)]

    @property
    def blocks_start(self) -> bool:
        """A start now would race the operation (its own last step starts the machine)."""
        return self.state == "running" and self.current != "start"

    def describe(self) -> str:
        """'being restored (step 3 of 4: restoring the snapshot)'"""
        return (f"{KIND_LABELS.get(self.kind, self.kind)} (step {self.step + 1} of {len(self.steps)}: "
                f"{STEP_LABELS.get(self.current, self.current)})")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_vm(cls, vm: dict | None) -> Operation | None:
        raw = ((vm or {}).get("metadata", {}).get("annotations") or {}).get(ANNOTATION_OPERATION)
        if not raw:
            return None
        try:
            data = json.loads(raw)
            return cls(**{key: data[key] for key in cls.__dataclass_fields__ if key in data})
        except (ValueError, TypeError, KeyError):
            return None  # not ours to read (hand-edited): no operation


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _seconds_since(stamp: str) -> float:
    try:
        then = datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
    except ValueError:
        return 0.0  # (a record from before steps had a start: a whole timeout)
    return (datetime.now(timezone.utc) - then).total_seconds()


def _stamp() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")


def refuse_start_during_operation(ws: Workstation):
    """The spawner's check: no start while an operation changes the machine, nor while a restore
    that did not finish locks it (KubeVirt refuses any change of its run state then:
    pkg/storage/admitters/vm-storage-status.go), with the sentence that says what to do."""
    op = Operation.from_vm(ws.vm)
    if op is not None and op.state == "running" and delete_requested(ws.vm, op):
        raise WorkstationError(f"Your workstation is {op.describe()} and is deleted when that is done (its disks "
                               "are kept); start it again after that.", reason=Reason.OPERATION_RUNNING,
                               status_code=409)
    if op is not None and op.blocks_start:
        after = ("it starts by itself when done" if op.was_running
                 else "start it again when that is done")
        raise WorkstationError(f"Your workstation is {op.describe()}; {after}.", reason=Reason.OPERATION_RUNNING,
                               status_code=409)
    holder = restore_lock(ws.vm)
    if holder:
        if op is not None and op.kind == "restore" and op.restore == holder and op.state == "failed" and op.error:
            raise WorkstationError(op.error, reason=Reason.RESTORE_STUCK, status_code=409)
        raise WorkstationError(
            f"Your workstation is locked by VirtualMachineRestore {ws.ident.namespace}/{holder}, which has not "
            "finished: it cannot start until an administrator lets that restore finish or deletes it.",
            reason=Reason.RESTORE_STUCK, status_code=409)


async def defer_delete_during_operation(ws: Workstation):
    """The spawner's check before it deletes a workstation (delete_forever). JupyterHub forgets the
    server whether or not that succeeds (user.py _delete_spawner only logs a failure), so nothing
    here can make the hub wait. Deleting the VM mid-restore would cut off KubeVirt's restore after
    it deleted the claims it replaces in place and before it made the new ones (restore.go
    reconcileVolumeRestores): the disks would be gone. So a running operation is asked to delete
    the workstation when it ends (the mark on the VM names it; `Operations.run` reads it after its
    last save, so a mark written before that save is seen there, and a later one sees the
    operation ended here); a VM a restore that did not finish still locks is left whole.

    Decided on the VM as the API server has it, not the cache: the cache may not have the record of
    an operation that began a moment ago."""
    ident = ws.ident
    vm = await _live_vm(ws)
    op = Operation.from_vm(vm)
    if op is not None and op.state == "running":
        try:
            vm = await ws.kube.patch(k.VM, ident.namespace, ident.vm,
                                     {"metadata": {"annotations": {m.ANNOTATION_DELETE_REQUESTED: op.id}}})
        except k.KubeError as err:
            raise WorkstationError(f"Your workstation is {op.describe()}, so it was not deleted, and the cluster "
                                   f"would not record the deletion for later ({err.for_users}); an administrator "
                                   "deletes it once that is done.", reason=Reason.OPERATION_RUNNING,
                                   status_code=409) from err
        now = Operation.from_vm(vm)
        if now is not None and now.id == op.id and now.state == "running":
            raise WorkstationError(f"Your workstation is {op.describe()}; it is deleted when that is done, and its "
                                   "disks and snapshots are kept.", reason=Reason.OPERATION_RUNNING, status_code=409)
        # It ended between the read and the mark: it will not read the mark, so the deletion is now.
        await ws.kube.patch(k.VM, ident.namespace, ident.vm,
                            {"metadata": {"annotations": {m.ANNOTATION_DELETE_REQUESTED: None}}})
    holder = restore_lock(vm)
    if holder:
        raise WorkstationError(
            f"Your workstation is locked by VirtualMachineRestore {ident.namespace}/{holder}, which has not finished, "
            "so it was not deleted (its disks may be half restored): an administrator lets that restore finish, or "
            "deletes it and restores the snapshot again, and then deletes the workstation.",
            reason=Reason.RESTORE_STUCK, status_code=409)


async def _live_vm(ws: Workstation) -> dict | None:
    """The workstation's VM from the API server (a list by name: the hub's RBAC lists and watches
    VMs, and may not get one)."""
    found = await ws.kube.list(k.VM, ws.ident.namespace, field_selector=f"metadata.name={ws.ident.vm}")
    return next(iter(found.get("items") or []), None)


def restore_lock(vm: dict | None) -> str:
    """The VirtualMachineRestore that locks the VM (status.restoreInProgress), or ""."""
    return ((vm or {}).get("status") or {}).get("restoreInProgress") or ""


def delete_requested(vm: dict | None, op: Operation) -> bool:
    """Whether the hub was asked to delete this machine while `op` ran (a mark left by an earlier
    operation is not this one's: a start withdraws it)."""
    return ((vm or {}).get("metadata", {}).get("annotations") or {}).get(m.ANNOTATION_DELETE_REQUESTED) == op.id


class Operations:
    """Runs restore and reset for one workstation, one operation at a time."""

    def __init__(self, ws: Workstation, server: Server, safety_snapshot: bool = True, timeout: float = 900.0):
        self.ws, self.server = ws, server
        self.safety_snapshot = safety_snapshot
        self.timeout = timeout

    def _time_left(self, op: Operation) -> float:
        """A step's timeout runs from when the step began, across restarts of the service: one that
        keeps being restarted still gives up on a stuck step. What is left is at least long enough
        for a restarted service to look once (its caches sync first)."""
        return max(self.timeout - _seconds_since(op.step_began), min(self.timeout, 10.0))

    @property
    def operation(self) -> Operation | None:
        return Operation.from_vm(self.ws.vm)

    def check_idle(self):
        op = self.operation
        if op is not None and op.state == "running":
            raise WorkstationError(f"Your workstation is already {op.describe()}; wait until it is done.",
                                   reason=Reason.OPERATION_RUNNING, status_code=409)

    def _require_machine(self):
        if self.ws.vm is None:
            raise WorkstationError("Your workstation has no machine yet: start it once first.", reason=Reason.NO_MACHINE,
                                   status_code=409)

    async def begin_restore(self, snapshot: str, by: str) -> Operation:
        """Check that the restore can happen and record it; `run()` then carries it out."""
        self._require_machine()
        self.check_idle()
        self.ws.snapshot_for_restore(snapshot)  # exists and is ready, or the sentence why not
        steps = (["snapshot"] if self.safety_snapshot else []) + ["stop", "restore", "start"]
        op = Operation("restore", steps, by, snapshot=snapshot, was_running=await self.server.running())
        self._name_safety_snapshot(op)
        await self._save(op)
        return op

    async def begin_reset(self, by: str) -> Operation:
        self._require_machine()
        self.check_idle()
        steps = (["snapshot"] if self.safety_snapshot else []) + ["stop", "delete-disk", "clone-disk", "start"]
        op = Operation("reset", steps, by, was_running=await self.server.running())
        self._name_safety_snapshot(op)
        await self._save(op)
        return op

    def _name_safety_snapshot(self, op: Operation):
        """Named at the start, so that the service counts it against the user's limit at once."""
        if self.safety_snapshot:
            op.safety = f"before-{op.kind}-{_stamp()}"
            op.safety_object = m.snapshot_object_name(self.ws.ident, op.safety)

    async def run(self, op: Operation) -> Operation:
        """Carry out the steps from the one under way (each may be repeated after an interruption);
        the record says how far it got and, on failure, why."""
        try:
            while op.step < len(op.steps):
                step = op.current
                if step == "start":  # the last step: a start must no longer be refused
                    op.state = "done"
                    await self._save(op)
                    if delete_requested(self.ws.vm, op):  # (read after the save: see defer_delete_during_operation)
                        return await self.delete_as_asked(op)
                await getattr(self, "_step_" + step.replace("-", "_"))(op)
                if step == "start":
                    break
                op.step += 1
                op.step_began = _now()
                await self._save(op)
            self.ws.log.info("%s done (asked by %s)", op.kind, op.by)
            return op
        except WorkstationError as err:
            await self._fail(op, err.jupyterhub_message or str(err))
            await self.retire_if_asked(op)
            raise
        except k.KubeError as err:
            await self._fail(op, f"the cluster refused a request ({err.for_users})")
            await self.retire_if_asked(op)
            raise
        except Exception as err:  # the hub refusing a stop or start, or a bug: recorded all the same
            await self._fail(op, str(getattr(err, "message", "") or err) or type(err).__name__)
            await self.retire_if_asked(op)
            raise

    async def delete_as_asked(self, op: Operation) -> Operation:
        """Done: the deletion the hub was asked for while this ran, instead of the start (also what a
        restarted service does for a record left "done" with the mark). Its record goes with the VM;
        one that cannot be deleted keeps a record saying so."""
        try:
            await self._retire_as_asked(op)
        except Exception as err:  # (the change itself is done: what is left is for an administrator)
            why = err.jupyterhub_message if isinstance(err, WorkstationError) else getattr(err, "for_users", None)
            op.state, op.error = "failed", (f"The {op.kind} is done, but the workstation was not deleted as asked while "
                                            f"it ran ({(why or str(err) or type(err).__name__).rstrip('.')}); an "
                                            "administrator deletes it.")
            self.ws.log.error("%s", op.error)
            await self._record_failure(op)
        return op

    async def _retire_as_asked(self, op: Operation):
        """The deletion the hub was asked for while this ran (defer_delete_during_operation)."""
        kept = await self.ws.retire()
        self.ws.log.info("deleted after the %s, as asked while it ran; kept %s", op.kind, ", ".join(kept) or "nothing")

    async def retire_if_asked(self, op: Operation):
        """After a failure: a deletion asked meanwhile happens, unless a restore that did not finish
        still locks the machine (deleting it would cut that restore off). A restore this operation
        cancelled unlocks it a moment later (KubeVirt's finalizer): that is waited for."""
        if not delete_requested(self.ws.vm, op):
            return
        try:
            await self.ws.caches.wait_for(lambda: not restore_lock(self.ws.vm), 10, self.ws.ident.namespace)
        except asyncio.TimeoutError:
            self.ws.log.warning("not deleted as asked while the %s ran: VirtualMachineRestore %s still locks it; an "
                                "administrator lets it finish, or deletes it and restores the snapshot again, and "
                                "then deletes the workstation", op.kind, restore_lock(self.ws.vm))
            return
        try:
            await self._retire_as_asked(op)
        except Exception:  # (the failure is what the caller reports; the deletion is for the admin's log)
            self.ws.log.exception("could not delete the workstation as asked while the %s ran; an administrator "
                                  "deletes it", op.kind)

    async def _fail(self, op: Operation, why: str):
        if op.current == "start":  # the change is made; only the start after it did not happen
            what = "restore" if op.kind == "restore" else "reset"
            why = (f"The {what} is done, but your workstation did not start again afterwards ({why.rstrip('.')}); "
                   "start it yourself.")
        op.state, op.error = "failed", why
        self.ws.log.warning("%s failed at step %d (%s): %s", op.kind, op.step + 1, op.current, why)
        await self._record_failure(op)

    async def _record_failure(self, op: Operation):
        try:
            await self._save(op)
        except asyncio.TimeoutError:
            pass  # written; the caches only lag behind
        except k.KubeError as err:
            # The cluster would not take it now (KubeVirt's VM webhook down, say). A record left
            # saying "running" would refuse every start for good: it is written once it can be.
            self.ws.log.warning("could not record yet that the %s failed (%s): trying again until the cluster "
                                "takes it", op.kind, err)
            task = asyncio.ensure_future(self._record_failure_later(op))
            _pending_records.add(task)
            task.add_done_callback(_pending_records.discard)

    async def _record_failure_later(self, op: Operation):
        delay = RECORD_RETRY_SECONDS
        while True:
            await asyncio.sleep(delay)
            current = Operation.from_vm(self.ws.vm)
            if current is None or current.id != op.id or current.revision >= op.revision:
                return  # the machine is gone, or another record took this one's place
            try:
                await self._save(op)
            except asyncio.TimeoutError:
                pass  # written; the caches only lag behind
            except k.KubeError as err:
                delay = min(delay * 2, 60.0)
                self.ws.log.info("could not record yet that the %s failed (%s): trying again in %.0fs",
                                 op.kind, err, delay)
                continue
            except Exception:  # never silently: the record would say "running" for good
                self.ws.log.exception("could not record that the %s failed", op.kind)
                return
            self.ws.log.info("recorded that the %s failed", op.kind)
            return

    async def _save(self, op: Operation):
        op.updated = _now()
        op.revision += 1
        await self.ws.kube.patch(k.VM, self.ws.ident.namespace, self.ws.ident.vm,
                                 {"metadata": {"annotations": {ANNOTATION_OPERATION: op.to_json()}}})

        def seen() -> bool:  # the caches may lag: later reads of the operation must see this save
            current = Operation.from_vm(self.ws.vm)
            return current is not None and current.id == op.id and current.revision >= op.revision
        await self.ws.caches.wait_for(seen, 30, self.ws.ident.namespace)

    # ---------------------------------------------------------------- steps
    async def _step_snapshot(self, op: Operation):
        if not op.safety:  # (an operation recorded by a version that named it here)
            self._name_safety_snapshot(op)
            await self._save(op)  # the name first, so a restarted run finds the snapshot it took
        what = f"restoring {op.snapshot}" if op.kind == "restore" else "a system reset"
        await self.ws.take_snapshot(op.safety, note=f"taken automatically before {what}",
                                    timeout=self._time_left(op), again=True)

    async def _step_stop(self, op: Operation):
        if await self.server.running():
            await self.server.stop()
        if not self.ws.stopped:  # the hub may not know of a machine that runs (or never stopped)
            await self.ws.stop()

    async def _step_restore(self, op: Operation):
        if not op.restore:
            op.restore = f"{self.ws.ident.slug}-restore-{_stamp()}"
            await self._save(op)
        await self.ws.restore_snapshot(op.snapshot, op.restore, timeout=self._time_left(op))

    async def _step_delete_disk(self, op: Operation):
        await self.ws.delete_root_disk(timeout=self._time_left(op))

    async def _step_clone_disk(self, op: Operation):
        await self.ws.clone_root_disk(timeout=self._time_left(op))

    async def _step_start(self, op: Operation):
        if op.was_running:
            await self.server.start()
