"""What the cluster adds by itself to what the hub writes, through the simulator's request path
(kubevirt_spawner/sim/server.py `_validate`, mutation.py, policies.py), as upstream does it:

- Kubernetes 1.32's scheme defaults (pkg/apis/core/v1/defaults.go, networking/v1 and rbac/v1
  defaults.go);
- KubeVirt v1.9's VM mutator (pkg/virt-api/webhooks/mutating-webhook/mutators/vm-mutator.go; its
  cases in vm-mutator_test.go: firmware UUID and serial on create and never on update, amd64 and
  q35 defaults, the PCI topology annotation v3 on q35 and not on i440fx, an existing version kept);
- virt-controller's write-backs (pkg/virt-controller/watch/vm/firmware.go Sync, vm.go
  syncPCITopologyAnnotationsToVM and SetLatestApiVersionAnnotation);
- then the hub's ValidatingAdmissionPolicy on the mutated object (kube-apiserver's
  staging/src/k8s.io/apiserver/pkg/admission/plugin/policy/validating/dispatcher.go wording).

Each object is sent as the hub sends it and read back as the cluster keeps it: nothing here is an
object built by hand the way the cluster would have changed it.
"""

from __future__ import annotations

import copy
import uuid

import pytest

from kubevirt_spawner import manifests as m
from kubevirt_spawner import names
from kubevirt_spawner.sim.isos import firmware_uuid

from simtools import http, hub_kubeconfig, start_sim, wait_for

IDENT = names.identity("carla")
SPEC = m.MachineSpec()
HUB = "system:serviceaccount:jupyterhub:hub"
VMS = "/apis/kubevirt.io/v1/namespaces/{ns}/virtualmachines"


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    sim = start_sim(tmp_path_factory.mktemp("chain"), guest_mode="null")
    kubeconfig = hub_kubeconfig(sim, tmp_path_factory.mktemp("chain-hub") / "hub.kubeconfig")
    token = next(line.split(":", 1)[1].strip() for line in open(kubeconfig) if "token:" in line)
    hub = {"Authorization": f"Bearer {token}"}
    r = http(sim).post(f"{sim.url}/api/v1/namespaces", json=m.namespace(IDENT), headers=hub)
    assert r.status_code == 201, r.text
    # the hub binds its namespaced role there, as it does in a namespace it makes
    r = http(sim).post(f"{sim.url}/apis/rbac.authorization.k8s.io/v1/namespaces/{IDENT.namespace}/rolebindings",
                       json=m.hub_role_binding(IDENT.namespace, HUB), headers=hub)
    assert r.status_code == 201, r.text
    sim.binding = r.json()
    yield sim, hub
    sim.stop()


def as_hub(chain, method: str, path: str, body=None, content_type: str = "application/json"):
    sim, hub = chain
    return http(sim).request(method, f"{sim.url}{path}", json=body, headers={**hub, "Content-Type": content_type},
                             timeout=30)


def new_vm(name: str, change=None) -> dict:
    vm = m.virtual_machine(IDENT, SPEC)
    vm["metadata"]["name"] = name
    if change:
        change(vm)
    return vm


def test_a_new_vm_gets_kubevirts_firmware_identity_architecture_machine_and_pci_topology(chain):
    """vm-mutator_test.go: 'should apply defaults on VM create' (q35 on amd64, a UUID and a
    serial), 'should set PCI topology version based on architecture' (v3 on amd64)."""
    made = [as_hub(chain, "POST", VMS.format(ns=IDENT.namespace), new_vm(f"id-{n}")) for n in range(2)]
    assert all(r.status_code == 201 for r in made), [r.text for r in made]
    one, two = (r.json()["spec"]["template"] for r in made)
    for template in (one, two):
        firmware = template["spec"]["domain"]["firmware"]
        assert uuid.UUID(firmware["uuid"]).version == 4 and uuid.UUID(firmware["serial"]).version == 4
        assert template["spec"]["architecture"] == "amd64"
        assert template["spec"]["domain"]["machine"] == {"type": "q35"}
        assert template["metadata"]["annotations"]["kubevirt.io/pci-topology-version"] == "v3"
    assert one["spec"]["domain"]["firmware"]["uuid"] != two["spec"]["domain"]["firmware"]["uuid"]  # random, not the name's


def test_kubevirt_keeps_a_pci_version_and_gives_i440fx_none(chain):
    """vm-mutator_test.go: 'should not override existing PCI topology version annotation' and
    'skip PCI topology version for i440fx'."""
    def v2(vm):
        vm["spec"]["template"]["metadata"].setdefault("annotations", {})["kubevirt.io/pci-topology-version"] = "v2"

    def i440fx(vm):
        vm["spec"]["template"]["spec"]["domain"]["machine"] = {"type": "pc-i440fx-2.12"}
    kept = as_hub(chain, "POST", VMS.format(ns=IDENT.namespace), new_vm("pci-v2", v2))
    assert kept.status_code == 201, kept.text
    assert kept.json()["spec"]["template"]["metadata"]["annotations"]["kubevirt.io/pci-topology-version"] == "v2"
    old = as_hub(chain, "POST", VMS.format(ns=IDENT.namespace), new_vm("pci-none", i440fx))
    assert old.status_code == 201, old.text
    assert "kubevirt.io/pci-topology-version" not in (old.json()["spec"]["template"]["metadata"].get("annotations") or {})


