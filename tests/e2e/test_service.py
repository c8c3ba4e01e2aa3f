"""The workstations service on a real JupyterHub (which starts it as a managed service from the
demo's hub config), the proxy and the simulator: snapshots, restore, reset, stop, keep-alive, the
rescue page, who may do what, bad input, and operations that are interrupted."""

from __future__ import annotations

import base64
import re

import pytest
import requests

from simtools import wait_for

from conftest import Cluster, Hub

EXTRA = """
c.KubeVirtSpawner.workspace_disk_size = "10Gi"
c.KubeVirtSpawner.start_timeout = 40
c.KubeVirtSpawner.clone_stall_timeout = 30
c.KubeVirtSpawner.http_timeout = 20
c.Workstations.snapshot_limit = 6
c.Workstations.keepalive_max_minutes = 120
c.Workstations.keepalive_interval = 1
"""
API = "/services/workstations/api/v1"


@pytest.fixture(scope="module")
def hub(e2e_sim, tmp_path_factory):
    h = Hub(tmp_path_factory.mktemp("hub"), e2e_sim, extra_config=EXTRA).start()
    wait_for(lambda: requests.get(f"{h.url}{API}/workstations", timeout=5).status_code == 401, 60,
             what="the workstations service")
    yield h
    h.close()


class Client:
    """The service's API as one caller sees it (a token, or none)."""

    def __init__(self, hub: Hub, token: str | None):
        self.hub = hub
        self.http = requests.Session()
        if token:
            self.http.headers["Authorization"] = f"token {token}"

    def call(self, method: str, path: str, json=None, data=None) -> requests.Response:
        return self.http.request(method, f"{self.hub.url}{API}{path}", json=json, data=data, timeout=120)

    def ok(self, method: str, path: str, json=None, status: int = 200) -> dict:
        r = self.call(method, path, json)
        assert r.status_code == status, (r.status_code, r.text)
        return r.json()


def user_token(hub: Hub, user: str) -> str:
    hub.ensure_user(user)
    r = hub.api("POST", f"/users/{user}/tokens", json={"note": "test"})
    assert r.status_code == 201, r.text
    return r.json()["token"]


def server_token(cluster: Cluster, user: str) -> str:
    """The token the user's guest holds (from the Secret its VM mounts)."""
    secret = cluster.core.read_namespaced_secret(f"{user}-hub-env", f"notebook-{user}")
    return base64.b64decode(secret.data["JUPYTERHUB_API_TOKEN"]).decode()


def wait_operation(client: Client, path: str, timeout: float = 180) -> dict:
    def finished():
        op = client.ok("GET", path)["operation"]
        return op if op and op["state"] != "running" else None
    return wait_for(finished, timeout, what=f"the operation on {path}")


@pytest.fixture(scope="module")
def tokens(hub):
    hub.ensure_user("admin")
    return {name: user_token(hub, name) for name in ("alice", "bob", "carl", "admin")}


def test_the_service_is_registered_and_lists_own_workstations(hub, tokens):
    """Registered in the hub config with a role of its own (the hub lists it); users see their own
    workstations only, admins everyone's."""
    r = hub.api("GET", "/services/workstations")
    assert r.status_code == 200 and r.json()["name"] == "workstations", r.text
    assert r.json()["roles"] == ["workstations-service"], r.json()
    hub.start_server("carl")
    carl = Client(hub, tokens["carl"])
    mine = carl.ok("GET", "/workstations")["workstations"]
    assert [(w["user"], w["server"], w["phase"]) for w in mine] == [("carl", "", "running")]
    assert mine[0]["disks"]["root"]["size"] == "60Gi" and mine[0]["disks"]["workspace"]["size"] == "10Gi"
    assert Client(hub, tokens["bob"]).ok("GET", "/workstations")["workstations"] == []
    everyone = Client(hub, tokens["admin"]).ok("GET", "/workstations")["workstations"]
    assert ("carl", "") in {(w["user"], w["server"]) for w in everyone}


