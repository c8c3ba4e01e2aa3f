"""API requests and the spawner's own time per first start, resume and stop.

The simulator runs in its own process (null guests), so this process's CPU time is the
spawner's. For each operation it prints the requests the simulator saw, by verb and resource,
and the wall time next to the simulator's own floor for that path (the sum of its configured
delays at this speed): the difference is what the spawner adds on top.
Targets: a resume makes at most 3 write requests; poll() makes none.
Not a pass/fail test: run `python bench/bench_spawner.py [--workstations N]`.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import logging
import os
import statistics
import tempfile
import time
import types

import requests
from traitlets.config import Config

from kubevirt_spawner import kube as k
from kubevirt_spawner import manifests as m
from kubevirt_spawner import names
from kubevirt_spawner import spawner as spawner_module
from kubevirt_spawner.reflector import Caches
from kubevirt_spawner.spawner import KubeVirtSpawner
from kubevirt_spawner.workstation import Settings, Workstation

from bench_sim import admin_session, start_simulator  # the bench/ folder is on sys.path when run as a script

LOG = logging.getLogger("bench")
SESSION = requests.Session()  # replaced by the admin's HTTPS session once the simulator made its CA
WRITES = ("create", "update", "patch", "delete")
SPEED = 100.0
FIRST_START_PATH = ("bind", "clone_schedule", "clone", "schedule", "launch", "agent")
RESUME_PATH = ("schedule", "launch", "agent")


def sim(base: str, method: str, path: str) -> dict:
    r = SESSION.request(method, f"{base}/sim/v1{path}", timeout=30)
    r.raise_for_status()
    return r.json()


class Measure:
    def __init__(self, base: str):
        self.base = base
        self.counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.walls: dict[str, list[float]] = collections.defaultdict(list)
        self.cpu: dict[str, float] = collections.defaultdict(float)

    async def run(self, name: str, n: int, coro_factory):
        sim(self.base, "DELETE", "/requests")
        cpu0 = time.process_time()

        async def timed(i):
            t0 = time.monotonic()
            await coro_factory(i)
            self.walls[name].append(time.monotonic() - t0)

        await asyncio.gather(*(timed(i) for i in range(n)))
        self.cpu[name] = (time.process_time() - cpu0) / n
        requests_seen = sim(self.base, "GET", "/requests")["requests"]
        for key, count in requests_seen.items():
            if not key.startswith("watch "):  # the shared caches' watches are not per operation
                self.counts[name][key] += count / n


def floor_seconds(timing: dict, path: tuple[str, ...]) -> float:
    return sum(timing[step] for step in path) / SPEED


async def main(n: int):
    state = tempfile.mkdtemp(prefix="bench-spawner-")
    port = 20000 + os.getpid() % 20000
    proc = start_simulator(state, port)
    global SESSION
    SESSION = admin_session(state)
    base = f"https://127.0.0.1:{port}"
    try:
        timing = sim(base, "GET", "/timing")["timing"]
        kube = k.Kube(k.load_api_client(os.path.join(state, "kubeconfig")), LOG)
        caches = Caches(kube, m.LABEL_WORKSTATION)
        caches.start()
        await caches.wait_synced(30)
        settings = Settings(url_mode="cluster-ip", start_timeout=300)
        settings.clone_gate.limit = n  # measure the spawner, not the clone queue
        wss = [Workstation(kube, caches, names.identity(f"bench{i}"), m.MachineSpec(), settings, LOG)
               for i in range(n)]
        env = {"JUPYTERHUB_API_TOKEN": "x" * 32}
        measure = Measure(base)
        await measure.run("first start", n, lambda i: wss[i].start(env, []))
        await measure.run("stop", n, lambda i: wss[i].stop())
        await measure.run("resume", n, lambda i: wss[i].start(env, []))
        config = Config()
        config.KubeVirtSpawner.kubeconfig = os.path.join(state, "kubeconfig")
        spawners = [KubeVirtSpawner(config=config, user=types.SimpleNamespace(name=f"bench{i}", url=f"/user/bench{i}/"))
                    for i in range(n)]
        for s in spawners:
            await s.poll()  # the hub's caches list once at start-up; not part of a poll

        async def polls(i):
            for _ in range(100):
                assert await spawners[i].poll() is None

        await measure.run("poll x100", n, polls)
        await measure.run("stop again", n, lambda i: wss[i].stop())

        floors = {"first start": floor_seconds(timing, FIRST_START_PATH), "resume": floor_seconds(timing, RESUME_PATH)}
        print(f"{n} workstations at simulator speed {SPEED:g} (null guests)\n")
        for name in ("first start", "resume", "stop", "poll x100"):
            counts = measure.counts[name]
            w = sum(v for key, v in counts.items() if key.split()[0] in WRITES)
            r = sum(v for key, v in counts.items() if key.split()[0] not in WRITES)
            walls = measure.walls[name]
            print(f"{name}: {w:.1f} writes, {r:.1f} reads per workstation; wall p50 {statistics.median(walls):.2f}s "
                  f"max {max(walls):.2f}s; spawner CPU {measure.cpu[name] * 1000:.1f} ms each")
            if name in floors:
                print(f"  simulator floor {floors[name]:.2f}s -> spawner adds {statistics.median(walls) - floors[name]:.2f}s"
                      " (p50) on top")
            for key in sorted(counts):
                print(f"  {counts[key]:5.1f}  {key}")
        resume_writes = sum(v for key, v in measure.counts["resume"].items() if key.split()[0] in WRITES)
        poll_requests = sum(measure.counts["poll x100"].values())
        print(f"\ntargets: resume writes {resume_writes:.1f} (<= 3), poll requests {poll_requests:.0f} (0)")
        caches.stop()
        await kube.aclose()
        for shared in spawner_module._shared.values():
            shared["caches"].stop()
            await shared["kube"].aclose()
    finally:
        proc.terminate()
        proc.wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workstations", type=int, default=20)
    asyncio.run(main(parser.parse_args().workstations))
