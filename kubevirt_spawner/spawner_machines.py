"""From the settings and a user's choice to a machine: the profiles a user may start, the
workstation's names, its MachineSpec, the hub-wide API client and caches, and the checks of the
configuration as a whole."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json

from jupyterhub.utils import maybe_future
from traitlets import TraitError

from . import kube as k
from . import manifests as m
from . import names
from . import profiles as prof
from .objects import field_value, merge_patch
from .quantity import format_bytes, parse_quantity
from .reasons import Reason
from .reflector import Caches
from .spawner_settings import KubeVirtSpawnerSettings
from .workstation import CloneGate, Settings, Workstation, WorkstationError, refusals_explained, wait_synced

TEMPLATE_SETTINGS = {key: f"KubeVirtSpawner.{key}_name_template" for key in names.DEFAULT_TEMPLATES}
TEMPLATE_SETTINGS["namespace"] = "KubeVirtSpawner.namespace_template"
# Hub-wide shared state: one API client, one set of caches and one clone gate per cluster.
_shared: dict[tuple, dict] = {}


def cpu_quantity(cpu: float) -> str:
    return str(int(cpu)) if float(cpu).is_integer() else f"{int(round(cpu * 1000))}m"


class SpawnerMachines(KubeVirtSpawnerSettings):
    """The machines the settings make, and the Workstation of this spawner's user and server."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._ident: m.Identity | None = None  # the workstation's names, once known (get_state keeps them)
        self._current: Workstation | None = None
        self.check_config()

    def check_config(self):
        """Fail early, naming the setting, on configuration that could never work."""
        try:
            names.identity("alice", "gpu", self._templates(), TEMPLATE_SETTINGS)
        except ValueError as exc:
            raise TraitError(str(exc)) from None
        if self.max_concurrent_clones < 1:
            raise TraitError("KubeVirtSpawner.max_concurrent_clones must be at least 1")
        if self.max_concurrent_csi_clones < 0:
            raise TraitError("KubeVirtSpawner.max_concurrent_csi_clones must be 0 (no limit) or more")
        if self.clone_stall_timeout >= self.start_timeout:
            raise TraitError(f"KubeVirtSpawner.clone_stall_timeout ({self.clone_stall_timeout:.0f}) must be shorter "
                             f"than start_timeout ({self.start_timeout}), or a stuck clone is never noticed")
        if not callable(self.profile_list):
            self._profiles()

    def _profiles(self) -> list[dict]:
        """The static profile_list, checked (a callable's is only known per user: _profiles_now)."""
        raw = [] if callable(self.profile_list) else self.profile_list
        try:
            return prof.normalise(raw or [])
        except prof.ProfileError as exc:
            raise TraitError(f"KubeVirtSpawner.profile_list: {exc}") from None

    async def _profiles_now(self) -> list[dict]:
        """The profiles as they are for this spawner now: a callable profile_list is asked (and
        awaited when it is async); a bad list is the administrator's to mend, said in a sentence."""
        if not callable(self.profile_list):
            return self._profiles()
        try:
            return prof.normalise(await maybe_future(self.profile_list(self)) or [])
        except prof.ProfileError as exc:
            raise WorkstationError(f"This hub's profile list cannot be used ({exc}). Tell your administrator.",
                                   reason=Reason.PROFILE) from None
        except Exception:
            self.log.exception("profile_list failed for %s", self._log_name)
            raise WorkstationError("This hub's profile list failed, so no profile can be chosen now. Tell your "
                                   "administrator; the hub's log has the error.", reason=Reason.PROFILE) from None

    def _group_names(self) -> list[str]:
        return [group.name for group in getattr(self.user, "groups", None) or []]

    async def _selection(self, user_options: dict, check_access: bool = True) -> prof.Selection | None:
        try:
            return prof.choose(await self._profiles_now(), user_options, self.user.name, self._group_names(),
                               check_access=check_access)
        except prof.ProfileError as exc:
            raise WorkstationError(str(exc), reason=Reason.PROFILE) from None

    async def _resolved(self, selection: prof.Selection | None) -> list[dict]:
        """The selection's overrides with callable values called (with this spawner; awaited when
        async), in the order they apply."""
        if selection is None:
            return []
        out = []
        for override in prof.overrides(selection):
            values = {}
            for name, value in override.items():
                try:
                    values[name] = await maybe_future(value(self)) if callable(value) else value
                except Exception:
                    self.log.exception("the profile %s's %s failed for %s", selection.slug, name, self._log_name)
                    raise WorkstationError(
                        f"The profile {selection.slug!r} could not work out its {name}. Tell your administrator; the "
                        "hub's log has the error.", reason=Reason.PROFILE) from None
            out.append(values)
        return out

    async def _spec_for(self, selection: prof.Selection | None) -> m.MachineSpec:
        return self._machine_spec(selection, await self._resolved(selection))

    def _shared(self) -> dict:
        ns_scope = self.namespace_template if "{" not in self.namespace_template else None
        key = (self.kubeconfig, self.kube_context, ns_scope, self.events_enabled)
        shared = _shared.get(key)
        if shared is None:
            # Shared by every spawner of the hub: it logs through the hub's logger.
            kube = k.Kube(k.load_api_client(self.kubeconfig, self.kube_context), self.log,
                          self.k8s_api_request_timeout, self.k8s_api_retry_timeout)
            caches = Caches(kube, m.LABEL_WORKSTATION, ns_scope, events=self.events_enabled)
            gate = CloneGate(self.max_concurrent_clones, self.max_concurrent_csi_clones)
            gate.attach(caches)
            shared = _shared[key] = {"kube": kube, "caches": caches, "gate": gate}
        shared["caches"].start()
        return shared

    # ---------------------------------------------------------------- identity and spec
    def _templates(self) -> dict[str, str]:
        return {"namespace": self.namespace_template, "vm": self.vm_name_template,
                "rootdisk": self.rootdisk_name_template, "workspace": self.workspace_name_template,
                "secret": self.secret_name_template, "service": self.service_name_template}

    @property
    def _log_name(self) -> str:
        return names.printable(super()._log_name)  # a user may choose a name with a newline

    def _user_created(self) -> str:
        """When the hub made this account (the service's stand-in users have no such record)."""
        created = getattr(self.user, "created", None)
        return created.isoformat() if created is not None else ""

    def _template_identity(self) -> m.Identity:
        return names.identity(self.user.name, self.name or "", self._templates(), TEMPLATE_SETTINGS,
                              user_created=self._user_created())

    def _found_identity(self, caches: Caches) -> m.Identity | None:
        """The workstation's names as they are in the cluster (after a restart that lost the state,
        or for kept disks after the server was deleted): found by the raw names, never by a slug.
        The slug found names what the machine does not (a workspace disk made later); names made
        with another hash (an older version's) stay."""
        user, server = self.user.name, self.name or ""
        for vm in caches.vms.values():
            if not m.belongs_to(vm, user, server):
                continue
            ident = self._identity_from(vm)
            volumes = {v["name"]: v for v in vm["spec"]["template"]["spec"].get("volumes") or []}
            claims = {name: field_value(v, "persistentVolumeClaim.claimName") for name, v in volumes.items()}
            service = next((s["metadata"]["name"] for s in caches.services.values()
                            if s["metadata"]["namespace"] == ident.namespace and m.belongs_to(s, user, server)
                            and (s["metadata"].get("labels") or {}).get(m.LABEL_WORKSTATION) == ident.slug),
                           ident.service)
            return dataclasses.replace(
                ident, vm=vm["metadata"]["name"], rootdisk=claims.get("rootdisk") or ident.rootdisk,
                workspace=claims.get("workspace") or ident.workspace,
                secret=(volumes.get(m.ENV_DISK_SERIAL) or {}).get("secret", {}).get("secretName") or ident.secret,
                service=service)
        for disk in (*caches.dvs.values(), *caches.pvcs.values()):  # no machine: a kept system disk
            # (its PVC carries the DataVolume's labels and annotations, and may be all that is left)
            if m.belongs_to(disk, user, server) and (disk["metadata"].get("labels") or {}).get(
                    m.LABEL_COMPONENT) == "rootdisk":
                return dataclasses.replace(self._identity_from(disk), rootdisk=disk["metadata"]["name"])
        return None

    def _identity_from(self, obj: dict) -> m.Identity:
        """The names the templates give with the slugs `obj` is labelled with, in its namespace."""
        template = self._template_identity()
        labels = obj["metadata"].get("labels") or {}
        fields = {"user": labels.get(m.LABEL_USER, template.user_slug), "server": labels.get(m.LABEL_SERVER, ""),
                  "user_server": labels.get(m.LABEL_WORKSTATION, template.slug)}
        named = {key: names.render(t, TEMPLATE_SETTINGS.get(key, key), service=key == "service", **fields)
                 for key, t in self._templates().items()}
        return dataclasses.replace(template, slug=fields["user_server"], user_slug=fields["user"],
                                   server_slug=fields["server"], **{**named, "namespace": obj["metadata"]["namespace"]})

    async def _workstation(self, spec: m.MachineSpec | None = None, for_start: bool = False) -> Workstation:
        """For a start, a workstation with `spec` (from the current settings and the user's profile
        and choices: hooks may have changed them). Poll, stop and the like do not depend on the
        spec: they reuse the last one (poll is hot)."""
        if not for_start and self._current is not None:
            return self._current
        shared = self._shared()
        caches = shared["caches"]
        if self._ident is None:
            with refusals_explained(self.log, "be found"):
                await wait_synced(caches, self.log, self.k8s_api_retry_timeout)
            self._ident = self._found_identity(caches) or self._template_identity()
        settings = Settings(url_mode=self.url_mode, cluster_domain=self.cluster_domain,
                            gpu_unavailable=self.gpu_unavailable,
                            start_timeout=max(1.0, self.start_timeout - 5), stop_timeout=self.stop_timeout,
                            retention_days=self.retention_days, clone_stall_timeout=self.clone_stall_timeout,
                            clone_gate=shared["gate"],
                            network_policy_from=tuple(self.network_policy_ingress_from),
                            namespace_quota=dict(self.namespace_resource_quota),
                            namespace_limits=tuple(self.namespace_limit_range),
                            namespace_labels=dict(self.namespace_labels),
                            namespace_annotations=dict(self.namespace_annotations))
        self._current = Workstation(shared["kube"], caches, self._ident, spec or self._machine_spec(None), settings,
                                    self.log, vm_hook=self._modify_vm if self.modify_vm_hook is not None else None)
        return self._current

    async def _modify_vm(self, vm: dict) -> dict:
        return await maybe_future(self.modify_vm_hook(self, vm))

    async def workstation(self, profile_slug: str | None = None, options: dict | None = None) -> Workstation:
        """This server's lifecycle object with the machine spec of the profile `profile_slug` and
        the user's choices in it, as the VM records them (its defaults when the choices no longer
        fit; the hub's own settings when the profile is gone or none is recorded): for the
        workstations service, which acts on servers from outside the hub's process."""
        profiles = await self._profiles_now()  # (a list that cannot be had is an error here too)
        selection = None
        if any(p["slug"] == profile_slug for p in profiles):
            for asked in ({"profile": profile_slug, **(options or {})}, {"profile": profile_slug}):
                with contextlib.suppress(prof.ProfileError):  # (choices the profile no longer has: its defaults)
                    selection = prof.choose(profiles, asked, check_access=False)
                    break
        elif profile_slug:
            # never another profile (it may be some group's): the hub's own settings
            self.log.warning("%s: its profile %r is no longer in profile_list; acting with the hub's own settings",
                             self._log_name, profile_slug)
        # (no profile recorded: a machine made before there were profiles, with the hub's own settings)
        return await self._workstation(await self._spec_for(selection), for_start=True)

    def _machine_spec(self, selection: prof.Selection | dict | None,
                      overrides: list[dict] | None = None) -> m.MachineSpec:
        """The machine from the settings with `overrides` applied in order (a dict merges, any
        other value replaces); without them, a profile's own override as it is (no callables)."""
        if isinstance(selection, dict):  # a profile without choices
            selection = prof.Selection(selection)
        profile = selection.profile if selection else {}
        slug = profile.get("slug", "")
        if overrides is None:
            overrides = [profile.get("kubevirt_override") or {}]
        values = {}
        for name in prof.OVERRIDABLE:
            value, changed = getattr(self, name), False
            for override in overrides:
                if name in override:
                    value, changed = merge_patch(copy.deepcopy(value), override[name]), True
            try:
                values[name] = self.traits()[name]._validate(self, value) if changed else value
            except TraitError as exc:
                raise WorkstationError(f"Profile {slug!r} has an invalid {name}: {exc}. Tell your "
                                       "administrator.", reason=Reason.PROFILE) from None
        mem_limit = values["mem_limit"]
        guest = values["memory_guest"] or mem_limit or values["mem_guarantee"]
        golden = values["golden_image"]
        shared, disks = m.shared_data(values["shared_data"]), m.extra_disks(values["extra_disks"])
        try:
            m.check_data_paths(shared, disks)
            for disk in disks:  # (the admission policy lets the hub clone from there only)
                if disk.clone_from and disk.clone_from.split("/")[0] != golden.split("/")[0]:
                    raise ValueError(f"the extra disk {disk.name} is cloned from {disk.clone_from}, outside the golden "
                                     f"image's namespace {golden.split('/')[0]}, where the hub may clone from")
        except ValueError as exc:
            raise WorkstationError(f"Profile {slug!r} has invalid shared data or extra disks: {exc}. Tell your "
                                   "administrator.", reason=Reason.PROFILE) from None
        return m.MachineSpec(
            cpu=cpu_quantity(values["cpu_guarantee"] or values["cpu_limit"] or 1),
            memory=format_bytes(values["mem_guarantee"] or mem_limit),
            cpu_limit=cpu_quantity(values["cpu_limit"]) if values["cpu_limit"] else None,
            memory_limit=format_bytes(mem_limit) if mem_limit else None,
            memory_guest=format_bytes(guest),
            gpus=tuple(sorted((d, n) for d, n in values["gpus"].items() if n)),
            node_selector=dict(values["node_selector"]), tolerations=tuple(values["tolerations"]),
            affinity=dict(values["affinity"]) or None, golden_image=golden,
            root_disk_size=values["root_disk_size"], storage_class=values["storage_class"],
            workspace_disk_size=values["workspace_disk_size"] or None,
            scratch_disk_size=values["scratch_disk_size"] or None, shared_data=shared,
            extra_disks=disks,
            termination_grace_period=values["termination_grace_period"], firmware=values["firmware"],
            ports=tuple(self.ports.items()), profile=slug,
            profile_version=profile.get("version", ""),
            profile_options=json.dumps(selection.options, sort_keys=True) if selection else "",
            extra_labels=dict(values["extra_labels"]), extra_annotations=dict(values["extra_annotations"]),
            ssh_enabled=values["ssh_enabled"], priority_class=values["priority_class_name"],
            extra_spec=copy.deepcopy(values["extra_vm_spec"]),
            extra_template_spec=copy.deepcopy(values["extra_vm_template_spec"]))

    @classmethod
    def validate_config(cls, config):
        """Check a hub's configuration now (call it last in jupyterhub_config.py): a bad setting
        stops the hub at start-up with a message naming it, instead of failing a user's start."""
        spawner = cls(config=config)
        spawner._check_storage_quota()
        spawner._check_origin(config)

    def _check_origin(self, config):
        hub = config.JupyterHub if "JupyterHub" in config else {}
        if not hub.get("subdomain_host") and not self.allow_shared_origin:
            raise TraitError(
                "c.JupyterHub.subdomain_host is not set, so every user's workstation would serve its pages on "
                "the hub's own origin, where a page of one user acts with the login of any user who opens it; "
                "set it (with wildcard DNS and TLS, deploy/README.md section 8), or set "
                "c.KubeVirtSpawner.allow_shared_origin = True for a hub whose users all trust each other")

    def _check_storage_quota(self):
        """A namespace's storage quota must hold one workstation of every profile while its system
        disk is cloned: its disks and the temporary copy of the system disk CDI's clone populator
        makes in the same namespace (pkg/controller/populators/populator-base.go, the prime PVC of
        the target's size), or the clone waits on ErrExceededQuota until the start gives up."""
        quota = self.namespace_resource_quota
        for spec in self._static_specs():
            root, workspace = parse_quantity(spec.root_disk_size), parse_quantity(spec.workspace_disk_size or 0)
            extra = sum((parse_quantity(d.size) for d in spec.extra_disks), parse_quantity(0))
            needed = 2 * root + workspace + extra
            for key in ("requests.storage", f"{spec.storage_class}.storageclass.storage.k8s.io/requests.storage"):
                if key in quota and parse_quantity(quota[key]) < needed:
                    where = f" (profile {spec.profile})" if spec.profile else ""
                    raise TraitError(
                        f"KubeVirtSpawner.namespace_resource_quota: {key} = {quota[key]} cannot hold one "
                        f"workstation{where} while it is cloned: its system disk ({spec.root_disk_size}), its "
                        f"workspace disk ({spec.workspace_disk_size or 0}), its extra disks ({format_bytes(extra)}) "
                        "and the temporary copy of the system "
                        f"disk CDI makes while cloning ({spec.root_disk_size}) need {format_bytes(needed)}; give "
                        "that much for each workstation a user may start at once")

    def _static_specs(self):
        """The machines the static profile_list can make: each profile with its default choices and
        with each listed choice of each option (a callable value, or a value a user types, is only
        known at a start)."""
        profiles = self._profiles()
        if not profiles:
            yield self._machine_spec(None)
        for profile in profiles:
            picks = [{}] + [{key: choice} for key, option in profile["profile_options"].items()
                            for choice in option["choices"]]
            for pick in picks:
                try:
                    selection = prof.choose([profile], {"profile": profile["slug"], **pick}, check_access=False)
                except prof.ProfileError:
                    continue  # (an option that only takes a typed value)
                assert selection is not None  # (a profile list was given)
                overrides = prof.overrides(selection)
                if not any(callable(v) for override in overrides for v in override.values()):
                    yield self._machine_spec(selection, overrides)
