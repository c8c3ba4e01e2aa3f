"""Shared watch-based caches of the objects the spawner waits on.

Each `Reflector` lists one kind once, then follows a watch from that resourceVersion, in a task on
the hub's event loop; a 410 Gone or a broken stream starts over with a fresh list. Changes are
applied between two awaits, so readers never see a half-applied update and need no locks.
`Caches` groups the reflectors and wakes the waiters of the namespaces that changed: `poll()` and
progress read from here and make no API requests. They log through the Kube client's logger (the
hub's).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Callable, TypeVar

from . import kube as k
from .objects import FINAL_PHASES, field_value

T = TypeVar("T")

# Scheduling and attach failures are Events on the virt-launcher Pod, as on any cluster.
WATCHED_EVENT_KINDS = {"VirtualMachine", "VirtualMachineInstance", "DataVolume", "PersistentVolumeClaim", "Pod"}


def _key(obj: dict) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return meta.get("namespace") or "", meta.get("name") or ""


LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"


def slim(obj: dict) -> dict:
    """What the caches keep of an object: no `managedFields` (server-side apply bookkeeping) and
    no copy of the object as `kubectl apply` last saw it; no reader uses them, and they can be
    most of an object's size."""
    meta = obj.get("metadata")
    if isinstance(meta, dict):
        meta.pop("managedFields", None)
        annotations = meta.get("annotations")
        if isinstance(annotations, dict):
            annotations.pop(LAST_APPLIED, None)
    return obj


