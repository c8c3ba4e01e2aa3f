"""Hub crashes mid-start, and a node that stops answering: one disk, one attachment, clear words."""

from __future__ import annotations

import pytest
from conftest import ROOT_DISK_ONLY, Hub

from simtools import wait_for


@pytest.fixture(scope="module")
def hub(e2e_sim, tmp_path_factory):
    # A short poll interval so the hub notices a lost machine quickly.
    h = Hub(tmp_path_factory.mktemp("hub"), e2e_sim, ROOT_DISK_ONLY + "c.KubeVirtSpawner.poll_interval = 1\n").start()
    yield h
    h.close()


@pytest.fixture
def slow(cluster):
    """Make one step of the simulated cluster slow for a test, and restore it afterwards."""
    saved = cluster.sim_api("GET", "/timing")["timing"]
    yield lambda **delays: cluster.sim_api("PUT", "/timing", delays)
    cluster.sim_api("PUT", "/timing", saved)


def dv_phase(cluster, ns, name):
    return next((dv.get("status", {}).get("phase") for dv in cluster.datavolumes(ns)
                 if dv["metadata"]["name"] == name), None)


def test_hub_crash_in_the_middle_of_a_clone_then_start_completes_with_one_disk(hub, cluster, slow):
    # 60 s at the e2e speed (the seeded RBD class clones by CSI, copy-on-write): the clone's time is
    # fixed when it begins, and a hub's restart beside the QEMU guests of a CI run took over 15 s.
    slow(csi_clone=1200)
    assert hub.request_start("frank").status_code == 202
    wait_for(lambda: dv_phase(cluster, "notebook-frank", "frank-rootdisk") == "CSICloneInProgress", 30,
             what="clone in progress")
    hub.restart(crash=True)
    assert dv_phase(cluster, "notebook-frank", "frank-rootdisk") == "CSICloneInProgress"
    r = hub.request_start("frank")
    assert r.status_code in (201, 202, 400), r.text  # 400: the new hub adopted the start already
    hub.wait_ready("frank", timeout=240)
    hub.write_file("frank", "home/frank/ok.txt", "ok")
    assert [dv["metadata"]["name"] for dv in cluster.datavolumes("notebook-frank")] == ["frank-rootdisk"]
    assert [p["metadata"]["name"] for p in cluster.pvcs("notebook-frank")] == ["frank-rootdisk"]
    assert len(cluster.objects("kubevirt.io", "v1", "virtualmachines", "notebook-frank")) == 1
    hub.stop_server("frank")


def test_hub_crash_in_the_middle_of_a_boot_then_start_completes_with_one_disk(hub, cluster, slow):
    slow(launch=200)  # 10 s from Scheduled to Running
    assert hub.request_start("gina").status_code == 202
    wait_for(lambda: (cluster.vmi("notebook-gina", "gina-workstation") or {}).get("status", {}).get("phase")
             == "Scheduled", 60, what="VMI scheduled")
    hub.restart(crash=True)
    r = hub.request_start("gina")
    assert r.status_code in (201, 202, 400), r.text
    hub.wait_ready("gina", timeout=120)
    hub.write_file("gina", "home/gina/ok.txt", "ok")
    assert hub.read_file("gina", "home/gina/ok.txt") == "ok"
    assert [dv["metadata"]["name"] for dv in cluster.datavolumes("notebook-gina")] == ["gina-rootdisk"]
    assert len(cluster.objects("kubevirt.io", "v1", "virtualmachineinstances", "notebook-gina")) == 1
    hub.stop_server("gina")


def test_a_lost_node_blocks_the_start_until_it_is_fenced(hub, cluster, slow):
    """Node loss as a real cluster shows it (Node Ready=Unknown, VMI still Running: kubevirt
    pkg/virt-controller/watch/node/node.go); fencing is Kubernetes' out-of-service taint
    (pkg/controller/podgc/gc_controller.go)."""
    hub.start_server("hana")
    hub.write_file("hana", "home/hana/work.txt", "before the node died")
    node = cluster.vmi("notebook-hana", "hana-workstation")["status"]["nodeName"]
    slow(heartbeat_timeout=100)  # KubeVirt's verdict on the node after 5 s at the e2e speed
    cluster.sim_api("POST", f"/nodes/{node}/lose")
    try:
        # The node stops answering; KubeVirt keeps the VMI Running (no phase Unknown), and the
        # hub recognises the lost node from the Node's Ready condition.
        assert cluster.vmi("notebook-hana", "hana-workstation")["status"]["phase"] == "Running"
        # poll() reports the machine as not running, and the VM is halted so that it cannot
        # come back by itself once the node is fenced ...
        wait_for(lambda: hub.server_model("hana") is None, 30, what="hub notices the lost machine")
        wait_for(lambda: cluster.vm("notebook-hana", "hana-workstation")["spec"]["runStrategy"] == "Halted", 30,
                 what="VM halted")
        # ... and a start is refused, naming the node and what the admin must do.
        r = hub.request_start("hana")
        assert f"still attached to a machine on node {node}" in r.text, r.text
        assert "confirms that" in r.text and "fenced" in r.text
        assert "Not starting hana's server : 409 WorkstationError(reason=lost-node)" in hub.log()
        assert "Unhandled error starting hana's server" not in hub.log()
        assert cluster.vmi("notebook-hana", "hana-workstation")["status"]["nodeName"] == node

        old = cluster.vmi("notebook-hana", "hana-workstation")
        assert "Unknown" not in [p["phase"] for p in old["status"]["phaseTransitionTimestamps"]]
        # The admin taints the node out-of-service; its launcher pod goes, and so does the VMI.
        cluster.sim_api("POST", f"/nodes/{node}/fence")
        wait_for(lambda: (cluster.vmi("notebook-hana", "hana-workstation") or {}).get("metadata", {}).get("uid")
                 != old["metadata"]["uid"], 30, what="the VMI on the fenced node gone")
        hub.start_server("hana")
        vmi = cluster.vmi("notebook-hana", "hana-workstation")
        assert vmi["status"]["nodeName"] != node
        assert hub.read_file("hana", "home/hana/work.txt") == "before the node died"
        assert cluster.sim_api("GET", "/violations")["violations"] == []
        assert [dv["metadata"]["name"] for dv in cluster.datavolumes("notebook-hana")] == ["hana-rootdisk"]
        hub.stop_server("hana")
    finally:
        cluster.sim_api("POST", f"/nodes/{node}/recover")

