"""The simulated API server: the Kubernetes REST protocol over HTTP on loopback."""

from __future__ import annotations

import base64
import collections
import copy
import json
import logging
import random
import re
from typing import Any

import tornado.iostream
import tornado.web
import yaml

from . import discovery, errors, protobuf, rbac, tables
from .admission import admit
from .auth import ANONYMOUS
from .errors import ApiError
from .eviction import evict
from .mutation import mutate
from .patch import apply_patch
from .policies import request_of
from .resources import BY_KIND, CRD_GROUPS, SUBRESOURCES_GROUP, VM_ACTIONS, VMI_AGENT_CALLS, lookup
from .selectors import parse_field_selector, parse_label_selector
from .watch import WatchStream

log = logging.getLogger(__name__)

_RESOURCE_PATH = re.compile(
    r"^/(?:api/(?P<cv>v1)|apis/(?P<group>[^/]+)/(?P<version>[^/]+))"
    r"(?:/namespaces/(?P<ns>[^/]+))?/(?P<plural>[^/]+)(?:/(?P<name>[^/]+))?(?:/(?P<sub>[^/]+))?$")



class RequestCounter:
    """Counts API requests by verb and resource, for benchmarks and request-budget tests."""

    def __init__(self):
        self.counts: collections.Counter = collections.Counter()

    def add(self, verb: str, resource: str):
        self.counts[f"{verb} {resource}"] += 1

    def snapshot(self) -> dict:
        return dict(self.counts)


