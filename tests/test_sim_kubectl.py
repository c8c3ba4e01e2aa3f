"""A real kubectl (v1.32) against the simulator, with the design document's manifests unchanged."""

from __future__ import annotations

import base64
import json
import os
import subprocess

import pytest

from simtools import wait_for


@pytest.fixture(scope="module")
def kubectl(sim):
    env = {**os.environ, "KUBECONFIG": sim.kubeconfig}

    def run(*args, check=True, stdin=None):
        proc = subprocess.run(["kubectl", *args], env=env, capture_output=True, text=True, input=stdin, timeout=60)
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {proc.stderr}")
        return proc
    return run


def test_design_document_manifests_run_a_gpu_workstation(kubectl, tmp_path, design_manifests):
    seed = design_manifests
    kubectl("apply", "-f", "-", stdin="apiVersion: v1\nkind: Namespace\nmetadata:\n  name: notebook-alice\n")
    out = kubectl("apply", "-f", str(seed / "alice-rootdisk.yaml"), "-f", str(seed / "alice-gpu-workstation.yaml"),
                  "-f", str(seed / "alice-notebook-service.yaml")).stdout
    assert "datavolume.cdi.kubevirt.io/alice-rootdisk created" in out
    assert "virtualmachine.kubevirt.io/alice-gpu-workstation created" in out
    kubectl("wait", "--for=condition=Ready", "dv/alice-rootdisk", "-n", "notebook-alice", "--timeout=30s")
    table = kubectl("get", "vm", "-n", "notebook-alice").stdout
    assert table.split("\n")[0].split() == ["NAME", "AGE", "STATUS", "READY"]
    assert "Stopped" in table
    body = tmp_path / "empty.json"
    body.write_text("{}")
    start = "/apis/subresources.kubevirt.io/v1/namespaces/notebook-alice/virtualmachines/alice-gpu-workstation/start"
    kubectl("replace", "--raw", start, "-f", str(body))
    again = kubectl("replace", "--raw", start, "-f", str(body), check=False)
    assert again.returncode != 0
    kubectl("wait", "--for=condition=Ready", "vmi/alice-gpu-workstation", "-n", "notebook-alice", "--timeout=30s")
    node = kubectl("get", "vmi", "alice-gpu-workstation", "-n", "notebook-alice",
                   "-o", "jsonpath={.status.nodeName}").stdout
    assert node == "vm-gpu-pci-1"
    # The design document's troubleshooting step: the launcher pod, on the VMI's node.
    pods = kubectl("get", "pods", "-n", "notebook-alice", "-l", "kubevirt.io=virt-launcher", "-o", "wide").stdout
    assert "virt-launcher-alice-gpu-workstation-" in pods and "Running" in pods and "vm-gpu-pci-1" in pods
    vm = json.loads(kubectl("get", "vm", "alice-gpu-workstation", "-n", "notebook-alice", "-o", "json").stdout)
    assert vm["status"]["printableStatus"] == "Running"
    snap = kubectl("apply", "-f", str(seed / "alice-before-cuda-upgrade.yaml")).stdout
    assert "created" in snap
    kubectl("wait", "--for=jsonpath={.status.phase}=Succeeded", "vmsnapshot/alice-before-cuda-upgrade",
            "-n", "notebook-alice", "--timeout=30s")
    stop = start.replace("/start", "/stop")
    kubectl("replace", "--raw", stop, "-f", str(body))
    kubectl("wait", "--for=delete", "vmi/alice-gpu-workstation", "-n", "notebook-alice", "--timeout=30s")


def test_label_replace_conflict_and_delete_wait(kubectl, tmp_path, core):
    kubectl("apply", "-f", "-", stdin="apiVersion: v1\nkind: Namespace\nmetadata:\n  name: kctl\n")
    kubectl("apply", "-n", "kctl", "-f", "-", stdin="apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: c\n"
                                                     "data:\n  k: v\n")
    kubectl("label", "configmap", "c", "-n", "kctl", "team=a")
    got = json.loads(kubectl("get", "cm", "c", "-n", "kctl", "-o", "json").stdout)
    assert got["metadata"]["labels"] == {"team": "a"}
    kubectl("label", "vm", "--all", "-n", "notebook-alice", "tier=gpu", check=False)
    stale = dict(got)
    stale["data"] = {"k": "w"}
    kubectl("label", "configmap", "c", "-n", "kctl", "team=b", "--overwrite")
    path = tmp_path / "stale.json"
    path.write_text(json.dumps(stale))
    res = kubectl("replace", "-f", str(path), check=False)
    assert res.returncode != 0 and "the object has been modified" in res.stderr
    assert kubectl("get", "cm", "-n", "kctl", "-l", "team=b", "-o", "name").stdout.strip() == "configmap/c"
    kubectl("delete", "configmap", "c", "-n", "kctl", "--wait=true", "--timeout=20s")
    assert "NotFound" in kubectl("get", "cm", "c", "-n", "kctl", check=False).stderr


