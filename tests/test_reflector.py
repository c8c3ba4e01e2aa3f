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
