"""The kinds the simulated API server serves, with what discovery and tables need."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Column:
    name: str
    json_path: str  # dotted path into the object, e.g. "status.phase"
    type: str = "string"
    priority: int = 0
    # how kubectl's printer shows the value, when not as it is (pkg/printers/internalversion)
    render: Callable[[object], object] | None = None


def _first_three(items: list[str]) -> str:
    """listWithMoreString in pkg/printers/internalversion/printers.go."""
    shown = ",".join(items[:3])
    return f"{shown} + {len(items) - 3} more..." if len(items) > 3 else (shown or "<unset>")


def _slice_ports(ports) -> str:
    return _first_three([str(p["port"]) if p.get("port") is not None else p.get("name") or "*" for p in ports or []])


def _slice_endpoints(endpoints) -> str:
    return _first_three([address for e in endpoints or [] for address in e.get("addresses") or []])


def _node_status(node) -> str:
    """printNode in pkg/printers/internalversion/printers.go: Ready, NotReady or Unknown from the
    Ready condition, then SchedulingDisabled for a cordoned node."""
    ready = next((c.get("status") for c in (node.get("status") or {}).get("conditions") or []
                  if c.get("type") == "Ready"), None)
    status = ["Ready" if ready == "True" else "NotReady" if ready == "False" else "Unknown"]
    if (node.get("spec") or {}).get("unschedulable"):
        status.append("SchedulingDisabled")
    return ",".join(status)


def _node_roles(labels) -> str:
    """findNodeRoles in the same file: node-role.kubernetes.io/ROLE and kubernetes.io/role."""
    roles = sorted({key.split("/", 1)[1] for key in labels or {} if key.startswith("node-role.kubernetes.io/")}
                   | ({labels["kubernetes.io/role"]} if (labels or {}).get("kubernetes.io/role") else set()))
    return ",".join(r for r in roles if r) or "<none>"


@dataclass(frozen=True)
class ResourceType:
    group: str  # "" for core
    versions: tuple[str, ...]  # served versions, storage version first
    kind: str
    plural: str
    namespaced: bool = True
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    subresources: tuple[str, ...] = ()  # served as /{plural}/{name}/{sub} (status included)
    schema: str | None = None  # key in the schema registry (schema.py)
    columns: tuple[Column, ...] = ()
    list_kind: str = ""

    @property
    def key(self) -> tuple[str, str]:
        return (self.group, self.plural)

    @property
    def singular(self) -> str:
        return self.kind.lower()

    def api_version(self, version: str | None = None) -> str:
        v = version or self.versions[0]
        return f"{self.group}/{v}" if self.group else v

    def versioned(self, obj: dict, version: str) -> dict:
        """The object as the given version of the resource serves it: its apiVersion says so."""
        if self.group and obj.get("apiVersion") != f"{self.group}/{version}":
            obj = dict(obj)
            obj["apiVersion"] = f"{self.group}/{version}"
        return obj

    @property
    def group_resource(self) -> str:
        """How Kubernetes names the resource in error messages: `virtualmachines.kubevirt.io`."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def qualified_kind(self) -> str:
        """How validation errors name the kind: `VirtualMachine.kubevirt.io`."""
        return f"{self.kind}.{self.group}" if self.group else self.kind


_AGE = Column("Age", "metadata.creationTimestamp", "date")

