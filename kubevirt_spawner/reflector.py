"""Shared watch-based caches of the objects the spawner waits on.

Each `Reflector` lists one kind once, then follows a watch from that resourceVersion, in its own
thread; a 410 Gone or a broken stream starts over with a fresh list. Changes are applied on the
event loop thread, so readers never see a half-applied update and need no locks. `Caches` groups
the reflectors and wakes every waiter on any change: `poll()` and progress read from here and
make no API requests. They log through the Kube client's logger (the hub's).
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from typing import Callable, TypeVar

from . import kube as k

T = TypeVar("T")

# Scheduling and attach failures are Events on the virt-launcher Pod, as on any cluster.
WATCHED_EVENT_KINDS = {"VirtualMachine", "VirtualMachineInstance", "DataVolume", "PersistentVolumeClaim", "Pod"}
FINAL_PHASES = ("Succeeded", "Failed")


def _key(obj: dict) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return meta.get("namespace") or "", meta.get("name") or ""


def slim(obj: dict) -> dict:
    """What the caches keep of an object: no `managedFields` (server-side apply bookkeeping that
    no reader uses and that can be most of an object's size)."""
    meta = obj.get("metadata")
    if isinstance(meta, dict):
        meta.pop("managedFields", None)
    return obj


class Reflector:
    def __init__(self, kube: k.Kube, kind: k.Kind, on_change: Callable[[], None], namespace: str | None = None,
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
        self._on_change = on_change
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._response = None

    def start(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name=f"reflector-{self.kind.plural}", daemon=True)
        self._thread.start()

    def stop(self):
        self._stopping.set()
        response = self._response
        if response is not None:
            try:
                # shutdown() (not close()) is the thread-safe way to end a blocked read now.
                getattr(response, "shutdown", response.close)()
            except Exception:  # a response that is already closed or broken
                self.kube.log.debug("closing the %s watch failed", self.kind.plural, exc_info=True)

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
        self._on_change()

    def _forbid(self, err: k.KubeError):
        if self.optional:
            self._replace_all([])
        self.forbidden = True
        self.refusal = err
        self._on_change()

    def _failed(self, err: k.KubeError):
        self.last_error = err

    def _apply(self, event_type: str, obj: dict):
        key = _key(obj)
        if event_type == "DELETED" or not self.keep(obj):
            self.objects.pop(key, None)
        else:
            self.objects[key] = obj
        self._on_change()

    def _post(self, fn, *args):
        if self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # the loop closed between the check and the call
                self._stopping.set()

    # ------------------------------------------------ in the thread
    def _query(self) -> dict:
        query: dict[str, str] = {}
        if self.label_selector:
            query["labelSelector"] = self.label_selector
        if self.field_selector:
            query["fieldSelector"] = self.field_selector
        return query

    def _run(self):
        failures = 0
        while not self._stopping.is_set():
            try:
                listing = self.kube.request("GET", self.kind.path(self.namespace), self._query() or None) or {}
                version = (listing.get("metadata") or {}).get("resourceVersion", "")
                self._post(self._replace_all, [slim(o) for o in listing.get("items") or []])
                failures = 0
                self._follow(version)
            except k.KubeError as err:
                if self._stopping.is_set():
                    return
                if err.status == 403:
                    if not self.forbidden:  # once, not at every retry
                        self._log_refusal(err)
                    err.logged = True
                    self._post(self._forbid, err)
                    self._stopping.wait(300 if self.optional else 60)
                    continue
                self._post(self._failed, err)
                failures += 1
                delay = min(0.5 * 2 ** min(failures, 6), 30.0) * (0.5 + random.random() / 2)
                level = logging.DEBUG if err.status == 410 else logging.WARNING
                self.kube.log.log(level, "watch of %s restarting in %.1fs: %s", self.kind.plural, delay, err)
                if err.status == 410:
                    delay = 0
                self._stopping.wait(delay)
            except Exception:  # never let the cache die silently
                if self._stopping.is_set():
                    return
                self.kube.log.exception("watch of %s failed", self.kind.plural)
                self._stopping.wait(5)

    def _log_refusal(self, err: k.KubeError):
        need = f"list and watch {self.kind.plural}" + (f" ({self.kind.group})" if self.kind.group else "")
        if self.optional:
            self.kube.log.warning("cannot read %s: %s. Going on without them; the hub's ServiceAccount needs %s "
                                  "(see deploy/rbac/)", self.kind.plural, err, need)
        else:
            self.kube.log.error("cannot read %s: %s. No workstation can start or stop until the hub's "
                                "ServiceAccount may %s (see deploy/rbac/)", self.kind.plural, err, need)

    def _follow(self, version: str):
        """Follow the watch until the server ends it; raise KubeError when it must restart."""
        while not self._stopping.is_set():
            query = {**self._query(), "watch": "1", "resourceVersion": version, "allowWatchBookmarks": "true",
                     "timeoutSeconds": str(random.randint(240, 360))}
            lines = self.kube.stream_lines(self.kind.path(self.namespace), query, (10, 400),
                                           on_open=lambda raw: setattr(self, "_response", raw))
            for event in lines:
                if self._stopping.is_set():
                    return
                obj = event.get("object") or {}
                if event.get("type") == "ERROR":
                    raise k.KubeError(obj.get("code", 500), obj.get("reason", ""), obj.get("message", ""))
                if event.get("type") == "BOOKMARK":
                    version = obj["metadata"]["resourceVersion"]
                    continue
                version = (obj.get("metadata") or {}).get("resourceVersion", version)
                self._post(self._apply, event["type"], slim(obj))


class Caches:
    """The reflectors one hub shares between all its spawners."""

    def __init__(self, kube: k.Kube, label_selector: str, namespace: str | None = None, events: bool = True):
        self.kube = kube
        self._changed: asyncio.Event | None = None
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
        self.reflectors = [self.vms, self.vmis, self.dvs, self.pvcs, self.services, self.nodes]
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
        self._changed = asyncio.Event()
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

    def notify(self):
        """Wake every waiter to re-check (for changes that are not in the cluster)."""
        self._notify()

    def _notify(self):
        if self._changed is not None:
            self._changed.set()
            self._changed = asyncio.Event()

    def _change_event(self) -> asyncio.Event:
        """The event the next change sets (the caches start with the first waiter)."""
        self.start()
        assert self._changed is not None  # start() made it
        return self._changed

    async def wait_for(self, predicate: Callable[[], T | None], timeout: float | None = None) -> T:
        """Wait until `predicate()` returns something truthy, re-checking on every cache change.
        Raises the KubeError of a needed cache the hub may not read: nothing would ever change."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            changed = self._change_event()
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

    async def next_change(self, timeout: float = 30.0):
        """Return after the next change (or `notify()`), or after `timeout` seconds."""
        try:
            await asyncio.wait_for(self._change_event().wait(), timeout)
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
