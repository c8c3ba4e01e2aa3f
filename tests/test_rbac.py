"""The hub's least-privilege RBAC (deploy/rbac/): enough for every call the spawner makes
(sufficient), every rule needed (minimal), and a missing permission explained.

The cluster side is the simulator's RBAC, which decides as kube-apiserver's authorizer does
(plugin/pkg/auth/authorizer/rbac/rbac.go), and CDI's clone check on DataVolume create and update
(pkg/apiserver/webhooks/datavolume-mutate.go)."""

from __future__ import annotations

import copy
import dataclasses
import logging
import uuid

import pytest

from kubevirt_spawner import kube as k
from kubevirt_spawner import manifests as m
from kubevirt_spawner import names
from kubevirt_spawner.objects import condition
from kubevirt_spawner.reflector import Caches
from kubevirt_spawner.workstation import Settings, Workstation, WorkstationError

from simtools import (
    HUB_NAMESPACE,
    HUB_SERVICE_ACCOUNT,
    apply,
    http,
    hub_kubeconfig,
    hub_rbac_objects,
    sim_api,
    start_sim,
)

HUB_USER = f"system:serviceaccount:{HUB_NAMESPACE}:{HUB_SERVICE_ACCOUNT}"


@pytest.fixture(scope="module")
def rsim(tmp_path_factory):
    s = start_sim(tmp_path_factory.mktemp("rbac"), guest_mode="null", speed=100)
    yield s
    s.stop()


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(f"{record.levelname} {record.getMessage()}")


@dataclasses.dataclass
class Outcome:
    error: WorkstationError | None
    lines: list[str]

    @property
    def complaints(self) -> list[str]:
        """What a missing permission leaves: the start's or stop's error and the admin's log lines."""
        found = [line for line in self.lines if "permission missing" in line or "cannot read" in line]
        return found + ([self.error.message] if self.error else [])


async def lifecycle(sim, kubeconfig: str) -> Outcome:
    """Everything the spawner does with a workstation, as the hub would, with the given credentials:
    a first start (clone, create), a second start while it runs (restart with a new token), a stop,
    a start with a bigger profile (template replaced, disk grown), a stop, two snapshots taken and
    one deleted, a restore, and the deletion that keeps disks and snapshots."""
    user = f"u{uuid.uuid4().hex[:6]}"
    log = logging.getLogger(f"hub-{user}")
    log.propagate = False
    log.setLevel(logging.INFO)
    lines = Lines()
    log.addHandler(lines)
    kube = k.Kube(k.load_api_client(kubeconfig), log, retry_timeout=5)
    caches = Caches(kube, m.LABEL_WORKSTATION)
    settings = Settings(url_mode="cluster-ip", start_timeout=60, stop_timeout=20,
                        network_policy_from=({"namespaceSelector": {"matchLabels": {
                            "kubernetes.io/metadata.name": HUB_NAMESPACE}}},),
                        namespace_quota={"requests.storage": "1Ti"},
                        namespace_limits=({"type": "PersistentVolumeClaim", "max": {"storage": "500Gi"}},))
    spec = m.MachineSpec(workspace_disk_size="10Gi")
    ident = names.identity(user)
    error = None
    try:
        ws = Workstation(kube, caches, ident, spec, settings, log)
        await ws.start({"JUPYTERHUB_API_TOKEN": "t1"}, [])
        await ws.start({"JUPYTERHUB_API_TOKEN": "t2"}, [])
        await ws.stop()
        bigger = dataclasses.replace(spec, cpu="4", root_disk_size="80Gi")
        ws = Workstation(kube, caches, ident, bigger, settings, log)
        await ws.start({"JUPYTERHUB_API_TOKEN": "t3"}, [])
        await caches.wait_for(lambda: condition(ws.vmi, "AgentConnected"), 30)
        assert await ws.filesystems()  # the workstations service's disk usage
        await ws.stop()
        assert await ws.snapshots_size() == 0
        assert [q["name"] for q in await ws.quotas()] == ["kubevirt-spawner"]  # the service's status
        await ws.take_snapshot("before")
        await ws.take_snapshot("scratch")
        await ws.delete_snapshot("scratch")
        await ws.restore_snapshot("before", f"{user}-restore")
        await ws.delete_root_disk()  # a reset
        await ws.clone_root_disk()
        await ws.retire()
    except WorkstationError as err:
        error = err
    finally:
        caches.stop()
        await kube.aclose()
        log.removeHandler(lines)
    return Outcome(error, lines.lines)


