"""The SSH tunnel: `<base_url>sshd/` on this Jupyter server, a websocket whose binary messages are
the bytes of one TCP connection to this machine's sshd (127.0.0.1:22).

It is how `kubevirt-spawner ssh`/`tunnel` (and so OpenSSH's ProxyCommand, VS Code Remote-SSH, scp,
rsync) reach the workstation: through the hub's proxy and Jupyter's own authentication, like every
request to the server, so no port of the VM is open to anyone but the hub and the proxy.

The relay is jupyter-server-proxy's raw socket proxy (`jupyter_server_proxy.rawsocket`, the one
jupyter-sshd-proxy builds on): its handler refuses a websocket without an authenticated user (403,
under JupyterHub: a token or cookie with `access:servers` for this server) and copies each
message to the stream and back. On top of it this handler:
- lets only the server's owner in (an admin or a user the server is shared with may open the
  server, but the machine's SSH is its owner's), and nobody when the hub turned SSH off;
- reaches the configured sshd only (`c.WorkstationGuest.sshd_host`, `sshd_port`), never a port
  named by the request;
- keeps the open tunnels in the web application's settings (`TUNNELS_KEY`: where from, since when)
  for the activity sampler: an open tunnel is someone working (a VS Code Remote window sends
  nothing for minutes), and the workstations service names it.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import re
import time
from typing import TYPE_CHECKING, Any

from jupyter_server.utils import url_path_join
from jupyter_server_proxy.rawsocket import RawSocketHandler
from tornado import web

from .activity import TUNNELS_KEY
from .proxy import owner_refusal

if TYPE_CHECKING:
    from jupyter_server.serverapp import ServerApp

    from .proxy import WorkstationGuest

SSH_OFF = "The hub's admin turned SSH off for this workstation."
# A refusal's sentence, for the client (kubevirt-spawner tunnel): a websocket client sees no page.
REFUSAL_HEADER = "X-Workstation-Refusal"
# RFC 6455 close code 1011: the server met a condition that kept it from completing the request.
CLOSE_INTERNAL_ERROR = 1011




def seconds_since_boot() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def client_address(forwarded_for: str | None, remote_ip: str | None) -> str:
    """Where the tunnel comes from, for the user's own status line: the first address of
    configurable-http-proxy's X-Forwarded-For (the client as the proxy saw it), else the peer.
    Only an IP address is kept: the header is the client's to write, and this text is shown."""
    for candidate in ((forwarded_for or "").split(",")[0].strip(), remote_ip or ""):
        try:
            return str(ipaddress.ip_address(candidate))
        except ValueError:
            continue
    return "an unknown address"


class SshTunnelHandler(RawSocketHandler):
    name = "sshd"

    def initialize(self, guest: WorkstationGuest) -> None:
        self.guest = guest
        self.port = guest.sshd_port
        self._tunnel_id: int | None = None

    async def prepare(self, *args: Any, **kwargs: Any) -> None:
        await super().prepare(*args, **kwargs)  # Jupyter's authentication: 403 without a user
        if not self.guest.ssh_enabled:
            raise web.HTTPError(403, SSH_OFF)
        refused = owner_refusal(self.current_user, self.guest.user, "open this workstation's SSH tunnel")
        if refused:
            raise web.HTTPError(403, refused)

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        said = exc.log_message if isinstance(exc, web.HTTPError) else None
        if said:  # (this handler's sentences; Jupyter's own 403 has none)
            # a header carries Latin-1 only, and no line breaks (an owner's name may hold anything)
            self.set_header(REFUSAL_HEADER, re.sub(r"[\x00-\x1f\x7f]", " ", said.encode("ascii", "backslashreplace").decode()))
        message = said or self._reason
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps({"error": message}))

    def _create_ws_connection(self, proto):  # the one sshd this server is configured with
        return asyncio.get_running_loop().create_connection(proto, self.guest.sshd_host, self.guest.sshd_port)

    async def proxy_open(self, host: str, port: int, proxied_path: str = "") -> None:
        where = f"{self.guest.sshd_host}:{self.guest.sshd_port}"
        # Jupyter is up early in a boot, sshd after the network and cloud-init: a tunnel opened
        # as the machine becomes ready (`kubevirt-spawner ssh` starting it) waits for sshd.
        waits = self.guest.sshd_boot_wait if seconds_since_boot() < self.guest.sshd_boot_window else 0.0
        deadline = time.monotonic() + waits
        while True:
            try:
                await super().proxy_open(host, port, proxied_path)
                break
            except OSError as err:
                if isinstance(err, ConnectionRefusedError) and time.monotonic() < deadline:
                    await asyncio.sleep(1.0)
                    continue
                reason = err.strerror or str(err)
                self.log.warning("SSH tunnel: sshd at %s does not answer: %s", where, reason)
                self.close(CLOSE_INTERNAL_ERROR, f"The workstation's sshd at {where} does not answer ({reason}).")
                return
        self._tunnel_id = id(self)
        tunnel = {"from": client_address(self.request.headers.get("X-Forwarded-For"), self.request.remote_ip),
                  "since": time.time()}
        self.settings.setdefault(TUNNELS_KEY, {})[self._tunnel_id] = tunnel
        self.log.info("SSH tunnel from %s opened", tunnel["from"])

    def on_close(self) -> None:
        super().on_close()
        if self._tunnel_id is not None:
            tunnel = self.settings.get(TUNNELS_KEY, {}).pop(self._tunnel_id, None)
            self._tunnel_id = None
            if tunnel:
                self.log.info("SSH tunnel from %s closed after %.0f s", tunnel["from"], time.time() - tunnel["since"])


def setup_handlers(serverapp: ServerApp, guest: WorkstationGuest) -> None:
    base = serverapp.web_app.settings["base_url"]
    serverapp.web_app.add_handlers(".*$", [(url_path_join(base, "sshd") + "(/?)", SshTunnelHandler, {"guest": guest})])
    if guest.ssh_enabled:
        serverapp.log.info("SSH tunnel: %ssshd/ reaches %s:%d", base, guest.sshd_host, guest.sshd_port)
    else:
        serverapp.log.info("SSH tunnel: %s", SSH_OFF)
