"""Writes the pages of docs/ that come from the code: the configuration reference, from the
traitlets of the classes a site configures; the failures a user can meet, from
`kubevirt_spawner.reasons.Reason`; the metrics, from the workstations service's Prometheus registry
(and the alerts from deploy/guardrails/prometheus-rules.yaml); and the REST API reference, from
docs/openapi.yaml. `python docs/generate.py` after changing any of them; tests/test_docs.py fails
when a page here differs from what this makes, or a setting has no help."""

from __future__ import annotations

import json
import logging
import sys
import textwrap
from pathlib import Path

import yaml

DOCS = Path(__file__).resolve().parent
RULES = DOCS.parent / "deploy" / "guardrails" / "prometheus-rules.yaml"

# (class, where it is configured, what it is): the classes a site's config file sets
CONFIGURABLES = (
    ("kubevirt_spawner.spawner", "KubeVirtSpawner", "the hub's config (`jupyterhub_config.py`)",
     "The spawner: the workstation each user gets, its profiles, disks, placement and namespace."),
    ("kubevirt_spawner.service.core", "Workstations", "the hub's config (the service loads the same file)",
     "The workstations service: snapshots, restore, reset, idle stops, keep-alives, drains, costs."),
    ("kubevirt_spawner.guest.activity", "WorkstationActivity", "the workstation's Jupyter server config",
     "What counts as activity inside a workstation (kernels, terminals, SSH, the GPU)."),
    ("kubevirt_spawner.guest.proxy", "WorkstationGuest", "the workstation's Jupyter server config",
     "The workstation's side of the Lab panel and the SSH tunnel."),
)


def settings_of(cls) -> dict:
    """The settings a class of this package defines: its own and its bases' (KubeVirtSpawner's are
    in KubeVirtSpawnerSettings), not those it inherits from JupyterHub or traitlets."""
    def owner(name: str):
        return next(c for c in cls.__mro__ if name in vars(c))
    return {name: trait for name, trait in cls.class_traits(config=True).items()
            if owner(name).__module__.startswith("kubevirt_spawner")}


def _class(module: str, name: str):
    __import__(module)
    return getattr(sys.modules[module], name)


def _help(text: str) -> str:
    return textwrap.dedent(text or "").strip()


def configuration() -> str:
    out = ["# Configuration reference", "",
           "Generated from the code by `python docs/generate.py`; a test fails when this page and the code "
           "differ, so edit the settings' help in the code, not here.", ""]
    for module, name, where, what in CONFIGURABLES:
        cls = _class(module, name)
        out += [f"## {name}", "", f"{what} Set in {where} as `c.{name}.SETTING`.", ""]
        for trait_name, trait in sorted(settings_of(cls).items()):
            default = trait.default_value_repr()
            if len(default) > 120:
                default = default[:117] + "..."
            out += [f"### `c.{name}.{trait_name}`", "",
                    f"{type(trait).__name__}, default `{default}`", "", _help(trait.help), ""]
    return "\n".join(out).rstrip() + "\n"


def failures() -> str:
    from kubevirt_spawner.reasons import Reason
    out = ["# Failures", "",
           "Generated from the code by `python docs/generate.py`; a test fails when this page and the code "
           "differ, so edit the descriptions in `kubevirt_spawner/reasons.py`, not here.", "",
           "A start, snapshot, restore or reset that fails in a way the user can act on shows them one sentence "
           "that says what happened and what to do, and carries a short reason: the hub's log shows it, and "
           "JupyterHub's spawn-failure metrics label a failed start with it (`reason`).", "",
           "| Reason | When, and what to do |", "| --- | --- |"]
    out += [f"| `{reason.value}` | {reason.description.replace('|', '&#124;')} |" for reason in Reason]
    return "\n".join(out) + "\n"


def _cell(text) -> str:
    """Text for a Markdown table's cell: one line, its bars escaped."""
    return " ".join(str(text).split()).replace("|", "&#124;")


def service_registry():
    """The workstations service's Prometheus registry, as the service makes it (no database is
    opened: the service's tables are made on first use)."""
    from traitlets.config import Config

    from kubevirt_spawner.service.core import Workstations
    config = Config()
    config.Workstations.ssh_keys_db_url = "sqlite://"
    return Workstations(hub=None, config=config, log=logging.getLogger("docs")).registry


def _label_names(registry) -> dict[str, tuple[str, ...]]:
    """Each metric's label names. A family from collect() has its labels only in its samples, and
    a metric without children has none; prometheus_client keeps the names on each collector (the
    wrapper's or the custom family's `_labelnames`) without a public accessor."""
    out: dict[str, tuple[str, ...]] = {}
    collectors = [*registry._collector_to_names, *getattr(registry, "_collectors_without_names", [])]
    for collector in collectors:
        for family in collector.collect():
            out[family.name] = tuple(getattr(collector, "_labelnames", None) or getattr(family, "_labelnames", ()))
    return out


