"""The workstation lifecycle against the simulator, without a hub: request budgets, caches,
concurrency, clone admission, GPUs, timeouts and profile changes."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import logging
import os
import re
import time
import types
import uuid
from datetime import datetime, timedelta, timezone

import pytest
from jupyterhub.spawner import SpawnException
from traitlets import TraitError
from traitlets.config import Config

from kubevirt_spawner import kube as k
from kubevirt_spawner import manifests as m
from kubevirt_spawner import names
from kubevirt_spawner import spawner as spawner_module
from kubevirt_spawner.objects import condition, field_value
from kubevirt_spawner.operations import (
    Operation,
    Operations,
    defer_delete_during_operation,
    refuse_start_during_operation,
)
from kubevirt_spawner.reflector import Caches
from kubevirt_spawner.spawner import KubeVirtSpawner
from kubevirt_spawner.workstation import CloneGate, Settings, Workstation, WorkstationError
from kubevirt_spawner.workstation.base import ANNOTATION_SPEC_HASH

from simtools import http, hub_kubeconfig, sim_api, site_policy, start_sim, wait_for

GPU = "nvidia.com/A100-PCIE-40GB"
GPU_PLACEMENT = dict(node_selector={"accelerator.example.com/mode": "vfio"},
                     tolerations=({"key": "workload.example.com/kubevirt", "operator": "Exists",
                                   "effect": "NoSchedule"},))
WRITES = ("create", "update", "patch", "delete")
LOG = logging.getLogger("test-hub")  # stands in for the hub's logger


@pytest.fixture(scope="module")
def wsim(tmp_path_factory):
    s = start_sim(tmp_path_factory.mktemp("ws"), guest_mode="null")
    # The hub's requests are made as the hub: Zero-to-JupyterHub's ServiceAccount bound to
    # deploy/rbac/, so a step that needs a permission the hub lacks fails here.
    s.hub_kubeconfig = hub_kubeconfig(s, tmp_path_factory.mktemp("ws-hub") / "hub.kubeconfig")
    yield s
    s.stop()


@pytest.fixture
async def env(wsim):
    kube = k.Kube(k.load_api_client(wsim.hub_kubeconfig), LOG)
    admin = k.Kube(k.load_api_client(wsim.kubeconfig), LOG)  # the cluster admin: what a test sets up
    caches = Caches(kube, m.LABEL_WORKSTATION)
    caches.start()
    await caches.wait_synced(30)
    yield types.SimpleNamespace(kube=kube, admin=admin, caches=caches, sim=wsim)
    caches.stop()
    await kube.aclose()
    await admin.aclose()


@contextlib.contextmanager
def user_error(reason: str, match: str):
    """A failure the user can act on: a JupyterHub SpawnException with this reason, whose sentence
    JupyterHub shows as it is."""
    with pytest.raises(SpawnException, match=match) as caught:
        yield caught
    assert isinstance(caught.value, WorkstationError)
    assert caught.value.reason == reason
    assert caught.value.jupyterhub_message == caught.value.message


def counts(sim) -> dict:
    return sim_api(sim, "GET", "/requests")["requests"]


def diff(before: dict, after: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


def writes(delta: dict) -> dict:
    return {k: v for k, v in delta.items() if k.split()[0] in WRITES}


async def ensure_namespace(env, name: str):
    """A user namespace as the hub makes one (labelled as this project's), watched by the hub's
    caches: it has bound itself there."""
    try:
        await env.admin.create(k.NAMESPACE, {"metadata": {"name": name, "labels": {
            "app.kubernetes.io/managed-by": m.MANAGED_BY}}})
    except k.KubeError as err:
        if err.status != 409:
            raise
    await env.caches.watch_namespace(name)
    await env.caches.wait_synced(10, name)


def workstation(env, user, spec=None, user_created: str = "", **settings) -> Workstation:
    """`user_created`: the account's creation time, as the hub knows it (a test without: unknown)."""
    settings.setdefault("url_mode", "cluster-ip")
    return Workstation(env.kube, env.caches, names.identity(user, user_created=user_created), spec or m.MachineSpec(),
                       Settings(**settings), LOG)


async def test_first_start_resume_and_stop_use_few_requests(env):
    ws = workstation(env, "rita")
    before = counts(env.sim)
    url = await ws.start({"JUPYTERHUB_API_TOKEN": "t1"}, [])
    first = diff(before, counts(env.sim))
    assert url.startswith("http://127.") and url.endswith(":8888")
    assert writes(first) == {"create namespaces": 1, "create rolebindings": 1, "create secrets": 1, "create datavolumes": 1,
                             "create virtualmachines": 1, "create services": 1, "update virtualmachines/start": 1}
    # Waits read the caches: the only reads are the first lists of the new namespace's caches.
    assert {k for k in first if k.startswith(("get", "list"))} == {
        f"list {kind}" for kind in ("virtualmachines", "virtualmachineinstances", "datavolumes",
                                    "persistentvolumeclaims", "services", "virtualmachinesnapshots", "events")}

    before = counts(env.sim)
    await ws.stop()
    assert writes(diff(before, counts(env.sim))) == {"update virtualmachines/stop": 1}
    assert ws.status() == "stopped" and ws.vm is not None and ws.rootdisk_pvc["status"]["phase"] == "Bound"

    before = counts(env.sim)
    await ws.start({"JUPYTERHUB_API_TOKEN": "t2"}, [])
    resume = diff(before, counts(env.sim))
    assert writes(resume) == {"update secrets": 1, "update virtualmachines/start": 1}
    assert sum(writes(resume).values()) <= 3
    await ws.stop()


async def test_no_wait_is_unbounded_when_the_cluster_cannot_be_read(wsim, caplog):
    """A hub whose caches cannot fill (every LIST of VMs fails): a start gives up after its
    start_timeout and a stop after its stop_timeout, each with one sentence and a log line naming
    the cache and its error; poll says "running" (never "stopped" on a guess) after
    k8s_api_retry_timeout."""
    sim_api(wsim, "PUT", "/faults/api", {"verb": "list", "resource": "virtualmachines", "rate": 1, "code": 500})
    kube = k.Kube(k.load_api_client(wsim.kubeconfig), LOG, retry_timeout=0.3)
    caches = Caches(kube, m.LABEL_WORKSTATION)
    try:
        blind = types.SimpleNamespace(kube=kube, caches=caches, sim=wsim)
        with user_error("cluster-unavailable", "The hub cannot read the state of your workstation from the cluster"):
            # (8 s: on a loaded machine the failed first answer took longer than 2 s, and the log line
            # said "no answer yet" instead of the cluster's error)
            await asyncio.wait_for(workstation(blind, "una", start_timeout=8).start({}, []), 20)
        assert any("caches are not synced after 8s: " in r.getMessage()
                   and "virtualmachines in notebook-una (500 InternalError" in r.getMessage() for r in caplog.records)
        with user_error("cluster-unavailable", "Try again in a few minutes"):
            await asyncio.wait_for(workstation(blind, "una", stop_timeout=1).stop(), 10)

        c = Config()
        c.KubeVirtSpawner.kubeconfig = wsim.kubeconfig
        c.KubeVirtSpawner.k8s_api_retry_timeout = 1.0
        spawner = KubeVirtSpawner(config=c, user=types.SimpleNamespace(name="una", url="/user/una/"))
        spawner.load_state({"workstation": names.identity("una").to_state()})
        assert await asyncio.wait_for(spawner.poll(), 10) is None
        assert any("cannot tell whether the workstation of" in r.getMessage() for r in caplog.records)
    finally:
        sim_api(wsim, "DELETE", "/faults/api")
        caches.stop()
        await kube.aclose()


async def test_poll_reads_the_cache_only_and_waits_for_it_after_a_restart(env, wsim):
    ws = workstation(env, "sam")
    await ws.start({}, [])
    c = Config()
    c.KubeVirtSpawner.kubeconfig = wsim.kubeconfig
    # A fresh hub whose caches cannot list VMIs yet: poll must wait, not say "stopped".
    sim_api(wsim, "PUT", "/faults/api", {"verb": "list", "resource": "virtualmachineinstances", "rate": 1,
                                         "code": 500})
    try:
        spawner = KubeVirtSpawner(config=c, user=types.SimpleNamespace(name="sam", url="/user/sam/"))
        spawner.load_state({"workstation": ws.ident.to_state()})
        poll = asyncio.ensure_future(spawner.poll())
        await asyncio.sleep(1.0)
        assert not poll.done()
    finally:
        sim_api(wsim, "DELETE", "/faults/api")
    assert await asyncio.wait_for(poll, 30) is None
    # Every reflector lists again after the fault, each after its own backoff (other namespaces'
    # too): that is background, not poll, so the count starts once all have.
    hub_caches = spawner_module._shared[next(iter(spawner_module._shared))]["caches"]
    await hub_caches.wait_synced(60)

    before = counts(wsim)
    for _ in range(50):
        assert await spawner.poll() is None
    # (a reflector may renew its watch meanwhile: that is background, not poll)
    assert {k: v for k, v in diff(before, counts(wsim)).items() if not k.startswith("watch ")} == {}

    # Lost state: the labels find the workstation again.
    spawner2 = KubeVirtSpawner(config=c, user=types.SimpleNamespace(name="sam", url="/user/sam/"))
    assert await spawner2.poll() is None
    assert spawner2.get_state()["workstation"] == ws.ident.to_state()

    await ws.stop()
    await hub_caches.wait_for(lambda: hub_caches.vmis.get(ws.ident.namespace, ws.ident.vm) is None, 10)
    assert await spawner.poll() == 0


async def test_concurrent_starts_act_once(env):
    a = workstation(env, "tom")
    b = workstation(env, "tom")
    before = counts(env.sim)
    urls = await asyncio.gather(a.start({}, []), b.start({}, []))
    assert urls[0] == urls[1]
    w = writes(diff(before, counts(env.sim)))
    assert w["create datavolumes"] == 1 and w["create virtualmachines"] == 1 and w["update virtualmachines/start"] == 1
    await a.stop()


@pytest.fixture
async def copy_clones(env):
    """CDI clones into ceph-rbd with host-assisted copies (its StorageProfile says `copy`), as it
    does on storage without CSI clones (pkg/controller/storageprofile-controller.go)."""
    profile = k.STORAGE_PROFILE

    async def strategy(value):
        await env.admin.patch(profile, None, "ceph-rbd", {"spec": {"cloneStrategy": value}})
        expected = value or "csi-clone"
        await env.caches.wait_for(lambda: env.caches.clone_strategy("ceph-rbd") == expected, 10)

    await strategy("copy")
    yield
    await strategy(None)


async def test_clone_admission_queues_copy_clones_beyond_the_limit(env, copy_clones):
    gate = CloneGate(copy_limit=2)
    messages: dict[str, list[str]] = {}
    most = 0

    def running_clones():
        return sum(1 for dv in env.caches.dvs.values() if dv["metadata"]["namespace"].startswith("notebook-q")
                   and (dv.get("status") or {}).get("phase") not in ("Succeeded", "Failed"))

    async def watch():
        nonlocal most
        while True:
            most = max(most, running_clones())
            await env.caches.next_change(1)

    watcher = asyncio.ensure_future(watch())
    users = [f"q{i}" for i in range(5)]
    wss = [workstation(env, u, clone_gate=gate) for u in users]
    await asyncio.gather(*(ws.start({}, [], lambda p, msg, u=u: messages.setdefault(u, []).append(msg))
                           for ws, u in zip(wss, users, strict=True)))
    watcher.cancel()
    assert most <= 2
    queued = [msg for u in users for msg in messages[u] if msg.startswith("Queued for disk clone:")]
    assert any("Queued for disk clone: 2 ahead" in q or "Queued for disk clone: 3 ahead" in q for q in queued), queued
    await asyncio.gather(*(ws.stop(now=True) for ws in wss))


async def test_no_free_gpu_fail_fast_explains_and_leaves_nothing_running(env):
    holder = workstation(env, "uma", m.MachineSpec(gpus=((GPU, 2),), **GPU_PLACEMENT))
    await holder.start({}, [])
    ws = workstation(env, "vic", m.MachineSpec(gpus=((GPU, 1),), **GPU_PLACEMENT), gpu_unavailable="fail")
    with user_error("gpu-unavailable", f"No {GPU} is free right now"):
        await ws.start({}, [])
    assert ws.vmi is None and ws.vm["spec"]["runStrategy"] == "Halted"

    waiting = workstation(env, "vic", m.MachineSpec(gpus=((GPU, 1),), **GPU_PLACEMENT), start_timeout=3)
    seen = []
    with user_error("timeout", f"did not start within 3 seconds while waiting for a free {GPU}"):
        await waiting.start({}, [], lambda p, msg: seen.append(msg))
    assert f"Waiting for a node with a free {GPU}: all are in use" in seen
    await env.caches.wait_for(lambda: waiting.vmi is None, 10)
    assert waiting.vm["spec"]["runStrategy"] == "Halted"
    await holder.stop()
    await waiting.start({}, [])  # the GPU is free again
    await waiting.stop()


async def test_profile_changes_replace_the_machine_and_treat_disk_sizes_as_minimums(env):
    """GPU -> CPU leaves no GPU, GPU placement or old limits behind (the template is replaced, not
    merged); a larger disk is kept, a smaller one grows; both directions start."""
    gpu = m.MachineSpec(cpu="4", memory="8Gi", cpu_limit="8", memory_limit="16Gi", gpus=((GPU, 1),),
                        root_disk_size="80Gi", workspace_disk_size="20Gi", profile="gpu", profile_version="1",
                        **GPU_PLACEMENT)
    ws = workstation(env, "wes", gpu)
    await ws.start({}, [])
    await ws.stop()
    seen: list[str] = []
    cpu = workstation(env, "wes", m.MachineSpec(cpu="2", memory="4Gi", root_disk_size="60Gi",
                                                workspace_disk_size="10Gi", profile="cpu", profile_version="1"))
    await cpu.start({}, [], lambda p, msg: seen.append(msg))
    assert "Keeping your 80Gi system disk (the profile asks for at least 60Gi)" in seen
    assert "Keeping your 20Gi workspace disk (the profile asks for at least 10Gi)" in seen
    template = cpu.vm["spec"]["template"]["spec"]
    assert template["domain"]["resources"] == {"requests": {"cpu": "2", "memory": "4Gi"}}
    assert "gpus" not in template["domain"]["devices"]
    assert "nodeSelector" not in template and "tolerations" not in template
    assert cpu.vm["metadata"]["annotations"][m.ANNOTATION_PROFILE] == "cpu"
    assert field_value(cpu.vmi, "status.nodeName") != "vm-gpu-pci-1"
    assert cpu.rootdisk_pvc["spec"]["resources"]["requests"]["storage"] == "80Gi"
    await cpu.stop()
    bigger = workstation(env, "wes", dataclasses.replace(gpu, root_disk_size="100Gi", workspace_disk_size="30Gi",
                                                         profile_version="2"))
    seen.clear()
    await bigger.start({}, [], lambda p, msg: seen.append(msg))
    assert "Growing your system disk from 80Gi to 100Gi" in seen
    assert "Growing your workspace disk from 20Gi to 30Gi" in seen
    assert bigger.vm["spec"]["template"]["spec"]["domain"]["devices"]["gpus"] == [{"name": "gpu0", "deviceName": GPU}]
    assert bigger.vm["spec"]["template"]["spec"]["domain"]["resources"]["limits"] == {"cpu": "8", "memory": "16Gi"}
    assert bigger.rootdisk_pvc["spec"]["resources"]["requests"]["storage"] == "100Gi"
    await bigger.stop()


async def test_a_stop_during_a_slow_shutdown_is_fine_and_a_start_waits_for_it(env):
    """KubeVirt takes a second stop only to shorten the grace period, and refuses a start while the
    old VMI's phase is not final, even while it is being deleted (pkg/virt-api/rest/lifecycle.go):
    the spawner waits the shutdown out instead of failing."""
    ws = workstation(env, "tess", m.MachineSpec(termination_grace_period=600))
    await ws.start({}, [])
    guest = f"/vmis/{ws.ident.namespace}/{ws.ident.vm}/guest"
    sim_api(env.sim, "PUT", guest, {"shutdownSeconds": 80})  # 2 s at the tests' speed
    try:
        await env.admin.vm_action(ws.ident.namespace, ws.ident.vm, "stop")  # someone else stopped it
        await env.caches.wait_for(lambda: ws.vmi is not None and ws.vmi["metadata"].get("deletionTimestamp"), 10)
        await ws.stop()  # answered 409 "shorter graceperiod": a stop is under way, so wait for it
        assert ws.vmi is None

        await ws.start({}, [])
        await env.admin.vm_action(ws.ident.namespace, ws.ident.vm, "stop")
        await env.caches.wait_for(lambda: ws.vmi is not None and ws.vmi["metadata"].get("deletionTimestamp"), 10)
        old_uid = ws.vmi["metadata"]["uid"]
        seen: list[str] = []
        await ws.start({}, [], lambda p, msg: seen.append(msg))
        assert "Waiting for your workstation to finish shutting down" in seen
        assert ws.status() == "running" and ws.vmi["metadata"]["uid"] != old_uid
    finally:
        sim_api(env.sim, "DELETE", guest)
    await ws.stop(now=True)


async def test_a_missing_root_disk_is_reported_never_silently_recreated(env):
    ws = workstation(env, "xena")
    await ws.start({}, [])
    await ws.stop()
    await env.admin.delete(k.DV, ws.ident.namespace, ws.ident.rootdisk)
    await env.caches.wait_for(lambda: ws.rootdisk is None and ws.rootdisk_pvc is None, 20)
    before = counts(env.sim)
    with user_error("disk-missing", "Your system disk .* is missing"):
        await ws.start({}, [])
    assert "create datavolumes" not in diff(before, counts(env.sim))


async def test_a_stuck_clone_fails_the_start_with_cdis_words_and_does_not_hold_up_the_queue(env):
    """CDI never turns a clone that cannot proceed Failed: it keeps its phase and says why in Warning
    events (pkg/controller/datavolume/clone-controller-base.go, pvc-clone-controller.go). A start
    gives up after `clone_stall_timeout` without progress, quotes CDI, and the clone no longer
    takes a place in the clone queue: the next user's clone runs."""
    sim_api(env.sim, "POST", "/clones/fail-next", {"count": 1})
    gate = CloneGate(csi_limit=1)
    ws = workstation(env, "yuri", clone_gate=gate, clone_stall_timeout=2)
    with user_error("clone-failed", "Cloning your system disk from ubuntu-24-04-cuda-golden has made no progress "
                                    r"for \d+ seconds \(ProvisioningFailed: failed to provision volume"):
        await ws.start({}, [])
    assert ws.vmi is None and field_value(ws.rootdisk, "status.phase") == "CSICloneInProgress"
    other = workstation(env, "yuko", clone_gate=gate)
    seen: list[str] = []
    await asyncio.wait_for(other.start({}, [], lambda p, msg: seen.append(msg)), 60)
    assert not [m for m in seen if m.startswith("Queued")]
    assert "Cloning your system disk from ubuntu-24-04-cuda-golden (copy-on-write)" in seen
    await other.stop(now=True)


async def test_csi_clones_are_not_queued_by_default(env):
    """On Ceph RBD CDI clones with CSI clones (copy-on-write; the StorageProfile's cloneStrategy
    `csi-clone`): a login rush of first starts does not queue behind a limit meant for copies."""
    gate = CloneGate()  # copy limit 4, CSI unlimited
    users = [f"rush{i}" for i in range(6)]
    seen: list[str] = []
    wss = [workstation(env, u, clone_gate=gate) for u in users]
    await asyncio.gather(*(ws.start({}, [], lambda p, msg: seen.append(msg)) for ws in wss))
    assert not [msg for msg in seen if msg.startswith("Queued")], seen
    await asyncio.gather(*(ws.stop(now=True) for ws in wss))


async def test_an_object_of_someone_else_is_never_adopted(env):
    """The hub never GETs single objects: an object that exists is looked for in the caches (which
    see everything with this project's label) and else listed by name; it must carry this
    workstation's raw user and server names."""
    ident = names.identity("zoe")
    await ensure_namespace(env, ident.namespace)
    await env.admin.create(k.SERVICE, {"metadata": {"name": ident.service, "namespace": ident.namespace},
                                      "spec": {"ports": [{"port": 80}]}})
    ws = workstation(env, "zoe")
    with user_error("name-taken", f"Service {ident.namespace}/{ident.service} already exists and is not this "
                                  "workstation's, so nothing was done"):
        await ws.start({}, [])


async def test_an_object_of_its_own_missing_from_a_lagging_cache_is_adopted(env, monkeypatch):
    """A create repeated after a timeout may find its first attempt's object before the watch
    brings it: listed by name, it is recognised as this workstation's, not called foreign."""
    ws = workstation(env, "lex")
    await ensure_namespace(env, ws.ident.namespace)
    await env.admin.create(k.SERVICE, m.service(ws.ident, ws.spec))
    monkeypatch.setattr(env.caches.services, "get", lambda namespace, name: None)  # the watch lags
    before = counts(env.sim)
    found = await ws._ensure(k.SERVICE, m.service(ws.ident, ws.spec), env.caches.services)
    assert found["metadata"]["name"] == ws.ident.service
    # (a reflector may renew a watch meanwhile: that is background, not this create)
    assert {key: n for key, n in diff(before, counts(env.sim)).items() if not key.startswith("watch ")} == {
        "create services": 1, "list services": 1}


async def test_retire_deletes_the_machine_and_keeps_disks_and_snapshots(env):
    from kubevirt_spawner.workstation import SNAPSHOT
    ws = workstation(env, "ivy", m.MachineSpec(workspace_disk_size="10Gi"))
    await ws.start({}, [])
    await ws.stop()
    await ws.set_reclaim_policy([ws.rootdisk_pvc])  # (Delete: a restore cut off in its window)
    assert ("Bound", "Delete") in volumes_of(env, ws.ident.namespace).values()
    snap = {"apiVersion": "snapshot.kubevirt.io/v1beta1", "kind": "VirtualMachineSnapshot",
            "metadata": {"name": "ivy-before-upgrade", "namespace": ws.ident.namespace,
                         "labels": m.labels(ws.ident, "snapshot"), "annotations": m.identity_annotations(ws.ident)},
            "spec": {"source": {"apiGroup": "kubevirt.io", "kind": "VirtualMachine", "name": ws.ident.vm}}}
    await env.admin.create(SNAPSHOT, snap)
    before = counts(env.sim)
    kept = await ws.retire()
    assert sorted(kept) == ["DataVolume/ivy-rootdisk", "DataVolume/ivy-workspace",
                            "PersistentVolumeClaim/ivy-rootdisk", "PersistentVolumeClaim/ivy-workspace",
                            "VirtualMachineSnapshot/ivy-before-upgrade"]
    deleted = {key for key in diff(before, counts(env.sim)) if key.startswith("delete")}
    assert deleted == {"delete virtualmachines", "delete services", "delete secrets"}
    # kept disks are kept: their volumes at Retain, even one a cut-off restore left at Delete
    assert sorted(volumes_of(env, ws.ident.namespace).values()) == [("Bound", "Retain")] * 2
    for kind, name in ((k.DV, "ivy-rootdisk"), (k.PVC, "ivy-workspace"), (SNAPSHOT, "ivy-before-upgrade")):
        obj = await env.admin.get(kind, ws.ident.namespace, name)
        assert obj["metadata"]["labels"][m.LABEL_RETAINED] == "true"
        assert obj["metadata"]["annotations"][m.ANNOTATION_RETAIN_UNTIL] > "2026"
    await env.caches.wait_for(lambda: ws.vm is None and ws.service is None, 10)

    # The user comes back before the retention ends: the same disk, no longer marked as retained.
    again = workstation(env, "ivy", m.MachineSpec(workspace_disk_size="10Gi"))
    before = counts(env.sim)
    await again.start({}, [])
    assert "create datavolumes" not in diff(before, counts(env.sim))
    dv = await env.admin.get(k.DV, ws.ident.namespace, "ivy-rootdisk")
    assert m.LABEL_RETAINED not in dv["metadata"]["labels"]
    await again.stop()


async def test_a_cluster_that_keeps_refusing_is_an_error_for_the_admin_not_a_user_failure(env):
    """Not the user's to act on: no SpawnException, so JupyterHub logs the traceback and counts an
    error; the user still reads one sentence."""
    kube = k.Kube(k.load_api_client(env.sim.kubeconfig), LOG, retry_timeout=0.5)
    sim_api(env.sim, "PUT", "/faults/api", {"verb": "create", "resource": "datavolumes", "rate": 1, "code": 500})
    try:
        ws = Workstation(kube, env.caches, names.identity("quinn"), m.MachineSpec(), Settings(url_mode="cluster-ip"),
                         LOG)
        with pytest.raises(k.KubeError) as caught:
            await ws.start({}, [])
    finally:
        sim_api(env.sim, "DELETE", "/faults/api")
        await kube.aclose()
    assert not isinstance(caught.value, SpawnException)
    assert caught.value.status == 500 and str(caught.value).endswith(
        f"(POST /apis/cdi.kubevirt.io/v1beta1/namespaces/{ws.ident.namespace}/datavolumes)")
    # the cause in words, not the API server's raw answer (which the log has)
    assert caught.value.jupyterhub_message.startswith("The cluster refused to start your workstation (the cluster's "
                                                      "API server did not complete the request). Try again")
    assert "etcdserver" not in caught.value.jupyterhub_message
    assert ws.vmi is None


async def test_throttling_waits_as_long_as_the_server_asks(env):
    """A 429 carries Retry-After (the API server's max-in-flight and priority-and-fairness filters,
    staging/src/k8s.io/apiserver/pkg/server/filters/maxinflight.go, send 1 s): the client waits at
    least that long instead of its own shorter backoff."""
    import time
    rule = {"verb": "create", "resource": "configmaps", "rate": 1, "code": 429}
    sim_api(env.sim, "PUT", "/faults/api", rule)
    before = counts(env.sim).get("create configmaps", 0)
    t0 = time.monotonic()
    call = asyncio.ensure_future(env.admin.call("POST", "/api/v1/namespaces/default/configmaps", None,
                                               {"metadata": {"name": f"throttled-{int(t0 * 1000)}"}}))
    try:
        while counts(env.sim).get("create configmaps", 0) == before:  # one 429 answered
            await asyncio.sleep(0.02)
    finally:
        sim_api(env.sim, "DELETE", "/faults/api")
    await call
    assert time.monotonic() - t0 >= 0.95  # without Retry-After the backoff would have retried within 0.2 s


async def test_a_restart_that_may_have_landed_is_not_sent_again(env):
    """Unlike start and stop (a repeat is refused with 409), a repeated restart would restart the
    machine twice: after a 5xx it is not sent again."""
    ws = workstation(env, "rory")
    await ws.start({}, [])
    sim_api(env.sim, "PUT", "/faults/api", {"verb": "update", "resource": "virtualmachines/restart", "rate": 1,
                                            "code": 500})
    before = counts(env.sim)
    try:
        with pytest.raises(k.KubeError) as caught:
            await env.admin.vm_action(ws.ident.namespace, ws.ident.vm, "restart")
    finally:
        sim_api(env.sim, "DELETE", "/faults/api")
    assert caught.value.status == 500
    assert diff(before, counts(env.sim)).get("update virtualmachines/restart") == 1
    await ws.stop(now=True)


async def test_a_node_blip_blocks_a_second_attach_but_only_kubevirts_verdict_loses_the_machine(env):
    """A node that stops answering (Ready=Unknown) may come back: the machine is not lost (poll
    would have the hub halt it) until KubeVirt gives up on the node's virt-handler and labels it
    kubevirt.io/schedulable=false (pkg/virt-controller/watch/node/node.go); a start is refused
    meanwhile, since the disk may still be in use there."""
    ws = workstation(env, "nia")
    await ws.start({}, [])
    node = field_value(ws.vmi, "status.nodeName")
    saved = sim_api(env.sim, "GET", "/timing")["timing"]["heartbeat_timeout"]
    sim_api(env.sim, "PUT", "/timing", {"heartbeat_timeout": 4000})  # 100 s at the tests' speed
    try:
        sim_api(env.sim, "POST", f"/nodes/{node}/lose")
        await env.caches.wait_for(lambda: ws.vmi is not None and env.caches.on_unreachable_node(ws.vmi), 10)
        assert ws.status() == "running"
        with user_error("lost-node", f"still attached to a machine on node {node}"):
            ws._refuse_double_attach()
        sim_api(env.sim, "POST", f"/nodes/{node}/recover")
        sim_api(env.sim, "PUT", "/timing", {"heartbeat_timeout": 40})  # 1 s
        sim_api(env.sim, "POST", f"/nodes/{node}/lose")
        await env.caches.wait_for(lambda: ws.status() == "lost", 20)
    finally:
        sim_api(env.sim, "POST", f"/nodes/{node}/recover")
        sim_api(env.sim, "PUT", "/timing", {"heartbeat_timeout": saved})
    await env.caches.wait_for(lambda: ws.status() == "running", 20)
    await ws.stop(now=True)


async def test_the_service_url_uses_the_cluster_domain(env):
    ws = workstation(env, "nell", url_mode="dns", cluster_domain="corp.example")
    assert ws.url() == f"http://{ws.ident.service}.{ws.ident.namespace}.svc.corp.example:8888"


async def test_the_caches_keep_no_managed_fields(env):
    """managedFields (server-side apply bookkeeping) are dropped from cached objects."""
    ident = names.identity("mona")
    await ensure_namespace(env, ident.namespace)
    fields = [{"manager": "kubectl", "operation": "Update", "apiVersion": "v1", "fieldsType": "FieldsV1",
               "fieldsV1": {"f:metadata": {"f:labels": {}}}}]
    await env.admin.create(k.SERVICE, {"metadata": {"name": "mona-extra", "namespace": ident.namespace,
                                                   "labels": {m.LABEL_WORKSTATION: ident.slug},
                                                   "managedFields": fields},
                                      "spec": {"ports": [{"port": 80}]}})
    cached = await env.caches.wait_for(lambda: env.caches.services.get(ident.namespace, "mona-extra"), 10)
    assert "managedFields" not in cached["metadata"] and cached["metadata"]["labels"]


async def test_api_errors_and_throttling_are_retried(env):
    sim_api(env.sim, "PUT", "/faults/api", {"verb": "create", "resource": "*", "rate": 0.25, "code": 500})
    sim_api(env.sim, "PUT", "/faults/api", {"verb": "update", "resource": "*", "rate": 0.25, "code": 429})
    try:
        ws = workstation(env, "jay")
        before = counts(env.sim)
        await ws.start({}, [])
        await ws.stop()
    finally:
        sim_api(env.sim, "DELETE", "/faults/api")
    w = writes(diff(before, counts(env.sim)))
    assert sum(w.values()) > 8  # some requests were answered with 500/429 and sent again
    assert [dv["metadata"]["name"] for dv in env.caches.dvs.values() if dv["metadata"]["namespace"] == "notebook-jay"] \
        == ["jay-rootdisk"]


@pytest.mark.parametrize("delay", [0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5])
async def test_a_cancelled_start_leaves_the_machine_stopped(env, delay):
    """Cancelled at any moment (provisioning, the start request, mid-clone, booting), a start
    leaves the VM Halted and no machine running."""
    ws = workstation(env, f"kim{int(delay * 100)}")
    saved = sim_api(env.sim, "GET", "/timing")["timing"]["csi_clone"]
    sim_api(env.sim, "PUT", "/timing", {"csi_clone": 30})  # the clone takes 0.75 s: the later delays are mid-clone
    try:
        task = asyncio.ensure_future(ws.start({}, []))
        await asyncio.sleep(delay)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        sim_api(env.sim, "PUT", "/timing", {"csi_clone": saved})
    # The caller is released at once; the start's clean-up (a forced stop) goes on: join it.
    await asyncio.wait_for(ws.stop(now=True), 60)
    # Long enough for a clone and a boot at this speed: would the start carry on behind our back?
    await asyncio.sleep(2.5)
    assert ws.vmi is None
    assert ws.vm is None or ws.vm["spec"]["runStrategy"] == "Halted"


async def test_stop_asks_the_cluster_even_before_the_cache_shows_the_vm(env, monkeypatch):
    ws = workstation(env, "lou")
    await ensure_namespace(env, ws.ident.namespace)
    for cache in (env.caches.vms, env.caches.vmis):  # the caches lag behind
        monkeypatch.setattr(cache.members[ws.ident.namespace], "_apply", lambda changes: None)
    vm = m.virtual_machine(ws.ident, ws.spec)
    vm["spec"]["runStrategy"] = "Always"
    await env.admin.create(k.VM, vm)
    assert ws.vm is None
    await ws.stop(now=True)
    stored = await env.admin.get(k.VM, ws.ident.namespace, ws.ident.vm)
    assert stored["spec"]["runStrategy"] == "Halted"


async def test_snapshots_say_how_consistent_they_are(env):
    """KubeVirt's snapshot indications (pkg/storage/snapshot/snapshot.go): a running VM with its
    guest agent is frozen first (application-consistent), without the agent it is crash-consistent,
    a stopped VM's snapshot is offline (no indications at all)."""
    ws = workstation(env, "sana")
    await ws.start({}, [])
    await env.caches.wait_for(lambda: condition(ws.vmi, "AgentConnected"), 30)
    frozen = await ws.take_snapshot("with-agent", note="before the CUDA upgrade")
    assert frozen["consistency"] == "application-consistent" and frozen["ready"]
    assert frozen["note"] == "before the CUDA upgrade" and frozen["object"] == f"{ws.ident.slug}.with-agent"
    sim_api(env.sim, "PUT", f"/vmis/{ws.ident.namespace}/{ws.ident.vm}/agent", {"connected": False})
    await env.caches.wait_for(lambda: not condition(ws.vmi, "AgentConnected"), 30)
    assert (await ws.take_snapshot("no-agent"))["consistency"] == "crash-consistent"
    await ws.stop()
    assert (await ws.take_snapshot("stopped"))["consistency"] == "offline"
    listed = ws.snapshots()  # oldest first (timestamps have whole seconds: ties are in name order)
    assert {s["name"] for s in listed} == {"with-agent", "no-agent", "stopped"}
    assert [s["created"] for s in listed] == sorted(s["created"] for s in listed)


async def test_snapshot_names_are_checked_and_kept_apart(env):
    ws = workstation(env, "tilo")
    with user_error("no-machine", "start it once"):
        await ws.take_snapshot("early")
    await ws.start({}, [])
    await ws.stop()
    before = counts(env.sim)
    for bad in ("", "Upper", "-dash", "x" * 41, "with space", "dots.are.not"):
        with user_error("bad-input", "A snapshot name has 1 to 40 lower-case letters"):
            await ws.take_snapshot(bad)
    with user_error("bad-input", "at most 500 characters"):
        await ws.take_snapshot("long-note", note="n" * 501)
    assert writes(diff(before, counts(env.sim))) == {}  # refused before anything was sent
    await ws.take_snapshot("one")
    with user_error("snapshot-exists", "A snapshot named one exists already"):
        await ws.take_snapshot("one")
    await ws.delete_snapshot("one")
    await env.caches.wait_for(lambda: not ws.snapshots(), 10)
    with user_error("no-snapshot", "There is no snapshot named one"):
        await ws.delete_snapshot("one")


class LocalServer:
    """The hub's view of a server, for lifecycle tests without a hub: the machine itself."""

    def __init__(self, ws: Workstation):
        self.ws = ws
        self.calls: list[str] = []

    async def running(self) -> bool:
        return self.ws.status() in ("running", "starting")

    async def stop(self):
        self.calls.append("stop")
        await self.ws.stop()

    async def start(self):
        self.calls.append("start")
        await self.ws.start({}, [])


def write_markers(ws: Workstation, env, *paths: str) -> str:
    root = env.sim.cluster.volume_dir(ws.rootdisk_pvc)
    for marker in paths:
        os.makedirs(os.path.dirname(os.path.join(root, marker)), exist_ok=True)
        with open(os.path.join(root, marker), "w") as f:
            f.write("changed")
    return root


async def test_restore_puts_the_system_back_in_place_and_the_disk_stays_the_users(env):
    """A VirtualMachineRestore with volumeRestorePolicy InPlace and volumeOwnershipPolicy None
    (staging/src/kubevirt.io/api/snapshot/v1beta1/types.go, pkg/storage/snapshot/restore.go): the
    root disk keeps its name, comes back adopted by its DataVolume and gets no VM owner, so
    deleting the VM later keeps it. A snapshot of the state before is taken first; a running
    machine is stopped through the hub and started again."""
    ws = workstation(env, "rhea")
    await ws.start({}, [])
    await ws.take_snapshot("clean")
    write_markers(ws, env, "etc/broken.conf", "opt/new-cuda/VERSION")
    server = LocalServer(ws)
    ops = Operations(ws, server)
    with user_error("no-snapshot", "There is no snapshot named dirty"):
        await ops.begin_restore("dirty", by="rhea")
    old_uid = ws.rootdisk_pvc["metadata"]["uid"]
    op = await ops.begin_restore("clean", by="rhea")
    assert op.was_running and op.steps == ["snapshot", "stop", "restore", "start"]
    with user_error("operation-running", re.escape("already being restored (step 1 of 4: taking a safety snapshot)")):
        await ops.begin_reset(by="rhea")
    with user_error("operation-running",
                    re.escape("being restored (step 1 of 4: taking a safety snapshot); it starts by itself")):
        refuse_start_during_operation(ws)
    done = await ops.run(op)
    assert done.state == "done" and server.calls == ["stop", "start"]
    assert Operation.from_vm(ws.vm).state == "done"
    pvc = await env.caches.wait_for(lambda: ws.rootdisk_pvc if ws.rootdisk_pvc["metadata"]["uid"] != old_uid
                                    else None, 30, ws.ident.namespace)
    root = env.sim.cluster.volume_dir(pvc)
    assert not os.path.exists(os.path.join(root, "etc/broken.conf"))
    assert not os.path.exists(os.path.join(root, "opt/new-cuda/VERSION"))
    assert os.path.exists(os.path.join(root, "etc/os-release"))  # the system from the golden image is back
    owners = await env.caches.wait_for(lambda: [o["kind"] for o in ws.rootdisk_pvc["metadata"].get(
        "ownerReferences") or []] or None, 30, ws.ident.namespace)
    assert owners == ["DataVolume"]  # adopted again; never the VM
    assert [s["name"] for s in ws.snapshots() if s["name"].startswith("before-restore-")]
    assert ws.status() in ("running", "starting")  # started again, as it was running before
    await ws.stop(now=True)


def machine_identity(vm: dict) -> tuple:
    """What KubeVirt gave the machine and the guest sees (its firmware UUID is cloud-init's
    instance-id): firmware UUID and serial, PCI topology, chipset."""
    template = vm["spec"]["template"]
    return (field_value(template, "spec.domain.firmware.uuid"), field_value(template, "spec.domain.firmware.serial"),
            (field_value(template, "metadata.annotations") or {}).get("kubevirt.io/pci-topology-version"),
            field_value(template, "spec.architecture"), field_value(template, "spec.domain.machine.type"))


async def test_a_profile_switch_and_a_restore_keep_the_machines_firmware_identity(env):
    """Issue 47, item 2. KubeVirt's VM mutator gives a new VM a random firmware UUID and serial on
    create only (vm-mutator.go setFirmwareDefaultsIfEmpty); a template replaced whole without them
    got the name's UUID from virt-controller (firmware.go Sync) and no serial, so cloud-init
    (instance-id = the firmware UUID, pkg/cloud-init/cloud-init.go) saw a new instance and made
    new SSH host keys. A profile switch and the first start after a restore (which replaces the
    template: the restored VM has no spec hash) keep what the cluster set."""
    ws = workstation(env, "fern", m.MachineSpec(profile="big", profile_version="1"))
    await ws.start({}, [])
    before = machine_identity(ws.vm)
    assert uuid.UUID(before[0]).version == 4 and before[1] and before[2] == "v3", before
    assert field_value(ws.vmi, "spec.domain.firmware") == ws.vm["spec"]["template"]["spec"]["domain"]["firmware"]
    await ws.take_snapshot("kept")
    await ws.stop()
    switched = workstation(env, "fern", m.MachineSpec(cpu="2", memory="4Gi", profile="small", profile_version="1"))
    await switched.start({}, [])
    assert switched.vm["spec"]["template"]["spec"]["domain"]["resources"]["requests"]["cpu"] == "2"
    assert machine_identity(switched.vm) == before
    assert field_value(switched.vmi, "spec.domain.firmware.uuid") == before[0]
    ops = Operations(switched, LocalServer(switched))
    done = await ops.run(await ops.begin_restore("kept", by="fern"))
    assert done.state == "done" and done.steps[-1] == "start"  # (started again: it was running)
    assert switched.vm["metadata"]["annotations"][ANNOTATION_SPEC_HASH]  # the start replaced the restored template
    assert machine_identity(switched.vm) == before
    assert field_value(switched.vmi, "spec.domain.firmware.uuid") == before[0]
    await switched.stop(now=True)


def volumes_of(env, namespace: str) -> dict[str, tuple[str, str]]:
    """The namespace's claims' volumes: name -> (phase, reclaim policy)."""
    items = http(env.sim).get(f"{env.sim.url}/api/v1/persistentvolumes").json()["items"]
    return {v["metadata"]["name"]: (v["status"]["phase"], v["spec"]["persistentVolumeReclaimPolicy"])
            for v in items if v["spec"]["claimRef"]["namespace"] == namespace}


async def test_disks_the_hub_deletes_on_purpose_take_their_volumes_with_them(env):
    """The class keeps a deleted claim's volume, Released, with its RBD image (reclaimPolicy Retain;
    pkg/controller/volume/persistentvolume/pv_controller.go), against mistakes. A restore in place
    (KubeVirt deletes the claims it replaces, pkg/storage/snapshot/restore.go) and a reset are no
    mistakes: the hub sets those volumes to Delete first, and none is left Released."""
    ws = workstation(env, "vera", m.MachineSpec(workspace_disk_size="10Gi"))
    await ws.start({}, [])
    await ws.stop()
    first = volumes_of(env, ws.ident.namespace)
    assert sorted(first.values()) == [("Bound", "Retain")] * 2
    await ws.take_snapshot("clean")
    await ws.restore_snapshot("clean", "vera-restore")
    await ws.delete_root_disk()
    await ws.clone_root_disk()
    await env.caches.wait_for(lambda: ws.rootdisk_pvc and field_value(ws.rootdisk_pvc, "status.phase") == "Bound", 30,
                              ws.ident.namespace)
    now = await asyncio.to_thread(wait_for, lambda: (v := volumes_of(env, ws.ident.namespace)) and
                                  not set(v) & set(first) and len(v) == 2 and v)
    assert sorted(now.values()) == [("Bound", "Retain")] * 2  # the new disks are kept against mistakes


@contextlib.contextmanager
def restores_fail(env, message: str):
    """Every restore reports `message` as restore.go's doUpdateError does (no Failure), until the end."""
    sim_api(env.sim, "PUT", "/faults/restores", {"error": message})
    try:
        yield
    finally:
        sim_api(env.sim, "DELETE", "/faults/restores")


async def stopped_with_snapshot(env, user: str) -> Workstation:
    ws = workstation(env, user, m.MachineSpec(workspace_disk_size="10Gi"))
    await ws.start({}, [])
    await ws.stop()
    await ws.take_snapshot("clean")
    return ws


async def volume_snapshots(env, ws: Workstation, *claims: str) -> list[str]:
    """The VolumeSnapshots of `claims` (the volumes of the workstation's snapshots)."""
    found = (await env.admin.list(k.VOLUME_SNAPSHOT, ws.ident.namespace))["items"]
    return [vs["metadata"]["name"] for vs in found if field_value(vs, "spec.source.persistentVolumeClaimName") in claims]


def locked_by(ws: Workstation) -> str | None:
    return (ws.vm.get("status") or {}).get("restoreInProgress")


async def test_a_restore_the_webhook_refuses_gives_the_volumes_retain_back(env):
    """KubeVirt's webhook refuses a restore while another of the VM is not complete
    (pkg/storage/admitters/vmrestore.go). The volumes were marked Delete for the restore in place
    just before: they are kept again (Retain), since no restore will replace their claims."""
    ws = await stopped_with_snapshot(env, "rolf")
    snap = ws.snapshot_for_restore("clean")
    with restores_fail(env, "VolumeSnapshot vs-x not ready"):
        await env.admin.create(k.RESTORE, m.virtual_machine_restore(ws.ident, snap["object"], "someone-elses"))
        with pytest.raises(k.KubeError, match='VirtualMachineRestore \\"someone-elses\\" in progress'):
            await ws.restore_snapshot("clean", "rolf-restore", timeout=30)
        assert sorted(volumes_of(env, ws.ident.namespace).values()) == [("Bound", "Retain")] * 2
        await env.admin.delete(k.RESTORE, ws.ident.namespace, "someone-elses")


async def test_a_restore_that_stalls_before_replacing_a_disk_is_cancelled(env):
    """restore.go reports most errors only in Ready (doUpdateError) and tries again without end: no
    Failure comes. When the hub gives up and no claim was replaced yet, the restore goes (its
    finalizer unlocks the VM: handleVMRestoreDeletion), the volumes are kept again, the user reads
    that nothing changed, and the workstation starts."""
    ws = await stopped_with_snapshot(env, "sten")
    with restores_fail(env, "VolumeSnapshot vs-x not ready"):
        with user_error("restore-failed", "VolumeSnapshot vs-x not ready.*cancelled before any disk was replaced"):
            await ws.restore_snapshot("clean", "sten-restore", timeout=3)
    assert sorted(volumes_of(env, ws.ident.namespace).values()) == [("Bound", "Retain")] * 2
    found = await env.admin.list(k.RESTORE, ws.ident.namespace)
    assert [r["metadata"]["name"] for r in found["items"] if not r["metadata"].get("deletionTimestamp")] == []
    await env.caches.wait_for(lambda: locked_by(ws) is None, 30, ws.ident.namespace)
    refuse_start_during_operation(ws)  # nothing refuses a start
    await ws.start({}, [])
    assert ws.status() in ("running", "starting")
    await ws.stop(now=True)


async def test_a_restore_stuck_after_replacing_a_disk_says_what_an_admin_must_do(env):
    """In place, restore.go deletes a claim before it makes the new one from the VolumeSnapshot
    (reconcileVolumeRestores, createRestorePVC: "missing volumeSnapshot"): a missing snapshot then
    stalls the restore with the VM locked (restoreInProgress) and no Failure. The restore stays
    (fixing the cause lets it finish); the operation's record, and every start, say which restore
    an admin must let finish, in one sentence, never KubeVirt's "Cannot update VM runStrategy"."""
    ws = await stopped_with_snapshot(env, "tova")
    for vs in await volume_snapshots(env, ws, ws.ident.rootdisk):
        await env.admin.delete(k.VOLUME_SNAPSHOT, ws.ident.namespace, vs)
    ops = Operations(ws, LocalServer(ws), safety_snapshot=False, timeout=5)
    op = await ops.begin_restore("clean", by="tova")
    sentence = f"until an administrator fixes that so that VirtualMachineRestore {ws.ident.namespace}/tova-restore-"
    with user_error("restore-stuck", "stopped half-way .*missing volumeSnapshot .*" + re.escape(sentence)):
        await ops.run(op)
    recorded = Operation.from_vm(ws.vm)
    assert recorded.state == "failed" and recorded.restore in recorded.error and recorded.error.startswith("Restoring")
    assert locked_by(ws) == recorded.restore
    assert (await env.admin.get(k.RESTORE, ws.ident.namespace, recorded.restore)) is not None  # left to finish
    with user_error("restore-stuck", re.escape(recorded.error)):
        refuse_start_during_operation(ws)
    # What the admin does when the cause cannot be fixed: the restore goes, KubeVirt unlocks the VM
    await env.admin.delete(k.RESTORE, ws.ident.namespace, recorded.restore)
    await env.caches.wait_for(lambda: locked_by(ws) is None, 30, ws.ident.namespace)
    refuse_start_during_operation(ws)


async def test_a_workstation_deleted_mid_restore_is_deleted_when_the_restore_ends_and_keeps_its_disks(env, wsim):
    """In place, KubeVirt deletes the claims it replaces before it makes the restored ones
    (pkg/storage/snapshot/restore.go reconcileVolumeRestores): deleting the VM in between cuts the
    restore off with the disks gone (the CI soak found this, seed 311067). JupyterHub forgets a
    named server whose delete_forever fails (jupyterhub/user.py _delete_spawner only logs it), so
    the spawner's delete, asked mid-restore, leaves the machine whole and is carried out when the
    restore ends: the disks come back restored and are kept, marked retained, their volumes Retain;
    no start meanwhile."""
    ws = await stopped_with_snapshot(env, "dora")
    write_markers(ws, env, "etc/after-the-snapshot")
    old_uid = ws.rootdisk_pvc["metadata"]["uid"]
    ops = Operations(ws, LocalServer(ws), safety_snapshot=False, timeout=60)
    op = await ops.begin_restore("clean", by="dora")
    saved = sim_api(env.sim, "GET", "/timing")["timing"]["restore"]
    sim_api(env.sim, "PUT", "/timing", {"restore": 200})  # the VM's rewrite 5 s after the new claims
    try:
        run = asyncio.ensure_future(ops.run(op))
        await env.caches.wait_for(lambda: locked_by(ws) and (ws.rootdisk_pvc or {}).get("metadata", {}).get(
            "uid") not in (None, old_uid), 30, ws.ident.namespace)  # the claims replaced, the restore not done
        c = Config()
        c.KubeVirtSpawner.kubeconfig = wsim.kubeconfig
        spawner = KubeVirtSpawner(config=c, user=types.SimpleNamespace(name="dora", url="/user/dora/"))
        await spawner.delete_forever()  # what the hub calls, and forgets the server after, however it ends
        await env.caches.wait_for(lambda: m.ANNOTATION_DELETE_REQUESTED in ws.vm["metadata"]["annotations"], 10,
                                  ws.ident.namespace)
        with user_error("operation-running", re.escape("being restored (step 2 of 3: restoring the snapshot); it is "
                                                       "deleted when that is done, and its disks and snapshots are "
                                                       "kept.")):
            await defer_delete_during_operation(ws)  # (the sentence the hub's log has)
        assert not run.done() and locked_by(ws)
        with user_error("operation-running", "is deleted when that is done \\(its disks are kept\\)"):
            refuse_start_during_operation(ws)
        done = await asyncio.wait_for(run, 60)
    finally:
        sim_api(env.sim, "PUT", "/timing", {"restore": saved})
    assert done.state == "done" and done.current == "start"
    await env.caches.wait_for(lambda: ws.vm is None, 30, ws.ident.namespace)  # deleted instead of started
    kept = [(kind, obj) for kind, obj in ws.disks_and_snapshots() if kind in (k.DV, k.PVC)]
    assert sorted(obj["metadata"]["name"] for _, obj in kept) == ["dora-rootdisk", "dora-rootdisk",
                                                                   "dora-workspace", "dora-workspace"]
    assert all(obj["metadata"]["labels"].get(m.LABEL_RETAINED) == "true" for _, obj in kept)
    assert sorted(volumes_of(env, ws.ident.namespace).values()) == [("Bound", "Retain")] * 2
    root = env.sim.cluster.volume_dir(ws.rootdisk_pvc)
    assert not os.path.exists(os.path.join(root, "etc/after-the-snapshot"))  # restored before it was kept
    assert [r for r in (await env.admin.list(k.RESTORE, ws.ident.namespace))["items"]
            if not r["metadata"].get("deletionTimestamp")] == []


async def test_a_workstation_a_stuck_restore_locks_is_not_deleted(env):
    """A deletion asked while a restore runs that then stalls with a claim replaced (a missing
    VolumeSnapshot: restore.go createRestorePVC) is not carried out: deleting the VM would cut that
    restore off (its disks half restored). Asked again, the refusal names the restore an
    administrator must let finish or delete first."""
    ws = await stopped_with_snapshot(env, "theo")
    for vs in await volume_snapshots(env, ws, ws.ident.rootdisk):
        await env.admin.delete(k.VOLUME_SNAPSHOT, ws.ident.namespace, vs)
    ops = Operations(ws, LocalServer(ws), safety_snapshot=False, timeout=5)
    op = await ops.begin_restore("clean", by="theo")
    run = asyncio.ensure_future(ops.run(op))
    await env.caches.wait_for(lambda: locked_by(ws), 30, ws.ident.namespace)
    with user_error("operation-running", "it is deleted when that is done"):
        await defer_delete_during_operation(ws)
    with user_error("restore-stuck", "stopped half-way"):
        await asyncio.wait_for(run, 60)
    holder = locked_by(ws)
    vm = await env.admin.get(k.VM, ws.ident.namespace, ws.ident.vm)  # (the API server's word: kept)
    assert vm["metadata"]["annotations"][m.ANNOTATION_DELETE_REQUESTED] == op.id
    with user_error("restore-stuck", re.escape(f"locked by VirtualMachineRestore {ws.ident.namespace}/{holder}, "
                                               "which has not finished, so it was not deleted")):
        await defer_delete_during_operation(ws)
    assert (await env.admin.get(k.VM, ws.ident.namespace, ws.ident.vm)) is not None
    assert (await env.admin.get(k.RESTORE, ws.ident.namespace, holder)) is not None
    await env.admin.delete(k.RESTORE, ws.ident.namespace, holder)  # (the admin's way out: the stuck restore test)


async def test_a_restore_that_fails_with_nothing_replaced_carries_out_the_deletion_asked_meanwhile(env):
    """A restore cancelled before it replaced a disk leaves the machine as it was and unlocked: the
    deletion asked while it ran is carried out then, the disks kept."""
    ws = await stopped_with_snapshot(env, "ugo")
    ops = Operations(ws, LocalServer(ws), safety_snapshot=False, timeout=3)
    op = await ops.begin_restore("clean", by="ugo")
    with restores_fail(env, "VolumeSnapshot vs-x not ready"):
        run = asyncio.ensure_future(ops.run(op))
        await env.caches.wait_for(lambda: Operation.from_vm(ws.vm).current == "restore", 30, ws.ident.namespace)
        with user_error("operation-running", "it is deleted when that is done"):
            await defer_delete_during_operation(ws)
        with user_error("restore-failed", "cancelled before any disk was replaced"):
            await asyncio.wait_for(run, 60)
    await env.caches.wait_for(lambda: ws.vm is None, 30, ws.ident.namespace)
    kept = [obj for kind, obj in ws.disks_and_snapshots() if kind is k.PVC]
    assert len(kept) == 2 and all(obj["metadata"]["labels"].get(m.LABEL_RETAINED) == "true" for obj in kept)
    assert sorted(volumes_of(env, ws.ident.namespace).values()) == [("Bound", "Retain")] * 2


async def test_a_deletion_asked_during_an_earlier_operation_never_deletes_after_a_later_one(env):
    """The mark names the operation it was asked during: one left by an earlier operation (its
    restore stuck, the machine kept) does not make a later restore delete the machine."""
    ws = await stopped_with_snapshot(env, "wim")
    await env.admin.patch(k.VM, ws.ident.namespace, ws.ident.vm,
                          {"metadata": {"annotations": {m.ANNOTATION_DELETE_REQUESTED: "4f0c2a9e1b7d"}}})
    await env.caches.wait_for(lambda: m.ANNOTATION_DELETE_REQUESTED in ws.vm["metadata"]["annotations"], 10,
                              ws.ident.namespace)
    ops = Operations(ws, LocalServer(ws), safety_snapshot=False, timeout=30)
    done = await ops.run(await ops.begin_restore("clean", by="wim"))
    assert done.state == "done"
    vm = await env.admin.get(k.VM, ws.ident.namespace, ws.ident.vm)
    assert vm is not None and m.LABEL_RETAINED not in (ws.rootdisk_pvc["metadata"].get("labels") or {})


async def test_a_start_withdraws_a_deletion_asked_during_an_operation(env):
    """A deletion left undone (a stuck restore kept the machine) is withdrawn by a start: the user
    wants the machine, and the next restore or reset must not delete it when it ends."""
    ws = workstation(env, "vida")
    await ws.start({}, [])
    await ws.stop()
    await env.admin.patch(k.VM, ws.ident.namespace, ws.ident.vm,
                          {"metadata": {"annotations": {m.ANNOTATION_DELETE_REQUESTED: "4f0c2a9e1b7d"}}})
    await env.caches.wait_for(lambda: m.ANNOTATION_DELETE_REQUESTED in ws.vm["metadata"]["annotations"], 10,
                              ws.ident.namespace)
    await ws.start({}, [])
    await env.caches.wait_for(lambda: m.ANNOTATION_DELETE_REQUESTED not in ws.vm["metadata"]["annotations"], 10,
                              ws.ident.namespace)
    await ws.stop(now=True)


async def test_a_failure_the_cluster_will_not_record_yet_is_recorded_once_it_can(env, monkeypatch):
    """With virt-api unreachable, KubeVirt's VM webhook (failurePolicy Fail) refuses every change
    of a VM, the operation's record too: a restore that fails then cannot say so. Left saying
    "running", the record would refuse every start ("it starts by itself when done") for good, and
    a restore or reset with it; so the failure is written as soon as the cluster takes it (the
    CI soak found this, seed 423114)."""
    from kubevirt_spawner import operations
    monkeypatch.setattr(operations, "RECORD_RETRY_SECONDS", 0.2)
    monkeypatch.setattr(env.kube, "retry_timeout", 0.5)
    ws = await stopped_with_snapshot(env, "vito")
    ops = Operations(ws, LocalServer(ws), safety_snapshot=False, timeout=10)
    op = await ops.begin_restore("clean", by="vito")
    sim_api(env.sim, "PUT", "/faults/api", {"verb": "patch", "resource": "virtualmachines", "rate": 1, "code": 500})
    try:
        with pytest.raises(k.KubeError):
            await ops.run(op)  # its first record after the stop is refused, and so is the failure's
        assert Operation.from_vm(ws.vm).state == "running"
        await asyncio.sleep(1)
        assert Operation.from_vm(ws.vm).state == "running"  # still refused meanwhile
    finally:
        sim_api(env.sim, "DELETE", "/faults/api")
    recorded = await env.caches.wait_for(
        lambda: (Operation.from_vm(ws.vm) if Operation.from_vm(ws.vm).state == "failed" else None), 10,
        ws.ident.namespace)
    assert recorded.id == op.id and "the cluster refused a request" in recorded.error
    assert sorted(volumes_of(env, ws.ident.namespace).values()) == [("Bound", "Retain")] * 2


async def test_a_restore_lock_without_a_record_still_refuses_starts_with_a_sentence(env):
    """A restore someone else made (kubectl, an earlier hub) that holds the VM: the start is refused
    before KubeVirt's webhook would, with the restore's name."""
    ws = await stopped_with_snapshot(env, "ulla")
    for vs in await volume_snapshots(env, ws, ws.ident.rootdisk, ws.ident.workspace):
        await env.admin.delete(k.VOLUME_SNAPSHOT, ws.ident.namespace, vs)
    snap = ws.snapshot_for_restore("clean")
    await env.admin.create(k.RESTORE, m.virtual_machine_restore(ws.ident, snap["object"], "by-hand"))
    await env.caches.wait_for(lambda: locked_by(ws) == "by-hand", 30, ws.ident.namespace)
    with user_error("restore-stuck", re.escape(f"locked by VirtualMachineRestore {ws.ident.namespace}/by-hand")):
        refuse_start_during_operation(ws)
    await env.admin.delete(k.RESTORE, ws.ident.namespace, "by-hand")
    await env.caches.wait_for(lambda: locked_by(ws) is None, 30, ws.ident.namespace)


async def test_reset_clones_a_new_system_disk_and_keeps_the_workspace(env):
    """A reset deletes only the system disk, clones a new one from the golden image configured
    now, and leaves the workspace disk as it was; the safety snapshot can bring the old system back."""
    ws = workstation(env, "rena", m.MachineSpec(workspace_disk_size="10Gi"))
    await ws.start({}, [])
    await ws.stop()
    write_markers(ws, env, "etc/custom.conf")
    workspace = env.caches.pvcs.get(ws.ident.namespace, ws.ident.workspace)
    with open(os.path.join(env.sim.cluster.volume_dir(workspace), "notes.txt"), "w") as f:
        f.write("my work")
    old_uid = ws.rootdisk_pvc["metadata"]["uid"]
    server = LocalServer(ws)
    ops = Operations(ws, server)
    op = await ops.run(await ops.begin_reset(by="admin"))
    assert op.state == "done" and not op.was_running and server.calls == []  # stopped before, stays stopped
    assert ws.rootdisk_pvc["metadata"]["uid"] != old_uid and ws.rootdisk["status"]["phase"] == "Succeeded"
    root = env.sim.cluster.volume_dir(ws.rootdisk_pvc)
    assert not os.path.exists(os.path.join(root, "etc/custom.conf"))
    assert os.path.exists(os.path.join(root, "etc/os-release"))
    same = env.caches.pvcs.get(ws.ident.namespace, ws.ident.workspace)
    assert same["metadata"]["uid"] == workspace["metadata"]["uid"]
    with open(os.path.join(env.sim.cluster.volume_dir(same), "notes.txt")) as f:
        assert f.read() == "my work"
    # The safety snapshot brings the old system back.
    await ops.run(await ops.begin_restore(op.safety, by="rena"))
    pvc = await env.caches.wait_for(lambda: ws.rootdisk_pvc if (ws.rootdisk_pvc["metadata"].get("annotations") or {})
                                    .get("restore.kubevirt.io/lastRestoreUID") else None, 30, ws.ident.namespace)
    assert os.path.exists(os.path.join(env.sim.cluster.volume_dir(pvc), "etc/custom.conf"))


async def test_extra_disks_are_made_once_and_kept_across_stop_start_reset_and_retirement(env):
    """Issue 26: extra disks (blank, or cloned from a claim of the golden images' namespace, as
    the admission policy allows) are made at the first start, in the VM with serial disk-NAME,
    and kept like the workspace disk: the same claim after a stop and a start and after a
    system reset, grown when the profile's size grows, marked retained with the workstation's
    other disks when it is deleted and taken back at its next start."""
    disks = [{"name": "models", "size": "2Gi", "mount_path": "/data/models"},
             {"name": "ref", "size": "1Gi", "mount_path": "/data/ref",
              "clone_from": "vm-images/ubuntu-24-04-cuda-golden"}]
    spec = m.MachineSpec(workspace_disk_size="1Gi", extra_disks=m.extra_disks(disks))
    # A clone CDI cannot make (a target smaller than its source: CDI's clone validation) says so
    # in events only (pkg/controller/datavolume/pvc-clone-controller.go); the start ends with its words.
    with user_error("clone-failed", r"Making your extra disk ref from vm-images/ubuntu-24-04-cuda-golden has made "
                                    r"no progress for \d+ seconds \(.*smaller than the source"):
        await workstation(env, "edda", spec, clone_stall_timeout=2).start({}, [])
    ws = workstation(env, "edda", spec)
    ns, models, ref = ws.ident.namespace, f"{ws.ident.workspace}-models", f"{ws.ident.workspace}-ref"
    assert ws.vmi is None and field_value(env.caches.dvs.get(ns, models), "status.phase") == "Succeeded"
    await env.admin.delete(k.DV, ns, ref)
    await env.caches.wait_for(lambda: env.caches.dvs.get(ns, ref) is None and env.caches.pvcs.get(ns, ref) is None,
                              30, ns)
    disks[1]["size"] = "60Gi"  # (the golden image's)
    spec = m.MachineSpec(workspace_disk_size="1Gi", extra_disks=m.extra_disks(disks))
    ws = workstation(env, "edda", spec)
    await ws.start({}, [])
    assert ws.extra_claims == [models, ref]
    assert field_value(env.caches.dvs.get(ns, models), "spec.source") == {"blank": {}}
    assert field_value(env.caches.dvs.get(ns, ref), "spec.source") == {
        "pvc": {"namespace": "vm-images", "name": "ubuntu-24-04-cuda-golden"}}
    tspec = ws.vm["spec"]["template"]["spec"]
    assert {"name": "disk-models", "serial": "disk-models", "disk": {"bus": "virtio"}} in tspec["domain"]["devices"][
        "disks"]
    assert {"name": "disk-ref", "persistentVolumeClaim": {"claimName": ref}} in tspec["volumes"]
    secret = await env.admin.get(k.SECRET, ns, ws.ident.secret)
    assert "KUBEVIRT_EXTRA_DISKS" not in secret["data"]  # (the spawner adds m.guest_env; this Workstation has none)
    await ws.stop()
    before = env.caches.pvcs.get(ns, models)
    with open(os.path.join(env.sim.cluster.volume_dir(before), "weights.txt"), "w") as f:
        f.write("w")
    await ws.start({}, [])
    await ws.stop()
    assert env.caches.pvcs.get(ns, models)["metadata"]["uid"] == before["metadata"]["uid"]
    op = await Operations(ws, LocalServer(ws)).run(await Operations(ws, LocalServer(ws)).begin_reset(by="admin"))
    assert op.state == "done"
    kept = env.caches.pvcs.get(ns, models)
    assert kept["metadata"]["uid"] == before["metadata"]["uid"]
    with open(os.path.join(env.sim.cluster.volume_dir(kept), "weights.txt")) as f:
        assert f.read() == "w"
    grown = dataclasses.replace(spec, extra_disks=m.extra_disks([{**disks[0], "size": "3Gi"}, disks[1]]))
    ws = workstation(env, "edda", grown)
    await ws.start({}, [])
    assert field_value(env.caches.pvcs.get(ns, models), "spec.resources.requests.storage") == "3Gi"
    kept_names = await ws.retire()
    assert {f"PersistentVolumeClaim/{models}", f"PersistentVolumeClaim/{ref}", f"DataVolume/{models}"} <= set(kept_names)
    assert m.LABEL_RETAINED in env.caches.pvcs.get(ns, models)["metadata"]["labels"] or m.LABEL_RETAINED in (
        await env.admin.get(k.PVC, ns, models))["metadata"]["labels"]
    await ws.start({}, [])
    assert m.LABEL_RETAINED not in ((await env.admin.get(k.PVC, ns, models))["metadata"].get("labels") or {})
    assert (await env.admin.get(k.PVC, ns, models))["metadata"]["uid"] == before["metadata"]["uid"]


async def test_an_interrupted_operation_goes_on_from_its_record(env):
    """The record on the VM is all a restarted service has: running it again finishes the job
    (the safety snapshot already taken is the one waited for, not a second one)."""
    ws = workstation(env, "ivo")
    await ws.start({}, [])
    await ws.stop()
    await ws.take_snapshot("base")
    ops = Operations(ws, LocalServer(ws))
    op = await ops.begin_restore("base", by="ivo")
    await ops._step_snapshot(op)  # then the service dies
    recorded = Operation.from_vm(ws.vm)
    assert recorded.state == "running" and recorded.current == "snapshot" and recorded.safety == op.safety
    before = len(ws.snapshots())
    done = await Operations(ws, LocalServer(ws)).run(recorded)
    assert done.state == "done" and len(ws.snapshots()) == before


async def test_a_resumed_step_keeps_the_deadline_it_began_with(env):
    """A service that is restarted again and again (a crash loop, a node drained twice) must still
    give up on a stuck step: restore.go's errors without Failure are retried without end
    (pkg/storage/snapshot/restore.go, doUpdateError), so only the hub's deadline ends one. The
    deadline runs from the step's start as recorded, not from the restart."""
    ws = await stopped_with_snapshot(env, "rosa")
    ops = Operations(ws, LocalServer(ws), safety_snapshot=False, timeout=600)
    op = await ops.begin_restore("clean", by="rosa")
    op.step = op.steps.index("restore")
    op.step_began = (datetime.now(timezone.utc) - timedelta(seconds=597)).strftime("%Y-%m-%dT%H:%M:%SZ")
    await ops._save(op)  # as a service that died 597 s into the restore step left it
    began = time.monotonic()
    with restores_fail(env, "VolumeSnapshot vs-y not ready"):
        with user_error("restore-failed", "not finished within 10 seconds.*cancelled before any disk was replaced"):
            await asyncio.wait_for(Operations(ws, LocalServer(ws), safety_snapshot=False, timeout=600)
                                   .run(Operation.from_vm(ws.vm)), 120)
    assert time.monotonic() - began < 60
    assert sorted(volumes_of(env, ws.ident.namespace).values()) == [("Bound", "Retain")] * 2


async def test_kubevirts_default_restore_would_give_the_disk_to_the_vm(env):
    """The contrast (pkg/storage/snapshot/restore.go, createRestorePVC): with the defaults,
    volumeRestorePolicy RandomizeNames and volumeOwnershipPolicy Vm, the VM is pointed at a new
    disk `restore-<uid>-rootdisk` owned by the VM, so deleting the VM would delete the user's disk.
    This is why the spawner restores InPlace with ownership None."""
    ws = workstation(env, "dora")
    await ws.start({}, [])
    await ws.stop()
    snap = await ws.take_snapshot("plain")
    default = m.virtual_machine_restore(ws.ident, snap["object"], "dora-default-restore")
    del default["spec"]["volumeRestorePolicy"], default["spec"]["volumeOwnershipPolicy"]
    await env.admin.create(k.RESTORE, default)

    def restored_claim():
        volume = next(v for v in field_value(ws.vm, "spec.template.spec.volumes") if v["name"] == "rootdisk")
        claim = field_value(volume, "persistentVolumeClaim.claimName")
        return claim if claim != ws.ident.rootdisk else None
    claim = await env.caches.wait_for(restored_claim, 30)
    assert claim.startswith("restore-")
    pvc = await env.caches.wait_for(lambda: env.caches.pvcs.get(ws.ident.namespace, claim), 10)
    assert [o["kind"] for o in pvc["metadata"].get("ownerReferences") or []] == ["VirtualMachine"]


async def test_a_reset_installs_the_golden_image_configured_now(env):
    """How users upgrade: the profile now names a newer golden image; a reset clones the system disk
    from it (a start alone keeps the disk the machine has)."""
    golden_v2 = "ubuntu-24-04-cuda-golden-v2"
    try:  # (as the cluster's admin, in the golden images' namespace: the hub only reads there)
        await env.admin.create(k.DV, {"apiVersion": "cdi.kubevirt.io/v1beta1", "kind": "DataVolume",
                                     "metadata": {"name": golden_v2, "namespace": "vm-images"},
                                     "spec": {"source": {"pvc": {"namespace": "vm-images",
                                                                 "name": "ubuntu-24-04-cuda-golden"}},
                                              "storage": {"resources": {"requests": {"storage": "60Gi"}}}}})
    except k.KubeError as err:
        if err.status != 409:
            raise
    async def listed(kind):  # (the caches hold only workstations' objects)
        found = await env.admin.list(kind, "vm-images", field_selector=f"metadata.name={golden_v2}")
        return next(iter(found.get("items") or []), None)
    for _ in range(300):
        if field_value(await listed(k.DV), "status.phase") == "Succeeded":
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError("the second golden image was not cloned within 30 s")
    new_image = await listed(k.PVC)
    with open(os.path.join(env.sim.cluster.volume_dir(new_image), "etc", "golden-image"), "w") as f:
        f.write("v2\n")
    ws = workstation(env, "ugo")
    await ws.start({}, [])
    await ws.stop()
    upgraded = workstation(env, "ugo", m.MachineSpec(golden_image=f"vm-images/{golden_v2}"))
    await upgraded.start({}, [])  # a start keeps the disk
    await upgraded.stop()
    assert field_value(upgraded.rootdisk, "spec.source.pvc.name") == "ubuntu-24-04-cuda-golden"
    op = await Operations(upgraded, LocalServer(upgraded)).run(
        await Operations(upgraded, LocalServer(upgraded)).begin_reset(by="ugo"))
    assert op.state == "done" and field_value(upgraded.rootdisk, "spec.source.pvc.name") == golden_v2
    with open(os.path.join(env.sim.cluster.volume_dir(upgraded.rootdisk_pvc), "etc", "golden-image")) as f:
        assert f.read() == "v2\n"


async def test_a_users_namespace_gets_its_network_policy_quota_and_limits_when_a_workstation_starts(env):
    peers = ({"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "jupyterhub"}},
              "podSelector": {"matchExpressions": [{"key": "component", "operator": "In",
                                                    "values": ["hub", "proxy"]}]}},)
    guards = {"network_policy_from": peers, "namespace_quota": {"requests.storage": "200Gi"},
              "namespace_limits": ({"type": "PersistentVolumeClaim", "max": {"storage": "100Gi"}},)}
    ws = workstation(env, "nora", **guards)
    before = counts(env.sim)
    await ws.start({"JUPYTERHUB_API_TOKEN": "t1"}, [])
    made = writes(diff(before, counts(env.sim)))
    assert made["create networkpolicies"] == made["create resourcequotas"] == made["create limitranges"] == 1
    ns = ws.ident.namespace
    policy = http(env.sim).get(f"{env.sim.url}/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies/"
                               "kubevirt-spawner").json()
    # only the hub and the proxy, only on the machine's ports, to the workstations' pods (the VMI's
    # labels, which KubeVirt puts on its launcher pod)
    assert policy["spec"]["ingress"] == [{"from": list(peers), "ports": [
        {"protocol": "TCP", "port": 22}, {"protocol": "TCP", "port": 8080}, {"protocol": "TCP", "port": 8888}]}]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= \
        ws.vm["spec"]["template"]["metadata"]["labels"].items()
    quota_url = f"{env.sim.url}/api/v1/namespaces/{ns}/resourcequotas/kubevirt-spawner"
    assert http(env.sim).get(quota_url).json()["spec"]["hard"] == {"requests.storage": "200Gi"}
    await ws.stop()
    # a second workstation of the same user leaves them as an admin changed them
    assert http(env.sim).patch(quota_url, json={"spec": {"hard": {"requests.storage": "300Gi"}}},
                               headers={"Content-Type": "application/merge-patch+json"}).status_code == 200
    second = Workstation(env.kube, env.caches, names.identity("nora", "gpu"), m.MachineSpec(),
                         Settings(url_mode="cluster-ip", **guards), LOG)
    await second.start({"JUPYTERHUB_API_TOKEN": "t2"}, [])
    assert http(env.sim).get(quota_url).json()["spec"]["hard"] == {"requests.storage": "300Gi"}
    await second.stop()
    # none of them without the settings
    plain = workstation(env, "otto")
    await plain.start({"JUPYTERHUB_API_TOKEN": "t3"}, [])
    quotas = f"{env.sim.url}/api/v1/namespaces/{plain.ident.namespace}/resourcequotas"
    assert http(env.sim).get(quotas).json()["items"] == []
    await plain.stop()
    # ... and that workstation, started again once the hub has them, gets them then
    again = Workstation(env.kube, env.caches, plain.ident, m.MachineSpec(), Settings(url_mode="cluster-ip", **guards),
                        LOG)
    await again.start({"JUPYTERHUB_API_TOKEN": "t4"}, [])
    assert [q["spec"]["hard"] for q in http(env.sim).get(quotas).json()["items"]] == [{"requests.storage": "200Gi"}]
    await again.stop()


async def test_a_namespace_made_just_now_may_be_not_found_for_a_moment(env, monkeypatch):
    """Kubernetes 1.30 to 1.32 before kubernetes#135359 (staging/src/k8s.io/apiserver/pkg/admission/
    plugin/policy/generic/policy_dispatcher.go took the namespace from the lister only): with a
    ValidatingAdmissionPolicy installed, the first creates in a namespace made a moment ago can be
    refused NotFound. A first start goes on; a namespace that stays missing still fails."""
    real_create = env.kube.create
    refused = []

    async def stale_admission(kind, obj, query=None):
        ns = obj["metadata"].get("namespace")
        if ns == "notebook-wanda" and kind.kind in ("RoleBinding", "NetworkPolicy") and refused.count(kind.kind) < 3:
            refused.append(kind.kind)
            raise k.KubeError(404, "NotFound", f'namespaces "{ns}" not found')
        return await real_create(kind, obj, query)
    monkeypatch.setattr(env.kube, "create", stale_admission)
    guards = {"network_policy_from": ({"namespaceSelector": {}},)}
    ws = workstation(env, "wanda", **guards)
    await ws.start({"JUPYTERHUB_API_TOKEN": "t"}, [])
    # (the hub's binding of its role there first: deploy/rbac/, and the policy matches RoleBindings)
    assert refused == ["RoleBinding"] * 3 + ["NetworkPolicy"] * 3 and ws.status() in ("running", "starting")
    await ws.stop()
    # a namespace that exists from before: a NotFound is not waited out
    refused.clear()
    again = workstation(env, "wanda", **guards)
    with pytest.raises(k.KubeError):
        await again.start({"JUPYTERHUB_API_TOKEN": "t2"}, [])
    assert refused == ["NetworkPolicy"]


def _colliding_names(victim: str) -> str:
    """A user name other than `victim` whose slug is the same (found by search: only possible
    with a hash made short for the test)."""
    wanted = names.safe_slug(victim)
    for dots in range(2, 20000):
        other = victim.replace(".", "." * dots)
        if names.safe_slug(other) == wanted:
            return other
    raise AssertionError("no collision found")


async def test_a_forced_slug_collision_gives_the_second_account_nothing_of_the_first(env, monkeypatch):
    """Issue 30, item 2. A name that is not a safe slug is named by a hash of it; with the hash cut
    to 10 bits, a second account whose name gives the same slug is found in seconds. Its
    workstation is refused with a sentence for every action, and nothing of the first account's
    changes: no write reaches the cluster. (Before the fix, ownership was the slug label: the
    second account's start replaced the first's Secret and VM template and booted its disks.)"""
    from kubevirt_spawner.workstation import SNAPSHOT
    monkeypatch.setattr(names, "HASH_LENGTH", 2)
    victim, attacker = "Vera.Victim", _colliding_names("Vera.Victim")
    assert attacker != victim and names.identity(attacker) == dataclasses.replace(names.identity(victim),
                                                                                  user=attacker)
    first = workstation(env, victim)
    await first.start({"JUPYTERHUB_API_TOKEN": "victim-token"}, [])
    await first.take_snapshot("mine")
    ns = first.ident.namespace
    theirs = [(k.VM, first.ident.vm), (k.DV, first.ident.rootdisk), (k.PVC, first.ident.rootdisk),
              (k.SECRET, first.ident.secret), (k.SERVICE, first.ident.service),
              (SNAPSHOT, m.snapshot_object_name(first.ident, "mine"))]
    versions = {(kind.kind, name): (await env.admin.get(kind, ns, name))["metadata"]["resourceVersion"]
                for kind, name in theirs}

    second = workstation(env, attacker)
    assert second.vm is None and second.vmi is None and second.service is None and second.rootdisk is None
    assert second.status() == "stopped" and second.snapshots() == [] and second.disks_and_snapshots() == []
    assert len(first.disks_and_snapshots()) == 3  # (what an administrator's purge of the second would take)
    before = counts(env.sim)
    refused = "already exists and is not this workstation's, so nothing was done"
    with user_error("name-taken", refused):
        await second.start({"JUPYTERHUB_API_TOKEN": "attacker-token"}, [])
    for action in (lambda: second.stop(now=True), lambda: second.take_snapshot("x"),
                   lambda: second.restore_snapshot("mine", "r1"), second.delete_root_disk,
                   second.clone_root_disk, lambda: second.delete_snapshot("mine"), second.ensure_halted):
        with user_error("name-taken", refused):
            await action()
    assert await second.retire() == []  # (an admin deleting the second account: it had nothing)
    assert writes(diff(before, counts(env.sim))) == {}
    assert {(kind.kind, name): (await env.admin.get(kind, ns, name))["metadata"]["resourceVersion"]
            for kind, name in theirs} == versions
    assert first.status() == "running" and [s["name"] for s in first.snapshots()] == ["mine"]
    await first.stop()

    # With the real hash (80 bits), the two names have slugs of their own.
    monkeypatch.setattr(names, "HASH_LENGTH", 16)
    assert names.safe_slug(victim) != names.safe_slug(attacker)


async def test_kept_disks_go_back_to_an_account_made_again_only_when_an_administrator_confirms(env):
    """Issue 30, item 2. A deleted user's disks are kept (retire); an account made later under the
    same name may be someone else, so its start is refused with a sentence until an administrator
    marks the disks as its own (ANNOTATION_CONFIRMED_FOR = the new account's creation time). The
    same account (its server deleted and made again) gets them back at once."""
    made = "2026-01-05T10:00:00"
    ws = workstation(env, "kim", user_created=made)
    await ws.start({}, [])
    await ws.retire()
    await env.caches.wait_for(lambda: ws.vm is None, 10)
    dv = await env.admin.get(k.DV, ws.ident.namespace, ws.ident.rootdisk)
    assert dv["metadata"]["annotations"][m.ANNOTATION_USER_CREATED] == made

    later = "2026-11-30T08:00:00"
    newcomer = workstation(env, "kim", user_created=later)
    before = counts(env.sim)
    with user_error("kept-for-earlier-account", "Disks kept from an earlier account named kim wait in notebook-kim"):
        await newcomer.start({}, [])
    assert not {key for key in writes(diff(before, counts(env.sim)))
                if key.split()[1] in ("datavolumes", "persistentvolumeclaims", "virtualmachines", "secrets")}
    for kind in (k.DV, k.PVC):
        assert m.LABEL_RETAINED in (await env.admin.get(kind, ws.ident.namespace, ws.ident.rootdisk))["metadata"]["labels"]

    for kind in (k.DV, k.PVC):  # the administrator confirms
        await env.admin.patch(kind, ws.ident.namespace, ws.ident.rootdisk,
                              {"metadata": {"annotations": {m.ANNOTATION_CONFIRMED_FOR: later}}})
    await env.caches.wait_for(lambda: (newcomer.rootdisk_pvc["metadata"]["annotations"] or {}).get(
        m.ANNOTATION_CONFIRMED_FOR) == later, 10)
    await newcomer.start({}, [])
    dv = await env.admin.get(k.DV, ws.ident.namespace, ws.ident.rootdisk)
    assert m.LABEL_RETAINED not in dv["metadata"]["labels"]
    assert dv["metadata"]["annotations"][m.ANNOTATION_USER_CREATED] == later
    assert m.ANNOTATION_CONFIRMED_FOR not in dv["metadata"]["annotations"]
    await newcomer.retire()

    # The same account comes back: no confirmation needed.
    await env.caches.wait_for(lambda: newcomer.vm is None, 10)
    again = workstation(env, "kim", user_created=later)
    await again.start({}, [])
    await again.stop()


async def test_workstations_named_with_the_short_hash_keep_their_names(env, wsim, monkeypatch):
    """Issue 30, item 2. Workstations made before the hash grew to 80 bits (8 hex digits) keep their
    names: a hub that lost its state finds them by their raw-name annotations, the machine first,
    and after the server was deleted, its kept system disk."""
    import hashlib
    with monkeypatch.context() as old:
        old.setattr(names, "HASH_LENGTH", 8)
        old.setattr(names, "_hash", lambda *parts: hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:8])
        ws = workstation(env, "Olga.Old")
    assert ws.ident.slug != names.workstation_slug("Olga.Old") and len(ws.ident.slug.split("---")[1]) == 8
    await ws.start({}, [])
    await ws.stop()
    c = Config()
    c.KubeVirtSpawner.kubeconfig = wsim.kubeconfig
    spawner = KubeVirtSpawner(config=c, user=types.SimpleNamespace(name="Olga.Old", url="/user/Olga.Old/"))
    assert await spawner.poll() == 0
    assert spawner.get_state()["workstation"] == ws.ident.to_state()

    await ws.retire()
    hub_caches = spawner_module._shared[next(iter(spawner_module._shared))]["caches"]
    await hub_caches.wait_for(lambda: hub_caches.vms.get(ws.ident.namespace, ws.ident.vm) is None, 10)
    later = KubeVirtSpawner(config=c, user=types.SimpleNamespace(name="Olga.Old", url="/user/Olga.Old/"))
    found = await later.workstation()
    assert found.ident == ws.ident


