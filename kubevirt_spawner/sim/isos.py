"""The configuration disks virt-launcher builds for a VMI, as ISO 9660 images (for guests that boot
a real disk image with QEMU).

- A `secret` (or configMap) volume with a disk: every entry of the volume's mount grafted at the
  image's root, label `volumeLabel` or `cfgdata` (kubevirt pkg/config/config.go,
  defaultCreateIsoImage: `xorrisofs -follow-links -volid LABEL -joliet -rock -graft-points
  -partition_cyl_align on NAME=PATH...`). The mount is kubelet's, so its AtomicWriter entries
  `..data` and `..<timestamp>` are grafted too (kubernetes pkg/volume/util/atomic_writer.go).
- A `cloudInitNoCloud` volume: `meta-data` (JSON: instance-id, local-hostname), `user-data` and,
  when there is network data, `network-config`, label `cidata` (kubevirt pkg/cloud-init/cloud-init.go,
  defaultIsoFunc: `xorrisofs -output ISO -volid cidata -joliet -rock -partition_cyl_align on DIR`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
import uuid

SECRET_LABEL = "cfgdata"  # KubeVirt's default volumeLabel of a secret/configMap disk
NOCLOUD_LABEL = "cidata"
# KubeVirt's firmware UUID of a VM without one: UUIDv5 of the VM's name in this namespace
# (pkg/virt-controller/watch/vm/firmware.go, CalculateLegacyUUID); cloud-init's instance-id is it.
FIRMWARE_UUID_NAMESPACE = uuid.UUID("6a1a24a1-4061-4607-8bf4-a3963d0c5895")


def xorrisofs() -> str:
    exe = shutil.which("xorrisofs")
    if exe is None:
        raise RuntimeError("xorrisofs is missing: apt-get install xorriso (the qemu guests need it)")
    return exe


def firmware_uuid(vm_name: str) -> str:
    return str(uuid.uuid5(FIRMWARE_UUID_NAMESPACE, vm_name))


def config_disk(data: dict[str, bytes], iso: str, label: str = SECRET_LABEL) -> str:
    """The ISO of a secret volume whose Secret holds `data`, laid out as kubelet mounts it."""
    with tempfile.TemporaryDirectory() as mount:
        stamp = time.strftime("..%Y_%m_%d_%H_%M_%S.000000000", time.gmtime())
        os.mkdir(os.path.join(mount, stamp))
        for key, value in data.items():
            with open(os.path.join(mount, stamp, key), "wb") as f:
                f.write(value)
            os.symlink(os.path.join("..data", key), os.path.join(mount, key))
        os.symlink(stamp, os.path.join(mount, "..data"))
        grafts = [f"{name}={os.path.join(mount, name)}" for name in sorted(os.listdir(mount))]
        _run([xorrisofs(), "-output", iso, "-follow-links", "-volid", label, "-joliet", "-rock",
              "-graft-points", "-partition_cyl_align", "on", *grafts])
    return iso


def nocloud_disk(iso: str, instance_id: str, hostname: str, user_data: str, network_data: str = "") -> str:
    """The NoCloud ISO of a cloudInitNoCloud volume."""
    with tempfile.TemporaryDirectory() as directory:
        files = {"meta-data": json.dumps({"instance-id": instance_id, "local-hostname": hostname}),
                 "user-data": user_data}
        if network_data:
            files["network-config"] = network_data
        for name, text in files.items():
            path = os.path.join(directory, name)
            with open(path, "w") as f:
                f.write(text)
            os.chmod(path, 0o600)
        _run([xorrisofs(), "-output", iso, "-volid", NOCLOUD_LABEL, "-joliet", "-rock",
              "-partition_cyl_align", "on", directory])
    return iso


def _run(command: list[str]):
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{command[0]} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
