"""Controller plumbing: de-duplicating work queues with delayed requeue, and Events."""

from __future__ import annotations

import asyncio
import inspect
import logging
import uuid
from typing import Awaitable, Callable, Hashable

from .resources import BY_KIND
from .timeutil import now_iso

log = logging.getLogger(__name__)


class WorkQueue:
    """Keys to reconcile; a key queued twice before it is handled is handled once."""

    def __init__(self, name: str, handler: Callable[[Hashable], Awaitable[None] | None]):
        self.name = name
        self.handler = handler
        self.pending: dict[Hashable, None] = {}
        self.timers: dict[Hashable, asyncio.TimerHandle] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def add(self, key: Hashable, delay: float = 0.0):
        if delay > 0:
            timer = self.timers.get(key)
            loop = asyncio.get_running_loop()
            when = loop.time() + delay
            if timer is not None and timer.when() <= when:
                return  # an earlier wake-up is already planned
            if timer is not None:
                timer.cancel()
            self.timers[key] = loop.call_at(when, self._fire, key)
            return
        self.pending[key] = None
        self._wake.set()

    def _fire(self, key):
        self.timers.pop(key, None)
        self.add(key)

    def start(self):
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self):
        for t in self.timers.values():
            t.cancel()
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def _run(self):
        while True:
            await self._wake.wait()
            self._wake.clear()
            keys = list(self.pending)
            self.pending.clear()
            for key in keys:
                try:
                    result = self.handler(key)
                    if inspect.isawaitable(result):
                        await result
                except Exception:
                    log.exception("%s: reconciling %s failed; retrying", self.name, key)
                    self.add(key, 1.0)


class EventRecorder:
    """Writes core/v1 Events as the upstream controllers do, folding repeats into `count`."""

    def __init__(self, store):
        self.store = store
        self.rt = BY_KIND["Event"]
        self._recent: dict[tuple, str] = {}

    def record(self, obj: dict, event_type: str, reason: str, message: str, component: str):
        meta = obj["metadata"]
        namespace = meta.get("namespace") or "default"
        key = (namespace, meta["uid"], reason, message)
        now = now_iso()
        existing_name = self._recent.get(key)
        existing = self.store.get(self.rt, namespace, existing_name) if existing_name else None
        if existing is not None:
            updated = dict(existing)
            updated["count"] = existing.get("count", 1) + 1
            updated["lastTimestamp"] = now
            self.store.update(self.rt, updated, check_rv=False)
            return
        name = f"{meta['name']}.{uuid.uuid4().hex[:16]}"
        self._recent[key] = name
        self.store.create(self.rt, {
            "metadata": {"name": name, "namespace": namespace},
            "involvedObject": {"kind": obj["kind"], "namespace": meta.get("namespace", ""), "name": meta["name"],
                               "uid": meta["uid"], "apiVersion": obj["apiVersion"],
                               "resourceVersion": meta.get("resourceVersion", "")},
            "reason": reason, "message": message, "type": event_type, "count": 1,
            "firstTimestamp": now, "lastTimestamp": now, "eventTime": None,
            "source": {"component": component}, "reportingComponent": component, "reportingInstance": "",
        })
