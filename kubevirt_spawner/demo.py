"""The local demo: the simulator, configurable-http-proxy and JupyterHub with the local config.

The same pieces start the end-to-end tests, so what the tests check is what the demo runs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
SOURCE_DIR = PACKAGE_DIR.parent  # the checkout, when run from one (its node_modules has the proxy)
DEMO_CONFIG = PACKAGE_DIR / "data" / "demo_config.py"  # package data: the demo works from a wheel
DEMO_PASSWORD = "demo"


class DemoError(Exception):
    """Something the demo needs is missing; the text says what to do."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_proxy() -> str:
    """configurable-http-proxy on PATH, or the one `npm ci` put into the source checkout."""
    local = SOURCE_DIR / "node_modules" / ".bin" / "configurable-http-proxy"
    if local.exists():
        return str(local)
    found = shutil.which("configurable-http-proxy")
    if found:
        return found
    raise DemoError("configurable-http-proxy is not installed: run `npm ci` in the source checkout "
                    "(or `npm install -g configurable-http-proxy`)")


# What the demo needs beyond the hub's own install, each with why: the [demo] extra brings them all.
DEMO_NEEDS = (
    # its workstations are process guests, Jupyter servers on this machine
    ("the demo's workstations run JupyterLab", ("jupyterlab", "ipykernel")),
    ("the demo's simulator checks every object against KubeVirt's schemas", ("jsonschema",)),
    ("the demo's simulator evaluates admission policies as kube-apiserver does", ("cel_expr_python",)),
)


