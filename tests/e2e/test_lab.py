"""JupyterLab in a workstation, in a real browser (Debian's headless Chromium driven by Playwright,
no browser download) against the demo's hub config, the proxy and the simulator: log in, start,
run a cell, and use the Workstation panel to take a snapshot, restore it, reset the system and
stop the machine. Screenshots of every step go to test-artifacts/lab/.

The simulator's guest runs the workstation's environment (jupyterhub-singleuser with JupyterLab,
ipykernel and this package's guest extension) with the machine's root disk as its root directory,
so a kernel's working directory (the notebook's folder, the root) is the machine's `/`: a cell
writes `opt/...` where a real machine's cell would write `/opt/...`. `/home` is the workspace disk.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import requests
from conftest import Cluster, Hub

from kubevirt_spawner.demo import DEMO_PASSWORD

from simtools import wait_for

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "lab"
EXTRA = """
c.KubeVirtSpawner.start_timeout = 60
c.KubeVirtSpawner.clone_stall_timeout = 30
c.KubeVirtSpawner.http_timeout = 40
c.Workstations.idle_timeout = 3600
# the server reports its activity to the hub every second (not every 5 minutes)
c.KubeVirtSpawner.environment = {"JUPYTERHUB_ACTIVITY_INTERVAL": "1"}
"""
USER = "lena"
LONG = 180_000  # ms: a restore or reset stops, rewrites a disk and boots the machine again


@pytest.fixture(scope="module")
def hub(e2e_sim, tmp_path_factory):
    h = Hub(tmp_path_factory.mktemp("hub"), e2e_sim, extra_config=EXTRA).start()
    wait_for(lambda: requests.get(f"{h.url}/services/workstations/api/v1/workstations", timeout=5).status_code == 401,
             60, what="the workstations service")
    yield h
    h.close()


@pytest.fixture(scope="module")
def page(browser):
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    context.set_default_timeout(60_000)
    pg = context.new_page()
    yield pg
    context.close()


class Steps:
    def __init__(self, page):
        self.page = page
        self.n = 0
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        for old in ARTIFACTS.glob("*.png"):  # this run's screenshots only
            old.unlink()

    def shot(self, name: str):
        self.n += 1
        self.page.screenshot(path=str(ARTIFACTS / f"{self.n:02d}-{name}.png"))


def login_and_start(page, hub: Hub, user: str, steps: "Steps | None" = None):
    """Log in with the demo's password, take the default profile, land in JupyterLab."""
    page.goto(f"{hub.url}/hub/login")
    page.fill("#username_input", user)
    page.fill("#password_input", DEMO_PASSWORD)
    if steps:
        steps.shot("login")
    page.click("#login_submit")
    page.wait_for_url(re.compile(r"/hub/spawn"))
    if steps:
        steps.shot("profiles")
    page.locator("form#spawn_form input[type=submit], form#spawn_form button[type=submit]").first.click()
    wait_for_lab(page, user=user)
    if steps:
        steps.shot("lab")


def wait_for_lab(page, timeout: float = LONG, user: str = USER):
    page.wait_for_url(re.compile(rf"/user/{user}/lab"), timeout=timeout)
    page.locator("#jp-main-dock-panel").wait_for(timeout=timeout)
    page.locator("#jupyterlab-splash").wait_for(state="detached", timeout=timeout)