async def test_concurrent_snapshots_cannot_pass_the_users_limit_together(env, wsim):
    """Issue 30, item 5. The limit was checked before the snapshot's create, outside any lock: 30
    requests at once all saw 0 of 5 and made 30 snapshots (outside the namespace's quota, in the
    shared Ceph pool). Now the requests in flight count too: 5 are made, 25 refused with a sentence."""
    from kubevirt_spawner.service.access import Caller, ServiceError
    from kubevirt_spawner.service.core import Workstations
    ws = workstation(env, "lena")
    await ws.start({}, [])
    await ws.stop()
    c = Config()
    c.KubeVirtSpawner.kubeconfig = wsim.hub_kubeconfig
    c.Workstations.snapshot_limit = 5
    service = Workstations(hub=None, config=c, log=LOG)
    lena = Caller(name="lena", admin=False)
    results = await asyncio.gather(*(service.take_snapshot(lena, "lena", "", f"s{i}", "") for i in range(30)),
                                   return_exceptions=True)
    refused = [r for r in results if isinstance(r, ServiceError)]
    assert len(refused) == 25 and all(r.status == 409 and "lena has 5 snapshots, the most allowed" in r.message
                                      for r in refused), results
    await env.caches.wait_for(lambda: len(ws.snapshots()) == 5, 10)
    with pytest.raises(ServiceError, match="the most allowed"):
        await service.take_snapshot(lena, "lena", "", "one-more", "")


