"""Shared fixtures: an in-process simulator and clients bound to it."""

from __future__ import annotations

import inspect
import os
import threading
import uuid
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest
from kubernetes import client

from kubevirt_spawner import spawner as spawner_module
from kubevirt_spawner.sim.schema import SchemaRegistry, schema_not_found_message

from simtools import KeysService, api_client, start_sim, tasks_left_running

CHECKOUT = Path(__file__).resolve().parents[1]


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups (its --dist loadgroup)
def pytest_collection_modifyitems(config, items):
    """How scripts/test.sh spreads the suite over pytest-xdist's workers: each test file is one unit
    (its module-scoped simulator and hub are made once), and the tests marked `guests` (QEMU guests
    and golden image builds, which share the session's image builds) are one unit run first, on one
    worker, while the other workers take the rest."""
    items.sort(key=lambda item: item.get_closest_marker("guests") is None)  # stable: order kept
    for item in items:
        group = "guests" if item.get_closest_marker("guests") else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(group))
        if inspect.iscoroutinefunction(getattr(item, "obj", None)):
            # every test on an event loop (the hub's side runs on one) ends as a new hub; a sync test
            # gets no loop of its own (Playwright's sync API and asyncio.run want none running)
            item.fixturenames.insert(0, "hub_state_isolated")


# Lines a test wants in the run's summary (`record_property("summary", line)`): a test's own print
# is lost under pytest-xdist, but its report's properties reach the controller's hooks.
SUMMARY_PROPERTY = "summary"
_summary_lines: list[str] = []


def pytest_runtest_logreport(report):
    _summary_lines.extend(value for name, value in report.user_properties
                          if name == SUMMARY_PROPERTY and value not in _summary_lines)


def pytest_terminal_summary(terminalreporter):
    for line in _summary_lines:
        terminalreporter.write_line(line)


async def forget_hub_state():
    """A new hub, as a restarted hub process is: the API client and caches all spawners of a hub
    share (`spawner._shared`) stopped and forgotten."""
    for shared in spawner_module._shared.values():
        shared["caches"].stop()
        await shared["kube"].aclose()
    spawner_module._shared.clear()


@pytest.fixture
async def hub_state_isolated():
    """Each test on an event loop (every one: pytest_collection_modifyitems adds it) starts as a
    new hub and leaves nothing running: after it, the hub-wide shared state is forgotten, and a
    task still running on its loop (a watch, a start, an operation that would act during the next
    test) fails the test."""
    yield
    await forget_hub_state()
    leaked = await tasks_left_running()
    for task in leaked:
        task.cancel()
    assert not leaked, f"tasks left running after the test: {[t.get_coro() for t in leaked]}"


def absent_outside_data(reason: str):
    """Data that stays outside the project (../shared) is missing: the test that needs it is
    skipped with the reason, except in CI, where that is a failure."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def schemas() -> SchemaRegistry:
    """The upstream KubeVirt/CDI schemas."""
    registry = SchemaRegistry()
    if not registry.available:
        absent_outside_data(schema_not_found_message())
    return registry


@pytest.fixture(scope="session")
def design_manifests() -> Path:
    """The design document's manifests (../shared/seed/manifests beside the checkout)."""
    path = CHECKOUT.parent / "shared" / "seed" / "manifests"
    if not path.is_dir():
        absent_outside_data(f"the design document's manifests were not found at {path}")
    return path


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    s = start_sim(tmp_path_factory.mktemp("sim"))
    yield s
    s.stop()


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


@pytest.fixture
def keys_service():
    """A stand-in workstations service on loopback that answers `KeysService.answers` (path:
    (status, body)) to the token s3cret; its URL, as the spawner gives it to a guest."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), KeysService)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/services/workstations/"
    server.shutdown()
    server.server_close()
