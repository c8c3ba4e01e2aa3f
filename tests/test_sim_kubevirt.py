"""KubeVirt, CDI, scheduler, snapshot and guest behaviour of the simulator, on the wire."""

from __future__ import annotations

import ipaddress
import json
import os
import struct
import subprocess
import time

import pytest
import requests
from kubernetes import client
from kubernetes.client.rest import ApiException

from kubevirt_spawner.guest.activity import BusyProcesses

from kube_objects import CDI, KV, SNAP, clone_dv, vm
from simtools import answers, api_client, http, sim_api, start_sim, wait_for

SUB = "/apis/subresources.kubevirt.io/v1/namespaces/{ns}/{kind}/{name}/{action}"


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    # Its own cluster: these tests use up GPUs and lose nodes.
    s = start_sim(tmp_path_factory.mktemp("kubevirt"))
    yield s
    s.stop()


def action(sim, ns, name, what, body=None):
    return http(sim).put(sim.url + SUB.format(ns=ns, kind="virtualmachines", name=name, action=what),
                        json=body or {})


def agent(sim, ns, name, call):
    return http(sim).get(sim.url + SUB.format(ns=ns, kind="virtualmachineinstances", name=name, action=call))


def get(custom, group, ns, plural, name):
    try:
        return custom.get_namespaced_custom_object(*group, ns, plural, name)
    except ApiException as e:
        if e.status == 404:
            return None
        raise


def vm_status(custom, ns, name):
    return (get(custom, KV, ns, "virtualmachines", name) or {}).get("status", {}).get("printableStatus")


def vmi_phase(custom, ns, name):
    return ((get(custom, KV, ns, "virtualmachineinstances", name) or {}).get("status") or {}).get("phase")


def make_disk(custom, ns, name, size="60Gi", annotations: dict | None = None):
    dv = clone_dv(name, size)
    if annotations:
        dv["metadata"]["annotations"] = dict(annotations)
    custom.create_namespaced_custom_object(*CDI, ns, "datavolumes", dv)
    return wait_for(lambda: (get(custom, CDI, ns, "datavolumes", name) or {}).get("status", {}).get("phase")
                    == "Succeeded", what=f"clone {name}")


def running_vm(sim, custom, ns, name, annotations: dict | None = None, **kw):
    make_disk(custom, ns, f"{name}-disk", annotations=annotations)
    custom.create_namespaced_custom_object(*KV, ns, "virtualmachines", vm(name, f"{name}-disk", **kw))
    assert action(sim, ns, name, "start").status_code == 202
    wait_for(lambda: vm_status(custom, ns, name) == "Running", what=f"{name} running")


PROFILES = ("cdi.kubevirt.io", "v1beta1", "storageprofiles")


def clone_phases(custom, ns, name) -> set:
    phases = set()

    def done():
        st = (get(custom, CDI, ns, "datavolumes", name) or {}).get("status") or {}
        phases.add((st.get("phase"), st.get("progress")))
        return st.get("phase") == "Succeeded"
    wait_for(done, timeout=30, interval=0.01, what=f"clone {name} done")
    return phases


def test_clones_follow_the_storage_profile_csi_for_rbd_copy_when_asked(custom, core, ns, sim):
    """CDI keeps a StorageProfile per StorageClass; for the Ceph RBD provisioner it knows block
    property sets and the csi-clone strategy (pkg/storagecapabilities/storagecapabilities.go,
    pkg/controller/storageprofile-controller.go). A CSI clone is copy-on-write and reports progress
    "N/A" (CSICloneInProgress); a host-assisted copy reports percentages (CloneInProgress)."""
    profile = custom.get_cluster_custom_object(*PROFILES, "ceph-rbd")
    assert profile["status"]["provisioner"] == "rbd.csi.ceph.com"
    assert profile["status"]["cloneStrategy"] == "csi-clone"
    assert {"accessModes": ["ReadWriteOnce"], "volumeMode": "Block"} in profile["status"]["claimPropertySets"]
    custom.create_namespaced_custom_object(*CDI, ns, "datavolumes", clone_dv("fast"))
    phases = clone_phases(custom, ns, "fast")
    assert ("CSICloneInProgress", "N/A") in phases and ("Succeeded", "100.0%") in phases
    assert not [p for p, progress in phases if p == "CloneInProgress"]
    reasons = {e.reason for e in core.list_namespaced_event(ns).items}
    assert {"CloneScheduled", "CSICloneInProgress", "CloneSucceeded"} <= reasons

    custom.patch_cluster_custom_object(*PROFILES, "ceph-rbd", {"spec": {"cloneStrategy": "copy"}})
    sim.call(lambda: sim.cluster.timing.update(clone=40.0, clone_schedule=20.0))
    try:
        custom.create_namespaced_custom_object(*CDI, ns, "datavolumes", clone_dv("slow"))
        phases = clone_phases(custom, ns, "slow")
    finally:
        sim.call(lambda: sim.cluster.timing.update(clone=30.0, clone_schedule=2.0))
        custom.patch_cluster_custom_object(*PROFILES, "ceph-rbd", {"spec": {"cloneStrategy": None}})
    assert any(p == "CloneInProgress" and progress not in ("0.00%", "N/A") and progress.endswith("%")
               for p, progress in phases)
    assert ("Succeeded", "100.0%") in phases
    pvc = core.read_namespaced_persistent_volume_claim("slow", ns)
    assert pvc.metadata.owner_references[0].kind == "DataVolume" and pvc.spec.volume_mode == "Block"
    assert custom.get_cluster_custom_object(*PROFILES, "ceph-rbd")["status"]["cloneStrategy"] == "csi-clone"


def test_a_clone_that_cannot_proceed_keeps_its_phase_and_says_why(custom, core, ns, sim):
    """CDI never turns such a clone Failed (pkg/controller/datavolume/clone-controller-base.go,
    pvc-clone-controller.go): a missing source is CloneWithoutSource, a target smaller than the
    source CloneValidationFailed, both on the conditions with the phase kept; a CSI clone the
    driver cannot make leaves ProvisioningFailed Warnings and no progress."""
    import time
    http(sim).post(f"{sim.url}/sim/v1/clones/fail-next", json={"count": 1})
    custom.create_namespaced_custom_object(*CDI, ns, "datavolumes", clone_dv("broken"))
    wait_for(lambda: any(e.reason == "ProvisioningFailed" and e.involved_object.name == "broken"
                         for e in core.list_namespaced_event(ns).items), what="the driver's complaint")
    time.sleep(1)
    assert get(custom, CDI, ns, "datavolumes", "broken")["status"]["phase"] == "CSICloneInProgress"

    small = clone_dv("small", "10Gi")
    custom.create_namespaced_custom_object(*CDI, ns, "datavolumes", small)

    def bound_reason(name):
        conds = (get(custom, CDI, ns, "datavolumes", name) or {}).get("status", {}).get("conditions", [])
        return next((c for c in conds if c["type"] == "Bound" and c["status"] == "False"), {})
    cond = wait_for(lambda: bound_reason("small").get("reason") == "CloneValidationFailed" and bound_reason("small"),
                    what="CloneValidationFailed")
    assert cond["message"] == ("The clone doesn't meet the validation requirements: target resources requests "
                               f"storage size is smaller than the source {10 * 2**30} < {60 * 2**30}")
    dv = clone_dv("orphan")
    dv["spec"]["source"]["pvc"]["name"] = "no-such-golden"
    custom.create_namespaced_custom_object(*CDI, ns, "datavolumes", dv)
    wait_for(lambda: bound_reason("orphan").get("reason") == "CloneWithoutSource", what="CloneWithoutSource")
    for name in ("broken", "small", "orphan"):
        assert get(custom, CDI, ns, "datavolumes", name)["status"].get("phase") != "Failed"


def test_start_stop_answers_like_virt_api(custom, ns, sim):
    make_disk(custom, ns, "m-disk")
    custom.create_namespaced_custom_object(*KV, ns, "virtualmachines", vm("m", "m-disk"))
    wait_for(lambda: vm_status(custom, ns, "m") == "Stopped", what="stopped")
    r = action(sim, ns, "m", "stop")
    assert r.status_code == 409 and r.json()["reason"] == "Conflict" and "VM is not running" in r.json()["message"]
    r = action(sim, ns, "m", "start")
    assert r.status_code == 202 and r.text == ""
    assert custom.get_namespaced_custom_object(*KV, ns, "virtualmachines", "m")["spec"]["runStrategy"] == "Always"
    seen = set()
    wait_for(lambda: seen.add(vm_status(custom, ns, "m")) or "Running" in seen, interval=0.01, what="running")
    assert "Starting" in seen
    r = action(sim, ns, "m", "start")
    assert r.status_code == 409 and "VM is already running" in r.json()["message"]
    vmi = custom.get_namespaced_custom_object(*KV, ns, "virtualmachineinstances", "m")
    assert vmi["status"]["nodeName"].startswith("vm-cpu") and vmi["status"]["interfaces"][0]["ipAddress"]
    assert [c for c in vmi["status"]["conditions"] if c["type"] == "Ready"][0]["status"] == "True"
    phases = [p["phase"] for p in vmi["status"]["phaseTransitionTimestamps"]]
    assert phases[:4] == ["Pending", "Scheduling", "Scheduled", "Running"]
    r = action(sim, ns, "m", "stop", {"gracePeriod": 0})
    assert r.status_code == 202
    wait_for(lambda: get(custom, KV, ns, "virtualmachineinstances", "m") is None, what="vmi gone")
    assert vm_status(custom, ns, "m") == "Stopped"
    assert custom.get_namespaced_custom_object(*KV, ns, "virtualmachines", "m")["spec"]["runStrategy"] == "Halted"
    # Always refuses a manual start; Manual uses stateChangeRequests.
    custom.patch_namespaced_custom_object(*KV, ns, "virtualmachines", "m", {"spec": {"runStrategy": "Always"}})
    wait_for(lambda: vm_status(custom, ns, "m") == "Running", what="Always starts it")
    custom.patch_namespaced_custom_object(*KV, ns, "virtualmachines", "m", {"spec": {"runStrategy": "Manual"}})
    assert action(sim, ns, "m", "stop").status_code == 202
    wait_for(lambda: vm_status(custom, ns, "m") == "Stopped", what="manual stop")
    assert action(sim, ns, "m", "start").status_code == 202
    wait_for(lambda: vm_status(custom, ns, "m") == "Running", what="manual start")
    custom.patch_namespaced_custom_object(*KV, ns, "virtualmachines", "m", {"spec": {"runStrategy": "Always"}})
    r = action(sim, ns, "m", "start")
    assert r.status_code == 409
    assert action(sim, ns, "m", "stop").status_code == 202
    wait_for(lambda: vm_status(custom, ns, "m") == "Stopped", what="stopped again")
    r = http(sim).put(sim.url + SUB.format(ns=ns, kind="virtualmachines", name="nope", action="start"), json={})
    assert r.status_code == 404