async def test_workstations_sharing_a_namespace_never_share_a_snapshot_object(env):
    """Issue 30, item 9. With one namespace for everyone (a `namespace_template` without {user}),
    the object names `slug-name` collided: `bob` + `x-y` and `bob-x` + `y` were both `bob-x-y`,
    so the second was refused, and a name taken in advance made an operation's safety snapshot wait
    out its timeout. A dot keeps slug and name apart; an object of another workstation under the
    name an operation expects is refused at once."""
    from kubevirt_spawner.workstation import SNAPSHOT
    shared = {"namespace": "notebooks-shared"}
    bob, bobx = (Workstation(env.kube, env.caches, names.identity(user, templates=shared), m.MachineSpec(),
                             Settings(url_mode="cluster-ip"), LOG) for user in ("bob", "bob-x"))
    with site_policy(env.sim, USER_NAMESPACE_PREFIX="notebooks-"):  # (a site's namespace, listed there)
        for ws in (bob, bobx):
            await ws.start({}, [])
            await ws.stop()
        assert (await bob.take_snapshot("x-y"))["object"] == "bob.x-y"
        assert (await bobx.take_snapshot("y"))["object"] == "bob-x.y"

        squatted = m.virtual_machine_snapshot(bobx.ident, "before-restore-1")
        squatted["metadata"]["name"] = m.snapshot_object_name(bob.ident, "before-restore-1")
        await env.admin.create(SNAPSHOT, squatted)
        started = time.monotonic()
        with user_error("name-taken", "bob.before-restore-1 already exists and is not this workstation's"):
            await bob.take_snapshot("before-restore-1", again=True, timeout=60)
        assert time.monotonic() - started < 10
        for ws in (bob, bobx):
            await ws.retire()