class Reflector:
    def __init__(self, kube: k.Kube, kind: k.Kind, on_change: Callable[[str | None], None],
                 namespace: str | None = None,
                 label_selector: str | None = None, keep: Callable[[dict], bool] | None = None,
                 field_selector: str | None = None, optional: bool = False):
        self.kube, self.kind, self.namespace = kube, kind, namespace
        self.label_selector, self.field_selector = label_selector, field_selector
        self.keep = keep or (lambda obj: True)
        self.objects: dict[tuple[str, str], dict] = {}
        self.synced = False
        # A cache the hub may not read (403) is tried again now and then. An optional one counts as
        # synced and empty meanwhile; a required one makes every wait on the caches fail at once
        # with `refusal`, rather than wait for a permission that nobody is granting.
        self.optional = optional
        self.forbidden = False
        self.refusal: k.KubeError | None = None
        self.last_error: k.KubeError | None = None  # why the cache is not synced, when it is not
        # Called on the loop with the namespace that changed (None: possibly all of them).
        self._on_change = on_change
        # Per-object listeners (object or None when gone, its key) and whole-cache ones (a relist).
        self.on_object: list[Callable[[dict | None, tuple[str, str]], None]] = []
        self.on_reset: list[Callable[[object], None]] = []
        self._task: asyncio.Task | None = None
        self._stopping = False

    def start(self, loop: asyncio.AbstractEventLoop):
        self._stopping = False
        self._task = loop.create_task(self._run(), name=f"reflector-{self.kind.plural}")

    def stop(self):
        self._stopping = True
        task = self._task
        if task is None or task.done() or task.get_loop().is_closed():
            return
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if here is task.get_loop():
            task.cancel()
        else:
            task.get_loop().call_soon_threadsafe(task.cancel)

    def get(self, namespace: str, name: str) -> dict | None:
        return self.objects.get((namespace, name))

    def values(self):
        return self.objects.values()

    # ------------------------------------------------ on the event loop
    def _replace_all(self, items: list[dict]):
        self.forbidden = False
        self.refusal = None
        self.last_error = None
        self.objects = {_key(o): o for o in items if self.keep(o)}
        self.synced = True
        for reset in self.on_reset:
            reset(self.objects.values())
        self._on_change(None)

    def _forbid(self, err: k.KubeError):
        if self.optional:
            self._replace_all([])
        self.forbidden = True
        self.refusal = err
        self._on_change(None)

    def _failed(self, err: k.KubeError):
        self.last_error = err

    def _apply(self, changes: list[tuple[str, dict]]):
        """A batch of watch events, applied in order; then each namespace that changed wakes its
        waiters once. Cluster-scoped objects (nodes, storage profiles) may matter to every
        workstation."""
        namespaces: set[str | None] = set()
        for event_type, obj in changes:
            key = _key(obj)
            if event_type == "DELETED" or not self.keep(obj):
                self.objects.pop(key, None)
                current = None
            else:
                self.objects[key] = obj
                current = obj
            for listener in self.on_object:
                listener(current, key)
            namespaces.add(key[0] if self.kind.namespaced else None)
        for namespace in (None,) if None in namespaces else namespaces:
            self._on_change(namespace)

    # ------------------------------------------------ the task
    def _query(self) -> dict:
        query: dict[str, str] = {}
        if self.label_selector:
            query["labelSelector"] = self.label_selector
        if self.field_selector:
            query["fieldSelector"] = self.field_selector
        return query

    async def _run(self):
        failures = 0
        told = False  # the admin has read that the hub may not read these (told once)
        while not self._stopping:
            try:
                listing = await self.kube.call("GET", self.kind.path(self.namespace), self._query() or None) or {}
                version = (listing.get("metadata") or {}).get("resourceVersion", "")
                self._replace_all([slim(o) for o in listing.get("items") or []])
                failures = 0
                await self._follow(version)
            except k.KubeError as err:
                if self._stopping:
                    return
                if err.status == 403 or (self.optional and err.status == 404):  # refused, or not served here
                    if not told:  # once, not at every retry
                        self._log_refusal(err)
                        told = True
                    err.logged = True
                    self._forbid(err)
                    await asyncio.sleep(300 if self.optional else 60)
                    continue
                self._failed(err)
                told = False  # another problem: a refusal after it is news again
                failures += 1
                delay = min(0.5 * 2 ** min(failures, 6), 30.0) * (0.5 + random.random() / 2)
                level = logging.DEBUG if err.status == 410 else logging.WARNING
                self.kube.log.log(level, "watch of %s restarting in %.1fs: %s", self.kind.plural, delay, err)
                await asyncio.sleep(0 if err.status == 410 else delay)
            except Exception:  # never let the cache die silently
                if self._stopping:
                    return
                self.kube.log.exception("watch of %s failed", self.kind.plural)
                await asyncio.sleep(5)

    def _log_refusal(self, err: k.KubeError):
        need = f"list and watch {self.kind.plural}" + (f" ({self.kind.group})" if self.kind.group else "")
        if self.optional:
            self.kube.log.warning("cannot read %s: %s. Going on without them; the hub's ServiceAccount needs %s "
                                  "(see deploy/rbac/)", self.kind.plural, err, need)
        else:
            self.kube.log.error("cannot read %s: %s. No workstation can start or stop until the hub's "
                                "ServiceAccount may %s (see deploy/rbac/)", self.kind.plural, err, need)

    async def _follow(self, version: str):
        """Follow the watch until the server ends it; raise KubeError when it must restart."""
        while not self._stopping:
            query = {**self._query(), "watch": "1", "resourceVersion": version, "allowWatchBookmarks": "true",
                     "timeoutSeconds": str(random.randint(240, 360))}
            async for batch in self.kube.watch(self.kind.path(self.namespace), query, 400):
                changes: list[tuple[str, dict]] = []
                try:
                    for event in batch:
                        obj = event.get("object") or {}
                        if event.get("type") == "ERROR":
                            raise k.KubeError(obj.get("code", 500), obj.get("reason", ""), obj.get("message", ""))
                        if event.get("type") == "BOOKMARK":
                            version = obj["metadata"]["resourceVersion"]
                            continue
                        version = (obj.get("metadata") or {}).get("resourceVersion", version)
                        changes.append((event["type"], slim(obj)))
                finally:
                    if changes:  # what came before an error still happened
                        self._apply(changes)


