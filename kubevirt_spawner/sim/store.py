"""The simulated etcd: objects, resourceVersions, watch history, finalizers, garbage collection
and persistence to the state directory."""

from __future__ import annotations

import asyncio
import collections
import copy
import json
import logging
import os
import uuid
from dataclasses import dataclass, field
from typing import Callable

from ..objects import field_value
from . import errors
from .resources import BY_KEY, ResourceType
from .timeutil import now_iso

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (group, plural)
# (named here: inside Store, `list` is its method)
Dependents = list[tuple[ResourceType, dict]]
History = list[tuple[str, dict, dict | None]]


@dataclass(eq=False)
class Watcher:
    rt: ResourceType
    namespace: str | None
    label_match: Callable[[dict], bool]
    field_match: Callable[[dict], bool]
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    closed: bool = False

    def matches(self, obj: dict | None) -> bool:
        if obj is None:
            return False
        meta = obj["metadata"]
        if self.namespace and meta.get("namespace") != self.namespace:
            return False
        return self.label_match(meta.get("labels") or {}) and self.field_match(obj)

    def close(self):
        if not self.closed:
            self.closed = True
            self.queue.put_nowait(None)


def _graceful_pod(rt: ResourceType, obj: dict, grace_period: int | None) -> bool:
    """A running pod on a node is deleted gracefully: it is only marked, and its kubelet removes it
    once its containers have stopped (pkg/registry/core/pod/strategy.go, CheckGracefulDelete)."""
    return rt.kind == "Pod" and grace_period != 0 and bool(field_value(obj, "spec.nodeName")) \
        and field_value(obj, "status.phase") not in ("Succeeded", "Failed")


