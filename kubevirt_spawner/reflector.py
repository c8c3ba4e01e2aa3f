"""Shared watch-based caches of the objects the spawner waits on.

Each `Reflector` lists one kind once, then follows a watch from that resourceVersion, in a task on
the hub's event loop; a 410 Gone or a broken stream starts over with a fresh list. Changes are
applied between two awaits, so readers never see a half-applied update and need no locks.
`Caches` groups the reflectors and wakes the waiters of the namespaces that changed: `poll()` and
progress read from here and make no API requests. They log through the Kube client's logger (the
hub's).

The hub may read and write only in the user namespaces it has bound its namespaced role in
(deploy/rbac/), so the namespaced kinds are watched one namespace at a time (`PerNamespace`): the
namespaces labelled as this project's are followed cluster-wide, and each is bound and watched as
it appears (a hub with one shared namespace watches only that one).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Any, Awaitable, Callable, Collection, TypeVar, ValuesView

from . import kube as k
from . import manifests as m
from .objects import FINAL_PHASES, field_value

T = TypeVar("T")

BIND_RETRY_SECONDS = 30.0
BIND_SETTLE_SECONDS = 10.0

# Scheduling and attach failures are Events on the virt-launcher Pod, as on any cluster.
WATCHED_EVENT_KINDS = {"VirtualMachine", "VirtualMachineInstance", "DataVolume", "PersistentVolumeClaim", "Pod"}


def _key(obj: dict[str, Any]) -> tuple[str, str]:
    meta = obj.get("metadata") or {}
    return meta.get("namespace") or "", meta.get("name") or ""


LAST_APPLIED = "kubectl.kubernetes.io/last-applied-configuration"


def slim(obj: dict[str, Any]) -> dict[str, Any]:
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


async def within(awaitable: Awaitable[T], timeout: float | None) -> T:
    """The result of `awaitable`, or asyncio.TimeoutError after `timeout` seconds (which cancels
    it). asyncio.wait_for, except that a cancellation is never lost: on Python 3.11 wait_for
    returns the result of an inner task that ends as the caller is cancelled (fixed in 3.12 by the
    rewrite on asyncio.timeout), and a cancelled start must never go on."""
    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout)
    except BaseException:
        task.cancel()  # (it cleans up after itself: the clone gate gives back a place)
        raise
    if not done:
        task.cancel()
        await asyncio.wait({task})
        raise asyncio.TimeoutError()
    return task.result()


async def _wait_event(event: asyncio.Event, timeout: float | None) -> bool:
    """Whether `event` was set within `timeout` seconds."""
    try:
        await within(event.wait(), timeout)
        return True
    except asyncio.TimeoutError:
        return False


class Reflector:
    def __init__(self, kube: k.Kube, kind: k.Kind, on_change: Callable[[str | None], None],
                 namespace: str | None = None,
                 label_selector: str | None = None, keep: Callable[[dict[str, Any]], bool] | None = None,
                 field_selector: str | None = None, optional: bool = False,
                 prepare: Callable[[], Awaitable[None]] | None = None):
        self.kube, self.kind, self.namespace = kube, kind, namespace
        # Awaited before a list that follows a refusal (binding the hub in the namespace again).
        self.prepare = prepare
        # Until then a refusal is asked again soon, not reported (a binding made just now).
        self.patient_until = 0.0
        self.label_selector, self.field_selector = label_selector, field_selector
        self.keep = keep or (lambda obj: True)
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
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
        # Per-object listeners (object or None when gone, its key) and whole-cache ones (a relist:
        # all the objects, and the namespace they are all of, None for the whole cluster).
        self.on_object: list[Callable[[dict[str, Any] | None, tuple[str, str]], None]] = []
        self.on_reset: list[Callable[[Collection[dict[str, Any]], str | None], None]] = []
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._stopping = False
        where = f"-{self.namespace}" if self.namespace else ""
        self._task = loop.create_task(self._run(), name=f"reflector-{self.kind.plural}{where}")

    def stop(self) -> None:
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

    def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.objects.get((namespace, name))

    def values(self) -> ValuesView[dict[str, Any]]:
        return self.objects.values()

    # ------------------------------------------------ on the event loop
    def _replace_all(self, items: list[dict[str, Any]]) -> None:
        self.forbidden = False
        self.refusal = None
        self.last_error = None
        self.objects = {_key(o): o for o in items if self.keep(o)}
        self.synced = True
        for reset in self.on_reset:
            reset(self.objects.values(), self.namespace)
        self._on_change(self.namespace)

    def _forbid(self, err: k.KubeError) -> None:
        if self.optional:
            self._replace_all([])
        self.forbidden = True
        self.refusal = err
        self._on_change(self.namespace)

    def _failed(self, err: k.KubeError) -> None:
        self.last_error = err

    def _apply(self, changes: list[tuple[str, dict[str, Any]]]) -> None:
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
    def _query(self) -> dict[str, Any]:
        query: dict[str, str] = {}
        if self.label_selector:
            query["labelSelector"] = self.label_selector
        if self.field_selector:
            query["fieldSelector"] = self.field_selector
        return query

    async def _run(self) -> None:
        failures = 0
        told = False  # the admin has read that the hub may not read these (told once)
        while not self._stopping:
            try:
                if self.forbidden and self.prepare is not None:
                    await self.prepare()
                listing = await self.kube.call("GET", self.kind.path(self.namespace), self._query() or None) or {}
                version = (listing.get("metadata") or {}).get("resourceVersion", "")
                self.patient_until = 0.0  # listed: the authorizer knows the binding
                self._replace_all([slim(o) for o in listing.get("items") or []])
                failures = 0
                await self._follow(version)
            except k.KubeError as err:
                if self._stopping:
                    return
                if err.status == 403 and time.monotonic() < self.patient_until:
                    self._failed(err)
                    await asyncio.sleep(0.5)
                    continue
                if err.status == 403 or (self.optional and err.status == 404):  # refused, or not served here
                    if not told:  # once, not at every retry
                        self._log_refusal(err)
                        told = True
                    self._forbid(err.again(logged=True))
                    await asyncio.sleep(300 if self.optional else 60)
                    continue
                self._failed(err)
                told = False  # another problem: a refusal after it is news again
                failures += 1
                delay = min(0.5 * 2 ** min(failures, 6), 30.0) * (0.5 + random.random() / 2)
                level = logging.DEBUG if err.status == 410 else logging.WARNING
                self.kube.log.log(level, "watch of %s restarting in %.1fs: %s", self.describe(), delay, err)
                await asyncio.sleep(0 if err.status == 410 else delay)
            except Exception:  # never let the cache die silently
                if self._stopping:
                    return
                self.kube.log.exception("watch of %s failed", self.describe())
                await asyncio.sleep(5)

    def describe(self) -> str:
        """What this reflector watches, for a log line."""
        return self.kind.plural + (f" in {self.namespace}" if self.namespace else "")

    def _log_refusal(self, err: k.KubeError) -> None:
        need = f"list and watch {self.kind.plural}" + (f" ({self.kind.group})" if self.kind.group else "")
        if self.namespace:
            need += f" in {self.namespace} (ClusterRole {m.HUB_NAMESPACED_ROLE}, bound there)"
        if self.optional:
            self.kube.log.warning("cannot read %s: %s. Going on without them; the hub's ServiceAccount needs %s "
                                  "(see deploy/rbac/)", self.describe(), err, need)
        else:
            self.kube.log.error("cannot read %s: %s. No workstation%s can start or stop until the hub's "
                                "ServiceAccount may %s (see deploy/rbac/)", self.describe(), err,
                                f" in {self.namespace}" if self.namespace else "", need)

    async def _follow(self, version: str) -> None:
        """Follow the watch until the server ends it; raise KubeError when it must restart."""
        while not self._stopping:
            query = {**self._query(), "watch": "1", "resourceVersion": version, "allowWatchBookmarks": "true",
                     "timeoutSeconds": str(random.randint(240, 360))}
            async for batch in self.kube.watch(self.kind.path(self.namespace), query, 400):
                changes: list[tuple[str, dict[str, Any]]] = []
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


class PerNamespace:
    """One namespaced kind, read as one cache: a Reflector for each namespace the hub watches."""

    def __init__(self, kind: k.Kind, optional: bool, make: Callable[[str], Reflector]):
        self.kind, self.optional = kind, optional
        self._make = make
        self.members: dict[str, Reflector] = {}
        # Listeners as a Reflector has them; a relist is of one namespace.
        self.on_object: list[Callable[[dict[str, Any] | None, tuple[str, str]], None]] = []
        self.on_reset: list[Callable[[Collection[dict[str, Any]], str | None], None]] = []

    def add(self, namespace: str, loop: asyncio.AbstractEventLoop | None) -> Reflector:
        """The namespace's reflector, made and (on `loop`) started if it is new."""
        member = self.members.get(namespace)
        if member is None:
            member = self.members[namespace] = self._make(namespace)
            member.on_object.append(self._object)
            member.on_reset.append(self._reset)
            if loop is not None:
                member.start(loop)
        return member

    def drop(self, namespace: str) -> None:
        """Stop watching a namespace (it is gone): its objects went with it."""
        member = self.members.pop(namespace, None)
        if member is not None:
            member.stop()
            self._reset([], namespace)

    def stop(self) -> None:
        for member in self.members.values():
            member.stop()

    def _object(self, obj: dict[str, Any] | None, key: tuple[str, str]) -> None:
        for listener in self.on_object:
            listener(obj, key)

    def _reset(self, objects: Collection[dict[str, Any]], namespace: str | None) -> None:
        for reset in self.on_reset:
            reset(objects, namespace)

    def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        member = self.members.get(namespace)
        return None if member is None else member.get(namespace, name)

    def values(self) -> list[dict[str, Any]]:
        return [obj for member in self.members.values() for obj in member.values()]

    def in_namespace(self, namespace: str) -> Collection[dict[str, Any]]:
        member = self.members.get(namespace)
        return () if member is None else member.values()

    @property
    def synced(self) -> bool:
        return all(member.synced for member in self.members.values())

    def synced_in(self, namespace: str) -> bool:
        member = self.members.get(namespace)
        return member is not None and member.synced

    def refusal_in(self, namespace: str) -> k.KubeError | None:
        member = self.members.get(namespace)
        return None if member is None else member.refusal


