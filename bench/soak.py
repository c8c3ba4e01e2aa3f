"""Fault soak: random user and admin actions through the real hub and the workstations service while
faults are injected at random, with the product's invariants checked after every step.

Starts the simulator (null guests: the machines' disks are directories, and the soak reads and
writes the users' files on them), configurable-http-proxy and a real JupyterHub with the demo's
config, running as Zero-to-JupyterHub's hub ServiceAccount bound to deploy/rbac/. Then, until the
time is up: one step after another, each an action (start, stop, resume, snapshot, restore, reset,
keep-alive, profile switch, named-server delete, purge, a user writing files) or a fault (API
500/429 bursts, watch cuts, SIGKILL of the hub or of the service, a node lost then fenced, stalled
clones, agent disconnects, restore errors without Failure, virt-api and cdi-api down), and after
each the invariants. At the end the faults are cleared, everything settles and every workstation
is checked for good. A violated invariant stops the soak with the seed and the step.

    python bench/soak.py --seed 7 --minutes 3 --users 4
    python bench/soak.py --seed 11 --minutes 30 --users 20 --results bench/RESULTS.md

The seed fixes the sequence of choices (which action or fault, on whom, how long); the timing of
the processes is the machine's, so a rerun makes the same choices, not the same interleavings.
The last line reads `soak: seed N, A actions, F faults, C invariant checks, V violations`; the
exit status is 0 only with no violation.
"""

from __future__ import annotations

import argparse
import calendar
import collections
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import types
from dataclasses import dataclass, field
from pathlib import Path

import requests

from kubevirt_spawner import demo
from kubevirt_spawner import manifests as m
from kubevirt_spawner.names import identity
from kubevirt_spawner.operations import Operation

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent / "tests"))
from scale import machine  # noqa: E402

from bench_sim import admin_session  # noqa: E402
from simtools import descendants, hub_kubeconfig  # noqa: E402  (the tests' helpers: process trees, the hub's RBAC)

OPERATION_TIMEOUT = 20  # seconds a step of a restore or reset may take: short, so timeouts happen
STOP_TIMEOUT = 10
DRAIN_GRACE = 12  # seconds the service gives a workstation on a drained node
# How long a drain may take past its grace before a workstation left on the node is a violation:
# the service may be down meanwhile (the hub restarts it within 30 s) or the API failing.
DRAIN_SLACK = 150
EXTRA_CONFIG = f"""
c.JupyterHub.log_level = "INFO"
c.KubeVirtSpawner.profile_list = [
    {{"display_name": "small", "slug": "small", "default": True,
     "kubevirt_override": {{"cpu_guarantee": 0.1, "mem_guarantee": "256M"}}}},
    {{"display_name": "large", "slug": "large",
     "kubevirt_override": {{"cpu_guarantee": 0.2, "mem_guarantee": "512M"}}}},
]
c.KubeVirtSpawner.start_timeout = 150
c.KubeVirtSpawner.clone_stall_timeout = 40
c.KubeVirtSpawner.http_timeout = 60
c.KubeVirtSpawner.stop_timeout = {STOP_TIMEOUT}
c.KubeVirtSpawner.retention_days = 0  # purges are possible at once
c.Workstations.operation_timeout = {OPERATION_TIMEOUT}
c.Workstations.snapshot_limit = 12
c.Workstations.drain_grace = {DRAIN_GRACE}
c.Workstations.drain_check_every = 1
"""
# What a sentence a user reads must never hold: a traceback, a raw Kubernetes answer, HTML.
RAW = re.compile(r"Traceback|File \"|\"kind\":|'kind':|apiVersion|HTTP response|Reason: |\(5\d\d\)|<html|"
                 r"failed calling webhook|etcdserver|Internal error occurred|denied the request|"
                 r"Too many requests, please|^(Internal Server Error|Unhandled error|Bad Gateway)\.?$", re.I)
ACTIONS = {  # weights
    "start": 14, "stop": 8, "stop-service": 3, "write": 10, "snapshot": 8, "delete-snapshot": 3,
    "restore": 18, "reset": 3, "keepalive": 3, "switch-profile": 3, "delete-named": 2, "purge": 2,
}
# While an operation runs, these weigh more (added to FAULTS); most restores and half the resets get
# one of them at a random moment of their first seconds.
OPERATION_FAULTS = {"restore-error": 14, "kill-service": 3, "webhooks-down": 3}
FAULTS = {
    "api-500": 3, "api-429": 2, "watch-cut": 3, "kill-hub": 2, "kill-service": 3, "node-loss": 2,
    "clone-stall": 2, "agent-disconnect": 2, "restore-error": 4, "webhooks-down": 2, "drain": 2,
}
ROOT_MARKER = "opt/soak/marker.txt"  # on the system disk (a reset replaces it)
HOME_MARKER = "home/soak/marker.txt"  # on the workspace disk (/home: kept by a reset)


class Violation(Exception):
    """An invariant the product broke: stops the soak with the seed and the step."""


@dataclass
class Station:
    """What the soak knows of one workstation: the users' files it expects, by disk (each a set of
    acceptable contents, None for no file), and its snapshots' files."""
    user: str
    server: str = ""
    root: set = field(default_factory=lambda: {None})
    home: set = field(default_factory=lambda: {None})
    snapshots: dict = field(default_factory=dict)  # name -> (root, home) when known
    touched: float = 0.0  # when the soak last asked something of it
    deleted: bool = False  # a named server removed (its disks retained until purged)
    started: bool = False  # a start whose outcome is still to be read

    def __post_init__(self):
        ident = identity(self.user, self.server)
        self.namespace, self.vm_name, self.label = ident.namespace, ident.vm, ident.slug
        self.key = (self.namespace, self.label)

    @property
    def path(self) -> str:
        return f"{self.user}/{self.server}" if self.server else self.user

    @property
    def hub_path(self) -> str:
        return f"/users/{self.user}/servers/{self.server}" if self.server else f"/users/{self.user}/server"

    @property
    def service_path(self) -> str:
        return f"/workstations/{self.user}" + (f"/servers/{self.server}" if self.server else "")


