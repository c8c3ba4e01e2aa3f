"""The guest server extension (kubevirt_spawner.guest) in a real jupyter-server process, in front of
a fake workstations service that records what it is sent."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests

CHECKOUT = Path(__file__).resolve().parents[1]
JUPYTER_SERVER = os.path.join(os.path.dirname(sys.executable), "jupyter-server")
BROWSER_TOKEN = "browser-token-for-this-jupyter-server"  # what the browser (the panel) authenticates with
SERVER_TOKEN = "the-servers-own-hub-token"  # JUPYTERHUB_API_TOKEN: what the service must see
BASE_URL = "/user/alice/gpu/"  # as under JupyterHub
SERVICE_PREFIX = "/services/workstations/"
WORKSTATION = SERVICE_PREFIX + "api/v1/workstations/alice/servers/gpu"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Call:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class FakeService:
    """The workstations service: records each call and answers `status`/`body`/`content_type`
    (and `headers`), after `delay` seconds."""

    port: int = 0
    calls: list[Call] = field(default_factory=list)
    activity_reports: list[Call] = field(default_factory=list)
    status: int = 200
    body: bytes = b"{}"
    content_type: str = "application/json"
    delay: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)

    def answer(self, status: int, data, content_type: str = "application/json", delay: float = 0.0,
               headers: dict[str, str] | None = None) -> None:
        self.status, self.content_type, self.delay, self.headers = status, content_type, delay, headers or {}
        self.body = data if isinstance(data, bytes) else json.dumps(data).encode()

    def reset(self) -> None:
        self.calls.clear()
        self.answer(200, {})

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}{SERVICE_PREFIX}"


def start_fake_service() -> tuple[FakeService, ThreadingHTTPServer]:
    fake = FakeService()

    class Handler(BaseHTTPRequestHandler):
        def handle_call(self):
            length = int(self.headers.get("Content-Length") or 0)
            call = Call(self.command, self.path, dict(self.headers), self.rfile.read(length))
            if self.path.endswith("/activity"):  # the guest's own activity reports, not the panel's calls
                fake.activity_reports.append(call)
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")
                return
            fake.calls.append(call)
            status, body, content_type, headers = fake.status, fake.body, fake.content_type, fake.headers
            time.sleep(fake.delay)
            try:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            except OSError:
                pass  # the guest gave up waiting (the timeout test)

        do_GET = do_POST = do_DELETE = handle_call

        def log_message(self, *args):
            """Quiet: the tests read the recorded calls, not a log."""

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    fake.port = httpd.server_address[1]
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return fake, httpd


class Server:
    """A jupyter-server with the guest extension, started as the spawner starts one in a workstation."""

    def __init__(self, tmp: Path, env: dict[str, str], args: tuple[str, ...] = (), base_url: str = "/",
                 wait: bool = True):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}{base_url}"
        self.log_path = tmp / "server.log"
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER", "KUBEVIRT_"))}
        # The checkout first: the extension under test is this one, whatever is installed.
        pythonpath = os.pathsep.join(p for p in (str(CHECKOUT), os.environ.get("PYTHONPATH")) if p)
        clean.update(HOME=str(tmp), JUPYTER_CONFIG_DIR=str(tmp / "config"), JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
                     JUPYTER_DATA_DIR=str(tmp / "data"), PYTHONPATH=pythonpath, **env)
        cmd = [JUPYTER_SERVER, "--ServerApp.jpserver_extensions={'kubevirt_spawner.guest': True}",
               f"--IdentityProvider.token={BROWSER_TOKEN}", "--ServerApp.open_browser=False",
               f"--ServerApp.root_dir={tmp}", "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={self.port}",
               "--ServerApp.port_retries=0", f"--ServerApp.base_url={base_url}", *args]
        if not any(arg.startswith("--WorkstationGuest.code_server=") for arg in args):
            cmd.append("--WorkstationGuest.code_server=")  # no VS Code, whatever this machine's PATH has
        if os.geteuid() == 0:
            cmd.append("--allow-root")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, env=clean, stdout=log, stderr=subprocess.STDOUT, cwd=tmp)
        if wait:
            try:
                self.wait_ready()
            except BaseException:
                self.stop()
                raise

    def wait_ready(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"jupyter-server exited with {self.proc.returncode}:\n{self.log()}")
            with contextlib.suppress(requests.ConnectionError):  # not listening yet
                if self.request("GET", "api/status").status_code == 200:
                    return
            time.sleep(0.1)
        pytest.fail(f"jupyter-server did not answer in {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def request(self, method: str, path: str, *, token: str | None = BROWSER_TOKEN, **kwargs) -> requests.Response:
        headers = kwargs.pop("headers", {})
        if token:
            headers["Authorization"] = f"token {token}"
        return requests.request(method, self.base + path, headers=headers, timeout=30, **kwargs)

    def last_activity(self) -> datetime:
        """The server's last activity, as JupyterHub's activity reports and the culler see it
        (/api/status itself does not count)."""
        status = self.request("GET", "api/status?no_track_activity=1")
        assert status.status_code == 200
        return datetime.fromisoformat(status.json()["last_activity"])

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def fake_service():
    fake, httpd = start_fake_service()
    yield fake
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def fake(fake_service):
    fake_service.reset()
    return fake_service


def hub_env(service_url: str, server_name: str = "gpu", **extra: str) -> dict[str, str]:
    env = dict(JUPYTERHUB_USER="alice", JUPYTERHUB_SERVER_NAME=server_name, JUPYTERHUB_API_TOKEN=SERVER_TOKEN,
               JUPYTERHUB_BASE_URL="/", KUBEVIRT_WORKSTATIONS_URL=service_url)
    return {**env, **extra}


@pytest.fixture(scope="module")
def server(tmp_path_factory, fake_service):
    """alice's server `gpu`; a 1 s timeout, set as a jupyter_server config option."""
    s = Server(tmp_path_factory.mktemp("guest"), hub_env(fake_service.url),
               ("--WorkstationGuest.request_timeout=1",), base_url=BASE_URL)
    yield s
    s.stop()