async def test_a_name_with_a_newline_cannot_forge_a_log_line(env, wsim, caplog):
    """Issue 30, item 7. A snapshot name is the user's choice and reached the audit line raw: a
    name with a newline wrote a second, forged audit line. Every argument of the service's lines
    and of a workstation's is made printable (escaped) first."""
    from kubevirt_spawner.service.access import Caller, ServiceError
    from kubevirt_spawner.service.core import Workstations
    ws = workstation(env, "nell")
    await ws.start({}, [])
    c = Config()
    c.KubeVirtSpawner.kubeconfig = wsim.hub_kubeconfig
    service = Workstations(hub=None, config=c, log=LOG)
    forged = "x\n[I 2026-12-01 10:00:00.000 workstations core:1] audit: admin reset nell: done"
    try:
        with caplog.at_level(logging.INFO, logger=LOG.name):
            with pytest.raises(ServiceError, match="There is no snapshot named"):
                await service.delete_snapshot(Caller(name="nell", admin=False), "nell", "", forged)
            ws.log.info("the user asked for %s", forged)
        lines = [r.getMessage() for r in caplog.records if "x\\n[I 2026" in r.getMessage()]
        assert len(lines) == 2 and all("\n" not in line for line in lines), lines
        assert any(line.startswith("audit: nell delete-snapshot nell: failed") for line in lines)
    finally:
        await ws.stop()


