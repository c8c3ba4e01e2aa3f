"""Contract tests of the simulated API server through the official Python client."""

from __future__ import annotations

import json
import threading

import pytest
from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from kube_objects import CDI, KV, SNAP, clone_dv, vm
from simtools import http, sim_api, start_sim, wait_for


def status_of(exc: ApiException) -> dict:
    return json.loads(exc.body)


def test_discovery_lists_groups_and_kinds(kube, sim):
    groups = {g.name: g for g in client.ApisApi(kube).get_api_versions().groups}
    for g in ("kubevirt.io", "cdi.kubevirt.io", "snapshot.kubevirt.io", "subresources.kubevirt.io",
              "storage.k8s.io", "snapshot.storage.k8s.io", "networking.k8s.io"):
        assert g in groups
    assert [v.version for v in groups["snapshot.kubevirt.io"].versions] == ["v1beta1", "v1alpha1"]
    assert client.VersionApi(kube).get_code().git_version.startswith("v1.32")
    kv = http(sim).get(f"{sim.url}/apis/kubevirt.io/v1/").json()
    vm_entry = next(r for r in kv["resources"] if r["name"] == "virtualmachines")
    assert vm_entry["namespaced"] and "watch" in vm_entry["verbs"] and "vm" in vm_entry["shortNames"]
    assert any(r["name"] == "virtualmachines/status" for r in kv["resources"])
    sub = http(sim).get(f"{sim.url}/apis/subresources.kubevirt.io/v1").json()
    assert {"virtualmachines/start", "virtualmachines/stop", "virtualmachineinstances/guestosinfo"} <= \
        {r["name"] for r in sub["resources"]}


def test_raw_requests_trust_each_simulators_own_ca_when_a_port_is_reused(tmp_path):
    """A module's simulator may get the port of one an earlier module stopped (the kernel hands
    ports out again): raw requests to it must verify its own cluster CA, not the stopped one's
    (before, one CI run's SSH tests failed at setup with 'certificate signature failure')."""
    first = start_sim(tmp_path / "first")
    try:
        assert http(first).get(f"{first.url}/version", timeout=10).status_code == 200
    finally:
        first.stop()
    second = start_sim(tmp_path / "second", port=first.sim.port)
    try:
        assert second.url == first.url and second.ca_file != first.ca_file
        assert http(second).get(f"{second.url}/version", timeout=10).status_code == 200
    finally:
        second.stop()


def test_create_get_conflicts_and_errors(core, ns):
    cm = core.create_namespaced_config_map(ns, {"metadata": {"name": "a", "labels": {"x": "1"}}, "data": {"k": "v"}})
    assert cm.metadata.uid and cm.metadata.resource_version
    with pytest.raises(ApiException) as e:
        core.create_namespaced_config_map(ns, {"metadata": {"name": "a"}})
    assert e.value.status == 409 and status_of(e.value)["reason"] == "AlreadyExists"
    gen = core.create_namespaced_config_map(ns, {"metadata": {"generateName": "gen-"}})
    assert gen.metadata.name.startswith("gen-") and len(gen.metadata.name) > 4
    with pytest.raises(ApiException) as e:
        core.read_namespaced_config_map("missing", ns)
    body = status_of(e.value)
    assert e.value.status == 404 and body["kind"] == "Status" and body["reason"] == "NotFound"
    assert body["message"] == 'configmaps "missing" not found'
    with pytest.raises(ApiException) as e:
        core.create_namespaced_config_map("no-such-namespace", {"metadata": {"name": "a"}})
    assert e.value.status == 404 and status_of(e.value)["message"] == 'namespaces "no-such-namespace" not found'


def test_update_with_stale_resource_version_is_a_conflict(core, ns):
    cm = core.create_namespaced_config_map(ns, {"metadata": {"name": "c"}, "data": {"k": "1"}})
    cm.data = {"k": "2"}
    fresh = core.replace_namespaced_config_map("c", ns, cm)
    assert int(fresh.metadata.resource_version) > int(cm.metadata.resource_version)
    cm.data = {"k": "3"}  # still carries the old resourceVersion
    with pytest.raises(ApiException) as e:
        core.replace_namespaced_config_map("c", ns, cm)
    assert e.value.status == 409 and status_of(e.value)["reason"] == "Conflict"
    assert "the object has been modified" in status_of(e.value)["message"]


