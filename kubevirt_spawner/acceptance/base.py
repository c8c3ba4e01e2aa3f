"""What every section of the acceptance suite stands on: its options, what it made, the run's
names (user, server, tag), one experiment run into one Record, and the reads the sections share
(the test workstation's VM and VMI, whether a VMI runs on its profile's pool, the users the run
makes, the disks a deleted workstation keeps)."""

from __future__ import annotations

import asyncio
import json
import secrets
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, TextIO

import aiohttp

from ..ssh import ClientError
from .client import AcceptanceError, GuestError, Target, workstation_name
from .cluster import Cluster
from .report import FAIL, SKIP, Record

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


class SuiteBase:
    """The state and the shared steps of a run; the sections' experiments are mixins on it (Suite)."""

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

    # ------------------------------------------------------------ what the sections share
    async def vm_and_vmi(self, user: str | None = None, server: str | None = None) -> tuple[dict, dict | None]:
        user = self.user if user is None else user
        server = self.server if server is None else server
        vm = await self.cluster.workstation_vm(user, server)
        if vm is None:
            raise AcceptanceError(f"The cluster has no VirtualMachine of {workstation_name(user, server)}.")
        return vm, await self.cluster.vmi(vm["metadata"]["namespace"], vm["metadata"]["name"])

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

    async def new_user(self, name: str) -> str:
        """A user this run makes (and deletes at the end); one the hub has already is refused:
        the suite never acts as someone else's account."""
        if not await self.t.ensure_user(name):
            raise AcceptanceError(f"The hub has a user {name} already: the suite acts only as users it makes "
                                  "(name another --user).")
        self.made.users.append(name)
        return name

    async def retained(self, user: str, server: str) -> list[dict]:
        status, data = await self.t.service("GET", "capacity")
        if status != 200 or not isinstance(data, dict):
            raise AcceptanceError(f"The service's capacity view did not answer ({status}): {said(data)}")
        return [r for r in data.get("retained") or [] if r.get("user") == user and r.get("server", "") == server]


def said(data: Any) -> str:
    if isinstance(data, dict):
        for key in ("error", "message"):
            if isinstance(data.get(key), str):
                return data[key][:300]
    return json.dumps(data)[:300] if data is not None else "no answer"
