"""The workstations service on a real JupyterHub (which starts it as a managed service from the
demo's hub config), the proxy and the simulator: snapshots, restore, reset, stop, keep-alive, the
rescue page, who may do what, bad input, and operations that are interrupted."""

from __future__ import annotations

import base64
import os
import re
import signal
import subprocess

import pytest
import requests
from conftest import SERVICE_API, Cluster, Hub, hub_with_service

from simtools import wait_for

EXTRA = """
c.KubeVirtSpawner.workspace_disk_size = "10Gi"
c.KubeVirtSpawner.start_timeout = 40
c.KubeVirtSpawner.clone_stall_timeout = 30
c.KubeVirtSpawner.http_timeout = 20
c.Workstations.snapshot_limit = 6
c.Workstations.keepalive_max_minutes = 120
c.Workstations.keepalive_interval = 1
"""
API = SERVICE_API


@pytest.fixture(scope="module")
def hub(e2e_sim, tmp_path_factory):
    yield from hub_with_service(e2e_sim, tmp_path_factory, EXTRA)


class Client:
    """The service's API as one caller sees it (a token, or none)."""

    def __init__(self, hub: Hub, token: str | None, in_url: bool = False):
        self.hub = hub
        self.http = requests.Session()
        self.params = {}
        if token and in_url:
            # HubAuth takes a token from the URL for a websocket (which anyone can claim to open).
            self.params = {"token": token}
            self.http.headers["Sec-Fetch-Mode"] = "websocket"
        elif token:
            self.http.headers["Authorization"] = f"token {token}"

    def call(self, method: str, path: str, json=None, data=None) -> requests.Response:
        """`path` under the API (/...), or under the service (metrics)."""
        url = f"{self.hub.url}{API}{path}" if path.startswith("/") else f"{self.hub.url}/services/workstations/{path}"
        return self.http.request(method, url, json=json, data=data, params=self.params, timeout=120)

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
        r = client.call("GET", path)
        if r.status_code == 503:  # the service is being started again
            return None
        assert r.status_code == 200, r.text
        op = r.json()["operation"]
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
    assert ws["snapshots"]["count"] == 0 and ws["snapshots"]["total_size"] == "0"
    assert ws["snapshots"]["limit"] == 6 and ws["snapshots"]["user_count"] == 0  # (c.Workstations.snapshot_limit here)
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
    # What a snapshot would be is said before one is taken (the Lab panel's snapshot form shows it).
    assert bob.ok("GET", "/workstations/bob")["snapshot_consistency"] == "application-consistent"
    snap = bob.ok("POST", "/workstations/bob/snapshots", {"name": "with-agent", "note": "before CUDA"}, 201)
    assert snap["consistency"] == "application-consistent" and snap["ready"]
    cluster.sim_api("PUT", "/vmis/notebook-bob/bob-workstation/agent", {"connected": False})
    wait_for(lambda: not bob.ok("GET", "/workstations/bob")["disks"]["root"]["live"], 60, what="agent gone")
    assert bob.ok("GET", "/workstations/bob")["snapshot_consistency"] == "crash-consistent"
    assert bob.ok("POST", "/workstations/bob/snapshots", {"name": "no-agent"}, 201)["consistency"] == \
        "crash-consistent"
    cluster.sim_api("PUT", "/vmis/notebook-bob/bob-workstation/agent", {"connected": True})
    hub.stop_server("bob")
    assert bob.ok("GET", "/workstations/bob")["snapshot_consistency"] == "offline"
    assert bob.ok("POST", "/workstations/bob/snapshots", {}, 201)["consistency"] == "offline"
    taken = cluster.objects("snapshot.kubevirt.io", "v1beta1", "virtualmachinesnapshots", "notebook-bob")
    assert all(t["status"]["snapshotVolumes"]["includedVolumes"] == ["rootdisk", "workspace"] for t in taken)
    # (by name: two snapshots taken within one second have the same creation time, which is all
    # the listing's order goes by)
    listed = {s["name"]: s for s in bob.ok("GET", "/workstations/bob/snapshots")["snapshots"]}
    [auto] = [name for name in listed if name not in ("with-agent", "no-agent")]
    assert {name: s["consistency"] for name, s in listed.items()} == {
        "with-agent": "application-consistent", "no-agent": "crash-consistent", auto: "offline"}
    assert listed["with-agent"]["note"] == "before CUDA" and all(s["ready"] for s in listed.values())
    assert re.match(r"snapshot-\d{8}-\d{6}$", auto)
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


