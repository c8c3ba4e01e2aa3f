"""Node drains: a workstation on a node being drained is warned, given `drain_grace`, then stopped
gracefully through the hub, and the stop is recorded.

How a drain reaches here. The spawner gives every VM `evictionStrategy: External`
(manifests.EVICTION_STRATEGY). `kubectl drain` cordons the node and evicts its pods; KubeVirt's
eviction webhook denies the eviction of a launcher pod with 429 and marks the VMI for evacuation
(`status.evacuationNodeName`, pkg/virt-api/webhooks/validating-webhook/admitters/
pod-eviction-admitter.go); kubectl retries every 5 s, and KubeVirt itself does nothing more for
External (pkg/virt-controller/watch/drain/evacuation/evacuation.go). This module is that outside
controller: once the machine is stopped its launcher pod goes, and the drain completes.
`kubevirt-spawner admin drain NODE` starts the same on demand (`drain_node`).

What is a drain. KubeVirt marks a VMI for any eviction of its launcher pod, whoever asked: the
descheduler (which only rebalances; KubeVirt then also annotates the VMI kubevirt.io/eviction-source:
descheduler), an eviction by hand, or a drain. Only a node being emptied makes it a drain: one
cordoned (spec.unschedulable, what `kubectl cordon` and `kubectl drain` set first:
staging/src/k8s.io/kubectl/pkg/drain/cordon.go) or tainted for deletion by the cluster autoscaler.
A marked VMI on a schedulable node keeps running, unwarned. Conversely a cordon alone starts the
warning at once: `kubectl drain --disable-eviction` deletes the launcher pods right after the
cordon, without the Eviction API and so without any mark; a machine gone from a cordoned node
without a warning is recorded as such. Uncordoned before the grace ends, the warning is withdrawn.

The record of a drain is a JSON annotation on the VM (manifests.ANNOTATION_DRAIN): its deadline
outlives a restart of the service, and once the machine stopped it says why.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

import aiohttp

from .. import kube as k
from .. import manifests as m
from ..objects import field_value
from ..operations import Operation
from . import times
from .access import SERVICE_CALLER, Caller, ServiceError, workstation_path
from .hub import Hub, HubError

if TYPE_CHECKING:
    from ..workstation import Workstation
    from .actions import Actions
    from .audit import Audit
    from .hubsettings import HubSettings
    from .metrics import ServiceMetrics
    from .settings import WorkstationsSettings

# KubeVirt's mark of a descheduler's eviction on the VMI (staging/src/kubevirt.io/api/core/v1/types.go)
EVICTION_SOURCE = "kubevirt.io/eviction-source"
# An admin may say why on the node (kubectl annotate node NODE kubevirt-spawner.io/drain-reason=...)
ANNOTATION_NODE_REASON = m.LABEL_PREFIX + "drain-reason"
REASON_MAX = 200
_NODE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
FINAL_PHASES = ("Succeeded", "Failed")


def drain_record(vm: dict | None) -> dict | None:
    """The VM's drain record, or None (also for a record that is not one of ours)."""
    raw = ((vm or {}).get("metadata", {}).get("annotations") or {}).get(m.ANNOTATION_DRAIN)
    try:
        record = json.loads(raw) if raw else None
    except ValueError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("node"), str) else None


def running_on(vmi: dict | None) -> str | None:
    """The node a VMI that is not final nor going away runs (or is scheduled) on."""
    if vmi is None or field_value(vmi, "status.phase") in FINAL_PHASES or vmi["metadata"].get("deletionTimestamp"):
        return None
    return field_value(vmi, "status.nodeName")


def evacuation_node(vmi: dict | None) -> str | None:
    """The node KubeVirt marked the VMI to leave (an eviction of its launcher pod), if it still
    runs there."""
    node = running_on(vmi)
    return node if node and field_value(vmi, "status.evacuationNodeName") == node else None


def active(record: dict | None, vmi: dict | None) -> bool:
    """Whether the record is a drain still to finish: the machine still runs on that node."""
    return bool(record and not record.get("stopped_at") and running_on(vmi) == record["node"])


AUTOSCALER_DELETION_TAINT = "ToBeDeletedByClusterAutoscaler"  # cluster-autoscaler utils/taints


