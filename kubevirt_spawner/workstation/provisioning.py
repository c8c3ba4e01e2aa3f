"""Provisioning a workstation: its namespace and guards, its disks, VM and Service created or
kept up to date, before each start."""

from __future__ import annotations

import asyncio
import copy
import json
import time

from .. import kube as k
from .. import manifests as m
from ..objects import field_value
from ..reasons import Reason
from ..reflector import within
from .base import (
    ANNOTATION_SPEC_HASH,
    CHECK_ONLY,
    Report,
    WorkstationError,
    spec_hash,
    wait_synced,
)
from .disks import Disks


class Provisioning(Disks):
    """What a start makes or updates before the VM runs; nothing here starts it."""

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
        await self._withdraw_deletion(vm)
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

    async def _withdraw_deletion(self, vm: dict | None):
        """A deletion asked while a restore or reset ran and not carried out (the restore stopped
        with the machine locked): a start means the user wants the machine, so a restarted service
        must not carry that deletion out (Actions.resume_interrupted)."""
        if vm is not None and m.ANNOTATION_DELETE_REQUESTED in (vm["metadata"].get("annotations") or {}):
            await self.kube.patch(k.VM, self.ident.namespace, self.ident.vm,
                                  {"metadata": {"annotations": {m.ANNOTATION_DELETE_REQUESTED: None}}})
            self.log.info("started again: the deletion asked while an operation ran is withdrawn")

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
        # (keeping what KubeVirt set that the guest depends on: its firmware UUID is cloud-init's
        # instance-id, and a new one would give the machine new SSH host keys)
        template = m.keep_machine_identity(vm["spec"].get("template") or {}, desired["spec"]["template"])
        ops = [{"op": "replace", "path": "/spec/template", "value": template}]
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
