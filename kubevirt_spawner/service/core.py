"""What the workstations service does, without HTTP: the entry point the web layer (`web.py`)
calls, and the configurable of its settings (`c.Workstations.*`, in `settings.py`). It makes the
service's parts and hands each what it needs:

- `hubsettings.HubSettings`: the hub's spawner settings and caches, and each workstation;
- `access.Access`: who may act on what;
- `views.Views`: a workstation's status, the caller's list, the capacity view;
- `usage.DiskUsage`: the disks' usage, remembered;
- `activity.Activity`: keep-alives, the guests' activity reports, idle deadlines;
- `actions.Actions`: snapshots, restores, resets, stops and purges, each through `audit.Audit`;
- `drains.Drains`, `metering.Meter`, `userkeys.UserKeys` and `metrics.ServiceMetrics`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from .. import names
from ..reflector import Caches
from ..workstation import Workstation
from .access import Access, Caller
from .actions import Actions
from .activity import Activity
from .audit import Audit
from .drains import Drains
from .hub import Hub
from .hubsettings import HubSettings
from .metering import Meter
from .metrics import ServiceMetrics
from .settings import WorkstationsSettings
from .sshkeys import KeyStore
from .usage import DiskUsage
from .userkeys import UserKeys
from .views import Views


class Workstations(WorkstationsSettings):
    """The service's settings (`c.Workstations.*` in the hub config) and its actions."""

    def __init__(self, hub: Hub, **kwargs):
        super().__init__(**kwargs)
        names.confine_log_arguments(self.log)  # names, notes and paths are the users' own choice
        self.hub = hub
        self.hub_settings = HubSettings(self.config, self.log)
        self.keystore = KeyStore(self.ssh_keys_db_url)
        self.metrics = ServiceMetrics()
        self.registry: CollectorRegistry = self.metrics.registry
        self.audit = Audit(self.log, self.metrics)
        self.access = Access(self, self.hub_settings)
        self.usage = DiskUsage()
        self.activity = Activity(self, hub, self.access, self.audit, self.log)
        self.actions = Actions(self, hub, self.hub_settings, self.access, self.audit, self.metrics, self.activity,
                               self.log)
        self.drains = Drains(self, hub, self.hub_settings, self.actions, self.audit, self.metrics, self.log)
        self.meter = Meter(self)
        self.views = Views(self, hub, self.hub_settings, self.access, self.usage, self.activity, self.actions,
                           self.drains, self.meter, self.log)
        self.keys = UserKeys(self.keystore, hub, self.access, self.audit)

    def _caches(self) -> Caches:
        """The hub-wide caches, as the meter reads them."""
        return self.hub_settings.caches

    # ---------------------------------------------------------------- reading
    async def existing(self, caller: Caller, user: str, server: str) -> Workstation:
        return await self.access.existing(caller, user, server)

    async def list_workstations(self, caller: Caller, user: str | None = None) -> list[dict]:
        return await self.views.list_workstations(caller, user)

    async def describe(self, ws: Workstation) -> dict:
        return await self.views.describe(ws)

    async def last_start(self, ws: Workstation) -> dict | None:
        return await self.views.last_start(ws)

    def start_events(self, ws: Workstation, limit: int = 20) -> list[dict]:
        return self.views.start_events(ws, limit)

    def capacity(self, caller: Caller) -> dict:
        return self.views.capacity(caller)

    async def snapshots(self, caller: Caller, user: str, server: str) -> list[dict]:
        return await self.actions.snapshots(caller, user, server)

    # ---------------------------------------------------------------- acting
    async def take_snapshot(self, caller: Caller, user: str, server: str, name, note) -> dict:
        return await self.actions.take_snapshot(caller, user, server, name, note)

    async def delete_snapshot(self, caller: Caller, user: str, server: str, name: str) -> None:
        await self.actions.delete_snapshot(caller, user, server, name)

    async def restore(self, caller: Caller, user: str, server: str, snapshot, confirm) -> dict:
        return await self.actions.restore(caller, user, server, snapshot, confirm)

    async def reset(self, caller: Caller, user: str, server: str, confirm) -> dict:
        return await self.actions.reset(caller, user, server, confirm)

    async def stop(self, caller: Caller, user: str, server: str, wait=True) -> dict:
        return await self.actions.stop(caller, user, server, wait)

    async def purge(self, caller: Caller, user: str, server: str, confirm) -> dict:
        return await self.actions.purge(caller, user, server, confirm)

    async def keepalive(self, caller: Caller, user: str, server: str, minutes) -> dict:
        return await self.activity.keepalive(caller, user, server, minutes)

    async def report_activity(self, caller: Caller, user: str, server: str, sources, every) -> dict:
        return await self.activity.report(caller, user, server, sources, every)

    # ---------------------------------------------------------------- SSH keys
    async def ssh_keys(self, caller: Caller, user: str) -> dict:
        return await self.keys.keys(caller, user)

    async def add_ssh_key(self, caller: Caller, user: str, text) -> dict:
        return await self.keys.add(caller, user, text)

    async def delete_ssh_key(self, caller: Caller, user: str, fingerprint: str) -> dict:
        return await self.keys.delete(caller, user, fingerprint)

    # ---------------------------------------------------------------- metrics
    def refresh_metrics(self) -> None:
        self.metrics.refresh(self.hub_settings.caches, self.usage)