def namespace_state(cluster: Cluster, ns: str) -> dict:
    """Every object of a workstation's namespace with its resourceVersion: what "nothing changed" means."""
    state = {}
    for group, version, plural in (("kubevirt.io", "v1", "virtualmachines"), ("cdi.kubevirt.io", "v1beta1", "datavolumes"),
                                   ("snapshot.kubevirt.io", "v1beta1", "virtualmachinesnapshots"),
                                   ("snapshot.kubevirt.io", "v1beta1", "virtualmachinerestores")):
        for obj in cluster.objects(group, version, plural, ns):
            state[(plural, obj["metadata"]["name"])] = obj["metadata"]["resourceVersion"]
    for pvc in cluster.pvcs(ns):
        state[("persistentvolumeclaims", pvc["metadata"]["name"])] = pvc["metadata"]["resourceVersion"]
    return state


@pytest.fixture(scope="module")
def dave(hub, cluster, tokens):
    """dave's running workstation and the callers of the authorization matrix (a server's token is
    valid while its server runs: JupyterHub revokes it at the stop)."""
    for user in ("dave", "erin", "gina", "admin"):
        hub.start_server(user)
    hub.stop_server("gina")  # a stopped one
    admin = Client(hub, tokens["admin"])
    # Its disk usage is read once (and remembered on the VM): later reads change nothing.
    wait_for(lambda: admin.ok("GET", "/workstations/dave")["disks"]["root"]["live"], 60, what="dave's agent")
    callers = {"owner": Client(hub, user_token(hub, "dave")), "owner's server token": Client(hub, server_token(
        cluster, "dave")), "other user": Client(hub, user_token(hub, "erin")),
        "other user's server token": Client(hub, server_token(cluster, "erin")),
        "admin": Client(hub, tokens["admin"]), "anonymous": Client(hub, None),
        # An admin's machine holds a token of the admin's: it is not an admin's session.
        "admin's server token in the URL": Client(hub, server_token(cluster, "admin"), in_url=True),
        "garbage token": Client(hub, "0123456789abcdef0123456789abcdef")}
    return callers


# (method, path, body, {caller: status}); callers not named get the default of their kind.
MATRIX = [
    ("GET", "/workstations/dave", None, {}),
    ("GET", "/workstations?user=dave", None, {}),
    ("GET", "/workstations/dave/snapshots", None, {}),
    ("POST", "/workstations/dave/snapshots", {"name": "Bad Name"}, {"allowed": 400}),
    # a server's token (anyone with a terminal in it can read it) may not delete snapshots
    ("DELETE", "/workstations/dave/snapshots/ghost", None, {"allowed": 404, "owner's server token": 403}),
    ("POST", "/workstations/dave/restore", {"snapshot": "ghost", "confirm": False}, {"allowed": 400}),
    ("POST", "/workstations/dave/reset", {"confirm": "wrong"}, {"allowed": 400}),
    # dave's server token stands for that server: not for another workstation of dave's
    ("POST", "/workstations/dave/servers/nope/stop", None, {"allowed": 404, "owner's server token": 403}),
    ("GET", "/workstations/dave/servers/nope", None, {"allowed": 404, "owner's server token": 403}),
    ("POST", "/workstations/dave/keepalive", {"minutes": 0}, {"allowed": 400}),
    ("POST", "/workstations/dave/activity", {"sources": "busy", "every": 60}, {"allowed": 400}),
    ("POST", "/workstations/dave/servers/nope/activity", {"sources": [], "every": 60},
     {"allowed": 404, "owner's server token": 403}),
    ("POST", "/workstations/dave/purge", {"confirm": "wrong"}, {"admin": 400, "allowed": 403}),
    ("GET", "/capacity", None, {"admin": 200, "allowed": 403}),
    ("GET", "/costs", None, {"admin": 200, "allowed": 403}),
    ("GET", "/drains/no-such-node", None, {"admin": 404, "allowed": 403}),
    ("POST", "/drains/no-such-node", {"dry_run": True}, {"admin": 404, "allowed": 403}),
    ("GET", "metrics", None, {"admin": 200, "allowed": 403}),
]