def test_the_service_sees_the_servers_own_token_not_the_browsers(server, fake):
    """The call to the service carries this server's hub token (JUPYTERHUB_API_TOKEN); the browser's
    Authorization header and cookies stay in the guest."""
    fake.answer(200, {"name": "alice/gpu", "phase": "Running"})
    r = server.request("GET", "workstation/api/status", headers={"Cookie": "hub-session=secret"})
    assert r.status_code == 200
    assert r.json() == {"name": "alice/gpu", "phase": "Running"}
    [call] = fake.calls
    assert call.headers["Authorization"] == f"token {SERVER_TOKEN}"
    assert BROWSER_TOKEN not in json.dumps(call.headers)
    assert "Cookie" not in call.headers
    assert SERVER_TOKEN not in server.log()


@pytest.mark.parametrize(("method", "path", "body", "service_path"), [
    ("GET", "status", None, ""),
    ("GET", "status?no_track_activity=1", None, ""),
    ("GET", "snapshots", None, "/snapshots"),
    ("POST", "snapshots", {"name": "before-upgrade", "note": "CUDA 12"}, "/snapshots"),
    ("DELETE", "snapshots/before-upgrade", None, "/snapshots/before-upgrade"),
    ("DELETE", "snapshots/a%20b", None, "/snapshots/a%20b"),
    ("POST", "restore", {"snapshot": "before-upgrade", "confirm": "alice"}, "/restore"),
    ("POST", "reset", {"confirm": "alice"}, "/reset"),
    ("POST", "stop", {}, "/stop"),
    ("POST", "keepalive", {"minutes": 60}, "/keepalive"),
])
def test_path_mapping(server, fake, method, path, body, service_path):
    """Each panel route reaches the service's endpoint of alice's server `gpu` with the same method
    and JSON body, names quoted again, and without the query string (it is for this server only)."""
    r = server.request(method, "workstation/api/" + path, json=body)
    assert r.status_code == 200, r.text
    [call] = fake.calls
    assert (call.method, call.path) == (method, WORKSTATION + service_path)
    if method == "POST":
        assert json.loads(call.body) == body
        assert call.headers["Content-Type"] == "application/json"


