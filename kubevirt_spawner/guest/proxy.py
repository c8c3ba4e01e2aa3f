"""The workstation panel's API inside the guest: `<base_url>workstation/api/...` on this Jupyter
server, forwarded to the hub's workstations service with this server's own hub token.

The browser never talks to the service itself: its cookies and headers stay here, and the service
sees the server's token, which may act only on this server's own workstation.

Routes (under the server's base_url):
    GET         workstation/api/info                 answered here: who this server is, the rescue page, VS Code
    GET         workstation/api/status               -> <service>api/v1/workstations/<user>[/servers/<server>]
    GET, POST   workstation/api/snapshots            -> .../snapshots
    DELETE      workstation/api/snapshots/<name>     -> .../snapshots/<name>
    POST        workstation/api/<action>             -> .../<action>, action: restore, reset, stop, keepalive
Any other path is 404 here and never forwarded (e.g. `purge`, which only an admin may do).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join
from tornado import web
from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest
from traitlets import Bool, Float, Integer, Unicode, default
from traitlets.config import LoggingConfigurable

if TYPE_CHECKING:
    from jupyter_server.serverapp import ServerApp

# The hub-side service's name (kubevirt_spawner.service), repeated here: the guest imports none of it.
SERVICE_NAME = "workstations"
# What the panel may ask for; the service's other actions (purge) are not the panel's business.
ACTIONS = frozenset({"snapshots", "restore", "reset", "stop", "keepalive"})

NOT_CONFIGURED = ("This server was not started by a JupyterHub with the workstations service, "
                  "so the workstation panel cannot reach it.")


class WorkstationGuest(LoggingConfigurable):
    """Where the workstations service is and who this server is (`c.WorkstationGuest.*`)."""

    service_url = Unicode(
        help="The workstations service's URL (ends with /services/workstations/). "
             "Default: $KUBEVIRT_WORKSTATIONS_URL, set by the spawner.",
    ).tag(config=True)

    request_timeout = Float(30.0, help="Seconds to wait for the workstations service's answer.").tag(config=True)

    # Who this server is: given by the hub that started it, so not configurable.
    user = Unicode()
    server_name = Unicode()
    api_token = Unicode()
    hub_base_url = Unicode()
    service_page_url = Unicode()  # the service's own public URL, when it has a host of its own

    ssh_enabled = Bool(help="Whether `sshd/` tunnels to this machine's sshd. Default: "
                            "$KUBEVIRT_SSH_ENABLED (set by the spawner from c.KubeVirtSpawner.ssh_enabled), "
                            "else on.").tag(config=True)
    sshd_host = Unicode("127.0.0.1", help="Where this machine's sshd listens.").tag(config=True)
    sshd_port = Integer(22, min=1, max=65535, help="The port of this machine's sshd.").tag(config=True)
    sshd_boot_wait = Float(60.0, min=0.0, help="Seconds an SSH tunnel opened in the first minutes after a boot waits "
                                               "for sshd to listen (it starts after Jupyter).").tag(config=True)
    sshd_boot_window = Float(300.0, min=0.0, help="Seconds after a boot in which sshd may still be starting "
                                                  "(sshd_boot_wait applies).").tag(config=True)

    code_server = Unicode(help="The code-server command behind `vscode/` (VS Code in the browser); empty: "
                               "VS Code is not offered. Default: code-server on PATH (the golden image's "
                               "/usr/local/bin/code-server), else empty.").tag(config=True)
    code_server_timeout = Float(120.0, help="Seconds code-server may take to answer after it is started "
                                            "(its first start on a slow machine takes tens of seconds).").tag(config=True)

    @default("code_server")
    def _default_code_server(self) -> str:
        return shutil.which("code-server") or ""

    @default("ssh_enabled")
    def _default_ssh_enabled(self) -> bool:
        return os.environ.get("KUBEVIRT_SSH_ENABLED", "1") != "0"

    @default("service_url")
    def _default_service_url(self) -> str:
        return os.environ.get("KUBEVIRT_WORKSTATIONS_URL", "")

    @default("user")
    def _default_user(self) -> str:
        return os.environ.get("JUPYTERHUB_USER", "")

    @default("server_name")
    def _default_server_name(self) -> str:
        return os.environ.get("JUPYTERHUB_SERVER_NAME", "")  # empty: the user's default server

    @default("api_token")
    def _default_api_token(self) -> str:
        return os.environ.get("JUPYTERHUB_API_TOKEN", "")

    @default("service_page_url")
    def _default_service_page_url(self) -> str:
        return os.environ.get("KUBEVIRT_WORKSTATIONS_PAGE", "")  # (set by the spawner)

    @default("hub_base_url")
    def _default_hub_base_url(self) -> str:
        return os.environ.get("JUPYTERHUB_BASE_URL") or "/"

    @property
    def configured(self) -> bool:
        return bool(self.service_url and self.user and self.api_token)

    def workstation(self) -> str:
        """`<user>[/servers/<server>]`, as the service's URLs name this server's workstation."""
        path = quote(self.user, safe="")
        if self.server_name:
            path += "/servers/" + quote(self.server_name, safe="")
        return path

    @property
    def service_page(self) -> str:
        """The service's public rescue page of this workstation (works while it is down, too). With
        subdomains the service has a host of its own (which the spawner passes): a path alone
        would stay on this server's host, where the proxy routes nothing of the service's."""
        if self.service_page_url:
            return url_path_join(self.service_page_url, "workstation", self.workstation())
        return url_path_join(self.hub_base_url, "services", SERVICE_NAME, "workstation", self.workstation())

    @property
    def ssh_keys_page(self) -> str:
        """Where the user manages their SSH keys (the service's page of all their workstations):
        the owner's own login there, since this server's token may not change them."""
        base = self.service_page_url or url_path_join(self.hub_base_url, "services", SERVICE_NAME)
        return base.rstrip("/") + "/#ssh-keys"

    @property
    def vscode_url(self) -> str:
        """Where VS Code in the browser is (guest.vscode), or "" when it is not offered."""
        if not self.code_server:
            return ""
        base = self.parent.base_url if self.parent is not None else "/"
        return url_path_join(base, "vscode") + "/"

    def api_url(self, path: str) -> str:
        return self.service_url.rstrip("/") + "/api/v1/workstations/" + self.workstation() + path


def service_path(rest: str) -> str | None:
    """The path below the workstation on the service for the panel's `workstation/api/<rest>`,
    or None when it is not forwarded. `rest` is decoded by tornado, so each part is quoted again."""
    parts = rest.removesuffix("/").split("/")
    if parts == ["status"]:
        return ""
    named = len(parts) == 2 and parts[0] == "snapshots"  # only a snapshot is named below its action
    if parts[0] in ACTIONS and (len(parts) == 1 or named) and parts[-1] not in ("", ".", ".."):
        return "".join("/" + quote(part, safe="") for part in parts)
    return None


def short_reason(err: Exception) -> str:
    """`connection refused`, `timeout during request`, ...: why the service did not answer."""
    if isinstance(err, HTTPClientError):
        reason = err.message or ""
    else:
        reason = getattr(err, "strerror", None) or str(err)
    reason = reason or type(err).__name__
    return reason[:1].lower() + reason[1:]


def owner_refusal(current_user: Any, owner: str, what: str, instead: str = "") -> str | None:
    """Under JupyterHub, whoever else may open this server (an admin, a user it is shared with)
    is not its owner: they do not act on the machine as the owner. None when the caller is the
    owner; else the sentence that refuses them."""
    hub_user = getattr(current_user, "hub_user", None)
    if not isinstance(hub_user, dict):
        return None  # not under JupyterHub: only this server's own token gets here
    if hub_user.get("kind", "user") == "user" and hub_user.get("name") == owner:
        return None
    who = hub_user.get("name") or "this caller"
    return f"Only {owner} can {what}, not {who};{instead}" if instead else f"Only {owner} can {what}, not {who}."


class GuestHandler(APIHandler):
    """Jupyter's own authentication (under JupyterHub: the hub's, for those with access to this
    server) and XSRF check for POST/DELETE; errors are `{"error": "<one sentence>"}` like the service's."""

    auth_resource = "workstation"

    def initialize(self, guest: WorkstationGuest) -> None:
        self.guest = guest
        # The panel polls (GET) while it is open: that is not the user's activity, or an idle
        # server with the panel open would never be culled. A POST or DELETE is the user acting.
        self._track_activity = self.request.method != "GET"

    def reply(self, status: int, data: dict[str, Any]) -> None:
        self.set_status(status)
        self.finish(json.dumps(data))

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        message = (exc.log_message if isinstance(exc, web.HTTPError) else None) or self._reason
        self.finish(json.dumps({"error": message}))


