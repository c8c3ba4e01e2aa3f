"""Placement of VMIs on nodes, with the kube-scheduler's rules and its FailedScheduling wording."""

from __future__ import annotations

from collections import Counter
from decimal import Decimal

from ..objects import field_value
from ..quantity import parse_quantity
from .admission import gpu_requests


def vmi_requests(vmi: dict) -> dict[str, Decimal]:
    """CPU, memory and devices a VMI's launcher pod asks for."""
    domain = field_value(vmi, "spec.domain") or {}
    requests = field_value(domain, "resources.requests") or {}
    cpu = requests.get("cpu")
    if cpu is None:
        topo = domain.get("cpu") or {}
        cpu = int(topo.get("cores", 1)) * int(topo.get("sockets", 1)) * int(topo.get("threads", 1))
    memory = requests.get("memory") or field_value(domain, "memory.guest") or "1Gi"
    out = {"cpu": parse_quantity(cpu), "memory": parse_quantity(memory)}
    for device, count in gpu_requests(vmi.get("spec") or {}).items():
        out[device] = Decimal(count)
    return out


def _tolerated(taint: dict, tolerations: list[dict]) -> bool:
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint.get("effect"):
            continue
        if t.get("operator") == "Exists":
            if not t.get("key") or t["key"] == taint.get("key"):
                return True
        elif t.get("key") == taint.get("key") and t.get("value", "") == taint.get("value", ""):
            return True
    return False


def _affinity_ok(labels: dict, affinity: dict | None) -> bool:
    terms = field_value(affinity or {}, "nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms")
    if not terms:
        return True
    for term in terms:
        ok = True
        for e in term.get("matchExpressions") or []:
            key, op, values = e["key"], e["operator"], e.get("values") or []
            present = key in labels
            if (op == "In" and labels.get(key) not in values) or (op == "NotIn" and present and labels[key] in values) \
                    or (op == "Exists" and not present) or (op == "DoesNotExist" and present):
                ok = False
            if op in ("Gt", "Lt") and present:
                try:
                    v, ref = int(labels[key]), int(values[0])
                    ok = ok and ((v > ref) if op == "Gt" else (v < ref))
                except (ValueError, IndexError):
                    ok = False
        if ok:
            return True
    return False


def node_ready(node: dict) -> bool:
    for c in field_value(node, "status.conditions") or []:
        if c.get("type") == "Ready":
            return c.get("status") == "True"
    return False


def allocated(vmis: list[dict]) -> dict[str, Counter]:
    """What the VMIs placed on each node use now."""
    used: dict[str, Counter] = {}
    for vmi in vmis:
        node = field_value(vmi, "status.nodeName")
        if node and field_value(vmi, "status.phase") not in ("Succeeded", "Failed"):
            used.setdefault(node, Counter()).update(vmi_requests(vmi))
    return used


def schedule(vmi: dict, nodes: list[dict], placed_vmis: list[dict]) -> tuple[str | None, str]:
    """The node for `vmi`, or None and the scheduler's message (`0/4 nodes are available: ...`)."""
    spec = vmi.get("spec") or {}
    selector = spec.get("nodeSelector") or {}
    tolerations = list(spec.get("tolerations") or [])
    need = vmi_requests(vmi)
    used = allocated(placed_vmis)
    reasons: Counter = Counter()
    fitting = []
    for node in sorted(nodes, key=lambda n: n["metadata"]["name"]):
        labels = node["metadata"].get("labels") or {}
        if not node_ready(node) or field_value(node, "spec.unschedulable"):
            reasons["node(s) were unschedulable" if field_value(node, "spec.unschedulable")
                    else "node(s) had untolerated taint {node.kubernetes.io/unreachable: }"] += 1
            continue
        if any(labels.get(k) != v for k, v in selector.items()) or not _affinity_ok(labels, spec.get("affinity")):
            reasons["node(s) didn't match Pod's node affinity/selector"] += 1
            continue
        untolerated = [t for t in field_value(node, "spec.taints") or []
                       if t.get("effect") in ("NoSchedule", "NoExecute") and not _tolerated(t, tolerations)]
        if untolerated:
            t = untolerated[0]
            reasons[f"node(s) had untolerated taint {{{t['key']}: {t.get('value', '')}}}"] += 1
            continue
        allocatable = field_value(node, "status.allocatable") or {}
        short = []
        for resource, amount in need.items():
            free = parse_quantity(allocatable.get(resource, 0)) - used.get(node["metadata"]["name"], Counter())[resource]
            if amount > free:
                short.append(resource)
        if short:
            for resource in short:
                reasons[f"Insufficient {resource}"] += 1
            continue
        fitting.append(node)
    if fitting:
        # Spread: the node with the most free CPU wins, as the default scoring tends to do.
        def free_cpu(n):
            alloc = parse_quantity((field_value(n, "status.allocatable") or {}).get("cpu", 0))
            return alloc - used.get(n["metadata"]["name"], Counter())["cpu"]
        return max(fitting, key=free_cpu)["metadata"]["name"], ""
    detail = ", ".join(f"{count} {reason}" for reason, count in sorted(reasons.items()))
    total = len(nodes)
    return None, (f"0/{total} nodes are available: {detail}. preemption: 0/{total} nodes are available: "
                  f"{total} Preemption is not helpful for scheduling.")
