"""Every user-facing failure names a `Reason` (kubevirt_spawner/reasons.py), never a bare string:
a typo would otherwise make a new reason that no page lists and no metric dashboard expects. And
every Reason says when it happens and what to do (docs/failures.md shows it)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kubevirt_spawner.reasons import DESCRIPTIONS, Reason
from kubevirt_spawner.workstation import WorkstationError

PACKAGE = Path(__file__).resolve().parents[1] / "kubevirt_spawner"
RAISERS = ("WorkstationError", "SpawnException")


def reason_arguments(source: str) -> list[tuple[int, ast.expr]]:
    """(line, value) of each `reason=` given to a WorkstationError or SpawnException."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        if name in RAISERS:
            found += [(node.lineno, kw.value) for kw in node.keywords if kw.arg == "reason"]
    return found


def is_string_literal(value: ast.expr) -> bool:
    return (isinstance(value, ast.Constant) and isinstance(value.value, str)) or isinstance(value, ast.JoinedStr)


def modules_outside_the_simulator() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if p.relative_to(PACKAGE).parts[0] != "sim"]


def test_no_failure_passes_a_bare_string_as_its_reason():
    offenders, seen = [], 0
    for path in modules_outside_the_simulator():
        for line, value in reason_arguments(path.read_text()):
            seen += 1
            if is_string_literal(value):
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{line}: reason={ast.unparse(value)}")
    assert offenders == [], "use a member of kubevirt_spawner.reasons.Reason:\n" + "\n".join(offenders)
    assert seen >= 40  # the scan finds the raising sites (it is not passing by finding none)


@pytest.mark.parametrize("source, bare", [
    ('raise WorkstationError("No GPU.", reason="gpu-unavailable", status_code=503)', True),
    ('raise ws.WorkstationError("x", reason=f"gpu-{kind}")', True),
    ('raise SpawnException("x", reason="image")', True),
    ('raise WorkstationError("No GPU.", reason=Reason.GPU_UNAVAILABLE, status_code=503)', False),
    ('raise KubeError(409, reason="AlreadyExists")', False),  # not a user-facing failure
])
def test_the_scan_tells_a_bare_string_from_a_reason(source, bare):
    found = reason_arguments(source)
    assert any(is_string_literal(value) for _, value in found) is bare


def test_every_reason_has_a_description():
    assert set(DESCRIPTIONS) == set(Reason)
    for reason in Reason:
        text = reason.description
        assert text.strip() and len(text) < 200, reason
        assert text.endswith(".") and "|" not in text, reason  # one sentence, fit for the table of docs/failures.md


def test_a_reason_is_its_string_in_logs_and_metrics():
    assert {r.name for r in Reason} == {r.value.upper().replace("-", "_") for r in Reason}
    err = WorkstationError("No GPU is free.", reason=Reason.GPU_UNAVAILABLE, status_code=503)
    assert err.reason == "gpu-unavailable" and f"{err.reason}" == str(err.reason) == "gpu-unavailable"
    assert "(reason=gpu-unavailable)" in str(err)
