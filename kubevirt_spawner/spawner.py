"""KubeVirtSpawner: JupyterHub's Spawner API on top of `workstation/`.

Configuration (traitlets) and the JupyterHub hooks only; the lifecycle lives in `Workstation`.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import json
import re
from datetime import datetime, timezone

from jupyterhub.spawner import Spawner
from jupyterhub.traitlets import ByteSpecification
from jupyterhub.utils import maybe_future
from traitlets import Bool, Callable, Dict, Enum, Float, Integer, List, TraitError, Unicode, Union, default, validate

from . import kube as k
from . import manifests as m
from . import names
from . import profiles as prof
from .objects import field_value, merge_patch
from .operations import refuse_start_during_operation
from .quantity import format_bytes, parse_quantity
from .reasons import Reason
from .reflector import Caches
from .service import SERVICE_NAME
from .workstation import CloneGate, Settings, Workstation, WorkstationError, refusals_explained, wait_synced

TEMPLATE_SETTINGS = {key: f"KubeVirtSpawner.{key}_name_template" for key in names.DEFAULT_TEMPLATES}
TEMPLATE_SETTINGS["namespace"] = "KubeVirtSpawner.namespace_template"
# Hub-wide shared state: one API client, one set of caches and one clone gate per cluster.
_shared: dict[tuple, dict] = {}


def cpu_quantity(cpu: float) -> str:
    return str(int(cpu)) if float(cpu).is_integer() else f"{int(round(cpu * 1000))}m"


class KubeVirtSpawner(Spawner):
    """Gives each user (each named server) a persistent KubeVirt VM whose root disk is an RBD volume."""

    # ---------------------------------------------------------------- cluster access
    kubeconfig = Unicode(None, allow_none=True, config=True, help="""
        Path of a kubeconfig file. Unset: in-cluster credentials when the hub runs in a pod,
        else the default kubeconfig (~/.kube/config or $KUBECONFIG).""")
    kube_context = Unicode(None, allow_none=True, config=True, help="kubeconfig context to use (default: current).")
    k8s_api_request_timeout = Float(30.0, config=True, help="Seconds one Kubernetes API request may take.")
    k8s_api_retry_timeout = Float(60.0, config=True, help="""
        Seconds a request is retried (with backoff) on 429, 5xx and connection errors before it fails;
        also how long poll() and a first lookup wait for the watch caches to fill.""")
    events_enabled = Bool(True, config=True, help="""
        Show the cluster's Events about the workstation (FailedScheduling and the like) in the progress
        stream. Needs permission to watch Events.""")

    # ---------------------------------------------------------------- names
    namespace_template = Unicode("notebook-{user}", config=True, help="""
        Namespace of each workstation. Fields: {user}, {server}, {user_server}. A template without
        fields gives one shared namespace.""")
    vm_name_template = Unicode("{user_server}-workstation", config=True, help="VirtualMachine name template.")
    rootdisk_name_template = Unicode("{user_server}-rootdisk", config=True, help="Root disk DataVolume/PVC name.")
    workspace_name_template = Unicode("{user_server}-workspace", config=True, help="Workspace disk name.")
    secret_name_template = Unicode("{user_server}-hub-env", config=True, help="Name of the env Secret.")
    service_name_template = Unicode("{user_server}-notebook", config=True, help="Service name (a letter first).")

    # ---------------------------------------------------------------- the machine
    golden_image = Unicode("vm-images/ubuntu-24-04-cuda-golden", config=True, help="""
        The golden image PVC every root disk is cloned from, as namespace/name.""")
    root_disk_size = Unicode("60Gi", config=True, help="Root disk size (a Kubernetes quantity, e.g. 150Gi).")
    storage_class = Unicode("ceph-rbd", config=True, help="StorageClass of the disks (RBD, volumeMode Block).")
    workspace_disk_size = Unicode("", config=True, help="""
        Size of an extra workspace disk that survives a system reset; empty for none.""")
    scratch_disk_size = Unicode("", config=True, help="""
        Size of a discardable scratch disk on /scratch (KubeVirt's emptyDisk: a blank image on the
        node's local disk, in the virt-launcher pod's ephemeral storage, made anew at every start);
        empty for none. A profile may override it.""")
    shared_data = List(Dict(), config=True, help="""
        Existing claims of the workstation's namespace (CephFS datasets, a team folder) the guest
        mounts through virtiofs at every boot, e.g. `[{"claim": "datasets", "mount_path":
        "/data/datasets", "read_only": True}]`; `name` (the claim's by default) is the mount tag,
        `read_only` (default false, as Kubernetes' readOnly) is enforced by the launcher pod's
        mount. The claim must be a Filesystem one, ReadWriteMany or ReadOnlyMany where several
        machines use it; KubeVirt v1.9 needs its EnableVirtioFsStorageVolumes feature gate. A
        start whose claim is missing fails with a sentence. A profile may override it (the list
        replaces this one).""")
    extra_disks = List(Dict(), config=True, help="""
        Data disks of each workstation's own beside the workspace disk, e.g. `[{"name": "models",
        "size": "200Gi", "mount_path": "/data/models"}]`, with optional `storage_class` (the
        machine's by default) and `clone_from` (NAMESPACE/NAME of a claim in the golden image's
        namespace the disk starts as a copy of; blank otherwise). The guest makes a filesystem on a
        blank one and mounts each at its path at every boot. Like the workspace disk, they are
        kept across stops and system resets, grow when their size grows, are in snapshots, and
        are deleted only by a purge. A profile may override it (the list replaces this one).""")
    memory_guest = ByteSpecification(None, allow_none=True, config=True, help="""
        Memory the guest sees (spec.domain.memory.guest). Default: mem_limit, else mem_guarantee.""")
    gpus = Dict(value_trait=Integer(), config=True, help="""
        GPUs to pass through, as {deviceName: count}, e.g. {"nvidia.com/A100-PCIE-40GB": 1}.""")
    node_selector = Dict(config=True, help="nodeSelector of the VM.")
    tolerations = List(Dict(), config=True, help="Tolerations of the VM.")
    affinity = Dict(config=True, help="Affinity of the VM (the Kubernetes Affinity object).")
    termination_grace_period = Integer(120, config=True, help="""
        Seconds the guest gets to shut down cleanly on a graceful stop before it is powered off.""")
    firmware = Enum(["bios", "efi"], "bios", config=True, help="""
        The firmware the VM boots its root disk with: bios (SeaBIOS, KubeVirt's default) or efi
        (OVMF, Secure Boot off). It must be one the golden image's bootloader is built for
        (deploy/golden-image/build.sh --firmware; its image.json and the golden DataVolume's
        kubevirt-spawner.io/firmware annotation list them): the project's image boots with both.
        A profile may override it along with its golden_image.""")
    ports = Dict(value_trait=Integer(), default_value={"ssh": 22, "code-server": 8080, "jupyterlab": m.JUPYTER_PORT},
                 config=True, help="Ports the VM's interface and the Service expose, as {name: port}; 8888 is Jupyter.")
    extra_labels = Dict(config=True, help="""
        Extra labels on every object of a workstation. The hub's admission policy lets a VM's
        template (whose labels its launcher pod gets) carry only this project's, Zero-to-JupyterHub's
        network-access ones and those deploy/settings.env's VM_EXTRA_LABEL_PREFIXES lists.""")
    extra_annotations = Dict(config=True, help="""
        Extra annotations on every object of a workstation; on a VM's template only those
        deploy/settings.env's VM_EXTRA_ANNOTATION_PREFIXES lists pass the hub's admission policy.""")

    # ---------------------------------------------------------------- a user's namespace
    network_policy_ingress_from = List(Dict(), config=True, help="""
        NetworkPolicy peers (Kubernetes NetworkPolicyPeer objects) that may reach the workstations'
        ports; the hub makes a NetworkPolicy `kubevirt-spawner` with them in each namespace it makes
        (with a user's first workstation), so nothing else reaches a workstation, other
        workstations included. Empty (the default): no NetworkPolicy. Zero-to-JupyterHub's hub and
        proxy: [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": HUB_NAMESPACE}},
        "podSelector": {"matchExpressions": [{"key": "component", "operator": "In", "values":
        ["hub", "proxy"]}]}}].""")
    namespace_labels = Dict(value_trait=Unicode(), config=True, help="""
        Labels of each namespace the hub makes (KubeSpawner's user_namespace_labels), given when it
        is made; `{user}` in a value is the user's name as a safe slug. The admission policy lets
        the hub give those whose keys deploy/settings.env's NAMESPACE_EXTRA_LABEL_PREFIXES lists
        (a namespace's labels decide which NetworkPolicies admit its machines elsewhere).""")
    namespace_annotations = Dict(value_trait=Unicode(), config=True, help="""
        Annotations of each namespace the hub makes (KubeSpawner's user_namespace_annotations),
        `{user}` filled in as in namespace_labels; the policy's NAMESPACE_EXTRA_ANNOTATION_PREFIXES
        lists the keys allowed.""")
    namespace_resource_quota = Dict(value_trait=Unicode(), config=True, help="""
        The `hard` limits of a ResourceQuota `kubevirt-spawner` the hub makes in each namespace it
        makes, e.g. {"requests.cpu": "16", "requests.memory": "128Gi", "requests.storage": "1Ti",
        "requests.nvidia.com/A100-PCIE-40GB": "1"}. Empty (the default): none.""")
    namespace_limit_range = List(Dict(), config=True, help="""
        The `limits` of a LimitRange `kubevirt-spawner` the hub makes in each namespace it makes, e.g.
        [{"type": "PersistentVolumeClaim", "max": {"storage": "500Gi"}}]: PersistentVolumeClaim limits
        only (a Container or Pod limit would land on the VM's launcher pod; bound VMs with
        namespace_resource_quota). Empty (the default): none.""")

    # ---------------------------------------------------------------- behaviour
    url_mode = Enum(["dns", "cluster-ip"], default_value="dns", config=True, help="""
        How the hub reaches the guest: the Service's DNS name
        (http://{service}.{namespace}.svc.{cluster_domain}:8888) or its ClusterIP.""")
    cluster_domain = Unicode("cluster.local", config=True, help="""
        The cluster's DNS domain (the kubelet's clusterDomain), for Service DNS names.""")
    gpu_unavailable = Enum(["wait", "fail"], default_value="wait", config=True, help="""
        When no requested GPU is free: keep waiting until start_timeout, or fail at once.""")
    max_concurrent_clones = Integer(4, config=True, help="""
        Most host-assisted (copy) root-disk clones at a time across the hub; later starts queue.
        CDI copies when the StorageProfile of the disk's StorageClass says `copy` (or when the hub
        cannot read StorageProfiles): pods stream every byte, the load worth limiting.""")
    max_concurrent_csi_clones = Integer(0, config=True, help="""
        Most CSI or snapshot (copy-on-write) root-disk clones at a time across the hub; 0: no limit.
        On Ceph RBD a CSI clone takes seconds and hardly loads the cluster.""")
    clone_stall_timeout = Float(600.0, config=True, help="""
        Seconds a root-disk clone may show no progress before the start fails with CDI's reason (CDI
        never fails a clone that cannot proceed; it keeps trying and says why in Warning events).""")
    retention_days = Integer(30, config=True, help="""
        Days the disks of a deleted user or named server are kept (labelled as retained).""")
    stop_timeout = Integer(300, config=True, help="Seconds a graceful stop may take before the VM is forced off.")
    allow_shared_origin = Bool(False, config=True, help="""
        Let the hub run without `c.JupyterHub.subdomain_host`, with every user's pages (what the
        user's workstation serves under /user/NAME/) on the hub's own origin. Users are root in their
        workstations and serve what they like there: on the hub's origin, a page of theirs that
        another user opens acts with that user's hub login (reads the workstations page, restores,
        resets, makes API tokens). Only for a hub whose users all trust each other, or a local demo;
        otherwise give each user a subdomain (wildcard DNS and TLS, deploy/README.md section 8).""")
    ssh_enabled = Bool(True, config=True, help="""
        Let the workstation's owner reach its sshd through the hub (`kubevirt-spawner ssh`, VS Code
        Remote-SSH): a websocket under the user's server that only the owner may open, with keys
        the owner keeps in the workstations service. False: the tunnel refuses everyone. A profile
        may override it. Passed to the guest as KUBEVIRT_SSH_ENABLED.""")
    workstations_url = Unicode("", config=True, help="""
        URL at which a workstation reaches the hub's `workstations` service (its Lab panel calls
        it), ending in /services/workstations/; `service.register()` sets it. Passed to the guest
        as KUBEVIRT_WORKSTATIONS_URL.""")
    profile_list = Union([List(Dict()), Dict(), Callable()], config=True, help="""
        Profiles users choose from, in KubeSpawner 7.1's shape: a list of dicts, or a dict of them
        by key (shown in the order of the keys), or a callable taking the spawner and returning
        either (it may be async). Each has display_name, slug, description, default, version,
        kubevirt_override (settings such as cpu_guarantee, mem_guarantee, gpus, node_selector,
        tolerations, root_disk_size, golden_image, workspace_disk_size; a value may be a callable
        taking the spawner), profile_options (choices inside the profile, each with its own
        kubevirt_override, and an unlisted_choice the user types, checked by its
        validation_regex, put for {value} in its kubevirt_override), and allowed_users /
        allowed_groups (JupyterHub names and groups: only they may start it, and only they see
        it). Overrides apply in order, the profile's then each option's: a dict merges into the
        setting (a key set to None is removed), any other value replaces it.""")
    modify_vm_hook = Callable(None, allow_none=True, config=True, help="""
        KubeSpawner's modify_pod_hook for the VirtualMachine: called as `hook(spawner, vm)` (it may
        be async) with the VM a start is about to create, or whose template it is about to replace,
        after every setting and profile has been applied; it returns the VM to use. It must keep
        the VM's name, namespace and the hub's labels and annotations. The cluster checks the
        result (a dry run, unknown fields refused) before any disk is made: a VM it refuses fails
        the start with a sentence, and nothing is created.""")
    extra_vm_spec = Dict(config=True, help="""
        Fields merge_patch into the VirtualMachine's spec (KubeSpawner's extra_pod_config): maps merge,
        lists replace, a key set to None is removed. A profile may override it.""")
    extra_vm_template_spec = Dict(config=True, help="""
        Fields merge_patch into the VM template's spec (the machine: domain, tolerations,
        dnsConfig, ...), with extra_vm_spec's rules: maps merge, lists replace (a list given here
        replaces the workstation's own: never give `volumes` or `domain.devices.disks`), None
        removes a key. A profile may override it.""")
    priority_class_name = Unicode("", config=True, help="""
        The PriorityClass of the machine (its virt-launcher pod's priority: a GPU profile may
        pre-empt batch work). The admission policy allows the classes its
        VM_PRIORITY_CLASSES parameter lists. A profile may override it.""")
    profile_form_template = Unicode("", config=True, help="""
        A Jinja2 template for the spawn page's profiles instead of this package's
        (templates/profiles_form.html). It gets `profile_list` (the profiles this user may start,
        each with `slug` and its `profile_options` filled in), `user_options` (the last choice)
        and `unlisted` (the select's value for a value of one's own). The fields it posts are
        KubeSpawner's: `profile`, `profile-option-SLUG--OPTION` and
        `profile-option-SLUG--OPTION--unlisted-choice`. Escapes HTML by default.""")

    @default("profile_list")
    def _default_profile_list(self):
        return []

    @default("default_url")
    def _default_default_url(self):
        return "/lab"  # a workstation is a JupyterLab machine

    @default("start_timeout")
    def _default_start_timeout(self):
        return 900  # a first start clones a large disk

    @default("http_timeout")
    def _default_http_timeout(self):
        return 120  # a VM boots before Jupyter answers

    @default("cpu_guarantee")
    def _default_cpu(self):
        return 2.0

    @default("mem_guarantee")
    def _default_mem(self):
        return 4 * 2 ** 30

    @validate("golden_image")
    def _check_golden(self, proposal):
        value = proposal["value"]
        if not re.match(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?/[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", value or ""):
            raise TraitError(f"KubeVirtSpawner.golden_image = {value!r}: give the golden image PVC as namespace/name")
        return value

    @validate("namespace_labels", "namespace_annotations")
    def _check_namespace_metadata(self, proposal):
        name = proposal["trait"].name
        try:  # (the longest slug a user may have: a label value must still fit)
            m.namespace_metadata(f"KubeVirtSpawner.{name}", proposal["value"], "u" * names.USER_SLUG_MAX,
                                 labels=name == "namespace_labels")
        except ValueError as exc:
            raise TraitError(str(exc)) from None
        return proposal["value"]

    @validate("shared_data", "extra_disks")
    def _check_data_volumes(self, proposal):
        name = proposal["trait"].name
        try:
            {"shared_data": m.shared_data, "extra_disks": m.extra_disks}[name](proposal["value"])
        except ValueError as exc:
            raise TraitError(f"KubeVirtSpawner.{name}: {exc}") from None
        return proposal["value"]

    @validate("root_disk_size", "workspace_disk_size", "scratch_disk_size")
    def _check_size(self, proposal):
        value = proposal["value"]
        if value:
            try:
                parse_quantity(value)
            except ValueError:
                raise TraitError(f"KubeVirtSpawner.{proposal['trait'].name} = {value!r} is not a Kubernetes "
                                 "quantity such as 60Gi") from None
        return value

    @validate("gpus")
    def _check_gpus(self, proposal):
        for device, count in proposal["value"].items():
            if count < 0 or "/" not in device:
                raise TraitError(f"KubeVirtSpawner.gpus: {device!r}: {count} must be a resource name such as "
                                 "nvidia.com/A100-PCIE-40GB with a count of 0 or more")
        return proposal["value"]

    @validate("ports")
    def _check_ports(self, proposal):
        if m.JUPYTER_PORT not in proposal["value"].values():
            raise TraitError(f"KubeVirtSpawner.ports must include Jupyter's port {m.JUPYTER_PORT}")
        return proposal["value"]

    @validate("network_policy_ingress_from")
    def _check_peers(self, proposal):
        for peer in proposal["value"]:
            if not peer or set(peer) - {"podSelector", "namespaceSelector", "ipBlock"}:
                raise TraitError(f"KubeVirtSpawner.network_policy_ingress_from: {peer!r} is not a NetworkPolicy "
                                 "peer (podSelector, namespaceSelector and/or ipBlock)")
        return proposal["value"]

    @validate("namespace_resource_quota")
    def _check_quota(self, proposal):
        for resource, amount in proposal["value"].items():
            try:
                parse_quantity(amount)
            except ValueError:
                raise TraitError(f"KubeVirtSpawner.namespace_resource_quota: {resource} = {amount!r} is not a "
                                 "Kubernetes quantity such as 16 or 128Gi") from None
        return proposal["value"]

    @validate("namespace_limit_range")
    def _check_limits(self, proposal):
        for item in proposal["value"]:
            if item.get("type") in ("Container", "Pod"):
                # The VM's launcher pod is the only pod there: a Container default limit becomes the
                # limit of QEMU's container, which KubeVirt leaves unlimited unless the VM has one
                # (pkg/virt-controller/services/renderresources.go), and the guest is OOM-killed; a
                # max below the VM and its overhead keeps the pod from being created.
                raise TraitError(f"KubeVirtSpawner.namespace_limit_range: {item!r}: a {item['type']} limit would "
                                 "apply to the VM's launcher pod (a default limit OOM-kills the guest, a max below "
                                 "the VM and its overhead refuses the pod); bound VMs with namespace_resource_quota "
                                 "and give only PersistentVolumeClaim limits here")
            if item.get("type") != "PersistentVolumeClaim":
                raise TraitError(f"KubeVirtSpawner.namespace_limit_range: {item!r} needs the type "
                                 "PersistentVolumeClaim")
            for bound in ("max", "min", "default", "defaultRequest", "maxLimitRequestRatio"):
                for resource, amount in (item.get(bound) or {}).items():
                    try:
                        parse_quantity(amount)
                    except ValueError:
                        raise TraitError(f"KubeVirtSpawner.namespace_limit_range: {bound} {resource} = {amount!r} "
                                         "is not a Kubernetes quantity") from None
        return proposal["value"]

    # ---------------------------------------------------------------- set-up
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._ident: m.Identity | None = None
        self._current: Workstation | None = None
        self._progress: list[dict] = []
        self._start_began: str | None = None
        self._starting = False
        self._halting: asyncio.Future | None = None  # halting again after a post-stop halt failed
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

    # ---------------------------------------------------------------- options form
    @default("options_form")
    def _default_options_form(self):
        return self._render_options_form

    async def _render_options_form(self, spawner):
        """The profiles this user may start (a profile limited to others is not shown; a start
        naming it is refused too), with their last choices picked."""
        profiles = prof.usable(await self._profiles_now(), self.user.name, self._group_names())
        last = self.user_options or {}
        try:  # (saved options may be stale, or whatever the REST API was sent)
            prof.choose(profiles, last, self.user.name, self._group_names())
        except prof.ProfileError:
            last = {}
        return prof.options_form(profiles, last, self.profile_form_template)

    @default("options_from_form")
    def _default_options_from_form(self):
        return prof.options_from_form

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

    # ---------------------------------------------------------------- state
    def get_state(self):
        # The machine outlives its servers: JupyterHub's clear_state() between starts leaves these
        # names alone, so a workstation keeps its objects for life.
        state = super().get_state()
        if self._ident is not None:
            state["workstation"] = self._ident.to_state()
        return state

    def load_state(self, state):
        super().load_state(state)
        if state.get("workstation"):
            self._ident = m.Identity.from_state(state["workstation"])
            if not self._ident.user_created:  # (a state saved before the time was recorded)
                self._ident = dataclasses.replace(self._ident, user_created=self._user_created())
            self._current = None

    # ---------------------------------------------------------------- lifecycle
    def get_env(self):
        env = super().get_env()
        env["JUPYTERHUB_SERVICE_URL"] = f"http://0.0.0.0:{m.JUPYTER_PORT}{self.server.base_url if self.server else '/'}"
        if self.workstations_url:
            env["KUBEVIRT_WORKSTATIONS_URL"] = self.workstations_url
        page = self._workstations_page()
        if page:
            env["KUBEVIRT_WORKSTATIONS_PAGE"] = page
        return env

    def _workstations_page(self) -> str:
        """Where a browser finds the workstations service: with subdomains, JupyterHub gives each
        service a host of its own (NAME--service.HUB, its default subdomain_hook), which the
        guest cannot know; without, the path under the hub's base URL, which it can."""
        services = (getattr(self.user, "settings", None) or {}).get("services") or {}
        service = services.get(SERVICE_NAME)
        if service is None or not getattr(service, "host", ""):
            return ""
        return service.host + service.prefix

    async def start(self):
        self._progress = []
        self._start_began = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        self._starting = True
        try:
            if self._halting is not None and not self._halting.done():
                self._halting.cancel()  # (a stop on its way lands first: the client lets it)
                with contextlib.suppress(asyncio.CancelledError):
                    await self._halting
            selection = await self._selection(self.user_options)
            ws = await self._workstation(await self._spec_for(selection), for_start=True)
            with refusals_explained(self.log, "start"):
                await wait_synced(ws.caches, ws.log, self.k8s_api_retry_timeout, ws.ident.namespace)
            refuse_start_during_operation(ws)  # a restore or reset changes the machine now
            self.ip, self.port = "0.0.0.0", m.JUPYTER_PORT
            env = self.get_env()
            env.update(m.guest_env(ws.spec))  # (the profile's SSH setting and shared data, if it says)
            ws.log.info("starting for %s (profile %s)", self._log_name, ws.spec.profile or "-")
            url = await ws.start(env, self.get_args(), self._report)
            self._report(100, "Your workstation is ready")
            return url
        finally:
            self._starting = False
            self._wake_progress()

    def _report(self, percent: int, message: str):
        self._progress.append({"progress": percent, "message": message})
        self._wake_progress()

    def _wake_progress(self):
        """Wake this server's progress stream (it waits on changes in its namespace)."""
        self._shared()["caches"].notify(self._ident.namespace if self._ident else None)

    async def progress(self):
        """Our own steps, and the cluster's Events about this workstation since the start began."""
        shared = self._shared()
        caches = shared["caches"]
        sent, seen_events, percent = 0, set(), 0
        while True:
            while sent < len(self._progress):
                event = self._progress[sent]
                sent += 1
                percent = max(percent, event["progress"])
                yield event
            if self._ident is not None and self._start_began:
                ident = self._ident
                for ev in caches.events_for(ident.namespace, {ident.vm, ident.rootdisk, ident.workspace},
                                            (f"virt-launcher-{ident.vm}-",)):
                    key = (ev["metadata"].get("uid"), ev.get("count"), ev.get("lastTimestamp"))
                    stamp = ev.get("lastTimestamp") or ev.get("eventTime") or ""
                    if key in seen_events or stamp < self._start_began:
                        continue
                    seen_events.add(key)
                    yield {"progress": percent, "message": f"{ev.get('reason')}: {ev.get('message')}"}
            if not self._starting:
                return
            await caches.next_change(namespace=self._ident.namespace if self._ident else None)

    async def poll(self):
        if self._starting:
            return None
        try:
            ws = await self._workstation()
            # Never report a running machine as stopped before the caches know.
            with refusals_explained(self.log, "be checked"):
                await wait_synced(ws.caches, ws.log, self.k8s_api_retry_timeout, ws.ident.namespace)
        except WorkstationError as err:
            self.log.warning("cannot tell whether the workstation of %s runs (%s): reporting it as running",
                             self._log_name, err.reason)
            return None
        status = ws.status()
        if status in ("running", "starting"):
            return None
        if status == "lost":
            ws.log.warning("on a node that stopped responding: reporting %s as not running", self._log_name)
            return 1
        return 1 if status == "failed" else 0

    async def get_url(self):
        ws = await self._workstation()
        return ws.url() or await super().get_url()

    async def stop(self, now=False):
        ws = await self._workstation()
        await ws.stop(now=now)

    async def run_post_stop_hook(self):
        """JupyterHub skips stop() when poll() already says "not running" (the guest powered off or
        crashed, or its node was lost); halt the VM then, so it does not restart behind the hub."""
        try:
            ws = await self._workstation()
            await ws.ensure_halted()
        except Exception:
            self.log.exception("could not make sure the workstation of %s stays stopped; trying again until it "
                               "does or the server starts", self._log_name)
            if self._halting is None or self._halting.done():
                self._halting = asyncio.ensure_future(self._halt_until_done())  # (start() cancels it)
        return await maybe_future(super().run_post_stop_hook())

    async def _halt_until_done(self, first_delay: float = 5.0):
        """Halt the VM again and again (with backoff, at most a minute apart) until it lands: with
        virt-api down for minutes, a VM left to run (runStrategy Always) comes back by itself when
        its lost node is fenced, with no server in the hub."""
        delay = first_delay
        while True:
            await asyncio.sleep(delay)
            try:
                await (await self._workstation()).ensure_halted()
            except Exception as exc:
                delay = min(delay * 2, 60.0)
                self.log.warning("still cannot make sure the workstation of %s stays stopped (%s); trying again in "
                                 "%.0f s", self._log_name, exc, delay)
                continue
            self.log.info("the workstation of %s stays stopped now", self._log_name)
            return

    async def delete_forever(self):
        ws = await self._workstation()
        kept = await ws.retire()
        ws.log.info("deleted the workstation of %s; kept %s", self._log_name, ", ".join(kept))