def expected(caller: str, overrides: dict) -> int:
    if caller in ("anonymous", "garbage token"):
        return 401
    if caller in ("other user", "other user's server token", "admin's server token in the URL"):
        return 403
    if caller in overrides:
        return overrides[caller]
    return overrides.get("allowed", 200)


def test_authorization_matrix(hub, cluster, dave):
    """Every endpoint x {owner, owner's server token, other user, other user's server token, admin,
    an admin's server token sent in the URL, anonymous, garbage token}: the owner (and the token her
    guest holds) and admins act on her workstation, nobody else does, and a token never acts with
    more than its own scopes; admin-only views refuse everyone else; unknown callers get 401.
    Actions the owner may take are sent with input they refuse, so the matrix changes nothing."""
    before = namespace_state(cluster, "notebook-dave")
    seen = {}
    for method, path, body, overrides in MATRIX:
        for caller, client in dave.items():
            r = client.call(method, path, json=body)
            seen[(method, path, caller)] = (r.status_code, expected(caller, overrides))
            if r.status_code >= 400:
                assert r.headers["Content-Type"].startswith("application/json") and r.json()["error"], r.text
            elif path == "metrics":
                assert "workstations_operations" in r.text
    wrong = {key: got for key, got in seen.items() if got[0] != got[1]}
    assert wrong == {}, wrong
    assert namespace_state(cluster, "notebook-dave") == before


BAD_INPUT = [
    ("admin", "GET", "/workstations/nobody", None, 404, "nobody has no workstation."),
    ("owner", "GET", "/workstations/dave/servers/nope", None, 404, "dave has no workstation named nope."),
    ("owner", "POST", "/workstations/dave/restore", {"snapshot": "ghost", "confirm": True}, 404,
     "There is no snapshot named ghost."),
    ("owner", "POST", "/workstations/dave/snapshots", {"name": "Not OK"}, 400,
     "A snapshot name has 1 to 40 lower-case letters, digits and dashes, and starts and ends with a letter or digit "
     "(for example before-cuda-12)."),
    ("owner", "POST", "/workstations/dave/snapshots", {"name": "fine", "note": 7}, 400, '"note" must be a string.'),
    ("owner", "POST", "/workstations/dave/restore", {"snapshot": "ghost"}, 400,
     'Confirm the restore with "confirm": true: the workstation is stopped and its disks are put back as they were '
     "in the snapshot."),
    ("owner", "POST", "/workstations/dave/reset", {"confirm": "dav"}, 400,
     'Type the workstation\'s name to confirm the reset ("confirm": "dave"): its system disk is replaced by a fresh '
     "copy of the golden image; the workspace disk is kept and a snapshot is taken first."),
    ("owner", "POST", "/workstations/dave/reset", {}, 400,
     'Type the workstation\'s name to confirm the reset ("confirm": "dave"): its system disk is replaced by a fresh '
     "copy of the golden image; the workspace disk is kept and a snapshot is taken first."),
    ("owner", "POST", "/workstations/dave/keepalive", {"minutes": 121}, 400, "A keep-alive lasts at most 120 minutes."),
    ("owner", "POST", "/workstations/dave/keepalive", {"minutes": "60"}, 400,
     'Say for how many minutes to keep the workstation running ("minutes": 60).'),
    ("admin", "POST", "/workstations/gina/keepalive", {"minutes": 30}, 409,
     "The workstation is not running; start it first."),
    ("owner", "POST", "/workstations/dave/activity", {"sources": [{"source": "keepalive", "text": "forever"}],
                                                       "every": 60}, 400,
     '"sources" is a list of at most 20 {"source": one of jupyter, ssh, console, gpu, cpu, kernel, ssh-tunnel, "text": "...", '
     '"since": time or null}.'),
    ("owner", "POST", "/workstations/dave/activity", {"sources": [], "every": 0}, 400,
     '"every" is the number of seconds until the next report, 1 to 3600.'),
    # (issue 30, item 8: every field bounded, and the body: the service keeps reports in memory)
    ("owner", "POST", "/workstations/dave/activity", {"sources": [{"source": "ssh", "text": "login",
                                                                   "since": "x" * 100000}], "every": 60}, 413,
     "The request body is larger than 64 KiB."),
    ("owner", "POST", "/workstations/dave/activity", {"sources": [{"source": "ssh", "text": "login",
                                                                   "since": "2026-12-01T10:00:00+00:00" + "0" * 40}],
                                                       "every": 60}, 400,
     '"sources" is a list of at most 20 {"source": one of jupyter, ssh, console, gpu, cpu, kernel, ssh-tunnel, "text": "...", '
     '"since": time or null}.'),
    ("owner", "POST", "/workstations/dave/activity", {"sources": [{"source": "ssh", "text": "login",
                                                                   "since": "yesterday"}], "every": 60}, 400,
     '"sources" is a list of at most 20 {"source": one of jupyter, ssh, console, gpu, cpu, kernel, ssh-tunnel, "text": "...", '
     '"since": time or null}.'),
    ("owner", "POST", "/workstations/dave/restore", {"snapshot": "s" * 5000, "confirm": True}, 400,
     'Name the snapshot to restore ("snapshot", at most 40 characters).'),
    ("owner", "POST", "/workstations/dave/snapshots", "not json", 400, "The request body is not JSON."),
    ("owner", "POST", "/workstations/dave/snapshots", ["a list"], 400, "The request body must be a JSON object."),
    ("owner", "POST", "/workstations/dave/explode", {}, 404, "No such endpoint."),
    ("owner", "POST", "/workstations/dave/stop", {"wait": "no"}, 400, '"wait" must be true or false.'),
    ("admin", "POST", "/workstations/dave/purge", {"confirm": "dave"}, 409,
     "dave still has its workstation; only the disks of a deleted workstation are purged."),
]


