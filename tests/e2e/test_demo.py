"""`kubevirt-spawner demo`: one command brings up the simulator, proxy and hub; Ctrl-C stops it all."""

from __future__ import annotations

import email.parser
import json
import os
import re
import signal
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import requests
from conftest import Hub
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from kubevirt_spawner.demo import DEMO_NEEDS, DemoError, free_port

from simtools import wait_for

CHECKOUT = Path(__file__).resolve().parents[2]


def children_of(pid: int) -> set[int]:
    """Every descendant process of `pid` (from /proc)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def start_demo(state, port, command=(sys.executable, "-m", "kubevirt_spawner.cli"), **popen) -> tuple[
        subprocess.Popen, dict]:
    info_file = state / "demo.json"
    if info_file.exists():
        info_file.unlink()
    proc = subprocess.Popen([*command, "demo", "--state", str(state), "--port", str(port), "--speed", "20"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)
    wait_for(lambda: info_file.exists() or proc.poll() is not None, 90, 0.2, "demo.json")
    assert proc.poll() is None, proc.stdout.read()
    return proc, json.loads(info_file.read_text())


def log_in(url: str, user: str, password: str) -> requests.Session:
    """Log in through the hub's login form, as a person does."""
    web = requests.Session()
    web.get(f"{url}/hub/login", timeout=30)
    ok = web.post(f"{url}/hub/login", data={"username": user, "password": password,
                                            "_xsrf": web.cookies.get("_xsrf")}, timeout=30, allow_redirects=False)
    assert ok.status_code == 302, ok.text
    return web


def spawn_from_form(web: requests.Session, url: str, profile: str):
    started = web.post(f"{url}/hub/spawn", data={"profile": profile, "_xsrf": web.cookies.get("_xsrf")},
                       timeout=60, allow_redirects=False)
    assert started.status_code == 302, started.text


def wait_ready(api: requests.Session, url: str, user: str, what: str):
    wait_for(lambda: api.get(f"{url}/hub/api/users/{user}", timeout=30).json()["servers"].get("", {}).get("ready"),
             90, 0.3, what)


def admin_api(info: dict) -> requests.Session:
    api = requests.Session()
    api.headers["Authorization"] = f"token {info['admin_token']}"
    return api


def ctrl_c(proc) -> str:
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "stopping the demo" in out
    return out


def test_demo_runs_a_workstation_and_stops_everything_on_ctrl_c(tmp_path):
    port = free_port()
    state = tmp_path / "demo"
    proc, info = start_demo(state, port)
    try:
        assert info["url"] == f"http://127.0.0.1:{port}" and os.path.exists(info["kubeconfig"])

        # Log in like a person: the documented password works, a wrong one does not.
        stranger = requests.Session()
        stranger.get(f"{info['url']}/hub/login", timeout=30)
        bad = stranger.post(f"{info['url']}/hub/login", data={"username": "ada", "password": "nope",
                                                              "_xsrf": stranger.cookies.get("_xsrf")},
                            timeout=30, allow_redirects=False)
        assert bad.status_code == 403
        web = log_in(info["url"], "ada", info["password"])

        # The options form lists the profiles; submitting it starts the chosen one.
        form = web.get(f"{info['url']}/hub/spawn", timeout=30)
        assert form.status_code == 200
        for slug in ("cpu", "gpu-a100-1", "gpu-a100-2"):
            assert f'value="{slug}"' in form.text
        assert "GPU workstation: 1x A100" in form.text
        spawn_from_form(web, info["url"], "cpu")

        api = admin_api(info)
        wait_ready(api, info["url"], "ada", "ada's server")
        assert api.get(f"{info['url']}/hub/api/users/ada", timeout=30).json()["servers"][""]["user_options"] == \
            {"profile": "cpu"}
        r = api.get(f"{info['url']}/user/ada/api/contents/etc/os-release", timeout=30)
        assert r.status_code == 200 and "Ubuntu" in r.json()["content"]

        family = children_of(proc.pid)
        assert len(family) >= 3  # hub, proxy, ada's guest
        ctrl_c(proc)
        wait_for(lambda: not [p for p in family if alive(p)], 15, 0.2, "every process of the demo to exit")

        # The next run resumes the same cluster: ada's machine boots again and the hub adopts it.
        proc, info = start_demo(state, port)
        wait_ready(api, info["url"], "ada", "ada's server after the restart")
        r = api.get(f"{info['url']}/user/ada/api/contents/etc/os-release", timeout=30)
        assert r.status_code == 200, r.text
        ctrl_c(proc)
    finally:
        if proc.poll() is None:
            proc.kill()


def lands_in_jupyterlab(browser, url: str, user: str, password: str):
    """Log in as a person does and open the running server: JupyterLab's shell, and the Workstation
    panel of the labextension the wheel carries (share/jupyter/labextensions)."""
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    try:
        page = context.new_page()
        page.goto(f"{url}/hub/login")
        page.fill("#username_input", user)
        page.fill("#password_input", password)
        page.click("#login_submit")
        page.wait_for_url(re.compile(r"/hub/(home|spawn|spawn-pending)|/user/"), timeout=60_000)
        page.goto(f"{url}/user/{user}/lab")
        page.locator("#jp-main-dock-panel").wait_for(timeout=120_000)
        page.locator("#jupyterlab-splash").wait_for(state="detached", timeout=120_000)
        page.locator('li[data-id="kubevirt-workstation"]').click()
        page.locator(".kvs-panel .kvs-summary").wait_for(timeout=60_000)
        assert "cpu" in page.locator(".kvs-panel .kvs-summary").inner_text()
    finally:
        context.close()