@pytest.mark.parametrize("method", ["GET", "POST", "DELETE"])
@pytest.mark.parametrize("path", ["purge", "status/x", "snapshots/a/b", "restore/x", "stop/now", "snapshots/..", "", "workstations"])
def test_unknown_action_is_404_and_not_forwarded(server, fake, method, path):
    """Only the panel's actions are forwarded: purge (admin-only) and any other path is 404 JSON here."""
    r = server.request(method, "workstation/api/" + path, json={} if method == "POST" else None)
    assert r.status_code == 404
    assert r.json()["error"]
    assert fake.calls == []


def test_service_errors_pass_through(server, fake):
    """The service's status and sentence come back unchanged."""
    error = {"error": "The workstation is restoring; wait until it is done."}
    fake.answer(409, error)
    r = server.request("POST", "workstation/api/snapshots", json={})
    assert (r.status_code, r.json()) == (409, error)
    fake.answer(202, {"operation": "restore"})
    r = server.request("POST", "workstation/api/restore", json={"snapshot": "s1", "confirm": "alice"})
    assert (r.status_code, r.json()) == (202, {"operation": "restore"})


def test_non_json_answer_is_502(server, fake):
    """An answer that is not JSON (e.g. a proxy's or login page) is a 502 with a sentence."""
    fake.answer(200, b"<html>Sign in</html>", content_type="text/html")
    r = server.request("GET", "workstation/api/status")
    assert r.status_code == 502
    assert r.json() == {"error": "The workstations service answered 200 without JSON; ask your hub admin."}


def test_redirect_is_not_followed(server, fake):
    """A redirect is not followed (it would carry the token elsewhere); it is not JSON: 502."""
    fake.answer(302, b"", content_type="text/html", headers={"Location": f"http://127.0.0.1:{fake.port}/elsewhere"})
    r = server.request("GET", "workstation/api/status")
    assert r.status_code == 502
    assert [c.path for c in fake.calls] == [WORKSTATION]


def test_slow_service_is_503_after_the_configured_timeout(server, fake):
    """c.WorkstationGuest.request_timeout applies: a service slower than it is a 503 with the reason."""
    fake.answer(200, {}, delay=2.5)
    start = time.monotonic()
    r = server.request("GET", "workstation/api/status")
    assert time.monotonic() - start < 2.5
    assert r.status_code == 503
    assert r.json()["error"].startswith("The workstations service does not answer (timeout")
    assert "does not answer" in server.log()


def test_info_is_answered_locally(server, fake):
    """info says who this server is and where its rescue page is, without calling the service."""
    r = server.request("GET", "workstation/api/info")
    assert r.status_code == 200
    assert r.json() == {"user": "alice", "server": "gpu", "configured": True,
                        "service_page": "/services/workstations/workstation/alice/servers/gpu",
                        "ssh_keys_page": "/services/workstations/#ssh-keys", "vscode_url": ""}
    assert fake.calls == []


@pytest.mark.parametrize(("method", "path"), [("GET", "status"), ("GET", "info"), ("POST", "snapshots"),
                                              ("DELETE", "snapshots/s1")])
def test_unauthenticated_request_is_refused(server, fake, method, path):
    """Without Jupyter's token or login cookie: 403, nothing forwarded."""
    r = server.request(method, "workstation/api/" + path, token=None)
    assert r.status_code in (401, 403)
    assert fake.calls == []


def test_xsrf_is_checked_for_cookie_sessions(server, fake):
    """A browser session (login cookie) must send the XSRF token with a POST, as JupyterLab does."""
    session = requests.Session()
    assert session.get(server.base + "api/status", headers={"Authorization": f"token {BROWSER_TOKEN}"}).ok
    assert session.cookies, "the token request set a login cookie"
    r = session.post(server.base + "workstation/api/snapshots", json={})
    assert r.status_code == 403
    assert fake.calls == []
    session.cookies.set("_xsrf", "panel-xsrf")
    r = session.post(server.base + "workstation/api/snapshots", json={}, headers={"X-XSRFToken": "panel-xsrf"})
    assert r.status_code == 200
    assert len(fake.calls) == 1


def test_polls_are_not_activity_actions_are(server, fake):
    """GET polls (with or without ?no_track_activity=1) leave the server's last_activity alone, so an
    idle server with the panel open can be culled; a POST (taking a snapshot) is the user's activity."""
    before = server.last_activity()
    time.sleep(0.05)
    for path in ("status", "status?no_track_activity=1", "snapshots", "info"):
        assert server.request("GET", "workstation/api/" + path).status_code == 200
    assert server.last_activity() == before
    time.sleep(0.05)
    assert server.request("POST", "workstation/api/snapshots", json={"name": "s1"}).status_code == 200
    assert server.last_activity() > before


