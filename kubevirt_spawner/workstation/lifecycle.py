"""A workstation's start (resume) and stop: one at a time, bounded by the start's deadline, leaving
nothing running after a failed start."""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timedelta, timezone

from .. import kube as k
from .. import manifests as m
from ..objects import FINAL_PHASES, field_value
from ..reasons import Reason
from .base import (
    ALREADY_RUNNING,
    SNAPSHOT,
    STALL_CHECK_SECONDS,
    Report,
    WorkstationError,
    _ignore_report,
    _once,
    refusals_explained,
    wait_synced,
)
from .progress import _StartSteps
from .provisioning import Provisioning


class Lifecycle(Provisioning):
    """Start and stop, each one task per workstation (`_once`)."""

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