def test_guest_runs_jupyter_on_its_root_disk_behind_the_service(custom, core, ns, sim):
    """The guest: a Jupyter server on the VM's root disk behind its Service, with its Secret's
    environment; the guest agent's calls as virt-handler answers them, the userlist as KubeVirt's
    VirtualMachineInstanceGuestOSUser (staging/src/kubevirt.io/api/core/v1/types.go: userName,
    domain, loginTime). Inside it, what a Linux guest keeps: login records in /run/utmp as glibc's
    struct utmp (bits/utmp.h), the last input on a tty as its atime (procps w.c takes the idle time
    from it), busy processes in /proc (proc(5): /proc/stat, /proc/PID/stat, /proc/PID/status). The
    fault API refuses a body no guest could have, and then nothing changes."""
    core.create_namespaced_secret(ns, {"metadata": {"name": "env"}, "stringData": {"GREETING": "hello"}})
    make_disk(custom, ns, "g-disk")
    custom.create_namespaced_custom_object(*KV, ns, "virtualmachines", vm("g", "g-disk", secret="env"))
    svc = core.create_namespaced_service(ns, {"metadata": {"name": "g-notebook"}, "spec": {
        "selector": {"app": "g"}, "ports": [{"name": "jupyter", "port": 8888, "targetPort": 8888}]}})
    assert ipaddress.ip_address(svc.spec.cluster_ip) in sim.cluster.service_network
    assert action(sim, ns, "g", "start").status_code == 202
    wait_for(lambda: vm_status(custom, ns, "g") == "Running", what="running")
    url = f"http://{svc.spec.cluster_ip}:8888"
    wait_for(lambda: answers(url + "/api"), timeout=60, interval=0.3, what="jupyter behind the service")
    requests.put(url + "/api/contents/opt/marker.txt", json={"type": "file", "format": "text", "content": "x"})
    pvc = core.read_namespaced_persistent_volume_claim("g-disk", ns)
    root = os.path.join(sim.cluster.state_dir, "volumes", pvc.spec.volume_name)
    assert open(os.path.join(root, "opt", "marker.txt")).read() == "x"
    machine_id = open(os.path.join(root, "etc", "machine-id")).read().strip()
    assert machine_id != "uninitialized" and len(machine_id) == 32
    ep = core.read_namespaced_endpoints("g-notebook", ns)
    vmi = custom.get_namespaced_custom_object(*KV, ns, "virtualmachineinstances", "g")
    assert ep.subsets[0].addresses[0].ip == vmi["status"]["interfaces"][0]["ipAddress"]
    guests = http(sim).get(f"{sim.url}/sim/v1/guests").json()["guests"]
    pid = next(g["pid"] for g in guests if g["name"] == "g")
    environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    assert b"GREETING=hello" in environ
    # The guest agent.
    wait_for(lambda: agent(sim, ns, "g", "guestosinfo").status_code == 200, what="agent")
    info = agent(sim, ns, "g", "guestosinfo").json()
    assert info["os"]["prettyName"] == "Ubuntu 24.04.1 LTS"
    fs = agent(sim, ns, "g", "filesystemlist").json()["items"][0]
    assert fs["mountPoint"] == "/" and 0 < fs["usedBytes"] <= fs["totalBytes"] == 60 * 2**30
    http(sim).put(f"{sim.url}/sim/v1/vmis/{ns}/g/users", json={"users": [
        {"userName": "alice", "loginTime": 1.5, "host": "10.0.0.5", "tty": "pts/3", "idleSeconds": 120}]})
    assert agent(sim, ns, "g", "userlist").json()["items"] == [{"userName": "alice", "loginTime": 1.5}]
    # Inside the guest, where a Linux machine keeps them: utmp and the tty's last input (its atime).
    utmp = open(os.path.join(root, "run", "utmp"), "rb").read()
    assert len(utmp) == 384
    kind, _pid, line, _id, user, host = struct.unpack_from("<h2xi32s4s32s256s", utmp)
    assert (kind, line.rstrip(b"\0"), user.rstrip(b"\0"), host.rstrip(b"\0")) == (7, b"pts/3", b"alice", b"10.0.0.5")
    assert 100 < time.time() - os.stat(os.path.join(root, "dev", "pts", "3")).st_atime < 140
    # A busy process, as the guest's tools see it in /proc (proc(5): /proc/stat, /proc/PID/stat
    # and status), its CPU time growing with the wall clock.
    http(sim).put(f"{sim.url}/sim/v1/vmis/{ns}/g/processes", json={"processes": [
        {"pid": 4242, "uid": 1000, "command": "python3 train.py", "cpu": 95}]})
    processes = BusyProcesses(root, 1000)
    assert processes.read(50) == []  # the first read only takes a sample
    time.sleep(2.5)
    [busy] = processes.read(50)
    assert (busy.pid, busy.uid, busy.command) == (4242, 1000, "python3 train.py") and 80 < busy.cpu < 110
    assert os.path.exists(os.path.join(root, "proc", "2000"))  # alice's session: her utmp record is not stale
    for what, body in (("processes", {"processes": [{"pid": 4243, "cpu": "x"}]}),
                       ("processes", {"processes": [{"command": "no pid", "cpu": 5}]}),
                       ("processes", {"processes": [{"pid": 4242}, {"pid": 4242}]}),
                       ("processes", ["not", "an", "object"]),
                       ("users", {"users": [{"userName": "eve", "tty": "../../etc/passwd"}]}),
                       ("users", {"users": [{"host": "10.0.0.6"}]}),
                       ("gpu", {"utilization": "lots"})):
        r = http(sim).put(f"{sim.url}/sim/v1/vmis/{ns}/g/{what}", json=body)
        assert r.status_code == 400, (body, r.text)
    assert "cpu wrong or missing" in http(sim).put(f"{sim.url}/sim/v1/vmis/{ns}/g/processes", json={
        "processes": [{"pid": 4243, "cpu": "x"}]}).json()["message"]
    facts = sim_api(sim, "GET", f"/vmis/{ns}/g/processes")
    assert [p["pid"] for p in facts["processes"]] == [4242] and [u["userName"] for u in facts["users"]] == ["alice"]
    assert facts["gpuUtilization"] == 0.0
    assert sorted(os.listdir(os.path.join(root, "proc"))) == ["2000", "4242", "stat"]
    http(sim).put(f"{sim.url}/sim/v1/vmis/{ns}/g/processes", json={"processes": []})
    assert not os.path.exists(os.path.join(root, "proc"))
    http(sim).put(f"{sim.url}/sim/v1/vmis/{ns}/g/agent", json={"connected": False})
    r = agent(sim, ns, "g", "guestosinfo")
    assert r.status_code == 500 and r.headers["Content-Type"].startswith("text/plain")
    wait_for(lambda: not any(c["type"] == "AgentConnected" for c in
                             custom.get_namespaced_custom_object(*KV, ns, "virtualmachineinstances", "g")
                             ["status"]["conditions"]), what="agent condition dropped")
    http(sim).put(f"{sim.url}/sim/v1/vmis/{ns}/g/agent", json={"connected": True})
    assert action(sim, ns, "g", "stop").status_code == 202
    wait_for(lambda: get(custom, KV, ns, "virtualmachineinstances", "g") is None, what="stopped")
    assert not answers(url + "/api")
    r = agent(sim, ns, "g", "guestosinfo")
    assert r.status_code == 404
    assert core.read_namespaced_persistent_volume_claim("g-disk", ns).status.phase == "Bound"