class Store:
    """All objects of the simulated cluster; every write goes through here."""

    def __init__(self, state_dir: str | None, history: int = 20000):
        self.state_dir = state_dir
        self.objects: dict[Key, dict[tuple[str, str], dict]] = {k: {} for k in BY_KEY}
        self.by_uid: dict[str, tuple[Key, str, str]] = {}
        self.rv = 0
        self.history: collections.deque = collections.deque(maxlen=history)
        self.watchers: set[Watcher] = set()
        self.listeners: list[Callable[[str, ResourceType, dict, dict | None], None]] = []
        self._dirty = False
        self._path = os.path.join(state_dir, "objects.json") if state_dir else None
        if self._path and os.path.exists(self._path):
            self._load(self._path)

    # ---------- persistence
    def _load(self, path: str):
        with open(path) as f:
            data = json.load(f)
        self.rv = data["resourceVersion"]
        for obj in data["objects"]:
            group = obj["apiVersion"].split("/")[0] if "/" in obj["apiVersion"] else ""
            rt = next(rt for rt in BY_KEY.values() if rt.group == group and rt.kind == obj["kind"])
            meta = obj["metadata"]
            self.objects[rt.key][(meta.get("namespace", ""), meta["name"])] = obj
            self.by_uid[meta["uid"]] = (rt.key, meta.get("namespace", ""), meta["name"])

    def flush(self):
        if not self._path or not self._dirty:
            return
        self._dirty = False
        data = {"resourceVersion": self.rv,
                "objects": [o for objs in self.objects.values() for o in objs.values()]}
        tmp = self._path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, separators=(",", ":"))
        os.replace(tmp, self._path)

    async def flush_forever(self, interval: float = 0.5):
        while True:
            await asyncio.sleep(interval)
            try:
                self.flush()
            except OSError:
                log.exception("could not persist the simulator's objects")

    # ---------- reads (callers get the stored dict: copy before changing it)
    def get(self, rt: ResourceType, namespace: str, name: str) -> dict | None:
        return self.objects[rt.key].get((namespace if rt.namespaced else "", name))

    def must_get(self, rt: ResourceType, namespace: str, name: str) -> dict:
        obj = self.get(rt, namespace, name)
        if obj is None:
            raise errors.not_found(rt, name)
        return obj

    def list(self, rt: ResourceType, namespace: str | None = None) -> list[dict]:
        objs = self.objects[rt.key]
        if namespace and rt.namespaced:
            return [o for (ns, _), o in objs.items() if ns == namespace]
        return list(objs.values())

    def by_uid_get(self, uid: str) -> tuple[ResourceType, dict] | None:
        ref = self.by_uid.get(uid)
        if ref is None:
            return None
        key, ns, name = ref
        return BY_KEY[key], self.objects[key][(ns, name)]

    # ---------- writes
    def _next_rv(self) -> str:
        self.rv += 1
        return str(self.rv)

    def _emit(self, kind: str, rt: ResourceType, obj: dict, old: dict | None):
        self._dirty = True
        self.history.append((self.rv, rt.key, kind, obj, old))
        for w in list(self.watchers):
            if w.rt.key == rt.key and not w.closed:
                deliver = watch_event_for(w, kind, obj, old)
                if deliver:
                    w.queue.put_nowait(deliver)
        for listener in self.listeners:
            try:
                listener(kind, rt, obj, old)
            except Exception:  # a controller bug must not break the API server
                log.exception("store listener failed")

    def create(self, rt: ResourceType, obj: dict) -> dict:
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise errors.invalid(rt, "", [{"field": "metadata.name",
                                               "message": "Required value: name or generateName is required",
                                               "reason": "FieldValueRequired"}])
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        ns = meta.get("namespace", "") if rt.namespaced else ""
        if rt.namespaced:
            meta["namespace"] = ns
        else:
            meta.pop("namespace", None)
        if (ns, meta["name"]) in self.objects[rt.key]:
            raise errors.already_exists(rt, meta["name"])
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = now_iso()
        meta["generation"] = 1
        meta.pop("deletionTimestamp", None)
        meta["resourceVersion"] = self._next_rv()
        obj["apiVersion"] = rt.api_version(obj.get("apiVersion", "").split("/")[-1]
                                           if obj.get("apiVersion", "").split("/")[-1] in rt.versions else None)
        obj["kind"] = rt.kind
        self.objects[rt.key][(ns, meta["name"])] = obj
        self.by_uid[meta["uid"]] = (rt.key, ns, meta["name"])
        self._emit("ADDED", rt, obj, None)
        return obj

    def update(self, rt: ResourceType, obj: dict, *, subresource: str | None = None,
               check_rv: bool = True) -> dict:
        """Replace an object. `subresource="status"` keeps everything but status; a plain update of
        a kind with a status subresource keeps the stored status. A stale resourceVersion is a 409."""
        meta = obj.get("metadata") or {}
        name = meta.get("name", "")
        ns = meta.get("namespace", "") if rt.namespaced else ""
        old = self.get(rt, ns, name)
        if old is None:
            raise errors.not_found(rt, name)
        if check_rv and meta.get("resourceVersion") and meta["resourceVersion"] != old["metadata"]["resourceVersion"]:
            raise errors.stale(rt, name)
        new = copy.deepcopy(obj)
        if subresource == "status":
            status = new.get("status")
            new = copy.deepcopy(old)
            if status is None:
                new.pop("status", None)
            else:
                new["status"] = status
        else:
            if "status" in rt.subresources:
                if "status" in old:
                    new["status"] = copy.deepcopy(old["status"])
                else:
                    new.pop("status", None)
            nm = new.setdefault("metadata", {})
            om = old["metadata"]
            for immutable in ("uid", "creationTimestamp", "namespace", "deletionTimestamp", "generation"):
                if immutable in om:
                    nm[immutable] = om[immutable]
                else:
                    nm.pop(immutable, None)
            if not rt.namespaced:
                nm.pop("namespace", None)
            if _spec_of(new) != _spec_of(old):
                nm["generation"] = om.get("generation", 1) + 1
            if om.get("deletionTimestamp") and _added_finalizers(om, nm):
                raise errors.forbidden(rt, name, "no new finalizers can be added if the object is being deleted")
        new["apiVersion"], new["kind"] = old["apiVersion"], old["kind"]
        new["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
        if new == old:
            return old  # a write that changes nothing keeps the resourceVersion, as upstream
        new["metadata"]["resourceVersion"] = self._next_rv()
        self.objects[rt.key][(ns, name)] = new
        if new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers") \
                and rt.kind != "Pod":  # a terminating pod goes when its kubelet (or podgc) says so
            return self._remove(rt, new)
        self._emit("MODIFIED", rt, new, old)
        return new

    def delete(self, rt: ResourceType, namespace: str, name: str, propagation: str | None = None,
               precondition_uid: str | None = None, precondition_rv: str | None = None,
               grace_period: int | None = None) -> dict:
        obj = self.must_get(rt, namespace, name)
        meta = obj["metadata"]
        if precondition_uid and precondition_uid != meta["uid"]:
            raise errors.conflict(rt, name, f"Precondition failed: UID in precondition: {precondition_uid}, "
                                            f"UID in object meta: {meta['uid']}")
        if precondition_rv and precondition_rv != meta["resourceVersion"]:
            raise errors.conflict(rt, name, "Precondition failed: ResourceVersion in precondition: "
                                            f"{precondition_rv}, ResourceVersion in object meta: "
                                            f"{meta['resourceVersion']}")
        propagation = propagation or "Background"
        if propagation not in ("Background", "Foreground", "Orphan"):
            raise errors.bad_request(f'unsupported propagation policy "{propagation}"')
        finalizers = list(meta.get("finalizers") or [])
        if propagation == "Foreground" and self.dependents(meta["uid"]):
            if "foregroundDeletion" not in finalizers:
                finalizers.append("foregroundDeletion")
        if propagation == "Orphan" and self.dependents(meta["uid"]):
            self._orphan(meta["uid"])
        if finalizers or _graceful_pod(rt, obj, grace_period):
            if meta.get("deletionTimestamp") and finalizers == list(meta.get("finalizers") or []):
                return obj
            new = copy.deepcopy(obj)
            new["metadata"]["finalizers"] = finalizers
            new["metadata"].setdefault("deletionTimestamp", now_iso())
            if grace_period is not None:
                new["metadata"]["deletionGracePeriodSeconds"] = grace_period
            new["metadata"]["resourceVersion"] = self._next_rv()
            self.objects[rt.key][(meta.get("namespace", ""), name)] = new
            self._emit("MODIFIED", rt, new, obj)
            if "foregroundDeletion" in finalizers:
                for drt, dep in self.dependents(meta["uid"]):
                    self._delete_quietly(drt, dep, "Foreground")
                self._maybe_finish_foreground(meta["uid"])
            return new
        return self._remove(rt, obj)

    def _remove(self, rt: ResourceType, obj: dict) -> dict:
        meta = obj["metadata"]
        key = (meta.get("namespace", ""), meta["name"])
        if self.objects[rt.key].pop(key, None) is None:
            return obj
        self.by_uid.pop(meta["uid"], None)
        gone = copy.deepcopy(obj)
        gone["metadata"]["resourceVersion"] = self._next_rv()
        self._emit("DELETED", rt, gone, obj)
        self._collect_garbage(meta["uid"])
        for ref in meta.get("ownerReferences") or []:
            self._maybe_finish_foreground(ref["uid"])
        return gone

    # ---------- garbage collection by ownerReferences
    def dependents(self, owner_uid: str) -> Dependents:
        out = []
        for key, objs in self.objects.items():
            for o in objs.values():
                if any(r.get("uid") == owner_uid for r in o["metadata"].get("ownerReferences") or []):
                    out.append((BY_KEY[key], o))
        return out

    def _orphan(self, owner_uid: str):
        for rt, dep in self.dependents(owner_uid):
            new = copy.deepcopy(dep)
            new["metadata"]["ownerReferences"] = [r for r in dep["metadata"]["ownerReferences"]
                                                  if r.get("uid") != owner_uid]
            if not new["metadata"]["ownerReferences"]:
                del new["metadata"]["ownerReferences"]
            self.update(rt, new, check_rv=False)

    def _collect_garbage(self, owner_uid: str):
        for rt, dep in self.dependents(owner_uid):
            live = [r for r in dep["metadata"]["ownerReferences"] if r.get("uid") in self.by_uid]
            if not live:
                self._delete_quietly(rt, dep, "Background")

    def _delete_quietly(self, rt: ResourceType, obj: dict, propagation: str):
        try:
            self.delete(rt, obj["metadata"].get("namespace", ""), obj["metadata"]["name"], propagation)
        except errors.ApiError:
            pass

    def _maybe_finish_foreground(self, owner_uid: str):
        found = self.by_uid_get(owner_uid)
        if not found:
            return
        rt, owner = found
        meta = owner["metadata"]
        blocking = [d for _, d in self.dependents(owner_uid)
                    if any(r.get("uid") == owner_uid and r.get("blockOwnerDeletion")
                           for r in d["metadata"].get("ownerReferences") or [])]
        if meta.get("deletionTimestamp") and "foregroundDeletion" in (meta.get("finalizers") or []) and not blocking:
            new = copy.deepcopy(owner)
            new["metadata"]["finalizers"] = [f for f in meta["finalizers"] if f != "foregroundDeletion"]
            self.update(rt, new, check_rv=False)

    # ---------- watches
    def events_since(self, rt: ResourceType, rv: int) -> History | None:
        """History after `rv` for one kind, or None when `rv` is older than what is kept (410 Gone)."""
        if self.history and rv < self.history[0][0] - 1 and len(self.history) == self.history.maxlen:
            return None
        return [(kind, obj, old) for (erv, key, kind, obj, old) in self.history if erv > rv and key == rt.key]

    def cut_watches(self):
        for w in list(self.watchers):
            w.close()
        self.watchers.clear()


def watch_event_for(w: Watcher, kind: str, obj: dict, old: dict | None) -> tuple[str, dict] | None:
    """What a filtered watch sees: an object that starts or stops matching is ADDED or DELETED."""
    now, before = w.matches(obj), w.matches(old)
    if kind == "DELETED":
        return ("DELETED", obj) if before or now else None
    if now and not before:
        return ("ADDED", obj)
    if before and not now:
        return ("DELETED", obj)
    if now:
        return (kind, obj)
    return None


def _spec_of(obj: dict) -> dict:
    return {k: v for k, v in obj.items() if k not in ("metadata", "status", "apiVersion", "kind")}


def _added_finalizers(old_meta: dict, new_meta: dict) -> bool:
    return bool(set(new_meta.get("finalizers") or []) - set(old_meta.get("finalizers") or []))
