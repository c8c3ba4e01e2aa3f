"""The golden image's recipe without building it: what each suite is made of (build.sh --plan), the
options it refuses, and the disk layout make-disk.py writes, which a VM's firmware boots: GRUB's
BIOS blocks where grub-bios-setup puts them (GRUB include/grub/i386/pc/boot.h: the core image's
LBA at 0x5c of the MBR, the drive 0xff at 0x64, the blocklist of the rest of the core image at
the end of its first sector, loaded at segment 0x820) and the EFI system partition holding
\\EFI\\BOOT\\BOOTX64.EFI (UEFI 2.x, 3.5.1.1: the removable-media path OVMF falls back to)."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import struct
import subprocess

import pytest

RECIPE = pathlib.Path(__file__).resolve().parent.parent / "deploy" / "golden-image"
BUILD = RECIPE / "build.sh"


def plan(*args: str) -> dict:
    done = subprocess.run(["bash", str(BUILD), "--plan", *args], capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def refused(*args: str) -> str:
    done = subprocess.run(["bash", str(BUILD), "--plan", *args], capture_output=True, text=True, check=False)
    assert done.returncode == 2, done.stdout
    return done.stderr


@pytest.mark.parametrize("suite,python,kernel,distribution", [
    ("bookworm", "3.11", "linux-image-amd64", "debian"),  # Debian 12's python3
    ("trixie", "3.13", "linux-image-amd64", "debian"),  # Debian 13's python3
    ("noble", "3.12", "linux-image-virtual", "ubuntu"),  # Ubuntu 24.04's; Ubuntu has no linux-image-amd64
])
def test_each_suite_gets_its_own_python_kernel_and_archive(suite, python, kernel, distribution):
    p = plan("--suite", suite)
    assert p["python"] == python and p["distribution"] == distribution
    # the wheels are downloaded for the suite's own Python and ABI, never the build machine's
    pip = " ".join(p["pip_download"])
    assert f"--python-version {python}" in pip and f"--abi cp{python.replace('.', '')}" in pip
    assert kernel in p["packages"]
    assert {"grub-pc-bin", "grub-efi-amd64-bin", "qemu-guest-agent", "cloud-init", "openssh-server"} <= set(p["packages"])
    # the initramfs compressor initramfs.conf names (without it, initramfs-tools falls back to gzip)
    assert "zstd" in p["packages"] and "COMPRESS=zstd" in (RECIPE / "initramfs.conf").read_text().split()
    # the archive is the suite's: its own suite, -updates and -security lines
    assert all(f" {suite}" in line for line in p["sources"]) and len(p["sources"]) == 3
    assert p["fstab_root"] == "UUID" and p["firmware"] == ["bios", "efi"]


def test_noble_comes_from_ubuntus_archive_with_universe():
    sources = plan("--suite", "noble")["sources"]
    assert sources[0] == ("deb [signed-by=/usr/share/keyrings/ubuntu-archive-keyring.gpg] "
                          "http://archive.ubuntu.com/ubuntu noble main universe")
    assert "security.ubuntu.com/ubuntu noble-security" in sources[2]
    assert "linux-image-amd64" not in plan("--suite", "noble")["packages"]


def test_a_gpu_image_adds_debians_nvidia_driver_from_non_free():
    p = plan("--suite", "trixie", "--gpu", "nvidia")
    assert {"nvidia-kernel-dkms", "nvidia-smi", "libcuda1", "linux-headers-amd64"} <= set(p["packages"])
    assert "nvidia-cuda-toolkit" not in p["packages"]
    assert p["sources"][0].endswith("trixie main contrib non-free non-free-firmware")
    assert "nvidia-cuda-toolkit" in plan("--gpu", "nvidia", "--cuda-toolkit")["packages"]


def test_vs_code_is_in_every_image_unless_left_out():
    """code-server (code-server.sh) with the Node.js major its package asks for (code-server 4.100's
    package.json: engines.node 20), and the suite's ripgrep, which VS Code's search runs."""
    for suite in ("bookworm", "trixie", "noble"):
        p = plan("--suite", suite)
        assert p["code_server"]["version"] == "4.100.3" and p["code_server"]["node"].startswith("20.")
        assert "ripgrep" in p["packages"]
    assert plan("--no-code-server")["code_server"] is None


@pytest.mark.parametrize("args,message", [
    (("--suite", "jammy"), "unknown suite jammy"),
    (("--firmware", "uefi"), "--firmware is bios, efi or bios,efi"),
    (("--gpu", "amd"), "--gpu is nvidia"),
    (("--suite", "noble", "--gpu", "nvidia"), "for Ubuntu, install the driver your GPUs need"),
    (("--cuda-toolkit",), "--cuda-toolkit needs --gpu nvidia"),
    (("--size", "lots"), "--size is a number with G or M"),
])
def test_bad_options_are_refused_before_anything_is_built(args, message):
    assert message in refused(*args)


@pytest.fixture(scope="module")
def make_disk():
    spec = importlib.util.spec_from_file_location("make_disk", RECIPE / "make-disk.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_core(sectors: int) -> bytes:
    """A core image as grub-mkimage makes one: diskboot's blocklist says how many sectors follow."""
    core = bytearray(b"\x11" * (sectors * 512 - 100))
    struct.pack_into("<QHH", core, 500, 2, sectors - 1, 0x820)
    return bytes(core)