async def test_the_hub_runs_on_deploy_rbac_and_uses_every_permission_it_grants(rsim, tmp_path):
    """Sufficient: the whole lifecycle works with the ServiceAccount bound to deploy/rbac/, without
    a single refusal. And nothing granted is unused: every verb on every resource of the
    ClusterRoles (the cluster-wide one and the one it binds in each user namespace) shows in what the
    API server authorized for the hub."""
    kubeconfig = hub_kubeconfig(rsim, tmp_path / "hub.kubeconfig")
    sim_api(rsim, "DELETE", "/authorized")
    outcome = await lifecycle(rsim, kubeconfig)
    assert outcome.error is None and outcome.complaints == []
    used = {(a["verb"], a["group"], a["resource"]) for a in sim_api(rsim, "GET", "/authorized")["authorized"]
            if a["user"] == HUB_USER}
    granted = {(verb, group, resource) for role in hub_rbac_objects() if role["kind"] == "ClusterRole"
               for rule in role["rules"] for verb in rule["verbs"]
               for group in rule["apiGroups"] for resource in rule["resources"]}
    assert granted - used == set(), "granted but never used"


def _without(objects: list[dict], name: str, index: int, verb: str) -> list[dict]:
    """The RBAC with one verb less in one rule of role `name` (the rule gone when that was its only verb)."""
    out = copy.deepcopy(objects)
    role = next(o for o in out if o["kind"] in ("ClusterRole", "Role") and o["metadata"]["name"] == name)
    role["rules"][index]["verbs"].remove(verb)
    if not role["rules"][index]["verbs"]:
        del role["rules"][index]
    return out


def _grants() -> list:
    return [pytest.param(obj["metadata"]["name"], i, verb, rule["resources"],
                         id=f"{obj['metadata']['name']}-{rule['resources'][0]}-{verb}")
            for obj in hub_rbac_objects() if obj["kind"] in ("ClusterRole", "Role")
            for i, rule in enumerate(obj["rules"]) for verb in rule["verbs"]]


@pytest.mark.parametrize("role,index,verb,resources", _grants())
async def test_every_permission_is_needed_and_its_absence_is_explained(rsim, tmp_path, role, index, verb, resources):
    """Minimal: without any one rule, or any one verb of a rule, the lifecycle meets a refusal. The
    admin gets one log line per refused request, naming it and the cluster's reason (the verb and
    resource); a start or stop that cannot go on tells the user in one sentence to ask the
    administrator."""
    objects = _without(hub_rbac_objects(), role, index, verb)
    kubeconfig = hub_kubeconfig(rsim, tmp_path / "hub.kubeconfig", objects)
    try:
        outcome = await lifecycle(rsim, kubeconfig)
    finally:
        for obj in hub_rbac_objects():  # put the full RBAC back for the next test
            apply(rsim, obj)
    assert outcome.complaints, f"nothing failed without {verb} on {resources}"
    # The complaint names what is missing: the authorizer's words, a cache that cannot be read, or
    # CDI's clone check.
    wanted = [f'cannot {verb} resource "{r}"' for r in resources] + [f"cannot read {r} " for r in resources]
    if resources == ["datavolumes/source"]:
        wanted.append("insufficient permissions in clone source namespace vm-images")
    if resources == ["clusterroles"]:  # binding a role it may not bind (escalation_check.go)
        wanted.append("is attempting to grant RBAC permissions not currently held")
    assert [line for line in outcome.complaints if any(w in line for w in wanted)], outcome.complaints
    if outcome.error is not None:
        assert outcome.error.reason == "forbidden"
        assert "Tell your administrator" in outcome.error.message
        refusals = [line for line in outcome.lines if "permission missing" in line or "cannot read" in line]
        assert refusals and len(set(refusals)) == len(refusals), outcome.lines  # each refused request once