def test_a_replaced_template_loses_its_firmware_until_virt_controller_derives_one_from_the_name(chain):
    """vm-mutator_test.go: 'should NOT assign new UUID or Serial when VM template spec lacks them on
    update'; firmware.go Sync then sets CalculateLegacyUUID(name), and no serial: a client that
    replaces the template whole changes the machine's identity (which the spawner must not do:
    test_workstation.py test_a_profile_switch_and_a_restore_keep_the_machines_firmware_identity)."""
    made = as_hub(chain, "POST", VMS.format(ns=IDENT.namespace), new_vm("replaced")).json()
    template = copy.deepcopy(new_vm("replaced")["spec"]["template"])
    r = as_hub(chain, "PATCH", VMS.format(ns=IDENT.namespace) + "/replaced",
               [{"op": "replace", "path": "/spec/template", "value": template}], "application/json-patch+json")
    assert r.status_code == 200, r.text
    firmware = r.json()["spec"]["template"]["spec"]["domain"]["firmware"]
    assert "uuid" not in firmware and "serial" not in firmware
    assert r.json()["spec"]["template"]["spec"]["domain"]["machine"] == {"type": "q35"}  # (on update too)

    def rewritten():
        vm = http(chain[0]).get(chain[0].url + VMS.format(ns=IDENT.namespace) + "/replaced").json()  # (as admin)
        return vm if "uuid" in vm["spec"]["template"]["spec"]["domain"]["firmware"] else None
    vm = wait_for(rewritten, 10)
    assert vm["spec"]["template"]["spec"]["domain"]["firmware"] == {**firmware, "uuid": firmware_uuid("replaced")}
    assert firmware_uuid("replaced") != made["spec"]["template"]["spec"]["domain"]["firmware"]["uuid"]
    assert vm["metadata"]["annotations"]["kubevirt.io/latest-observed-api-version"] == "v1"


def test_the_hubs_policy_admits_what_kubevirt_added_and_refuses_what_it_refused(chain):
    """Mutation runs before the ValidatingAdmissionPolicy, so the policy sees KubeVirt's PCI
    annotation on the hub's create and on every later write (a merge patch of the VM's
    annotations, as the operation marks are written); a hook sidecar stays refused, in
    kube-apiserver's words."""
    created = as_hub(chain, "POST", VMS.format(ns=IDENT.namespace), new_vm("marked"))
    assert created.status_code == 201, created.text
    marked = as_hub(chain, "PATCH", VMS.format(ns=IDENT.namespace) + "/marked",
                    {"metadata": {"annotations": {m.ANNOTATION_DRAIN: "x"}}}, "application/merge-patch+json")
    assert marked.status_code == 200, marked.text
    hook = as_hub(chain, "PATCH", VMS.format(ns=IDENT.namespace) + "/marked",
                  {"spec": {"template": {"metadata": {"annotations": {"hooks.kubevirt.io/hookSidecars": "[]"}}}}},
                  "application/merge-patch+json")
    assert hook.status_code == 403 and hook.json()["reason"] == "Forbidden", hook.text
    assert hook.json()["message"].startswith(
        'virtualmachines.kubevirt.io "marked" is forbidden: ValidatingAdmissionPolicy \'kubevirt-spawner-hub\' '
        "with binding 'kubevirt-spawner-hub' denied request: the template of a VM of the hub has labels of")
    # the spawner's dry run (provisioning.py _check_vm) is checked on the mutated object too
    dry = as_hub(chain, "POST", VMS.format(ns=IDENT.namespace) + "?dryRun=All", new_vm("checked"))
    assert dry.status_code == 201, dry.text
    assert dry.json()["spec"]["template"]["metadata"]["annotations"]["kubevirt.io/pci-topology-version"] == "v3"

    def sidecar(vm):
        vm["spec"]["template"]["metadata"]["annotations"] = {"hooks.kubevirt.io/hookSidecars": "[]"}
    dry = as_hub(chain, "POST", VMS.format(ns=IDENT.namespace) + "?dryRun=All", new_vm("checked", sidecar))
    assert dry.status_code == 403 and "the template of a VM of the hub" in dry.json()["message"], dry.text
    gone = as_hub(chain, "DELETE", VMS.format(ns=IDENT.namespace) + "/marked")
    assert gone.status_code == 200, gone.text


def test_the_core_kinds_the_hub_writes_get_the_api_servers_defaults(chain):
    """SetDefaults_Secret (Opaque), SetDefaults_Service (internalTrafficPolicy Cluster),
    SetDefaults_NetworkPolicy (policyTypes), SetDefaults_Subject (a ServiceAccount's apiGroup "")."""
    ns = IDENT.namespace
    secret = as_hub(chain, "POST", f"/api/v1/namespaces/{ns}/secrets", m.env_secret(IDENT, {"A": "b"}, []))
    assert secret.status_code == 201 and secret.json()["type"] == "Opaque", secret.text
    service = as_hub(chain, "POST", f"/api/v1/namespaces/{ns}/services", m.service(IDENT, SPEC))
    assert service.status_code == 201, service.text
    assert service.json()["spec"]["internalTrafficPolicy"] == "Cluster"
    policy = as_hub(chain, "POST", f"/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies",
                    m.network_policy(IDENT, SPEC.ports, [{"namespaceSelector": {}}]))
    assert policy.status_code == 201 and policy.json()["spec"]["policyTypes"] == ["Ingress"], policy.text
    assert chain[0].binding["subjects"][0]["apiGroup"] == ""  # (the fixture's, made as the hub)
