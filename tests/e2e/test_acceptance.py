"""`kubevirt-spawner acceptance` against the demo (the simulator's process guests, the real hub,
proxy and workstations service), with a kubeconfig that has only deploy/acceptance/'s reads: each
experiment's outcome on the simulator is asserted, and what the simulator cannot show is SKIP with
its reason, never PASS.

Upstream behaviour the experiments lean on: JupyterHub's REST API and its 403 for a token without
access to a server (jupyterhub/apihandlers/users.py, jupyterhub/services/auth.py), KubeVirt's
launcher pod holding the VM's requests on its node (kubevirt pkg/virt-controller/services/
template.go), the agent-frozen online snapshot (kubevirt pkg/storage/snapshot/snapshot.go)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import io
from pathlib import Path

import pytest
import yaml
from conftest import Hub, hub_with_service
from kubernetes import client

from kubevirt_spawner.acceptance import guest, run_suite
from kubevirt_spawner.acceptance.client import AcceptanceError
from kubevirt_spawner.acceptance.experiments import EXPERIMENTS, Options, Suite
from kubevirt_spawner.acceptance.report import FAIL, PASS, SKIP, to_html

from simtools import api_client, apply, service_account_kubeconfig, sim_api

READER = Path(__file__).resolve().parents[2] / "deploy" / "acceptance" / "acceptance-reader.yaml"
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "acceptance"  # docs/screenshots.py
IDLE_TIMEOUT = 40
# The demo's CPU placement (kubevirt_spawner/data/demo_config.py): the pool, off its VFIO nodes.
CPU_POOL = {"node_selector": {"workload.example.com/kubevirt": "true"},
            "tolerations": [{"key": "workload.example.com/kubevirt", "operator": "Equal", "value": "true",
                             "effect": "NoSchedule"}],
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": "accelerator.example.com/mode", "operator": "DoesNotExist"}]}]}}}}
CONFIG = f"""
c.KubeVirtSpawner.retention_days = 0  # the suite may purge what it made at once
c.KubeVirtSpawner.start_timeout = 180
c.Workstations.idle_timeout = {IDLE_TIMEOUT}
c.Workstations.idle_cull_every = 3
c.Workstations.idle_warn_before = 20
# the demo's profiles, and one like its CPU profile (placed as it is) with a larger disk
c.KubeVirtSpawner.profile_list.append({{"display_name": "CPU workstation, larger disk", "slug": "cpu-big",
                                        "kubevirt_override": {{"cpu_guarantee": 2, "mem_guarantee": "4G",
                                                              "root_disk_size": "80Gi", **{CPU_POOL!r}}}}})
"""


@pytest.fixture(scope="module")
def hub(e2e_sim, tmp_path_factory):
    # (e2e_sim is the demo's cluster: its nodes in the workstation pools, as deploy/README.md has a
    # platform team put them with deploy/host/label-nodes.sh)
    yield from hub_with_service(e2e_sim, tmp_path_factory, CONFIG)


def reader_kubeconfig(sim, path: Path) -> str:
    """A ServiceAccount bound to the acceptance reader's ClusterRole, and nothing else."""
    role = yaml.safe_load(READER.read_text())
    apply(sim, role)
    apply(sim, {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                "metadata": {"name": "kubevirt-spawner-acceptance"},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role["metadata"]["name"]},
                "subjects": [{"kind": "ServiceAccount", "name": "acceptance", "namespace": "default"}]})
    return service_account_kubeconfig(sim, "default", "acceptance", path)


def run(hub: Hub, kubeconfig: str | None, suite_class=Suite, prompt=None, **options) -> tuple[dict, str, list, dict]:
    out = io.StringIO()
    suite = run_suite(hub.url + "/", hub.settings.admin_token, kubeconfig, Options(**options), out, prompt=prompt,
                      suite_class=suite_class)
    # (on a thread of its own: a test that holds Playwright's sync API has a loop running on this one)
    with concurrent.futures.ThreadPoolExecutor(1) as own:
        records, meta = own.submit(asyncio.run, suite).result()
    return {f"{r.section}/{r.name}": r for r in records}, out.getvalue(), records, meta


