"""The QEMU command line of the simulator's qemu guests against what virt-launcher's domain amounts
to (kubevirt v1.9 pkg/virt-launcher/virtwrap/converter/converter.go, testdata/domain_x86_64.xml;
converter/vcpu/vcpu.go; converter/compute/channels.go; converter/compute/os.go and
virtwrap/efi/efi.go for the firmware; virtwrap/manager.go for Secure Boot's default;
converter/network/configurator.go for the NIC's ROM; docs/pci-topology.md for the buses;
pkg/network/link/address.go) and the 20-byte virtio-blk serial (QEMU hw/block/virtio-blk.c)."""

from __future__ import annotations

import os

import pytest

from kubevirt_spawner.sim import qemu
from kubevirt_spawner.sim.qemu import Disk, Machine


def machine(**changes) -> Machine:
    base = dict(name="alice-workstation", cpus=2, memory_mib=2048,
                disks=(Disk("root.raw", "rootdisk", boot_order=1), Disk("ws.raw", "workspace"), Disk("ci.iso"),
                       Disk("env.iso", "hubenv")),
                forwards=(("127.0.5.7", 8888, 8888), ("127.0.5.7", 22, 22)),
                agent_socket="qga.sock", monitor_socket="qmp.sock", console_log="console.log")
    base.update(changes)
    return Machine(**base)  # type: ignore[arg-type]


def test_the_command_line_is_the_domain_virt_launcher_defines():
    args = qemu.command(machine())
    line = " ".join(args)
    assert "-machine q35,accel=tcg,smm=off" in line and "-smp 2,sockets=2,cores=1,threads=1" in line and "-m 2048" in line
    # the firmware boots the disks: no kernel of its own, only disks with a boot order are tried
    assert "-kernel" not in args and "-initrd" not in args and "-boot strict=on" in line
    assert "pflash" not in line  # (no firmware given: SeaBIOS, QEMU's own)
    devices = [args[i + 1] for i, a in enumerate(args) if a == "-device"]
    blk = [d for d in devices if d.startswith("virtio-blk-pci")]
    assert blk == ["virtio-blk-pci,drive=disk0,bus=rp3,serial=rootdisk,bootindex=1",
                   "virtio-blk-pci,drive=disk1,bus=rp4,serial=workspace", "virtio-blk-pci,drive=disk2,bus=rp5",
                   "virtio-blk-pci,drive=disk3,bus=rp6,serial=hubenv"]
    assert "virtserialport,chardev=agent,name=org.qemu.guest_agent.0" in devices
    # the NIC on bus 1 (enp1s0 in the guest, as in a KubeVirt VM), without an option ROM
    assert devices[:2] == ["pcie-root-port,id=rp1,chassis=1,bus=pcie.0", "virtio-net-pci,netdev=net0,bus=rp1,romfile="]
    netdev = args[args.index("-netdev") + 1]
    assert "host=10.0.2.1,dhcpstart=10.0.2.2" in netdev and "hostname=alice-workstation" in netdev
    assert "hostfwd=tcp:127.0.5.7:8888-10.0.2.2:8888" in netdev and "hostfwd=tcp:127.0.5.7:22-10.0.2.2:22" in netdev
    assert "-cpu host" in " ".join(qemu.command(machine(accel="kvm")))


def test_a_tap_nic_takes_the_place_of_the_user_network_on_the_same_bus():
    """A test plays the pod's side of the masquerade binding behind a tap device: the NIC stays
    where KubeVirt puts it; forwards belong to the user network and are refused with a tap."""
    args = qemu.command(machine(forwards=(), tap="tap0"))
    assert args[args.index("-netdev") + 1] == "tap,id=net0,ifname=tap0,script=no,downscript=no"
    assert "virtio-net-pci,netdev=net0,bus=rp1,romfile=" in args
    with pytest.raises(ValueError, match="no forwards"):
        qemu.command(machine(tap="tap0"))


@pytest.mark.parametrize("efi,expected", [
    (None, (False, False)),
    ({"bios": {}}, (False, False)),
    ({"efi": {}}, (True, True)),  # KubeVirt: SecureBoot == nil || *SecureBoot
    ({"efi": {"secureBoot": True}}, (True, True)),
    ({"efi": {"secureBoot": False}}, (True, False)),
])
def test_the_firmware_is_the_one_the_vmi_asks_for(efi, expected):
    spec = {"domain": {"firmware": {"bootloader": efi}}} if efi is not None else {"domain": {}}
    assert qemu.vmi_firmware(spec) == expected


