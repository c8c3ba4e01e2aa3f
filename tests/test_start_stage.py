"""Where a start is, as a pure function of the objects (no simulator, no caches): what the user
reads at each stage, what a timed-out start waited for, and the starts that cannot go on.

The phases and fields are upstream's: a DataVolume's `status.phase` and `status.progress` ("N/A"
before a copy begins, CSI and snapshot clones in progress without a percentage), CDI's
pkg/apis/core/v1beta1/types.go (DataVolumePhase); a VMI's `status.phase`, `status.nodeName`,
`status.interfaces` and its PodScheduled and AgentConnected conditions, KubeVirt's
staging/src/kubevirt.io/api/core/v1/types.go (VirtualMachineInstancePhase,
VirtualMachineInstanceAgentConnected) and pkg/virt-controller/watch/vmi (PodScheduled copied from
the launcher pod's condition).
"""

from __future__ import annotations

from kubevirt_spawner import manifests as m
from kubevirt_spawner.reasons import Reason
from kubevirt_spawner.workstation.progress import stage

SPEC = m.MachineSpec(golden_image="vm-images/golden")
GPU = "nvidia.com/A100-PCIE-40GB"
URL = "http://10.96.0.10:8888"


def dv(phase: str | None, progress: str = "N/A", name: str = "ada-rootdisk", message: str = "") -> dict:
    obj: dict = {"metadata": {"name": name}, "status": {"progress": progress}}
    if phase:
        obj["status"]["phase"] = phase
    if message:
        obj["status"]["conditions"] = [{"type": "Running", "status": "False", "message": message}]
    return obj


def vmi(phase: str = "Scheduling", node: str = "", conditions: tuple = (), address: str = "",
        deleting: bool = False) -> dict:
    obj: dict = {"metadata": {"name": "ada-workstation"},
                 "status": {"phase": phase, "conditions": [dict(c) for c in conditions]}}
    if node:
        obj["status"]["nodeName"] = node
    if address:
        obj["status"]["interfaces"] = [{"name": "default", "ipAddress": address}]
    if deleting:
        obj["metadata"]["deletionTimestamp"] = "2026-12-05T05:00:00Z"
    return obj


RUNNING_VM = {"spec": {"runStrategy": "Always"}}
HALTED_VM = {"spec": {"runStrategy": "Halted"}}
DONE = dv("Succeeded", "100.0%")


def test_a_clone_reports_its_progress_and_is_watched_for_stalls():
    at = stage(SPEC, HALTED_VM, None, dv("CloneInProgress", "40.0%"), [], url=URL)
    assert at.said == ((27, "Cloning your system disk from golden: 40%"),)
    assert at.waiting_for == "the system disk clone to finish"
    assert at.clone is not None and at.clone[0] == "ada-rootdisk"
    assert at.asked_to_run is None and at.url is None and at.failed is None


def test_a_clone_without_a_percentage_yet_or_copy_on_write():
    assert stage(SPEC, None, None, dv("ImportScheduled"), [], url=URL).said == \
        ((5, "Cloning your system disk from golden"),)
    cow = stage(SPEC, None, None, dv("CSICloneInProgress"), [], url=URL)
    assert cow.said == ((20, "Cloning your system disk from golden (copy-on-write)"),)
    assert cow.clone is not None


def test_a_disk_waiting_for_its_first_consumer_is_not_a_stalled_clone():
    at = stage(SPEC, None, None, dv("WaitForFirstConsumer"), [], url=URL)
    assert at.clone is None and at.failed is None and at.waiting_for == "the system disk clone to finish"


def test_a_failed_clone_ends_the_start_with_cdis_words():
    at = stage(SPEC, None, None, dv("Failed", message="source PVC not found"), [], url=URL)
    assert at.failed is not None and at.failed.reason is Reason.CLONE_FAILED and at.failed.status == 500
    assert at.failed.sentence == ("Cloning your system disk from golden failed (source PVC not found). "
                                  "Ask your administrator to check the golden image and storage.")


def test_an_extra_disk_is_made_before_the_machine_starts():
    disk = m.ExtraDisk("data", "100Gi", "/data", clone_from="datasets/imagenet")
    making = stage(SPEC, HALTED_VM, None, DONE, [(disk, "ada-data", dv("CloneInProgress", "10%", "ada-data"))],
                   url=URL)
    assert making.said == ((60, "Making your extra disk data from datasets/imagenet"),)
    assert making.waiting_for == "the extra disk data" and making.clone is not None
    assert making.clone[0] == "ada-data" and making.asked_to_run is None
    failed = stage(SPEC, HALTED_VM, None, DONE, [(disk, "ada-data", dv("Failed", name="ada-data", message="no"))],
                   url=URL)
    assert failed.failed is not None and failed.failed.sentence.startswith(
        "Making your extra disk data from datasets/imagenet failed (no).")
    made = stage(SPEC, HALTED_VM, None, DONE, [(disk, "ada-data", dv("Succeeded", "100.0%", "ada-data"))], url=URL)
    assert made.said == ((62, "Creating your virtual machine"),) and made.asked_to_run is False


