"""Validation of KubeVirt, CDI and snapshot objects against the upstream schemas.

The schemas are data from the upstream projects (see `shared/schemas/README.md`) and stay outside
this project: they are read from `$KUBEVIRT_SCHEMAS_DIR`, else from `../shared/schemas` beside a
source checkout. Like the API server, a create or update is checked against the CRD's
`openAPIV3Schema`; unknown fields are pruned (reported as warnings) or, with
`fieldValidation=Strict`, refused. Without the schemas the simulator still runs, and KubeVirt/CDI
objects are checked by its own admission rules only.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import jsonschema
import yaml

# kind -> (file, how to reach openAPIV3Schema inside it)
SCHEMA_FILES = {
    "VirtualMachine": ("kubevirt/virtualmachine.openapiv3.yaml", None),
    "VirtualMachineInstance": ("kubevirt/virtualmachineinstance.openapiv3.yaml", None),
    "VirtualMachineSnapshot": ("kubevirt/virtualmachinesnapshot.openapiv3.yaml", None),
    "VirtualMachineSnapshotContent": ("kubevirt/virtualmachinesnapshotcontent.openapiv3.yaml", None),
    "VirtualMachineRestore": ("kubevirt/virtualmachinerestore.openapiv3.yaml", None),
    "DataVolume": ("cdi/datavolume.crd.yaml", "crd"),
    # (not served with validation by the simulator: deploy/'s manifests are checked against them)
    "KubeVirt": ("kubevirt/kubevirt.openapiv3.yaml", None),
    "CDI": ("cdi/cdi.crd.yaml", "crd"),
    "CDIConfig": ("cdi/cdiconfig.crd.yaml", "crd"),
    "StorageProfile": ("cdi/storageprofile.crd.yaml", "crd"),
}


class SchemaError(Exception):
    pass


def schema_not_found_message() -> str:
    return ("the upstream KubeVirt/CDI API schemas were not found ($KUBEVIRT_SCHEMAS_DIR, or shared/schemas beside "
            "the source checkout): KubeVirt and CDI objects are checked by the simulator's own admission rules only")


def schemas_dir() -> Path | None:
    """`$KUBEVIRT_SCHEMAS_DIR`, else `shared/schemas` beside the source checkout, else None."""
    env = os.environ.get("KUBEVIRT_SCHEMAS_DIR")
    if env:
        return Path(env)
    checkout = Path(__file__).resolve().parents[2]  # .../<checkout>/kubevirt_spawner/sim/schema.py
    candidate = checkout.parent / "shared" / "schemas"
    if (checkout / "pyproject.toml").is_file() and candidate.is_dir():
        return candidate
    return None


def _to_jsonschema(node):
    """OpenAPI v3 structural schema -> JSON Schema: `nullable` becomes a null type and
    `x-kubernetes-int-or-string` accepts both kinds."""
    if isinstance(node, list):
        return [_to_jsonschema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _to_jsonschema(v) for k, v in node.items() if k != "description"}
    if out.get("x-kubernetes-int-or-string") and "anyOf" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if out.pop("nullable", False) and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


class KindSchema:
    def __init__(self, raw: dict):
        self.raw = raw
        self.validator = jsonschema.Draft4Validator(_to_jsonschema(raw))

    def unknown_fields(self, obj, node=None, path="") -> list[str]:
        """Paths of fields the schema does not declare (what the API server prunes)."""
        node = self.raw if node is None else node
        found: list[str] = []
        if isinstance(obj, dict) and isinstance(node, dict):
            if node.get("x-kubernetes-preserve-unknown-fields"):
                return found
            props = node.get("properties")
            extra = node.get("additionalProperties")
            for key, value in obj.items():
                sub_path = f"{path}.{key}" if path else key
                if props is not None and key in props:
                    found += self.unknown_fields(value, props[key], sub_path)
                elif isinstance(extra, dict):
                    found += self.unknown_fields(value, extra, sub_path)
                elif props is not None and path != "metadata" and extra is not True:
                    found.append(sub_path)
        elif isinstance(obj, list) and isinstance(node, dict) and isinstance(node.get("items"), dict):
            for i, item in enumerate(obj):
                found += self.unknown_fields(item, node["items"], f"{path}[{i}]")
        return found

    def errors(self, obj: dict) -> list[dict]:
        causes = []
        for err in sorted(self.validator.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path))):
            field = _field_path(err.absolute_path)
            if err.validator == "required":
                missing = err.message.split("'")[1] if "'" in err.message else ""
                causes.append({"field": f"{field}.{missing}".lstrip("."), "message": "Required value",
                               "reason": "FieldValueRequired"})
            elif err.validator == "enum":
                allowed = ", ".join(f'"{v}"' for v in err.validator_value)
                causes.append({"field": field, "reason": "FieldValueNotSupported",
                               "message": f'Unsupported value: "{err.instance}": supported values: {allowed}'})
            elif err.validator == "type":
                expected = err.validator_value if isinstance(err.validator_value, str) else err.validator_value[0]
                causes.append({"field": field, "reason": "FieldValueTypeInvalid",
                               "message": f'Invalid value: "{_json_type(err.instance)}": {field} in body must be '
                                          f"of type {expected}: \"{_json_type(err.instance)}\""})
            else:
                causes.append({"field": field, "reason": "FieldValueInvalid",
                               "message": f"Invalid value: {err.instance!r}: {err.message}"})
        return causes


def _field_path(parts) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def _json_type(value) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
            dict: "object", type(None): "null"}[type(value)]


@functools.lru_cache(maxsize=None)
def _load(directory: str, kind: str) -> KindSchema:
    rel, layout = SCHEMA_FILES[kind]
    with open(os.path.join(directory, rel)) as f:
        doc = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    if layout == "crd":  # the version the API server stores
        doc = next(v for v in doc["spec"]["versions"] if v.get("storage"))["schema"]
    return KindSchema(doc["openAPIV3Schema"])


class SchemaRegistry:
    """The upstream schemas, when there are any. A folder that was named (the argument or
    `$KUBEVIRT_SCHEMAS_DIR`) must hold them; none found otherwise means no schema checks."""

    def __init__(self, directory: str | Path | None = None):
        found = Path(directory) if directory else schemas_dir()
        self.directory = str(found) if found else None
        if self.directory is not None and not os.path.isdir(os.path.join(self.directory, "kubevirt")):
            raise SchemaError(f"{self.directory} does not hold the upstream schemas (kubevirt/, cdi/)")

    @property
    def available(self) -> bool:
        return self.directory is not None

    def for_kind(self, kind: str) -> KindSchema | None:
        if self.directory is None or kind not in SCHEMA_FILES:
            return None
        return _load(self.directory, kind)