def test_a_workstation_shows_disk_usage_image_snapshots_and_activity(hub, cluster, tokens):
    carl = Client(hub, tokens["carl"])
    wait_for(lambda: carl.ok("GET", "/workstations/carl")["disks"]["root"]["live"], 60, what="the guest agent")
    hub.write_file("carl", "home/carl/data.bin", "x" * 100_000)
    ws = carl.ok("GET", "/workstations/carl")
    root, workspace = ws["disks"]["root"], ws["disks"]["workspace"]
    assert root["used_bytes"] > 0 and root["total_bytes"] >= 60 * 2 ** 30 and root["level"] == "ok"
    assert workspace["used_bytes"] >= 100_000 and workspace["live"]  # the guest's /home is the workspace disk
    assert ws["golden_image"] == {"cloned_from": "vm-images/ubuntu-24-04-cuda-golden",
                                  "configured": "vm-images/ubuntu-24-04-cuda-golden", "newer_available": False}
    assert ws["profile"]["slug"] == "cpu" and ws["node"] and ws["hub"]["ready"]
    assert ws["snapshots"] == {"count": 0, "total_size": "0"}
    hub.stop_server("carl")
    stopped = carl.ok("GET", "/workstations/carl")
    assert stopped["phase"] == "stopped" and not stopped["disks"]["workspace"]["live"]
    assert stopped["disks"]["workspace"]["used_bytes"] == workspace["used_bytes"]  # the last known value


def test_snapshot_consistency_follows_the_guest_agent(hub, cluster, tokens):
    """KubeVirt's indications (pkg/storage/snapshot/snapshot.go) as the service words them:
    running with the agent, running without it (simulator fault), stopped."""
    hub.start_server("bob")
    bob = Client(hub, tokens["bob"])
    wait_for(lambda: bob.ok("GET", "/workstations/bob")["disks"]["root"]["live"], 60, what="bob's guest agent")
    snap = bob.ok("POST", "/workstations/bob/snapshots", {"name": "with-agent", "note": "before CUDA"}, 201)
    assert snap["consistency"] == "application-consistent" and snap["ready"]
    cluster.sim_api("PUT", "/vmis/notebook-bob/bob-workstation/agent", {"connected": False})
    wait_for(lambda: not bob.ok("GET", "/workstations/bob")["disks"]["root"]["live"], 60, what="agent gone")
    assert bob.ok("POST", "/workstations/bob/snapshots", {"name": "no-agent"}, 201)["consistency"] == \
        "crash-consistent"
    cluster.sim_api("PUT", "/vmis/notebook-bob/bob-workstation/agent", {"connected": True})
    hub.stop_server("bob")
    assert bob.ok("POST", "/workstations/bob/snapshots", {}, 201)["consistency"] == "offline"
    listed = bob.ok("GET", "/workstations/bob/snapshots")["snapshots"]
    assert [s["consistency"] for s in listed] == ["application-consistent", "crash-consistent", "offline"]
    assert listed[0]["note"] == "before CUDA" and all(s["ready"] for s in listed)
    assert re.match(r"snapshot-\d{8}-\d{6}$", listed[2]["name"])
    assert bob.ok("GET", "/workstations/bob")["snapshots"]["count"] == 3


def system_files(hub: Hub, user: str) -> dict:
    return {path: hub.read_file(user, path) for path in ("etc/marker.conf", "opt/tool/VERSION", "opt/before.txt")}


