"""The spawner's settings: every `c.KubeVirtSpawner.*` trait with its default and its check (a
bad value stops the hub at start-up with a sentence naming it)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from jupyterhub.traitlets import ByteSpecification
from traitlets import Bool, Callable, Dict, Enum, Float, Integer, List, TraitError, Unicode, Union, default, validate

from . import manifests as m
from . import names
from .quantity import parse_quantity

# The spawner's parts are mixins that KubeVirtSpawner joins with JupyterHub's Spawner (which refuses
# a subclass without its own start, stop and poll); to the type checker each part is a Spawner.
if TYPE_CHECKING:
    from jupyterhub.spawner import Spawner as SpawnerPart
else:
    from traitlets.config import LoggingConfigurable as SpawnerPart


class KubeVirtSpawnerSettings(SpawnerPart):
    """What a site configures as `c.KubeVirtSpawner.SETTING` (traitlets reads the settings of a
    class and of its bases under the class's own name)."""

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