def test_kubectl_delete_vm_with_templates_deletes_its_disk(kubectl, custom):
    manifest = {
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "metadata": {"name": "tpl", "namespace": "kctl"},
        "spec": {"runStrategy": "Halted", "dataVolumeTemplates": [{
            "metadata": {"name": "tpl-disk"},
            "spec": {"source": {"pvc": {"namespace": "vm-images", "name": "ubuntu-24-04-cuda-golden"}},
                     "storage": {"resources": {"requests": {"storage": "60Gi"}}}}}],
            "template": {"spec": {"domain": {"devices": {"disks": [{"name": "root", "disk": {"bus": "virtio"}}]},
                                             "resources": {"requests": {"memory": "1Gi"}}},
                                  "volumes": [{"name": "root", "dataVolume": {"name": "tpl-disk"}}]}}}}
    kubectl("apply", "-f", "-", stdin=json.dumps(manifest))
    kubectl("wait", "--for=condition=Ready", "dv/tpl-disk", "-n", "kctl", "--timeout=30s")
    assert "tpl-disk" in kubectl("get", "pvc", "-n", "kctl", "-o", "name").stdout
    kubectl("delete", "vm", "tpl", "-n", "kctl", "--wait=true", "--timeout=30s")
    wait_for(lambda: "tpl-disk" not in kubectl("get", "pvc,dv", "-n", "kctl", "-o", "name").stdout,
             what="template disk deleted")


def test_kubectl_creates_service_accounts_and_their_tokens(kubectl, sim, tmp_path):
    """kubectl sends protobuf for `create namespace`, `create serviceaccount` and `create token`
    (the TokenRequest API, pkg/registry/core/serviceaccount/storage/token.go); the token it gets
    is a ServiceAccount's, allowed only what RBAC grants (here: nothing but discovery)."""
    kubectl("create", "namespace", "robots")
    kubectl("create", "serviceaccount", "r2", "-n", "robots")
    token = kubectl("create", "token", "r2", "-n", "robots", "--duration=1h").stdout.strip()
    refused = kubectl("--token", token, "get", "pods", "-n", "robots", check=False)
    assert refused.returncode == 1 and ('User "system:serviceaccount:robots:r2" cannot list resource "pods" in API '
                                        'group "" in the namespace "robots"') in refused.stderr
    short = kubectl("create", "token", "r2", "-n", "robots", "--duration=1m", check=False)
    assert "may not specify a duration less than 10 minutes" in short.stderr
    assert kubectl("--token", "nonsense", "get", "pods", check=False).stderr.strip().endswith("(Unauthorized)")


def test_kubectl_creates_generic_secrets(kubectl, tmp_path):
    """`kubectl create secret generic` sends protobuf (Secret: data = 2 as map<string, bytes>, type = 3;
    staging/src/k8s.io/api/core/v1/generated.proto); the data reads back as the bytes given, a
    file's included."""
    (tmp_path / "key.bin").write_bytes(b"\x00\xffbinary")
    kubectl("create", "namespace", "secrets")
    kubectl("create", "secret", "generic", "s1", "-n", "secrets", "--from-literal=password=p4ss w0rd",
            f"--from-file=key={tmp_path / 'key.bin'}", "--type=example.com/opaque")
    secret = json.loads(kubectl("get", "secret", "s1", "-n", "secrets", "-o", "json").stdout)
    assert secret["type"] == "example.com/opaque"
    assert {k: base64.b64decode(v) for k, v in secret["data"].items()} == {"password": b"p4ss w0rd",
                                                                         "key": b"\x00\xffbinary"}


