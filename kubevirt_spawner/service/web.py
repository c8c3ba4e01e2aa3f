"""The workstations service over HTTP: the REST API (tokens or the OAuth cookie), the rescue page
(OAuth login, XSRF-protected forms) and Prometheus metrics. Requests are translated into calls
of `core.Workstations`; nothing here decides anything about a workstation.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
from collections.abc import Callable
from datetime import datetime, timezone
from urllib.parse import quote

import jinja2
from jupyterhub.services.auth import HubOAuth, HubOAuthCallbackHandler, HubOAuthenticated, UserNotAllowed
from prometheus_client import generate_latest
from tornado import web
from traitlets import default
from traitlets.config import Application
from traitlets.config.loader import PyFileConfigLoader

from .. import kube as k
from ..workstation import WorkstationError
from . import CONFIG_ENV, SERVICE_NAME
from .access import Caller, ServiceError, cluster_refusal, workstation_path
from .core import Workstations
from .hub import Hub
from .metering import csv_report, month_of, previous_month

TEMPLATES = jinja2.Environment(loader=jinja2.PackageLoader("kubevirt_spawner.service", "templates"),
                               autoescape=True)
API_ACTIONS = ("snapshots", "restore", "reset", "stop", "keepalive", "purge", "activity")
# No request of the API or the page needs more (a note is 500 characters, a report 20 of 300): a
# larger body is refused with a sentence, and one beyond the server's own bound is not read at all.
MAX_BODY_BYTES = 64 * 1024
MAX_READ_BYTES = 1024 * 1024


class Base(HubOAuthenticated, web.RequestHandler):
    def initialize(self, core: Workstations):
        self.core = core

    @property
    def hub_auth(self):
        return self.settings["hub_auth"]

    def caller(self) -> Caller:
        """Who asks, or ServiceError 401 (nobody, or a token the hub does not know) / 403 (a token
        without access to this service). An admin acts as one through a browser session, or with a
        token that carries admin rights (`admin:servers`); never through a server's token."""
        model = self.hub_auth.get_user(self)
        if not model:
            raise ServiceError(401, "Log in to JupyterHub, or send a JupyterHub token (Authorization: token ...).")
        try:
            self.check_hub_user(model)
        except UserNotAllowed:
            raise ServiceError(403, f"This token may not use the {SERVICE_NAME} service; it needs the scope "
                                    f"access:services!service={SERVICE_NAME}.") from None
        scopes = set(model.get("scopes") or [])
        # A token (in a header or in the URL, as HubAuth takes it) carries its own scopes; only the
        # hub's browser session (the OAuth cookie) stands for the user with all their rights.
        by_token = bool(getattr(self, "_token_authenticated", False))
        admin = bool(model.get("admin")) and (not by_token or "admin:servers" in scopes)
        metrics = "read:metrics" in scopes
        if model.get("kind") == "service":
            return Caller(f"service:{model['name']}", "admin:servers" in scopes, reads_metrics=metrics)
        return Caller(model["name"], admin, _own_servers(model["name"], scopes) if by_token else None,
                      reads_metrics=metrics)

    def body(self) -> dict:
        if not self.request.body:
            return {}
        if len(self.request.body) > MAX_BODY_BYTES:
            raise ServiceError(413, f"The request body is larger than {MAX_BODY_BYTES // 1024} KiB.")
        try:
            data = json.loads(self.request.body)
        except ValueError:
            raise ServiceError(400, "The request body is not JSON.") from None
        if not isinstance(data, dict):
            raise ServiceError(400, "The request body must be a JSON object.")
        return data


def _own_servers(user: str, scopes: set[str]) -> frozenset[str] | None:
    """The servers ("user/server") a server's own token stands for (JupyterHub gives it access to
    that one server only); None for a token with access to all the user's servers."""
    broad = {"access:servers", f"access:servers!user={user}", "servers", f"servers!user={user}", "admin:servers"}
    own = {scope.split("=", 1)[1] for scope in scopes if scope.startswith("access:servers!server=")}
    return frozenset(own) if own and not broad & scopes else None


