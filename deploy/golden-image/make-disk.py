#!/usr/bin/env python3
"""Assemble the golden image's disk.raw from its root directory, in a file: no loop device, no mount.

The layout (GPT) is what a VM's firmware boots, SeaBIOS or OVMF, as KubeVirt boots a PVC root disk:
  1  BIOS boot partition, 1 MiB: GRUB's core image (SeaBIOS runs the MBR's boot code, which loads it)
  2  EFI system partition, FAT32: \\EFI\\BOOT\\BOOTX64.EFI, the removable-media path OVMF tries on a
     disk when its NVRAM has no boot entry (a new VM's has none)
  3  the root filesystem, ext4, to the end of the disk (last, so growpart grows it with its PVC)

Each filesystem is made straight into its partition's place in the file: mkfs.ext4 -d copies the
root directory in (with the target's /etc/mke2fs.conf, so the features are the ones its kernel
and GRUB read), mkfs.fat --offset and mtools' IMAGE@@OFFSET make and fill the EFI partition.
GRUB's BIOS blocks are placed as grub-bios-setup places them (GRUB's include/grub/i386/pc/boot.h):
boot.img's code in the MBR with the LBA of the core image, the core image's first blocklist
pointing at the rest of it. grub-bios-setup itself insists on probing the device under its own
module directory, which fails where the build machine has no device node for it (a container).
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys

SECTOR = 512
BIOS_BOOT_TYPE = "21686148-6449-6E6F-744E-656564454649"
ESP_TYPE = "C12A7328-F81F-11D2-BA4B-00A0C93EC93B"
LINUX_TYPE = "0FC63DAF-8483-4772-8E79-3D69D8477DE4"
BIOS_BOOT_START, BIOS_BOOT_SECTORS = 2048, 2048  # 1 MiB at 1 MiB
ESP_START, ESP_SECTORS = 4096, 258048  # 126 MiB: the root starts at 128 MiB
ROOT_START = ESP_START + ESP_SECTORS

# GRUB's i386-pc boot sector (include/grub/i386/pc/boot.h) and its core image's first sector
# (diskboot.img: a blocklist of the rest at its end, loaded at segment 0x820)
BOOT_CODE_END = 0x1B8  # the boot code; from here on the MBR's disk signature and partition table
BPB_START, BPB_END = 0x3, 0x5A
KERNEL_SECTOR = 0x5C  # 8 bytes: the LBA of the core image's first sector
BOOT_DRIVE = 0x64  # 0xff: the drive the BIOS booted from
DRIVE_CHECK = 0x66  # a jump that only a floppy needs: two NOPs on a hard disk, as grub-bios-setup writes
BLOCKLIST = SECTOR - 12  # struct grub_boot_blocklist { u64 start; u16 len; u16 segment; }
CORE_SEGMENT = 0x820


def parse_size(text: str) -> int:
    units = {"M": 2**20, "G": 2**30}
    if not text or text[-1] not in units or not text[:-1].isdigit():
        raise ValueError(f"a size is a number with M or G (for example 8G), not {text!r}")
    return int(text[:-1]) * units[text[-1]]


def partition(disk: str, size: int) -> None:
    if size < (ROOT_START + 2048) * SECTOR:
        raise ValueError(f"a disk of {size} bytes has no room for a root filesystem after its boot partitions")
    with open(disk, "wb") as f:
        f.truncate(size)
    table = (f"label: gpt\n"
             f"start={BIOS_BOOT_START}, size={BIOS_BOOT_SECTORS}, type={BIOS_BOOT_TYPE}, name=bios-boot\n"
             f"start={ESP_START}, size={ESP_SECTORS}, type={ESP_TYPE}, name=esp\n"
             f"start={ROOT_START}, type={LINUX_TYPE}, name=root\n")
    subprocess.run(["sfdisk", "--quiet", disk], input=table, text=True, check=True)


def root_sectors(disk: str) -> int:
    """The root partition's length: sfdisk ends it before the backup GPT."""
    out = subprocess.run(["sfdisk", "--json", disk], capture_output=True, text=True, check=True).stdout
    return next(int(p["size"]) for p in json.loads(out)["partitiontable"]["partitions"] if p["start"] == ROOT_START)


