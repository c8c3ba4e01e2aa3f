"""deploy/host/label-nodes.sh with a real kubectl against the simulator: a node pool's labels and
taint as the design document sets them (kubectl label/taint as in staging/src/k8s.io/kubectl/pkg/
cmd/label/label.go and cmd/taint/taint.go), and a node that still runs other workloads refused."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "deploy" / "host" / "label-nodes.sh"


@pytest.fixture(scope="module")
def kubectl_env(sim):
    return {**os.environ, "KUBECONFIG": sim.kubeconfig}


def label_nodes(env, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=120,
                          check=False)


def node(env, name: str) -> dict:
    return json.loads(subprocess.run(["kubectl", "get", "node", name, "-o", "json"], env=env, capture_output=True,
                                     text=True, check=True).stdout)


def test_a_gpu_pool_node_gets_the_labels_and_the_taint(kubectl_env):
    """... and, drained (cordoned) for the pool, takes pods again: the taint keeps others away."""
    subprocess.run(["kubectl", "cordon", "vm-gpu-pci-1"], env=kubectl_env, check=True, capture_output=True)
    assert node(kubectl_env, "vm-gpu-pci-1")["spec"]["unschedulable"] is True
    done = label_nodes(kubectl_env, "--pool", "vm-gpu-pci", "vm-gpu-pci-1")
    assert done.returncode == 0, done.stderr
    labelled = node(kubectl_env, "vm-gpu-pci-1")
    assert labelled["metadata"]["labels"]["workload.example.com/kubevirt"] == "true"
    assert labelled["metadata"]["labels"]["accelerator.example.com/mode"] == "vfio"
    taints = [t for t in labelled["spec"]["taints"] if t["key"] == "workload.example.com/kubevirt"]
    assert taints == [{"key": "workload.example.com/kubevirt", "value": "true", "effect": "NoSchedule"}]
    assert not labelled["spec"].get("unschedulable")
    # run again: nothing changes, nothing fails (the taint is overwritten, not doubled)
    assert label_nodes(kubectl_env, "--pool", "vm-gpu-pci", "vm-gpu-pci-1").returncode == 0
    assert node(kubectl_env, "vm-gpu-pci-1")["spec"]["taints"].count(taints[0]) == 1


def test_a_node_with_other_workloads_is_refused_and_nothing_changes(kubectl_env, tmp_path):
    pod = tmp_path / "pod.yaml"
    # a bare pod (no owner) is another workload; a static pod's mirror (owned by its Node, the
    # kubelet's pkg/kubelet/pod/mirror_client.go) and a labelled one owned by a DaemonSet are not
    pod.write_text("apiVersion: v1\nkind: Pod\nmetadata: {name: trainer, namespace: default, labels: {team: ml}}\n"
                   "spec:\n  nodeName: container-gpu-1\n  containers: [{name: main, image: busybox}]\n---\n"
                   "apiVersion: v1\nkind: Pod\nmetadata:\n  name: kube-proxy-container-gpu-1\n"
                   "  namespace: kube-system\n  ownerReferences: [{apiVersion: v1, kind: Node, "
                   "name: container-gpu-1, uid: 00000000-0000-0000-0000-000000000001, controller: true}]\n"
                   "spec:\n  nodeName: container-gpu-1\n  containers: [{name: kube-proxy, image: kube-proxy}]\n")
    subprocess.run(["kubectl", "apply", "-f", str(pod)], env=kubectl_env, check=True, capture_output=True)
    before = node(kubectl_env, "vm-cpu-2")["metadata"]["labels"]
    done = label_nodes(kubectl_env, "--pool", "vm-cpu", "vm-cpu-2", "container-gpu-1")
    assert done.returncode == 1
    assert "container-gpu-1 still runs other workloads: default/trainer\n" in done.stderr
    assert "no node was changed" in done.stderr
    assert node(kubectl_env, "vm-cpu-2")["metadata"]["labels"] == before  # checked all before changing any
    forced = label_nodes(kubectl_env, "--pool", "vm-cpu", "--force", "container-gpu-1")
    assert forced.returncode == 0, forced.stderr
    labels = node(kubectl_env, "container-gpu-1")["metadata"]["labels"]
    assert labels["workload.example.com/kubevirt"] == "true" and "accelerator.example.com/mode" not in labels


def test_bad_usage_and_unknown_nodes_change_nothing(kubectl_env):
    assert "--pool is required" in label_nodes(kubectl_env, "vm-cpu-1").stderr
    assert "unknown pool gpu" in label_nodes(kubectl_env, "--pool", "gpu", "vm-cpu-1").stderr
    before = node(kubectl_env, "vm-cpu-1")
    missing = label_nodes(kubectl_env, "--pool", "vm-gpu-pci", "vm-cpu-1", "no-such-node")
    assert missing.returncode == 1 and "no node was changed" in missing.stderr
    dry = label_nodes(kubectl_env, "--pool", "vm-gpu-pci", "--dry-run", "vm-cpu-1")
    assert dry.returncode == 0
    assert node(kubectl_env, "vm-cpu-1")["metadata"] == before["metadata"]
    assert dry.stdout.splitlines() == [
        "kubectl label node vm-cpu-1 workload.example.com/kubevirt=true --overwrite",
        "kubectl label node vm-cpu-1 accelerator.example.com/mode=vfio --overwrite",
        "kubectl taint node vm-cpu-1 workload.example.com/kubevirt=true:NoSchedule --overwrite",
        "kubectl uncordon vm-cpu-1"]


def test_the_demos_cluster_starts_with_its_cpu_nodes_as_the_script_leaves_them(tmp_path):
    """`node_pools` (the demo's cluster, `kubevirt-spawner sim --node-pools`): vm-cpu-1 and -2 carry
    the pool's label and taint already, so label-nodes.sh changes nothing on them; a restart on the
    same state adds no second taint."""
    from simtools import start_sim
    s = start_sim(tmp_path / "cluster", node_pools=True)
    env = {**os.environ, "KUBECONFIG": s.kubeconfig}
    try:
        before = {name: node(env, name) for name in ("vm-cpu-1", "vm-cpu-2")}
        for n in before.values():
            assert n["metadata"]["labels"]["workload.example.com/kubevirt"] == "true"
            assert "accelerator.example.com/mode" not in n["metadata"]["labels"]
            assert n["spec"]["taints"] == [{"key": "workload.example.com/kubevirt", "value": "true",
                                            "effect": "NoSchedule"}]
        done = label_nodes(env, "--pool", "vm-cpu", "vm-cpu-1", "vm-cpu-2")
        assert done.returncode == 0, done.stderr
        for name, n in before.items():
            after = node(env, name)
            assert (after["metadata"]["labels"], after["spec"]["taints"]) == \
                (n["metadata"]["labels"], n["spec"]["taints"])
    finally:
        s.stop()
    again = start_sim(tmp_path / "cluster", node_pools=True)
    try:
        assert node({**os.environ, "KUBECONFIG": again.kubeconfig}, "vm-cpu-1")["spec"]["taints"] == \
            before["vm-cpu-1"]["spec"]["taints"]
    finally:
        again.stop()
