"""The golden image boots the way KubeVirt boots a PVC root disk: through the VM's firmware, with
nothing given to QEMU but the disk (no -kernel). The machine is the simulator's (the command line
of kubevirt_spawner/sim/qemu.py: q35, KubeVirt's firmware choice from converter/compute/os.go
and virtwrap/efi/efi.go, bootindex from the disks' bootOrder), so what boots here boots there.

- The image built by build.sh reaches its own kernel through SeaBIOS and through OVMF.
- A firmware the image's bootloader is not built for does not boot it: what build.sh
  --firmware bios leaves for OVMF (an EFI system partition without \\EFI\\BOOT\\BOOTX64.EFI) and
  what --firmware efi leaves for SeaBIOS (the protective MBR without GRUB's boot code).
- The old single-partition disk (GPT, one ext4 partition, no bootloader: the image before this
  layout) boots through neither: SeaBIOS runs an empty MBR, OVMF finds no boot option.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from kubevirt_spawner.sim import qemu

pytestmark = pytest.mark.guests  # one after another on one xdist worker (tests/conftest.py)

KERNEL_BANNER = "Linux version"
BOOT_TIMEOUT = 240  # firmware, GRUB and the kernel's first line under TCG on a busy 2-CPU machine


def boot(tmp_path: Path, disk: Path, efi: bool, until: tuple[str, ...], timeout: float, linger: float = 0) -> str:
    """Boot `disk` as a VMI with (efi) or without a firmware setting; the serial console (and, for
    SeaBIOS, its debug port 0x402) until one of `until` shows and `linger` seconds more, or
    `timeout`."""
    console, debug = tmp_path / "console.log", tmp_path / "seabios.log"
    firmware = qemu.ovmf_firmware(False, str(tmp_path / "vm_VARS.fd")) if efi else qemu.Firmware()
    machine = qemu.Machine(name="vm", cpus=1, memory_mib=1024, disks=(qemu.Disk(str(disk), "rootdisk", boot_order=1),),
                           forwards=(), agent_socket=str(tmp_path / "qga.sock"),
                           monitor_socket=str(tmp_path / "qmp.sock"), console_log=str(console), firmware=firmware)
    args = qemu.command(machine) + ["-snapshot", "-chardev", f"file,id=seabios,path={debug}",
                                    "-device", "isa-debugcon,iobase=0x402,chardev=seabios"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen = ""
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None:
            seen = (console.read_text(errors="replace") if console.exists() else "") + \
                (debug.read_text(errors="replace") if debug.exists() else "")
            if any(mark in seen for mark in until):
                time.sleep(linger)
                break
            time.sleep(0.5)
        seen = (console.read_text(errors="replace") if console.exists() else "") + \
            (debug.read_text(errors="replace") if debug.exists() else "")
    finally:
        proc.kill()
        proc.wait()
    return seen


def copy(src: Path, dst: Path) -> Path:
    qemu.sparse_copy(str(src), str(dst))
    return dst


@pytest.mark.parametrize("efi", [False, True], ids=["seabios", "ovmf"])
def test_the_golden_image_boots_its_own_kernel_through_the_firmware(golden_image, tmp_path, efi):
    seen = boot(tmp_path, golden_image / "disk.raw", efi, (KERNEL_BANNER,), BOOT_TIMEOUT)
    assert KERNEL_BANNER in seen, seen[-2000:]
    assert "Loading Linux" in seen  # (grub.cfg's entry: GRUB read it from the disk)


def test_ovmf_does_not_boot_an_image_built_for_bios_only(golden_image, tmp_path):
    """build.sh --firmware bios writes the EFI system partition without GRUB's EFI image."""
    disk = copy(golden_image / "disk.raw", tmp_path / "bios-only.raw")
    esp = f"{disk}@@{4096 * 512}"
    subprocess.run(["mdel", "-i", esp, "::/EFI/BOOT/BOOTX64.EFI"], check=True, env={"MTOOLS_SKIP_CHECK": "1"})
    seen = boot(tmp_path, disk, True, ("Shell>", "No bootable", KERNEL_BANNER), BOOT_TIMEOUT)
    assert KERNEL_BANNER not in seen and "GRUB" not in seen
    assert "BdsDxe: failed to load" in seen or "No bootable" in seen, seen[-2000:]


def test_seabios_does_not_boot_an_image_built_for_efi_only(golden_image, tmp_path):
    """build.sh --firmware efi leaves sfdisk's protective MBR: no boot code, no core image."""
    disk = copy(golden_image / "disk.raw", tmp_path / "efi-only.raw")
    with open(disk, "r+b") as f:
        f.write(bytes(0x1B8))  # the MBR's code area, as sfdisk leaves it
    seen = boot(tmp_path, disk, False, ("Booting from 0000:7c00",), BOOT_TIMEOUT, linger=10)
    # SeaBIOS ran the (empty) MBR, and nothing came of it in 10 s
    assert "Booting from 0000:7c00" in seen, seen[-2000:]
    assert "GRUB" not in seen and KERNEL_BANNER not in seen


def test_the_old_single_partition_disk_boots_through_neither_firmware(tmp_path):
    """The image before this layout: GPT with one ext4 partition holding the system, kernel in
    /boot, no bootloader. KubeVirt would have stopped at the firmware with every workstation."""
    root = tmp_path / "root"
    (root / "boot").mkdir(parents=True)
    (root / "boot" / "vmlinuz").write_bytes(b"not a bootloader")
    disk = tmp_path / "old.raw"
    with open(disk, "wb") as f:
        f.truncate(64 * 2**20)
    subprocess.run(["sfdisk", "--quiet", str(disk)], check=True, text=True,
                   input="label: gpt\nstart=2048, type=0FC63DAF-8483-4772-8E79-3D69D8477DE4, name=root\n")
    subprocess.run(["mkfs.ext4", "-q", "-F", "-L", "kvs-root", "-d", str(root), "-E", f"offset={2048 * 512}", str(disk),
                    "60000k"], check=True)
    bios = tmp_path / "bios"
    bios.mkdir()
    seen = boot(bios, disk, False, ("Booting from 0000:7c00",), BOOT_TIMEOUT, linger=10)
    assert "Booting from Hard Disk" in seen and "GRUB" not in seen and KERNEL_BANNER not in seen, seen[-2000:]
    efi = tmp_path / "efi"
    efi.mkdir()
    seen = boot(efi, disk, True, ("Shell>", "No bootable", KERNEL_BANNER), BOOT_TIMEOUT)
    assert KERNEL_BANNER not in seen and ("BdsDxe: failed to load" in seen or "No bootable" in seen), seen[-2000:]
    shutil.rmtree(root)
