"""Shared fixtures: an in-process simulator and clients bound to it."""

from __future__ import annotations

import uuid

import pytest
from kubernetes import client

from simtools import api_client, start_sim


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