class InfoHandler(GuestHandler):
    @web.authenticated
    @authorized
    def get(self) -> None:
        guest = self.guest
        self.finish(json.dumps({"user": guest.user, "server": guest.server_name,
                                "service_page": guest.service_page, "ssh_keys_page": guest.ssh_keys_page,
                                "configured": guest.configured, "vscode_url": guest.vscode_url}))


class ProxyHandler(GuestHandler):
    @web.authenticated
    @authorized
    async def get(self, rest: str) -> None:
        await self.forward(rest)

    @web.authenticated
    @authorized
    async def post(self, rest: str) -> None:
        await self.forward(rest)

    @web.authenticated
    @authorized
    async def delete(self, rest: str) -> None:
        await self.forward(rest)

    async def forward(self, rest: str) -> None:
        path = service_path(rest)
        if path is None:
            return self.reply(404, {"error": f"The workstation panel has no action {rest!r}."})
        guest = self.guest
        method = self.request.method or "GET"
        refused = owner_refusal(self.current_user, guest.user, "use this workstation's panel",
                                " an admin acts on it through the workstations service's page.")
        if refused:
            return self.reply(403, {"error": refused})
        if not guest.configured:
            guest.log.warning("Workstation panel: %s %s not forwarded: %s", method, rest, NOT_CONFIGURED)
            return self.reply(503, {"error": NOT_CONFIGURED})
        url = guest.api_url(path)
        # Only the server's own token: the browser's cookies and Authorization header stay here.
        headers = {"Authorization": f"token {guest.api_token}", "Accept": "application/json"}
        body = None
        if method == "POST":
            body = self.request.body
            headers["Content-Type"] = "application/json"
        request = HTTPRequest(url, method=method, headers=headers, body=body,
                              connect_timeout=guest.request_timeout, request_timeout=guest.request_timeout,
                              # a redirect would carry the token elsewhere; the service's API never redirects
                              follow_redirects=False)
        try:
            response = await AsyncHTTPClient().fetch(request, raise_error=False)
        except (OSError, HTTPClientError) as err:  # refused, DNS, timeout, reset
            reason = short_reason(err)
            guest.log.warning("Workstation panel: %s %s: the workstations service does not answer: %s",
                              method, url, reason)
            return self.reply(503, {"error": f"The workstations service does not answer ({reason}); "
                                             "try again in a minute, or ask your hub admin."})
        try:
            json.loads(response.body)
        except ValueError:
            guest.log.warning("Workstation panel: %s %s: the workstations service answered %s without JSON",
                              method, url, response.code)
            return self.reply(502, {"error": f"The workstations service answered {response.code} without JSON; "
                                             "ask your hub admin."})
        # The service's status and sentence are the panel's to show, unchanged.
        self.set_status(response.code, response.reason)
        self.finish(response.body)


