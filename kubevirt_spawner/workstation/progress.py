"""Where a start is: `stage()`, a pure function of the workstation's objects as the caches have
them, gives the progress a user sees, what the start waits for and why it cannot go on; `_StartSteps`
keeps what needs memory between two looks (a start that was asked for and then stopped, a clone
that makes no progress)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from .. import manifests as m
from ..objects import FINAL_PHASES, condition, field_value
from ..reasons import Reason
from .base import (
    COPY_ON_WRITE_PHASES,
    WAITING_FOR_CONSUMER,
    Report,
    WorkstationError,
)

if TYPE_CHECKING:
    from .lifecycle import Lifecycle


class Failure(NamedTuple):
    """A start that cannot go on: the user's sentence, its reason and the HTTP status."""
    sentence: str
    reason: Reason
    status: int = 500


@dataclass(frozen=True)
class Stage:
    """Where a start is at one look."""
    said: tuple[tuple[int, str], ...]  # the progress lines reached, in order (percent, message)
    waiting_for: str  # what a start that times out here waited for ("": as before)
    url: str | None = None  # Jupyter's address: the machine is up
    failed: Failure | None = None
    clone: tuple[str, dict, str] | None = None  # (claim, DataVolume, what): a clone that must make progress
    asked_to_run: bool | None = None  # the VM is asked to run (None: the disks are not made yet)
    on_unreachable_node: bool = False  # the VMI is on a node that stopped answering


def stage(spec: m.MachineSpec, vm: dict | None, vmi: dict | None, rootdisk: dict | None,
          extra_disks: list[tuple[m.ExtraDisk, str, dict | None]], *, url: str | None,
          vmi_on_unreachable_node: bool = False, gpu_unavailable: str = "wait") -> Stage:
    """The stage of a start from the root disk's DataVolume, the extra disks' (disk, claim,
    DataVolume), the VM and its VMI: the system disk's clone (CDI's phases and progress), the
    extra disks, the VMI's scheduling (PodScheduled), boot (phase Running), the guest agent
    (AgentConnected) and its address (status.interfaces), as KubeVirt reports them."""
    phase = field_value(rootdisk, "status.phase")
    cloning = f"Cloning your system disk from {spec.golden_name}"
    if rootdisk is not None and phase == "Failed":
        why = condition(rootdisk, "Running").get("message") or "see the cluster events"
        return Stage((), "the system disk clone to finish", failed=Failure(
            f"{cloning} failed ({why}). Ask your administrator to check the golden image and storage.",
            Reason.CLONE_FAILED))
    if rootdisk is not None and phase != "Succeeded":
        claim = rootdisk["metadata"]["name"]
        watch = None if phase in WAITING_FOR_CONSUMER else (claim, rootdisk, cloning)
        if phase in COPY_ON_WRITE_PHASES:  # no progress to report
            return Stage(((20, f"{cloning} (copy-on-write)"),), "the system disk clone to finish", clone=watch)
        try:
            pct = float((field_value(rootdisk, "status.progress") or "").rstrip("%"))
        except ValueError:  # "N/A" before a copy has begun
            return Stage(((5, cloning),), "the system disk clone to finish", clone=watch)
        return Stage(((5 + int(pct * 0.55), f"{cloning}: {pct:.0f}%"),), "the system disk clone to finish",
                     clone=watch)
    for disk, claim, dv in extra_disks:
        phase = field_value(dv, "status.phase")
        if dv is None or phase == "Succeeded" or phase in WAITING_FOR_CONSUMER:
            continue
        what = f"Making your extra disk {disk.name}" + (f" from {disk.clone_from}" if disk.clone_from else "")
        if phase == "Failed":
            why = condition(dv, "Running").get("message") or "see the cluster events"
            return Stage((), f"the extra disk {disk.name}", failed=Failure(
                f"{what} failed ({why}). Ask your administrator to check the profile's extra disks and the "
                "storage.", Reason.CLONE_FAILED))
        return Stage(((60, what),), f"the extra disk {disk.name}", clone=(claim, dv, what))
    asked = vmi is not None or field_value(vm, "spec.runStrategy") not in (None, "Halted")
    if vmi is None or vmi["metadata"].get("deletionTimestamp"):
        return Stage(((62, "Creating your virtual machine"),), "the virtual machine to be created", asked_to_run=asked)
    vmi_phase = field_value(vmi, "status.phase")
    if vmi_phase in FINAL_PHASES:
        return Stage((), "the machine to boot", asked_to_run=asked, failed=Failure(
            "Your workstation shut down while it was booting. Start it again; if it keeps happening, ask your "
            "administrator.", Reason.BOOT_FAILED))
    machine = Stage((), "", asked_to_run=asked, on_unreachable_node=vmi_on_unreachable_node)
    scheduled = condition(vmi, "PodScheduled")
    if not field_value(vmi, "status.nodeName"):
        devices = [d for d, n in spec.gpus if n]
        if scheduled.get("status") == "False":
            message = scheduled.get("message") or ""
            short_of_gpu = [d for d in devices if d in message]
            if not short_of_gpu:
                return _at(machine, (65, f"Waiting for a node: {message}"), "a node with enough free resources")
            gpus = ", ".join(short_of_gpu)
            waiting = _at(machine, (65, f"Waiting for a node with a free {gpus}: all are in use"), f"a free {gpus}")
            if gpu_unavailable != "fail":
                return waiting
            return Stage((), waiting.waiting_for, asked_to_run=asked, failed=Failure(
                f"No {gpus} is free right now ({message}). Try again later or choose a profile without a GPU.",
                Reason.GPU_UNAVAILABLE, 503))
        with_gpu = f" with a free {', '.join(devices)}" if devices else ""
        return _at(machine, (65, "Waiting for a node" + with_gpu), "a node")
    if vmi_phase != "Running":
        return _at(machine, (75, f"Booting on {field_value(vmi, 'status.nodeName')}"), "the machine to boot")
    if condition(vmi, "AgentConnected").get("status") != "True":
        return _at(machine, (82, "Booting"), "the guest agent to connect")
    address = (field_value(vmi, "status.interfaces") or [{}])[0].get("ipAddress")
    if not address or not url:
        return _at(machine, (90, "Guest agent connected"), "a network address")
    return Stage(((90, "Guest agent connected"), (95, "Starting Jupyter")), "", url=url,
                 asked_to_run=asked, on_unreachable_node=vmi_on_unreachable_node)