@pytest.fixture(scope="module")
def other_servers(tmp_path_factory, fake_service):
    """Servers set up otherwise, started together (each takes seconds to start):
    default: alice@example.org's default server, under a hub at /jhub/;
    subdomain: alice's, on a subdomain of its own (the hub elsewhere);
    down: nothing listens at its service URL; unconfigured: not started by a hub."""
    # Bound but not listening: connections are refused, and no process started later gets the port.
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    envs = {
        "default": hub_env(fake_service.url, server_name="", JUPYTERHUB_USER="alice@example.org",
                           JUPYTERHUB_BASE_URL="/jhub/"),
        # users' servers on subdomains: the service has a host of its own, which the spawner passes
        "subdomain": hub_env(fake_service.url, server_name="", JUPYTERHUB_USER="alice", JUPYTERHUB_BASE_URL="/jhub/",
                             KUBEVIRT_WORKSTATIONS_PAGE="https://workstations--service.jupyter.example.org"
                                                        "/jhub/services/workstations/"),
        "down": hub_env(f"http://127.0.0.1:{closed.getsockname()[1]}{SERVICE_PREFIX}"),
        "unconfigured": {},
    }
    servers = {name: Server(tmp_path_factory.mktemp(name), env, wait=False) for name, env in envs.items()}
    try:
        for s in servers.values():
            s.wait_ready()
        yield servers
    finally:
        for s in servers.values():
            s.proc.terminate()  # all at once: each takes a second to shut down
        for s in servers.values():
            s.stop()
        closed.close()


def test_with_subdomains_the_rescue_page_is_on_the_services_host(other_servers, fake):
    """Issue 30, item 1: on alice.jupyter.example.org a path alone would stay on her own host; the
    service is on a host of its own (JupyterHub's subdomain_hook: NAME--service.HUB)."""
    info = other_servers["subdomain"].request("GET", "workstation/api/info").json()
    assert info["service_page"] == \
        "https://workstations--service.jupyter.example.org/jhub/services/workstations/workstation/alice"
    assert info["ssh_keys_page"] == "https://workstations--service.jupyter.example.org/jhub/services/workstations/#ssh-keys"


def test_default_server(other_servers, fake):
    """The default server (JUPYTERHUB_SERVER_NAME empty) is the workstation `<user>` without
    /servers/; the user name is quoted; the rescue page is under the hub's base URL."""
    s = other_servers["default"]
    assert s.request("GET", "workstation/api/info").json() == {
        "user": "alice@example.org", "server": "", "configured": True,
        "service_page": "/jhub/services/workstations/workstation/alice%40example.org",
        "ssh_keys_page": "/jhub/services/workstations/#ssh-keys", "vscode_url": ""}
    assert s.request("GET", "workstation/api/status").status_code == 200
    assert s.request("DELETE", "workstation/api/snapshots/s1").status_code == 200
    workstation = SERVICE_PREFIX + "api/v1/workstations/alice%40example.org"
    assert [(c.method, c.path) for c in fake.calls] == [("GET", workstation), ("DELETE", workstation + "/snapshots/s1")]


def test_service_down_is_503(other_servers):
    """Nothing listening at the service's address: 503 with a sentence, logged without the token."""
    s = other_servers["down"]
    r = s.request("POST", "workstation/api/stop", json={})
    log = s.log()
    assert r.status_code == 503
    assert r.json() == {"error": "The workstations service does not answer (connection refused); "
                                 "try again in a minute, or ask your hub admin."}
    assert "does not answer: connection refused" in log
    assert SERVER_TOKEN not in log


def test_not_configured_is_503(other_servers):
    """A server not started by a hub with the service (no URL, user, token): info says so, the rest is 503."""
    s = other_servers["unconfigured"]
    info = s.request("GET", "workstation/api/info").json()
    r = s.request("GET", "workstation/api/status")
    assert info["configured"] is False
    assert r.status_code == 503
    assert "not started by a JupyterHub with the workstations service" in r.json()["error"]