class ActivityReporter:
    """Tells the workstations service why this machine counts as busy (what the activity sampler
    found), with the server's own token; a failure is logged once until the next success."""

    def __init__(self, guest: WorkstationGuest):
        self.guest = guest
        self._failing = ""

    async def __call__(self, reasons: list[dict[str, Any]], every: float) -> None:
        guest = self.guest
        if not guest.configured:
            return
        request = HTTPRequest(guest.api_url("/activity"), method="POST", body=json.dumps({"sources": reasons, "every": every}),
                              headers={"Authorization": f"token {guest.api_token}", "Content-Type": "application/json"},
                              connect_timeout=guest.request_timeout, request_timeout=guest.request_timeout,
                              follow_redirects=False)
        try:
            response = await AsyncHTTPClient().fetch(request, raise_error=False)
            problem = "" if response.code < 300 else f"the service answered {response.code}"
        except (OSError, HTTPClientError) as err:
            problem = f"the service does not answer ({short_reason(err)})"
        if problem and problem != self._failing:
            guest.log.warning("Workstation activity: not reported: %s", problem)
        self._failing = problem


def setup_handlers(serverapp: ServerApp) -> WorkstationGuest:
    guest = WorkstationGuest(parent=serverapp)  # parent: c.WorkstationGuest.* applies, logs go to the server's log
    base = serverapp.web_app.settings["base_url"]
    args = {"guest": guest}
    serverapp.web_app.add_handlers(".*$", [
        (url_path_join(base, "workstation/api/info"), InfoHandler, args),
        (url_path_join(base, "workstation/api/(.*)"), ProxyHandler, args),
    ])
    if guest.configured:
        serverapp.log.info("Workstation panel: forwarding to %s for %s", guest.service_url, guest.workstation())
    else:
        serverapp.log.warning("Workstation panel: %s", NOT_CONFIGURED)
    return guest