def test_gpu_scheduling_and_capacity_release(custom, core, sim):
    """GPUs as the scheduler counts a device plugin's resource, with its FitError message
    (pkg/scheduler/framework/types.go; Insufficient from plugins/noderesources/fit.go, the node
    affinity reason from plugins/nodeaffinity/node_affinity.go). Inside a guest with one passed
    through, the nvidia-smi the driver installs answers a query as the nvidia-smi man page
    describes it (--query-gpu with --format=csv,noheader,nounits: one line per GPU) and refuses
    what it does not know with a RETURN VALUE other than 0."""
    ns = "gpus"
    core.create_namespace({"metadata": {"name": ns}})
    running_vm(sim, custom, ns, "gpu1", gpu=True)
    running_vm(sim, custom, ns, "gpu2", gpu=True)
    for n in ("gpu1", "gpu2"):
        assert custom.get_namespaced_custom_object(*KV, ns, "virtualmachineinstances", n)["status"]["nodeName"] \
            == "vm-gpu-pci-1"
    make_disk(custom, ns, "gpu3-disk")
    custom.create_namespaced_custom_object(*KV, ns, "virtualmachines", vm("gpu3", "gpu3-disk", gpu=True))
    assert action(sim, ns, "gpu3", "start").status_code == 202
    wait_for(lambda: vm_status(custom, ns, "gpu3") == "ErrorUnschedulable", what="unschedulable")
    vmi = custom.get_namespaced_custom_object(*KV, ns, "virtualmachineinstances", "gpu3")
    cond = next(c for c in vmi["status"]["conditions"] if c["type"] == "PodScheduled")
    assert cond["status"] == "False" and cond["reason"] == "Unschedulable"
    assert cond["message"].startswith("0/4 nodes are available: 1 Insufficient nvidia.com/A100-PCIE-40GB, "
                                      "3 node(s) didn't match Pod's node affinity/selector")
    assert any(e.reason == "FailedScheduling" for e in core.list_namespaced_event(ns).items)
    # The guest's nvidia-smi (on its PATH, as the NVIDIA driver installs it) reports the utilisation
    # the fault API sets, in the CSV form of `nvidia-smi --query-gpu=... --format=csv,noheader,nounits`.
    http(sim).put(f"{sim.url}/sim/v1/vmis/{ns}/gpu1/gpu", json={"utilization": 87})
    smi = os.path.join(sim.cluster.state_dir, "guests", f"{ns}_gpu1.bin", "nvidia-smi")
    query = [smi, "--query-gpu=index,name,utilization.gpu", "--format=csv,noheader,nounits"]
    assert subprocess.run(query, capture_output=True, text=True, check=True).stdout == \
        "0, NVIDIA A100-PCIE-40GB, 87\n"
    assert subprocess.run([smi, "-q"], capture_output=True).returncode == 2
    assert action(sim, ns, "gpu1", "stop").status_code == 202
    wait_for(lambda: vm_status(custom, ns, "gpu3") == "Running", what="gpu3 gets the freed GPU")


def test_what_a_guest_keeps_in_memory_is_not_on_its_disk(custom, core, sim, caplog):
    """A Linux guest's /run is a tmpfs, /dev a devtmpfs with devpts, /proc a procfs (systemd's
    src/shared/mount-setup.c mounts them at boot; proc(5)): none of it is on the root disk, so none outlives a power-off and
    each boot starts without it. A reboot ends login sessions and processes: the fault API's facts
    of a VMI go with it. A machine without a GPU still has the CUDA image's nvidia-smi, which fails
    as the nvidia-smi man page says it does with no driver loaded (RETURN VALUE 9)."""
    ns = "runtime"
    core.create_namespace({"metadata": {"name": ns}})
    running_vm(sim, custom, ns, "rt")
    pvc = core.read_namespaced_persistent_volume_claim("rt-disk", ns)
    root = os.path.join(sim.cluster.state_dir, "volumes", pvc.spec.volume_name)
    wait_for(lambda: os.path.exists(os.path.join(root, "run", "utmp")), what="the guest's /run")
    smi = os.path.join(sim.cluster.state_dir, "guests", f"{ns}_rt.bin", "nvidia-smi")
    done = subprocess.run([smi, "--query-gpu=index,name,utilization.gpu", "--format=csv,noheader,nounits"],
                          capture_output=True, text=True)
    assert (done.returncode, done.stdout) == (9, "")
    assert done.stderr == ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
                           "Make sure that the latest NVIDIA driver is installed and running.\n")

    # Facts the fault API would refuse, put there behind its back, do not end the CPU-time refreshes.
    sim.call(lambda: sim.cluster.compute.processes.__setitem__((ns, "rt"), [{"pid": 78, "cpu": "x"}]))
    wait_for(lambda: "guest facts of runtime/rt could not be refreshed" in caplog.text, what="the refresh's log")
    sim_api(sim, "PUT", f"/vmis/{ns}/rt/processes", {"processes": [{"pid": 77, "uid": 1000, "command": "make",
                                                                   "cpu": 90}]})
    sim_api(sim, "PUT", f"/vmis/{ns}/rt/users", {"users": [{"userName": "bob", "tty": "pts/1", "host": "10.0.0.7"}]})
    sim_api(sim, "PUT", f"/vmis/{ns}/rt/gpu", {"utilization": 40})
    processes = BusyProcesses(root, 1000)
    assert processes.read(50) == []
    time.sleep(2.5)
    assert [p.pid for p in processes.read(50)] == [77]
    for path in ("run/utmp", "dev/pts/1", "proc/77/stat"):
        assert os.path.exists(os.path.join(root, path)), path

    assert action(sim, ns, "rt", "stop").status_code == 202
    wait_for(lambda: get(custom, KV, ns, "virtualmachineinstances", "rt") is None, what="stopped")
    assert [d for d in ("run", "dev", "proc") if os.path.exists(os.path.join(root, d))] == []
    assert os.path.exists(os.path.join(root, "etc", "machine-id"))  # the disk itself stays
    facts = sim_api(sim, "GET", f"/vmis/{ns}/rt/users")
    assert (facts["users"], facts["processes"], facts["gpuUtilization"]) == ([], [], 0.0)

    assert action(sim, ns, "rt", "start").status_code == 202
    wait_for(lambda: os.path.exists(os.path.join(root, "run", "utmp")), what="the next boot's /run")
    assert os.path.getsize(os.path.join(root, "run", "utmp")) == 0
    assert not os.path.exists(os.path.join(root, "dev")) and not os.path.exists(os.path.join(root, "proc"))
    action(sim, ns, "rt", "stop", {"gracePeriod": 0})