def test_the_guest_reports_why_its_machine_is_busy_with_its_own_token(fake, server):
    """At start and every c.WorkstationActivity.interval the guest posts what its activity sampler
    found (an empty list: idle) to the service's activity endpoint, with the server's token."""
    wait = time.monotonic() + 10
    while not fake.activity_reports and time.monotonic() < wait:
        time.sleep(0.1)
    report = fake.activity_reports[0]
    assert report.method == "POST" and report.path == f"{SERVICE_PREFIX}api/v1/workstations/alice/servers/gpu/activity"
    assert report.headers["Authorization"] == f"token {SERVER_TOKEN}"
    body = json.loads(report.body)
    sources = body["sources"]  # (this machine's own logins and GPUs, if any)
    assert isinstance(sources, list) and all({"source", "text", "since"} <= set(x) for x in sources)
    assert body["every"] == 60.0  # the default interval: the service ages the report by it


# ------------------------------------------------------------------------------------ the SSH tunnel
class FakeSshd:
    """A TCP server in place of the guest's sshd: sends an SSH banner, then echoes; records who
    connected (a refused tunnel must reach it not at all)."""

    BANNER = b"SSH-2.0-FakeSshd\r\n"

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    def _echo(self, conn):
        with conn:
            conn.sendall(self.BANNER)
            while data := conn.recv(65536):
                conn.sendall(data)

    def close(self):
        self.sock.close()


@pytest.fixture(scope="module")
def sshd():
    fake = FakeSshd()
    yield fake
    fake.close()


@pytest.fixture(scope="module")
def ssh_server(tmp_path_factory, fake_service, sshd):
    """alice's server `gpu` with its sshd on the fake's port, sampling activity every second."""
    s = Server(tmp_path_factory.mktemp("guest-ssh"), hub_env(fake_service.url),
               (f"--WorkstationGuest.sshd_port={sshd.port}", "--WorkstationActivity.interval=1"), base_url=BASE_URL)
    yield s
    s.stop()


def tunnel_url(server: Server) -> str:
    return server.base.replace("http://", "ws://") + "sshd/"


def reported_sources(fake: FakeService, since: int) -> list[list[str]]:
    return [[r["source"] for r in json.loads(call.body)["sources"]] for call in fake.activity_reports[since:]]


async def test_the_tunnel_carries_the_bytes_of_one_connection_to_sshd_and_counts_as_activity(ssh_server, sshd, fake):
    """`sshd/` is jupyter-server-proxy's raw socket relay (jupyter_server_proxy/rawsocket.py): each
    binary message is written to the sshd connection and what sshd sends comes back as messages.
    While it is open the activity sampler reports it (source ssh-tunnel, with where it comes from),
    and not once it is closed."""
    import aiohttp
    before = sshd.connections
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(tunnel_url(ssh_server), headers={
                "Authorization": f"token {BROWSER_TOKEN}", "X-Forwarded-For": "10.0.0.5, 10.1.1.1"}) as ws:
            received = b""
            while len(received) < len(FakeSshd.BANNER):
                received += (await ws.receive_bytes(timeout=10))
            assert received == FakeSshd.BANNER
            await ws.send_bytes(b"SSH-2.0-OpenSSH_9.2\r\n")
            assert await ws.receive_bytes(timeout=10) == b"SSH-2.0-OpenSSH_9.2\r\n"
            assert sshd.connections == before + 1
            mark = len(fake.activity_reports)
            deadline = time.monotonic() + 10
            while not any("ssh-tunnel" in s for s in reported_sources(fake, mark)) and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            report = next(json.loads(c.body)["sources"] for c in fake.activity_reports[mark:]
                          if "ssh-tunnel" in [r["source"] for r in json.loads(c.body)["sources"]])
            tunnel = next(r for r in report if r["source"] == "ssh-tunnel")
            assert tunnel["text"].startswith("SSH through the hub from 10.0.0.5 since ")
        mark = len(fake.activity_reports)
        deadline = time.monotonic() + 10
        while len(fake.activity_reports) < mark + 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert reported_sources(fake, mark + 1) and not any("ssh-tunnel" in s for s in reported_sources(fake, mark + 1))