SAMPLES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",), "summary": ("_sum", "_count")}


def metrics() -> str:
    registry = service_registry()
    labels = _label_names(registry)
    out = ["# Metrics", "",
           "Generated from the code by `python docs/generate.py`: the metrics from the workstations service's "
           "Prometheus registry, the alerts from `deploy/guardrails/prometheus-rules.yaml`; a test fails when this "
           "page and the code differ.", "",
           "The workstations service serves them at `/services/workstations/metrics` to admins and to tokens with "
           "the scope `read:metrics` ([Metrics, alerts and logs](admin/monitoring.md) has the scrape). JupyterHub's "
           "own metrics, at `/hub/metrics`, have the starts: a failed start's `reason` label is one of "
           "[Failures](failures.md).", "",
           "| Metric | Type | Labels | What it counts |", "| --- | --- | --- | --- |"]
    for family in sorted(registry.collect(), key=lambda f: f.name):
        names = ", ".join(f"`{family.name}{suffix}`" for suffix in SAMPLES[family.type])
        names_of_labels = ", ".join(f"`{name}`" for name in labels[family.name]) or "none"
        out.append(f"| {names} | {family.type} | {names_of_labels} | {_cell(family.documentation)} |")
    out += ["", "## Alerts", "",
            "`deploy/guardrails/prometheus-rules.yaml`, a PrometheusRule of the Prometheus Operator (the runbook's "
            "[step 9](deploy/README.md#9-guard-rails-and-alerts) renders and applies it; `${...}` are the "
            "settings of `deploy/settings.env`).", "",
            "| Alert | Severity | After | Summary | What to do |", "| --- | --- | --- | --- | --- |"]
    records = []
    for group in yaml.safe_load(RULES.read_text())["spec"]["groups"]:
        for rule in group["rules"]:
            if "record" in rule:
                records.append(rule["record"])
                continue
            notes = rule.get("annotations") or {}
            out.append(f"| `{rule['alert']}` | {rule['labels']['severity']} | {rule.get('for', 'at once')} | "
                       f"{_cell(notes.get('summary', ''))} | {_cell(notes.get('description', ''))} |")
    out += ["", "Recording rules the alerts read: " + ", ".join(f"`{name}`" for name in records) + "."]
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------ the REST API
def openapi() -> dict:
    return yaml.safe_load((DOCS / "openapi.yaml").read_text())


def _ref_name(ref: str) -> str:
    return ref.rsplit("/", 1)[1]


def _type(schema: dict) -> str:
    """A schema in a few words, a named one as a link to its section."""
    if "$ref" in schema:
        name = _ref_name(schema["$ref"])
        return f"[{name}](#{name.lower()})"
    if "oneOf" in schema or "allOf" in schema:
        parts = schema.get("oneOf") or schema.get("allOf")
        return (" or " if "oneOf" in schema else " and ").join(_type(p) for p in parts)
    kinds = schema.get("type", "object")
    kinds = kinds if isinstance(kinds, list) else [kinds]
    words = []
    for kind in kinds:
        if kind == "array" and "items" in schema:
            words.append(f"array of {_type(schema['items'])}")
        elif kind == "object" and "properties" in schema:
            words.append("object with " + ", ".join(f"`{name}`" for name in schema["properties"]))
        else:
            words.append(str(kind))
    text = " or ".join(words)
    if "enum" in schema:
        text += ": " + ", ".join(f"`{value}`" for value in schema["enum"] if value is not None)
    if "default" in schema:
        text += f" (default `{json.dumps(schema['default'])}`)"
    return text


def _resolve(doc: dict, item: dict) -> dict:
    while "$ref" in item:
        node = doc
        for part in item["$ref"].lstrip("#/").split("/"):
            node = node[part]
        item = node
    return item


def _operations(doc: dict):
    """(method, path, operation, path parameters) in the document's order. A named server's path
    whose operation is its default server's (a YAML alias) is shown with it, the path as
    `/workstations/{user}[/servers/{server}]/...`."""
    found = [(method, path, item[method], item.get("parameters", [])) for path, item in doc["paths"].items()
             for method in ("get", "post", "put", "patch", "delete") if method in item]
    by_path = {(method, path): operation for method, path, operation, _ in found}
    for method, path, operation, params in found:
        default = path.replace("/servers/{server}", "", 1)
        if default != path and by_path.get((method, default)) is operation:
            continue  # shown with its default server's
        named = path.replace("/{user}", "/{user}/servers/{server}", 1)
        if named != path and by_path.get((method, named)) is operation:
            path = path.replace("/{user}", "/{user}[/servers/{server}]", 1)
            params = doc["paths"][named].get("parameters", [])
        yield method, path, operation, params


