"""Pure functions that build the Kubernetes objects of one workstation. No I/O.

Every object carries the labels that find it again after a hub restart (`LABEL_WORKSTATION`) and
the raw user and server names as annotations.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Iterable

import yaml

from .objects import (
    ARGS_KEY,
    EXTRA_DISKS_ENV,
    ROOT_DISK_SERIAL,
    SCRATCH_DISK_SERIAL,
    SHARED_DATA_ENV,
    USERDATA_KEY,
    WORKSPACE_DISK_SERIAL,
    check_mount_path,
    field_value,
    merge_patch,
)
from .objects import ENV_DISK_SERIAL as ENV_DISK_SERIAL  # re-exported: the hub reads it here too
from .objects import EXTRA_DISK_PREFIX as EXTRA_DISK_PREFIX  # re-exported: the hub reads it here too
from .quantity import parse_quantity

MANAGED_BY = "kubevirt-spawner"
LABEL_PREFIX = "kubevirt-spawner.io/"
LABEL_WORKSTATION = LABEL_PREFIX + "workstation"
LABEL_USER = LABEL_PREFIX + "user"
LABEL_SERVER = LABEL_PREFIX + "server"
LABEL_COMPONENT = LABEL_PREFIX + "component"
LABEL_RETAINED = LABEL_PREFIX + "retained"
ANNOTATION_USERNAME = LABEL_PREFIX + "username"
ANNOTATION_SERVERNAME = LABEL_PREFIX + "servername"
ANNOTATION_PROFILE = LABEL_PREFIX + "profile"
ANNOTATION_PROFILE_VERSION = LABEL_PREFIX + "profile-version"
ANNOTATION_PROFILE_OPTIONS = LABEL_PREFIX + "profile-options"  # the user's choices in the profile (JSON)
ANNOTATION_RETAIN_UNTIL = LABEL_PREFIX + "retain-until"
# When the JupyterHub account was made: an account deleted and made again under the same name may
# be another person, so its kept disks need an administrator's word (ANNOTATION_CONFIRMED_FOR).
ANNOTATION_USER_CREATED = LABEL_PREFIX + "user-created"
# A drain of the workstation's node, as the workstations service handles it (JSON: node, reason,
# since, deadline, by; stopped_at once it stopped): on the VM, so it outlives a service restart.
ANNOTATION_DRAIN = LABEL_PREFIX + "drain"
ANNOTATION_CONFIRMED_FOR = LABEL_PREFIX + "confirmed-for-user-created"
# When the hub was asked to delete the workstation while a restore or reset ran (JupyterHub forgets
# the server all the same): the operation deletes it when it ends, instead of starting it.
ANNOTATION_DELETE_REQUESTED = LABEL_PREFIX + "delete-requested"

JUPYTER_PORT = 8888
EVICTION_STRATEGY = "External"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class Identity:
    """Who a workstation belongs to and the names of its objects (fixed once created)."""
    user: str
    server: str
    slug: str
    user_slug: str
    server_slug: str
    namespace: str
    vm: str
    rootdisk: str
    workspace: str
    secret: str
    service: str
    user_created: str = ""  # the account's creation time (JupyterHub's user.created), when known

    def to_state(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "Identity":
        return cls(**{k: state[k] for k in cls.__dataclass_fields__ if k in state})  # (older states lack user_created)


@dataclass(frozen=True)
class SharedData:
    """An existing claim of the workstation's namespace (a CephFS dataset, a team folder) the
    guest mounts at `path` through virtiofs; `name` is the VM's filesystem and the mount tag."""
    name: str
    claim: str
    path: str
    read_only: bool = False


# The VM's own volume names, which shared data may not take.
OWN_VOLUMES = ("rootdisk", "workspace", "scratch", "cloudinit", ENV_DISK_SERIAL)
# A shared data name is a volume name (a DNS label) and the virtiofs mount tag, which Linux's
# virtio-fs takes up to 36 bytes long (include/uapi/linux/virtio_fs.h).
SHARED_NAME_MAX = 36
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
SHARED_DATA_KEYS = {"name", "claim", "mount_path", "read_only"}


def _check_entry(item: object, keys: set[str], needed: str, what: str) -> dict[str, Any]:
    """One entry of a list setting: a dict of known keys, or ValueError with a sentence."""
    if not isinstance(item, dict):
        raise ValueError(f"{item!r} is not a dict with {needed}")
    unknown = sorted(set(item) - keys)
    if unknown:
        raise ValueError(f"{item!r}: unknown keys {', '.join(map(str, unknown))}; {what} has "
                         f"{', '.join(sorted(keys))}")
    return item


