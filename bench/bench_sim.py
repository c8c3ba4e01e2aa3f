"""Simulator throughput with 500 running VMIs, the simulator pinned to one core.

Prints requests per second for GET of one VMI, LIST of all VMIs, and events per second
delivered to a fan-out of watchers. Not a pass/fail test: run `python bench/bench_sim.py`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import requests

from kubevirt_spawner.sim.auth import ADMIN_TOKEN


def admin_session(state: str) -> requests.Session:
    """HTTPS to the simulator as its admin, trusting the cluster CA in its state directory."""
    s = requests.Session()
    s.trust_env = False
    s.verify = os.path.join(state, "pki", "ca.crt")
    s.headers["Authorization"] = f"Bearer {ADMIN_TOKEN}"
    return s

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def start_simulator(state: str, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kubevirt_spawner.cli", "--log-level", "WARNING", "sim", "--state", state,
           "--port", str(port), "--speed", "100", "--guests", "null"]
    if hasattr(os, "sched_setaffinity"):
        cmd = ["taskset", "-c", "0", *cmd]
    proc = subprocess.Popen(cmd, cwd=ROOT)
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            admin_session(state).get(f"https://127.0.0.1:{port}/version", timeout=1)
            return proc
        except (requests.RequestException, OSError):  # not listening, or no CA written yet
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("the simulator did not come up")


def vm_body(i: int) -> dict:
    return {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "metadata": {"name": f"vm{i}"},
            "spec": {"runStrategy": "Always", "template": {"metadata": {"labels": {"app": f"vm{i}"}}, "spec": {
                "domain": {"resources": {"requests": {"cpu": "100m", "memory": "256Mi"}},
                           "devices": {"disks": [{"name": "root", "disk": {"bus": "virtio"}}]}},
                "volumes": [{"name": "root", "persistentVolumeClaim": {"claimName": f"disk{i}"}}]}}}}


def rate(fn, seconds: float, workers: int, state: str) -> float:
    stop = time.monotonic() + seconds
    count = [0] * workers

    def loop(w):
        s = admin_session(state)
        while time.monotonic() < stop:
            fn(s)
            count[w] += 1
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        list(pool.map(loop, range(workers)))
    return sum(count) / seconds


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--vmis", type=int, default=500)
    parser.add_argument("--watchers", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--port", type=int, default=18555)
    args = parser.parse_args()
    base = f"https://127.0.0.1:{args.port}"
    with tempfile.TemporaryDirectory() as state:
        proc = start_simulator(state, args.port)
        try:
            s = admin_session(state)
            s.post(f"{base}/api/v1/namespaces", json={"metadata": {"name": "bench"}}).raise_for_status()
            t0 = time.monotonic()
            for i in range(args.vmis):
                s.post(f"{base}/api/v1/namespaces/bench/persistentvolumeclaims", json={
                    "metadata": {"name": f"disk{i}"},
                    "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}}
                       ).raise_for_status()
                s.post(f"{base}/apis/kubevirt.io/v1/namespaces/bench/virtualmachines", json=vm_body(i)).raise_for_status()
            created = time.monotonic() - t0
            while True:
                items = s.get(f"{base}/apis/kubevirt.io/v1/namespaces/bench/virtualmachineinstances").json()["items"]
                running = sum(1 for v in items if (v.get("status") or {}).get("phase") == "Running")
                if running == args.vmis:
                    break
                if time.monotonic() - t0 > 600:
                    raise SystemExit(f"only {running} of {args.vmis} VMIs running after 600 s")
                time.sleep(0.5)
            all_running = time.monotonic() - t0
            get_rps = rate(lambda ss: ss.get(
                f"{base}/apis/kubevirt.io/v1/namespaces/bench/virtualmachineinstances/vm7").raise_for_status(),
                args.seconds, 4, state)
            list_rps = rate(lambda ss: ss.get(
                f"{base}/apis/kubevirt.io/v1/namespaces/bench/virtualmachineinstances").raise_for_status(),
                args.seconds, 2, state)
            # Watch fan-out: N watchers on all VMIs while VM labels change.
            rv = s.get(f"{base}/apis/kubevirt.io/v1/namespaces/bench/virtualmachineinstances?limit=1").json()[
                "metadata"]["resourceVersion"]
            received = [0] * args.watchers
            writes = 200

            def watcher(w):
                r = admin_session(state).get(f"{base}/apis/kubevirt.io/v1/namespaces/bench/virtualmachineinstances",
                                             params={"watch": "true", "resourceVersion": rv, "timeoutSeconds": "60"},
                                             stream=True)
                for line in r.iter_lines():
                    if line:
                        received[w] += 1
                        if received[w] >= writes:
                            break
                r.close()
            threads = [threading.Thread(target=watcher, args=(w,), daemon=True) for w in range(args.watchers)]
            for t in threads:
                t.start()
            time.sleep(1)
            t1 = time.monotonic()
            for i in range(writes):
                s.patch(f"{base}/apis/kubevirt.io/v1/namespaces/bench/virtualmachineinstances/vm{i % args.vmis}",
                        data=json.dumps({"metadata": {"labels": {"bench": str(i)}}}),
                        headers={"Content-Type": "application/merge-patch+json"}).raise_for_status()
            for t in threads:
                t.join(60)
            fanout = time.monotonic() - t1
            delivered = sum(received)
            rss = int(open(f"/proc/{proc.pid}/status").read().split("VmRSS:")[1].split()[0]) // 1024 \
                if os.path.exists(f"/proc/{proc.pid}/status") else -1
            print(f"VMIs running: {args.vmis} (created in {created:.1f} s, all Running after {all_running:.1f} s)")
            print(f"GET one VMI:      {get_rps:8.0f} requests/s")
            print(f"LIST {args.vmis} VMIs:    {list_rps:8.1f} requests/s")
            print(f"WATCH fan-out:    {args.watchers} watchers x {writes} changes = {delivered} events in "
                  f"{fanout:.2f} s ({delivered / fanout:.0f} events/s)")
            print(f"simulator RSS:    {rss} MiB (one core)")
        finally:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()
