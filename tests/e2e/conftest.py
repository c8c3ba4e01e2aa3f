"""End-to-end harness: the simulator, configurable-http-proxy and a real JupyterHub running the
local hub config (the demo's) as a ServiceAccount bound to deploy/rbac/, driven through the hub's
REST API and the proxy."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import signal
import threading
import time
import uuid
from pathlib import Path

import pytest
import requests
from kubernetes import client
from tornado.httpclient import HTTPRequest
from tornado.websocket import websocket_connect

from kubevirt_spawner import demo

from simtools import api_client, descendants, hub_kubeconfig, sim_api, start_sim

GOLDEN_BUILD = Path(__file__).resolve().parents[2] / "deploy" / "golden-image" / "build.sh"


def build_golden_image(*options: str) -> Path:
    """A golden image built by the recipe a platform team runs, cached by the recipe's hash: each
    recipe is built once per machine (once per CI run)."""
    import subprocess
    done = subprocess.run(["bash", str(GOLDEN_BUILD), *options], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, timeout=2400, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return Path(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def golden_image() -> Path:
    """The Debian 12 image the QEMU tests boot (build.sh's defaults: BIOS and EFI)."""
    return build_golden_image()

E2E_SPEED = 20.0
# The demo gives every machine a workspace disk; the hub tests that count a machine's disks use a
# hub config without one (also a supported setup: /home on the system disk).
ROOT_DISK_ONLY = 'c.KubeVirtSpawner.workspace_disk_size = ""\n'


class Hub:
    """One JupyterHub (restartable) behind one proxy, against one simulator."""

    def __init__(self, state_dir: Path, sim, extra_config: str = "", subdomains: bool = False):
        """`subdomains`: users' servers on subdomains of hub.localhost (which browsers map to this
        machine; the C library, and so the tests' HTTP clients, does not): `public_url`."""
        self.sim = sim
        self.state_dir = state_dir
        extra = state_dir / "extra_config.py"
        state_dir.mkdir(parents=True, exist_ok=True)
        # The hub runs as Zero-to-JupyterHub's `hub` ServiceAccount with exactly deploy/rbac/.
        self.kubeconfig = hub_kubeconfig(sim, state_dir / "hub.kubeconfig")
        self.settings = demo.HubSettings.create(state_dir, self.kubeconfig, extra_config=str(extra))
        self.public_url = f"http://hub.localhost:{self.settings.port}" if subdomains else self.settings.url
        if subdomains:
            extra_config += f"\nc.JupyterHub.subdomain_host = {self.public_url!r}\n"
        extra.write_text(extra_config)
        self.log_dir = state_dir / "logs"
        self.log_dir.mkdir(exist_ok=True)
        self.proxy = demo.start_proxy(self.settings, self.log_dir / "proxy.log", host_routing=subdomains)
        self.proc = None
        self.http = requests.Session()
        self.http.headers["Authorization"] = f"token {self.settings.admin_token}"

    @property
    def url(self) -> str:
        return self.settings.url

    def start(self):
        self.proc = demo.start_hub(self.settings, self.log_dir / "hub.log")
        return self

    def kill(self):
        """A hub crash: no clean shutdown, and its managed services (started in sessions of their
        own) die with it, as everything in a crashed pod does."""
        doomed = [self.proc.pid, *descendants(self.proc.pid)]
        for pid in doomed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()

    def restart(self, crash: bool = True):
        if crash:
            self.kill()
        else:
            demo.stop_process(self.proc)
        self.start()

    def close(self):
        demo.stop_process(self.proc)
        demo.stop_process(self.proxy)

    def log(self) -> str:
        return (self.log_dir / "hub.log").read_text(errors="replace")

    def execute(self, user: str, code: str, wait: bool = True, timeout: float = 120) -> str:
        """Run Python `code` in a new kernel on the user's server (Jupyter's kernel websocket). With
        `wait`, until it ends: what it printed (its error fails the test), and the kernel is shut
        down. Without, only until the kernel is busy with it, and the kernel is left running it."""
        base = f"{self.url}/user/{user}"
        kernel = self.http.post(f"{base}/api/kernels", json={"name": "python3"}, timeout=timeout)
        assert kernel.status_code == 201, kernel.text
        kid = kernel.json()["id"]
        token = self.http.headers["Authorization"].split()[1]
        out: list[str] = []

        async def execute():
            # (the call's own bound, not tornado's 20 s: a TCG guest beside code-server was slower)
            ws = await websocket_connect(HTTPRequest(f"{base.replace('http', 'ws', 1)}/api/kernels/{kid}/channels",
                                                     headers={"Authorization": f"token {token}"},
                                                     connect_timeout=timeout, request_timeout=timeout))
            msg_id = uuid.uuid4().hex
            ws.write_message(json.dumps({
                "header": {"msg_id": msg_id, "msg_type": "execute_request", "username": user, "session": msg_id,
                           "version": "5.3", "date": ""},
                "parent_header": {}, "metadata": {}, "channel": "shell",
                "content": {"code": code, "silent": False, "store_history": False, "user_expressions": {},
                            "allow_stdin": False, "stop_on_error": True}}))
            while True:
                reply = json.loads(await ws.read_message())
                if reply["parent_header"].get("msg_id") != msg_id:
                    continue
                if reply["msg_type"] == "stream":
                    out.append(reply["content"]["text"])
                elif reply["msg_type"] == "error":
                    raise AssertionError("\n".join(reply["content"]["traceback"]))
                elif reply["msg_type"] == "status" and reply["content"]["execution_state"] == ("idle" if wait
                                                                                              else "busy"):
                    break
            ws.close()
        async def bounded():
            await asyncio.wait_for(execute(), timeout)

        try:
            # On a thread of its own, with its own loop: a test that drives Chromium holds Playwright's
            # sync API, whose loop is already running on this thread.
            with concurrent.futures.ThreadPoolExecutor(1) as own:
                own.submit(asyncio.run, bounded()).result()
        finally:
            if wait:
                self.http.delete(f"{base}/api/kernels/{kid}", timeout=60)
        return "".join(out)

    # ------------------------------------------------------------ hub REST API
    def api(self, method: str, path: str, **kw) -> requests.Response:
        return self.http.request(method, f"{self.url}/hub/api{path}", timeout=60, **kw)

    def ensure_user(self, name: str):
        r = self.api("POST", f"/users/{name}")
        assert r.status_code in (201, 409), r.text

    def server_path(self, user: str, server: str = "") -> str:
        return f"/users/{user}/servers/{server}" if server else f"/users/{user}/server"

    def request_start(self, user: str, server: str = "", profile: str | None = None) -> requests.Response:
        self.ensure_user(user)
        body = {"profile": profile} if profile else {}
        return self.api("POST", self.server_path(user, server), json=body)

    def server_model(self, user: str, server: str = "") -> dict | None:
        model = self.api("GET", f"/users/{user}").json()
        return (model.get("servers") or {}).get(server)

    def wait_ready(self, user: str, server: str = "", timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            last = self.server_model(user, server)
            if last and last.get("ready"):
                return last
            failure = self.spawn_failure(user, server) if last is None else None
            if failure:
                raise AssertionError(f"start of {user}/{server} failed: {failure}")
            time.sleep(0.2)
        raise AssertionError(f"{user}/{server} not ready within {timeout}s: {last}")

    def spawn_failure(self, user: str, server: str = "") -> str | None:
        """The message the hub shows for a start that failed (its progress stream's last event)."""
        r = self.http.get(f"{self.url}/hub/api{self.server_path(user, server)}/progress", timeout=30)
        if r.status_code != 200:
            return None  # not starting, and no failed start to tell about
        events = [json.loads(line[5:]) for line in r.text.splitlines() if line.startswith("data:")]
        return events[-1]["message"] if events and events[-1].get("failed") else None

    def start_server(self, user: str, server: str = "", profile: str | None = None, timeout: float = 120) -> dict:
        r = self.request_start(user, server, profile)
        assert r.status_code in (201, 202), r.text
        return self.wait_ready(user, server, timeout)

    def progress(self, user: str, server: str = "", events: list | None = None, timeout: float = 120) -> list[dict]:
        """Every event of the hub's progress stream until it ends, appended to `events` as they come."""
        url = f"{self.url}/hub/api{self.server_path(user, server)}/progress"
        events = [] if events is None else events
        with self.http.get(url, stream=True, timeout=timeout) as r:
            for line in r.iter_lines(decode_unicode=True):
                if line and line.startswith("data:"):
                    events.append(json.loads(line[5:]))
        return events

    def start_and_watch(self, user: str, server: str = "", profile: str | None = None, timeout: float = 60) -> list[str]:
        """Start a server and read its whole progress stream while it starts (the hub answers the
        start request only after a while, and a stream opened after the start has ended says "ready"
        only): the messages, in order."""
        answer: list[requests.Response] = []
        request = threading.Thread(target=lambda: answer.append(self.request_start(user, server, profile)))
        request.start()
        url = f"{self.url}/hub/api{self.server_path(user, server)}/progress"
        deadline = time.monotonic() + timeout
        events: list[dict] = []
        while not events and time.monotonic() < deadline:
            with self.http.get(url, stream=True, timeout=timeout) as r:
                if r.status_code == 200:
                    events = [json.loads(line[5:]) for line in r.iter_lines(decode_unicode=True)
                              if line and line.startswith("data:")]
                else:
                    time.sleep(0.05)  # not starting yet
        request.join(timeout)
        assert answer and answer[0].status_code in (201, 202), answer
        return [e["message"] for e in events]

    def stop_server(self, user: str, server: str = "", timeout: float = 120):
        r = self.api("DELETE", self.server_path(user, server))
        assert r.status_code in (202, 204), r.text
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            model = self.server_model(user, server)
            if model is None or (model.get("stopped") and not model.get("pending")):
                return
            time.sleep(0.2)
        raise AssertionError(f"{user}/{server} did not stop within {timeout}s")

    # ------------------------------------------------------------ the user's Jupyter server, through the proxy
    def contents(self, user: str, server: str = "") -> str:
        prefix = f"/user/{user}/{server}/" if server else f"/user/{user}/"
        return f"{self.url}{prefix}api/contents/"

    def write_file(self, user: str, path: str, text: str, server: str = ""):
        base = self.contents(user, server)
        parts = path.split("/")
        for i in range(1, len(parts)):
            directory = "/".join(parts[:i])
            r = self.http.get(base + directory, params={"content": 0}, timeout=30)
            if r.status_code == 404:
                r = self.http.put(base + directory, json={"type": "directory"}, timeout=30)
                assert r.status_code in (200, 201), r.text
        r = self.http.put(base + path, json={"type": "file", "format": "text", "content": text}, timeout=30)
        assert r.status_code in (200, 201), r.text

    def read_file(self, user: str, path: str, server: str = "") -> str | None:
        r = self.http.get(self.contents(user, server) + path, timeout=30)
        if r.status_code == 404:
            return None
        assert r.status_code == 200, r.text
        return r.json()["content"]


class Cluster:
    """Reads of the simulated cluster, and its /sim/v1 control API."""

    def __init__(self, sim):
        self.sim = sim
        self.api = api_client(sim)
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)

    def objects(self, group: str, version: str, plural: str, ns: str) -> list[dict]:
        return self.custom.list_namespaced_custom_object(group, version, ns, plural)["items"]

    def vm(self, ns: str, name: str) -> dict | None:
        return self._get("kubevirt.io", "v1", ns, "virtualmachines", name)

    def vmi(self, ns: str, name: str) -> dict | None:
        return self._get("kubevirt.io", "v1", ns, "virtualmachineinstances", name)

    def _get(self, group, version, ns, plural, name):
        try:
            return self.custom.get_namespaced_custom_object(group, version, ns, plural, name)
        except client.ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def datavolumes(self, ns: str) -> list[dict]:
        return self.objects("cdi.kubevirt.io", "v1beta1", "datavolumes", ns)

    def pvcs(self, ns: str) -> list[dict]:
        r = self.api.call_api(*self.api.param_serialize("GET", f"/api/v1/namespaces/{ns}/persistentvolumeclaims",
                                                        auth_settings=["BearerToken"]))
        r.read()
        return json.loads(r.data)["items"]

    def sim_api(self, method: str, path: str, body: dict | None = None) -> dict:
        return sim_api(self.sim, method, path, body)


@pytest.fixture(scope="module")
def e2e_sim(tmp_path_factory):
    # the demo's cluster: its CPU nodes in the workstation pool, as the demo config's profiles select
    s = start_sim(tmp_path_factory.mktemp("cluster"), speed=E2E_SPEED, node_pools=True)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def cluster(e2e_sim):
    return Cluster(e2e_sim)


@pytest.fixture(scope="module")
def hub(e2e_sim, tmp_path_factory):
    h = Hub(tmp_path_factory.mktemp("hub"), e2e_sim, ROOT_DISK_ONLY).start()
    yield h
    h.close()


SERVICE_API = "/services/workstations/api/v1"


def tunnel_handshake(hub: Hub, user: str, token: str) -> tuple[int, str]:
    """Open `user`'s SSH tunnel (`/user/USER/sshd/`, through the proxy) with `token` in the
    Authorization header, as `kubevirt-spawner tunnel` does: the handshake's status and, refused,
    the guest's sentence (X-Workstation-Refusal); opened (101), sshd's banner (the first line it
    sends: the connection reached it), and the tunnel closed before any SSH is spoken."""
    import aiohttp

    async def handshake() -> tuple[int, str]:
        async with aiohttp.ClientSession() as session:
            try:
                ws = await session.ws_connect(f"{hub.url}/user/{user}/sshd/", headers={"Authorization": f"token {token}"},
                                              timeout=aiohttp.ClientWSTimeout(ws_close=10))
            except aiohttp.WSServerHandshakeError as refused:
                return refused.status, (refused.headers or {}).get("X-Workstation-Refusal", "")
            try:
                message = await ws.receive(timeout=60)
                said = message.data if isinstance(message.data, (bytes, str)) else b""
                banner = (said.decode(errors="replace") if isinstance(said, bytes) else said).splitlines()
                return 101, banner[0] if banner else ""
            finally:
                await ws.close()
    return asyncio.run(handshake())
CHROMIUM = "/usr/bin/chromium"  # Debian's; never a browser Playwright downloads


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run"])
        yield b
        b.close()



def hub_with_service(e2e_sim, tmp_path_factory, extra_config: str):
    """A hub with `extra_config` whose workstations service answers (401 without a token): a
    module fixture's body (`yield from`)."""
    from simtools import wait_for
    h = Hub(tmp_path_factory.mktemp("hub"), e2e_sim, extra_config=extra_config).start()
    wait_for(lambda: requests.get(f"{h.url}{SERVICE_API}/workstations", timeout=5).status_code == 401, 60,
             what="the workstations service")
    yield h
    h.close()
