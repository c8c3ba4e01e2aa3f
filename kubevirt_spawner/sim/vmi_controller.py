"""KubeVirt's VirtualMachineInstance controller (pkg/virt-controller/watch/vmi): a VMI's launcher
pod is created, scheduled and bound, its volumes checked and attached, and its status follows
the pod and the guest (Ready, AgentConnected, EvictionRequested) until it is finished; its machine
is virt-handler's (handler.py)."""

from __future__ import annotations

import copy

from ..objects import field_value
from .agent import GuestAgent
from .attachdetach import attachments, sync_volume_attachments
from .conditions import condition, drop_condition, get_condition, set_condition
from .handler import Handler
from .instances import FINAL, NODE, PVC, VMI, VMI_FINALIZER, claim_names, set_phase, write_vmi_status
from .launcher import SCHEDULABLE_LABEL, Launchers, pod_ready
from .scheduler import node_ready, schedule


def _as_launcher(vmi: dict) -> dict:
    """What the scheduler places: the launcher pod, which also needs a node where virt-handler
    runs and answers (pkg/virt-controller/services/nodeselectorrenderer.go)."""
    spec = dict(vmi.get("spec") or {})
    spec["nodeSelector"] = {**(spec.get("nodeSelector") or {}), SCHEDULABLE_LABEL: "true"}
    return {**vmi, "spec": spec}


