"""deploy/host/check-node.sh on fake hosts: /proc, /sys and /dev trees laid out as Linux lays
them out (the PCI devices' `class`, `vendor`, `device`, `driver` and `iommu_group` links as
drivers/pci/pci-sysfs.c and drivers/iommu/iommu.c make them), for a node that is ready for GPU
passthrough, one without an IOMMU, one whose kernel has no IOMMU support at all, one without a PCI
bus, and one whose GPU is still bound to the NVIDIA driver."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "deploy" / "host" / "check-node.sh"
GPU, GPU_AUDIO = "0000:3b:00.0", "0000:3b:00.1"


def fake_host(root: pathlib.Path, *, iommu: bool = True, gpu_driver: str = "vfio-pci",
              audio_driver: str = "vfio-pci", modules: tuple[str, ...] = ("kvm", "kvm_intel", "vhost_net", "tun",
                                                                           "vfio", "vfio_pci", "vfio_iommu_type1"),
              flags: str = "fpu vme de pse tsc msr pae vmx ept", devices=("kvm", "vhost-net", "net/tun"),
              containerd: str | None = "version = 2\n[plugins]\n  [plugins.\"io.containerd.grpc.v1.cri\"]\n"
                                       "    device_ownership_from_security_context = true\n") -> pathlib.Path:
    """A host with two CPUs and one A100 (with its audio function) in IOMMU group 42, and containerd
    set up as CDI's doc/block_cri_ownership_config.md asks."""
    (root / "proc").mkdir(parents=True)
    (root / "proc" / "cpuinfo").write_text("".join(
        f"processor\t: {n}\nvendor_id\t: GenuineIntel\nflags\t\t: {flags}\n\n" for n in range(2)))
    cmdline = "BOOT_IMAGE=/vmlinuz root=/dev/sda1 ro" + (" intel_iommu=on iommu=pt" if iommu else "")
    (root / "proc" / "cmdline").write_text(cmdline + "\n")
    if containerd is not None:
        (root / "etc" / "containerd").mkdir(parents=True)
        (root / "etc" / "containerd" / "config.toml").write_text(containerd)
    for module in modules:
        (root / "sys" / "module" / module).mkdir(parents=True)
    if "kvm_intel" in modules:
        (root / "sys" / "module" / "kvm_intel" / "parameters").mkdir()
        (root / "sys" / "module" / "kvm_intel" / "parameters" / "nested").write_text("Y\n")
    for dev in devices:
        (root / "dev" / dev).parent.mkdir(parents=True, exist_ok=True)
        (root / "dev" / dev).write_text("")
    pci = root / "sys" / "bus" / "pci"
    (root / "sys" / "kernel" / "iommu_groups").mkdir(parents=True)
    for driver in ("vfio-pci", "nvidia", "snd_hda_intel"):
        (pci / "drivers" / driver).mkdir(parents=True, exist_ok=True)
    # The devices' real directories are under /sys/devices; /sys/bus/pci/devices links to them.
    for address, klass, device, driver in ((GPU, "0x030200", "0x20b0", gpu_driver),
                                           (GPU_AUDIO, "0x040300", "0x1aef", audio_driver),
                                           ("0000:00:02.0", "0x060400", "0x2030", "pcieport")):
        real = root / "sys" / "devices" / "pci0000:00" / address
        real.mkdir(parents=True)
        (real / "class").write_text(klass + "\n")
        (real / "vendor").write_text(("0x8086" if klass.startswith("0x0604") else "0x10de") + "\n")
        (real / "device").write_text(device + "\n")
        (pci / "drivers" / driver).mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(pci / "drivers" / driver, real), real / "driver")
        (pci / "devices").mkdir(exist_ok=True)
        os.symlink(os.path.relpath(real, pci / "devices"), pci / "devices" / address)
        if iommu:
            group = root / "sys" / "kernel" / "iommu_groups" / "42"
            (group / "devices").mkdir(parents=True, exist_ok=True)
            os.symlink(os.path.relpath(group, real), real / "iommu_group")
            os.symlink(os.path.relpath(real, group / "devices"), group / "devices" / address)
    return root