class Api(Base):
    """JSON in and out; errors are {"error": "<one sentence>"}."""

    def _cluster_refusal(self, err: k.KubeError) -> ServiceError:
        self.core.log.warning("%s %s: the cluster refused: %s", self.request.method, self.request.path, err)
        return cluster_refusal(err)

    def write_json(self, data, status: int = 200):
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(data))

    def write_error(self, status_code: int, **kwargs):
        exc = kwargs.get("exc_info", (None, None))[1]
        message = self._reason if not isinstance(exc, web.HTTPError) else (exc.log_message or self._reason)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps({"error": message}))

    async def run(self, work, status: int | Callable[[dict], int] = 200):
        try:
            result = await work
        except ServiceError as err:
            return self.write_json({"error": err.message}, err.status)
        except WorkstationError as err:
            return self.write_json({"error": err.jupyterhub_message}, err.status_code)
        except k.KubeError as err:  # what no step turned into a sentence: the cause in words, the rest logged
            refusal = self._cluster_refusal(err)
            return self.write_json({"error": refusal.message}, refusal.status)
        result = result if result is not None else {}
        self.write_json(result, status(result) if callable(status) else status)


class WorkstationsApi(Api):
    async def get(self):
        async def work():
            caller = self.caller()
            return {"workstations": await self.core.list_workstations(caller, self.get_argument("user", None))}
        await self.run(work())


class CapacityApi(Api):
    async def get(self):
        async def work():
            return self.core.capacity(self.caller())
        await self.run(work())


class DrainApi(Api):
    """/api/v1/drains/NODE: GET what still runs there; POST {"dry_run", "reason"} warns and stops
    every workstation on it after the grace (admins only)."""

    async def get(self, node):
        async def work():
            return self.core.drains.node_state(self.caller(), node)
        await self.run(work())

    async def post(self, node):
        async def work():
            body = self.body()
            return await self.core.drains.drain_node(self.caller(), node, body.get("dry_run", False),
                                                     body.get("reason"))
        await self.run(work())


class CostsApi(Api):
    """/api/v1/costs?month=YYYY-MM&by=user|profile|workstation&format=json|csv (admins): each
    group's units and cost in the month (default: this one)."""

    async def get(self):
        async def work():
            if not self.caller().admin:
                raise ServiceError(403, "Only administrators see the cost reports.")
            try:
                return await self.core.meter.report(self.get_argument("month", None), self.get_argument("by", "user"))
            except ValueError as err:
                raise ServiceError(400, str(err)) from None
        fmt = self.get_argument("format", "json")
        if fmt not in ("json", "csv"):
            return self.write_json({"error": 'A report\'s "format" is json or csv.'}, 400)
        if fmt == "json":
            return await self.run(work())
        try:
            view = await work()
        except ServiceError as err:
            return self.write_json({"error": err.message}, err.status)
        self.set_header("Content-Type", "text/csv; charset=utf-8")
        self.set_header("Content-Disposition", f'attachment; filename="workstations-{view["month"]}-{view["by"]}.csv"')
        self.finish(csv_report(view))


class WorkstationApi(Api):
    """/api/v1/workstations/USER[/servers/SERVER][/ACTION[/NAME]]"""

    async def get(self, user, server, action, name):
        async def work():
            caller = self.caller()
            if action is None and name is None:
                return await self.core.describe(await self.core.existing(caller, user, server or ""))
            if action == "snapshots" and name is None:
                return {"snapshots": await self.core.snapshots(caller, user, server or "")}
            raise ServiceError(405, "Use POST for this action.")
        await self.run(work())

    async def post(self, user, server, action, name):
        async def work():
            caller = self.caller()
            body = self.body()
            srv = server or ""
            if action == "snapshots" and name is None:
                return await self.core.take_snapshot(caller, user, srv, body.get("name"), body.get("note"))
            if name is not None or action is None:
                raise ServiceError(404, "No such endpoint.")
            if action == "restore":
                return await self.core.restore(caller, user, srv, body.get("snapshot"), body.get("confirm"))
            if action == "reset":
                return await self.core.reset(caller, user, srv, body.get("confirm"))
            if action == "stop":
                return await self.core.stop(caller, user, srv, body.get("wait", True))
            if action == "activity":
                return await self.core.report_activity(caller, user, srv, body.get("sources"), body.get("every"))
            if action == "keepalive":
                return await self.core.keepalive(caller, user, srv, body.get("minutes"))
            if action == "purge":
                return await self.core.purge(caller, user, srv, body.get("confirm"))
            raise ServiceError(404, "No such endpoint.")
        def status(result: dict) -> int:  # 202: under way in the background
            if action in ("restore", "reset") or result.get("stopping"):
                return 202
            return 201 if action == "snapshots" else 200
        await self.run(work(), status)

    async def delete(self, user, server, action, name):
        async def work():
            caller = self.caller()
            if action != "snapshots" or not name:
                raise ServiceError(405, "Only snapshots can be deleted.")
            await self.core.delete_snapshot(caller, user, server or "", name)
            return {"deleted": name}
        await self.run(work())