@pytest.mark.parametrize("who,method,path,body,status,sentence", BAD_INPUT,
                         ids=[f"{c[1]} {c[2]} {str(c[3])[:30]}" for c in BAD_INPUT])
def test_bad_input_is_refused_with_a_sentence_and_changes_nothing(hub, cluster, dave, who, method, path, body,
                                                                  status, sentence):
    before = namespace_state(cluster, "notebook-dave")
    client = dave[who]
    if isinstance(body, str):
        r = client.call(method, path, data=body)
    else:
        r = client.call(method, path, json=body)
    assert (r.status_code, r.json()) == (status, {"error": sentence})
    assert namespace_state(cluster, "notebook-dave") == before


def test_purge_waits_for_the_end_of_retention(hub, cluster, dave):
    """A deleted named server keeps its disks, labelled until retain-until; the admin's purge before
    then is refused with the date, and changes nothing."""
    hub.start_server("dave", "old")
    r = hub.api("DELETE", "/users/dave/servers/old", json={"remove": True})
    assert r.status_code in (202, 204), r.text
    wait_for(lambda: cluster.vm("notebook-dave", "dave--old-workstation") is None, 60, what="the VM retired")
    before = namespace_state(cluster, "notebook-dave")
    r = dave["admin"].call("POST", "/workstations/dave/servers/old/purge", json={"confirm": "dave"})
    assert r.status_code == 409 and re.match(r"The disks of dave/old are kept until \d{4}-\d\d-\d\dT", r.json()["error"])
    assert namespace_state(cluster, "notebook-dave") == before
    capacity = dave["admin"].ok("GET", "/capacity")
    assert {(d["name"], d["user"]) for d in capacity["retained"]} >= {("dave--old-rootdisk", "dave")}
    # Once the date has passed (here: moved back), the purge deletes them, and their volumes with
    # them: the class keeps a deleted claim's volume (Retain) only against mistakes.
    past = {"metadata": {"annotations": {"kubevirt-spawner.io/retain-until": "2000-01-01T00:00:00Z"}}}
    volumes = {}
    for claim in cluster.pvcs("notebook-dave"):
        if claim["metadata"]["name"].startswith("dave--old-"):
            volumes[claim["metadata"]["name"]] = claim["spec"]["volumeName"]
            cluster.core.patch_namespaced_persistent_volume_claim(claim["metadata"]["name"], "notebook-dave", past)
    for dv in cluster.datavolumes("notebook-dave"):
        if dv["metadata"]["name"].startswith("dave--old-"):
            cluster.custom.patch_namespaced_custom_object("cdi.kubevirt.io", "v1beta1", "notebook-dave", "datavolumes",
                                                          dv["metadata"]["name"], past)
    assert sorted(volumes) == ["dave--old-rootdisk", "dave--old-workspace"]
    wait_for(lambda: all(d["retain_until"].startswith("2000") for d in dave["admin"].ok("GET", "/capacity")["retained"]
                         if d["name"].startswith("dave--old-")), 30, what="the service seeing the new dates")
    deleted = dave["admin"].ok("POST", "/workstations/dave/servers/old/purge", {"confirm": "dave"})["deleted"]
    assert "DataVolume/dave--old-rootdisk" in deleted  # (its claim goes with it)
    wait_for(lambda: not set(volumes.values()) & {v.metadata.name for v in cluster.core.list_persistent_volume().items},
             30, what="the purged disks' volumes gone")