class ApiHandler(tornado.web.RequestHandler):
    """One handler for every path: Kubernetes routes are easier to parse than to declare."""

    def initialize(self, cluster):
        self.cluster = cluster
        self.store = cluster.store
        self._watch: WatchStream | None = None
        self.user = ANONYMOUS

    def check_xsrf_cookie(self):
        """The Kubernetes API has no cookies, so there is nothing to check."""

    def compute_etag(self):
        return None

    # ---------- plumbing
    def _send(self, body, code: int = 200):
        self.set_status(code)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(body, separators=(",", ":")))

    def _fail(self, err: ApiError):
        self.set_status(err.code)
        for k, v in err.headers.items():
            self.set_header(k, v)
        if err.plain:
            if "Content-Type" not in err.headers:
                self.set_header("Content-Type", "text/plain; charset=utf-8")
            self.finish(err.message)
        else:
            self.set_header("Content-Type", "application/json")
            self.finish(json.dumps(err.status()))

    def _body(self):
        raw = self.request.body
        if not raw:
            return None
        if "protobuf" in self.request.headers.get("Content-Type", ""):
            return protobuf.decode(raw)
        try:
            if raw.lstrip()[:1] in (b"{", b"["):
                return json.loads(raw)
            return yaml.safe_load(raw)
        except (ValueError, yaml.YAMLError) as exc:
            raise errors.bad_request(f"the request body could not be decoded: {exc}") from None

    def on_connection_close(self):
        if self._watch:
            self._watch.close()

    async def get(self, path):
        await self._dispatch("GET")

    async def post(self, path):
        await self._dispatch("POST")

    async def put(self, path):
        await self._dispatch("PUT")

    async def patch(self, path):
        await self._dispatch("PATCH")

    async def delete(self, path):
        await self._dispatch("DELETE")

    async def _dispatch(self, method: str):
        path = self.request.path.rstrip("/") or "/"
        try:
            if path.startswith("/sim/v1"):
                result = await self.cluster.faults.handle(method, path[len("/sim/v1"):], self._body())
                return self._send(result)
            self.user = self.cluster.auth.authenticate(self.request.headers.get("Authorization"))
            if method == "GET":
                doc = discovery.document(path, self.request.host)
                if doc is not None:
                    self._authorize(rbac.Request("get", path=path))
                    return self._send(doc)
            m = _RESOURCE_PATH.match(path)
            if not m:
                raise ApiError(404, "NotFound", "the server could not find the requested resource")
            await self._resource(method, m)
        except ApiError as err:
            self._fail(err)
        except tornado.iostream.StreamClosedError:
            pass

    # ---------- resources
    async def _resource(self, method: str, m):
        group = m.group("group") or ""
        version = m.group("cv") or m.group("version")
        ns, plural, name, sub = m.group("ns"), m.group("plural"), m.group("name"), m.group("sub")
        if group == SUBRESOURCES_GROUP:
            return await self._kubevirt_subresource(method, ns, plural, name, sub)
        if group == "authentication.k8s.io" and plural == "selfsubjectreviews" and not ns and not name:
            return self._self_subject_review(method)
        # /api/v1/namespaces/{name}[/status] addresses the Namespace itself.
        if group == "" and ns and plural in ("status", "finalize") and not name:
            plural, name, sub, ns = "namespaces", ns, plural, None
        rt = lookup(group, version, plural)
        if rt is None:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        namespace = ns or ""
        if not rt.namespaced and ns:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        if sub and sub not in rt.subresources:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        if rt.kind == "ServiceAccount" and sub == "token" and name and method == "POST":
            return self._token_request(rt, namespace, name)
        if rt.kind == "Pod" and sub == "eviction":
            return self._eviction(rt, namespace, name, method)
        verb = self._verb(method, name)
        self._authorize(rbac.Request(verb, group, rt.plural, sub or "", namespace, name or ""))
        # (a dry run is counted apart: it stores nothing, so it is no write)
        self.cluster.requests.add(verb + ("-dry-run" if self._dry_run() else ""), rt.plural + (f"/{sub}" if sub else ""))
        self.cluster.faults.maybe_fail(verb, rt.plural)
        self.cluster.faults.maybe_fail(verb, rt.plural + (f"/{sub}" if sub else ""))
        if verb == "watch":
            self._watch = WatchStream(self, self.store, lambda: self.cluster.t("bookmark"), rt, namespace, name)
            return await self._watch.serve()
        if verb == "list":
            return self._list(rt, namespace, version)
        if verb == "get":
            obj = self.store.must_get(rt, namespace, name)
            return self._send_object(rt, obj, version)
        if verb == "create":
            return self._create(rt, namespace, version)
        if verb == "update":
            return self._update(rt, namespace, name, sub, version)
        if verb == "patch":
            return self._patch(rt, namespace, name, sub, version)
        if verb == "delete":
            return self._delete(rt, namespace, name, version)
        if verb == "deletecollection":
            return self._delete_collection(rt, namespace, version)
        raise errors.method_not_allowed()

    def _authorize(self, req: rbac.Request):
        rbac.check(self.store, self.user, req)
        if not req.path and not self.user.superuser:
            self.cluster.authorized[(self.user.name, req.verb, req.group, req.combined_resource)] += 1

    def _token_request(self, rt, namespace: str, name: str):
        """The TokenRequest API: a token for the ServiceAccount, as `kubectl create token` asks."""
        self._authorize(rbac.Request("create", "", rt.plural, "token", namespace, name))
        self.cluster.requests.add("create", "serviceaccounts/token")
        body = self._body()
        if body is not None and not isinstance(body, dict):
            raise errors.bad_request("the request body must be an object")
        account = self.store.must_get(rt, namespace, name)
        self._send(self.cluster.auth.issue(account, body), 201)

    def _eviction(self, rt, namespace: str, name: str | None, method: str):
        """The Eviction API, as `kubectl drain` calls it (sim/eviction.py)."""
        if method != "POST" or not name:
            raise errors.method_not_allowed()
        self._authorize(rbac.Request("create", "", rt.plural, "eviction", namespace, name))
        self.cluster.requests.add("create" + ("-dry-run" if self._dry_run() else ""), "pods/eviction")
        self.cluster.faults.maybe_fail("create", "pods/eviction")
        self._send(evict(self.cluster, namespace, name, self._body(), self._dry_run()), 201)

    def _self_subject_review(self, method: str):
        """The SelfSubjectReview API (kubectl auth whoami): who the caller is, as authenticated;
        nothing is stored (pkg/registry/authentication/selfsubjectreview/rest.go)."""
        if method != "POST":
            raise errors.method_not_allowed()
        self._authorize(rbac.Request("create", "authentication.k8s.io", "selfsubjectreviews", "", "", ""))
        self._send({"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview",
                    "metadata": {"creationTimestamp": None},
                    "status": {"userInfo": {"username": self.user.name, "groups": list(self.user.groups)}}}, 201)

    def _verb(self, method: str, name: str | None) -> str:
        if method == "GET":
            if self.get_argument("watch", "") in ("true", "1"):
                return "watch"
            return "get" if name else "list"
        if method == "POST":
            if name:
                raise errors.method_not_allowed()
            return "create"
        if method == "PUT":
            return "update"
        if method == "PATCH":
            return "patch"
        if method == "DELETE":
            return "delete" if name else "deletecollection"
        raise errors.method_not_allowed()

    def _wants_table(self) -> bool:
        return "as=Table" in self.request.headers.get("Accept", "")

    def _send_object(self, rt, obj: dict, version: str, code: int = 200):
        obj = rt.versioned(obj, version)
        if self._wants_table():
            return self._send(tables.table(rt, [obj], {"resourceVersion": obj["metadata"]["resourceVersion"]}), code)
        self._send(obj, code)

    def _list(self, rt, namespace: str, version: str):
        label_match = parse_label_selector(self.get_argument("labelSelector", None))
        field_match = parse_field_selector(self.get_argument("fieldSelector", None))
        items = [o for o in self.store.list(rt, namespace or None)
                 if label_match(o["metadata"].get("labels") or {}) and field_match(o)]
        items.sort(key=lambda o: (o["metadata"].get("namespace", ""), o["metadata"]["name"]))
        meta: dict[str, Any] = {"resourceVersion": str(self.store.rv)}
        token = self.get_argument("continue", None)
        if token:
            try:
                after = json.loads(base64.urlsafe_b64decode(token.encode()))
                meta["resourceVersion"] = after["rv"]
                start = tuple(after["start"])
            except (ValueError, KeyError, TypeError):
                raise errors.bad_request("continue key is not valid: illegal base64 data") from None
            items = [o for o in items if (o["metadata"].get("namespace", ""), o["metadata"]["name"]) > start]
        limit = int(self.get_argument("limit", "0") or 0)
        if limit and len(items) > limit:
            last = items[limit - 1]["metadata"]
            meta["continue"] = base64.urlsafe_b64encode(json.dumps(
                {"rv": meta["resourceVersion"], "start": [last.get("namespace", ""), last["name"]]}).encode()).decode()
            meta["remainingItemCount"] = len(items) - limit
            items = items[:limit]
        items = [rt.versioned(o, version) for o in items]
        if self._wants_table():
            return self._send(tables.table(rt, items, meta))
        self._send({"kind": rt.kind + "List", "apiVersion": rt.api_version(version), "metadata": meta,
                    "items": items})

    def _check_namespace(self, rt, namespace: str):
        if not rt.namespaced:
            return
        ns = self.store.get(BY_KIND["Namespace"], "", namespace)
        if ns is None:
            raise errors.not_found(BY_KIND["Namespace"], namespace)
        if ns["metadata"].get("deletionTimestamp"):
            raise errors.forbidden(rt, "", f"unable to create new content in namespace {namespace} because "
                                           "it is being terminated")

    def _validate(self, rt, obj: dict, old: dict | None, version: str):
        """What kube-apiserver does to a write before storing it, in its order: decoding (unknown
        fields pruned, or refused when strict), defaulting (a create's: Cluster.defaults), the
        mutating webhooks (mutation.py; CDI's clone token in admission.py), validation (the
        schema), the validating webhooks (admission.py), then the ValidatingAdmissionPolicies on
        the mutated object (policies.py). Returns the object to store."""
        name = (obj.get("metadata") or {}).get("name") or (obj.get("metadata") or {}).get("generateName", "")
        schema = self.cluster.schemas.for_kind(rt.kind) if rt.schema else None
        if schema is not None:
            unknown = schema.unknown_fields(obj)
            if unknown:
                if self.get_argument("fieldValidation", "") == "Strict":
                    # the decoder's refusal, before any validation (apiserver's handlers/create.go and
                    # update.go turn a strict decoding error into BadRequest)
                    raise errors.bad_request("strict decoding error: " + ", ".join(f'unknown field "{f}"'
                                                                                  for f in unknown))
                self.set_header("Warning", ", ".join(f'299 - "unknown field \\"{f}\\""' for f in unknown))
                obj = _prune(obj, unknown)
        if old is None:
            self.cluster.defaults(rt, obj)
        mutate(rt.kind, obj, old)
        if schema is not None:
            causes = schema.errors(obj)
            if causes:
                raise errors.invalid(rt, name, causes)
        self.cluster.faults.call_webhooks(rt.kind)
        if rt.kind in ("Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding") and not self.user.superuser:
            asked = rbac.waiver(rt.kind, obj)  # what the API server asks the authorizer first
            if rbac.allowed(self.store, self.user, asked):
                self.cluster.authorized[(self.user.name, asked.verb, asked.group, asked.combined_resource)] += 1
        admit(self.store, rt, obj, old, self.user)
        self._check_policies(rt, version, "UPDATE" if old is not None else "CREATE", name, obj, old)
        return obj

    def _check_policies(self, rt, version: str, operation: str, name: str, obj: dict | None, old: dict | None):
        subject = obj if obj is not None else old
        namespace = (subject or {}).get("metadata", {}).get("namespace", "")
        ns_obj = self.store.get(BY_KIND["Namespace"], "", namespace) if rt.namespaced and namespace else None
        request = request_of(rt, version, operation, name, namespace, None, self.user, self._dry_run())
        self.cluster.policies.check(rt, request, obj and rt.versioned(obj, version),
                                    old and rt.versioned(old, version), ns_obj)

    def _dry_run(self) -> bool:
        return self.get_argument("dryRun", "") == "All"

    def _create(self, rt, namespace: str, version: str):
        body = self._body()
        if not isinstance(body, dict):
            raise errors.bad_request("the request body must be an object")
        meta = body.setdefault("metadata", {})
        if rt.namespaced:
            if meta.get("namespace") and meta["namespace"] != namespace:
                raise errors.bad_request("the namespace of the provided object does not match the namespace "
                                         "sent on the request")
            meta["namespace"] = namespace
        body_kind = body.get("kind")
        if body_kind and body_kind != rt.kind:
            raise errors.bad_request(f"the kind {body_kind} does not match the endpoint's kind {rt.kind}")
        self._check_namespace(rt, namespace)
        body = self._validate(rt, body, None, version)
        if self._dry_run():
            # a dry run goes as far as storage, which refuses a name that exists (registry/store.go)
            if meta.get("name") and self.store.get(rt, namespace, meta["name"]) is not None:
                raise errors.already_exists(rt, meta["name"])
            return self._send_object(rt, body, version, 201)
        obj = self.store.create(rt, body)
        self._send_object(rt, obj, version, 201)

    def _update(self, rt, namespace: str, name: str, sub: str | None, version: str):
        body = self._body()
        if not isinstance(body, dict):
            raise errors.bad_request("the request body must be an object")
        meta = body.setdefault("metadata", {})
        if meta.get("name") and meta["name"] != name:
            raise errors.bad_request(f"the name of the object ({meta['name']}) does not match the name on "
                                     f"the URL ({name})")
        meta["name"] = name
        if rt.namespaced:
            meta["namespace"] = namespace
        old = self.store.must_get(rt, namespace, name)
        if not meta.get("resourceVersion") and rt.group in CRD_GROUPS:
            raise errors.invalid(rt, name, [{"field": "metadata.resourceVersion", "reason": "FieldValueInvalid",
                                             "message": "Invalid value: 0x0: must be specified for an update"}])
        self._write(rt, body, old, sub, version)

    def _write(self, rt, new: dict, old: dict, sub: str | None, version: str, check_rv: bool = True):
        if sub != "status":
            new = self._validate(rt, new, old, version)
        if self._dry_run():
            return self._send_object(rt, new, version)
        obj = self.store.update(rt, new, subresource=sub, check_rv=check_rv)
        self._send_object(rt, obj, version)

    def _patch(self, rt, namespace: str, name: str, sub: str | None, version: str):
        ct = self.request.headers.get("Content-Type", "")
        if "strategic-merge-patch" in ct and rt.group in CRD_GROUPS:
            raise ApiError(415, "UnsupportedMediaType", "the body of the request was in an unknown format - "
                           "accepted media types include: application/json-patch+json, "
                           "application/merge-patch+json, application/apply-patch+yaml")
        body = self._body()
        old = self.store.must_get(rt, namespace, name)
        new = apply_patch(ct, copy.deepcopy(old), body)
        if not isinstance(new, dict):
            raise errors.bad_request("the patch did not produce an object")
        new.setdefault("metadata", {})
        if new["metadata"].get("name") != name:
            raise errors.bad_request("metadata.name cannot be changed by a patch")
        # A patch may carry its own resourceVersion precondition; otherwise it applies to the latest.
        patched_rv = new["metadata"].get("resourceVersion")
        check = patched_rv is not None and patched_rv != old["metadata"]["resourceVersion"]
        self._write(rt, new, old, sub, version, check_rv=check)

    def _delete(self, rt, namespace: str, name: str, version: str):
        body = self._body() or {}
        propagation = body.get("propagationPolicy") or self.get_argument("propagationPolicy", None)
        if body.get("orphanDependents") is True:
            propagation = "Orphan"
        pre = body.get("preconditions") or {}
        grace = body.get("gracePeriodSeconds", self.get_argument("gracePeriodSeconds", None))
        obj = self.store.must_get(rt, namespace, name)
        self._check_policies(rt, version, "DELETE", name, None, obj)
        if self._dry_run():
            return self._send_object(rt, obj, version)
        self.cluster.before_delete(rt, obj, None if grace is None else int(grace))
        result = self.store.delete(rt, namespace, name, propagation, pre.get("uid"), pre.get("resourceVersion"),
                                   None if grace is None else int(grace))
        if result["metadata"].get("deletionTimestamp") and self.store.get(rt, namespace, name) is not None:
            return self._send_object(rt, result, version, 200)
        if rt.kind == "Pod":  # the pod registry returns the deleted object (ReturnDeletedObject)
            return self._send_object(rt, result, version, 200)
        self._send({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                    "details": {"name": name, "group": rt.group, "kind": rt.plural,
                                "uid": obj["metadata"]["uid"]}})

    def _delete_collection(self, rt, namespace: str, version: str):
        label_match = parse_label_selector(self.get_argument("labelSelector", None))
        field_match = parse_field_selector(self.get_argument("fieldSelector", None))
        deleted = []
        for o in list(self.store.list(rt, namespace or None)):
            if label_match(o["metadata"].get("labels") or {}) and field_match(o):
                self._check_policies(rt, version, "DELETE", o["metadata"]["name"], None, o)
                self.cluster.before_delete(rt, o, None)
                deleted.append(self.store.delete(rt, o["metadata"].get("namespace", ""), o["metadata"]["name"]))
        self._send({"kind": rt.kind + "List", "apiVersion": rt.api_version(version),
                    "metadata": {"resourceVersion": str(self.store.rv)}, "items": deleted})

    # ---------- subresources.kubevirt.io
    async def _kubevirt_subresource(self, method, ns, plural, name, sub):
        if not ns or not name or not sub:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        self.cluster.faults.call_virt_api()
        if plural == "virtualmachines" and sub in VM_ACTIONS:
            if method != "PUT":
                raise errors.method_not_allowed()
            self._authorize(rbac.Request("update", SUBRESOURCES_GROUP, plural, sub, ns, name))
            self.cluster.requests.add("update", f"virtualmachines/{sub}")
            self.cluster.faults.maybe_fail("update", f"virtualmachines/{sub}")
            self.cluster.vm_action(ns, name, sub, self._body() or {})
            self.set_status(202)
            return self.finish()
        if plural == "virtualmachineinstances" and sub in VMI_AGENT_CALLS:
            if method != "GET":
                raise errors.method_not_allowed()
            self._authorize(rbac.Request("get", SUBRESOURCES_GROUP, plural, sub, ns, name))
            self.cluster.requests.add("get", f"virtualmachineinstances/{sub}")
            self.cluster.faults.maybe_fail("get", f"virtualmachineinstances/{sub}")
            return self._send(self.cluster.agent_call(ns, name, sub))
        raise ApiError(404, "NotFound", "the server could not find the requested resource")


