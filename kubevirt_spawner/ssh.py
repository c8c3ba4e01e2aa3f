"""`kubevirt-spawner login`, `tunnel`, `ssh` and `ssh-config`: SSH into a workstation through the hub.

The workstation's Jupyter server relays a websocket at `<server URL>sshd/` to the machine's sshd
(guest/sshd.py), for the server's owner only. This client opens that websocket with a JupyterHub
API token in the Authorization header (never in a URL), starts a stopped workstation through the
hub's REST API first (like `coder ssh`, with the hub's progress messages on stderr), and copies
stdin and stdout to it: OpenSSH's `ProxyCommand` form, which `ssh`, scp, rsync, sftp, git and VS
Code Remote-SSH use unchanged through `ssh-config`'s Host blocks.

The hub's URL and the token come from the flags, then $JUPYTERHUB_URL and $JUPYTERHUB_API_TOKEN,
then the file `login` writes (mode 0600; one readable by others is refused). What goes wrong is
one sentence and exit status 2.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import shutil
import stat
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TextIO
from urllib.parse import quote, urljoin, urlsplit

import aiohttp

from . import names

EXIT_REFUSED = 2
CONFIG_NAME = "kubevirt-spawner/hub.json"
HOST_PREFIX = "kubevirt."
CONNECT_TIMEOUT = 30.0
START_TIMEOUT = 900.0  # a first start clones a disk and boots a machine
HEARTBEAT = 30.0  # websocket pings: idle SSH sessions survive proxies and load balancers that drop quiet connections
REFUSAL_HEADER = "X-Workstation-Refusal"  # guest/sshd.py says why it refused a tunnel here
CLOSE_INTERNAL_ERROR = 1011  # RFC 6455: guest/sshd.py closes with it (and a sentence) when sshd does not answer


class ClientError(Exception):
    """What went wrong, in one sentence for the user; the command exits with EXIT_REFUSED."""


@dataclass(frozen=True)
class Login:
    url: str  # the hub's public URL, ending with / (what users open in a browser)
    token: str


def config_path(env: Mapping[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    base = env.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, CONFIG_NAME)


def hub_url(text: str) -> str:
    """The hub's base URL from what a user pastes: `https://hub.example.org`, `.../hub/home`,
    `.../user/alice/lab` all give `https://hub.example.org/` (a base_url prefix is kept)."""
    parts = urlsplit(text.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ClientError(f"{text!r} is not a hub URL; give the address you open JupyterHub at, "
                          "e.g. https://hub.example.org/.")
    path = parts.path
    for marker in ("/hub/", "/user/", "/services/"):
        if marker in path + "/":
            path = (path + "/")[: (path + "/").index(marker)]
            break
    return f"{parts.scheme}://{parts.netloc}{path.rstrip('/')}/"


def read_config(path: str) -> dict[str, str]:
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return {}
    if info.st_mode & 0o077:
        raise ClientError(f"{path} can be read by others (mode {stat.S_IMODE(info.st_mode):o}); run chmod 600 {path} "
                          "and make a new token on the hub's token page: this one may have been read.")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as err:
        raise ClientError(f"{path} cannot be read ({err}); run kubevirt-spawner login again.") from None
    if not isinstance(data, dict) or not all(isinstance(data.get(k, ""), str) for k in ("url", "token")):
        raise ClientError(f"{path} is not a kubevirt-spawner login; run kubevirt-spawner login again.")
    return data


def write_config(path: str, login: Login) -> None:
    """The hub's URL and token, mode 0600 from the first byte (never readable in between)."""
    replace_file(path, json.dumps({"url": login.url, "token": login.token}), 0o600)


