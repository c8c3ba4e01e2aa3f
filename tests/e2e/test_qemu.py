"""A workstation that is a real Linux machine: the golden image deploy/golden-image/build.sh makes,
booted by QEMU under the simulator's `--guests qemu`, through the real hub and proxy.

What runs in the guest is the product's guest side: cloud-init (NoCloud) from the cidata disk, the
kubevirt-workstation unit reading the hubenv disk, jupyterhub-singleuser as the user, the real
qemu-guest-agent answering KubeVirt's guest-agent subresources, growpart. Each boot takes a minute
or more under software emulation, so the machine boots three times in all (start, start again,
restore) and the tests run in order on one machine.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from pathlib import Path
from urllib.parse import quote

import pytest
import requests
from conftest import GOLDEN_BUILD, SERVICE_API, Cluster, Hub, hub_with_service, tunnel_handshake
from guests import BOOT_TIMEOUT, GRACE, QEMU_CONFIG, holds, hub_token, qemu_simulator, run_as, volume_images
from test_ssh import cli, keygen, keys_api, ssh, ssh_config, token_of

from kubevirt_spawner.demo import DEMO_PASSWORD

from simtools import wait_for

pytestmark = pytest.mark.guests  # one after another on one xdist worker (tests/conftest.py)

REPO = Path(__file__).resolve().parents[2]
BUILD = GOLDEN_BUILD
USER = "alice"  # boots through SeaBIOS (the spawner's default firmware, bios: KubeVirt's default)
NS, VM = f"notebook-{USER}", f"{USER}-workstation"
EFI_USER = "bob"  # boots through OVMF (the profile's firmware: efi, Secure Boot off)


@pytest.fixture(scope="module")
def qemu_sim(golden_image, tmp_path_factory):
    yield from qemu_simulator(golden_image, tmp_path_factory)


@pytest.fixture(scope="module")
def cluster(qemu_sim):
    return Cluster(qemu_sim)


@pytest.fixture(scope="module")
def hub(qemu_sim, tmp_path_factory):
    yield from hub_with_service(qemu_sim, tmp_path_factory, QEMU_CONFIG)


@pytest.fixture(scope="module")
def ssh_key(tmp_path_factory) -> Path:
    key = tmp_path_factory.mktemp("ssh") / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    return key


def sh(hub: Hub, command: str, user: str = USER) -> str:
    return run_as(hub, user, command)


def qemu_running(cluster: Cluster) -> bool:
    """Whether this simulator's QEMU for alice's VMI runs (its console log is under the state directory)."""
    console = f"file:{console_log(cluster)}"
    return subprocess.run(["pgrep", "-f", console], capture_output=True).returncode == 0


def console_log(cluster: Cluster) -> Path:
    return Path(cluster.sim.sim.state_dir) / "guests" / f"{NS}_{VM}.console.log"


def agent(cluster: Cluster, call: str) -> dict:
    """A guest-agent subresource of the VMI, as kubectl and the service read it."""
    r = cluster.api.call_api(*cluster.api.param_serialize(
        "GET", f"/apis/subresources.kubevirt.io/v1/namespaces/{NS}/virtualmachineinstances/{VM}/{call}",
        auth_settings=["BearerToken"]))
    r.read()
    assert r.status == 200, r.data
    return json.loads(r.data)


def golden_file(golden_image: Path, path: str) -> str | None:
    """A file of the golden image's root filesystem (debugfs reads its partition, the last, in
    place); None when there is no such file."""
    start = json.loads(subprocess.run(["sfdisk", "--json", str(golden_image / "disk.raw")], capture_output=True,
                                      text=True, check=True).stdout)["partitiontable"]["partitions"][-1]["start"]
    done = subprocess.run(["debugfs", "-R", f"cat {path}", f"{golden_image / 'disk.raw'}?offset={start * 512}"],
                          capture_output=True, text=True, check=True)
    return None if "File not found" in done.stderr else done.stdout


def test_the_golden_image_is_built_once_and_sealed(golden_image: Path):
    """build.sh builds the image from Debian's packages and pinned PyPI packages once per recipe: run
    again, it finds its cached build. The image is sealed: no machine-id, no SSH host keys, no
    cloud-init instance, no root history (the design document's sealing section)."""
    again = subprocess.run(["bash", str(BUILD)], capture_output=True, text=True, timeout=600, check=True)
    assert again.stdout.strip().splitlines()[-1] == str(golden_image) and "(cached)" in again.stderr
    meta = json.loads((golden_image / "image.json").read_text())
    assert meta["suite"] == "bookworm" and "jupyterlab==4.6.6" in meta["python"] and "qemu-guest-agent" in meta["packages"]
    assert (golden_file(golden_image, "/etc/machine-id") or "").strip() in ("", "uninitialized")
    assert golden_file(golden_image, "/etc/ssh/ssh_host_ed25519_key") is None
    assert golden_file(golden_image, "/root/.bash_history") is None
    assert golden_file(golden_image, "/var/lib/cloud/instance/boot-finished") is None
    assert "%sudo ALL=(ALL:ALL) NOPASSWD: ALL" in (golden_file(golden_image, "/etc/sudoers.d/kubevirt-workstation") or "")
    unit = golden_file(golden_image, "/etc/systemd/system/kubevirt-workstation.service") or ""
    assert "Restart=always" in unit and "kubevirt-workstation" in unit
    # VS Code in the browser: code-server with its own Node.js (code-server.sh)
    assert meta["code_server"] == json.loads(subprocess.run(["bash", str(BUILD), "--plan"], capture_output=True,
                                                            text=True, check=True).stdout)["code_server"]
    assert "/opt/code-server/bin/node" in (golden_file(golden_image, "/usr/local/bin/code-server") or "")


def test_alice_has_a_real_machine_that_keeps_what_she_installs(hub: Hub, cluster: Cluster, golden_image: Path,
                                                               ssh_key: Path):
    """alice starts: QEMU boots her clone of the golden image, cloud-init gives it an identity, the
    workstation unit reads the hubenv disk and runs jupyterhub-singleuser as alice, and JupyterLab
    answers through the proxy. She writes into /etc and /opt (sudo) and her home, logs in over the
    forwarded SSH port (the guest agent's user list shows it), stops (QEMU ends within the grace
    period, from the guest's own power-off), starts again: everything is there, and it is the same
    machine. Upstream: kubevirt pkg/host-disk/host-disk.go (disk.img), pkg/cloud-init/cloud-init.go
    (the cidata disk), pkg/config/config.go (the Secret disk), pkg/virt-handler/vm.go (the grace
    period), staging/src/kubevirt.io/api/core/v1/types.go (the guest-agent types)."""
    began = time.monotonic()
    hub.start_server(USER, timeout=BOOT_TIMEOUT)
    cold_boot = time.monotonic() - began
    assert qemu_running(cluster)
    lab = hub.http.get(f"{hub.url}/user/{USER}/lab", timeout=60)
    assert lab.status_code == 200 and "JupyterLab" in lab.text, lab.status_code
    assert sh(hub, "id -un") == f"{USER}\n"
    # the machine is the golden image's, as the guest agent and the kernel say
    # (virt-handler polls the agent every 10 s: its first answer may predate cloud-init's hostname)
    info = wait_for(lambda: (lambda i: i if i["hostname"] == VM else None)(agent(cluster, "guestosinfo")), 60,
                    interval=2, what="the guest agent's hostname")
    assert info["os"]["id"] == "debian", info
    assert {f["mountPoint"] for f in info["fsInfo"]["disks"]} >= {"/", "/home"}
    # a fresh identity: machine-id and SSH host keys the sealed golden image does not have
    machine_id = sh(hub, "cat /etc/machine-id").strip()
    assert len(machine_id) == 32 and machine_id != (golden_file(golden_image, "/etc/machine-id") or "").strip()
    host_key = sh(hub, "cat /etc/ssh/ssh_host_ed25519_key.pub").split()[1]
    assert golden_file(golden_image, "/etc/ssh/ssh_host_ed25519_key.pub") is None
    verify = sh(hub, "sudo /usr/local/sbin/verify-clone.sh")
    assert "FAIL" not in verify, verify
    # the root partition grew to the 6 GiB disk
    root_bytes = int(sh(hub, "df --output=size -B1 / | tail -1").strip())
    assert root_bytes > 5 * 2**30, root_bytes
    # she installs things everywhere
    sh(hub, "echo tuned | sudo tee /etc/alice.conf && sudo mkdir -p /opt/tool && "
            "echo 1.2 | sudo tee /opt/tool/VERSION && echo mine > ~/notes.txt")
    # an SSH login over the VMI's forwarded port, with her key
    sh(hub, f"mkdir -p -m 700 ~/.ssh && echo '{ssh_key.with_suffix('.pub').read_text().strip()}' "
            ">> ~/.ssh/authorized_keys && chmod 600 ~/.ssh/authorized_keys")
    ip = cluster.vmi(NS, VM)["status"]["interfaces"][0]["ipAddress"]
    ssh = subprocess.Popen(["ssh", "-tt", "-i", str(ssh_key), "-o", "StrictHostKeyChecking=no", "-o",
                            "UserKnownHostsFile=/dev/null", "-o", "BatchMode=yes", "-o", "ConnectTimeout=30",
                            f"{USER}@{ip}", "sleep 120"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT)
    try:
        logins = wait_for(lambda: [u for u in agent(cluster, "userlist")["items"] if u["userName"] == USER],
                          60, interval=2, what="alice's SSH login in the guest agent's user list")
        assert logins[0]["loginTime"] > 0
        scanned = subprocess.run(["ssh-keyscan", "-t", "ed25519", ip], capture_output=True, text=True).stdout
        assert host_key in scanned  # the host key the forwarded port presents is the clone's own
    finally:
        ssh.kill()
        ssh.wait()

    # stop: the guest powers itself off (the agent's guest-shutdown) well within the grace period
    began = time.monotonic()
    hub.stop_server(USER, timeout=GRACE + 60)
    wait_for(lambda: not qemu_running(cluster), GRACE, interval=0.5, what="QEMU to end")
    stopped_in = time.monotonic() - began
    assert stopped_in < GRACE, stopped_in
    console = console_log(cluster).read_text(errors="replace")
    assert "reboot: Power down" in console  # the guest shut down; nothing killed it
    # SeaBIOS ran GRUB from the disk, and GRUB the disk's own kernel (no kernel given to QEMU)
    assert "Loading Linux" in console and "root=UUID=" in console, console[:3000]
    # the hub's token of that boot is on the env disk only: not on the system or workspace disk
    token = hub_token(cluster, NS, f"{USER}-hub-env")
    images = volume_images(cluster, NS)
    assert set(images) == {f"{USER}-rootdisk", f"{USER}-workspace"}, images
    for claim, image in images.items():
        assert not holds(image, token), f"the hub's token is on {claim}"

    # she starts again with another profile: the spawner replaces the VM's template (more memory)
    # and keeps the firmware UUID and serial KubeVirt gave the VM at create (vm-mutator.go
    # setFirmwareDefaultsIfEmpty), which is cloud-init's instance-id: the same instance, the same
    # SSH host keys (issue 47, item 2)
    identity = cluster.vm(NS, VM)["spec"]["template"]["spec"]["domain"]["firmware"]
    began = time.monotonic()
    hub.start_server(USER, profile="roomy", timeout=BOOT_TIMEOUT)
    resume = time.monotonic() - began
    assert sh(hub, "cat /etc/alice.conf /opt/tool/VERSION ~/notes.txt /etc/machine-id") == \
        f"tuned\n1.2\nmine\n{machine_id}\n"
    assert int(sh(hub, "awk '/MemTotal/ {print $2}' /proc/meminfo")) > 2_500_000  # the new profile's 3 GiB
    firmware = cluster.vm(NS, VM)["spec"]["template"]["spec"]["domain"]["firmware"]
    assert (firmware["uuid"], firmware["serial"]) == (identity["uuid"], identity["serial"])
    assert sh(hub, "sudo cat /sys/class/dmi/id/product_uuid /sys/class/dmi/id/product_serial") == \
        f"{firmware['uuid']}\n{firmware['serial']}\n"
    assert sh(hub, "cat /etc/ssh/ssh_host_ed25519_key.pub").split()[1] == host_key
    ip = cluster.vmi(NS, VM)["status"]["interfaces"][0]["ipAddress"]
    assert host_key in subprocess.run(["ssh-keyscan", "-t", "ed25519", ip], capture_output=True, text=True).stdout
    print(f"\ncold boot to Lab {cold_boot:.0f} s, stop {stopped_in:.1f} s, resume {resume:.0f} s")


def test_ssh_through_the_hub_with_a_key_from_the_service(hub: Hub, cluster: Cluster, tmp_path: Path):
    """The golden image's OpenSSH sshd, reached through alice's server (`sshd/`, the hub's proxy):
    her key from the workstations service logs her in (the image's AuthorizedKeysCommand asks the
    service from inside the machine), scp copies both ways, another user's token and the admin's
    open no tunnel (403; sshd's journal shows no connection), and the key deleted in the service
    is refused at the next login. Upstream: OpenSSH sshd_config(5) (AuthorizedKeysCommand,
    AuthorizedKeysCommandUser, LogLevel VERBOSE), jupyter-server-proxy jupyter_server_proxy/rawsocket.py."""
    if not (hub.server_model(USER) or {}).get("ready"):  # (run alone: the machine boots here)
        hub.start_server(USER, timeout=BOOT_TIMEOUT)
    token, other = token_of(hub, USER), token_of(hub, "mallory")
    public, fingerprint = keygen(tmp_path / "id_ed25519")
    r = keys_api(hub, token, "POST", USER, json={"key": public})
    assert r.status_code == 201, r.text
    config = ssh_config(hub, token, USER, tmp_path / "id_ed25519")
    done = ssh(config, token, hub, f"kubevirt.{USER}", "id -un; hostname")
    assert done.returncode == 0 and done.stdout == f"{USER}\n{VM}\n", (done.stdout, done.stderr)
    (tmp_path / "up.txt").write_text("up\n")
    assert ssh(config, token, hub, str(tmp_path / "up.txt"), f"kubevirt.{USER}:up.txt", program="scp").returncode == 0
    assert ssh(config, token, hub, f"kubevirt.{USER}:up.txt", str(tmp_path / "down.txt"), program="scp").returncode == 0
    assert (tmp_path / "down.txt").read_text() == "up\n" and sh(hub, "cat ~/up.txt") == "up\n"
    # another user's token opens no tunnel, nor does the hub's admin's (who may open her server):
    # 403, and no connection reaches the image's sshd, which logs each one (LogLevel VERBOSE; her
    # own empty tunnel shows the count moves)
    def connections() -> int:
        return int(sh(hub, "sudo -n journalctl -u ssh.service -o cat --no-pager | grep -c '^Connection from ' || true"))
    before = connections()
    opened, banner = tunnel_handshake(hub, USER, token)
    assert opened == 101 and banner.startswith("SSH-2.0-"), banner
    wait_for(lambda: connections() == before + 1, 60, what="her own tunnel's connection in sshd's journal")
    assert tunnel_handshake(hub, USER, other)[0] == 403
    admin = hub.http.headers["Authorization"].split()[1]
    assert tunnel_handshake(hub, USER, admin)[0] == 403
    time.sleep(3)
    assert connections() == before + 1
    refused = cli("tunnel", USER, "--no-start", token=other, hub=hub)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    # the password and root logins the image refuses
    root = ssh(config, token, hub, "-l", "root", f"kubevirt.{USER}", "true")
    assert root.returncode == 255 and "Permission denied" in root.stderr, root.stderr
    # deleted in the service: the next login is refused
    assert keys_api(hub, token, "DELETE", USER, rest="/" + quote(fingerprint, safe="")).status_code == 200
    again = ssh(config, token, hub, f"kubevirt.{USER}", "true")
    assert again.returncode == 255 and "Permission denied" in again.stderr, again.stderr


def test_vs_code_in_the_browser_is_the_images_code_server_for_its_owner_only(hub: Hub, browser):
    """The golden image's code-server (deploy/golden-image/code-server.sh) behind alice's server's
    `vscode/` (jupyter-server-proxy's supervised process, jupyter_server_proxy/handlers.py): her
    token gets VS Code's workbench, the admin (who may open her server) gets a sentence and no
    VS Code, and in a browser her Lab's launcher has the VS Code tile, which opens a workbench
    whose terminal runs a shell in her machine (code-server's websocket and node-pty, through the
    hub's proxy). Screenshots go to test-artifacts/qemu/."""
    if not (hub.server_model(USER) or {}).get("ready"):  # (run alone: the machine boots here)
        hub.start_server(USER, timeout=BOOT_TIMEOUT)
    base = f"{hub.url}/user/{USER}"
    own = requests.Session()
    own.headers["Authorization"] = f"token {token_of(hub, USER)}"
    began = time.monotonic()
    page = own.get(f"{base}/vscode/", timeout=BOOT_TIMEOUT)  # (code-server starts here)
    first = time.monotonic() - began
    assert page.status_code == 200 and "vscode-workbench-web-configuration" in page.text, page.text[:500]
    assert own.get(f"{base}/workstation/api/info", timeout=30).json()["vscode_url"] == f"/user/{USER}/vscode/"
    other = hub.http.get(f"{base}/vscode/", timeout=60)
    assert other.status_code == 403 and f"Only {USER} can use this workstation" in other.text

    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    artifacts = REPO / "test-artifacts" / "qemu"
    artifacts.mkdir(parents=True, exist_ok=True)
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    context.set_default_timeout(BOOT_TIMEOUT * 1000)
    try:
        lab = context.new_page()
        lab.goto(f"{hub.url}/hub/login")
        lab.fill("#username_input", USER)
        lab.fill("#password_input", DEMO_PASSWORD)
        lab.click("#login_submit")
        lab.goto(f"{base}/lab")
        tile = lab.locator(".jp-LauncherCard", has_text="VS Code")
        tile.wait_for()
        lab.screenshot(path=str(artifacts / "vscode-launcher.png"))
        with lab.expect_popup() as popup:
            tile.click()
        code = popup.value
        # her home's files listed: the workbench talks to code-server over its websocket
        code.locator(".explorer-folders-view .monaco-list-row").first.wait_for()
        trust = code.locator(".monaco-dialog-box .monaco-button", has_text="Yes, I trust the authors")
        with contextlib.suppress(PlaywrightTimeout):  # (VS Code asks once per folder)
            trust.wait_for(timeout=20_000)
            trust.click()
        code.keyboard.press("Control+Backquote")  # View: Toggle Terminal
        code.locator(".xterm").first.wait_for()
        code.locator(".xterm").first.click()
        code.keyboard.type("hostname > ~/from-vscode.txt\n")
        # (read through Jupyter's contents API: a kernel per look is heavy beside code-server on TCG)
        wait_for(lambda: hub.read_file(USER, "from-vscode.txt") == f"{VM}\n", 120, interval=2,
                 what="the command typed in VS Code's terminal")
        code.screenshot(path=str(artifacts / "vscode.png"))
    finally:
        context.close()
    print(f"\ncode-server's first page {first:.0f} s")


def test_an_online_snapshot_is_application_consistent_and_restores(hub: Hub, cluster: Cluster):
    """A snapshot of the running machine: the service says application-consistent, the guest's
    agent froze its filesystems (its own journal says so) and thawed them (the VMI's fsFreezeStatus
    is gone); a restore brings the machine back as it was. Upstream: kubevirt
    pkg/storage/snapshot/source.go (Freeze/Unfreeze), pkg/virt-handler/rest/lifecycle.go, qemu
    qga/commands-posix.c (guest-fsfreeze-*)."""
    if not (hub.server_model(USER) or {}).get("ready"):  # (run alone: the machine boots here)
        hub.start_server(USER, timeout=BOOT_TIMEOUT)
    token = hub.api("POST", f"/users/{USER}/tokens", json={"note": "test"}).json()["token"]
    api = requests.Session()
    api.headers["Authorization"] = f"token {token}"
    wait_for(lambda: api.get(f"{hub.url}{SERVICE_API}/workstations/{USER}", timeout=30).json()
             .get("snapshot_consistency") == "application-consistent", 60, interval=2,
             what="the service to see the agent")
    sh(hub, "echo before | sudo tee /opt/state")
    host_key = sh(hub, "cat /etc/ssh/ssh_host_ed25519_key.pub").split()[1]
    r = api.post(f"{hub.url}{SERVICE_API}/workstations/{USER}/snapshots", json={"name": "tuned"}, timeout=120)
    assert r.status_code == 201, r.text
    assert r.json()["consistency"] == "application-consistent"
    wait_for(lambda: next((s for s in api.get(f"{hub.url}{SERVICE_API}/workstations/{USER}/snapshots",
                                              timeout=30).json()["snapshots"] if s["name"] == "tuned"), {})
             .get("ready"), 120, interval=1, what="the snapshot ready")
    # qemu-ga logs each freeze (qga/commands-posix.c); the thaw shows as a root filesystem that
    # takes writes again (a write to a frozen one blocks, and this one would time out)
    journal = sh(hub, "sudo journalctl -u qemu-guest-agent --no-pager -o cat")
    assert journal.count("guest-fsfreeze called") == 1, journal[-2000:]
    assert "fsFreezeStatus" not in cluster.vmi(NS, VM)["status"]
    sh(hub, "echo after | sudo tee /opt/state")
    r = api.post(f"{hub.url}{SERVICE_API}/workstations/{USER}/restore", json={"snapshot": "tuned", "confirm": True},
                 timeout=120)
    assert r.status_code == 202, r.text
    wait_for(lambda: (api.get(f"{hub.url}{SERVICE_API}/workstations/{USER}", timeout=30).json().get("operation")
                      or {}).get("state") not in (None, "running"), BOOT_TIMEOUT + 120, interval=3,
             what="the restore")
    hub.wait_ready(USER, timeout=BOOT_TIMEOUT)
    assert sh(hub, "cat /opt/state /etc/alice.conf") == "before\ntuned\n"
    # the first start after a restore replaced the restored template: the same machine, the same
    # host key presented (issue 47, item 2)
    assert sh(hub, "cat /etc/ssh/ssh_host_ed25519_key.pub").split()[1] == host_key
    ip = cluster.vmi(NS, VM)["status"]["interfaces"][0]["ipAddress"]
    assert host_key in subprocess.run(["ssh-keyscan", "-t", "ed25519", ip], capture_output=True, text=True).stdout



def shared_dataset(cluster: Cluster, ns: str) -> Path:
    """What an admin does for shared data: KubeVirt's EnableVirtioFsStorageVolumes gate on, and a
    claim `datasets` in the user's namespace (made, labelled as the hub's, before its first start),
    holding a file. The claim's directory."""
    cluster.custom.create_namespaced_custom_object("kubevirt.io", "v1", "kubevirt", "kubevirts", {
        "apiVersion": "kubevirt.io/v1", "kind": "KubeVirt", "metadata": {"name": "kubevirt"},
        "spec": {"configuration": {"developerConfiguration": {"featureGates": ["EnableVirtioFsStorageVolumes"]}}}})
    cluster.core.create_namespace({"metadata": {"name": ns, "labels": {
        "app.kubernetes.io/managed-by": "kubevirt-spawner"}}})
    cluster.core.create_namespaced_persistent_volume_claim(ns, {"metadata": {"name": "datasets"}, "spec": {
        "accessModes": ["ReadOnlyMany"], "resources": {"requests": {"storage": "1Gi"}}}})
    claim = wait_for(lambda: cluster.core.read_namespaced_persistent_volume_claim("datasets", ns).spec.volume_name,
                     30, what="the datasets claim bound")
    data = Path(cluster.sim.sim.state_dir) / "volumes" / claim
    data.mkdir(parents=True, exist_ok=True)
    (data / "README").write_text("cifar-10\n")
    return data


def test_a_clone_boots_through_efi_too(hub: Hub, cluster: Cluster):
    """bob's profile says firmware efi: his VM asks for OVMF with Secure Boot off, and OVMF boots
    the same golden image from its EFI system partition (the removable-media path: a new VMI's
    variable store has no boot entry). His clone is his own, keeps what he writes across a stop
    and a start, and his token stays off his disks. Upstream: kubevirt
    pkg/virt-launcher/virtwrap/efi/efi.go, converter/compute/os.go, virtwrap/manager.go.

    His profile also mounts a shared dataset read-only and gives him a scratch disk (issue 26):
    the image's launcher mounts the virtiofs tag at its path (virtiofsd serves the claim, read-only
    as the launcher pod's readOnly mount: kubevirt pkg/virt-controller/services/rendervolumes.go,
    converter/storage/virtiofs.go), and the emptyDisk (pkg/emptydisk) is blank at every start.
    His extra disk (a blank DataVolume, disk serial disk-models) gets an ext4 filesystem of his own
    from the image's launcher at its first boot and keeps his files across a stop and a start."""
    ns, vm = f"notebook-{EFI_USER}", f"{EFI_USER}-workstation"
    if (hub.server_model(USER) or {}).get("ready"):
        hub.stop_server(USER, timeout=GRACE + 60)  # (two TCG guests at once would halve each)
    dataset = shared_dataset(cluster, ns)
    hub.ensure_user(EFI_USER)
    hub.start_server(EFI_USER, profile="efi", timeout=BOOT_TIMEOUT)
    firmware = cluster.vm(ns, vm)["spec"]["template"]["spec"]["domain"]["firmware"]
    assert firmware["bootloader"] == {"efi": {"secureBoot": False}}
    assert set(firmware) == {"bootloader", "uuid", "serial"}  # (KubeVirt's mutator gave the identity)
    lab = hub.http.get(f"{hub.url}/user/{EFI_USER}/lab", timeout=60)
    assert lab.status_code == 200 and "JupyterLab" in lab.text, lab.status_code
    assert "FAIL" not in sh(hub, "sudo /usr/local/sbin/verify-clone.sh", EFI_USER)
    assert sh(hub, "test -d /sys/firmware/efi && echo efi", EFI_USER) == "efi\n"
    sh(hub, "echo b | sudo tee /etc/bob.conf && sudo mkdir -p /opt/b && echo 2 | sudo tee /opt/b/V && "
            "echo his > ~/h.txt", EFI_USER)
    assert sh(hub, "cat /data/datasets/README && findmnt -n -o FSTYPE /data/datasets", EFI_USER) == \
        "cifar-10\nvirtiofs\n"
    # root in the guest cannot write the read-only share, even after remounting it read-write
    refused = sh(hub, "sudo mount -o remount,rw /data/datasets; sudo touch /data/datasets/x 2>&1; echo $?",
                 EFI_USER)
    assert "Read-only file system" in refused and not (dataset / "x").exists(), refused
    assert sh(hub, "stat -c %a /scratch && findmnt -n -o FSTYPE /scratch && echo s > /scratch/s && ls /scratch",
              EFI_USER) == "1777\next4\nlost+found\ns\n"
    mounted = sh(hub, "findmnt -n -o FSTYPE /data/models; readlink -f /dev/disk/by-id/virtio-disk-models; "
                      "findmnt -n -o SOURCE /data/models; stat -c %U /data/models; echo m > /data/models/m && echo ok",
                 EFI_USER).split()
    assert mounted[0] == "ext4" and mounted[1] == mounted[2] and mounted[3:] == [EFI_USER, "ok"], mounted
    hub.stop_server(EFI_USER, timeout=GRACE + 60)
    console = (Path(cluster.sim.sim.state_dir) / "guests" / f"{ns}_{vm}.console.log").read_text(errors="replace")
    assert "BdsDxe" in console and "Welcome to GRUB" in console, console[:3000]
    token = hub_token(cluster, ns, f"{EFI_USER}-hub-env")
    images = volume_images(cluster, ns, shares=("datasets",))
    assert set(images) == {f"{EFI_USER}-rootdisk", f"{EFI_USER}-workspace", f"{EFI_USER}-workspace-models"}, images
    for claim, image in images.items():
        assert not holds(image, token), f"the hub's token is on {claim}"
    hub.start_server(EFI_USER, profile="efi", timeout=BOOT_TIMEOUT)
    assert sh(hub, "cat /etc/bob.conf /opt/b/V ~/h.txt", EFI_USER) == "b\n2\nhis\n"
    assert sh(hub, "ls /scratch", EFI_USER) == "lost+found\n"  # a blank disk at every start
    assert sh(hub, "cat /data/models/m", EFI_USER) == "m\n"
    hub.stop_server(EFI_USER, timeout=GRACE + 60)



def test_the_acceptance_suite_keeps_its_promises_on_a_real_machine(hub: Hub, cluster: Cluster, tmp_path: Path):
    """`kubevirt-spawner acceptance --only persistence,security` against machines booted from the
    golden image: what the process guests cannot show runs here for real (a package installed with
    dpkg, a systemd unit the owner enabled, across a reboot of the same disk), and no credential is
    found on a real machine's disks. The idle experiment is SKIP (the hub's idle timeout is an hour).
    Upstream: systemd's systemctl(1) enable --now, dpkg-deb(1)/dpkg(1), kubevirt
    pkg/virt-controller/services/template.go (the launcher pod's requests, freed at the stop)."""
    import asyncio
    import concurrent.futures
    import io

    from test_acceptance import reader_kubeconfig

    from kubevirt_spawner.acceptance import run_suite
    from kubevirt_spawner.acceptance.experiments import Options

    for user in (USER, EFI_USER):  # (two TCG guests at once would halve each)
        if (hub.server_model(user) or {}).get("ready"):
            hub.stop_server(user, timeout=GRACE + 60)
    kubeconfig = reader_kubeconfig(cluster.sim, tmp_path / "reader.kubeconfig")
    out = io.StringIO()
    suite = run_suite(hub.url + "/", hub.settings.admin_token, kubeconfig,
                      Options(user="carol", only=("persistence", "security"), idle_wait=0,
                              start_timeout=BOOT_TIMEOUT, release_wait=GRACE + 60), out)
    # (on a thread of its own: the module's browser holds Playwright's sync API, whose loop runs on this one)
    with concurrent.futures.ThreadPoolExecutor(1) as own:
        records, _ = own.submit(asyncio.run, suite).result()
    outcome = {f"{r.section}/{r.name}": r.result for r in records}
    assert outcome == {
        "persistence/first-start": "PASS", "persistence/stop-releases-compute-keeps-disks": "PASS",
        "persistence/files-kept": "PASS", "persistence/pip-package-kept": "PASS",
        "persistence/system-package-kept": "PASS", "persistence/systemd-unit-kept": "PASS",
        "security/other-users-are-refused": "PASS", "security/vmi-address-refuses-without-token": "PASS",
        "security/no-cluster-credentials-in-guest": "PASS", "security/usage-and-snapshots-visible-to-user": "PASS",
        "persistence/reset-keeps-workspace": "PASS", "security/idle-warning-then-stop": "SKIP",
        "persistence/deleted-server-keeps-disks": "PASS"}, out.getvalue()
    assert "a virtual machine" in next(r.sentence for r in records if r.name == "first-start")
