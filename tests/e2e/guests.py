"""What the QEMU tests share: the hub's settings for guests that reach it through QEMU's user
network, and reads of a guest and of its disks."""

from __future__ import annotations

import base64
import os
from pathlib import Path

from conftest import E2E_SPEED, Cluster, Hub

from simtools import start_sim

GRACE = 90  # the machine's terminationGracePeriodSeconds
BOOT_TIMEOUT = 600  # a cold boot under TCG on a busy 2-CPU machine takes 70-80 s; leave room
# How the guest reaches this machine: QEMU's user network maps the gateway to the host's 127.0.0.1
# (kubevirt_spawner.sim.qemu), as a real guest reaches the hub's Service.
QEMU_CONFIG = f"""
import os
c.KubeVirtSpawner.hub_connect_url = "http://10.0.2.1:" + os.environ["KUBEVIRT_DEMO_HUB_PORT"]
c.KubeVirtSpawner.workstations_url = "http://10.0.2.1:" + os.environ["KUBEVIRT_DEMO_SERVICE_PORT"] + "/services/workstations/"
c.KubeVirtSpawner.root_disk_size = "6Gi"
c.KubeVirtSpawner.workspace_disk_size = "2Gi"
c.KubeVirtSpawner.termination_grace_period = {GRACE}
c.KubeVirtSpawner.start_timeout = {BOOT_TIMEOUT}
c.KubeVirtSpawner.http_timeout = {BOOT_TIMEOUT - 60}
c.KubeVirtSpawner.profile_list = [
    {{"display_name": "Test machine: 2 CPUs, 2 GiB", "slug": "small", "default": True,
      "kubevirt_override": {{"cpu_guarantee": 2, "mem_guarantee": "2G"}}}},
    {{"display_name": "Test machine: 2 CPUs, 3 GiB", "slug": "roomy",
      "kubevirt_override": {{"cpu_guarantee": 2, "mem_guarantee": "3G"}}}},
    {{"display_name": "Test machine booting through EFI, with shared data, an extra disk and scratch",
      "slug": "efi",
      "kubevirt_override": {{"cpu_guarantee": 2, "mem_guarantee": "2G", "firmware": "efi",
                            "scratch_disk_size": "1Gi",
                            "extra_disks": [{{"name": "models", "size": "1Gi", "mount_path": "/data/models"}}],
                            "shared_data": [{{"claim": "datasets", "mount_path": "/data/datasets",
                                              "read_only": True}}]}}}},
]
"""


def qemu_simulator(image: Path, tmp_path_factory):
    """A simulator whose guests boot `image` under QEMU: a module fixture's body (`yield from`)."""
    s = start_sim(tmp_path_factory.mktemp("cluster"), speed=E2E_SPEED, guest_mode="qemu", golden_image=str(image))
    yield s
    s.stop()


def run_as(hub: Hub, user: str, command: str) -> str:
    """A shell command run by the user on their machine (sudo works: the owner administers it)."""
    return hub.execute(user, f"import subprocess\nprint(subprocess.run({command!r}, shell=True, check=True, "
                    "capture_output=True, text=True).stdout, end='')")


def holds(path: Path, secret: bytes) -> bool:
    """Whether the disk image holds `secret` anywhere in its data, free blocks included (its holes
    are only zeros: SEEK_DATA/SEEK_HOLE walk the written extents of a sparse 6 GiB image)."""
    with open(path, "rb") as f:
        fd, end, offset = f.fileno(), os.fstat(f.fileno()).st_size, 0
        while offset < end:
            try:
                start = os.lseek(fd, offset, os.SEEK_DATA)
            except OSError:  # (ENXIO: no data after offset)
                return False
            stop = os.lseek(fd, start, os.SEEK_HOLE)
            f.seek(start)
            tail = b""
            while f.tell() < stop:
                chunk = tail + f.read(min(8 << 20, stop - f.tell()))
                if secret in chunk:
                    return True
                tail = chunk[-len(secret):]
            offset = stop
    return False


def volume_images(cluster: Cluster, ns: str, shares: tuple[str, ...] = ()) -> dict[str, Path]:
    """The disk image of each of the namespace's claims, by claim name (but `shares`, claims of
    shared data: they hold files, served through virtiofs)."""
    state = Path(cluster.sim.sim.state_dir)
    return {pvc["metadata"]["name"]: state / "volumes" / pvc["spec"]["volumeName"] / "disk.img"
            for pvc in cluster.pvcs(ns) if (pvc.get("spec") or {}).get("volumeName")
            and pvc["metadata"]["name"] not in shares}


def hub_token(cluster: Cluster, ns: str, secret: str) -> bytes:
    """The hub's API token of the workstation's latest start (its env Secret)."""
    data = cluster.core.read_namespaced_secret(secret, ns).data
    return base64.b64decode(data["JUPYTERHUB_API_TOKEN"])