def test_restore_brings_the_system_back_and_the_disk_stays_the_users(hub, cluster, tokens):
    """alice snapshots, changes /etc and /opt, restores: her markers are gone and the earlier files
    back; the machine was running, so it is stopped and started again through the hub. The root
    disk comes back in place, adopted by its DataVolume and never owned by the VM (restore.go with
    InPlace and volumeOwnershipPolicy None), so deleting the VM keeps it. (A test in
    tests/test_workstation.py shows KubeVirt's default restore giving the disk to the VM.)"""
    alice = Client(hub, tokens["alice"])
    hub.start_server("alice")
    hub.write_file("alice", "opt/before.txt", "as it was")
    alice.ok("POST", "/workstations/alice/snapshots", {"name": "clean"}, 201)
    hub.write_file("alice", "etc/marker.conf", "changed")
    hub.write_file("alice", "opt/tool/VERSION", "12.4")
    hub.write_file("alice", "opt/before.txt", "changed")
    op = alice.ok("POST", "/workstations/alice/restore", {"snapshot": "clean", "confirm": True}, 202)
    assert op["kind"] == "restore" and op["state"] == "running" and op["steps"] == 4
    done = wait_operation(alice, "/workstations/alice")
    assert done["state"] == "done", done
    hub.wait_ready("alice")
    assert system_files(hub, "alice") == {"etc/marker.conf": None, "opt/tool/VERSION": None,
                                          "opt/before.txt": "as it was"}
    names = [s["name"] for s in alice.ok("GET", "/workstations/alice/snapshots")["snapshots"]]
    assert "clean" in names and any(n.startswith("before-restore-") for n in names) and len(names) == 2
    pvc = next(p for p in cluster.pvcs("notebook-alice") if p["metadata"]["name"] == "alice-rootdisk")
    assert [o["kind"] for o in pvc["metadata"].get("ownerReferences") or []] == ["DataVolume"]
    # Deleting her VM (as an admin by mistake) keeps the disk.
    hub.stop_server("alice")
    cluster.custom.delete_namespaced_custom_object("kubevirt.io", "v1", "notebook-alice", "virtualmachines",
                                                   "alice-workstation")
    wait_for(lambda: cluster.vm("notebook-alice", "alice-workstation") is None, 30, what="the VM deleted")
    # (the simulator's garbage collector runs as the VM goes, as the real one follows it)
    assert "alice-rootdisk" in {p["metadata"]["name"] for p in cluster.pvcs("notebook-alice")}


def test_reset_replaces_the_system_keeps_the_workspace_and_its_snapshot_brings_the_old_back(hub, cluster, tokens):
    carl = Client(hub, tokens["carl"])
    hub.start_server("carl")
    hub.write_file("carl", "etc/marker.conf", "carl's system change")
    hub.write_file("carl", "home/carl/notes.txt", "carl's work")
    r = carl.call("POST", "/workstations/carl/reset", {"confirm": "carl"})
    assert r.status_code == 202, r.text
    done = wait_operation(carl, "/workstations/carl")
    assert done["state"] == "done" and done["kind"] == "reset", done
    hub.wait_ready("carl")
    assert hub.read_file("carl", "etc/marker.conf") is None
    assert hub.read_file("carl", "home/carl/notes.txt") == "carl's work"  # /home is the workspace disk
    safety = done["safety_snapshot"]
    assert safety.startswith("before-reset-")
    assert carl.ok("POST", "/workstations/carl/restore", {"snapshot": safety, "confirm": True}, 202)
    assert wait_operation(carl, "/workstations/carl")["state"] == "done"
    hub.wait_ready("carl")
    assert hub.read_file("carl", "etc/marker.conf") == "carl's system change"
    hub.stop_server("carl")


def test_one_operation_at_a_time_and_the_hub_refuses_a_start_meanwhile(hub, cluster, tokens):
    """A second restore while one runs is refused (409, naming it); a start through the hub during
    the restore is refused by the spawner with the operation's name and step."""
    bob = Client(hub, tokens["bob"])
    cluster.sim_api("PUT", "/timing", {"restore": 200.0})  # a slow restore: 10 s at the tests' speed
    try:
        first = bob.call("POST", "/workstations/bob/restore", {"snapshot": "offline-one", "confirm": True})
        assert first.status_code == 404 and first.json()["error"] == "There is no snapshot named offline-one."
        snap = bob.ok("GET", "/workstations/bob/snapshots")["snapshots"][0]["name"]
        assert bob.call("POST", "/workstations/bob/restore", {"snapshot": snap, "confirm": True}).status_code == 202
        second = bob.call("POST", "/workstations/bob/restore", {"snapshot": snap, "confirm": True})
        assert second.status_code == 409 and "is being restored (step" in second.json()["error"], second.text
        wait_for(lambda: bob.ok("GET", "/workstations/bob")["operation"]["step_name"] == "restore", 60,
                 what="the restore step")
        r = hub.request_start("bob")
        # The hub answers with the spawner's refusal when it comes quickly (it does), else later.
        assert r.status_code in (202, 409), r.text
        failure = r.json()["message"] if r.status_code == 409 else \
            wait_for(lambda: hub.spawn_failure("bob"), 30, what="the refused start")
        assert "Your workstation is being restored (step" in failure and "start it again when that is done" in failure
    finally:
        cluster.sim_api("PUT", "/timing", {"restore": 2.0})
    assert wait_operation(bob, "/workstations/bob")["state"] == "done"