def test_a_copy_of_a_disk_leaves_out_what_the_guest_keeps_in_memory(tmp_path):
    """A CDI clone or a CSI snapshot copies the disk (CDI pkg/controller/clone/csi-clone.go; the RBD image
    in ceph-csi), and a root filesystem's /run, /dev and /proc are not on it (systemd's
    src/shared/mount-setup.c mounts tmpfs, devtmpfs and procfs there; proc(5)). On a disk that is no root filesystem
    (no /etc), such as the workspace on /home, a directory of those names is data."""
    from kubevirt_spawner.sim.storage import copy_tree
    root, home = tmp_path / "root", tmp_path / "home"
    for rel in ("etc/hostname", "opt/data", "run/utmp", "dev/pts/0", "proc/stat"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("x")
    (home / "dev").mkdir(parents=True)
    (home / "dev" / "notes.txt").write_text("mine")
    copy_tree(str(root), str(tmp_path / "clone"))
    assert sorted(os.listdir(tmp_path / "clone")) == ["etc", "opt"]
    copy_tree(str(home), str(tmp_path / "home-copy"))
    assert (tmp_path / "home-copy" / "dev" / "notes.txt").read_text() == "mine"


def test_delete_vm_keeps_standalone_pvc(custom, core, ns, sim):
    running_vm(sim, custom, ns, "keep")
    custom.delete_namespaced_custom_object(*KV, ns, "virtualmachines", "keep")
    wait_for(lambda: get(custom, KV, ns, "virtualmachines", "keep") is None, what="vm deleted")
    assert get(custom, KV, ns, "virtualmachineinstances", "keep") is None
    assert core.read_namespaced_persistent_volume_claim("keep-disk", ns).status.phase == "Bound"
    assert get(custom, CDI, ns, "datavolumes", "keep-disk") is not None


def test_a_lost_node_keeps_its_vmi_running_until_its_launcher_pod_is_gone(custom, core, sim):
    """Node loss as upstream shows it. Kubernetes' node lifecycle controller sets Ready=Unknown and the
    unreachable taints (pkg/controller/nodelifecycle/node_lifecycle_controller.go) and marks the pods
    not ready; taint eviction marks them for deletion, and they stay Terminating, no kubelet confirming
    (pkg/controller/tainteviction/taint_eviction.go). KubeVirt never sets a VMI to phase Unknown: after
    virt-handler's heartbeat timeout it labels the node kubevirt.io/schedulable=false with a
    NodeUnresponsive event, and fails a VMI only once its launcher pod is gone
    (pkg/virt-controller/watch/node/node.go), here when an admin taints the node out-of-service and
    podgc force-deletes the pods (pkg/controller/podgc/gc_controller.go). Until then the VMI holds its
    disk: a second VM waits with a Multi-Attach error on its launcher Pod."""
    ns = "fencing"
    core.create_namespace({"metadata": {"name": ns}})
    saved = sim_api(sim, "GET", "/timing")["timing"]
    sim_api(sim, "PUT", "/timing", {"eviction": 40, "heartbeat_timeout": 40})  # 1 s each at the tests' speed
    try:
        running_vm(sim, custom, ns, "a")
        vmi = custom.get_namespaced_custom_object(*KV, ns, "virtualmachineinstances", "a")
        node = vmi["status"]["nodeName"]
        pods = core.list_namespaced_pod(ns, label_selector="kubevirt.io=virt-launcher").items
        assert [p.metadata.name for p in pods] == [p.metadata.name for p in pods if
                                                    p.metadata.name.startswith("virt-launcher-a-")] and len(pods) == 1
        pod = pods[0]
        assert pod.spec.node_name == node and pod.status.phase == "Running"
        assert pod.metadata.owner_references[0].uid == vmi["metadata"]["uid"]
        assert pod.metadata.labels["kubevirt.io/created-by"] == vmi["metadata"]["uid"]
        # the disk's VolumeAttachment (kubernetes pkg/volume/csi/csi_attacher.go): csi-<sha256> per volume and node
        pv = core.read_namespaced_persistent_volume_claim("a-disk", ns).spec.volume_name
        storage = client.StorageV1Api(core.api_client)

        def attached() -> list[tuple[str, str, bool]]:
            return sorted((va.spec.node_name, va.metadata.name, bool(va.status and va.status.attached))
                          for va in storage.list_volume_attachment().items if va.spec.source.persistent_volume_name == pv)
        held = attached()
        assert [(n, a) for n, _, a in held] == [(node, True)] and len(held[0][1]) == len("csi-") + 64, held

        http(sim).post(f"{sim.url}/sim/v1/nodes/{node}/lose")
        n = core.read_node(node)
        assert next(c for c in n.status.conditions if c.type == "Ready").status == "Unknown"
        assert {(t.key, t.effect) for t in n.spec.taints} >= {("node.kubernetes.io/unreachable", "NoSchedule"),
                                                              ("node.kubernetes.io/unreachable", "NoExecute")}
        wait_for(lambda: core.read_node(node).metadata.labels.get("kubevirt.io/schedulable") == "false",
                 what="KubeVirt marks the node")
        assert any(e.reason == "NodeUnresponsive" and e.involved_object.name == node
                   for e in core.list_namespaced_event("default").items)
        wait_for(lambda: core.read_namespaced_pod(pod.metadata.name, ns).metadata.deletion_timestamp,
                 what="the pod evicted, and Terminating")
        assert vmi_phase(custom, ns, "a") == "Running"
        ready = [c for c in get(custom, KV, ns, "virtualmachineinstances", "a")["status"]["conditions"]
                 if c["type"] == "Ready"]
        assert ready[0]["status"] == "False"
        assert any(g["name"] == "a" and g["alive"] for g in http(sim).get(f"{sim.url}/sim/v1/guests").json()["guests"])
        # Stopping cannot reach the lost node: the VMI stays, Running, and so does its hold on the disk.
        assert action(sim, ns, "a", "stop").status_code == 202
        wait_for(lambda: (get(custom, KV, ns, "virtualmachineinstances", "a") or {}).get("metadata", {})
                 .get("deletionTimestamp"), what="deletion requested")
        assert vmi_phase(custom, ns, "a") == "Running"
        custom.create_namespaced_custom_object(*KV, ns, "virtualmachines", vm("b", "a-disk"))
        assert action(sim, ns, "b", "start").status_code == 202

        def multi_attach():
            return [e for e in core.list_namespaced_event(ns).items if e.reason == "FailedAttachVolume"]
        events = wait_for(multi_attach, what="Multi-Attach error")
        assert events[0].involved_object.kind == "Pod" and events[0].involved_object.name.startswith("virt-launcher-b-")
        assert pod.metadata.name in events[0].message
        assert vmi_phase(custom, ns, "b") == "Scheduled"
        assert [n for n, _, _ in attached()] == [node]  # (still the lost node's: nothing detached it)

        http(sim).post(f"{sim.url}/sim/v1/nodes/{node}/fence")
        assert any(t.key == "node.kubernetes.io/out-of-service" and t.effect == "NoExecute"
                   for t in core.read_node(node).spec.taints)
        wait_for(lambda: get(custom, KV, ns, "virtualmachineinstances", "a") is None, what="fenced VMI gone")
        assert any(e.reason == "NodeUnresponsive" and e.involved_object.name == "a"
                   for e in core.list_namespaced_event(ns).items)
        wait_for(lambda: vmi_phase(custom, ns, "b") == "Running", what="b takes the disk")
        assert custom.get_namespaced_custom_object(*KV, ns, "virtualmachineinstances", "b")["status"]["nodeName"] != node
        b_node = custom.get_namespaced_custom_object(*KV, ns, "virtualmachineinstances", "b")["status"]["nodeName"]
        assert [(n, a) for n, _, a in attached()] == [(b_node, True)]  # detached from the fenced node, then attached
        assert http(sim).get(f"{sim.url}/sim/v1/violations").json()["violations"] == []
        http(sim).post(f"{sim.url}/sim/v1/nodes/{node}/recover")
        n = core.read_node(node)
        assert next(c for c in n.status.conditions if c.type == "Ready").status == "True"
        assert not [t for t in n.spec.taints or [] if t.key.startswith("node.kubernetes.io/")]
        wait_for(lambda: core.read_node(node).metadata.labels.get("kubevirt.io/schedulable") == "true",
                 what="virt-handler back")
    finally:
        sim_api(sim, "PUT", "/timing", saved)
    # KubeVirt has no use for phase Unknown: no VMI ever showed it.
    assert not [e for e in core.list_namespaced_event(ns).items if "Unknown" in (e.message or "")]


def test_a_node_back_after_eviction_finishes_its_terminating_pods(custom, core, sim):
    """Pods evicted from an unreachable node stay Terminating (no kubelet confirms); when the node
    answers again its kubelet stops them, and the VMIs whose pods are gone fail
    (pkg/controller/tainteviction/taint_eviction.go, pkg/virt-controller/watch/vmi/lifecycle.go)."""
    ns = "comeback"
    core.create_namespace({"metadata": {"name": ns}})
    saved = sim_api(sim, "GET", "/timing")["timing"]
    sim_api(sim, "PUT", "/timing", {"eviction": 40})  # 1 s at the tests' speed
    try:
        running_vm(sim, custom, ns, "c")
        custom.patch_namespaced_custom_object(*KV, ns, "virtualmachines", "c", {"spec": {"runStrategy": "Manual"}})
        node = custom.get_namespaced_custom_object(*KV, ns, "virtualmachineinstances", "c")["status"]["nodeName"]
        pod = core.list_namespaced_pod(ns, label_selector="kubevirt.io=virt-launcher").items[0].metadata.name
        http(sim).post(f"{sim.url}/sim/v1/nodes/{node}/lose")
        wait_for(lambda: core.read_namespaced_pod(pod, ns).metadata.deletion_timestamp, what="pod Terminating")
        http(sim).post(f"{sim.url}/sim/v1/nodes/{node}/recover")
        wait_for(lambda: not core.list_namespaced_pod(ns).items, what="the kubelet finished the pod")
        wait_for(lambda: vmi_phase(custom, ns, "c") == "Failed", what="VMI failed")
        assert not any(g["name"] == "c" and g["alive"]
                       for g in http(sim).get(f"{sim.url}/sim/v1/guests").json()["guests"])
    finally:
        http(sim).post(f"{sim.url}/sim/v1/nodes/{node}/recover")
        sim_api(sim, "PUT", "/timing", saved)
    action(sim, ns, "c", "stop")


def test_a_deleted_launcher_pod_fails_its_vmi(custom, core, sim):
    """A Running VMI whose launcher pod is gone is Failed (pkg/virt-controller/watch/vmi/lifecycle.go);
    `kubectl delete pod --force` on a node that answers."""
    ns = "podgone"
    core.create_namespace({"metadata": {"name": ns}})
    running_vm(sim, custom, ns, "p")
    # Manual, so that the VM controller does not start a new VMI at once (Always would).
    custom.patch_namespaced_custom_object(*KV, ns, "virtualmachines", "p", {"spec": {"runStrategy": "Manual"}})
    pod = core.list_namespaced_pod(ns, label_selector="kubevirt.io=virt-launcher").items[0]
    core.delete_namespaced_pod(pod.metadata.name, ns, grace_period_seconds=0)
    wait_for(lambda: vmi_phase(custom, ns, "p") == "Failed", what="VMI failed")
    assert not any(g["name"] == "p" and g["alive"] for g in http(sim).get(f"{sim.url}/sim/v1/guests").json()["guests"])
    action(sim, ns, "p", "stop")


def test_double_attach_on_one_node_is_recorded(custom, core, sim):
    ns = "violation"
    core.create_namespace({"metadata": {"name": ns}})
    make_disk(custom, ns, "shared")
    pin = {"kubernetes.io/hostname": "vm-cpu-2"}
    for name in ("x", "y"):
        body = vm(name, "shared")
        body["spec"]["template"]["spec"]["nodeSelector"] = pin
        custom.create_namespaced_custom_object(*KV, ns, "virtualmachines", body)
        action(sim, ns, name, "start")
        wait_for(lambda n=name: vm_status(custom, ns, n) == "Running", what=f"{name} running")
    violations = http(sim).get(f"{sim.url}/sim/v1/violations").json()["violations"]
    assert violations and violations[-1]["claim"] == "shared" and violations[-1]["vmis"] == ["x", "y"]
    sim.call(lambda: sim.cluster.compute.violations.clear())
    for name in ("x", "y"):
        action(sim, ns, name, "stop")


def test_snapshot_indications_and_restores(custom, core, sim):
    """Indications as pkg/storage/snapshot/snapshot.go sets them; restores as pkg/storage/snapshot/
    restore.go makes them: in place, a DataVolume's claim is deleted and made again under its name
    from the VolumeSnapshot (populatedFor the DataVolume, which adopts it and is marked
    prePopulated); RandomizeNames (the default) makes a new claim owned by the VM. A snapshot of a
    running machine holds its disk, not the guest's in-memory /run (systemd's src/shared/mount-setup.c)."""
    ns = "snaps"
    core.create_namespace({"metadata": {"name": ns}})
    running_vm(sim, custom, ns, "w", annotations={"example.com/owner": "wanda"})
    pvc = core.read_namespaced_persistent_volume_claim("w-disk", ns)
    # CDI gives the claim its DataVolume's annotations (pkg/controller/datavolume/controller-base.go
    # newPersistentVolumeClaim), which the snapshot keeps for a restore (getSimplifiedMetaObject,
    # pkg/storage/snapshot/util.go; CreateRestorePVCDef copies them back)
    assert pvc.metadata.annotations["example.com/owner"] == "wanda"
    root = os.path.join(sim.cluster.state_dir, "volumes", pvc.spec.volume_name)
    open(os.path.join(root, "opt", "state.txt"), "w").write("before")
    wait_for(lambda: agent(sim, ns, "w", "guestosinfo").status_code == 200, what="agent")
    assert os.path.exists(os.path.join(root, "run", "utmp"))

    def snapshot(name):
        custom.create_namespaced_custom_object(*SNAP, ns, "virtualmachinesnapshots", {
            "apiVersion": "snapshot.kubevirt.io/v1beta1", "kind": "VirtualMachineSnapshot",
            "metadata": {"name": name}, "spec": {"source": {"apiGroup": "kubevirt.io", "kind": "VirtualMachine",
                                                            "name": "w"}}})
        return wait_for(lambda: (lambda s: s if (s.get("status") or {}).get("readyToUse") else None)(
            custom.get_namespaced_custom_object(*SNAP, ns, "virtualmachinesnapshots", name)), what=name)
    online = snapshot("online")
    assert online["status"]["phase"] == "Succeeded"
    # Sorted, with KubeVirt's messages (pkg/storage/snapshot/snapshot.go); a stopped VM has none.
    assert online["status"]["indications"] == ["GuestAgent", "Online"]
    assert [i["indication"] for i in online["status"]["sourceIndications"]] == ["GuestAgent", "Online"]
    assert online["status"]["sourceIndications"][0]["message"] == (
        "Guest agent was active and attempted to quiesce the filesystem for application consistency.")
    assert online["status"]["snapshotVolumes"]["includedVolumes"] == ["rootdisk"]
    content = custom.get_namespaced_custom_object(*SNAP, ns, "virtualmachinesnapshotcontents",
                                                  online["status"]["virtualMachineSnapshotContentName"])
    assert content["status"]["readyToUse"] and content["spec"]["volumeBackups"][0]["volumeName"] == "rootdisk"
    http(sim).put(f"{sim.url}/sim/v1/vmis/{ns}/w/agent", json={"connected": False})
    assert snapshot("noagent")["status"]["indications"] == ["NoGuestAgent", "Online"]
    action(sim, ns, "w", "stop")
    wait_for(lambda: vm_status(custom, ns, "w") == "Stopped", what="stopped")
    offline = snapshot("offline")["status"]
    assert "indications" not in offline and "sourceIndications" not in offline
    open(os.path.join(root, "opt", "state.txt"), "w").write("after")

    def restore(name, **spec):
        custom.create_namespaced_custom_object(*SNAP, ns, "virtualmachinerestores", {
            "apiVersion": "snapshot.kubevirt.io/v1beta1", "kind": "VirtualMachineRestore", "metadata": {"name": name},
            "spec": {"target": {"apiGroup": "kubevirt.io", "kind": "VirtualMachine", "name": "w"},
                     "virtualMachineSnapshotName": "online", **spec}})
        return wait_for(lambda: (lambda r: r if (r.get("status") or {}).get("complete") else None)(
            custom.get_namespaced_custom_object(*SNAP, ns, "virtualmachinerestores", name)), what=name)
    # InPlace: a new claim of the same name with the snapshot's data, adopted by the DataVolume.
    r = restore("inplace", volumeRestorePolicy="InPlace")
    assert r["status"]["restores"][0]["persistentVolumeClaim"] == "w-disk"
    assert r["status"]["restores"][0]["dataVolumeName"] == "w-disk"
    again = core.read_namespaced_persistent_volume_claim("w-disk", ns)
    assert again.metadata.uid != pvc.metadata.uid and again.spec.data_source.kind == "VolumeSnapshot"
    assert again.metadata.annotations["cdi.kubevirt.io/storage.populatedFor"] == "w-disk"
    assert again.metadata.annotations["example.com/owner"] == "wanda"
    assert again.metadata.annotations["restore.kubevirt.io/lastRestoreUID"].startswith("inplace-")
    wait_for(lambda: [o.kind for o in core.read_namespaced_persistent_volume_claim("w-disk", ns).metadata
                      .owner_references or []] == ["DataVolume"], what="the DataVolume adopts the claim")
    dv = get(custom, CDI, ns, "datavolumes", "w-disk")
    assert dv["metadata"]["annotations"]["cdi.kubevirt.io/storage.prePopulated"] == "w-disk"
    assert dv["status"]["phase"] == "Succeeded"
    root = os.path.join(sim.cluster.state_dir, "volumes", again.spec.volume_name)
    assert open(os.path.join(root, "opt", "state.txt")).read() == "before"
    assert not os.path.exists(os.path.join(root, "run"))  # taken while running: the disk, not its /run
    assert "restoreInProgress" not in (custom.get_namespaced_custom_object(*KV, ns, "virtualmachines", "w")
                                       .get("status") or {})
    # RandomizeNames (the default): a new claim owned by the VM, the VM rewritten to use it.
    open(os.path.join(root, "opt", "state.txt"), "w").write("after")
    r = restore("randomized")
    claim = r["status"]["restores"][0]["persistentVolumeClaim"]
    assert claim.startswith("restore-") and claim.endswith("-rootdisk")
    new_pvc = core.read_namespaced_persistent_volume_claim(claim, ns)
    assert new_pvc.metadata.owner_references[0].kind == "VirtualMachine"
    new_root = os.path.join(sim.cluster.state_dir, "volumes", new_pvc.spec.volume_name)
    assert open(os.path.join(new_root, "opt", "state.txt")).read() == "before"
    vm_obj = custom.get_namespaced_custom_object(*KV, ns, "virtualmachines", "w")
    assert vm_obj["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == claim
    # StopTarget stops a running target first.
    action(sim, ns, "w", "start")
    wait_for(lambda: vm_status(custom, ns, "w") == "Running", what="running for StopTarget")
    r = restore("stoptarget", targetReadinessPolicy="StopTarget", volumeRestorePolicy="InPlace")
    assert r["status"]["complete"] and vm_status(custom, ns, "w") == "Stopped"


def test_restore_errors_are_tried_again_without_failure_and_a_deleted_restore_unlocks(custom, core, sim):
    """pkg/storage/snapshot/restore.go: an error in reconcile goes through doUpdateError (Progressing
    and Ready False with the error as reason, a VirtualMachineRestoreError event, no Failure) and
    is tried again. In place, the claim is deleted before the new one is made, so a missing
    VolumeSnapshot ("missing volumeSnapshot", createRestorePVC) and a quota refusing the new claim
    stall it with the VM locked (status.restoreInProgress, which vm-storage-status.go enforces).
    Deleting the restore unlocks the VM through its finalizer (handleVMRestoreDeletion)."""
    ns = "restore-errors"
    core.create_namespace({"metadata": {"name": ns}})
    make_disk(custom, ns, "e-disk")
    custom.create_namespaced_custom_object(*KV, ns, "virtualmachines", vm("e", "e-disk"))
    custom.create_namespaced_custom_object(*SNAP, ns, "virtualmachinesnapshots", {
        "apiVersion": "snapshot.kubevirt.io/v1beta1", "kind": "VirtualMachineSnapshot", "metadata": {"name": "s"},
        "spec": {"source": {"apiGroup": "kubevirt.io", "kind": "VirtualMachine", "name": "e"}}})
    wait_for(lambda: (custom.get_namespaced_custom_object(*SNAP, ns, "virtualmachinesnapshots", "s").get("status")
                      or {}).get("readyToUse"), what="snapshot ready")

    def restore_status(name):
        return custom.get_namespaced_custom_object(*SNAP, ns, "virtualmachinerestores", name).get("status") or {}

    def stalled_with(name, words):
        ready = next((c for c in restore_status(name).get("conditions") or [] if c["type"] == "Ready"), {})
        return words in (ready.get("reason") or "")

    def locked():
        return (custom.get_namespaced_custom_object(*KV, ns, "virtualmachines", "e").get("status") or {}).get(
            "restoreInProgress")
    # a quota the new claim does not fit in (the old one is gone by then): refused, tried again
    core.create_namespaced_resource_quota(ns, {"metadata": {"name": "claims"}, "spec": {"hard": {
        "persistentvolumeclaims": "0"}}})
    custom.create_namespaced_custom_object(*SNAP, ns, "virtualmachinerestores", {
        "apiVersion": "snapshot.kubevirt.io/v1beta1", "kind": "VirtualMachineRestore", "metadata": {"name": "q"},
        "spec": {"target": {"apiGroup": "kubevirt.io", "kind": "VirtualMachine", "name": "e"},
                 "virtualMachineSnapshotName": "s", "volumeRestorePolicy": "InPlace"}})
    wait_for(lambda: stalled_with("q", "exceeded quota: claims"), what="the quota's refusal in Ready")
    status = restore_status("q")
    assert not status["complete"] and not any(c["type"] == "Failure" for c in status["conditions"])
    assert locked() == "q"
    events = [e for e in core.list_namespaced_event(ns).items if e.reason == "VirtualMachineRestoreError"]
    assert events and "exceeded quota: claims" in events[0].message
    # the lock: no change of the run state (pkg/storage/admitters/vm-storage-status.go)
    refused = action(sim, ns, "e", "start")
    assert refused.status_code == 500 and 'Cannot update VM runStrategy until restore \\"q\\" completes' in refused.text
    # deleted, it unlocks the VM and goes
    custom.delete_namespaced_custom_object(*SNAP, ns, "virtualmachinerestores", "q")
    wait_for(lambda: locked() is None, what="the VM unlocked")
    wait_for(lambda: get(custom, SNAP, ns, "virtualmachinerestores", "q") is None, what="the restore gone")
    core.delete_namespaced_resource_quota("claims", ns, _preload_content=False)
    # a missing VolumeSnapshot: found missing only when the claim it replaces is gone
    for vs in custom.list_namespaced_custom_object("snapshot.storage.k8s.io", "v1", ns, "volumesnapshots")["items"]:
        custom.delete_namespaced_custom_object("snapshot.storage.k8s.io", "v1", ns, "volumesnapshots",
                                               vs["metadata"]["name"])
    custom.create_namespaced_custom_object(*SNAP, ns, "virtualmachinerestores", {
        "apiVersion": "snapshot.kubevirt.io/v1beta1", "kind": "VirtualMachineRestore", "metadata": {"name": "m"},
        "spec": {"target": {"apiGroup": "kubevirt.io", "kind": "VirtualMachine", "name": "e"},
                 "virtualMachineSnapshotName": "s", "volumeRestorePolicy": "InPlace"}})
    wait_for(lambda: stalled_with("m", "missing volumeSnapshot"), what="the missing VolumeSnapshot in Ready")
    assert locked() == "m" and not any(c["type"] == "Failure" for c in restore_status("m")["conditions"])
    custom.delete_namespaced_custom_object(*SNAP, ns, "virtualmachinerestores", "m")
    wait_for(lambda: locked() is None, what="the VM unlocked")
    # the simulator's fault: any error, as doUpdateError reports it; a bad body is refused
    assert http(sim).put(f"{sim.url}/sim/v1/faults/restores", json={"error": ""}).status_code == 400
    assert http(sim).put(f"{sim.url}/sim/v1/faults/restores", json={"error": "boom"}).json() == {"error": "boom"}
    assert http(sim).delete(f"{sim.url}/sim/v1/faults/restores").json() == {"error": None}


def test_webhooks_down_refuse_kubevirt_and_cdi_writes_as_the_api_server_does(custom, core, sim):
    """With virt-api and cdi-api unreachable, the API server refuses what their validating webhooks
    (failurePolicy Fail) would check, with its own 500 (apiserver's validating dispatcher wraps
    ErrCallingWebhook, pkg/util/webhook/error.go, in NewInternalError), and the aggregator answers
    503 for virt-api's subresources (kube-aggregator handler_proxy.go). Names and paths: KubeVirt's
    pkg/virt-operator/resource/generate/components/webhooks.go, CDI's
    pkg/operator/resources/cluster/apiserver.go. Reads, deletes and other kinds go on."""
    ns = "webhooks-down"
    core.create_namespace({"metadata": {"name": ns}})
    make_disk(custom, ns, "w-disk")
    assert http(sim).put(f"{sim.url}/sim/v1/faults/webhooks", json={"down": "yes"}).status_code == 400
    assert http(sim).put(f"{sim.url}/sim/v1/faults/webhooks", json={"down": True}).json() == {"down": True}
    try:
        with pytest.raises(ApiException) as refused:
            custom.create_namespaced_custom_object(*KV, ns, "virtualmachines", vm("w", "w-disk"))
        assert refused.value.status == 500
        message = json.loads(refused.value.body)["message"]
        assert message.startswith('Internal error occurred: failed calling webhook "virtualmachine-validator.'
                                  'kubevirt.io": failed to call webhook: Post "https://virt-api.kubevirt.svc:443/'
                                  'virtualmachines-validate?timeout=10s"'), message
        with pytest.raises(ApiException) as refused:
            custom.create_namespaced_custom_object(*CDI, ns, "datavolumes", clone_dv("w-other", "60Gi"))
        assert 'failed calling webhook "datavolume-validate.cdi.kubevirt.io"' in json.loads(refused.value.body)["message"]
        assert action(sim, ns, "w", "start").status_code == 503
        core.create_namespaced_config_map(ns, {"metadata": {"name": "unchecked"}})  # no webhook for it
        assert get(custom, CDI, ns, "datavolumes", "w-disk") is not None
        assert get(custom, KV, ns, "virtualmachines", "w") is None  # nothing was made
    finally:
        assert http(sim).delete(f"{sim.url}/sim/v1/faults/webhooks").json() == {"down": False}
    custom.create_namespaced_custom_object(*KV, ns, "virtualmachines", vm("w", "w-disk"))
    assert action(sim, ns, "w", "start").status_code == 202


def test_gpu_quota_blocks_the_launcher(custom, core, sim):
    ns = "gpuquota"
    core.create_namespace({"metadata": {"name": ns}})
    core.create_namespaced_resource_quota(ns, {"metadata": {"name": "gpus"}, "spec": {"hard": {
        "requests.nvidia.com/A100-PCIE-40GB": "0"}}})
    make_disk(custom, ns, "q-disk")
    custom.create_namespaced_custom_object(*KV, ns, "virtualmachines", vm("q", "q-disk", gpu=True))
    assert action(sim, ns, "q", "start").status_code == 202
    ev = wait_for(lambda: next((e for e in core.list_namespaced_event(ns).items if e.reason == "FailedCreate"), None),
                  what="FailedCreate")
    assert "exceeded quota: gpus" in ev.message
    assert get(custom, KV, ns, "virtualmachineinstances", "q") is None
    action(sim, ns, "q", "stop")


def test_run_strategies_rerun_once_and_restart(custom, core, sim):
    ns = "strategies"
    core.create_namespace({"metadata": {"name": ns}})
    make_disk(custom, ns, "r-disk")
    # The guest exits with an error shortly after boot: RerunOnFailure replaces the VMI.
    sim.call(lambda: setattr(sim.cluster, "guest_command", ["sh", "-c", "sleep 0.5; exit 3", "--"]))
    try:
        custom.create_namespaced_custom_object(*KV, ns, "virtualmachines",
                                               vm("r", "r-disk", run_strategy="RerunOnFailure"))
        first = wait_for(lambda: (get(custom, KV, ns, "virtualmachineinstances", "r") or {}).get("metadata", {})
                         .get("uid"), what="first VMI")
        wait_for(lambda: (get(custom, KV, ns, "virtualmachineinstances", "r") or {}).get("metadata", {})
                 .get("uid") not in (None, first), timeout=30, what="VMI replaced after failure")
        assert any(e.reason == "Failed" for e in core.list_namespaced_event(ns).items)
        custom.patch_namespaced_custom_object(*KV, ns, "virtualmachines", "r", {"spec": {"runStrategy": "Halted"}})
        wait_for(lambda: get(custom, KV, ns, "virtualmachineinstances", "r") is None, what="halted")
        # Once: runs one time, then the VM is Halted.
        sim.call(lambda: setattr(sim.cluster, "guest_command", ["sh", "-c", "sleep 0.5; exit 0", "--"]))
        custom.patch_namespaced_custom_object(*KV, ns, "virtualmachines", "r", {"spec": {"runStrategy": "Once"}})
        r = action(sim, ns, "r", "start")
        assert r.status_code == 409 and ("Once does not support manual start requests" in r.json()["message"]
                                         or "VM is already running" in r.json()["message"])
        wait_for(lambda: custom.get_namespaced_custom_object(*KV, ns, "virtualmachines", "r")["spec"]["runStrategy"]
                 == "Halted", timeout=30, what="Once -> Halted")
    finally:
        sim.call(lambda: setattr(sim.cluster, "guest_command", None))
    # restart: a new VMI replaces the running one.
    assert action(sim, ns, "r", "restart").status_code == 409
    action(sim, ns, "r", "start")
    wait_for(lambda: vm_status(custom, ns, "r") == "Running", what="running")
    uid = custom.get_namespaced_custom_object(*KV, ns, "virtualmachineinstances", "r")["metadata"]["uid"]
    assert action(sim, ns, "r", "restart", {"gracePeriodSeconds": 0}).status_code == 202
    wait_for(lambda: (get(custom, KV, ns, "virtualmachineinstances", "r") or {}).get("metadata", {}).get("uid")
             not in (None, uid) and vm_status(custom, ns, "r") == "Running", timeout=30, what="restarted")
    action(sim, ns, "r", "stop")


def test_simulator_restart_keeps_running_machines(tmp_path):
    from kubernetes import client
    s = start_sim(tmp_path, guest_mode="null")
    kube = api_client(s)
    custom, core = client.CustomObjectsApi(kube), client.CoreV1Api(kube)
    core.create_namespace({"metadata": {"name": "keep"}})
    make_disk(custom, "keep", "k-disk")
    custom.create_namespaced_custom_object(*KV, "keep", "virtualmachines", vm("k", "k-disk"))
    action(s, "keep", "k", "start")
    wait_for(lambda: vm_status(custom, "keep", "k") == "Running", what="running")
    ip = custom.get_namespaced_custom_object(*KV, "keep", "virtualmachineinstances", "k")["status"]["interfaces"][0][
        "ipAddress"]
    s.stop()
    s2 = start_sim(tmp_path, guest_mode="null")
    try:
        custom2 = client.CustomObjectsApi(api_client(s2))
        assert vm_status(custom2, "keep", "k") == "Running"
        wait_for(lambda: answers(f"http://{ip}:8888/api"), what="guest back")
    finally:
        s2.stop()


def test_grace_period_bounds_a_guest_that_ignores_shutdown(custom, core, sim):
    import time
    ns = "grace"
    core.create_namespace({"metadata": {"name": ns}})
    make_disk(custom, ns, "s-disk")
    body = vm("s", "s-disk")
    body["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 1
    custom.create_namespaced_custom_object(*KV, ns, "virtualmachines", body)
    sim.call(lambda: setattr(sim.cluster, "guest_command", ["sh", "-c", "trap '' TERM; sleep 60 & wait; sleep 60",
                                                            "--"]))
    try:
        action(sim, ns, "s", "start")
        wait_for(lambda: vm_status(custom, ns, "s") == "Running", what="running")
        t0 = time.monotonic()
        action(sim, ns, "s", "stop")
        wait_for(lambda: get(custom, KV, ns, "virtualmachineinstances", "s") is None, what="forced off")
        assert 0.9 <= time.monotonic() - t0 < 10
    finally:
        sim.call(lambda: setattr(sim.cluster, "guest_command", None))


def test_a_graceful_stop_takes_the_guests_time_and_virt_api_answers_calls_meanwhile(custom, core, sim):
    """A stop lasts as long as the guest takes to shut down, bounded by the grace period
    (virt-handler, pkg/virt-handler/vm.go); meanwhile virt-api (pkg/virt-api/rest/lifecycle.go)
    refuses a start (it looks at the VMI's phase, not its deletion), a second stop without a shorter
    grace period, and a restart of a Halted VM; a stop with gracePeriod 0 powers the guest off."""
    import time
    ns = "slow-stop"
    core.create_namespace({"metadata": {"name": ns}})
    make_disk(custom, ns, "st-disk")
    body = vm("st", "st-disk")
    body["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 600
    custom.create_namespaced_custom_object(*KV, ns, "virtualmachines", body)
    guest = f"{sim.url}/sim/v1/vmis/{ns}/st/guest"
    assert http(sim).put(guest, json={"shutdownSeconds": 80}).status_code == 200  # 2 s at the tests' speed
    assert action(sim, ns, "st", "start").status_code == 202
    wait_for(lambda: vm_status(custom, ns, "st") == "Running", what="running")
    t0 = time.monotonic()
    assert action(sim, ns, "st", "stop").status_code == 202
    wait_for(lambda: (get(custom, KV, ns, "virtualmachineinstances", "st") or {}).get("metadata", {})
             .get("deletionTimestamp"), what="VMI deleting")
    assert vmi_phase(custom, ns, "st") == "Running" and vm_status(custom, ns, "st") == "Stopping"
    r = action(sim, ns, "st", "start")
    assert r.status_code == 409 and r.json()["message"].endswith(": VM is already running")
    r = action(sim, ns, "st", "stop")
    assert r.status_code == 409 and r.json()["message"].endswith(
        ": Halted only supports manual stop requests with a shorter graceperiod")
    r = action(sim, ns, "st", "restart")
    assert r.status_code == 409 and r.json()["message"].endswith(
        ": RunStategy Halted does not support manual restart requests")  # sic, as upstream spells it
    wait_for(lambda: get(custom, KV, ns, "virtualmachineinstances", "st") is None, timeout=30, what="stopped")
    assert 1.5 <= time.monotonic() - t0 < 15

    # A guest that would take minutes: gracePeriod 0 during its shutdown powers it off now.
    assert http(sim).put(guest, json={"shutdownSeconds": 4000}).status_code == 200
    assert action(sim, ns, "st", "start").status_code == 202
    wait_for(lambda: vm_status(custom, ns, "st") == "Running", what="running again")
    assert action(sim, ns, "st", "stop").status_code == 202
    wait_for(lambda: (get(custom, KV, ns, "virtualmachineinstances", "st") or {}).get("metadata", {})
             .get("deletionTimestamp"), what="VMI deleting")
    t0 = time.monotonic()
    assert action(sim, ns, "st", "stop", {"gracePeriod": 0}).status_code == 202
    wait_for(lambda: get(custom, KV, ns, "virtualmachineinstances", "st") is None, timeout=30, what="forced off")
    assert time.monotonic() - t0 < 10
    http(sim).delete(guest)


def test_the_guest_agent_connects_when_the_guest_starts_it_or_never(custom, core, sim):
    """AgentConnected is virt-handler's report of the guest agent's channel
    (updateGuestAgentConditions, pkg/virt-handler/vm.go): it appears when the guest has started
    its agent, which a guest may never do."""
    ns = "agents"
    core.create_namespace({"metadata": {"name": ns}})
    make_disk(custom, ns, "ag-disk")
    custom.create_namespaced_custom_object(*KV, ns, "virtualmachines", vm("ag", "ag-disk"))
    guest = f"{sim.url}/sim/v1/vmis/{ns}/ag/guest"
    assert http(sim).put(guest, json={"agentSeconds": None}).status_code == 200
    assert http(sim).put(guest, json={"agentSeconds": "soon"}).status_code == 400

    def agent_connected():
        vmi = get(custom, KV, ns, "virtualmachineinstances", "ag") or {}
        return any(c["type"] == "AgentConnected" and c["status"] == "True"
                   for c in (vmi.get("status") or {}).get("conditions") or [])

    assert action(sim, ns, "ag", "start").status_code == 202
    wait_for(lambda: vm_status(custom, ns, "ag") == "Running", what="running")
    with pytest.raises(AssertionError):
        wait_for(agent_connected, timeout=2, what="an agent that never starts")
    assert http(sim).put(guest, json={"agentSeconds": 0}).status_code == 200
    wait_for(agent_connected, timeout=10, what="the agent, once the guest starts it")
    action(sim, ns, "ag", "stop", {"gracePeriod": 0})
    http(sim).delete(guest)


def test_shared_data_and_scratch_as_kubevirt_serves_them(custom, core, ns, sim):
    """Issue 26. virtiofs of a claim needs KubeVirt's EnableVirtioFsStorageVolumes gate (KubeVirt
    v1.9 pkg/virt-api/webhooks/validating-webhook/admitters/vmi-create-admitter.go,
    validateFilesystemsWithVirtIOFSEnabled; pkg/virt-config/featuregate/active.go); the guest
    sees the claim's files at the path KUBEVIRT_SHARED_DATA gives its tag, read-only where the
    claim volume says readOnly (pkg/virt-controller/services/rendervolumes.go mounts it so in the
    launcher pod), and an emptyDisk (pkg/emptydisk) is blank at every start."""
    for claim in ("datasets", "team"):
        core.create_namespaced_persistent_volume_claim(ns, {"metadata": {"name": claim}, "spec": {
            "accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}}})
        wait_for(lambda c=claim: core.read_namespaced_persistent_volume_claim(c, ns).status.phase == "Bound",
                 what=f"{claim} bound")
    def claim_dir(claim):
        return os.path.join(sim.cluster.state_dir, "volumes",
                            core.read_namespaced_persistent_volume_claim(claim, ns).spec.volume_name)
    datasets = claim_dir("datasets")
    os.makedirs(datasets, exist_ok=True)
    with open(os.path.join(datasets, "mnist.csv"), "w") as f:
        f.write("label,pixels\n")
    env = {"KUBEVIRT_SHARED_DATA": json.dumps([{"tag": "datasets", "path": "/data/datasets", "readOnly": False},
                                               {"tag": "team", "path": "/data/team", "readOnly": False}])}
    core.create_namespaced_secret(ns, {"metadata": {"name": "shared-env"}, "stringData": env})
    make_disk(custom, ns, "sd-disk")
    machine = vm("sd", "sd-disk", secret="shared-env")
    tspec = machine["spec"]["template"]["spec"]
    tspec["domain"]["devices"]["filesystems"] = [{"name": "datasets", "virtiofs": {}}, {"name": "team", "virtiofs": {}}]
    tspec["domain"]["devices"]["disks"].append({"name": "scratch", "serial": "scratch", "disk": {"bus": "virtio"}})
    tspec["volumes"] += [
        {"name": "datasets", "persistentVolumeClaim": {"claimName": "datasets", "readOnly": True}},  # (the guest asks rw)
        {"name": "team", "persistentVolumeClaim": {"claimName": "team"}},
        {"name": "scratch", "emptyDisk": {"capacity": "2Gi"}}]
    with pytest.raises(ApiException) as refused:
        custom.create_namespaced_custom_object(*KV, ns, "virtualmachines", machine)
    assert refused.value.status == 422 and "virtiofs is not allowed: virtiofs feature gate is not enabled for PVC" \
        in refused.value.body and "spec.template.spec.domain.devices.filesystems" in refused.value.body
    assert get(custom, KV, ns, "virtualmachines", "sd") is None
    kubevirt = {"apiVersion": "kubevirt.io/v1", "kind": "KubeVirt", "metadata": {"name": "kubevirt"},
                "spec": {"configuration": {"developerConfiguration": {
                    "featureGates": ["EnableVirtioFsStorageVolumes"]}}}}
    custom.create_namespaced_custom_object(*KV, "kubevirt", "kubevirts", kubevirt)
    try:
        custom.create_namespaced_custom_object(*KV, ns, "virtualmachines", machine)
        for boot in (1, 2):
            assert action(sim, ns, "sd", "start").status_code == 202
            wait_for(lambda: vm_status(custom, ns, "sd") == "Running", what="running")
            vmi = get(custom, KV, ns, "virtualmachineinstances", "sd")
            url = f"http://{vmi['status']['interfaces'][0]['ipAddress']}:8888/api/contents/"
            wait_for(lambda u=url: answers(u), timeout=60, interval=0.3, what="jupyter")
            assert requests.get(url + "scratch").json()["content"] == [], f"boot {boot}: /scratch is blank"
            assert requests.put(url + "scratch/tmp.bin", json={"type": "file", "format": "text",
                                                                "content": "x"}).status_code == 201
            if boot == 1:
                listed = wait_for(lambda: agent(sim, ns, "sd", "filesystemlist").json().get("items"), what="fs")
                scratch = next(f for f in listed if f["mountPoint"] == "/scratch")
                assert scratch["disk"] == [{"busType": "virtio", "serial": "scratch"}] and \
                    scratch["totalBytes"] == 2 * 2**30
                got = requests.get(url + "data/datasets/mnist.csv").json()
                assert got["content"] == "label,pixels\n"
                wrote = requests.put(url + "data/datasets/evil.csv", json={"type": "file", "format": "text",
                                                                           "content": "x"})
                assert wrote.status_code >= 400 and not os.path.exists(os.path.join(datasets, "evil.csv"))
                assert requests.put(url + "data/team/notes.md", json={"type": "file", "format": "text",
                                                                      "content": "hi"}).status_code == 201
            assert action(sim, ns, "sd", "stop").status_code == 202
            wait_for(lambda: get(custom, KV, ns, "virtualmachineinstances", "sd") is None, what="stopped")
        assert open(os.path.join(claim_dir("team"), "notes.md")).read() == "hi"
        root = claim_dir("sd-disk")  # (the mounts were the guest's own: none in the simulator's namespace)
        assert os.listdir(os.path.join(root, "data", "datasets")) == []
    finally:
        custom.delete_namespaced_custom_object(*KV, "kubevirt", "kubevirts", "kubevirt")


def test_an_extra_disk_is_the_guests_at_its_path_and_keeps_its_files(custom, core, ns, sim):
    """Issue 26. An extra disk is a claim volume with disk serial disk-NAME (the guest's
    /dev/disk/by-id/virtio-disk-NAME); the golden image's launcher mounts it at the path
    KUBEVIRT_EXTRA_DISKS gives (guest/launch.py, mount_extra_disks). What the guest writes there
    is on the claim and there again at the next boot; the guest agent lists the filesystem with
    its disk's serial (qemu-ga's guest-get-fsinfo, KubeVirt's filesystemlist)."""
    blank = {"apiVersion": "cdi.kubevirt.io/v1beta1", "kind": "DataVolume", "metadata": {"name": "ed-models"},
             "spec": {"source": {"blank": {}}, "storage": {"accessModes": ["ReadWriteOnce"], "volumeMode": "Block",
                                                           "resources": {"requests": {"storage": "3Gi"}}}}}
    custom.create_namespaced_custom_object(*CDI, ns, "datavolumes", blank)
    env = {"KUBEVIRT_EXTRA_DISKS": json.dumps([{"serial": "disk-models", "path": "/data/models"}])}
    core.create_namespaced_secret(ns, {"metadata": {"name": "extra-env"}, "stringData": env})
    make_disk(custom, ns, "ed-disk")
    machine = vm("ed", "ed-disk", secret="extra-env")
    tspec = machine["spec"]["template"]["spec"]
    tspec["domain"]["devices"]["disks"].append({"name": "disk-models", "serial": "disk-models",
                                                "disk": {"bus": "virtio"}})
    tspec["volumes"].append({"name": "disk-models", "persistentVolumeClaim": {"claimName": "ed-models"}})
    custom.create_namespaced_custom_object(*KV, ns, "virtualmachines", machine)
    models = os.path.join(sim.cluster.state_dir, "volumes",
                          core.read_namespaced_persistent_volume_claim("ed-models", ns).spec.volume_name)
    for boot in (1, 2):
        assert action(sim, ns, "ed", "start").status_code == 202
        wait_for(lambda: vm_status(custom, ns, "ed") == "Running", what="running")
        vmi = get(custom, KV, ns, "virtualmachineinstances", "ed")
        url = f"http://{vmi['status']['interfaces'][0]['ipAddress']}:8888/api/contents/"
        wait_for(lambda u=url: answers(u), timeout=60, interval=0.3, what="jupyter")
        if boot == 1:
            assert requests.put(url + "data/models/weights.txt", json={"type": "file", "format": "text",
                                                                       "content": "w"}).status_code == 201
            listed = wait_for(lambda: agent(sim, ns, "ed", "filesystemlist").json().get("items"), what="fs")
            disk = next(f for f in listed if f["mountPoint"] == "/data/models")
            assert disk["disk"] == [{"busType": "virtio", "serial": "disk-models"}] and disk["totalBytes"] == 3 * 2**30
        else:
            assert requests.get(url + "data/models/weights.txt").json()["content"] == "w"
        assert action(sim, ns, "ed", "stop").status_code == 202
        wait_for(lambda: get(custom, KV, ns, "virtualmachineinstances", "ed") is None, what="stopped")
    assert open(os.path.join(models, "weights.txt")).read() == "w"
    root = os.path.join(sim.cluster.state_dir, "volumes",
                        core.read_namespaced_persistent_volume_claim("ed-disk", ns).spec.volume_name)
    assert not os.path.exists(os.path.join(root, "data", "models", "weights.txt"))  # (on the disk, not the system)


def test_kubectl_drain_evicts_as_kubevirt_does(custom, core, sim, tmp_path):
    """`kubectl drain` (v1.32: staging/src/k8s.io/kubectl/pkg/drain/drain.go finds the Eviction API
    in discovery, evicts, and retries a 429 every 5 s) against KubeVirt's eviction webhook
    (pkg/virt-api/webhooks/validating-webhook/admitters/pod-eviction-admitter.go, v1.9): a VMI with
    evictionStrategy External is marked for evacuation (status.evacuationNodeName) and its launcher
    pod kept, denied with 429, again while marked; nothing migrates it (pkg/virt-controller/watch/
    drain/evacuation/evacuation.go). A VMI with KubeVirt's default strategy (None,
    pkg/virt-config/configuration.go) has its pod evicted, and its machine goes down with it."""
    ns = "drain"
    core.create_namespace({"metadata": {"name": ns}})
    node = "vm-cpu-1"
    running_vm(sim, custom, ns, "ext", eviction_strategy="External", node=node, run_strategy="Manual")
    running_vm(sim, custom, ns, "plain", node=node, run_strategy="Manual")
    env = {**os.environ, "KUBECONFIG": sim.kubeconfig}

    def drain(*extra):
        return subprocess.run(["kubectl", "drain", node, "--ignore-daemonsets", *extra], env=env,
                              capture_output=True, text=True, timeout=60)

    try:
        refused = drain()  # launcher pods hold emptyDirs: kubectl asks for consent first
        assert refused.returncode != 0 and "--delete-emptydir-data" in refused.stderr, refused.stderr
        assert core.read_node(node).spec.unschedulable is True  # (cordoned before it looked at the pods)
        # A dry run is denied too (the webhook answers it), and marks nothing.
        launcher = next(p.metadata.name for p in core.list_namespaced_pod(ns).items
                        if p.metadata.name.startswith("virt-launcher-ext-"))
        with pytest.raises(ApiException) as dry:
            core.create_namespaced_pod_eviction(launcher, ns, {"apiVersion": "policy/v1", "kind": "Eviction",
                                                               "metadata": {"name": launcher, "namespace": ns}},
                                                dry_run="All")
        assert dry.value.status == 429
        assert "evacuationNodeName" not in get(custom, KV, ns, "virtualmachineinstances", "ext")["status"]
        assert vmi_phase(custom, ns, "plain") == "Running"

        done = drain("--delete-emptydir-data", "--timeout=7s")
        assert done.returncode != 0, done.stdout
        ext = get(custom, KV, ns, "virtualmachineinstances", "ext")
        assert ext["status"]["evacuationNodeName"] == node and ext["status"]["phase"] == "Running"
        wait_for(lambda: any(c["type"] == "EvictionRequested" and c["status"] == "True" for c in
                             get(custom, KV, ns, "virtualmachineinstances", "ext")["status"]["conditions"]),
                 what="the VMI's EvictionRequested condition")
        assert (f'admission webhook "virt-launcher-eviction-interceptor.kubevirt.io" denied the request: '
                f'Eviction triggered evacuation of VMI "{ns}/ext"') in done.stderr
        assert "will retry after 5s" in done.stderr and "Evacuation in progress" in done.stderr
        assert "evicted" in done.stdout and "virt-launcher-plain-" in done.stdout
        wait_for(lambda: vmi_phase(custom, ns, "plain") in (None, "Failed", "Succeeded"), what="plain stopped")
        assert [p.metadata.name.startswith("virt-launcher-ext-")
                for p in core.list_namespaced_pod(ns).items] == [True]

        # With virt-api down the API server refuses a launcher pod's eviction (failurePolicy Fail).
        sim_api(sim, "PUT", "/faults/webhooks", {"down": True})
        try:
            with pytest.raises(ApiException) as down:
                core.create_namespaced_pod_eviction(launcher, ns, {"apiVersion": "policy/v1", "kind": "Eviction",
                                                                   "metadata": {"name": launcher, "namespace": ns}})
            assert down.value.status == 500
            assert 'failed calling webhook "virt-launcher-eviction-interceptor.kubevirt.io"' in \
                json.loads(down.value.body)["message"]
        finally:
            sim_api(sim, "DELETE", "/faults/webhooks")

        # The product's answer: the machine stopped; its pod goes and the drain completes.
        assert action(sim, ns, "ext", "stop").status_code == 202
        wait_for(lambda: get(custom, KV, ns, "virtualmachineinstances", "ext") is None, what="ext stopped")
        again = drain("--delete-emptydir-data", "--timeout=20s")
        assert again.returncode == 0 and f"node/{node} drained" in again.stdout, again.stderr
    finally:
        subprocess.run(["kubectl", "uncordon", node], env=env, capture_output=True, timeout=60)
