"""What watching users' namespaces one by one costs the hub: the caches of N user namespaces.

The hub holds no namespaced right cluster-wide (deploy/rbac/): it binds its role in each user
namespace and watches each one, one watch per kind (seven). This starts the simulator in its own
process (pinned to CPU 0), makes N labelled user namespaces with one workstation's objects each
(a VM, a DataVolume, a PVC, a Service), then, in this process, starts the hub's caches and prints:
the time until they are synced, the watch connections open, this process's resident memory and
CPU for it, and how long one change takes to reach the cache (median of 50) with all of them open.
Not a pass/fail test: run `python bench/bench_namespaces.py [--namespaces 50 200 500]`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import resource
import statistics
import tempfile
import time

from kubevirt_spawner import kube as k
from kubevirt_spawner import manifests as m
from kubevirt_spawner import names
from kubevirt_spawner.reflector import Caches

from bench_sim import start_simulator  # the bench/ folder is on sys.path when run as a script

LOG = logging.getLogger("bench")


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def open_connections(port: int) -> int:
    """This process's TCP connections to the simulator's port (from /proc/net/tcp)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    count = 0
    with open("/proc/net/tcp") as table:
        for line in list(table)[1:]:
            fields = line.split()
            remote_port = int(fields[2].split(":")[1], 16)
            if remote_port == port and fields[3] == "01" and fields[9] in inodes:  # ESTABLISHED
                count += 1
    return count


async def make_namespaces(admin: k.Kube, n: int):
    spec = m.MachineSpec()

    async def one(i: int):
        ident = names.identity(f"bench{i}")
        await admin.create(k.NAMESPACE, m.namespace(ident))
        await admin.create(k.SERVICE, m.service(ident, spec))
        await admin.create(k.DV, m.root_datavolume(ident, spec))
        await admin.create(k.VM, m.virtual_machine(ident, spec))
    for start in range(0, n, 20):
        await asyncio.gather(*(one(i) for i in range(start, min(n, start + 20))))


async def measure(state: str, port: int, n: int):
    admin = k.Kube(k.load_api_client(os.path.join(state, "kubeconfig")), LOG)
    await make_namespaces(admin, n)
    kube = k.Kube(k.load_api_client(os.path.join(state, "kubeconfig")), LOG)
    before = open_connections(port)  # the admin's, which made the namespaces
    rss0, cpu0, wall0 = rss_mib(), time.process_time(), time.monotonic()
    caches = Caches(kube, m.LABEL_WORKSTATION)
    caches.start()
    await caches.wait_synced(600)
    synced, cpu = time.monotonic() - wall0, time.process_time() - cpu0
    await asyncio.sleep(2)  # the first lists' garbage gone
    connections, rss = open_connections(port) - before, rss_mib() - rss0
    # One change, seen: a label on a Service of a namespace in the middle, 50 times.
    ident = names.identity(f"bench{n // 2}")
    latencies = []

    def labelled(value: str) -> bool:
        service = caches.services.get(ident.namespace, ident.service) or {}
        return (service.get("metadata", {}).get("labels") or {}).get("bench") == value

    for i in range(50):
        began = time.monotonic()
        await admin.patch(k.SERVICE, ident.namespace, ident.service, {"metadata": {"labels": {"bench": str(i)}}})
        await caches.wait_for(lambda value=str(i): labelled(value), 10, ident.namespace)
        latencies.append(time.monotonic() - began)
    watched = sum(len(cache.members) for cache in caches.namespaced) + len(caches.cluster)
    print(f"{n:5d} namespaces: {watched:5d} watches, {connections:5d} connections open, synced in "
          f"{synced:6.1f} s using {cpu:5.1f} s of CPU, +{rss:6.1f} MiB resident, a change seen in "
          f"{statistics.median(latencies) * 1000:5.1f} ms (median of 50)", flush=True)
    caches.stop()
    await kube.aclose()
    await admin.aclose()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--namespaces", type=int, nargs="+", default=[50, 200, 500])
    args = parser.parse_args()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # a watch is a connection, on both ends
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 65536, hard))
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {1})
    for n in args.namespaces:
        with tempfile.TemporaryDirectory() as state:  # each size on a fresh cluster
            port = 20000 + (os.getpid() + n) % 20000
            proc = start_simulator(state, port)
            try:
                asyncio.run(measure(state, port, n))
            finally:
                proc.terminate()
                proc.wait()


if __name__ == "__main__":
    main()
