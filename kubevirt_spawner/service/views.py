"""What the service shows of workstations: a workstation's status (the hub's view of its server,
its machine, disks, snapshots, quota, cost, operation, keep-alive, idle deadline, drain and why it
is busy), the caller's list, the hub's last start and the cluster's warnings, and the
administrators' capacity view."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import aiohttp

from .. import kube as k
from .. import manifests as m
from ..objects import field_value
from ..operations import Operation
from ..quantity import parse_quantity
from ..workstation import Workstation, WorkstationError
from . import times
from .access import Access, Caller, ServiceError, workstation_path
from .actions import operation_view
from .hub import Hub, HubError
from .metering import held_now

if TYPE_CHECKING:
    from .actions import Actions
    from .activity import Activity
    from .drains import Drains
    from .hubsettings import HubSettings
    from .metering import Meter
    from .settings import WorkstationsSettings
    from .usage import DiskUsage


class Views:
    def __init__(self, settings: WorkstationsSettings, hub: Hub, hub_settings: HubSettings, access: Access,
                 usage: DiskUsage, activity: Activity, actions: Actions, drains: Drains, meter: Meter,
                 log: logging.Logger | logging.LoggerAdapter):
        self.settings = settings
        self.hub = hub
        self.hub_settings = hub_settings
        self.access = access
        self.usage = usage
        self.activity = activity
        self.actions = actions
        self.drains = drains
        self.meter = meter
        self.log = log

    async def list_workstations(self, caller: Caller, user: str | None = None) -> list[dict]:
        if user is not None:
            self.access.authorize(caller, user)
        elif not caller.admin:
            user = caller.name
        out = []
        for owner, server in self.hub_settings.all_workstations():
            if (user is None or owner == user) and caller.may_act_on(owner, server):
                out.append(await self.describe(await self.hub_settings.workstation(owner, server)))
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
        keepalive = self.activity.keepalives.get((ident.user, ident.server))
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
            "disks": await self.usage.disks(ws),
            "golden_image": {"cloned_from": cloned, "configured": ws.spec.golden_image,
                             "newer_available": bool(cloned and cloned != ws.spec.golden_image)},
            "snapshots": {"count": len(snaps), "total_size": _gib(await self._snapshots_size(ws)),
                          # (the limit counts all the user's workstations' snapshots)
                          "user_count": self.actions.user_snapshot_count(ident.user),
                          "limit": self.settings.snapshot_limit or None, "retention": _snapshot_retention(ws)},
            "quota": await self._quota(ws),
            "cost": await self._cost(ident.user, ident.server),
            "operation": operation_view(op),
            "keepalive_until": times.iso(keepalive) if keepalive and keepalive > times.now() else None,
            "keepalive_max_minutes": self.settings.keepalive_max_minutes,
            "agent_connected": agent_connected,
            # what a snapshot taken now would be (KubeVirt freezes the filesystems through the agent)
            "snapshot_consistency": ("offline" if vmi is None else "application-consistent" if agent_connected
                                     else "crash-consistent"),
            "idle": self.activity.idle(server, keepalive),
            "drain": self.drains.view(vm, vmi),  # a drain of its node: the deadline of its stop
            "last_stop": self.drains.last_stop(vm, vmi),  # why a drain stopped it
            "activity": self.activity.why_active(ident.user, ident.server, server, keepalive)
            if server and server.get("ready") else None,  # (a stopped machine is busy with nothing)
        }

    async def _cost(self, user: str, server: str) -> dict | None:
        """The workstation's cost view; None when the database does not answer (the rest of the
        status, a drain's warning included, must not fail with it)."""
        try:
            return await self.meter.workstation_cost(user, server)
        except Exception as err:
            self.log.warning("cannot read the cost of %s: %s", workstation_path(user, server), err)
            return None

    async def _quota(self, ws: Workstation) -> list[dict] | None:
        try:
            return await ws.quotas()
        except (WorkstationError, k.KubeError) as err:  # (a missing permission is logged for the admin)
            self.log.debug("cannot read the quotas of %s: %s", ws.ident.namespace, err)
            return None

    async def _hub_server(self, user: str, server: str) -> dict | None:
        try:
            return await self.hub.server(user, server)
        except HubError as err:
            self.log.warning("cannot read %s's server from the hub: %s", user, err)
            return None

    @staticmethod
    async def _snapshots_size(ws: Workstation) -> float | None:
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

    @staticmethod
    def start_events(ws: Workstation, limit: int = 20) -> list[dict]:
        """The cluster's Warning events about the workstation (its VM, disks, launcher pods), the
        latest last: why its last start waited or failed."""
        ident = ws.ident
        events = ws.caches.events_for(ident.namespace, {ident.vm, ident.rootdisk, ident.workspace},
                                      (f"virt-launcher-{ident.vm}-",))
        return [{"time": e.get("lastTimestamp") or e.get("eventTime"), "reason": e.get("reason"),
                 "object": f"{(e.get('involvedObject') or {}).get('kind')}/{(e.get('involvedObject') or {}).get('name')}",
                 "message": e.get("message")} for e in events if e.get("type") == "Warning"][-limit:]

    def capacity(self, caller: Caller) -> dict:
        if not caller.admin:
            raise ServiceError(403, "Only administrators see the capacity view.")
        caches = self.hub_settings.caches
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
                "disks": {"provisioned_bytes": int(provisioned), "used_bytes_last_known": self.usage.used_bytes()},
                "snapshots": len(caches.snapshots.values()),
                "ssh_sessions": self.activity.ssh_sessions(),
                "stopped": sorted(stopped, key=lambda s: s["stopped_since"] or ""),
                "retained": sorted(retained, key=lambda r: (r["retain_until"] or "", r["name"]))}


def _snapshot_retention(ws: Workstation) -> str:
    return (f"Snapshots are kept until you delete them; when the workstation is deleted, they are kept "
            f"{ws.settings.retention_days} days with its disks.")


def _gib(size: float | None) -> str | None:
    return None if size is None else f"{size / 2 ** 30:.0f}Gi" if size else "0"
