"""A VMI's disks on this machine: the directory (process guests) or image (QEMU guests) behind
each volume, the Secrets and cloud-init it mounts, and what the golden image's fstab makes of
the workspace, scratch and extra disks. Upstream: pkg/host-disk, pkg/emptydisk, pkg/config and
pkg/cloud-init, which virt-launcher uses to attach them."""

from __future__ import annotations

import base64
import binascii
import os
import shutil
import uuid

from ..objects import (
    EXTRA_DISK_PREFIX,
    SCRATCH_DISK_SERIAL,
    SCRATCH_MOUNT,
    WORKSPACE_DISK_SERIAL,
    WORKSPACE_MOUNT,
    field_value,
)
from ..quantity import parse_quantity
from .guests import guest_environment
from .instances import PVC, claim_names
from .isos import config_disk, nocloud_disk
from .machines import volume_image
from .qemu import Disk
from .resources import BY_KIND

SECRET = BY_KIND["Secret"]


class GuestDisks:
    def __init__(self, cluster):
        self.c = cluster
        self.store = cluster.store

    def root_dir(self, vmi: dict) -> str | None:
        """The directory of the first disk's volume: the machine's root filesystem."""
        ns = vmi["metadata"]["namespace"]
        disks = field_value(vmi, "spec.domain.devices.disks") or []
        claims = dict(claim_names(vmi.get("spec") or {}))
        for disk in disks:
            claim = claims.get(disk.get("name"))
            if claim:
                pvc = self.store.get(PVC, ns, claim)
                if pvc is not None:
                    return self.c.volume_dir(pvc)
        return None

    def disk_dir(self, vmi: dict, serial: str) -> tuple[dict | None, str | None]:
        """The claim and directory of the disk with this serial."""
        claims = dict(claim_names(vmi.get("spec") or {}))
        for disk in field_value(vmi, "spec.domain.devices.disks") or []:
            if disk.get("serial") == serial and claims.get(disk.get("name")):
                pvc = self.store.get(PVC, vmi["metadata"]["namespace"], claims[disk["name"]])
                if pvc is not None:
                    return pvc, self.c.volume_dir(pvc)
        return None, None

    def extra_disk_dirs(self, vmi: dict) -> dict[str, str]:
        """Serial -> directory of each extra disk (a claim whose disk serial is disk-NAME)."""
        out = {}
        for disk in field_value(vmi, "spec.domain.devices.disks") or []:
            serial = disk.get("serial") or ""
            if serial.startswith(EXTRA_DISK_PREFIX):
                _, directory = self.disk_dir(vmi, serial)
                if directory is not None:
                    os.makedirs(directory, exist_ok=True)
                    out[serial] = directory
        return out

    def mount_workspace(self, vmi: dict, root: str):
        """What the golden image's fstab does: the disk with serial `workspace` on /home (a link
        here; the root disk's own /home, if any, is hidden while it is mounted)."""
        _, workspace = self.disk_dir(vmi, WORKSPACE_DISK_SERIAL)
        home = os.path.join(root, WORKSPACE_MOUNT.strip("/"))
        if workspace is None:
            if os.path.islink(home):
                os.unlink(home)  # the disk was removed from the machine
            return
        os.makedirs(workspace, exist_ok=True)
        if os.path.islink(home):
            if os.readlink(home) == workspace:
                return
            os.unlink(home)
        elif os.path.isdir(home):
            os.replace(home, home + ".under-mount")
        os.symlink(workspace, home)

    def mount_scratch(self, vmi: dict, root: str):
        """What the golden image's fstab does with the emptyDisk of serial `scratch`: a blank
        filesystem on /scratch at every boot (virt-launcher makes the disk anew for each VMI,
        pkg/emptydisk). Here, a directory emptied at every start, linked at /scratch."""
        link = os.path.join(root, SCRATCH_MOUNT.strip("/"))
        if os.path.islink(link):
            os.unlink(link)
        if not self.has_empty_disk(vmi, SCRATCH_DISK_SERIAL):
            return
        scratch = self.scratch_dir(vmi)
        shutil.rmtree(scratch, ignore_errors=True)
        os.makedirs(scratch)
        os.chmod(scratch, 0o1777)  # (the launcher makes it everyone's, sticky, as /tmp)
        if os.path.isdir(link):
            os.replace(link, link + ".under-mount")  # (hidden by the mount, as the workspace's /home)
        os.symlink(scratch, link)

    def scratch_dir(self, vmi: dict) -> str:
        return os.path.join(self.c.state_dir, "ephemeral", f"{vmi['metadata']['namespace']}_{vmi['metadata']['name']}")

    @staticmethod
    def has_empty_disk(vmi: dict, serial: str) -> bool:
        empty = {v["name"] for v in field_value(vmi, "spec.volumes") or [] if "emptyDisk" in v}
        return any(d.get("serial") == serial and d.get("name") in empty
                   for d in field_value(vmi, "spec.domain.devices.disks") or [])

    def shared_dirs(self, vmi: dict) -> dict[str, tuple[str, bool]]:
        """Tag -> (directory, read-only) of each virtiofs filesystem of the VMI: the claim's files,
        read-only when its volume says readOnly (virt-controller's rendervolumes.go mounts the claim
        so in the launcher pod, and virtiofsd serves that mount)."""
        ns = vmi["metadata"]["namespace"]
        volumes = {v.get("name"): v for v in field_value(vmi, "spec.volumes") or []}
        out = {}
        for fs in field_value(vmi, "spec.domain.devices.filesystems") or []:
            volume = volumes.get(fs.get("name")) or {}
            claim = (volume.get("persistentVolumeClaim") or {}).get("claimName") or \
                (volume.get("dataVolume") or {}).get("name")
            pvc = self.store.get(PVC, ns, claim) if claim and "virtiofs" in fs else None
            if pvc is None:
                continue
            directory = self.c.volume_dir(pvc)
            os.makedirs(directory, exist_ok=True)
            out[fs["name"]] = (directory, bool((volume.get("persistentVolumeClaim") or {}).get("readOnly")))
        return out

    def guest_env(self, vmi: dict) -> dict:
        return guest_environment(self.secret_datas(vmi))

    def secret_datas(self, vmi: dict) -> list[dict]:
        """The decoded data of every Secret the VMI mounts (as a disk or as cloud-init)."""
        ns = vmi["metadata"]["namespace"]
        datas = []
        for v in field_value(vmi, "spec.volumes") or []:
            names = []
            if "secret" in v:
                names.append(v["secret"].get("secretName"))
            for source in ("cloudInitNoCloud", "cloudInitConfigDrive"):
                if source in v:
                    for ref in ("secretRef", "networkDataSecretRef"):
                        if (v[source].get(ref) or {}).get("name"):
                            names.append(v[source][ref]["name"])
            for secret_name in names:
                secret = self.store.get(SECRET, ns, secret_name)
                if secret is not None:
                    datas.append(self.c.secret_data(secret))
        return datas

    def machine_disks(self, vmi: dict, workdir: str) -> list[Disk]:
        """The VMI's disks, each with its bootOrder: volumes as their disk images, Secret volumes
        and cloud-init as the ISO images virt-launcher builds from them."""
        ns, name = vmi["metadata"]["namespace"], vmi["metadata"]["name"]
        volumes = {v["name"]: v for v in field_value(vmi, "spec.volumes") or []}
        disks = sorted(field_value(vmi, "spec.domain.devices.disks") or [],
                       key=lambda d: d.get("bootOrder") or 1_000_000)  # (stable: the rest in spec order)
        out = []
        for disk in disks:
            volume = volumes.get(disk.get("name")) or {}
            claim = (volume.get("persistentVolumeClaim") or {}).get("claimName") or \
                (volume.get("dataVolume") or {}).get("name")
            if claim:
                pvc = self.store.get(PVC, ns, claim)
                size = int(parse_quantity(field_value(pvc, "status.capacity.storage") or "1Gi"))
                path = volume_image(self.c.volume_dir(pvc), size)
            elif "secret" in volume:
                secret = self.store.get(SECRET, ns, volume["secret"].get("secretName") or "")
                data = {k: v.encode() for k, v in (self.c.secret_data(secret) if secret else {}).items()}
                path = config_disk(data, os.path.join(workdir, f"{disk['name']}.iso"),
                                   volume["secret"].get("volumeLabel") or "cfgdata")
            elif "emptyDisk" in volume:  # (pkg/emptydisk: a blank image of its capacity, for this VMI only)
                path = os.path.join(workdir, f"{disk['name']}.img")
                with open(path, "wb") as image:
                    image.truncate(int(parse_quantity(volume["emptyDisk"].get("capacity") or "1Mi")))
            elif "cloudInitNoCloud" in volume:
                user_data, network_data = self._cloud_init(ns, volume["cloudInitNoCloud"])
                # the instance-id is the VMI's firmware UUID (cloud-init.go cloudInitUUIDFromVMI)
                instance_id = field_value(vmi, "spec.domain.firmware.uuid") or str(uuid.uuid4())
                path = nocloud_disk(os.path.join(workdir, "cloudinit.iso"), instance_id, name,
                                    user_data, network_data)
            else:
                continue  # (kinds this product does not attach)
            out.append(Disk(path, disk.get("serial"), boot_order=disk.get("bootOrder")))
        return out

    def _cloud_init(self, ns: str, source: dict) -> tuple[str, str]:
        """User and network data of a cloudInitNoCloud volume: inline, base64, or from a Secret's
        `userdata` / `networkdata` keys (kubevirt pkg/cloud-init/cloud-init.go)."""
        def from_secret(ref: str, keys: tuple[str, ...]) -> str | None:
            name = (source.get(ref) or {}).get("name")
            secret = self.store.get(SECRET, ns, name) if name else None
            data = self.c.secret_data(secret) if secret else {}
            return next((data[k] for k in keys if k in data), None)
        user = source.get("userData") or _b64(source.get("userDataBase64")) or \
            from_secret("secretRef", ("userdata", "userData")) or ""
        network = source.get("networkData") or _b64(source.get("networkDataBase64")) or \
            from_secret("networkDataSecretRef", ("networkdata", "networkData")) or ""
        return user, network


def _b64(text: str | None) -> str | None:
    if not text:
        return None
    try:
        return base64.b64decode(text).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None
