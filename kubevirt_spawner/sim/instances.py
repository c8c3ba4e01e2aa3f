"""What KubeVirt's pieces (the VM and VMI controllers, virt-api, virt-handler) share about
VirtualMachines and their instances: the kinds, the phases, the claims a VMI mounts, and how a
VMI's phase and status are written."""

from __future__ import annotations

import copy

from .resources import BY_KIND
from .store import Store
from .timeutil import now_iso

VM = BY_KIND["VirtualMachine"]
VMI = BY_KIND["VirtualMachineInstance"]
NODE = BY_KIND["Node"]
PVC = BY_KIND["PersistentVolumeClaim"]

VMI_FINALIZER = "foregroundDeleteVirtualMachine"
FINAL = ("Succeeded", "Failed")
# A VMI without terminationGracePeriodSeconds gets KubeVirt's DefaultGracePeriodSeconds
# (staging/src/kubevirt.io/api/core/v1/types.go); nothing fills the field in.
DEFAULT_GRACE_SECONDS = 30


def claim_names(spec: dict) -> list[tuple[str, str]]:
    """(volume name, claim name) of every PVC or DataVolume volume of a VMI spec."""
    out = []
    for v in spec.get("volumes") or []:
        if "persistentVolumeClaim" in v:
            out.append((v["name"], v["persistentVolumeClaim"].get("claimName")))
        elif "dataVolume" in v:
            out.append((v["name"], v["dataVolume"].get("name")))
    return out


def run_strategy(vm: dict) -> str:
    spec = vm.get("spec") or {}
    if spec.get("runStrategy"):
        return spec["runStrategy"]
    return "Always" if spec.get("running") else "Halted"


def set_phase(status: dict, phase: str):
    status["phase"] = phase
    status.setdefault("phaseTransitionTimestamps", []).append(
        {"phase": phase, "phaseTransitionTimestamp": now_iso()})


def write_vmi_status(store: Store, vmi: dict, status: dict) -> bool:
    """Write the VMI's status if it changed; whether it did."""
    if status == vmi.get("status"):
        return False
    new = copy.deepcopy(vmi)
    new["status"] = status
    store.update(VMI, new, subresource="status", check_rv=False)
    return True
