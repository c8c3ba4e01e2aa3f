"""The acceptance suite's host and scheduling experiments: the node pools labelled and tainted, the
check-node DaemonSet's verdicts, no container GPU on a VFIO node, the test workstation on its pool."""

from __future__ import annotations

import contextlib

from .base import GPU_VENDOR_PREFIXES, Skip, SuiteBase
from .report import FAIL, PASS


class HostExperiments(SuiteBase):
    """Host and scheduling: read from the cluster (--kubeconfig), none of them needs a workstation
    but the placement."""

    async def host_checks(self):
        names = ["node-pools", "check-node", "no-container-gpus-on-vfio-nodes"]
        if not self.has_cluster:
            self.skipped("host", names, "Give --kubeconfig (read access to nodes and pods) to check the hosts.")
            return
        await self.experiment("host", "node-pools", self.node_pools)
        await self.experiment("host", "check-node", self.check_node)
        await self.experiment("host", "no-container-gpus-on-vfio-nodes", self.no_container_gpus)

    async def node_pools(self):
        """deploy/host/label-nodes.sh: a node of the workstation pool carries the pool label and its
        NoSchedule taint (container pods stay off); a VFIO node is in the pool too."""
        nodes = await self.cluster.nodes()
        label, accel = self.o.pool_label, self.o.accelerator_label
        pool = [n for n in nodes if (n["metadata"].get("labels") or {}).get(label) == "true"]
        kubevirt = [n for n in nodes if (n["metadata"].get("labels") or {}).get("kubevirt.io/schedulable") == "true"]
        vfio = [n for n in nodes if (n["metadata"].get("labels") or {}).get(accel) == "vfio"]
        wrong = []
        for n in {n["metadata"]["name"]: n for n in pool + kubevirt + vfio}.values():
            name, labels = n["metadata"]["name"], n["metadata"].get("labels") or {}
            tainted = any(t.get("key") == label and t.get("value") == "true" and t.get("effect") == "NoSchedule"
                          for t in (n.get("spec") or {}).get("taints") or [])
            if labels.get(label) != "true":
                wrong.append(f"{name} runs KubeVirt's virt-handler (kubevirt.io/schedulable) but is in no workstation "
                             f"pool ({label}=true): put it in one, or keep virt-handler off it (the KubeVirt CR's "
                             "nodePlacement)")
            elif not tainted:
                wrong.append(f"{name} lacks the taint {label}=true:NoSchedule, so container pods may land there")
        figures = {"pool nodes": sorted(n["metadata"]["name"] for n in pool),
                   "VFIO nodes": sorted(n["metadata"]["name"] for n in vfio),
                   "KubeVirt nodes": sorted(n["metadata"]["name"] for n in kubevirt)}
        if not pool:
            return FAIL, f"No node carries {label}=true: label the workstation nodes with deploy/host/label-nodes.sh.", figures
        if wrong:
            return FAIL, "; ".join(wrong) + ".", figures
        return PASS, f"{len(pool)} node(s) are in the workstation pools, labelled and tainted.", figures

    async def check_node(self):
        """deploy/host/check-node-daemonset.yaml: its pod on a node is Ready when the node passed
        (virtualisation, KVM, vhost, TUN, IOMMU, VFIO for its pool); its log has the table."""
        sets = await self.cluster.daemonsets("app.kubernetes.io/name=check-node")
        if not sets:
            raise Skip("The check-node DaemonSet is not deployed (deploy/host/check-node-daemonset.yaml); deploy "
                       "it to see each node's virtualisation, KVM, vhost, TUN, IOMMU and VFIO.")
        pods = await self.cluster.pods("app.kubernetes.io/name=check-node")
        results, failing = {}, []
        for pod in pods:
            node = (pod.get("spec") or {}).get("nodeName") or "?"
            ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                        for c in (pod.get("status") or {}).get("conditions") or [])
            results[node] = "passed" if ready else "failed"
            if not ready:
                with contextlib.suppress(Exception):
                    log = await self.cluster.pod_log(pod["metadata"]["namespace"], pod["metadata"]["name"], 5)
                    results[node] = "failed: " + " / ".join(line.strip() for line in log.splitlines() if line.strip())
                failing.append(node)
        if not pods:
            return FAIL, "The check-node DaemonSet runs no pod: no node is in its pools.", {}
        if failing:
            return FAIL, f"{len(failing)} node(s) failed their host checks: {', '.join(sorted(failing))} (kubectl logs " \
                         "shows the fixes).", results
        return PASS, f"All {len(pods)} node(s) passed their host checks.", results

    async def no_container_gpus(self):
        """A VFIO node's GPUs are KubeVirt's: no container asks for a GPU there, and no device
        plugin offers container GPUs (nvidia.com/gpu) on it."""
        nodes = [n for n in await self.cluster.nodes()
                 if (n["metadata"].get("labels") or {}).get(self.o.accelerator_label) == "vfio"]
        if not nodes:
            raise Skip(f"No node is in VFIO mode ({self.o.accelerator_label}=vfio): no GPU node pool to check.")
        wrong, figures = [], {}
        for node in nodes:
            name = node["metadata"]["name"]
            offered = {k: v for k, v in ((node.get("status") or {}).get("allocatable") or {}).items()
                       if k.startswith(GPU_VENDOR_PREFIXES)}
            figures[name] = offered
            if str(offered.get("nvidia.com/gpu", "0")) not in ("0", ""):
                wrong.append(f"{name} offers nvidia.com/gpu to containers (a container device plugin runs there)")
            for pod in await self.cluster.pods_on(name):
                if (pod["metadata"].get("labels") or {}).get("kubevirt.io") == "virt-launcher":
                    continue
                asked = [k for c in (pod.get("spec") or {}).get("containers") or []
                         for k in ((c.get("resources") or {}).get("limits") or {}) if k.startswith(GPU_VENDOR_PREFIXES)]
                if asked:
                    wrong.append(f"pod {pod['metadata']['namespace']}/{pod['metadata']['name']} holds {asked[0]} on {name}")
        if wrong:
            return FAIL, "; ".join(wrong) + ".", figures
        return PASS, f"No container holds a GPU on the {len(nodes)} VFIO node(s).", figures

    async def placement(self):
        """The test workstation's VMI runs on a node its VM selects, in the workstation pool."""
        if not self.has_cluster:
            raise Skip("Give --kubeconfig to see where the workstation runs.")
        problem, figures = await self.misplaced(self.user, self.server)
        figures["profile"] = self.o.profile or "default"
        if problem:
            return FAIL, problem, figures
        return PASS, f"The workstation runs on {figures['node']}, a node of its profile's pool.", figures