class VmiController:
    def __init__(self, cluster, launchers: Launchers, handler: Handler, agent: GuestAgent):
        self.c = cluster
        self.store = cluster.store
        self.launchers = launchers
        self.handler = handler
        self.agent = agent

    async def reconcile(self, key):
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
                write_vmi_status(self.store, vmi, status)
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
            set_phase(status, "Scheduling")
            write_vmi_status(self.store, vmi, status)
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
                if write_vmi_status(self.store, vmi, status) or not self._reported_unschedulable(vmi, message):
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
            set_phase(status, "Scheduled")
            drop_condition(status, "PodScheduled")
            write_vmi_status(self.store, vmi, status)
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
            await self.handler.boot(vmi, pod)
            return
        if phase == "Running":
            self._sync_running(vmi, pod)

    def _pod_gone(self, vmi: dict):
        """The launcher pod is gone under a VMI that is not final: the VMI fails
        (pkg/virt-controller/watch/vmi/lifecycle.go); on a node that stopped answering, with the
        reason KubeVirt's node controller gives (pkg/virt-controller/watch/node/node.go)."""
        self.handler.pull_plug((vmi["metadata"]["namespace"], vmi["metadata"]["name"]))
        node_name = field_value(vmi, "status.nodeName")
        node = self.store.get(NODE, "", node_name) if node_name else None
        status = copy.deepcopy(vmi["status"])
        set_phase(status, "Failed")
        set_condition(status, condition("Ready", "False", "PodNotExists", "virt-launcher pod does not exist"))
        drop_condition(status, "AgentConnected")
        if node_name and (node is None or not node_ready(node)):
            status["reason"] = "NodeUnresponsive"
            self.c.events.record(vmi, "Normal", "NodeUnresponsive", f"virt-handler on node {node_name} is not "
                                 "responsive, marking VMI as failed", "virtualmachine-controller")
        write_vmi_status(self.store, vmi, status)
        self._release(vmi)

    def _reported_unschedulable(self, vmi, message) -> bool:
        return (get_condition(vmi, "PodScheduled") or {}).get("message") == message

    def _volume_problem(self, vmi: dict) -> tuple[str, str] | None:
        ns = vmi["metadata"]["namespace"]
        for _, claim in claim_names(vmi.get("spec") or {}):
            pvc = self.store.get(PVC, ns, claim)
            if pvc is None:
                return "FailedPvcNotFound", f"PVC {ns}/{claim} does not exist, waiting for it to appear"
            if field_value(pvc, "status.phase") != "Bound":
                return "PVCNotBound", f"PVC {ns}/{claim} is not bound yet"
        return None

    def _attach_blocker(self, vmi: dict, pod: dict) -> str | None:
        ns = vmi["metadata"]["namespace"]
        node = field_value(vmi, "status.nodeName")
        for _, claim in claim_names(vmi.get("spec") or {}):
            pvc = self.store.get(PVC, ns, claim)
            if pvc is None or "ReadWriteOnce" not in (field_value(pvc, "spec.accessModes") or []):
                continue
            others = attachments(self.store, ns, claim, vmi["metadata"]["uid"])
            elsewhere = [o for o in others if field_value(o, "status.nodeName") != node]
            if elsewhere:
                holder = self.launchers.of(elsewhere[0])
                holder_name = holder["metadata"]["name"] if holder else f"virt-launcher-{elsewhere[0]['metadata']['name']}"
                return (f'Multi-Attach error for volume "{field_value(pvc, "spec.volumeName")}" Volume is already '
                        f"used by pod(s) {holder_name}")
        return None

    def _sync_running(self, vmi: dict, pod: dict):
        status = copy.deepcopy(vmi["status"])
        if not pod_ready(pod):
            # The node stopped answering: the pod is marked not ready and the VMI follows it
            # (syncReadyConditionFromPod); virt-handler is gone, so nothing else changes.
            ready: dict = next((c for c in field_value(pod, "status.conditions") or [] if c["type"] == "Ready"), {})
            set_condition(status, condition("Ready", "False", ready.get("reason") or "PodNotReady",
                                            ready.get("message") or ""))
            write_vmi_status(self.store, vmi, status)
            return
        set_condition(status, condition("Ready", "True"))
        # (pkg/virt-controller/watch/vmi/lifecycle.go: the mark of an eviction, as a condition)
        if status.get("evacuationNodeName"):
            set_condition(status, condition("EvictionRequested", "True", "EvictionRequested",
                                            "VMI is marked for eviction"))
        else:
            drop_condition(status, "EvictionRequested")
        self.handler.revive(vmi)
        if self.agent.connected(vmi) and self.agent.due(vmi):
            set_condition(status, condition("AgentConnected", "True"))
            status["guestOSInfo"] = self.agent.os_info(vmi)
            status["guestOSInfo"].pop("_", None)
        else:
            drop_condition(status, "AgentConnected")
        write_vmi_status(self.store, vmi, status)

    async def _terminate(self, vmi: dict):
        ns, name = vmi["metadata"]["namespace"], vmi["metadata"]["name"]
        key = (ns, name)
        if key in self.handler.stopping:
            return
        guest = self.handler.guests.get(key)
        phase = field_value(vmi, "status.phase")
        pod = self.launchers.of(vmi)
        node = self.store.get(NODE, "", field_value(vmi, "status.nodeName") or "")
        if phase not in FINAL and node is not None and not node_ready(node):
            if pod is None:
                return self._pod_gone(vmi)
            return  # virt-handler cannot be reached: the VMI stays until its pod is gone or the node is back
        if guest is not None and phase == "Running":
            # The guest shuts down on its own time; the VMI is finished when it is done (it is
            # requeued then). The queue goes on meanwhile.
            self.handler.begin_shutdown(guest, vmi)
            return
        status = copy.deepcopy(vmi.get("status") or {})
        if status.get("phase") not in FINAL:
            set_phase(status, "Succeeded")
            set_condition(status, condition("Ready", "False", "PodTerminating"))
            write_vmi_status(self.store, vmi, status)
            self.c.events.record(vmi, "Normal", "Deleted", "Signaled Deletion", "virt-handler")
            vmi = self.store.get(VMI, ns, name)
        if pod is not None:
            self.launchers.remove(pod)
        self._release(vmi)
        new = copy.deepcopy(vmi)
        new["metadata"]["finalizers"] = [f for f in vmi["metadata"].get("finalizers") or [] if f != VMI_FINALIZER]
        self.store.update(VMI, new, check_rv=False)

    def _release(self, vmi: dict):
        sync_volume_attachments(self.store)  # (its disks are detached)
        self.c.release_ip("vmi", vmi["metadata"]["uid"])
        # Capacity and attachments are derived from VMI phases, so waiting VMIs may fit now.
        for other in self.store.list(VMI):
            if field_value(other, "status.phase") in ("Scheduling", "Scheduled", "Pending"):
                self.c.vmi_queue.add((other["metadata"]["namespace"], other["metadata"]["name"]))
