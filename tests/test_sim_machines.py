"""The qemu guest mode's pieces that need no VM: volume images as virt-launcher makes them
(kubevirt pkg/host-disk/host-disk.go: a sparse disk.img of the claim's size, grown with the claim),
the vCPUs and memory of a domain (pkg/virt-launcher/virtwrap/converter/vcpu/vcpu.go), the golden
image build.sh describes, the guest agent's answers in KubeVirt's types
(staging/src/kubevirt.io/api/core/v1/types.go), and the QMP power button (QEMU qapi/control.json:
the greeting, qmp_capabilities, then commands)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import pytest

from kubevirt_spawner.objects import field_value
from kubevirt_spawner.sim.agent import qemu_agent_answer
from kubevirt_spawner.sim.cluster import Cluster
from kubevirt_spawner.sim.instances import VM, VMI
from kubevirt_spawner.sim.machines import (
    GoldenImage,
    QemuGuest,
    forwarded_ports,
    memory_mib,
    monitor_command,
    vcpus,
    volume_image,
)
from kubevirt_spawner.sim.qemu import AgentError, Machine
from kubevirt_spawner.sim.snapshots import SNAP


def test_a_volume_image_is_sparse_at_the_claims_size_and_grows_never_shrinks(tmp_path):
    path = volume_image(str(tmp_path / "pvc"), 2 * 2**30)
    assert os.path.getsize(path) == 2 * 2**30 and os.stat(path).st_blocks * 512 < 2**20
    with open(path, "r+b") as f:
        f.write(b"data")
    assert volume_image(str(tmp_path / "pvc"), 3 * 2**30) == path and os.path.getsize(path) == 3 * 2**30
    volume_image(str(tmp_path / "pvc"), 2**30)
    assert os.path.getsize(path) == 3 * 2**30
    with open(path, "rb") as f:
        assert f.read(4) == b"data"


def test_vcpus_and_memory_come_from_the_domain():
    assert vcpus({"cpu": {"cores": 2, "sockets": 2}}) == 4
    assert vcpus({"resources": {"requests": {"cpu": "1500m"}}}) == 2
    assert vcpus({"resources": {"requests": {"cpu": "1"}, "limits": {"cpu": "3"}}}) == 3
    assert vcpus({}) == 1
    assert memory_mib({"memory": {"guest": "2Gi"}, "resources": {"requests": {"memory": "4Gi"}}}) == 2048
    assert memory_mib({"resources": {"requests": {"memory": "2G"}}}) == 1907


def test_the_declared_ports_are_forwarded_else_jupyter_and_ssh():
    spec = {"domain": {"devices": {"interfaces": [{"name": "default", "masquerade": {},
                                                   "ports": [{"name": "jupyter", "port": 8888},
                                                             {"name": "dns", "port": 53, "protocol": "UDP"}]}]}}}
    assert forwarded_ports(spec) == [8888]
    assert forwarded_ports({"domain": {"devices": {"interfaces": [{"name": "default"}]}}}) == [8888, 22]


def test_a_golden_image_is_what_build_sh_describes(tmp_path):
    with pytest.raises(ValueError, match="no readable image.json.*build.sh"):
        GoldenImage.load(str(tmp_path))
    # an image from before images had a bootloader (its kernel booted directly) is refused
    (tmp_path / "image.json").write_text(json.dumps({"disk": "disk.raw", "kernel": "vmlinuz", "initrd": "initrd.img",
                                                     "cmdline": "root=LABEL=kvs-root ro"}))
    with pytest.raises(ValueError, match="boots by no firmware"):
        GoldenImage.load(str(tmp_path))
    (tmp_path / "image.json").write_text(json.dumps({"disk": "disk.raw", "probe_kernel": "vmlinuz",
                                                     "firmware": ["bios", "efi"]}))
    (tmp_path / "disk.raw").write_bytes(b"")
    with pytest.raises(ValueError, match="lacks vmlinuz"):
        GoldenImage.load(str(tmp_path))
    (tmp_path / "vmlinuz").write_bytes(b"")
    image = GoldenImage.load(str(tmp_path))
    assert image.disk == str(tmp_path / "disk.raw") and image.firmware == ("bios", "efi")


def test_qemu_guests_need_a_golden_image(tmp_path):
    with pytest.raises(ValueError, match="--golden-image"):
        Cluster(str(tmp_path / "state"), guest_mode="qemu")
    with pytest.raises(ValueError, match="'process', 'null' or 'qemu'"):
        Cluster(str(tmp_path / "state"), guest_mode="vmware")


AGENT = {
    "info": {"version": "7.2.15", "supported_commands": [{"name": "guest-get-users", "enabled": True,
                                                          "success-response": True}]},
    "osinfo": {"id": "debian", "name": "Debian GNU/Linux", "pretty-name": "Debian GNU/Linux 12 (bookworm)",
               "version": "12 (bookworm)", "version-id": "12", "kernel-release": "6.1.0-28-amd64",
               "kernel-version": "#1 SMP PREEMPT_DYNAMIC Debian 6.1.119-1", "machine": "x86_64"},
    "hostname": {"host-name": "alice-workstation"},
    "timezone": {"zone": "UTC", "offset": 0},
    "users": [{"user": "alice", "login-time": 1764532800.25}],
    "fsinfo": [{"name": "vda1", "mountpoint": "/", "type": "ext4", "used-bytes": 1610612736,
                "total-bytes": 6227619840, "disk": [{"serial": "rootdisk", "bus-type": "virtio", "bus": 0,
                                                     "target": 0, "unit": 0, "dev": "/dev/vda1"}]}],
}


def test_the_agents_answers_in_kubevirts_types():
    info = qemu_agent_answer(AGENT, "guestosinfo", "fallback")
    assert info["guestAgentVersion"] == "7.2.15" and info["hostname"] == "alice-workstation"
    assert info["os"] == {"id": "debian", "name": "Debian GNU/Linux", "prettyName": "Debian GNU/Linux 12 (bookworm)",
                          "version": "12 (bookworm)", "versionId": "12", "kernelRelease": "6.1.0-28-amd64",
                          "kernelVersion": "#1 SMP PREEMPT_DYNAMIC Debian 6.1.119-1", "machine": "x86_64"}
    assert info["timezone"] == "UTC, 0" and info["supportedCommands"] == [{"name": "guest-get-users", "enabled": True}]
    assert qemu_agent_answer(AGENT, "userlist", "x")["items"] == [{"userName": "alice", "loginTime": 1764532800.25}]
    assert qemu_agent_answer(AGENT, "filesystemlist", "x")["items"] == [{
        "diskName": "vda1", "mountPoint": "/", "fileSystemType": "ext4", "usedBytes": 1610612736,
        "totalBytes": 6227619840, "disk": [{"busType": "virtio", "serial": "rootdisk"}]}]
    assert qemu_agent_answer({}, "guestosinfo", "alice-workstation")["hostname"] == "alice-workstation"


async def test_the_power_button_is_pressed_over_qmp(tmp_path):
    seen: list[str] = []

    async def qemu_monitor(reader, writer):
        writer.write(b'{"QMP": {"version": {}, "capabilities": []}}\n')
        while line := await reader.readline():
            command = json.loads(line)["execute"]
            seen.append(command)
            if command == "system_powerdown":
                writer.write(b'{"event": "POWERDOWN", "timestamp": {}}\n')
            writer.write(b'{"return": {}}\n' if command != "nonsense" else
                         b'{"error": {"class": "CommandNotFound", "desc": "The command nonsense has not been found"}}\n')
            await writer.drain()
        writer.close()

    path = str(tmp_path / "qmp.sock")
    server = await asyncio.start_unix_server(qemu_monitor, path)
    async with server:
        assert await monitor_command(path, "system_powerdown") == {"return": {}}
        with pytest.raises(ValueError, match="QEMU refused nonsense: The command nonsense has not been found"):
            await monitor_command(path, "nonsense")
    assert seen == ["qmp_capabilities", "system_powerdown", "qmp_capabilities", "nonsense"]


class QuietMachine(QemuGuest):
    """A QEMU guest whose process is a stand-in; its shutdown request is only counted."""

    def __init__(self, tmp_path):
        machine = Machine("m", 1, 256, (), (), str(tmp_path / "a.sock"),
                          str(tmp_path / "q.sock"), str(tmp_path / "console.log"))
        super().__init__(("ns", "m"), machine, str(tmp_path / "work"), str(tmp_path / "qemu.log"))
        self.requests = 0

    async def request_shutdown(self):
        self.requests += 1


async def test_a_stop_ends_when_the_guest_powers_off_or_the_grace_period_does(tmp_path):
    """virt-handler's graceful shutdown (pkg/virt-handler/vm.go): the VMI is done when the domain is
    off, or at the end of the grace period, when the domain is destroyed."""
    cluster = Cluster(str(tmp_path / "state"))
    vmi = {"metadata": {"namespace": "ns", "name": "m"}, "spec": {"terminationGracePeriodSeconds": 30}}
    guest = QuietMachine(tmp_path)
    guest.proc = await asyncio.create_subprocess_exec("sleep", "0.5")  # powers off half a second later
    began = time.monotonic()
    await cluster.compute._shut_down(guest, vmi)
    assert guest.requests == 1 and time.monotonic() - began < 5 and guest.proc.returncode == 0

    vmi["spec"]["terminationGracePeriodSeconds"] = 1
    guest = QuietMachine(tmp_path)
    guest.proc = await asyncio.create_subprocess_exec("sleep", "60", start_new_session=True)  # never does
    began = time.monotonic()
    await cluster.compute._shut_down(guest, vmi)
    assert 1 <= time.monotonic() - began < 5 and guest.proc.returncode == -signal.SIGTERM


class FreezingMachine(QuietMachine):
    """A running QEMU guest whose agent freezes (or refuses to) and thaws, in order."""

    def __init__(self, tmp_path, refuse: bool = False):
        super().__init__(tmp_path)
        self.calls: list[str] = []
        self.refuse = refuse
        self.agent_connected = True

    async def freeze(self):
        self.calls.append("freeze")
        if self.refuse:
            raise AgentError("the guest agent refused guest-fsfreeze-freeze: GenericError: busy")

    async def thaw(self):
        self.calls.append("thaw")


@pytest.mark.parametrize("refuse", [False, True])
async def test_an_online_snapshot_freezes_the_guest_around_the_copy(tmp_path, refuse):
    """virt-controller asks virt-handler to freeze the guest's filesystems through the agent before
    the volumes are snapshotted and to thaw them after (kubevirt pkg/storage/snapshot/source.go);
    the VMI says status.fsFreezeStatus "frozen" meanwhile. A freeze the agent refuses leaves the
    snapshot crash-consistent, and it says so (NoGuestAgent)."""
    cluster = Cluster(str(tmp_path / "state"))
    store = cluster.store
    vm = store.create(VM, {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
                           "metadata": {"name": "m", "namespace": "ns"}, "spec": {"template": {"spec": {}}}})
    store.create(VMI, {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
                       "metadata": {"name": "m", "namespace": "ns"}, "spec": {}, "status": {"phase": "Running"}})
    snap = store.create(SNAP, {"apiVersion": "snapshot.kubevirt.io/v1beta1", "kind": "VirtualMachineSnapshot",
                               "metadata": {"name": "s", "namespace": "ns"},
                               "spec": {"source": {"apiGroup": "kubevirt.io", "kind": "VirtualMachine", "name": "m"}},
                               "status": {"indications": ["GuestAgent", "Online"]}})
    guest = FreezingMachine(tmp_path, refuse)
    guest.proc = await asyncio.create_subprocess_exec("sleep", "30")
    cluster.compute.guests[("ns", "m")] = guest
    during: list[str | None] = []

    async def copy(snap, vm):
        guest.calls.append("copy")
        during.append(field_value(store.get(VMI, "ns", "m"), "status.fsFreezeStatus"))
    cluster.snapshots._copy_volumes = copy
    try:
        await cluster.snapshots._take(snap, vm)
    finally:
        guest.proc.kill()
        await guest.proc.wait()
    assert field_value(store.get(VMI, "ns", "m"), "status.fsFreezeStatus") is None
    indications = field_value(store.get(SNAP, "ns", "s"), "status.indications")
    if refuse:
        assert guest.calls == ["freeze", "copy"] and during == [None] and indications == ["NoGuestAgent", "Online"]
    else:
        assert guest.calls == ["freeze", "copy", "thaw"] and during == ["frozen"]
        assert indications == ["GuestAgent", "Online"]