def replace_file(path: str, text: str, mode: int) -> None:
    """Write `path` whole, with `mode` from its first byte (a reader sees the old file or the new one)."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    tmp = path + ".kubevirt-spawner.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def resolve_login(url: str | None, token: str | None, env: dict[str, str] | None = None) -> Login:
    env = dict(os.environ) if env is None else env
    saved = read_config(config_path(env))
    url = url or env.get("JUPYTERHUB_URL") or saved.get("url")
    if not url:
        raise ClientError("Say which hub: --hub-url URL, $JUPYTERHUB_URL, or kubevirt-spawner login --hub-url URL.")
    url = hub_url(url)
    token = token or env.get("JUPYTERHUB_API_TOKEN")
    if not token and saved.get("url") and hub_url(saved["url"]) == url:
        token = saved.get("token")
    if not token:
        raise ClientError(f"No token for {url}: make one on {url}hub/token and give it with kubevirt-spawner login, "
                          "$JUPYTERHUB_API_TOKEN or --token.")
    return Login(url, token)


def target(text: str | None, me: str) -> tuple[str, str]:
    """`alice` or `alice/gpu` (default: the token's own user's default server)."""
    if not text:
        return me, ""
    user, _, server = text.partition("/")
    if not user or (_ and not server) or "/" in server:
        raise ClientError(f"{text!r} names no workstation; write USER or USER/SERVER.")
    return user, server


def _sentence(text: object, limit: int = 300) -> str:
    """What the hub or a workstation said, fit for a terminal: no escapes, no page."""
    said = names.printable(text).strip()
    return said if len(said) <= limit else said[:limit] + "..."


def host_alias(user: str, server: str, prefix: str = HOST_PREFIX) -> str:
    """The Host name of a workstation in ~/.ssh/config: a safe slug whatever the user's name."""
    return prefix + names.workstation_slug(user, server)


# ------------------------------------------------------------------------------------------ the hub
class Hub:
    """The hub's REST API with one token."""

    def __init__(self, login: Login, session: aiohttp.ClientSession):
        self.login = login
        self.session = session

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"token {self.login.token}", "Accept": "application/json"}

    def api(self, path: str) -> str:
        return self.login.url + "hub/api/" + path

    async def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        return await self.request(method, self.api(path), body)

    async def request(self, method: str, url: str, body: Any = None) -> tuple[int, Any]:
        """A JSON request with the token to one of the hub's URLs (its API, a service's)."""
        try:
            async with self.session.request(method, url, headers=self.headers, json=body, allow_redirects=False,
                                            timeout=aiohttp.ClientTimeout(total=CONNECT_TIMEOUT)) as r:
                text = await r.text()
                status = r.status
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as err:
            raise ClientError(f"Cannot reach the hub at {self.login.url} ({_reason(err)}).") from None
        try:
            data = json.loads(text) if text else None
        except ValueError:
            data = None
        return status, data

    async def whoami(self) -> dict:
        status, data = await self.call("GET", "user")
        if status in (401, 403):
            raise ClientError(f"The hub at {self.login.url} refused the token ({status}): make a new one on "
                              f"{self.login.url}hub/token.")
        if status != 200 or not isinstance(data, dict) or not isinstance(data.get("name"), str):
            raise ClientError(f"{self.login.url} does not answer as a JupyterHub (GET hub/api/user: {status}); give "
                              "the address you open JupyterHub at.")
        return data

    async def user(self, user: str) -> dict:
        status, data = await self.call("GET", f"users/{quote(user, safe='')}?include_stopped_servers=1")
        if status == 404:
            raise ClientError(f"The hub shows this token no user {_sentence(user)} (there is none, or the token "
                              "may not see their servers).")
        if status == 403:
            raise ClientError(f"This token may not see {_sentence(user)}'s servers (it needs read:servers).")
        if status != 200 or not isinstance(data, dict):
            raise ClientError(f"The hub answered {status} for the user {_sentence(user)}: {_message(data)}")
        return data

    def server_path(self, user: str, server: str) -> str:
        who = quote(user, safe="")
        return f"users/{who}/servers/{quote(server, safe='')}" if server else f"users/{who}/server"

    async def start(self, user: str, server: str, options: dict) -> None:
        status, data = await self.call("POST", self.server_path(user, server), {"user_options": options})
        if status not in (201, 202):
            raise ClientError(f"The hub did not start {workstation_name(user, server)} ({status}): {_message(data)}")

    async def progress(self, user: str, server: str) -> AsyncIterator[dict]:
        """The hub's progress events of a pending start (its event stream), until ready or failed."""
        url = self.api(self.server_path(user, server) + "/progress")
        try:
            async with self.session.get(url, headers={**self.headers, "Accept": "text/event-stream"},
                                        timeout=aiohttp.ClientTimeout(total=START_TIMEOUT, sock_read=60)) as r:
                if r.status != 200:
                    return
                async for raw in r.content:
                    line = raw.decode("utf-8", "replace").strip()
                    if line.startswith("data:"):
                        with contextlib.suppress(ValueError):
                            event = json.loads(line[5:])
                            if isinstance(event, dict):
                                yield event
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as err:
            raise ClientError(f"Lost the hub's progress of {workstation_name(user, server)} "
                              f"({_reason(err)}).") from None