def test_bad_configuration_stops_the_hub_at_start_up_naming_the_setting(e2e_sim, tmp_path):
    hub = Hub(tmp_path, e2e_sim, "c.KubeVirtSpawner.golden_image = 'golden'\n")
    try:
        with pytest.raises(DemoError, match="exited"):
            hub.start()
        assert "KubeVirtSpawner.golden_image = 'golden': give the golden image PVC as namespace/name" in hub.log()
    finally:
        hub.close()


def demo_extra_of(wheel: Path, extra: str | None = "demo") -> set[str]:
    """The distributions a wheel's METADATA requires with `extra` (its extras of itself followed), or
    without any extra when `extra` is None."""
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(name for name in archive.namelist() if name.endswith(".dist-info/METADATA"))
        requires = [Requirement(value) for key, value in
                    email.parser.Parser().parsestr(archive.read(metadata).decode()).items() if key == "Requires-Dist"]
    wanted, names, extras = [extra], set(), set()
    while wanted:
        current = wanted.pop()
        extras.add(current)
        for req in requires:
            applies = (req.marker is None if current is None
                       else req.marker is not None and req.marker.evaluate({"extra": current}))
            if not applies:
                continue
            if req.name == "kubevirt-spawner":
                wanted.extend(e for e in req.extras if e not in extras)
            else:
                names.add(canonicalize_name(req.name))
    return names


def test_the_demo_runs_from_an_installed_wheel_outside_any_checkout(tmp_path, browser):
    """`pip install <wheel>` + `kubevirt-spawner demo --state DIR`, in a directory with no source tree
    and no upstream schemas: the hub config is package data, and the simulator starts without the
    schemas, saying so once. The project comes from the wheel (checked); its dependencies from this
    test's environment (a path file, so that environment's editable install of the checkout is not
    seen), which spares downloading them again. A browser lands in JupyterLab with the wheel's
    Workstation panel, as a new user of the `[demo]` extra would."""
    wheels, venv, work = tmp_path / "wheels", tmp_path / "venv", tmp_path / "elsewhere"
    work.mkdir()
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(wheels),
                    str(CHECKOUT)], check=True, timeout=300)
    wheel = next(wheels.glob("kubevirt_spawner-*.whl"))
    # The dependencies come from this environment (below), so the wheel's own word is checked: its
    # [demo] extra brings everything the demo checks for, and its plain install none of them.
    # (a module by its distribution's name: cel_expr_python is cel-expr-python)
    assert demo_extra_of(wheel) >= {canonicalize_name(name) for _, modules in DEMO_NEEDS for name in modules}
    assert not demo_extra_of(wheel, extra=None) & {"jsonschema", "jupyterlab", "ipykernel", "cel-expr-python"}
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    purelib = "import sysconfig; print(sysconfig.get_path('purelib'))"
    venv_site = Path(subprocess.run([venv / "bin" / "python", "-c", purelib], capture_output=True, text=True,
                                    check=True).stdout.strip())
    (venv_site / "dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run([venv / "bin" / "python", "-m", "pip", "install", "--quiet", "--no-deps", "--ignore-installed",
                    str(wheel)], check=True, timeout=300)
    env = {key: value for key, value in os.environ.items() if key not in ("KUBEVIRT_SCHEMAS_DIR", "PYTHONPATH")}
    env["PATH"] = f"{CHECKOUT / 'node_modules' / '.bin'}{os.pathsep}{env['PATH']}"  # configurable-http-proxy
    where = subprocess.run([venv / "bin" / "python", "-c", "import kubevirt_spawner; print(kubevirt_spawner.__file__)"],
                           cwd=work, env=env, capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(venv)), where

    proc, info = start_demo(work / "state", free_port(), command=(str(venv / "bin" / "kubevirt-spawner"),),
                            cwd=work, env=env)
    try:
        web = log_in(info["url"], "wendy", info["password"])
        spawn_from_form(web, info["url"], "cpu")
        api = admin_api(info)
        wait_ready(api, info["url"], "wendy", "wendy's server")
        landing = web.get(f"{info['url']}/user/wendy/", timeout=60)
        assert landing.status_code == 200 and landing.url.startswith(f"{info['url']}/user/wendy/"), landing.url
        r = api.get(f"{info['url']}/user/wendy/api/contents/etc/os-release", timeout=30)
        assert r.status_code == 200 and "Ubuntu" in r.json()["content"], r.text
        lands_in_jupyterlab(browser, info["url"], "wendy", info["password"])
        out = ctrl_c(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert out.count("upstream KubeVirt/CDI API schemas were not found") == 1, out
    assert "checked by the simulator's own admission rules only" in out
