"""Kubernetes resource quantities ("150Gi", "500m", "8") as numbers."""

from __future__ import annotations

import re
from decimal import Decimal

_SUFFIX: dict[str, int | Decimal] = {"": 1, "m": Decimal("0.001"), "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15,
           "E": 10**18, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_RE = re.compile(r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)([a-zA-Z]*)$")


def parse_quantity(value: str | int | float | Decimal) -> Decimal:
    if isinstance(value, (int, float)):
        return Decimal(str(value))
    m = _RE.match(str(value).strip())
    if not m or m.group(2) not in _SUFFIX:
        raise ValueError(f"quantities must match the regular expression "
                         f"'^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$': {value!r}")
    return Decimal(m.group(1)) * Decimal(_SUFFIX[m.group(2)])


def format_bytes(n: int | Decimal) -> str:
    n = int(n)
    for suffix in ("Ei", "Pi", "Ti", "Gi", "Mi", "Ki"):
        size = int(_SUFFIX[suffix])
        if n and n % size == 0:
            return f"{n // size}{suffix}"
    return str(n)