RESOURCE_TYPES: tuple[ResourceType, ...] = (
    ResourceType("", ("v1",), "Namespace", "namespaces", namespaced=False, short_names=("ns",),
                 subresources=("status",), columns=(Column("Status", "status.phase"), _AGE)),
    ResourceType("", ("v1",), "Node", "nodes", namespaced=False, short_names=("no",),
                 subresources=("status",),
                 columns=(Column("Status", "", render=_node_status), Column("Roles", "metadata.labels", render=_node_roles),
                          _AGE, Column("Version", "status.nodeInfo.kubeletVersion"))),
    ResourceType("", ("v1",), "Service", "services", short_names=("svc",), categories=("all",),
                 subresources=("status",),
                 columns=(Column("Type", "spec.type"), Column("Cluster-IP", "spec.clusterIP"), _AGE)),
    ResourceType("", ("v1",), "Endpoints", "endpoints", short_names=("ep",), columns=(_AGE,)),
    ResourceType("", ("v1",), "Pod", "pods", short_names=("po",), categories=("all",),
                 subresources=("status", "eviction"),
                 columns=(Column("Status", "status.phase"), Column("IP", "status.podIP"),
                          Column("Node", "spec.nodeName"), _AGE)),
    ResourceType("", ("v1",), "Secret", "secrets", columns=(Column("Type", "type"), _AGE)),
    ResourceType("", ("v1",), "ConfigMap", "configmaps", short_names=("cm",), columns=(_AGE,)),
    ResourceType("", ("v1",), "PersistentVolumeClaim", "persistentvolumeclaims", short_names=("pvc",),
                 subresources=("status",),
                 columns=(Column("Status", "status.phase"), Column("Volume", "spec.volumeName"),
                          Column("Capacity", "status.capacity.storage"),
                          Column("StorageClass", "spec.storageClassName"), _AGE)),
    ResourceType("", ("v1",), "PersistentVolume", "persistentvolumes", short_names=("pv",), namespaced=False,
                 subresources=("status",),
                 columns=(Column("Capacity", "spec.capacity.storage"),
                          Column("Reclaim Policy", "spec.persistentVolumeReclaimPolicy"),
                          Column("Status", "status.phase"), Column("Claim", "spec.claimRef.name"),
                          Column("StorageClass", "spec.storageClassName"), _AGE)),
    ResourceType("", ("v1",), "Event", "events", short_names=("ev",),
                 columns=(Column("Type", "type"), Column("Reason", "reason"),
                          Column("Object", "involvedObject.name"), Column("Message", "message"))),
    ResourceType("", ("v1",), "ServiceAccount", "serviceaccounts", short_names=("sa",), subresources=("token",),
                 columns=(_AGE,)),
    ResourceType("rbac.authorization.k8s.io", ("v1",), "Role", "roles", columns=(_AGE,)),
    ResourceType("rbac.authorization.k8s.io", ("v1",), "RoleBinding", "rolebindings",
                 columns=(Column("Role", "roleRef.name"), _AGE)),
    ResourceType("rbac.authorization.k8s.io", ("v1",), "ClusterRole", "clusterroles", namespaced=False,
                 columns=(_AGE,)),
    ResourceType("rbac.authorization.k8s.io", ("v1",), "ClusterRoleBinding", "clusterrolebindings",
                 namespaced=False, columns=(Column("Role", "roleRef.name"), _AGE)),
    ResourceType("", ("v1",), "ResourceQuota", "resourcequotas", short_names=("quota",),
                 subresources=("status",), columns=(_AGE,)),
    ResourceType("", ("v1",), "LimitRange", "limitranges", short_names=("limits",), columns=(_AGE,)),
    ResourceType("storage.k8s.io", ("v1",), "StorageClass", "storageclasses", namespaced=False,
                 short_names=("sc",), columns=(Column("Provisioner", "provisioner"), _AGE)),
    ResourceType("snapshot.storage.k8s.io", ("v1",), "VolumeSnapshotClass", "volumesnapshotclasses",
                 namespaced=False, short_names=("vsclass", "vsclasses"), columns=(Column("Driver", "driver"), _AGE)),
    ResourceType("snapshot.storage.k8s.io", ("v1",), "VolumeSnapshot", "volumesnapshots",
                 short_names=("vs",), subresources=("status",),
                 columns=(Column("ReadyToUse", "status.readyToUse", "boolean"), _AGE)),
    ResourceType("networking.k8s.io", ("v1",), "NetworkPolicy", "networkpolicies", short_names=("netpol",),
                 columns=(_AGE,)),
    ResourceType("networking.k8s.io", ("v1",), "Ingress", "ingresses", short_names=("ing",), subresources=("status",),
                 columns=(Column("Class", "spec.ingressClassName"), _AGE)),
    # The Gateway API's CRD (gateway.networking.k8s.io), for the deployment's TLS example.
    ResourceType("gateway.networking.k8s.io", ("v1",), "HTTPRoute", "httproutes", subresources=("status",),
                 columns=(Column("Hostnames", "spec.hostnames"), _AGE)),
    # The attach/detach controller's record of a CSI volume attached to a node (kubectl's columns).
    ResourceType("storage.k8s.io", ("v1",), "VolumeAttachment", "volumeattachments", namespaced=False,
                 subresources=("status",),
                 columns=(Column("Attacher", "spec.attacher"), Column("PV", "spec.source.persistentVolumeName"),
                          Column("Node", "spec.nodeName"), Column("Attached", "status.attached", "boolean"), _AGE)),
    ResourceType("storage.k8s.io", ("v1",), "CSIDriver", "csidrivers", namespaced=False,
                 columns=(Column("AttachRequired", "spec.attachRequired", "boolean"),
                          Column("PodInfoOnMount", "spec.podInfoOnMount", "boolean"),
                          Column("StorageCapacity", "spec.storageCapacity", "boolean"),
                          Column("Modes", "spec.volumeLifecycleModes"), _AGE)),
    ResourceType("discovery.k8s.io", ("v1",), "EndpointSlice", "endpointslices",
                 columns=(Column("AddressType", "addressType"), Column("Ports", "ports", render=_slice_ports),
                          Column("Endpoints", "endpoints", render=_slice_endpoints), _AGE)),
    ResourceType("apps", ("v1",), "DaemonSet", "daemonsets", short_names=("ds",), categories=("all",),
                 subresources=("status",), columns=(_AGE,)),
    ResourceType("admissionregistration.k8s.io", ("v1",), "ValidatingAdmissionPolicy",
                 "validatingadmissionpolicies", namespaced=False, categories=("api-extensions",),
                 subresources=("status",), columns=(_AGE,)),
    ResourceType("admissionregistration.k8s.io", ("v1",), "ValidatingAdmissionPolicyBinding",
                 "validatingadmissionpolicybindings", namespaced=False, categories=("api-extensions",),
                 columns=(_AGE,)),
    # The Prometheus Operator's CRD (monitoring.coreos.com), for the deployment's alerts.
    ResourceType("monitoring.coreos.com", ("v1",), "PrometheusRule", "prometheusrules", short_names=("promrule",),
                 columns=(_AGE,)),
    ResourceType("monitoring.coreos.com", ("v1",), "ServiceMonitor", "servicemonitors", short_names=("smon",),
                 columns=(_AGE,)),
    # The definitions of the kinds above that are CRDs upstream (seeded with the cluster).
    ResourceType("apiextensions.k8s.io", ("v1",), "CustomResourceDefinition", "customresourcedefinitions",
                 short_names=("crd", "crds"), namespaced=False, categories=("api-extensions",),
                 subresources=("status",), columns=(Column("Created At", "metadata.creationTimestamp"),)),
    # KubeVirt's and CDI's operator CRs (pkg/virt-operator/resource/generate/components/crds.go,
    # CDI's pkg/operator/resources/crds_generated.go).
    ResourceType("kubevirt.io", ("v1",), "KubeVirt", "kubevirts", short_names=("kv", "kvs"), categories=("all",),
                 subresources=("status",), schema="KubeVirt", columns=(_AGE, Column("Phase", "status.phase"))),
    ResourceType("cdi.kubevirt.io", ("v1beta1",), "CDI", "cdis", namespaced=False, short_names=("cdi", "cdis"),
                 subresources=("status",), schema="CDI", columns=(_AGE, Column("Phase", "status.phase"))),
    ResourceType("cdi.kubevirt.io", ("v1beta1",), "CDIConfig", "cdiconfigs", namespaced=False,
                 subresources=("status",), schema="CDIConfig", columns=(_AGE,)),
    ResourceType("kubevirt.io", ("v1",), "VirtualMachine", "virtualmachines", short_names=("vm", "vms"),
                 categories=("all",), subresources=("status",), schema="VirtualMachine",
                 columns=(_AGE, Column("Status", "status.printableStatus"), Column("Ready", "status.conditions[?type=Ready].status"))),
    ResourceType("kubevirt.io", ("v1",), "VirtualMachineInstance", "virtualmachineinstances",
                 short_names=("vmi", "vmis"), categories=("all",), subresources=("status",),
                 schema="VirtualMachineInstance",
                 columns=(_AGE, Column("Phase", "status.phase"), Column("IP", "status.interfaces[0].ipAddress"),
                          Column("NodeName", "status.nodeName"),
                          Column("Ready", "status.conditions[?type=Ready].status"))),
    ResourceType("cdi.kubevirt.io", ("v1beta1",), "DataVolume", "datavolumes", short_names=("dv", "dvs"),
                 categories=("all",), subresources=("status",), schema="DataVolume",
                 columns=(Column("Phase", "status.phase"), Column("Progress", "status.progress"),
                          Column("Restarts", "status.restartCount", "integer"), _AGE)),
    ResourceType("cdi.kubevirt.io", ("v1beta1",), "StorageProfile", "storageprofiles", namespaced=False,
                 subresources=("status",), columns=(_AGE,)),
    ResourceType("snapshot.kubevirt.io", ("v1beta1", "v1alpha1"), "VirtualMachineSnapshot",
                 "virtualmachinesnapshots", short_names=("vmsnapshot", "vmsnapshots"), categories=("all",),
                 subresources=("status",), schema="VirtualMachineSnapshot",
                 columns=(Column("SourceKind", "spec.source.kind"), Column("SourceName", "spec.source.name"),
                          Column("Phase", "status.phase"), Column("ReadyToUse", "status.readyToUse", "boolean"), _AGE)),
    ResourceType("snapshot.kubevirt.io", ("v1beta1", "v1alpha1"), "VirtualMachineSnapshotContent",
                 "virtualmachinesnapshotcontents", short_names=("vmsnapshotcontent", "vmsnapshotcontents"),
                 categories=("all",), subresources=("status",), schema="VirtualMachineSnapshotContent",
                 columns=(Column("ReadyToUse", "status.readyToUse", "boolean"), _AGE)),
    ResourceType("snapshot.kubevirt.io", ("v1beta1", "v1alpha1"), "VirtualMachineRestore",
                 "virtualmachinerestores", short_names=("vmrestore", "vmrestores"), categories=("all",),
                 subresources=("status",), schema="VirtualMachineRestore",
                 columns=(Column("TargetKind", "spec.target.kind"), Column("TargetName", "spec.target.name"),
                          Column("Complete", "status.complete", "boolean"), _AGE)),
)

