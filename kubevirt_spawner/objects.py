"""Reading Kubernetes objects held as plain dicts."""

from __future__ import annotations

import copy

# Phases after which a VMI, a DataVolume or a snapshot changes no more.
FINAL_PHASES = ("Succeeded", "Failed")


def field_value(obj: dict | None, path: str):
    """The value at a dotted path such as `status.phase`, or None where any part is missing."""
    cur = obj
    for part in path.split("."):
        if not isinstance(cur, dict):
            return None
        cur = cur.get(part)
    return cur


def merge_patch(target, patch):
    """RFC 7386, which is also KubeSpawner's rule for overrides and extra specs: objects merge key
    by key, None (null) removes a key, everything else (a list included) replaces. Neither
    argument changes."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def condition(obj: dict | None, ctype: str) -> dict:
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