def service_pids(hub: Hub) -> list[int]:
    out = subprocess.run(["pgrep", "-f", f"kubevirt_spawner.cli service --ip 127.0.0.1 --port {hub.settings.service_port}"],
                         capture_output=True, text=True).stdout.split()
    return [int(pid) for pid in out]


def test_a_restore_goes_on_after_the_service_is_killed(hub, cluster, tokens):
    """The operation's record on the VM is what a restarted service reads: killed during the
    restore step (JupyterHub starts its managed service again), it follows the restore it had
    made to the end, and the machine is consistent: the snapshot's files, the disk adopted by its
    DataVolume, no restore lock left on the VM."""
    bob = Client(hub, tokens["bob"])
    ensure_running(hub, "bob")
    hub.write_file("bob", "opt/state.txt", "snapshotted")
    bob.ok("POST", "/workstations/bob/snapshots", {"name": "base"}, 201)
    hub.write_file("bob", "opt/state.txt", "changed later")
    cluster.sim_api("PUT", "/timing", {"restore": 200.0})  # 10 s at the tests' speed
    try:
        bob.ok("POST", "/workstations/bob/restore", {"snapshot": "base", "confirm": True}, 202)
        wait_for(lambda: bob.ok("GET", "/workstations/bob")["operation"]["step_name"] == "restore", 60,
                 what="the restore step")
        [pid] = service_pids(hub)
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: pid not in service_pids(hub), 10, what="the service gone")
        # JupyterHub polls its managed services (every 30 s) and starts a dead one again.
        done = wait_operation(bob, "/workstations/bob", timeout=120)
    finally:
        cluster.sim_api("PUT", "/timing", {"restore": 2.0})
    assert done["state"] == "done" and pid not in service_pids(hub), done
    log = hub.log()
    assert "going on with the restore bob asked for" in log
    assert len(re.findall(r"restoring snapshot base \(bob-restore-", log)) == 1  # made once, followed to the end
    assert cluster.objects("snapshot.kubevirt.io", "v1beta1", "virtualmachinerestores", "notebook-bob") == []
    hub.wait_ready("bob")
    assert hub.read_file("bob", "opt/state.txt") == "snapshotted"
    vm = cluster.vm("notebook-bob", "bob-workstation")
    assert "restoreInProgress" not in (vm.get("status") or {})
    pvc = next(p for p in cluster.pvcs("notebook-bob") if p["metadata"]["name"] == "bob-rootdisk")
    assert [o["kind"] for o in pvc["metadata"].get("ownerReferences") or []] == ["DataVolume"]


def ensure_running(hub: Hub, user: str):
    model = hub.server_model(user)
    if not (model and model.get("ready")):
        hub.start_server(user)


def test_keepalive_reports_activity_until_it_ends_and_a_stop_ends_it(hub, tokens):
    bob = Client(hub, tokens["bob"])
    ensure_running(hub, "bob")
    before = hub.server_model("bob")["last_activity"]
    answer = bob.ok("POST", "/workstations/bob/keepalive", {"minutes": 30})
    assert answer["keepalive_until"] > before
    wait_for(lambda: hub.server_model("bob")["last_activity"] > before, 10, what="activity reported")
    first = hub.server_model("bob")["last_activity"]
    wait_for(lambda: hub.server_model("bob")["last_activity"] > first, 10, what="activity reported again")
    assert bob.ok("GET", "/workstations/bob")["keepalive_until"] == answer["keepalive_until"]
    assert bob.ok("POST", "/workstations/bob/stop") == {"stopped": True, "changed": True}
    assert hub.server_model("bob") is None or not hub.server_model("bob").get("ready")
    assert bob.ok("GET", "/workstations/bob")["keepalive_until"] is None
    assert "audit: bob keepalive bob: ok (30 min)" in hub.log() and "audit: bob stop bob: done" in hub.log()