BY_KEY: dict[tuple[str, str], ResourceType] = {rt.key: rt for rt in RESOURCE_TYPES}
BY_KIND: dict[str, ResourceType] = {rt.kind: rt for rt in RESOURCE_TYPES}
# The groups whose kinds are CustomResourceDefinitions upstream (KubeVirt's and CDI's operators, the
# CSI snapshotter, the Gateway API, the Prometheus Operator install them).
CRD_GROUPS = ("kubevirt.io", "cdi.kubevirt.io", "snapshot.kubevirt.io", "snapshot.storage.k8s.io",
              "gateway.networking.k8s.io", "monitoring.coreos.com")

# KubeVirt's aggregated subresource API group: served by virt-api, not stored.
SUBRESOURCES_GROUP = "subresources.kubevirt.io"
VM_ACTIONS = ("start", "stop", "restart")
VMI_AGENT_CALLS = ("guestosinfo", "userlist", "filesystemlist")


def lookup(group: str, version: str, plural: str) -> ResourceType | None:
    rt = BY_KEY.get((group, plural))
    if rt is None or version not in rt.versions:
        return None
    return rt


def groups() -> dict[str, list[str]]:
    """Every non-core API group with its served versions, preferred first."""
    out: dict[str, list[str]] = {}
    for rt in RESOURCE_TYPES:
        if rt.group:
            versions = out.setdefault(rt.group, [])
            for v in rt.versions:
                if v not in versions:
                    versions.append(v)
    out[SUBRESOURCES_GROUP] = ["v1"]
    return out

