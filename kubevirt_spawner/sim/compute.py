"""The KubeVirt side: VirtualMachine and VirtualMachineInstance controllers, virt-api's start/stop/
restart, and the guest agent calls."""

from __future__ import annotations

import asyncio
import base64
import binascii
import copy
import hashlib
import logging
import os
import shutil

from ..objects import (
    EXTRA_DISK_PREFIX,
    EXTRA_DISKS_ENV,
    SCRATCH_DISK_SERIAL,
    SCRATCH_MOUNT,
    WORKSPACE_DISK_SERIAL,
    WORKSPACE_MOUNT,
    field_value,
)
from ..quantity import parse_quantity
from . import errors
from .admission import admit, check_quota, gpu_requests
from .conditions import condition, drop_condition, get_condition, set_condition
from .guests import (
    Guest,
    boot_problem,
    clear_runtime,
    extra_disk_mounts,
    first_boot,
    guest_arguments,
    guest_environment,
    listed_mounts,
    shared_data_mounts,
    write_logins,
    write_nvidia_smi,
    write_processes,
)
from .isos import config_disk, firmware_uuid, nocloud_disk
from .launcher import POD, SCHEDULABLE_LABEL, Launchers, pod_ready
from .machines import QemuGuest, file_servers, machine_accelerator, new_machine, volume_image, workdir_for
from .qemu import Disk
from .resources import BY_KIND
from .scheduler import node_ready, schedule
from .timeutil import now_iso, seconds_since

log = logging.getLogger(__name__)

VM = BY_KIND["VirtualMachine"]
VMI = BY_KIND["VirtualMachineInstance"]
DV = BY_KIND["DataVolume"]
PVC = BY_KIND["PersistentVolumeClaim"]
NODE = BY_KIND["Node"]
PV = BY_KIND["PersistentVolume"]
VOLUME_ATTACHMENT = BY_KIND["VolumeAttachment"]
SECRET = BY_KIND["Secret"]

VM_FINALIZER = "kubevirt.io/virtualMachineControllerFinalize"
VMI_FINALIZER = "foregroundDeleteVirtualMachine"
FINAL = ("Succeeded", "Failed")
# A VMI without terminationGracePeriodSeconds gets KubeVirt's DefaultGracePeriodSeconds
# (staging/src/kubevirt.io/api/core/v1/types.go); nothing fills the field in.
DEFAULT_GRACE_SECONDS = 30
ATTACHED = ("Running",)
UNREACHABLE = "node.kubernetes.io/unreachable"
OUT_OF_SERVICE = "node.kubernetes.io/out-of-service"



def claim_names(spec: dict) -> list[tuple[str, str]]:
    """(volume name, claim name) of every PVC or DataVolume volume of a VMI spec."""
    out = []
    for v in spec.get("volumes") or []:
        if "persistentVolumeClaim" in v:
            out.append((v["name"], v["persistentVolumeClaim"].get("claimName")))
        elif "dataVolume" in v:
            out.append((v["name"], v["dataVolume"].get("name")))
    return out


def _pod_key(pod: dict) -> tuple[str, str]:
    return pod["metadata"]["namespace"], pod["metadata"]["name"]


def _as_launcher(vmi: dict) -> dict:
    """What the scheduler places: the launcher pod, which also needs a node where virt-handler
    runs and answers (pkg/virt-controller/services/nodeselectorrenderer.go)."""
    spec = dict(vmi.get("spec") or {})
    spec["nodeSelector"] = {**(spec.get("nodeSelector") or {}), SCHEDULABLE_LABEL: "true"}
    return {**vmi, "spec": spec}


def run_strategy(vm: dict) -> str:
    spec = vm.get("spec") or {}
    if spec.get("runStrategy"):
        return spec["runStrategy"]
    return "Always" if spec.get("running") else "Halted"