def test_patches_merge_json_with_test_and_strategic(core, custom, ns, sim):
    core.create_namespaced_service(ns, {"metadata": {"name": "s", "labels": {"a": "1"}},
                                        "spec": {"selector": {"app": "x"}, "ports": [{"name": "http", "port": 80}]}})
    # The Python client sends a dict body to a core kind as a strategic merge patch.
    svc = core.patch_namespaced_service("s", ns, {"metadata": {"labels": {"b": "2"}},
                                                  "spec": {"ports": [{"name": "ssh", "port": 22}]}})
    assert svc.metadata.labels == {"a": "1", "b": "2"}
    assert sorted(p.port for p in svc.spec.ports) == [22, 80]  # merged by the `port` key
    svc = core.patch_namespaced_service("s", ns, [{"op": "test", "path": "/metadata/labels/a", "value": "1"},
                                                  {"op": "replace", "path": "/metadata/labels/a", "value": "3"}])
    assert svc.metadata.labels["a"] == "3"
    with pytest.raises(ApiException) as e:
        core.patch_namespaced_service("s", ns, [{"op": "test", "path": "/metadata/labels/a", "value": "1"},
                                                {"op": "remove", "path": "/metadata/labels/a"}])
    assert e.value.status == 422 and "test failed" in e.value.body
    custom.create_namespaced_custom_object(*KV, ns, "virtualmachines", vm("v", "disk"))
    # Custom objects get a JSON merge patch; null deletes.
    custom.patch_namespaced_custom_object(*KV, ns, "virtualmachines", "v", {"metadata": {"labels": {"k": "v"}}})
    got = custom.patch_namespaced_custom_object(*KV, ns, "virtualmachines", "v", {"metadata": {"labels": {"k": None}}})
    assert "k" not in (got["metadata"].get("labels") or {})
    r = http(sim).patch(f"{sim.url}/apis/kubevirt.io/v1/namespaces/{ns}/virtualmachines/v", data="{}",
                       headers={"Content-Type": "application/strategic-merge-patch+json"})
    assert r.status_code == 415


def test_label_and_field_selectors_and_paging(core, ns):
    for i, (team, tier) in enumerate([("a", "gpu"), ("a", "cpu"), ("b", "gpu"), ("c", None)]):
        labels = {"team": team}
        if tier:
            labels["tier"] = tier
        core.create_namespaced_config_map(ns, {"metadata": {"name": f"cm{i}", "labels": labels}})

    def names(**kw):
        return sorted(c.metadata.name for c in core.list_namespaced_config_map(ns, **kw).items)
    assert names(label_selector="team=a") == ["cm0", "cm1"]
    assert names(label_selector="team!=a") == ["cm2", "cm3"]
    assert names(label_selector="team in (a,b),tier=gpu") == ["cm0", "cm2"]
    assert names(label_selector="team notin (a)") == ["cm2", "cm3"]
    assert names(label_selector="!tier") == ["cm3"]
    assert names(label_selector="tier") == ["cm0", "cm1", "cm2"]
    assert names(field_selector="metadata.name=cm2") == ["cm2"]
    with pytest.raises(ApiException) as e:
        core.list_namespaced_config_map(ns, label_selector="team in a,b)")
    assert e.value.status == 400
    page = core.list_namespaced_config_map(ns, limit=3)
    assert len(page.items) == 3 and page.metadata._continue and page.metadata.remaining_item_count == 1
    rest = core.list_namespaced_config_map(ns, limit=3, _continue=page.metadata._continue)
    assert [c.metadata.name for c in rest.items] == ["cm3"] and not rest.metadata._continue


