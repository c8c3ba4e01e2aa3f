"""Authorization as kube-apiserver's RBAC authorizer decides it, and the 403 it answers.

Rule matching follows plugin/pkg/auth/authorizer/rbac/rbac.go and pkg/apis/rbac/v1/
evaluation_helpers.go: `*` matches any verb, group or resource; a subresource is asked for as
`resource/subresource` and matched by that or by `*/subresource`; `resourceNames` only match a
request that names an object (never a create or a list). ClusterRoleBindings grant everywhere;
RoleBindings grant in their namespace only, whether they point at a Role or a ClusterRole.
`system:masters` is never refused. The forbidden message is the API server's
(staging/src/k8s.io/apiserver/pkg/endpoints/handlers/responsewriters/errors.go).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import errors
from .auth import User
from .resources import BY_KIND

ROLE, CLUSTER_ROLE = BY_KIND["Role"], BY_KIND["ClusterRole"]
ROLE_BINDING, CLUSTER_ROLE_BINDING = BY_KIND["RoleBinding"], BY_KIND["ClusterRoleBinding"]


@dataclass(frozen=True)
class Request:
    """What is asked: a resource request, or a non-resource one (`path` set)."""

    verb: str
    group: str = ""
    resource: str = ""
    subresource: str = ""
    namespace: str = ""
    name: str = ""
    path: str = ""

    @property
    def combined_resource(self) -> str:
        return f"{self.resource}/{self.subresource}" if self.subresource else self.resource


def _has(values, wanted: str) -> bool:
    return "*" in (values or []) or wanted in (values or [])


def _resource_matches(rule: dict, req: Request) -> bool:
    for res in rule.get("resources") or []:
        if res in ("*", req.combined_resource):
            return True
        if req.subresource and res == f"*/{req.subresource}":
            return True
    return False


def _path_matches(rule: dict, path: str) -> bool:
    for pattern in rule.get("nonResourceURLs") or []:
        if pattern == "*" or pattern == path or (pattern.endswith("*") and path.startswith(pattern[:-1])):
            return True
    return False


def rule_allows(rule: dict, req: Request) -> bool:
    if not _has(rule.get("verbs"), req.verb):
        return False
    if req.path:
        return _path_matches(rule, req.path)
    if not _has(rule.get("apiGroups"), req.group) or not _resource_matches(rule, req):
        return False
    names = rule.get("resourceNames") or []
    return not names or req.name in names


def _subject_is(subject: dict, user: User, binding_namespace: str) -> bool:
    kind = subject.get("kind")
    if kind == "User":
        return subject.get("name") == user.name
    if kind == "Group":
        return subject.get("name") in user.groups
    if kind == "ServiceAccount":
        ns = subject.get("namespace") or binding_namespace
        return user.name == f"system:serviceaccount:{ns}:{subject.get('name')}"
    return False


def _rules_of(store, role_ref: dict, namespace: str) -> list[dict]:
    if role_ref.get("kind") == "ClusterRole":
        role = store.get(CLUSTER_ROLE, "", role_ref.get("name", ""))
    elif role_ref.get("kind") == "Role" and namespace:
        role = store.get(ROLE, namespace, role_ref.get("name", ""))
    else:
        role = None
    return (role or {}).get("rules") or []


def allowed(store, user: User, req: Request) -> bool:
    if user.superuser:
        return True
    bindings = [(b, "") for b in store.list(CLUSTER_ROLE_BINDING)]
    if req.namespace and not req.path:
        bindings += [(b, req.namespace) for b in store.list(ROLE_BINDING, req.namespace)]
    for binding, namespace in bindings:
        if not any(_subject_is(s, user, namespace) for s in binding.get("subjects") or []):
            continue
        if any(rule_allows(rule, req) for rule in _rules_of(store, binding.get("roleRef") or {}, namespace)):
            return True
    return False


def forbidden(user: User, req: Request) -> errors.ApiError:
    """The API server's 403 for a request no rule allows."""
    if req.path:
        return errors.ApiError(403, "Forbidden", f'forbidden: User "{user.name}" cannot {req.verb} path "{req.path}"',
                               {})
    where = f'in the namespace "{req.namespace}"' if req.namespace else "at the cluster scope"
    why = (f'User "{user.name}" cannot {req.verb} resource "{req.combined_resource}" in API group "{req.group}" '
           f"{where}")
    resource = f"{req.resource}.{req.group}" if req.group else req.resource
    subject = f'{resource} "{req.name}"' if req.name else resource
    details = {"kind": req.resource}  # empty fields are left out, as Go's omitempty does
    if req.name:
        details["name"] = req.name
    if req.group:
        details["group"] = req.group
    return errors.ApiError(403, "Forbidden", f"{subject} is forbidden: {why}", details)


def check(store, user: User, req: Request):
    if not allowed(store, user, req):
        raise forbidden(user, req)


# ---------- escalation prevention (pkg/registry/rbac/escalation_check.go, pkg/registry/rbac/
# {role,clusterrole,rolebinding,clusterrolebinding}/policybased/storage.go, validation/rule.go):
# a user writes a role, or a binding to one, only if they hold every permission it grants (in the
# binding's namespace; cluster-wide for cluster objects), or may `escalate` that role (for a role)
# or `bind` it (for a binding). system:masters, and the cluster's own controllers, may always.

def _atoms(rule: dict, namespace: str):
    """The rule as requests, one per verb and resource (and name): what holding it means."""
    verbs = rule.get("verbs") or []
    for url in rule.get("nonResourceURLs") or []:
        for verb in verbs:
            yield Request(verb, path=url)
    for group in rule.get("apiGroups") or []:
        for resource in rule.get("resources") or []:
            base, _, sub = resource.partition("/")
            for name in rule.get("resourceNames") or [""]:
                for verb in verbs:
                    yield Request(verb, group, base, sub, namespace, name)