async def test_a_workstations_own_token_may_not_delete_its_snapshots(env, wsim):
    """Issue 30, item 6. The token a server holds ($JUPYTERHUB_API_TOKEN) is readable by anyone
    with a terminal in it (a user it is shared with, an admin who opens it), who could call the
    service as the owner and delete every snapshot. By default that token may restore and reset
    (each takes a safety snapshot first) but not delete a snapshot, which only the owner's login
    does; `server_token_actions` says what sharing grants."""
    from kubevirt_spawner.service.access import Caller, ServiceError
    from kubevirt_spawner.service.core import Workstations
    ws = workstation(env, "tess")
    await ws.start({}, [])
    await ws.take_snapshot("keep")
    c = Config()
    c.KubeVirtSpawner.kubeconfig = wsim.hub_kubeconfig
    service = Workstations(hub=None, config=c, log=LOG)
    servers_token = Caller(name="tess", admin=False, servers=frozenset({"tess/"}))
    try:
        with pytest.raises(ServiceError, match="A workstation's own token may not delete a snapshot") as refused:
            await service.delete_snapshot(servers_token, "tess", "", "keep")
        assert refused.value.status == 403 and [s["name"] for s in ws.snapshots()] == ["keep"]
        # what sharing grants by default: a restore passes this check (and meets the next one)
        with pytest.raises(ServiceError, match="Confirm the restore"):
            await service.restore(servers_token, "tess", "", "keep", False)
        strict = Workstations(hub=None, config=c, log=LOG, server_token_actions=[])
        with pytest.raises(ServiceError, match="may not restore a snapshot"):
            await strict.restore(servers_token, "tess", "", "keep", True)
        with pytest.raises(ServiceError, match="may not reset the system"):
            await strict.reset(servers_token, "tess", "", "tess")
        unsafe = Workstations(hub=None, config=c, log=LOG, safety_snapshot=False)  # nothing would undo it
        with pytest.raises(ServiceError, match="may not restore a snapshot"):
            await unsafe.restore(servers_token, "tess", "", "keep", True)
        with pytest.raises(TraitError, match="wipe is not one of"):
            Workstations(hub=None, config=c, log=LOG, server_token_actions=["wipe"])
        await service.delete_snapshot(Caller(name="tess", admin=False), "tess", "", "keep")  # the owner's login
        # (the service's caches saw it go; this test's own see it a moment later)
        await env.caches.wait_for(lambda: ws.snapshots() == [], 10, ws.ident.namespace)
    finally:
        await ws.stop()