def test_watch_streams_resumes_and_expires(core, ns, sim):
    start = core.list_namespaced_config_map(ns).metadata.resource_version
    seen = []

    def watcher():
        w = watch.Watch()
        for ev in w.stream(core.list_namespaced_config_map, ns, resource_version=start, timeout_seconds=5):
            seen.append((ev["type"], ev["object"].metadata.name))
            if len(seen) == 3:
                w.stop()
    t = threading.Thread(target=watcher)
    t.start()
    core.create_namespaced_config_map(ns, {"metadata": {"name": "w1"}})
    core.patch_namespaced_config_map("w1", ns, {"data": {"a": "b"}})
    core.delete_namespaced_config_map("w1", ns)
    t.join(10)
    assert seen == [("ADDED", "w1"), ("MODIFIED", "w1"), ("DELETED", "w1")]
    # Resuming from a resourceVersion replays what happened after it.
    replay = [ev["type"] for ev in watch.Watch().stream(core.list_namespaced_config_map, ns,
                                                           resource_version=start, timeout_seconds=1)]
    assert replay == ["ADDED", "MODIFIED", "DELETED"]
    # A selector that stops matching turns a change into DELETED for that watch.
    core.create_namespaced_config_map(ns, {"metadata": {"name": "w2", "labels": {"keep": "yes"}}})
    rv = core.list_namespaced_config_map(ns).metadata.resource_version
    core.patch_namespaced_config_map("w2", ns, {"metadata": {"labels": {"keep": "no"}}})
    evs = [ev["type"] for ev in watch.Watch().stream(core.list_namespaced_config_map, ns, label_selector="keep=yes",
                                                        resource_version=rv, timeout_seconds=1)]
    assert evs == ["DELETED"]
    # A resourceVersion older than the kept history is 410 Gone.
    sim.call(lambda: sim.cluster.store.history.clear())
    sim.call(lambda: [sim.cluster.store.history.append((10**9, ("", "x"), "ADDED", {}, None))
                      for _ in range(sim.cluster.store.history.maxlen)])
    with pytest.raises(ApiException) as e:
        list(watch.Watch().stream(core.list_namespaced_config_map, ns, resource_version="1", timeout_seconds=1))
    assert e.value.status == 410
    sim.call(lambda: sim.cluster.store.history.clear())


def test_watch_bookmarks_only_when_asked(core, ns, sim):
    """With allowWatchBookmarks the API server's watch cache sends a BOOKMARK (the kind, and only a
    resourceVersion) about once a minute and right before the watch ends
    (staging/src/k8s.io/apiserver/pkg/storage/cacher/cacher.go, defaultBookmarkFrequency); without
    it, none. (The minute is divided by the simulator's speed, here set shorter.)"""
    saved = sim_api(sim, "GET", "/timing")["timing"]["bookmark"]
    sim_api(sim, "PUT", "/timing", {"bookmark": 20})  # 0.5 s at the tests' speed
    try:
        core.create_namespaced_config_map(ns, {"metadata": {"name": "b1"}})
        rv = core.list_namespaced_config_map(ns).metadata.resource_version
        url = f"{sim.url}/api/v1/namespaces/{ns}/configmaps"
        with_marks = http(sim).get(url, params={"watch": "1", "resourceVersion": rv, "allowWatchBookmarks": "true",
                                               "timeoutSeconds": "2"}, timeout=10)
        without = http(sim).get(url, params={"watch": "1", "resourceVersion": rv, "timeoutSeconds": "1"}, timeout=10)
    finally:
        sim_api(sim, "PUT", "/timing", {"bookmark": saved})
    events = [json.loads(line) for line in with_marks.text.splitlines()]
    assert len(events) >= 3 and {e["type"] for e in events} == {"BOOKMARK"}, events
    assert events[0]["object"] == {"kind": "ConfigMap", "apiVersion": "v1",
                                   "metadata": {"resourceVersion": events[0]["object"]["metadata"]["resourceVersion"]}}
    assert int(events[-1]["object"]["metadata"]["resourceVersion"]) >= int(rv)
    assert without.text == ""