class Caches:
    """The reflectors one hub shares between all its spawners."""

    def __init__(self, kube: k.Kube, label_selector: str, namespace: str | None = None, events: bool = True):
        self.kube = kube
        # Waiters wake on changes in their namespace (None: on any change), not on every event.
        self._changed: dict[str | None, asyncio.Event] = {}
        sel = label_selector

        def watched_event(ev: dict) -> bool:
            involved = ev.get("involvedObject") or {}
            if involved.get("kind") == "Pod":  # of the pods, only KubeVirt's launchers
                return (involved.get("name") or "").startswith("virt-launcher-")
            return involved.get("kind") in WATCHED_EVENT_KINDS

        self.vms = Reflector(kube, k.VM, self._notify, namespace, sel)
        self.vmis = Reflector(kube, k.VMI, self._notify, namespace, sel)
        self.dvs = Reflector(kube, k.DV, self._notify, namespace, sel)
        self.pvcs = Reflector(kube, k.PVC, self._notify, namespace, sel)
        self.services = Reflector(kube, k.SERVICE, self._notify, namespace, sel)
        # Whether a machine's node still answers: KubeVirt leaves the VMI Running on a lost node.
        self.nodes = Reflector(kube, k.NODE, self._notify, optional=True)
        # How CDI clones into each StorageClass (copy, or copy-on-write): the clone queue needs it.
        self.storage_profiles = Reflector(kube, k.STORAGE_PROFILE, self._notify, optional=True)
        # Snapshots (optional: a cluster without KubeVirt's snapshot API still runs workstations).
        self.snapshots = Reflector(kube, k.SNAPSHOT, self._notify, namespace, sel, optional=True)
        self.reflectors = [self.vms, self.vmis, self.dvs, self.pvcs, self.services, self.nodes, self.storage_profiles,
                           self.snapshots]
        self.events = None
        if events:
            # Warnings only: they say why a start waits or fails, and they are a small share of a
            # busy cluster's Events (which carry no labels to select ours by).
            # Optional: without them a start only says less about why it waits.
            self.events = Reflector(kube, k.EVENT, self._notify, namespace, None, keep=watched_event,
                                    field_selector="type=Warning", optional=True)
            self.reflectors.append(self.events)
        self.started = False

    def start(self):
        if self.started:
            return
        loop = asyncio.get_running_loop()
        for r in self.reflectors:
            r.start(loop)
        self.started = True

    def stop(self):
        for r in self.reflectors:
            r.stop()

    @property
    def synced(self) -> bool:
        return all(r.synced for r in self.reflectors)

    @property
    def refusal(self) -> k.KubeError | None:
        """The 403 of a cache the hub needs and may not read, or None."""
        return next((r.refusal for r in self.reflectors if r.refusal is not None and not r.optional), None)

    def unsynced(self) -> str:
        """Which caches are not synced and why, for a log line."""
        return ", ".join(f"{r.kind.plural} ({r.last_error or 'no answer yet'})" for r in self.reflectors
                         if not r.synced) or "none"

    def clone_strategy(self, storage_class: str) -> str | None:
        """CDI's clone strategy for a StorageClass (its StorageProfile's status), when known."""
        return field_value(self.storage_profiles.get("", storage_class), "status.cloneStrategy")

    def notify(self, namespace: str | None = None):
        """Wake the waiters of a namespace (None: every waiter) to re-check, for changes that are
        not in the cluster."""
        self._notify(namespace)

    def _notify(self, namespace: str | None):
        if namespace is None:
            events, self._changed = list(self._changed.values()), {}
        else:
            events = [e for e in (self._changed.pop(namespace, None), self._changed.pop(None, None)) if e]
        for event in events:
            event.set()

    def _change_event(self, namespace: str | None = None) -> asyncio.Event:
        """The event the next change in `namespace` (None: anywhere) sets; the caches start with
        the first waiter."""
        self.start()
        event = self._changed.get(namespace)
        if event is None:
            event = self._changed[namespace] = asyncio.Event()
        return event

    async def wait_for(self, predicate: Callable[[], T | None], timeout: float | None = None,
                       namespace: str | None = None) -> T:
        """Wait until `predicate()` returns something truthy, re-checking on every change in
        `namespace` (all of them when None; cluster-scoped changes wake every waiter). Raises the
        KubeError of a needed cache the hub may not read: nothing would ever change."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            changed = self._change_event(namespace)
            result = predicate()
            if result:
                return result
            refusal = self.refusal
            if refusal is not None:
                err = k.KubeError(refusal.status, refusal.reason, refusal.message, refusal.body, refusal.request)
                err.logged = True  # the cache's own line told the admin
                raise err
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise asyncio.TimeoutError()
            try:
                await asyncio.wait_for(changed.wait(), remaining)
            except asyncio.TimeoutError:
                if deadline is not None and time.monotonic() >= deadline:
                    raise

    async def next_change(self, timeout: float = 30.0, namespace: str | None = None):
        """Return after the next change in `namespace` (or `notify()`), or after `timeout` seconds."""
        try:
            await asyncio.wait_for(self._change_event(namespace).wait(), timeout)
        except asyncio.TimeoutError:
            return  # nothing changed: the caller looks again anyway

    async def wait_synced(self, timeout: float | None = None):
        await self.wait_for(lambda: self.synced, timeout)

    def _node_of(self, vmi: dict) -> tuple[bool, dict | None]:
        """(whether the VMI is unfinished on a node, that node as cached). Without permission to
        read Nodes, nothing is known of them."""
        status = vmi.get("status") or {}
        if not status.get("nodeName") or status.get("phase") in FINAL_PHASES or self.nodes.forbidden:
            return False, None
        return True, self.nodes.get("", status["nodeName"])

    def on_unreachable_node(self, vmi: dict) -> bool:
        """An unfinished VMI on a node that stopped answering (Ready=Unknown, as the node lifecycle
        controller marks it) or that is gone: the machine may still run there and hold its disk,
        so nothing else may start on that disk until the node is fenced. KubeVirt keeps the VMI
        Running meanwhile. (Ready=False is a node that answers and reports a problem.)"""
        placed, node = self._node_of(vmi)
        if not placed:
            return False
        if node is None:
            return True
        ready = [c for c in (node.get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"]
        return bool(ready) and ready[0].get("status") == "Unknown"

    def on_lost_node(self, vmi: dict) -> bool:
        """Unreachable, and KubeVirt has given up on the node's virt-handler after its heartbeat
        timeout (it labels the node kubevirt.io/schedulable=false; pkg/virt-controller/watch/node/
        node.go): a short network blip is not a lost machine."""
        if not self.on_unreachable_node(vmi):
            return False
        _, node = self._node_of(vmi)
        return node is None or ((node.get("metadata") or {}).get("labels") or {}).get(
            "kubevirt.io/schedulable") == "false"

    def events_for(self, namespace: str, names: set[str], prefixes: tuple[str, ...] = ()) -> list[dict]:
        """Cluster Events about the given objects (and those whose names start with a prefix, such
        as a VM's launcher pods), oldest first."""
        if self.events is None:
            return []
        def about(event: dict) -> bool:
            name = (event.get("involvedObject") or {}).get("name") or ""
            return name in names or any(name.startswith(prefix) for prefix in prefixes)

        out = [e for e in self.events.values()
               if (e.get("metadata") or {}).get("namespace") == namespace and about(e)]
        return sorted(out, key=lambda e: (e.get("lastTimestamp") or e.get("eventTime") or "",
                                          int((e.get("metadata") or {}).get("resourceVersion") or 0)))
