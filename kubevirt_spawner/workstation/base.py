"""What every part of a workstation shares: its errors, its log, the hub-wide settings, the
one-at-a-time operations, and the views of its objects in the caches."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Literal

from jupyterhub.spawner import SpawnException

from .. import kube as k
from .. import manifests as m
from .. import names
from ..clonegate import CloneGate
from ..objects import FINAL_PHASES, field_value
from ..reasons import Reason
from ..reflector import Caches, PerNamespace

ANNOTATION_SPEC_HASH = m.LABEL_PREFIX + "spec-hash"
SNAPSHOT = k.SNAPSHOT
STALL_CHECK_SECONDS = 5.0
# DataVolume phases of a CSI or snapshot clone (copy-on-write, progress "N/A"), and of a disk that
# waits for its first consumer (no clone stalls there).
COPY_ON_WRITE_PHASES = ("CSICloneInProgress", "SnapshotForSmartCloneInProgress")
WAITING_FOR_CONSUMER = ("WaitForFirstConsumer", "PendingPopulation")
ALREADY_RUNNING = ("already running", "does not support manual start requests")
# A write the API server checks all through (decoding with unknown fields refused, validation,
# admission, the name's uniqueness) and then does not store.
CHECK_ONLY = {"dryRun": "All", "fieldValidation": "Strict"}
WorkstationState = Literal["running", "starting", "stopped", "failed", "lost"]
VmHook = Callable[[dict], Awaitable[dict]]

Report = Callable[[int, str], None]


class WorkstationError(SpawnException):
    """A failure the user can act on. `message` is the sentence shown to them; `reason` a short
    label (`Reason.GPU_UNAVAILABLE`, whose value `gpu-unavailable` the hub's log and metrics show;
    `reasons.py` lists them all). JupyterHub logs these without a traceback."""

    def __init__(self, message: str, *, reason: Reason, status_code: int = 400):
        super().__init__(message, reason=reason, status_code=status_code)
        # Without this, JupyterHub shows its own generic text for some reasons ("timeout").
        self.jupyterhub_message = message


def name_taken(obj: dict) -> WorkstationError:
    return WorkstationError(
        f"{obj.get('kind') or 'An object'} {obj['metadata'].get('namespace')}/{obj['metadata']['name']} already exists "
        f"and is not this workstation's, so nothing was done; ask your administrator to rename or remove it.",
        reason=Reason.NAME_TAKEN, status_code=409)


class WorkstationLog(logging.LoggerAdapter):
    """The hub's log format has no field for the workstation, so every line starts with it."""

    def __init__(self, logger: logging.Logger | logging.LoggerAdapter, workstation: str):
        super().__init__(logger, {"workstation": workstation})
        self.workstation = workstation

    def process(self, msg, kwargs):
        # (and the record carries it, for a handler that formats or ships it: a JSON log)
        kwargs["extra"] = {**(self.extra or {}), **(kwargs.get("extra") or {})}
        return f"{self.workstation}: {msg}", kwargs

    def log(self, level, msg, *args, **kwargs):
        # Arguments may be what a user chose (snapshot names, errors quoting them): never raw.
        super().log(level, msg, *names.printable_args(args), **kwargs)


def _ignore_report(percent: int, message: str):
    """The progress sink of callers that do not show progress."""


def spec_hash(vm: dict) -> str:
    """What a start keeps up to date on a stopped VM: its spec but the run strategy (the hub's
    start and stop set that), and the profile and choices it records."""
    annotations = vm["metadata"].get("annotations") or {}
    kept = {"spec": {k: v for k, v in vm["spec"].items() if k != "runStrategy"},
            "profile": [annotations.get(key) for key in (m.ANNOTATION_PROFILE, m.ANNOTATION_PROFILE_OPTIONS)]}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class Settings:
    """Hub-wide behaviour a Workstation needs from the spawner's configuration."""
    url_mode: str = "dns"  # or "cluster-ip"
    cluster_domain: str = "cluster.local"
    gpu_unavailable: str = "wait"  # or "fail"
    start_timeout: float = 600.0
    stop_timeout: float = 300.0
    retention_days: int = 30
    clone_stall_timeout: float = 600.0
    clone_gate: CloneGate = field(default_factory=CloneGate)
    # What a user's namespace gets with its first workstation (nothing when empty).
    network_policy_from: tuple = ()
    namespace_quota: dict = field(default_factory=dict)
    namespace_limits: tuple = ()
    namespace_labels: dict = field(default_factory=dict)  # the admin's, {user} filled in at creation
    namespace_annotations: dict = field(default_factory=dict)


# One task per workstation and operation kind, so concurrent starts act once; with its number of
# waiters, so that the task is cancelled when the last one gives up (and not before).
_operations: dict[tuple[str, str, str], list] = {}