def test_metrics_count_operations_snapshots_and_full_disks(hub, tokens):
    """Counted since the service (last) started."""
    hub.start_server("ivan")
    hub.stop_server("ivan")
    ivan = Client(hub, user_token(hub, "ivan"))
    ivan.ok("POST", "/workstations/ivan/snapshots", {"name": "counted"}, 201)
    ivan.ok("POST", "/workstations/ivan/snapshots", {"name": "counted"}, 409)  # refused, not failed
    ivan.ok("POST", "/workstations/ivan/restore", {"snapshot": "counted", "confirm": True}, 202)
    assert wait_operation(ivan, "/workstations/ivan")["state"] == "done"
    text = Client(hub, tokens["admin"]).call("GET", "metrics").text
    assert re.search(r'^workstations_operations_total\{kind="restore",result="succeeded"\} [1-9]', text, re.M), text
    assert re.search(r'^workstations_operations_total\{kind="snapshot",result="succeeded"\} [1-9]', text, re.M)
    assert re.search(r'^workstations_operations_total\{kind="snapshot",result="refused"\} [1-9]', text, re.M)
    assert not re.search(r'^workstations_operations_total\{kind="snapshot",result="failed"\} [1-9]', text, re.M)
    assert re.search(r'^workstations_snapshots\{user="ivan"\} 2\.0$', text, re.M)  # and the safety one
    # A monitoring token needs JupyterHub's read:metrics scope (an admin may make one), not admin rights.
    monitoring = hub.api("POST", "/users/admin/tokens", json={
        "note": "prometheus", "scopes": ["read:metrics", "access:services!service=workstations"]})
    assert monitoring.status_code == 201, monitoring.text
    assert Client(hub, monitoring.json()["token"]).call("GET", "metrics").status_code == 200
    r = ivan.call("GET", "metrics")
    assert (r.status_code, r.json()) == (403, {"error": "Only administrators and tokens with the scope read:metrics "
                                                         "read the metrics."})
    assert re.search(r"^workstations_disks_above_85_percent 0\.0$", text, re.M)
    assert "workstations_operation_seconds_bucket" in text


def login(hub: Hub, user: str) -> tuple[requests.Session, requests.Response]:
    """A browser going to the rescue page: sent to the hub's login form (its XSRF token read from
    the form), then back through OAuth to the page (not to the user's server, which the hub would
    start)."""
    from kubevirt_spawner.demo import DEMO_PASSWORD
    browser = requests.Session()
    form = browser.get(f"{hub.url}/services/workstations/", timeout=30)
    assert "/hub/login" in form.url, form.url
    page = browser.post(form.url, data={"username": user, "password": DEMO_PASSWORD, "_xsrf": form_token(form.text)},
                        timeout=30)
    assert page.status_code == 200 and page.url.startswith(f"{hub.url}/services/workstations/"), page.url
    return browser, page


def form_token(page: str) -> str:
    return re.search(r'name="_xsrf" value="([^"]+)"', page).group(1)


