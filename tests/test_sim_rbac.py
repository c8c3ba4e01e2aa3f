"""The simulator's authentication and authorization: ServiceAccount tokens from the TokenRequest
API, RBAC as kube-apiserver evaluates it, the API server's 401/403 bodies, and CDI's clone
permission check."""

from __future__ import annotations

import base64
import json
import uuid

import pytest
import requests
from kubernetes import client

from kube_objects import CDI, GOLDEN, KV, clone_dv, vm
from simtools import api_client_for, http, service_account_kubeconfig

RBAC = "rbac.authorization.k8s.io"


@pytest.fixture
def bot(sim, ns, tmp_path):
    """A ServiceAccount `bot` in the test's namespace, with no permissions yet: (core API, raw session)."""
    api = api_client_for(service_account_kubeconfig(sim, ns, "bot", tmp_path / "bot.kubeconfig"))
    raw = requests.Session()
    raw.trust_env = False
    raw.verify = sim.ca_file
    raw.headers["Authorization"] = api.configuration.get_api_key_with_prefix("BearerToken")
    return client.CoreV1Api(api), client.CustomObjectsApi(api), raw


def grant(ns: str | None, rules: list[dict], subject_ns: str, name: str | None = None, cluster_role: bool = False,
          kube=None):
    """Bind `rules` to the ServiceAccount bot: a Role + RoleBinding in `ns`, a ClusterRole +
    RoleBinding in `ns` (cluster_role), or a ClusterRole + ClusterRoleBinding (ns None)."""
    rbac = client.RbacAuthorizationV1Api(kube)
    name = name or f"r-{uuid.uuid4().hex[:6]}"
    subject = [{"kind": "ServiceAccount", "name": "bot", "namespace": subject_ns}]
    if ns is None or cluster_role:
        rbac.create_cluster_role({"metadata": {"name": name}, "rules": rules})
        ref = {"apiGroup": RBAC, "kind": "ClusterRole", "name": name}
    else:
        rbac.create_namespaced_role(ns, {"metadata": {"name": name}, "rules": rules})
        ref = {"apiGroup": RBAC, "kind": "Role", "name": name}
    if ns is None:
        rbac.create_cluster_role_binding({"metadata": {"name": name}, "roleRef": ref, "subjects": subject})
    else:
        rbac.create_namespaced_role_binding(ns, {"metadata": {"name": name}, "roleRef": ref, "subjects": subject})
    return name


def refusal(call) -> dict:
    with pytest.raises(client.ApiException) as e:
        call()
    return {**json.loads(e.value.body), "status": e.value.status}  # the HTTP status, not "Failure"


def test_token_request_issues_bound_service_account_tokens(sim, core, ns, bot):
    """pkg/registry/core/serviceaccount/storage/token.go and pkg/serviceaccount/claims.go: a
    TokenRequest answers with a JWT for `system:serviceaccount:NS:NAME`, bound to the account's
    uid; expirationSeconds below 10 minutes is refused; a token of a deleted account is 401
    (staging/src/k8s.io/apiserver/pkg/endpoints/filters/authentication.go)."""
    bot_core, _, raw = bot
    tr = core.create_namespaced_service_account_token("bot", ns, {"spec": {}})
    assert tr.spec.expiration_seconds == 3600 and tr.status.expiration_timestamp is not None
    claims = json.loads(base64.urlsafe_b64decode(tr.status.token.split(".")[1] + "=="))
    assert claims["sub"] == f"system:serviceaccount:{ns}:bot"
    account = core.read_namespaced_service_account("bot", ns)
    assert claims["kubernetes.io"]["serviceaccount"] == {"name": "bot", "uid": account.metadata.uid}
    short = refusal(lambda: core.create_namespaced_service_account_token("bot", ns, {"spec": {"expirationSeconds": 60}}))
    assert short["status"] == 422 and short["message"] == (
        'TokenRequest.authentication.k8s.io "" is invalid: spec.expirationSeconds: Invalid value: 60: '
        "may not specify a duration less than 10 minutes")

    # Authenticated, and allowed nothing beyond discovery.
    assert raw.get(f"{sim.url}/api").status_code == 200
    no = refusal(lambda: bot_core.list_namespaced_pod(ns))
    assert no["status"] == 403 and no["reason"] == "Forbidden"
    assert no["message"] == (f'pods is forbidden: User "system:serviceaccount:{ns}:bot" cannot list resource "pods" '
                             f'in API group "" in the namespace "{ns}"')
    assert no["details"] == {"kind": "pods"}

    # Not a token at all, and the token of an account that is gone: 401, the API server's body.
    garbage = requests.get(f"{sim.url}/api/v1/namespaces/{ns}/pods", verify=sim.ca_file,
                           headers={"Authorization": "Bearer not-a-token"})
    assert garbage.status_code == 401 and garbage.json() == {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": "Unauthorized",
        "reason": "Unauthorized", "code": 401}
    core.delete_namespaced_service_account("bot", ns)
    assert raw.get(f"{sim.url}/api").status_code == 401
    # Re-created under the same name, it is another account: the old token stays dead.
    core.create_namespaced_service_account(ns, {"metadata": {"name": "bot"}})
    assert raw.get(f"{sim.url}/api").status_code == 401


