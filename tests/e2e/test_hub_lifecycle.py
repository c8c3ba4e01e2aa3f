"""A real JupyterHub with KubeVirtSpawner against the simulator: start, files, stop, resume, and
profile switches in both directions (a profile's disk size is a minimum)."""

from __future__ import annotations

import base64
import json
import threading

from simtools import wait_for

GPU = "nvidia.com/A100-PCIE-40GB"
MACHINE_PATHS = ["etc/workstation.conf", "opt/conda/envs/torch/marker.txt", "usr/local/bin/tool.sh",
                 "var/lib/app/state.json", "home/alice/.cache/pip/wheel.txt"]


def test_files_survive_stop_and_start_and_a_stopped_gpu_is_free_for_others(hub, cluster):
    hub.start_server("alice", profile="gpu-a100-2")  # both A100s of the GPU node
    # The guest gets JupyterHub's environment through the Secret; the token is never in the VM.
    secret = cluster.core.read_namespaced_secret("alice-hub-env", "notebook-alice")
    env = {k: base64.b64decode(v).decode() for k, v in secret.data.items()}
    assert env["JUPYTERHUB_SERVICE_URL"] == "http://0.0.0.0:8888/user/alice/"
    assert env["JUPYTERHUB_USER"] == "alice" and len(env["JUPYTERHUB_API_TOKEN"]) >= 32
    assert env["KUBEVIRT_SSH_ENABLED"] == "1"  # (c.KubeVirtSpawner.ssh_enabled's default)
    assert env["JUPYTERHUB_API_TOKEN"] not in json.dumps(cluster.vm("notebook-alice", "alice-workstation"))
    first_token = env["JUPYTERHUB_API_TOKEN"]
    for path in MACHINE_PATHS:
        hub.write_file("alice", path, f"alice wrote {path}")

    # bob wants one of those GPUs: he waits, and sees why.
    r = hub.request_start("bob", profile="gpu-a100-1")
    assert r.status_code == 202, r.text
    bob_events: list[dict] = []
    watcher = threading.Thread(target=hub.progress, args=("bob", "", bob_events))
    watcher.start()
    wait_for(lambda: any(f"Waiting for a node with a free {GPU}" in e["message"] for e in bob_events)
             or any("FailedScheduling" in e["message"] for e in bob_events), 60, what="bob told about the GPU")

    hub.stop_server("alice")
    vm = cluster.vm("notebook-alice", "alice-workstation")
    assert vm is not None and vm["spec"]["runStrategy"] == "Halted"
    assert cluster.vmi("notebook-alice", "alice-workstation") is None
    pvcs = {p["metadata"]["name"]: p for p in cluster.pvcs("notebook-alice")}
    assert pvcs["alice-rootdisk"]["status"]["phase"] == "Bound"
    assert cluster.core.read_namespaced_service("alice-notebook", "notebook-alice") is not None

    # alice's GPUs are free again: bob's GPU workstation now starts on that node.
    hub.wait_ready("bob", timeout=120)
    watcher.join(30)
    bob_vmi = cluster.vmi("notebook-bob", "bob-workstation")
    assert bob_vmi["status"]["nodeName"] == "vm-gpu-pci-1"
    messages = [e["message"] for e in bob_events]
    assert "Cloning your system disk from ubuntu-24-04-cuda-golden (copy-on-write)" in messages
    assert any(m == "Guest agent connected" for m in messages) and any(m == "Starting Jupyter" for m in messages)
    # The cluster's own words about why bob waited are in his progress stream too.
    assert any(m.startswith("FailedScheduling: ") and GPU in m for m in messages), messages
    assert all(0 <= e["progress"] <= 100 for e in bob_events)
    hub.stop_server("bob")

    # A day of writing on the CPU profile (60Gi): her 150Gi disk stays as it is, and the machine is a
    # CPU machine through and through (no GPU, no GPU placement, no old resources).
    timing = cluster.sim_api("GET", "/timing")["timing"]
    cluster.sim_api("PUT", "/timing", {"launch": 100})  # 5 s at this speed: time to read the progress stream
    try:
        messages = hub.start_and_watch("alice", profile="cpu")
    finally:
        cluster.sim_api("PUT", "/timing", timing)
    hub.wait_ready("alice")
    assert messages.count("Keeping your 150Gi system disk (the profile asks for at least 60Gi)") == 1, messages
    template = cluster.vm("notebook-alice", "alice-workstation")["spec"]["template"]["spec"]
    assert "gpus" not in template["domain"]["devices"]
    # (the demo's CPU placement: the pool, off its VFIO nodes; nothing of the GPU profile's)
    assert template["nodeSelector"] == {"workload.example.com/kubevirt": "true"}
    assert template["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] == {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "accelerator.example.com/mode", "operator": "DoesNotExist"}]}]}
    assert template["domain"]["resources"] == {"requests": {"cpu": "2", "memory": "4Gi"}}
    assert cluster.vmi("notebook-alice", "alice-workstation")["status"]["nodeName"] != "vm-gpu-pci-1"
    pvcs = {p["metadata"]["name"]: p for p in cluster.pvcs("notebook-alice")}
    assert pvcs["alice-rootdisk"]["spec"]["resources"]["requests"]["storage"] == "150Gi"
    for path in MACHINE_PATHS:
        assert hub.read_file("alice", path) == f"alice wrote {path}"
    hub.stop_server("alice")

    # alice comes back with one GPU: the same machine, with everything she installed.
    hub.start_server("alice", profile="gpu-a100-1")
    secret = cluster.core.read_namespaced_secret("alice-hub-env", "notebook-alice")
    assert base64.b64decode(secret.data["JUPYTERHUB_API_TOKEN"]).decode() != first_token  # a new token every start
    for path in MACHINE_PATHS:
        assert hub.read_file("alice", path) == f"alice wrote {path}"
    vm = cluster.vm("notebook-alice", "alice-workstation")
    assert len(vm["spec"]["template"]["spec"]["domain"]["devices"]["gpus"]) == 1
    assert vm["metadata"]["annotations"]["kubevirt-spawner.io/profile"] == "gpu-a100-1"
    assert len(cluster.datavolumes("notebook-alice")) == 1
    assert cluster.sim_api("GET", "/violations")["violations"] == []
    hub.stop_server("alice")


def test_users_are_isolated_named_servers_get_their_own_disk_and_deleting_keeps_disks(hub, cluster):
    hub.start_server("carol")
    hub.start_server("dave")
    hub.write_file("carol", "home/carol/secret.txt", "carol only")
    assert hub.read_file("dave", "home/carol/secret.txt") is None
    assert hub.read_file("carol", "home/carol/secret.txt") == "carol only"

    hub.start_server("carol", server="gpu")
    assert hub.read_file("carol", "home/carol/secret.txt", server="gpu") is None
    disks = sorted(dv["metadata"]["name"] for dv in cluster.datavolumes("notebook-carol"))
    assert disks == ["carol--gpu-rootdisk", "carol-rootdisk"]

    # Removing the named server deletes its VM but keeps its disk.
    r = hub.api("DELETE", "/users/carol/servers/gpu", json={"remove": True})
    assert r.status_code in (202, 204), r.text
    wait_for(lambda: cluster.vm("notebook-carol", "carol--gpu-workstation") is None, 60, what="named VM deleted")

    # Deleting the user deletes VMs, Services and Secrets, and keeps every disk, marked as retained.
    hub.stop_server("carol")
    assert hub.api("DELETE", "/users/carol").status_code == 204
    wait_for(lambda: cluster.vm("notebook-carol", "carol-workstation") is None, 60, what="VM deleted")
    dvs = {dv["metadata"]["name"]: dv for dv in cluster.datavolumes("notebook-carol")}
    assert sorted(dvs) == ["carol--gpu-rootdisk", "carol-rootdisk"]
    for dv in dvs.values():
        assert dv["metadata"]["labels"]["kubevirt-spawner.io/retained"] == "true"
        assert dv["metadata"]["annotations"]["kubevirt-spawner.io/retain-until"].endswith("Z")
    pvcs = {p["metadata"]["name"] for p in cluster.pvcs("notebook-carol")}
    assert pvcs == {"carol--gpu-rootdisk", "carol-rootdisk"}
    services = cluster.core.list_namespaced_service("notebook-carol").items
    secrets = cluster.core.list_namespaced_secret("notebook-carol").items
    assert services == [] and secrets == []
    hub.stop_server("dave")


def test_unknown_profile_and_tampered_options_are_refused_clearly(hub, cluster):
    r = hub.request_start("erin", profile="tpu-v5")
    assert r.status_code in (400, 500), r.text
    assert "Unknown profile 'tpu-v5'. Choose one of: cpu, gpu-a100-1, gpu-a100-2." in r.text
    hub.ensure_user("erin")
    r = hub.api("POST", "/users/erin/server", json={"profile": "cpu", "cpu_guarantee": 64})
    assert "Unsupported option(s) cpu_guarantee" in r.text
    assert cluster.vm("notebook-erin", "erin-workstation") is None