def check(root: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), "--root", str(root), *args], capture_output=True, text=True,
                          check=False, timeout=60)


def rows(out: str) -> dict[str, list[str]]:
    """CHECK -> the results of its rows."""
    table: dict[str, list[str]] = {}
    for line in out.splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 2 and parts[0] in ("PASS", "WARN", "FAIL", "SKIP"):
            table.setdefault(parts[1], []).append(parts[0])
    return table


def test_a_ready_passthrough_host_passes_every_check(tmp_path):
    done = check(fake_host(tmp_path / "ready"), "--pool", "vm-gpu-pci")
    assert done.returncode == 0, done.stdout + done.stderr
    table = rows(done.stdout)
    assert table == {
        "cpu-virtualisation": ["PASS"], "kvm-modules": ["PASS"], "dev-kvm": ["PASS"], "dev-vhost-net": ["PASS"],
        "dev-net-tun": ["PASS"], "nested-virtualisation": ["PASS"], "virt-host-validate": ["SKIP"],
        "iommu": ["PASS"], "iommu-passthrough": ["PASS"], "vfio-modules": ["PASS"], "gpu-binding": ["PASS"],
        "iommu-group": ["PASS"], "driver-conflicts": ["PASS"], "block-device-owner": ["PASS"]}, done.stdout
    assert "0000:3b:00.0 (10de:20b0) is bound to vfio-pci" in done.stdout
    assert "node ready for pool vm-gpu-pci" in done.stdout


def test_a_host_without_iommu_fails_with_the_fix(tmp_path):
    done = check(fake_host(tmp_path / "no-iommu", iommu=False), "--pool", "vm-gpu-pci")
    assert done.returncode == 1
    table = rows(done.stdout)
    assert table["iommu"] == ["FAIL"] and table["iommu-passthrough"] == ["WARN"]
    assert "iommu-group" not in table  # nothing to say of groups that do not exist beyond the FAIL above
    assert table["cpu-virtualisation"] == ["PASS"] and table["gpu-binding"] == ["PASS"]
    assert "fix: enable VT-d / AMD-Vi in the BIOS and boot with intel_iommu=on iommu=pt" in done.stdout
    assert "node NOT ready for pool vm-gpu-pci" in done.stdout


def test_a_kernel_without_iommu_support_gets_the_table_not_an_early_exit(tmp_path):
    """iommu_init (drivers/iommu/iommu.c) makes /sys/kernel/iommu_groups at boot, empty when the IOMMU
    is off; a kernel built without CONFIG_IOMMU_API has no such directory. A `find | wc -l` of it
    ended the script there under set -e and pipefail, with no table and no fix."""
    root = fake_host(tmp_path / "no-iommu-support", iommu=False)
    (root / "sys" / "kernel" / "iommu_groups").rmdir()
    done = check(root, "--pool", "vm-gpu-pci")
    # the whole table and the verdict, not an exit status 1 from set -e halfway through
    assert done.returncode == 1 and "node NOT ready for pool vm-gpu-pci" in done.stdout, done.stdout + done.stderr
    table = rows(done.stdout)
    assert table["iommu"] == ["FAIL"] and table["iommu-passthrough"] == ["WARN"]
    assert table["vfio-modules"] == ["PASS"] and table["gpu-binding"] == ["PASS"], done.stdout
    assert table["driver-conflicts"] == ["PASS"] and "iommu-group" not in table
    assert "no /sys/kernel/iommu_groups: the kernel has no IOMMU support" in done.stdout
    assert "fix: boot a kernel built with CONFIG_INTEL_IOMMU / CONFIG_AMD_IOMMU" in done.stdout
    assert "then enable VT-d / AMD-Vi in the BIOS" in done.stdout
    # a CPU workstation node needs no IOMMU: the same host is ready for it
    cpu = check(root, "--pool", "vm-cpu")
    assert cpu.returncode == 0 and "node ready for pool vm-cpu" in cpu.stdout, cpu.stdout + cpu.stderr