def _compact(req: Request) -> str:
    """A missing permission as the API server writes it (rbac/v1 helpers CompactString)."""
    if req.path:
        return f'{{NonResourceURLs:["{req.path}"], Verbs:["{req.verb}"]}}'
    names = f', ResourceNames:["{req.name}"]' if req.name else ""
    return f'{{APIGroups:["{req.group}"], Resources:["{req.combined_resource}"]{names}, Verbs:["{req.verb}"]}}'


def confirm_no_escalation(store, user: User | None, kind: str, obj: dict, rules: list[dict], namespace: str,
                          waiver: Request):
    """Raise the API server's 403 if `user` writes `obj` (a role or binding of `kind`) that grants
    `rules` in `namespace` ("" cluster-wide) without holding them, unless `waiver` is allowed."""
    if user is None or user.superuser or allowed(store, user, waiver):
        return
    missing = [atom for rule in rules for atom in _atoms(rule, namespace) if not allowed(store, user, atom)]
    if not missing:
        return
    plural = {"Role": "roles", "ClusterRole": "clusterroles", "RoleBinding": "rolebindings",
              "ClusterRoleBinding": "clusterrolebindings"}[kind]
    groups = " ".join(f'"{g}"' for g in user.groups)
    name = obj["metadata"]["name"]
    raise errors.ApiError(
        403, "Forbidden", f'{plural}.rbac.authorization.k8s.io "{name}" is forbidden: user "{user.name}" '
        f"(groups=[{groups}]) is attempting to grant RBAC permissions not currently held:\n"
        + "\n".join(_compact(atom) for atom in missing),
        {"name": name, "group": "rbac.authorization.k8s.io", "kind": plural})


def waiver(kind: str, obj: dict) -> Request:
    """The permission that lets a user write a role (`escalate`) or a binding (`bind` its role)
    granting more than they hold; the API server asks the authorizer for it first."""
    if kind in ("Role", "ClusterRole"):
        namespace = obj["metadata"].get("namespace", "") if kind == "Role" else ""
        plural = "roles" if kind == "Role" else "clusterroles"
        return Request("escalate", "rbac.authorization.k8s.io", plural, "", namespace, obj["metadata"]["name"])
    namespace = obj["metadata"].get("namespace", "") if kind == "RoleBinding" else ""
    ref = obj.get("roleRef") or {}
    plural = "clusterroles" if ref.get("kind") == "ClusterRole" else "roles"
    return Request("bind", ref.get("apiGroup", "rbac.authorization.k8s.io"), plural, "", namespace,
                   ref.get("name", ""))


def check_role_write(store, user: User | None, kind: str, obj: dict):
    namespace = obj["metadata"].get("namespace", "") if kind == "Role" else ""
    confirm_no_escalation(store, user, kind, obj, obj.get("rules") or [], namespace, waiver(kind, obj))


def check_binding_write(store, user: User | None, kind: str, obj: dict):
    namespace = obj["metadata"].get("namespace", "") if kind == "RoleBinding" else ""
    ref = obj.get("roleRef") or {}
    confirm_no_escalation(store, user, kind, obj, _rules_of(store, ref, namespace), namespace, waiver(kind, obj))


# The API server's bootstrap policy (plugin/pkg/auth/authorizer/rbac/bootstrappolicy/policy.go):
# the roles every cluster has, reconciled at every start.
_DISCOVERY_URLS = ["/api", "/api/*", "/apis", "/apis/*", "/healthz", "/livez", "/openapi", "/openapi/*",
                   "/readyz", "/version", "/version/"]
_PUBLIC_INFO_URLS = ["/healthz", "/livez", "/readyz", "/version", "/version/"]


def bootstrap_objects() -> list[dict]:
    def cluster_role(name: str, rules: list[dict]) -> dict:
        return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                "metadata": {"name": name, "labels": {"kubernetes.io/bootstrapping": "rbac-defaults"}},
                "rules": rules}

    def binding(name: str, groups: list[str]) -> dict:
        return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                "metadata": {"name": name, "labels": {"kubernetes.io/bootstrapping": "rbac-defaults"}},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
                "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": g} for g in groups]}

    return [
        cluster_role("cluster-admin", [{"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]},
                                       {"nonResourceURLs": ["*"], "verbs": ["*"]}]),
        cluster_role("system:discovery", [{"nonResourceURLs": _DISCOVERY_URLS, "verbs": ["get"]}]),
        binding("system:discovery", ["system:authenticated"]),
        cluster_role("system:public-info-viewer", [{"nonResourceURLs": _PUBLIC_INFO_URLS, "verbs": ["get"]}]),
        binding("system:public-info-viewer", ["system:authenticated", "system:unauthenticated"]),
        # Who am I (kubectl auth whoami) and what may I do: every authenticated user may ask.
        cluster_role("system:basic-user", [
            {"apiGroups": ["authorization.k8s.io"], "resources": ["selfsubjectaccessreviews",
                                                                  "selfsubjectrulesreviews"], "verbs": ["create"]},
            {"apiGroups": ["authentication.k8s.io"], "resources": ["selfsubjectreviews"], "verbs": ["create"]}]),
        binding("system:basic-user", ["system:authenticated"]),
    ]


def ensure_bootstrap_policy(store):
    """Create the bootstrap roles and bindings that are missing (a cluster saved by an older
    simulator has none)."""
    for obj in bootstrap_objects():
        rt = BY_KIND[obj["kind"]]
        if store.get(rt, "", obj["metadata"]["name"]) is None:
            store.create(rt, obj)
