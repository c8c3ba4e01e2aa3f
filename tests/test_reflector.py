"""The watch caches' bookkeeping on the event loop, fed events directly (no cluster)."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
import types

import pytest

from kubevirt_spawner import kube as k
from kubevirt_spawner import reflector
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
    """An API server with the given user namespaces and nothing in them, whose authorizer lets the
    hub read a namespace `lag` seconds after its binding there was made (each API server learns of
    bindings from its own watch); `refuse_binding`: namespaces where a binding is refused (the
    admission policy's 403). Watches never end."""

    log = logging.getLogger("test-hub")

    def __init__(self, namespaces: list[str], lag: float = 0.0, refuse_binding: tuple[str, ...] = ()):
        self.namespaces, self.lag, self.refuse_binding = namespaces, lag, refuse_binding
        self.created: list[tuple[str, str, str]] = []
        self.listed: list[tuple[str, dict | None]] = []
        self.bound_at: dict[str, float] = {}
        self.reviews = 0

    async def call(self, method, path, query=None, body=None, **_):
        if path.endswith("/selfsubjectreviews"):
            self.reviews += 1
            await asyncio.sleep(0.01)
            return {"status": {"userInfo": {"username": "system:serviceaccount:jupyterhub:hub"}}}
        if path == "/api/v1/namespaces":
            self.listed.append((path, query))
            return {"metadata": {"resourceVersion": "1"},
                    "items": [{"metadata": {"name": ns, "resourceVersion": "1"}} for ns in self.namespaces]}
        if "/namespaces/" not in path:  # nodes, storage profiles
            self.listed.append((path, query))
            return {"metadata": {"resourceVersion": "1"}, "items": []}
        namespace = path.split("/namespaces/")[1].split("/")[0]
        bound = self.bound_at.get(namespace)
        if bound is None or time.monotonic() < bound + self.lag:
            raise k.KubeError(403, "Forbidden", f'User "system:serviceaccount:jupyterhub:hub" cannot list resource '
                                                f'"{path.rsplit("/", 1)[1]}" in the namespace "{namespace}"')
        self.listed.append((path, query))
        return {"metadata": {"resourceVersion": "1"}, "items": []}

    async def create(self, kind, obj):
        namespace = obj["metadata"].get("namespace", "")
        if namespace in self.refuse_binding:
            raise k.KubeError(403, "Forbidden", "the hub may only bind ClusterRole kubevirt-spawner-hub-namespaced "
                                                "to itself, in users' namespaces (notebook-...)")
        self.created.append((kind.kind, namespace, obj["metadata"]["name"]))
        self.bound_at[namespace] = time.monotonic()
        return obj

    async def watch(self, path, query, read_timeout):
        await asyncio.Event().wait()
        yield []


async def test_each_user_namespace_is_bound_then_watched_and_forgotten_when_it_goes():
    """The hub holds no namespaced right cluster-wide (deploy/rbac/): for each namespace labelled
    as this project's it binds its role there, then watches each kind there (an unbound list would
    be refused); a namespace that is deleted is no longer watched, and one that is not there has
    nothing to wait for. Who the hub is, it asks once."""
    cluster = FakeCluster(["notebook-ada", "notebook-bob"])
    c = Caches(cluster, "kubevirt-spawner.io/workstation")
    c.start()
    try:
        await c.wait_synced(5)
        assert c.refusal is None and cluster.reviews == 1
        assert sorted(cluster.created) == [
            ("RoleBinding", "notebook-ada", "kubevirt-spawner-hub:jupyterhub:hub"),
            ("RoleBinding", "notebook-bob", "kubevirt-spawner-hub:jupyterhub:hub")]
        paths = [path for path, _ in cluster.listed]
        assert ("/api/v1/namespaces", {"labelSelector": "app.kubernetes.io/managed-by=kubevirt-spawner"}) in \
            cluster.listed  # only this project's namespaces
        assert "/apis/kubevirt.io/v1/virtualmachines" not in paths  # never cluster-wide
        assert "/apis/kubevirt.io/v1/namespaces/notebook-ada/virtualmachines" in paths
        assert all(set(cache.members) == {"notebook-ada", "notebook-bob"} for cache in c.namespaced)
        assert c.synced_in("notebook-ada") and c.synced_in("notebook-cyd")  # (cyd's is not there)
        bobs = [cache.members["notebook-bob"] for cache in c.namespaced]
        c.namespaces._apply([("DELETED", {"metadata": {"name": "notebook-bob", "resourceVersion": "2"}})])
        assert not c.watches("notebook-bob") and all("notebook-bob" not in cache.members for cache in c.namespaced)
        await asyncio.sleep(0)
        assert all(r._task.cancelled() or r._task.done() for r in bobs)  # their watches ended
        assert c.lacks_namespace("notebook-bob") and not c.lacks_namespace("notebook-ada")
    finally:
        c.stop()


async def test_a_binding_the_authorizer_has_not_seen_yet_is_waited_for_not_reported():
    """A namespace bound a moment ago may still be refused by an API server whose authorizer has
    not seen the binding yet: the caches ask again and sync, and nobody is told of a refusal."""
    cluster = FakeCluster(["notebook-ada"], lag=0.3)
    c = Caches(cluster, "kubevirt-spawner.io/workstation")
    c.start()
    try:
        await c.wait_synced(5, "notebook-ada")
        assert c.refusal_for("notebook-ada") is None and c.synced_in("notebook-ada")
    finally:
        c.stop()


async def test_a_namespace_the_hub_may_not_bind_itself_in_holds_up_no_one_else(monkeypatch):
    """A labelled namespace the policy refuses to bind the hub in (not a user's, say): its own
    workstations read the refusal; the wait for all caches (a first poll after a hub restart, every
    request of the workstations service) and the other namespaces' go on."""
    monkeypatch.setattr(reflector, "BIND_SETTLE_SECONDS", 0.3)
    cluster = FakeCluster(["notebook-ada", "infra-tools"], refuse_binding=("infra-tools",))
    c = Caches(cluster, "kubevirt-spawner.io/workstation")
    c.start()
    try:
        await c.wait_synced(5)
        await c.wait_synced(5, "notebook-ada")
        with pytest.raises(k.KubeError, match='cannot list resource "virtualmachines" in the namespace "infra-tools"'):
            await c.wait_synced(5, "infra-tools")
        assert c.refusal is None
    finally:
        c.stop()


async def test_a_namespace_made_now_stays_watched_when_an_older_list_comes_in():
    """A relist taken before the hub made a namespace does not stop its watches, nor cancel the
    start that waits for them."""
    cluster = FakeCluster([])
    c = Caches(cluster, "kubevirt-spawner.io/workstation")
    c.start()
    try:
        await c.wait_synced(5)
        cluster.namespaces.append("notebook-new")  # made by the start, not yet in any list
        waiting = asyncio.ensure_future(c.watch_namespace("notebook-new"))
        await asyncio.sleep(0.001)  # binding the hub there
        assert c.watches("notebook-new") and not waiting.done()
        c._namespaces_listed([], None)  # the list from before
        await asyncio.wait_for(waiting, 5)
        await c.wait_synced(5, "notebook-new")
        assert c.watches("notebook-new") and all("notebook-new" in cache.members for cache in c.namespaced)
    finally:
        c.stop()


async def test_a_task_left_running_is_found_and_a_cancelled_one_is_not():
    """The suite's isolation (conftest's autouse `hub_state_isolated`) fails a test that leaves a
    task running: what it finds, and what it lets unwind."""
    from simtools import tasks_left_running

    forgotten = asyncio.ensure_future(asyncio.sleep(60))
    stopped = asyncio.ensure_future(asyncio.sleep(60))
    stopped.cancel()
    try:
        assert await tasks_left_running(grace=0.2) == [forgotten]
    finally:
        forgotten.cancel()
    assert await tasks_left_running(grace=0.2) == []