@pytest.mark.parametrize("headers, why", [
    ({}, "no token"),
    ({"Authorization": "token not-this-servers-token"}, "a wrong token"),
])
async def test_a_tunnel_without_the_servers_authentication_is_403_and_reaches_no_sshd(ssh_server, sshd, headers, why):
    import aiohttp
    before = sshd.connections
    async with aiohttp.ClientSession() as session:
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await session.ws_connect(tunnel_url(ssh_server), headers=headers)
    assert refused.value.status == 403, why
    await asyncio.sleep(0.3)
    assert sshd.connections == before


async def test_a_tunnel_the_hub_turned_off_is_403_and_reaches_no_sshd(tmp_path, fake_service, sshd):
    """c.KubeVirtSpawner.ssh_enabled = False reaches the guest as KUBEVIRT_SSH_ENABLED=0."""
    import aiohttp
    s = Server(tmp_path, hub_env(fake_service.url, KUBEVIRT_SSH_ENABLED="0"),
               (f"--WorkstationGuest.sshd_port={sshd.port}",), base_url=BASE_URL)
    try:
        before = sshd.connections
        async with aiohttp.ClientSession() as session:
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await session.ws_connect(tunnel_url(s), headers={"Authorization": f"token {BROWSER_TOKEN}"})
        assert refused.value.status == 403
        assert sshd.connections == before
        assert "SSH tunnel: The hub's admin turned SSH off for this workstation." in s.log()
    finally:
        s.stop()


async def test_a_tunnel_to_an_sshd_that_does_not_listen_is_closed_with_a_sentence(tmp_path, fake_service):
    """(Right after a boot it would first wait sshd_boot_wait for sshd to start: not here.)"""
    import aiohttp
    port = free_port()  # nothing listens there
    s = Server(tmp_path, hub_env(fake_service.url), (f"--WorkstationGuest.sshd_port={port}",
                                                     "--WorkstationGuest.sshd_boot_wait=0"), base_url=BASE_URL)
    try:
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(tunnel_url(s), headers={"Authorization": f"token {BROWSER_TOKEN}"}) as ws:
                message = await ws.receive(timeout=10)
        assert message.type == aiohttp.WSMsgType.CLOSE and message.data == 1011
        assert message.extra.startswith(f"The workstation's sshd at 127.0.0.1:{port} does not answer (")
    finally:
        s.stop()


@pytest.mark.parametrize("forwarded, peer, shown", [
    ("10.0.0.5", "10.9.9.9", "10.0.0.5"),
    ("2001:db8::1, 10.1.1.1", "10.9.9.9", "2001:db8::1"),
    ("<script>alert(1)</script>", "10.9.9.9", "10.9.9.9"),  # the client writes the header: only an address is shown
    (None, "10.9.9.9", "10.9.9.9"),
    ("evil", "also evil", "an unknown address"),
])
def test_where_a_tunnel_comes_from_is_an_address_or_nothing(forwarded, peer, shown):
    from kubevirt_spawner.guest.sshd import client_address
    assert client_address(forwarded, peer) == shown


# ------------------------------------------------------------------------------------ VS Code
# In place of code-server (the golden image's; tests/e2e/test_qemu.py runs the real one): an HTTP
# server on the unix socket it is given, as code-server serves `--socket PATH`, that says how it
# was started and echoes on a websocket (VS Code's connection to its server is one).
STAND_IN_CODE_SERVER = """#!{python}
import json, os, sys
from aiohttp import web

args = sys.argv[1:]
socket_path = args[args.index("--socket") + 1]

async def page(request):
    if request.headers.get("Upgrade", "").lower() == "websocket":
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for message in ws:
            await ws.send_str("echo " + message.data)
        return ws
    return web.json_response({{"path": request.path_qs, "argv": args, "pid": os.getpid(),
                               "socket_mode": oct(os.stat(os.path.dirname(socket_path)).st_mode & 0o777)}})

app = web.Application()
app.router.add_route("*", "/{{tail:.*}}", page)
web.run_app(app, path=socket_path, print=None)
"""


@pytest.fixture(scope="module")
def vscode_server(tmp_path_factory, fake_service):
    tmp = tmp_path_factory.mktemp("guest-vscode")
    stand_in = tmp / "code-server"
    stand_in.write_text(STAND_IN_CODE_SERVER.format(python=sys.executable))
    stand_in.chmod(0o755)
    s = Server(tmp, hub_env(fake_service.url), (f"--WorkstationGuest.code_server={stand_in}",), base_url=BASE_URL)
    yield s
    s.stop()