class SshKeysApi(Api):
    """/api/v1/users/USER/ssh-keys[/FINGERPRINT] (the fingerprint as ssh-keygen -l prints it,
    URL-encoded: it holds / and +)."""

    async def get(self, user, fingerprint):
        async def work():
            if fingerprint:
                raise ServiceError(405, "Use GET on the list of keys; DELETE removes one.")
            return await self.core.ssh_keys(self.caller(), user)
        await self.run(work())

    async def post(self, user, fingerprint):
        async def work():
            caller = self.caller()
            if fingerprint:
                raise ServiceError(404, "No such endpoint.")
            return await self.core.add_ssh_key(caller, user, self.body().get("key"))
        await self.run(work(), 201)

    async def delete(self, user, fingerprint):
        async def work():
            caller = self.caller()
            if not fingerprint:
                raise ServiceError(405, "Name the key to delete by its fingerprint.")
            return await self.core.delete_ssh_key(caller, user, fingerprint)
        await self.run(work())


class NotFoundApi(Api):
    async def get(self, *args):
        self.write_json({"error": "No such endpoint."}, 404)

    post = delete = put = patch = get


class Metrics(Api):
    async def get(self):
        async def work():
            caller = self.caller()
            if not (caller.admin or caller.reads_metrics):
                raise ServiceError(403, "Only administrators and tokens with the scope read:metrics read the metrics.")
            self.core.refresh_metrics()
            await self.core.meter.refresh_metrics()
            return None
        try:
            await work()
        except ServiceError as err:
            return self.write_json({"error": err.message}, err.status)
        self.set_header("Content-Type", "text/plain; version=0.0.4")
        self.finish(generate_latest(self.core.registry))


DONE = {"snapshot": "Snapshot taken.", "deleted": "Snapshot deleted.", "restore": "Restore started.",
        "reset": "Reset started.", "stopped": "Stopped.", "key-added": "SSH key added.",
        "key-deleted": "SSH key deleted."}


def _back_up(view: dict) -> bool:
    """The operation the page follows went well and the hub says the server is up again (after a
    failure the page stays, with the failure's sentence)."""
    state = (view.get("operation") or {}).get("state")
    return state not in ("running", "failed") and view["hub"]["ready"] and bool(view["hub"]["url"])


def _refresh(view: dict, follow: str) -> bool:
    """Whether the page reloads itself: while an operation runs, and while what the visitor came
    from the Lab to wait for (`follow`: the server back up, or the machine stopped) is under way
    as the hub sees it."""
    op = view.get("operation") or {}
    if op.get("state") == "running":
        return True
    if op.get("state") == "failed" or view["phase"] in ("failed", "lost"):
        return False
    if follow == "lab":
        return view["hub"]["pending"] is not None
    if follow == "stop":
        return view["hub"]["pending"] is not None or view["hub"]["ready"]
    return False