def test_anonymous_requests_get_the_public_info_only(sim):
    """plugin/pkg/auth/authorizer/rbac/bootstrappolicy/policy.go: system:public-info-viewer lets
    anyone read /version and /healthz; discovery is for authenticated users only."""
    anonymous = requests.Session()
    anonymous.trust_env = False
    anonymous.verify = sim.ca_file
    assert anonymous.get(f"{sim.url}/version").json()["minor"] == "32"
    r = anonymous.get(f"{sim.url}/api")
    assert r.status_code == 403 and r.json()["message"] == 'forbidden: User "system:anonymous" cannot get path "/api"'
    r = anonymous.get(f"{sim.url}/api/v1/nodes")
    assert r.json()["message"] == ('nodes is forbidden: User "system:anonymous" cannot list resource "nodes" in API '
                                   'group "" at the cluster scope')


def test_roles_grant_in_their_namespace_and_cluster_roles_everywhere(sim, core, ns, bot, kube):
    """pkg/registry/rbac/validation/rule.go: a RoleBinding grants in its own namespace only, even
    when it points at a ClusterRole; a ClusterRoleBinding grants in every namespace and at the
    cluster scope. Forbidden messages as responsewriters/errors.go writes them."""
    bot_core, _, _ = bot
    other = f"t-{uuid.uuid4().hex[:8]}"
    core.create_namespace({"metadata": {"name": other}})
    for n in (ns, other):
        core.create_namespaced_config_map(n, {"metadata": {"name": "c"}})
    grant(ns, [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list"]}], ns, kube=kube)
    assert [c.metadata.name for c in bot_core.list_namespaced_config_map(ns).items] == ["c"]
    no = refusal(lambda: bot_core.read_namespaced_config_map("c", other))
    assert no["message"] == (f'configmaps "c" is forbidden: User "system:serviceaccount:{ns}:bot" cannot get resource '
                             f'"configmaps" in API group "" in the namespace "{other}"')
    no = refusal(lambda: bot_core.list_config_map_for_all_namespaces())
    assert no["message"].endswith('cannot list resource "configmaps" in API group "" at the cluster scope')

    # A ClusterRole bound by a RoleBinding: still this namespace only.
    grant(ns, [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["list"]}], ns, cluster_role=True, kube=kube)
    bot_core.list_namespaced_secret(ns)
    assert refusal(lambda: bot_core.list_namespaced_secret(other))["status"] == 403
    # A ClusterRoleBinding: everywhere.
    grant(None, [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["list"]}], ns, kube=kube)
    bot_core.list_namespaced_secret(other)
    bot_core.list_secret_for_all_namespaces()


