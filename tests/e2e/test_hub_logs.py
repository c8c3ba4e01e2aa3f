"""What a hub admin reads: the spawner's lines in the hub's own log, and failures a user can act
on logged as JupyterHub `SpawnException`s (a reason, no traceback), while internal errors keep theirs.

JupyterHub's handling is in jupyterhub/user.py (`User.spawn`: "Not starting ..." for a
SpawnException, `log.exception` for anything else) and jupyterhub/apihandlers/users.py (the
progress stream's "Spawn failed: ..." from `format_exception`).
"""

from __future__ import annotations

import re

import pytest
from conftest import ROOT_DISK_ONLY, Hub

from simtools import apply, hub_rbac_objects, wait_for

GPU = "nvidia.com/A100-PCIE-40GB"
HUB_LINE = re.compile(r"^\[[DIWEC] \d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+ JupyterHub \w+:\d+\] ")


@pytest.fixture(scope="module")
def hub(e2e_sim, tmp_path_factory):
    extra = (ROOT_DISK_ONLY + 'c.KubeVirtSpawner.gpu_unavailable = "fail"\n'
             "c.KubeVirtSpawner.k8s_api_retry_timeout = 2\n")
    h = Hub(tmp_path_factory.mktemp("hub"), e2e_sim, extra).start()
    yield h
    h.close()


def log_since(hub, offset: int) -> str:
    return hub.log()[offset:]


def wait_failed(hub, user: str) -> str:
    return wait_for(lambda: hub.spawn_failure(user), 60, interval=0.3, what=f"{user}'s start to fail")


def test_the_spawner_logs_through_the_hub_naming_the_workstation(hub):
    hub.start_server("lena")
    lines = [line for line in hub.log().splitlines() if "notebook-lena/lena-workstation: " in line]
    created = [line for line in lines if line.endswith("notebook-lena/lena-workstation: created DataVolume "
                                                       "lena-rootdisk")]
    assert created and HUB_LINE.match(created[0]), lines
    assert any("notebook-lena/lena-workstation: starting for lena (profile cpu)" in line for line in lines)
    assert all(HUB_LINE.match(line) for line in lines), lines  # the hub's format, the hub's handler
    hub.stop_server("lena")
    # The hub runs as a ServiceAccount with deploy/rbac/: nothing it did was refused.
    assert "permission missing" not in hub.log() and "cannot read" not in hub.log()


def test_user_failures_are_spawn_exceptions_with_a_reason_and_no_traceback(hub, cluster):
    offset = len(hub.log())
    # Unknown profile: refused before anything is created.
    r = hub.request_start("nora", profile="tpu-v5")
    assert r.status_code == 400, r.text
    assert "Unknown profile 'tpu-v5'. Choose one of: cpu, gpu-a100-1, gpu-a100-2." in r.json()["message"]
    assert cluster.vm("notebook-nora", "nora-workstation") is None

    # No GPU free, with gpu_unavailable = "fail": mia holds both A100s, owen's start fails at once.
    hub.start_server("mia", profile="gpu-a100-2")
    r = hub.request_start("owen", profile="gpu-a100-1")
    assert r.status_code in (202, 503), r.text
    message = wait_failed(hub, "owen")
    assert message.startswith(f"Spawn failed: No {GPU} is free right now"), message
    assert message.endswith("Try again later or choose a profile without a GPU.")
    wait_for(lambda: cluster.vmi("notebook-owen", "owen-workstation") is None, 30, what="owen's VMI gone")

    # mia's system disk is gone (deleted by hand): never re-cloned behind her back.
    hub.stop_server("mia")
    cluster.custom.delete_namespaced_custom_object("cdi.kubevirt.io", "v1beta1", "notebook-mia", "datavolumes",
                                                   "mia-rootdisk")
    wait_for(lambda: not cluster.pvcs("notebook-mia"), 30, what="mia's disk gone")
    r = hub.request_start("mia", profile="gpu-a100-2")
    assert "Your system disk notebook-mia/mia-rootdisk is missing" in r.text + str(wait_failed(hub, "mia")), r.text

    log = log_since(hub, offset)
    for user, reason in (("nora", "profile"), ("owen", "gpu-unavailable"), ("mia", "disk-missing")):
        assert re.search(rf"Not starting {user}'s server : \d+ WorkstationError\(reason={reason}\): ", log), log
    assert "Traceback" not in log and "Unhandled error" not in log, log


