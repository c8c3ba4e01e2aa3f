"""Node drains on the real hub, the workstations service, the proxy, a real `kubectl drain` (v1.32)
and the simulator's eviction as KubeVirt v1.9 does it: the spawner's VMs have
`evictionStrategy: External`, so virt-api's eviction webhook denies the launcher pod's eviction
with 429 and marks the VMI (status.evacuationNodeName: kubevirt pkg/virt-api/webhooks/
validating-webhook/admitters/pod-eviction-admitter.go), kubectl retries every 5 s
(kubernetes staging/src/k8s.io/kubectl/pkg/drain/drain.go), KubeVirt migrates nothing
(pkg/virt-controller/watch/drain/evacuation/evacuation.go), and the service warns, waits the
grace, stops through the hub; then the pod is gone and the drain completes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from datetime import datetime, timedelta

import pytest
from conftest import SERVICE_API, Cluster, Hub, hub_with_service

from simtools import wait_for

GRACE = 40
PRICES = {"currency": "EUR", "cpu_hour": 0.5, "memory_gib_hour": 0.1, "disk_gib_month": 7.3, "snapshot_gib_month": 3.65}
EXTRA = f"""
c.Workstations.drain_grace = {GRACE}
c.Workstations.drain_check_every = 1
c.KubeVirtSpawner.stop_timeout = 20
c.Workstations.meter_every = 1
c.Workstations.prices = {PRICES!r}
"""
NODE, OTHER = "vm-cpu-1", "vm-cpu-2"
REASON_ANNOTATION = "kubevirt-spawner.io/drain-reason"


@pytest.fixture(scope="module")
def hub(e2e_sim, tmp_path_factory):
    yield from hub_with_service(e2e_sim, tmp_path_factory, EXTRA)


def kubectl(cluster: Cluster, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["kubectl", *args], env={**os.environ, "KUBECONFIG": cluster.sim.kubeconfig},
                          capture_output=True, text=True, timeout=timeout)


def status(hub: Hub, user: str) -> dict:
    r = hub.http.get(f"{hub.url}{SERVICE_API}/workstations/{user}", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def node_of(cluster: Cluster, user: str) -> str | None:
    return ((cluster.vmi(f"notebook-{user}", f"{user}-workstation") or {}).get("status") or {}).get("nodeName")


def on_node_only(cluster: Cluster, start):
    """Run `start` while the other CPU node is cordoned, so the machines land on NODE."""
    assert kubectl(cluster, "cordon", OTHER).returncode == 0
    try:
        start()
    finally:
        kubectl(cluster, "uncordon", OTHER)


def admin_drain(hub: Hub, tmp_path, *args: str, wait: bool = True):
    env = {**os.environ, "JUPYTERHUB_URL": hub.url + "/", "JUPYTERHUB_API_TOKEN": hub.settings.admin_token,
           "HOME": str(tmp_path)}
    command = [sys.executable, "-m", "kubevirt_spawner.cli", "admin", "drain", *args]
    if wait:
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def metric(hub: Hub, event: str) -> float:
    text = hub.http.get(f"{hub.url}/services/workstations/metrics", timeout=30).text
    found = re.search(rf'^workstations_drains_total{{event="{event}"}} ([0-9.]+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def test_a_kubectl_drain_warns_both_users_and_stops_their_machines_after_the_grace(hub: Hub, cluster: Cluster):
    """Two running workstations on one node; an admin says why on the node and runs kubectl drain.
    Both users are warned (the Lab shows it, with "Stop now": the browser test for one of them),
    nothing stops before the grace ends, then both stop through the hub with their disks kept, the
    drain completes, and the next start lands on another node."""
    from conftest import CHROMIUM
    from playwright.sync_api import sync_playwright
    from test_lab import login_and_start

    users = ("dee", "dan")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"])
        drain = None
        try:
            page = browser.new_context(viewport={"width": 1400, "height": 900}).new_page()
            page.set_default_timeout(60_000)
            on_node_only(cluster, lambda: (login_and_start(page, hub, "dee"), hub.start_server("dan", timeout=180)))
            assert [node_of(cluster, u) for u in users] == [NODE, NODE]
            disks = {u: cluster.core.read_namespaced_persistent_volume_claim(f"{u}-rootdisk", f"notebook-{u}")
                     .metadata.uid for u in users}
            assert kubectl(cluster, "annotate", "node", NODE, f"{REASON_ANNOTATION}=kernel update").returncode == 0
            drain = subprocess.Popen(["kubectl", "drain", NODE, "--ignore-daemonsets", "--delete-emptydir-data",
                                      "--timeout=300s"], env={**os.environ, "KUBECONFIG": cluster.sim.kubeconfig},
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            seen = {u: wait_for(lambda u=u: status(hub, u)["drain"], 30, what=f"{u} warned") for u in users}
            for view in seen.values():
                assert (view["node"], view["reason"], view["grace_seconds"]) == (NODE, "kernel update", GRACE), view
                since, deadline = datetime.fromisoformat(view["since"]), datetime.fromisoformat(view["deadline"])
                assert deadline - since == timedelta(seconds=GRACE)
            warning = page.locator(".jp-toast-message", has_text="is being drained (kernel update)")
            warning.wait_for(timeout=30_000)  # (the panel's status poll: every 15 s)
            assert re.search(r"will be stopped in \d+ s\. Save your work\.$", warning.inner_text()), warning.inner_text()
            page.locator('li[data-id="kubevirt-workstation"]').click()  # the panel says the rest
            page.locator(".kvs-summary dd", has_text=f"{NODE} (kernel update): stopped in").wait_for(timeout=20_000)
            assert re.search(r"^\d+\.\d\d EUR this month; \d+\.\d\d EUR an hour now$",
                             page.locator(".kvs-summary dd", has_text="EUR this month").inner_text())
            assert page.locator(".jp-toast-button", has_text="Stop now").is_visible()

            # Nothing is stopped before the grace ends ...
            deadline = min(datetime.fromisoformat(v["deadline"]) for v in seen.values())
            while datetime.now().astimezone() < deadline - timedelta(seconds=3):
                for u in users:
                    assert (hub.server_model(u) or {}).get("ready"), f"{u}'s machine stopped before the grace ended"
                    assert node_of(cluster, u) == NODE
                time.sleep(1)
            # ... then both are, through the hub, and the drain completes.
            for u in users:
                wait_for(lambda u=u: hub.server_model(u) is None, 90, what=f"{u} stopped by the drain")
                wait_for(lambda u=u: cluster.vmi(f"notebook-{u}", f"{u}-workstation") is None, 60, what=f"{u}'s VMI")
            out, err = drain.communicate(timeout=120)
            assert drain.returncode == 0 and f"node/{NODE} drained" in out, (out, err)
            assert "Eviction triggered evacuation" in err  # (kubectl's retries while the users were warned)
            for u in users:
                view = status(hub, u)
                assert view["drain"] is None and view["phase"] == "stopped", view
                assert "after the warning's grace period" in view["last_stop"]["text"], view["last_stop"]
                assert "the next start goes to another node" in view["last_stop"]["text"]
                assert cluster.core.read_namespaced_persistent_volume_claim(
                    f"{u}-rootdisk", f"notebook-{u}").metadata.uid == disks[u]
                assert f"drain-warn {u}: stop due" in hub.log() and f"drain-stop {u}: stopped after grace" in hub.log()
            assert metric(hub, "stopped-after-grace") == 2 and metric(hub, "warned") == 2

            hub.start_server("dan", timeout=180)
            assert node_of(cluster, "dan") == OTHER  # (the drained node is cordoned)
            assert status(hub, "dan")["last_stop"] is None
        finally:
            if drain is not None and drain.poll() is None:
                drain.kill()
            browser.close()
            kubectl(cluster, "uncordon", NODE)
            kubectl(cluster, "annotate", "node", NODE, f"{REASON_ANNOTATION}-")
            for u in users:
                hub.stop_server(u)


def test_admin_drain_warns_waits_and_prints_the_kubectl_drain(hub: Hub, cluster: Cluster, tmp_path):
    """`kubevirt-spawner admin drain`: a bad or unknown node is one sentence and exit status 2; a
    dry run lists who would be warned and warns nobody; the drain warns, waits until the machine
    is gone (here the user stops it early, as "Stop now" does), then prints the kubectl drain."""
    bad = admin_drain(hub, tmp_path, "No_Such!")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "Kubernetes name" in bad.stderr, bad.stderr
    unknown = admin_drain(hub, tmp_path, "vm-nope-9")
    assert unknown.returncode == 2 and "There is no node named vm-nope-9." in unknown.stderr, unknown.stderr
    empty = admin_drain(hub, tmp_path, "vm-gpu-pci-1", "--dry-run")
    assert empty.returncode == 0 and "No workstation runs on vm-gpu-pci-1" in empty.stdout, empty

    on_node_only(cluster, lambda: hub.start_server("dot", timeout=180))
    assert node_of(cluster, "dot") == NODE
    dry = admin_drain(hub, tmp_path, NODE, "--dry-run")
    assert dry.returncode == 0 and f"would warn dot, and stop it {GRACE} s later" in dry.stdout, dry
    assert status(hub, "dot")["drain"] is None  # (a dry run warns nobody)

    uncordoned = admin_drain(hub, tmp_path, NODE)
    assert uncordoned.returncode == 2 and f"Cordon {NODE} first (kubectl cordon {NODE})" in uncordoned.stderr
    assert status(hub, "dot")["drain"] is None  # (refused: nobody warned)
    assert kubectl(cluster, "cordon", NODE).returncode == 0
    try:
        run = admin_drain(hub, tmp_path, NODE, "--reason", "disk swap", wait=False)
        # (the cordon warned dot at once; the admin's reason then replaces the node's)
        view = wait_for(lambda: (lambda v: v if v and v["reason"] == "disk swap" else None)(status(hub, "dot")["drain"]),
                        30, what="dot warned, with the admin's reason")
        assert view["node"] == NODE
        r = hub.http.post(f"{hub.url}{SERVICE_API}/workstations/dot/stop", json={"wait": False}, timeout=30)
        assert r.status_code in (200, 202), r.text  # what the Lab's "Stop now" asks
        out, err = run.communicate(timeout=120)
        assert run.returncode == 0, (out, err)
        assert "warned dot: stopped at" in out
        assert out.rstrip().endswith(f"No workstation runs on {NODE}. Drain it now:\n"
                                     f"  kubectl drain {NODE} --ignore-daemonsets --delete-emptydir-data"), out
        stopped = wait_for(lambda: status(hub, "dot")["last_stop"], 30, what="dot's stop recorded")
        assert "during the warning's grace period" in stopped["text"] and "disk swap" in stopped["text"], stopped
    finally:
        kubectl(cluster, "uncordon", NODE)


def test_status_and_reports_show_quota_retention_and_cost(hub: Hub, cluster: Cluster):
    """After the drains, each user's status says their quota (the namespace's ResourceQuota status),
    the snapshot limit and retention, and this month's units and cost, priced as configured; the
    admins' JSON and CSV reports and the metrics say the same."""
    view = status(hub, "dee")
    assert view["snapshots"]["limit"] == 20 and "kept until you delete them" in view["snapshots"]["retention"]
    assert isinstance(view["quota"], list)
    for quota in view["quota"]:
        assert set(quota["used"]) <= set(quota["hard"]), quota
    cost = view["cost"]
    month = cost["this_month"]
    assert cost["currency"] == "EUR" and not cost["held"]["running"] and cost["held"]["disk_gib"] > 0
    assert month["cpu_hours"] > 0 and month["disk_gib_months"] > 0  # (dee's machine ran, its disks stay)
    by_hand = (month["cpu_hours"] * 0.5 + month["memory_gib_hours"] * 0.1 + month["disk_gib_months"] * 7.3
               + month["snapshot_gib_months"] * 3.65)
    assert abs(month["cost"]["total"] - by_hand) < 0.001, (month, by_hand)
    assert cost["per_hour"]["cpu_hours"] == 0 and cost["per_hour"]["cost"]["total"] > 0  # (stopped: disks only)

    report = hub.http.get(f"{hub.url}{SERVICE_API}/costs", params={"by": "user"}, timeout=30)
    assert report.status_code == 200, report.text
    rows = {r["user"]: r for r in report.json()["rows"]}
    assert {"dee", "dan", "dot"} <= set(rows) and rows["dee"]["cost"]["total"] >= month["cost"]["total"]
    table = hub.http.get(f"{hub.url}{SERVICE_API}/costs", params={"by": "user", "format": "csv"}, timeout=30)
    assert table.headers["Content-Type"].startswith("text/csv")
    lines = {line.split(",")[1]: line.split(",") for line in table.text.splitlines()[1:]}
    assert abs(float(lines["dee"][-1]) - rows["dee"]["cost"]["total"]) < 0.01
    bad = hub.http.get(f"{hub.url}{SERVICE_API}/costs", params={"month": "last"}, timeout=30)
    assert bad.status_code == 400 and "YYYY-MM" in bad.json()["error"]
    metrics = hub.http.get(f"{hub.url}/services/workstations/metrics", timeout=30).text
    found = re.search(r'^workstations_cost_total\{profile="[^"]*",user="dee"\} ([0-9.e+-]+)$', metrics, re.M)
    assert found and float(found.group(1)) >= month["cost"]["total"] - 0.01, metrics[-2000:]
    assert re.search(r'^workstations_held\{resource="disk_gib"\} [1-9]', metrics, re.M)

    # The admins' page: capacity now, this month's and last month's costs, who holds disks while stopped.
    page = hub.http.get(f"{hub.url}/services/workstations/", timeout=30)
    assert page.status_code == 200 and "Capacity and costs" in page.text, page.text[:500]
    month = report.json()["month"]
    table = re.search(rf'<table class="table cost-report" data-month="{month}" data-by="user">(.*?)</table>', page.text,
                      re.S)
    assert table and re.search(r"<td>dee</td>.*?<td>{:.2f}</td>".format(rows["dee"]["cost"]["total"]), table.group(1),
                               re.S), table
    stopped = re.search(r'<table class="table stopped">(.*?)</table>', page.text, re.S).group(1)
    assert re.search(r"<td>dee</td><td>[^<]+</td><td>[1-9][0-9.]*</td>", stopped), stopped


