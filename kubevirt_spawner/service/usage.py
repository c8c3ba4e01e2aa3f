"""What the workstations' disks hold: their sizes, and their usage as the guest agent reports it,
remembered for a machine that is stopped or whose agent does not answer (in memory, and on the VM
when a disk crosses a level)."""

from __future__ import annotations

import json

from .. import kube as k
from .. import manifests as m
from ..objects import ROOT_DISK_SERIAL, SCRATCH_DISK_SERIAL, WORKSPACE_DISK_SERIAL, field_value
from ..workstation import Workstation, WorkstationError
from . import times

ANNOTATION_DISK_USAGE = m.LABEL_PREFIX + "disk-usage"  # the last usage the guest agent reported
LEVELS = ((95, "95"), (85, "85"), (70, "70"))


def usage_level(percent: float | None) -> str | None:
    """ok, or the threshold (70, 85, 95 %) the disk is above."""
    if percent is None:
        return None
    return next((name for limit, name in LEVELS if percent >= limit), "ok")


class DiskUsage:
    """The disks of each workstation, with the usage last seen: (user, server): {disk: {"used",
    "total", "at"}}."""

    def __init__(self) -> None:
        self.remembered: dict[tuple[str, str], dict] = {}

    def used_bytes(self) -> int:
        """All the remembered disks' use, as last known."""
        return int(sum(d.get("used", 0) for usage in self.remembered.values() for d in usage.values()))

    def full_disks(self, percent: float) -> int:
        """How many remembered disks are at least `percent` full."""
        return sum(1 for usage in self.remembered.values() for d in usage.values()
                   if d.get("total") and 100.0 * d["used"] / d["total"] >= percent)

    async def disks(self, ws: Workstation) -> dict:
        """Size of each disk, and its usage as the guest agent reports it (the last known when the
        machine is stopped or the agent does not answer)."""
        key = (ws.ident.user, ws.ident.server)
        usage = await self._live_usage(ws)
        if usage:
            await self._remember(ws, usage)
        else:
            usage = self.remembered.get(key) or _json((ws.vm or {}).get("metadata", {}).get("annotations", {})
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
        out.update(data_disks(ws, usage))
        return out

    async def _live_usage(self, ws: Workstation) -> dict | None:
        try:
            filesystems = await ws.filesystems()
        except WorkstationError:  # a missing permission, logged for the admin: no usage to show
            return None
        if filesystems is None:
            return None
        at = times.iso(times.now())
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

    async def _remember(self, ws: Workstation, usage: dict) -> None:
        """Kept in memory, and on the VM when a level changes (what a stopped machine shows)."""
        key = (ws.ident.user, ws.ident.server)
        # (the disks that are kept: the scratch disk's usage is gone with the machine)
        stored = {disk: seen for disk, seen in usage.items()
                  if disk in ("root", "workspace") or disk.startswith(m.EXTRA_DISK_PREFIX)}
        before = _json(((ws.vm or {}).get("metadata", {}).get("annotations") or {}).get(ANNOTATION_DISK_USAGE)) or {}
        self.remembered[key] = stored

        def level(data: dict, disk: str) -> str | None:
            d = data.get(disk) or {}
            return usage_level(100.0 * d["used"] / d["total"]) if d.get("total") else None
        if any(level(stored, d) != level(before, d) for d in {*stored, *before}) or not before:
            await ws.kube.patch(k.VM, ws.ident.namespace, ws.ident.vm, {"metadata": {"annotations": {
                ANNOTATION_DISK_USAGE: json.dumps(stored, sort_keys=True)}}})


def data_disks(ws: Workstation, usage: dict) -> dict:
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


def _json(raw: str | None) -> dict | None:
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return None