def test_watch_timeout_and_cut(core, ns, sim):
    import time
    t0 = time.monotonic()
    assert list(watch.Watch().stream(core.list_namespaced_secret, ns, timeout_seconds=1)) == []
    assert time.monotonic() - t0 < 5
    done = threading.Event()

    def watcher():
        # Drain the stream: it ends only when the simulator cuts it (well before the 30 s timeout).
        list(watch.Watch().stream(core.list_namespaced_secret, ns, timeout_seconds=30,
                                  resource_version=core.list_namespaced_secret(ns).metadata.resource_version))
        done.set()
    threading.Thread(target=watcher, daemon=True).start()
    wait_for(lambda: len(sim.cluster.store.watchers) > 0, what="watch registered")
    assert http(sim).post(f"{sim.url}/sim/v1/watches/cut").json()["cut"] >= 1
    assert done.wait(5)


def test_finalizers_and_propagation(core, ns):
    owner = core.create_namespaced_config_map(ns, {"metadata": {"name": "owner"}})
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner.metadata.uid,
           "blockOwnerDeletion": True}
    for n in ("dep1", "dep2"):
        core.create_namespaced_config_map(ns, {"metadata": {"name": n, "ownerReferences": [ref]}})
    core.delete_namespaced_config_map("owner", ns, propagation_policy="Orphan")
    dep = core.read_namespaced_config_map("dep1", ns)
    assert not dep.metadata.owner_references
    owner = core.create_namespaced_config_map(ns, {"metadata": {"name": "owner2"}})
    ref["uid"], ref["name"] = owner.metadata.uid, "owner2"
    core.create_namespaced_config_map(ns, {"metadata": {"name": "dep3", "ownerReferences": [ref],
                                                        "finalizers": ["example.com/hold"]}})
    core.delete_namespaced_config_map("owner2", ns, propagation_policy="Foreground")
    # Foreground: the owner waits (deletionTimestamp + finalizer) until its dependent is gone.
    o = core.read_namespaced_config_map("owner2", ns)
    assert o.metadata.deletion_timestamp and "foregroundDeletion" in o.metadata.finalizers
    d = core.read_namespaced_config_map("dep3", ns)
    assert d.metadata.deletion_timestamp
    core.patch_namespaced_config_map("dep3", ns, {"metadata": {"finalizers": None}})
    with pytest.raises(ApiException):
        core.read_namespaced_config_map("dep3", ns)
    with pytest.raises(ApiException):
        core.read_namespaced_config_map("owner2", ns)
    # Background (default): dependents go after the owner.
    owner = core.create_namespaced_config_map(ns, {"metadata": {"name": "owner3"}})
    ref["uid"], ref["name"] = owner.metadata.uid, "owner3"
    core.create_namespaced_config_map(ns, {"metadata": {"name": "dep4", "ownerReferences": [ref]}})
    core.delete_namespaced_config_map("owner3", ns)
    assert "dep4" not in [c.metadata.name for c in core.list_namespaced_config_map(ns).items]


def test_schema_validation_prunes_or_refuses_unknown_fields(custom, ns, sim, schemas):
    bad = vm("typo", "disk")
    bad["spec"]["template"]["spec"]["domain"]["resources"]["requests"]["cpu"] = {"not": "a quantity"}
    with pytest.raises(ApiException) as e:
        custom.create_namespaced_custom_object(*KV, ns, "virtualmachines", bad)
    body = status_of(e.value)
    assert e.value.status == 422 and body["reason"] == "Invalid"
    assert body["details"]["causes"][0]["field"].startswith("spec.template.spec.domain.resources.requests")
    extra = vm("extra", "disk")
    extra["spec"]["template"]["spec"]["domain"]["bogusField"] = 1
    r = http(sim).post(f"{sim.url}/apis/kubevirt.io/v1/namespaces/{ns}/virtualmachines?fieldValidation=Strict",
                      json=extra)
    # the decoder's refusal (apiserver's endpoints/handlers/create.go: a strict decoding error is a
    # BadRequest), before validation
    assert r.status_code == 400 and r.json()["message"] == \
        'strict decoding error: unknown field "spec.template.spec.domain.bogusField"'
    r = http(sim).post(f"{sim.url}/apis/kubevirt.io/v1/namespaces/{ns}/virtualmachines", json=extra)
    assert r.status_code == 201 and "bogusField" in r.headers.get("Warning", "")
    assert "bogusField" not in r.json()["spec"]["template"]["spec"]["domain"]