def _at(machine: Stage, said: tuple[int, str], waiting_for: str) -> Stage:
    return Stage((said,), waiting_for, asked_to_run=machine.asked_to_run,
                 on_unreachable_node=machine.on_unreachable_node)


class _StartSteps:
    """Looks at the caches after each change (`stage`), reports where the start is and returns the
    URL when ready; remembers what one look cannot tell."""

    def __init__(self, ws: Lifecycle, report: Report):
        self.ws, self.report = ws, report
        self.last: tuple[int, str] | None = None
        self.waiting_for = "the workstation to start"
        self.start_seen = False
        self.clone_state: tuple | None = None  # what the clone last showed, and since when
        self.clone_since = time.monotonic()

    def say(self, percent: int, message: str):
        if (percent, message) != self.last:
            self.last = (percent, message)
            self.report(percent, message)

    def check(self) -> str | None:
        ws = self.ws
        vmi = ws.vmi
        extra = [(disk, claim, ws._mine(ws.caches.dvs.get(ws.ident.namespace, claim)))
                 for disk, claim in ((d, m.extra_disk_claim(ws.ident, d)) for d in ws.spec.extra_disks)]
        now = stage(ws.spec, ws.vm, vmi, ws.rootdisk, extra, url=ws.url(),
                    vmi_on_unreachable_node=vmi is not None and ws.caches.on_unreachable_node(vmi),
                    gpu_unavailable=ws.settings.gpu_unavailable)
        if now.asked_to_run:
            self.start_seen = True
        elif now.asked_to_run is False and self.start_seen:  # running was asked for, and now it is not
            raise WorkstationError("Your workstation was stopped while it was starting. Start it again.",
                                   reason=Reason.STOPPED_WHILE_STARTING)
        if now.on_unreachable_node:
            ws._refuse_double_attach()
        if now.waiting_for:
            self.waiting_for = now.waiting_for
        if now.failed is not None:
            raise WorkstationError(now.failed.sentence, reason=now.failed.reason, status_code=now.failed.status)
        for percent, message in now.said:
            self.say(percent, message)
        if now.clone is not None:
            claim, dv, what = now.clone
            self._check_clone_moves(dv, claim, what)
        return now.url

    def _check_clone_moves(self, dv: dict, claim: str, what: str):
        """CDI never fails a clone that cannot proceed: it keeps its phase and says why in Warning
        events and conditions. No change for `clone_stall_timeout` fails the start with CDI's words,
        and frees the system disk clone's place in the queue for others."""
        ws = self.ws
        state = (claim, field_value(dv, "status.phase"), field_value(dv, "status.progress"))
        now = time.monotonic()
        if state != self.clone_state:
            self.clone_state, self.clone_since = state, now
            return
        stalled = now - self.clone_since
        if stalled < ws.settings.clone_stall_timeout:
            return
        if claim == ws.ident.rootdisk:
            ws.settings.clone_gate.give_up((ws.ident.namespace, ws.ident.rootdisk))
        raise WorkstationError(
            f"{what} has made no progress for {stalled:.0f} seconds ({self._clone_trouble(dv, claim)}). Ask your "
            "administrator to check the golden image, the profile's disks and the storage.",
            reason=Reason.CLONE_FAILED, status_code=500)

    def _clone_trouble(self, dv: dict, claim: str) -> str:
        """CDI's own words: the newest Warning about the disk, else a condition that is not True."""
        ws = self.ws
        events = ws.caches.events_for(ws.ident.namespace, {claim})
        if events:
            return f"{events[-1].get('reason')}: {events[-1].get('message')}"
        for ctype in ("Bound", "Running"):
            cond = condition(dv, ctype)
            if cond.get("status") == "False" and cond.get("reason"):
                return f"{cond['reason']}: {cond.get('message') or ''}".rstrip(": ")
        return f"phase {field_value(dv, 'status.phase') or 'Pending'}, no events"

    def timeout_message(self, timeout: float) -> str:
        gpus = self.waiting_for.startswith("a free ")
        hint = "Try again later or choose a smaller profile." if gpus or "node" in self.waiting_for \
            else "Try again; if it keeps failing, ask your administrator."
        return f"Your workstation did not start within {timeout:.0f} seconds while waiting for {self.waiting_for}. {hint}"
