"""ValidatingAdmissionPolicies, evaluated as kube-apiserver 1.32 evaluates them
(staging/src/k8s.io/apiserver/pkg/admission/plugin/policy/validating: dispatcher.go, validator.go),
with Google's CEL runtime (cel-cpp, through cel-expr-python).

For a write that a binding's policy matches (its resourceRules, then every matchCondition), each
validation must be true; a false one denies with its message (or messageExpression), an
expression that errors denies under failurePolicy Fail and is skipped under Ignore. Bindings act
by their validationActions: Deny refuses, Warn and Audit do not. They run on the object as the
mutating admission left it, after the validating webhooks (kube-apiserver's plugin order).

Not modelled (the project's policy uses none; a policy that does is refused, so nothing passes
for want of a feature): paramKind, a binding's matchResources, auditAnnotations' effects.
"""

from __future__ import annotations

import dataclasses
import threading

from cel_expr_python import cel
from cel_expr_python.ext import ext_optional, ext_strings

from . import errors

VARIABLES = ("object", "oldObject", "namespaceObject", "request", "params", "variables", "authorizer")


@dataclasses.dataclass
class Verdict:
    allowed: bool
    matched: bool
    message: str = ""
    reason: str = ""


class Policy:
    """One ValidatingAdmissionPolicy, compiled once (a syntax or type error fails here, where the
    API server's type check would report it)."""

    def __init__(self, doc: dict):
        self._error_type = cel.Type.ERROR
        self.name = doc["metadata"]["name"]
        self.spec = doc["spec"]
        self.unsupported = "paramKind" in self.spec
        env = cel.NewEnv(variables={n: cel.Type.DYN for n in VARIABLES},
                         extensions=[ext_optional.ExtOptional(), ext_strings.ExtStrings()])
        self.fail_closed = self.spec.get("failurePolicy", "Fail") == "Fail"
        self.conditions = [(c["name"], env.compile(c["expression"])) for c in self.spec.get("matchConditions", [])]
        self.variables = [(v["name"], env.compile(v["expression"])) for v in self.spec.get("variables", [])]
        self.validations = [(v["expression"], env.compile(v["expression"]), v.get("message"),
                             env.compile(v["messageExpression"]) if "messageExpression" in v else None,
                             v.get("reason") or "Invalid")
                            for v in self.spec.get("validations", [])]

    def matches(self, request: dict) -> bool:
        """matchConstraints.resourceRules (with '*'), less excludeResourceRules."""
        constraints = self.spec.get("matchConstraints") or {}

        def hit(rule: dict) -> bool:
            res = request["resource"]
            resource = res["resource"] + (f"/{request['subResource']}" if request["subResource"] else "")
            return all(("*" in rule.get(key, []) or value in rule.get(key, []))
                       for key, value in (("apiGroups", res["group"]), ("apiVersions", res["version"]),
                                          ("resources", resource), ("operations", request["operation"])))
        return any(hit(r) for r in constraints.get("resourceRules", [])) and \
            not any(hit(r) for r in constraints.get("excludeResourceRules", []))

    def _failed(self, what: str) -> Verdict:
        return Verdict(not self.fail_closed, True, what, "Invalid")

    def admit(self, request: dict, obj: dict | None, old: dict | None, namespace: dict | None) -> Verdict:
        if not self.matches(request):
            return Verdict(True, False)
        if self.unsupported:
            return Verdict(False, True, "the simulator does not evaluate policies with paramKind", "Invalid")
        data: dict = {"object": obj, "oldObject": old, "namespaceObject": namespace, "request": request,
                      "params": None, "variables": {}, "authorizer": None}
        for name, condition in self.conditions:
            value = condition.eval(data=data)
            if value.type() == self._error_type:
                return self._failed(f"failed to evaluate matchCondition {name}: {value.value()}")
            if value.value() is not True:
                return Verdict(True, False)
        for name, expr in self.variables:
            data["variables"] = {**data["variables"], name: expr.eval(data=data).plain_value()}
        for source, expr, message, message_expr, reason in self.validations:
            value = expr.eval(data=data)
            if value.type() == self._error_type:
                verdict = self._failed(f"expression '{source}' resulted in error: {value.value()}")
                if not verdict.allowed:
                    return verdict
                continue
            if value.value() is not True:
                text = message_expr.eval(data=data).value() if message_expr else message
                return Verdict(False, True, text or f"failed expression: {source}", reason)
        return Verdict(True, True)


class Policies:
    """The cluster's stored policies and bindings, each policy compiled once per version of it."""

    def __init__(self, store):
        self.store = store
        self._compiled: dict[tuple[str, str], Policy] = {}
        self._lock = threading.Lock()

    def _policy(self, doc: dict) -> Policy:
        key = (doc["metadata"]["uid"], doc["metadata"]["resourceVersion"])
        with self._lock:
            if key not in self._compiled:
                self._compiled = {k: v for k, v in self._compiled.items() if k[0] != key[0]}
                self._compiled[key] = Policy(doc)
            return self._compiled[key]

    def check(self, rt, request: dict, obj: dict | None, old: dict | None, namespace: dict | None) -> None:
        """Raise the API server's refusal when a binding with the Deny action denies the request."""
        from .resources import BY_KIND
        bindings = self.store.list(BY_KIND["ValidatingAdmissionPolicyBinding"])
        if not bindings:
            return
        by_name = {p["metadata"]["name"]: p for p in self.store.list(BY_KIND["ValidatingAdmissionPolicy"])}
        for binding in sorted(bindings, key=lambda b: b["metadata"]["name"]):
            spec = binding.get("spec") or {}
            doc = by_name.get(spec.get("policyName", ""))
            if doc is None or "Deny" not in (spec.get("validationActions") or []):
                continue
            verdict = self._policy(doc).admit(request, obj, old, namespace)
            if spec.get("matchResources") or spec.get("paramRef"):
                verdict = Verdict(False, True, "the simulator does not evaluate bindings with matchResources or "
                                               "paramRef", "Invalid") if verdict.matched else verdict
            if not verdict.allowed:
                message = (f"ValidatingAdmissionPolicy '{doc['metadata']['name']}' with binding "
                           f"'{binding['metadata']['name']}' denied request: {verdict.message}")
                raise refusal(rt, request["name"], message, verdict.reason)


CODES = {"Unauthorized": 401, "Forbidden": 403, "RequestEntityTooLarge": 413, "Invalid": 422}


def refusal(rt, name: str, message: str, reason: str) -> errors.ApiError:
    """admission.NewForbidden's wording with the validation's reason and its code (dispatcher.go)."""
    details = {"name": name, "kind": rt.plural, "causes": [{"message": message}]}
    if rt.group:
        details["group"] = rt.group
    return errors.ApiError(CODES.get(reason, 422), reason, f'{rt.group_resource} "{name}" is forbidden: {message}',
                           details)


def request_of(rt, version: str, operation: str, name: str, namespace: str, sub: str | None, user,
               dry_run: bool) -> dict:
    """The AdmissionRequest a policy sees as `request`."""
    return {"operation": operation, "name": name, "namespace": namespace if rt.namespaced else "",
            "userInfo": {"username": user.name, "groups": list(user.groups)},
            "resource": {"group": rt.group, "version": version, "resource": rt.plural},
            "kind": {"group": rt.group, "version": version, "kind": rt.kind},
            "subResource": sub or "", "dryRun": dry_run}