def back_in_lab(page, steps: "Steps", name: str):
    """After the reboot JupyterLab reopens the notebook that was open; the kernel it had was a
    process of the machine before the reboot, so JupyterLab asks which kernel to start."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    wait_for_lab(page)
    dialog = page.locator(".jp-Dialog")
    try:
        dialog.wait_for(timeout=5000)
    except PlaywrightTimeout:
        steps.shot(name)
        return
    steps.shot(name + "-dialog")
    text = dialog.inner_text()
    assert "kernel" in text.lower(), text
    accept_dialog(page)
    dialog.wait_for(state="detached")
    steps.shot(name)


def run_cell(page, code: str, expect: str):
    """Type code into the open notebook's last cell, run it, and wait for its output."""
    cell = page.locator(".jp-Notebook .jp-Cell").last
    cell.locator(".cm-content").click()
    page.keyboard.insert_text(code)  # as pasted: no auto-closed brackets
    page.keyboard.press("Shift+Enter")
    try:
        page.locator(".jp-OutputArea-output", has_text=expect).last.wait_for(timeout=60_000)
    except Exception:
        page.screenshot(path=str(ARTIFACTS / "failed-cell.png"))
        raise


def open_notebook(page):
    page.locator('.jp-LauncherCard[data-category="Notebook"]').first.click()
    page.locator(".jp-Notebook .jp-Cell .cm-content").first.wait_for()
    # the kernel is up and connected when the status bar says it is idle
    page.locator(".jp-StatusBar-Widget", has_text=re.compile(r"\| Idle")).first.wait_for(timeout=60_000)


def open_panel(page):
    """Open the panel from its sidebar tab (a click on the tab of an open panel would close it;
    JupyterLab reopens the panel that was open when the Lab loads again)."""
    if not page.locator(".kvs-panel").is_visible():
        page.locator('li[data-id="kubevirt-workstation"]').click()
    page.locator(".kvs-panel .kvs-summary").wait_for()


CONTRAST = """() => {
  // WCAG contrast of the panel's text against its background
  const lum = c => { const [r, g, b] = c.match(/[0-9.]+/g).slice(0, 3).map(Number).map(v => v / 255)
    .map(v => v <= 0.03928 ? v / 12.92 : Math.pow((v + 0.055) / 1.055, 2.4)); return 0.2126 * r + 0.7152 * g + 0.0722 * b; };
  const panel = document.querySelector('.kvs-panel');
  const text = getComputedStyle(panel.querySelector('.kvs-summary dd')).color;
  const [a, b] = [lum(text), lum(getComputedStyle(panel).backgroundColor)].sort((x, y) => y - x);
  return (a + 0.05) / (b + 0.05);
}"""


def in_the_dark_theme(page, steps: "Steps"):
    """Switch to JupyterLab Dark from the command palette: the panel stays readable; then back."""
    for theme, dark in (("JupyterLab Dark", True), ("JupyterLab Light", False)):
        page.keyboard.press("Control+Shift+C")
        page.keyboard.type(f"Use Theme: {theme}")
        page.keyboard.press("Enter")
        page.wait_for_function(f"document.body.dataset.jpThemeLight === '{str(not dark).lower()}'")
        page.locator("#jupyterlab-splash").wait_for(state="detached")  # (shown while the theme loads)
        page.locator(".kvs-panel").wait_for()
        assert page.evaluate(CONTRAST) >= 4.5, theme
        if dark:
            steps.shot("panel-dark")


def accept_dialog(page):
    page.locator(".jp-Dialog .jp-Dialog-button.jp-mod-accept").click()