def shared_data(items: Iterable[object]) -> tuple[SharedData, ...]:
    """The shared data of a setting such as `[{"claim": "datasets", "mount_path": "/data/datasets",
    "read_only": True}]` (`name` defaults to the claim's), or ValueError with a sentence."""
    out: list[SharedData] = []
    for entry in items or ():
        item = _check_entry(entry, SHARED_DATA_KEYS, "claim, mount_path and read_only", "a shared data entry")
        claim = item.get("claim")
        if not isinstance(claim, str) or len(claim) > 253 or not _DNS_SUBDOMAIN.match(claim):
            raise ValueError(f"{item!r}: claim must be the name of a PersistentVolumeClaim of the workstation's "
                             "namespace")
        name = item.get("name", claim)
        if not isinstance(name, str) or len(name) > SHARED_NAME_MAX or not _DNS_LABEL.match(name):
            raise ValueError(f"{item!r}: name (the claim's when not given) must be at most {SHARED_NAME_MAX} "
                             "lower-case letters, digits and dashes: give a shorter name")
        if name in OWN_VOLUMES or name.startswith(EXTRA_DISK_PREFIX):
            raise ValueError(f"{item!r}: the name {name} is one of the workstation's own volumes (or starts "
                             f"{EXTRA_DISK_PREFIX}, as its extra disks do): give another")
        read_only = item.get("read_only", False)
        if not isinstance(read_only, bool):
            raise ValueError(f"{item!r}: read_only is true or false")
        path = check_mount_path(item.get("mount_path"))
        for other in out:
            if other.name == name:
                raise ValueError(f"two shared data entries are named {name}: give one a name of its own")
            if _overlap(path, other.path):
                raise ValueError(f"the mount points {other.path} and {path} overlap: give each its own directory")
        out.append(SharedData(name, claim, path, read_only))
    return tuple(out)


@dataclass(frozen=True)
class ExtraDisk:
    """A data disk of the workstation's own beside the workspace disk (a block claim of the
    profile's storage class or its own, blank or cloned from a claim of the golden images'
    namespace), mounted at `path`. Like the workspace disk it is kept across resets, grows with
    its size and is deleted only by a purge."""
    name: str
    size: str
    path: str
    storage_class: str = ""  # the machine's when empty
    clone_from: str = ""  # NAMESPACE/NAME of the claim it is cloned from; blank when empty

    @property
    def volume(self) -> str:
        """The VM's volume and disk name, and the disk's serial (/dev/disk/by-id/virtio-disk-NAME)."""
        return EXTRA_DISK_PREFIX + self.name


# A disk serial reaches the guest as at most 20 bytes (virtio-blk's VIRTIO_BLK_ID_BYTES,
# include/uapi/linux/virtio_blk.h): `disk-` and the name must fit.
EXTRA_DISK_NAME_MAX = 20 - len(EXTRA_DISK_PREFIX)
EXTRA_DISK_KEYS = {"name", "size", "mount_path", "storage_class", "clone_from"}


def extra_disks(items: Iterable[object]) -> tuple[ExtraDisk, ...]:
    """The extra disks of a setting such as `[{"name": "models", "size": "200Gi", "mount_path":
    "/data/models"}]` (optional `storage_class`, and `clone_from` NAMESPACE/NAME for a disk that
    starts as a copy of a prepared claim), or ValueError with a sentence."""
    out: list[ExtraDisk] = []
    for entry in items or ():
        item = _check_entry(entry, EXTRA_DISK_KEYS, "name, size and mount_path", "an extra disk")
        name = item.get("name")
        if not isinstance(name, str) or len(name) > EXTRA_DISK_NAME_MAX or not _DNS_LABEL.match(name):
            raise ValueError(f"{item!r}: name must be 1 to {EXTRA_DISK_NAME_MAX} lower-case letters, digits and "
                             "dashes (the guest sees the disk as /dev/disk/by-id/virtio-disk-NAME)")
        size = item.get("size")
        try:
            if not isinstance(size, str) or parse_quantity(size) <= 0:
                raise ValueError
        except ValueError:
            raise ValueError(f"{item!r}: size must be a Kubernetes quantity such as 100Gi") from None
        storage_class = item.get("storage_class") or ""
        if not isinstance(storage_class, str) or (storage_class and not _DNS_SUBDOMAIN.match(storage_class)):
            raise ValueError(f"{item!r}: storage_class must be the name of a StorageClass")
        clone_from = item.get("clone_from") or ""
        parts = clone_from.split("/") if isinstance(clone_from, str) else []
        if clone_from and not (len(parts) == 2 and _DNS_LABEL.match(parts[0]) and _DNS_SUBDOMAIN.match(parts[1])):
            raise ValueError(f"{item!r}: clone_from must be NAMESPACE/NAME of a PersistentVolumeClaim")
        path = check_mount_path(item.get("mount_path"))
        for other in out:
            if other.name == name:
                raise ValueError(f"two extra disks are named {name}: give each a name of its own")
            if _overlap(path, other.path):
                raise ValueError(f"the mount points {other.path} and {path} overlap: give each its own directory")
        out.append(ExtraDisk(name, size, path, storage_class, clone_from))
    return tuple(out)


