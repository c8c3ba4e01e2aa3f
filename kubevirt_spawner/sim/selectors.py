"""Label and field selectors, with the syntax and matching rules of Kubernetes."""

from __future__ import annotations

import re
from typing import Callable

from ..objects import field_value
from .errors import bad_request

Matcher = Callable[[dict], bool]

_SET_EXPR = re.compile(r"^\s*(!?)\s*([A-Za-z0-9_./-]+)\s*(?:\s(in|notin)\s*\(([^)]*)\))?\s*$")
_EQ_EXPR = re.compile(r"^\s*([A-Za-z0-9_./-]+)\s*(==|=|!=)\s*([A-Za-z0-9_.-]*)\s*$")


def _split_requirements(text: str) -> list[str]:
    """Split on commas that are not inside a `( ... )` value set."""
    parts: list[str] = []
    current: list[str] = []
    depth = 0
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    parts.append("".join(current))
    return [p for p in (p.strip() for p in parts) if p]


def parse_label_selector(text: str | None) -> Matcher:
    if not text:
        return lambda labels: True
    tests: list[Matcher] = []
    for req in _split_requirements(text):
        m = _EQ_EXPR.match(req)
        if m:
            key, op, value = m.groups()
            tests.append(_equals(key, value, op != "!="))
            continue
        m = _SET_EXPR.match(req)
        if not m:
            raise bad_request(f'unable to parse requirement: invalid label selector "{text}"')
        negate, key, op, values = m.groups()
        if op:
            if negate:
                raise bad_request(f'unable to parse requirement: invalid label selector "{text}"')
            vals = {v.strip() for v in values.split(",") if v.strip()}
            tests.append(_among(key, vals, op == "in"))
        else:
            tests.append(_present(key, not negate))
    return lambda labels: all(t(labels) for t in tests)


def _equals(key: str, value: str, want: bool) -> Matcher:
    return lambda labels: (labels.get(key) == value) == want


def _among(key: str, values: set[str], want: bool) -> Matcher:
    return lambda labels: (labels.get(key) in values) == want


def _present(key: str, want: bool) -> Matcher:
    return lambda labels: (key in labels) == want


def match_labels_matcher(selector: dict | None) -> Matcher:
    """A structured selector (`matchLabels` / `matchExpressions`), or a Service's plain map."""
    selector = selector or {}
    if "matchLabels" in selector or "matchExpressions" in selector:
        plain = selector.get("matchLabels") or {}
        exprs = selector.get("matchExpressions") or []
    else:
        plain, exprs = selector, []

    def test(labels: dict) -> bool:
        if any(labels.get(k) != v for k, v in plain.items()):
            return False
        for e in exprs:
            key, op, values = e["key"], e["operator"], set(e.get("values") or [])
            present = key in labels
            if op == "In" and (not present or labels[key] not in values):
                return False
            if op == "NotIn" and present and labels[key] in values:
                return False
            if op == "Exists" and not present:
                return False
            if op == "DoesNotExist" and present:
                return False
        return True
    return test


def parse_field_selector(text: str | None) -> Matcher:
    if not text:
        return lambda obj: True
    tests = []
    for req in _split_requirements(text):
        m = _EQ_EXPR.match(req) or re.match(r"^\s*([A-Za-z0-9_.]+)\s*(==|=|!=)\s*(.*?)\s*$", req)
        if not m:
            raise bad_request(f'invalid field selector: "{text}"')
        path, op, value = m.groups()

        def test(obj, p=path, o=op, v=value):
            actual = field_value(obj, p)
            actual = "" if actual is None else str(actual)
            return (actual != v) if o == "!=" else (actual == v)
        tests.append(test)
    return lambda obj: all(t(obj) for t in tests)