def test_subresources_and_resource_names(sim, ns, bot, kube, custom):
    """pkg/apis/rbac/v1/evaluation_helpers.go: `virtualmachines` does not cover the
    `virtualmachines/start` subresource (only `*`, the exact pair or `*/start` do); resourceNames
    match requests that name an object, never a list or a create. KubeVirt's start is an `update`
    in API group subresources.kubevirt.io (pkg/virt-api/api.go)."""
    _, bot_custom, raw = bot
    custom.create_namespaced_custom_object(*KV, ns, "virtualmachines", vm("m", "m-disk"))
    custom.create_namespaced_custom_object(*KV, ns, "virtualmachines", vm("n", "n-disk"))
    grant(ns, [{"apiGroups": ["kubevirt.io"], "resources": ["virtualmachines"], "verbs": ["*"]}], ns, kube=kube)
    start = f"{sim.url}/apis/subresources.kubevirt.io/v1/namespaces/{ns}/virtualmachines/m/start"
    r = raw.put(start, json={})
    assert r.status_code == 403 and r.json()["message"] == (
        f'virtualmachines.subresources.kubevirt.io "m" is forbidden: User "system:serviceaccount:{ns}:bot" cannot '
        f'update resource "virtualmachines/start" in API group "subresources.kubevirt.io" in the namespace "{ns}"')
    assert r.json()["details"] == {"name": "m", "group": "subresources.kubevirt.io", "kind": "virtualmachines"}
    grant(ns, [{"apiGroups": ["subresources.kubevirt.io"], "resources": ["*/start"], "verbs": ["update"]}], ns, kube=kube)
    assert raw.put(start, json={}).status_code == 202
    assert raw.put(start.replace("/start", "/stop"), json={}).status_code == 403

    grant(ns, [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list", "create"],
                "resourceNames": ["allowed"]}], ns, kube=kube)
    base = f"{sim.url}/api/v1/namespaces/{ns}/configmaps"
    http(sim).post(base, json={"metadata": {"name": "allowed"}}).raise_for_status()
    assert raw.get(f"{base}/allowed").status_code == 200
    assert raw.get(f"{base}/other").status_code == 403
    assert raw.get(base).status_code == 403
    assert raw.post(base, json={"metadata": {"name": "allowed"}}).status_code == 403


def test_cdi_webhook_checks_clone_permission_in_the_source_namespace(sim, core, ns, bot, kube, custom):
    """CDI's DataVolume mutating webhook (pkg/apiserver/webhooks/datavolume-mutate.go and
    staging/src/kubevirt.io/containerized-data-importer-api/pkg/apis/core/v1beta1/authorize.go):
    on create and on update, a cross-namespace clone needs `create datavolumes/source` (or
    `create pods`) in the source namespace; the denial is the webhook's 422 with CDI's sentence,
    same-namespace clones are not checked, an allowed create carries the clone token."""
    _, bot_custom, _ = bot
    grant(ns, [{"apiGroups": ["cdi.kubevirt.io"], "resources": ["datavolumes"], "verbs": ["create", "patch"]}], ns,
          kube=kube)
    no = refusal(lambda: bot_custom.create_namespaced_custom_object(*CDI, ns, "datavolumes", clone_dv("d")))
    why = f"User system:serviceaccount:{ns}:bot has insufficient permissions in clone source namespace vm-images"
    assert no["status"] == 422
    assert no["message"] == f'admission webhook "datavolume-mutate.cdi.kubevirt.io" denied the request:  {why}'
    assert no["details"]["causes"] == [{"reason": "FieldValueInvalid", "message": why,
                                        "field": "spec.source.PVC.namespace"}]
    assert custom.list_namespaced_custom_object(*CDI, ns, "datavolumes")["items"] == []

    source = grant(GOLDEN["namespace"], [{"apiGroups": ["cdi.kubevirt.io"], "resources": ["datavolumes/source"],
                                          "verbs": ["create"]}], ns, kube=kube)
    made = bot_custom.create_namespaced_custom_object(*CDI, ns, "datavolumes", clone_dv("d"))
    assert made["metadata"]["annotations"]["cdi.kubevirt.io/storage.clone.token"]
    # Updates are checked again: without the permission, not even a label changes.
    client.RbacAuthorizationV1Api(kube).delete_namespaced_role_binding(source, GOLDEN["namespace"])
    label = {"metadata": {"labels": {"x": "y"}}}
    assert refusal(lambda: bot_custom.patch_namespaced_custom_object(*CDI, ns, "datavolumes", "d", label))[
        "status"] == 422
    # The fallback: whoever may create pods there may clone from there.
    grant(GOLDEN["namespace"], [{"apiGroups": [""], "resources": ["pods"], "verbs": ["create"]}], ns, kube=kube)
    bot_custom.patch_namespaced_custom_object(*CDI, ns, "datavolumes", "d", label)

    # A clone inside one namespace is not checked; a source namespace that does not exist is a 400.
    same = clone_dv("local")
    same["spec"]["source"]["pvc"] = {"namespace": ns, "name": "d"}
    bot_custom.create_namespaced_custom_object(*CDI, ns, "datavolumes", same)
    nowhere = clone_dv("far")
    nowhere["spec"]["source"]["pvc"] = {"namespace": "no-such-namespace", "name": "x"}
    missing = refusal(lambda: bot_custom.create_namespaced_custom_object(*CDI, ns, "datavolumes", nowhere))
    assert missing["status"] == 400 and missing["message"].endswith('denied the request: namespaces '
                                                                    '"no-such-namespace" not found')


