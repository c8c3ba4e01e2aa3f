"""The second image lane: Debian 13 (trixie) with Debian's NVIDIA driver (build.sh --suite trixie
--gpu nvidia), booted through the firmware behind the real hub and proxy, on a VM without a GPU.

It is the slow lane of the QEMU tests: the build downloads the driver and compiles its DKMS
module for the image's kernel (several minutes on 2 CPUs, once per recipe), and the machine boots
once. What it shows: everything that depends on the target came from trixie (Python 3.13, its
kernel, its GRUB), the module was built for that kernel (the guest's own `uname -r`), nvidia-smi
is on the PATH and exits as the activity code expects without a GPU (kubevirt_spawner/guest/
activity.py: 6/9 mean no GPU source), and the hub's token stays off the disks.
Upstream: kubevirt pkg/virt-launcher/virtwrap/converter/compute/os.go (no firmware: SeaBIOS),
NVIDIA's nvidia-smi(1) return values.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import Cluster, Hub, build_golden_image, hub_with_service
from guests import BOOT_TIMEOUT, GRACE, QEMU_CONFIG, holds, hub_token, qemu_simulator, run_as, volume_images

pytestmark = pytest.mark.guests  # one after another on one xdist worker (tests/conftest.py)

USER = "tess"


@pytest.fixture(scope="module")
def trixie_gpu_image() -> Path:
    return build_golden_image("--suite", "trixie", "--gpu", "nvidia")


@pytest.fixture(scope="module")
def trixie_sim(trixie_gpu_image, tmp_path_factory):
    yield from qemu_simulator(trixie_gpu_image, tmp_path_factory)


@pytest.fixture(scope="module")
def hub(trixie_sim, tmp_path_factory):
    yield from hub_with_service(trixie_sim, tmp_path_factory, QEMU_CONFIG)


def test_the_image_is_trixies_with_a_module_for_its_own_kernel(trixie_gpu_image: Path):
    meta = json.loads((trixie_gpu_image / "image.json").read_text())
    assert meta["suite"] == "trixie" and meta["python_version"] == "3.13" and meta["gpu"] == "nvidia"
    assert meta["firmware"] == ["bios", "efi"]
    assert {"nvidia-current", "nvidia-current-uvm"} <= set(meta["gpu_modules"])
    assert meta["kernel_version"].endswith("-amd64")


def test_a_gpu_image_without_a_gpu_reaches_jupyter(hub: Hub, trixie_sim, trixie_gpu_image: Path):
    cluster = Cluster(trixie_sim)
    ns = f"notebook-{USER}"
    hub.ensure_user(USER)
    hub.start_server(USER, timeout=BOOT_TIMEOUT)
    lab = hub.http.get(f"{hub.url}/user/{USER}/lab", timeout=60)
    assert lab.status_code == 200 and "JupyterLab" in lab.text, lab.status_code
    assert "FAIL" not in run_as(hub, USER, "sudo /usr/local/sbin/verify-clone.sh")
    assert run_as(hub, USER, ". /etc/os-release && echo $VERSION_CODENAME") == "trixie\n"
    meta = json.loads((trixie_gpu_image / "image.json").read_text())
    assert run_as(hub, USER, "uname -r").strip() == meta["kernel_version"]
    # the module DKMS built at image build time is for the kernel this machine runs
    vermagic = run_as(hub, USER, "/sbin/modinfo -F vermagic nvidia-current")
    assert vermagic.split()[0] == meta["kernel_version"], vermagic
    # nvidia-smi is there, and with no GPU says so the way the activity code reads as "no GPU"
    code = run_as(hub, USER, "command -v nvidia-smi >/dev/null && { nvidia-smi >/dev/null 2>&1; echo $?; }").strip()
    assert code in ("6", "9"), code
    gpus = run_as(hub, USER, "/opt/jupyter/bin/python -c 'from kubevirt_spawner.guest.activity import read_gpus; "
                   "print(read_gpus(None, 30))'")
    assert gpus == "None\n", gpus
    hub.stop_server(USER, timeout=GRACE + 60)
    token = hub_token(cluster, ns, f"{USER}-hub-env")
    for claim, image in volume_images(cluster, ns).items():
        assert not holds(image, token), f"the hub's token is on {claim}"
