"""Server-side printing: the `Table` answers `kubectl get` asks for."""

from __future__ import annotations

import re
from typing import Any

from .resources import ResourceType
from .timeutil import seconds_since

_FILTER = re.compile(r"^(\w+)\[\?(\w+)=(\w+)\]$")
_INDEX = re.compile(r"^(\w+)\[(\d+)\]$")


def column_value(obj: dict, path: str) -> Any:
    if not path:  # (a column rendered from the whole object)
        return obj
    cur: Any = obj  # (a JSON value: whatever the path leads to)
    for part in path.split("."):
        if cur is None:
            return None
        m = _FILTER.match(part)
        if m:
            items = cur.get(m.group(1)) or []
            cur = next((i for i in items if str(i.get(m.group(2))) == m.group(3)), None)
            continue
        m = _INDEX.match(part)
        if m:
            items = cur.get(m.group(1)) or []
            idx = int(m.group(2))
            cur = items[idx] if idx < len(items) else None
            continue
        cur = cur.get(part) if isinstance(cur, dict) else None
    return cur


def table(rt: ResourceType, objects: list[dict], list_meta: dict) -> dict:
    columns = [{"name": "Name", "type": "string", "format": "name", "description": "Name", "priority": 0}]
    columns += [{"name": c.name, "type": c.type, "format": "", "description": c.name, "priority": c.priority}
                for c in rt.columns]
    rows = []
    for obj in objects:
        cells = [obj["metadata"]["name"]]
        for c in rt.columns:
            value = column_value(obj, c.json_path)
            if c.render is not None:
                value = c.render(value)
            if c.type == "date" and value:
                value = _age(value)
            cells.append("<none>" if value is None and c.type == "string" else value)
        rows.append({"cells": cells, "object": {"kind": "PartialObjectMetadata",
                                                "apiVersion": "meta.k8s.io/v1", "metadata": obj["metadata"]}})
    return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": list_meta,
            "columnDefinitions": columns, "rows": rows}


def _age(timestamp: str) -> str:
    seconds = int(seconds_since(timestamp))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size * 2 or (unit == "m" and seconds >= 60):
            return f"{seconds // size}{unit}"
    return f"{max(seconds, 0)}s"