async def test_disks_in_use_get_the_accounts_time_and_keep_it_when_kept(env):
    """Disks made before the account's time was recorded (or by the service, which does not know
    it) get it at their next start from the hub, and keep it when the server is deleted: the same
    account that makes the server again gets them back without an administrator."""
    old = workstation(env, "uma")  # no time known
    await old.start({}, [])
    await old.stop()
    made = "2026-02-03T04:05:06"
    known = workstation(env, "uma", user_created=made)
    await known.start({}, [])
    for kind in (k.DV, k.PVC):
        disk = await env.admin.get(kind, known.ident.namespace, known.ident.rootdisk)
        assert disk["metadata"]["annotations"][m.ANNOTATION_USER_CREATED] == made, kind
    await known.retire()
    await env.caches.wait_for(lambda: known.vm is None, 10)
    disk = await env.admin.get(k.DV, known.ident.namespace, known.ident.rootdisk)
    assert disk["metadata"]["annotations"][m.ANNOTATION_USER_CREATED] == made
    again = workstation(env, "uma", user_created=made)
    await again.start({}, [])
    await again.stop()


class StoppedHub:
    """The hub's side of an operation, for the service without a hub: every server is stopped."""

    async def running(self, user: str, server: str) -> bool:
        return False

    async def stop(self, user: str, server: str, timeout: float):
        """Nothing to stop: the hub has no server running."""

    async def start(self, user: str, server: str):
        """Not asked: an operation starts a server again only if it was running (none was)."""