# What the simulator shows, and why the rest is SKIP there.
EXPECTED = {
    "host/node-pools": PASS,
    "host/check-node": SKIP,  # no DaemonSet runs on the simulator's nodes
    "host/no-container-gpus-on-vfio-nodes": PASS,
    "host/placement": PASS,
    "persistence/first-start": PASS,
    "persistence/stop-releases-compute-keeps-disks": PASS,
    "persistence/files-kept": PASS,
    "persistence/pip-package-kept": PASS,
    "persistence/system-package-kept": SKIP,  # process guests have no package database of their own
    "persistence/systemd-unit-kept": SKIP,  # nor a systemd
    "security/other-users-are-refused": PASS,
    "security/vmi-address-refuses-without-token": PASS,
    "security/no-cluster-credentials-in-guest": PASS,
    "security/usage-and-snapshots-visible-to-user": PASS,
    "storage/guest-storage-benchmark": SKIP,  # a process guest measures this machine's disk (figures kept)
    "storage/online-snapshot": PASS,
    "storage/offline-snapshot-restored": PASS,
    "storage/disk-grows": PASS,
    "storage/concurrent-clones": PASS,
    "storage/node-loss-fenced-cold-start": SKIP,  # only with --destructive --node
    "persistence/reset-keeps-workspace": PASS,
    "security/idle-warning-then-stop": PASS,
    "persistence/deleted-server-keeps-disks": PASS,
}


def test_the_suite_passes_what_the_simulator_can_show(hub: Hub, browser, tmp_path: Path):
    kubeconfig = reader_kubeconfig(hub.sim, tmp_path / "reader.kubeconfig")
    found, printed, records, meta = run(hub, kubeconfig, user="acc", grow_profile="cpu-big", clones=2, idle_wait=120,
                                  start_timeout=180, bench_mib=16, bench_files=500)
    # the HTML report, as a platform team opens it (docs/acceptance-report.png is such a page)
    page = browser.new_page(viewport={"width": 1200, "height": 900})
    page.set_content(to_html(records, meta))
    assert page.locator("h2").all_inner_texts() == ["Summary", "Host and scheduling", "Persistence semantics",
                                                     "Storage and recovery", "Security and product experience"]
    assert page.locator("td.PASS").count() == sum(1 for v in EXPECTED.values() if v == PASS)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "acceptance-report.png"), full_page=True)
    page.close()
    outcome = {name: r.result for name, r in found.items()}
    assert outcome == EXPECTED, printed
    for r in records:
        assert r.sentence and "\n" not in r.sentence, r
    assert found["persistence/system-package-kept"].sentence.startswith("The simulator's process guests")
    assert found["storage/guest-storage-benchmark"].figures["write_mb_per_second"] > 0
    assert meta["user"] == "acc" and set(found) == {f"{s}/{n}" for s, names in EXPERIMENTS.items() for n in names}
    # what the suite made is gone: its users, and (retention 0) their disks
    users = {u["name"] for u in hub.api("GET", "/users").json()}
    assert not {u for u in users if u.startswith("acc")}, users


# ------------------------------------------------------------ each experiment fails when broken
class FileLostAtStop(Suite):
    """A file in /etc goes between the write and the stop, as a disk that lost it would show."""

    async def stop_releases(self):
        await self.t.run_python(self.user, self.server, guest.PRELUDE + "os.remove(at('/etc/kvs-acceptance/marker'))")
        return await super().stop_releases()