def test_the_rescue_page_restores_a_machine_that_does_not_boot(hub, cluster):
    """frank breaks /etc/fstab (his machine no longer boots: no agent, no Jupyter; the hub's start
    fails). On the rescue page, after logging in through the hub, he restores the snapshot from
    before, and his machine starts again. Forms without the page's XSRF token are refused."""
    hub.start_server("frank")
    hub.write_file("frank", "etc/fstab", "# <file system> <mount point> <type> <options> <dump> <pass>\n")
    frank_api = Client(hub, user_token(hub, "frank"))
    frank_api.ok("POST", "/workstations/frank/snapshots", {"name": "good"}, 201)
    hub.write_file("frank", "etc/fstab", "UUID=broken-line\n")
    hub.stop_server("frank")
    r = hub.request_start("frank")
    assert r.status_code in (202, 500), r.text
    failure = wait_for(lambda: hub.spawn_failure("frank"), 90, what="the failed start")
    assert "frank" in failure or "did not" in failure or "respond" in failure, failure

    browser, page = login(hub, "frank")
    assert 'data-name="frank"' in page.text, page.text[:500]
    page = browser.get(f"{hub.url}/services/workstations/workstation/frank", timeout=30)
    assert page.status_code == 200 and 'data-name="good"' in page.text
    assert "Why the last start waited or failed" in page.text
    assert "<strong>failed</strong>" in page.text  # the hub's word on the failed start
    before = namespace_state(cluster, "notebook-frank")
    forged = browser.post(f"{hub.url}/services/workstations/workstation/frank",
                          data={"action": "restore", "snapshot": "good", "confirm": "yes"}, timeout=30)
    assert forged.status_code == 403 and namespace_state(cluster, "notebook-frank") == before
    done = browser.post(f"{hub.url}/services/workstations/workstation/frank",
                        data={"action": "restore", "snapshot": "good", "confirm": "yes", "_xsrf": form_token(page.text)},
                        timeout=30)
    assert done.status_code == 200 and "Restore started." in done.text, done.text[:800]
    assert 'http-equiv="refresh"' in done.text  # the page follows the steps by itself

    def restored():
        text = browser.get(f"{hub.url}/services/workstations/workstation/frank", timeout=30).text
        return text if "The restore is done." in text else None
    wait_for(restored, 120, what="the restore")
    hub.start_server("frank", timeout=120)
    assert "broken-line" not in hub.read_file("frank", "etc/fstab")
    page = browser.get(f"{hub.url}/services/workstations/workstation/frank", timeout=30).text
    assert "Open JupyterLab" in page and "/user/frank/lab" in page


def test_the_snapshot_limit_is_per_user_and_says_so(hub, cluster, tokens):
    """(c.Workstations.snapshot_limit = 6 here; safety snapshots count too.)"""
    hub.start_server("hana")
    hub.stop_server("hana")
    hana = Client(hub, user_token(hub, "hana"))
    for i in range(6):
        hana.ok("POST", "/workstations/hana/snapshots", {"name": f"s{i}"}, 201)
    before = namespace_state(cluster, "notebook-hana")
    r = hana.call("POST", "/workstations/hana/snapshots", {"name": "one-more"})
    assert (r.status_code, r.json()) == (409, {"error": "hana has 6 snapshots, the most allowed; delete one before "
                                                        "taking another."})
    r = hana.call("POST", "/workstations/hana/restore", {"snapshot": "s0", "confirm": True})  # needs a safety one
    assert (r.status_code, r.json()) == (409, {"error": "hana has 6 snapshots, the most allowed; delete one before "
                                                        "taking another (a restore takes a safety snapshot first)."})
    assert namespace_state(cluster, "notebook-hana") == before
    hana.ok("DELETE", "/workstations/hana/snapshots/s0")
    hana.ok("POST", "/workstations/hana/snapshots", {"name": "one-more"}, 201)


def test_a_stopped_hub_leaves_no_service_behind(e2e_sim, tmp_path_factory):
    """JupyterHub stops its managed services with SIGINT, and with SIGTERM only after
    interrupt_timeout (jupyterhub/spawner.py, LocalProcessSpawner.stop). A hub started from a
    background job inherits SIGINT ignored: its workstations service and idle culler must still go
    at its SIGINT, or a hub stopped meanwhile leaves them running."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # (as a background job starts it)
    try:
        h = Hub(tmp_path_factory.mktemp("hub"), e2e_sim).start()
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        wait_for(lambda: requests.get(f"{h.url}{SERVICE_API}/workstations", timeout=5).status_code == 401, 60,
                 what="the workstations service")
        children = wait_for(lambda: (lambda pids: pids if len(pids) == 2 else None)(
            subprocess.run(["pgrep", "-P", str(h.proc.pid)], capture_output=True, text=True).stdout.split()),
            30, what="the service and the culler")
    finally:
        h.close()
    wait_for(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in children), 10,
             what="the hub's services gone with it")