async def _once(key: tuple[str, str, str], factory):
    entry = _operations.get(key)
    if entry is None or entry[0].done():
        task = asyncio.ensure_future(factory())
        entry = _operations[key] = [task, 0]
        task.add_done_callback(lambda t: _operations.pop(key, None) if _operations.get(key, [None])[0] is t
                               else None)
    task = entry[0]
    entry[1] += 1
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        if entry[1] == 1 and not task.done():
            task.cancel()  # the operation cleans up after itself (a start stops the VM again)
        raise
    finally:
        entry[1] -= 1


@contextlib.contextmanager
def refusals_explained(log: logging.Logger | logging.LoggerAdapter, doing: str):
    """A request the hub is not allowed to make: one line for the admin naming the request and
    the cluster's refusal (which names the verb and resource), one sentence for the user."""
    try:
        yield
    except k.KubeError as err:
        if not err.permission_denied:
            raise
        if not err.logged:
            log.error("permission missing: the cluster refused %s: %s. Grant it to the hub's ServiceAccount "
                      "(see deploy/rbac/).", err.request or "a request", err.message)
        raise WorkstationError(
            f"Your workstation could not {doing}: the hub is not allowed to do part of it on the cluster. "
            "Tell your administrator; the hub's log names the missing permission.",
            reason=Reason.FORBIDDEN, status_code=500) from err


async def wait_synced(caches: Caches, log: logging.Logger | logging.LoggerAdapter, timeout: float,
                      namespace: str | None = None):
    """Wait for the caches (those of `namespace`; None: all), at most `timeout` seconds: without
    them nothing can be decided. (A cache the hub may not read fails at once, with its KubeError.)"""
    try:
        await caches.wait_synced(max(0.0, timeout), namespace)
    except asyncio.TimeoutError:
        log.error("the hub's caches are not synced after %.0fs: %s", timeout, caches.unsynced(namespace))
        raise WorkstationError(
            "The hub cannot read the state of your workstation from the cluster right now. Try again in a few "
            "minutes; if it keeps failing, tell your administrator.",
            reason=Reason.CLUSTER_UNAVAILABLE, status_code=503) from None


