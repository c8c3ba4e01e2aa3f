"""The clone queue's cost and order, fed DataVolume events directly (no cluster)."""

from __future__ import annotations

import asyncio
import types

from kubevirt_spawner.clonegate import COPY, CSI, CloneGate, strategy_kind


def caches(profiles: dict[str, str]):
    """What the gate reads of the hub's caches: the DataVolume cache's hooks and each StorageClass's
    clone strategy (from its StorageProfile)."""
    dvs = types.SimpleNamespace(on_object=[], on_reset=[], synced=False, values=lambda: [])
    return types.SimpleNamespace(dvs=dvs, clone_strategy=profiles.get)


def dv(name: str, phase: str, progress: str = "", storage_class: str = "ceph-rbd") -> dict:
    """A root disk DataVolume cloning from the golden image, as CDI reports it."""
    return {"metadata": {"namespace": f"notebook-{name}", "name": f"{name}-rootdisk"},
            "spec": {"source": {"pvc": {"namespace": "vm-images", "name": "golden"}},
                     "storage": {"storageClassName": storage_class}},
            "status": {"phase": phase, "progress": progress}}


def key(name: str) -> tuple[str, str]:
    return f"notebook-{name}", f"{name}-rootdisk"


def test_strategies_and_phases_say_what_a_clone_costs():
    """CDI's StorageProfile clone strategies (pkg/controller/storageprofile-controller.go) and the
    phases its clone populators report: only host-assisted copies are the costly kind."""
    assert strategy_kind("copy") == COPY and strategy_kind(None) == COPY
    assert strategy_kind("csi-clone") == CSI and strategy_kind("snapshot") == CSI
    gate = CloneGate()
    gate.attach(caches({"ceph-rbd": "csi-clone", "nfs": "copy"}))
    assert gate.kind_of(dv("a", "CloneInProgress")) == COPY
    assert gate.kind_of(dv("a", "CSICloneInProgress")) == CSI
    # Before CDI has started, the class's profile says; no profile known: the safe side.
    assert gate.kind_of(dv("a", "CloneScheduled")) == CSI
    assert gate.kind_of(dv("a", "CloneScheduled", storage_class="nfs")) == COPY
    assert gate.kind_of(dv("a", "CloneScheduled", storage_class="unknown")) == COPY


async def test_each_datavolume_event_is_constant_work_and_wakes_no_one_until_a_slot_frees():
    """200 starts queued behind one running copy clone; 2000 progress updates of that clone cost
    one unit of work each and wake none of the queued starts. When it finishes, the head of the
    queue goes and the others are told their new place once."""
    gate = CloneGate(copy_limit=1)
    hub = caches({"ceph-rbd": "copy"})
    gate.attach(hub)
    hub.dvs.on_reset[0]([dv("run", "CloneInProgress", "1.00%")])
    assert gate.count(COPY) == 1
    reports: dict[str, list[str]] = {}
    waiting = [asyncio.ensure_future(gate.admit(key(f"u{i}"), "ceph-rbd",
                                                lambda p, msg, i=i: reports.setdefault(f"u{i}", []).append(msg)))
               for i in range(200)]
    await asyncio.sleep(0)
    assert all(len(r) == 1 for r in reports.values()) and len(reports) == 200
    assert reports["u0"] == ["Queued for disk clone: 1 ahead (1 of 1 clones running)"]
    assert reports["u199"] == ["Queued for disk clone: 200 ahead (1 of 1 clones running)"]

    before = gate.operations
    for step in range(2000):
        hub.dvs.on_object[0](dv("run", "CloneInProgress", f"{step / 20:.2f}%"), key("run"))
    await asyncio.sleep(0)
    assert gate.operations - before == 2000  # one unit per event, whatever the queue's length
    assert all(len(r) == 1 for r in reports.values())  # nobody woken

    before = gate.operations
    gate.on_datavolume(dv("run", "Succeeded", "100.0%"), key("run"))
    await asyncio.sleep(0)
    assert waiting[0].done() and not any(w.done() for w in waiting[1:])
    assert gate.operations - before == 1 + 199  # the event, and each still queued told its place once
    assert reports["u1"][-1] == "Queued for disk clone: 1 ahead (1 of 1 clones running)"
    # The admitted start's DataVolume appears and counts from the cluster; its start ends.
    gate.on_datavolume(dv("u0", "CloneScheduled"), key("u0"))
    gate.release(key("u0"))
    assert gate.count(COPY) == 1 and not waiting[1].done()
    for w in waiting[1:]:
        w.cancel()
    await asyncio.gather(*waiting[1:], return_exceptions=True)
    assert not gate.queues[COPY]


async def test_csi_clones_have_their_own_limit_unlimited_by_default():
    gate = CloneGate(copy_limit=1)
    gate.attach(caches({"ceph-rbd": "csi-clone"}))
    gate.on_relist([dv("copying", "CloneInProgress")])
    for i in range(300):
        await asyncio.wait_for(gate.admit(key(f"c{i}"), "ceph-rbd", lambda p, msg: None), 1)
    assert gate.count(CSI) == 300 and gate.count(COPY) == 1
    limited = CloneGate(copy_limit=1, csi_limit=2)
    limited.attach(caches({"ceph-rbd": "snapshot"}))
    await limited.admit(key("a"), "ceph-rbd", lambda p, msg: None)
    await limited.admit(key("b"), "ceph-rbd", lambda p, msg: None)
    third = asyncio.ensure_future(limited.admit(key("c"), "ceph-rbd", lambda p, msg: None))
    await asyncio.sleep(0)
    assert not third.done()
    limited.release(key("a"))  # its start failed before its DataVolume existed
    await asyncio.wait_for(third, 1)


async def test_a_cancelled_start_leaves_no_place_taken():
    gate = CloneGate(copy_limit=1)
    await gate.admit(key("a"), "x", lambda p, msg: None)
    queued = asyncio.ensure_future(gate.admit(key("b"), "x", lambda p, msg: None))
    later = asyncio.ensure_future(gate.admit(key("c"), "x", lambda p, msg: None))
    await asyncio.sleep(0)
    queued.cancel()
    await asyncio.gather(queued, return_exceptions=True)
    gate.release(key("a"))
    await asyncio.wait_for(later, 1)
    assert gate.count(COPY) == 1 and list(gate.admitted) == [key("c")]
