"""What the cluster adds by itself to the objects a client writes, before validation: the API
server's scheme defaults of the core kinds (default_fields, on every write) and KubeVirt's
mutating webhooks (mutate).

What the registries add on create (a Service's cluster IP, a PVC's storage class and finalizer) is
`Cluster.defaults`; CDI's DataVolume mutator (a clone token) is `admission._authorize_clone`,
which also refuses. They run in the request path in upstream's order (sim/server.py
`_validate`): defaulting, these mutators, validation, the validating webhooks, then the
ValidatingAdmissionPolicies (sim/policies.py).
"""

from __future__ import annotations

import uuid

DEFAULT_ARCHITECTURE = "amd64"  # the cluster's (KubeVirt CR status.defaultArchitecture: runtime.GOARCH)
MACHINE_TYPES = {"amd64": "q35", "arm64": "virt", "s390x": "s390-ccw-virtio"}  # pkg/virt-config/virt-config.go
PCI_TOPOLOGY_VERSION = "kubevirt.io/pci-topology-version"  # staging/src/kubevirt.io/api/core/v1/types.go
PCI_SLOT_COUNT = "kubevirt.io/pci-interface-slot-count"
PCI_TOPOLOGY_V3 = "v3"


def default_fields(kind: str, obj: dict) -> None:
    """Kubernetes 1.32's scheme defaults (pkg/apis/core/v1/defaults.go, networking/v1 and rbac/v1
    defaults.go) of the core kinds this product writes, each only where the field is unset."""
    spec = obj.get("spec")
    if kind == "Namespace":  # SetDefaults_Namespace
        obj["metadata"].setdefault("labels", {})["kubernetes.io/metadata.name"] = obj["metadata"]["name"]
    elif kind == "Secret":  # SetDefaults_Secret
        obj.setdefault("type", "Opaque")
    elif kind == "Service" and isinstance(spec, dict):  # SetDefaults_Service
        spec.setdefault("type", "ClusterIP")
        spec.setdefault("sessionAffinity", "None")
        if spec["type"] in ("ClusterIP", "NodePort", "LoadBalancer"):
            spec.setdefault("internalTrafficPolicy", "Cluster")
        for port in spec.get("ports") or []:
            port.setdefault("protocol", "TCP")
            port.setdefault("targetPort", port.get("port"))
    elif kind == "PersistentVolumeClaim" and isinstance(spec, dict):  # SetDefaults_PersistentVolumeClaimSpec
        spec.setdefault("volumeMode", "Filesystem")
    elif kind == "NetworkPolicy" and isinstance(spec, dict):  # SetDefaults_NetworkPolicy
        for rule in (spec.get("ingress") or []) + (spec.get("egress") or []):
            for port in rule.get("ports") or []:
                port.setdefault("protocol", "TCP")
        if not spec.get("policyTypes"):
            spec["policyTypes"] = ["Ingress"] + (["Egress"] if spec.get("egress") else [])
    elif kind in ("RoleBinding", "ClusterRoleBinding"):  # SetDefaults_RoleBinding, SetDefaults_Subject
        if isinstance(obj.get("roleRef"), dict):
            obj["roleRef"].setdefault("apiGroup", "rbac.authorization.k8s.io")
        for subject in obj.get("subjects") or []:
            subject.setdefault("apiGroup", "" if subject.get("kind") == "ServiceAccount"
                               else "rbac.authorization.k8s.io")
    elif kind == "LimitRange" and isinstance(spec, dict):  # SetDefaults_LimitRangeItem (containers only)
        for item in spec.get("limits") or []:
            if item.get("type") != "Container":
                continue
            for resource, amount in (item.get("max") or {}).items():
                item.setdefault("default", {}).setdefault(resource, amount)
            for source in ("default", "min"):
                for resource, amount in (item.get(source) or {}).items():
                    item.setdefault("defaultRequest", {}).setdefault(resource, amount)


def supports_pcie_hotplug(vmi_spec: dict) -> bool:
    """pkg/defaults/defaults.go SupportsPCIeHotplug: amd64 or arm64 (or no architecture) on a
    q35 or virt machine (or none)."""
    arch = vmi_spec.get("architecture") or ""
    machine = (vmi_spec.get("domain") or {}).get("machine")
    if arch not in ("amd64", "arm64", ""):
        return False
    if machine is None:
        return True
    machine_type = machine.get("type") or ""
    return "q35" in machine_type or machine_type.startswith("virt")


def set_pci_topology_version(meta: dict) -> None:
    """vmi-mutator.go setDefaultPciTopologyVersion: v3, unless a version is there already."""
    annotations = meta.setdefault("annotations", {})
    annotations.setdefault(PCI_TOPOLOGY_VERSION, PCI_TOPOLOGY_V3)


def set_architecture_and_machine(vmi_spec: dict) -> None:
    """pkg/defaults/defaults.go setDefaultArchitecture and setVMDefaultMachineType (VM) or
    SetDefaultVirtualMachineInstance's (VMI): the cluster's architecture, that architecture's
    machine type, each only when empty."""
    if not vmi_spec.get("architecture"):
        vmi_spec["architecture"] = DEFAULT_ARCHITECTURE
    machine = vmi_spec.setdefault("domain", {}).setdefault("machine", {})
    if not machine.get("type"):
        machine["type"] = MACHINE_TYPES.get(vmi_spec["architecture"], "q35")


def mutate_vm(vm: dict, creating: bool) -> None:
    """KubeVirt v1.9's VM mutator (pkg/virt-api/webhooks/mutating-webhook/mutators/vm-mutator.go,
    Mutate), on create and update, in its order: on create only, a random firmware UUID and
    serial where the template has none (setFirmwareDefaultsIfEmpty: an update never gets one, so
    a client that replaces the template drops them); on both, the architecture and machine type
    (SetVirtualMachineDefaults); on create only, the PCI topology annotation of the template where
    the machine supports PCIe hotplug. A VM being deleted is left as it is."""
    if vm["metadata"].get("deletionTimestamp"):
        return
    template = vm.setdefault("spec", {}).setdefault("template", {})
    tspec = template.setdefault("spec", {})
    if creating:
        firmware = tspec.setdefault("domain", {}).setdefault("firmware", {})
        if not firmware.get("uuid"):
            firmware["uuid"] = str(uuid.uuid4())
        if not firmware.get("serial"):
            firmware["serial"] = str(uuid.uuid4())
    set_architecture_and_machine(tspec)
    if creating and supports_pcie_hotplug(tspec):
        set_pci_topology_version(template.setdefault("metadata", {}))


def mutate_vmi(vmi: dict) -> None:
    """KubeVirt v1.9's VMI mutator on create (vmi-mutator.go Mutate): the parts the product
    sees: the architecture and machine type, and the PCI topology annotation that virt-controller
    copies back into the VM's template (vm.go syncPCITopologyAnnotationsToVM)."""
    spec = vmi.setdefault("spec", {})
    set_architecture_and_machine(spec)
    if supports_pcie_hotplug(spec):
        set_pci_topology_version(vmi["metadata"])


MUTATORS = {"VirtualMachine": lambda obj, old: mutate_vm(obj, creating=old is None),
            "VirtualMachineInstance": lambda obj, old: mutate_vmi(obj) if old is None else None}


def mutate(kind: str, obj: dict, old: dict | None) -> None:
    """The scheme's defaults and the mutating webhooks of `kind`, in place."""
    default_fields(kind, obj)
    mutator = MUTATORS.get(kind)
    if mutator is not None:
        mutator(obj, old)
