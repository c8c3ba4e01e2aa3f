"""What the upstream admission webhooks and the quota admission plugin refuse."""

from __future__ import annotations

import secrets
from decimal import Decimal

from ..objects import field_value
from ..quantity import format_bytes, parse_quantity
from . import errors, rbac
from .auth import User
from .operators import feature_gates
from .resources import BY_KIND, ResourceType

VIRTIOFS_STORAGE_GATE = "EnableVirtioFsStorageVolumes"  # pkg/virt-config/featuregate/active.go
RUN_STRATEGIES = ("Always", "Halted", "Manual", "RerunOnFailure", "Once", "WaitAsReceiver")
SNAPSHOT_KINDS = ("VirtualMachineSnapshot", "VirtualMachineSnapshotContent", "VirtualMachineRestore")


def admit(store, rt: ResourceType, obj: dict, old: dict | None, user: User | None = None):
    """Raise the upstream error for an object the real cluster would refuse. `user` sent the
    request; None is one of the cluster's own controllers (which hold what they need)."""
    check = _CHECKS.get(rt.kind)
    if check:
        check(store, rt, obj, old, user)


def _run_strategy(vm: dict) -> str:
    spec = vm.get("spec") or {}
    return spec.get("runStrategy") or ("Always" if spec.get("running") else "Halted")


def _vm(store, rt, obj, old, user):
    spec = obj.get("spec") or {}
    name = obj["metadata"]["name"]
    has_running = spec.get("running") is not None
    has_strategy = spec.get("runStrategy") is not None
    if has_running and has_strategy:
        raise errors.invalid(rt, name, [{"field": "spec.running", "message":
            "Running and RunStrategy are mutually exclusive. Note that Running is deprecated, "
            "please use RunStrategy instead"}])
    if not has_running and not has_strategy:
        raise errors.invalid(rt, name, [{"field": "spec.runStrategy", "reason": "FieldValueRequired",
                                         "message": "One of Running or RunStrategy must be specified"}])
    if has_strategy and spec["runStrategy"] not in RUN_STRATEGIES:
        raise errors.invalid(rt, name, [{"field": "spec.runStrategy", "reason": "FieldValueInvalid",
                                         "message": f"Invalid RunStrategy ({spec['runStrategy']})"}])
    # pkg/storage/admitters/vm-storage-status.go: no change of the run state while the VM is locked
    restoring = field_value(old, "status.restoreInProgress") if old else None
    if restoring and _run_strategy(obj) != _run_strategy(old):
        raise errors.invalid(rt, name, [{"field": "spec", "message":
                                         f'Cannot update VM runStrategy until restore "{restoring}" completes'}])
    snapshotting = field_value(old, "status.snapshotInProgress") if old else None
    if snapshotting and _run_strategy(obj) != _run_strategy(old):
        raise errors.invalid(rt, name, [{"field": "spec", "message":
                                         f'Cannot update vm running state until snapshot "{snapshotting}" completes'}])
    tspec = field_value(spec, "template.spec") or {}
    volumes = {v.get("name") for v in tspec.get("volumes") or []}
    _check_filesystems(store, rt, name, tspec)
    for i, disk in enumerate(field_value(tspec, "domain.devices.disks") or []):
        if disk.get("name") not in volumes:
            raise errors.invalid(rt, name, [{
                "field": f"spec.template.spec.domain.devices.disks[{i}].name",
                "message": f"spec.template.spec.domain.devices.disks[{i}].name '{disk.get('name')}' not found."}])


def _check_filesystems(store, rt, name: str, tspec: dict):
    """virtiofs of a claim needs the EnableVirtioFsStorageVolumes gate (KubeVirt v1.9
    pkg/virt-api/webhooks/validating-webhook/admitters/vmi-create-admitter.go,
    validateFilesystemsWithVirtIOFSEnabled, which the VM admitter runs on the template too); a
    filesystem without a volume of its name is not checked there."""
    volumes = {v.get("name"): v for v in tspec.get("volumes") or []}
    for fs in field_value(tspec, "domain.devices.filesystems") or []:
        volume = volumes.get(fs.get("name"))
        if volume is None:
            continue
        if ("persistentVolumeClaim" in volume or "dataVolume" in volume) and \
                VIRTIOFS_STORAGE_GATE not in feature_gates(store):
            raise errors.invalid(rt, name, [{"field": "spec.template.spec.domain.devices.filesystems",
                                             "message": "virtiofs is not allowed: virtiofs feature gate is not "
                                                        "enabled for PVC"}])


CDI_MUTATING_WEBHOOK = "datavolume-mutate.cdi.kubevirt.io"
CLONE_TOKEN = "cdi.kubevirt.io/storage.clone.token"