def _reason(err: BaseException) -> str:
    """Why a connection failed, in a few words (`connection refused`, `timed out`)."""
    if isinstance(err, asyncio.TimeoutError):
        return "timed out"
    cause = getattr(err, "os_error", None) or err
    if isinstance(cause, OSError) and (cause.errno or cause.strerror):
        return (os.strerror(cause.errno) if cause.errno else str(cause.strerror)).lower()
    return _sentence(cause) or type(err).__name__


def _message(data: Any) -> str:
    if isinstance(data, dict) and isinstance(data.get("message"), str):
        return _sentence(data["message"])
    return "no reason given."


def workstation_name(user: str, server: str) -> str:
    return f"{_sentence(user)}'s workstation" + (f" {_sentence(server)}" if server else "")


def server_url(login: Login, model: dict) -> str:
    """The server's own URL: with subdomains the hub gives a full one, else a path on the hub's host."""
    url = model.get("full_url") or model.get("url") or ""
    if not isinstance(url, str) or not url:
        raise ClientError("The hub gave no URL for the server.")
    return urljoin(login.url, url)


async def running_server(hub: Hub, user: str, server: str, start: bool, err: TextIO) -> str:
    """The URL of `user`'s server `server`, started first when it is stopped (unless `start` is
    False), with the hub's progress messages on `err`."""
    servers = (await hub.user(user)).get("servers") or {}
    model = servers.get(server)
    name = workstation_name(user, server)
    if not isinstance(model, dict):
        if server:
            raise ClientError(f"{_sentence(user)} has no server named {_sentence(server)}; start it once from the "
                              "hub's home page.")
        model = {}
    if model.get("ready"):
        return server_url(hub.login, model)
    if model.get("pending") not in (None, "spawn"):
        raise ClientError(f"{name} is {_sentence(model['pending'])}ing; try again in a minute.")
    if model.get("pending") is None:
        if not start:
            raise ClientError(f"{name} is stopped (--no-start); start it from the hub's home page or leave out --no-start.")
        print(f"Starting {name}...", file=err, flush=True)
        options = model.get("user_options")
        await hub.start(user, server, options if isinstance(options, dict) else {})
    async for event in hub.progress(user, server):
        if event.get("message"):
            print(f"  {_sentence(event['message'])}", file=err, flush=True)
        if event.get("failed"):
            raise ClientError(f"{name} did not start: {_sentence(event.get('message') or 'the hub gave no reason')}")
        if event.get("ready"):
            break
    model = ((await hub.user(user)).get("servers") or {}).get(server) or {}
    if not model.get("ready"):
        raise ClientError(f"{name} did not become ready; see the hub's home page.")
    return server_url(hub.login, model)


