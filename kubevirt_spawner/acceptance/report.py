"""The acceptance suite's records and reports: JSON (the source of truth), HTML (one page for a
change request) and Markdown (for a pull request). Pure functions; what a guest or the cluster said
may be in a sentence or a figure, so everything is escaped for its format."""

from __future__ import annotations

import html
import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from ..names import printable

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
# The design document's section 13, in its order.
SECTIONS = {
    "host": "Host and scheduling",
    "persistence": "Persistence semantics",
    "storage": "Storage and recovery",
    "security": "Security and product experience",
}
REPORT_FORMATS = (".json", ".html", ".md")


@dataclass
class Record:
    """One experiment's outcome: PASS, FAIL or SKIP, one sentence why, and what it measured."""
    section: str
    name: str
    result: str
    sentence: str
    figures: dict[str, Any] = field(default_factory=dict)
    duration: float = 0.0  # seconds

    def line(self) -> str:
        """What the suite prints as the experiment ends (a terminal's control characters dropped)."""
        figures = ", ".join(f"{k} {_figure(v)}" for k, v in self.figures.items())
        text = f"{self.result} {self.section}/{self.name}: {self.sentence}" + (f" [{figures}]" if figures else "")
        return printable(text)


def _figure(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(_figure(v) for v in value) or "none"
    if isinstance(value, dict):
        return "; ".join(f"{k}: {_figure(v)}" for k, v in value.items()) or "none"
    return str(value)


def counts(records: list[Record]) -> dict[str, int]:
    return {result: sum(1 for r in records if r.result == result) for result in (PASS, FAIL, SKIP)}


def to_json(records: list[Record], meta: dict) -> str:
    return json.dumps({"meta": meta, "summary": counts(records), "experiments": [asdict(r) for r in records]},
                      indent=2, sort_keys=False) + "\n"


def from_json(text: str) -> tuple[list[Record], dict]:
    data = json.loads(text)
    return [Record(**r) for r in data["experiments"]], data.get("meta") or {}


def _by_section(records: list[Record]) -> list[tuple[str, list[Record]]]:
    out = [(title, [r for r in records if r.section == key]) for key, title in SECTIONS.items()]
    return [(title, rs) for title, rs in out if rs]


def to_markdown(records: list[Record], meta: dict) -> str:
    def cell(text: Any) -> str:  # (a table cell: no line breaks, no pipes, no markup or links from a guest)
        escaped = html.escape(" ".join(printable(str(text)).split()), quote=False)  # (quotes need none)
        return re.sub(r"([\\`*_\[\]()!#<>~|])", r"\\\1", escaped)

    c = counts(records)
    lines = [f"# Acceptance of {cell(meta.get('hub_url', 'a hub'))}", "",
             f"{c[PASS]} passed, {c[FAIL]} failed, {c[SKIP]} skipped; {cell(meta.get('started', ''))}, "
             f"{meta.get('duration', 0):.0f} s.", ""]
    for title, rs in _by_section(records):
        lines += [f"## {title}", "", "| result | experiment | why | figures | seconds |", "| --- | --- | --- | --- | --- |"]
        for r in rs:
            lines.append(f"| {r.result} | {cell(r.name)} | {cell(r.sentence)} | {cell(_figure(r.figures))} | "
                         f"{r.duration:.1f} |")
        lines.append("")
    return "\n".join(lines)


STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 70em; color: #1d1d1f; }
h1 { font-size: 1.6em; } h2 { margin-top: 1.6em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; width: 100%; margin: .6em 0; }
th, td { border: 1px solid #ccc; padding: .3em .5em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
.PASS { color: #0a6b2b; font-weight: 600; } .FAIL { color: #b00020; font-weight: 600; }
.SKIP { color: #6b5b00; font-weight: 600; }
table.figures { width: auto; margin: .3em 0 0; } table.figures td { border: none; padding: 0 .8em 0 0; }
.meta { color: #555; }
"""


def to_html(records: list[Record], meta: dict) -> str:
    e = html.escape
    c = counts(records)

    def figures(r: Record) -> str:
        if not r.figures:
            return ""
        rows = "".join(f"<tr><td>{e(str(k))}</td><td>{e(_figure(v))}</td></tr>" for k, v in r.figures.items())
        return f'<table class="figures">{rows}</table>'

    summary = "".join(
        f'<tr><td>{e(title)}</td>' + "".join(f"<td>{sum(1 for r in rs if r.result == x)}</td>" for x in (PASS, FAIL, SKIP))
        + "</tr>" for title, rs in _by_section(records))
    parts = [
        "<!doctype html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>Acceptance of {e(str(meta.get('hub_url', 'a hub')))}</title><style>{STYLE}</style></head><body>",
        f"<h1>Workstation acceptance: {e(str(meta.get('hub_url', '')))}</h1>",
        f'<p class="meta">{c[PASS]} passed, {c[FAIL]} failed, {c[SKIP]} skipped. Started {e(str(meta.get("started", "")))}, '
        f"took {meta.get('duration', 0):.0f} s; kubevirt-spawner {e(str(meta.get('version', '')))}; test user "
        f"{e(str(meta.get('user', '')))}; profile {e(str(meta.get('profile') or 'the default'))}.</p>",
        "<h2>Summary</h2>", "<table><tr><th>section</th><th>PASS</th><th>FAIL</th><th>SKIP</th></tr>",
        summary, "</table>",
    ]
    for title, rs in _by_section(records):
        parts += [f"<h2>{e(title)}</h2>",
                  "<table><tr><th>result</th><th>experiment</th><th>why</th><th>figures</th><th>seconds</th></tr>"]
        for r in rs:
            parts.append(f'<tr><td class="{e(r.result)}">{e(r.result)}</td><td>{e(r.name)}</td><td>{e(r.sentence)}</td>'
                         f"<td>{figures(r)}</td><td>{r.duration:.1f}</td></tr>")
        parts.append("</table>")
    parts.append("</body></html>\n")
    return "\n".join(parts)


def render(path: str, records: list[Record], meta: dict) -> str:
    """The report for `path`'s suffix; a suffix without a format is a ValueError with a sentence."""
    suffix = path[path.rfind("."):].lower() if "." in path else ""
    if suffix == ".json":
        return to_json(records, meta)
    if suffix == ".html":
        return to_html(records, meta)
    if suffix == ".md":
        return to_markdown(records, meta)
    raise ValueError(f"--report {path}: name a .json, .html or .md file.")
