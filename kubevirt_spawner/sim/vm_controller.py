"""KubeVirt's VirtualMachine controller (pkg/virt-controller/watch/vm): a VM's run strategy and
start/stop requests become a VMI, or its deletion; its DataVolume templates become DataVolumes;
its status says what the VM looks like (printableStatus, Ready, PodScheduled)."""

from __future__ import annotations

import copy

from ..objects import field_value
from . import errors
from .admission import check_quota, gpu_requests
from .conditions import condition, drop_condition, get_condition, set_condition
from .instances import FINAL, VM, VMI, VMI_FINALIZER, claim_names, run_strategy
from .isos import firmware_uuid
from .mutation import PCI_SLOT_COUNT, PCI_TOPOLOGY_VERSION, mutate_vmi
from .resources import BY_KIND
from .timeutil import now_iso

DV = BY_KIND["DataVolume"]
VM_FINALIZER = "kubevirt.io/virtualMachineControllerFinalize"
LATEST_API_VERSION = "kubevirt.io/latest-observed-api-version"  # pkg/controller/controller.go
STORAGE_API_VERSION = "kubevirt.io/storage-observed-api-version"


class VmController:
    def __init__(self, cluster):
        self.c = cluster
        self.store = cluster.store

    async def reconcile(self, key):
        ns, name = key
        vm = self.store.get(VM, ns, name)
        vmi = self.store.get(VMI, ns, name)
        if vm is None:
            return
        meta = vm["metadata"]
        if meta.get("deletionTimestamp"):
            if vmi is not None:
                self._delete_vmi(vmi)
                return
            if VM_FINALIZER in (meta.get("finalizers") or []):
                new = copy.deepcopy(vm)
                new["metadata"]["finalizers"] = [f for f in meta["finalizers"] if f != VM_FINALIZER]
                self.store.update(VM, new, check_rv=False)
            return
        if VM_FINALIZER not in (meta.get("finalizers") or []):
            new = copy.deepcopy(vm)
            new["metadata"].setdefault("finalizers", []).append(VM_FINALIZER)
            vm = self.store.update(VM, new, check_rv=False)
        vm = self._write_back(vm, vmi)
        self._ensure_datavolume_templates(vm)
        strategy = run_strategy(vm)
        requests = list(field_value(vm, "status.stateChangeRequests") or [])
        status = copy.deepcopy(vm.get("status") or {})
        # Manual start/stop requests (and RerunOnFailure starts) come in as stateChangeRequests.
        if requests:
            req = requests[0]
            if req.get("action") == "Stop":
                if vmi is not None and (not req.get("uid") or req["uid"] == vmi["metadata"]["uid"]):
                    self._delete_vmi(vmi)
                    return
                requests.pop(0)
            elif req.get("action") == "Start":
                if vmi is not None and vmi["metadata"].get("deletionTimestamp"):
                    return self._write_vm_status(vm, status, vmi)  # wait for the old one to go
                if vmi is not None and field_value(vmi, "status.phase") in FINAL:
                    self._delete_vmi(vmi)
                    return
                if vmi is None:
                    vmi = self._create_vmi(vm)
                    if vmi is None:
                        return self._write_vm_status(vm, status, None)
                requests.pop(0)
            status["stateChangeRequests"] = requests
            if not requests:
                status.pop("stateChangeRequests", None)
        else:
            want = self._wants_vmi(strategy, vm, vmi)
            if want and vmi is not None and field_value(vmi, "status.phase") in FINAL:
                self._delete_vmi(vmi)  # Always/RerunOnFailure: replace a finished VMI
                return
            if want and vmi is None:
                vmi = self._create_vmi(vm)
            elif want is False and vmi is not None and not vmi["metadata"].get("deletionTimestamp"):
                if field_value(vmi, "status.phase") not in FINAL or strategy == "Halted":
                    self._delete_vmi(vmi)
                    vmi = self.store.get(VMI, ns, name)
            if strategy == "Once" and vmi is not None and field_value(vmi, "status.phase") in FINAL:
                new = copy.deepcopy(vm)
                new["spec"]["runStrategy"] = "Halted"
                vm = self.store.update(VM, new, check_rv=False)
        self._write_vm_status(vm, status, vmi)

    def _write_back(self, vm: dict, vmi: dict | None) -> dict:
        """What virt-controller writes into a VM's metadata and spec by itself, every sync:
        the API version it observed (vm.go execute, controller.SetLatestApiVersionAnnotation),
        a firmware UUID derived from the name where the template has none (firmware.go Sync,
        CalculateLegacyUUID: a template replaced without it gets that one, not the one the
        mutator gave at create; no serial), and the VMI's PCI topology annotations where the
        template has no version (vm.go syncPCITopologyAnnotationsToVM)."""
        new = copy.deepcopy(vm)
        annotations = new["metadata"].setdefault("annotations", {})
        annotations[LATEST_API_VERSION] = annotations[STORAGE_API_VERSION] = "v1"
        template = new["spec"].setdefault("template", {})
        firmware = template.setdefault("spec", {}).setdefault("domain", {}).setdefault("firmware", {})
        if not firmware.get("uuid"):
            firmware["uuid"] = firmware_uuid(vm["metadata"]["name"])
        vmi_annotations = (vmi or {}).get("metadata", {}).get("annotations") or {}
        version = vmi_annotations.get(PCI_TOPOLOGY_VERSION)
        tannotations = template.setdefault("metadata", {}).setdefault("annotations", {})
        if version and not tannotations.get(PCI_TOPOLOGY_VERSION):
            tannotations[PCI_TOPOLOGY_VERSION] = version
            slots = vmi_annotations.get(PCI_SLOT_COUNT)
            if slots:
                tannotations[PCI_SLOT_COUNT] = slots
        if not tannotations:
            template["metadata"].pop("annotations")
        if not template["metadata"]:
            template.pop("metadata")
        if new == vm:
            return vm
        return self.store.update(VM, new, check_rv=False)

    def _wants_vmi(self, strategy: str, vm: dict, vmi: dict | None) -> bool | None:
        """True: must run; False: must not; None: leave as it is (Manual)."""
        phase = field_value(vmi, "status.phase") if vmi else None
        if strategy == "Always":
            return True
        if strategy == "Halted":
            return False
        if strategy == "RerunOnFailure":
            return phase != "Succeeded"
        if strategy == "Once":
            # After its one run the controller switches the VM to Halted (below).
            return True if vmi is None else None
        return None

    def _ensure_datavolume_templates(self, vm: dict):
        ns = vm["metadata"]["namespace"]
        for tpl in field_value(vm, "spec.dataVolumeTemplates") or []:
            name = tpl["metadata"]["name"]
            if self.store.get(DV, ns, name) is None:
                obj = {"apiVersion": "cdi.kubevirt.io/v1beta1", "kind": "DataVolume",
                       "metadata": {**copy.deepcopy(tpl.get("metadata") or {}), "namespace": ns,
                                    "ownerReferences": [self.c.owner_ref(vm)]},
                       "spec": copy.deepcopy(tpl.get("spec") or {})}
                self.c.defaults(DV, obj)
                self.store.create(DV, obj)

    def _volumes_ready(self, vm: dict) -> tuple[bool, str]:
        """Whether every DataVolume behind the VM's volumes is done; the VM status if not."""
        ns = vm["metadata"]["namespace"]
        spec = field_value(vm, "spec.template.spec") or {}
        for _, claim in claim_names(spec):
            dv = self.store.get(DV, ns, claim)
            if dv is not None:
                phase = field_value(dv, "status.phase")
                if phase == "Failed":
                    return False, "DataVolumeError"
                if phase != "Succeeded":
                    return False, "Provisioning"
        return True, ""

    def _create_vmi(self, vm: dict) -> dict | None:
        ready, _ = self._volumes_ready(vm)
        if not ready:
            return None
        ns, name = vm["metadata"]["namespace"], vm["metadata"]["name"]
        template = copy.deepcopy(field_value(vm, "spec.template") or {})
        tmeta = template.get("metadata") or {}
        spec = template.get("spec") or {}
        try:
            check_quota(self.store, ns, {f"requests.{d}": n for d, n in gpu_requests(spec).items()}, VMI, name)
        except errors.ApiError as err:
            self.c.events.record(vm, "Warning", "FailedCreate", f"Error creating pod: {err.message}",
                                 "virtualmachine-controller")
            self.c.vm_queue.add((ns, name), self.c.t("schedule_retry"))
            return None
        firmware = spec.setdefault("domain", {}).setdefault("firmware", {})
        if not firmware.get("uuid"):  # vm.go setupStableFirmwareUUID
            firmware["uuid"] = firmware_uuid(name)
        labels = dict(tmeta.get("labels") or {})
        labels["kubevirt.io/created-by"] = vm["metadata"]["uid"]
        obj = {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
               "metadata": {"name": name, "namespace": ns, "labels": labels,
                            "annotations": dict(tmeta.get("annotations") or {}),
                            "ownerReferences": [self.c.owner_ref(vm)], "finalizers": [VMI_FINALIZER]},
               "spec": spec, "status": {"phase": "Pending", "phaseTransitionTimestamps": [
                   {"phase": "Pending", "phaseTransitionTimestamp": now_iso()}]}}
        mutate_vmi(obj)  # (virt-controller creates it through the API server and its webhooks)
        vmi = self.store.create(VMI, obj)
        self.c.events.record(vm, "Normal", "SuccessfulCreate", f"Started the virtual machine by creating the new "
                             f"virtual machine instance {name}", "virtualmachine-controller")
        return vmi

    def _delete_vmi(self, vmi: dict):
        if not vmi["metadata"].get("deletionTimestamp"):
            self.store.delete(VMI, vmi["metadata"]["namespace"], vmi["metadata"]["name"])

    def _write_vm_status(self, vm: dict, status: dict, vmi: dict | None):
        ready_volumes, volume_state = self._volumes_ready(vm)
        phase = field_value(vmi, "status.phase") if vmi else None
        strategy = run_strategy(vm)
        status["created"] = vmi is not None and phase not in FINAL
        status["ready"] = bool(vmi and (get_condition(vmi, "Ready") or {}).get("status") == "True")
        status["runStrategy"] = strategy
        status["printableStatus"] = self._printable(vm, vmi, volume_state, strategy, status)
        status["desiredGeneration"] = vm["metadata"].get("generation", 1)
        status["observedGeneration"] = vm["metadata"].get("generation", 1)
        if not status["created"]:
            status.pop("created")
        if not status["ready"]:
            status.pop("ready")
        ready = condition("Ready", "True" if status.get("ready") else "False",
                          "" if status.get("ready") else ("VMINotExists" if vmi is None else "PodNotReady"),
                          "" if status.get("ready") else ("VMI does not exist" if vmi is None else ""))
        set_condition(status, ready)
        scheduled = get_condition(vmi, "PodScheduled") if vmi else None
        if scheduled and scheduled.get("status") == "False":
            set_condition(status, dict(scheduled))
        else:
            drop_condition(status, "PodScheduled")
        for c in status.get("conditions") or []:
            c.pop("lastProbeTime", None)
        if status != (vm.get("status") or {}):
            new = copy.deepcopy(vm)
            new["status"] = status
            self.store.update(VM, new, subresource="status", check_rv=False)

    def _printable(self, vm, vmi, volume_state, strategy, status) -> str:
        phase = field_value(vmi, "status.phase") if vmi else None
        if vm["metadata"].get("deletionTimestamp"):
            return "Terminating"
        if vmi is not None and phase not in FINAL and (vmi["metadata"].get("deletionTimestamp")
                                                       or strategy == "Halted"):
            return "Stopping"
        if phase == "Running":
            return "Running"
        if volume_state == "Provisioning" and (vmi is None or phase not in ("Running",)):
            if strategy != "Halted" or vmi is not None or status.get("stateChangeRequests"):
                return "Provisioning"
        if vmi is not None and phase not in FINAL:
            sched = get_condition(vmi, "PodScheduled")
            if sched and sched.get("status") == "False" and sched.get("reason") == "Unschedulable":
                return "ErrorUnschedulable"
            sync = get_condition(vmi, "Synchronized")
            if sync and sync.get("reason") == "FailedPvcNotFound":
                return "ErrorPvcNotFound"
            if sync and sync.get("reason") == "PVCNotBound":
                return "WaitingForVolumeBinding"
        if volume_state == "DataVolumeError":
            return "DataVolumeError"
        if vmi is not None and phase in ("Pending", "Scheduling", "Scheduled"):
            return "Starting"
        if vmi is None or phase in FINAL:
            return "Stopped"
        return "Unknown"
