"""Discovery documents: /version, /api, /apis and the resource lists of each group version."""

from __future__ import annotations

from .errors import ApiError
from .resources import RESOURCE_TYPES, SUBRESOURCES_GROUP, VM_ACTIONS, VMI_AGENT_CALLS, groups

VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]


def version() -> dict:
    return {"major": "1", "minor": "32", "gitVersion": "v1.32.0-kubevirt-sim", "gitCommit": "0" * 40,
            "gitTreeState": "clean", "buildDate": "2026-01-01T00:00:00Z", "goVersion": "go1.23",
            "compiler": "gc", "platform": "linux/amd64"}


def api_versions(address: str) -> dict:
    return {"kind": "APIVersions", "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": address}]}


def _group_doc(name: str, versions: list[str]) -> dict:
    gv = [{"groupVersion": f"{name}/{v}", "version": v} for v in versions]
    return {"kind": "APIGroup", "apiVersion": "v1", "name": name, "versions": gv, "preferredVersion": gv[0]}


def api_group_list() -> dict:
    return {"kind": "APIGroupList", "apiVersion": "v1",
            "groups": [_group_doc(g, vs) for g, vs in groups().items()]}


def api_group(name: str) -> dict | None:
    vs = groups().get(name)
    return _group_doc(name, vs) if vs else None


def resource_list(group: str, version: str) -> dict | None:
    gv = f"{group}/{version}" if group else version
    resources = []
    if group == SUBRESOURCES_GROUP:
        if version != "v1":
            return None
        for action in VM_ACTIONS:
            resources.append({"name": f"virtualmachines/{action}", "singularName": "", "namespaced": True,
                              "kind": "VirtualMachine", "verbs": ["update"]})
        for call in VMI_AGENT_CALLS:
            resources.append({"name": f"virtualmachineinstances/{call}", "singularName": "", "namespaced": True,
                              "kind": "VirtualMachineInstance", "verbs": ["get"]})
        return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": resources}
    found = False
    for rt in RESOURCE_TYPES:
        if rt.group != group or version not in rt.versions:
            continue
        found = True
        entry = {"name": rt.plural, "singularName": rt.singular, "namespaced": rt.namespaced, "kind": rt.kind,
                 "verbs": VERBS, "storageVersionHash": ""}
        if rt.short_names:
            entry["shortNames"] = list(rt.short_names)
        if rt.categories:
            entry["categories"] = list(rt.categories)
        resources.append(entry)
        for sub in rt.subresources:
            if sub == "token":  # the TokenRequest API (kubectl create token)
                resources.append({"name": f"{rt.plural}/token", "singularName": "", "namespaced": True,
                                  "group": "authentication.k8s.io", "version": "v1", "kind": "TokenRequest",
                                  "verbs": ["create"]})
                continue
            if sub == "eviction":  # the Eviction API (kubectl drain finds it here: drain.CheckEvictionSupport)
                resources.append({"name": f"{rt.plural}/eviction", "singularName": "", "namespaced": True,
                                  "group": "policy", "version": "v1", "kind": "Eviction", "verbs": ["create"]})
                continue
            resources.append({"name": f"{rt.plural}/{sub}", "singularName": "", "namespaced": rt.namespaced,
                              "kind": rt.kind, "verbs": ["get", "patch", "update"]})
    if not found:
        return None
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": resources}


def openapi_v3_root() -> dict:
    paths = {"api/v1": {"serverRelativeURL": "/openapi/v3/api/v1?hash=sim"}}
    for group, versions in groups().items():
        if group == SUBRESOURCES_GROUP:
            continue
        for v in versions:
            paths[f"apis/{group}/{v}"] = {"serverRelativeURL": f"/openapi/v3/apis/{group}/{v}?hash=sim"}
    return {"paths": paths}


def openapi_v3_group_version(group: str, version: str) -> dict | None:
    """A minimal OpenAPI v3 document per group version. It declares the `fieldValidation`
    parameter on each kind's PATCH, which is how kubectl learns to leave validation to the
    server (and the server checks objects against the upstream schemas)."""
    field_validation = {"name": "fieldValidation", "in": "query", "schema": {"type": "string", "uniqueItems": True}}
    paths = {}
    for rt in RESOURCE_TYPES:
        if rt.group != group or version not in rt.versions:
            continue
        prefix = f"/apis/{group}/{version}" if group else "/api/v1"
        ns = "/namespaces/{namespace}" if rt.namespaced else ""
        gvk = {"group": group, "version": version, "kind": rt.kind}
        op = {"x-kubernetes-group-version-kind": gvk, "parameters": [field_validation],
              "responses": {"200": {"description": "OK"}}}
        paths[f"{prefix}{ns}/{rt.plural}/{{name}}"] = {"patch": {**op, "x-kubernetes-action": "patch"},
                                                     "put": {**op, "x-kubernetes-action": "put"}}
        paths[f"{prefix}{ns}/{rt.plural}"] = {"post": {**op, "x-kubernetes-action": "post"}}
    if not paths:
        return None
    return {"openapi": "3.0.0", "info": {"title": "Kubernetes", "version": "v1.32.0"}, "paths": paths,
            "components": {"schemas": {}}}


def document(path: str, host: str) -> dict | str | None:
    """The discovery document, health answer or OpenAPI document at a path; None where the path is
    no such thing (a resource's, then)."""
    if path in ("/healthz", "/readyz", "/livez"):
        return "ok"
    if path == "/version":
        return version()
    if path == "/api":
        return api_versions(host)
    if path == "/api/v1":
        return resource_list("", "v1")
    if path == "/apis":
        return api_group_list()
    if path == "/openapi/v3":
        return openapi_v3_root()
    if path.startswith("/openapi/v3/"):
        rest = path[len("/openapi/v3/"):].split("/")
        doc = (openapi_v3_group_version("", "v1") if rest == ["api", "v1"] else
               openapi_v3_group_version(rest[1], rest[2]) if len(rest) == 3 and rest[0] == "apis"
               else None)
        if doc is None:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        return doc
    parts = path.split("/")
    if len(parts) == 3 and parts[1] == "apis":
        doc = api_group(parts[2])
        if doc is None:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        return doc
    if len(parts) == 4 and parts[1] == "apis":
        doc = resource_list(parts[2], parts[3])
        if doc is None:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        return doc
    return None