# --------------------------------------------------------------------------------------- the tunnel
async def open_tunnel(session: aiohttp.ClientSession, login: Login, url: str, name: str) -> aiohttp.ClientWebSocketResponse:
    tunnel = url.rstrip("/") + "/sshd/"
    try:
        return await session.ws_connect(tunnel, headers={"Authorization": f"token {login.token}"},
                                        heartbeat=HEARTBEAT, max_msg_size=0, autoping=True,
                                        timeout=aiohttp.ClientWSTimeout(ws_close=10))
    except aiohttp.WSServerHandshakeError as err:
        why = err.headers.get(REFUSAL_HEADER) if err.headers is not None else None
        if why:
            raise ClientError(_sentence(why)) from None
        if err.status in (401, 403):
            raise ClientError(f"{name} refused the tunnel ({err.status}): only its owner may open it.") from None
        if err.status == 404:
            raise ClientError(f"{name} has no SSH tunnel at {tunnel} (its golden image predates it); ask your hub "
                              "admin.") from None
        raise ClientError(f"{name} did not open the tunnel ({err.status}); it may be stopping: try again.") from None
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as err:
        raise ClientError(f"Cannot reach {name} at {tunnel} ({_reason(err)}).") from None


async def relay(ws: aiohttp.ClientWebSocketResponse, reader: asyncio.StreamReader,
                write: Callable[[bytes], Awaitable[None]]) -> None:
    """Copy `reader` to the websocket and the websocket to `write` until either side ends; a
    tunnel the workstation closes with a reason (its sshd does not answer) is a ClientError."""

    async def upstream() -> None:
        while data := await reader.read(65536):
            await ws.send_bytes(data)
        await ws.close()

    sending = asyncio.ensure_future(upstream())
    try:
        while True:
            message = await ws.receive()
            if message.type == aiohttp.WSMsgType.BINARY:
                await write(message.data)
            elif message.type == aiohttp.WSMsgType.TEXT:
                await write(message.data.encode())
            elif message.type == aiohttp.WSMsgType.CLOSE:
                if message.data == CLOSE_INTERNAL_ERROR:  # the workstation's own sentence (guest/sshd.py)
                    raise ClientError(_sentence(message.extra or "The workstation closed the tunnel."))
                break
            elif message.type == aiohttp.WSMsgType.ERROR:
                raise ClientError(f"The tunnel broke ({_sentence(ws.exception())}).")
            else:  # CLOSING, CLOSED: this side closed it (stdin ended)
                break
    finally:
        sending.cancel()
        with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError, ConnectionError):
            await sending