def test_grubs_bios_blocks_go_where_grub_bios_setup_puts_them(make_disk, tmp_path):
    disk = tmp_path / "disk.raw"
    make_disk.partition(str(disk), 256 * 2**20)
    protective = disk.read_bytes()[:512]
    boot = bytes(range(256)) * 2
    make_disk.install_bios_boot(str(disk), boot, fake_core(60))
    data = disk.read_bytes()
    mbr = data[:512]
    assert struct.unpack_from("<Q", mbr, 0x5C)[0] == 2048  # the core image's first sector
    assert mbr[0x64] == 0xFF and mbr[0x66:0x68] == b"\x90\x90"
    assert mbr[:0x3] == boot[:0x3] and mbr[0x68:0x1B8] == boot[0x68:0x1B8]
    # the protective MBR's partition entry and signature stay: the GPT is intact
    assert mbr[0x1B8:] == protective[0x1B8:] and mbr[510:] == b"\x55\xaa"
    core = data[2048 * 512:2048 * 512 + 60 * 512]
    assert struct.unpack_from("<QHH", core, 500) == (2049, 59, 0x820)
    table = json.loads(subprocess.run(["sfdisk", "--json", str(disk)], capture_output=True, text=True,
                                      check=True).stdout)["partitiontable"]["partitions"]
    assert [p["type"] for p in table] == [make_disk.BIOS_BOOT_TYPE, make_disk.ESP_TYPE, make_disk.LINUX_TYPE]
    assert table[-1]["start"] == make_disk.ROOT_START  # the root last: growpart grows it


def test_a_core_image_that_does_not_fit_or_disagrees_is_refused(make_disk, tmp_path):
    disk = tmp_path / "disk.raw"
    make_disk.partition(str(disk), 256 * 2**20)
    with pytest.raises(ValueError, match="does not fit the 1 MiB BIOS boot partition"):
        make_disk.install_bios_boot(str(disk), bytes(512), fake_core(2049))
    wrong = bytearray(fake_core(10))
    struct.pack_into("<H", wrong, 508, 3)
    with pytest.raises(ValueError, match="says it has 4 sectors, it has 10"):
        make_disk.install_bios_boot(str(disk), bytes(512), bytes(wrong))
    with pytest.raises(ValueError, match="no room for a root filesystem"):
        make_disk.partition(str(tmp_path / "small.raw"), 64 * 2**20)


def test_the_efi_partition_holds_grub_at_the_removable_media_path(make_disk, tmp_path):
    disk = tmp_path / "disk.raw"
    make_disk.partition(str(disk), 256 * 2**20)
    efi = tmp_path / "BOOTX64.EFI"
    efi.write_bytes(b"MZ" + bytes(4000))
    make_disk.make_esp(str(disk), "ABCD1234", str(efi))
    place = f"{disk}@@{make_disk.ESP_START * 512}"
    listing = subprocess.run(["mdir", "-b", "-i", place, "::/EFI/BOOT"], capture_output=True, text=True, check=True,
                             env={"MTOOLS_SKIP_CHECK": "1", "PATH": "/usr/bin:/bin"}).stdout
    assert "BOOTX64.EFI" in listing
    info = subprocess.run(["minfo", "-i", place], capture_output=True, text=True, check=True,
                          env={"MTOOLS_SKIP_CHECK": "1", "PATH": "/usr/bin:/bin"}).stdout
    assert "serial number: ABCD1234" in info or "ABCD-1234" in info, info


