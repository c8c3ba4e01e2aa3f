"""What the workstations service does, without HTTP: who may act on what, each action on the
lifecycle layer (`workstation.py`, `operations.py`) with the spawner's own settings, audit lines
and metrics. The web layer (`web.py`) only translates requests and answers.
"""

from __future__ import annotations

import asyncio
import json
import types
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from traitlets import Bool, Dict, Float, Integer, List, TraitError, Unicode, default, validate
from traitlets.config import LoggingConfigurable

from .. import kube as k
from .. import manifests as m
from .. import names
from ..objects import ROOT_DISK_SERIAL, SCRATCH_DISK_SERIAL, WORKSPACE_DISK_SERIAL, field_value
from ..operations import STEP_LABELS, Operation, Operations
from ..quantity import parse_quantity
from ..spawner import KubeVirtSpawner
from ..workstation import Workstation, WorkstationError, refusals_explained
from . import SERVICE_NAME
from .drains import Drains
from .hub import Hub, HubError, HubServer
from .metering import Meter, check_prices, held_now
from .sshkeys import BadKey, KeyConflict, KeyStore, parse_public_key

ANNOTATION_DISK_USAGE = m.LABEL_PREFIX + "disk-usage"  # the last usage the guest agent reported
LEVELS = ((95, "95"), (85, "85"), (70, "70"))


async def _no_auth_state():
    return None


def recorded_options(text: str | None) -> dict:
    """The user's choices in the profile as the VM records them; anything else is no choice (the
    spawner checks them against the profile again)."""
    try:
        options = json.loads(text or "{}")
    except ValueError:
        return {}
    return {k: v for k, v in options.items() if isinstance(k, str) and isinstance(v, str)} \
        if isinstance(options, dict) else {}