def _authorize_clone(store, obj: dict, user: User | None, creating: bool):
    """CDI's DataVolume mutating webhook (pkg/apiserver/webhooks/datavolume-mutate.go, with the
    checks of core/v1beta1/authorize.go), on create and on every update: whoever clones a PVC from
    another namespace must be allowed to create `datavolumes/source` there, or else pods. On a
    create it signs the clone with a token annotation (for the clone controller, which the
    simulator's does not check)."""
    source = field_value(obj, "spec.source.pvc") or {}
    target_ns = obj["metadata"].get("namespace", "")
    source_ns = source.get("namespace") or target_ns
    if not source.get("name") or obj["metadata"].get("deletionTimestamp"):
        return
    if source_ns == target_ns:  # nothing to check within one namespace; still signed
        if creating:
            obj["metadata"].setdefault("annotations", {})[CLONE_TOKEN] = secrets.token_urlsafe(48)
        return
    if store.get(BY_KIND["Namespace"], "", source_ns) is None:
        raise errors.ApiError(400, "", f'admission webhook "{CDI_MUTATING_WEBHOOK}" denied the request: '
                              f'namespaces "{source_ns}" not found')
    if user is not None:
        asks = (rbac.Request("create", "cdi.kubevirt.io", "datavolumes", "source", source_ns, source["name"]),
                rbac.Request("create", "", "pods", "", source_ns, source["name"]))
        if not any(rbac.allowed(store, user, ask) for ask in asks):
            why = f"User {user.name} has insufficient permissions in clone source namespace {source_ns}"
            raise errors.ApiError(422, "", f'admission webhook "{CDI_MUTATING_WEBHOOK}" denied the request:  {why}',
                                  {"causes": [{"reason": "FieldValueInvalid", "message": why,
                                               "field": "spec.source.PVC.namespace"}]})
    if creating:
        obj["metadata"].setdefault("annotations", {})[CLONE_TOKEN] = secrets.token_urlsafe(48)


def _dv(store, rt, obj, old, user):
    name = obj["metadata"]["name"]
    ns = obj["metadata"].get("namespace", "")
    _authorize_clone(store, obj, user, creating=old is None)
    if old is not None:
        if obj.get("spec") != old.get("spec"):
            raise errors.invalid(rt, name, [{"field": "spec", "message": "Cannot update DataVolume Spec"}])
        return
    spec = obj.get("spec") or {}
    if not spec.get("source") and not spec.get("sourceRef"):
        raise errors.invalid(rt, name, [{"field": "spec.source", "reason": "FieldValueRequired",
                                         "message": "Data volume should have either Source or SourceRef"}])
    if not spec.get("pvc") and not spec.get("storage"):
        raise errors.invalid(rt, name, [{"field": "spec", "reason": "FieldValueRequired",
                                         "message": "Missing Data volume PVC or Storage"}])
    pvc = store.get(BY_KIND["PersistentVolumeClaim"], ns, name)
    if pvc is not None and not any(r.get("kind") == "DataVolume"
                                   for r in pvc["metadata"].get("ownerReferences") or []):
        raise errors.invalid(rt, name, [{"field": "metadata.name", "reason": "FieldValueDuplicate",
                                         "message": f"Destination PVC {ns}/{name} already exists"}])
    source_pvc = field_value(spec, "source.pvc")
    if source_pvc is not None and not source_pvc.get("name"):
        raise errors.invalid(rt, name, [{"field": "spec.source.pvc.name", "reason": "FieldValueRequired",
                                         "message": "Source PVC name is required"}])


def _snapshot_like(store, rt, obj, old, user):
    name = obj["metadata"]["name"]
    ns = obj["metadata"].get("namespace", "")
    if old is not None and obj.get("spec") != old.get("spec"):
        raise errors.invalid(rt, name, [{"field": "spec", "message": "spec is immutable after creation"}])
    if old is not None:
        return
    spec = obj.get("spec") or {}
    ref_field = {"VirtualMachineSnapshot": "source", "VirtualMachineRestore": "target"}.get(rt.kind)
    if ref_field is None:
        return
    ref = spec.get(ref_field) or {}
    if not ref.get("apiGroup"):
        raise errors.invalid(rt, name, [{"field": f"spec.{ref_field}.apiGroup", "reason": "FieldValueInvalid",
                                         "message": "missing apiGroup"}])
    if ref.get("apiGroup") != "kubevirt.io" or ref.get("kind") != "VirtualMachine":
        raise errors.invalid(rt, name, [{"field": f"spec.{ref_field}", "reason": "FieldValueInvalid",
                                         "message": f"invalid kind/apiGroup: {ref.get('kind')}/{ref.get('apiGroup')}"}])
    if rt.kind == "VirtualMachineRestore":
        if not spec.get("virtualMachineSnapshotName"):
            raise errors.invalid(rt, name, [{"field": "spec.virtualMachineSnapshotName",
                                             "reason": "FieldValueRequired", "message": "Required value"}])
        for other in store.list(rt, ns):
            ospec = other.get("spec") or {}
            if field_value(ospec, "target.name") == ref.get("name") and not field_value(other, "status.complete"):
                raise errors.invalid(rt, name, [{"field": "spec.target", "reason": "FieldValueInvalid",
                                                 "message": f"VirtualMachineRestore \"{other['metadata']['name']}\" "
                                                            "in progress"}])


