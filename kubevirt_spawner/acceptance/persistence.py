"""The acceptance suite's persistence experiments: the first start; what the user changes (files, a
pip package, a system package, a systemd unit) survives a stop and a start, and the stop frees the
node's CPU, memory and GPUs and keeps the disks; a reset keeps the workspace; a deleted named
server keeps its disks."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from . import guest
from .base import GPU_VENDOR_PREFIXES, Skip, SuiteBase, said
from .client import AcceptanceError, NamedServersOff
from .cluster import free_on
from .report import FAIL, PASS


class PersistenceExperiments(SuiteBase):
    """Persistence semantics: what a stop, a start, a reset and a deleted server keep."""

    async def first_start(self):
        if await self.t.server_model(self.user, self.server) is not None:
            raise AcceptanceError(f"{self.name} exists already: the suite uses only workstations it makes.")
        try:
            seconds = await self.t.start(self.user, self.server, self.o.profile, self.o.start_timeout)
        except NamedServersOff:
            if self.user not in self.made.users:
                raise AcceptanceError(f"The hub has no named servers and {self.user} was not made by this run: the "
                                      "suite will not use a user's own workstation; name a new --user.") from None
            self.server = ""  # (the hub has no named servers: the new test user's default server)
            seconds = await self.t.start(self.user, self.server, self.o.profile, self.o.start_timeout)
        finally:
            if (self.user, self.server) not in self.made.servers:
                self.made.servers.append((self.user, self.server))
        self.facts = await self.t.guest_json(self.user, self.server, guest.probe())
        kind = "a process guest of the simulator" if self.facts.get("simulated") else "a virtual machine"
        return PASS, f"{self.name} started ({kind}).", {"seconds": round(seconds, 1)}

    async def persistence(self):
        real = not self.facts.get("simulated")
        package = real and bool(self.facts.get("dpkg") and self.facts.get("sudo"))
        unit = real and bool(self.facts.get("systemd") and self.facts.get("sudo"))
        state: dict = {}
        seconds = 0.0

        async def written_then_stopped():
            await self.t.guest_json(self.user, self.server, guest.write_state(self.nonce, package, unit))
            self.written = {"package": package, "unit": unit}
            return await self.stop_releases()
        stop = await self.experiment("persistence", "stop-releases-compute-keeps-disks", written_then_stopped)
        if not self.written:
            self.skipped("persistence", ["files-kept", "pip-package-kept", "system-package-kept", "systemd-unit-kept"],
                         f"Nothing was written before the stop: {stop.sentence}")
            return

        async def started_and_read():
            nonlocal state, seconds
            seconds = await self.t.start(self.user, self.server, self.o.profile, self.o.start_timeout)
            state = await self.t.guest_json(self.user, self.server, guest.read_state(package, unit))
            return await self.files_kept(state, seconds)
        await self.experiment("persistence", "files-kept", started_and_read)
        await self.experiment("persistence", "pip-package-kept", lambda: self.pip_kept(state))
        await self.experiment("persistence", "system-package-kept", lambda: self.package_kept(state))
        await self.experiment("persistence", "systemd-unit-kept", lambda: self.unit_kept(state))

    async def stop_releases(self):
        """Stopped: no VMI, no launcher pod on the node it ran on (its CPU, memory and GPU free for
        others), every disk still Bound."""
        before: dict = {}
        if self.has_cluster:
            vm, vmi = await self.vm_and_vmi()
            node = (vmi or {}).get("status", {}).get("nodeName")
            uid = (vmi or {}).get("metadata", {}).get("uid")
            if not node or not uid:
                raise AcceptanceError("The workstation had no VirtualMachineInstance on a node before the stop: "
                                      "nothing to see released.")
            before = {"node": node, "uid": uid, "free": await self.free_on(node)}
        seconds = await self.t.stop(self.user, self.server, self.o.start_timeout)
        figures: dict[str, Any] = {"stop seconds": round(seconds, 1)}
        if not self.has_cluster:
            view = await self.t.status(self.user, self.server)
            if view.get("phase") not in ("stopped", "Stopped") and view.get("hub", {}).get("ready"):
                return FAIL, f"The service says {self.name} is {view.get('phase')} after the hub stopped it.", figures
            raise Skip("Stopped, as the hub and the service say; give --kubeconfig to see the node's CPU, memory "
                       "and GPU freed and the disks Bound.")
        node, uid = before["node"], before["uid"]
        vm, vmi = await self.vm_and_vmi()
        if vmi is not None:
            return FAIL, "The VirtualMachineInstance is still there after the stop.", figures
        # the launcher pod goes with a grace period; wait for it as the scheduler would
        deadline = time.monotonic() + self.o.release_wait
        while True:
            left = [p["metadata"]["name"] for p in await self.cluster.pods_on(node)
                    if (p["metadata"].get("labels") or {}).get("kubevirt.io/created-by") == uid]
            if not left or time.monotonic() > deadline:
                break
            await asyncio.sleep(2)
        after = await self.free_on(node)
        freed = {k: after.get(k, 0.0) - before["free"].get(k, 0.0) for k in after
                 if k == "cpu" or k == "memory" or k.startswith(GPU_VENDOR_PREFIXES)}
        figures.update({"node": node, "freed cpu": round(freed.get("cpu", 0.0), 2),
                        "freed memory GiB": round(freed.get("memory", 0.0) / 2**30, 2),
                        "freed GPUs": {k: v for k, v in freed.items() if k.startswith(GPU_VENDOR_PREFIXES)}})
        if left:
            return FAIL, (f"The launcher pod {left[0]} still holds its CPU, memory and GPUs on {node} "
                          f"{self.o.release_wait:.0f} s after the stop."), figures
        claims = await self.cluster.workstation_claims(vm)
        unbound = [c["metadata"]["name"] for c in claims if (c.get("status") or {}).get("phase") != "Bound"]
        figures["disks"] = sorted(c["metadata"]["name"] for c in claims)
        if not claims:
            return FAIL, "The workstation's disks are gone after a stop.", figures
        if unbound:
            return FAIL, f"Disks not Bound after the stop: {', '.join(unbound)}.", figures
        return PASS, (f"Stopped: the VMI and its launcher pod are gone from {node} (their CPU, memory and GPUs free), "
                      f"and its {len(claims)} disk(s) are Bound."), figures

    async def free_on(self, node: str) -> dict[str, float]:
        nodes = {n["metadata"]["name"]: n for n in await self.cluster.nodes()}
        return free_on(nodes[node], await self.cluster.pods_on(node)) if node in nodes else {}

    async def files_kept(self, state: dict, start_seconds: float):
        files = state.get("files") or {}
        lost = [p for p in guest.MARKERS if files.get(p) != self.nonce]
        figures = {"files": len(guest.MARKERS), "start seconds": round(start_seconds, 1)}
        if lost:
            return FAIL, f"After a stop and a start these files are lost or changed: {', '.join(lost)}.", figures
        return PASS, ("Files in /etc, /opt, /usr/local, the home and a Python environment in /opt are there after a "
                      "stop and a start."), figures

    async def pip_kept(self, state: dict):
        if state.get("pip") != self.nonce:
            return FAIL, f"The package pip installed into {guest.VENV} does not import after a stop and a start.", {}
        return PASS, f"The package pip installed into {guest.VENV} still imports after a stop and a start.", {}

    async def package_kept(self, state: dict):
        if not self.written.get("package"):
            raise Skip("The simulator's process guests have no package database of their own." if self.facts.get(
                "simulated") else "The machine has no dpkg-deb or its owner no sudo: no system package was installed.")
        package = state.get("package") or {}
        if package.get("status") != "install ok installed" or package.get("nonce") != self.nonce:
            return FAIL, f"The system package {guest.PACKAGE} is not installed after a stop and a start ({package}).", {}
        return PASS, f"The system package {guest.PACKAGE} (installed with dpkg) is there after a stop and a start.", {}

    async def unit_kept(self, state: dict):
        if not self.written.get("unit"):
            raise Skip("The simulator's process guests run no systemd." if self.facts.get("simulated")
                       else "The machine runs no systemd or its owner has no sudo: no unit was enabled.")
        unit = state.get("unit") or {}
        rebooted = state.get("boot_id") != self.facts.get("boot_id")
        figures = {"rebooted": rebooted, **unit}
        if unit.get("enabled") != "enabled" or unit.get("active") != "active" or (unit.get("ran") or "") != self.nonce:
            return FAIL, f"The systemd unit {guest.UNIT} the user enabled did not start at the next boot.", figures
        if not rebooted:
            return FAIL, "The machine did not boot again at the start (the same boot id): nothing was proven.", figures
        return PASS, f"The systemd unit {guest.UNIT} the user enabled ran again at the next boot.", figures

    async def reset_keeps_workspace(self):
        """A reset rebuilds the system disk from the golden image: the root disk's changes go, the
        workspace disk (/home) keeps its files."""
        view = await self.t.status(self.user, self.server)
        if not (view.get("disks") or {}).get("workspace"):
            raise Skip("The workstation has no workspace disk (c.KubeVirtSpawner.workspace_disk_size is empty): a "
                       "reset replaces everything.")
        await self.t.guest_json(self.user, self.server, guest.write_files(
            {guest.RESET_ROOT_MARKER: self.nonce, guest.RESET_HOME_MARKER: self.nonce}))
        began = time.monotonic()
        status, data = await self.t.service("POST", self.t.workstation_path(self.user, self.server) + "/reset",
                                            {"confirm": self.name})
        if status != 202:
            return FAIL, f"The service refused the reset ({status}): {said(data)}", {}
        op = await self.t.wait_operation(self.user, self.server, data, self.o.start_timeout)
        if op.get("state") != "done":
            return FAIL, f"The reset did not finish: {op.get('error') or op.get('description')}", {}
        if not (await self.t.server_model(self.user, self.server) or {}).get("ready"):
            await self.t.start(self.user, self.server, self.o.profile, self.o.start_timeout)
        seen = await self.t.guest_json(self.user, self.server, guest.read_files(
            [guest.RESET_ROOT_MARKER, guest.RESET_HOME_MARKER, guest.MARKERS[3]]))
        figures = {"reset seconds": round(time.monotonic() - began, 1)}
        if seen[guest.RESET_ROOT_MARKER] is not None:
            return FAIL, f"{guest.RESET_ROOT_MARKER} on the system disk is still there after the reset.", figures
        if seen[guest.RESET_HOME_MARKER] != self.nonce or seen[guest.MARKERS[3]] != self.nonce:
            return FAIL, "Files in the home (the workspace disk) are lost after the reset.", figures
        return PASS, "The reset gave a fresh system disk and kept the home's files on the workspace disk.", figures

    async def deleted_server_keeps_disks(self):
        """A named server deleted in the hub keeps its disks, marked retained with a date."""
        if not self.server:
            raise Skip("The hub has no named servers (c.JupyterHub.allow_named_servers): the test used the default "
                       "server, which the suite does not delete.")
        with contextlib.suppress(AcceptanceError):
            await self.t.stop(self.user, self.server, self.o.start_timeout)
        await self.t.delete_server(self.user, self.server)
        deadline = time.monotonic() + 120
        while True:
            kept = await self.retained(self.user, self.server)
            if kept or time.monotonic() > deadline:
                break
            await asyncio.sleep(2)
        figures = {"retained": [f"{r['kind']}/{r['name']}" for r in kept],
                   "retain until": sorted({r.get("retain_until") or "never" for r in kept})}
        if not kept:
            return FAIL, f"After {self.name} was deleted in the hub, no retained disk of it is listed.", figures
        if any(not r.get("retain_until") for r in kept):
            return FAIL, "A retained disk has no retain-until date.", figures
        if self.has_cluster:
            by_namespace: dict[str, set[str]] = {}
            for r in kept:
                if r["kind"] == "PersistentVolumeClaim":
                    by_namespace.setdefault(r["namespace"], set()).add(r["name"])
            claims = [c for ns, names in by_namespace.items() for c in await self.cluster.claims(ns, names)]
            unbound = [c["metadata"]["name"] for c in claims if (c.get("status") or {}).get("phase") != "Bound"]
            if not claims or unbound:
                return FAIL, f"The deleted workstation's claims are not all there and Bound ({unbound or 'none'}).", \
                    figures
        return PASS, f"{self.name} was deleted in the hub; its disks are kept until {figures['retain until'][-1]}.", figures
