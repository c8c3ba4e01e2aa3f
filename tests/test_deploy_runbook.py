"""deploy/README.md, rehearsed: every command of its shell blocks that talks to the cluster runs,
in order, with a real kubectl (1.32) against the simulator, and its checks see what the runbook
says they will. The simulator serves the kinds the runbook touches as upstream shapes them: the
KubeVirt CR (pkg/virt-operator/util/client.go conditions), the CDI CR and CDIConfig
(controller-lifecycle-operator-sdk reconciler.go, CDI's pkg/controller/config-controller.go), the
StorageProfile (pkg/controller/storageprofile-controller.go), CSIDriver (ceph-csi
deploy/rbd/kubernetes/csidriver.yaml), EndpointSlices (staging/src/k8s.io/endpointslice/utils.go),
DaemonSets, ValidatingAdmissionPolicies and PrometheusRules (stored, not run).

Not run: what needs the world outside this machine or is not a cluster command (sudo on a node,
pip, docker, helm, the site's DNS and TLS, the operators' release manifests from GitHub, which the
simulator stands for).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kubevirt_spawner import kube as k
from kubevirt_spawner import manifests as m
from kubevirt_spawner import names
from kubevirt_spawner.reflector import Caches
from kubevirt_spawner.service.web import load_hub_config
from kubevirt_spawner.spawner import KubeVirtSpawner
from kubevirt_spawner.workstation import Settings, Workstation

from simtools import start_sim, wait_for

REPO = Path(__file__).resolve().parent.parent
NEW_IMAGE = "ubuntu-24-04-cuda-golden-2027-01"  # step 15's new golden image
RUNBOOK = REPO / "deploy" / "README.md"
# Commands that reach past the cluster: run by a platform team, not here.
# (`kubevirt-spawner admin` talks to the hub's workstations service: tests/e2e/test_drain.py)
NOT_HERE = ("sudo ", "python3 ", "docker ", "helm ", "getent ", "curl ", "kubevirt-spawner ")
RELEASES = re.compile(r'^kubectl apply -f "https://github\.com/kubevirt/(kubevirt|containerized-data-importer)/'
                      r'releases/download/\$\{(KUBEVIRT|CDI)_VERSION\}/(kubevirt|cdi)-operator\.yaml"$')


def runbook_commands() -> list[tuple[str, str]]:
    """(section, command) for every command of the runbook's sh blocks, continuation lines joined."""
    out, section, in_block, pending = [], "", False, ""
    for line in RUNBOOK.read_text().splitlines():
        if line.startswith("## "):
            section = line[3:]
        elif line.strip() == "```sh":
            in_block = True
        elif line.strip() == "```":
            in_block = False
        elif in_block:
            text = re.sub(r"\s+#[^'\"]*$", "", line).strip()  # a trailing comment
            if text.endswith("\\"):
                pending += text[:-1] + " "
                continue
            command = (pending + text).strip()
            pending = ""
            if command:
                out.append((section, command))
    return out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    s = start_sim(tmp_path_factory.mktemp("runbook-cluster"), guest_mode="null")
    yield s
    s.stop()


class Runbook:
    def __init__(self, sim, workdir: Path):
        # (the OIDC client's secret, which the runbook keeps out of settings.env, in the shell)
        self.env = {**os.environ, "KUBECONFIG": sim.kubeconfig, "OIDC_CLIENT_SECRET": "from-the-identity-provider"}
        self.workdir = workdir
        self.ran: list[str] = []

    def run(self, command: str) -> str:
        # Every command starts from the settings, as a shell that loaded them in step 0 would.
        done = subprocess.run(["bash", "-c", f"set -euo pipefail; set -a; . deploy/settings.env; set +a\n{command}"],
                              cwd=self.workdir, env=self.env, capture_output=True, text=True, timeout=180,
                              check=False)
        assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"
        self.ran.append(command)
        return done.stdout


def production_spawner(monkeypatch_env: dict) -> KubeVirtSpawner:
    """The spawner as the production config (hub-config/kubevirt_spawner_config.py) makes it with
    the runbook's settings: its profiles' placement (the pool label and taint label-nodes.sh set)
    and what it gives a user's namespace."""
    saved = {name: os.environ.get(name) for name in monkeypatch_env}
    os.environ.update(monkeypatch_env)
    try:
        return KubeVirtSpawner(config=load_hub_config(str(REPO / "hub-config" / "kubevirt_spawner_config.py")))
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