def _overlap(a: str, b: str) -> bool:
    return a == b or a.startswith(b + "/") or b.startswith(a + "/")


def check_data_paths(shares: tuple[SharedData, ...], disks: tuple[ExtraDisk, ...]) -> None:
    """Shared data and extra disks each get a directory of their own: ValueError with a sentence
    when a mount point of one is on or inside the other's."""
    for share in shares:
        for disk in disks:
            if _overlap(share.path, disk.path):
                raise ValueError(f"the shared data {share.name} at {share.path} and the extra disk {disk.name} at "
                                 f"{disk.path} overlap: give each its own directory")


@dataclass(frozen=True)
class MachineSpec:
    """What the machine looks like: compute, devices, placement and disks (from the profile)."""
    cpu: str = "2"
    memory: str = "4Gi"
    cpu_limit: str | None = None
    memory_limit: str | None = None
    memory_guest: str | None = None
    gpus: tuple[tuple[str, int], ...] = ()
    node_selector: dict[str, Any] = field(default_factory=dict)
    tolerations: tuple[Any, ...] = ()
    affinity: dict[str, Any] | None = None
    golden_image: str = "vm-images/ubuntu-24-04-cuda-golden"
    root_disk_size: str = "60Gi"
    storage_class: str = "ceph-rbd"
    workspace_disk_size: str | None = None
    shared_data: tuple[SharedData, ...] = ()
    extra_disks: tuple[ExtraDisk, ...] = ()
    scratch_disk_size: str | None = None  # an emptyDisk on /scratch, blank at every start
    termination_grace_period: int = 120
    firmware: str = "bios"  # what the golden image boots with: bios or efi
    ssh_enabled: bool = True  # the guest's SSH tunnel opens for its owner (the guest reads KUBEVIRT_SSH_ENABLED)
    ports: tuple[tuple[str, int], ...] = (("ssh", 22), ("code-server", 8080), ("jupyterlab", JUPYTER_PORT))
    profile: str = ""
    profile_version: str = ""
    profile_options: str = ""  # the user's choices in the profile, as JSON (profiles.Selection.options)
    extra_labels: dict[str, Any] = field(default_factory=dict)
    extra_annotations: dict[str, Any] = field(default_factory=dict)
    priority_class: str = ""  # the machine's PriorityClass (the launcher pod's priority)
    # the admin's own fields, merge_patch in last (maps merge, lists replace, None removes a key)
    extra_spec: dict[str, Any] = field(default_factory=dict)  # into the VM's spec
    extra_template_spec: dict[str, Any] = field(default_factory=dict)  # into its template's spec

    @property
    def golden_namespace(self) -> str:
        return self.golden_image.split("/", 1)[0]

    @property
    def golden_name(self) -> str:
        return self.golden_image.split("/", 1)[1]


def vmi_selector(ident: Identity) -> dict[str, Any]:
    """Labels that pick out the running machine (the VMI and its virt-launcher pod) only."""
    return {LABEL_WORKSTATION: ident.slug, LABEL_COMPONENT: "workstation"}


def labels(ident: Identity, component: str, spec: MachineSpec | None = None) -> dict[str, Any]:
    out = dict(spec.extra_labels) if spec else {}
    out.update({"app.kubernetes.io/managed-by": MANAGED_BY, "app.kubernetes.io/component": component,
                LABEL_WORKSTATION: ident.slug, LABEL_USER: ident.user_slug, LABEL_COMPONENT: component})
    if ident.server_slug:
        out[LABEL_SERVER] = ident.server_slug
    return out


def identity_annotations(ident: Identity, spec: MachineSpec | None = None) -> dict[str, Any]:
    out = dict(spec.extra_annotations) if spec else {}
    out[ANNOTATION_USERNAME] = ident.user
    if ident.server:
        out[ANNOTATION_SERVERNAME] = ident.server
    if ident.user_created:
        out[ANNOTATION_USER_CREATED] = ident.user_created
    return out


def belongs_to(obj: dict[str, Any] | None, user: str, server: str) -> bool:
    """Whether `obj` is the workstation of `user`'s server `server` by the raw names it carries. Its
    name and slug labels are not enough: a slug is a hash, which a chosen user name can make collide."""
    if obj is None:
        return False
    annotations = (obj.get("metadata") or {}).get("annotations") or {}
    return annotations.get(ANNOTATION_USERNAME) == user and annotations.get(ANNOTATION_SERVERNAME, "") == server


