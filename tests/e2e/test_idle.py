"""Idle stops on the real hub, with the real jupyterhub-idle-culler (short timeouts), the proxy
and the simulator: an idle machine is stopped (disks kept, GPU freed, forced off when its guest
ignores the shutdown, the next start resumes it);
a busy GPU, an SSH session with recent input, a kernel running a long cell and a keep-alive keep a
machine running, and the workstations service says why for each.

The culler decides on the server's last_activity in the hub (jupyterhub_idle_culler/__init__.py,
cull_idle: `inactive = now - last_activity` against --timeout); the guest moves it through
jupyterhub-singleuser's activity report (jupyterhub/singleuser/extension.py, every
JUPYTERHUB_ACTIVITY_INTERVAL seconds) from what its activity sampler found.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta

import pytest
from conftest import SERVICE_API, Cluster, Hub, hub_with_service

from simtools import wait_for

TIMEOUT = 40  # (the Lab warns 20 s before: after its polls have lingered once in a background tab)
EXTRA = f"""
c.Workstations.idle_timeout = {TIMEOUT}  # the demo's config runs the culler with this policy
c.Workstations.idle_cull_every = 2
c.Workstations.idle_warn_before = 20
c.KubeVirtSpawner.environment = {{"JUPYTERHUB_ACTIVITY_INTERVAL": "2"}}
# (a login counts for an hour after its last input: sam's session must not age out on a slow machine)
c.KubeVirtSpawner.args = ["--ContentsManager.allow_hidden=True", "--WorkstationActivity.interval=2",
                          "--WorkstationActivity.login_idle_seconds=3600"]
