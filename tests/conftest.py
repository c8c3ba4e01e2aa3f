"""Shared fixtures: an in-process simulator and clients bound to it."""

from __future__ import annotations

import time
import uuid

import pytest
from kubernetes import client, config

from kubevirt_spawner.sim import SimulatorThread

FAST = 40.0  # controller speed factor in tests


def start_sim(path, **options) -> SimulatorThread:
    options.setdefault("speed", FAST)
    return SimulatorThread(str(path), **options).start()


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    s = start_sim(tmp_path_factory.mktemp("sim"))
    yield s
    s.stop()


def api_client(sim) -> client.ApiClient:
    cfg = client.Configuration()
    config.load_kube_config(config_file=sim.kubeconfig, client_configuration=cfg)
    return client.ApiClient(cfg)


@pytest.fixture(scope="module")
def kube(sim):
    return api_client(sim)


@pytest.fixture(scope="module")
def core(kube):
    return client.CoreV1Api(kube)


@pytest.fixture(scope="module")
def custom(kube):
    return client.CustomObjectsApi(kube)


@pytest.fixture
def ns(core):
    name = f"t-{uuid.uuid4().hex[:8]}"
    core.create_namespace({"metadata": {"name": name}})
    return name


def wait_for(predicate, timeout: float = 20.0, interval: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what} (last value: {last!r})")