def _meta(ident: Identity, name: str, component: str, spec: MachineSpec | None = None, **extra: str) -> dict[str, Any]:
    return {"name": name, "namespace": ident.namespace, "labels": labels(ident, component, spec),
            "annotations": {**identity_annotations(ident, spec), **extra}}


# apimachinery's qualified name (a label or annotation key) and label value
_QUALIFIED_NAME = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                             r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
OWN_NAMESPACE_KEYS = ("app.kubernetes.io/managed-by", LABEL_PREFIX)  # the project's: never the admin's


def namespace_metadata(what: str, items: dict[str, Any], user_slug: str, labels: bool) -> dict[str, str]:
    """An admin's namespace labels or annotations with {user} (the user's slug) filled in, or
    ValueError with a sentence naming the setting and the entry."""
    out = {}
    for key, template in items.items():
        prefix = key.split("/")[0] if isinstance(key, str) and "/" in key else ""
        if not isinstance(key, str) or len(prefix) > 253 \
                or not _QUALIFIED_NAME.match(key) \
                or prefix in ("kubernetes.io", "k8s.io"):  # (a site may list pod-security.kubernetes.io/)
            raise ValueError(f"{what}: {key!r} is not a key of one's own (prefix/name, outside kubernetes.io)")
        if key == OWN_NAMESPACE_KEYS[0] or key.startswith(OWN_NAMESPACE_KEYS[1]):
            raise ValueError(f"{what}: {key} is kubevirt-spawner's own")
        try:
            value = str(template).format(user=user_slug)
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"{what}: {key} = {template!r} is not a template of {{user}} only: {exc}") from None
        if labels and not _LABEL_VALUE.match(value):
            raise ValueError(f"{what}: {key} = {template!r} gives {value!r}, which is not a label value (at most "
                             "63 letters, digits, '-', '_' and '.')")
        out[key] = value
    return out


def namespace(ident: Identity, extra_labels: dict[str, Any] | None = None, extra_annotations: dict[str, Any] | None = None) -> dict[str, Any]:
    """A user's namespace, with the admin's labels and annotations ({user} filled in) beside the
    project's own, which win."""
    labels = namespace_metadata("namespace_labels", extra_labels or {}, ident.user_slug, labels=True)
    annotations = namespace_metadata("namespace_annotations", extra_annotations or {}, ident.user_slug,
                                     labels=False)
    labels.update({"app.kubernetes.io/managed-by": MANAGED_BY, LABEL_USER: ident.user_slug})
    annotations[ANNOTATION_USERNAME] = ident.user
    return {"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": ident.namespace, "labels": labels, "annotations": annotations}}


# What the hub may do inside a user's namespace is the ClusterRole HUB_NAMESPACED_ROLE of
# deploy/rbac/, bound there by the hub itself: it holds no such rights cluster-wide. The
# admission policy lets it bind nothing else, to nobody else.
HUB_NAMESPACED_ROLE = "kubevirt-spawner-hub-namespaced"
SERVICE_ACCOUNT_USER = "system:serviceaccount:"


def rbac_subject(username: str) -> dict[str, Any]:
    """The RBAC subject of an authenticated user name (a ServiceAccount's is system:serviceaccount:NS:NAME)."""
    if username.startswith(SERVICE_ACCOUNT_USER) and username.count(":") == 3:
        namespace, name = username[len(SERVICE_ACCOUNT_USER):].split(":")
        return {"kind": "ServiceAccount", "name": name, "namespace": namespace}
    return {"kind": "User", "apiGroup": "rbac.authorization.k8s.io", "name": username}


def hub_role_binding_name(hub_username: str) -> str:
    """One binding per hub identity, so that a binding there (AlreadyExists) is this hub's: two hubs
    (or a hub whose ServiceAccount was renamed) never take each other's for their own."""
    subject = rbac_subject(hub_username)
    if subject["kind"] == "ServiceAccount":  # both parts are DNS names: the name says whose it is
        return f"kubevirt-spawner-hub:{subject['namespace']}:{subject['name']}"
    return "kubevirt-spawner-hub:user-" + hashlib.sha256(hub_username.encode()).hexdigest()[:20]


def hub_role_binding(namespace: str, hub_username: str) -> dict[str, Any]:
    """The hub's rights in one user namespace: HUB_NAMESPACED_ROLE, bound to the hub's own identity."""
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": {"name": hub_role_binding_name(hub_username), "namespace": namespace,
                         "labels": {"app.kubernetes.io/managed-by": MANAGED_BY}},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": HUB_NAMESPACED_ROLE},
            "subjects": [rbac_subject(hub_username)]}


NAMESPACE_GUARD_NAME = "kubevirt-spawner"


def _namespace_guard_meta(ident: Identity) -> dict[str, Any]:
    return {"name": NAMESPACE_GUARD_NAME, "namespace": ident.namespace,
            "labels": {"app.kubernetes.io/managed-by": MANAGED_BY, LABEL_USER: ident.user_slug}}