def test_an_internal_error_keeps_its_traceback_and_the_user_reads_one_sentence(hub, cluster):
    offset = len(hub.log())
    cluster.sim_api("PUT", "/faults/api", {"verb": "create", "resource": "datavolumes", "rate": 1, "code": 500})
    try:
        r = hub.request_start("pia")
        assert r.status_code in (202, 500), r.text
        message = wait_failed(hub, "pia")
    finally:
        cluster.sim_api("DELETE", "/faults/api")
    # the user reads the cause in words; the API server's own answer is for the admin's log
    assert message.startswith("Spawn failed: The cluster refused to start your workstation (the cluster's API "
                              "server did not complete the request). Try again in a minute"), message
    assert "etcdserver" not in message and "Internal error occurred" not in message, message
    log = log_since(hub, offset)
    assert "Unhandled error starting pia's server: " in log
    tail = log[log.index("Unhandled error starting pia's server"):]
    assert "Traceback (most recent call last)" in tail, tail
    assert "ServerError: 500 InternalError: Internal error occurred: injected fault: etcdserver: request timed out " \
           "(POST /apis/cdi.kubevirt.io/v1beta1/namespaces/notebook-pia/datavolumes)" in tail, tail


def test_a_proxys_html_page_during_a_start_is_one_sentence_for_the_user(hub, cluster):
    """A reverse proxy in front of the API server answers its own HTML page (nginx's 502) while a
    start creates the system disk: the user reads one sentence, never the page; the admin's log has
    the request and the page on one bounded line. (The client retries 5xx like client-go's
    rest/request.go until k8s_api_retry_timeout.)"""
    offset = len(hub.log())
    cluster.sim_api("PUT", "/faults/api", {"verb": "create", "resource": "datavolumes", "rate": 1, "code": 502})
    try:
        r = hub.request_start("pim")
        assert r.status_code in (202, 500), r.text
        message = wait_failed(hub, "pim")
    finally:
        cluster.sim_api("DELETE", "/faults/api")
    assert message == ("Spawn failed: The cluster refused to start your workstation (the cluster's API server did "
                       "not complete the request). Try again in a minute; if it keeps failing, tell your "
                       "administrator."), message
    tail = log_since(hub, offset)
    tail = tail[tail.index("Unhandled error starting pim's server"):]
    assert "ServerError: 502 Bad Gateway: <html> <head><title>502 Bad Gateway</title></head> <body> <center><h1>502 " \
        "Bad Gateway</h1></center> <hr><center>nginx</center> </body> </html> (POST /apis/cdi.kubevirt.io/v1beta1/" \
        "namespaces/notebook-pim/datavolumes)" in tail, tail
    wait_for(lambda: cluster.vmi("notebook-pim", "pim-workstation") is None, 30, what="nothing left running")


def test_a_missing_permission_is_one_admin_line_and_one_user_sentence(hub, cluster):
    """RBAC refusing the start call (403, staging/src/k8s.io/apiserver/pkg/endpoints/handlers/
    responsewriters/errors.go): the admin reads the refused request and what is missing, the user
    reads a sentence that sends them to the administrator, and nothing is left running."""
    offset = len(hub.log())
    without_start = hub_rbac_objects()
    cluster_role = next(o for o in without_start if o["kind"] == "ClusterRole"
                        and o["metadata"]["name"] == "kubevirt-spawner-hub-namespaced")  # bound in users' namespaces
    for rule in cluster_role["rules"]:
        rule["resources"] = [r for r in rule["resources"] if r != "virtualmachines/start"]
    apply(cluster.sim, cluster_role)
    try:
        r = hub.request_start("quin")
        assert r.status_code in (202, 500), r.text
        message = wait_failed(hub, "quin")
    finally:
        for obj in hub_rbac_objects():
            apply(cluster.sim, obj)
    assert message == ("Spawn failed: Your workstation could not start: the hub is not allowed to do part of it on "
                       "the cluster. Tell your administrator; the hub's log names the missing permission.")
    log = log_since(hub, offset)
    refusals = [line for line in log.splitlines() if "permission missing" in line]
    assert len(refusals) == 1 and HUB_LINE.match(refusals[0]), log
    assert ("the cluster refused PUT /apis/subresources.kubevirt.io/v1/namespaces/notebook-quin/virtualmachines/"
            'quin-workstation/start: virtualmachines.subresources.kubevirt.io "quin-workstation" is forbidden: User '
            '"system:serviceaccount:jupyterhub:hub" cannot update resource "virtualmachines/start"') in refusals[0]
    assert "WorkstationError(reason=forbidden)" in log and "Traceback" not in log, log
    assert cluster.vmi("notebook-quin", "quin-workstation") is None
    hub.start_server("quin")  # with the permission back, the same start works