async def test_concurrent_restores_cannot_pass_the_users_limit_with_their_safety_snapshots(env, wsim):
    """Issue 30, item 5: a restore's safety snapshot counts from the moment it is asked for. With
    3 of 4 snapshots taken, restores of three of the user's servers at once leave room for one
    safety snapshot: one begins, two are refused (before, each saw 3 of 4 and all three began)."""
    from kubevirt_spawner.service.access import Caller, ServiceError
    from kubevirt_spawner.service.core import Workstations
    machines = [Workstation(env.kube, env.caches, names.identity("lars", server), m.MachineSpec(),
                            Settings(url_mode="cluster-ip"), LOG) for server in ("", "a", "b")]
    for ws in machines:
        await ws.start({}, [])
        await ws.stop()
        await ws.take_snapshot("s")
    c = Config()
    c.KubeVirtSpawner.kubeconfig = wsim.hub_kubeconfig
    c.Workstations.snapshot_limit = 4
    service = Workstations(hub=StoppedHub(), config=c, log=LOG)
    lars = Caller(name="lars", admin=False)
    results = await asyncio.gather(*(service.restore(lars, "lars", server, "s", True) for server in ("", "a", "b")),
                                   return_exceptions=True)
    refused = [r for r in results if isinstance(r, ServiceError)]
    assert len(refused) == 2 and all("a restore takes a safety snapshot first" in r.message for r in refused), \
        results
    for task in list(service.actions.tasks.values()):
        await asyncio.wait_for(task, 120)
    assert sum(len(ws.snapshots()) for ws in machines) == 4