def _prune(obj: dict, paths: list[str]) -> dict:
    obj = copy.deepcopy(obj)
    for path in paths:
        parts = re.findall(r"[^.\[\]]+|\[\d+\]", path)
        cur: Any = obj  # (a JSON value)
        for part in parts[:-1]:
            cur = cur[int(part[1:-1])] if part.startswith("[") else cur.get(part)
            if cur is None:
                break
        else:
            if isinstance(cur, dict):
                cur.pop(parts[-1], None)
    return obj


class FaultPicker:
    """Injected API error rates: {verb: {resource: {"rate": 0.5, "code": 500}}}. 502 is not the API
    server's answer but a proxy's in front of it: an HTML page, not a Status."""

    def __init__(self):
        self.rules: dict[tuple[str, str], tuple[float, int]] = {}
        self.random = random.Random(1234)

    def set(self, verb: str, resource: str, rate: float, code: int):
        if rate <= 0:
            self.rules.pop((verb, resource), None)
        else:
            self.rules[(verb, resource)] = (rate, code)

    def maybe_fail(self, verb: str, resource: str):
        rule = self.rules.get((verb, resource)) or self.rules.get((verb, "*")) or self.rules.get(("*", resource))
        if rule and self.random.random() < rule[0]:
            if rule[1] == 429:
                raise errors.too_many_requests()
            if rule[1] == 502:
                raise errors.proxy_page(502, "Bad Gateway")
            raise errors.internal("injected fault: etcdserver: request timed out")


def make_app(cluster) -> tornado.web.Application:
    return tornado.web.Application([(r"(/.*)", ApiHandler, {"cluster": cluster})], log_function=_quiet_log)


def _quiet_log(handler):
    if handler.get_status() >= 500 and log.isEnabledFor(logging.DEBUG):
        log.debug("%s %s -> %s", handler.request.method, handler.request.uri, handler.get_status())