def test_a_binding_keeps_its_role(kube, ns):
    """pkg/apis/rbac/validation/validation.go: roleRef is immutable and of a supported kind."""
    rbac = client.RbacAuthorizationV1Api(kube)
    ref = {"apiGroup": RBAC, "kind": "ClusterRole", "name": "view"}
    rbac.create_namespaced_role_binding(ns, {"metadata": {"name": "b"}, "roleRef": ref, "subjects": []})
    moved = refusal(lambda: rbac.patch_namespaced_role_binding("b", ns, {"roleRef": {**ref, "name": "edit"}}))
    assert moved["status"] == 422 and moved["message"].endswith("cannot change roleRef")
    odd = refusal(lambda: rbac.create_cluster_role_binding({"metadata": {"name": f"b-{ns}"},
                                                            "roleRef": {**ref, "kind": "Role"}, "subjects": []}))
    assert odd["status"] == 422 and 'supported values: "ClusterRole"' in odd["message"]


def test_nobody_grants_what_they_do_not_hold(sim, ns, bot, kube):
    """pkg/registry/rbac/rolebinding/policybased/storage.go and escalation_check.go: a user may
    bind a role only if they hold all it grants in the binding's namespace (validation/rule.go
    ConfirmNoEscalation) or may `bind` that role; write a role only if they hold its rules or may
    `escalate` it. (What a hub that makes RoleBindings in users' namespaces meets.)"""
    rbac = client.RbacAuthorizationV1Api(kube)
    bot_rbac = client.RbacAuthorizationV1Api(bot[0].api_client)
    writes = [{"apiGroups": [RBAC], "resources": ["rolebindings", "roles"], "verbs": ["create"]}]
    grant(ns, writes, ns, kube=kube)
    rbac.create_cluster_role({"metadata": {"name": f"pods-{ns}"},
                              "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]}]})
    binding = {"metadata": {"name": "b1"}, "roleRef": {"apiGroup": RBAC, "kind": "ClusterRole", "name": f"pods-{ns}"},
               "subjects": [{"kind": "ServiceAccount", "name": "default", "namespace": ns}]}
    no = refusal(lambda: bot_rbac.create_namespaced_role_binding(ns, binding))
    assert no["status"] == 403 and no["message"] == (
        f'rolebindings.rbac.authorization.k8s.io "b1" is forbidden: user "system:serviceaccount:{ns}:bot" '
        f'(groups=["system:serviceaccounts" "system:serviceaccounts:{ns}" "system:authenticated"]) is attempting '
        'to grant RBAC permissions not currently held:\n{APIGroups:[""], Resources:["pods"], Verbs:["get"]}\n'
        '{APIGroups:[""], Resources:["pods"], Verbs:["list"]}'), no["message"]
    # `bind` on that one ClusterRole, in this namespace: allowed
    grant(ns, [{"apiGroups": [RBAC], "resources": ["clusterroles"], "verbs": ["bind"],
                "resourceNames": [f"pods-{ns}"]}], ns, kube=kube)
    bot_rbac.create_namespaced_role_binding(ns, binding)
    # holding what a role grants is enough too; granting more is not
    grant(ns, [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get"]}], ns, kube=kube)
    bot_rbac.create_namespaced_role(ns, {"metadata": {"name": "cm"},
                                         "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get"]}]})
    wider = refusal(lambda: bot_rbac.create_namespaced_role(ns, {"metadata": {"name": "all"}, "rules": [
        {"apiGroups": [""], "resources": ["*"], "verbs": ["*"]}]}))
    assert wider["status"] == 403 and wider["message"].endswith(
        '{APIGroups:[""], Resources:["*"], Verbs:["*"]}'), wider["message"]
