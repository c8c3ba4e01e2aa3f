"""Status conditions of the simulated objects, as the upstream controllers write them."""

from __future__ import annotations

from ..objects import field_value
from .timeutil import now_iso


def condition(ctype: str, status: str, reason: str = "", message: str = "") -> dict:
    c = {"type": ctype, "status": status, "lastProbeTime": None, "lastTransitionTime": now_iso()}
    if reason:
        c["reason"] = reason
    if message:
        c["message"] = message
    return c


def get_condition(obj: dict, ctype: str) -> dict | None:
    return next((c for c in field_value(obj, "status.conditions") or [] if c.get("type") == ctype), None)


def set_condition(status: dict, cond: dict):
    """Replace a condition, keeping lastTransitionTime when its status did not change."""
    conds = status.setdefault("conditions", [])
    for i, c in enumerate(conds):
        if c.get("type") == cond["type"]:
            if c.get("status") == cond["status"]:
                cond["lastTransitionTime"] = c.get("lastTransitionTime", cond["lastTransitionTime"])
            conds[i] = cond
            return
    conds.append(cond)


def drop_condition(status: dict, ctype: str):
    status["conditions"] = [c for c in status.get("conditions") or [] if c.get("type") != ctype]