SPAWNER = production_spawner({"POD_NAMESPACE": "jupyterhub", "SUBDOMAIN_HOST": "https://jupyter.example.com"})
ALICE = SPAWNER._machine_spec(next(p for p in SPAWNER._profiles() if p.get("default")))
NAMESPACE_RULES = Settings(url_mode="cluster-ip", start_timeout=120,
                           network_policy_from=tuple(SPAWNER.network_policy_ingress_from),
                           namespace_quota=dict(SPAWNER.namespace_resource_quota),
                           namespace_limits=tuple(SPAWNER.namespace_limit_range))


def as_the_hub(sim, action, user: str = "alice", spec=ALICE):
    """Run `action(workstation)` on the user's workstation with the spawner's own lifecycle code."""
    log = logging.getLogger("runbook")

    async def run():
        kube = k.Kube(k.load_api_client(sim.kubeconfig), log)
        caches = Caches(kube, m.LABEL_WORKSTATION)
        caches.start()
        await caches.wait_synced(30)
        try:
            await action(Workstation(kube, caches, names.identity(user), spec, NAMESPACE_RULES, log))
        finally:
            caches.stop()
            await kube.aclose()
    asyncio.run(run())


async def log_in_and_snapshot(ws: Workstation):
    """Alice logs in (her first workstation starts) and takes a snapshot from the panel."""
    await ws.start({"JUPYTERHUB_API_TOKEN": "t"}, [])
    await ws.take_snapshot("first")


async def stop(ws: Workstation):
    await ws.stop()


async def delete_the_user(ws: Workstation):
    """The admin deletes alice on the hub's admin page: the spawner's delete_forever."""
    await ws.retire()


async def reset_the_system(ws: Workstation):
    """The user's reset, on a stopped machine: the root disk cloned anew from the image the hub
    is configured with now (operations.py's reset, less its safety snapshot)."""
    await ws.delete_root_disk()
    await ws.clone_root_disk()


async def start(ws: Workstation):
    await ws.start({"JUPYTERHUB_API_TOKEN": "t"}, [])


def kubectl(sim, *args: str) -> str:
    done = subprocess.run(["kubectl", *args], env={**os.environ, "KUBECONFIG": sim.kubeconfig}, capture_output=True,
                          text=True, timeout=60, check=True)
    return done.stdout