def test_a_dry_run_create_changes_nothing_and_meets_an_existing_name(custom, ns, sim, schemas):
    """dryRun=All goes through decoding, validation and admission, and storage's check of the
    name (apiserver's registry/generic/registry/dryrun.go), but stores nothing."""
    url = f"{sim.url}/apis/kubevirt.io/v1/namespaces/{ns}/virtualmachines"
    r = http(sim).post(f"{url}?dryRun=All&fieldValidation=Strict", json=vm("dry", "disk"))
    assert r.status_code == 201 and r.json()["metadata"]["name"] == "dry"
    assert "dry" not in [o["metadata"]["name"] for o in custom.list_namespaced_custom_object(*KV, ns,
                                                                                          "virtualmachines")["items"]]
    custom.create_namespaced_custom_object(*KV, ns, "virtualmachines", vm("dry", "disk"))
    r = http(sim).post(f"{url}?dryRun=All", json=vm("dry", "disk"))
    assert r.status_code == 409 and r.json()["reason"] == "AlreadyExists"


def test_admission_rules(custom, core, ns):
    both = vm("both", "disk")
    both["spec"]["running"] = False
    with pytest.raises(ApiException) as e:
        custom.create_namespaced_custom_object(*KV, ns, "virtualmachines", both)
    assert e.value.status == 422 and "mutually exclusive" in e.value.body
    neither = vm("neither", "disk")
    del neither["spec"]["runStrategy"]
    with pytest.raises(ApiException) as e:
        custom.create_namespaced_custom_object(*KV, ns, "virtualmachines", neither)
    assert e.value.status == 422
    custom.create_namespaced_custom_object(*CDI, ns, "datavolumes", clone_dv("d1"))
    with pytest.raises(ApiException) as e:
        custom.patch_namespaced_custom_object(*CDI, ns, "datavolumes", "d1",
                                              {"spec": {"storage": {"resources": {"requests": {"storage": "99Gi"}}}}})
    assert e.value.status == 422
    core.create_namespaced_persistent_volume_claim(ns, {"metadata": {"name": "plain"}, "spec": {
        "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}})
    with pytest.raises(ApiException) as e:
        custom.create_namespaced_custom_object(*CDI, ns, "datavolumes", clone_dv("plain"))
    assert e.value.status == 422 and "already exists" in e.value.body
    snap = {"apiVersion": "snapshot.kubevirt.io/v1beta1", "kind": "VirtualMachineSnapshot",
            "metadata": {"name": "s"}, "spec": {"source": {"kind": "VirtualMachine", "name": "x"}}}
    with pytest.raises(ApiException) as e:
        custom.create_namespaced_custom_object(*SNAP, ns, "virtualmachinesnapshots", snap)
    assert e.value.status == 422 and "apiGroup" in e.value.body
    snap["spec"]["source"]["apiGroup"] = "kubevirt.io"
    custom.create_namespaced_custom_object(*SNAP, ns, "virtualmachinesnapshots", snap)
    with pytest.raises(ApiException) as e:
        custom.patch_namespaced_custom_object(*SNAP, ns, "virtualmachinesnapshots", "s",
                                              {"spec": {"source": {"name": "y"}}})
    assert e.value.status == 422
    restore = {"apiVersion": "snapshot.kubevirt.io/v1beta1", "kind": "VirtualMachineRestore",
               "metadata": {"name": "r1"}, "spec": {"target": {"apiGroup": "kubevirt.io", "kind": "VirtualMachine",
                                                               "name": "x"}, "virtualMachineSnapshotName": "s"}}
    custom.create_namespaced_custom_object(*SNAP, ns, "virtualmachinerestores", restore)
    restore["metadata"]["name"] = "r2"
    with pytest.raises(ApiException) as e:
        custom.create_namespaced_custom_object(*SNAP, ns, "virtualmachinerestores", restore)
    assert e.value.status == 422 and "in progress" in e.value.body


def test_resource_quota_for_storage_and_claims(core, custom, ns):
    core.create_namespaced_resource_quota(ns, {"metadata": {"name": "q"}, "spec": {"hard": {
        "requests.storage": "30Gi", "persistentvolumeclaims": "2"}}})
    core.create_namespaced_persistent_volume_claim(ns, {"metadata": {"name": "a"}, "spec": {
        "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "20Gi"}}}})
    with pytest.raises(ApiException) as e:
        core.create_namespaced_persistent_volume_claim(ns, {"metadata": {"name": "b"}, "spec": {
            "accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "20Gi"}}}})
    body = status_of(e.value)
    assert e.value.status == 403 and body["reason"] == "Forbidden"
    assert "exceeded quota: q, requested: requests.storage=20Gi, used: requests.storage=20Gi" in body["message"]
    # CDI cannot create the PVC of a DataVolume over quota: the DataVolume says why.
    custom.create_namespaced_custom_object(*CDI, ns, "datavolumes", clone_dv("big", "50Gi"))
    dv = wait_for(lambda: (lambda d: d if any(c.get("reason") == "ErrExceededQuota"
                                              for c in d.get("status", {}).get("conditions", [])) else None)(
        custom.get_namespaced_custom_object(*CDI, ns, "datavolumes", "big")), what="quota condition")
    assert dv["status"]["phase"] == "Pending"


def test_state_survives_a_restart(tmp_path):
    s = start_sim(tmp_path)
    from simtools import api_client
    core = client.CoreV1Api(api_client(s))
    core.create_namespace({"metadata": {"name": "keep"}})
    core.create_namespaced_config_map("keep", {"metadata": {"name": "c"}, "data": {"k": "v"}})
    rv = core.list_namespaced_config_map("keep").metadata.resource_version
    s.stop()
    s2 = start_sim(tmp_path)
    try:
        core2 = client.CoreV1Api(api_client(s2))
        assert core2.read_namespaced_config_map("c", "keep").data == {"k": "v"}
        assert int(core2.list_namespaced_config_map("keep").metadata.resource_version) >= int(rv)
        assert core2.read_namespaced_persistent_volume_claim("ubuntu-24-04-cuda-golden", "vm-images").status.phase == "Bound"
    finally:
        s2.stop()


def test_injected_api_errors(core, sim, ns):
    http(sim).put(f"{sim.url}/sim/v1/faults/api", json={"verb": "list", "resource": "configmaps", "rate": 1,
                                                       "code": 429})
    try:
        with pytest.raises(ApiException) as e:
            core.list_namespaced_config_map(ns)
        assert e.value.status == 429 and e.value.headers.get("Retry-After") == "1"
    finally:
        http(sim).delete(f"{sim.url}/sim/v1/faults/api")
    core.list_namespaced_config_map(ns)
    http(sim).put(f"{sim.url}/sim/v1/faults/api", json={"verb": "get", "resource": "secrets", "rate": 1, "code": 500})
    try:
        with pytest.raises(ApiException) as e:
            core.read_namespaced_secret("x", ns)
        assert e.value.status == 500 and status_of(e.value)["reason"] == "InternalError"
    finally:
        http(sim).delete(f"{sim.url}/sim/v1/faults/api")
    assert http(sim).put(f"{sim.url}/sim/v1/faults/api", json={"rate": 2}).status_code == 400


def test_two_simulators_never_draw_the_same_addresses(tmp_path, monkeypatch):
    """Each simulator holds its loopback ranges while it runs (a lock file per pair): two that drew
    the same pair took each other's Service addresses ("address already in use"), a failure
    pytest-xdist's parallel workers met."""
    from kubevirt_spawner.sim import cluster

    class Unshuffled:
        def shuffle(self, picks):  # every simulator draws the same first pair
            pass
    monkeypatch.setattr(cluster.random, "SystemRandom", Unshuffled)
    first, second = tmp_path / "one", tmp_path / "two"
    first.mkdir()
    second.mkdir()
    held = [cluster._networks(str(first)), cluster._networks(str(second))]
    try:
        assert held[0][0] != held[1][0] and held[0][1] != held[1][1]
        again = cluster._networks(str(first))  # the same state directory keeps its pair
        assert again[0] == held[0][0] and again[2] is None  # (held by the first: said in a warning)
    finally:
        for _, _, lock in held:
            lock.close()