def make_root(disk: str, root: str, uuid: str, mke2fs_conf: str) -> None:
    env = dict(os.environ, MKE2FS_CONFIG=mke2fs_conf) if os.path.isfile(mke2fs_conf) else dict(os.environ)
    sectors = root_sectors(disk)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-U", uuid, "-d", root, "-E", f"offset={ROOT_START * SECTOR}",
                    disk, f"{sectors // 2}k"], env=env, check=True)


def make_esp(disk: str, volume_id: str, efi_image: str | None) -> None:
    """A FAT32 filesystem in partition 2; with an EFI image, GRUB at the removable-media path."""
    subprocess.run(["mkfs.fat", "-F", "32", "-s", "1", "-n", "EFI", "-i", volume_id, "--offset", str(ESP_START), disk,
                    str(ESP_SECTORS // 2)], check=True, capture_output=True)
    if efi_image:
        place = f"{disk}@@{ESP_START * SECTOR}"
        env = dict(os.environ, MTOOLS_SKIP_CHECK="1")
        subprocess.run(["mmd", "-i", place, "::/EFI", "::/EFI/BOOT"], env=env, check=True)
        subprocess.run(["mcopy", "-i", place, efi_image, "::/EFI/BOOT/BOOTX64.EFI"], env=env, check=True)


def install_bios_boot(disk: str, boot_img: bytes, core_img: bytes) -> None:
    """GRUB for SeaBIOS: the core image in the BIOS boot partition, boot.img's code in the MBR."""
    if len(boot_img) != SECTOR:
        raise ValueError(f"boot.img has {len(boot_img)} bytes, not one sector")
    sectors = -(-len(core_img) // SECTOR)
    if sectors > BIOS_BOOT_SECTORS:
        raise ValueError(f"GRUB's core image ({len(core_img)} bytes) does not fit the 1 MiB BIOS boot partition")
    core = bytearray(core_img.ljust(sectors * SECTOR, b"\0"))
    # the rest of the core image follows its first sector, contiguously
    made_len = struct.unpack_from("<H", core, BLOCKLIST + 8)[0]
    if made_len != sectors - 1:
        raise ValueError(f"GRUB's core image says it has {made_len + 1} sectors, it has {sectors}")
    struct.pack_into("<QHH", core, BLOCKLIST, BIOS_BOOT_START + 1, sectors - 1, CORE_SEGMENT)
    with open(disk, "r+b") as f:
        mbr = bytearray(f.read(SECTOR))
        code = bytearray(boot_img)
        code[BPB_START:BPB_END] = mbr[BPB_START:BPB_END]
        struct.pack_into("<Q", code, KERNEL_SECTOR, BIOS_BOOT_START)
        code[BOOT_DRIVE] = 0xFF
        code[DRIVE_CHECK:DRIVE_CHECK + 2] = b"\x90\x90"
        mbr[:BOOT_CODE_END] = code[:BOOT_CODE_END]  # (the protective MBR's partition entry stays)
        f.seek(0)
        f.write(mbr)
        f.seek(BIOS_BOOT_START * SECTOR)
        f.write(core)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--size", required=True)
    p.add_argument("--root-uuid", required=True)
    p.add_argument("--esp-id", required=True, help="the FAT volume id, 8 hex digits")
    p.add_argument("--firmware", required=True, help="bios, efi or bios,efi")
    p.add_argument("--grub", required=True, help="the directory with boot.img, core.img and BOOTX64.EFI")
    p.add_argument("--mke2fs-conf", default="")
    a = p.parse_args(argv)
    firmware = set(a.firmware.split(","))
    if not firmware or firmware - {"bios", "efi"}:
        p.error(f"--firmware is bios, efi or bios,efi, not {a.firmware}")
    try:
        partition(a.out, parse_size(a.size))
        make_root(a.out, a.root, a.root_uuid, a.mke2fs_conf)
        make_esp(a.out, a.esp_id, os.path.join(a.grub, "BOOTX64.EFI") if "efi" in firmware else None)
        if "bios" in firmware:
            with open(os.path.join(a.grub, "boot.img"), "rb") as b, open(os.path.join(a.grub, "core.img"), "rb") as c:
                install_bios_boot(a.out, b.read(), c.read())
    except (ValueError, OSError, subprocess.CalledProcessError) as err:
        print(f"make-disk.py: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
