"""Reading Kubernetes objects held as plain dicts."""

from __future__ import annotations

import copy
import posixpath
import re
from typing import Any

# Phases after which a VMI, a DataVolume or a snapshot changes no more.
FINAL_PHASES = ("Succeeded", "Failed")


def field_value(obj: dict[str, Any] | None, path: str) -> Any:
    """The value at a dotted path such as `status.phase`, or None where any part is missing."""
    cur: Any = obj
    for part in path.split("."):
        if not isinstance(cur, dict):
            return None
        cur = cur.get(part)
    return cur


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386, which is also KubeSpawner's rule for overrides and extra specs: objects merge key
    by key, None (null) removes a key, everything else (a list included) replaces. Neither
    argument changes."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result: dict[str, Any] = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def condition(obj: dict[str, Any] | None, ctype: str) -> dict[str, Any]:
    """The status condition of that type, or {} when there is none."""
    return next((c for c in field_value(obj, "status.conditions") or [] if c.get("type") == ctype), {})


# How the guest names and mounts the workstation's disks (the golden image's fstab, the guest
# agent's filesystem list, the simulator's guests): by the serials the VM gives them.
ROOT_DISK_SERIAL = "rootdisk"
WORKSPACE_DISK_SERIAL = "workspace"
WORKSPACE_MOUNT = "/home"  # users' homes live on the workspace disk, so they survive a system reset
# The Secret disk that carries JupyterHub's environment into the guest: one file per variable, the
# extra Jupyter arguments as a JSON list, and cloud-init's user data (not an environment variable).
ENV_DISK_SERIAL = "hubenv"
ARGS_KEY = "args.json"
USERDATA_KEY = "userdata"
# Shared data: each is a virtiofs filesystem of the VM whose mount tag is its name (KubeVirt v1.9
# pkg/virt-launcher/virtwrap/converter: the tag is the filesystem's name); the guest learns where
# each goes from this variable, a JSON list of {"tag", "path", "readOnly"}.
SHARED_DATA_ENV = "KUBEVIRT_SHARED_DATA"
# Extra data disks: block claims of the workstation's own, each with the disk serial `disk-NAME`
# (the VM's volume name too); the guest learns where each goes from this variable, a JSON list of
# {"serial", "path"}, and makes a filesystem on a blank one.
EXTRA_DISKS_ENV = "KUBEVIRT_EXTRA_DISKS"
EXTRA_DISK_PREFIX = "disk-"
# The discardable scratch disk (an emptyDisk: blank at every start of the VM) on /scratch.
SCRATCH_DISK_SERIAL = "scratch"
SCRATCH_MOUNT = "/scratch"
# Where shared data may not go: the system's own directories (a mount there hides the system),
# the workspace disk's /home and the scratch disk's mount.
SYSTEM_PATHS = ("/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/opt", "/proc", "/root",
                "/run", "/sbin", "/scratch", "/snap", "/sys", "/tmp", "/usr", "/var")
_MOUNT_PATH = re.compile(r"^(/[A-Za-z0-9._-]+)+$")


def check_mount_path(path: Any) -> str:
    """A mount point for shared data or an extra disk, or ValueError with a sentence: absolute, plain (letters,
    digits, ., _ and -), normalised, and outside the system's directories."""
    if not isinstance(path, str) or not _MOUNT_PATH.match(path) or posixpath.normpath(path) != path \
            or any(part in (".", "..") for part in path.split("/")):
        raise ValueError(f"{path!r} is not a mount point: give an absolute path of letters, digits, '.', '_' and '-' "
                         "such as /data/datasets")
    for system in SYSTEM_PATHS:
        if path == system or path.startswith(system + "/"):
            raise ValueError(f"{path} is inside {system}, which the system (or the workstation's own disks) uses: "
                             "mount it elsewhere, such as under /data or /srv")
    return path