def _body_table(doc: dict, body: dict) -> list[str]:
    media = body["content"]["application/json"]
    schema = _resolve(doc, media["schema"])
    required = set(schema.get("required", []))
    out = ["| Field | Type | Required | Description |", "| --- | --- | --- | --- |"]
    for name, prop in schema.get("properties", {}).items():
        out.append(f"| `{name}` | {_cell(_type(prop))} | {'yes' if name in required else 'no'} | "
                   f"{_cell(prop.get('description', ''))} |")
    if "example" in media:
        out += ["", "```json", json.dumps(media["example"]), "```"]
    return out


def api() -> str:
    doc = openapi()
    info = doc["info"]
    server = doc["servers"][0]
    out = ["# REST API reference", "",
           "Generated by `python docs/generate.py` from [`openapi.yaml`](openapi.yaml), the OpenAPI document of the "
           "workstations service; `tests/test_openapi.py` fails when the document and the service's routes, "
           "methods, request bodies or error answers disagree.", "",
           _cell(info["description"]), "",
           f"Every path is under `{server['url']}` ({{hub}}: {_cell(server['variables']['hub']['description'])})",
           "", "## Authentication", ""]
    for name, scheme in doc["components"]["securitySchemes"].items():
        out.append(f"- **{name}** ({scheme['in']} `{scheme['name']}`): {_cell(scheme['description'])}")
    out += ["", "## Errors", "",
            "Every error is the JSON object [Error](#error), `{\"error\": \"<one sentence>\"}`, with one of these "
            "statuses; nothing is changed.", "", "| Status | When |", "| --- | --- |"]
    statuses: dict[str, str] = {}
    for _, _, operation, _ in _operations(doc):
        for status, response in operation["responses"].items():
            if status[0] in "45" and "$ref" in response:
                statuses.setdefault(status, _resolve(doc, response)["description"])
    out += [f"| {status} | {_cell(text)} |" for status, text in sorted(statuses.items())]
    out += ["", "## Endpoints", ""]
    for method, path, operation, path_params in _operations(doc):
        out += [f"### {operation['summary']}", "", f"`{method.upper()} {path}`", "",
                _cell(operation.get("description", "")), ""]
        params = [_resolve(doc, p) for p in [*path_params, *operation.get("parameters", [])]]
        if params:
            out += ["| Parameter | In | Type | Description |", "| --- | --- | --- | --- |"]
            out += [f"| `{p['name']}` | {p['in']} | {_cell(_type(p['schema']))} | {_cell(p.get('description', ''))} |"
                    for p in params]
            out.append("")
        if "requestBody" in operation:
            out += ["Request body (JSON):", ""] + _body_table(doc, operation["requestBody"]) + [""]
        out += ["| Status | Answer |", "| --- | --- |"]
        errors = []
        for status, response in operation["responses"].items():
            if status[0] in "45":
                errors.append(status)
                continue
            resolved = _resolve(doc, response)
            kinds = [_type(content["schema"]) if media == "application/json" else f"`{media}`"
                     for media, content in (resolved.get("content") or {}).items()]
            answer = resolved["description"] + (f" ({', '.join(kinds)})" if kinds else "")
            out.append(f"| {status} | {_cell(answer)} |")
        out += [f"| {', '.join(errors)} | [Error](#error), as in [Errors](#errors) |", ""]
    out += ["## Schemas", ""]
    for name, schema in doc["components"]["schemas"].items():
        out += [f"### {name}", ""]
        if schema.get("description"):
            out += [_cell(schema["description"]), ""]
        parts = schema.get("allOf", [schema])
        props = {}
        for part in parts:
            if "$ref" in part:
                out += [f"{_type(part)}, and:", ""]
            else:
                props.update(part.get("properties", {}))
        if props:
            out += ["| Field | Type | Description |", "| --- | --- | --- |"]
            out += [f"| `{p}` | {_cell(_type(s))} | {_cell(s.get('description', ''))} |" for p, s in props.items()]
            out.append("")
    return "\n".join(out).rstrip() + "\n"


PAGES = {"configuration.md": configuration, "failures.md": failures, "metrics.md": metrics, "api.md": api}


def missing_help() -> list[str]:
    """The configurable settings without help text: each needs a sentence for the reference."""
    out = []
    for module, name, _, _ in CONFIGURABLES:
        cls = _class(module, name)
        out += [f"{name}.{t}" for t, trait in settings_of(cls).items() if not _help(trait.help)]
    return out


def main() -> int:
    for page, make in PAGES.items():
        (DOCS / page).write_text(make())
        print(f"wrote {DOCS / page}")
    if missing_help():
        print("settings without help: " + ", ".join(missing_help()), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
