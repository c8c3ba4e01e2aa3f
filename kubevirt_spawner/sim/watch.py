"""A watch request's answer, as the API server streams it (staging/src/k8s.io/apiserver/pkg/
endpoints/handlers/watch.go): the objects there now, or the changes since a resourceVersion
(410 Gone when that is too old), then each change as it comes, batched, with BOOKMARKs as the
watch cache sends them, until the timeout or the client goes."""

from __future__ import annotations

import asyncio
import json
from typing import Callable

import tornado.iostream
import tornado.web
from tornado.http1connection import HTTP1Connection

from . import errors
from .resources import ResourceType
from .selectors import parse_field_selector, parse_label_selector
from .store import Store, Watcher, watch_event_for


class WatchStream:
    def __init__(self, handler: tornado.web.RequestHandler, store: Store, bookmark_seconds: Callable[[], float],
                 rt: ResourceType, namespace: str, name: str | None):
        self.handler = handler  # (the response is written through it)
        self.store = store
        self.bookmark_seconds = bookmark_seconds  # (the simulator's timing, which may change meanwhile)
        self.rt = rt
        self.namespace = namespace
        field_sel = handler.get_argument("fieldSelector", None)
        if name:
            field_sel = ",".join(filter(None, [field_sel, f"metadata.name={name}"]))
        self.watcher = Watcher(rt, namespace or None, parse_label_selector(handler.get_argument("labelSelector", None)),
                               parse_field_selector(field_sel))
        self.version = handler.request.path.split("/")[3] if rt.group else "v1"

    def close(self):
        self.watcher.close()

    async def serve(self):
        h, w, rt = self.handler, self.watcher, self.rt
        rv_arg = h.get_argument("resourceVersion", "")
        timeout = float(h.get_argument("timeoutSeconds", "0") or 0) or 1800.0
        bookmarks = h.get_argument("allowWatchBookmarks", "") == "true"
        h.set_header("Content-Type", "application/json")
        initial: list = []
        if rv_arg in ("", "0"):
            initial = [("ADDED", o) for o in self.store.list(rt, self.namespace or None) if w.matches(o)]
        else:
            try:
                since = int(rv_arg)
            except ValueError:
                raise errors.bad_request(f'invalid resource version "{rv_arg}"') from None
            history = self.store.events_since(rt, since)
            if history is None:
                err = errors.gone(f"too old resource version: {since} ({self.store.history[0][0]})")
                h.write(json.dumps({"type": "ERROR", "object": err.status()}) + "\n")
                return h.finish()
            for kind, obj, old in history:
                ev = watch_event_for(w, kind, obj, old)
                if ev:
                    initial.append(ev)
        self.store.watchers.add(w)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            for kind, obj in initial:
                h.write(self._event_line(kind, obj))
            await h.flush()
            next_bookmark = loop.time() + self.bookmark_seconds()
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    if bookmarks and w.queue.empty():  # and one right before the deadline, as the watch
                        h.write(self._bookmark_line())  # cache sends it; never past an event
                    break
                try:
                    wait = min(remaining, next_bookmark - loop.time()) if bookmarks else remaining
                    ev = await asyncio.wait_for(w.queue.get(), max(wait, 0))
                except asyncio.TimeoutError:
                    if bookmarks and loop.time() >= next_bookmark:
                        # Nothing is queued for this watcher: every change up to now has reached it.
                        h.write(self._bookmark_line())
                        await h.flush()
                        next_bookmark = loop.time() + self.bookmark_seconds()
                    continue
                if ev is None:
                    break
                chunk = [self._event_line(ev[0], ev[1])]
                while not w.queue.empty():  # batch what is already queued into one write
                    nxt = w.queue.get_nowait()
                    if nxt is None:
                        w.closed = True
                        break
                    chunk.append(self._event_line(nxt[0], nxt[1]))
                h.write("".join(chunk))
                await h.flush()
                if w.closed:
                    break
        except tornado.iostream.StreamClosedError:
            pass
        finally:
            w.close()
            self.store.watchers.discard(w)
        connection = h.request.connection
        if isinstance(connection, HTTP1Connection) and not connection.stream.closed():
            h.finish()

    def _bookmark_line(self) -> str:
        """A BOOKMARK (staging/src/k8s.io/apiserver/pkg/storage/cacher/cacher.go): an object of the
        kind with only its resourceVersion, the store's current one."""
        obj = {"kind": self.rt.kind, "apiVersion": self.rt.api_version(self.version),
               "metadata": {"resourceVersion": str(self.store.rv)}}
        return json.dumps({"type": "BOOKMARK", "object": obj}, separators=(",", ":")) + "\n"

    def _event_line(self, kind: str, obj: dict) -> str:
        return json.dumps({"type": kind, "object": self.rt.versioned(obj, self.version)}, separators=(",", ":")) + "\n"
