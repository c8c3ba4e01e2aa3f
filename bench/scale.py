"""Scale: N workstations through the real hub, proxy and simulator (a benchmark, not a test).

Starts the simulator (null guests: one tiny responder answers Jupyter's /api for every VMI), the
proxy and a real JupyterHub with the demo's config, then: N users start at once, a quiet minute,
all stop at once, all resume at once. For each phase it prints the wall time and the per-user
p50/p95, the API requests per workstation by verb and resource, the hub's CPU seconds and the
spawner's share of them (bench/scale_probe.py samples the hub), the hub's RSS per workstation,
the hub's own `jupyterhub_event_loop_interval_seconds` histogram, and every slow event-loop
callback (> 20 ms, asyncio debug mode) with whether it was the spawner's.

    python bench/scale.py --users 200            # 500 works on a 2-core machine
    python bench/scale.py --users 500 --results bench/RESULTS.md
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

from kubevirt_spawner import demo

from bench_sim import admin_session  # the bench/ folder is on sys.path when run as a script

BENCH = Path(__file__).resolve().parent
EXTRA_CONFIG = """
import asyncio, sys
sys.path.insert(0, {bench!r})
import scale_probe
scale_probe.Probe({probe!r}).install()
c.JupyterHub.concurrent_spawn_limit = 0  # all at once: the point of the exercise
c.JupyterHub.active_server_limit = 0
c.JupyterHub.log_level = "WARN"
c.KubeVirtSpawner.start_timeout = 900
c.KubeVirtSpawner.clone_stall_timeout = 600
c.KubeVirtSpawner.http_timeout = 300
# Small machines, so that 500 fit on the simulated nodes (the scheduler counts CPU and memory).
c.KubeVirtSpawner.profile_list = [{{"display_name": "scale", "slug": "scale", "default": True,
                                   "kubevirt_override": {{"cpu_guarantee": 0.1, "mem_guarantee": "128M"}}}}]
