"""The cluster as a kubeconfig with read access shows it (deploy/acceptance/acceptance-reader.yaml lists
what the suite reads): nodes, pods, the test workstations' VMs, VMIs and claims. Blocking client
calls run on threads; objects come back as the API's JSON (dicts)."""

from __future__ import annotations

import asyncio
from typing import Any

from urllib3.exceptions import HTTPError

from .. import manifests as m
from ..quantity import parse_quantity
from .client import AcceptanceError

KUBEVIRT = ("kubevirt.io", "v1")
TERMINAL_PHASES = ("Succeeded", "Failed")


class Cluster:
    def __init__(self, kubeconfig: str):
        from kubernetes import client, config
        try:
            self.api = config.new_client_from_config(config_file=kubeconfig)
        except Exception as err:  # (the client raises several kinds for a bad file)
            raise AcceptanceError(f"Cannot use the kubeconfig {kubeconfig}: {err}") from None
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.storage = client.StorageV1Api(self.api)
        self.apps = client.AppsV1Api(self.api)

    async def _call(self, fn, *args, **kwargs) -> Any:
        from kubernetes.client.rest import ApiException
        try:
            result = await asyncio.to_thread(fn, *args, **kwargs)
        except ApiException as err:
            if err.status == 404:
                return None
            raise AcceptanceError(f"The cluster refused to show {getattr(fn, '__name__', 'an object')} "
                                  f"({err.status} {err.reason}); the kubeconfig needs the reads "
                                  "deploy/acceptance/acceptance-reader.yaml grants.") from None
        except (OSError, HTTPError) as err:  # (urllib3's: a refused or broken connection, retries run out)
            raise AcceptanceError(f"The cluster's API server does not answer ({type(err).__name__}).") from None
        return result if isinstance(result, dict) else self.api.sanitize_for_serialization(result)

    async def _list(self, fn, *args, **kwargs) -> list[dict]:
        """A list's items; a list the cluster does not serve (404: an API it lacks) is a sentence."""
        found = await self._call(fn, *args, **kwargs)
        if found is None:
            raise AcceptanceError(f"The cluster does not serve {getattr(fn, '__name__', 'a list')} (404): is "
                                  "KubeVirt installed, and is the kubeconfig for this cluster?")
        return found["items"]

    async def nodes(self) -> list[dict]:
        return await self._list(self.core.list_node)

    async def pods_on(self, node: str) -> list[dict]:
        found = await self._list(self.core.list_pod_for_all_namespaces, field_selector=f"spec.nodeName={node}")
        return [p for p in found if (p.get("status") or {}).get("phase") not in TERMINAL_PHASES]

    async def pods(self, label_selector: str) -> list[dict]:
        return await self._list(self.core.list_pod_for_all_namespaces, label_selector=label_selector)

    async def pod_log(self, namespace: str, name: str, tail: int = 40) -> str:
        text = await asyncio.to_thread(self.core.read_namespaced_pod_log, name, namespace, tail_lines=tail)
        return text if isinstance(text, str) else ""

    async def daemonsets(self, label_selector: str) -> list[dict]:
        return await self._list(self.apps.list_daemon_set_for_all_namespaces, label_selector=label_selector)

    async def workstation_vm(self, user: str, server: str) -> dict | None:
        """The test workstation's VirtualMachine, found by the raw names the spawner annotates."""
        found = await self._list(self.custom.list_cluster_custom_object, *KUBEVIRT, "virtualmachines",
                                 label_selector=f"app.kubernetes.io/managed-by={m.MANAGED_BY}")
        for vm in found:
            ann = vm["metadata"].get("annotations") or {}
            if ann.get(m.ANNOTATION_USERNAME) == user and ann.get(m.ANNOTATION_SERVERNAME, "") == server:
                return vm
        return None

    async def vmi(self, namespace: str, name: str) -> dict | None:
        return await self._call(self.custom.get_namespaced_custom_object, *KUBEVIRT, namespace,
                                "virtualmachineinstances", name)

    async def claims(self, namespace: str, names: set[str]) -> list[dict]:
        found = await self._list(self.core.list_namespaced_persistent_volume_claim, namespace)
        return [c for c in found if c["metadata"]["name"] in names]

    async def workstation_claims(self, vm: dict) -> list[dict]:
        """The claims the workstation's VM mounts (its disks)."""
        volumes = ((vm.get("spec") or {}).get("template") or {}).get("spec", {}).get("volumes") or []
        names = {str((v.get("persistentVolumeClaim") or {}).get("claimName") or (v.get("dataVolume") or {}).get("name"))
                 for v in volumes if v.get("persistentVolumeClaim") or v.get("dataVolume")}
        return await self.claims(vm["metadata"]["namespace"], names)

    async def volume_attachments(self) -> list[dict]:
        found = await self._call(self.storage.list_volume_attachment)
        if found is None:
            raise AcceptanceError("The cluster serves no VolumeAttachments (storage.k8s.io/v1): cannot see where "
                                  "disks are attached.")
        return found["items"]


def requests_of(pod: dict) -> dict[str, float]:
    """What a pod holds on its node for the scheduler: its containers' requests (the largest init
    container's where that is more), as kube-scheduler's resource fit counts them."""
    spec = pod.get("spec") or {}
    total: dict[str, float] = {}
    for c in spec.get("containers") or []:
        for k, v in ((c.get("resources") or {}).get("requests") or {}).items():
            total[k] = total.get(k, 0.0) + float(parse_quantity(v))
    for c in spec.get("initContainers") or []:
        for k, v in ((c.get("resources") or {}).get("requests") or {}).items():
            total[k] = max(total.get(k, 0.0), float(parse_quantity(v)))
    for k, v in (spec.get("overhead") or {}).items():
        total[k] = total.get(k, 0.0) + float(parse_quantity(v))
    return total


def free_on(node: dict, pods: list[dict]) -> dict[str, float]:
    """The node's allocatable less what its pods request: what a new VM could have there."""
    free = {k: float(parse_quantity(v)) for k, v in ((node.get("status") or {}).get("allocatable") or {}).items()}
    for pod in pods:
        for k, v in requests_of(pod).items():
            free[k] = free.get(k, 0.0) - v
    return free