def test_efi_boots_ovmf_from_pflash_with_the_vmis_own_variable_store(tmp_path):
    ovmf = tmp_path / "ovmf"
    ovmf.mkdir()
    for name in ("OVMF_CODE_4M.fd", "OVMF_VARS_4M.fd", "OVMF_CODE_4M.secboot.fd", "OVMF_VARS_4M.ms.fd"):
        (ovmf / name).write_bytes(name.encode())
    plain = qemu.ovmf_firmware(False, str(tmp_path / "a_VARS.fd"), str(ovmf))
    assert (tmp_path / "a_VARS.fd").read_bytes() == b"OVMF_VARS_4M.fd"  # a copy: the template stays
    line = " ".join(qemu.command(machine(firmware=plain)))
    assert f"if=pflash,format=raw,unit=0,readonly=on,file={ovmf}/OVMF_CODE_4M.fd" in line
    assert f"if=pflash,format=raw,unit=1,file={tmp_path}/a_VARS.fd" in line and "smm=off" in line
    secure = qemu.ovmf_firmware(True, str(tmp_path / "b_VARS.fd"), str(ovmf))
    line = " ".join(qemu.command(machine(firmware=secure)))
    # Secure Boot needs SMM (KubeVirt's webhook refuses it without) and Microsoft's enrolled keys
    assert "smm=on" in line and "OVMF_CODE_4M.secboot.fd" in line and "property=secure,value=on" in line
    assert (tmp_path / "b_VARS.fd").read_bytes() == b"OVMF_VARS_4M.ms.fd"
    with pytest.raises(RuntimeError, match="EFI OVMF roms missing"):
        qemu.ovmf_firmware(False, str(tmp_path / "c_VARS.fd"), str(tmp_path / "nowhere"))


def test_a_serial_longer_than_virtio_gives_is_refused():
    with pytest.raises(ValueError, match="longer than the 20 bytes"):
        qemu.command(machine(disks=(Disk("root.raw", "r" * 21),)))


def test_a_disk_copy_stays_sparse(tmp_path):
    image = tmp_path / "disk.raw"
    with open(image, "wb") as f:
        f.truncate(512 * 1024 * 1024)
        f.seek(4096)
        f.write(b"data")
    qemu.sparse_copy(str(image), str(tmp_path / "copy.raw"))
    copy = os.stat(tmp_path / "copy.raw")
    assert copy.st_size == 512 * 1024 * 1024 and copy.st_blocks * 512 < 1024 * 1024
    assert (tmp_path / "copy.raw").read_bytes()[4096:4100] == b"data"


@pytest.mark.parametrize("behaviour,expected", [
    ('echo "failed to set MSR 0x10a" >&2; exit 134', "tcg"),  # what nested KVM does on this kind of host
    ('sleep 30', "tcg"),  # a guest that hangs
    ('exit 0', "tcg"),  # exited, but the kernel never ran
    ('echo "Kernel panic - not syncing: VFS: Unable to mount root fs" > "$console"; exit 0', "kvm"),
])
def test_kvm_is_used_only_where_a_guest_really_boots(tmp_path, monkeypatch, behaviour, expected):
    """The probe QEMU here is a script: its serial console is the file after `-serial file:`."""
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        monkeypatch.setattr(qemu.os, "access", lambda path, mode: True)
    fake = tmp_path / "qemu"
    fake.write_text('#!/bin/sh\nfor a; do case "$a" in file:*) console="${a#file:}";; esac; done\n' + behaviour + "\n")
    fake.chmod(0o755)
    assert qemu.accelerator("vmlinuz", exe=str(fake), timeout=2) == expected


def test_without_dev_kvm_it_is_tcg(monkeypatch):
    monkeypatch.setattr(qemu.os, "access", lambda path, mode: False)
    assert qemu.accelerator("vmlinuz", exe="/nonexistent") == "tcg"