def test_the_machine_from_creation_to_jupyter():
    steps = [
        (None, ((62, "Creating your virtual machine"),), "the virtual machine to be created"),
        (vmi(deleting=True), ((62, "Creating your virtual machine"),), "the virtual machine to be created"),
        (vmi(), ((65, "Waiting for a node"),), "a node"),
        (vmi("Scheduled", node="vm-cpu-1"), ((75, "Booting on vm-cpu-1"),), "the machine to boot"),
        (vmi("Running", node="vm-cpu-1"), ((82, "Booting"),), "the guest agent to connect"),
        (vmi("Running", node="vm-cpu-1", conditions=({"type": "AgentConnected", "status": "True"},)),
         ((90, "Guest agent connected"),), "a network address"),
    ]
    for machine, said, waiting in steps:
        at = stage(SPEC, RUNNING_VM, machine, DONE, [], url=URL)
        assert (at.said, at.waiting_for, at.url, at.failed) == (said, waiting, None, None), machine
        assert at.asked_to_run is True
    ready = stage(SPEC, RUNNING_VM, vmi("Running", node="vm-cpu-1", address="10.244.1.7",
                                        conditions=({"type": "AgentConnected", "status": "True"},)), DONE, [], url=URL)
    assert ready.said == ((90, "Guest agent connected"), (95, "Starting Jupyter")) and ready.url == URL
    no_service_yet = stage(SPEC, RUNNING_VM, vmi("Running", node="n", address="10.244.1.7",
                                                 conditions=({"type": "AgentConnected", "status": "True"},)),
                           DONE, [], url=None)
    assert no_service_yet.url is None and no_service_yet.waiting_for == "a network address"


def test_a_machine_that_shut_down_while_booting():
    for phase in ("Failed", "Succeeded"):
        at = stage(SPEC, RUNNING_VM, vmi(phase, node="n"), DONE, [], url=URL)
        assert at.failed is not None and at.failed.reason is Reason.BOOT_FAILED and at.url is None


def test_no_free_gpu_waits_or_fails_as_the_hub_is_configured():
    spec = m.MachineSpec(golden_image="vm-images/golden", gpus=((GPU, 1),))
    unschedulable = vmi(conditions=({"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                     "message": f"0/3 nodes are available: 3 Insufficient {GPU}."},))
    waits = stage(spec, RUNNING_VM, unschedulable, DONE, [], url=URL)
    assert waits.said == ((65, f"Waiting for a node with a free {GPU}: all are in use"),)
    assert waits.waiting_for == f"a free {GPU}" and waits.failed is None
    fails = stage(spec, RUNNING_VM, unschedulable, DONE, [], url=URL, gpu_unavailable="fail")
    assert fails.failed is not None and fails.failed.reason is Reason.GPU_UNAVAILABLE and fails.failed.status == 503
    assert fails.failed.sentence.startswith(f"No {GPU} is free right now (0/3 nodes are available")
    other = vmi(conditions=({"type": "PodScheduled", "status": "False", "message": "0/3 nodes: Insufficient cpu."},))
    assert stage(spec, RUNNING_VM, other, DONE, [], url=URL, gpu_unavailable="fail").said == \
        ((65, "Waiting for a node: 0/3 nodes: Insufficient cpu."),)
    assert stage(spec, RUNNING_VM, vmi(), DONE, [], url=URL).said == ((65, f"Waiting for a node with a free {GPU}"),)


def test_a_machine_on_a_node_that_stopped_answering_is_flagged():
    on_lost = stage(SPEC, RUNNING_VM, vmi("Running", node="n"), DONE, [], url=URL, vmi_on_unreachable_node=True)
    assert on_lost.on_unreachable_node
    finished = stage(SPEC, RUNNING_VM, vmi("Failed", node="n"), DONE, [], url=URL, vmi_on_unreachable_node=True)
    assert not finished.on_unreachable_node  # a finished machine holds nothing


def test_a_machine_asked_to_run_is_told_apart_from_one_that_was_stopped():
    assert stage(SPEC, HALTED_VM, None, DONE, [], url=URL).asked_to_run is False
    assert stage(SPEC, RUNNING_VM, None, DONE, [], url=URL).asked_to_run is True
    assert stage(SPEC, None, None, DONE, [], url=URL).asked_to_run is False