def network_policy(ident: Identity, ports: tuple[tuple[str, int], ...], peers: list[dict[str, Any]]) -> dict[str, Any]:
    """Who may reach the workstations of a namespace: only `peers` (the hub and the proxy), on the
    machines' ports; so workstations do not reach each other, whatever else runs there."""
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": _namespace_guard_meta(ident),
            "spec": {"podSelector": {"matchLabels": {"app.kubernetes.io/managed-by": MANAGED_BY}},
                     "policyTypes": ["Ingress"],
                     "ingress": [{"from": [dict(p) for p in peers],
                                  "ports": [{"protocol": "TCP", "port": port} for _, port in ports]}]}}


def resource_quota(ident: Identity, hard: dict[str, str]) -> dict[str, Any]:
    """What one user's namespace may hold in all (CPU, memory, GPUs, disk space, machines)."""
    return {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": _namespace_guard_meta(ident),
            "spec": {"hard": dict(hard)}}


def limit_range(ident: Identity, limits: list[dict[str, Any]]) -> dict[str, Any]:
    """Bounds on each pod, container or claim in one user's namespace."""
    return {"apiVersion": "v1", "kind": "LimitRange", "metadata": _namespace_guard_meta(ident),
            "spec": {"limits": [dict(item) for item in limits]}}


def _b64(text: str) -> str:
    return base64.b64encode(text.encode("utf-8")).decode("ascii")


def user_data(ident: Identity) -> str:
    """cloud-init user data: the hostname only. Nothing is installed at boot: the golden image has
    the guest agent and everything else (a cluster without egress to a mirror starts the same),
    and its systemd unit mounts the env disk (serial `hubenv`) and runs jupyterhub-singleuser."""
    config = {"hostname": ident.vm}
    return "#cloud-config\n" + yaml.safe_dump(config, sort_keys=False)


def env_secret(ident: Identity, env: dict[str, str], args: list[str]) -> dict[str, Any]:
    """The Secret the VM mounts as a disk: one key per environment variable, the extra Jupyter
    arguments as JSON, and the cloud-init user data. It is rewritten before every start."""
    bad = sorted(k for k in env if not _ENV_NAME.match(k))
    if bad:
        raise ValueError(f"environment variable names must be letters, digits and _: {', '.join(bad)}")
    data = {k: _b64(str(v)) for k, v in env.items()}
    data[ARGS_KEY] = _b64(json.dumps(list(args)))
    data[USERDATA_KEY] = _b64(user_data(ident))
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": _meta(ident, ident.secret, "env"), "data": data}


def _datavolume(ident: Identity, name: str, component: str, spec: MachineSpec, source: dict[str, Any], size: str) -> dict[str, Any]:
    return {"apiVersion": "cdi.kubevirt.io/v1beta1", "kind": "DataVolume",
            "metadata": _meta(ident, name, component, spec),
            "spec": {"source": source,
                     "storage": {"storageClassName": spec.storage_class, "accessModes": ["ReadWriteOnce"],
                                 "volumeMode": "Block", "resources": {"requests": {"storage": size}}}}}


def root_datavolume(ident: Identity, spec: MachineSpec) -> dict[str, Any]:
    """The root disk: a standalone DataVolume cloned from the golden image PVC."""
    source = {"pvc": {"namespace": spec.golden_namespace, "name": spec.golden_name}}
    return _datavolume(ident, ident.rootdisk, "rootdisk", spec, source, spec.root_disk_size)


def workspace_datavolume(ident: Identity, spec: MachineSpec) -> dict[str, Any]:
    """The optional workspace disk: blank, and kept when the system is reset."""
    if not spec.workspace_disk_size:
        raise ValueError("this machine has no workspace disk (workspace_disk_size is not set)")
    return _datavolume(ident, ident.workspace, "workspace", spec, {"blank": {}}, spec.workspace_disk_size)


def extra_disk_claim(ident: Identity, disk: ExtraDisk) -> str:
    """The DataVolume and claim of an extra disk: the workspace disk's name and the disk's."""
    return f"{ident.workspace}-{disk.name}"


def extra_disk_datavolume(ident: Identity, spec: MachineSpec, disk: ExtraDisk) -> dict[str, Any]:
    """An extra disk: blank, or cloned from a claim (the admission policy allows the golden
    images' namespace only, as for system disks)."""
    if disk.clone_from:
        namespace, name = disk.clone_from.split("/")
        source: dict[str, Any] = {"pvc": {"namespace": namespace, "name": name}}
    else:
        source = {"blank": {}}
    dv = _datavolume(ident, extra_disk_claim(ident, disk), "datadisk", spec, source, disk.size)
    if disk.storage_class:
        dv["spec"]["storage"]["storageClassName"] = disk.storage_class
    return dv


