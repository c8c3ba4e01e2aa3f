"""What the fault API says happens inside a running guest, and how long its boot and shutdown
take: who is logged in, which processes are busy, how busy its GPUs are, whether its agent
answers. Kept per VMI, written where a Linux guest keeps them, and forgotten with the VMI."""

from __future__ import annotations

import asyncio
import logging

from ..objects import field_value
from .guests import Guest, write_logins, write_nvidia_smi, write_processes
from .instances import VMI
from .machines import QemuGuest

log = logging.getLogger(__name__)


class GuestFacts:
    def __init__(self, cluster, guests: dict[tuple[str, str], Guest | QemuGuest]):
        self.c = cluster
        self.store = cluster.store
        self.guests = guests  # (virt-handler's: the facts are written into the running ones)
        self.agents: dict[tuple[str, str], bool] = {}  # agent connectivity override per VMI
        self.users: dict[tuple[str, str], list[dict]] = {}
        self.gpu_utilization: dict[tuple[str, str], float] = {}
        self.processes: dict[tuple[str, str], list[dict]] = {}  # busy processes inside a guest
        # Per guest (by VM name), in seconds at speed 1: {"agentSeconds": float | None (never),
        # "shutdownSeconds": float}; the `agent` and `shutdown` timings otherwise.
        self.guest_behaviour: dict[tuple[str, str], dict] = {}
        self.store.listeners.append(self._forget)

    def _forget(self, kind: str, rt, obj: dict, old: dict | None):
        """The fault API's facts of a VMI go with it: a reboot ends login sessions and processes,
        and the next VMI of the VM starts with none and an idle GPU."""
        if rt is VMI and kind == "DELETED":
            key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
            self.users.pop(key, None)
            self.processes.pop(key, None)
            self.gpu_utilization.pop(key, None)

    def guest_seconds(self, key: tuple[str, str], what: str) -> float | None:
        """How long the guest takes to start its agent / to shut down, at this speed (None: never)."""
        behaviour = self.guest_behaviour.get(key) or {}
        if f"{what}Seconds" in behaviour:
            seconds = behaviour[f"{what}Seconds"]
            return None if seconds is None else float(seconds) / self.c.speed
        return self.c.t(what)

    def write(self, key: tuple[str, str]):
        """What the fault API says happens inside a running guest, where a Linux guest keeps it:
        login records and tty input times under its root, an nvidia-smi on its PATH."""
        guest = self.guests.get(key)
        vmi = self.store.get(VMI, *key)
        if not isinstance(guest, Guest) or vmi is None:
            return  # (a QEMU guest has its own)
        write_logins(guest.root, self.users.get(key, []))
        # the product name the driver reports for a device plugin's resource (nvidia.com/A100-PCIE-40GB)
        gpus = ["NVIDIA " + g.get("deviceName", "GPU").rsplit("/", 1)[-1]
                for g in field_value(vmi, "spec.domain.devices.gpus") or []]
        write_nvidia_smi(guest.bindir, gpus, self.gpu_utilization.get(key, 0.0))
        self._write_processes(key)

    def _write_processes(self, key: tuple[str, str]):
        guest, vmi = self.guests.get(key), self.store.get(VMI, *key)
        if not isinstance(guest, Guest) or vmi is None:
            return
        cpus = int(float(field_value(vmi, "spec.domain.cpu.cores") or 1)) or 1
        write_processes(guest.root, self.processes.get(key, []), self.users.get(key, []), guest.booted, cpus)

    async def refresh_forever(self):
        """A running process's CPU time grows: the guests with busy processes see it every second."""
        while True:
            await asyncio.sleep(1.0)
            for key in [k for k, procs in self.processes.items() if procs and k in self.guests]:
                try:
                    self._write_processes(key)  # (logins and GPUs change only through the fault API)
                except OSError as exc:  # the machine's disk went away meanwhile
                    log.debug("guest facts of %s/%s: %s", *key, exc)
                except Exception:  # one guest's trouble must not end the refreshes of all of them
                    log.exception("guest facts of %s/%s could not be refreshed", *key)