class LauncherHeld(Suite):
    """The launcher pod of the GPU machine stays (a finalizer nobody removes): its GPU is not released."""

    sim = None  # (the test's simulator: its admin makes the finalizer)
    pod: tuple[str, str] | None = None

    async def stop_releases(self):
        vm, vmi = await self.vm_and_vmi()
        uid = vmi["metadata"]["uid"]
        pods = [p for p in await self.cluster.pods("kubevirt.io=virt-launcher")
                if (p["metadata"].get("labels") or {}).get("kubevirt.io/created-by") == uid]
        ns, name = pods[0]["metadata"]["namespace"], pods[0]["metadata"]["name"]
        LauncherHeld.pod = (ns, name)
        admin = client.CoreV1Api(api_client(self.sim))
        admin.patch_namespaced_pod(name, ns, {"metadata": {"finalizers": ["example.com/hold"]}})
        return await super().stop_releases()


class TokenOnDisk(Suite):
    """The hub's API token written to the root disk, as a leaking program would."""

    async def no_credentials(self):
        await self.t.run_python(self.user, self.server, guest.PRELUDE +
                                "put('/var/tmp/kvs-leak', os.environ['JUPYTERHUB_API_TOKEN'])")
        return await super().no_credentials()


def test_each_experiment_fails_when_what_it_checks_is_broken(hub: Hub, tmp_path: Path):
    """A file lost at the stop, a launcher pod (and its GPU) not released, the hub's token on the
    root disk: each experiment that checks it says FAIL with a sentence naming it."""
    kubeconfig = reader_kubeconfig(hub.sim, tmp_path / "reader.kubeconfig")
    LauncherHeld.sim = hub.sim

    found, printed, _, _ = run(hub, kubeconfig, FileLostAtStop, user="lost", only=("persistence",), clones=0)
    assert found["persistence/files-kept"].result == FAIL, printed
    assert "/etc/kvs-acceptance/marker" in found["persistence/files-kept"].sentence
    assert found["persistence/pip-package-kept"].result == PASS, printed

    found, printed, _, _ = run(hub, kubeconfig, LauncherHeld, user="held", only=("persistence",), profile="gpu-a100-1",
                            release_wait=8)
    try:
        r = found["persistence/stop-releases-compute-keeps-disks"]
        assert r.result == FAIL and "still holds its CPU, memory and GPUs" in r.sentence, printed
    finally:
        ns, name = LauncherHeld.pod
        client.CoreV1Api(api_client(hub.sim)).patch_namespaced_pod(name, ns, {"metadata": {"finalizers": None}})

    # a first start that fails (a profile the hub does not have): every other experiment is listed, SKIP
    found, printed, _, _ = run(hub, kubeconfig, user="nostart", only=("persistence", "security"), profile="no-such")
    assert found["persistence/first-start"].result == FAIL, printed
    assert set(found) == {f"{s}/{n}" for s in ("persistence", "security") for n in EXPERIMENTS[s]}, printed
    assert all(r.result == SKIP and r.sentence.startswith("The first start failed: ")
               for name, r in found.items() if name != "persistence/first-start"), printed

    hub.ensure_user("leak")  # (a user the suite did not make: it stays, and so would its tokens)
    hub.ensure_user("leak-clone-1")  # (the hub's own user, named like a clone: never used)
    found, printed, _, meta = run(hub, kubeconfig, TokenOnDisk, user="leak", only=("security",))
    r = found["security/no-cluster-credentials-in-guest"]
    assert r.result == FAIL and "/var/tmp/kvs-leak (holds the hub's API token)" in r.sentence, printed
    # the tokens the suite made for it (its requests as the owner) are revoked at the end
    tokens = hub.api("GET", "/users/leak/tokens").json()["api_tokens"]
    assert not [t for t in tokens if t["note"] == "kubevirt-spawner acceptance"], tokens
    # a user of the hub's: its own servers untouched (the test one was new), its helpers named apart
    servers = hub.api("GET", "/users/leak?include_stopped_servers=1").json()["servers"]
    assert not [name for name in servers if name.startswith("acceptance")], servers  # (its own: deleted)
    assert not (servers.get("") or {}).get("ready") and not (servers.get("") or {}).get("pending"), servers
    users = {u["name"] for u in hub.api("GET", "/users").json()}
    assert {"leak", "leak-clone-1"} <= users and not {u for u in users if u.startswith("leak-") and
                                                          u != "leak-clone-1"}, users