def node_draining(node: dict | None) -> bool:
    """Whether the node is being emptied: cordoned, or marked for deletion by the cluster
    autoscaler. A node the caches do not know is not taken for one."""
    if node is None:
        return False
    return bool(field_value(node, "spec.unschedulable")) or any(
        t.get("key") == AUTOSCALER_DELETION_TAINT for t in field_value(node, "spec.taints") or [])


def check_node_name(node) -> str:
    if not isinstance(node, str) or not _NODE_NAME.match(node):
        raise ServiceError(400, "Name a node by its Kubernetes name (lowercase letters, digits, '-' and '.').")
    return node


def check_reason(reason) -> str:
    if reason is None:
        return ""
    if not isinstance(reason, str) or len(reason) > REASON_MAX or any(ord(ch) < 32 for ch in reason):
        raise ServiceError(400, f"A drain's reason is one line of at most {REASON_MAX} characters.")
    return reason.strip()


def wants_to_run(vm: dict | None) -> bool:
    """Whether the VM is meant to run (a hub's stop makes it Halted): a machine that went down
    meanwhile, KubeVirt starts again."""
    spec = (vm or {}).get("spec") or {}
    return spec.get("runStrategy") == "Always" or (spec.get("runStrategy") is None and spec.get("running") is True)


def stop_text(record: dict) -> str:
    """Why the machine stopped, for its status while it is stopped (or running again)."""
    why = f" ({record['reason']})" if record.get("reason") else ""
    if record.get("went_down"):
        warned = "without a warning" if record.get("stopped") == "without-warning" else "during the warning"
        return (f"Went down {warned}: its node {record['node']} was drained{why} and its machine's pod deleted "
                "(a drain that does not use the Eviction API), and KubeVirt started it again on another node. "
                "Its disks are kept; what was only in memory is lost.")
    if record.get("stopped") == "without-warning":
        return (f"Stopped without a warning: its node {record['node']} was drained{why} and its machine's pod "
                "deleted at once (a drain that does not use the Eviction API). Its disks are kept; the next start "
                "goes to another node.")
    how = ("after the warning's grace period" if record.get("stopped") == "after-grace"
           else "during the warning's grace period")
    return (f"Stopped {how}: its node {record['node']} was being drained{why}. Its disks are kept; the next "
            "start goes to another node.")


