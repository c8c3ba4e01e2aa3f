"""The guest agent as KubeVirt reports it: whether it is connected (the VMI's AgentConnected
condition), and the guestosinfo, userlist and filesystemlist subresources, in KubeVirt's types
(staging/src/kubevirt.io/api/core/v1/types.go). A QEMU guest's real agent answers for itself; a
process guest's answers come from its root disk and the fault API's facts."""

from __future__ import annotations

import os

from ..objects import (
    EXTRA_DISKS_ENV,
    SCRATCH_DISK_SERIAL,
    SCRATCH_MOUNT,
    WORKSPACE_DISK_SERIAL,
    WORKSPACE_MOUNT,
    field_value,
)
from ..quantity import parse_quantity
from . import errors
from .facts import GuestFacts
from .guest_disks import GuestDisks
from .guests import Guest, listed_mounts
from .instances import PVC, VMI, claim_names
from .machines import QemuGuest
from .timeutil import seconds_since


class GuestAgent:
    def __init__(self, cluster, guests: dict[tuple[str, str], Guest | QemuGuest], facts: GuestFacts,
                 disks: GuestDisks):
        self.c = cluster
        self.store = cluster.store
        self.guests = guests
        self.facts = facts
        self.disks = disks

    def connected(self, vmi: dict) -> bool:
        key = (vmi["metadata"]["namespace"], vmi["metadata"]["name"])
        guest = self.guests.get(key)
        if isinstance(guest, QemuGuest):  # the real agent: connected while it answers
            return self.facts.agents.get(key, True) and guest.alive and guest.agent_connected
        return self.facts.agents.get(key, True) and field_value(vmi, "status.phase") == "Running" \
            and guest is not None and guest.alive

    def due(self, vmi: dict) -> bool:
        """The guest agent connects once the guest has booted far enough to start it: the `agent`
        delay, or the guest's own (which may be never)."""
        key = (vmi["metadata"]["namespace"], vmi["metadata"]["name"])
        if isinstance(self.guests.get(key), QemuGuest):
            return True  # (its agent is connected when it answers)
        stamps = field_value(vmi, "status.phaseTransitionTimestamps") or []
        running = [s for s in stamps if s["phase"] == "Running"]
        due = self.facts.guest_seconds(key, "agent")
        if not running or due is None:
            return False
        elapsed = seconds_since(running[-1]["phaseTransitionTimestamp"])
        if elapsed + 1 >= due:  # timestamps have one-second resolution
            return True
        self.c.vmi_queue.add((vmi["metadata"]["namespace"], vmi["metadata"]["name"]), due - elapsed)
        return False

    def call(self, ns: str, name: str, call: str) -> dict:
        vmi = self.store.get(VMI, ns, name)
        if vmi is None:
            raise errors.not_found(VMI, name)
        if field_value(vmi, "status.phase") != "Running":
            raise errors.agent_unavailable("VMI is not running")
        if not self.connected(vmi):
            raise errors.agent_unavailable("VMI does not have guest agent connected")
        guest = self.guests.get((ns, name))
        if isinstance(guest, QemuGuest):
            return qemu_agent_answer(guest.agent_info, call, name)
        if call == "guestosinfo":
            info = self.os_info(vmi)
            return {"guestAgentVersion": "8.2.2", "hostname": name, "os": info, "timezone": "UTC, 0",
                    "userList": self.user_list((ns, name)),
                    "fsInfo": {"disks": self.filesystems(vmi)},
                    "supportedCommands": [{"name": c, "enabled": True} for c in
                                          ("guest-info", "guest-get-osinfo", "guest-get-users",
                                           "guest-get-fsinfo", "guest-fsfreeze-freeze", "guest-shutdown")]}
        if call == "userlist":
            return {"metadata": {}, "items": self.user_list((ns, name))}
        if call == "filesystemlist":
            return {"metadata": {}, "items": self.filesystems(vmi)}
        raise errors.bad_request(f"unknown guest agent call {call}")

    def user_list(self, key: tuple[str, str]) -> list[dict]:
        """The guest agent's users as KubeVirt reports them (VirtualMachineInstanceGuestOSUser in
        staging/src/kubevirt.io/api/core/v1/types.go: userName, domain, loginTime); where they
        logged in from stays in the guest."""
        return [{k: u[k] for k in ("userName", "domain", "loginTime") if k in u}
                for u in self.facts.users.get(key, [])]

    def os_info(self, vmi: dict) -> dict:
        guest = self.guests.get((vmi["metadata"]["namespace"], vmi["metadata"]["name"]))
        if isinstance(guest, QemuGuest):
            return qemu_os_info(guest.agent_info.get("osinfo") or {})
        root = self.disks.root_dir(vmi)
        release = {}
        if root:
            try:
                with open(os.path.join(root, "etc", "os-release")) as f:
                    for line in f:
                        if "=" in line:
                            k, v = line.rstrip("\n").split("=", 1)
                            release[k] = v.strip('"')
            except OSError:
                pass
        return {"name": release.get("NAME", "Linux"), "prettyName": release.get("PRETTY_NAME", "Linux"),
                "version": release.get("VERSION", ""), "versionId": release.get("VERSION_ID", ""),
                "id": release.get("ID", "linux"), "kernelRelease": "6.8.0-45-generic",
                "kernelVersion": "#45-Ubuntu SMP PREEMPT_DYNAMIC", "machine": "x86_64"}

    def filesystems(self, vmi: dict) -> list[dict]:
        disks = self.disks
        root = disks.root_dir(vmi)
        if root is None:
            return []
        ns = vmi["metadata"]["namespace"]
        claims = dict(claim_names(vmi.get("spec") or {}))
        pvc = self.store.get(PVC, ns, claims.get((field_value(vmi, "spec.domain.devices.disks") or [{}])[0]
                                                 .get("name"), ""))
        total = int(parse_quantity(field_value(pvc, "status.capacity.storage") or "0")) if pvc else 0
        used = directory_size(root)  # (os.walk does not follow the workspace's link)
        out = [{"diskName": "vda1", "mountPoint": "/", "fileSystemType": "ext4", "usedBytes": used,
                "totalBytes": max(total, used), "disk": [{"busType": "virtio", "serial": "rootdisk"}]}]
        workspace_pvc, workspace = disks.disk_dir(vmi, WORKSPACE_DISK_SERIAL)
        if workspace is not None:
            size = int(parse_quantity(field_value(workspace_pvc, "status.capacity.storage") or "0"))
            used = directory_size(workspace)
            out.append({"diskName": "vdb", "mountPoint": WORKSPACE_MOUNT, "fileSystemType": "ext4",
                        "usedBytes": used, "totalBytes": max(size, used),
                        "disk": [{"busType": "virtio", "serial": WORKSPACE_DISK_SERIAL}]})
        paths = {entry.get("serial"): path for entry, path in listed_mounts(disks.guest_env(vmi), EXTRA_DISKS_ENV)}
        for n, (serial, directory) in enumerate(sorted(disks.extra_disk_dirs(vmi).items())):
            if serial not in paths:
                continue  # (the launcher mounts only what the hub's list names)
            pvc, _ = disks.disk_dir(vmi, serial)
            size = int(parse_quantity(field_value(pvc, "status.capacity.storage") or "0"))
            used = directory_size(directory)
            out.append({"diskName": f"vd{chr(ord('d') + n)}", "mountPoint": paths[serial], "fileSystemType": "ext4",
                        "usedBytes": used, "totalBytes": max(size, used),
                        "disk": [{"busType": "virtio", "serial": serial}]})
        scratch = disks.scratch_dir(vmi)
        if disks.has_empty_disk(vmi, SCRATCH_DISK_SERIAL) and os.path.isdir(scratch):
            capacity = next((v["emptyDisk"].get("capacity") for v in field_value(vmi, "spec.volumes") or []
                             if "emptyDisk" in v and v.get("name") == "scratch"), None) or "0"
            used = directory_size(scratch)
            out.append({"diskName": "vdc", "mountPoint": SCRATCH_MOUNT, "fileSystemType": "ext4", "usedBytes": used,
                        "totalBytes": max(int(parse_quantity(capacity)), used),
                        "disk": [{"busType": "virtio", "serial": SCRATCH_DISK_SERIAL}]})
        return out