async def test_the_agent_client_syncs_then_asks(tmp_path):
    """qga/qapi-schema.json: guest-sync-delimited is answered after a 0xFF byte, and the id comes
    back; a leftover answer for an earlier client is skipped; errors carry class and desc;
    guest-shutdown answers nothing."""
    import asyncio
    import json as json_
    seen: list[dict] = []

    async def agent(reader, writer):
        while line := await reader.readline():
            message = json_.loads(line.lstrip(b"\xff"))
            seen.append(message)
            if message["execute"] == "guest-sync-delimited":
                writer.write(b'{"return": 7}\n\xff' + b'{"return": 1}\n'  # a stale answer first
                             + json_.dumps({"return": message["arguments"]["id"]}).encode() + b"\n")
            elif message["execute"] == "guest-get-users":
                writer.write(b'{"return": [{"user": "bob", "login-time": 1796063290.5}]}\n')
            elif message["execute"] == "guest-fsfreeze-thaw":
                writer.write(b'{"error": {"class": "GenericError", "desc": "not frozen"}}\n')
            await writer.drain()

    path = str(tmp_path / "qga.sock")
    server = await asyncio.start_unix_server(agent, path)
    try:
        a = qemu.Agent(path)
        assert await a.call("guest-get-users") == [{"user": "bob", "login-time": 1796063290.5}]
        with pytest.raises(qemu.AgentError, match="refused guest-fsfreeze-thaw: GenericError: not frozen"):
            await a.call("guest-fsfreeze-thaw")
        assert await a.call("guest-shutdown", reply=False) is None
        await asyncio.sleep(0.1)
        assert seen[-1] == {"execute": "guest-shutdown"}
        with pytest.raises(qemu.AgentError, match="did not answer guest-ping"):
            await a.call("guest-ping", timeout=0.5)  # (the fake never answers a ping)
    finally:
        server.close()
    with pytest.raises(qemu.AgentError, match="did not answer guest-info"):
        await qemu.Agent(str(tmp_path / "absent.sock")).call("guest-info")


def test_a_volume_holding_a_disk_image_is_cloned_sparse(tmp_path):
    """A QEMU guest's PVC holds its disk as one image file; a clone, snapshot or restore of it
    (storage.copy_tree) keeps it sparse, as Ceph RBD's copy-on-write clone takes no room until
    written (ceph-csi: rbd clone)."""
    from kubevirt_spawner.sim.storage import copy_tree
    volume = tmp_path / "golden"
    volume.mkdir()
    with open(volume / "disk.img", "wb") as f:
        f.truncate(1024 * 1024 * 1024)
        f.write(b"boot")
    (volume / "notes.txt").write_text("not an image")
    copy_tree(str(volume), str(tmp_path / "clone"))
    image = os.stat(tmp_path / "clone" / "disk.img")
    assert image.st_size == 1024 * 1024 * 1024 and image.st_blocks * 512 < 1024 * 1024
    assert (tmp_path / "clone" / "disk.img").read_bytes()[:4] == b"boot"
    assert (tmp_path / "clone" / "notes.txt").read_text() == "not an image"


def test_a_virtiofs_share_is_served_by_virtiofsd_that_qemu_connects_to(tmp_path):
    """Issue 26. virt-launcher's domain for a virtiofs filesystem: a vhost-user-fs device of the
    filesystem's name as its tag, on memory the daemon shares (kubevirt v1.9 pkg/virt-launcher/
    virtwrap/converter/storage/virtiofs.go: Driver type virtiofs, MemoryBacking access shared). A
    read-only one is served from a read-only bind mount (the launcher pod's readOnly mount).
    Here QEMU starts with it, connects to virtiofsd, and virtiofsd ends when QEMU does."""
    import subprocess
    import time

    from kubevirt_spawner.sim.machines import file_servers
    data = tmp_path / "datasets"
    data.mkdir()
    workdir = str(tmp_path)
    shares, commands = file_servers({"datasets": (str(data), True)}, workdir)
    assert shares == (qemu.Share("datasets", os.path.join(workdir, "fs-datasets.sock")),)
    assert commands[0][:5] == ["unshare", "--mount", "--propagation", "private", "--"]
    assert f"source={tmp_path}/fs-datasets" in commands[0] and "sandbox=chroot" in commands[0]
    args = qemu.command(machine(disks=(), forwards=(), memory_mib=256, shares=shares,
                                agent_socket=str(tmp_path / "qga.sock"), monitor_socket=str(tmp_path / "qmp.sock"),
                                console_log=str(tmp_path / "console.log")))
    line = " ".join(args)
    assert "-object memory-backend-memfd,id=mem,size=256M,share=on -numa node,memdev=mem" in line
    assert "vhost-user-fs-pci,chardev=fs3,tag=datasets,bus=rp3" in line
    log = open(tmp_path / "virtiofsd.log", "w")
    server = subprocess.Popen(commands[0], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while not os.path.exists(shares[0].socket) and time.monotonic() < deadline:
            time.sleep(0.05)
        vm = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(2)
        assert vm.poll() is None, vm.stderr.read().decode()
        vm.terminate()
        vm.wait(10)
        # virtiofsd serves one connection and ends when its vhost-user client goes: one that QEMU
        # never reached would still be waiting (the C and the Rust daemon alike; no log text checked)
        assert server.wait(10) == 0, (tmp_path / "virtiofsd.log").read_text()
    finally:
        if server.poll() is None:
            os.killpg(server.pid, 9)
    assert not os.path.ismount(tmp_path / "fs-datasets")  # (the mount was virtiofsd's own)