async def test_only_the_authorizers_refusals_are_missing_permissions(rsim, tmp_path):
    """A 403 is a missing permission only in the authorizer's words (responsewriters/errors.go);
    a quota's 403 (plugin/pkg/admission/resourcequota) is not. CDI's 422 for a clone from a
    namespace the hub may not read is one."""
    admin = k.Kube(k.load_api_client(rsim.kubeconfig), logging.getLogger("admin"))
    ns = f"q-{uuid.uuid4().hex[:6]}"
    await admin.create(k.NAMESPACE, {"metadata": {"name": ns}})
    await admin.create(k.Kind("ResourceQuota", "", "v1", "resourcequotas"),
                       {"metadata": {"name": "none", "namespace": ns}, "spec": {"hard": {"persistentvolumeclaims": "0"}}})
    claim = {"metadata": {"name": "c", "namespace": ns}, "spec": {"accessModes": ["ReadWriteOnce"],
                                                                 "resources": {"requests": {"storage": "1Gi"}}}}
    with pytest.raises(k.KubeError) as quota:
        await admin.create(k.PVC, claim)
    assert quota.value.status == 403 and "exceeded quota" in quota.value.message
    assert not quota.value.permission_denied

    hub = k.Kube(k.load_api_client(hub_kubeconfig(rsim, tmp_path / "hub.kubeconfig")), logging.getLogger("hub"))
    with pytest.raises(k.KubeError) as rbac:
        await hub.create(k.PVC, claim)
    assert rbac.value.status == 403 and rbac.value.permission_denied
    golden_role = next(o for o in hub_rbac_objects() if o["kind"] == "RoleBinding")
    bindings = f"{rsim.url}/apis/rbac.authorization.k8s.io/v1/namespaces/vm-images/rolebindings/"
    http(rsim).delete(bindings + golden_role["metadata"]["name"]).raise_for_status()
    ident = names.identity(f"c{uuid.uuid4().hex[:6]}")
    await admin.create(k.NAMESPACE, m.namespace(ident))
    await admin.create(k.ROLE_BINDING, m.hub_role_binding(ident.namespace, HUB_USER))  # as the hub binds itself
    try:
        with pytest.raises(k.KubeError) as clone:
            await hub.create(k.DV, m.root_datavolume(ident, m.MachineSpec()))
    finally:
        apply(rsim, golden_role)
    assert clone.value.status == 422 and clone.value.permission_denied
    await admin.aclose()
    await hub.aclose()


def test_nothing_in_deploy_rbac_is_a_wildcard():
    """No `*` in any rule's groups, resources, verbs or names, and no rule without resources (a
    nonResourceURLs rule): every permission is named."""
    rules = [rule for obj in hub_rbac_objects() if obj["kind"] in ("ClusterRole", "Role") for rule in obj["rules"]]
    assert rules
    for rule in rules:
        assert rule.get("resources") and "nonResourceURLs" not in rule, rule
        for field in ("apiGroups", "resources", "verbs", "resourceNames"):
            assert not any("*" in value for value in rule.get(field) or []), rule


