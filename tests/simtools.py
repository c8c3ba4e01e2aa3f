"""Helpers shared by the test suites: an in-process simulator and clients bound to it."""

from __future__ import annotations

import time

import requests
from kubernetes import client, config

from kubevirt_spawner.sim import SimulatorThread

FAST = 40.0  # controller speed factor in tests


def start_sim(path, **options) -> SimulatorThread:
    options.setdefault("speed", FAST)
    return SimulatorThread(str(path), **options).start()


def api_client(sim) -> client.ApiClient:
    cfg = client.Configuration()
    config.load_kube_config(config_file=sim.kubeconfig, client_configuration=cfg)
    return client.ApiClient(cfg)


def wait_for(predicate, timeout: float = 20.0, interval: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what} (last value: {last!r})")


def answers(url: str) -> bool:
    """Whether `url` answers 200 now; a server that is not listening (yet) is a plain no."""
    try:
        return requests.get(url, timeout=1).status_code == 200
    except requests.RequestException:  # refused, reset or timed out
        return False


def sim_api(sim, method: str, path: str, body: dict | None = None) -> dict:
    """A call to the simulator's /sim/v1 control API (faults, timing, request counts)."""
    r = requests.request(method, f"{sim.url}/sim/v1{path}", json=body, timeout=30)
    assert r.status_code < 400, r.text
    return r.json()