class Caches:
    """The reflectors one hub shares between all its spawners."""

    def __init__(self, kube: k.Kube, label_selector: str, namespace: str | None = None, events: bool = True):
        self.kube = kube
        # Waiters wake on changes in their namespace (None: on any change), not on every event.
        self._changed: dict[str | None, asyncio.Event] = {}
        sel = label_selector

        def watched_event(ev: dict[str, Any]) -> bool:
            involved = ev.get("involvedObject") or {}
            if involved.get("kind") == "Pod":  # of the pods, only KubeVirt's launchers
                return (involved.get("name") or "").startswith("virt-launcher-")
            return involved.get("kind") in WATCHED_EVENT_KINDS

        def per_namespace(kind: k.Kind, selector: str | None, optional: bool = False, **options: Any) -> PerNamespace:
            def make(ns: str) -> Reflector:
                return Reflector(kube, kind, self._notify, ns, selector, optional=optional,
                                 prepare=lambda: self._bind(ns), **options)
            return PerNamespace(kind, optional, make)

        self.vms = per_namespace(k.VM, sel)
        self.vmis = per_namespace(k.VMI, sel)
        self.dvs = per_namespace(k.DV, sel)
        self.pvcs = per_namespace(k.PVC, sel)
        self.services = per_namespace(k.SERVICE, sel)
        # Snapshots (optional: a cluster without KubeVirt's snapshot API still runs workstations).
        self.snapshots = per_namespace(k.SNAPSHOT, sel, optional=True)
        self.namespaced = [self.vms, self.vmis, self.dvs, self.pvcs, self.services, self.snapshots]
        self.events = None
        if events:
            # Warnings only: they say why a start waits or fails, and they are a small share of a
            # busy cluster's Events (which carry no labels to select ours by).
            # Optional: without them a start only says less about why it waits.
            self.events = per_namespace(k.EVENT, None, optional=True, keep=watched_event,
                                        field_selector="type=Warning")
            self.namespaced.append(self.events)
        # Whether a machine's node still answers: KubeVirt leaves the VMI Running on a lost node.
        self.nodes = Reflector(kube, k.NODE, self._notify, optional=True)
        # How CDI clones into each StorageClass (copy, or copy-on-write): the clone queue needs it.
        self.storage_profiles = Reflector(kube, k.STORAGE_PROFILE, self._notify, optional=True)
        self.cluster = [self.nodes, self.storage_profiles]
        # The namespaces to watch: the one shared namespace, or those labelled as this project's
        # (the hub labels the ones it makes; the admission policy lets it act in no other).
        self.shared_namespace = namespace
        self.namespaces: Reflector | None = None
        if namespace is None:
            self.namespaces = Reflector(kube, k.NAMESPACE, self._notify,
                                        label_selector=f"app.kubernetes.io/managed-by={m.MANAGED_BY}")
            self.namespaces.on_object.append(self._namespace_changed)
            self.namespaces.on_reset.append(self._namespaces_listed)
            self.cluster.append(self.namespaces)
        self._watching: dict[str, asyncio.Task[None]] = {}  # namespace: its binding and watches, once
        self._binding: dict[str, asyncio.Lock] = {}
        self._bind_refused: dict[str, tuple[float, str]] = {}  # namespace: when, and what it said
        self._username: str | None = None
        self._whoami_lock = asyncio.Lock()
        self._explicit: dict[str, float] = {}  # namespace: when a workstation asked to watch it
        self.started = False

    @property
    def reflectors(self) -> list[Reflector]:
        """Every reflector: the cluster-wide ones and each watched namespace's."""
        return self.cluster + [r for cache in self.namespaced for r in cache.members.values()]

    def start(self) -> None:
        if self.started:
            return
        loop = asyncio.get_running_loop()
        for r in self.cluster:
            r.start(loop)
        self.started = True
        if self.shared_namespace is not None:
            self._watch(self.shared_namespace)

    def stop(self) -> None:
        for r in self.cluster:
            r.stop()
        for cache in self.namespaced:
            cache.stop()
        for task in self._watching.values():
            task.cancel()

    # ------------------------------------------------ the watched namespaces
    def _namespace_changed(self, obj: dict[str, Any] | None, key: tuple[str, str]) -> None:
        if obj is None:
            self._unwatch(key[1])
        else:
            self._watch(key[1])

    def _namespaces_listed(self, objects: Collection[dict[str, Any]], _namespace: str | None) -> None:
        listed = {obj["metadata"]["name"] for obj in objects}
        for namespace in listed:
            self._watch(namespace)
        recent = {ns for ns, asked in self._explicit.items() if time.monotonic() - asked < 60}
        for namespace in set(self._watching) - listed - recent:  # (a list older than a namespace made now)
            self._unwatch(namespace)

    def _watch(self, namespace: str) -> asyncio.Task[None]:
        """Bind the hub in the namespace and watch it from now on (once); the task that does it."""
        task = self._watching.get(namespace)
        if task is None:
            task = self._watching[namespace] = asyncio.get_running_loop().create_task(
                self._bind_and_watch(namespace), name=f"watch-namespace-{namespace}")
        return task

    def _unwatch(self, namespace: str) -> None:
        """The namespace is gone, and its objects with it."""
        self._bind_refused.pop(namespace, None)
        self._binding.pop(namespace, None)
        self._explicit.pop(namespace, None)
        task = self._watching.pop(namespace, None)
        if task is not None:
            task.cancel()
        for cache in self.namespaced:
            cache.drop(namespace)
        self._notify(namespace)

    async def _bind_and_watch(self, namespace: str) -> None:
        try:
            await self._bind(namespace)
        except Exception:  # the watches start anyway, and say what they are refused
            self.kube.log.exception("binding the hub in Namespace %s failed", namespace)
        loop = asyncio.get_running_loop()
        # Each API server's authorizer learns of a new binding from its own watch, a moment later
        # (plugin/pkg/auth/authorizer/rbac: listers): a refusal just after the bind is asked again.
        patient_until = time.monotonic() + BIND_SETTLE_SECONDS
        for cache in self.namespaced:
            cache.add(namespace, loop).patient_until = patient_until

    async def _whoami(self) -> str:
        """The hub's user name as the API server knows it (a SelfSubjectReview, which every
        authenticated user may ask: the system:basic-user role)."""
        async with self._whoami_lock:
            return await self._ask_whoami()

    async def _ask_whoami(self) -> str:
        if self._username is None:
            review = await self.kube.call("POST", "/apis/authentication.k8s.io/v1/selfsubjectreviews", None,
                                          {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"})
            username = field_value(review or {}, "status.userInfo.username")
            if not username:
                raise k.KubeError(500, "InternalError", "the API server's SelfSubjectReview named no user")
            self._username = username
        return self._username

    async def _bind(self, namespace: str) -> None:
        """Bind the hub's namespaced role in `namespace` (deploy/rbac/), so that it may watch and act
        there. Usually it is bound already (409): a namespace is bound with its first workstation,
        and again by each hub that starts. Never raises: a namespace the hub cannot be bound in is
        refused, and says so, when its caches are read."""
        lock = self._binding.setdefault(namespace, asyncio.Lock())
        async with lock:
            refused_at, refusal = self._bind_refused.get(namespace, (0.0, ""))
            if time.monotonic() - refused_at < BIND_RETRY_SECONDS:
                return  # (each kind's watch asks again after its refusal: once for all of them)
            try:
                binding = m.hub_role_binding(namespace, await self._whoami())
                await self._create_binding(binding)
                self._bind_refused.pop(namespace, None)
            except k.KubeError as err:
                self._bind_refused[namespace] = (time.monotonic(), str(err))
                if str(err) != refusal:  # told once, not at every retry
                    self.kube.log.warning(
                        "%scannot bind the hub's role %s in Namespace %s: %s. Its workstations work only once "
                        "the hub's ServiceAccount is bound to it there (see deploy/rbac/)",
                        "permission missing: " if err.status == 403 else "", m.HUB_NAMESPACED_ROLE, namespace, err)

    async def _create_binding(self, binding: dict[str, Any]) -> None:
        namespace = binding["metadata"]["namespace"]
        deadline = time.monotonic() + 10
        while True:
            try:
                await self.kube.create(k.ROLE_BINDING, binding)
                self.kube.log.info("bound the hub's role %s in Namespace %s", m.HUB_NAMESPACED_ROLE, namespace)
                return
            except k.KubeError as err:
                if err.status == 409:
                    return
                # A namespace made just now may not be found for a few seconds (kubernetes#135359).
                if not err.not_found or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)

    async def watch_namespace(self, namespace: str) -> None:
        """Watch a namespace from now on (the hub has just made it): returns once its caches are
        started, not synced."""
        self.start()
        if self.namespaces is None and namespace != self.shared_namespace:
            raise ValueError(f"these caches watch only {self.shared_namespace}, not {namespace}")
        self._explicit[namespace] = time.monotonic()
        for _ in range(3):
            task = self._watch(namespace)
            await asyncio.wait([task])  # (an unwatch cancels the task, not its waiter)
            if not task.cancelled():
                return

    # ------------------------------------------------ state
    @property
    def synced(self) -> bool:
        """Every cache has the cluster's state: the cluster-wide ones, and each watched namespace's
        (a namespace the hub may not read counts as known: its refusal is told for its own
        workstations, and must not hold up everyone else's)."""
        return (all(r.synced for r in self.cluster) and all(task.done() for task in self._watching.values())
                and all(r.synced or r.forbidden for cache in self.namespaced for r in cache.members.values()))

    def synced_in(self, namespace: str) -> bool:
        """The caches a workstation of `namespace` reads have the cluster's state. A namespace that
        is not watched (it does not exist, or is not this project's) has nothing in it to wait for."""
        if not all(r.synced for r in self.cluster):
            return False
        task = self._watching.get(namespace)
        if task is None:
            return self.namespaces is not None
        return task.done() and all(cache.synced_in(namespace) for cache in self.namespaced)

    def watches(self, namespace: str) -> bool:
        """Whether the namespace is watched (or about to be): the hub is bound there, or binding."""
        return namespace in self._watching

    def lacks_namespace(self, namespace: str) -> bool:
        """Whether the namespace is known not to be there as this project's (False: it is, or
        these caches follow one shared namespace and cannot tell)."""
        return self.namespaces is not None and self.namespaces.synced and self.namespaces.get("", namespace) is None

    def refusal_for(self, namespace: str | None = None) -> k.KubeError | None:
        """The 403 of a cache the hub needs and may not read: cluster-wide, or in `namespace`
        (None: the cluster-wide ones only; one namespace's refusal is that namespace's)."""
        required = [r for r in self.cluster if not r.optional]
        if namespace is not None:
            required += [cache.members[namespace] for cache in self.namespaced
                         if not cache.optional and namespace in cache.members]
        return next((r.refusal for r in required if r.refusal is not None), None)

    @property
    def refusal(self) -> k.KubeError | None:
        return self.refusal_for(None)

    def unsynced(self, namespace: str | None = None) -> str:
        """Which caches are not synced and why (the cluster-wide ones and those of `namespace`;
        None: all), for a log line."""
        return ", ".join(f"{r.describe()} ({r.last_error or 'no answer yet'})" for r in self.reflectors
                         if not r.synced and (namespace is None or r.namespace in (None, namespace))) or "none"

    def clone_strategy(self, storage_class: str) -> str | None:
        """CDI's clone strategy for a StorageClass (its StorageProfile's status), when known."""
        strategy = field_value(self.storage_profiles.get("", storage_class), "status.cloneStrategy")
        return strategy if isinstance(strategy, str) else None

    def notify(self, namespace: str | None = None) -> None:
        """Wake the waiters of a namespace (None: every waiter) to re-check, for changes that are
        not in the cluster."""
        self._notify(namespace)

    def _notify(self, namespace: str | None) -> None:
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
            refusal = self.refusal_for(namespace)
            if refusal is not None:
                raise refusal.again(logged=True)  # a new one each time (the cache's own line told the admin)
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise asyncio.TimeoutError()
            if not await _wait_event(changed, remaining) and deadline is not None and time.monotonic() >= deadline:
                raise asyncio.TimeoutError()

    async def next_change(self, timeout: float = 30.0, namespace: str | None = None) -> None:
        """Return after the next change in `namespace` (or `notify()`), or after `timeout` seconds."""
        await _wait_event(self._change_event(namespace), timeout)  # (nothing changed: the caller looks again)

    async def wait_synced(self, timeout: float | None = None, namespace: str | None = None) -> None:
        """Wait until the caches have the cluster's state: all of them, or (with `namespace`) those
        a workstation there reads. A namespace that exists is watched first, if it is not yet."""
        if namespace is None:
            await self.wait_for(lambda: self.synced, timeout)
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        await self.wait_for(lambda: all(r.synced for r in self.cluster), timeout, namespace)
        if self.namespaces is None or self.namespaces.get("", namespace) is not None:
            await self.watch_namespace(namespace)  # (bounded by the binding's own retries)
        await self.wait_for(lambda: self.synced_in(namespace),
                            None if deadline is None else max(0.0, deadline - time.monotonic()), namespace)

    def _node_of(self, vmi: dict[str, Any]) -> tuple[bool, dict[str, Any] | None]:
        """(whether the VMI is unfinished on a node, that node as cached). Without permission to
        read Nodes, nothing is known of them."""
        status = vmi.get("status") or {}
        if not status.get("nodeName") or status.get("phase") in FINAL_PHASES or self.nodes.forbidden:
            return False, None
        return True, self.nodes.get("", status["nodeName"])

    def on_unreachable_node(self, vmi: dict[str, Any]) -> bool:
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

    def on_lost_node(self, vmi: dict[str, Any]) -> bool:
        """Unreachable, and KubeVirt has given up on the node's virt-handler after its heartbeat
        timeout (it labels the node kubevirt.io/schedulable=false; pkg/virt-controller/watch/node/
        node.go): a short network blip is not a lost machine."""
        if not self.on_unreachable_node(vmi):
            return False
        _, node = self._node_of(vmi)
        return node is None or ((node.get("metadata") or {}).get("labels") or {}).get(
            "kubevirt.io/schedulable") == "false"

    def events_for(self, namespace: str, names: set[str], prefixes: tuple[str, ...] = ()) -> list[dict[str, Any]]:
        """Cluster Events about the given objects (and those whose names start with a prefix, such
        as a VM's launcher pods), oldest first."""
        if self.events is None:
            return []
        def about(event: dict[str, Any]) -> bool:
            name = (event.get("involvedObject") or {}).get("name") or ""
            return name in names or any(name.startswith(prefix) for prefix in prefixes)

        out = [e for e in self.events.in_namespace(namespace) if about(e)]
        return sorted(out, key=lambda e: (e.get("lastTimestamp") or e.get("eventTime") or "",
                                          int((e.get("metadata") or {}).get("resourceVersion") or 0)))
