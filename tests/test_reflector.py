"""The watch caches' bookkeeping on the event loop, fed events directly (no cluster)."""

from __future__ import annotations

import asyncio
import collections
import logging
import types

from kubevirt_spawner import kube as k
from kubevirt_spawner.reflector import LAST_APPLIED, Caches, PerNamespace, Reflector


def caches() -> Caches:
    c = Caches(types.SimpleNamespace(log=logging.getLogger("test-hub")), "app.kubernetes.io/managed-by")
    c.started = True  # fed by hand: no watch tasks
    for r in c.cluster:
        r.synced = True
    return c


def member(cache: PerNamespace, namespace: str) -> Reflector:
    """A watched namespace's reflector of one kind, synced, fed by hand."""
    r = cache.add(namespace, None)
    r.synced = True
    return r


def dv(namespace: str, name: str) -> dict:
    return {"metadata": {"namespace": namespace, "name": name, "resourceVersion": "1"}}


async def settle():
    """Let every woken waiter run its check."""
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_change_wakes_only_the_waiters_of_its_namespace():
    """200 starts waiting, each in its own namespace: 1000 changes in one namespace re-check only
    the waiter there; a Node change (cluster-scoped: a lost node matters to everyone) wakes all."""
    c = caches()
    checks: collections.Counter = collections.Counter()

    def waiting_for(namespace: str):
        def check():
            checks[namespace] += 1
            return c.dvs.get(namespace, "disk")
        return check

    waiters = [asyncio.ensure_future(c.wait_for(waiting_for(f"ns{i}"), 10, f"ns{i}")) for i in range(200)]
    await asyncio.sleep(0)
    assert set(checks.values()) == {1}
    for step in range(1000):
        member(c.dvs, "ns0")._apply([("MODIFIED", dv("ns0", f"other-{step % 3}"))])
        await settle()
    assert checks["ns0"] == 1001 and all(checks[f"ns{i}"] == 1 for i in range(1, 200))
    member(c.dvs, "ns7")._apply([("ADDED", dv("ns7", "disk"))])
    assert (await asyncio.wait_for(waiters[7], 1))["metadata"]["name"] == "disk"
    await settle()
    assert checks["ns7"] == 2 and checks["ns8"] == 1
    c.nodes._apply([("MODIFIED", {"metadata": {"name": "vm-cpu-1", "resourceVersion": "2"}})])
    await settle()
    assert checks["ns8"] == 2 and checks["ns199"] == 2
    for w in waiters:
        w.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)


async def test_a_batch_of_events_wakes_each_namespace_once_and_listeners_see_each_object():
    """A reflector of a whole cluster (as the cluster-scoped kinds are) wakes each namespace of a
    batch once."""
    seen = []
    woken: collections.Counter = collections.Counter()
    dvs = Reflector(types.SimpleNamespace(log=logging.getLogger("test-hub")), k.DV,
                    lambda namespace: woken.update([namespace]))
    dvs.on_object.append(lambda obj, key: seen.append((key, obj is not None)))
    dvs._apply([("ADDED", dv("a", "x")), ("MODIFIED", dv("a", "x")), ("ADDED", dv("b", "y")),
                ("DELETED", dv("a", "x"))])
    assert woken == {"a": 1, "b": 1}
    assert seen == [(("a", "x"), True), (("a", "x"), True), (("b", "y"), True), (("a", "x"), False)]


def test_the_caches_keep_no_server_side_bookkeeping():
    from kubevirt_spawner.reflector import slim
    obj = {"metadata": {"name": "x", "managedFields": [{"manager": "kubectl"}],
                        "annotations": {LAST_APPLIED: "{...}", "keep": "me"}}}
    assert slim(obj) == {"metadata": {"name": "x", "annotations": {"keep": "me"}}}


class FakeCluster:
    """An API server with the given user namespaces and nothing in them; watches never end."""

    log = logging.getLogger("test-hub")

    def __init__(self, namespaces: list[str]):
        self.namespaces = namespaces
        self.created: list[tuple[str, str, str]] = []
        self.listed: list[str] = []

    async def call(self, method, path, query=None, body=None, **_):
        if path.endswith("/selfsubjectreviews"):
            return {"status": {"userInfo": {"username": "system:serviceaccount:jupyterhub:hub"}}}
        self.listed.append(path)
        items = [{"metadata": {"name": ns, "resourceVersion": "1"}} for ns in self.namespaces] \
            if path == "/api/v1/namespaces" else []
        return {"metadata": {"resourceVersion": "1"}, "items": items}

    async def create(self, kind, obj):
        self.created.append((kind.kind, obj["metadata"].get("namespace", ""), obj["metadata"]["name"]))
        return obj

    async def watch(self, path, query, read_timeout):
        await asyncio.Event().wait()
        yield []


async def test_each_user_namespace_is_bound_then_watched_and_forgotten_when_it_goes():
    """The hub holds no namespaced right cluster-wide (deploy/rbac/): for each namespace labelled
    as this project's it binds its role there, then watches each kind there; a namespace that is
    deleted is no longer watched, and one that is not there has nothing to wait for."""
    cluster = FakeCluster(["notebook-ada", "notebook-bob"])
    c = Caches(cluster, "kubevirt-spawner.io/workstation")
    c.start()
    try:
        await c.wait_synced(5)
        assert sorted(cluster.created) == [
            ("RoleBinding", "notebook-ada", "kubevirt-spawner-hub:jupyterhub:hub"),
            ("RoleBinding", "notebook-bob", "kubevirt-spawner-hub:jupyterhub:hub")]
        assert "/apis/kubevirt.io/v1/virtualmachines" not in cluster.listed  # never cluster-wide
        assert "/apis/kubevirt.io/v1/namespaces/notebook-ada/virtualmachines" in cluster.listed
        assert all(set(cache.members) == {"notebook-ada", "notebook-bob"} for cache in c.namespaced)
        assert c.synced_in("notebook-ada") and c.synced_in("notebook-cyd")  # (cyd's is not there)
        c.namespaces._apply([("DELETED", {"metadata": {"name": "notebook-bob", "resourceVersion": "2"}})])
        assert not c.watches("notebook-bob") and all("notebook-bob" not in cache.members for cache in c.namespaced)
        assert c.lacks_namespace("notebook-bob") and not c.lacks_namespace("notebook-ada")
    finally:
        c.stop()