def launcher_pod(cluster: Cluster, user: str) -> str:
    pods = cluster.core.list_namespaced_pod(f"notebook-{user}", label_selector="kubevirt.io=virt-launcher").items
    running = [p.metadata.name for p in pods if p.status.phase not in ("Succeeded", "Failed")]
    assert len(running) == 1, running
    return running[0]


def test_only_a_node_being_emptied_is_a_drain(hub: Hub, cluster: Cluster):
    """Issue 47, item 4. KubeVirt marks the VMI for any eviction of its launcher pod
    (pod-eviction-admitter.go markVMI), and for the descheduler's (its Eviction annotated
    requested-by: sigs.k8s.io/descheduler) annotates it kubevirt.io/eviction-source: descheduler;
    only the node's cordon (kubectl pkg/drain/cordon.go) says a node is being emptied. A
    descheduler-style eviction on a schedulable node leaves the machine running, unwarned. A
    cordon warns at once, and an uncordon withdraws the warning. `kubectl drain
    --disable-eviction` deletes the launcher pod without the Eviction API, right after its
    cordon: the machine stops, and its status says why."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    ns = "notebook-dora"
    on_node_only(cluster, lambda: hub.start_server("dora", timeout=180))
    assert node_of(cluster, "dora") == NODE
    try:
        eviction = client.V1Eviction(api_version="policy/v1", kind="Eviction", metadata=client.V1ObjectMeta(
            name=launcher_pod(cluster, "dora"), namespace=ns, annotations={"requested-by": "sigs.k8s.io/descheduler"}))
        with pytest.raises(ApiException) as denied:
            cluster.core.create_namespaced_pod_eviction(eviction.metadata.name, ns, eviction)
        assert denied.value.status == 429 and "Eviction triggered evacuation" in denied.value.body
        vmi = cluster.vmi(ns, "dora-workstation")
        assert vmi["status"]["evacuationNodeName"] == NODE
        assert vmi["metadata"]["annotations"]["kubevirt.io/eviction-source"] == "descheduler"
        wait_for(lambda: "which is not being drained: it keeps running" in hub.log(), 30, what="the service's note")
        time.sleep(3)  # (rounds every second: none warns)
        assert status(hub, "dora")["drain"] is None and (hub.server_model("dora") or {}).get("ready")

        assert kubectl(cluster, "cordon", NODE).returncode == 0
        began = time.monotonic()
        view = wait_for(lambda: status(hub, "dora")["drain"], 10, interval=0.2, what="dora warned at the cordon")
        assert view["node"] == NODE and time.monotonic() - began < 5
        assert kubectl(cluster, "uncordon", NODE).returncode == 0
        wait_for(lambda: status(hub, "dora")["drain"] is None, 10, interval=0.2, what="the warning withdrawn")
        assert "drain-withdrawn dora: kept running" in hub.log()
        assert (hub.server_model("dora") or {}).get("ready")

        drain = kubectl(cluster, "drain", NODE, "--disable-eviction", "--ignore-daemonsets", "--delete-emptydir-data",
                        "--timeout=120s", timeout=150)
        assert drain.returncode == 0 and f"node/{NODE} drained" in drain.stdout, (drain.stdout, drain.stderr)
        # KubeVirt starts the VM again elsewhere (its run strategy is Always); its status says why
        # the machine went down
        stopped = wait_for(lambda: status(hub, "dora")["last_stop"], 60, what="dora's stop recorded")
        assert stopped["why"] == "drain" and stopped["node"] == NODE, stopped
        assert "Went down" in stopped["text"] and "its node vm-cpu-1 was drained" in stopped["text"], stopped
        assert "KubeVirt started it again on another node. Its disks are kept" in stopped["text"], stopped
        assert node_of(cluster, "dora") == OTHER
    finally:
        kubectl(cluster, "uncordon", NODE)
        hub.stop_server("dora")
