"""Reading Kubernetes objects held as plain dicts."""

from __future__ import annotations

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