def check_demo_software() -> None:
    for why, modules in DEMO_NEEDS:
        missing = [name for name in modules if importlib.util.find_spec(name) is None]
        if missing:
            raise DemoError(f"{why}, and {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                            "not installed: pip install 'kubevirt-spawner[demo]'")


def wait_http(url: str, timeout: float = 60.0, proc: subprocess.Popen | None = None, what: str = "server",
              any_status: bool = True):
    """Wait until `url` answers (with any HTTP status, or only a success); fail early when `proc` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise DemoError(f"the {what} exited with code {proc.returncode} before it answered at {url}")
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return
        except urllib.error.HTTPError:
            if any_status:
                return
            time.sleep(0.1)
        except (urllib.error.URLError, OSError):
            time.sleep(0.1)
    raise DemoError(f"the {what} did not answer at {url} within {timeout:.0f}s")


@dataclass
class HubSettings:
    """What the local hub config reads from the environment."""
    state_dir: Path
    kubeconfig: str
    port: int
    hub_port: int
    proxy_api_port: int
    proxy_token: str
    admin_token: str
    service_port: int
    extra_config: str | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update({"KUBEVIRT_DEMO_STATE": str(self.state_dir), "KUBEVIRT_SPAWNER_KUBECONFIG": self.kubeconfig,
                    "KUBEVIRT_DEMO_PORT": str(self.port), "KUBEVIRT_DEMO_HUB_PORT": str(self.hub_port),
                    "CONFIGPROXY_API_URL": f"http://127.0.0.1:{self.proxy_api_port}",
                    "CONFIGPROXY_AUTH_TOKEN": self.proxy_token, "KUBEVIRT_DEMO_ADMIN_TOKEN": self.admin_token,
                    "KUBEVIRT_DEMO_SERVICE_PORT": str(self.service_port),
                    "KUBEVIRT_DEMO_EXTRA_CONFIG": self.extra_config or ""})
        return env

    @classmethod
    def create(cls, state_dir: Path, kubeconfig: str, port: int = 0, extra_config: str | None = None):
        """Ports and tokens. They are kept in the state directory: running machines have the hub's
        API URL in their environment, so the hub must come back at the same address."""
        state_dir.mkdir(parents=True, exist_ok=True)
        saved_file = state_dir / "demo-settings.json"
        saved = json.loads(saved_file.read_text()) if saved_file.exists() else {}
        fresh = {"proxy_token": lambda: secrets.token_hex(32), "admin_token": lambda: secrets.token_hex(32),
                 "hub_port": free_port, "proxy_api_port": free_port, "service_port": free_port}
        missing = [key for key in fresh if key not in saved]
        for key in missing:  # (a state directory from an older version lacks the newer ones)
            saved[key] = fresh[key]()
        if missing:
            saved_file.write_text(json.dumps(saved))
            saved_file.chmod(0o600)
        return cls(state_dir, kubeconfig, port or free_port(), saved["hub_port"], saved["proxy_api_port"],
                   saved["proxy_token"], saved["admin_token"], saved["service_port"], extra_config)


def start_proxy(settings: HubSettings, log_path: Path, host_routing: bool = False) -> subprocess.Popen:
    """The proxy; `host_routing` for a hub with users' subdomains (c.JupyterHub.subdomain_host)."""
    cmd = [find_proxy(), "--ip", "127.0.0.1", "--port", str(settings.port), "--api-ip", "127.0.0.1",
           "--api-port", str(settings.proxy_api_port),
           "--error-target", f"http://127.0.0.1:{settings.hub_port}/hub/error", *(["--host-routing"] * host_routing)]
    log = open(log_path, "ab")
    proc = subprocess.Popen(cmd, env=settings.env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    wait_http(f"http://127.0.0.1:{settings.proxy_api_port}/api/routes", 30, proc, "proxy")
    return proc


def start_hub(settings: HubSettings, log_path: Path, config: Path = DEMO_CONFIG) -> subprocess.Popen:
    if not config.exists():
        raise DemoError(f"the demo's hub config {config} is missing: reinstall kubevirt-spawner")
    hub_dir = settings.state_dir / "hub"
    hub_dir.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "ab")
    proc = subprocess.Popen([sys.executable, "-m", "jupyterhub", "-f", str(config)], cwd=hub_dir,
                            env=settings.env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    # Through the proxy, so the hub's route is in place too.
    wait_http(f"{settings.url}/hub/api/", 90, proc, f"hub (log: {log_path})", any_status=False)
    return proc


def stop_process(proc: subprocess.Popen | None, timeout: float = 15.0):
    """SIGTERM, then SIGKILL when it does not exit in time."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run(state_dir: str, port: int = 8000, speed: float = 5.0) -> int:
    """`kubevirt-spawner demo`: run everything until Ctrl-C, then stop everything it started."""
    try:  # (before anything starts or is written)
        check_demo_software()
        find_proxy()
    except DemoError as exc:
        print(f"kubevirt-spawner demo: {exc}", file=sys.stderr)
        return 2
    # (after the check: the simulator needs jsonschema, which only the [demo] extra brings)
    from .sim import SimulatorThread  # the demo is the only place outside tests that embeds the simulator
    state = Path(state_dir).resolve()
    state.mkdir(parents=True, exist_ok=True)
    logs = state / "logs"
    logs.mkdir(exist_ok=True)
    sim = proxy = hub = None
    stop = {"now": False}

    def interrupt(signum, frame):
        stop["now"] = True

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)  # also when started in the background, where SIGINT is ignored
    try:
        # (its nodes in the workstation pools, as deploy/README.md has a platform team put them)
        sim = SimulatorThread(str(state / "cluster"), speed=speed, node_pools=True).start()
        settings = HubSettings.create(state, sim.kubeconfig, port)
        proxy = start_proxy(settings, logs / "proxy.log")
        hub = start_hub(settings, logs / "hub.log")
        info = {"url": settings.url, "admin_token": settings.admin_token, "kubeconfig": sim.kubeconfig,
                "password": DEMO_PASSWORD, "simulator": sim.url, "logs": str(logs)}
        (state / "demo.json").write_text(json.dumps(info, indent=2))
        print(f"\nkubevirt-spawner demo is running: {settings.url}\n"
              f"  log in with any user name and the password '{DEMO_PASSWORD}' (user 'admin' is a hub admin)\n"
              f"  kubectl --kubeconfig {sim.kubeconfig} get vm,vmi,dv,pvc -A\n"
              f"  details: {state / 'demo.json'}; logs: {logs}\n"
              f"  Ctrl-C stops everything.\n", flush=True)
        while not stop["now"]:
            for what, proc in (("hub", hub), ("proxy", proxy)):
                if proc.poll() is not None:
                    print(f"the {what} exited (code {proc.returncode}); see {logs}", file=sys.stderr)
                    return 1
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    except DemoError as exc:
        print(f"kubevirt-spawner demo: {exc}", file=sys.stderr)
        return 2
    finally:
        # A second Ctrl-C must not cut the clean-up short and leave processes behind.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("stopping the demo ...", flush=True)
        stop_process(hub)
        stop_process(proxy)
        if sim is not None:
            sim.stop()
    return 0