def test_a_bound_claim_has_a_volume_that_its_reclaim_policy_keeps_or_deletes(kubectl, sim):
    """The CSI external-provisioner makes a PersistentVolume per bound claim with the StorageClass's
    reclaim policy (kubernetes-csi/external-provisioner pkg/controller/controller.go); a deleted
    claim releases it, and a Released volume is kept under Retain, deleted under Delete
    (kubernetes/kubernetes pkg/controller/volume/persistentvolume/pv_controller.go), which is how an
    admin removes a retained disk for good: set its policy to Delete."""
    kubectl("create", "namespace", "pv-test")
    claim = ("apiVersion: v1\nkind: PersistentVolumeClaim\nmetadata:\n  name: {name}\n  namespace: pv-test\n"
             "spec:\n  accessModes: [ReadWriteOnce]\n  volumeMode: Block\n  storageClassName: ceph-rbd\n"
             "  resources:\n    requests:\n      storage: 2Gi\n")
    volumes = {}
    for name in ("kept", "gone"):
        kubectl("apply", "-f", "-", stdin=claim.format(name=name))
        kubectl("wait", "--for=jsonpath={.status.phase}=Bound", f"pvc/{name}", "-n", "pv-test", "--timeout=30s")
        volumes[name] = kubectl("get", "pvc", name, "-n", "pv-test", "-o", "jsonpath={.spec.volumeName}").stdout
    pv = json.loads(kubectl("get", "pv", volumes["kept"], "-o", "json").stdout)
    assert pv["spec"]["persistentVolumeReclaimPolicy"] == "Retain"  # the seeded ceph-rbd class's
    assert pv["spec"]["claimRef"]["name"] == "kept" and pv["spec"]["csi"]["driver"] == "rbd.csi.ceph.com"
    assert (pv["status"]["phase"], pv["spec"]["capacity"]["storage"], pv["spec"]["volumeMode"]) == ("Bound", "2Gi", "Block")
    kubectl("delete", "pvc", "kept", "gone", "-n", "pv-test")
    for volume in volumes.values():
        wait_for(lambda v=volume: kubectl("get", "pv", v, "-o", "jsonpath={.status.phase}").stdout == "Released")
    kubectl("patch", "pv", volumes["gone"], "--type", "merge", "-p",
            '{"spec":{"persistentVolumeReclaimPolicy":"Delete"}}')
    kubectl("wait", "--for=delete", f"pv/{volumes['gone']}", "--timeout=30s")
    table = kubectl("get", "pv", volumes["kept"]).stdout
    assert table.split("\n")[0].split()[:5] == ["NAME", "CAPACITY", "RECLAIM", "POLICY", "STATUS"]
    assert "Released" in table
    kubectl("delete", "namespace", "pv-test")


def test_a_service_without_endpoints_has_the_placeholder_slice(kubectl):
    """kube-controller-manager's endpointslice reconciler keeps one placeholder slice, without ports
    or endpoints, for a Service that selects nothing (staging/src/k8s.io/endpointslice/
    reconciler.go); kubectl prints both as <unset> (pkg/printers/internalversion/printers.go
    listWithMoreString)."""
    kubectl("create", "namespace", "slices")
    kubectl("apply", "-f", "-", stdin="apiVersion: v1\nkind: Service\nmetadata: {name: nobody, namespace: slices}\n"
                                      "spec:\n  selector: {app: nothing}\n  ports: [{name: http, port: 80}]\n")
    wait_for(lambda: "nobody-" in kubectl("get", "endpointslice", "-n", "slices").stdout)
    [row] = kubectl("get", "endpointslice", "-n", "slices", "--no-headers").stdout.splitlines()
    assert row.split()[1:4] == ["IPv4", "<unset>", "<unset>"], row
    [item] = json.loads(kubectl("get", "endpointslice", "-n", "slices", "-o", "json").stdout)["items"]
    assert item.get("ports") is None and item.get("endpoints") is None
    kubectl("delete", "namespace", "slices")


def test_the_operators_crds_are_established(kubectl):
    """The kinds of CRD groups have their CustomResourceDefinitions, Established
    (apiextensions-apiserver's establishing_controller.go), as after the operators' install."""
    kubectl("wait", "crd/kubevirts.kubevirt.io", "crd/cdis.cdi.kubevirt.io", "--for=condition=Established",
            "--timeout=10s")
    crd = json.loads(kubectl("get", "crd", "datavolumes.cdi.kubevirt.io", "-o", "json").stdout)
    assert (crd["spec"]["group"], crd["spec"]["scope"], crd["spec"]["names"]["kind"]) == \
        ("cdi.kubevirt.io", "Namespaced", "DataVolume")
    names = kubectl("get", "crds", "-o", "name").stdout.split()
    assert "customresourcedefinition.apiextensions.k8s.io/virtualmachines.kubevirt.io" in names
    assert not any(name.endswith((".apps", "pods")) for name in names)  # built-in kinds have none