def test_a_host_without_a_pci_bus_has_no_gpu(tmp_path):
    """No /sys/bus/pci at all, as on a machine without PCI (a virtio-mmio microVM such as
    Firecracker's, some Arm boards): the GPU pools say there is no GPU, the CPU pool does not care."""
    root = fake_host(tmp_path / "no-pci")
    shutil.rmtree(root / "sys" / "bus")
    passthrough = check(root, "--pool", "vm-gpu-pci")
    assert passthrough.returncode == 1, passthrough.stdout + passthrough.stderr
    assert rows(passthrough.stdout)["gpus"] == ["FAIL"]
    assert "fix: label this node for the vm-cpu pool, or pass --gpu-vendors" in passthrough.stdout
    containers = check(root, "--pool", "container-gpu")
    assert containers.returncode == 0 and rows(containers.stdout)["gpus"] == ["WARN"], containers.stdout
    cpu = check(root, "--pool", "vm-cpu")
    assert cpu.returncode == 0 and "gpus" not in rows(cpu.stdout), cpu.stdout + cpu.stderr


def test_a_gpu_bound_to_the_host_driver_fails_and_so_does_its_group(tmp_path):
    root = fake_host(tmp_path / "wrong-driver", gpu_driver="nvidia", audio_driver="snd_hda_intel",
                     modules=("kvm", "kvm_intel", "vhost_net", "tun", "vfio", "vfio_pci", "vfio_iommu_type1",
                              "nvidia"))
    done = check(root, "--pool", "vm-gpu-pci")
    assert done.returncode == 1
    table = rows(done.stdout)
    assert table["gpu-binding"] == ["FAIL"] and table["iommu-group"] == ["FAIL"]
    assert table["driver-conflicts"] == ["WARN"] and table["iommu"] == ["PASS"]
    assert "0000:3b:00.0 (10de:20b0) is bound to nvidia, not vfio-pci" in done.stdout
    assert "options vfio-pci ids=10de:20b0 and softdep nvidia pre: vfio-pci" in done.stdout
    assert "IOMMU group 42 of 0000:3b:00.0 also holds 0000:3b:00.1 (snd_hda_intel)" in done.stdout
    # the same host is a good container GPU node, and a GPU bound to vfio-pci is not
    assert check(root, "--pool", "container-gpu").returncode == 0
    vfio = check(fake_host(tmp_path / "vfio"), "--pool", "container-gpu")
    assert vfio.returncode == 1 and rows(vfio.stdout)["gpu-binding"] == ["FAIL"]


@pytest.mark.parametrize(("change", "failing"), [
    ({"flags": "fpu vme de pse tsc msr pae"}, "cpu-virtualisation"),
    ({"flags": "fpu vme de pse tsc msr pae hypervisor"}, "cpu-virtualisation"),
    ({"modules": ("kvm", "vhost_net", "tun")}, "kvm-modules"),
    ({"devices": ("kvm", "net/tun")}, "dev-vhost-net"),
    ({"devices": ("vhost-net", "net/tun")}, "dev-kvm"),
    ({"containerd": "version = 2\n[plugins]\n  [plugins.\"io.containerd.grpc.v1.cri\"]\n"
                    "    # device_ownership_from_security_context = true\n"}, "block-device-owner"),
])
def test_a_cpu_node_fails_each_missing_piece_alone(tmp_path, change, failing):
    done = check(fake_host(tmp_path / "host", **change))
    assert done.returncode == 1
    assert [check for check, results in rows(done.stdout).items() if "FAIL" in results] == [failing], done.stdout
    assert check(fake_host(tmp_path / "fine")).returncode == 0