class Compute:
    def __init__(self, cluster):
        self.c = cluster
        self.store = cluster.store
        self.guests: dict[tuple[str, str], Guest | QemuGuest] = {}
        self.agents: dict[tuple[str, str], bool] = {}  # agent connectivity override per VMI
        self.users: dict[tuple[str, str], list[dict]] = {}
        self.gpu_utilization: dict[tuple[str, str], float] = {}
        self.processes: dict[tuple[str, str], list[dict]] = {}  # busy processes inside a guest
        # Per guest (by VM name), in seconds at speed 1: {"agentSeconds": float | None (never),
        # "shutdownSeconds": float}; the `agent` and `shutdown` timings otherwise.
        self.guest_behaviour: dict[tuple[str, str], dict] = {}
        self.violations: list[dict] = []
        self._stopping: set[tuple[str, str]] = set()
        self._booting: set[tuple[str, str]] = set()  # QEMU machines being set up (their disks made)
        self._shutdowns: set[asyncio.Task] = set()  # guests shutting down, each on its own time
        self.launchers = Launchers(cluster)
        self.store.listeners.append(self._forget_facts)

    def _forget_facts(self, kind: str, rt, obj: dict, old: dict | None):
        """The fault API's facts of a VMI go with it: a reboot ends login sessions and processes,
        and the next VMI of the VM starts with none and an idle GPU."""
        if rt is VMI and kind == "DELETED":
            key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
            self.users.pop(key, None)
            self.processes.pop(key, None)
            self.gpu_utilization.pop(key, None)

    # ================= VirtualMachine controller
    async def reconcile_vm(self, key):
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
            check_quota(self.store, ns, {f"requests.{d}": n for d, n in gpu_requests(spec).items()},
                        BY_KIND["VirtualMachineInstance"], name)
        except errors.ApiError as err:
            self.c.events.record(vm, "Warning", "FailedCreate", f"Error creating pod: {err.message}",
                                 "virtualmachine-controller")
            self.c.vm_queue.add((ns, name), self.c.t("schedule_retry"))
            return None
        labels = dict(tmeta.get("labels") or {})
        labels["kubevirt.io/created-by"] = vm["metadata"]["uid"]
        obj = {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
               "metadata": {"name": name, "namespace": ns, "labels": labels,
                            "annotations": dict(tmeta.get("annotations") or {}),
                            "ownerReferences": [self.c.owner_ref(vm)], "finalizers": [VMI_FINALIZER]},
               "spec": spec, "status": {"phase": "Pending", "phaseTransitionTimestamps": [
                   {"phase": "Pending", "phaseTransitionTimestamp": now_iso()}]}}
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

    # ================= virt-api: start / stop / restart
    def vm_action(self, ns: str, name: str, action: str, body: dict):
        vm = self.store.get(VM, ns, name)
        if vm is None:
            raise errors.not_found(VM, name)
        vmi = self.store.get(VMI, ns, name)
        phase = field_value(vmi, "status.phase") if vmi else None
        final = vmi is not None and phase in FINAL
        strategy = run_strategy(vm)
        if action == "start":
            if vmi is not None and not final and phase not in (None, "Unknown"):
                raise errors.subresource_conflict(VM, name, "VM is already running")
            if strategy in ("Always", "Once"):
                raise errors.subresource_conflict(VM, name, f"{strategy} does not support manual start requests")
            if strategy == "Halted":
                return self._set_running(vm, True)
            if strategy == "RerunOnFailure" and phase == "Failed":
                raise errors.subresource_conflict(VM, name, "RerunOnFailure does not support starting VM from "
                                                            "failed state")
            reqs = []
            if final:
                reqs.append({"action": "Stop", "uid": vmi["metadata"]["uid"]})
            reqs.append({"action": "Start"})
            return self._add_requests(vm, reqs)
        if action == "stop":
            grace = body.get("gracePeriod")
            has_vmi = vmi is not None and not final
            old_grace = field_value(vmi, "spec.terminationGracePeriodSeconds") if vmi else None
            if has_vmi and grace is not None:
                new_vmi = copy.deepcopy(vmi)
                new_vmi["spec"]["terminationGracePeriodSeconds"] = int(grace)
                self.store.update(VMI, new_vmi, check_rv=False)
                self._hurry(vmi, int(grace))
            if strategy == "Halted":
                if not has_vmi:
                    raise errors.subresource_conflict(VM, name, "VM is not running")
                if grace is None or (old_grace is not None and int(grace) >= old_grace):
                    raise errors.subresource_conflict(VM, name, "Halted only supports manual stop requests with "
                                                                "a shorter graceperiod")
                return self._add_requests(vm, [{"action": "Stop", "uid": vmi["metadata"]["uid"]}])
            if strategy == "Manual":
                if not has_vmi:
                    raise errors.subresource_conflict(VM, name, "VM is not running")
                return self._add_requests(vm, [{"action": "Stop", "uid": vmi["metadata"]["uid"]}])
            return self._set_running(vm, False)
        if action == "restart":
            # As RestartVMRequestHandler does: no check of the VMI's phase or deletion.
            grace = body.get("gracePeriodSeconds")
            if grace is not None and int(grace) > 0:
                raise errors.bad_request("For force restart, only gracePeriod=0 is supported for now")
            if grace is not None and int(grace) < 0:
                raise errors.bad_request("gracePeriod has to be greater or equal to 0")
            if strategy in ("Halted", "Once"):
                raise errors.subresource_conflict(VM, name, f"RunStategy {strategy} does not support manual "
                                                            "restart requests")
            if vmi is None:
                raise errors.subresource_conflict(VM, name, "VM is not running: Halted")
            if grace is not None:
                new_vmi = copy.deepcopy(vmi)
                new_vmi["spec"]["terminationGracePeriodSeconds"] = 1
                self.store.update(VMI, new_vmi, check_rv=False)
                self._hurry(vmi, 1)
            return self._add_requests(vm, [{"action": "Stop", "uid": vmi["metadata"]["uid"]}, {"action": "Start"}])
        raise errors.bad_request(f"unknown action {action}")

    def _set_running(self, vm: dict, running: bool):
        new = copy.deepcopy(vm)
        if new["spec"].get("running") is not None:
            new["spec"]["running"] = running
        else:
            new["spec"]["runStrategy"] = "Always" if running else "Halted"
        # virt-api patches the VM through the API server, so KubeVirt's VM webhook sees it (a restore's
        # lock: pkg/storage/admitters/vm-storage-status.go) and a refusal comes back as an internal
        # error (pkg/virt-api/rest/lifecycle.go)
        try:
            admit(self.store, VM, new, vm)
        except errors.ApiError as err:
            causes = (err.details or {}).get("causes") or [{"message": err.message}]
            raise errors.internal('admission webhook "virtualmachine-validator.kubevirt.io" denied the request: '
                                  + causes[0]["message"]) from None
        self.store.update(VM, new, check_rv=False)

    def _add_requests(self, vm: dict, reqs: list[dict]):
        """As getChangeRequestJson: added to none pending; a lone Stop replaces what is pending;
        anything else while requests are pending is refused."""
        new = copy.deepcopy(vm)
        status = new.setdefault("status", {})
        pending = list(status.get("stateChangeRequests") or [])
        if pending and not (len(reqs) == 1 and reqs[0]["action"] == "Stop"):
            raise errors.internal("unable to complete request: stop/start already underway")
        status["stateChangeRequests"] = reqs
        self.store.update(VM, new, subresource="status", check_rv=False)

    def _hurry(self, vmi: dict, grace: int):
        g = self.guests.get((vmi["metadata"]["namespace"], vmi["metadata"]["name"]))
        if g is not None:
            g.hurry(grace)

    # ================= VirtualMachineInstance controller
    async def reconcile_vmi(self, key):
        ns, name = key
        vmi = self.store.get(VMI, ns, name)
        if vmi is None:
            return
        phase = field_value(vmi, "status.phase") or "Pending"
        if vmi["metadata"].get("deletionTimestamp"):
            return await self._terminate(vmi)
        if phase in FINAL:
            self._release(vmi)
            return
        pod = self.launchers.of(vmi)
        if phase == "Pending":
            problem = self._volume_problem(vmi)
            if problem:
                reason, message = problem
                status = copy.deepcopy(vmi["status"])
                set_condition(status, condition("Synchronized", "False", reason, message))
                self._write_vmi_status(vmi, status)
                self.c.events.record(vmi, "Warning", reason, message, "virtualmachine-controller")
                self.c.vmi_queue.add(key, self.c.t("schedule_retry"))
                return
            if pod is None:
                pod = self.launchers.create(vmi)
                self.c.events.record(vmi, "Normal", "SuccessfulCreate",
                                     f"Created virtual machine pod {pod['metadata']['name']}",
                                     "virtualmachine-controller")
            status = copy.deepcopy(vmi["status"])
            drop_condition(status, "Synchronized")
            self._phase(status, "Scheduling")
            self._write_vmi_status(vmi, status)
            self.c.step_due(self.c.vmi_queue, key, "schedule")
            return
        if pod is None:
            return self._pod_gone(vmi)
        if phase == "Scheduling":
            if not self.c.step_due(self.c.vmi_queue, key, "schedule"):
                return
            nodes = self.store.list(NODE)
            placed = [v for v in self.store.list(VMI) if v["metadata"]["uid"] != vmi["metadata"]["uid"]]
            node, message = schedule(_as_launcher(vmi), nodes, placed)
            status = copy.deepcopy(vmi["status"])
            if node is None:
                # The scheduler's words go on the Pod; KubeVirt copies PodScheduled=False to the VMI.
                unschedulable = condition("PodScheduled", "False", "Unschedulable", message)
                set_condition(status, unschedulable)
                self.launchers.update_status(pod, lambda s: set_condition(
                    s, condition("PodScheduled", "False", "Unschedulable", message)))
                if self._write_vmi_status(vmi, status) or not self._reported_unschedulable(vmi, message):
                    self.c.events.record(pod, "Warning", "FailedScheduling", message, "default-scheduler")
                self.c.vmi_queue.add(key, self.c.t("schedule_retry"))
                return
            pod = self.launchers.bind(pod, node)
            self.c.events.record(pod, "Normal", "Scheduled", f"Successfully assigned {ns}/{pod['metadata']['name']} "
                                 f"to {node}", "default-scheduler")
            new = copy.deepcopy(vmi)
            new["metadata"].setdefault("labels", {})["kubevirt.io/nodeName"] = node
            vmi = self.store.update(VMI, new, check_rv=False)
            status = copy.deepcopy(vmi["status"])
            status["nodeName"] = node
            self._phase(status, "Scheduled")
            drop_condition(status, "PodScheduled")
            self._write_vmi_status(vmi, status)
            self.c.step_due(self.c.vmi_queue, key, "launch")
            return
        if phase == "Scheduled":
            if not self.c.step_due(self.c.vmi_queue, key, "launch"):
                return
            node = self.store.get(NODE, "", field_value(vmi, "status.nodeName") or "")
            if node is not None and not node_ready(node):
                self.c.vmi_queue.add(key, self.c.t("schedule_retry"))  # no kubelet to start the pod
                return
            blocked = self._attach_blocker(vmi, pod)
            if blocked:
                self.c.events.record(pod, "Warning", "FailedAttachVolume", blocked, "attachdetach-controller")
                self.c.vmi_queue.add(key, self.c.t("schedule_retry"))
                return
            await self._boot(vmi, pod)
            return
        if phase == "Running":
            self._sync_running(vmi, pod)

    def _pod_gone(self, vmi: dict):
        """The launcher pod is gone under a VMI that is not final: the VMI fails
        (pkg/virt-controller/watch/vmi/lifecycle.go); on a node that stopped answering, with the
        reason KubeVirt's node controller gives (pkg/virt-controller/watch/node/node.go)."""
        key = (vmi["metadata"]["namespace"], vmi["metadata"]["name"])
        guest = self.guests.get(key)
        if guest is not None:  # the machine is powered off with its pod
            self._stopping.add(key)
            self._powered_off(guest)
            guest.kill()
            self._stopping.discard(key)
        node_name = field_value(vmi, "status.nodeName")
        node = self.store.get(NODE, "", node_name) if node_name else None
        status = copy.deepcopy(vmi["status"])
        self._phase(status, "Failed")
        set_condition(status, condition("Ready", "False", "PodNotExists", "virt-launcher pod does not exist"))
        drop_condition(status, "AgentConnected")
        if node_name and (node is None or not node_ready(node)):
            status["reason"] = "NodeUnresponsive"
            self.c.events.record(vmi, "Normal", "NodeUnresponsive", f"virt-handler on node {node_name} is not "
                                 "responsive, marking VMI as failed", "virtualmachine-controller")
        self._write_vmi_status(vmi, status)
        self._release(vmi)

    def _phase(self, status: dict, phase: str):
        status["phase"] = phase
        status.setdefault("phaseTransitionTimestamps", []).append(
            {"phase": phase, "phaseTransitionTimestamp": now_iso()})

    def _reported_unschedulable(self, vmi, message) -> bool:
        return (get_condition(vmi, "PodScheduled") or {}).get("message") == message

    def _write_vmi_status(self, vmi: dict, status: dict) -> bool:
        if status == vmi.get("status"):
            return False
        new = copy.deepcopy(vmi)
        new["status"] = status
        self.store.update(VMI, new, subresource="status", check_rv=False)
        return True

    def _volume_problem(self, vmi: dict) -> tuple[str, str] | None:
        ns = vmi["metadata"]["namespace"]
        for _, claim in claim_names(vmi.get("spec") or {}):
            pvc = self.store.get(PVC, ns, claim)
            if pvc is None:
                return "FailedPvcNotFound", f"PVC {ns}/{claim} does not exist, waiting for it to appear"
            if field_value(pvc, "status.phase") != "Bound":
                return "PVCNotBound", f"PVC {ns}/{claim} is not bound yet"
        return None

    def attachments(self, ns: str, claim: str, exclude_uid: str | None = None) -> list[dict]:
        """VMIs that hold a claim attached now (a VMI on a lost node still holds it)."""
        out = []
        for v in self.store.list(VMI, ns):
            if v["metadata"]["uid"] == exclude_uid or field_value(v, "status.phase") not in ATTACHED:
                continue
            if claim in (c for _, c in claim_names(v.get("spec") or {})):
                out.append(v)
        return out

    def _attach_blocker(self, vmi: dict, pod: dict) -> str | None:
        ns = vmi["metadata"]["namespace"]
        node = field_value(vmi, "status.nodeName")
        for _, claim in claim_names(vmi.get("spec") or {}):
            pvc = self.store.get(PVC, ns, claim)
            if pvc is None or "ReadWriteOnce" not in (field_value(pvc, "spec.accessModes") or []):
                continue
            others = self.attachments(ns, claim, vmi["metadata"]["uid"])
            elsewhere = [o for o in others if field_value(o, "status.nodeName") != node]
            if elsewhere:
                holder = self.launchers.of(elsewhere[0])
                holder_name = holder["metadata"]["name"] if holder else f"virt-launcher-{elsewhere[0]['metadata']['name']}"
                return (f'Multi-Attach error for volume "{field_value(pvc, "spec.volumeName")}" Volume is already '
                        f"used by pod(s) {holder_name}")
        return None

    async def _boot(self, vmi: dict, pod: dict):
        ns, name = vmi["metadata"]["namespace"], vmi["metadata"]["name"]
        key = (ns, name)
        for vol, claim in claim_names(vmi.get("spec") or {}):
            modes = field_value(self.store.get(PVC, ns, claim), "spec.accessModes") or []
            if "ReadWriteMany" in modes or "ReadOnlyMany" in modes:
                continue  # (shared data: many machines at once is what it is for)
            for other in self.attachments(ns, claim, vmi["metadata"]["uid"]):
                self.violations.append({"time": now_iso(), "namespace": ns, "claim": claim, "volume": vol,
                                        "vmis": [other["metadata"]["name"], name],
                                        "nodes": [field_value(other, "status.nodeName"),
                                                  field_value(vmi, "status.nodeName")]})
        ip = self.c.allocate_ip("vmi", vmi["metadata"]["uid"])
        self.launchers.running(pod, ip)
        root = self.root_dir(vmi)
        status = copy.deepcopy(vmi["status"])
        self._phase(status, "Running")
        status["interfaces"] = [{"name": "default", "ipAddress": ip, "ipAddresses": [ip], "mac": _mac(ip),
                                 "infoSource": "domain, guest-agent", "interfaceName": "enp1s0",
                                 "podInterfaceName": "eth0", "queueCount": 1}]
        status["guestOSInfo"] = {}
        status["launcherContainerImageVersion"] = "quay.io/kubevirt/virt-launcher:v1.9.0"
        status["volumeStatus"] = [{"name": vol, "target": f"vd{chr(97 + i)}",
                                   **({"persistentVolumeClaimInfo": {"claimName": claim}} if claim else {})}
                                  for i, (vol, claim) in enumerate(claim_names(vmi.get("spec") or {}))]
        set_condition(status, condition("Ready", "True"))
        set_condition(status, condition("LiveMigratable", "False", "DisksNotLiveMigratable",
                                        "cannot migrate VMI: PVC is not shared, live migration requires that all "
                                        "PVCs must be shared (using ReadWriteMany access mode)"))
        self._write_vmi_status(vmi, status)
        self.sync_volume_attachments()  # (its disks are attached to its node)
        self.c.events.record(vmi, "Normal", "Started", "VirtualMachineInstance started.", "virt-handler")
        if root is not None and self.c.guest_mode == "qemu":
            if key not in self._booting:
                self._booting.add(key)
                await self._boot_machine(vmi, ip)
        elif root is not None:
            first_boot(root)
            self._mount_workspace(vmi, root)
            self._mount_scratch(vmi, root)
            await self._start_guest(vmi, ip, root)
        self.c.vmi_queue.add(key, self.c.t("agent"))

    def _disk_dir(self, vmi: dict, serial: str) -> tuple[dict | None, str | None]:
        """The claim and directory of the disk with this serial."""
        claims = dict(claim_names(vmi.get("spec") or {}))
        for disk in field_value(vmi, "spec.domain.devices.disks") or []:
            if disk.get("serial") == serial and claims.get(disk.get("name")):
                pvc = self.store.get(PVC, vmi["metadata"]["namespace"], claims[disk["name"]])
                if pvc is not None:
                    return pvc, self.c.volume_dir(pvc)
        return None, None

    def extra_disk_dirs(self, vmi: dict) -> dict[str, str]:
        """Serial -> directory of each extra disk (a claim whose disk serial is disk-NAME)."""
        out = {}
        for disk in field_value(vmi, "spec.domain.devices.disks") or []:
            serial = disk.get("serial") or ""
            if serial.startswith(EXTRA_DISK_PREFIX):
                _, directory = self._disk_dir(vmi, serial)
                if directory is not None:
                    os.makedirs(directory, exist_ok=True)
                    out[serial] = directory
        return out

    def _mount_workspace(self, vmi: dict, root: str):
        """What the golden image's fstab does: the disk with serial `workspace` on /home (a link
        here; the root disk's own /home, if any, is hidden while it is mounted)."""
        _, workspace = self._disk_dir(vmi, WORKSPACE_DISK_SERIAL)
        home = os.path.join(root, WORKSPACE_MOUNT.strip("/"))
        if workspace is None:
            if os.path.islink(home):
                os.unlink(home)  # the disk was removed from the machine
            return
        os.makedirs(workspace, exist_ok=True)
        if os.path.islink(home):
            if os.readlink(home) == workspace:
                return
            os.unlink(home)
        elif os.path.isdir(home):
            os.replace(home, home + ".under-mount")
        os.symlink(workspace, home)

    def _mount_scratch(self, vmi: dict, root: str):
        """What the golden image's fstab does with the emptyDisk of serial `scratch`: a blank
        filesystem on /scratch at every boot (virt-launcher makes the disk anew for each VMI,
        pkg/emptydisk). Here, a directory emptied at every start, linked at /scratch."""
        link = os.path.join(root, SCRATCH_MOUNT.strip("/"))
        if os.path.islink(link):
            os.unlink(link)
        if not self._has_empty_disk(vmi, SCRATCH_DISK_SERIAL):
            return
        scratch = self._scratch_dir(vmi)
        shutil.rmtree(scratch, ignore_errors=True)
        os.makedirs(scratch)
        os.chmod(scratch, 0o1777)  # (the launcher makes it everyone's, sticky, as /tmp)
        if os.path.isdir(link):
            os.replace(link, link + ".under-mount")  # (hidden by the mount, as the workspace's /home)
        os.symlink(scratch, link)

    def _scratch_dir(self, vmi: dict) -> str:
        return os.path.join(self.c.state_dir, "ephemeral", f"{vmi['metadata']['namespace']}_{vmi['metadata']['name']}")

    @staticmethod
    def _has_empty_disk(vmi: dict, serial: str) -> bool:
        empty = {v["name"] for v in field_value(vmi, "spec.volumes") or [] if "emptyDisk" in v}
        return any(d.get("serial") == serial and d.get("name") in empty
                   for d in field_value(vmi, "spec.domain.devices.disks") or [])

    def shared_dirs(self, vmi: dict) -> dict[str, tuple[str, bool]]:
        """Tag -> (directory, read-only) of each virtiofs filesystem of the VMI: the claim's files,
        read-only when its volume says readOnly (virt-controller's rendervolumes.go mounts the claim
        so in the launcher pod, and virtiofsd serves that mount)."""
        ns = vmi["metadata"]["namespace"]
        volumes = {v.get("name"): v for v in field_value(vmi, "spec.volumes") or []}
        out = {}
        for fs in field_value(vmi, "spec.domain.devices.filesystems") or []:
            volume = volumes.get(fs.get("name")) or {}
            claim = (volume.get("persistentVolumeClaim") or {}).get("claimName") or \
                (volume.get("dataVolume") or {}).get("name")
            pvc = self.store.get(PVC, ns, claim) if claim and "virtiofs" in fs else None
            if pvc is None:
                continue
            directory = self.c.volume_dir(pvc)
            os.makedirs(directory, exist_ok=True)
            out[fs["name"]] = (directory, bool((volume.get("persistentVolumeClaim") or {}).get("readOnly")))
        return out

    def root_dir(self, vmi: dict) -> str | None:
        """The directory of the first disk's volume: the machine's root filesystem."""
        ns = vmi["metadata"]["namespace"]
        disks = field_value(vmi, "spec.domain.devices.disks") or []
        claims = dict(claim_names(vmi.get("spec") or {}))
        for disk in disks:
            claim = claims.get(disk.get("name"))
            if claim:
                pvc = self.store.get(PVC, ns, claim)
                if pvc is not None:
                    return self.c.volume_dir(pvc)
        return None

    def guest_env(self, vmi: dict) -> dict:
        return guest_environment(self._secret_datas(vmi))

    def _secret_datas(self, vmi: dict) -> list[dict]:
        """The decoded data of every Secret the VMI mounts (as a disk or as cloud-init)."""
        ns = vmi["metadata"]["namespace"]
        datas = []
        for v in field_value(vmi, "spec.volumes") or []:
            names = []
            if "secret" in v:
                names.append(v["secret"].get("secretName"))
            for source in ("cloudInitNoCloud", "cloudInitConfigDrive"):
                if source in v:
                    for ref in ("secretRef", "networkDataSecretRef"):
                        if (v[source].get(ref) or {}).get("name"):
                            names.append(v[source][ref]["name"])
            for secret_name in names:
                secret = self.store.get(SECRET, ns, secret_name)
                if secret is not None:
                    datas.append(self.c.secret_data(secret))
        return datas

    def user_list(self, key: tuple[str, str]) -> list[dict]:
        """The guest agent's users as KubeVirt reports them (VirtualMachineInstanceGuestOSUser in
        staging/src/kubevirt.io/api/core/v1/types.go: userName, domain, loginTime); where they
        logged in from stays in the guest."""
        return [{k: u[k] for k in ("userName", "domain", "loginTime") if k in u} for u in self.users.get(key, [])]

    async def _start_guest(self, vmi: dict, ip: str, root: str):
        problem = boot_problem(root)
        if problem:  # the VMI runs (QEMU does) while the guest sits in its emergency shell
            log.info("%s/%s does not boot: %s", vmi["metadata"]["namespace"], vmi["metadata"]["name"], problem)
            return
        await self._launch(self._register_guest(vmi, ip, root))

    def _register_guest(self, vmi: dict, ip: str, root: str) -> Guest:
        """The guest is known before its process starts, so a second reconcile does not start it twice."""
        key = (vmi["metadata"]["namespace"], vmi["metadata"]["name"])
        old = self.guests.pop(key, None)
        if old is not None:
            old.kill()
        datas = self._secret_datas(vmi)
        guest = Guest(key, ip, root, guest_environment(datas), guest_arguments(datas),
                      os.path.join(self.c.state_dir, "guests", f"{key[0]}_{key[1]}.log"), self.c.guest_command)
        guest.uid = vmi["metadata"]["uid"]
        guest.mounts = extra_disk_mounts(guest.env, self.extra_disk_dirs(vmi), root) + shared_data_mounts(
            guest.env, self.shared_dirs(vmi), root)
        self.guests[key] = guest
        clear_runtime(root)  # a boot: nothing of the last one's memory is there
        self.write_guest_facts(key)
        return guest

    async def _boot_machine(self, vmi: dict, ip: str):
        """Set the machine up and start it; the VMI's key is in _booting meanwhile, so another
        reconcile does not start a second machine on the same disks."""
        key = (vmi["metadata"]["namespace"], vmi["metadata"]["name"])
        try:
            guest = await self._register_machine(vmi, ip)
        except Exception as exc:  # (ISO tools, disk images, the accelerator probe: any of them)
            log.error("%s/%s: its machine could not be set up: %s", *key, exc)
            self.c.events.record(vmi, "Warning", "SyncFailed", f"the domain could not be defined: {exc}",
                                 "virt-handler")
            return
        finally:
            self._booting.discard(key)
        current = self.store.get(VMI, *key)
        if current is None or current["metadata"]["uid"] != guest.uid or current["metadata"].get("deletionTimestamp"):
            self._powered_off(guest)  # stopped while its disks were set up
            return
        await self._launch(guest)

    async def _register_machine(self, vmi: dict, ip: str) -> QemuGuest:
        """A QEMU machine for the VMI, with its disks and configuration disks as virt-launcher
        attaches them; known before it starts, so a second reconcile does not start it twice."""
        key = (vmi["metadata"]["namespace"], vmi["metadata"]["name"])
        old = self.guests.pop(key, None)
        if old is not None:
            old.kill()
        workdir = workdir_for(key)
        try:
            disks = await asyncio.get_running_loop().run_in_executor(None, self._machine_disks, vmi, workdir)
        except (OSError, RuntimeError):
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        if self.guests.get(key) is not None:  # (a stop, or the node lost, meanwhile: nothing to boot)
            shutil.rmtree(workdir, ignore_errors=True)
            raise RuntimeError("a machine runs already")
        console = os.path.join(self.c.state_dir, "guests", f"{key[0]}_{key[1]}.console.log")
        accel = await asyncio.get_running_loop().run_in_executor(None, machine_accelerator, self.c.golden.probe_kernel)
        try:
            shares, servers = file_servers(self.shared_dirs(vmi), workdir)
            machine = new_machine(key[1], vmi.get("spec") or {}, disks, ip, workdir, console, accel, shares)
        except (OSError, RuntimeError):
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        guest = QemuGuest(key, machine, workdir, os.path.join(self.c.state_dir, "guests", f"{key[0]}_{key[1]}.log"),
                          on_agent_change=lambda: self.c.vmi_queue.add(key), file_servers=servers)
        guest.uid = vmi["metadata"]["uid"]
        self.guests[key] = guest
        return guest

    def _machine_disks(self, vmi: dict, workdir: str) -> list[Disk]:
        """The VMI's disks, each with its bootOrder: volumes as their disk images, Secret volumes
        and cloud-init as the ISO images virt-launcher builds from them."""
        ns, name = vmi["metadata"]["namespace"], vmi["metadata"]["name"]
        volumes = {v["name"]: v for v in field_value(vmi, "spec.volumes") or []}
        disks = sorted(field_value(vmi, "spec.domain.devices.disks") or [],
                       key=lambda d: d.get("bootOrder") or 1_000_000)  # (stable: the rest in spec order)
        out = []
        for disk in disks:
            volume = volumes.get(disk.get("name")) or {}
            claim = (volume.get("persistentVolumeClaim") or {}).get("claimName") or \
                (volume.get("dataVolume") or {}).get("name")
            if claim:
                pvc = self.store.get(PVC, ns, claim)
                size = int(parse_quantity(field_value(pvc, "status.capacity.storage") or "1Gi"))
                path = volume_image(self.c.volume_dir(pvc), size)
            elif "secret" in volume:
                secret = self.store.get(SECRET, ns, volume["secret"].get("secretName") or "")
                data = {k: v.encode() for k, v in (self.c.secret_data(secret) if secret else {}).items()}
                path = config_disk(data, os.path.join(workdir, f"{disk['name']}.iso"),
                                   volume["secret"].get("volumeLabel") or "cfgdata")
            elif "emptyDisk" in volume:  # (pkg/emptydisk: a blank image of its capacity, for this VMI only)
                path = os.path.join(workdir, f"{disk['name']}.img")
                with open(path, "wb") as image:
                    image.truncate(int(parse_quantity(volume["emptyDisk"].get("capacity") or "1Mi")))
            elif "cloudInitNoCloud" in volume:
                user_data, network_data = self._cloud_init(ns, volume["cloudInitNoCloud"])
                path = nocloud_disk(os.path.join(workdir, "cloudinit.iso"), firmware_uuid(name), name,
                                    user_data, network_data)
            else:
                continue  # (kinds this product does not attach)
            out.append(Disk(path, disk.get("serial"), boot_order=disk.get("bootOrder")))
        return out

    def _cloud_init(self, ns: str, source: dict) -> tuple[str, str]:
        """User and network data of a cloudInitNoCloud volume: inline, base64, or from a Secret's
        `userdata` / `networkdata` keys (kubevirt pkg/cloud-init/cloud-init.go)."""
        def from_secret(ref: str, keys: tuple[str, ...]) -> str | None:
            name = (source.get(ref) or {}).get("name")
            secret = self.store.get(SECRET, ns, name) if name else None
            data = self.c.secret_data(secret) if secret else {}
            return next((data[k] for k in keys if k in data), None)
        user = source.get("userData") or _b64(source.get("userDataBase64")) or \
            from_secret("secretRef", ("userdata", "userData")) or ""
        network = source.get("networkData") or _b64(source.get("networkDataBase64")) or \
            from_secret("networkDataSecretRef", ("networkdata", "networkData")) or ""
        return user, network

    def _powered_off(self, guest: Guest | QemuGuest):
        """The machine is off: its guest is let go, and what it kept in memory (/run, /dev, /proc)
        is gone; not when a newer boot of the VMI has taken its place meanwhile."""
        if isinstance(guest, QemuGuest):
            guest.discard()  # (its configuration disks hold the hub's token)
        if self.guests.get(guest.key) is guest:
            del self.guests[guest.key]
            if guest.root:
                clear_runtime(guest.root)

    def write_guest_facts(self, key: tuple[str, str]):
        """What the fault API says happens inside a running guest, where a Linux guest keeps it:
        login records and tty input times under its root, an nvidia-smi on its PATH."""
        guest = self.guests.get(key)
        vmi = self.store.get(VMI, *key)
        if not isinstance(guest, Guest) or vmi is None:
            return  # (a QEMU guest has its own)
        write_logins(guest.root, self.users.get(key, []))
        # the product name the driver reports for a device plugin's resource (nvidia.com/A100-PCIE-40GB)
        gpus = ["NVIDIA " + g.get("deviceName", "GPU").rsplit("/", 1)[-1]
                for g in field_value(vmi, "spec.domain.devices.gpus") or []]
        write_nvidia_smi(guest.bindir, gpus, self.gpu_utilization.get(key, 0.0))
        self._write_processes(key)

    def _write_processes(self, key: tuple[str, str]):
        guest, vmi = self.guests.get(key), self.store.get(VMI, *key)
        if not isinstance(guest, Guest) or vmi is None:
            return
        cpus = int(float(field_value(vmi, "spec.domain.cpu.cores") or 1)) or 1
        write_processes(guest.root, self.processes.get(key, []), self.users.get(key, []), guest.booted, cpus)

    async def refresh_guest_facts_forever(self):
        """A running process's CPU time grows: the guests with busy processes see it every second."""
        while True:
            await asyncio.sleep(1.0)
            for key in [k for k, procs in self.processes.items() if procs and k in self.guests]:
                try:
                    self._write_processes(key)  # (logins and GPUs change only through the fault API)
                except OSError as exc:  # the machine's disk went away meanwhile
                    log.debug("guest facts of %s/%s: %s", *key, exc)
                except Exception:  # one guest's trouble must not end the refreshes of all of them
                    log.exception("guest facts of %s/%s could not be refreshed", *key)

    async def _launch(self, guest: Guest | QemuGuest):
        key = guest.key
        try:
            if isinstance(guest, QemuGuest):
                await guest.start()
                if self.guests.get(key) is not guest:  # stopped while QEMU was starting
                    guest.kill()
                    return
            elif self.c.guest_mode == "null":
                await guest.start_null()
            else:
                await guest.start_process()
        except (OSError, ValueError, RuntimeError) as exc:  # (RuntimeError: a virtiofsd that did not listen)
            log.error("guest %s/%s could not start: %s", *key, exc)
            self._guest_exited(guest, 1)
            return
        asyncio.get_running_loop().create_task(self._watch_guest(guest))

    async def _watch_guest(self, guest: Guest | QemuGuest):
        code = await guest.wait()
        self._guest_exited(guest, code)

    def _guest_exited(self, guest: Guest | QemuGuest, code: int):
        ns, name = guest.key
        if isinstance(guest, QemuGuest):
            log.info("%s/%s: QEMU ended (%s)", ns, name, code)
        self._powered_off(guest)
        if guest.key in self._stopping or not self.c.started:
            return  # a requested shutdown (_terminate finishes the VMI) or the simulator stopping
        vmi = self.store.get(VMI, ns, name)
        if vmi is None or vmi["metadata"]["uid"] != guest.uid or field_value(vmi, "status.phase") != "Running":
            return
        status = copy.deepcopy(vmi["status"])
        self._phase(status, "Succeeded" if code == 0 else "Failed")
        set_condition(status, condition("Ready", "False", "PodTerminating" if code == 0 else "PodFailed"))
        self._write_vmi_status(vmi, status)
        self.c.events.record(vmi, "Normal" if code == 0 else "Warning", "Stopped" if code == 0 else "Failed",
                             "The VirtualMachineInstance was shut down." if code == 0 else
                             f"The VirtualMachineInstance crashed (guest exited with {code}).", "virt-handler")

    def agent_connected(self, vmi: dict) -> bool:
        key = (vmi["metadata"]["namespace"], vmi["metadata"]["name"])
        guest = self.guests.get(key)
        if isinstance(guest, QemuGuest):  # the real agent: connected while it answers
            return self.agents.get(key, True) and guest.alive and guest.agent_connected
        return self.agents.get(key, True) and field_value(vmi, "status.phase") == "Running" \
            and guest is not None and guest.alive

    def _sync_running(self, vmi: dict, pod: dict):
        ns, name = vmi["metadata"]["namespace"], vmi["metadata"]["name"]
        status = copy.deepcopy(vmi["status"])
        if not pod_ready(pod):
            # The node stopped answering: the pod is marked not ready and the VMI follows it
            # (syncReadyConditionFromPod); virt-handler is gone, so nothing else changes.
            ready = next((c for c in field_value(pod, "status.conditions") or [] if c["type"] == "Ready"), {})
            set_condition(status, condition("Ready", "False", ready.get("reason") or "PodNotReady",
                                            ready.get("message") or ""))
            self._write_vmi_status(vmi, status)
            return
        set_condition(status, condition("Ready", "True"))
        # (pkg/virt-controller/watch/vmi/lifecycle.go: the mark of an eviction, as a condition)
        if status.get("evacuationNodeName"):
            set_condition(status, condition("EvictionRequested", "True", "EvictionRequested",
                                            "VMI is marked for eviction"))
        else:
            drop_condition(status, "EvictionRequested")
        if (ns, name) not in self.guests and self.c.started and self.c.guest_mode == "qemu":
            # The simulator restarted under a running machine, which went with it: it boots again.
            if (ns, name) not in self._booting:
                self._booting.add((ns, name))
                ip = field_value(vmi, "status.interfaces")[0]["ipAddress"]
                asyncio.get_running_loop().create_task(self._boot_machine(vmi, ip))
        elif (ns, name) not in self.guests and self.c.started and self.root_dir(vmi) is not None \
                and boot_problem(self.root_dir(vmi)) is None:
            # The simulator restarted under a running machine: bring its guest back.
            guest = self._register_guest(vmi, field_value(vmi, "status.interfaces")[0]["ipAddress"],
                                         self.root_dir(vmi))
            asyncio.get_running_loop().create_task(self._launch(guest))
        if self.agent_connected(vmi) and self._agent_due(vmi):
            set_condition(status, condition("AgentConnected", "True"))
            status["guestOSInfo"] = self.guest_os_info(vmi)
            status["guestOSInfo"].pop("_", None)
        else:
            drop_condition(status, "AgentConnected")
        self._write_vmi_status(vmi, status)

    def _guest_seconds(self, key: tuple[str, str], what: str) -> float | None:
        """How long the guest takes to start its agent / to shut down, at this speed (None: never)."""
        behaviour = self.guest_behaviour.get(key) or {}
        if f"{what}Seconds" in behaviour:
            seconds = behaviour[f"{what}Seconds"]
            return None if seconds is None else float(seconds) / self.c.speed
        return self.c.t(what)

    def _agent_due(self, vmi: dict) -> bool:
        """The guest agent connects once the guest has booted far enough to start it: the `agent`
        delay, or the guest's own (which may be never)."""
        key = (vmi["metadata"]["namespace"], vmi["metadata"]["name"])
        if isinstance(self.guests.get(key), QemuGuest):
            return True  # (its agent is connected when it answers)
        stamps = field_value(vmi, "status.phaseTransitionTimestamps") or []
        running = [s for s in stamps if s["phase"] == "Running"]
        due = self._guest_seconds(key, "agent")
        if not running or due is None:
            return False
        elapsed = seconds_since(running[-1]["phaseTransitionTimestamp"])
        if elapsed + 1 >= due:  # timestamps have one-second resolution
            return True
        self.c.vmi_queue.add((vmi["metadata"]["namespace"], vmi["metadata"]["name"]), due - elapsed)
        return False

    async def _terminate(self, vmi: dict):
        ns, name = vmi["metadata"]["namespace"], vmi["metadata"]["name"]
        key = (ns, name)
        if key in self._stopping:
            return
        guest = self.guests.get(key)
        phase = field_value(vmi, "status.phase")
        pod = self.launchers.of(vmi)
        node = self.store.get(NODE, "", field_value(vmi, "status.nodeName") or "")
        if phase not in FINAL and node is not None and not node_ready(node):
            if pod is None:
                return self._pod_gone(vmi)
            return  # virt-handler cannot be reached: the VMI stays until its pod is gone or the node is back
        if guest is not None and phase == "Running":
            # The guest shuts down on its own time (each virt-handler drives its VMIs in parallel);
            # the VMI is finished when it is done. The queue goes on meanwhile.
            self._stopping.add(key)
            task = asyncio.get_running_loop().create_task(self._shut_down_then_finish(guest, vmi))
            self._shutdowns.add(task)
            task.add_done_callback(self._shutdowns.discard)
            return
        status = copy.deepcopy(vmi.get("status") or {})
        if status.get("phase") not in FINAL:
            self._phase(status, "Succeeded")
            set_condition(status, condition("Ready", "False", "PodTerminating"))
            self._write_vmi_status(vmi, status)
            self.c.events.record(vmi, "Normal", "Deleted", "Signaled Deletion", "virt-handler")
            vmi = self.store.get(VMI, ns, name)
        if pod is not None:
            self.launchers.remove(pod)
        self._release(vmi)
        new = copy.deepcopy(vmi)
        new["metadata"]["finalizers"] = [f for f in vmi["metadata"].get("finalizers") or [] if f != VMI_FINALIZER]
        self.store.update(VMI, new, check_rv=False)

    async def _shut_down_then_finish(self, guest: Guest | QemuGuest, vmi: dict):
        key = guest.key
        try:
            await self._shut_down(guest, vmi)
        finally:
            self._stopping.discard(key)
            self._powered_off(guest)
            self.c.vmi_queue.add(key)

    async def _shut_down(self, guest: Guest | QemuGuest, vmi: dict):
        """An ACPI shutdown as virt-handler drives it (pkg/virt-handler/vm.go): the guest takes its
        shutdown time; once the grace period is over (a stop may shorten it meanwhile) it is
        powered off."""
        began = asyncio.get_running_loop().time()
        shutdown = self._guest_seconds(guest.key, "shutdown") or 0.0
        if isinstance(guest, QemuGuest):  # the guest really shuts down: until QEMU ends, at most the grace period
            await guest.request_shutdown()
            shutdown = float("inf")

        def grace() -> float:
            value = guest.grace_override
            if value is None:
                value = vmi["metadata"].get("deletionGracePeriodSeconds")
            if value is None:
                value = field_value(vmi, "spec.terminationGracePeriodSeconds")
            return float(DEFAULT_GRACE_SECONDS if value is None else value)

        ended = asyncio.ensure_future(guest.exited()) if isinstance(guest, QemuGuest) else None
        try:
            while ended is None or not ended.done():
                remaining = began + min(shutdown, grace()) - asyncio.get_running_loop().time()
                if remaining <= 0:
                    break
                guest.hurried.clear()
                hurried = asyncio.ensure_future(guest.hurried.wait())
                done, _ = await asyncio.wait({hurried, *([ended] if ended else [])}, timeout=remaining,
                                             return_when=asyncio.FIRST_COMPLETED)
                hurried.cancel()
                if not done:
                    break
        finally:
            if ended is not None:
                ended.cancel()
        left = began + grace() - asyncio.get_running_loop().time()
        await guest.stop(max(left, 0.0))

    def sync_volume_attachments(self):
        """What the attach/detach controller and ceph-csi's external-attacher keep: one
        VolumeAttachment per CSI volume and node while a machine there holds it (a lost node's
        until its pod is gone), named as kubernetes pkg/volume/csi/csi_attacher.go names it
        (csi-<sha256(volume handle, driver, node)>), status.attached once attached."""
        desired: dict[str, dict] = {}
        for vmi in self.store.list(VMI):
            node = field_value(vmi, "status.nodeName")
            if not node or field_value(vmi, "status.phase") not in ATTACHED:
                continue
            for _, claim in claim_names(vmi.get("spec") or {}):
                pvc = self.store.get(PVC, vmi["metadata"]["namespace"], claim or "")
                pv = self.store.get(PV, "", field_value(pvc, "spec.volumeName") or "") if pvc else None
                csi = field_value(pv, "spec.csi") if pv else None
                if not csi:
                    continue
                digest = hashlib.sha256(f"{csi['volumeHandle']}{csi['driver']}{node}".encode()).hexdigest()
                desired[f"csi-{digest}"] = {"attacher": csi["driver"], "nodeName": node,
                                            "source": {"persistentVolumeName": pv["metadata"]["name"]}}
        current = {va["metadata"]["name"] for va in self.store.list(VOLUME_ATTACHMENT)}
        for name in sorted(set(desired) - current):
            self.store.create(VOLUME_ATTACHMENT, {"apiVersion": "storage.k8s.io/v1", "kind": "VolumeAttachment",
                                                  "metadata": {"name": name}, "spec": desired[name],
                                                  "status": {"attached": True}})
        for name in sorted(current - set(desired)):
            self.store.delete(VOLUME_ATTACHMENT, "", name)

    def _release(self, vmi: dict):
        self.sync_volume_attachments()  # (its disks are detached)
        self.c.release_ip("vmi", vmi["metadata"]["uid"])
        # Capacity and attachments are derived from VMI phases, so waiting VMIs may fit now.
        for other in self.store.list(VMI):
            if field_value(other, "status.phase") in ("Scheduling", "Scheduled", "Pending"):
                self.c.vmi_queue.add((other["metadata"]["namespace"], other["metadata"]["name"]))

    # ================= nodes lost, fenced, recovered
    # The fault API does what happens to a node (it stops answering, comes back) and what an admin
    # does (taints it out-of-service once it is confirmed off); reconcile_node and reconcile_pod
    # are what the node lifecycle controller, taint eviction, podgc, the kubelet and KubeVirt's node
    # controller do about it.
    def node_lost(self, node_name: str):
        self._set_node_ready(node_name, "Unknown", "NodeStatusUnknown", "Kubelet stopped posting node status.")

    def node_recovered(self, node_name: str):
        self._set_node_ready(node_name, "True", "KubeletReady", "kubelet is posting ready status")

    def node_fenced(self, node_name: str):
        """An admin confirmed the node is off: Kubernetes' non-graceful node shutdown taint."""
        node = self._must_node(node_name)
        taints = [t for t in field_value(node, "spec.taints") or [] if t.get("key") != OUT_OF_SERVICE]
        taints.append({"key": OUT_OF_SERVICE, "value": "nodeshutdown", "effect": "NoExecute", "timeAdded": now_iso()})
        new = copy.deepcopy(node)
        new["spec"]["taints"] = taints
        self.store.update(NODE, new, check_rv=False)

    def _must_node(self, node_name: str) -> dict:
        node = self.store.get(NODE, "", node_name)
        if node is None:
            raise errors.not_found(NODE, node_name)
        return node

    def _set_node_ready(self, node_name: str, ready: str, reason: str, message: str):
        node = self._must_node(node_name)
        new = copy.deepcopy(node)
        set_condition(new.setdefault("status", {}), {**condition("Ready", ready, reason, message),
                                                     "lastHeartbeatTime": now_iso()})
        for c in new["status"]["conditions"]:
            c.pop("lastProbeTime", None)
        # pkg/controller/nodelifecycle: Ready=Unknown brings the unreachable taints. A node that is
        # back loses them, and the out-of-service taint an admin set while it was off.
        lifted = (UNREACHABLE, OUT_OF_SERVICE) if ready == "True" else (UNREACHABLE,)
        taints = [t for t in field_value(new, "spec.taints") or [] if t.get("key") not in lifted]
        if ready != "True":
            taints += [{"key": UNREACHABLE, "effect": effect, "timeAdded": now_iso()}
                       for effect in ("NoSchedule", "NoExecute")]
        new.setdefault("spec", {})["taints"] = taints
        self.store.update(NODE, new, subresource="status", check_rv=False)
        self.store.update(NODE, new, check_rv=False)

    def reconcile_node(self, key):
        node = self.store.get(NODE, "", key[1])
        if node is None:
            return
        name = node["metadata"]["name"]
        pods = self.launchers.on_node(name)
        labels = node["metadata"].get("labels") or {}
        if node_ready(node):
            for clock in ("eviction", "heartbeat_timeout"):
                self.c.forget_step(self.c.node_queue, key, clock)
            if labels.get(SCHEDULABLE_LABEL) == "false":  # virt-handler's heartbeat is back
                self._label_node(node, "true")
            for pod in pods:
                if pod["metadata"].get("deletionTimestamp"):
                    self.c.pod_queue.add(_pod_key(pod))  # its kubelet finishes the eviction now
                else:
                    self.launchers.set_ready(pod, True)
            return
        # Not ready: pods are marked not ready at once (MarkPodsNotReady) ...
        for pod in pods:
            if pod_ready(pod):
                self.launchers.set_ready(pod, False)
                self.c.events.record(pod, "Warning", "NodeNotReady", "Node is not ready", "node-controller")
        taints = {t.get("key") for t in field_value(node, "spec.taints") or []}
        if OUT_OF_SERVICE in taints:
            # ... the out-of-service taint: taint eviction marks the pods, podgc force-deletes them
            # (pkg/controller/podgc/gc_controller.go, gcTerminating) ...
            for pod in pods:
                self.launchers.update_status(pod, lambda st: st.update({"phase": "Failed"}))
                self.launchers.remove(pod)
        elif pods and self.c.step_due(self.c.node_queue, key, "eviction"):
            # ... after the default tolerationSeconds, taint eviction deletes them; they stay
            # Terminating, as no kubelet confirms (pkg/controller/tainteviction/taint_eviction.go).
            for pod in pods:
                if not pod["metadata"].get("deletionTimestamp"):
                    self.c.events.record(pod, "Normal", "TaintManagerEviction",
                                         f"Marking for deletion Pod {pod['metadata']['namespace']}/"
                                         f"{pod['metadata']['name']}", "taint-eviction-controller")
                    self.store.delete(POD, pod["metadata"]["namespace"], pod["metadata"]["name"])
        # ... and once virt-handler missed its heartbeat for long enough, KubeVirt marks the node.
        if labels.get(SCHEDULABLE_LABEL) == "true" and self.c.step_due(self.c.node_queue, key, "heartbeat_timeout"):
            self.c.events.record(node, "Normal", "NodeUnresponsive",
                                 "virt-handler is not responsive, marking node as unresponsive", "virt-controller")
            self._label_node(node, "false")

    def _label_node(self, node: dict, schedulable: str):
        new = copy.deepcopy(node)
        new["metadata"].setdefault("labels", {})[SCHEDULABLE_LABEL] = schedulable
        self.store.update(NODE, new, check_rv=False)

    async def reconcile_pod(self, key):
        """The kubelet, for launcher pods being deleted on a node that answers: the container is
        stopped (virt-launcher shuts the guest down) and the pod goes."""
        pod = self.store.get(POD, *key)
        if pod is None or not pod["metadata"].get("deletionTimestamp"):
            return
        node = self.store.get(NODE, "", field_value(pod, "spec.nodeName") or "")
        if node is None or not node_ready(node):
            return
        owner = next((r for r in pod["metadata"].get("ownerReferences") or [] if r.get("kind") == "VirtualMachineInstance"),
                     None)
        vm_key = (key[0], owner["name"]) if owner else None
        guest = self.guests.get(vm_key) if vm_key else None
        if guest is not None and guest.uid == (owner or {}).get("uid"):
            self._stopping.add(guest.key)
            try:
                grace = pod["metadata"].get("deletionGracePeriodSeconds")
                await guest.stop(float(DEFAULT_GRACE_SECONDS if grace is None else grace))
            finally:
                self._stopping.discard(guest.key)
                self.guests.pop(guest.key, None)
        self.launchers.remove(pod)

    # ================= the guest agent
    def agent_call(self, ns: str, name: str, call: str) -> dict:
        vmi = self.store.get(VMI, ns, name)
        if vmi is None:
            raise errors.not_found(VMI, name)
        if field_value(vmi, "status.phase") != "Running":
            raise errors.agent_unavailable("VMI is not running")
        if not self.agent_connected(vmi):
            raise errors.agent_unavailable("VMI does not have guest agent connected")
        guest = self.guests.get((ns, name))
        if isinstance(guest, QemuGuest):
            return qemu_agent_answer(guest.agent_info, call, name)
        if call == "guestosinfo":
            info = self.guest_os_info(vmi)
            return {"guestAgentVersion": "8.2.2", "hostname": name, "os": info, "timezone": "UTC, 0",
                    "userList": self.user_list((ns, name)),
                    "fsInfo": {"disks": self.filesystems(vmi)},
                    "supportedCommands": [{"name": c, "enabled": True} for c in
                                          ("guest-info", "guest-get-osinfo", "guest-get-users",
                                           "guest-get-fsinfo", "guest-fsfreeze-freeze", "guest-shutdown")]}
        if call == "userlist":
            return {"metadata": {}, "items": self.user_list((ns, name))}
        if call == "filesystemlist":
            return {"metadata": {}, "items": self.filesystems(vmi)}
        raise errors.bad_request(f"unknown guest agent call {call}")

    def guest_os_info(self, vmi: dict) -> dict:
        guest = self.guests.get((vmi["metadata"]["namespace"], vmi["metadata"]["name"]))
        if isinstance(guest, QemuGuest):
            return qemu_os_info(guest.agent_info.get("osinfo") or {})
        root = self.root_dir(vmi)
        release = {}
        if root:
            try:
                with open(os.path.join(root, "etc", "os-release")) as f:
                    for line in f:
                        if "=" in line:
                            k, v = line.rstrip("\n").split("=", 1)
                            release[k] = v.strip('"')
            except OSError:
                pass
        return {"name": release.get("NAME", "Linux"), "prettyName": release.get("PRETTY_NAME", "Linux"),
                "version": release.get("VERSION", ""), "versionId": release.get("VERSION_ID", ""),
                "id": release.get("ID", "linux"), "kernelRelease": "6.8.0-45-generic",
                "kernelVersion": "#45-Ubuntu SMP PREEMPT_DYNAMIC", "machine": "x86_64"}

    def filesystems(self, vmi: dict) -> list[dict]:
        root = self.root_dir(vmi)
        if root is None:
            return []
        ns = vmi["metadata"]["namespace"]
        claims = dict(claim_names(vmi.get("spec") or {}))
        pvc = self.store.get(PVC, ns, claims.get((field_value(vmi, "spec.domain.devices.disks") or [{}])[0]
                                                 .get("name"), ""))
        total = int(parse_quantity(field_value(pvc, "status.capacity.storage") or "0")) if pvc else 0
        used = directory_size(root)  # (os.walk does not follow the workspace's link)
        out = [{"diskName": "vda1", "mountPoint": "/", "fileSystemType": "ext4", "usedBytes": used,
                "totalBytes": max(total, used), "disk": [{"busType": "virtio", "serial": "rootdisk"}]}]
        workspace_pvc, workspace = self._disk_dir(vmi, WORKSPACE_DISK_SERIAL)
        if workspace is not None:
            size = int(parse_quantity(field_value(workspace_pvc, "status.capacity.storage") or "0"))
            used = directory_size(workspace)
            out.append({"diskName": "vdb", "mountPoint": WORKSPACE_MOUNT, "fileSystemType": "ext4",
                        "usedBytes": used, "totalBytes": max(size, used),
                        "disk": [{"busType": "virtio", "serial": WORKSPACE_DISK_SERIAL}]})
        paths = {entry.get("serial"): path for entry, path in listed_mounts(self.guest_env(vmi), EXTRA_DISKS_ENV)}
        for n, (serial, directory) in enumerate(sorted(self.extra_disk_dirs(vmi).items())):
            if serial not in paths:
                continue  # (the launcher mounts only what the hub's list names)
            pvc, _ = self._disk_dir(vmi, serial)
            size = int(parse_quantity(field_value(pvc, "status.capacity.storage") or "0"))
            used = directory_size(directory)
            out.append({"diskName": f"vd{chr(ord('d') + n)}", "mountPoint": paths[serial], "fileSystemType": "ext4",
                        "usedBytes": used, "totalBytes": max(size, used),
                        "disk": [{"busType": "virtio", "serial": serial}]})
        scratch = self._scratch_dir(vmi)
        if self._has_empty_disk(vmi, SCRATCH_DISK_SERIAL) and os.path.isdir(scratch):
            capacity = next((v["emptyDisk"].get("capacity") for v in field_value(vmi, "spec.volumes") or []
                             if "emptyDisk" in v and v.get("name") == "scratch"), None) or "0"
            used = directory_size(scratch)
            out.append({"diskName": "vdc", "mountPoint": SCRATCH_MOUNT, "fileSystemType": "ext4", "usedBytes": used,
                        "totalBytes": max(int(parse_quantity(capacity)), used),
                        "disk": [{"busType": "virtio", "serial": SCRATCH_DISK_SERIAL}]})
        return out