async def test_the_hub_reaches_nothing_outside_the_namespaces_it_is_bound_in(rsim, tmp_path):
    """Bound to deploy/rbac/, the hub holds nothing namespaced cluster-wide: a tenant's VM in
    another namespace (its cloud-init user data holding a password) cannot be listed, read, started,
    stopped or restarted by the hub (virt-api authorizes the subresources as `update
    virtualmachines/start` and so on: pkg/virt-api/rest/authorizer.go), nor its guest's filesystems,
    Secrets or Events read. The hub cannot bind itself cluster-wide, nor bind any role but its own
    (pkg/registry/rbac/escalation_check.go: binding cluster-admin is refused). RBAC cannot say where
    or to whom the hub binds its own role: that it binds it only to itself and only in users'
    namespaces is the admission policy's part (tests/test_deploy_admission.py), which the simulator
    does not run."""
    admin = k.Kube(k.load_api_client(rsim.kubeconfig), logging.getLogger("admin"))
    hub = k.Kube(k.load_api_client(hub_kubeconfig(rsim, tmp_path / "hub.kubeconfig")), logging.getLogger("hub"),
                 retry_timeout=2)
    tenant = f"tenant-{uuid.uuid4().hex[:6]}"
    await admin.create(k.NAMESPACE, {"metadata": {"name": tenant}})
    vm = m.virtual_machine(names.identity("infra"), m.MachineSpec())
    vm["metadata"] = {"name": "billing-db", "namespace": tenant}
    vm["spec"]["template"]["spec"]["volumes"] = [
        v for v in vm["spec"]["template"]["spec"]["volumes"] if "cloudInitNoCloud" not in v] + [
        {"name": "cloudinit", "cloudInitNoCloud": {"userData": "#cloud-config\npassword: hunter2\n"}}]
    await admin.create(k.VM, vm)
    refused = {
        "list VMs everywhere": hub.call("GET", k.VM.path()),
        "list the tenant's VMs": hub.call("GET", k.VM.path(tenant)),
        "start": hub.vm_action(tenant, "billing-db", "start"),
        "stop": hub.vm_action(tenant, "billing-db", "stop"),
        "restart": hub.vm_action(tenant, "billing-db", "restart"),
        "filesystems": hub.call("GET", k.VMI_SUBRESOURCES.path(tenant, "billing-db", "filesystemlist")),
        "list Events everywhere": hub.call("GET", k.EVENT.path()),
        "list the tenant's Secrets": hub.call("GET", k.SECRET.path(tenant)),
        "list disks everywhere": hub.call("GET", k.PVC.path()),
        "bind itself cluster-wide": hub.create(k.Kind("ClusterRoleBinding", "rbac.authorization.k8s.io", "v1",
                                                      "clusterrolebindings", namespaced=False), {
            "metadata": {"name": "hub-everywhere"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": m.HUB_NAMESPACED_ROLE},
            "subjects": [m.rbac_subject(HUB_USER)]}),
        "bind cluster-admin": hub.create(k.ROLE_BINDING, {
            **m.hub_role_binding(tenant, HUB_USER),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"}}),
    }
    for what, call in refused.items():
        with pytest.raises(k.KubeError) as err:
            await call
        assert err.value.status == 403 and ("cannot" in err.value.message or "not currently held" in
                                            err.value.message), what
    vms = (await admin.call("GET", k.VM.path(tenant)))["items"]
    assert [v["spec"]["runStrategy"] for v in vms] == ["Halted"]  # never started
    # The same calls in a user namespace it is bound in go through (these credentials do work).
    user = names.identity(f"t{uuid.uuid4().hex[:6]}")
    await admin.create(k.NAMESPACE, m.namespace(user))
    await hub.create(k.ROLE_BINDING, m.hub_role_binding(user.namespace, HUB_USER))
    await admin.create(k.VM, {**vm, "metadata": {"name": "own", "namespace": user.namespace}})
    assert [v["metadata"]["name"] for v in (await hub.call("GET", k.VM.path(user.namespace)))["items"]] == ["own"]
    await hub.vm_action(user.namespace, "own", "start")
    await admin.aclose()
    await hub.aclose()
