"""Where a start is, read from the caches after each change: the progress a user sees, the
clone's stalls, and the sentence of a start that cannot go on."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

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


class _StartSteps:
    """Reads the caches after each change and reports where the start is; returns the URL when ready."""

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
        ws, spec = self.ws, self.ws.spec
        dv = ws.rootdisk
        phase = field_value(dv, "status.phase")
        if dv is not None and phase == "Failed":
            raise WorkstationError(f"Cloning your system disk from {spec.golden_name} failed "
                                   f"({condition(dv, 'Running').get('message') or 'see the cluster events'}). "
                                   "Ask your administrator to check the golden image and storage.",
                                   reason=Reason.CLONE_FAILED, status_code=500)
        if dv is not None and phase != "Succeeded":
            self.waiting_for = "the system disk clone to finish"
            if phase not in WAITING_FOR_CONSUMER:
                self._check_clone_moves(dv, ws.ident.rootdisk, f"Cloning your system disk from {spec.golden_name}")
            if phase in COPY_ON_WRITE_PHASES:  # no progress to report
                self.say(20, f"Cloning your system disk from {spec.golden_name} (copy-on-write)")
                return None
            try:
                pct = float((field_value(dv, "status.progress") or "").rstrip("%"))
            except ValueError:  # "N/A" before a copy has begun
                self.say(5, f"Cloning your system disk from {spec.golden_name}")
                return None
            self.say(5 + int(pct * 0.55), f"Cloning your system disk from {spec.golden_name}: {pct:.0f}%")
            return None
        if self._making_extra_disk():
            return None
        if ws.vmi is not None or field_value(ws.vm, "spec.runStrategy") not in (None, "Halted"):
            self.start_seen = True
        elif self.start_seen:  # running was asked for, and now it is not: someone stopped it
            raise WorkstationError("Your workstation was stopped while it was starting. Start it again.",
                                   reason=Reason.STOPPED_WHILE_STARTING)
        vmi = ws.vmi
        if vmi is None or vmi["metadata"].get("deletionTimestamp"):
            self.waiting_for = "the virtual machine to be created"
            self.say(62, "Creating your virtual machine")
            return None
        vmi_phase = field_value(vmi, "status.phase")
        if vmi_phase in FINAL_PHASES:
            raise WorkstationError("Your workstation shut down while it was booting. Start it again; if it keeps "
                                   "happening, ask your administrator.", reason=Reason.BOOT_FAILED, status_code=500)
        if ws.caches.on_unreachable_node(vmi):
            ws._refuse_double_attach()
        scheduled = condition(vmi, "PodScheduled")
        if not field_value(vmi, "status.nodeName"):
            if scheduled.get("status") == "False":
                self._unschedulable(scheduled.get("message") or "")
                return None
            self.waiting_for = "a node"
            self.say(65, "Waiting for a node" + self._gpu_phrase())
            return None
        if vmi_phase != "Running":
            self.waiting_for = "the machine to boot"
            self.say(75, f"Booting on {field_value(vmi, 'status.nodeName')}")
            return None
        if condition(vmi, "AgentConnected").get("status") != "True":
            self.waiting_for = "the guest agent to connect"
            self.say(82, "Booting")
            return None
        self.say(90, "Guest agent connected")
        address = (field_value(vmi, "status.interfaces") or [{}])[0].get("ipAddress")
        url = ws.url()
        if not address or not url:
            self.waiting_for = "a network address"
            return None
        self.say(95, "Starting Jupyter")
        return url

    def _making_extra_disk(self) -> bool:
        """Whether an extra disk is still being made (a clone as long as its copy takes); the
        machine cannot boot before. One that fails or makes no progress fails the start."""
        ws = self.ws
        for disk in ws.spec.extra_disks:
            name = m.extra_disk_claim(ws.ident, disk)
            dv = ws._mine(ws.caches.dvs.get(ws.ident.namespace, name))
            phase = field_value(dv, "status.phase")
            if dv is None or phase == "Succeeded" or phase in WAITING_FOR_CONSUMER:
                continue
            what = f"Making your extra disk {disk.name}" + (f" from {disk.clone_from}" if disk.clone_from else "")
            if phase == "Failed":
                why = condition(dv, "Running").get("message") or "see the cluster events"
                raise WorkstationError(f"{what} failed ({why}). Ask your administrator to check the profile's extra "
                                       "disks and the storage.", reason=Reason.CLONE_FAILED, status_code=500)
            self.waiting_for = f"the extra disk {disk.name}"
            self.say(60, what)
            self._check_clone_moves(dv, name, what)
            return True
        return False

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

    def _gpu_phrase(self) -> str:
        devices = [d for d, n in self.ws.spec.gpus if n]
        return f" with a free {', '.join(devices)}" if devices else ""

    def _unschedulable(self, message: str):
        devices = [d for d, n in self.ws.spec.gpus if n]
        short_of_gpu = [d for d in devices if d in message]
        if short_of_gpu:
            text = f"Waiting for a node with a free {', '.join(short_of_gpu)}: all are in use"
            self.waiting_for = f"a free {', '.join(short_of_gpu)}"
            if self.ws.settings.gpu_unavailable == "fail":
                raise WorkstationError(f"No {', '.join(short_of_gpu)} is free right now ({message}). Try again "
                                       "later or choose a profile without a GPU.", reason=Reason.GPU_UNAVAILABLE,
                                       status_code=503)
        else:
            text = f"Waiting for a node: {message}"
            self.waiting_for = "a node with enough free resources"
        self.say(65, text)
        return None

    def timeout_message(self, timeout: float) -> str:
        gpus = self.waiting_for.startswith("a free ")
        hint = "Try again later or choose a smaller profile." if gpus or "node" in self.waiting_for \
            else "Try again; if it keeps failing, ask your administrator."
        return f"Your workstation did not start within {timeout:.0f} seconds while waiting for {self.waiting_for}. {hint}"