c.Workstations.keepalive_interval = 1
c.Workstations.keepalive_max_minutes = 45  # below the Lab's hour: its "Keep running" asks for the cap
c.KubeVirtSpawner.stop_timeout = 5  # a guest that ignores its shutdown is forced off after 5 s
"""
API = SERVICE_API


@pytest.fixture(scope="module")
def hub(e2e_sim, tmp_path_factory):
    yield from hub_with_service(e2e_sim, tmp_path_factory, EXTRA)


def status(hub: Hub, user: str) -> dict:
    r = hub.http.get(f"{hub.url}{API}/workstations/{user}", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def capacity(hub: Hub) -> dict:
    r = hub.http.get(f"{hub.url}{API}/capacity", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_idle_machines_are_stopped_busy_ones_are_not_and_the_service_says_why(hub: Hub, cluster: Cluster):
    ns = {user: f"notebook-{user}" for user in ("ivy", "gus", "sam", "kim", "kai")}
    # Each busy machine gets what keeps it busy, where a guest sees it, as soon as it is up (the
    # timeout is short); the idle one starts last.
    hub.start_server("gus", profile="gpu-a100-1", timeout=180)
    cluster.sim_api("PUT", f"/vmis/{ns['gus']}/gus-workstation/gpu", {"utilization": 87})
    hub.start_server("sam", timeout=180)
    cluster.sim_api("PUT", f"/vmis/{ns['sam']}/sam-workstation/users", {"users": [
        {"userName": "sam", "loginTime": time.time() - 600, "host": "10.1.2.3", "idleSeconds": 5}]})
    hub.start_server("kim", timeout=180)
    hub.execute("kim", "import time; time.sleep(3600)", wait=False)
    hub.start_server("kai", timeout=180)
    r = hub.http.post(f"{hub.url}{API}/workstations/kai/keepalive", json={"minutes": 45}, timeout=30)
    assert r.status_code == 200, r.text
    # ivy's guest ignores the shutdown (its grace period is 120 s): the stop forces it off.
    cluster.sim_api("PUT", f"/vmis/{ns['ivy']}/ivy-workstation/guest", {"shutdownSeconds": 4000})
    hub.start_server("ivy", profile="gpu-a100-1", timeout=180)
    gpus = "nvidia.com/A100-PCIE-40GB"
    assert capacity(hub)["gpus"][gpus] == 2  # gus's and ivy's
    rootdisk_uid = cluster.core.read_namespaced_persistent_volume_claim("ivy-rootdisk", ns["ivy"]).metadata.uid

    # The idle one: a deadline, a warning time before it, then the culler stops it.
    ivy = status(hub, "ivy")
    idle = ivy["idle"]
    assert idle["timeout_seconds"] == TIMEOUT and idle["check_every_seconds"] == 2
    deadline, warn_at = datetime.fromisoformat(idle["deadline"]), datetime.fromisoformat(idle["warn_at"])
    assert deadline - datetime.fromisoformat(idle["last_activity"]) == timedelta(seconds=TIMEOUT)
    assert deadline - warn_at == timedelta(seconds=20)
    # and by the service's own clock, for a client whose clock is off (the acceptance suite)
    assert idle["warn_before_seconds"] == 20 and 0 <= idle["stop_in_seconds"] <= TIMEOUT
    wait_for(lambda: hub.server_model("ivy") is None, 3 * TIMEOUT, what="the culler to stop ivy's idle server")
    wait_for(lambda: cluster.vmi(ns["ivy"], "ivy-workstation") is None, 30, what="ivy's VMI forced off")
    assert "ivy-workstation did not shut down within 5s: forcing it off" in hub.log()
    cluster.sim_api("DELETE", f"/vmis/{ns['ivy']}/ivy-workstation/guest")
    assert cluster.core.read_namespaced_persistent_volume_claim("ivy-rootdisk", ns["ivy"]).metadata.uid == \
        rootdisk_uid
    assert capacity(hub)["gpus"][gpus] == 1  # ivy's GPU is free again

    # The busy ones outlive two timeouts, and the service says why.
    time.sleep(TIMEOUT)
    why = {}
    for user in ("gus", "sam", "kim", "kai"):
        assert (hub.server_model(user) or {}).get("ready"), f"{user}'s busy machine was stopped"
        why[user] = [s["source"] + ": " + s["text"] for s in (status(hub, user)["activity"] or {}).get("sources", [])]
    assert any(w.startswith("gpu: GPU 0 (NVIDIA A100-PCIE-40GB) 87 % busy") for w in why["gus"]), why
    assert any(w.startswith("ssh: SSH session of sam from 10.1.2.3") for w in why["sam"]), why
    assert any(w.startswith("kernel: ") for w in why["kim"]), why
    assert any(w.startswith("keepalive: kept running until") for w in why["kai"]), why

    # The next start resumes the same machine.
    hub.start_server("ivy", profile="gpu-a100-1", timeout=180)
    assert cluster.core.read_namespaced_persistent_volume_claim("ivy-rootdisk", ns["ivy"]).metadata.uid == \
        rootdisk_uid


HIDE = """(hidden) => {
  // the tab goes to the background (or comes back): JupyterLab's polls stand by while hidden
  Object.defineProperty(document, 'visibilityState', {configurable: true, get: () => hidden ? 'hidden' : 'visible'});
  document.dispatchEvent(new Event('visibilitychange'));
}"""


def settled_last_activity(hub: Hub, user: str) -> str:
    """The server's last_activity once JupyterLab's requests have stopped and reached the hub: in a
    background tab each of its polls runs once more (lumino's Poll lingers, @lumino/polling), the
    slowest every 10 s."""
    seen = {"value": None, "since": time.monotonic()}

    def still() -> bool:
        value = (hub.server_model(user) or {}).get("last_activity")
        if value != seen["value"]:
            seen.update(value=value, since=time.monotonic())
        return time.monotonic() - seen["since"] >= 12
    wait_for(still, 60, what="the server's last activity to settle")
    return str(seen["value"])


def wait_for_warning(page, user: str, hub: Hub) -> dict:
    """The tab goes to the background, so nothing more happens on the machine; the Lab's warning
    appears at the service's warn_at (checked every second: about a second of slack), before the
    deadline. The idle view it went by."""
    # JupyterLab polls its kernel specs every 61 s (KernelSpecManager), which jupyter-server counts as
    # activity; a background tab lingers one more poll, which could land anywhere in the timeout.
    page.route("**/api/kernelspecs*", lambda route: route.abort())
    page.evaluate(HIDE, True)
    settled_last_activity(hub, user)
    idle = status(hub, user)["idle"]
    warning = page.locator(".jp-toast-message", has_text="will be stopped")
    warning.wait_for(timeout=TIMEOUT * 2000)
    seen = datetime.now().astimezone()
    assert status(hub, user)["idle"]["deadline"] == idle["deadline"], "something moved the deadline"
    assert datetime.fromisoformat(idle["warn_at"]) - timedelta(seconds=1.5) <= seen, (seen, idle)
    assert seen < datetime.fromisoformat(idle["deadline"]), (seen, idle)
    return idle


def test_the_lab_warns_before_an_idle_stop_and_keep_running_keeps_the_machine(hub: Hub, cluster: Cluster):
    """A tab left in the background polls nothing, so the machine goes idle: the Lab warns at the
    service's warn_at. Unheeded, the culler stops the machine at the deadline. Heeded, "Keep
    running" asks the service's cap (45 min here, below the Lab's hour), the warning goes, and the
    keep-alive (reported to the hub's activity API, which the culler reads) keeps the machine past
    the deadline the warning named."""
    from conftest import CHROMIUM
    from playwright.sync_api import sync_playwright
    from test_lab import login_and_start, open_panel, wait_for_lab

    user = "wes"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run"])
        try:
            page = browser.new_context(viewport={"width": 1400, "height": 900}).new_page()
            page.set_default_timeout(60_000)
            login_and_start(page, hub, user)
            open_panel(page)
            # Warned, not heeded: stopped by the culler.
            idle = wait_for_warning(page, user, hub)
            # (the panel shows what the Lab fetched before it warned)
            page.locator(".kvs-summary dd", has_text="no; idle since").wait_for(timeout=5000)
            activity = status(hub, user)["activity"]
            assert activity["sources"] == [] and activity["idle_since"], activity  # nothing keeps it busy
            idle_since = datetime.fromisoformat(activity["idle_since"])
            assert abs(idle_since - datetime.fromisoformat(idle["last_activity"])) < timedelta(seconds=1)
            wait_for(lambda: hub.server_model(user) is None, 2 * TIMEOUT, what="the culler to stop wes's machine")
            assert datetime.now().astimezone() >= datetime.fromisoformat(idle["deadline"])

            # Warned and heeded: kept.
            hub.start_server(user, timeout=180)
            page.goto(f"{hub.url}/user/{user}/lab")
            wait_for_lab(page, user=user)
            idle = wait_for_warning(page, user, hub)
            counted = page.locator(".jp-Notification-Status-Text")
            shown = int(counted.inner_text())  # (the notification center keeps a toast that closes)
            page.locator(".jp-toast-button", has_text="Keep running").click()
            wait_for(lambda: int(counted.inner_text()) == shown - 1, 10, what="the warning withdrawn")
            # (the toast goes at the click; the Lab's keep-alive request may still be on its way)
            kept = wait_for(lambda: (s := status(hub, user)).get("keepalive_until") and s, 10, interval=0.2,
                            what="the keep-alive recorded")
            until = datetime.fromisoformat(kept["keepalive_until"])
            assert timedelta(minutes=44) < until - datetime.now().astimezone() <= timedelta(minutes=45), kept
            # the keep-alive's activity reaches the hub past the deadline the warning named ...
            deadline = datetime.fromisoformat(idle["deadline"])
            wait_for(lambda: datetime.fromisoformat((hub.server_model(user) or {}).get("last_activity") or
                                                    "2000-01-01T00:00:00Z") > deadline,
                     2 * TIMEOUT, what="the keep-alive's activity past the old deadline")
            time.sleep(5)  # (more than two of the culler's checks)
            # ... and the machine is still up, and the service says why
            assert (hub.server_model(user) or {}).get("ready"), "the kept machine was stopped"
            why = status(hub, user)["activity"]
            assert "keepalive" in [s["source"] for s in why["sources"]] and why["idle_since"] is None, why
            page.evaluate(HIDE, False)  # back to the tab: the panel lists why the machine is in use
            open_panel(page)
            page.locator(".kvs-activity li", has_text="kept running until").wait_for(timeout=30_000)
        finally:
            browser.close()
    hub.stop_server(user)


def test_an_open_ssh_tunnel_keeps_the_machine_until_it_closes(hub: Hub):
    """A VS Code Remote window is a tunnel that sends nothing for minutes and has no terminal: the
    guest counts the open tunnel itself (guest/sshd.py keeps it, guest/activity.py reports it), so
    the machine outlives two timeouts, its status and the admins' capacity view name it; closed,
    the culler stops the machine after the timeout."""
    import os
    import subprocess
    import sys

    user = "tess"
    hub.ensure_user(user)
    token = hub.api("POST", f"/users/{user}/tokens", json={"note": "tunnel"}).json()["token"]
    hub.start_server(user, timeout=180)
    env = {**os.environ, "JUPYTERHUB_API_TOKEN": token, "JUPYTERHUB_URL": hub.url}
    tunnel = subprocess.Popen([sys.executable, "-m", "kubevirt_spawner.cli", "tunnel", user, "--no-start"], env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: any(s["source"] == "ssh-tunnel" for s in (status(hub, user)["activity"] or {})
                             .get("sources", [])), 30, what="the open tunnel in tess's status")
        sessions = capacity(hub)["ssh_sessions"]
        assert [(s["user"], s["text"].startswith("SSH through the hub from 127.0.0.1 since ")) for s in sessions
                if s["user"] == user] == [(user, True)], sessions
        # (within sshd's LoginGraceTime, 120 s, which ends a connection that never logs in)
        time.sleep(2 * TIMEOUT)
        assert (hub.server_model(user) or {}).get("ready"), "the culler stopped a machine with an open tunnel"
    finally:
        tunnel.kill()
        tunnel.wait()
    wait_for(lambda: hub.server_model(user) is None, 4 * TIMEOUT, what="the culler to stop tess's machine")