def drained_as_the_service_does(sim, book: Runbook, command: str, user: str) -> str:
    """Step 12's `kubectl drain`, with the workstations service's part played here: the drain's
    eviction marks the user's VMI (KubeVirt's webhook for evictionStrategy External), and once it
    is marked the machine is stopped (what the service does after the grace; tests/e2e/
    test_drain.py runs the service itself); then the drain completes."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        drain = pool.submit(book.run, command)
        vmi = f"vmi/{user}-workstation"
        wait_for(lambda: drain.done() or kubectl(sim, "-n", f"notebook-{user}", "get", vmi, "-o",
                                                 "jsonpath={.status.evacuationNodeName}") == "vm-cpu-1", 60,
                 what="the drain to mark the VMI")
        assert not drain.done(), f"the drain ended while a workstation ran on the node: {drain.exception()}"
        as_the_hub(sim, stop, user)
        return drain.result(timeout=120)


def test_the_runbook_runs_against_the_simulator(cluster, tmp_path):
    workdir = tmp_path / "checkout"
    shutil.copytree(REPO / "deploy", workdir / "deploy", ignore=shutil.ignore_patterns("rendered"))
    book = Runbook(cluster, workdir)
    commands = runbook_commands()
    skipped_releases = []
    outputs: dict[str, str] = {}
    begun: set[str] = set()
    for section, command in commands:
        if command.startswith(NOT_HERE):
            continue
        if RELEASES.match(command):
            skipped_releases.append(command)
            continue
        if section.startswith("10."):
            if not any(c.startswith("kubectl -n notebook-alice") for c in book.ran):
                as_the_hub(cluster, log_in_and_snapshot)  # "Log in as a test user and start a server"
            if command == "kubectl -n notebook-alice get vm,vmi,pvc":
                as_the_hub(cluster, stop)  # "Stopping from the hub's home page"
        if section.startswith("11.") and not any(c.startswith("kubectl get pvc -A -l") for c in book.ran):
            as_the_hub(cluster, delete_the_user)  # "Deleting a user ... on the hub's admin page"
        if section.startswith("12.") and "12." not in begun:
            # bob works on vm-cpu-1 when its maintenance comes
            others = ("vm-cpu-2", "vm-gpu-pci-1")  # (the pool's other nodes)
            kubectl(cluster, "cordon", *others)
            as_the_hub(cluster, start, "bob")
            kubectl(cluster, "uncordon", *others)
        if section.startswith("15.") and "15." not in begun:
            # "give it a new name and URL in deploy/settings.env"
            settings = workdir / "deploy" / "settings.env"
            settings.write_text(re.sub(r"(?m)^GOLDEN_IMAGE=.*$", f"GOLDEN_IMAGE={NEW_IMAGE}", re.sub(
                r"(?m)^GOLDEN_IMAGE_URL=.*$", f"GOLDEN_IMAGE_URL=https://images.example.com/{NEW_IMAGE}.qcow2",
                settings.read_text())))
        begun.add(section[:3])
        if section.startswith("12.") and command.startswith("kubectl drain "):
            outputs[command] = drained_as_the_service_does(cluster, book, command, "bob")
            continue
        outputs[command] = book.run(command)
    # the two operators' releases (installed, then upgraded) are the only commands left to the cluster's owner
    assert len(skipped_releases) == 4
    assert len(book.ran) >= 40

    def out(prefix: str) -> str:
        return next(text for command, text in outputs.items() if command.startswith(prefix))
    assert "rendered" in out("deploy/render.sh")
    assert re.search(r"vm-gpu-pci-1\s.*true\s+vfio", out("kubectl get nodes -L")), out("kubectl get nodes -L")
    assert "workload.example.com/kubevirt=true:NoSchedule" in out("kubectl describe node vm-gpu-pci-1")
    assert out("kubectl get kubevirt -n kubevirt kubevirt -o jsonpath") == "Deployed v1.9.0\n"
    assert "nvidia.com/A100-PCIE-40GB" in out("kubectl get node vm-gpu-pci-1 -o jsonpath")
    assert out("kubectl get cdi cdi -o jsonpath") == "Deployed v1.66.0\n"
    assert "rbd.csi.ceph.com" in out("kubectl get csidriver rbd.csi.ceph.com")
    assert out('kubectl get storageprofile "$STORAGE_CLASS"') == "csi-clone\n"
    assert out("kubectl get cdiconfig config") == "ceph-rbd-scratch\n"
    assert "ceph-rbd-snapclass" in out("kubectl get volumesnapshotclass")
    assert "Succeeded" in out('kubectl -n "$GOLDEN_NAMESPACE" get dv,pvc') and "Bound" in \
        out('kubectl -n "$GOLDEN_NAMESPACE" get dv,pvc')
    assert "kubevirt-spawner-hub" in out("kubectl get validatingadmissionpolicy")
    # the first workstation, its launcher pod, and its Service's EndpointSlice with the pod's address
    assert "virt-launcher-alice-workstation-" in out("kubectl -n notebook-alice get pods -l kubevirt.io=virt-launcher")
    slice_table = out("kubectl -n notebook-alice get endpointslice -l kubernetes.io/service-name=alice-notebook")
    assert re.search(r"alice-notebook-\w{5}\s+IPv4\s+22,8080,8888\s+\d+\.\d+\.\d+\.\d+\s", slice_table), slice_table
    guards = out("kubectl -n notebook-alice get networkpolicy,resourcequota,limitrange")
    assert "networkpolicy.networking.k8s.io/kubevirt-spawner" in guards and "limitrange/kubevirt-spawner" in guards
    assert "alice.first" in out("kubectl -n notebook-alice get vmsnapshot")
    stopped = out("kubectl -n notebook-alice get vm,vmi,pvc")
    assert "Stopped" in stopped and "virtualmachineinstance" not in stopped and stopped.count("Bound") == 2, stopped
    # offboarding: the retained disks listed with their volumes and date; their volumes deleted
    # with the namespace (policy Delete first), none left Released
    # an admin confirms kept disks for an account made again: both disks of both kinds
    assert out("kubectl -n notebook-alice annotate").count("annotated") == 4
    retained = out("kubectl get pvc -A -l kubevirt-spawner.io/retained=true")
    assert retained.count("notebook-alice") == 2 and "alice" in retained, retained
    listing = out("kubectl -n notebook-alice get pvc -o jsonpath")
    volumes = [line.split("\t")[1] for line in listing.splitlines()]
    assert len(volumes) == 2 and all(line.split("\t")[2].startswith("20") for line in listing.splitlines()), listing
    left = out("kubectl get pv -o custom-columns")
    assert not any(volume in left for volume in volumes) and "notebook-alice" not in left, left
    assert "pvc-golden-ubuntu-24-04-cuda" in left  # (other volumes untouched)
    assert out("kubectl get pv -o jsonpath") == ""
    assert "hub-oidc" in out('kubectl -n "$HUB_NAMESPACE" get secret hub-oidc')
    # step 12: bob's workstation listed on the node, the drain done once it stopped, the node back
    assert "bob-workstation" in out("kubectl get vmi -A -l kubevirt.io/nodeName=vm-cpu-1")
    assert "node/vm-cpu-1 drained" in out("kubectl drain vm-cpu-1")
    assert re.search(r"vm-cpu-1\s+Ready,SchedulingDisabled\s.*\strue$", out("kubectl get node vm-cpu-1 -L"), re.M), \
        out("kubectl get node vm-cpu-1 -L")
    assert "node/vm-cpu-1 uncordoned" in out("kubectl uncordon vm-cpu-1")
    assert kubectl(cluster, "get", "node", "vm-cpu-1", "-o", "jsonpath={.metadata.annotations}").find(
        "drain-reason") == -1
    # step 13: nothing on the GPU node when its binding changes; its GPUs advertised again
    assert out("kubectl get vmi -A -l kubevirt.io/nodeName=vm-gpu-pci-1") == ""
    assert "node/vm-gpu-pci-1 drained" in out("kubectl drain vm-gpu-pci-1")
    assert "nvidia.com/A100-PCIE-40GB" in out("kubectl get node vm-gpu-pci-1 -o jsonpath")
    # step 14: where KubeVirt and CDI stand, and their upgrades rolled out (here: the versions they run)
    assert out("kubectl get kubevirt -n kubevirt kubevirt -o jsonpath='{.status.observedKubeVirtVersion} {.status.target"
               ) == "v1.9.0 v1.9.0\n"
    assert out("kubectl get kubevirt -n kubevirt kubevirt -o jsonpath='{.status.observedKubeVirtVersion} {.status.cond"
               ) == "v1.9.0 False\n"
    assert out("kubectl get cdi cdi -o jsonpath='{.status.observedVersion} {.status.cond") == "v1.66.0 False\n"
    # step 15: the new image imported beside the old one; bob still runs the old system until he
    # resets, which clones the new one (the hub pointed at it)
    images = out('kubectl -n "$GOLDEN_NAMESPACE" get pvc')
    assert NEW_IMAGE in images and "ubuntu-24-04-cuda-golden " in images and images.count("Bound") == 2, images
    assert re.search(r"notebook-bob\s+bob-rootdisk\s+ubuntu-24-04-cuda-golden$", out("kubectl get dv -A -l"), re.M)
    new_spec = production_spawner({"POD_NAMESPACE": "jupyterhub", "SUBDOMAIN_HOST": "https://jupyter.example.com",
                                   "GOLDEN_IMAGE": f"vm-images/{NEW_IMAGE}"})
    as_the_hub(cluster, reset_the_system, "bob", new_spec._machine_spec(next(
        p for p in new_spec._profiles() if p.get("default"))))
    assert kubectl(cluster, "-n", "notebook-bob", "get", "dv", "bob-rootdisk", "-o",
                   "jsonpath={.spec.source.pvc.name}") == NEW_IMAGE