"""
LOOP_METRIC = "jupyterhub_event_loop_interval_seconds"


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def proc_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Bench:
    def __init__(self, users: int, speed: float, quiet: float, workdir: Path):
        self.n = users
        self.quiet = quiet
        self.users = [f"u{i:04d}" for i in range(users)]
        self.workdir = workdir
        cluster = workdir / "cluster"
        cluster.mkdir(parents=True)
        self.sim_log = open(workdir / "sim.log", "wb")
        self.hub = self.proxy = None
        self.pinned = "not pinned (one CPU)"
        self.sim = subprocess.Popen([sys.executable, "-m", "kubevirt_spawner.cli", "--log-level", "WARNING", "sim",
                                     "--state", str(cluster), "--speed", str(speed), "--guests", "null"],
                                    stdout=self.sim_log, stderr=subprocess.STDOUT)
        try:
            self._start_hub(cluster)
        except BaseException:
            self.close()  # nothing left running behind a failed start
            raise
        self.results: list[str] = []

    def _start_hub(self, cluster: Path):
        workdir = self.workdir
        deadline = time.monotonic() + 60
        while not (cluster / "sim.json").exists():
            if time.monotonic() > deadline or self.sim.poll() is not None:
                raise SystemExit(f"the simulator did not start (log: {workdir / 'sim.log'})")
            time.sleep(0.2)
        self.sim_url = json.loads((cluster / "sim.json").read_text())["url"]
        self.sim_http = admin_session(str(cluster))
        self.probe_path = workdir / "probe.jsonl"
        extra = workdir / "extra_config.py"
        extra.write_text(EXTRA_CONFIG.format(bench=str(BENCH), probe=str(self.probe_path)))
        self.settings = demo.HubSettings.create(workdir / "hub", str(cluster / "kubeconfig"), extra_config=str(extra))
        self.proxy = demo.start_proxy(self.settings, workdir / "proxy.log")
        self.hub = demo.start_hub(self.settings, workdir / "hub.log")
        self._pin()
        self.http = requests.Session()
        self.http.headers["Authorization"] = f"token {self.settings.admin_token}"
        adapter = requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=128)
        self.http.mount("http://", adapter)

    def close(self):
        for proc in (self.hub, self.proxy):
            demo.stop_process(proc, 60)
        demo.stop_process(self.sim, 30)
        self.sim_log.close()

    # ------------------------------------------------------------ hub and simulator
    def api(self, method: str, path: str, **kw) -> requests.Response:
        return self.http.request(method, f"{self.settings.url}/hub/api{path}", timeout=600, **kw)

    def users_in_state(self, state: str) -> set[str]:
        names: set[str] = set()
        offset = 0
        while True:
            r = self.api("GET", f"/users?state={state}&offset={offset}&limit=200",
                         headers={"Accept": "application/jupyterhub-pagination+json"})
            r.raise_for_status()
            page = r.json()
            names.update(u["name"] for u in page["items"])
            nxt = (page.get("_pagination") or {}).get("next")
            if not nxt:
                return names
            offset = nxt["offset"]

    def sim_requests(self, reset: bool = False) -> dict[str, int]:
        r = self.sim_http.request("DELETE" if reset else "GET", f"{self.sim_url}/sim/v1/requests", timeout=30)
        r.raise_for_status()
        return r.json()["requests"]

    def loop_histogram(self) -> dict[str, float]:
        r = self.http.get(f"{self.settings.url}/hub/metrics", timeout=60)
        r.raise_for_status()
        out = {}
        for line in r.text.splitlines():
            m = re.match(rf'^{LOOP_METRIC}_bucket{{le="([^"]+)"}} ([0-9.e+]+)$', line)
            if m:
                out[m.group(1)] = float(m.group(2))
        return out

    def probe_lines(self) -> list[dict]:
        if not self.probe_path.exists():
            return []
        return [json.loads(line) for line in self.probe_path.read_text().splitlines() if line.strip()]

    # ------------------------------------------------------------ phases
    def storm(self, name: str, method: str, done_state: str, want_in_state: bool, timeout: float = 1800):
        """Fire one request per user at once, then wait until every user is (or is no longer) in
        `done_state`; the per-user time is from its request to the first poll that shows it."""
        before = self._snapshot()
        sent: dict[str, float] = {}
        t0 = time.monotonic()

        def fire(user):
            sent[user] = time.monotonic()
            r = self.api(method, f"/users/{user}/server")
            if r.status_code not in (201, 202, 204):
                raise RuntimeError(f"{method} {user}: {r.status_code} {r.text[:200]}")

        with concurrent.futures.ThreadPoolExecutor(64) as pool:
            futures = [pool.submit(fire, u) for u in self.users]
            finished: dict[str, float] = {}
            while len(finished) < self.n:
                if time.monotonic() - t0 > timeout:
                    raise SystemExit(f"{name}: only {len(finished)} of {self.n} done after {timeout:.0f}s")
                now = time.monotonic()
                state = self.users_in_state(done_state)
                for user in self.users:
                    if user not in finished and user in sent and (user in state) == want_in_state:
                        finished[user] = now
                time.sleep(0.5)
            for f in futures:
                f.result()
        wall = time.monotonic() - t0
        self._report(name, before, wall, [finished[u] - sent[u] for u in self.users])

    def quiet_minute(self):
        before = self._snapshot()
        time.sleep(self.quiet)
        self._report(f"quiet {self.quiet:.0f} s", before, self.quiet, [])

    def _snapshot(self) -> dict:
        self.sim_requests(reset=True)
        lines = self.probe_lines()
        return {"cpu": proc_cpu(self.hub.pid), "t": time.time(), "probe": len(lines),
                "loop": self.loop_histogram(), "last": next((x for x in reversed(lines) if "main_samples" in x), None)}

    def _report(self, name: str, before: dict, wall: float, latencies: list[float]):
        requests_seen = self.sim_requests()
        hub_cpu = proc_cpu(self.hub.pid) - before["cpu"]
        lines = self.probe_lines()
        new = lines[before["probe"]:]
        last = next((x for x in reversed(lines) if "main_samples" in x), None)
        first = before["last"]
        out = [f"### {name}", ""]
        if latencies:
            out.append(f"- wall {wall:.1f} s; per user p50 {percentile(latencies, 0.5):.1f} s, "
                       f"p95 {percentile(latencies, 0.95):.1f} s, max {max(latencies):.1f} s")
        per = max(1, self.n) if latencies else 1
        unit = "per workstation" if latencies else "in total"
        main = {k: v for k, v in requests_seen.items() if v / per >= 0.01}
        reqs = ", ".join(f"{k} {v / per:.2f}" for k, v in sorted(main.items(), key=lambda kv: -kv[1]))
        rest = sum(v for k, v in requests_seen.items() if k not in main)
        if rest:  # the caches' first lists and watches, a renewed watch
            reqs += f"; and {rest} list/watch requests of the caches in all"
        out.append(f"- API requests {unit}: {reqs or 'none'}")
        if first and last:
            events = collections.Counter(last.get("watch_events") or {})
            events.subtract(first.get("watch_events") or {})
            seen = ", ".join(f"{k} {v / per:.1f}" for k, v in events.most_common() if v > 0)
            out.append(f"- watch events {unit}: {seen or 'none'}")
        if first and last:
            d_cpu = {k: last["cpu"].get(k, 0) - first["cpu"].get(k, 0) for k in last["cpu"]}
            d_samples = {k: last["main_samples"].get(k, 0) - first["main_samples"].get(k, 0)
                         for k in ("ours", "other", "debug", "idle")}
            busy = d_samples["ours"] + d_samples["other"] + d_samples["debug"]
            main = d_cpu.get("main", 0)
            main_ours = main * (d_samples["ours"] / busy if busy else 0)
            debug = main * (d_samples["debug"] / busy if busy else 0)
            threads = d_cpu.get("watches", 0) + d_cpu.get("client", 0)
            ours = threads + main_ours
            measured = hub_cpu - d_cpu.get("probe", 0) - debug
            share = ours / measured if measured > 0 else 0
            out.append(f"- hub CPU {measured:.1f} s (left out: the probe's {d_cpu.get('probe', 0):.1f} s and asyncio "
                       f"debug mode's {debug:.1f} s); spawner {ours:.1f} s = {share:.0%}: on the event loop "
                       f"{main_ours:.1f} s of its {main - debug:.1f} s (its code, its TLS connections to the API "
                       f"server and their parsing), in threads {threads:.1f} s")
            if latencies:
                out.append(f"- hub RSS {last['rss'] / 2**20:.0f} MiB")
        loop = self._loop_diff(before["loop"], self.loop_histogram())
        if loop:
            out.append(f"- event loop intervals ({LOOP_METRIC}): {loop}")
        if first and last:
            functions = collections.Counter(last.get("functions") or {})
            functions.subtract(first.get("functions") or {})
            top = [f"{where} {n}" for where, n in functions.most_common(6) if n > 0]
            if top:
                out.append(f"- where the loop was in the spawner's code (samples): {'; '.join(top)}")
        if first and last and "full_collections" in last:
            count = last["full_collections"][0] - (first.get("full_collections") or [0, 0, 0])[0]
            total = last["full_collections"][1] - (first.get("full_collections") or [0, 0, 0])[1]
            out.append(f"- full garbage collections of the hub's heap: {count}, {total * 1000:.0f} ms in all, the "
                       f"longest of the run so far {last['full_collections'][2] * 1000:.0f} ms")
        slow = [x for x in new if "slow" in x]
        # The spawner's: most of the loop's samples meanwhile were in its code, and the callback
        # used more than 20 ms of CPU (not merely waited for a CPU or the GIL) outside a full
        # garbage collection (a pause of the whole hub, set off by whichever allocation came next).
        gc_slow = [x for x in slow if x.get("gc", 0) > x["seconds"] / 2]
        ours_slow = [x for x in slow if x["samples"] and x["ours"] / x["samples"] > 0.5 and x["cpu"] > 0.02
                     and x not in gc_slow]
        starved = [x for x in slow if x["cpu"] <= 0.02]
        out.append(f"- slow callbacks (> 20 ms): {len(slow)}, of them the spawner's: {len(ours_slow)} "
                   f"({len(starved)} of all used under 20 ms of CPU: they waited for a CPU or the GIL; "
                   f"{len(gc_slow)} were mostly a full garbage collection)")
        for x in gc_slow:
            if x["samples"] and x["ours"] / x["samples"] > 0.5:
                out.append(f"  - in the spawner's code, {x['seconds'] * 1000:.0f} ms of which a full garbage "
                           f"collection {x['gc'] * 1000:.0f} ms: {x['slow'][:100]}")
        for x in ours_slow[:10]:
            out.append(f"  - {x['seconds'] * 1000:.0f} ms ({x['cpu'] * 1000:.0f} ms CPU) in {x['our_functions']}: "
                       f"{x['slow'][:120]}")
        others = collections.Counter(re.sub(r"0x[0-9a-f]+|\d+", "#", x["slow"])[:90] for x in slow
                                     if x not in ours_slow)
        for what, count in others.most_common(3):
            out.append(f"  - not ours, {count}x: {what}")
        text = "\n".join(out)
        print(text + "\n", flush=True)
        self.results.append(text)

    @staticmethod
    def _loop_diff(before: dict, after: dict) -> str:
        if not after:
            return ""
        diff = {le: after[le] - before.get(le, 0) for le in after}
        total = diff.get("+Inf", 0)
        if not total:
            return ""
        over = {le: total - n for le, n in diff.items() if le in ("0.05", "0.1", "0.5", "1.0")}
        return f"{total:.0f} samples; above 50 ms {over.get('0.05', 0) / total:.1%}, above 100 ms " \
               f"{over.get('0.1', 0) / total:.1%}, above 500 ms {over.get('0.5', 0) / total:.1%}"

    def run(self):
        r = self.api("POST", "/users", json={"usernames": self.users})
        assert r.status_code in (201, 409), r.text
        baseline_rss = self._hub_rss()
        self.storm(f"start: {self.n} first starts at once", "POST", "ready", True)
        rss = self._hub_rss()
        self.results.append(f"- hub RSS {rss / 2**20:.0f} MiB with {self.n} running, "
                            f"{(rss - baseline_rss) / self.n / 1024:.0f} KiB per workstation "
                            f"(before the starts {baseline_rss / 2**20:.0f} MiB)")
        print(self.results[-1] + "\n")
        self.quiet_minute()
        self.storm(f"stop: {self.n} stops at once", "DELETE", "active", False)
        self.storm(f"resume: {self.n} starts of stopped machines at once", "POST", "ready", True)
        self.storm(f"stop again: {self.n} stops at once", "DELETE", "active", False)

    def _pin(self):
        """With two CPUs or more, the hub gets the last CPU to itself and everything else (the
        simulator, the proxy, this driver) shares the others: the hub's numbers then measure the
        hub, not its neighbours."""
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            return
        hub_cpu, rest = {cpus[-1]}, set(cpus[:-1])
        for pid in (self.sim.pid, self.proxy.pid, os.getpid()):
            for tid in os.listdir(f"/proc/{pid}/task"):
                os.sched_setaffinity(int(tid), rest)
        for tid in os.listdir(f"/proc/{self.hub.pid}/task"):
            os.sched_setaffinity(int(tid), hub_cpu)
        self.pinned = f"hub on CPU {cpus[-1]}, simulator, proxy and driver on CPU {','.join(map(str, cpus[:-1]))}"

    def _hub_rss(self) -> int:
        with open(f"/proc/{self.hub.pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def machine() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:  # not Linux
        model = ""
    return f"{os.cpu_count()} CPUs ({model or platform.processor()}), Python {platform.python_version()}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=int, default=200)
    parser.add_argument("--speed", type=float, default=10.0, help="simulator speed factor (default 10)")
    parser.add_argument("--quiet", type=float, default=60.0, help="seconds of the quiet phase")
    parser.add_argument("--results", help="append the results to this Markdown file")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="bench-scale-"))
    print(f"work directory (logs): {workdir}\n", flush=True)
    bench = Bench(args.users, args.speed, args.quiet, workdir)
    try:
        bench.run()
    finally:
        bench.close()
    header = (f"## {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {args.users} users, simulator speed "
              f"{args.speed:g}\n\nMachine: {machine()}; {bench.pinned}.\n")
    if args.results:
        with open(args.results, "a") as f:
            f.write("\n" + header + "\n" + "\n\n".join(bench.results) + "\n")
    print(header)


if __name__ == "__main__":
    main()