def ini(path: pathlib.Path) -> dict[str, list[tuple[str, str]]]:
    """A systemd unit or .network file's sections, each a list of (key, value) in order."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), [])
        else:
            key, _, value = line.partition("=")
            current.append((key, value))
    return sections


def test_the_network_is_every_ethernet_nic_whatever_its_name_and_mac():
    """KubeVirt writes the VM's network data verbatim (pkg/cloud-init/cloud-init.go) and a VMI's
    MAC changes from start to start unless the VM fixes it, so the image matches by type. For
    dual-stack masquerade, virt-launcher's DHCPv6 server (pkg/network/dhcp/serverv6) gives the
    address without a router advertisement: the client solicits anyway, and the route goes to the
    binding's gateway (pkg/virt-launcher/virtwrap/api/defaults.go: fd10:0:2::/120)."""
    network = ini(RECIPE / "network.network")
    assert network["Match"] == [("Type", "ether"), ("Kind", "!*")]
    assert ("DHCP", "yes") in network["Network"]
    assert network["DHCPv6"] == [("WithoutRA", "solicit")]
    assert dict(network["Route"]) == {"Gateway": "fd10:0:2::1", "GatewayOnLink": "yes"}
    cloud = (RECIPE / "cloud.cfg").read_text()
    assert "network:\n  config: disabled" in cloud
    # nothing that installs packages runs at boot
    assert "package-update-upgrade-install" not in cloud and "apt-configure" not in cloud


def test_the_workstation_unit_starts_beside_cloud_init_not_after_it():
    """Jupyter's start-up overlaps cloud-init's and the network's (sysinit.target waits for
    cloud-init.service, which waits for network-online.target): the unit leaves the default
    dependencies out and names the ones it needs, the env disk's device among them, and still
    stops before the machine does (systemd.special(7), systemd.unit(5) DefaultDependencies=). It
    starts after home.mount: the workspace disk's fstab line is nofail, and systemd orders a
    nofail mount before nothing, local-fs.target included (systemd.mount(5), nofail), so without
    it a home was made on the system disk and then hidden by the late mount (a CI run)."""
    unit = ini(RECIPE / "kubevirt-workstation.service")["Unit"]
    keys = {}
    for key, value in unit:
        keys.setdefault(key, []).extend(value.split())
    assert keys["DefaultDependencies"] == ["no"]
    assert {"local-fs.target", "systemd-journald.socket", "dev-disk-by\\x2did-virtio\\x2dhubenv.device",
            "home.mount"} <= set(keys["After"])
    assert "/home  ext4  defaults,nofail," in (RECIPE / "fstab").read_text()
    assert "network-online.target" not in keys["After"] and "cloud-init.service" not in keys["After"]
    assert keys["Conflicts"] == ["shutdown.target"] and keys["Before"] == ["shutdown.target"]


def test_the_guest_agent_starts_when_its_port_appears_not_after_cloud_init():
    """The spawner waits for KubeVirt's AgentConnected (the agent answering on its virtio-serial
    channel, pkg/virt-handler/rest/ and pkg/virt-launcher/virtwrap/agent-poller/ in kubevirt),
    and Debian's qemu-guest-agent.service has default dependencies: after sysinit.target, so
    after cloud-init's network stage. The image's drop-in leaves them out, keeps the ordering
    after the local filesystems and the clean stop, and is installed where systemd reads it."""
    unit = ini(RECIPE / "qemu-guest-agent-early.conf")["Unit"]
    keys = {}
    for key, value in unit:
        keys.setdefault(key, []).extend(value.split())
    assert keys["DefaultDependencies"] == ["no"]
    assert {"local-fs.target", "systemd-journald.socket"} == set(keys["After"])
    assert keys["Conflicts"] == ["shutdown.target"] and keys["Before"] == ["shutdown.target"]
    assert ('"$here/qemu-guest-agent-early.conf" '
            '"$root/etc/systemd/system/qemu-guest-agent.service.d/50-early.conf"') in (RECIPE / "customize.sh").read_text()


def test_grub_boots_at_once_and_falls_back_to_the_previous_kernel():
    """No menu wait (Debian's and Ubuntu's cloud images set GRUB_TIMEOUT=0; timeout_style=hidden
    cost 3 s here before GRUB went on); the entry says on the console what it loads; `fallback`
    names the previous-kernel entry, which exists only when the kernel package left a .old link
    (GRUB manual: timeout, timeout_style, fallback)."""
    cfg = (RECIPE / "grub.cfg").read_text()
    lines = [line.strip() for line in cfg.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert "set timeout=0" in lines and not any(x.startswith("set timeout_style") for x in lines)
    assert lines.index("echo 'Loading Linux ...'") < next(i for i, x in enumerate(lines) if x.startswith("linux "))
    guard = lines.index("if [ -f @LINK_DIR@/vmlinuz.old ]; then")
    assert lines[guard + 1] == "set fallback=1" and "initrd @LINK_DIR@/initrd.img.old" in lines[guard:]
