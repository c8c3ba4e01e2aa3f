"""Services: Endpoints and an EndpointSlice from the VMIs behind each selector (their launcher
pods, which carry the VMI's labels), and a kube-proxy that forwards `clusterIP:port` on loopback to
the current VMI's address. The EndpointSlice is shaped as kube-controller-manager's endpointslice
controller makes it (staging/src/k8s.io/endpointslice/utils.go, reconciler.go): named after the
Service with a random suffix, labelled with the Service's name and the controller, owned by the
Service, one endpoint per address with its conditions, node and launcher pod."""

from __future__ import annotations

import asyncio
import copy
import functools
import logging
import random

from ..objects import field_value
from .instances import VMI
from .resources import BY_KIND
from .selectors import match_labels_matcher

log = logging.getLogger(__name__)

SERVICE = BY_KIND["Service"]
ENDPOINTS = BY_KIND["Endpoints"]
ENDPOINT_SLICE = BY_KIND["EndpointSlice"]
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
SLICE_MANAGED_BY = "endpointslice.kubernetes.io/managed-by"
SLICE_CONTROLLER = "endpointslice-controller.k8s.io"
_NAME_CHARS = "bcdfghjklmnpqrstvwxz2456789"  # apiserver's SimpleNameGenerator alphabet


class Network:
    def __init__(self, cluster):
        self.c = cluster
        self.store = cluster.store
        self.listeners: dict[tuple[str, str], dict[int, asyncio.AbstractServer]] = {}

    def backends(self, svc: dict) -> list[str]:
        return sorted(ip for ip, _ in self._backend_vmis(svc))

    def _backend_vmis(self, svc: dict) -> list[tuple[str, dict]]:
        selector = field_value(svc, "spec.selector")
        if not selector:
            return []
        match = match_labels_matcher(selector)
        out = []
        for vmi in self.store.list(VMI, svc["metadata"]["namespace"]):
            if field_value(vmi, "status.phase") != "Running" or vmi["metadata"].get("deletionTimestamp"):
                continue
            if match(vmi["metadata"].get("labels") or {}):
                ip = (field_value(vmi, "status.interfaces") or [{}])[0].get("ipAddress")
                if ip:
                    out.append((ip, vmi))
        return sorted(out, key=lambda pair: pair[0])

    def _slices(self, ns: str, name: str) -> list[dict]:
        return [s for s in self.store.list(ENDPOINT_SLICE, ns)
                if (s["metadata"].get("labels") or {}).get(SERVICE_NAME_LABEL) == name
                and (s["metadata"].get("labels") or {}).get(SLICE_MANAGED_BY) == SLICE_CONTROLLER]

    def _reconcile_slice(self, svc: dict, ports: list[dict]):
        ns, name = svc["metadata"]["namespace"], svc["metadata"]["name"]
        endpoints = []
        for ip, vmi in self._backend_vmis(svc):
            endpoint = {"addresses": [ip], "conditions": {"ready": True, "serving": True, "terminating": False}}
            if field_value(vmi, "status.nodeName"):
                endpoint["nodeName"] = field_value(vmi, "status.nodeName")
            pod = self.c.compute.launchers.of(vmi)
            if pod is not None:
                endpoint["targetRef"] = {"kind": "Pod", "namespace": ns, "name": pod["metadata"]["name"],
                                         "uid": pod["metadata"]["uid"]}
            endpoints.append(endpoint)
        labels = {k: v for k, v in (svc["metadata"].get("labels") or {}).items()
                  if k not in (SERVICE_NAME_LABEL, SLICE_MANAGED_BY)}
        labels.update({SERVICE_NAME_LABEL: name, SLICE_MANAGED_BY: SLICE_CONTROLLER})
        # (empty lists come back as null from the API server's storage; a Service without
        # endpoints has the placeholder slice, which has no ports either: reconciler.go)
        wanted = {"addressType": "IPv4", "endpoints": endpoints or None, "ports": (ports or None) if endpoints else None}
        existing = self._slices(ns, name)
        for extra in existing[1:]:
            self.store.delete(ENDPOINT_SLICE, ns, extra["metadata"]["name"])
        if not existing:
            self.store.create(ENDPOINT_SLICE, {
                "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": {"name": f"{name}-" + "".join(random.choices(_NAME_CHARS, k=5)),
                             "generateName": f"{name}-", "namespace": ns, "labels": labels,
                             "ownerReferences": [self.c.owner_ref(svc)]}, **wanted})
            return
        current = existing[0]
        if any(current.get(k) != v for k, v in wanted.items()) or current["metadata"].get("labels") != labels:
            new = copy.deepcopy(current)
            new.update(wanted)
            new["metadata"]["labels"] = labels
            self.store.update(ENDPOINT_SLICE, new, check_rv=False)

    async def reconcile_service(self, key):
        ns, name = key
        svc = self.store.get(SERVICE, ns, name)
        if svc is None:
            await self._close(key)
            ep = self.store.get(ENDPOINTS, ns, name)
            if ep is not None:
                self.store.delete(ENDPOINTS, ns, name)
            for endpoint_slice in self._slices(ns, name):
                self.store.delete(ENDPOINT_SLICE, ns, endpoint_slice["metadata"]["name"])
            return
        addresses = self.backends(svc)
        ports = [{"name": p.get("name", ""), "port": _target(p), "protocol": p.get("protocol", "TCP")}
                 for p in field_value(svc, "spec.ports") or []]
        subsets = [{"addresses": [{"ip": ip} for ip in addresses], "ports": ports}] if addresses else []
        body = {"apiVersion": "v1", "kind": "Endpoints",
                "metadata": {"name": name, "namespace": ns, "labels": svc["metadata"].get("labels") or {}},
                "subsets": subsets}
        ep = self.store.get(ENDPOINTS, ns, name)
        if ep is None:
            self.store.create(ENDPOINTS, body)
        elif ep.get("subsets") != subsets:
            new = copy.deepcopy(ep)
            new["subsets"] = subsets
            self.store.update(ENDPOINTS, new, check_rv=False)
        if field_value(svc, "spec.selector"):  # (the controller skips Services without a selector)
            self._reconcile_slice(svc, ports)
        await self._listen(svc)

    async def _listen(self, svc: dict):
        ip = field_value(svc, "spec.clusterIP")
        if not ip or ip == "None":
            return
        key = (svc["metadata"]["namespace"], svc["metadata"]["name"])
        open_ports = self.listeners.setdefault(key, {})
        wanted = {int(p["port"]): p for p in field_value(svc, "spec.ports") or []}
        for port in list(open_ports):
            if port not in wanted:
                open_ports.pop(port).close()
        for port, spec in wanted.items():
            if port in open_ports:
                continue
            try:
                open_ports[port] = await asyncio.start_server(
                    functools.partial(self._forward, key=key, port_spec=spec), ip, port)
            except OSError as exc:
                log.warning("service %s/%s: cannot listen on %s:%s (%s)", *key, ip, port, exc)

    async def _close(self, key):
        for server in self.listeners.pop(key, {}).values():
            server.close()

    async def close_all(self):
        for key in list(self.listeners):
            await self._close(key)

    async def _forward(self, reader, writer, key, port_spec):
        svc = self.store.get(SERVICE, *key)
        backends = self.backends(svc) if svc else []
        if not backends:
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(backends[0], _target(port_spec))
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))


def _target(port: dict) -> int:
    target = port.get("targetPort", port.get("port"))
    return int(str(target)) if str(target).isdigit() else int(port["port"])


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
    try:
        while True:
            data = await reader.read(65536)
            if not data:
                break
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        try:
            writer.close()
        except RuntimeError:
            pass