def test_vscode_is_code_server_started_once_on_a_private_socket(vscode_server):
    """`vscode/` is jupyter-server-proxy's supervised process (jupyter_server_proxy/handlers.py,
    SuperviseAndProxyHandler; config.py, ServerProcess with unix_socket): code-server starts at
    the first request, on a unix socket in a directory only this server's user opens, without
    its own password, in the server's root directory, and later requests reach the same one."""
    info = vscode_server.request("GET", "workstation/api/info").json()
    assert info["vscode_url"] == BASE_URL + "vscode/"
    first = vscode_server.request("GET", "vscode/?folder=/home/alice")
    assert first.status_code == 200, first.text
    seen = first.json()
    assert seen["path"] == "/?folder=/home/alice"
    argv = seen["argv"]
    assert argv[argv.index("--auth") + 1] == "none" and "--disable-telemetry" in argv
    assert argv[-1] == str(vscode_server.log_path.parent)  # the server's root directory
    assert seen["socket_mode"] == "0o700"
    again = vscode_server.request("GET", "vscode/static/out/workbench.js").json()
    assert again["pid"] == seen["pid"] and again["path"] == "/static/out/workbench.js"
    assert "VS Code: /user/alice/gpu/vscode/ runs " in vscode_server.log()


async def test_vscodes_websocket_reaches_code_server(vscode_server):
    import aiohttp
    url = vscode_server.base.replace("http://", "ws://") + "vscode/stable-1/?reconnectionToken=x"
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(url, headers={"Authorization": f"token {BROWSER_TOKEN}"}) as ws:
            await ws.send_str("hello")
            assert await ws.receive_str(timeout=30) == "echo hello"


@pytest.mark.parametrize("upgrade", [False, True])
def test_vscode_without_the_servers_authentication_starts_nothing(tmp_path, fake_service, upgrade):
    """No token: a page request goes to the login page, a websocket is 403, and code-server is
    never started (the stand-in here records each start)."""
    record = tmp_path / "started"
    stand_in = tmp_path / "code-server"
    stand_in.write_text(f"#!/bin/sh\necho started >> {record}\n")
    stand_in.chmod(0o755)
    s = Server(tmp_path, hub_env(fake_service.url), (f"--WorkstationGuest.code_server={stand_in}",), base_url=BASE_URL)
    try:
        headers = {"Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Version": "13",
                   "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="} if upgrade else {}
        r = s.request("GET", "vscode/", token=None, headers=headers, allow_redirects=False)
        assert r.status_code == (403 if upgrade else 302), r.text
        if not upgrade:
            assert "/login" in r.headers["Location"]
        assert not record.exists()
    finally:
        s.stop()


def test_without_code_server_there_is_no_vscode(server):
    assert server.request("GET", "workstation/api/info").json()["vscode_url"] == ""
    assert server.request("GET", "vscode/").status_code == 404
    assert "VS Code: not offered" in server.log()


async def test_a_tunnel_opened_as_the_machine_boots_waits_for_sshd_to_listen(tmp_path, fake_service):
    """Jupyter is ready before sshd at a boot (the image's unit starts it early): a tunnel opened
    then (within sshd_boot_window of the boot) waits for
    sshd and carries the bytes once it listens."""
    import aiohttp
    port = free_port()
    s = Server(tmp_path, hub_env(fake_service.url), (f"--WorkstationGuest.sshd_port={port}",
                                                     "--WorkstationGuest.sshd_boot_wait=30",
                                                     "--WorkstationGuest.sshd_boot_window=1e9"), base_url=BASE_URL)
    try:
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(tunnel_url(s), headers={"Authorization": f"token {BROWSER_TOKEN}"}) as ws:
                await asyncio.sleep(2)  # sshd comes up late
                server = await asyncio.start_server(
                    lambda r, w: (w.write(b"SSH-2.0-late\r\n"), None)[1], "127.0.0.1", port)
                try:
                    message = await ws.receive(timeout=20)
                finally:
                    server.close()
        assert message.type == aiohttp.WSMsgType.BINARY and message.data.startswith(b"SSH-2.0-late"), message
    finally:
        s.stop()