def test_bad_usage_changes_nothing_and_says_why(tmp_path):
    bad_pool = check(fake_host(tmp_path / "h"), "--pool", "gpu")
    assert bad_pool.returncode == 2 and "unknown pool gpu" in bad_pool.stderr and not bad_pool.stdout
    not_a_host = check(tmp_path / "nothing")
    assert not_a_host.returncode == 2 and "is --root the host's root?" in not_a_host.stderr
    assert "--pool POOL" in subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True,
                                           check=True).stdout


def test_the_runtimes_block_device_ownership_is_read_where_it_is_set(tmp_path):
    """CRI-O in a drop-in (crio.conf.d), containerd 2's section: both pass; no runtime config on
    the node (another runtime, or not mounted) is a warning to check by hand."""
    crio = fake_host(tmp_path / "crio", containerd=None)
    (crio / "etc" / "crio" / "crio.conf.d").mkdir(parents=True)
    (crio / "etc" / "crio" / "crio.conf.d" / "10-kubevirt.conf").write_text(
        "[crio.runtime]\ndevice_ownership_from_security_context = true\n")
    assert rows(check(crio).stdout)["block-device-owner"] == ["PASS"]
    two = fake_host(tmp_path / "containerd2", containerd='version = 3\n[plugins."io.containerd.cri.v1.runtime"]\n'
                                                         "  device_ownership_from_security_context = true\n")
    assert rows(check(two).stdout)["block-device-owner"] == ["PASS"]
    unknown = check(fake_host(tmp_path / "unknown", containerd=None))
    assert unknown.returncode == 0 and rows(unknown.stdout)["block-device-owner"] == ["WARN"], unknown.stdout


def test_a_node_cdis_importer_may_use_needs_the_runtimes_block_ownership_and_nothing_of_kvm(tmp_path):
    """Issue 47, item 5. CDI's importer runs as a non-root user (CDI v1.66
    pkg/controller/common/util.go SetRestrictedSecurityContext: the qemu uid 107) and opens the Block volume only when the runtime hands
    devices to the pod's user; it runs where the CDI CR's workload placement puts it, off the
    tainted VM pools, on nodes without KVM or GPUs."""
    plain = fake_host(tmp_path / "worker", modules=(), flags="fpu vme de pse", devices=())
    ready = check(plain, "--pool", "cdi")
    assert ready.returncode == 0 and "node ready for pool cdi" in ready.stdout, ready.stdout + ready.stderr
    assert rows(ready.stdout) == {"block-device-owner": ["PASS"]}
    root_only = check(fake_host(tmp_path / "root-only", modules=(), flags="fpu", devices=(),
                                containerd="version = 2\n"), "--pool", "cdi")
    assert root_only.returncode == 1 and rows(root_only.stdout) == {"block-device-owner": ["FAIL"]}
    assert "set device_ownership_from_security_context = true" in root_only.stdout


def test_the_cdi_check_lands_where_cdis_workload_pods_do(tmp_path):
    """The check-node-cdi DaemonSet has the CDI CR's workload placement (deploy/cluster/cdi-cr.yaml
    spec.workload; CDI v1.66 api NodePlacement: nodeSelector, affinity, tolerations), so it runs on
    every node an importer may (a DaemonSet tolerates no custom taint either)."""
    import yaml
    rendered = tmp_path / "rendered"
    subprocess.run(["bash", str(SCRIPT.parents[1] / "render.sh"), "--out", str(rendered)], check=True,
                   capture_output=True)
    cdi = yaml.safe_load((rendered / "cluster" / "cdi-cr.yaml").read_text())
    sets = {d["metadata"]["name"]: d for d in yaml.safe_load_all((rendered / "host" / "check-node-daemonset.yaml")
                                                                  .read_text()) if d["kind"] == "DaemonSet"}
    pod = sets["check-node-cdi"]["spec"]["template"]["spec"]
    workload = cdi["spec"]["workload"]
    assert pod.get("nodeSelector") == workload.get("nodeSelector")
    assert pod.get("tolerations") == workload.get("tolerations") and pod.get("affinity") == workload.get("affinity")
    assert "--pool cdi" in pod["containers"][0]["command"][-1]