def qemu_os_info(osinfo: dict) -> dict:
    """guest-get-osinfo's answer as KubeVirt words it (VirtualMachineInstanceGuestOSInfo)."""
    names = {"name": "name", "prettyName": "pretty-name", "version": "version", "versionId": "version-id",
             "id": "id", "kernelRelease": "kernel-release", "kernelVersion": "kernel-version", "machine": "machine"}
    return {ours: osinfo[theirs] for ours, theirs in names.items() if theirs in osinfo}


def qemu_agent_answer(info: dict, call: str, hostname: str) -> dict:
    """A guest-agent subresource from the real agent's latest answers, in KubeVirt's types
    (staging/src/kubevirt.io/api/core/v1/types.go: VirtualMachineInstanceGuestAgentInfo,
    VirtualMachineInstanceGuestOSUserList, VirtualMachineInstanceFileSystemList), as virt-handler's
    agent poller converts them (pkg/virt-launcher/virtwrap/agent-poller)."""
    users = [{"userName": u.get("user", ""), "loginTime": u.get("login-time", 0),
              **({"domain": u["domain"]} if u.get("domain") else {})} for u in info.get("users") or []]
    filesystems = [{"diskName": f.get("name", ""), "mountPoint": f.get("mountpoint", ""),
                    "fileSystemType": f.get("type", ""), "usedBytes": f.get("used-bytes", 0),
                    "totalBytes": f.get("total-bytes", 0),
                    "disk": [{k: d[q] for k, q in (("busType", "bus-type"), ("serial", "serial")) if d.get(q)}
                             for d in f.get("disk") or []]}
                   for f in info.get("fsinfo") or []]
    if call == "userlist":
        return {"metadata": {}, "items": users}
    if call == "filesystemlist":
        return {"metadata": {}, "items": filesystems}
    if call != "guestosinfo":
        raise errors.bad_request(f"unknown guest agent call {call}")
    zone = info.get("timezone") or {}
    return {"guestAgentVersion": (info.get("info") or {}).get("version", ""),
            "hostname": (info.get("hostname") or {}).get("host-name", hostname),
            "os": qemu_os_info(info.get("osinfo") or {}),
            "timezone": f"{zone.get('zone', 'UTC')}, {zone.get('offset', 0)}",
            "userList": users, "fsInfo": {"disks": filesystems},
            "supportedCommands": [{"name": c.get("name", ""), "enabled": bool(c.get("enabled"))}
                                  for c in (info.get("info") or {}).get("supported_commands") or []]}


def directory_size(path: str) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total
