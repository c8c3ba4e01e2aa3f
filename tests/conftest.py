"""Shared fixtures: an in-process simulator and clients bound to it."""

from __future__ import annotations

import os
import uuid

import pytest
from kubernetes import client

from kubevirt_spawner.sim.schema import SchemaRegistry, schema_not_found_message

from simtools import api_client, start_sim


@pytest.fixture(scope="session")
def schemas() -> SchemaRegistry:
    """The upstream KubeVirt/CDI schemas. They live outside the project: a test that needs them is
    skipped, with the reason, where they are absent, except in CI, where that is a failure."""
    registry = SchemaRegistry()
    if not registry.available:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but {schema_not_found_message()}")
        pytest.skip(schema_not_found_message())
    return registry


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