async def test_a_machine_an_earlier_account_never_retired_needs_an_administrators_word_too(env):
    """An account removed without its workstation being retired (its VM still there) and made again:
    the VM records the first account's time, so the second's start is refused, until confirmed."""
    first = workstation(env, "otto", user_created="2026-01-01T00:00:00")
    await first.start({}, [])
    await first.stop()
    later = "2026-06-01T00:00:00"
    second = workstation(env, "otto", user_created=later)
    before = counts(env.sim)
    with user_error("kept-for-earlier-account", "A workstation of an earlier account named otto is in notebook-otto"):
        await second.start({}, [])
    assert writes(diff(before, counts(env.sim))) == {}
    await env.admin.patch(k.VM, first.ident.namespace, first.ident.vm,
                          {"metadata": {"annotations": {m.ANNOTATION_CONFIRMED_FOR: later}}})
    await env.caches.wait_for(lambda: (second.vm["metadata"]["annotations"] or {}).get(m.ANNOTATION_CONFIRMED_FOR)
                              == later, 10)
    await second.start({}, [])
    await second.stop()


def hooked(env, user: str, hook) -> Workstation:
    return Workstation(env.kube, env.caches, names.identity(user), m.MachineSpec(), Settings(url_mode="cluster-ip"),
                       LOG, vm_hook=hook)


async def objects_in(env, ns: str) -> dict:
    return {kind.kind: [o["metadata"]["name"] for o in (await env.admin.list(kind, ns))["items"]]
            for kind in (k.VM, k.DV, k.PVC)}


async def test_the_admins_hook_changes_the_vm_and_the_cluster_checks_it_before_any_disk(env, schemas):
    """modify_vm_hook (KubeSpawner's modify_pod_hook, for the VM): its VM is what the start
    creates. A VM the cluster refuses (a field KubeVirt's schema lacks, refused by a dry run with
    fieldValidation=Strict: apiserver's endpoints/handlers/create.go) fails the start with one
    sentence before any disk is made; a hook that fails or returns something else too."""
    async def annotate(vm):
        vm["metadata"]["annotations"]["example.com/owner"] = "hugo"
        return vm
    ws = hooked(env, "hugo", annotate)
    await ws.start({}, [])
    assert ws.vm["metadata"]["annotations"]["example.com/owner"] == "hugo"
    await ws.stop()

    async def typo(vm):
        vm["spec"]["template"]["spec"]["domain"]["cpuu"] = {"cores": 4}
        return vm

    def nothing(vm):
        async def none():
            return None
        return none()

    async def broken(vm):
        raise KeyError("gpu")

    async def relabel(vm):  # (the hub would never find this VM again: its caches select by label)
        vm["metadata"]["labels"] = {"team": "physics"}
        return vm

    async def unserialisable(vm):
        vm["metadata"]["annotations"]["example.com/tags"] = {"a", "b"}
        return vm

    for user, hook, words in (("ivan", typo, 'strict decoding error: unknown field "spec.template.spec.domain.cpuu"'),
                              ("ines", nothing, "modify_vm_hook did not return your workstation's machine"),
                              ("ida", broken, "modify_vm_hook failed on your workstation's machine"),
                              ("iris", relabel, "modify_vm_hook did not return your workstation's machine"),
                              ("isa", unserialisable, "a value Kubernetes cannot take")):
        with user_error("vm-spec", words):
            await hooked(env, user, hook).start({}, [])
        assert await objects_in(env, f"notebook-{user}") == {"VirtualMachine": [], "DataVolume": [],
                                                             "PersistentVolumeClaim": []}, user
    # an existing machine: its replaced template is checked the same way, and nothing changes
    before = copy.deepcopy(ws.vm)
    with user_error("vm-spec", "unknown field"):
        await hooked(env, "hugo", typo).start({}, [])
    after = await env.admin.get(k.VM, "notebook-hugo", "hugo-workstation")
    assert after["spec"] == before["spec"] and after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]


async def test_a_halt_that_fails_after_a_stop_is_tried_again_until_it_lands(env, wsim, caplog):
    """JupyterHub skips stop() when poll() says the machine is not running (its node was lost), and
    the hub halts the VM in its post-stop hook. With virt-api down longer than the client retries
    (the fault soak met a minute of it), the hub keeps trying: a VM left at runStrategy Always comes
    back by itself once the lost node is fenced (KubeVirt's VM controller,
    pkg/virt-controller/watch/vm.go), with no server in the hub. A start ends the tries."""
    ws = workstation(env, "hal")
    await ws.start({}, [])
    c = Config()
    c.KubeVirtSpawner.kubeconfig = wsim.kubeconfig
    c.KubeVirtSpawner.k8s_api_retry_timeout = 1.0
    spawner = KubeVirtSpawner(config=c, user=types.SimpleNamespace(name="hal", url="/user/hal/"))
    spawner.load_state({"workstation": ws.ident.to_state()})
    sim_api(wsim, "PUT", "/faults/api", {"verb": "update", "resource": "virtualmachines/stop", "rate": 1,
                                         "code": 500})
    try:
        await spawner.run_post_stop_hook()
        assert "could not make sure the workstation of hal stays stopped; trying again" in caplog.text
        assert spawner._halting is not None and not spawner._halting.done()
        # the first try again (5 s later) fails too; the fault stays until it has said so, however
        # slow the machine (a fixed sleep raced the client's own retries: CI run of fd47712)
        for _ in range(300):
            if "still cannot make sure the workstation of hal stays stopped" in caplog.text:
                break
            await asyncio.sleep(0.1)
        assert "still cannot make sure the workstation of hal stays stopped" in caplog.text
        assert not spawner._halting.done()
        assert field_value(await env.admin.get(k.VM, ws.ident.namespace, ws.ident.vm), "spec.runStrategy") != "Halted"
    finally:
        sim_api(wsim, "DELETE", "/faults/api")
    await asyncio.wait_for(asyncio.shield(spawner._halting), 30)
    assert field_value(await env.admin.get(k.VM, ws.ident.namespace, ws.ident.vm), "spec.runStrategy") == "Halted"
    # a start ends the tries at once
    spawner._halting = asyncio.ensure_future(spawner._halt_until_done(first_delay=3600))
    spawner._wake_progress = lambda: None
    start = asyncio.ensure_future(spawner.start())
    await asyncio.sleep(0.5)
    assert spawner._halting.cancelled()
    start.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await start


KUBEVIRT_CR = k.Kind("KubeVirt", "kubevirt.io", "v1", "kubevirts")


async def test_shared_data_needs_its_gate_and_its_claim_before_anything_is_made(env):
    """Issue 26. A VM with virtiofs of a claim is refused by KubeVirt without the
    EnableVirtioFsStorageVolumes gate (v1.9 vmi-create-admitter.go,
    validateFilesystemsWithVirtIOFSEnabled, run on a VM's template too): the dry run says so and
    nothing is made. A missing or Block claim fails the start with a sentence, before any disk is
    made; the claims are the admin's and stay as they are. With both, the VM mounts them and has its
    scratch disk."""
    spec = m.MachineSpec(scratch_disk_size="5Gi", shared_data=m.shared_data(
        [{"claim": "datasets", "mount_path": "/data/datasets", "read_only": True}]))
    empty = {"VirtualMachine": [], "DataVolume": [], "PersistentVolumeClaim": []}
    with user_error("vm-spec", "virtiofs is not allowed: virtiofs feature gate is not enabled for PVC"):
        await workstation(env, "shira", spec).start({}, [])
    assert await objects_in(env, "notebook-shira") == empty
    await env.admin.create(KUBEVIRT_CR, {"apiVersion": "kubevirt.io/v1", "kind": "KubeVirt", "metadata": {
        "name": "kubevirt", "namespace": "kubevirt"}, "spec": {"configuration": {"developerConfiguration": {
            "featureGates": ["EnableVirtioFsStorageVolumes"]}}}})
    try:
        with user_error("shared-data", "The shared data volume notebook-shira/datasets that your workstation mounts "
                                       "at /data/datasets does not exist, so nothing was started"):
            await workstation(env, "shira", spec).start({}, [])
        assert await objects_in(env, "notebook-shira") == empty
        # a workstation's disk (in a namespace several users share, a typed choice could name one)
        disk = {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                "metadata": {"name": "datasets", "namespace": "notebook-shira",
                             "labels": {"app.kubernetes.io/managed-by": m.MANAGED_BY}},
                "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}}
        await env.admin.create(k.PVC, disk)
        with user_error("shared-data", "is a disk of a workstation, not shared data, so nothing was started"):
            await workstation(env, "shira", spec).start({}, [])
        await env.admin.delete(k.PVC, "notebook-shira", "datasets")
        while await env.admin.get(k.PVC, "notebook-shira", "datasets") is not None:
            await asyncio.sleep(0.05)
        claim = {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                 "metadata": {"name": "datasets", "namespace": "notebook-shira"},
                 "spec": {"accessModes": ["ReadOnlyMany"], "volumeMode": "Block",
                          "resources": {"requests": {"storage": "1Gi"}}}}
        await env.admin.create(k.PVC, claim)
        with user_error("shared-data", "is a block device, not a filesystem"):
            await workstation(env, "shira", spec).start({}, [])
        assert await objects_in(env, "notebook-shira") == {**empty, "PersistentVolumeClaim": ["datasets"]}
        await env.admin.delete(k.PVC, "notebook-shira", "datasets")
        claim["spec"]["volumeMode"] = "Filesystem"
        while await env.admin.get(k.PVC, "notebook-shira", "datasets") is not None:
            await asyncio.sleep(0.05)
        await env.admin.create(k.PVC, claim)
        ws = workstation(env, "shira", spec)
        await ws.start({}, [])
        tspec = ws.vm["spec"]["template"]["spec"]
        assert tspec["domain"]["devices"]["filesystems"] == [{"name": "datasets", "virtiofs": {}}]
        assert {"name": "scratch", "emptyDisk": {"capacity": "5Gi"}} in tspec["volumes"]
        await ws.stop()
        assert (await env.admin.get(k.PVC, "notebook-shira", "datasets"))["metadata"].get("labels") is None
        # A snapshot holds the share when its StorageClass has a VolumeSnapshotClass (ceph-rbd's
        # here): a restore in place would put it back for everyone, so it is refused.
        await ws.take_snapshot("with-share")
        with user_error("snapshot-holds-shared-data", "The snapshot with-share also holds the shared data datasets"):
            await ws.restore_snapshot("with-share", "restore-with-share")
        assert (await env.admin.list(k.RESTORE, "notebook-shira"))["items"] == []
        # on a class without one (CephFS's, as the README asks), the snapshot leaves it out
        await env.admin.create(k.Kind("StorageClass", "storage.k8s.io", "v1", "storageclasses", namespaced=False), {
            "apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": {"name": "cephfs-shared"},
            "provisioner": "cephfs.csi.ceph.com", "reclaimPolicy": "Retain"})
        claim["metadata"]["name"] = "datasets-fs"
        claim["spec"]["storageClassName"] = "cephfs-shared"
        await env.admin.create(k.PVC, claim)
        fs_spec = dataclasses.replace(spec, shared_data=m.shared_data(
            [{"name": "datasets", "claim": "datasets-fs", "mount_path": "/data/datasets", "read_only": True}]))
        ws = workstation(env, "shira", fs_spec)
        await ws.start({}, [])
        await ws.stop()
        await ws.take_snapshot("without-share")
        assert sorted(ws._snapshot("without-share")["volumes"]) == ["rootdisk"]
        await ws.restore_snapshot("without-share", "restore-without-share")
    finally:
        await env.admin.delete(KUBEVIRT_CR, "kubevirt", "kubevirt")


async def test_a_new_namespace_gets_the_admins_labels_and_annotations(env):
    """Issue 26: namespace_labels and namespace_annotations (KubeSpawner's user_namespace_labels
    and user_namespace_annotations), {user} filled in with the user's slug, given when the hub
    makes the namespace; the project's own labels win."""
    ws = workstation(env, "nadia", namespace_labels={"example.com/team": "team-{user}"},
                     namespace_annotations={"example.com/owner": "{user}@example.com"})
    with site_policy(env.sim, NAMESPACE_EXTRA_LABEL_PREFIXES="example.com/",
                     NAMESPACE_EXTRA_ANNOTATION_PREFIXES="example.com/"):  # (listed, as deploy/README says)
        await ws.start({}, [])
    made = await env.admin.get(k.NAMESPACE, None, "notebook-nadia")
    assert made["metadata"]["labels"]["example.com/team"] == "team-nadia"
    assert made["metadata"]["labels"]["app.kubernetes.io/managed-by"] == m.MANAGED_BY
    assert made["metadata"]["annotations"]["example.com/owner"] == "nadia@example.com"
    await ws.stop()


def test_the_workstation_log_names_the_workstation_in_the_line_and_on_the_record(caplog):
    """Every line starts with the workstation; the record carries it too (`record.workstation`),
    for a handler that ships structured logs, beside what a caller adds; a user's text is escaped."""
    from kubevirt_spawner.workstation import WorkstationLog
    log = WorkstationLog(LOG, "notebook-ann/ann-workstation")
    with caplog.at_level(logging.INFO, logger=LOG.name):
        log.info("snapshot %s taken", "evil\nline", extra={"operation": "snapshot"})
    [record] = [r for r in caplog.records if r.name == LOG.name]
    assert record.getMessage().startswith("notebook-ann/ann-workstation: snapshot ")
    assert "\n" not in record.getMessage()
    assert record.workstation == "notebook-ann/ann-workstation" and record.operation == "snapshot"
