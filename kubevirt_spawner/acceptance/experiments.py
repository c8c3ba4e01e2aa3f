"""The design document's production acceptance experiments (its section 13), run against a hub.

One `Suite` walks a test user's workstation through the promises in order: placed on its pool;
what the user changes survives a stop and a start; a stop frees CPU, memory and GPU and keeps the
disks; other users cannot reach it; snapshots and restores work; a reset keeps the workspace; an
idle machine is warned, then stopped; a deleted named server keeps its disks. Each experiment ends
as one Record: PASS, FAIL or SKIP with one sentence and its figures. What the suite made goes at
the end (its workstations stopped and deleted; their kept disks purged where the retention allows,
else listed)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, TextIO
from urllib.parse import quote

import aiohttp

from ..ssh import ClientError
from . import guest
from .client import AcceptanceError, GuestError, NamedServersOff, Target, workstation_name
from .cluster import Cluster, free_on
from .report import FAIL, PASS, SKIP, Record

SERVER = "acceptance"  # the test workstation's named server (the default server when named ones are off)
DEFAULT_USER = "kvs-acceptance"  # with this run's tag: a deleted test user's kept disks never meet a new one
# What the hub token must allow: make and delete the test users and their servers, make their
# tokens, and reach their workstations (kernels) and the workstations service as them.
NEEDED_SCOPES = ("admin:users", "admin:servers", "tokens", "access:servers", "access:services")
# Every experiment, by section, in the order of the report (what a run that stops early lists as SKIP).
EXPERIMENTS = {
    "host": ("node-pools", "check-node", "no-container-gpus-on-vfio-nodes", "placement"),
    "persistence": ("first-start", "stop-releases-compute-keeps-disks", "files-kept", "pip-package-kept",
                    "system-package-kept", "systemd-unit-kept", "reset-keeps-workspace",
                    "deleted-server-keeps-disks"),
    "security": ("other-users-are-refused", "vmi-address-refuses-without-token", "no-cluster-credentials-in-guest",
                 "usage-and-snapshots-visible-to-user", "idle-warning-then-stop"),
    "storage": ("guest-storage-benchmark", "online-snapshot", "offline-snapshot-restored", "disk-grows",
                "concurrent-clones", "node-loss-fenced-cold-start"),
}
GPU_VENDOR_PREFIXES = ("nvidia.com/", "amd.com/", "gpu.intel.com/")
OUT_OF_SERVICE = "node.kubernetes.io/out-of-service"


class Skip(Exception):
    """The experiment cannot run here: its SKIP, with the reason."""


@dataclass
class Options:
    user: str | None = None  # (None: DEFAULT_USER with this run's tag, made and deleted by the run)
    profile: str | None = None
    only: tuple[str, ...] = ()
    clones: int = 2
    grow_profile: str | None = None
    idle_wait: float = 900.0  # the longest idle timeout the suite waits out
    start_timeout: float = 1800.0
    destructive: bool = False
    node: str | None = None
    pool_label: str = "workload.example.com/kubevirt"
    accelerator_label: str = "accelerator.example.com/mode"
    bench_mib: int = 256
    bench_files: int = 5000
    fence_timeout: float = 1800.0
    release_wait: float = 120.0  # how long a stopped machine's launcher pod may take to go


@dataclass
class Made:
    """What the suite made, to remove at the end."""
    users: list[str] = field(default_factory=list)
    servers: list[tuple[str, str]] = field(default_factory=list)
    snapshots: list[tuple[str, str, str]] = field(default_factory=list)
    tokens: dict[str, tuple[str, str]] = field(default_factory=dict)  # user: (token, its id)


class Suite:
    def __init__(self, target: Target, cluster: Cluster | None, options: Options, out: TextIO = sys.stdout,
                 prompt: Callable[[str], None] | None = None):
        self.t, self.o, self.out = target, options, out
        self._cluster = cluster
        self.prompt = prompt or (lambda text: print(text, file=sys.stderr, flush=True))
        self.records: list[Record] = []
        self.made = Made()
        self.nonce = secrets.token_hex(8)
        self.tag = self.nonce[:6]
        self.user = options.user or f"{DEFAULT_USER}-{self.tag}"
        # a user named with --user may have servers of their own: the test one is new
        self.server = SERVER if not options.user else f"{SERVER}-{self.tag}"
        self.helpers = self.user  # the prefix of the other users the run makes (the other user, the clones)
        self.facts: dict[str, Any] = {}
        self.written: dict[str, bool] = {}

    @property
    def has_cluster(self) -> bool:
        return self._cluster is not None

    @property
    def cluster(self) -> Cluster:
        """The cluster's reads; only where has_cluster was checked (an experiment without one is SKIP)."""
        if self._cluster is None:
            raise Skip("Give --kubeconfig (read access to the cluster) for this experiment.")
        return self._cluster

    @property
    def name(self) -> str:
        return workstation_name(self.user, self.server)

    async def token_of(self, user: str) -> str:
        """A token of `user` for the suite's requests as that user: made once, revoked at the end."""
        if user not in self.made.tokens:
            self.made.tokens[user] = await self.t.token_for(user, "kubevirt-spawner acceptance", 3600)
        return self.made.tokens[user][0]

    def wants(self, section: str) -> bool:
        return not self.o.only or section in self.o.only

    # ------------------------------------------------------------ running experiments
    async def experiment(self, section: str, name: str, work) -> Record:
        """Run one experiment: `work()` returns (result, sentence, figures) or raises Skip or
        AcceptanceError (a FAIL with its sentence)."""
        began = time.monotonic()
        try:
            result, sentence, figures = await work()
        except Skip as why:
            result, sentence, figures = SKIP, str(why), {}
        except GuestError as err:
            result, sentence, figures = FAIL, f"Code in the workstation failed: {err}", {}
        except AcceptanceError as err:
            result, sentence, figures = FAIL, str(err), {}
        except (ClientError, aiohttp.ClientError, asyncio.TimeoutError, OSError) as err:
            result, sentence, figures = FAIL, f"The hub or the workstation did not answer ({type(err).__name__}: " \
                                              f"{str(err)[:200]}).", {}
        except Exception as err:  # (the cluster client's own errors, an answer of an unexpected shape)
            result, sentence, figures = FAIL, f"The experiment could not finish: {type(err).__name__}: " \
                                              f"{str(err)[:200]}.", {}
        record = Record(section, name, result, sentence, figures, round(time.monotonic() - began, 1))
        self.records.append(record)
        print(record.line(), file=self.out, flush=True)
        return record

    def skipped(self, section: str, names: list[str], why: str):
        for name in names:
            record = Record(section, name, SKIP, why)
            self.records.append(record)
            print(record.line(), file=self.out, flush=True)

    async def run(self) -> list[Record]:
        me = await self.t.hub.whoami()
        lacking = [s for s in NEEDED_SCOPES if s not in (me.get("scopes") or [])]
        if lacking and not me.get("admin"):
            raise AcceptanceError("The suite makes its own test users and workstations and acts as them: give a hub "
                                  f"admin's token (it lacks {', '.join(lacking)}).")
        if self.o.destructive and self.wants("storage"):
            await self.check_node_to_lose()
        if self.wants("host"):
            await self.host_checks()
        sections = [s for s in ("persistence", "storage", "security") if self.wants(s)]
        if not sections and not self.wants("host"):
            return self.records
        if await self.t.ensure_user(self.user):
            self.made.users.append(self.user)
        else:  # (a user of the hub's: the users the run adds are named apart from any of theirs)
            self.helpers = f"{self.user}-{self.tag}"
        try:
            start = await self.experiment("persistence", "first-start", self.first_start)
            if start.result != PASS:  # (nothing else can be shown without it)
                done = {(r.section, r.name) for r in self.records}
                for section in [s for s in EXPERIMENTS if self.wants(s)]:
                    self.skipped(section, [n for n in EXPERIMENTS[section] if (section, n) not in done],
                                 f"The first start failed: {start.sentence}")
                return self.records
            if self.wants("host"):
                await self.experiment("host", "placement", self.placement)
            if self.wants("persistence"):
                await self.persistence()
            if self.wants("security"):
                await self.security()
            if self.wants("storage"):
                await self.storage()
            if self.wants("persistence"):
                await self.experiment("persistence", "reset-keeps-workspace", self.reset_keeps_workspace)
            if self.wants("security"):
                await self.experiment("security", "idle-warning-then-stop", self.idle_warning_then_stop)
            if self.wants("persistence"):
                await self.experiment("persistence", "deleted-server-keeps-disks", self.deleted_server_keeps_disks)
        finally:
            await self.clean_up()
        return self.records

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

    # ------------------------------------------------------------ host and scheduling
    async def host_checks(self):
        names = ["node-pools", "check-node", "no-container-gpus-on-vfio-nodes"]
        if not self.has_cluster:
            self.skipped("host", names, "Give --kubeconfig (read access to nodes and pods) to check the hosts.")
            return
        await self.experiment("host", "node-pools", self.node_pools)
        await self.experiment("host", "check-node", self.check_node)
        await self.experiment("host", "no-container-gpus-on-vfio-nodes", self.no_container_gpus)

    async def node_pools(self):
        """deploy/host/label-nodes.sh: a node of the workstation pool carries the pool label and its
        NoSchedule taint (container pods stay off); a VFIO node is in the pool too."""
        nodes = await self.cluster.nodes()
        label, accel = self.o.pool_label, self.o.accelerator_label
        pool = [n for n in nodes if (n["metadata"].get("labels") or {}).get(label) == "true"]
        kubevirt = [n for n in nodes if (n["metadata"].get("labels") or {}).get("kubevirt.io/schedulable") == "true"]
        vfio = [n for n in nodes if (n["metadata"].get("labels") or {}).get(accel) == "vfio"]
        wrong = []
        for n in {n["metadata"]["name"]: n for n in pool + kubevirt + vfio}.values():
            name, labels = n["metadata"]["name"], n["metadata"].get("labels") or {}
            tainted = any(t.get("key") == label and t.get("value") == "true" and t.get("effect") == "NoSchedule"
                          for t in (n.get("spec") or {}).get("taints") or [])
            if labels.get(label) != "true":
                wrong.append(f"{name} runs KubeVirt's virt-handler (kubevirt.io/schedulable) but is in no workstation "
                             f"pool ({label}=true): put it in one, or keep virt-handler off it (the KubeVirt CR's "
                             "nodePlacement)")
            elif not tainted:
                wrong.append(f"{name} lacks the taint {label}=true:NoSchedule, so container pods may land there")
        figures = {"pool nodes": sorted(n["metadata"]["name"] for n in pool),
                   "VFIO nodes": sorted(n["metadata"]["name"] for n in vfio),
                   "KubeVirt nodes": sorted(n["metadata"]["name"] for n in kubevirt)}
        if not pool:
            return FAIL, f"No node carries {label}=true: label the workstation nodes with deploy/host/label-nodes.sh.", figures
        if wrong:
            return FAIL, "; ".join(wrong) + ".", figures
        return PASS, f"{len(pool)} node(s) are in the workstation pools, labelled and tainted.", figures

    async def check_node(self):
        """deploy/host/check-node-daemonset.yaml: its pod on a node is Ready when the node passed
        (virtualisation, KVM, vhost, TUN, IOMMU, VFIO for its pool); its log has the table."""
        sets = await self.cluster.daemonsets("app.kubernetes.io/name=check-node")
        if not sets:
            raise Skip("The check-node DaemonSet is not deployed (deploy/host/check-node-daemonset.yaml); deploy "
                       "it to see each node's virtualisation, KVM, vhost, TUN, IOMMU and VFIO.")
        pods = await self.cluster.pods("app.kubernetes.io/name=check-node")
        results, failing = {}, []
        for pod in pods:
            node = (pod.get("spec") or {}).get("nodeName") or "?"
            ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                        for c in (pod.get("status") or {}).get("conditions") or [])
            results[node] = "passed" if ready else "failed"
            if not ready:
                with contextlib.suppress(Exception):
                    log = await self.cluster.pod_log(pod["metadata"]["namespace"], pod["metadata"]["name"], 5)
                    results[node] = "failed: " + " / ".join(line.strip() for line in log.splitlines() if line.strip())
                failing.append(node)
        if not pods:
            return FAIL, "The check-node DaemonSet runs no pod: no node is in its pools.", {}
        if failing:
            return FAIL, f"{len(failing)} node(s) failed their host checks: {', '.join(sorted(failing))} (kubectl logs " \
                         "shows the fixes).", results
        return PASS, f"All {len(pods)} node(s) passed their host checks.", results

    async def no_container_gpus(self):
        """A VFIO node's GPUs are KubeVirt's: no container asks for a GPU there, and no device
        plugin offers container GPUs (nvidia.com/gpu) on it."""
        nodes = [n for n in await self.cluster.nodes()
                 if (n["metadata"].get("labels") or {}).get(self.o.accelerator_label) == "vfio"]
        if not nodes:
            raise Skip(f"No node is in VFIO mode ({self.o.accelerator_label}=vfio): no GPU node pool to check.")
        wrong, figures = [], {}
        for node in nodes:
            name = node["metadata"]["name"]
            offered = {k: v for k, v in ((node.get("status") or {}).get("allocatable") or {}).items()
                       if k.startswith(GPU_VENDOR_PREFIXES)}
            figures[name] = offered
            if str(offered.get("nvidia.com/gpu", "0")) not in ("0", ""):
                wrong.append(f"{name} offers nvidia.com/gpu to containers (a container device plugin runs there)")
            for pod in await self.cluster.pods_on(name):
                if (pod["metadata"].get("labels") or {}).get("kubevirt.io") == "virt-launcher":
                    continue
                asked = [k for c in (pod.get("spec") or {}).get("containers") or []
                         for k in ((c.get("resources") or {}).get("limits") or {}) if k.startswith(GPU_VENDOR_PREFIXES)]
                if asked:
                    wrong.append(f"pod {pod['metadata']['namespace']}/{pod['metadata']['name']} holds {asked[0]} on {name}")
        if wrong:
            return FAIL, "; ".join(wrong) + ".", figures
        return PASS, f"No container holds a GPU on the {len(nodes)} VFIO node(s).", figures

    async def placement(self):
        """The test workstation's VMI runs on a node its VM selects, in the workstation pool."""
        if not self.has_cluster:
            raise Skip("Give --kubeconfig to see where the workstation runs.")
        problem, figures = await self.misplaced(self.user, self.server)
        figures["profile"] = self.o.profile or "default"
        if problem:
            return FAIL, problem, figures
        return PASS, f"The workstation runs on {figures['node']}, a node of its profile's pool.", figures

    async def misplaced(self, user: str, server: str) -> tuple[str | None, dict]:
        """Why the running workstation's VMI is on the wrong node (None: it is not), and where it is."""
        vm, vmi = await self.vm_and_vmi(user, server)
        name = workstation_name(user, server)
        if vmi is None:
            raise AcceptanceError(f"The VirtualMachineInstance of {name} is not there though the hub says it runs.")
        node_name = (vmi.get("status") or {}).get("nodeName")
        node = next((n for n in await self.cluster.nodes() if n["metadata"]["name"] == node_name), None)
        labels = (node or {}).get("metadata", {}).get("labels") or {}
        selector = ((vm.get("spec") or {}).get("template") or {}).get("spec", {}).get("nodeSelector") or {}
        figures: dict[str, Any] = {"node": node_name, "nodeSelector": selector}
        if node is None:
            return f"{name} runs on {node_name}, which is not a node of the cluster.", figures
        unmet = {k: v for k, v in selector.items() if labels.get(k) != v}
        if unmet:
            return f"{node_name} does not carry the labels the VM of {name} selects: {unmet}.", figures
        if labels.get(self.o.pool_label) != "true":
            return (f"{name} runs on {node_name}, outside the workstation pools ({self.o.pool_label} is not true "
                    "there): its profile selects no pool."), figures
        devices = ((vm.get("spec") or {}).get("template") or {}).get("spec", {}).get("domain", {}).get("devices") or {}
        wants_gpus = bool(devices.get("gpus") or devices.get("hostDevices"))
        on_gpu_node = labels.get(self.o.accelerator_label) == "vfio"
        figures["pool"] = "GPU passthrough" if on_gpu_node else "CPU"
        if wants_gpus and not on_gpu_node:
            return f"The GPU workstation {name} runs on {node_name}, which is not a VFIO node.", figures
        if on_gpu_node and not wants_gpus:
            return (f"The CPU workstation {name} runs on the GPU node {node_name}, holding its CPUs and memory from "
                    f"the GPU workstations: give CPU profiles a node affinity with {self.o.accelerator_label} "
                    "DoesNotExist."), figures
        return None, figures

    async def vm_and_vmi(self, user: str | None = None, server: str | None = None) -> tuple[dict, dict | None]:
        user = self.user if user is None else user
        server = self.server if server is None else server
        vm = await self.cluster.workstation_vm(user, server)
        if vm is None:
            raise AcceptanceError(f"The cluster has no VirtualMachine of {workstation_name(user, server)}.")
        return vm, await self.cluster.vmi(vm["metadata"]["namespace"], vm["metadata"]["name"])

    # ------------------------------------------------------------ persistence semantics
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
            return FAIL, f"The service refused the reset ({status}): {_said(data)}", {}
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

    async def retained(self, user: str, server: str) -> list[dict]:
        status, data = await self.t.service("GET", "capacity")
        if status != 200 or not isinstance(data, dict):
            raise AcceptanceError(f"The service's capacity view did not answer ({status}): {_said(data)}")
        return [r for r in data.get("retained") or [] if r.get("user") == user and r.get("server", "") == server]

    # ------------------------------------------------------------ security and product experience
    async def new_user(self, name: str) -> str:
        """A user this run makes (and deletes at the end); one the hub has already is refused:
        the suite never acts as someone else's account."""
        if not await self.t.ensure_user(name):
            raise AcceptanceError(f"The hub has a user {name} already: the suite acts only as users it makes "
                                  "(name another --user).")
        self.made.users.append(name)
        return name

    async def security(self):
        async def other_user_refused():
            return await self.other_user_refused(await self.token_of(await self.new_user(f"{self.helpers}-other")))
        await self.experiment("security", "other-users-are-refused", other_user_refused)
        await self.experiment("security", "vmi-address-refuses-without-token", self.vmi_address_refuses)
        await self.experiment("security", "no-cluster-credentials-in-guest", self.no_credentials)
        await self.experiment("security", "usage-and-snapshots-visible-to-user", self.visible_to_user)

    async def other_user_refused(self, token: str):
        """Another user's token: the workstation's Jupyter, the service's view and actions on it and
        its SSH tunnel all refuse, and nothing changed."""
        import aiohttp
        url = await self.t.url_of(self.user, self.server)
        path = self.t.workstation_path(self.user, self.server)
        before = len((await self.t.service("GET", path + "/snapshots"))[1].get("snapshots") or [])
        answers: dict[str, Any] = {
            "jupyter": (await self.t.as_user(token, "GET", url + "api/contents"))[0],
            "service view": (await self.t.service("GET", path, token=token))[0],
            "service snapshot": (await self.t.service("POST", path + "/snapshots", {"name": "acc-intruder"},
                                                      token=token))[0],
            "service reset": (await self.t.service("POST", path + "/reset", {"confirm": self.name}, token=token))[0],
            "service stop": (await self.t.service("POST", path + "/stop", {"wait": False}, token=token))[0],
        }
        try:
            ws = await self.t.session.ws_connect(url + "sshd/", headers={"Authorization": f"token {token}"},
                                                 timeout=aiohttp.ClientWSTimeout(ws_close=10))
            await ws.close()
            answers["ssh tunnel"] = 101
        except aiohttp.WSServerHandshakeError as refused:
            answers["ssh tunnel"] = refused.status
        except (aiohttp.ClientError, asyncio.TimeoutError) as err:
            answers["ssh tunnel"] = f"no connection ({type(err).__name__})"
        if 200 <= answers["service snapshot"] < 300:  # (let in: it goes with the rest at the end)
            self.made.snapshots.append((self.user, self.server, "acc-intruder"))
        after = (await self.t.service("GET", path + "/snapshots"))[1].get("snapshots") or []
        owner = await self.token_of(self.user)
        controls = {"jupyter": (await self.t.as_user(owner, "GET", url + "api/contents"))[0],
                    "service view": (await self.t.service("GET", path, token=owner))[0]}
        if any(v != 200 for v in controls.values()):
            return FAIL, f"The owner's own token was not let in either ({controls}): the refusals show nothing.", \
                {**answers, **{f"owner {k}": v for k, v in controls.items()}}
        let_in = [k for k, v in answers.items() if isinstance(v, int) and (200 <= v < 300 or v == 101)]
        still = (await self.t.server_model(self.user, self.server) or {}).get("ready")
        if let_in:
            return FAIL, f"Another user's token was let in: {', '.join(let_in)}.", answers
        if len(after) != before or not still:
            return FAIL, "Another user's requests changed the workstation (a snapshot, or a stop).", answers
        return PASS, "Another user's token is refused by the workstation's Jupyter, the service and the SSH tunnel.", answers

    async def vmi_address_refuses(self):
        """Straight to the VMI's address, past the hub and the proxy, without a token: refused (or
        not reachable at all, as network policies make it)."""
        if not self.has_cluster:
            raise Skip("Give --kubeconfig to learn the VMI's address.")
        import aiohttp
        _, vmi = await self.vm_and_vmi()
        ip = next((i.get("ipAddress") for i in (vmi or {}).get("status", {}).get("interfaces") or [] if i.get("ipAddress")),
                  None)
        if not ip:
            raise AcceptanceError("The VMI reports no address.")
        url = await self.t.url_of(self.user, self.server)
        prefix = "/" + url.split("://", 1)[1].split("/", 1)[1] if "/" in url.split("://", 1)[1] else "/"
        direct = f"http://{ip}:8888{prefix}api/contents"
        try:
            async with self.t.session.get(direct, allow_redirects=False,
                                          timeout=aiohttp.ClientTimeout(total=10)) as r:
                answer: Any = r.status
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as err:
            answer = f"no connection ({type(err).__name__})"
        figures = {"address": f"{ip}:8888", "answer": answer}
        if isinstance(answer, int) and 200 <= answer < 300:
            return FAIL, f"The VMI's own address {ip}:8888 served the workstation's files without a token.", figures
        if not isinstance(answer, int):
            raise Skip(f"The VMI's address {ip}:8888 cannot be reached from here ({answer}); run the suite from "
                       "inside the cluster's network to see it refuse.")
        if answer not in (401, 403) and not 300 <= answer < 400:  # (a refusal, or a redirect to the hub's login)
            return FAIL, (f"The VMI's own address answered {answer}, which is no refusal: the workstation's Jupyter "
                          "did not answer there as it does through the hub, so nothing was shown."), figures
        return PASS, f"The VMI's own address answered {answer} without a token.", figures

    async def no_credentials(self):
        found = await self.t.guest_json(self.user, self.server, guest.credentials_scan(), timeout=900)
        figures = {"files scanned": found.get("scanned"), "hub token known": found.get("had_token")}
        problems = list(found.get("found") or [])
        if found.get("kube_env"):
            problems.append("environment variables " + ", ".join(found["kube_env"]))
        if problems:
            return FAIL, "Credentials the guest must not hold: " + "; ".join(problems[:5]) + ".", figures
        if not found.get("had_token"):
            return FAIL, "The kernel had no hub API token to look for: nothing was proven.", figures
        return PASS, ("No ServiceAccount token, no kubeconfig, and the hub's API token nowhere outside the runtime "
                      "tmpfs."), figures

    async def visible_to_user(self):
        """What the user sees in the Lab panel (the service's status, with the user's own token):
        disk usage with its level, snapshot count, limit and retention, quota."""
        token = await self.token_of(self.user)
        deadline = time.monotonic() + 120
        while True:  # the guest agent reports usage a little after a boot
            view = await self.t.status(self.user, self.server, token=token)
            root = (view.get("disks") or {}).get("root") or {}
            if root.get("percent") is not None or time.monotonic() > deadline:
                break
            await asyncio.sleep(3)
        snaps = view.get("snapshots") or {}
        figures = {"root size": root.get("size"), "root used %": root.get("percent"), "level": root.get("level"),
                   "snapshots": snaps.get("count"), "snapshot limit": snaps.get("limit"),
                   "quota": [q.get("name") for q in view.get("quota") or []] if view.get("quota") else None,
                   "cost": (view.get("cost") or {}).get("month_to_date") if isinstance(view.get("cost"), dict) else None}
        missing = [k for k, v in (("disk usage", root.get("percent")), ("usage level", root.get("level")),
                                  ("snapshot count", snaps.get("count")), ("snapshot retention", snaps.get("retention")))
                   if v is None]
        if missing:
            return FAIL, f"The user's status lacks: {', '.join(missing)}.", figures
        return PASS, "The user sees the disk usage and its level, the snapshot count, limit and retention.", figures

    async def idle_warning_then_stop(self):
        """The idle culler's stop comes after the Lab's warning, and the disks stay."""
        view = await self.t.status(self.user, self.server)
        idle = view.get("idle")
        if not idle:
            raise Skip("The hub stops no idle workstation (no idle culler), or the workstation does not run.")
        timeout = idle.get("timeout_seconds") or 0
        if timeout > self.o.idle_wait:
            raise Skip(f"The idle timeout is {timeout} s, longer than --idle-wait {self.o.idle_wait:.0f}: run with "
                       f"--idle-wait {timeout + 300} to watch the warning and the stop.")
        # Seconds by this machine's monotonic clock; whether the warning is due by the service's
        # (stop_in_seconds): the two machines' wall clocks need not agree.
        began = time.monotonic()
        warned_at = stopped_at = None
        warn_before, every = idle.get("warn_before_seconds"), idle.get("check_every_seconds")
        deadline = began + timeout + 600
        while time.monotonic() < deadline:
            model = await self.t.server_model(self.user, self.server)
            now = time.monotonic()
            if model is None:  # (stopped, and no longer stopping)
                stopped_at = now
                break
            idle = (await self.t.status(self.user, self.server)).get("idle") or {}
            left = idle.get("stop_in_seconds")
            if warned_at is None and left is not None and warn_before is not None and left <= warn_before:
                warned_at = now  # what the Lab shows from then on, while the machine still runs
            await asyncio.sleep(2)
        figures = {"timeout seconds": timeout, "warned after s": _after(began, warned_at),
                   "stopped after s": _after(began, stopped_at)}
        if stopped_at is None:
            return FAIL, f"The idle workstation was not stopped within {timeout + 600} s.", figures
        if warned_at is None:
            return FAIL, "The idle workstation was stopped without a warning time having come first.", figures
        ahead = round(stopped_at - warned_at, 1)
        figures["warning before stop s"] = ahead
        slack = (every or 60) + 6  # (the culler's round, and two polls of 2 s)
        if warn_before and ahead < warn_before - slack:
            return FAIL, (f"The warning came {ahead:.0f} s before the stop; the Lab promises {warn_before} s "
                          "(c.Workstations.idle_warn_before)."), figures
        after = await self.t.status(self.user, self.server)
        if not (after.get("disks") or {}).get("root"):
            return FAIL, "The root disk is gone after the idle stop.", figures
        # the rest of the suite wants it running again
        await self.t.start(self.user, self.server, self.o.profile, self.o.start_timeout)
        return PASS, "The idle workstation was warned first, then stopped; its disks stay.", figures

    # ------------------------------------------------------------ storage and recovery
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
            raise AcceptanceError(f"The service did not take the snapshot {name} ({status}): {_said(data)}")
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
            return FAIL, f"The service refused the restore ({status}): {_said(data)}", {}
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

    # ------------------------------------------------------------ the end
    async def clean_up(self):
        """Stop and delete what the suite made; its kept disks are purged where their retention
        allows, else listed (a disk is never deleted before its retention ends). Each step on its
        own: one that fails is listed, and the rest still go."""
        left: list[str] = []

        async def step(what: str, work) -> Any:
            try:
                return await work
            except Exception as err:  # (the clean-up goes on; what is left is said at the end)
                left.append(f"{what} ({type(err).__name__}: {str(err)[:120]})")
                return None

        for user, (_, token_id) in self.made.tokens.items():
            await step(f"revoking {user}'s token", self.t.revoke_token(user, token_id))
        for user, name, snap in self.made.snapshots:
            path = self.t.workstation_path(user, name) + f"/snapshots/{snap}"
            await step(f"snapshot {snap} of {workstation_name(user, name)}", self.t.service("DELETE", path))
        for user, server in self.made.servers:
            await step(f"stopping {workstation_name(user, server)}", self.t.stop(user, server, self.o.start_timeout))
            if server:
                await step(f"deleting {workstation_name(user, server)}", self.t.delete_server(user, server))
        for user in self.made.users:
            await step(f"deleting the user {user}", self.t.api("DELETE", f"users/{quote(user, safe='')}"))
        kept = []
        for user, server in self.made.servers:
            retained = None
            for _ in range(30):  # (the spawner marks them retained as the server or user goes)
                retained = await step(f"the kept disks of {workstation_name(user, server)}", self.retained(user, server))
                if retained or retained is None:
                    break
                await asyncio.sleep(2)
            if not retained:
                continue
            answer = await step(f"purging {workstation_name(user, server)}",
                                self.t.service("POST", self.t.workstation_path(user, server) + "/purge",
                                               {"confirm": user}))
            if not answer or answer[0] != 200:
                kept.append(f"{workstation_name(user, server)} until "
                            f"{max(r.get('retain_until') or '?' for r in retained)}")
        if kept:
            print(f"Kept (retention): the disks of {', '.join(kept)}; purge them then from the admin page.",
                  file=self.out, flush=True)
        if left:
            print(f"Not cleaned up: {'; '.join(left)}.", file=self.out, flush=True)


def _said(data: Any) -> str:
    if isinstance(data, dict):
        for key in ("error", "message"):
            if isinstance(data.get(key), str):
                return data[key][:300]
    return json.dumps(data)[:300] if data is not None else "no answer"


def _after(began: float, when: float | None) -> float | None:
    return None if when is None else round(when - began, 1)


def _gib(n: Any) -> float | None:
    return round(n / 2**30, 2) if isinstance(n, (int, float)) else None