class Page(Base):
    """The rescue page: the caller's workstations (an admin's: everyone's) and their actions, as
    plain forms, usable while a machine is stopped or does not boot."""

    def set_default_headers(self):
        self.set_header("Content-Security-Policy", "frame-ancestors 'self'")  # no framing: no clickjacking

    def render_page(self, name: str, **values):
        values.update(prefix=self.settings["prefix"], hub_prefix=self.settings["hub_prefix"],
                      xsrf_form_html=self.xsrf_form_html(), quote=quote, workstation_path=workstation_path)
        self.finish(TEMPLATES.get_template(name).render(**values))

    def write_error(self, status_code: int, **kwargs):
        exc = kwargs.get("exc_info", (None, None))[1]
        message = getattr(exc, "log_message", None) or self._reason
        self.render_page("error.html", status=status_code, message=message)

    def _render_refusal(self, err: ServiceError | k.KubeError):
        if isinstance(err, k.KubeError):
            self.core.log.warning("%s %s: the cluster refused: %s", self.request.method, self.request.path, err)
            err = cluster_refusal(err)
        self.set_status(err.status)
        self.render_page("error.html", status=err.status, message=err.message)

    async def _capacity(self, caller: Caller) -> dict:
        """The admins' part of the page: capacity now, and the costs of this month and the last."""
        this_month = month_of(datetime.now(timezone.utc))
        months = [this_month, previous_month(this_month)]
        return {"capacity": self.core.capacity(caller),
                "reports": [await self.core.meter.report(month, by) for month in months for by in ("user", "profile")]}

    @web.authenticated
    async def get(self, user=None, server=None):
        caller = self.caller()
        try:
            if user is None:
                items = await self.core.list_workstations(caller)
                keys, keys_error = [], ""
                if not caller.name.startswith("service:"):
                    try:  # (the rescue page works without them: the hub's API may be what is down)
                        keys = (await self.core.ssh_keys(caller, caller.name))["ssh_keys"]
                    except ServiceError as err:
                        keys_error = f"Your SSH keys cannot be read now: {err.message}"
                return self.render_page("index.html", caller=caller, workstations=items, ssh_keys=keys,
                                        keys_error=keys_error, message=DONE.get(self.get_argument("done", ""), ""),
                                        **(await self._capacity(caller) if caller.admin else {}))
            ws = await self.core.existing(caller, user, server or "")
            view = await self.core.describe(ws)
            follow = self.get_argument("follow", "")
            if follow == "lab" and _back_up(view):
                return self.redirect(view["hub"]["url"] + "lab")
            self.render_page("workstation.html", caller=caller, ws=view, snapshots=await self.core.snapshots(
                caller, user, server or ""), events=self.core.start_events(ws), last_start=await self.core.last_start(ws),
                message=DONE.get(self.get_argument("done", ""), ""), follow=follow, refresh=_refresh(view, follow),
                # (the panel's Delete: a workstation's token may not delete, the owner's login here may)
                confirm_delete=self.get_argument("delete", ""))
        except (ServiceError, k.KubeError) as err:
            self._render_refusal(err)

    @web.authenticated
    async def post(self, user=None, server=None):
        """One form per action; the answer is the workstation's page with what happened."""
        caller = self.caller()
        srv = server or ""
        action = self.get_body_argument("action", "")
        try:
            if len(self.request.body) > MAX_BODY_BYTES:
                raise ServiceError(413, f"The form is larger than {MAX_BODY_BYTES // 1024} KiB.")
            if user is None:  # the page of all the caller's workstations: their SSH keys
                if action == "add-ssh-key":
                    await self.core.add_ssh_key(caller, caller.name, self.get_body_argument("key", ""))
                    return self.redirect(f"{self.settings['prefix']}?done=key-added#ssh-keys")
                if action == "delete-ssh-key":
                    await self.core.delete_ssh_key(caller, caller.name, self.get_body_argument("fingerprint", ""))
                    return self.redirect(f"{self.settings['prefix']}?done=key-deleted#ssh-keys")
                raise ServiceError(404, "No workstation named.")
            if action == "snapshot":
                await self.core.take_snapshot(caller, user, srv, self.get_body_argument("name", "") or None,
                                              self.get_body_argument("note", ""))
                done = "snapshot"
            elif action == "delete-snapshot":
                await self.core.delete_snapshot(caller, user, srv, self.get_body_argument("snapshot", ""))
                done = "deleted"
            elif action == "restore":
                await self.core.restore(caller, user, srv, self.get_body_argument("snapshot", ""),
                                        self.get_body_argument("confirm", "") == "yes")
                done = "restore"
            elif action == "reset":
                await self.core.reset(caller, user, srv, self.get_body_argument("confirm", ""))
                done = "reset"
            elif action == "stop":
                await self.core.stop(caller, user, srv)
                done = "stopped"
            else:
                raise ServiceError(400, "Unknown action.")
        except (ServiceError, k.KubeError) as err:
            return self._render_refusal(err)
        page = f"{self.settings['prefix']}workstation/{quote(user, safe='')}"
        if srv:
            page += f"/servers/{quote(srv, safe='')}"
        self.redirect(f"{page}?done={done}")