def firmware(kind: str) -> dict[str, Any]:
    """The VM's firmware, which must be what the golden image's bootloader is built for (build.sh
    --firmware): BIOS (SeaBIOS, KubeVirt's default) or EFI (OVMF). EFI says secureBoot false:
    KubeVirt's default for `efi: {}` is true, which only a signed bootloader passes."""
    if kind == "bios":
        return {"bootloader": {"bios": {}}}
    if kind == "efi":
        return {"bootloader": {"efi": {"secureBoot": False}}}
    raise ValueError(f"the firmware is bios or efi, not {kind!r}")


def virtual_machine(ident: Identity, spec: MachineSpec) -> dict[str, Any]:
    requests = {"cpu": spec.cpu, "memory": spec.memory}
    if spec.scratch_disk_size:
        # The emptyDisk is a file in the launcher pod's ephemeral storage on the node's disk:
        # requested, the scheduler places the machine where it fits (virt-controller passes the
        # domain's requests to the compute container: services/renderresources.go).
        requests["ephemeral-storage"] = spec.scratch_disk_size
    resources: dict[str, Any] = {"requests": requests}
    limits = {k: v for k, v in (("cpu", spec.cpu_limit), ("memory", spec.memory_limit)) if v}
    if limits:
        resources["limits"] = limits
    # Serials name the disks inside the guest (/dev/disk/by-id/virtio-SERIAL): the golden image
    # mounts the workspace disk by its serial, and the guest agent's filesystem list reports them.
    disks = [{"name": "rootdisk", "serial": ROOT_DISK_SERIAL, "bootOrder": 1, "disk": {"bus": "virtio"}}]
    volumes = [{"name": "rootdisk", "persistentVolumeClaim": {"claimName": ident.rootdisk}}]
    if spec.workspace_disk_size:
        disks.append({"name": "workspace", "serial": WORKSPACE_DISK_SERIAL, "disk": {"bus": "virtio"}})
        volumes.append({"name": "workspace", "persistentVolumeClaim": {"claimName": ident.workspace}})
    for extra in spec.extra_disks:
        disks.append({"name": extra.volume, "serial": extra.volume, "disk": {"bus": "virtio"}})
        volumes.append({"name": extra.volume, "persistentVolumeClaim": {"claimName": extra_disk_claim(ident, extra)}})
    if spec.scratch_disk_size:
        disks.append({"name": "scratch", "serial": SCRATCH_DISK_SERIAL, "disk": {"bus": "virtio"}})
        volumes.append({"name": "scratch", "emptyDisk": {"capacity": spec.scratch_disk_size}})
    # Shared data: virtiofs, a filesystem and a claim volume of the same name (KubeVirt v1.9 needs
    # the EnableVirtioFsStorageVolumes feature gate for it); read-only is the claim volume's
    # readOnly, which the launcher pod's mount enforces (virt-controller's rendervolumes.go).
    filesystems = [{"name": share.name, "virtiofs": {}} for share in spec.shared_data]
    volumes += [{"name": share.name, "persistentVolumeClaim": {"claimName": share.claim,
                                                                **({"readOnly": True} if share.read_only else {})}}
                for share in spec.shared_data]
    disks += [{"name": "cloudinit", "disk": {"bus": "virtio"}},
              {"name": ENV_DISK_SERIAL, "serial": ENV_DISK_SERIAL, "disk": {"bus": "virtio"}}]
    # no network data: the golden image configures every Ethernet NIC by DHCP whatever its name
    # and MAC (KubeVirt writes network data verbatim, and a name in it may not be the guest's)
    volumes += [{"name": "cloudinit", "cloudInitNoCloud": {"secretRef": {"name": ident.secret}}},
                {"name": ENV_DISK_SERIAL, "secret": {"secretName": ident.secret}}]
    gpus: list[dict[str, Any]] = []
    for device, count in spec.gpus:
        for _ in range(count):
            gpus.append({"name": f"gpu{len(gpus)}", "deviceName": device})
    devices = {"autoattachGraphicsDevice": False, "disks": disks,
               "interfaces": [{"name": "default", "masquerade": {},
                               "ports": [{"name": n, "port": p} for n, p in spec.ports]}]}
    if gpus:
        devices["gpus"] = gpus
    if filesystems:
        devices["filesystems"] = filesystems
    template_spec: dict[str, Any] = {
        "terminationGracePeriodSeconds": spec.termination_grace_period,
        # A drain's eviction of the launcher pod is denied and the VMI marked for evacuation
        # (status.evacuationNodeName), so the workstations service warns its user and stops it
        # after c.Workstations.drain_grace; KubeVirt's default (None) would let the eviction shut
        # the guest down unwarned (virt-api's pod-eviction-admitter.go).
        "evictionStrategy": EVICTION_STRATEGY,
        "domain": {"memory": {"guest": spec.memory_guest or spec.memory}, "resources": resources,
                   "firmware": firmware(spec.firmware), "devices": devices},
        "networks": [{"name": "default", "pod": {}}],
        "volumes": volumes,
    }
    if spec.node_selector:
        template_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        template_spec["tolerations"] = [dict(t) for t in spec.tolerations]
    if spec.affinity:
        template_spec["affinity"] = spec.affinity
    if spec.priority_class:
        template_spec["priorityClassName"] = spec.priority_class
    template_spec = merge_patch(template_spec, spec.extra_template_spec)
    profile = {ANNOTATION_PROFILE: spec.profile, ANNOTATION_PROFILE_VERSION: spec.profile_version}
    if spec.profile:  # (the workstations service starts the machine with them again)
        profile[ANNOTATION_PROFILE_OPTIONS] = spec.profile_options or "{}"
    return {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
            "metadata": _meta(ident, ident.vm, "workstation", spec, **profile),
            "spec": merge_patch({"runStrategy": "Halted",
                            "template": {"metadata": {"labels": labels(ident, "workstation", spec),
                                                      "annotations": identity_annotations(ident, spec)},
                                         "spec": template_spec}}, spec.extra_spec)}