def _pvc(store, rt, obj, old, user):
    if old is not None:
        ospec, nspec = old.get("spec") or {}, obj.get("spec") or {}
        before = parse_quantity(field_value(ospec, "resources.requests.storage") or 0)
        after = parse_quantity(field_value(nspec, "resources.requests.storage") or 0)
        if after < before:
            raise errors.invalid(rt, obj["metadata"]["name"], [{
                "field": "spec.resources.requests.storage",
                "message": "Forbidden: field can not be less than previous value"}])
        if after > before:
            sc = store.get(BY_KIND["StorageClass"], "", nspec.get("storageClassName") or "")
            if not (sc or {}).get("allowVolumeExpansion"):
                raise errors.forbidden(rt, obj["metadata"]["name"], "only dynamically provisioned pvc can be "
                                       "resized and the storageclass that provisions the pvc must support resize")
        return
    check_quota(store, obj["metadata"].get("namespace", ""), {
        "persistentvolumeclaims": 1,
        "requests.storage": parse_quantity(field_value(obj, "spec.resources.requests.storage") or 0),
    }, rt, obj["metadata"]["name"])


def check_quota(store, namespace: str, request: dict, rt: ResourceType, name: str):
    """403 Forbidden, worded as upstream, when `request` would exceed a ResourceQuota."""
    quotas = store.list(BY_KIND["ResourceQuota"], namespace)
    if not quotas:
        return
    used = namespace_usage(store, namespace)
    for quota in quotas:
        hard = field_value(quota, "spec.hard") or {}
        over = []
        for resource, amount in request.items():
            limit = hard.get(resource)
            if limit is None or not amount:
                continue
            if used.get(resource, 0) + amount > parse_quantity(limit):
                over.append(resource)
        if over:
            def fmt(resource: str, value: int | Decimal) -> str:
                return format_bytes(value) if resource.endswith("storage") else str(int(value))

            requested = ",".join(f"{r}={fmt(r, request[r])}" for r in over)
            usednow = ",".join(f"{r}={fmt(r, used.get(r, 0))}" for r in over)
            limited = ",".join(f"{r}={hard[r]}" for r in over)
            raise errors.forbidden(rt, name, f"exceeded quota: {quota['metadata']['name']}, requested: "
                                             f"{requested}, used: {usednow}, limited: {limited}")


def gpu_requests(vmi_spec: dict) -> dict[str, int]:
    out: dict[str, int] = {}
    for gpu in field_value(vmi_spec, "domain.devices.gpus") or []:
        out[gpu["deviceName"]] = out.get(gpu["deviceName"], 0) + 1
    return out


def namespace_usage(store, namespace: str) -> dict:
    used: dict = {"persistentvolumeclaims": 0, "requests.storage": 0}
    for pvc in store.list(BY_KIND["PersistentVolumeClaim"], namespace):
        used["persistentvolumeclaims"] += 1
        used["requests.storage"] += parse_quantity(field_value(pvc, "spec.resources.requests.storage") or 0)
    for vmi in store.list(BY_KIND["VirtualMachineInstance"], namespace):
        if field_value(vmi, "status.phase") in ("Succeeded", "Failed"):
            continue
        for device, count in gpu_requests(vmi.get("spec") or {}).items():
            used[f"requests.{device}"] = used.get(f"requests.{device}", 0) + count
    return used


def _binding(store, rt, obj, old, user):
    """pkg/apis/rbac/validation/validation.go: a binding's roleRef names a role of an allowed kind
    and never changes."""
    name = obj["metadata"]["name"]
    ref = obj.get("roleRef") or {}
    kinds = ("Role", "ClusterRole") if rt.kind == "RoleBinding" else ("ClusterRole",)
    if ref.get("kind") not in kinds:
        supported = ", ".join(f'"{k}"' for k in kinds)
        raise errors.invalid(rt, name, [{"field": "roleRef.kind", "reason": "FieldValueNotSupported",
                                         "message": f'Unsupported value: "{ref.get("kind", "")}": supported values: '
                                                    f"{supported}"}])
    if not ref.get("name"):
        raise errors.invalid(rt, name, [{"field": "roleRef.name", "reason": "FieldValueRequired",
                                         "message": "Required value"}])
    if old is not None and (old.get("roleRef") or {}) != ref:
        raise errors.invalid(rt, name, [{"field": "roleRef", "message": "Invalid value: "
                                         f'rbac.RoleRef{{APIGroup:"{ref.get("apiGroup", "")}", Kind:"{ref["kind"]}", '
                                         f'Name:"{ref["name"]}"}}: cannot change roleRef'}])


def _binding_by(store, rt, obj, old, user):
    _binding(store, rt, obj, old, user)
    rbac.check_binding_write(store, user, rt.kind, obj)


def _role(store, rt, obj, old, user):
    rbac.check_role_write(store, user, rt.kind, obj)


_CHECKS = {
    "Role": _role,
    "ClusterRole": _role,
    "RoleBinding": _binding_by,
    "ClusterRoleBinding": _binding_by,
    "VirtualMachine": _vm,
    "DataVolume": _dv,
    "VirtualMachineSnapshot": _snapshot_like,
    "VirtualMachineSnapshotContent": _snapshot_like,
    "VirtualMachineRestore": _snapshot_like,
    "PersistentVolumeClaim": _pvc,
}