def _down(r: requests.Response) -> bool:
    """The proxy's answer for a hub or service that is down (killed, not yet started again): the
    availability check's to judge, not a message a user read."""
    return r.status_code in (502, 503)


class Soak:
    def __init__(self, seed: int, minutes: float, users: int, workdir: Path, speed: float, log=print):
        self.seed, self.rng = seed, random.Random(seed)
        self.deadline = time.monotonic() + minutes * 60
        self.workdir, self.speed, self.say = workdir, speed, log
        self.stations = [Station(f"soak{i:02d}") for i in range(users)]
        self.stations += [Station(f"soak{i:02d}", "lab") for i in range(0, users, 3)]
        self.actions: collections.Counter = collections.Counter()
        self.faults: collections.Counter = collections.Counter()
        self.checks = 0
        self.violations: list[str] = []
        self.step = 0
        self.later: list[tuple[float, str, object]] = []  # (when, what, undo): the ends of faults
        self.errors_seen = 0
        self.suspect_pvs: set[str] = set()
        self.known_pvcs: dict[str, tuple[str, str, str]] = {}  # uid -> (namespace, name, workstation label)
        self.licences: set[tuple[str, str]] = set()  # (namespace, label): purged since the last check
        self.last_check = 0.0  # (wall clock, as the operations' records)
        self.last_busy: set = set()  # the workstations an operation changed at the last check
        self.disagree: dict[str, float] = {}  # workstation -> since when hub and cluster disagree
        self.hub_down_since: float | None = None
        self.last_answer = ""
        self.hub_restarts = 0  # by the soak's "Deployment", after the hub exited by itself
        self.sim = self.hub = self.proxy = None
        self._start()

    # ------------------------------------------------------------ processes
    def _start(self):
        cluster = self.workdir / "cluster"
        cluster.mkdir(parents=True)
        self.sim_log = open(self.workdir / "sim.log", "wb")
        self.sim = subprocess.Popen([sys.executable, "-m", "kubevirt_spawner.cli", "--log-level", "WARNING", "sim",
                                     "--state", str(cluster), "--speed", str(self.speed), "--guests", "null"],
                                    stdout=self.sim_log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while not (cluster / "sim.json").exists():
                if time.monotonic() > deadline or self.sim.poll() is not None:
                    raise SystemExit(f"the simulator did not start (log: {self.workdir / 'sim.log'})")
                time.sleep(0.2)
            self.sim_url = json.loads((cluster / "sim.json").read_text())["url"]
            self.k8s = admin_session(str(cluster))
            sim = types.SimpleNamespace(url=self.sim_url, ca_file=str(cluster / "pki" / "ca.crt"),
                                        kubeconfig=str(cluster / "kubeconfig"))
            kubeconfig = hub_kubeconfig(sim, self.workdir / "hub.kubeconfig")
            extra = self.workdir / "extra_config.py"
            extra.write_text(EXTRA_CONFIG)
            self.settings = demo.HubSettings.create(self.workdir / "hub", kubeconfig, extra_config=str(extra))
            self.proxy = demo.start_proxy(self.settings, self.workdir / "proxy.log")
            self.hub = demo.start_hub(self.settings, self.workdir / "hub.log")
        except BaseException:
            self.close()
            raise
        self.http = requests.Session()
        self.http.headers["Authorization"] = f"token {self.settings.admin_token}"
        r = self.hub_api("POST", "/users", json={"usernames": sorted({s.user for s in self.stations})})
        assert r.status_code in (201, 409), r.text

    def close(self):
        if self.sim is not None and self.sim.poll() is None:
            with contextlib.suppress(Exception):
                self.clear_faults()
        if self.hub is not None:
            self.kill_hub(restart=False, graceful=True)
        demo.stop_process(self.proxy)
        demo.stop_process(self.sim, 30)
        with contextlib.suppress(AttributeError):
            self.sim_log.close()

    def kill_hub(self, restart: bool = True, graceful: bool = False):
        """A hub crash: its managed services (the workstations service, the idle culler) die with
        it, as everything in a crashed pod does; the pod comes back."""
        doomed = [self.hub.pid, *descendants(self.hub.pid)]
        if graceful:
            demo.stop_process(self.hub, 60)
        for pid in doomed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.hub.wait()
        if restart:
            self.hub = demo.start_hub(self.settings, self.workdir / "hub.log")

    def _supervise(self):
        """The hub runs in a pod: a hub that exited (JupyterHub exits when its managed service dies
        while it starts: app.py start_service) is started again, as its Deployment does."""
        if self.hub.poll() is not None:
            self.trace(f"the hub exited with status {self.hub.returncode}: started again")
            self.hub_restarts += 1
            self.kill_hub()

    def service_pids(self) -> list[int]:
        out = subprocess.run(["pgrep", "-f", f"kubevirt_spawner.cli service --ip 127.0.0.1 --port "
                                            f"{self.settings.service_port}"], capture_output=True, text=True)
        return [int(pid) for pid in out.stdout.split()]

    # ------------------------------------------------------------ requests
    def hub_api(self, method: str, path: str, **kw) -> requests.Response:
        return self.http.request(method, f"{self.settings.url}/hub/api{path}", timeout=90, **kw)

    def service(self, method: str, path: str, body: dict | None = None, timeout: float = 90) -> requests.Response:
        return self.http.request(method, f"{self.settings.url}/services/workstations/api/v1{path}", json=body,
                                 timeout=timeout)

    def kube(self, path: str) -> dict:
        """The soak's own reads of the cluster (as its admin): it observes, so it sees through the
        faults it injects (tries again on an injected 500 or 429)."""
        for attempt in range(30):
            r = self.k8s.get(f"{self.sim_url}{path}", timeout=60)
            if r.status_code not in (429, 500):
                r.raise_for_status()
                return r.json()
            time.sleep(0.05 * (attempt + 1))
        r.raise_for_status()
        return {}

    def items(self, path: str) -> list[dict]:
        return self.kube(path)["items"]

    def control(self, method: str, path: str, body: dict | None = None) -> dict:
        r = self.k8s.request(method, f"{self.sim_url}/sim/v1{path}", json=body, timeout=30)
        r.raise_for_status()
        return r.json()

    def saw(self, what: str, message) -> None:
        """A sentence a user or admin read: one line, never a traceback or a raw Kubernetes answer."""
        self.errors_seen += 1
        text = message if isinstance(message, str) else json.dumps(message)
        if not text.strip() or "\n" in text.strip() or len(text) > 600 or RAW.search(text.strip()):
            raise Violation(f"{what} showed a message that is not one plain sentence: {text[:800]!r}")

    def answered(self, what: str, r: requests.Response) -> bool:
        """Whether the request did what it asked; its error, if any, is a sentence a user read. A
        hub or service that is down (killed, not yet started again) answers through the proxy with
        the hub's error page or the proxy's: that is the availability check's to judge."""
        self.last_answer = f"{r.status_code} {r.text[:160]}"
        if r.status_code < 300:
            return True
        try:
            body = r.json()
        except ValueError:
            if _down(r):
                return False
            raise Violation(f"{what} answered {r.status_code} without JSON: {r.text[:300]!r}") from None
        self.saw(what, body.get("message") or body.get("error") or body)
        return False

    # ------------------------------------------------------------ the loop
    def run(self):
        self.say(f"soak: seed {self.seed}, {len(self.stations)} workstations of {len({s.user for s in self.stations})}"
                 f" users, work directory {self.workdir}")
        try:
            self.opening()
            while time.monotonic() < self.deadline:
                self.step += 1
                self._due()
                # Faults at random, more of them and of the kinds that hit an operation while one
                # runs: the paths between the steps are the point.
                operating = self.operating()
                if self.rng.random() < (0.4 if operating else 0.25):
                    kind = self._pick({**FAULTS, **(OPERATION_FAULTS if operating else {})})
                    self.inject(kind)
                else:
                    kind = self._pick(ACTIONS)
                    station = self._station_for(kind)
                    if self.act(kind, station):
                        self.actions[kind] += 1
                        self.trace(f"{kind} {station.path}: {self.last_answer}")
                self.check()
                time.sleep(self.rng.uniform(0.1, 1.5))
            self.step += 1
            self.settle()
            self.check(final=True)
        except Violation as v:
            self.violations.append(str(v))
            self.say(f"VIOLATION at step {self.step} (seed {self.seed}): {v}")
            self.trace(f"VIOLATION: {v}")
        except (requests.RequestException, subprocess.SubprocessError, demo.DemoError) as err:
            self.violations.append(f"the soak could not go on: {err}")
            self.say(f"VIOLATION at step {self.step} (seed {self.seed}): the hub or the simulator stopped "
                     f"answering: {err}")

    def opening(self):
        """Before the random steps, whatever the seed: the path of the review's first defect, walked
        once. A restore errs without a `Failure` condition (restore.go's doUpdateError paths: a
        VolumeSnapshot not ready) until the operation gives it up; the claims must get `Retain`
        back. Random steps alone reach it in most runs but not all (bench/RESULTS.md)."""
        s = self.stations[0]
        self._opening_step("start", s)
        deadline = time.monotonic() + 150
        while not (self.hub_server(s) or {}).get("ready"):
            if time.monotonic() > deadline:
                return  # (a start that fails is the checks' to judge; the random steps go on)
            time.sleep(0.5)
        self._opening_step("snapshot", s)
        deadline = time.monotonic() + 60
        while (name := self._some_snapshot(s)) is None:
            if time.monotonic() > deadline:
                return
            time.sleep(0.5)
        self.step += 1
        self.inject("restore-error", "the opening's restore")  # (aimed: it outlasts the operation's wait)
        r = self.service("POST", s.service_path + "/restore", {"snapshot": name, "confirm": True})
        if self.answered(f"restore of {s.path}", r):
            self.actions["restore"] += 1
            self.trace(f"restore {s.path}: {self.last_answer}")
            root, home = s.snapshots.get(name, ("?", "?"))
            s.root, s.home = s.root | {root}, s.home | {home}
        self.check()

    def _opening_step(self, kind: str, s: Station):
        self.step += 1
        if self.act(kind, s):
            self.actions[kind] += 1
            self.trace(f"{kind} {s.path}: {self.last_answer}")
        self.check()

    def trace(self, line: str):
        with open(self.workdir / "steps.log", "a") as f:
            f.write(f"{time.strftime('%H:%M:%S')} step {self.step}: {line}\n")

    def operating(self) -> bool:
        return any(_running_operation(vm) for vm in self.items("/apis/kubevirt.io/v1/virtualmachines"))

    def _station_for(self, kind: str) -> Station:
        """Anyone, except that a restore or a snapshot's delete goes to a workstation the soak knows
        snapshots of (when there is one): otherwise most of them would find nothing to act on."""
        known = [s for s in self.stations if s.snapshots and not s.deleted]
        if kind == "restore":  # (and mostly one that is not busy already)
            known = [s for s in known if self._operation_idle(s)] or known
        return self.rng.choice(known if kind in ("restore", "delete-snapshot") and known else self.stations)

    def _pick(self, weights: dict[str, int]) -> str:
        names = sorted(weights)
        return self.rng.choices(names, [weights[n] for n in names])[0]

    def _due(self):
        now = time.monotonic()
        for item in sorted((x for x in self.later if x[0] <= now), key=lambda x: x[0]):
            self.later.remove(item)
            item[2]()

    def _after(self, seconds: float, what: str, undo):
        self.later.append((time.monotonic() + seconds, what, undo))

    # ------------------------------------------------------------ actions
    def act(self, kind: str, s: Station) -> bool:
        """One user's or admin's request. True when it was made (some need a state first)."""
        self.last_answer = ""
        if s.deleted and kind not in ("start", "purge"):
            return False
        s.touched = time.monotonic()
        if kind in ("start", "switch-profile"):
            if kind == "switch-profile" and self.hub_server(s) is not None:
                return False  # a profile is chosen at a start
            profile = self.rng.choice(["small", "large"]) if kind == "switch-profile" else None
            r = self.hub_api("POST", s.hub_path, json={"profile": profile} if profile else {})
            if self.answered(f"start of {s.path}", r):
                s.started, s.deleted = True, False
            return True
        if kind == "stop":
            self.answered(f"stop of {s.path}", self.hub_api("DELETE", s.hub_path))
            return True
        if kind == "stop-service":
            self.answered(f"stop of {s.path} from the service",
                          self.service("POST", s.service_path + "/stop", {"wait": self.rng.random() < 0.5}))
            return True
        if kind == "write":
            return self.write_files(s)
        if kind == "keepalive":
            self.answered(f"keep-alive of {s.path}",
                          self.service("POST", s.service_path + "/keepalive", {"minutes": 30}))
            return True
        if kind == "snapshot":
            name = f"s{self.step}"
            files = self._files_now(s)
            r = self.service("POST", s.service_path + "/snapshots", {"name": name}, timeout=120)
            if self.answered(f"snapshot of {s.path}", r):
                s.snapshots[name] = files
            return True
        if kind == "delete-snapshot":
            name = self._some_snapshot(s)
            if name is None:
                return False
            if self.answered(f"delete of snapshot {name} of {s.path}",
                             self.service("DELETE", s.service_path + f"/snapshots/{name}")):
                s.snapshots.pop(name, None)
            return True
        if kind == "restore":
            name = self._some_snapshot(s)
            if name is None:
                return False
            # A cause restores stumble on may be there already (a quota, a VolumeSnapshot going):
            # a restore of a stopped machine is done within a second or two.
            if self.rng.random() < 0.6:
                self.inject("restore-error", "as a restore is asked for")
            r = self.service("POST", s.service_path + "/restore", {"snapshot": name, "confirm": True})
            if self.answered(f"restore of {s.path}", r):
                self._mid_operation(0.7)
                # as before or as in the snapshot (the safety snapshot and the soak's own before it
                # are not known file by file: anything)
                root, home = s.snapshots.get(name, ("?", "?"))
                s.root, s.home = s.root | {root}, s.home | {home}
            return True
        if kind == "reset":
            if self.answered(f"reset of {s.path}", self.service("POST", s.service_path + "/reset",
                                                                 {"confirm": s.path})):
                self._mid_operation(0.5)
                s.root = s.root | {None}  # a fresh system disk has no file of the user's
            return True
        if kind == "delete-named":
            if not s.server:
                return False
            if self.answered(f"delete of {s.path}", self.hub_api("DELETE", s.hub_path, json={"remove": True})):
                s.deleted = True
            return True
        if kind == "purge":
            if not s.deleted:
                return False
            self._licence(s)
            if self.answered(f"purge of {s.path}", self.service("POST", s.service_path + "/purge",
                                                                 {"confirm": s.user})):
                s.root, s.home, s.snapshots = {None}, {None}, {}
            return True
        raise ValueError(kind)

    def _mid_operation(self, chance: float):
        if self.rng.random() < chance:
            kind = self._pick(OPERATION_FAULTS)
            self._after(self.rng.uniform(0, 4), "soon", lambda: self.inject(kind, "during an operation"))

    def _licence(self, s: Station):
        """A purge deletes this workstation's claims: until the next check has seen them go."""
        self.licences.add(s.key)

    def hub_server(self, s: Station) -> dict | None:
        """The hub's model of the station's server; None without one, and while the hub is down
        (the proxy's 502/503, not JSON: a hub whose managed service died while it started exits,
        and _supervise starts it again; the availability check judges how long that takes)."""
        r = self.hub_api("GET", f"/users/{s.user}")
        if _down(r):
            return None
        model = r.json()
        return (model.get("servers") or {}).get(s.server)

    def _some_snapshot(self, s: Station) -> str | None:
        """One of the workstation's ready snapshots, at random (None without one)."""
        r = self.service("GET", s.service_path + "/snapshots")
        ready = sorted(x["name"] for x in r.json()["snapshots"] if x.get("ready")) if r.status_code == 200 else []
        return self.rng.choice(ready) if ready else None

    # ------------------------------------------------------------ the users' files
    def guest_roots(self) -> dict[tuple[str, str], str]:
        """(namespace, VM) -> the root directory of its running guest (the machine's disk)."""
        return {(g["namespace"], g["name"]): g["root"] for g in self.control("GET", "/guests")["guests"]
                if g["alive"] and g["root"]}

    @staticmethod
    def _read(root: str, rel: str) -> str | None:
        try:
            return Path(root, rel).read_text()
        except FileNotFoundError:
            return None

    def _files_now(self, s: Station) -> tuple:
        """What a snapshot taken now holds, as far as the soak knows ("?": not known)."""
        root = self.guest_roots().get((s.namespace, s.vm_name))
        if root is not None and self._operation_idle(s):
            return (self._read(root, ROOT_MARKER), self._read(root, HOME_MARKER))
        return (next(iter(s.root)) if len(s.root) == 1 else "?", next(iter(s.home)) if len(s.home) == 1 else "?")

    def write_files(self, s: Station) -> bool:
        """The user changes a file on each disk of the running machine."""
        root = self.guest_roots().get((s.namespace, s.vm_name))
        if root is None or not self._operation_idle(s):
            return False
        self.check_files(s, root)
        token = f"{s.path}@{self.step}"
        for rel in (ROOT_MARKER, HOME_MARKER):
            path = Path(root, rel)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(token)
        s.root, s.home = {token}, {token}
        return True

    def check_files(self, s: Station, root: str):
        got = (self._read(root, ROOT_MARKER), self._read(root, HOME_MARKER))
        for disk, want, have in (("system", s.root, got[0]), ("workspace", s.home, got[1])):
            if "?" not in want and have not in want:
                raise Violation(f"{s.path} runs without its data: its {disk} disk holds {have!r}, expected "
                                f"{' or '.join(sorted(map(repr, want)))}")
        s.root, s.home = {got[0]}, {got[1]}  # seen: known again

    def _operation_idle(self, s: Station) -> bool:
        r = self.k8s.get(f"{self.sim_url}/apis/kubevirt.io/v1/namespaces/{s.namespace}/virtualmachines/{s.vm_name}",
                         timeout=30)
        op = Operation.from_vm(r.json()) if r.status_code == 200 else None
        return op is None or op.state != "running"

    # ------------------------------------------------------------ faults
    def inject(self, kind: str, aimed: str = ""):
        """A fault, counted and traced when it could happen now; `aimed`: at which operation."""
        if self.fault(kind, mid_operation=bool(aimed)):
            self.faults[kind] += 1
            self.trace(f"fault {kind}" + (f" ({aimed})" if aimed else ""))

    def fault(self, kind: str, mid_operation: bool = False) -> bool:
        """Inject one fault (its end scheduled); False when that kind cannot happen now."""
        if kind in ("api-500", "api-429"):
            if any(w == "api" for _, w, _ in self.later):
                return False
            code = 500 if kind == "api-500" else 429
            self.control("PUT", "/faults/api", {"verb": "*", "resource": "*", "rate": self.rng.uniform(0.1, 0.4),
                                                "code": code})
            self._after(self.rng.uniform(2, 12), "api", lambda: self.control("DELETE", "/faults/api"))
            return True
        if kind == "watch-cut":
            self.control("POST", "/watches/cut")
            return True
        if kind == "kill-hub":
            self.kill_hub()
            return True
        if kind == "kill-service":
            pids = self.service_pids()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            return bool(pids)
        if kind == "node-loss":
            if any(w == "node" for _, w, _ in self.later):
                return False
            busy = collections.Counter(vmi["status"].get("nodeName") for vmi in
                                       self.items("/apis/kubevirt.io/v1/virtualmachineinstances")
                                       if (vmi.get("status") or {}).get("nodeName"))
            if not busy:
                return False
            node = self.rng.choice(sorted(busy))
            self.control("POST", f"/nodes/{node}/lose")
            fence_after = self.rng.uniform(5, 30)

            def fence():
                self.control("POST", f"/nodes/{node}/fence")  # the admin confirms the node is off
                self._after(self.rng.uniform(5, 20), "node", lambda: self.control("POST", f"/nodes/{node}/recover"))
            self._after(fence_after, "node", fence)
            return True
        if kind == "clone-stall":
            self.control("POST", "/clones/fail-next", {"count": 1})
            return True
        if kind == "agent-disconnect":
            running = [vmi for vmi in self.items("/apis/kubevirt.io/v1/virtualmachineinstances")
                       if (vmi.get("status") or {}).get("phase") == "Running"]
            if not running:
                return False
            vmi = self.rng.choice(sorted(running, key=lambda v: v["metadata"]["name"]))
            where = f"/vmis/{vmi['metadata']['namespace']}/{vmi['metadata']['name']}/agent"
            self.control("PUT", where, {"connected": False})
            self._after(self.rng.uniform(3, 30), "agent", lambda: self.control("PUT", where, {"connected": True}))
            return True
        if kind == "restore-error":
            if any(w == "restores" for _, w, _ in self.later):
                return False
            self.control("PUT", "/faults/restores", {"error": f"VolumeSnapshot vmsnapshot-{self.step}-disk not ready"})
            # Some outlast any restore's wait (a quota that refuses the new claim stays until an admin
            # acts): those aimed at a restore and half the others; the rest clear while a restore may
            # still finish.
            lasting = mid_operation or self.rng.random() < 0.5
            seconds = self.rng.uniform(2, 3) * OPERATION_TIMEOUT if lasting else self.rng.uniform(5, OPERATION_TIMEOUT)
            self._after(seconds, "restores", lambda: self.control("DELETE", "/faults/restores"))
            return True
        if kind == "drain":
            return self.drain()
        if kind == "webhooks-down":
            if any(w == "webhooks" for _, w, _ in self.later):
                return False
            self.control("PUT", "/faults/webhooks", {"down": True})
            self._after(self.rng.uniform(2, 15), "webhooks", lambda: self.control("DELETE", "/faults/webhooks"))
            return True
        raise ValueError(kind)

    # ------------------------------------------------------------ node drains
    def drain(self) -> bool:
        """`kubectl drain` of a node with workstations: cordon, then evict every launcher pod on it,
        again every few seconds (kubectl retries every 5 s) until none is left. The workstations'
        VMs have evictionStrategy External, so no eviction of theirs may ever be granted; the
        service warns each, stops it after its grace and records it (checked in _check_drain)."""
        if any(w == "drain-check" for _, w, _ in self.later):
            return False
        busy = sorted({(vmi.get("status") or {}).get("nodeName") for vmi in
                       self.items("/apis/kubevirt.io/v1/virtualmachineinstances")} - {None})
        if not busy:
            return False
        node = self.rng.choice(busy)
        self.cordon(node, True)
        begun = time.monotonic()
        self.evict_launchers(node)

        def check():
            if self._check_drain(node, begun):
                self.cordon(node, False)  # (maintenance done: the node is back)
            else:
                self.evict_launchers(node)
                self._after(5, "drain-check", check)
        self._after(DRAIN_GRACE, "drain-check", check)
        return True

    def _write(self, method: str, path: str, body: dict, content_type: str = "application/json") -> requests.Response:
        """The soak's own write, through the faults it injects (tried again on theirs)."""
        for attempt in range(30):
            r = self.k8s.request(method, f"{self.sim_url}{path}", data=json.dumps(body),
                                 headers={"Content-Type": content_type}, timeout=60)
            injected = ((r.status_code == 500 and "injected fault" in r.text)
                        or (r.status_code == 429 and "denied the request" not in r.text))
            if not injected:
                return r
            time.sleep(0.05 * (attempt + 1))
        return r

    def cordon(self, node: str, on: bool):
        r = self._write("PATCH", f"/api/v1/nodes/{node}", {"spec": {"unschedulable": True if on else None}},
                        "application/merge-patch+json")
        r.raise_for_status()

    def evict_launchers(self, node: str):
        pods = self.items(f"/api/v1/pods?fieldSelector=spec.nodeName%3D{node}&labelSelector=kubevirt.io%3Dvirt-launcher")
        for pod in pods:
            ns, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
            r = self._write("POST", f"/api/v1/namespaces/{ns}/pods/{name}/eviction",
                            {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": ns}})
            if r.status_code == 201 and ns.startswith("notebook-"):
                raise Violation(f"the drain of {node} evicted {ns}/{name}: a workstation shut down unwarned")
            if r.status_code == 500 and "failed calling webhook" in r.text:
                continue  # virt-api is down (webhooks-down): kubectl drain fails the pod, tries again later
            if r.status_code not in (201, 404, 429):
                raise Violation(f"the eviction of {ns}/{name} answered {r.status_code}: {r.text[:300]}")

    def _check_drain(self, node: str, begun: float) -> bool:
        """Whether the drain of `node` is done: no workstation runs there marked for evacuation.
        Past its grace and slack, one still there is a violation; a workstation that stopped holds
        a drain record that warned before it stopped, and waited its grace unless stopped early."""
        left = [f"{vmi['metadata']['namespace']}/{vmi['metadata']['name']}"
                for vmi in self.items("/apis/kubevirt.io/v1/virtualmachineinstances")
                if (vmi.get("status") or {}).get("evacuationNodeName") == node
                and (vmi.get("status") or {}).get("phase") not in ("Succeeded", "Failed")]
        for vm in self.items("/apis/kubevirt.io/v1/virtualmachines"):
            raw = (vm["metadata"].get("annotations") or {}).get(m.ANNOTATION_DRAIN)
            record = json.loads(raw) if raw else None
            if not record or record.get("node") != node or not record.get("stopped_at"):
                continue
            where = f"{vm['metadata']['namespace']}/{vm['metadata']['name']}"
            since, stopped, deadline = (_epoch(record.get(k)) for k in ("since", "stopped_at", "deadline"))
            if not since <= stopped:
                raise Violation(f"{where} stopped by the drain of {node} before its warning: {record}")
            if record.get("stopped") == "after-grace" and stopped < deadline - 1:
                raise Violation(f"{where} stopped by the drain of {node} before its grace ended: {record}")
        if left and time.monotonic() - begun > DRAIN_GRACE + DRAIN_SLACK and self.hub_down_since is None:
            raise Violation(f"{', '.join(left)} still on {node} {DRAIN_GRACE + DRAIN_SLACK} s after its drain began")
        return not left

    def clear_faults(self):
        """Every fault ends (nodes come back) at once."""
        for _ in range(2):  # (a fence schedules the node's recovery)
            # (no new faults; a drain under way goes on: its users were warned, the check follows it)
            ends = [x for x in sorted(self.later, key=lambda x: x[0]) if x[1] not in ("soon", "drain-check")]
            self.later = [x for x in self.later if x[1] == "drain-check"]
            for _, _, undo in ends:
                undo()
        self.control("DELETE", "/faults/api")
        self.control("DELETE", "/faults/restores")
        self.control("DELETE", "/faults/webhooks")

    # ------------------------------------------------------------ invariants
    def check(self, final: bool = False):
        self.checks += 1
        self._supervise()
        violations = self.control("GET", "/violations")["violations"]
        if violations:
            raise Violation(f"a read-write-once volume was attached twice: {violations[:3]}")
        hub_ok = self._hub_answers()
        vms = {(vm["metadata"]["namespace"], (vm["metadata"].get("labels") or {}).get(m.LABEL_WORKSTATION)): vm
               for vm in self.items("/apis/kubevirt.io/v1/virtualmachines")}
        restores = {(r["metadata"]["namespace"], r["spec"]["target"]["name"])
                    for r in self.items("/apis/snapshot.kubevirt.io/v1beta1/virtualmachinerestores")}
        # Busy: an operation runs, or a VirtualMachineRestore of the VM exists (KubeVirt may still
        # replace claims). Claims may also have gone with an operation that ended since the last
        # check, or with a purge.
        busy = {key for key, vm in vms.items() if _running_operation(vm) or
                (key[0], vm["metadata"]["name"]) in restores}
        ended = {key for key, vm in vms.items() if _operation_updated(vm) >= self.last_check - 5}
        self._check_operations(vms)
        # (and those busy at the last check: an operation that ended by deleting its VM, as a
        # delete asked while it ran does, leaves no record to read)
        self._check_claims(busy | ended | self.last_busy | set(self.licences))
        self.licences.clear()
        self._check_volumes(busy)
        self.last_check = time.time()
        self.last_busy = busy
        for (ns, label), vm in vms.items():
            op = Operation.from_vm(vm)
            if op is not None and op.state == "failed":
                self.saw(f"the failed {op.kind} of {ns}/{label}", op.error)
        servers = None
        if hub_ok:
            users = {u["name"]: u for u in self.hub_api("GET", "/users").json()}
            servers = {s.path: ((users.get(s.user) or {}).get("servers") or {}).get(s.server) for s in self.stations}
            self._check_hub_view(servers, final)
            for s in self.stations:
                if s.started and servers[s.path] is None:
                    s.started = False
                    failure = self.spawn_failure(s)
                    if failure:
                        self.saw(f"the failed start of {s.path}", failure)
        roots = self.guest_roots()
        for s in self.stations:
            root = roots.get((s.namespace, s.vm_name))
            if root is not None and s.key not in busy:
                self.check_files(s, root)
        if final:
            self._check_final(vms, servers or {}, roots)

    def _hub_answers(self) -> bool:
        """The hub and the service answer; a killed one is given the time JupyterHub takes to start
        its managed service again (it polls them every 30 s)."""
        try:
            hub = self.http.get(f"{self.settings.url}/hub/api/", timeout=30).status_code == 200
            svc = self.service("GET", "/workstations", timeout=30).status_code == 200
        except requests.RequestException:
            hub = svc = False
        now = time.monotonic()
        if hub and svc:
            self.hub_down_since = None
            return True
        self.hub_down_since = self.hub_down_since or now
        if now - self.hub_down_since > 120:
            raise Violation(f"the {'service' if hub else 'hub'} has not answered for "
                            f"{now - self.hub_down_since:.0f} s")
        return hub

    def _check_operations(self, vms: dict):
        limit = max(OPERATION_TIMEOUT, STOP_TIMEOUT + 60) + 150  # + the service's restart and catching up
        for (ns, label), vm in vms.items():
            op = Operation.from_vm(vm)
            if _running_operation(vm) and op.updated:
                age = time.time() - _operation_updated(vm)
                if age > limit:
                    raise Violation(f"the {op.kind} of {ns}/{label} still says running {age:.0f} s after its last "
                                    f"step began ({op.describe()})")

    def _check_claims(self, busy: set):
        """No claim goes except the system disk a reset replaces, the claims a restore replaces and
        the disks a purge deletes."""
        now = {p["metadata"]["uid"]: (p["metadata"]["namespace"], p["metadata"]["name"],
                                      (p["metadata"].get("labels") or {}).get(m.LABEL_WORKSTATION, ""))
               for p in self.items("/api/v1/persistentvolumeclaims")}
        for uid, (ns, name, label) in self.known_pvcs.items():
            if uid not in now and label and (ns, label) not in busy:
                raise Violation(f"the claim {ns}/{name} was deleted, and no reset, restore or purge of its "
                                "workstation was under way")
        self.known_pvcs = now

    def _check_volumes(self, busy: set):
        """No live disk's volume at Delete outside an operation (seen so twice in a row: the read of
        the volumes and of the operations are not one moment)."""
        claims = {(p["metadata"]["namespace"], p["metadata"]["name"]): p
                  for p in self.items("/api/v1/persistentvolumeclaims")}
        suspects = set()
        for pv in self.items("/api/v1/persistentvolumes"):
            ref = pv["spec"].get("claimRef") or {}
            claim = claims.get((ref.get("namespace"), ref.get("name")))
            label = ((claim or {}).get("metadata", {}).get("labels") or {}).get(m.LABEL_WORKSTATION)
            if claim and label and pv["spec"].get("persistentVolumeReclaimPolicy") == "Delete" \
                    and (ref["namespace"], label) not in busy:
                suspects.add(pv["metadata"]["name"])
        twice = suspects & self.suspect_pvs
        if twice:
            raise Violation(f"volumes of live disks are left at reclaim policy Delete with no operation under way: "
                            f"{sorted(twice)}")
        self.suspect_pvs = suspects

    def _check_hub_view(self, servers: dict, final: bool):
        """The hub's view agrees with the cluster: a server the hub calls ready has a running
        machine, and a running machine has a server in the hub. Each side lags the other by a poll:
        a disagreement counts once it lasted two minutes, or at the end."""
        vmis = {(v["metadata"]["namespace"], v["metadata"]["name"]): v
                for v in self.items("/apis/kubevirt.io/v1/virtualmachineinstances")}
        now = time.monotonic()
        for s in self.stations:
            server = servers[s.path]
            phase = ((vmis.get((s.namespace, s.vm_name)) or {}).get("status") or {}).get("phase")
            ready = bool(server and server.get("ready") and not server.get("pending"))
            wrong = None
            if ready and phase != "Running":
                wrong = f"the hub says {s.path} is ready, its VMI is {phase or 'not there'}"
            elif server is None and phase == "Running":
                wrong = f"{s.path}'s VMI runs, the hub has no server for it"
            if wrong is None:
                self.disagree.pop(s.path, None)
                continue
            since = self.disagree.setdefault(s.path, now)
            if final or (now - since > 120 and now - s.touched > 120):
                raise Violation(wrong + f" (for {now - since:.0f} s)")

    def spawn_failure(self, s: Station) -> str | None:
        r = self.http.get(f"{self.settings.url}/hub/api{s.hub_path}/progress", timeout=30)
        if r.status_code != 200:
            return None
        events = [json.loads(line[5:]) for line in r.text.splitlines() if line.startswith("data:")]
        return events[-1]["message"] if events and events[-1].get("failed") else None

    def _check_final(self, vms: dict, servers: dict, roots: dict):
        """Every workstation is running with its data, stopped with its disks Bound, or carries a
        record saying what failed and what to do."""
        claims = self.items("/api/v1/persistentvolumeclaims")
        for s in self.stations:
            vm = vms.get(s.key)
            if vm is None:
                continue  # never started, or a named server deleted (its disks: the claims check)
            op = Operation.from_vm(vm)
            if op is not None and op.state == "failed":
                continue  # the record says what failed and what to do (checked as a sentence)
            if op is not None and op.state == "done" and \
                    (vm["metadata"].get("annotations") or {}).get(m.ANNOTATION_DELETE_REQUESTED) == op.id:
                raise Violation(f"{s.path} was deleted while its {op.kind} ran, and is still there after it")
            if servers.get(s.path) is not None:
                if (s.namespace, s.vm_name) not in roots:
                    raise Violation(f"the hub says {s.path} runs, and no guest runs for it")
                continue  # its files: checked by check()
            mine = [p for p in claims if p["metadata"]["namespace"] == s.namespace
                    and (p["metadata"].get("labels") or {}).get(m.LABEL_WORKSTATION) == s.label]
            unbound = [p["metadata"]["name"] for p in mine if (p.get("status") or {}).get("phase") != "Bound"]
            if unbound or not mine:
                raise Violation(f"{s.path} is stopped and its disks are not all Bound: {unbound or 'none left'}")

    def settle(self, timeout: float = 300):
        """The faults end; then wait until no operation runs and no server is pending."""
        self.clear_faults()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._due()  # (a drain's evictions and checks)
            self.check()
            users = self.hub_api("GET", "/users").json()
            pending = [f"{u['name']}/{n}" for u in users for n, srv in (u.get("servers") or {}).items()
                       if srv.get("pending")]
            running = [vm["metadata"]["name"] for vm in self.items("/apis/kubevirt.io/v1/virtualmachines")
                       if _running_operation(vm)]
            draining = any(w == "drain-check" for _, w, _ in self.later)
            if not pending and not running and not draining:
                return
            time.sleep(2)
        raise Violation(f"nothing settled within {timeout:.0f} s after the faults ended: pending {pending}, "
                        f"operations running on {running}, a drain under way: {draining}")

    def summary(self) -> str:
        acts = ", ".join(f"{k} {v}" for k, v in sorted(self.actions.items()))
        faults = ", ".join(f"{k} {v}" for k, v in sorted(self.faults.items()))
        return (f"actions: {acts}\nfaults: {faults}\nmessages users read and checked: {self.errors_seen}\n"
                f"hub exits (restarted as a Deployment would): {self.hub_restarts}")

    def last_line(self) -> str:
        return (f"soak: seed {self.seed}, {sum(self.actions.values())} actions, {sum(self.faults.values())} faults, "
                f"{self.checks} invariant checks, {len(self.violations)} violations")


def _operation_updated(vm: dict) -> float:
    """When the VM's operation record was last saved (epoch seconds; 0 without one)."""
    op = Operation.from_vm(vm)
    if op is None or not op.updated:
        return 0.0
    return calendar.timegm(time.strptime(op.updated, "%Y-%m-%dT%H:%M:%SZ"))


def _epoch(stamp) -> float:
    """Seconds since the epoch of an RFC 3339 time the service wrote; 0 for none."""
    if not isinstance(stamp, str) or not stamp:
        return 0.0
    return calendar.timegm(time.strptime(stamp[:19], "%Y-%m-%dT%H:%M:%S"))


def _running_operation(vm: dict) -> bool:
    op = Operation.from_vm(vm)
    return op is not None and op.state == "running"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--minutes", type=float, required=True)
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--speed", type=float, default=20.0, help="simulator speed factor (default 20)")
    parser.add_argument("--results", help="append the figures to this Markdown file")
    parser.add_argument("--workdir", help="keep the logs and disks here (default: a new temporary directory)")
    args = parser.parse_args()
    if args.minutes <= 0 or args.users < 1:
        parser.error("--minutes must be above 0 and --users at least 1")
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    soak = Soak(args.seed, args.minutes, args.users, workdir, args.speed, log=lambda line: print(line, flush=True))
    try:
        soak.run()
    finally:
        soak.close()
    print(soak.summary())
    if args.results:
        with open(args.results, "a") as f:
            f.write(f"\n## {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: fault soak, seed {args.seed}, "
                    f"{args.users} users, {args.minutes:g} minutes (ran {(time.monotonic() - began) / 60:.1f})\n\n"
                    f"Machine: {machine()}; simulator speed {args.speed:g}.\n\n"
                    + "".join(f"- {line}\n" for line in soak.summary().splitlines())
                    + f"- `{soak.last_line()}`\n")
    print(soak.last_line())
    return 0 if not soak.violations else 1


if __name__ == "__main__":
    sys.exit(main())