# What KubeVirt writes into a VM's template by itself and the guest depends on (KubeVirt v1.9):
# the VM mutator gives a new VM a random firmware UUID and serial on create only
# (vm-mutator.go setFirmwareDefaultsIfEmpty), which the guest sees as its SMBIOS identity and
# cloud-init as its instance-id (pkg/cloud-init/cloud-init.go): a new one makes it a new
# instance, with new SSH host keys. The PCI topology annotations set the guest's PCI layout
# (vmi-mutator.go setDefaultPciTopologyVersion; vm.go syncPCITopologyAnnotationsToVM), and the
# architecture and machine type its chipset (pkg/defaults SetVirtualMachineDefaults, which an
# update re-fills from the cluster's config of the day).
CLUSTER_TEMPLATE_ANNOTATIONS = ("kubevirt.io/pci-topology-version", "kubevirt.io/pci-interface-slot-count")
CLUSTER_TEMPLATE_FIELDS = ("domain.firmware.uuid", "domain.firmware.serial", "architecture", "domain.machine.type")


def keep_machine_identity(live_template: dict[str, Any], template: dict[str, Any]) -> dict[str, Any]:
    """`template` (a new one for an existing VM) with what the cluster set in the live one and the
    guest depends on, where `template` does not set it: a template replaced whole keeps the
    machine's firmware identity, PCI layout and chipset."""
    out = copy.deepcopy(template)
    for path in CLUSTER_TEMPLATE_FIELDS:
        value = field_value(live_template, f"spec.{path}")
        if value in (None, "") or field_value(out, f"spec.{path}") not in (None, ""):
            continue
        *parents, leaf = ["spec", *path.split(".")]
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    live_annotations = field_value(live_template, "metadata.annotations") or {}
    for key in CLUSTER_TEMPLATE_ANNOTATIONS:
        if key in live_annotations:
            out.setdefault("metadata", {}).setdefault("annotations", {}).setdefault(key, live_annotations[key])
    return out


def guest_env(spec: MachineSpec) -> dict[str, str]:
    """What the guest learns of its machine through the env disk, beside JupyterHub's variables:
    whether its SSH tunnel opens, and where each shared data filesystem and extra disk goes."""
    env = {"KUBEVIRT_SSH_ENABLED": "1" if spec.ssh_enabled else "0"}
    if spec.shared_data:
        env[SHARED_DATA_ENV] = json.dumps([{"tag": s.name, "path": s.path, "readOnly": s.read_only}
                                           for s in spec.shared_data])
    if spec.extra_disks:
        env[EXTRA_DISKS_ENV] = json.dumps([{"serial": d.volume, "path": d.path} for d in spec.extra_disks])
    return env


def service(ident: Identity, spec: MachineSpec) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": _meta(ident, ident.service, "notebook", spec),
            "spec": {"type": "ClusterIP", "selector": vmi_selector(ident),
                     "ports": [{"name": n, "port": p, "targetPort": p, "protocol": "TCP"} for n, p in spec.ports]}}


ANNOTATION_SNAPSHOT_NAME = LABEL_PREFIX + "snapshot-name"  # the name the user gave it
ANNOTATION_NOTE = LABEL_PREFIX + "note"
SNAPSHOT_NAME_MAX = 40
_SNAPSHOT_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
SNAPSHOT_NOTE_MAX = 500