def test_the_workstation_panel_in_a_browser(hub: Hub, cluster: Cluster, page):
    """The issue's walk-through. The restore and reset follow KubeVirt's VirtualMachineRestore and
    CDI's clone as the simulator models them (pkg/storage/restore/restore.go in kubevirt/kubevirt;
    pkg/controller/datavolume/pvc-clone-controller.go in kubevirt/containerized-data-importer)."""
    steps = Steps(page)
    hub.ensure_user(USER)
    ns = f"notebook-{USER}"

    # log in; the hub shows the profile form, the default (CPU) profile starts the machine
    login_and_start(page, hub, USER, steps)

    open_notebook(page)
    run_cell(page, "import os, platform; print('kernel on', platform.python_version(), os.getcwd())", "kernel on")
    steps.shot("cell")

    open_panel(page)
    panel = page.locator(".kvs-panel")
    assert "cpu" in panel.locator(".kvs-summary").inner_text()
    panel.locator(".kvs-disk[data-disk=root] .kvs-bar").wait_for()
    steps.shot("panel")
    in_the_dark_theme(page, steps)

    # Take a snapshot from the command palette, with the keyboard only.
    page.keyboard.press("Control+Shift+C")
    page.keyboard.type("Take a snapshot of this workstation")
    page.keyboard.press("Enter")
    page.locator("#kvs-snapshot-name").wait_for()
    consistency = page.locator(".jp-Dialog .kvs-consistency").inner_text()
    assert "application-consistent" in consistency, consistency
    page.keyboard.type("before-tool")
    page.keyboard.press("Tab")
    page.keyboard.type("clean machine")
    steps.shot("snapshot-form")
    page.keyboard.press("Enter")
    snapshot = panel.locator('.kvs-snapshot[data-name="before-tool"]')
    snapshot.wait_for()
    page.locator('.kvs-snapshot[data-name="before-tool"][data-ready="true"]').wait_for(timeout=60_000)
    assert "application-consistent" in snapshot.inner_text()
    steps.shot("snapshot-ready")

    # The service's refusal is shown as its sentence.
    panel.locator(".kvs-take-snapshot").click()
    page.fill("#kvs-snapshot-name", "before-tool")
    accept_dialog(page)
    error = page.locator(".jp-Dialog", has_text="exists already")
    error.wait_for()
    assert "A snapshot named before-tool exists already; choose another name." in error.inner_text()
    steps.shot("snapshot-refused")
    page.keyboard.press("Escape")
    error.wait_for(state="detached")

    # Install something outside /home, then restore the snapshot: it is gone, the Lab comes back.
    run_cell(page, "open('opt/tool.txt', 'w').write('installed'); print('wrote opt')", "wrote opt")
    assert hub.read_file(USER, "opt/tool.txt") == "installed"
    # The safety snapshots of the restore and the reset take 5 s at the tests' speed: the Lab
    # shows their step before the machine stops.
    cluster.sim_api("PUT", "/timing", {"snapshot": 100.0})
    snapshot.locator(".kvs-restore").click()
    assert "Unsaved work in running kernels is lost" in page.locator(".jp-Dialog").inner_text()
    steps.shot("restore-confirm")
    accept_dialog(page)
    page.locator(".jp-Dialog .kvs-steps li.kvs-current", has_text="taking a safety snapshot").wait_for()
    steps.shot("restore-steps")
    page.wait_for_url(re.compile(r"/services/workstations/workstation/"), timeout=LONG)
    steps.shot("restore-service-page")
    back_in_lab(page, steps, "restored-lab")
    assert hub.read_file(USER, "opt/tool.txt") is None

    # Reset: the workspace (/home) survives, what was installed on the system disk does not.
    hub.write_file(USER, f"home/{USER}/notes.txt", "my notes")
    hub.write_file(USER, "opt/tool.txt", "installed again")
    open_panel(page)
    panel.locator(".kvs-reset").click()
    page.fill("#kvs-confirm", "someone-else")
    accept_dialog(page)
    assert "nothing was changed" in page.locator(".jp-Dialog").inner_text()
    steps.shot("reset-mistyped")
    page.keyboard.press("Escape")
    page.locator(".jp-Dialog").wait_for(state="detached")
    panel.locator(".kvs-reset").click()
    dialog_text = page.locator(".jp-Dialog").inner_text()
    assert "workspace disk (/home) is kept" in dialog_text and "snapshot" in dialog_text, dialog_text
    page.fill("#kvs-confirm", USER)
    steps.shot("reset-confirm")
    accept_dialog(page)
    page.locator(".jp-Dialog .kvs-steps li.kvs-current", has_text="taking a safety snapshot").wait_for()
    page.wait_for_url(re.compile(r"/services/workstations/workstation/"), timeout=LONG)
    cluster.sim_api("PUT", "/timing", {"snapshot": 2.0})
    steps.shot("reset-service-page")
    back_in_lab(page, steps, "reset-lab")
    assert hub.read_file(USER, f"home/{USER}/notes.txt") == "my notes"
    assert hub.read_file(USER, "opt/tool.txt") is None

    # Delete the reset's safety snapshot from the panel: on the workstations page, in a new tab, with
    # the owner's own login (the server's token, which a terminal can read, may not delete).
    open_panel(page)
    safety = panel.locator(".kvs-snapshot", has_text="taken automatically before a system reset")
    name = safety.get_attribute("data-name")
    with page.context.expect_page() as opened:
        safety.locator(".kvs-delete").click()
    confirm = opened.value
    confirm.locator(".confirm-delete button", has_text=f"Delete {name}").click()
    confirm.locator(".message", has_text="Snapshot deleted.").wait_for()
    confirm.close()
    panel.locator(f'.kvs-snapshot[data-name="{name}"]').wait_for(state="detached", timeout=LONG)

    # The status bar shows the root disk's use and the time left before an idle stop.
    status = page.locator(".kvs-status")
    status.wait_for()
    assert re.search(r"Disk \d+ %", status.inner_text()) and "idle stop in" in status.inner_text()

    # Stop from the panel: the machine is gone, its disks are kept.
    open_panel(page)
    steps.shot("panel-after-reset")
    panel.locator(".kvs-stop").click()
    assert "all disks are kept" in page.locator(".jp-Dialog").inner_text()
    accept_dialog(page)
    page.wait_for_url(re.compile(r"/services/workstations/workstation/"), timeout=LONG)
    page.locator(".follow", has_text="The workstation is stopped").wait_for(timeout=LONG)
    steps.shot("stopped")
    assert cluster.vmi(ns, f"{USER}-workstation") is None
    claims = {p["metadata"]["name"] for p in cluster.pvcs(ns)}
    assert {f"{USER}-rootdisk", f"{USER}-workspace"} <= claims
    assert hub.server_model(USER) is None or not hub.server_model(USER).get("ready")


