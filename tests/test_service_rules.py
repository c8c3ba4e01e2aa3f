"""The workstations service's pure rules: the idle deadline it shows, what a server's token may act
on, and when its page follows a workstation or takes the visitor back to JupyterLab."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from kubevirt_spawner import kube as k
from kubevirt_spawner.service.access import Caller, cluster_refusal
from kubevirt_spawner.service.core import Workstations
from kubevirt_spawner.service.web import _back_up, _own_servers, _refresh

T0 = datetime(2026, 11, 30, 10, 0, tzinfo=timezone.utc)
RUNNING = {"ready": True, "last_activity": "2026-11-30T10:00:00.000000Z"}


def test_the_idle_deadline_runs_from_the_last_activity_or_the_end_of_a_keepalive():
    core = Workstations(hub=None, idle_timeout=3600)
    assert core.activity.idle(RUNNING, None)["deadline"] == "2026-11-30T11:00:00Z"
    # a keep-alive reports activity until it ends: the culler's timeout starts then
    assert core.activity.idle(RUNNING, T0 + timedelta(hours=4))["deadline"] == "2026-11-30T15:00:00Z"
    assert core.activity.idle(RUNNING, T0 - timedelta(hours=1))["deadline"] == "2026-11-30T11:00:00Z"
    assert core.activity.idle({"ready": False, "last_activity": RUNNING["last_activity"]}, None) is None
    assert Workstations(hub=None).activity.idle(RUNNING, None) is None  # no idle stops configured


def test_a_servers_token_acts_on_its_own_workstation_only():
    """A JupyterHub server token carries access to its one server (jupyterhub/scopes.py: the
    `server` role's `access:servers!server=`); a user's token carries all their servers."""
    server_token = {"access:servers!server=dave/", "users:activity!user=dave", "access:services!service=workstations"}
    own = _own_servers("dave", server_token)
    assert own == frozenset({"dave/"})
    caller = Caller("dave", False, own)
    assert caller.may_act_on("dave", "") and not caller.may_act_on("dave", "gpu")
    assert not caller.may_act_on("erin", "")
    users_token = server_token | {"access:servers!user=dave", "servers!user=dave"}
    assert _own_servers("dave", users_token) is None
    assert Caller("dave", False, None).may_act_on("dave", "gpu")
    assert Caller("admin", True, None).may_act_on("dave", "gpu")


def view(op_state=None, ready=False, pending=None, phase="running", url="/user/lena/"):
    return {"operation": {"state": op_state} if op_state else None, "phase": phase,
            "hub": {"ready": ready, "pending": pending, "url": url}}


def test_the_page_follows_until_the_server_is_back_and_stops_following_at_an_end():
    # an operation under way: keep reloading
    assert _refresh(view("running", ready=False), "lab") and not _back_up(view("running", ready=True))
    # done, the hub starting the server: reload; up: back to JupyterLab
    assert _refresh(view("done", pending="spawn"), "lab")
    assert _back_up(view("done", ready=True)) and _back_up(view(None, ready=True))
    # a failed operation stays on the page with its sentence; a broken machine ends the reloads
    assert not _back_up(view("failed", ready=True)) and not _refresh(view("failed"), "lab")
    assert not _refresh(view("done", pending="spawn", phase="failed"), "lab")
    # nothing coming: no reloads
    assert not _refresh(view("done", phase="stopped"), "lab")
    # following a stop: while the hub still has the server, until it is stopped
    assert _refresh(view(None, ready=True), "stop") and _refresh(view(None, pending="stop"), "stop")
    assert not _refresh(view(None, phase="stopped"), "stop")
    assert not _refresh(view(None, ready=True), "")  # not following


def test_a_guest_report_is_checked_and_the_why_ages_with_the_guests_interval():
    """The guest names its sources (never a keep-alive: that is the service's own) and when it reports
    next; a report older than three of its intervals no longer holds (the guest stopped reporting),
    and with no reason left the status says since when the machine is idle."""
    import pytest

    from kubevirt_spawner.service.access import ServiceError
    from kubevirt_spawner.service.activity import check_activity_report
    reasons = [{"source": "gpu", "text": "GPU 0 (NVIDIA A100-PCIE-40GB) 87 % busy at 10:42", "since": None},
               {"source": "ssh", "text": "SSH session of alice from 10.0.0.5", "since": "2026-11-30T09:10:00Z"}]
    check_activity_report(reasons, 60)
    check_activity_report([], 60)
    for bad in (None, "busy", [{"source": "magic", "text": "x"}], [{"source": "keepalive", "text": "x"}],
                [{"source": "gpu"}], [{"source": "gpu", "text": "x" * 301}], [{"source": "gpu", "text": "x", "since": 5}],
                [reasons[0]] * 21,
                # (issue 30, item 8: "since" is a time, not any string the service would keep)
                [{"source": "gpu", "text": "x", "since": "x" * 1_000_000}],
                [{"source": "gpu", "text": "x", "since": "yesterday"}]):
        with pytest.raises(ServiceError) as err:
            check_activity_report(bad, 60)
        assert err.value.status == 400 and '"sources" is a list' in err.value.message
    for every in (None, 0, 3601, "60", True):
        with pytest.raises(ServiceError) as err:
            check_activity_report(reasons, every)
        assert err.value.status == 400 and '"every"' in err.value.message

    core = Workstations(hub=None)
    at = datetime(2026, 11, 30, 10, 0, tzinfo=timezone.utc)
    core.activity.reports[("alice", "")] = {"at": at, "every": 60, "sources": reasons}
    fresh = core.activity.why_active("alice", "", RUNNING, None, now=at + timedelta(seconds=179))
    assert fresh == {"reported": "2026-11-30T10:00:00Z", "sources": reasons, "idle_since": None}
    stale = core.activity.why_active("alice", "", RUNNING, None, now=at + timedelta(seconds=181))
    assert stale == {"reported": None, "sources": [], "idle_since": "2026-11-30T10:00:00Z"}
    kept = core.activity.why_active("alice", "", RUNNING, at + timedelta(minutes=30), now=at + timedelta(seconds=181))
    assert [s["source"] for s in kept["sources"]] == ["keepalive"] and kept["idle_since"] is None


async def test_keepalives_are_reported_until_they_end_and_survive_a_stop_meanwhile():
    """While a keep-alive lasts the service reports activity; its end is reported as the last
    activity (the culler's timeout runs from there). A stop or a renewal while the hub is being
    told (the loop awaits it) neither ends the loop nor drops the renewed keep-alive."""
    import asyncio

    class Hub:
        def __init__(self):
            self.calls: list[tuple[str, datetime]] = []

        async def record_activity(self, user, server, when):
            self.calls.append((user, when))
            if user == "stopped":
                core.activity.keepalives.pop((user, server), None)  # a stop meanwhile
            if user == "renewed" and len([c for c in self.calls if c[0] == "renewed"]) == 1:
                core.activity.keepalives[(user, server)] = datetime.now(timezone.utc) + timedelta(minutes=5)
            if user == "broken":
                raise RuntimeError("the hub's answer made no sense")

    hub = Hub()
    core = Workstations(hub=hub, keepalive_interval=0.05)
    now = datetime.now(timezone.utc)
    ended = now - timedelta(seconds=1)
    core.activity.keepalives = {("broken", ""): now + timedelta(minutes=5), ("stopped", ""): now + timedelta(minutes=5),
                        ("ended", ""): ended, ("renewed", ""): ended}
    task = asyncio.ensure_future(core.activity.report_keepalives())
    await asyncio.sleep(0.3)
    assert not task.done(), task
    task.cancel()
    assert ("ended", ended) in hub.calls and ("ended", "") not in core.activity.keepalives  # its end, once
    assert len([c for c in hub.calls if c[0] == "ended"]) == 1
    assert ("renewed", "") in core.activity.keepalives and ("stopped", "") not in core.activity.keepalives
    assert len([c for c in hub.calls if c[0] == "broken"]) > 1  # tried again at every interval


def test_the_operations_the_alerts_watch_are_counted_from_zero():
    """deploy/guardrails/prometheus-rules.yaml alerts on increase(workstations_operations_total
    {result="failed"}); increase() needs a sample before the first failure (Prometheus'
    promql/functions.go extrapolatedRate works on the samples in the range), so the series start at 0."""
    from prometheus_client import generate_latest
    text = generate_latest(Workstations(hub=None).registry).decode()
    for kind in ("snapshot", "restore", "reset"):
        assert f'workstations_operations_total{{kind="{kind}",result="failed"}} 0.0' in text


def test_a_cluster_refusal_no_step_explained_is_a_sentence_with_its_cause():
    """What the service answers for a KubeError that reached it (a snapshot's create refused while
    virt-api is down, say): the cause in words, 503 when the cluster is unavailable, the refusal's
    own status otherwise; never the API server's raw answer."""
    down = cluster_refusal(k.KubeError(500, "InternalError", 'Internal error occurred: failed calling webhook '
                                       '"virtualmachinesnapshot-validator.snapshot.kubevirt.io": failed to call webhook'))
    assert down.status == 503
    assert down.message == ("The cluster did not take the request (KubeVirt's virt-api did not answer the cluster's "
                            "API server). Try again in a minute; if it keeps failing, tell your administrator.")
    refused = cluster_refusal(k.KubeError(422, "Invalid", "spec.source: Required value"))
    assert refused.status == 422 and "(spec.source: Required value)" in refused.message


def test_every_source_the_guest_reports_is_one_the_service_takes():
    """The guest's open SSH tunnels (guest.activity.open_tunnels) are a source of their own: the
    service refused the whole report while one was open, so a VS Code window's machine showed no
    reason to be up."""
    import time

    from kubevirt_spawner.guest.activity import TUNNELS_KEY, open_tunnels
    from kubevirt_spawner.service.activity import check_activity_report
    now = time.time()
    report = open_tunnels({TUNNELS_KEY: {1: {"from": "10.0.0.5", "since": now - 60}}}, now)
    assert report[0]["source"] == "ssh-tunnel"
    check_activity_report(report, 60)


def test_the_capacity_view_lists_who_is_on_ssh_from_fresh_reports():
    """Admins see which workstations have SSH sessions open (the guests' reports: tunnels through
    the hub and terminal logins), not those whose guest stopped reporting."""
    core = Workstations(hub=None)
    now = datetime.now(timezone.utc)
    tunnel = {"source": "ssh-tunnel", "text": "SSH through the hub from 10.0.0.5 since 09:10", "since": "x"}
    core.activity.reports = {
        ("alice", ""): {"at": now, "every": 60, "sources": [tunnel, {"source": "gpu", "text": "GPU 0", "since": None}]},
        ("bob", "gpu"): {"at": now, "every": 60, "sources": [{"source": "ssh", "text": "SSH session of bob",
                                                               "since": None}]},
        ("carl", ""): {"at": now - timedelta(minutes=10), "every": 60, "sources": [tunnel]},  # stale
        ("dora", ""): {"at": now, "every": 60, "sources": [{"source": "jupyter", "text": "Jupyter", "since": None}]},
    }
    assert [(s["user"], s["server"], s["text"]) for s in core.activity.ssh_sessions(now)] == [
        ("alice", "", tunnel["text"]), ("bob", "gpu", "SSH session of bob")]



def test_the_status_lists_the_extra_disks_scratch_disk_and_shared_data_with_their_usage():
    """Issue 26: the machine's extra disks (their claims' sizes), scratch disk (an emptyDisk) and
    shares (virtiofs filesystems) as its VM has them; the disks' usage as the guest agent reports
    it (by each disk's serial), the extra disks' remembered while stopped. A share has none:
    qemu-ga's guest-get-fsinfo leaves out filesystems without a block device."""
    import types as _types

    from kubevirt_spawner import manifests as m
    from kubevirt_spawner.service.usage import data_disks
    spec = m.MachineSpec(scratch_disk_size="50Gi", shared_data=m.shared_data(
        [{"claim": "datasets", "mount_path": "/data/datasets", "read_only": True}]),
        extra_disks=m.extra_disks([{"name": "models", "size": "20Gi", "mount_path": "/data/models"}]))
    ident = m.Identity(user="dave", server="", slug="dave", user_slug="dave", server_slug="",
                       namespace="notebook-dave", vm="dave-workstation", rootdisk="dave-rootdisk",
                       workspace="dave-workspace", secret="dave-hub-env", service="dave-notebook")
    claims = {("notebook-dave", "dave-workspace-models"): {"status": {"capacity": {"storage": "25Gi"}}}}
    caches = _types.SimpleNamespace(pvcs=_types.SimpleNamespace(get=lambda ns, name: claims.get((ns, name))))
    ws = _types.SimpleNamespace(vm=m.virtual_machine(ident, spec), spec=spec, ident=ident, caches=caches)
    usage = {"live": True, "scratch": {"used": 2**30, "total": 50 * 2**30, "at": "t"},
             "disk-models": {"used": 5 * 2**30, "total": 25 * 2**30, "at": "t"}}
    disks = data_disks(ws, usage)
    assert disks["extra"] == [{"name": "models", "path": "/data/models", "claim": "dave-workspace-models",
                               "size": "25Gi", "used_bytes": 5 * 2**30, "total_bytes": 25 * 2**30, "percent": 20.0,
                               "level": "ok", "measured": "t", "live": True}]
    assert disks["scratch"]["size"] == "50Gi" and disks["scratch"]["percent"] == 2.0 and disks["scratch"]["live"]
    assert disks["shared"] == [{"name": "datasets", "claim": "datasets", "path": "/data/datasets", "read_only": True}]
    stopped = data_disks(ws, {"root": {"used": 1, "total": 2, "at": "t"}})
    assert stopped["scratch"]["used_bytes"] is None and not stopped["scratch"]["live"]
    assert stopped["extra"][0]["size"] == "25Gi" and stopped["extra"][0]["used_bytes"] is None
    plain = m.MachineSpec()
    assert data_disks(_types.SimpleNamespace(vm=m.virtual_machine(ident, plain), spec=plain,
                                                           ident=ident, caches=caches), {}) == \
        {"extra": [], "scratch": None, "shared": []}