class WorkstationBase:
    """One workstation's names, collaborators and cached views; the parts (provisioning,
    lifecycle, snapshots, disks) build on it and `Workstation` joins them."""

    def __init__(self, kube: k.Kube, caches: Caches, ident: m.Identity, spec: m.MachineSpec, settings: Settings,
                 log: logging.Logger | logging.LoggerAdapter, vm_hook: VmHook | None = None):
        self.kube, self.caches, self.ident, self.spec, self.settings = kube, caches, ident, spec, settings
        self.vm_hook = vm_hook  # the admin's last word on the VM (the spawner's modify_vm_hook)
        self.log = WorkstationLog(log, f"{ident.namespace}/{ident.vm}")
        self._namespace_made_at: float | None = None  # (monotonic) when this start made the namespace

    # ------------------------------------------------------------ cached views
    # Only what carries this workstation's raw user and server names: an object under its names
    # that carries others is another workstation's (a forced slug collision), which the hub neither
    # shows nor touches (`_refuse_foreign`).
    def _mine(self, obj: dict | None) -> dict | None:
        return obj if m.belongs_to(obj, self.ident.user, self.ident.server) else None

    @property
    def vm(self) -> dict | None:
        return self._mine(self.caches.vms.get(self.ident.namespace, self.ident.vm))

    @property
    def vmi(self) -> dict | None:
        return self._mine(self.caches.vmis.get(self.ident.namespace, self.ident.vm))

    @property
    def rootdisk(self) -> dict | None:
        return self._mine(self.caches.dvs.get(self.ident.namespace, self.ident.rootdisk))

    @property
    def rootdisk_pvc(self) -> dict | None:
        return self._mine(self.caches.pvcs.get(self.ident.namespace, self.ident.rootdisk))

    @property
    def extra_claims(self) -> list[str]:
        """The claims of the machine's extra disks (their DataVolumes have the same names)."""
        return [m.extra_disk_claim(self.ident, disk) for disk in self.spec.extra_disks]

    @property
    def service(self) -> dict | None:
        return self._mine(self.caches.services.get(self.ident.namespace, self.ident.service))

    def _foreign_object(self) -> dict | None:
        """An object under this workstation's names that is another's, if there is one."""
        ident = self.ident
        named: tuple[tuple[PerNamespace, str], ...] = (
            (self.caches.vms, ident.vm), (self.caches.vmis, ident.vm), (self.caches.dvs, ident.rootdisk),
                 (self.caches.pvcs, ident.rootdisk), (self.caches.dvs, ident.workspace),
                 (self.caches.pvcs, ident.workspace), (self.caches.services, ident.service))
        named += tuple((cache, name) for name in self.extra_claims for cache in (self.caches.dvs, self.caches.pvcs))
        for cache, name in named:
            obj = cache.get(ident.namespace, name)
            if obj is not None and self._mine(obj) is None:
                theirs = obj["metadata"].get("annotations") or {}
                self.log.warning("%s %s/%s belongs to another workstation (user %r, server %r): left alone",
                                 obj.get("kind") or "object", ident.namespace, name,
                                 theirs.get(m.ANNOTATION_USERNAME), theirs.get(m.ANNOTATION_SERVERNAME, ""))
                return obj
        return None

    def _refuse_foreign(self):
        """Before any action: no object under this workstation's names may be another's."""
        foreign = self._foreign_object()
        if foreign is not None:
            raise name_taken(foreign)

    def status(self) -> WorkstationState:
        """What the machine is doing; lost: its VMI is on a node that stopped answering."""
        vmi = self.vmi
        if vmi is None:
            return "stopped"
        phase = field_value(vmi, "status.phase")
        if self.caches.on_lost_node(vmi):
            return "lost"
        if phase == "Failed":
            return "failed"
        if phase == "Succeeded" or vmi["metadata"].get("deletionTimestamp"):
            return "stopped"
        if phase == "Running":
            return "running"
        return "starting"

    def url(self) -> str | None:
        port = m.JUPYTER_PORT
        if self.settings.url_mode == "cluster-ip":
            ip = field_value(self.service, "spec.clusterIP")
            return f"http://{ip}:{port}" if ip and ip != "None" else None
        return f"http://{self.ident.service}.{self.ident.namespace}.svc.{self.settings.cluster_domain}:{port}"

    def attached_elsewhere(self) -> list[dict]:
        """VMIs, ours included, that still hold the root disk (not finished)."""
        out = []
        for vmi in self.caches.vmis.values():
            if vmi["metadata"]["namespace"] != self.ident.namespace:
                continue
            claims = [field_value(v, "persistentVolumeClaim.claimName") or field_value(v, "dataVolume.name")
                      for v in field_value(vmi, "spec.volumes") or []]
            if self.ident.rootdisk in claims and field_value(vmi, "status.phase") not in FINAL_PHASES:
                out.append(vmi)
        return out

    async def _wait_until(self, predicate: Callable[[], object], deadline: float, waiting_for: str):
        """A wait of the start, bounded by the start's deadline."""
        try:
            return await self.caches.wait_for(predicate, max(0.0, deadline - time.monotonic()), self.ident.namespace)
        except asyncio.TimeoutError:
            raise self._timed_out(waiting_for) from None

    def _timed_out(self, waiting_for: str) -> WorkstationError:
        return WorkstationError(
            f"Your workstation did not start within {self.settings.start_timeout:.0f} seconds while waiting "
            f"for {waiting_for}. Try again in a minute; if it keeps failing, tell your administrator.",
            reason=Reason.TIMEOUT, status_code=504)

    async def _create(self, kind: k.Kind, obj: dict, query: dict | None = None) -> dict:
        """Create `obj`, patient for a few seconds with a namespace this start has just made: on
        Kubernetes 1.30 to 1.32 before kubernetes#135359, ValidatingAdmissionPolicies looked the
        namespace up in the API server's cache only, so a create right after the namespace's could
        be refused with NotFound (a create is NotFound only when its namespace is)."""
        while True:
            try:
                return await self.kube.create(kind, obj, query)
            except k.KubeError as err:
                made = self._namespace_made_at
                if not err.not_found or made is None or time.monotonic() - made > 10:
                    raise
                self.log.info("the namespace made just now is not found yet; creating %s again", kind.kind)
                await asyncio.sleep(0.5)

    async def _ensure(self, kind: k.Kind, obj: dict, cache: PerNamespace) -> dict:
        """Create the object; when it exists, the existing one, which must be this workstation's."""
        meta = obj["metadata"]
        try:
            created = await self._create(kind, obj)
            self.log.info("created %s %s", kind.kind, meta["name"])
            return created
        except k.KubeError as err:
            if err.status != 409 or err.reason != "AlreadyExists":
                raise
        existing = await self._existing_own(kind, obj, cache)
        if existing is None:  # deleted in between: once more
            return await self.kube.create(kind, obj)
        return existing

    async def _existing_own(self, kind: k.Kind, obj: dict, cache: PerNamespace) -> dict | None:
        """The object of `obj`'s name that a create found there, which must be this workstation's
        (name-taken otherwise); None when it is gone meanwhile. From the cache, else listed by
        name (a cache may lag behind a create that was repeated after a timeout): the hub never
        needs to GET single objects."""
        meta = obj["metadata"]
        existing = cache.get(meta["namespace"], meta["name"])
        if existing is None:
            found = await self.kube.list(kind, meta["namespace"], field_selector=f"metadata.name={meta['name']}")
            existing = next(iter(found.get("items") or []), None)
        if existing is not None:
            existing.setdefault("kind", kind.kind)
            self._check_owner(existing)
        return existing

    def _need(self, cache: PerNamespace):
        """An optional cache this operation cannot do without: its refusal (in this workstation's
        namespace) ends the operation."""
        refusal = cache.refusal_in(self.ident.namespace)
        if refusal is not None:
            raise refusal.again(logged=True)  # the cache said so when it was refused

    def _check_owner(self, obj: dict):
        if self._mine(obj) is None:
            raise name_taken(obj)