async def stdio() -> tuple[asyncio.StreamReader, Callable[[bytes], Awaitable[None]]]:
    """stdin as a stream and a writer to stdout (OpenSSH's ProxyCommand gives pipes or sockets)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=2**20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin.buffer)
    out = sys.stdout.buffer

    async def write(data: bytes) -> None:
        await loop.run_in_executor(None, _write_all, out, data)

    return reader, write


def _write_all(out: Any, data: bytes) -> None:
    out.write(data)
    out.flush()


async def tunnel(login: Login, spec: str | None, start: bool, err: TextIO) -> int:
    async with aiohttp.ClientSession() as session:
        hub = Hub(login, session)
        me = (await hub.whoami())["name"]
        user, server = target(spec, me)
        url = await running_server(hub, user, server, start, err)
        ws = await open_tunnel(session, login, url, workstation_name(user, server))
        reader, write = await stdio()
        await relay(ws, reader, write)
    return 0


# ------------------------------------------------------------------------------------ ssh and config
def own_command() -> list[str]:
    """How OpenSSH runs this command again (as ProxyCommand)."""
    exe = shutil.which("kubevirt-spawner")
    return [exe] if exe else [sys.executable, "-m", "kubevirt_spawner.cli"]


def proxy_command(url: str, spec: str, start: bool = True) -> str:
    """OpenSSH's ProxyCommand for a workstation: shell-quoted, and with `%` doubled (ssh expands
    its %-tokens in ProxyCommand, and a user name may hold a %)."""
    words = [*own_command(), "tunnel", spec, "--hub-url", url] + ([] if start else ["--no-start"])
    return shlex.join(words).replace("%", "%%")


# OpenSSH's options that take a value (ssh.c's getopt string), to tell its options from its command.
SSH_VALUE_OPTIONS = frozenset("bceilmopBDEFIJLOPQRSWw")


def split_ssh_args(args: list[str]) -> tuple[list[str], list[str]]:
    """What follows `kubevirt-spawner ssh ... --`: OpenSSH's own options, then the command to run
    there (ssh(1): ssh [options] destination [command]); the host goes between them."""
    i = 0
    while i < len(args) and args[i].startswith("-") and args[i] != "-":
        if args[i] == "--":
            return args[:i], args[i + 1:]
        letters = args[i][1:]
        for j, letter in enumerate(letters):  # (a cluster such as -vvN; a value ends it)
            if letter in SSH_VALUE_OPTIONS:
                i += 1 if j == len(letters) - 1 else 0  # (its value is the next word, or the cluster's rest)
                break
        i += 1
    return args[:i], args[i:]


def linux_user(hub_user: str) -> str:
    from .guest.launch import linux_name  # the account the golden image's unit makes for the user
    return linux_name(hub_user)


def host_block(url: str, user: str, server: str, prefix: str = HOST_PREFIX) -> str:
    spec = f"{user}/{server}" if server else user
    alias = host_alias(user, server, prefix)
    host = urlsplit(url).hostname or "hub"
    return "\n".join([
        f"Host {alias}",
        f"  User {linux_user(user)}",
        f"  ProxyCommand {proxy_command(url, spec)}",
        # known_hosts keys the workstation, not the hub: each has its own host keys
        f"  HostKeyAlias {alias}.{host}",
        "",
    ])


def marker(url: str, end: bool = False) -> str:
    return f"# --- {'end' if end else 'start'} of kubevirt-spawner's workstations on {url} ---"


def config_block(url: str, servers: list[tuple[str, str]], prefix: str = HOST_PREFIX) -> str:
    lines = [marker(url), "# written by `kubevirt-spawner ssh-config --write`, which replaces this block; "
                          "the token stays in kubevirt-spawner's own login file", ""]
    lines += [host_block(url, user, server, prefix) for user, server in servers]
    return "\n".join(lines) + marker(url, end=True) + "\n"


def replace_block(text: str, url: str, block: str) -> str:
    """`text` (an ~/.ssh/config) with this hub's block replaced, or added at the end."""
    start, end = marker(url), marker(url, end=True)
    if start in text and end in text.split(start, 1)[1]:
        before, rest = text.split(start, 1)
        after = rest.split(end, 1)[1].lstrip("\n")
        return before + block + after
    return text + ("\n" if text and not text.endswith("\n") else "") + ("\n" if text else "") + block


def write_ssh_config(path: str, url: str, block: str) -> None:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        mode = stat.S_IMODE(os.stat(path).st_mode)  # (the user's own mode is kept)
    except FileNotFoundError:
        text, mode = "", 0o600
    replace_file(path, replace_block(text, url, block), mode)


async def workstations(login: Login) -> list[tuple[str, str]]:
    """The token's user's servers (default first, then by name), stopped ones too."""
    async with aiohttp.ClientSession() as session:
        hub = Hub(login, session)
        me = (await hub.whoami())["name"]
        servers = (await hub.user(me)).get("servers") or {}
    return [(me, "")] + [(me, name) for name in sorted(servers) if name]


async def check_login(login: Login) -> str:
    async with aiohttp.ClientSession() as session:
        return (await Hub(login, session).whoami())["name"]
