"""The lifecycle of one workstation: provision, start (resume), wait, stop and retire.

Used by the spawner and by the hub service. Every wait reads the shared caches (`reflector.py`);
API requests are only made to change something. Failures a user can act on are `WorkstationError`
(a JupyterHub `SpawnException`): one sentence that says what happened and what to do, and a short
reason. Everything is logged through the logger the caller gives (the hub's), each line naming the
workstation.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Awaitable, Callable

from jupyterhub.spawner import SpawnException

from . import kube as k
from . import manifests as m
from . import names
from .clonegate import CloneGate
from .objects import FINAL_PHASES, condition, field_value
from .quantity import parse_quantity
from .reasons import Reason
from .reflector import Caches, PerNamespace, within

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


class Workstation:
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

    def status(self) -> str:
        """running | starting | stopped | failed | lost (a VMI on a node that stopped answering)."""
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

    # ------------------------------------------------------------ start
    async def start(self, env: dict[str, str], args: list[str], report: Report = _ignore_report) -> str:
        key = (self.ident.namespace, self.ident.vm, "start")
        return await _once(key, lambda: self._start(env, args, report))

    async def _start(self, env, args, report) -> str:
        deadline = time.monotonic() + self.settings.start_timeout
        with refusals_explained(self.log, "start"):
            await wait_synced(self.caches, self.log, self.settings.start_timeout, self.ident.namespace)
            self._refuse_foreign()  # (before the `try`: its failure path stops the machine by name)
            vm = self.vm  # a machine an account of this name made at another time never retired
            if vm is not None and m.ANNOTATION_USER_CREATED in (vm["metadata"].get("annotations") or {}):
                self._refuse_earlier_accounts([(k.VM, vm)])
            refused = await self._prepare_namespace(deadline) if vm is None else None
            try:
                self._refuse_double_attach()
                report(1, "Preparing your workstation")
                new = self.vm is None
                await self._provision(report, deadline, refused)
                await self._write_env(env, args, new)
                await self._wait_for_shutdown(report, deadline)
                await self._request_start(report, deadline)
                return await self._wait_ready(report, deadline)
            except BaseException as exc:
                await asyncio.shield(self._stop_after_failed_start())
                # Not the user's to act on, so not a SpawnException: JupyterHub logs the traceback and
                # counts an error. The user reads one sentence.
                if isinstance(exc, k.KubeError) and not exc.permission_denied:
                    raise exc.again(jupyterhub_message=(
                        f"The cluster refused to start your workstation ({exc.for_users}). Try again in a minute; "
                        "if it keeps failing, tell your administrator.")) from exc
                raise
            finally:
                self.settings.clone_gate.release((self.ident.namespace, self.ident.rootdisk))

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

    def _refuse_double_attach(self):
        for vmi in self.attached_elsewhere():
            name = vmi["metadata"]["name"]
            node = field_value(vmi, "status.nodeName") or "an unknown node"
            if self.caches.on_unreachable_node(vmi):
                raise WorkstationError(
                    f"Your workstation's disk is still attached to a machine on node {node}, which has stopped "
                    f"responding. It cannot start anywhere else until an administrator confirms that {node} is "
                    f"fenced (powered off), for example by tainting it "
                    f"node.kubernetes.io/out-of-service=nodeshutdown:NoExecute.", reason=Reason.LOST_NODE, status_code=409)
            if name != self.ident.vm:
                raise WorkstationError(
                    f"Your workstation's disk is in use by another virtual machine ({name} on {node}). "
                    f"Stop it first, or ask your administrator.", reason=Reason.DISK_IN_USE, status_code=409)

    async def _prepare_namespace(self, deadline: float) -> k.KubeError | None:
        """The namespace of a first start, made when missing, bound and watched: before anything is
        made there (so nothing needs stopping when this fails). The refusal to make one, when the
        hub may not but one may exist."""
        refused = await self._ensure_namespace()
        if refused is not None and self.caches.lacks_namespace(self.ident.namespace):
            raise refused  # the hub may not make it, and nothing can be made in a namespace that is not there
        if refused is None:
            # A namespace made just now: the hub binds its role there and watches it from now on.
            await self.caches.watch_namespace(self.ident.namespace)
            await wait_synced(self.caches, self.log, deadline - time.monotonic(), self.ident.namespace)
        return refused

    async def _provision(self, report: Report, deadline: float, refused: k.KubeError | None):
        """Create whatever is missing; adopt what exists (after a hub restart, or a second start).
        `refused`: the refusal to make the namespace, if the hub was refused."""
        try:
            await self._ensure_namespace_guards()
            await self._provision_objects(report, deadline)
        except k.KubeError as err:
            # The namespace is missing because the hub was not allowed to create it: say that.
            if refused is not None and err.not_found and f'namespaces "{self.ident.namespace}"' in err.message:
                raise refused from err
            raise

    async def _provision_objects(self, report: Report, deadline: float):
        ident, spec = self.ident, self.spec
        vm = self.vm
        # The machine as the cluster will take it, checked before any disk is made or grown.
        desired = await self._desired_vm()
        await self._check_vm(vm, desired)
        await self._check_shared_claims()
        disk = self.rootdisk or self.rootdisk_pvc
        if disk is None and vm is not None:
            raise WorkstationError(
                f"Your system disk {ident.namespace}/{ident.rootdisk} is missing, so your workstation cannot start. "
                "Ask your administrator to restore it from a snapshot or to reset your system.",
                reason=Reason.DISK_MISSING, status_code=409)
        if disk is None:
            gate = self.settings.clone_gate
            gate.attach(self.caches)
            try:
                await within(gate.admit((ident.namespace, ident.rootdisk), spec.storage_class, report),
                             max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                raise self._timed_out("a free place in the clone queue") from None
            report(5, f"Cloning your system disk from {spec.golden_name}")
            await self._ensure(k.DV, m.root_datavolume(ident, spec), self.caches.dvs)
        await self._unretire()
        if spec.workspace_disk_size and self.caches.dvs.get(ident.namespace, ident.workspace) is None \
                and self.caches.pvcs.get(ident.namespace, ident.workspace) is None:
            await self._ensure(k.DV, m.workspace_datavolume(ident, spec), self.caches.dvs)
        for extra in spec.extra_disks:  # (made once; never replaced, as the workspace disk)
            claim = m.extra_disk_claim(ident, extra)
            if self.caches.dvs.get(ident.namespace, claim) is None and self.caches.pvcs.get(ident.namespace,
                                                                                           claim) is None:
                report(5, f"Making your extra disk {extra.name}" + (f" from {extra.clone_from}"
                                                                   if extra.clone_from else ""))
                await self._ensure(k.DV, m.extra_disk_datavolume(ident, spec, extra), self.caches.dvs)
        if vm is None:
            vm = await self._ensure(k.VM, desired, self.caches.vms)
        await self._resize_disks(report)
        await self._update_stopped_vm(vm, desired)
        if self.service is None:
            await self._ensure(k.SERVICE, m.service(ident, spec), self.caches.services)

    async def _check_shared_claims(self):
        """Every shared data claim the machine mounts is there, is no workstation's disk (in a
        namespace shared by several users, a profile or a typed choice naming one would hand it
        over), and is a filesystem (virtiofs shares files; a Block claim has none): a machine
        started without it would wait in Pending for a claim that may never come. The claims
        are the administrator's: never made, changed or deleted here."""
        for share in self.spec.shared_data:
            where = f"{self.ident.namespace}/{share.claim}"
            # (a list by name: the hub lists and watches claims, and may not get one)
            found = await self.kube.list(k.PVC, self.ident.namespace, field_selector=f"metadata.name={share.claim}")
            pvc = next(iter(found.get("items") or []), None)
            if pvc is None:
                raise WorkstationError(
                    f"The shared data volume {where} that your workstation mounts at {share.path} does not exist, "
                    "so nothing was started; ask your administrator to make it or to take it out of your profile.",
                    reason=Reason.SHARED_DATA, status_code=409)
            if (field_value(pvc, "metadata.labels") or {}).get("app.kubernetes.io/managed-by") == m.MANAGED_BY:
                raise WorkstationError(
                    f"The shared data volume {where} that your workstation mounts at {share.path} is a disk of a "
                    "workstation, not shared data, so nothing was started; ask your administrator to correct the "
                    "profile.", reason=Reason.SHARED_DATA, status_code=409)
            if field_value(pvc, "spec.volumeMode") == "Block":
                raise WorkstationError(
                    f"The shared data volume {where} that your workstation mounts at {share.path} is a block "
                    "device, not a filesystem, so nothing was started; ask your administrator to give a "
                    "Filesystem claim.", reason=Reason.SHARED_DATA, status_code=409)

    async def _unretire(self):
        """A user who comes back before the retention ends gets their kept disks back. An account
        made again under the same name (another creation time, or none recorded: disks kept before
        the time was recorded) may be another person: it gets them only once an administrator has
        confirmed it, by setting ANNOTATION_CONFIRMED_FOR on each disk to the new account's
        creation time. Disks in use that lack the account's time get it (made before it was
        recorded, or by the workstations service, which does not know it)."""
        kept, unstamped = [], []
        for cache, kind in ((self.caches.dvs, k.DV), (self.caches.pvcs, k.PVC)):
            for name in (self.ident.rootdisk, self.ident.workspace, *self.extra_claims):
                obj = self._mine(cache.get(self.ident.namespace, name))
                if obj is None:
                    continue
                if m.LABEL_RETAINED in (obj["metadata"].get("labels") or {}):
                    kept.append((kind, obj))
                elif self.ident.user_created and m.ANNOTATION_USER_CREATED not in (obj["metadata"].get("annotations")
                                                                                   or {}):
                    unstamped.append((kind, obj))
        self._refuse_earlier_accounts(kept)  # all checked before any is taken back
        for kind, obj in kept:
            await self.kube.patch(kind, self.ident.namespace, obj["metadata"]["name"],
                                  m.unretained_patch(self.ident.user_created))
            self.log.info("%s %s is in use again: no longer marked as retained", kind.kind, obj["metadata"]["name"])
        for kind, obj in unstamped:
            await self.kube.patch(kind, self.ident.namespace, obj["metadata"]["name"], m.account_patch(
                self.ident.user_created))

    def _refuse_earlier_accounts(self, kept: list[tuple[k.Kind, dict]]):
        created = self.ident.user_created
        earlier = [(kind, disk) for kind, disk in kept if created and created not in (
            (disk["metadata"].get("annotations") or {}).get(m.ANNOTATION_USER_CREATED),
            (disk["metadata"].get("annotations") or {}).get(m.ANNOTATION_CONFIRMED_FOR))]
        if not earlier:
            return
        made = sorted({(d["metadata"].get("annotations") or {}).get(m.ANNOTATION_USER_CREATED, "an unknown time")
                       for _, d in earlier})
        disks = " ".join(f"{kind.plural}/{disk['metadata']['name']}" for kind, disk in earlier)
        self.log.warning("kept from an account %r made at %s, not this one (made at %s): an administrator "
                         "confirms they are this account's with: kubectl annotate -n %s %s %s=%s",
                         self.ident.user, ", ".join(made), created, self.ident.namespace, disks,
                         m.ANNOTATION_CONFIRMED_FOR, created)
        if all(kind is k.VM for kind, _ in earlier):
            sentence = (f"A workstation of an earlier account named {self.ident.user} is in {self.ident.namespace}, "
                        "and yours may use it only once your administrator confirms it is yours (the hub's log says "
                        "how).")
        else:
            sentence = (f"Disks kept from an earlier account named {self.ident.user} wait in {self.ident.namespace}, "
                        "and your workstation may use them only once your administrator confirms they are yours "
                        "(the hub's log says how).")
        raise WorkstationError(sentence, reason=Reason.KEPT_FOR_EARLIER_ACCOUNT, status_code=409)

    def _check_owner(self, obj: dict):
        if self._mine(obj) is None:
            raise name_taken(obj)

    async def _ensure_namespace(self) -> k.KubeError | None:
        """Create the namespace when missing. A hub may be allowed to use namespaces made for it but
        not to create any: the refusal is returned, and matters only if the namespace is missing."""
        try:
            await self.kube.create(k.NAMESPACE, m.namespace(self.ident, self.settings.namespace_labels,
                                                            self.settings.namespace_annotations))
            self._namespace_made_at = time.monotonic()
            self.log.info("created Namespace %s", self.ident.namespace)
        except k.KubeError as err:
            if err.status == 403:
                return err
            if err.status != 409:  # 409: it exists, all we need
                raise
        return None

    async def _ensure_namespace_guards(self):
        """The namespace's NetworkPolicy, ResourceQuota and LimitRange, as configured, made on every
        start: a namespace of a workstation from before these settings, or one whose guard was
        deleted, gets them too. One that exists is left as it is: an administrator may have changed it."""
        wanted = []
        if self.settings.network_policy_from:
            wanted.append((k.NETWORK_POLICY, m.network_policy(self.ident, self.spec.ports,
                                                              list(self.settings.network_policy_from))))
        if self.settings.namespace_quota:
            wanted.append((k.RESOURCE_QUOTA, m.resource_quota(self.ident, self.settings.namespace_quota)))
        if self.settings.namespace_limits:
            wanted.append((k.LIMIT_RANGE, m.limit_range(self.ident, list(self.settings.namespace_limits))))
        for kind, obj in wanted:
            try:
                await self._create(kind, obj)
                self.log.info("created %s %s/%s", kind.kind, self.ident.namespace, obj["metadata"]["name"])
            except k.KubeError as err:
                if err.status != 409:
                    raise

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

    async def _desired_vm(self) -> dict:
        """The VirtualMachine of this spec, as the admin's hook leaves it, with the hash of its
        template. A hook that fails, or hands back another object, stops the start here."""
        ident = self.ident
        desired = m.virtual_machine(ident, self.spec)
        if self.vm_hook is not None:
            try:
                changed = await self.vm_hook(copy.deepcopy(desired))
            except Exception:
                self.log.exception("modify_vm_hook failed")
                raise WorkstationError(
                    "This hub's modify_vm_hook failed on your workstation's machine, so nothing was created or "
                    "changed. Tell your administrator; the hub's log has the error.", reason=Reason.VM_SPEC,
                    status_code=500) from None
            if not self._kept_ours(desired, changed):
                self.log.error("modify_vm_hook returned no VirtualMachine %s/%s with the hub's labels and "
                               "annotations (it must return the VM it was given, changed)", ident.namespace, ident.vm)
                raise WorkstationError(
                    "This hub's modify_vm_hook did not return your workstation's machine, so nothing was created "
                    "or changed. Tell your administrator; the hub's log says what it returned.", reason=Reason.VM_SPEC,
                    status_code=500)
            desired = changed
        try:
            json.dumps(desired)
            desired["metadata"]["annotations"][ANNOTATION_SPEC_HASH] = spec_hash(desired)
        except (TypeError, ValueError):  # (a hook's value JSON has no form for)
            raise WorkstationError(
                "This hub's modify_vm_hook gave your workstation's machine a value Kubernetes cannot take, so nothing "
                "was created or changed. Tell your administrator.", reason=Reason.VM_SPEC, status_code=500) from None
        return desired

    def _kept_ours(self, ours: dict, changed) -> bool:
        """Whether a hook's VM is still this workstation's: its kind, name and namespace, and the
        hub's labels and annotations on it and its template (by which the hub finds and knows it)."""
        def same(part: dict, other: dict, path: str) -> bool:
            theirs = field_value(other, path)
            return isinstance(theirs, dict) and all(theirs.get(k) == v for k, v in field_value(part, path).items()
                                                    if k not in self.spec.extra_labels)
        if not (isinstance(changed, dict) and changed.get("kind") == ours["kind"]
                and isinstance(changed.get("metadata"), dict) and isinstance(changed.get("spec"), dict)
                and isinstance(field_value(changed, "spec.template.spec"), dict)):
            return False
        meta = changed["metadata"]
        return (meta.get("name"), meta.get("namespace")) == (self.ident.vm, self.ident.namespace) and all(
            same(ours, changed, path) for path in ("metadata.labels", "metadata.annotations",
                                                   "spec.template.metadata.labels",
                                                   "spec.template.metadata.annotations"))

    async def _check_vm(self, vm: dict | None, desired: dict):
        """The cluster checks the machine, storing nothing (a dry run with unknown fields refused):
        a new VM as it would be created, an existing one's replaced template. A refusal (a field
        the schema lacks or that is invalid, an admission policy) fails the start before any disk
        is made or grown, in one sentence."""
        try:
            if vm is None:
                await self._create(k.VM, desired, query=CHECK_ONLY)
            else:
                ops = self._template_ops(vm, desired)
                if ops:
                    await self.kube.json_patch(k.VM, self.ident.namespace, self.ident.vm, ops, query=CHECK_ONLY)
        except k.KubeError as err:
            if err.conflict:
                return  # (a VM the caches have not seen yet: the start adopts it)
            if err.status in (400, 422) or (err.status == 403 and not err.permission_denied):
                self.log.error("the cluster refuses this workstation's VirtualMachine: %s", err)
                raise WorkstationError(
                    f"The cluster refuses the machine this hub's settings make for you ({err.for_users}), so "
                    "nothing was created or changed. Tell your administrator (the profile, extra_vm_spec, "
                    "extra_vm_template_spec or modify_vm_hook).", reason=Reason.VM_SPEC, status_code=500) from None
            raise

    def _template_ops(self, vm: dict, desired: dict) -> list[dict]:
        """The JSON patch that gives a stopped machine the desired template (none when it has it,
        or while it runs: a running machine keeps its spec, the next start applies it). The
        template is replaced whole (a merge patch would keep what the new profile leaves out:
        GPUs, node selectors, limits)."""
        annotations = vm["metadata"].get("annotations") or {}
        if annotations.get(ANNOTATION_SPEC_HASH) == desired["metadata"]["annotations"][ANNOTATION_SPEC_HASH]:
            return []
        if self.status() not in ("stopped", "failed"):
            return []
        ops = [{"op": "replace", "path": "/spec/template", "value": desired["spec"]["template"]}]
        # (what extra_vm_spec sets beside the template; the run strategy is the hub's start and stop)
        ops += [{"op": "add", "path": f"/spec/{k.json_pointer_token(key)}", "value": value}
                for key, value in desired["spec"].items() if key not in ("template", "runStrategy")]
        for part in ("labels", "annotations"):
            if vm["metadata"].get(part) is None:
                ops.append({"op": "add", "path": f"/metadata/{part}", "value": {}})
            ops += [{"op": "add", "path": f"/metadata/{part}/{k.json_pointer_token(key)}", "value": value}
                    for key, value in desired["metadata"][part].items()]
        return ops

    async def _update_stopped_vm(self, vm: dict, desired: dict):
        """A changed profile takes effect at the next start (_template_ops)."""
        ops = self._template_ops(vm, desired)
        if not ops:
            return
        await self.kube.json_patch(k.VM, self.ident.namespace, self.ident.vm, ops)
        self.log.info("replaced the machine spec (profile %s %s)", self.spec.profile or "-", self.spec.profile_version)

    async def _resize_disks(self, report: Report):
        """A profile's disk sizes are minimums: a smaller disk grows, a larger one stays as it is
        (disks never shrink, and the disk is the user's whatever machine size they pick)."""
        disks = [(self.ident.rootdisk, self.spec.root_disk_size, "system disk"),
                 (self.ident.workspace, self.spec.workspace_disk_size, "workspace disk")]
        disks += [(m.extra_disk_claim(self.ident, d), d.size, f"extra disk {d.name}") for d in self.spec.extra_disks]
        for name, wanted, what in disks:
            pvc = self.caches.pvcs.get(self.ident.namespace, name)
            current = field_value(pvc, "spec.resources.requests.storage")
            if not (wanted and current) or parse_quantity(wanted) == parse_quantity(current):
                continue
            if parse_quantity(wanted) < parse_quantity(current):
                report(4, f"Keeping your {current} {what} (the profile asks for at least {wanted})")
                continue
            await self.kube.patch(k.PVC, self.ident.namespace, name,
                                  {"spec": {"resources": {"requests": {"storage": wanted}}}})
            report(4, f"Growing your {what} from {current} to {wanted}")
            self.log.info("expanding %s from %s to %s", name, current, wanted)

    async def _write_env(self, env: dict[str, str], args: list[str], new: bool):
        """One request: create the Secret for a new workstation, replace it for an existing one."""
        secret = m.env_secret(self.ident, env, args)
        first, second = (self.kube.create, self.kube.replace) if new else (self.kube.replace, self.kube.create)
        try:
            await first(k.SECRET, secret)
        except k.KubeError as err:
            if not (err.not_found or err.status == 409):
                raise
            await second(k.SECRET, secret)

    async def _wait_for_shutdown(self, report: Report, deadline: float):
        """A machine still shutting down (a stop moments ago) must be gone before a start: KubeVirt
        refuses a start while the old VMI's phase is not final, even while it is being deleted."""
        def shutting_down() -> bool:
            vmi = self.vmi
            return vmi is not None and bool(vmi["metadata"].get("deletionTimestamp")) \
                and field_value(vmi, "status.phase") not in FINAL_PHASES
        if not shutting_down():
            return
        report(6, "Waiting for your workstation to finish shutting down")
        await self._wait_until(lambda: not shutting_down(), deadline, "its previous shutdown to finish")

    async def _request_start(self, report: Report, deadline: float):
        ident = self.ident
        vmi = self.vmi
        if vmi is not None and self.status() in ("running", "starting"):
            # A machine booted by an earlier hub process holds an older token: reboot it with the new one.
            report(8, "Restarting your workstation so it picks up the new session")
            try:
                await self.kube.vm_action(ident.namespace, ident.vm, "restart")
                await self._wait_until(lambda: self.vmi is None or self.vmi["metadata"]["uid"] != vmi["metadata"]["uid"],
                                       deadline, "the running machine to restart")
                return
            except k.KubeError as err:
                if not err.conflict:
                    raise
        try:
            await self.kube.vm_action(ident.namespace, ident.vm, "start")
        except k.KubeError as err:
            if not (err.conflict and any(s in err.message for s in ALREADY_RUNNING)):
                raise
            self.log.info("start of %s: %s (continuing)", ident.vm, err.message)
        # The cache must show the request before the waits can tell "not started yet" from "stopped".
        await self._wait_until(lambda: field_value(self.vm, "spec.runStrategy") not in (None, "Halted")
                               or self.vmi is not None, deadline, "the cluster to take the start request")

    async def _wait_ready(self, report: Report, deadline: float) -> str:
        steps = _StartSteps(self, report)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WorkstationError(steps.timeout_message(self.settings.start_timeout), reason=Reason.TIMEOUT,
                                       status_code=504)
            try:
                # Woken by every change, and now and then without one: a stuck clone changes nothing.
                return await self.caches.wait_for(steps.check, min(remaining, STALL_CHECK_SECONDS), self.ident.namespace)
            except asyncio.TimeoutError:
                continue

    async def _stop_after_failed_start(self):
        """A failed start leaves nothing holding a node or a GPU."""
        try:
            await self.stop(now=True)
        except WorkstationError as err:  # already logged, and explained
            self.log.warning("could not stop %s after a failed start: %s", self.ident.vm, err.jupyterhub_message)
        except Exception:
            self.log.exception("could not stop %s after a failed start", self.ident.vm)

    # ------------------------------------------------------------ stop
    async def stop(self, now: bool = False):
        key = (self.ident.namespace, self.ident.vm, "stop-now" if now else "stop")
        await _once(key, lambda: self._stop(now))

    async def _stop(self, now: bool):
        with refusals_explained(self.log, "stop"):
            await wait_synced(self.caches, self.log, self.settings.stop_timeout, self.ident.namespace)
            self._refuse_foreign()
            # Always ask: the cache may not show a VM we have just created (a stop after a failed
            # start). Only in a namespace the hub watches: it makes nothing before it watches one.
            if self.caches.watches(self.ident.namespace):
                await self._stop_call(now)
            await self._wait_stopped()

    async def _wait_stopped(self):
        ident = self.ident
        if self.vmi is not None and self.caches.on_unreachable_node(self.vmi):
            # Halted now, so it does not come back by itself once the node is fenced.
            self.log.warning("%s is on node %s, which is not responding: it stays there until the node is fenced",
                             ident.vm, field_value(self.vmi, "status.nodeName"))
            return
        try:
            await self.caches.wait_for(self._gone, self.settings.stop_timeout, ident.namespace)
        except asyncio.TimeoutError:
            self.log.warning("%s did not shut down within %ss: forcing it off", ident.vm, self.settings.stop_timeout)
            await self._stop_call(True)
            try:
                await self.caches.wait_for(self._gone, 60, ident.namespace)
            except asyncio.TimeoutError:
                self.log.error("%s is still there a minute after it was forced off: check its node and its "
                               "virt-launcher pod", ident.vm)

    def _gone(self) -> bool:
        """Stopped as far as the caches know: no VMI, and the VM no longer asks for one."""
        return self.vmi is None and field_value(self.vm, "spec.runStrategy") in (None, "Halted")

    @property
    def stopped(self) -> bool:
        return self._gone()

    async def ensure_halted(self):
        """Make sure the VM does not come back by itself (KubeVirt restarts a VM whose runStrategy
        is Always when its guest powers off or crashes, or when a lost node is fenced)."""
        with refusals_explained(self.log, "stop"):
            await wait_synced(self.caches, self.log, self.settings.stop_timeout, self.ident.namespace)
            self._refuse_foreign()
            if self.vm is not None and field_value(self.vm, "spec.runStrategy") not in (None, "Halted"):
                self.log.info("%s ended on its own (%s): setting it to Halted", self.ident.vm, self.status())
                await self._stop_call(now=False)

    async def _stop_call(self, now: bool):
        try:
            await self.kube.vm_action(self.ident.namespace, self.ident.vm, "stop", {"gracePeriod": 0} if now else {})
        except k.KubeError as err:
            if err.not_found or (err.conflict and "not running" in err.message):
                return
            if err.conflict and (now or "shorter graceperiod" in err.message):
                return  # already stopping (KubeVirt takes a second stop only to shorten the grace period)
            raise

    # ------------------------------------------------------------ snapshots
    def _need(self, cache: PerNamespace):
        """An optional cache this operation cannot do without: its refusal (in this workstation's
        namespace) ends the operation."""
        refusal = cache.refusal_in(self.ident.namespace)
        if refusal is not None:
            raise refusal.again(logged=True)  # the cache said so when it was refused

    def _own(self, obj: dict) -> bool:
        return self._mine(obj) is not None

    def snapshots(self) -> list[dict]:
        """This workstation's snapshots as its user sees them, oldest first."""
        out = []
        for snap in self.caches.snapshots.values():
            if snap["metadata"].get("namespace") != self.ident.namespace or not self._own(snap) \
                    or snap["metadata"].get("deletionTimestamp"):
                continue  # (a deleted one waits for KubeVirt's vmsnapshot-protection finalizer: gone already)
            meta, status = snap["metadata"], snap.get("status") or {}
            out.append({"name": (meta.get("annotations") or {}).get(m.ANNOTATION_SNAPSHOT_NAME, meta["name"]),
                        "object": meta["name"], "note": (meta.get("annotations") or {}).get(m.ANNOTATION_NOTE, ""),
                        "created": status.get("creationTime") or meta.get("creationTimestamp"),
                        "phase": status.get("phase") or "Pending", "ready": bool(status.get("readyToUse")),
                        "consistency": m.snapshot_consistency(snap),
                        "error": field_value(status, "error.message") or "",
                        "volumes": list(field_value(status, "snapshotVolumes.includedVolumes") or [])})
        return sorted(out, key=lambda s: (s["created"] or "", s["name"]))

    def _snapshot(self, name: str) -> dict | None:
        return next((s for s in self.snapshots() if s["name"] == name), None)

    async def take_snapshot(self, name: str, note: str = "", timeout: float = 300.0, again: bool = False) -> dict:
        """Snapshot every disk of the machine, running or stopped; return it once KubeVirt has
        finished (Succeeded) or say why it failed. `again`: a snapshot of that name that exists
        already is the one asked for (an operation picking up where it was interrupted)."""
        with refusals_explained(self.log, "take a snapshot"):
            await wait_synced(self.caches, self.log, timeout, self.ident.namespace)
            self._refuse_foreign()
            self._need(self.caches.snapshots)
            try:
                obj = m.virtual_machine_snapshot(self.ident, name, note)
            except ValueError as exc:
                raise WorkstationError(str(exc), reason=Reason.BAD_INPUT, status_code=400) from None
            if self.vm is None:
                raise WorkstationError("Your workstation has no machine yet: start it once, then take snapshots.",
                                       reason=Reason.NO_MACHINE, status_code=409)
            if not (again and self._snapshot(name)):
                try:
                    await self.kube.create(SNAPSHOT, obj)
                    self.log.info("snapshot %s requested", name)
                except k.KubeError as err:
                    if not (err.status == 409 and err.reason == "AlreadyExists"):
                        raise
                    if not again:
                        raise WorkstationError(f"A snapshot named {name} exists already; choose another name.",
                                               reason=Reason.SNAPSHOT_EXISTS, status_code=409) from None
                    # an interrupted operation's snapshot: it must be this workstation's, or the
                    # operation would wait for it in vain
                    await self._existing_own(SNAPSHOT, obj, self.caches.snapshots)

            def finished() -> dict | None:
                # Done, and the VM unlocked: KubeVirt refuses a stop or start while a snapshot holds
                # it (status.snapshotInProgress; pkg/storage/admitters/vm-storage-status.go), and
                # lets go a moment after the snapshot succeeded.
                snap = self._snapshot(name)
                locked = field_value(self.vm, "status.snapshotInProgress") == (snap or {}).get("object")
                return snap if snap and snap["phase"] in ("Succeeded", "Failed") and not locked else None
            try:
                done = await self.caches.wait_for(finished, timeout, self.ident.namespace)
            except asyncio.TimeoutError:
                raise WorkstationError(f"The snapshot {name} did not finish within {timeout:.0f} seconds; it may still. "
                                       "Look at your snapshots again in a minute.", reason=Reason.TIMEOUT,
                                       status_code=504) from None
            if done["phase"] == "Failed":
                raise WorkstationError(f"The snapshot {name} failed ({done['error'] or 'no reason given'}).",
                                       reason=Reason.SNAPSHOT_FAILED, status_code=500)
            self.log.info("snapshot %s done (%s)", name, done["consistency"])
            return done

    async def snapshots_size(self) -> float | None:
        """Bytes the snapshots' disks add up to: each VolumeSnapshot's restoreSize, the size of the
        disk it restores (Ceph keeps only the changed blocks). None when they cannot be read."""
        with refusals_explained(self.log, "count its snapshots' size"):
            try:
                listing = await self.kube.list(k.VOLUME_SNAPSHOT, self.ident.namespace,
                                               f"snapshot.kubevirt.io/source-vm-name={self.ident.vm}")
            except k.KubeError as err:
                if err.permission_denied:
                    raise
                self.log.debug("cannot list volume snapshots: %s", err)  # (no CSI snapshot API here)
                return None
        return float(sum(parse_quantity(field_value(vs, "status.restoreSize") or "0")
                         for vs in listing.get("items") or []))

    async def quotas(self) -> list[dict]:
        """The namespace's ResourceQuotas, each one's hard limits beside what is used (their
        status, which Kubernetes' quota controller keeps)."""
        with refusals_explained(self.log, "read its namespace's quotas"):
            listing = await self.kube.list(k.RESOURCE_QUOTA, self.ident.namespace)
        return [{"name": q["metadata"]["name"], "hard": dict(field_value(q, "status.hard") or {}),
                 "used": dict(field_value(q, "status.used") or {})} for q in listing.get("items") or []]

    async def filesystems(self) -> list[dict] | None:
        """The guest agent's filesystem list (mount point, used and total bytes, disk serials) of the
        running machine; None when it is not running or the agent does not answer."""
        if self.status() != "running" or condition(self.vmi, "AgentConnected").get("status") != "True":
            return None  # (virt-api answers 500 without an agent: nothing to ask, nothing to retry)
        with refusals_explained(self.log, "report its disk usage"):
            try:
                # one attempt: a 500 means the agent went meanwhile (a reboot), and the status waits for it
                answer = await self.kube.call("GET", k.VMI_SUBRESOURCES.path(self.ident.namespace, self.ident.vm,
                                                                             "filesystemlist"), repeatable=False)
            except k.KubeError as err:
                if err.permission_denied:
                    raise
                self.log.debug("no filesystem list from the guest agent: %s", err)  # (409: no agent yet)
                return None
        return (answer or {}).get("items") or []

    def snapshot_for_restore(self, name: str) -> dict:
        """The user's snapshot `name`, ready to be restored, or the sentence why not."""
        self._need(self.caches.snapshots)
        snap = self._snapshot(name)
        if snap is None:
            raise WorkstationError(f"There is no snapshot named {name}.", reason=Reason.NO_SNAPSHOT, status_code=404)
        if not snap["ready"]:
            raise WorkstationError(f"The snapshot {name} is not ready yet; try again when it is.",
                                   reason=Reason.SNAPSHOT_NOT_READY, status_code=409)
        # An in-place restore puts back every volume the snapshot holds: shared data among them
        # would go back in time for everyone who uses it (KubeVirt snapshots a claim whose
        # StorageClass has a VolumeSnapshotClass).
        shared = sorted(v for v in set(snap["volumes"]) - set(m.OWN_VOLUMES) if not v.startswith(m.EXTRA_DISK_PREFIX))
        if shared:
            raise WorkstationError(
                f"The snapshot {name} also holds the shared data {', '.join(shared)}, which a restore would put back "
                "as it was for everyone who uses it, so nothing was restored. Ask your administrator: shared data "
                "belongs on a StorageClass without a VolumeSnapshotClass.", reason=Reason.SNAPSHOT_HOLDS_SHARED_DATA,
                status_code=409)
        return snap

    async def restore_snapshot(self, name: str, restore_name: str, timeout: float = 600.0) -> dict:
        """Put the stopped machine's disks back as they were in snapshot `name`, in place and owned
        by nobody, with a VirtualMachineRestore called `restore_name` (made unless it exists: an
        interrupted operation follows the one it made). Returns the finished restore."""
        with refusals_explained(self.log, "be restored"):
            await wait_synced(self.caches, self.log, timeout, self.ident.namespace)
            self._refuse_foreign()
            snap = self.snapshot_for_restore(name)
            if self.status() != "stopped":
                raise WorkstationError("Your workstation must be stopped to be restored; stop it first.",
                                       reason=Reason.RUNNING, status_code=409)
            # In place, KubeVirt deletes the disks it replaces (pkg/storage/snapshot/restore.go):
            # their volumes go with them, so they are marked Delete first. From here every way out
            # (done, failed, timed out, refused, cancelled) gives the claims that are still there
            # Retain back: the `finally`. A crash of the service in between is the operation's to
            # finish: its resumed run comes back here with the same restore.
            replaced = self._claims()
            try:
                # Made once: KubeVirt's webhook refuses a second restore of the VM while one is not
                # complete (pkg/storage/admitters/vmrestore.go), even one of the same name, before
                # the API server could say it exists.
                if not await self._restore_object(restore_name):
                    await self.set_reclaim_policy(replaced)
                    await self.kube.create(k.RESTORE, m.virtual_machine_restore(self.ident, snap["object"],
                                                                                restore_name))
                    self.log.info("restoring snapshot %s (%s)", name, restore_name)
                return await self._wait_restored(name, restore_name, replaced, timeout)
            finally:
                await asyncio.shield(self._keep_surviving(replaced))

    async def _wait_restored(self, name: str, restore_name: str, replaced: list[dict], timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:  # restores are rare and have no cache: one list a second by name
            current = await self._restore_object(restore_name)
            status = (current or {}).get("status") or {}
            if status.get("complete"):
                self.log.info("restored snapshot %s", name)
                await self._restored(restore_name)
                return current or {}
            failure = condition(current or {}, "Failure")
            if current is None:
                why = f"VirtualMachineRestore {self.ident.namespace}/{restore_name} was deleted before it finished"
            elif failure.get("status") == "True":
                why = failure.get("message") or failure.get("reason") or "no reason given"
            elif time.monotonic() > deadline:
                # restore.go's errors (a missing VolumeSnapshot, a quota refusing a claim, a lost
                # claim) only say so in Ready's reason and are tried again without end: no Failure
                ready = condition(current, "Ready")
                why = (f"not finished within {timeout:.0f} seconds: "
                       f"{ready.get('message') or ready.get('reason') or 'no reason given'}")
            else:
                await asyncio.sleep(1.0)
                continue
            raise await self._abandon_restore(name, restore_name, replaced, why, failed=current is None or
                                              failure.get("status") == "True")

    async def _abandon_restore(self, name: str, restore_name: str, replaced: list[dict], why: str,
                               failed: bool) -> WorkstationError:
        """A restore that will not finish by itself. One that replaced no disk yet goes (KubeVirt's
        finalizer unlocks the VM: restore.go handleVMRestoreDeletion): the workstation is as it
        was. One that replaced a disk stays if KubeVirt still tries it (fixing the cause lets it
        finish), and the sentence names it; a failed one goes, and a new restore finishes the job."""
        ns = self.ident.namespace
        if not failed and not await self._replaced_any(replaced):
            await self.kube.delete(k.RESTORE, ns, restore_name)
            if not await self._replaced_any(replaced):  # (KubeVirt may have gone on meanwhile)
                return WorkstationError(f"Restoring the snapshot {name} did not work ({why}). It was cancelled before "
                                        "any disk was replaced: your workstation is as it was. Try again later; if it "
                                        "fails again, ask your administrator.", reason=Reason.RESTORE_FAILED,
                                        status_code=500)
            failed = True
        if failed:
            if await self._restore_object(restore_name):
                await self.kube.delete(k.RESTORE, ns, restore_name)
            if not await self._replaced_any(replaced):
                return WorkstationError(f"Restoring the snapshot {name} failed ({why}); no disk was replaced: your "
                                        "workstation is as it was.", reason=Reason.RESTORE_FAILED, status_code=500)
            return WorkstationError(f"Restoring the snapshot {name} failed ({why}) after some of your disks were "
                                    f"replaced; restore the snapshot {name} again to finish it before you start your "
                                    "workstation.", reason=Reason.RESTORE_FAILED, status_code=500)
        return WorkstationError(
            f"Restoring the snapshot {name} stopped half-way ({why}). Your workstation cannot start until an "
            f"administrator fixes that so that VirtualMachineRestore {ns}/{restore_name} can finish (kubectl -n {ns} "
            f"describe virtualmachinerestore {restore_name}), or deletes it and restores the snapshot again.",
            reason=Reason.RESTORE_STUCK, status_code=500)

    async def _replaced_any(self, claims: list[dict]) -> bool:
        """Whether any of `claims` (as they were before the restore) is gone or going: read from the
        API server, not the cache, since this decides whether a restore may be cancelled."""
        if not claims:
            return False
        # (a list, as the caches read claims: the hub's RBAC grants no get of one)
        found = await self.kube.list(k.PVC, self.ident.namespace)
        now = {c["metadata"]["name"]: c for c in found.get("items") or []}
        for claim in claims:
            meta = claim["metadata"]
            current = now.get(meta["name"])
            if current is None or current["metadata"]["uid"] != meta["uid"] or \
                    current["metadata"].get("deletionTimestamp"):
                return True
        return False

    async def _keep_surviving(self, replaced: list[dict], tries: int = 5):
        """The claims a restore did not replace (after all) keep their volumes against mistakes
        again. The API server may refuse for a while (a burst of errors): tried again, and if it
        still refuses, the sentence says which volumes an admin must set back."""
        uids = {c["metadata"]["uid"] for c in replaced}
        delay = 1.0
        for attempt in range(tries):
            surviving = [c for c in self._claims() if c["metadata"]["uid"] in uids]
            try:
                await self.set_reclaim_policy(surviving, "Retain")
                return
            except k.KubeError as err:
                if err.permission_denied:
                    raise  # no retry mends that: the hub's RBAC, explained as any refusal
                if attempt == tries - 1:
                    volumes = ", ".join(field_value(c, "spec.volumeName") or "?" for c in surviving)
                    self.log.error("could not set the reclaim policy of %s back to Retain: %s", volumes, err.message)
                    raise WorkstationError(
                        f"The volumes of your disks could not be set back to keep their data if their claims are "
                        f"deleted ({err.for_users}); ask your administrator to set persistentVolumeReclaimPolicy "
                        f"to Retain on PersistentVolume {volumes}.", reason=Reason.RECLAIM_POLICY, status_code=500) from err
                await asyncio.sleep(delay)
                delay *= 2

    async def _restored(self, restore_name: str):
        """After a restore: the VM has the snapshot's spec but still the current spec's hash, so
        the hash goes and the next start applies the current profile; the restore object goes too
        (the operation's record and the log keep what happened)."""
        await self.kube.patch(k.VM, self.ident.namespace, self.ident.vm,
                              {"metadata": {"annotations": {ANNOTATION_SPEC_HASH: None}}})
        await self.kube.delete(k.RESTORE, self.ident.namespace, restore_name)

    async def _restore_object(self, name: str) -> dict | None:
        found = await self.kube.list(k.RESTORE, self.ident.namespace, field_selector=f"metadata.name={name}")
        return next(iter(found.get("items") or []), None)

    def _claims(self) -> list[dict]:
        """The machine's disks' claims (system, workspace and extra disks, those it has)."""
        names_ = (self.ident.rootdisk, self.ident.workspace, *self.extra_claims)
        return [c for c in (self.caches.pvcs.get(self.ident.namespace, n) for n in names_) if c is not None]

    async def set_reclaim_policy(self, claims: list[dict], policy: str = "Delete"):
        """Set the reclaim policy of the volumes bound to `claims`: Delete before the hub deletes
        them on purpose (a reset, a purge, a restore in place), so that their RBD images go too
        instead of staying Released under the storage class's Retain."""
        for claim in claims:
            volume = field_value(claim, "spec.volumeName")
            if not volume:
                continue  # never bound: no volume holds data
            try:
                await self.kube.patch(k.PV, None, volume, m.reclaim_patch(policy))
            except k.KubeError as err:
                if not err.not_found:
                    raise
            else:
                self.log.info("volume %s of %s: reclaim policy %s", volume, claim["metadata"]["name"], policy)

    async def delete_root_disk(self, timeout: float = 300.0):
        """Delete the system disk (its DataVolume and PVC) of a stopped machine and wait until both are
        gone. Only a system reset does this; the workspace disk is never touched."""
        with refusals_explained(self.log, "delete its system disk"):
            await wait_synced(self.caches, self.log, timeout, self.ident.namespace)
            self._refuse_foreign()
            if self.attached_elsewhere() or self.status() != "stopped":
                raise WorkstationError("Your workstation must be stopped before its system disk is replaced.",
                                       reason=Reason.RUNNING, status_code=409)
            ident = self.ident
            if self.rootdisk_pvc is not None:
                await self.set_reclaim_policy([self.rootdisk_pvc])
            for kind in (k.DV, k.PVC):
                if await self.kube.delete(kind, ident.namespace, ident.rootdisk):
                    self.log.info("deleted %s %s", kind.kind, ident.rootdisk)
            try:
                await self.caches.wait_for(lambda: self.rootdisk is None and self.rootdisk_pvc is None, timeout,
                                           ident.namespace)
            except asyncio.TimeoutError:
                raise WorkstationError(f"The old system disk was not gone within {timeout:.0f} seconds; ask your "
                                       f"administrator to look at PersistentVolumeClaim {ident.namespace}/"
                                       f"{ident.rootdisk}.", reason=Reason.TIMEOUT, status_code=504) from None

    async def clone_root_disk(self, timeout: float = 900.0) -> dict:
        """A new system disk cloned from the golden image of the current settings (a reset), once
        cloned; the machine boots from it at its next start."""
        with refusals_explained(self.log, "get a new system disk"):
            self._refuse_foreign()
            await self._ensure(k.DV, m.root_datavolume(self.ident, self.spec), self.caches.dvs)
            self.log.info("cloning a new system disk from %s", self.spec.golden_image)

            def cloned() -> dict | None:
                current = self.rootdisk
                phase = field_value(current, "status.phase")
                return current if phase == "Succeeded" or phase in WAITING_FOR_CONSUMER else None
            try:
                return await self.caches.wait_for(cloned, timeout, self.ident.namespace)
            except asyncio.TimeoutError:
                raise WorkstationError(f"The new system disk was not cloned within {timeout:.0f} seconds; it may "
                                       "still be. Start your workstation later, or ask your administrator.",
                                       reason=Reason.TIMEOUT, status_code=504) from None

    async def delete_snapshot(self, name: str):
        with refusals_explained(self.log, "delete a snapshot"):
            await wait_synced(self.caches, self.log, self.settings.stop_timeout, self.ident.namespace)
            self._refuse_foreign()
            self._need(self.caches.snapshots)
            snap = self._snapshot(name)
            if snap is None or not await self.kube.delete(SNAPSHOT, self.ident.namespace, snap["object"]):
                raise WorkstationError(f"There is no snapshot named {name}.", reason=Reason.NO_SNAPSHOT, status_code=404)
            # Until the cache has seen the deletion, counts and listings would still show it.
            try:
                await self.caches.wait_for(lambda: self._snapshot(name) is None, self.settings.stop_timeout,
                                           self.ident.namespace)
            except asyncio.TimeoutError:
                self.log.warning("snapshot %s deleted, but the hub's cache has not seen it yet", name)
            self.log.info("snapshot %s deleted", name)

    def disks_and_snapshots(self) -> list[tuple[k.Kind, dict]]:
        """This workstation's DataVolumes, PVCs and snapshots as the caches have them."""
        return [(kind, obj) for kind, cache in ((k.DV, self.caches.dvs), (k.PVC, self.caches.pvcs),
                                                (SNAPSHOT, self.caches.snapshots))
                for obj in cache.values() if obj["metadata"]["namespace"] == self.ident.namespace and self._mine(obj)]

    # ------------------------------------------------------------ retire
    async def retire(self) -> list[str]:
        """Delete the VM, Service and Secret; keep every disk and snapshot, marked as retained
        until `retention_days` from now. Returns the names of what was kept."""
        with refusals_explained(self.log, "be deleted"):
            return await self._retire()

    async def _retire(self) -> list[str]:
        ident = self.ident
        await wait_synced(self.caches, self.log, self.settings.stop_timeout, self.ident.namespace)
        # Under names another workstation has taken (a forced slug collision) the machine, its
        # Service and Secret are the other's: an account deleted keeps only what is its own.
        foreign = self._foreign_object()
        if foreign is None:
            await self.stop(now=True)
        until = (datetime.now(timezone.utc) + timedelta(days=self.settings.retention_days)).strftime(
            "%Y-%m-%dT%H:%M:%SZ")
        patch = m.retained_patch(until, self.ident.user_created)
        kept, claims = [], []
        selector = f"{m.LABEL_WORKSTATION}={ident.slug}"
        for kind in (k.DV, k.PVC, SNAPSHOT):
            try:
                listing = await self.kube.list(kind, ident.namespace, selector)
            except k.KubeError as err:
                if err.not_found and kind is SNAPSHOT:
                    continue  # snapshots not installed on this cluster
                raise
            for obj in listing.get("items") or []:
                if self._mine(obj) is None:
                    continue  # the slug is only a hash: another workstation's under a colliding one
                await self.kube.patch(kind, ident.namespace, obj["metadata"]["name"], patch)
                kept.append(f"{kind.kind}/{obj['metadata']['name']}")
                if kind is k.PVC:
                    claims.append(obj)
        # Kept means kept: a restore cut off in its window (its volumes at Delete until it gives
        # Retain back) loses its record with the VM, and nothing else would set them back.
        await self.set_reclaim_policy(claims, "Retain")
        for kind, name in ((k.VM, ident.vm), (k.SERVICE, ident.service), (k.SECRET, ident.secret)):
            if foreign is None:
                await self.kube.delete(kind, ident.namespace, name)
        self.log.info("retired %s; kept %s until %s", ident.vm, ", ".join(kept) or "nothing", until)
        return kept


class _StartSteps:
    """Reads the caches after each change and reports where the start is; returns the URL when ready."""

    def __init__(self, ws: Workstation, report: Report):
        self.ws, self.report = ws, report
        self.last: tuple[int, str] | None = None
        self.waiting_for = "the workstation to start"
        self.start_seen = False
        self.clone_state: tuple | None = None  # what the clone last showed, and since when
        self.clone_since = time.monotonic()

    def say(self, percent: int, message: str):
        if (percent, message) != self.last:
            self.last = (percent, message)
            self.report(percent, message)

    def check(self) -> str | None:
        ws, spec = self.ws, self.ws.spec
        dv = ws.rootdisk
        phase = field_value(dv, "status.phase")
        if dv is not None and phase == "Failed":
            raise WorkstationError(f"Cloning your system disk from {spec.golden_name} failed "
                                   f"({condition(dv, 'Running').get('message') or 'see the cluster events'}). "
                                   "Ask your administrator to check the golden image and storage.",
                                   reason=Reason.CLONE_FAILED, status_code=500)
        if dv is not None and phase != "Succeeded":
            self.waiting_for = "the system disk clone to finish"
            if phase not in WAITING_FOR_CONSUMER:
                self._check_clone_moves(dv, ws.ident.rootdisk, f"Cloning your system disk from {spec.golden_name}")
            if phase in COPY_ON_WRITE_PHASES:  # no progress to report
                self.say(20, f"Cloning your system disk from {spec.golden_name} (copy-on-write)")
                return None
            try:
                pct = float((field_value(dv, "status.progress") or "").rstrip("%"))
            except ValueError:  # "N/A" before a copy has begun
                self.say(5, f"Cloning your system disk from {spec.golden_name}")
                return None
            self.say(5 + int(pct * 0.55), f"Cloning your system disk from {spec.golden_name}: {pct:.0f}%")
            return None
        if self._making_extra_disk():
            return None
        if ws.vmi is not None or field_value(ws.vm, "spec.runStrategy") not in (None, "Halted"):
            self.start_seen = True
        elif self.start_seen:  # running was asked for, and now it is not: someone stopped it
            raise WorkstationError("Your workstation was stopped while it was starting. Start it again.",
                                   reason=Reason.STOPPED_WHILE_STARTING)
        vmi = ws.vmi
        if vmi is None or vmi["metadata"].get("deletionTimestamp"):
            self.waiting_for = "the virtual machine to be created"
            self.say(62, "Creating your virtual machine")
            return None
        vmi_phase = field_value(vmi, "status.phase")
        if vmi_phase in FINAL_PHASES:
            raise WorkstationError("Your workstation shut down while it was booting. Start it again; if it keeps "
                                   "happening, ask your administrator.", reason=Reason.BOOT_FAILED, status_code=500)
        if ws.caches.on_unreachable_node(vmi):
            ws._refuse_double_attach()
        scheduled = condition(vmi, "PodScheduled")
        if not field_value(vmi, "status.nodeName"):
            if scheduled.get("status") == "False":
                self._unschedulable(scheduled.get("message") or "")
                return None
            self.waiting_for = "a node"
            self.say(65, "Waiting for a node" + self._gpu_phrase())
            return None
        if vmi_phase != "Running":
            self.waiting_for = "the machine to boot"
            self.say(75, f"Booting on {field_value(vmi, 'status.nodeName')}")
            return None
        if condition(vmi, "AgentConnected").get("status") != "True":
            self.waiting_for = "the guest agent to connect"
            self.say(82, "Booting")
            return None
        self.say(90, "Guest agent connected")
        address = (field_value(vmi, "status.interfaces") or [{}])[0].get("ipAddress")
        url = ws.url()
        if not address or not url:
            self.waiting_for = "a network address"
            return None
        self.say(95, "Starting Jupyter")
        return url

    def _making_extra_disk(self) -> bool:
        """Whether an extra disk is still being made (a clone as long as its copy takes); the
        machine cannot boot before. One that fails or makes no progress fails the start."""
        ws = self.ws
        for disk in ws.spec.extra_disks:
            name = m.extra_disk_claim(ws.ident, disk)
            dv = ws._mine(ws.caches.dvs.get(ws.ident.namespace, name))
            phase = field_value(dv, "status.phase")
            if dv is None or phase == "Succeeded" or phase in WAITING_FOR_CONSUMER:
                continue
            what = f"Making your extra disk {disk.name}" + (f" from {disk.clone_from}" if disk.clone_from else "")
            if phase == "Failed":
                why = condition(dv, "Running").get("message") or "see the cluster events"
                raise WorkstationError(f"{what} failed ({why}). Ask your administrator to check the profile's extra "
                                       "disks and the storage.", reason=Reason.CLONE_FAILED, status_code=500)
            self.waiting_for = f"the extra disk {disk.name}"
            self.say(60, what)
            self._check_clone_moves(dv, name, what)
            return True
        return False

    def _check_clone_moves(self, dv: dict, claim: str, what: str):
        """CDI never fails a clone that cannot proceed: it keeps its phase and says why in Warning
        events and conditions. No change for `clone_stall_timeout` fails the start with CDI's words,
        and frees the system disk clone's place in the queue for others."""
        ws = self.ws
        state = (claim, field_value(dv, "status.phase"), field_value(dv, "status.progress"))
        now = time.monotonic()
        if state != self.clone_state:
            self.clone_state, self.clone_since = state, now
            return
        stalled = now - self.clone_since
        if stalled < ws.settings.clone_stall_timeout:
            return
        if claim == ws.ident.rootdisk:
            ws.settings.clone_gate.give_up((ws.ident.namespace, ws.ident.rootdisk))
        raise WorkstationError(
            f"{what} has made no progress for {stalled:.0f} seconds ({self._clone_trouble(dv, claim)}). Ask your "
            "administrator to check the golden image, the profile's disks and the storage.",
            reason=Reason.CLONE_FAILED, status_code=500)

    def _clone_trouble(self, dv: dict, claim: str) -> str:
        """CDI's own words: the newest Warning about the disk, else a condition that is not True."""
        ws = self.ws
        events = ws.caches.events_for(ws.ident.namespace, {claim})
        if events:
            return f"{events[-1].get('reason')}: {events[-1].get('message')}"
        for ctype in ("Bound", "Running"):
            cond = condition(dv, ctype)
            if cond.get("status") == "False" and cond.get("reason"):
                return f"{cond['reason']}: {cond.get('message') or ''}".rstrip(": ")
        return f"phase {field_value(dv, 'status.phase') or 'Pending'}, no events"

    def _gpu_phrase(self) -> str:
        devices = [d for d, n in self.ws.spec.gpus if n]
        return f" with a free {', '.join(devices)}" if devices else ""

    def _unschedulable(self, message: str):
        devices = [d for d, n in self.ws.spec.gpus if n]
        short_of_gpu = [d for d in devices if d in message]
        if short_of_gpu:
            text = f"Waiting for a node with a free {', '.join(short_of_gpu)}: all are in use"
            self.waiting_for = f"a free {', '.join(short_of_gpu)}"
            if self.ws.settings.gpu_unavailable == "fail":
                raise WorkstationError(f"No {', '.join(short_of_gpu)} is free right now ({message}). Try again "
                                       "later or choose a profile without a GPU.", reason=Reason.GPU_UNAVAILABLE,
                                       status_code=503)
        else:
            text = f"Waiting for a node: {message}"
            self.waiting_for = "a node with enough free resources"
        self.say(65, text)
        return None

    def timeout_message(self, timeout: float) -> str:
        gpus = self.waiting_for.startswith("a free ")
        hint = "Try again later or choose a smaller profile." if gpus or "node" in self.waiting_for \
            else "Try again; if it keeps failing, ask your administrator."
        return f"Your workstation did not start within {timeout:.0f} seconds while waiting for {self.waiting_for}. {hint}"