def qemu_os_info(osinfo: dict) -> dict:
    """guest-get-osinfo's answer as KubeVirt words it (VirtualMachineInstanceGuestOSInfo)."""
    names = {"name": "name", "prettyName": "pretty-name", "version": "version", "versionId": "version-id",
             "id": "id", "kernelRelease": "kernel-release", "kernelVersion": "kernel-version", "machine": "machine"}
    return {ours: osinfo[theirs] for ours, theirs in names.items() if theirs in osinfo}


def qemu_agent_answer(info: dict, call: str, hostname: str) -> dict:
    """A guest-agent subresource from the real agent's latest answers, in KubeVirt's types
    (staging/src/kubevirt.io/api/core/v1/types.go: VirtualMachineInstanceGuestAgentInfo,
    VirtualMachineInstanceGuestOSUserList, VirtualMachineInstanceFileSystemList), as virt-handler's
    agent poller converts them (pkg/virt-launcher/virtwrap/agent-poller)."""
    users = [{"userName": u.get("user", ""), "loginTime": u.get("login-time", 0),
              **({"domain": u["domain"]} if u.get("domain") else {})} for u in info.get("users") or []]
    filesystems = [{"diskName": f.get("name", ""), "mountPoint": f.get("mountpoint", ""),
                    "fileSystemType": f.get("type", ""), "usedBytes": f.get("used-bytes", 0),
                    "totalBytes": f.get("total-bytes", 0),
                    "disk": [{k: d[q] for k, q in (("busType", "bus-type"), ("serial", "serial")) if d.get(q)}
                             for d in f.get("disk") or []]}
                   for f in info.get("fsinfo") or []]
    if call == "userlist":
        return {"metadata": {}, "items": users}
    if call == "filesystemlist":
        return {"metadata": {}, "items": filesystems}
    if call != "guestosinfo":
        raise errors.bad_request(f"unknown guest agent call {call}")
    zone = info.get("timezone") or {}
    return {"guestAgentVersion": (info.get("info") or {}).get("version", ""),
            "hostname": (info.get("hostname") or {}).get("host-name", hostname),
            "os": qemu_os_info(info.get("osinfo") or {}),
            "timezone": f"{zone.get('zone', 'UTC')}, {zone.get('offset', 0)}",
            "userList": users, "fsInfo": {"disks": filesystems},
            "supportedCommands": [{"name": c.get("name", ""), "enabled": bool(c.get("enabled"))}
                                  for c in (info.get("info") or {}).get("supported_commands") or []]}


def directory_size(path: str) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


def _b64(text: str | None) -> str | None:
    if not text:
        return None
    try:
        return base64.b64decode(text).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None


def _mac(ip: str) -> str:
    parts = [int(p) for p in ip.split(".")]
    return "02:00:%02x:%02x:%02x:%02x" % tuple(parts)