def make_app(core: Workstations, prefix: str, hub_prefix: str = "/hub/") -> web.Application:
    # The one instance: JupyterHub's OAuth callback handler uses HubOAuth.instance(), and the
    # login's state (the PKCE verifier) must be found where it was stored.
    # The hub's __Host- cookie prefix for this service's cookies too (JupyterHub tells its users'
    # servers, not its services): no user's subdomain can toss a cookie of this host's.
    hub = core.config.JupyterHub if "JupyterHub" in core.config else {}
    hub_auth = HubOAuth.instance(api_token=core.hub.token, cache_max_age=60,
                                 cookie_host_prefix_enabled=bool(hub.get("cookie_host_prefix_enabled")))
    user = r"([^/]+)"
    server = r"(?:/servers/([^/]+))?"
    args = {"core": core}
    return web.Application([
        (prefix + "oauth_callback", HubOAuthCallbackHandler),
        (prefix + "api/v1/workstations/?", WorkstationsApi, args),
        (prefix + f"api/v1/workstations/{user}{server}(?:/({'|'.join(API_ACTIONS)}))?(?:/([^/]+))?/?",
         WorkstationApi, args),
        (prefix + "api/v1/capacity/?", CapacityApi, args),
        (prefix + "api/v1/drains/([^/]+)/?", DrainApi, args),
        (prefix + "api/v1/costs/?", CostsApi, args),
        (prefix + f"api/v1/users/{user}/ssh-keys(?:/([^/]+))?/?", SshKeysApi, args),
        (prefix + "api/(.*)", NotFoundApi, args),
        (prefix + "metrics/?", Metrics, args),
        (prefix + f"workstation/{user}{server}/?", Page, args),
        (prefix + "?", Page, args),
    ], hub_auth=hub_auth, prefix=prefix, hub_prefix=hub_prefix, cookie_secret=secrets.token_bytes(32),
        login_url=hub_auth.login_url)
    # No tornado xsrf_cookies: tornado would check before the caller is known, so token requests
    # would need a form token too. HubOAuth checks XSRF itself for cookie sessions (a POST with the
    # cookie and without the page's _xsrf is not authenticated); tokens need none.


def load_hub_config(path: str):
    """The hub's own config file, read as the hub reads it (`c`, `get_config`, `load_subconfig`)."""
    folder, name = os.path.split(os.path.abspath(path))
    return PyFileConfigLoader(name, path=folder).load_config()


class ServiceApp(Application):
    """The service's process: its logger is the one every configurable of the process (the
    spawner's code, HubOAuth) logs through, in JupyterHub's format, to the hub's log."""

    name = SERVICE_NAME
    log_format = "[%(levelname)1.1s %(asctime)s.%(msecs).03d %(name)s %(module)s:%(lineno)d] %(message)s"

    @default("log_level")
    def _default_log_level(self):
        return logging.INFO  # the audit lines are INFO


async def serve(port: int, config_path: str | None = None, ip: str = "127.0.0.1"):
    log = ServiceApp.instance().log
    path = config_path or os.environ.get(CONFIG_ENV)
    if not path:
        raise SystemExit(f"kubevirt-spawner service: no hub config (--config or ${CONFIG_ENV})")
    config = load_hub_config(path)
    hub = Hub(os.environ["JUPYTERHUB_API_URL"], os.environ["JUPYTERHUB_API_TOKEN"], log)
    core = Workstations(hub, config=config, log=log)
    prefix = os.environ.get("JUPYTERHUB_SERVICE_PREFIX", f"/services/{SERVICE_NAME}/")
    # The hub's pages (the spawn page the rescue page links to): with subdomains this service has a
    # host of its own, where the hub's login cookie is not sent, so the hub's own URL.
    hub_prefix = os.environ.get("JUPYTERHUB_PUBLIC_HUB_URL") or os.environ.get("JUPYTERHUB_BASE_URL", "/").rstrip(
        "/") + "/hub/"
    app = make_app(core, prefix, hub_prefix)
    app.listen(port, ip, max_body_size=MAX_READ_BYTES)
    log.info("workstations service on %s:%d%s (hub config %s)", ip, port, prefix, path)
    background = [asyncio.ensure_future(core.activity.report_keepalives()),
                  asyncio.ensure_future(core.actions.resume_interrupted()),
                  asyncio.ensure_future(core.drains.check_forever(core.drain_check_every)),
                  asyncio.ensure_future(core.meter.observe_forever(core.meter_every))]
    try:
        await asyncio.Event().wait()
    finally:
        for task in background:
            task.cancel()
        await hub.close()
        core.keystore.close()
        core.meter.ledger.close()