class Drains:
    """Finds workstations on nodes being drained and stops them after their grace."""

    def __init__(self, settings: WorkstationsSettings, hub: Hub, hub_settings: HubSettings, actions: Actions,
                 audit: Audit, metrics: ServiceMetrics, log: logging.Logger | logging.LoggerAdapter):
        self.settings = settings
        self.hub = hub
        self.hub_settings = hub_settings
        self.actions = actions
        self.audit = audit
        self.metrics = metrics
        self.log = log
        self._stopping: dict[tuple[str, str], asyncio.Task] = {}
        # The last record written per workstation: the cache may not show it yet, and an older
        # copy must not start a drain again (a later deadline) or finish one twice.
        self._written: dict[tuple[str, str], dict] = {}
        self._hub_trouble: set[tuple[str, str]] = set()  # (told once per outage, not every round)
        # Where each workstation's machine ran at the last round, (node, VMI uid): one gone since
        # from a cordoned node, without a warning, was drained without the Eviction API.
        self._seen: dict[tuple[str, str], tuple[str, str]] = {}
        self._not_drains: set[str] = set()  # VMI uids marked on schedulable nodes (told once)

    # ------------------------------------------------------------- views
    def view(self, vm: dict | None, vmi: dict | None) -> dict | None:
        """The drain the workstation is warned of, for its status: None when there is none."""
        record = drain_record(vm)
        if record is None or not active(record, vmi):
            return None
        return {"node": record["node"], "reason": record.get("reason") or "", "since": record["since"],
                "deadline": record["deadline"], "grace_seconds": self.settings.drain_grace}

    @staticmethod
    def last_stop(vm: dict | None, vmi: dict | None) -> dict | None:
        """Why a stopped machine stopped, when a drain stopped it; also while it runs again when
        it came back right after (KubeVirt restarts a VM whose pod a drain deleted: its run
        strategy is Always), so that its user learns why it rebooted."""
        record = drain_record(vm)
        if record is None or not record.get("stopped_at"):
            return None
        if running_on(vmi) and not (record.get("restarted_vmi") and field_value(vmi, "metadata.uid") ==
                                    record["restarted_vmi"]):
            return None
        return {"why": "drain", "node": record["node"], "reason": record.get("reason") or "",
                "at": record["stopped_at"], "text": stop_text(record)}

    def _node_reason(self, node: str) -> str:
        obj = self.hub_settings.caches.nodes.get("", node)
        reason = ((obj or {}).get("metadata", {}).get("annotations") or {}).get(ANNOTATION_NODE_REASON) or ""
        try:
            return check_reason(reason)
        except Exception:  # an unreadable note on the node is no reason to keep a workstation on it
            return ""

    def on_node(self, node: str) -> list[tuple[str, str, dict, dict]]:
        """(user, server, vm, vmi) of every workstation whose machine runs on the node."""
        caches = self.hub_settings.caches
        out = []
        for vmi in caches.vmis.values():
            if running_on(vmi) != node:
                continue
            vm = caches.vms.get(vmi["metadata"]["namespace"], vmi["metadata"]["name"])
            ann = (vm or {}).get("metadata", {}).get("annotations") or {}
            if vm is not None and ann.get(m.ANNOTATION_USERNAME):
                out.append((ann[m.ANNOTATION_USERNAME], ann.get(m.ANNOTATION_SERVERNAME, ""), vm, vmi))
        return sorted(out, key=lambda x: (x[0], x[1]))

    # ------------------------------------------------------------- acting
    async def check_forever(self, every: float = 5.0):
        while True:
            try:
                await self.check()
            except Exception:  # one bad round must not end the drains of all
                self.log.exception("checking for drains failed")
            await self._next_round(every)

    def _draining_nodes(self) -> frozenset[str]:
        return frozenset(n["metadata"]["name"] for n in self.hub_settings.caches.nodes.values() if node_draining(n))

    async def _next_round(self, every: float):
        """`every` seconds, or less: a node cordoned or uncordoned starts the next round at once
        (a drain without the Eviction API deletes the launcher pods right after its cordon)."""
        before = self._draining_nodes()
        try:
            with contextlib.suppress(asyncio.TimeoutError):  # (the interval passed with no change)
                await self.hub_settings.caches.wait_for(lambda: self._draining_nodes() != before, every)
        except Exception:  # (the caches cannot be read: the plain interval)
            await asyncio.sleep(every)

    async def check(self, now: datetime | None = None):
        """One round: new evacuations get their warning and deadline; due ones are stopped;
        machines that went before their deadline are recorded as stopped. Nothing is decided on
        caches that do not have the cluster's state yet (a restarted service's first moments)."""
        now = now or times.now()
        caches = self.hub_settings.caches
        if not caches.synced:
            return
        for vm in list(caches.vms.values()):
            ann = vm["metadata"].get("annotations") or {}
            user = ann.get(m.ANNOTATION_USERNAME)
            if not user:
                continue
            server = ann.get(m.ANNOTATION_SERVERNAME, "")
            try:  # (one workstation's trouble must not hold up the drains of the others)
                await self._check_one(user, server, vm, caches.vmis.get(vm["metadata"]["namespace"],
                                                                         vm["metadata"]["name"]), now)
            except Exception:
                self.log.exception("drain: checking %s failed", workstation_path(user, server))

    def _record(self, user: str, server: str, vm: dict) -> dict | None:
        """The workstation's drain record: the cache's, or the one last written when the cache does
        not show it yet."""
        cached, written = drain_record(vm), self._written.get((user, server))

        def order(record: dict | None) -> tuple:
            return (record or {}).get("since") or "", (record or {}).get("stopped_at") or ""
        return written if written is not None and order(written) > order(cached) else cached

    def _draining(self, node: str | None) -> bool:
        return bool(node) and node_draining(self.hub_settings.caches.nodes.get("", node or ""))

    async def _check_one(self, user: str, server: str, vm: dict, vmi: dict | None, now: datetime):
        record = self._record(user, server, vm)
        uid = (vmi or {}).get("metadata", {}).get("uid")
        node = running_on(vmi)
        seen, self._seen[(user, server)] = self._seen.get((user, server)), (node or "", uid or "")
        if record and record.get("stopped_at") and record.get("vmi") == uid and node == record["node"]:
            # recorded as stopped, yet the same machine still runs there: the drain goes on
            record = {key: value for key, value in record.items() if key not in ("stopped_at", "stopped")}
        if seen and seen[0] and (seen[1] != uid or not node) and (record or {}).get("vmi") != seen[1] \
                and self._draining(seen[0]):
            # gone from a cordoned node since the last round, unwarned: its pod was deleted
            await self._gone_unwarned(user, server, seen, now, wants_to_run(vm))
            return
        marked = evacuation_node(vmi)
        if marked and not self._draining(marked) and uid not in self._not_drains:
            self._not_drains.add(uid or "")  # (a descheduler's eviction, or one by hand)
            source = ((vmi or {}).get("metadata", {}).get("annotations") or {}).get(EVICTION_SOURCE) or "unknown"
            self.log.info("drain: %s's launcher pod was evicted on %s (source: %s), which is not being drained: "
                          "it keeps running", workstation_path(user, server), marked, source)
        if vmi is not None and node and self._draining(node) and not active(record, vmi) \
                and (record or {}).get("vmi") != uid:
            record = await self._begin(user, server, vmi, node, self._node_reason(node),
                                       "eviction" if marked and uid not in self._not_drains else "cordon", now)
        if record is not None and record.get("went_down") and not record.get("restarted_vmi") and node \
                and uid != record.get("vmi"):
            await self._write(await self.hub_settings.workstation(user, server), {**record, "restarted_vmi": uid})
            return
        if record is None or record.get("stopped_at"):
            return
        if active(record, vmi) and not self._draining(record["node"]) and (user, server) not in self._stopping:
            await self._withdraw(user, server, record)
            return
        if not active(record, vmi):
            if (user, server) not in self._stopping:  # it went by itself (Stop now, a user's stop, a restore)
                early = now < (times.parse_time(record.get("deadline")) or now)
                await self._finish(user, server, record, "before-grace" if early else "after-grace", now,
                                   went_down=wants_to_run(vm))
            return
        if now >= (times.parse_time(record.get("deadline")) or now) and (user, server) not in self._stopping:
            self._stopping[(user, server)] = asyncio.ensure_future(self._stop(user, server, record))

    async def _begin(self, user: str, server: str, vmi: dict, node: str, reason: str, by: str,
                     now: datetime) -> dict:
        record = {"node": node, "vmi": vmi["metadata"]["uid"], "reason": reason, "by": by, "since": times.iso(now),
                  "deadline": times.iso(now + timedelta(seconds=self.settings.drain_grace))}
        ws = await self.hub_settings.workstation(user, server)
        await self._write(ws, record)
        self.audit.of(SERVICE_CALLER, "drain-warn", ws, f"stop due {record['deadline']}",
                         f"node {node}" + (f": {reason}" if reason else ""))
        self.metrics.drains.labels("warned").inc()
        return record

    async def _withdraw(self, user: str, server: str, record: dict):
        """The node was uncordoned before the grace ended: no drain, the warning goes."""
        ws = await self.hub_settings.workstation(user, server)
        self._written.pop((user, server), None)
        await ws.kube.patch(k.VM, ws.ident.namespace, ws.ident.vm, {"metadata": {"annotations": {
            m.ANNOTATION_DRAIN: None}}})
        self.audit.of(SERVICE_CALLER, "drain-withdrawn", ws, "kept running", f"node {record['node']} uncordoned")
        self.metrics.drains.labels("withdrawn").inc()

    async def _gone_unwarned(self, user: str, server: str, seen: tuple[str, str], now: datetime, went_down: bool):
        """The machine left a cordoned node between two rounds with no warning (its pod deleted):
        recorded, so that its status says why it stopped."""
        node, uid = seen
        record = {"node": node, "vmi": uid, "reason": self._node_reason(node), "by": "pod-deleted",
                  "since": times.iso(now), "deadline": times.iso(now)}
        await self._finish(user, server, record, "without-warning", now, went_down)

    async def _stop(self, user: str, server: str, record: dict):
        """The grace is over: stop through the hub (so its view stays true), then record it."""
        try:
            ws = await self.hub_settings.workstation(user, server)
            caller = SERVICE_CALLER
            async with self.actions.lock(user, server):
                op = Operation.from_vm(ws.vm)
                if op is not None and op.state == "running":
                    return  # (a restore or reset stops and starts the machine itself; next round)
                if await self.hub.running(user, server):
                    await self.actions.stop_through_hub(caller, ws)
                if running_on(ws.vmi) == record["node"]:  # the hub did not know it ran: stop the VM itself
                    await self.audit.audited(caller, "stop", ws, ws.stop())
            if running_on(ws.vmi) == record["node"]:
                return  # (still there: tried again next round)
            self._hub_trouble.discard((user, server))
            await self._finish(user, server, record, "after-grace", times.now())
        except (ServiceError, HubError, aiohttp.ClientError, asyncio.TimeoutError) as err:
            # (audited) tried again next round; told once while it lasts (the hub may be down)
            if (user, server) not in self._hub_trouble:
                self._hub_trouble.add((user, server))
                self.log.warning("drain: stopping %s failed, trying again: %s", workstation_path(user, server),
                                 getattr(err, "message", None) or type(err).__name__)
        except Exception:
            self.log.exception("drain: stopping %s failed", f"{user}/{server}")
        finally:
            self._stopping.pop((user, server), None)

    async def _finish(self, user: str, server: str, record: dict, how: str, now: datetime, went_down: bool = False):
        """Record the stop; `went_down`: nobody stopped it (its pod was deleted under it)."""
        ws = await self.hub_settings.workstation(user, server)
        done = {**record, "stopped_at": times.iso(now), "stopped": how, **({"went_down": True} if went_down else {})}
        await self._write(ws, done)
        self.audit.of(SERVICE_CALLER, "drain-stop", ws, "stopped " + how.replace("-", " "),
                         f"node {record['node']}")
        self.metrics.drains.labels(f"stopped-{how}").inc()

    async def _write(self, ws: Workstation, record: dict):
        self._written[(ws.ident.user, ws.ident.server)] = record
        await ws.kube.patch(k.VM, ws.ident.namespace, ws.ident.vm, {"metadata": {"annotations": {
            m.ANNOTATION_DRAIN: json.dumps(record, sort_keys=True)}}})

    async def drain_node(self, caller: Caller, node, dry_run=False, reason=None) -> dict:
        """An admin's drain of a node: every workstation on it is warned and stopped after the
        grace, as if `kubectl drain` had evicted it. The node must be cordoned first (409 otherwise),
        so that no workstation starts there again (a dry run only lists who would be warned); the
        cordon itself may have warned them already (check), and the admin's reason then replaces
        the node's."""
        if not caller.admin:
            raise ServiceError(403, "Only administrators drain nodes.")
        node = check_node_name(node)
        reason = check_reason(reason)
        if not isinstance(dry_run, bool):
            raise ServiceError(400, '"dry_run" must be true or false.')
        obj = self._node(node)
        if not dry_run and not field_value(obj, "spec.unschedulable"):
            raise ServiceError(409, f"Cordon {node} first (kubectl cordon {node}): a workstation stopped for the "
                                      "drain could start there again.")
        now = times.now()
        warned = []
        for user, server, vm, vmi in self.on_node(node):
            record = self._record(user, server, vm)
            if not dry_run and not active(record, vmi):
                record = await self._begin(user, server, vmi, node, reason or self._node_reason(node), "admin", now)
            elif not dry_run and record is not None and reason and record.get("reason") != reason:
                # (warned at the cordon already: same deadline, the admin's reason)
                record = {**record, "reason": reason, "by": "admin"}
                await self._write(await self.hub_settings.workstation(user, server), record)
            warned.append(self._entry(user, server, record if active(record, vmi) else None))
        return {"node": node, "dry_run": dry_run, "cordoned": bool(field_value(obj, "spec.unschedulable")),
                "grace_seconds": self.settings.drain_grace, "workstations": warned}

    def node_state(self, caller: Caller, node) -> dict:
        """What still runs on the node, with each drain's deadline."""
        if not caller.admin:
            raise ServiceError(403, "Only administrators drain nodes.")
        node = check_node_name(node)
        obj = self._node(node)
        return {"node": node, "cordoned": bool(field_value(obj, "spec.unschedulable")),
                "workstations": [self._entry(user, server, drain_record(vm) if active(drain_record(vm), vmi) else None)
                                 for user, server, vm, vmi in self.on_node(node)]}

    def _node(self, node: str) -> dict:
        obj = self.hub_settings.caches.nodes.get("", node)
        if obj is None:
            raise ServiceError(404, f"There is no node named {node}.")
        return obj

    @staticmethod
    def _entry(user: str, server: str, record: dict | None) -> dict:
        return {"user": user, "server": server, "deadline": (record or {}).get("deadline"),
                "reason": (record or {}).get("reason")}

