"""How the simulator's QEMU guests are started: the command line virt-launcher's domain amounts to.

What it mirrors (kubevirt v1.9 pkg/virt-launcher/virtwrap/converter/converter.go and its testdata
domain_x86_64.xml, docs/pci-topology.md): a q35 machine with ACPI (pkg/defaults/amd64.go); vCPUs as
sockets (converter/vcpu/vcpu.go); the firmware the VMI asks for (converter/compute/os.go,
virtwrap/efi/efi.go): none given is libvirt's default, SeaBIOS; `efi` is OVMF from pflash, the
code read-only and a fresh copy of the variable store per VMI (<vmi>_VARS.fd), the Secure Boot
build and SMM when secureBoot is on (its default); no -kernel: the firmware boots the disks in
their bootOrder (<boot order=N/> on each disk, QEMU's bootindex, strictly: a disk without one is
never tried) and the NIC's option ROM is off (network/configurator.go). Each disk is virtio-blk
with the VM's serial (the guest names it /dev/disk/by-id/virtio-SERIAL); the guest agent's
virtio-serial port org.qemu.guest_agent.0 (converter/compute/channels.go); the serial console
ttyS0 to a log (compute/console.go). PCIe layout as docs/pci-topology.md gives it: the NIC on bus
1 (the guest calls it enp1s0), the virtio-serial controller and the disks on root ports after it.
The network is QEMU's user network laid out like KubeVirt's masquerade binding (pkg/network/link/
address.go: gateway 10.0.2.1, guest 10.0.2.2), with the VMI's ports forwarded from its address
(the binding's nftables DNAT, pkg/network/setup/netpod/masquerade/masquerade.go); the guest reaches
the host's 127.0.0.1 through the gateway address (libslirp, src/socket.c sotranslate_out).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

GATEWAY = "10.0.2.1"
GUEST = "10.0.2.2"
VIRTIO_BLK_ID_BYTES = 20  # QEMU hw/block/virtio-blk.c and Linux drivers/block/virtio_blk.c: the serial's bytes
# Debian's ovmf package (4 MiB builds): plain, and the Secure Boot build with Microsoft's keys
# enrolled, as KubeVirt's OVMF_CODE.secboot.fd / OVMF_VARS.secboot.fd are
OVMF_DIR = "/usr/share/OVMF"
OVMF = {False: ("OVMF_CODE_4M.fd", "OVMF_VARS_4M.fd"), True: ("OVMF_CODE_4M.secboot.fd", "OVMF_VARS_4M.ms.fd")}


@dataclass(frozen=True)
class Firmware:
    """What boots the machine: SeaBIOS (QEMU's own), or OVMF with its code and this VMI's own
    copy of the variable store."""
    efi: bool = False
    secure_boot: bool = False
    code: str = ""
    vars: str = ""


def vmi_firmware(spec: dict) -> tuple[bool, bool]:
    """(EFI, Secure Boot) of a VMI spec: BIOS unless bootloader.efi is given; its secureBoot is on
    unless it says false (kubevirt virtwrap/manager.go: SecureBoot == nil || *SecureBoot)."""
    bootloader = ((spec.get("domain") or {}).get("firmware") or {}).get("bootloader") or {}
    efi = bootloader.get("efi")
    if efi is None:
        return False, False
    return True, efi.get("secureBoot") is not False


def ovmf_firmware(secure_boot: bool, vars_copy: str, directory: str = OVMF_DIR) -> Firmware:
    """OVMF for one boot: the variable store is copied (a VMI's NVRAM starts from the template)."""
    code, template = (os.path.join(directory, name) for name in OVMF[secure_boot])
    for path in (code, template):
        if not os.path.isfile(path):
            raise RuntimeError(f"EFI OVMF roms missing ({path}): apt-get install ovmf")
    shutil.copyfile(template, vars_copy)
    return Firmware(efi=True, secure_boot=secure_boot, code=code, vars=vars_copy)


@dataclass(frozen=True)
class Disk:
    path: str
    serial: str | None = None
    readonly: bool = False
    boot_order: int | None = None


@dataclass(frozen=True)
class Share:
    """A virtiofs filesystem: `tag` in the guest, served by a virtiofsd listening on `socket`."""
    tag: str
    socket: str


@dataclass(frozen=True)
class Machine:
    name: str  # the VMI's name: the guest's DHCP hostname
    cpus: int
    memory_mib: int
    disks: tuple[Disk, ...]
    forwards: tuple[tuple[str, int, int], ...]  # (address on this host, port there, port in the guest)
    agent_socket: str
    monitor_socket: str
    console_log: str
    accel: str = "tcg"  # "kvm" where it works
    firmware: Firmware = Firmware()
    # The NIC's other end. None: QEMU's user network, which plays the pod side of KubeVirt's
    # masquerade binding for IPv4 (its DHCP, the gateway, the forwards). A tap device's name: the
    # device, in the network namespace QEMU runs in, where a caller plays that side itself
    # (virt-launcher's DHCPv4 and DHCPv6 servers, a dual-stack or IPv6-only pod); no forwards.
    tap: str | None = None
    shares: tuple[Share, ...] = ()
    # The VMI's firmware identity (spec.domain.firmware uuid and serial): libvirt's domain <uuid>
    # and SMBIOS system entries (pkg/virt-launcher/virtwrap/converter: UUID, SysInfo), which the
    # guest reads as its product_uuid and product_serial
    uuid: str | None = None
    serial: str | None = None


def command(m: Machine, exe: str = "qemu-system-x86_64") -> list[str]:
    """QEMU's arguments for machine `m`."""
    for disk in m.disks:
        if disk.serial is not None and len(disk.serial.encode()) > VIRTIO_BLK_ID_BYTES:
            raise ValueError(f"the serial {disk.serial!r} is longer than the {VIRTIO_BLK_ID_BYTES} bytes "
                             "virtio-blk gives a guest")
    smm = "on" if m.firmware.secure_boot else "off"  # (the webhook refuses Secure Boot without SMM)
    args = [exe, "-name", m.name, "-machine", f"q35,accel={m.accel},smm={smm}",
            "-cpu", "host" if m.accel == "kvm" else "max",
            "-smp", f"{m.cpus},sockets={m.cpus},cores=1,threads=1", "-m", str(m.memory_mib),
            "-nodefaults", "-display", "none", "-no-user-config", "-boot", "strict=on",
            "-serial", f"file:{m.console_log}", "-qmp", f"unix:{m.monitor_socket},server=on,wait=off"]
    if m.uuid:
        args += ["-uuid", m.uuid]
    smbios = {"manufacturer": "KubeVirt", "product": "None", "family": "KubeVirt", "serial": m.serial, "uuid": m.uuid}
    args += ["-smbios", "type=1," + ",".join(f"{k}={v}" for k, v in smbios.items() if v)]
    if m.shares:  # vhost-user: virtiofsd reads and writes the guest's memory, which must be shared
        args += ["-object", f"memory-backend-memfd,id=mem,size={m.memory_mib}M,share=on", "-numa", "node,memdev=mem"]
    if m.firmware.efi:
        if m.firmware.secure_boot:
            args += ["-global", "driver=cfi.pflash01,property=secure,value=on"]
        args += ["-drive", f"if=pflash,format=raw,unit=0,readonly=on,file={m.firmware.code}",
                 "-drive", f"if=pflash,format=raw,unit=1,file={m.firmware.vars}"]
    if m.tap is not None:
        if m.forwards:
            raise ValueError("a tap NIC has no forwards: its network's other end is the caller's")
        netdev = f"tap,id=net0,ifname={m.tap},script=no,downscript=no"
    else:
        forwards = "".join(f",hostfwd=tcp:{addr}:{port}-{GUEST}:{guest_port}" for addr, port, guest_port in m.forwards)
        netdev = (f"user,id=net0,ipv6=off,net=10.0.2.0/24,host={GATEWAY},dhcpstart={GUEST},dns=10.0.2.3,"
                  f"hostname={m.name}{forwards}")
    # bus 1: the NIC (enp1s0), without its option ROM (no PXE: it has no boot order)
    args += ["-device", "pcie-root-port,id=rp1,chassis=1,bus=pcie.0", "-netdev", netdev,
             "-device", "virtio-net-pci,netdev=net0,bus=rp1,romfile=",
             "-device", "pcie-root-port,id=rp2,chassis=2,bus=pcie.0",
             "-device", "virtio-serial-pci,bus=rp2",
             "-chardev", f"socket,id=agent,path={m.agent_socket},server=on,wait=off",
             "-device", "virtserialport,chardev=agent,name=org.qemu.guest_agent.0"]
    for n, disk in enumerate(m.disks):
        port = f"rp{n + 3}"
        drive = f"file={disk.path},if=none,id=disk{n},format=raw,discard=unmap" + (",readonly=on" if disk.readonly else "")
        device = f"virtio-blk-pci,drive=disk{n},bus={port}" + (f",serial={disk.serial}" if disk.serial else "") + \
            (f",bootindex={disk.boot_order}" if disk.boot_order else "")
        args += ["-device", f"pcie-root-port,id={port},chassis={n + 3},bus=pcie.0", "-drive", drive, "-device", device]
    for n, share in enumerate(m.shares, start=len(m.disks) + 3):
        args += ["-device", f"pcie-root-port,id=rp{n},chassis={n},bus=pcie.0",
                 "-chardev", f"socket,id=fs{n},path={share.socket}",
                 "-device", f"vhost-user-fs-pci,chardev=fs{n},tag={share.tag},bus=rp{n}"]
    return args


def sparse_copy(src: str, dst: str) -> None:
    """A disk image's copy (a CSI clone, a snapshot) that stays sparse: Python's file copy writes the
    holes out (a 60 GiB disk would take 60 GiB), cp does not, and shares blocks where it can."""
    cp = shutil.which("cp") or "cp"
    subprocess.run([cp, "--sparse=always", "--reflink=auto", src, dst], check=True, capture_output=True)


def accelerator(kernel: str, exe: str = "qemu-system-x86_64", timeout: float = 30.0) -> str:
    """"kvm" when a KVM guest really boots here, else "tcg" (software emulation). /dev/kvm opening
    is not enough: nested, a guest can hang, or QEMU abort setting up the vCPU. The probe boots the
    image's kernel with no disk and panic=-1 -no-reboot, so a working KVM guest panics for want of a
    root filesystem and QEMU exits within seconds."""
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return "tcg"
    with tempfile.TemporaryDirectory() as directory:
        console = os.path.join(directory, "console.log")
        try:
            done = subprocess.run([exe, "-machine", "q35,accel=kvm", "-cpu", "host", "-m", "256", "-nodefaults",
                                   "-display", "none", "-no-user-config", "-kernel", kernel,
                                   "-append", "console=ttyS0 panic=-1", "-no-reboot", "-serial", f"file:{console}"],
                                  capture_output=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            return "tcg"
        try:
            with open(console, errors="replace") as f:
                booted = "Kernel panic" in f.read()
        except OSError:
            booted = False
    return "kvm" if done.returncode == 0 and booted else "tcg"


class AgentError(Exception):
    """The guest agent did not answer, or answered with an error (its class and description)."""


class Agent:
    """A client of the guest's qemu-guest-agent on the VM's virtio-serial socket, as libvirt is one
    (qga/qapi-schema.json). The socket has no sessions and keeps what an earlier client left half
    read, so every connection starts with guest-sync-delimited: the agent answers after a 0xFF
    byte, and everything before that byte is dropped. One command at a time."""

    def __init__(self, socket_path: str):
        self.socket_path = socket_path
        self._lock = asyncio.Lock()

    async def call(self, command: str, arguments: dict | None = None, timeout: float = 10.0,
                   reply: bool = True):
        """`command`'s return value; None without a `reply` (guest-shutdown answers nothing)."""
        async with self._lock:
            try:
                return await asyncio.wait_for(self._call(command, arguments, reply), timeout)
            except (OSError, EOFError, asyncio.TimeoutError, asyncio.LimitOverrunError, ValueError) as err:
                raise AgentError(f"the guest agent did not answer {command}: {err or type(err).__name__}") from err

    async def _call(self, command: str, arguments: dict | None, reply: bool):
        reader, writer = await asyncio.open_unix_connection(self.socket_path)
        try:
            token = random.randint(1, 2**31)
            writer.write(b"\xff" + json.dumps({"execute": "guest-sync-delimited", "arguments": {"id": token}}).encode()
                         + b"\n")
            await writer.drain()
            await reader.readuntil(b"\xff")
            synced = False
            while not synced:  # (lines before ours answer an earlier client)
                synced = json.loads(await reader.readline()).get("return") == token
            message: dict = {"execute": command}
            if arguments:
                message["arguments"] = arguments
            writer.write(json.dumps(message).encode() + b"\n")
            await writer.drain()
            if not reply:
                return None
            answer = json.loads(await reader.readline())
        finally:
            writer.close()
        if "error" in answer:
            raise AgentError(f"the guest agent refused {command}: {answer['error'].get('class')}: "
                             f"{answer['error'].get('desc')}")
        return answer.get("return")