class ServiceError(Exception):
    """Bad input or a refused action: an HTTP status and one sentence; nothing was changed."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Caller:
    name: str
    admin: bool
    # A server's own token: the workstations ("user/server") it may act on; None: all of the user's.
    servers: frozenset[str] | None = None
    # JupyterHub's read:metrics scope (a monitoring service's token reads the metrics, nothing more)
    reads_metrics: bool = False

    def may_act_on(self, user: str, server: str) -> bool:
        if self.admin:
            return True
        return self.name == user and (self.servers is None or f"{user}/{server}" in self.servers)


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _iso(moment: datetime) -> str:
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# What a guest may name as the reason it is busy (kubevirt_spawner.guest.activity's sources); a
# keep-alive is the service's own, never the guest's word.
ACTIVITY_SOURCES = ("jupyter", "ssh", "console", "gpu", "cpu", "kernel", "ssh-tunnel")
# A guest's report older than this many of its own intervals is stale (the guest stopped reporting).
REPORT_STALE_INTERVALS = 3


def usage_level(percent: float | None) -> str | None:
    """ok, or the threshold (70, 85, 95 %) the disk is above."""
    if percent is None:
        return None
    return next((name for limit, name in LEVELS if percent >= limit), "ok")


def check_activity_report(sources, every):
    """A guest's activity report: at most 20 `{"source", "text", "since"}` and its interval. Every
    field is bounded (the service keeps the last report of every workstation in memory)."""
    if not isinstance(sources, list) or len(sources) > 20 or not all(
            isinstance(x, dict) and x.get("source") in ACTIVITY_SOURCES and isinstance(x.get("text"), str)
            and len(x["text"]) <= 300 and _time_or_none(x.get("since")) for x in sources):
        raise ServiceError(400, '"sources" is a list of at most 20 {"source": one of '
                                f'{", ".join(ACTIVITY_SOURCES)}, "text": "...", "since": time or null}}.')
    if not isinstance(every, (int, float)) or isinstance(every, bool) or not 1 <= every <= 3600:
        raise ServiceError(400, '"every" is the number of seconds until the next report, 1 to 3600.')


def _time_or_none(value) -> bool:
    return value is None or (isinstance(value, str) and len(value) <= 40 and _parse_time(value) is not None)


# What `server_token_actions` may allow a workstation's own token, in words for the refusal.
SERVER_TOKEN_ACTIONS = {"restore": "restore a snapshot", "reset": "reset the system",
                        "delete-snapshot": "delete a snapshot"}


def workstation_path(user: str, server: str) -> str:
    return f"{user}/{server}" if server else user


class Workstations(LoggingConfigurable):
    """The service's settings (`c.Workstations.*` in the hub config) and its actions."""

    snapshot_limit = Integer(20, config=True, help="""
        Most snapshots a user may keep, over all their workstations (safety snapshots included);
        0: no limit. Taking one more is refused with a sentence that says so.""")
    safety_snapshot = Bool(True, config=True, help="""
        Take a snapshot of the current state before every restore and reset.""")
    server_token_actions = List(Unicode(), default_value=["restore", "reset"], config=True, help="""
        What a workstation's own token may do beyond snapshots, stops, keep-alives and activity
        reports: any of "restore", "reset" and "delete-snapshot". That token is the one its server
        holds ($JUPYTERHUB_API_TOKEN), so whoever has a terminal in the workstation can read it:
        every user the server is shared with, and every admin who opens it; the panel acts with
        it. Restores and resets take a safety snapshot first (`safety_snapshot`); deleting a
        snapshot cannot be undone, so by default only the owner's own login does that (the
        workstations page, where the panel's Delete leads). [] keeps all three to the owner.""")
    keepalive_max_minutes = Integer(240, config=True, help="Longest keep-alive a user may ask for.")
    keepalive_interval = Float(60.0, config=True, help="""
        Seconds between the activity reports the service sends the hub while a keep-alive lasts.""")
    operation_timeout = Float(1800.0, config=True, help="Seconds each step of a restore or reset may take.")
    idle_timeout = Integer(0, config=True, help="""
        Seconds without activity after which the hub's idle culler stops a workstation
        (`register_idle_culler()` sets it with the culler's own timeout). 0: no idle stops.""")
    idle_cull_every = Integer(0, config=True, help="""
        Seconds between the culler's checks: a stop comes up to this long after the deadline.""")
    idle_warn_before = Integer(600, config=True, help="""
        Seconds before an idle stop at which the Lab warns, with a "Keep running" button.""")
    drain_grace = Integer(600, config=True, help="""
        Seconds a workstation on a node being drained keeps running after its user is warned (the
        Lab shows the node's reason, the time left and "Stop now"); then it is stopped through the
        hub, its disks kept, and its next start goes to another node. A drain is `kubectl drain`
        (KubeVirt marks the VMI for evacuation: the VMs' evictionStrategy is External) or
        `kubevirt-spawner admin drain NODE`.""")
    drain_check_every = Float(5.0, config=True, help="Seconds between the service's looks for drained nodes.")
    prices = Dict(config=True, help="""
        What workstations cost, for their status, the Lab panel and the admins' reports:
        {"currency": "EUR", "cpu_hour": 0.02, "memory_gib_hour": 0.004, "gpu_hour":
        {"nvidia.com/A100-PCIE-40GB": 1.2}, "disk_gib_month": 0.08, "snapshot_gib_month": 0.05}
        (any may be left out). CPU, memory and GPUs count while a machine runs, disks and snapshots
        always, at their configured size. Empty: the figures are given in those units only.""")
    meter_every = Float(60.0, config=True, help="""
        Seconds between the service's records of what each workstation holds (its machine's, disks'
        and snapshots' lifetimes, kept in the database of ssh_keys_db_url).""")

    @validate("drain_grace", "meter_every", "drain_check_every")
    def _check_seconds(self, proposal):
        name = proposal.trait.name
        least = "0 or more" if name == "drain_grace" else "above 0"  # (a grace may be none; a period not)
        if proposal.value < 0 or (proposal.value == 0 and name != "drain_grace"):
            raise TraitError(f"c.Workstations.{name} must be {least} seconds")
        return proposal.value

    @validate("prices")
    def _check_prices(self, proposal):
        try:
            return check_prices(proposal.value)
        except ValueError as err:
            raise TraitError(str(err)) from None

    ssh_keys_db_url = Unicode(config=True, help="""
        The database that keeps users' SSH public keys (a table kubevirt_spawner_ssh_keys, made on
        first use) and the lifetimes of workstations' machines, disks and snapshots that costs are
        counted from (kubevirt_spawner_lifetimes). Default: the hub's own `c.JupyterHub.db_url`, so
        they live and are backed up with the hub's users.""")

    @default("ssh_keys_db_url")
    def _default_ssh_keys_db_url(self):
        hub = self.config.JupyterHub if "JupyterHub" in self.config else {}
        return hub.get("db_url") or "sqlite:///jupyterhub.sqlite"  # (JupyterHub's own default)

    @validate("server_token_actions")
    def _check_server_token_actions(self, proposal):
        unknown = sorted(set(proposal.value) - set(SERVER_TOKEN_ACTIONS))
        if unknown:
            raise TraitError(f"c.Workstations.server_token_actions: {', '.join(unknown)} is not one of "
                             f"{', '.join(SERVER_TOKEN_ACTIONS)}")
        return proposal.value

    def __init__(self, hub: Hub, **kwargs):
        super().__init__(**kwargs)
        names.confine_log_arguments(self.log)  # names, notes and paths are the users' own choice
        self.hub = hub
        self._tasks: dict[tuple[str, str], asyncio.Task] = {}
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._snapshots_in_flight: dict[str, set[tuple[str, str]]] = {}  # user: (namespace, name) being made
        self._keepalives: dict[tuple[str, str], datetime] = {}
        self._usage: dict[tuple[str, str], dict] = {}
        self._activity: dict[tuple[str, str], dict] = {}  # the guest's last word on why it is busy
        self.keystore = KeyStore(self.ssh_keys_db_url)
        self.registry = CollectorRegistry()
        self.m_operations = Counter("workstations_operations", "Operations by kind and result",
                                    ["kind", "result"], registry=self.registry)
        # The series the alerts watch exist from the start, at 0: Prometheus' increase() cannot see
        # a series' first sample as an increase, so a first failure would otherwise go unnoticed.
        for kind in ("snapshot", "restore", "reset"):
            for result in ("succeeded", "failed", "refused"):
                self.m_operations.labels(kind, result)
        self.m_durations = Histogram("workstations_operation_seconds", "How long operations took", ["kind"],
                                     buckets=(1, 5, 15, 60, 300, 900, 1800, 3600), registry=self.registry)
        self.m_snapshots = Gauge("workstations_snapshots", "Snapshots per user", ["user"], registry=self.registry)
        self.m_full = Gauge("workstations_disks_above_85_percent", "Disks over 85 % full (last known)",
                            registry=self.registry)
        self.m_drains = Counter("workstations_drains", "Workstations warned of a node drain, and stopped by one "
                                "after or during the grace", ["event"], registry=self.registry)
        for event in ("warned", "stopped-after-grace", "stopped-before-grace"):
            self.m_drains.labels(event)
        # what the service does on its own (a drain's stop), in audit lines
        self.service_caller = Caller(f"service:{SERVICE_NAME}", admin=True)
        self.drains = Drains(self)
        self.meter = Meter(self)

    # ---------------------------------------------------------------- finding workstations
    def spawner(self, user: str, server: str) -> KubeVirtSpawner:
        """A spawner for the server, with the hub's own settings (names, profiles, images)."""
        orm = types.SimpleNamespace(name=server, display_name="", server=None, state=None, user_options=None)
        # (a callable profile_list may read the user's groups and auth state: the service has neither)
        return KubeVirtSpawner(config=self.config, log=self.log, orm_spawner=orm,
                               user=types.SimpleNamespace(name=user, url=f"/user/{user}/", groups=[],
                                                          get_auth_state=_no_auth_state))

    async def workstation(self, user: str, server: str) -> Workstation:
        """The lifecycle object of user/server with the spec of the profile it runs with."""
        spawner = self.spawner(user, server)
        ws = await spawner.workstation()
        annotations = (ws.vm or {}).get("metadata", {}).get("annotations") or {}
        slug = annotations.get(m.ANNOTATION_PROFILE)
        options = recorded_options(annotations.get(m.ANNOTATION_PROFILE_OPTIONS))
        if slug and (slug != ws.spec.profile or options):
            ws = await spawner.workstation(slug, options)
        return ws

    async def existing(self, caller: Caller, user: str, server: str) -> Workstation:
        """The workstation the caller names, if they may act on it and it exists."""
        self.authorize(caller, user, server)
        ws = await self.workstation(user, server)
        if ws.vm is None:
            which = f"named {server}" if server else ""
            raise ServiceError(404, f"{user} has no workstation {which}".rstrip() + ".")
        return ws

    def refuse_server_token(self, caller: Caller, action: str):
        """The owner's own login, or a token of theirs that is not a workstation's, for what
        `server_token_actions` keeps from a workstation's token."""
        allowed = set(self.server_token_actions)
        if not self.safety_snapshot:
            allowed -= {"restore", "reset"}  # (no safety snapshot: nothing would undo them)
        if caller.servers is not None and action not in allowed:
            raise ServiceError(403, f"A workstation's own token may not {SERVER_TOKEN_ACTIONS[action]} (anyone with "
                                    "a terminal in the workstation can read it); do it on the workstations page, "
                                    "logged in as yourself.")

    def authorize(self, caller: Caller, user: str, server: str | None = None):
        if caller.name != user and not caller.admin:
            raise ServiceError(403, "You may only act on your own workstations.")
        if server is not None and not caller.may_act_on(user, server):
            raise ServiceError(403, "This is a server's token: it acts on that server's workstation only.")

    def _caches(self):
        return self.spawner("-", "")._shared()["caches"]

    def all_workstations(self) -> list[tuple[str, str]]:
        """(user, server) of every workstation in the cluster, from the VMs' annotations."""
        out = set()
        for vm in self._caches().vms.values():
            ann = vm["metadata"].get("annotations") or {}
            if m.LABEL_WORKSTATION in (vm["metadata"].get("labels") or {}) and ann.get(m.ANNOTATION_USERNAME):
                out.add((ann[m.ANNOTATION_USERNAME], ann.get(m.ANNOTATION_SERVERNAME, "")))
        return sorted(out)

    # ---------------------------------------------------------------- reading
    async def list_workstations(self, caller: Caller, user: str | None = None) -> list[dict]:
        if user is not None:
            self.authorize(caller, user)
        elif not caller.admin:
            user = caller.name
        out = []
        for owner, server in self.all_workstations():
            if (user is None or owner == user) and caller.may_act_on(owner, server):
                out.append(await self.describe(await self.workstation(owner, server)))
        return out

    async def describe(self, ws: Workstation) -> dict:
        ident, vm = ws.ident, ws.vm or {}
        ann = vm.get("metadata", {}).get("annotations") or {}
        vmi = ws.vmi
        server = await self._hub_server(ident.user, ident.server)
        cloned_from = field_value(ws.rootdisk, "spec.source.pvc")
        cloned = f"{cloned_from.get('namespace')}/{cloned_from.get('name')}" if cloned_from else None
        snaps = ws.snapshots()
        op = Operation.from_vm(vm)
        keepalive = self._keepalives.get((ident.user, ident.server))
        template = field_value(vm, "spec.template.spec") or {}
        agent_connected = any(c.get("type") == "AgentConnected" and c.get("status") == "True"
                              for c in field_value(vmi, "status.conditions") or [])
        return {
            "user": ident.user, "server": ident.server, "phase": ws.status(),
            "hub": {"ready": bool(server and server.get("ready")), "pending": (server or {}).get("pending"),
                    "last_activity": (server or {}).get("last_activity"), "url": (server or {}).get("url")},
            "profile": {"slug": ann.get(m.ANNOTATION_PROFILE, ""), "version": ann.get(m.ANNOTATION_PROFILE_VERSION, "")},
            "cpu": field_value(template, "domain.resources.requests.cpu"),
            "memory": field_value(template, "domain.resources.requests.memory"),
            "gpus": [g.get("deviceName") for g in field_value(template, "domain.devices.gpus") or []],
            "node": field_value(vmi, "status.nodeName"),
            "disks": await self.disks(ws),
            "golden_image": {"cloned_from": cloned, "configured": ws.spec.golden_image,
                             "newer_available": bool(cloned and cloned != ws.spec.golden_image)},
            "snapshots": {"count": len(snaps), "total_size": _gib(await self._snapshots_size(ws)),
                          # (the limit counts all the user's workstations' snapshots)
                          "user_count": self._user_snapshot_count(ident.user), "limit": self.snapshot_limit or None,
                          "retention": self._snapshot_retention(ws)},
            "quota": await self._quota(ws),
            "cost": await self._cost(ident.user, ident.server),
            "operation": _operation_view(op),
            "keepalive_until": _iso(keepalive) if keepalive and keepalive > _now() else None,
            "keepalive_max_minutes": self.keepalive_max_minutes,
            "agent_connected": agent_connected,
            # what a snapshot taken now would be (KubeVirt freezes the filesystems through the agent)
            "snapshot_consistency": ("offline" if vmi is None else "application-consistent" if agent_connected
                                     else "crash-consistent"),
            "idle": self._idle(server, keepalive),
            "drain": self.drains.view(vm, vmi),  # a drain of its node: the deadline of its stop
            "last_stop": self.drains.last_stop(vm, vmi),  # why a drain stopped it
            "activity": self._why_active(ident.user, ident.server, server, keepalive) if server and server.get("ready")
            else None,  # (a stopped machine is busy with nothing)
        }

    async def _cost(self, user: str, server: str) -> dict | None:
        """The workstation's cost view; None when the database does not answer (the rest of the
        status, a drain's warning included, must not fail with it)."""
        try:
            return await self.meter.workstation_cost(user, server)
        except Exception as err:
            self.log.warning("cannot read the cost of %s: %s", workstation_path(user, server), err)
            return None

    @staticmethod
    def _snapshot_retention(ws: Workstation) -> str:
        return (f"Snapshots are kept until you delete them; when the workstation is deleted, they are kept "
                f"{ws.settings.retention_days} days with its disks.")

    async def _quota(self, ws: Workstation) -> list[dict] | None:
        try:
            return await ws.quotas()
        except (WorkstationError, k.KubeError) as err:  # (a missing permission is logged for the admin)
            self.log.debug("cannot read the quotas of %s: %s", ws.ident.namespace, err)
            return None

    def _why_active(self, user: str, server: str, hub_server: dict, keepalive: datetime | None,
                    now: datetime | None = None) -> dict:
        """Why the running machine counts as busy (its guest's last report, unless stale, and a
        keep-alive), or since when it is idle (the hub's last activity) when nothing does."""
        now = now or _now()
        reported = self._fresh_report(user, server, now)
        sources = list(reported["sources"]) if reported else []
        if keepalive and keepalive > now:
            sources.append({"source": "keepalive", "text": f"kept running until {_iso(keepalive)}",
                            "since": None})
        return {"reported": _iso(reported["at"]) if reported else None, "sources": sources,
                "idle_since": None if sources else _iso_or_none(_parse_time(hub_server.get("last_activity")))}

    def _fresh_report(self, user: str, server: str, now: datetime) -> dict | None:
        """The guest's last activity report, unless it stopped reporting (its last word no longer holds)."""
        reported = self._activity.get((user, server))
        if reported and now - reported["at"] > timedelta(seconds=REPORT_STALE_INTERVALS * reported["every"]):
            return None
        return reported

    def ssh_sessions(self, now: datetime | None = None) -> list[dict]:
        """The workstations with someone on SSH, as their guests last reported: a tunnel through
        the hub (a VS Code window, scp) or a login with a terminal."""
        now = now or _now()
        out = []
        for user, server in sorted(self._activity):
            reported = self._fresh_report(user, server, now)
            for x in reported["sources"] if reported else []:
                if x["source"] in ("ssh-tunnel", "ssh"):
                    out.append({"user": user, "server": server, "text": x["text"], "since": x["since"]})
        return out

    def _idle(self, server: dict | None, keepalive: datetime | None) -> dict | None:
        """When the idle culler would stop the running server: the timeout after its last activity,
        or after the end of a keep-alive. None without idle stops or a running server."""
        if not self.idle_timeout or not server or not server.get("ready"):
            return None
        last = _parse_time(server.get("last_activity"))
        if last is None:
            return None
        # a keep-alive reports activity until it ends: the timeout runs from then
        deadline = max(last, keepalive or last) + timedelta(seconds=self.idle_timeout)
        return {"timeout_seconds": self.idle_timeout, "last_activity": _iso(last), "deadline": _iso(deadline),
                "warn_at": _iso(deadline - timedelta(seconds=self.idle_warn_before)),
                "warn_before_seconds": self.idle_warn_before,
                # (by the service's clock, for a client whose own clock may be off)
                "stop_in_seconds": max(0, round((deadline - _now()).total_seconds())),
                "check_every_seconds": self.idle_cull_every or None}

    async def _hub_server(self, user: str, server: str) -> dict | None:
        try:
            return await self.hub.server(user, server)
        except HubError as err:
            self.log.warning("cannot read %s's server from the hub: %s", user, err)
            return None

    async def disks(self, ws: Workstation) -> dict:
        """Size of each disk, and its usage as the guest agent reports it (the last known when the
        machine is stopped or the agent does not answer)."""
        key = (ws.ident.user, ws.ident.server)
        usage = await self._live_usage(ws)
        if usage:
            await self._remember_usage(ws, usage)
        else:
            usage = self._usage.get(key) or _json((ws.vm or {}).get("metadata", {}).get("annotations", {})
                                                  .get(ANNOTATION_DISK_USAGE)) or {}
        out: dict = {}
        for disk, claim in (("root", ws.ident.rootdisk), ("workspace", ws.ident.workspace)):
            pvc = ws.caches.pvcs.get(ws.ident.namespace, claim)
            if pvc is None:
                out[disk] = None
                continue
            seen = usage.get(disk) or {}
            percent = round(100.0 * seen["used"] / seen["total"], 1) if seen.get("total") else None
            out[disk] = {"size": field_value(pvc, "status.capacity.storage") or field_value(
                pvc, "spec.resources.requests.storage"), "used_bytes": seen.get("used"),
                "total_bytes": seen.get("total"), "percent": percent, "level": usage_level(percent),
                "measured": seen.get("at"), "live": bool(usage.get("live"))}
        out.update(self._data_disks(ws, usage))
        return out

    @staticmethod
    def _data_disks(ws: Workstation, usage: dict) -> dict:
        """The machine's extra disks, scratch disk and shared data as its VM has them, with the
        disks' usage as the guest agent reports it (the extra disks' last known when the machine
        is stopped; the scratch disk's only while it runs: it is blank at every start)."""
        tspec = field_value(ws.vm, "spec.template.spec") or {}
        volumes = {v.get("name"): v for v in tspec.get("volumes") or []}
        live = bool(usage.get("live"))

        def measured(key: str, size: str | None = None) -> dict:
            seen = usage.get(key) or {}  # (what is remembered of a stopped machine has none of these)
            percent = round(100.0 * seen["used"] / seen["total"], 1) if seen.get("total") else None
            return {"size": size, "used_bytes": seen.get("used"), "total_bytes": seen.get("total"),
                    "percent": percent, "level": usage_level(percent), "measured": seen.get("at"), "live": live}
        scratch = (volumes.get("scratch") or {}).get("emptyDisk")
        extra = []
        for disk in ws.spec.extra_disks:
            name = m.extra_disk_claim(ws.ident, disk)
            pvc = ws.caches.pvcs.get(ws.ident.namespace, name)
            size = field_value(pvc, "status.capacity.storage") or field_value(pvc, "spec.resources.requests.storage")
            extra.append({"name": disk.name, "path": disk.path, "claim": name, **measured(disk.volume, size)})
        paths = {share.name: share.path for share in ws.spec.shared_data}
        shared = []
        for fs in field_value(tspec, "domain.devices.filesystems") or []:
            claim = (volumes.get(fs.get("name")) or {}).get("persistentVolumeClaim") or {}
            # (no usage: qemu-ga's filesystem list leaves out filesystems without a block device)
            shared.append({"name": fs.get("name"), "claim": claim.get("claimName"),
                           "read_only": bool(claim.get("readOnly")), "path": paths.get(fs.get("name"))})
        return {"extra": extra, "scratch": measured("scratch", scratch.get("capacity")) if scratch else None,
                "shared": shared}

    async def _live_usage(self, ws: Workstation) -> dict | None:
        try:
            filesystems = await ws.filesystems()
        except WorkstationError:  # a missing permission, logged for the admin: no usage to show
            return None
        if filesystems is None:
            return None
        at = _iso(_now())
        usage: dict = {"live": True}
        for fs in filesystems:
            serials = {d.get("serial") for d in fs.get("disk") or []}
            extra = sorted(s for s in serials if s and s.startswith(m.EXTRA_DISK_PREFIX))
            disk = ("root" if ROOT_DISK_SERIAL in serials or fs.get("mountPoint") == "/"
                    else "workspace" if WORKSPACE_DISK_SERIAL in serials
                    else "scratch" if SCRATCH_DISK_SERIAL in serials else extra[0] if extra else None)
            if disk and disk not in usage:
                usage[disk] = {"used": int(fs.get("usedBytes") or 0), "total": int(fs.get("totalBytes") or 0), "at": at}
        return usage

    async def _remember_usage(self, ws: Workstation, usage: dict):
        """Kept in memory, and on the VM when a level changes (what a stopped machine shows)."""
        key = (ws.ident.user, ws.ident.server)
        # (the disks that are kept: the scratch disk's usage is gone with the machine)
        stored = {disk: seen for disk, seen in usage.items()
                  if disk in ("root", "workspace") or disk.startswith(m.EXTRA_DISK_PREFIX)}
        before = _json(((ws.vm or {}).get("metadata", {}).get("annotations") or {}).get(ANNOTATION_DISK_USAGE)) or {}
        self._usage[key] = stored

        def level(data: dict, disk: str):
            d = data.get(disk) or {}
            return usage_level(100.0 * d["used"] / d["total"]) if d.get("total") else None
        if any(level(stored, d) != level(before, d) for d in {*stored, *before}) or not before:
            await ws.kube.patch(k.VM, ws.ident.namespace, ws.ident.vm, {"metadata": {"annotations": {
                ANNOTATION_DISK_USAGE: json.dumps(stored, sort_keys=True)}}})

    async def _snapshots_size(self, ws: Workstation) -> float | None:
        try:
            return await ws.snapshots_size()
        except WorkstationError:  # a missing permission, logged for the admin
            return None

    async def last_start(self, ws: Workstation) -> dict | None:
        """What the hub said of the last start (its message, and whether it failed)."""
        try:
            return await self.hub.last_start(ws.ident.user, ws.ident.server)
        except (HubError, aiohttp.ClientError, asyncio.TimeoutError) as err:
            self.log.warning("cannot read the hub's progress of %s: %s",
                             workstation_path(ws.ident.user, ws.ident.server), err)
            return None

    def start_events(self, ws: Workstation, limit: int = 20) -> list[dict]:
        """The cluster's Warning events about the workstation (its VM, disks, launcher pods), the
        latest last: why its last start waited or failed."""
        ident = ws.ident
        events = ws.caches.events_for(ident.namespace, {ident.vm, ident.rootdisk, ident.workspace},
                                      (f"virt-launcher-{ident.vm}-",))
        return [{"time": e.get("lastTimestamp") or e.get("eventTime"), "reason": e.get("reason"),
                 "object": f"{(e.get('involvedObject') or {}).get('kind')}/{(e.get('involvedObject') or {}).get('name')}",
                 "message": e.get("message")} for e in events if e.get("type") == "Warning"][-limit:]

    # ---------------------------------------------------------------- snapshots
    def _user_snapshot_count(self, user: str) -> int:
        """The user's snapshots: those the cache has, and those being made that it may not have yet."""
        have = {(s["metadata"]["namespace"], s["metadata"]["name"]) for s in self._caches().snapshots.values()
                if (s["metadata"].get("annotations") or {}).get(m.ANNOTATION_USERNAME) == user
                and not s["metadata"].get("deletionTimestamp")}
        return len(have | self._snapshots_in_flight.get(user, set()))

    async def take_snapshot(self, caller: Caller, user: str, server: str, name, note) -> dict:
        ws = await self.existing(caller, user, server)
        if note is not None and not isinstance(note, str):
            raise ServiceError(400, '"note" must be a string.')
        note = note or ""
        name = name or f"snapshot-{_now().strftime('%Y%m%d-%H%M%S')}"
        try:
            m.virtual_machine_snapshot(ws.ident, name, note)
        except ValueError as exc:
            raise ServiceError(400, str(exc)) from None
        key = (ws.ident.namespace, m.snapshot_object_name(ws.ident, name))
        # Counted and reserved in one step (nothing awaited in between: the loop runs nothing else), so
        # concurrent requests cannot all pass a limit that none of their snapshots has reached yet.
        self._check_snapshot_limit(user)
        reserved = self._snapshots_in_flight.setdefault(user, set())
        reserved.add(key)
        try:
            async with self._lock(user, server):
                self._refuse_during_operation(ws)
                return await self._audited(caller, "snapshot", ws,
                                           ws.take_snapshot(name, note, self.operation_timeout), detail=name)
        finally:
            reserved.discard(key)  # made (the cache counts it) or not made

    def _check_snapshot_limit(self, user: str, why: str = ""):
        if self.snapshot_limit and self._user_snapshot_count(user) >= self.snapshot_limit:
            raise ServiceError(409, f"{user} has {self.snapshot_limit} snapshots, the most allowed; delete one "
                                    f"before taking another{why}.")

    async def snapshots(self, caller: Caller, user: str, server: str) -> list[dict]:
        ws = await self.existing(caller, user, server)
        return [{key: s[key] for key in ("name", "note", "created", "consistency", "ready", "phase", "error")}
                for s in ws.snapshots()]

    async def delete_snapshot(self, caller: Caller, user: str, server: str, name: str):
        ws = await self.existing(caller, user, server)
        self.refuse_server_token(caller, "delete-snapshot")
        async with self._lock(user, server):
            op = Operation.from_vm(ws.vm)
            if op is not None and op.state == "running" and name in (op.snapshot, op.safety):
                raise ServiceError(409, f"The snapshot {name} is in use by the {op.kind} under way.")
            await self._audited(caller, "delete-snapshot", ws, ws.delete_snapshot(name), detail=name)

    # ---------------------------------------------------------------- operations
    def _lock(self, user: str, server: str) -> asyncio.Lock:
        return self._locks.setdefault((user, server), asyncio.Lock())

    def _refuse_during_operation(self, ws: Workstation):
        op = Operation.from_vm(ws.vm)
        if op is not None and op.state == "running":
            raise ServiceError(409, f"The workstation is {op.describe()}; wait until it is done.")
        task = self._tasks.get((ws.ident.user, ws.ident.server))
        if task is not None and not task.done():
            raise ServiceError(409, "The workstation is busy (stopping); wait until it is done.")

    def operations(self, ws: Workstation) -> Operations:
        return Operations(ws, HubServer(self.hub, ws.ident.user, ws.ident.server, ws.settings.stop_timeout + 60),
                          safety_snapshot=self.safety_snapshot, timeout=self.operation_timeout)

    async def restore(self, caller: Caller, user: str, server: str, snapshot, confirm) -> dict:
        ws = await self.existing(caller, user, server)
        self.refuse_server_token(caller, "restore")
        if confirm is not True:
            raise ServiceError(400, 'Confirm the restore with "confirm": true: the workstation is stopped and its '
                                    "disks are put back as they were in the snapshot.")
        if not isinstance(snapshot, str) or not snapshot or len(snapshot) > m.SNAPSHOT_NAME_MAX:
            raise ServiceError(400, f'Name the snapshot to restore ("snapshot", at most {m.SNAPSHOT_NAME_MAX} '
                                    "characters).")
        return await self._begin(caller, ws, "restore", lambda ops: ops.begin_restore(snapshot, caller.name),
                                 detail=snapshot, safety_why=" (a restore takes a safety snapshot first)")

    async def reset(self, caller: Caller, user: str, server: str, confirm) -> dict:
        ws = await self.existing(caller, user, server)
        self.refuse_server_token(caller, "reset")
        expected = workstation_path(user, server)
        if confirm != expected:
            raise ServiceError(400, f'Type the workstation\'s name to confirm the reset ("confirm": "{expected}"): '
                                    "its system disk is replaced by a fresh copy of the golden image; the workspace "
                                    "disk is kept and a snapshot is taken first.")
        return await self._begin(caller, ws, "reset", lambda ops: ops.begin_reset(caller.name),
                                 safety_why=" (a reset takes a safety snapshot first)")

    async def _begin(self, caller: Caller, ws: Workstation, kind: str, begin, detail: str = "",
                     safety_why: str = "") -> dict:
        """Begin the operation, its safety snapshot counted against the user's limit from now on
        (reserved as take_snapshot reserves one, then by its name, until the operation ends)."""
        reserved = self._snapshots_in_flight.setdefault(ws.ident.user, set())
        placeholder = (ws.ident.namespace, f"the safety snapshot of {workstation_path(ws.ident.user, ws.ident.server)}")
        if self.safety_snapshot:
            self._check_snapshot_limit(ws.ident.user, safety_why)
            reserved.add(placeholder)
        try:
            op = await self._begin_locked(caller, ws, kind, begin, detail)
        finally:
            reserved.discard(placeholder)
        if self.safety_snapshot and op.safety_object:
            safety = (ws.ident.namespace, op.safety_object)
            reserved.add(safety)
            self._tasks[(ws.ident.user, ws.ident.server)].add_done_callback(lambda _: reserved.discard(safety))
        return _operation_view(op) or {}

    async def _begin_locked(self, caller: Caller, ws: Workstation, kind: str, begin, detail: str) -> Operation:
        key = (ws.ident.user, ws.ident.server)
        async with self._lock(*key):
            ops = self.operations(ws)
            running = self._tasks.get(key)
            if running is not None and not running.done():
                op = ops.operation
                raise ServiceError(409, f"The workstation is {op.describe() if op else 'busy (stopping)'}; "
                                        "wait until it is done.")
            try:
                op = await begin(ops)
            except WorkstationError as err:
                self._audit(caller, kind, ws, f"refused: {err.jupyterhub_message}", detail)
                raise ServiceError(err.status_code, err.jupyterhub_message or str(err)) from None
            self._audit(caller, kind, ws, "started", detail)
            self._tasks[key] = asyncio.ensure_future(self._run(caller.name, ops, op, detail))
            return op

    async def _run(self, by: str, ops: Operations, op: Operation, detail: str = ""):
        """An operation in the background; its record on the VM says how it went."""
        began = asyncio.get_running_loop().time()
        result = "failed"
        try:
            await ops.run(op)
            result = "succeeded"
        except (WorkstationError, k.KubeError, HubError) as err:
            ops.ws.log.warning("%s failed: %s", op.kind, getattr(err, "jupyterhub_message", None) or err)
        except Exception:  # recorded on the VM by run(); the details are for the admin
            ops.ws.log.exception("%s failed", op.kind)
        finally:
            self.m_operations.labels(op.kind, result).inc()
            self.m_durations.labels(op.kind).observe(asyncio.get_running_loop().time() - began)
            self.log.info("audit: %s %s %s: %s%s", by, op.kind, workstation_path(ops.ws.ident.user,
                                                                                 ops.ws.ident.server),
                          result, f" ({detail})" if detail else "")

    async def resume_interrupted(self):
        """At start-up: operations a previous run of the service left under way go on."""
        caches = self._caches()
        delay = 5.0
        while True:  # nothing can be decided before the caches have the cluster's state
            try:
                await caches.wait_synced(60)
                break
            except (asyncio.TimeoutError, k.KubeError) as err:
                # (a refused cache fails at once: wait before asking again, the cache retries itself)
                self.log.warning("the caches are not synced yet (%s); operations left under way wait: %s",
                                 caches.unsynced(), err or "timeout")
                await asyncio.sleep(delay)
                delay = min(delay * 2, 300.0)
        for user, server in self.all_workstations():
            ws = await self.workstation(user, server)
            op = Operation.from_vm(ws.vm)
            if op is not None and op.state == "running":
                ws.log.info("going on with the %s %s asked for (%s)", op.kind, op.by, op.describe())
                self._tasks[(user, server)] = asyncio.ensure_future(self._run(op.by, self.operations(ws), op,
                                                                              op.snapshot))

    # ---------------------------------------------------------------- stop, keep-alive
    async def stop(self, caller: Caller, user: str, server: str, wait=True) -> dict:
        """Stop through the hub. `wait=False` answers once the stop is under way: a caller on the
        machine itself (the Lab panel) would otherwise lose its answer with the machine."""
        if not isinstance(wait, bool):
            raise ServiceError(400, '"wait" must be true or false.')
        ws = await self.existing(caller, user, server)
        key = (user, server)
        async with self._lock(*key):
            self._refuse_during_operation(ws)
            if not await self.hub.running(user, server) and ws.stopped:
                return {"stopped": True, "changed": False}
            if wait:
                await self._stop(caller, ws)
                return {"stopped": True, "changed": True}
            # Marked busy before the lock is let go: a restore or reset asked meanwhile is refused.
            self._tasks[key] = asyncio.ensure_future(self._stop_in_background(caller, ws))
        return {"stopped": False, "stopping": True, "changed": True}

    async def _stop(self, caller: Caller, ws: Workstation):
        user, server = ws.ident.user, ws.ident.server
        await self._audited(caller, "stop", ws, self.hub.stop(user, server, ws.settings.stop_timeout + 60))
        self._keepalives.pop((user, server), None)
        self._activity.pop((user, server), None)  # its guest's last word is about a machine that is gone

    async def _stop_in_background(self, caller: Caller, ws: Workstation):
        try:
            await self._stop(caller, ws)
        except ServiceError as err:  # audited
            self.log.warning("stop of %s failed: %s", workstation_path(ws.ident.user, ws.ident.server), err.message)
        except Exception:
            self._audit(caller, "stop", ws, "failed (see the traceback)")
            self.log.exception("stop of %s failed", workstation_path(ws.ident.user, ws.ident.server))

    async def keepalive(self, caller: Caller, user: str, server: str, minutes) -> dict:
        ws = await self.existing(caller, user, server)
        if not isinstance(minutes, int) or isinstance(minutes, bool) or minutes < 1:
            raise ServiceError(400, 'Say for how many minutes to keep the workstation running ("minutes": 60).')
        if minutes > self.keepalive_max_minutes:
            raise ServiceError(400, f"A keep-alive lasts at most {self.keepalive_max_minutes} minutes.")
        if ws.status() not in ("running", "starting"):
            raise ServiceError(409, "The workstation is not running; start it first.")
        until = _now() + timedelta(minutes=minutes)
        await self.hub.record_activity(user, server, _now())
        self._keepalives[(user, server)] = until
        self._audit(caller, "keepalive", ws, "ok", f"{minutes} min")
        return {"keepalive_until": _iso(until)}

    async def report_activity(self, caller: Caller, user: str, server: str, sources, every) -> dict:
        """What the guest says keeps its machine busy (logins with recent input, a busy GPU, ...),
        shown as the reason it counts as active; `every`: seconds until its next report. The hub's
        last_activity, which the culler reads, moves through JupyterHub's own activity report; this
        is the why."""
        await self.existing(caller, user, server)
        check_activity_report(sources, every)
        at = _now()
        self._activity[(user, server)] = {"at": at, "every": every, "sources": [
            {"source": x["source"], "text": x["text"], "since": _iso_or_none(_parse_time(x.get("since")))}
            for x in sources]}
        return {"recorded": _iso(at)}

    async def report_keepalives(self):
        """Every keepalive_interval: activity for the servers whose keep-alive lasts."""
        while True:
            # (and at the earliest end: its activity is recorded then, not up to an interval later)
            ends = [(until - _now()).total_seconds() for until in self._keepalives.values()]
            await asyncio.sleep(max(0.1, min([self.keepalive_interval, *ends])))
            now = _now()
            for key, until in list(self._keepalives.items()):
                if until <= now and self._keepalives.get(key) == until:  # (not renewed or stopped meanwhile)
                    # the end of the keep-alive is its last activity: the timeout runs from there
                    del self._keepalives[key]
                try:
                    await self.hub.record_activity(*key, min(until, now))
                except HubError as err:
                    self.log.warning("keep-alive of %s: the hub refused the activity: %s", workstation_path(*key), err)
                except Exception:  # one workstation's trouble must not end the keep-alives of all
                    self.log.exception("keep-alive of %s failed", workstation_path(*key))

    # ---------------------------------------------------------------- admin
    def capacity(self, caller: Caller) -> dict:
        if not caller.admin:
            raise ServiceError(403, "Only administrators see the capacity view.")
        caches = self._caches()
        cpu = memory = 0.0
        gpus: dict[str, int] = {}
        for vmi in caches.vmis.values():
            if field_value(vmi, "status.phase") in ("Succeeded", "Failed"):
                continue
            requests = field_value(vmi, "spec.domain.resources.requests") or {}
            cpu += float(parse_quantity(requests.get("cpu") or "0"))
            memory += float(parse_quantity(requests.get("memory") or "0"))
            for gpu in field_value(vmi, "spec.domain.devices.gpus") or []:
                gpus[gpu.get("deviceName", "?")] = gpus.get(gpu.get("deviceName", "?"), 0) + 1
        provisioned = sum(parse_quantity(field_value(p, "status.capacity.storage") or "0")
                          for p in caches.pvcs.values())
        used = sum(d.get("used", 0) for usage in self._usage.values() for d in usage.values())
        running = {(v["metadata"]["namespace"], v["metadata"]["name"]) for v in caches.vmis.values()}
        disk_gib: dict[tuple[str, str], float] = {}
        for item in held_now(caches):
            if item.kind == "disk":
                disk_gib[(item.user, item.server)] = disk_gib.get((item.user, item.server), 0.0) + item.held["gib"]
        stopped = []
        for vm in caches.vms.values():
            if (vm["metadata"]["namespace"], vm["metadata"]["name"]) in running:
                continue
            ann = vm["metadata"].get("annotations") or {}
            since = next((c.get("lastTransitionTime") for c in field_value(vm, "status.conditions") or []
                          if c.get("type") == "Ready"), None)
            who = (ann.get(m.ANNOTATION_USERNAME) or "", ann.get(m.ANNOTATION_SERVERNAME, ""))
            stopped.append({"user": who[0], "server": who[1], "stopped_since": since,
                            "disk_gib": round(disk_gib.get(who, 0.0), 3)})  # (what it holds while it is stopped)
        retained = []
        for kind, cache in (("DataVolume", caches.dvs), ("PersistentVolumeClaim", caches.pvcs)):
            for obj in cache.values():
                meta = obj["metadata"]
                if m.LABEL_RETAINED in (meta.get("labels") or {}):
                    ann = meta.get("annotations") or {}
                    retained.append({"kind": kind, "namespace": meta["namespace"], "name": meta["name"],
                                     "user": ann.get(m.ANNOTATION_USERNAME), "server": ann.get(m.ANNOTATION_SERVERNAME, ""),
                                     "retain_until": ann.get(m.ANNOTATION_RETAIN_UNTIL)})
        return {"running": len(running), "cpu": cpu, "memory_bytes": int(memory), "gpus": gpus,
                "disks": {"provisioned_bytes": int(provisioned), "used_bytes_last_known": int(used)},
                "snapshots": len(caches.snapshots.values()),
                "ssh_sessions": self.ssh_sessions(),
                "stopped": sorted(stopped, key=lambda s: s["stopped_since"] or ""),
                "retained": sorted(retained, key=lambda r: (r["retain_until"] or "", r["name"]))}

    async def purge(self, caller: Caller, user: str, server: str, confirm) -> dict:
        """Delete the retained disks and snapshots of a deleted workstation, once their retention
        has ended and the admin typed the user's name."""
        if not caller.admin:
            raise ServiceError(403, "Only administrators may purge retained disks.")
        if confirm != user:
            raise ServiceError(400, f'Type the user\'s name to confirm the purge ("confirm": "{user}"): their kept '
                                    "disks and snapshots are deleted for good.")
        ws = await self.workstation(user, server)
        if ws.vm is not None:
            raise ServiceError(409, f"{workstation_path(user, server)} still has its workstation; only the disks of a "
                                    "deleted workstation are purged.")
        ns = ws.ident.namespace
        kept = ws.disks_and_snapshots()
        if not kept:
            raise ServiceError(404, f"{workstation_path(user, server)} has no retained disks.")
        now = _iso(_now())
        early = [obj["metadata"]["name"] for _, obj in kept
                 if (obj["metadata"].get("annotations") or {}).get(m.ANNOTATION_RETAIN_UNTIL, "9999") > now]
        if early:
            until = max((obj["metadata"].get("annotations") or {}).get(m.ANNOTATION_RETAIN_UNTIL, "never")
                        for _, obj in kept)
            raise ServiceError(409, f"The disks of {workstation_path(user, server)} are kept until {until}; they can "
                                    "be purged after that.")
        # Their volumes go with them, RBD images included (the class keeps volumes, Retain, against
        # mistakes: a purge is no mistake).
        with refusals_explained(ws.log, "have its disks purged"):
            await ws.set_reclaim_policy([obj for kind, obj in kept if kind is k.PVC])
        deleted = []
        for kind, obj in kept:
            if await ws.kube.delete(kind, ns, obj["metadata"]["name"]):
                deleted.append(f"{kind.kind}/{obj['metadata']['name']}")
        self._audit(caller, "purge", ws, "deleted " + ", ".join(deleted))
        return {"deleted": deleted}

    # ---------------------------------------------------------------- SSH keys
    async def _account_created(self, user: str) -> str:
        """The JupyterHub account's creation time: keys are that account's, not its name's."""
        try:
            model = await self.hub.user(user)
        except HubError as err:
            raise ServiceError(502, f"The hub refused to say who {user} is: {err.message}") from None
        except (aiohttp.ClientError, asyncio.TimeoutError) as err:
            raise ServiceError(503, f"The hub does not answer ({type(err).__name__}); try again in a moment.") from None
        if model is None:
            raise ServiceError(404, f"JupyterHub has no user {user}.")
        return str(model.get("created") or "")

    async def ssh_keys(self, caller: Caller, user: str) -> dict:
        """The user's SSH public keys: for the user (a workstation's own token too: its sshd asks
        with it at every login) and admins."""
        self.authorize(caller, user)
        created = await self._account_created(user)
        return {"ssh_keys": await asyncio.to_thread(self.keystore.keys, user, created)}

    def _refuse_key_change(self, caller: Caller, user: str, action: str):
        if caller.name != user and not (caller.admin and action == "delete"):
            raise ServiceError(403, "You may only add or delete your own SSH keys (an admin may delete one).")
        if caller.name == user and caller.servers is not None:
            raise ServiceError(403, f"A workstation's own token may not {action} SSH keys (anyone with a terminal "
                                    "in the workstation can read it, and the keys open all your workstations); "
                                    "do it on the workstations page, logged in as yourself.")

    async def add_ssh_key(self, caller: Caller, user: str, text) -> dict:
        self._refuse_key_change(caller, user, "add")
        try:
            key = parse_public_key(text)
        except BadKey as err:
            raise ServiceError(400, str(err)) from None
        created = await self._account_created(user)
        try:
            added = await asyncio.to_thread(self.keystore.add, user, created, key)
        except KeyConflict as err:
            raise ServiceError(409, str(err)) from None
        self.log.info("audit: %s add-ssh-key %s: %s %s", caller.name, user, key.type, key.fingerprint)
        return added

    async def delete_ssh_key(self, caller: Caller, user: str, fingerprint: str) -> dict:
        self._refuse_key_change(caller, user, "delete")
        created = await self._account_created(user)
        if not await asyncio.to_thread(self.keystore.delete, user, created, fingerprint):
            raise ServiceError(404, f"{user} has no SSH key with the fingerprint {fingerprint[:80]}.")
        self.log.info("audit: %s delete-ssh-key %s: %s", caller.name, user, fingerprint)
        return {"deleted": fingerprint}

    # ---------------------------------------------------------------- audit, metrics
    def _audit(self, caller: Caller, action: str, ws: Workstation, result: str, detail: str = ""):
        self.log.info("audit: %s %s %s: %s%s", caller.name, action, workstation_path(ws.ident.user, ws.ident.server),
                      result, f" ({detail})" if detail else "")

    async def _audited(self, caller: Caller, action: str, ws: Workstation, work, detail: str = ""):
        try:
            result = await work
        except WorkstationError as err:
            self._audit(caller, action, ws, f"failed: {err.jupyterhub_message}", detail)
            # what the user asked was refused (a taken name, a limit) or it failed: alerts need the latter
            self.m_operations.labels(action, "refused" if err.status_code < 500 else "failed").inc()
            raise ServiceError(err.status_code, err.jupyterhub_message or str(err)) from None
        except k.KubeError as err:
            self._audit(caller, action, ws, f"failed: the cluster refused: {err}", detail)
            self.m_operations.labels(action, "failed").inc()
            raise cluster_refusal(err) from None
        except HubError as err:
            self._audit(caller, action, ws, f"failed: the hub said {err}", detail)
            self.m_operations.labels(action, "failed").inc()
            raise ServiceError(502, f"The hub refused: {err.message}") from None
        self._audit(caller, action, ws, "done", detail)
        self.m_operations.labels(action, "succeeded").inc()
        return result

    def refresh_metrics(self):
        per_user: dict[str, int] = {}
        for snap in self._caches().snapshots.values():
            user = (snap["metadata"].get("annotations") or {}).get(m.ANNOTATION_USERNAME)
            if user:
                per_user[user] = per_user.get(user, 0) + 1
        self.m_snapshots.clear()
        for user, count in per_user.items():
            self.m_snapshots.labels(user).set(count)
        full = sum(1 for usage in self._usage.values() for d in usage.values()
                   if d.get("total") and 100.0 * d["used"] / d["total"] >= 85)
        self.m_full.set(full)


def cluster_refusal(err: k.KubeError) -> ServiceError:
    """A request of the cluster's that no step turned into a sentence: its cause in words (the
    details are for the log)."""
    unavailable = err.status >= 500 or err.status in (0, 429)
    return ServiceError(503 if unavailable else err.status, f"The cluster did not take the request ({err.for_users}). "
                                                            "Try again in a minute; if it keeps failing, tell your "
                                                            "administrator.")


def _gib(size: float | None) -> str | None:
    return None if size is None else f"{size / 2 ** 30:.0f}Gi" if size else "0"


def _json(raw) -> dict | None:
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return None


def _iso_or_none(moment: datetime | None) -> str | None:
    return None if moment is None else _iso(moment)


def _parse_time(value) -> datetime | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)


def _operation_view(op: Operation | None) -> dict | None:
    if op is None:
        return None
    return {"id": op.id, "kind": op.kind, "state": op.state, "step": op.step + 1, "steps": len(op.steps),
            "step_labels": [STEP_LABELS.get(name, name) for name in op.steps],
            "step_name": op.current, "description": op.describe(), "by": op.by, "started": op.started,
            "updated": op.updated, "snapshot": op.snapshot or None, "safety_snapshot": op.safety or None,
            "error": op.error or None}
