"""Nodes lost, fenced, recovered. The fault API does what happens to a node (it stops answering,
comes back) and what an admin does (taints it out-of-service once it is confirmed off);
`reconcile` is what the node lifecycle controller, taint eviction, podgc and KubeVirt's node
controller (pkg/virt-controller/watch/node/node.go) do about it."""

from __future__ import annotations

import copy

from ..objects import field_value
from . import errors
from .conditions import condition, set_condition
from .instances import NODE
from .launcher import POD, SCHEDULABLE_LABEL, Launchers, pod_ready
from .scheduler import node_ready
from .timeutil import now_iso

UNREACHABLE = "node.kubernetes.io/unreachable"
OUT_OF_SERVICE = "node.kubernetes.io/out-of-service"


class NodeLifecycle:
    def __init__(self, cluster, launchers: Launchers):
        self.c = cluster
        self.store = cluster.store
        self.launchers = launchers

    def lost(self, node_name: str):
        self._set_ready(node_name, "Unknown", "NodeStatusUnknown", "Kubelet stopped posting node status.")

    def recovered(self, node_name: str):
        self._set_ready(node_name, "True", "KubeletReady", "kubelet is posting ready status")

    def fenced(self, node_name: str):
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

    def _set_ready(self, node_name: str, ready: str, reason: str, message: str):
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

    def reconcile(self, key):
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


def _pod_key(pod: dict) -> tuple[str, str]:
    return pod["metadata"]["namespace"], pod["metadata"]["name"]
