"""The acceptance suite's storage and recovery experiments: the guest's storage benchmark, an online
and an offline snapshot (restored), a disk that grows with a larger profile, concurrent clones, and
(with --destructive) a lost, fenced node and the cold start elsewhere."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from . import guest
from .base import OUT_OF_SERVICE, Skip, SuiteBase, said
from .client import AcceptanceError
from .report import FAIL, PASS, SKIP


class StorageExperiments(SuiteBase):
    """Storage and recovery: the disks' speed, snapshots and restores, growth, clones, a lost node."""

    async def check_node_to_lose(self):
        """--destructive --node: a node that is there, Ready and in the workstation pool, checked
        before anything is made (not after half an hour of experiments)."""
        if not self.has_cluster:
            raise AcceptanceError("--destructive needs --kubeconfig: the suite watches the node go and the disks "
                                  "attach elsewhere.")
        node = next((n for n in await self.cluster.nodes() if n["metadata"]["name"] == self.o.node), None)
        if node is None:
            raise AcceptanceError(f"--node {self.o.node}: the cluster has no such node.")
        if (node["metadata"].get("labels") or {}).get(self.o.pool_label) != "true":
            raise AcceptanceError(f"--node {self.o.node} is not in the workstation pool ({self.o.pool_label}=true): "
                                  "no workstation runs there to lose.")
        if not any(c.get("type") == "Ready" and c.get("status") == "True"
                   for c in (node.get("status") or {}).get("conditions") or []):
            raise AcceptanceError(f"--node {self.o.node} is not Ready now: bring it back before the suite loses it.")

    async def storage(self):
        await self.experiment("storage", "guest-storage-benchmark", self.benchmark)
        await self.experiment("storage", "online-snapshot", self.online_snapshot)
        await self.experiment("storage", "offline-snapshot-restored", self.offline_restore)
        await self.experiment("storage", "disk-grows", self.disk_grows)
        await self.experiment("storage", "concurrent-clones", self.concurrent_clones)
        await self.experiment("storage", "node-loss-fenced-cold-start", self.node_loss)

    async def benchmark(self):
        figures = await self.t.guest_json(self.user, self.server,
                                          guest.storage_benchmark(self.o.bench_mib, self.o.bench_files), timeout=1800)
        git = "" if figures.get("git_checkout_seconds") is not None else " (no git in the image: no checkout figure)"
        if self.facts.get("simulated"):  # (the figures, for what they are; no PASS for a disk that is not one)
            return SKIP, f"A process guest of the simulator measures this machine's disk, not a root disk{git}.", \
                figures
        return PASS, f"Measured on the root disk{git}.", figures

    async def snapshot(self, name: str, token: str | None = None) -> dict:
        path = self.t.workstation_path(self.user, self.server)
        status, data = await self.t.service("POST", path + "/snapshots", {"name": name, "note": "acceptance"},
                                            token=token)
        if status != 201:
            raise AcceptanceError(f"The service did not take the snapshot {name} ({status}): {said(data)}")
        self.made.snapshots.append((self.user, self.server, name))
        deadline = time.monotonic() + self.o.start_timeout
        while True:
            _, listed = await self.t.service("GET", path + "/snapshots")
            snap = next((s for s in (listed or {}).get("snapshots") or [] if s.get("name") == name), None)
            if snap and (snap.get("ready") or snap.get("error")):
                return snap
            if time.monotonic() > deadline:
                raise AcceptanceError(f"The snapshot {name} was not ready within {self.o.start_timeout:.0f} s.")
            await asyncio.sleep(2)

    async def online_snapshot(self):
        began = time.monotonic()
        snap = await self.snapshot(f"acc-online-{self.nonce[:6]}")
        figures = {"seconds": round(time.monotonic() - began, 1), "consistency": snap.get("consistency")}
        if snap.get("error") or not snap.get("ready"):
            return FAIL, f"The online snapshot failed: {snap.get('error')}", figures
        if snap.get("consistency") != "application-consistent":
            return FAIL, (f"The online snapshot is {snap.get('consistency')}: the guest agent did not freeze the "
                          "filesystems."), figures
        return PASS, "The online snapshot is application-consistent (the guest agent froze the filesystems).", figures

    async def offline_restore(self):
        """An offline snapshot, a change after it, the restore: the machine boots as it was, with
        its disks and (on a GPU profile) its GPUs."""
        # (its own file from before the snapshot: --only storage writes nothing else first)
        await self.t.guest_json(self.user, self.server, guest.write_files(
            {guest.MARKERS[1]: self.nonce, guest.RESTORE_HOME_MARKER: self.nonce}))
        had = {k for k, v in ((await self.t.status(self.user, self.server)).get("disks") or {}).items() if v}
        await self.t.stop(self.user, self.server, self.o.start_timeout)
        name = f"acc-offline-{self.nonce[:6]}"
        snap = await self.snapshot(name)
        if not snap.get("ready"):
            return FAIL, f"The offline snapshot failed: {snap.get('error')}", {}
        await self.t.start(self.user, self.server, self.o.profile, self.o.start_timeout)
        await self.t.guest_json(self.user, self.server, guest.write_files({guest.CHANGED_AFTER_SNAPSHOT: self.nonce}))
        await self.t.stop(self.user, self.server, self.o.start_timeout)
        began = time.monotonic()
        status, data = await self.t.service("POST", self.t.workstation_path(self.user, self.server) + "/restore",
                                            {"snapshot": name, "confirm": True})
        if status != 202:
            return FAIL, f"The service refused the restore ({status}): {said(data)}", {}
        op = await self.t.wait_operation(self.user, self.server, data, self.o.start_timeout)
        if op.get("state") != "done":
            return FAIL, f"The restore did not finish: {op.get('error') or op.get('description')}", {}
        if not (await self.t.server_model(self.user, self.server) or {}).get("ready"):
            await self.t.start(self.user, self.server, self.o.profile, self.o.start_timeout)
        figures: dict[str, Any] = {"restore and boot seconds": round(time.monotonic() - began, 1)}
        seen = await self.t.guest_json(self.user, self.server, guest.read_files(
            [guest.CHANGED_AFTER_SNAPSHOT, guest.MARKERS[1], guest.RESTORE_HOME_MARKER]))
        if seen[guest.CHANGED_AFTER_SNAPSHOT] is not None:
            return FAIL, "A file written after the snapshot is still there after its restore.", figures
        lost = [p for p in (guest.MARKERS[1], guest.RESTORE_HOME_MARKER) if seen[p] != self.nonce]
        if lost:
            return FAIL, f"Files from before the snapshot are missing after its restore: {', '.join(lost)}.", figures
        view = await self.t.status(self.user, self.server)
        disks = {k: v for k, v in (view.get("disks") or {}).items() if v}
        figures["disks"] = sorted(disks)
        if had - set(disks):
            return FAIL, f"The restored workstation lacks disks it had: {', '.join(sorted(had - set(disks)))}.", figures
        wanted = [g for g in view.get("gpus") or [] if g]
        if wanted:
            seen_gpus = await self.t.guest_json(self.user, self.server, guest.gpus())
            figures["GPUs"] = seen_gpus
            if seen_gpus is None or len(seen_gpus) < len(wanted):
                return FAIL, f"The restored machine sees {len(seen_gpus or [])} of its {len(wanted)} GPU(s).", figures
        gpus = f" and its {len(wanted)} GPU(s)" if wanted else ""
        return PASS, f"The restored workstation booted as it was at the snapshot, with its disks{gpus}.", figures

    async def disk_grows(self):
        if not self.o.grow_profile:
            raise Skip("Give --grow-profile SLUG (a profile with a larger root disk) to see a disk grow.")
        deadline = time.monotonic() + 300
        while True:  # (the guest agent reports the filesystem a little after a boot)
            before = ((await self.t.status(self.user, self.server)).get("disks") or {}).get("root") or {}
            if (before.get("live") and before.get("total_bytes")) or time.monotonic() > deadline:
                break
            await asyncio.sleep(3)
        if not before.get("total_bytes"):
            raise AcceptanceError("The guest agent reports no root filesystem size to grow from.")
        await self.t.stop(self.user, self.server, self.o.start_timeout)
        await self.t.start(self.user, self.server, self.o.grow_profile, self.o.start_timeout)
        self.o.profile = self.o.grow_profile  # the rest of the suite starts it so
        deadline = time.monotonic() + 300
        while True:
            after = ((await self.t.status(self.user, self.server)).get("disks") or {}).get("root") or {}
            grown = (after.get("total_bytes") or 0) > (before.get("total_bytes") or 0) and after.get("live")
            if grown or time.monotonic() > deadline:
                break
            await asyncio.sleep(3)
        figures = {"claim before": before.get("size"), "claim after": after.get("size"),
                   "filesystem GiB before": _gib(before.get("total_bytes")),
                   "filesystem GiB after": _gib(after.get("total_bytes"))}
        if not grown:
            return FAIL, "The filesystem the guest reports did not grow with the larger profile's disk.", figures
        return PASS, "The root disk grew with the larger profile, and the guest's filesystem with it.", figures

    async def concurrent_clones(self):
        if self.o.clones <= 0:
            raise Skip("--clones 0: no concurrent clones asked for.")
        users = [f"{self.helpers}-clone-{i + 1}" for i in range(self.o.clones)]
        for user in users:
            await self.new_user(user)
            self.made.servers.append((user, ""))

        async def one(user: str) -> float | str:
            try:
                return round(await self.t.start(user, "", self.o.profile, self.o.start_timeout), 1)
            except AcceptanceError as err:
                return str(err)
        times = await asyncio.gather(*(one(u) for u in users))
        figures: dict[str, Any] = dict(zip(users, times, strict=True))
        failed = [f"{u}: {t}" for u, t in figures.items() if isinstance(t, str)]
        done = [t for t in times if not isinstance(t, str)]
        if done:
            figures["slowest seconds"] = max(done)
        misplaced = []
        if self.has_cluster:  # (each test VM on its profile's pool, not only the first)
            for user, took in zip(users, times, strict=True):
                if not isinstance(took, str):
                    problem, where = await self.misplaced(user, "")
                    figures[f"{user} node"] = where["node"]
                    if problem:
                        misplaced.append(problem)
        for user in users:
            with contextlib.suppress(AcceptanceError):
                await self.t.stop(user, "", self.o.start_timeout)
        if failed:
            return FAIL, f"{len(failed)} of {len(users)} clones made at once did not start: {failed[0]}", figures
        if misplaced:
            return FAIL, f"A clone runs outside its profile's pool: {misplaced[0]}", figures
        return PASS, f"{len(users)} workstations cloned and started at once; the slowest took {max(done)} s.", figures

    async def node_loss(self):
        """With --destructive --node: the admin powers the node off and fences it; the workstation
        starts cold on another node, its root disk attached there only."""
        if not self.o.destructive or not self.o.node:
            raise Skip("Give --destructive --node NODE to lose a node and see the cold start elsewhere.")
        if not self.has_cluster:
            raise Skip("Give --kubeconfig to see the node and the volume attachments.")
        node = self.o.node
        _, vmi = await self.vm_and_vmi()
        ran_on = (vmi or {}).get("status", {}).get("nodeName")
        if ran_on != node:  # (the scheduler placed its last start elsewhere: nothing to lose)
            raise Skip(f"The test workstation runs on {ran_on}, not on {node}, so nothing was powered off: cordon "
                       f"the pool's other nodes, or run again with --only storage --destructive --node {ran_on}.")
        await self.t.guest_json(self.user, self.server, guest.write_files({guest.MARKERS[1]: self.nonce}))
        self.prompt(f"Power {node} off now (or cut it off the network), then fence it as deploy/README.md says "
                    f"(kubectl taint node {node} {OUT_OF_SERVICE}=nodeshutdown:NoExecute). Waiting for both ...")
        began = time.monotonic()
        deadline = began + self.o.fence_timeout
        while True:
            found = next((n for n in await self.cluster.nodes() if n["metadata"]["name"] == node), None)
            ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                        for c in (found or {}).get("status", {}).get("conditions") or [])
            fenced = any(t.get("key") == OUT_OF_SERVICE for t in (found or {}).get("spec", {}).get("taints") or [])
            if (not ready and fenced) or time.monotonic() > deadline:
                break
            await asyncio.sleep(3)
        if ready or not fenced:
            raise AcceptanceError(f"{node} was not seen off and fenced within {self.o.fence_timeout:.0f} s.")
        print(f"When this run is done, bring {node} back: power it on, and once it is Ready remove the fence "
              f"(kubectl taint node {node} {OUT_OF_SERVICE}-).", file=self.out, flush=True)
        # the hub learns the machine is gone; then a start comes up elsewhere
        await self.t.stop(self.user, self.server, self.o.start_timeout)
        seconds = await self.t.start(self.user, self.server, self.o.profile, self.o.start_timeout)
        _, vmi = await self.vm_and_vmi()
        now_on = (vmi or {}).get("status", {}).get("nodeName")
        vm, _ = await self.vm_and_vmi()
        volumes = {c["spec"].get("volumeName") for c in await self.cluster.workstation_claims(vm)}
        attached = [(str(a["spec"].get("nodeName")), str((a["spec"].get("source") or {}).get("persistentVolumeName")))
                    for a in await self.cluster.volume_attachments()
                    if (a["spec"].get("source") or {}).get("persistentVolumeName") in volumes
                    and (a.get("status") or {}).get("attached")]
        twice = sorted({pv for n, pv in attached if [x for x in attached if x[1] == pv and x[0] != n]})
        seen = await self.t.guest_json(self.user, self.server, guest.read_files([guest.MARKERS[1]]))
        figures = {"lost node": node, "started on": now_on, "cold start seconds": round(seconds, 1),
                   "attachments": [f"{pv} on {n}" for n, pv in attached]}
        if now_on == node:
            return FAIL, f"The workstation came back on the lost node {node}.", figures
        if twice:
            return FAIL, f"A disk is attached to two nodes at once: {', '.join(twice)}.", figures
        if seen[guest.MARKERS[1]] != self.nonce:
            return FAIL, "The workstation's files are not there after the cold start.", figures
        return PASS, f"After {node} was lost and fenced, the workstation started on {now_on} with its disks attached " \
                     "there only.", figures

def _gib(n: Any) -> float | None:
    return round(n / 2**30, 2) if isinstance(n, (int, float)) else None