# ------------------------------------------------------------ --destructive: a node lost and fenced
class SecondAttach(Suite):
    """After the cold start, the lost node still has the root disk attached (a VolumeAttachment a
    broken attach/detach controller left), as a node coming back could write through it."""

    sim = None
    armed = False

    async def vm_and_vmi(self, user=None, server=None):
        found = await super().vm_and_vmi(user, server)
        if SecondAttach.armed and found[1] and found[1]["status"].get("nodeName") != LOST:
            SecondAttach.armed = False
            claims = await self.cluster.workstation_claims(found[0])
            pv = next(c["spec"]["volumeName"] for c in claims if c["metadata"]["name"].endswith("-rootdisk"))
            client.StorageV1Api(api_client(self.sim)).create_volume_attachment({
                "metadata": {"name": "csi-" + "0" * 64}, "spec": {"attacher": "rbd.csi.ceph.com", "nodeName": LOST,
                                                                 "source": {"persistentVolumeName": pv}},
                "status": {"attached": True}})
        return found


LOST, OTHER_CPU_NODE = "vm-cpu-1", "vm-cpu-2"


def test_a_lost_and_fenced_node_gives_a_cold_start_elsewhere_and_no_second_attach(hub: Hub, tmp_path: Path):
    """--destructive --node: the suite asks the admin to power the node off and fence it (here the
    simulator loses the node and an admin's out-of-service taint follows: kubernetes' non-graceful
    node shutdown), then sees the workstation start on another node with its disk attached there
    only (VolumeAttachments, kubernetes pkg/volume/csi/csi_attacher.go); a VolumeAttachment left on
    the lost node is a FAIL."""
    kubeconfig = reader_kubeconfig(hub.sim, tmp_path / "reader.kubeconfig")
    admin = client.CoreV1Api(api_client(hub.sim))
    told: list[str] = []
    # a node that is not there, or not in the pool: said at once, before anything is made
    for node, said in (("vm-cpu-9", "the cluster has no such node"),
                       ("container-gpu-1", r"is not in the workstation pool \(workload.example.com/kubevirt=true\)")):
        with pytest.raises(AcceptanceError, match=said):
            run(hub, kubeconfig, user="nobody", only=("storage",), destructive=True, node=node)
    assert hub.api("GET", "/users/nobody").status_code == 404 and not told

    def power_off(text: str):  # what the admin does when the suite asks
        told.append(text)
        admin.patch_node(OTHER_CPU_NODE, {"spec": {"unschedulable": None}})
        sim_api(hub.sim, "POST", f"/nodes/{LOST}/lose")
        sim_api(hub.sim, "POST", f"/nodes/{LOST}/fence")
        SecondAttach.armed = suite_class is SecondAttach

    SecondAttach.sim = hub.sim
    for user, suite_class, expected in (("fenced", Suite, PASS), ("twice", SecondAttach, FAIL)):
        admin.patch_node(OTHER_CPU_NODE, {"spec": {"unschedulable": True}})  # the test machine lands on LOST
        try:
            found, printed, _, _ = run(hub, kubeconfig, suite_class, power_off, user=user, only=("storage",), clones=0,
                                       destructive=True, node=LOST, fence_timeout=120, bench_mib=4, bench_files=100)
        finally:
            admin.patch_node(OTHER_CPU_NODE, {"spec": {"unschedulable": None}})
            sim_api(hub.sim, "POST", f"/nodes/{LOST}/recover")
        r = found["storage/node-loss-fenced-cold-start"]
        assert r.result == expected, printed
        assert told and told[-1].startswith(f"Power {LOST} off now"), told
        if expected == PASS:
            assert r.figures["started on"] == OTHER_CPU_NODE and r.figures["attachments"] and \
                all(a.endswith(f" on {OTHER_CPU_NODE}") for a in r.figures["attachments"]), r.figures
        else:
            assert r.sentence.startswith("A disk is attached to two nodes at once: "), r.sentence