def test_the_panels_polling_is_not_activity(hub: Hub):
    """The panel's polls (GET status and snapshots, sent with ?no_track_activity=1) do not move the
    hub's last_activity, while a user's API request does. The server reports its activity every
    second here (JUPYTERHUB_ACTIVITY_INTERVAL, jupyterhub/singleuser/extension.py), and the hub
    does not count traffic through the proxy (JupyterHub.last_activity_interval = 0,
    jupyterhub/app.py update_last_activity)."""
    user = "pia"
    hub.start_server(user, timeout=120)
    base = f"{hub.url}/user/{user}"
    settle = 3.0
    made = hub.api("POST", f"/users/{user}/tokens", json={"note": "the user's browser, as it were"})
    assert made.status_code == 201, made.text
    own = requests.Session()
    own.headers["Authorization"] = f"token {made.json()['token']}"

    # Someone else with access to the server (here the admin) does not act with the owner's token.
    other = hub.http.get(f"{base}/workstation/api/status", timeout=30)
    assert other.status_code == 403 and "Only pia can use this workstation's panel" in other.json()["error"]

    def last_activity() -> str | None:
        return (hub.server_model(user) or {}).get("last_activity")

    time.sleep(settle)  # the start's own activity reported
    before = last_activity()
    for _ in range(10):
        for path in ("status", "snapshots"):
            answer = own.get(f"{base}/workstation/api/{path}", params={"no_track_activity": "1"}, timeout=30)
            assert answer.status_code == 200, answer.text
        time.sleep(0.3)
    time.sleep(settle)
    assert last_activity() == before

    # A user's request counts (so the check above can fail).
    assert own.get(f"{base}/api/contents", timeout=30).status_code == 200
    wait_for(lambda: last_activity() != before, 15, what="the hub to record the API request as activity")
    hub.stop_server(user)