def check_snapshot_name(name: str) -> str:
    """A user's snapshot name, or ValueError with a sentence saying what a valid one is."""
    if not (isinstance(name, str) and len(name) <= SNAPSHOT_NAME_MAX and _SNAPSHOT_NAME.match(name)):
        raise ValueError(f"A snapshot name has 1 to {SNAPSHOT_NAME_MAX} lower-case letters, digits and dashes, and "
                         f"starts and ends with a letter or digit (for example before-cuda-12).")
    return name


def snapshot_object_name(ident: Identity, name: str) -> str:
    """`alice--gpu.before-cuda`: a dot, which neither a slug nor a snapshot name has, keeps the two
    apart, so workstations sharing a namespace never get the same object name (with a dash,
    `bob` + `x-y` and `bob-x` + `y` did). Snapshots made with the dash keep their names: they are
    found by their annotations."""
    return f"{ident.slug}.{name}"


def virtual_machine_snapshot(ident: Identity, name: str, note: str = "") -> dict[str, Any]:
    """A VirtualMachineSnapshot of the workstation's VM: every disk (root and workspace) at once."""
    check_snapshot_name(name)
    if len(note) > SNAPSHOT_NOTE_MAX:
        raise ValueError(f"A snapshot note has at most {SNAPSHOT_NOTE_MAX} characters.")
    meta = _meta(ident, snapshot_object_name(ident, name), "snapshot")
    meta["annotations"][ANNOTATION_SNAPSHOT_NAME] = name
    if note:
        meta["annotations"][ANNOTATION_NOTE] = note
    return {"apiVersion": "snapshot.kubevirt.io/v1beta1", "kind": "VirtualMachineSnapshot", "metadata": meta,
            "spec": {"source": {"apiGroup": "kubevirt.io", "kind": "VirtualMachine", "name": ident.vm}}}


def virtual_machine_restore(ident: Identity, snapshot_object: str, name: str) -> dict[str, Any]:
    """Restore the VM from one of its snapshots, in place: the disks keep their names (the VM and
    the DataVolumes go on pointing at them) and no owner reference to the VM, so deleting the VM
    never takes a disk with it (KubeVirt's default, volumeOwnershipPolicy Vm, would)."""
    return {"apiVersion": "snapshot.kubevirt.io/v1beta1", "kind": "VirtualMachineRestore",
            "metadata": _meta(ident, name, "restore"),
            "spec": {"target": {"apiGroup": "kubevirt.io", "kind": "VirtualMachine", "name": ident.vm},
                     "virtualMachineSnapshotName": snapshot_object,
                     "volumeRestorePolicy": "InPlace", "volumeOwnershipPolicy": "None"}}


def snapshot_consistency(snapshot: dict[str, Any]) -> str | None:
    """How consistent a snapshot is, from KubeVirt's indications (pkg/storage/snapshot/snapshot.go):
    taken while running with the guest agent freezing the filesystems, while running without it,
    or while stopped. None until KubeVirt has looked."""
    status = snapshot.get("status") or {}
    if not status.get("phase"):
        return None
    found = {i.get("indication") for i in status.get("sourceIndications") or []} or set(status.get("indications")
                                                                                         or [])
    if "Online" not in found:
        return "offline"
    if "GuestAgent" in found and "QuiesceTimeout" not in found:
        return "application-consistent"
    return "crash-consistent"


def retained_patch(retain_until: str, user_created: str = "") -> dict[str, Any]:
    """Merge patch that marks a disk as kept after its workstation was deleted (by the account
    made at `user_created`, when known)."""
    annotations = {ANNOTATION_RETAIN_UNTIL: retain_until}
    if user_created:
        annotations[ANNOTATION_USER_CREATED] = user_created
    return {"metadata": {"labels": {LABEL_RETAINED: "true"}, "annotations": annotations}}


def account_patch(user_created: str) -> dict[str, Any]:
    """Merge patch that records the account a disk belongs to (made at `user_created`)."""
    return {"metadata": {"annotations": {ANNOTATION_USER_CREATED: user_created}}}


def reclaim_patch(policy: str) -> dict[str, Any]:
    """Merge patch of a PersistentVolume's reclaim policy: Delete before the hub deletes its claim on
    purpose (the storage class keeps volumes, Retain, against mistakes), Retain to undo that."""
    return {"spec": {"persistentVolumeReclaimPolicy": policy}}


def unretained_patch(user_created: str = "") -> dict[str, Any]:
    """Merge patch that removes the retained marks from a disk that is in use again, by the account
    made at `user_created` from now on."""
    annotations: dict[str, str | None] = {ANNOTATION_RETAIN_UNTIL: None, ANNOTATION_CONFIRMED_FOR: None}
    if user_created:
        annotations[ANNOTATION_USER_CREATED] = user_created
    return {"metadata": {"labels": {LABEL_RETAINED: None}, "annotations": annotations}}
