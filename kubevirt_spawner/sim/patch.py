"""The three patch formats the API server accepts: JSON merge, JSON (RFC 6902) and strategic merge."""

from __future__ import annotations

import copy

from ..objects import merge_patch
from .errors import ApiError, bad_request


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise bad_request(f'json patch path "{path}" must start with "/"')
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _resolve(doc, parts: list[str], path: str):
    cur = doc
    for p in parts:
        if isinstance(cur, dict) and p in cur:
            cur = cur[p]
        elif isinstance(cur, list) and p.isdigit() and int(p) < len(cur):
            cur = cur[int(p)]
        else:
            raise _unprocessable(f"doc is missing path: {path}")
    return cur


def _unprocessable(message: str) -> ApiError:
    return ApiError(422, "Invalid", message)


def _add(doc, parts, value, path):
    parent = _resolve(doc, parts[:-1], path)
    last = parts[-1]
    if isinstance(parent, dict):
        parent[last] = value
    elif isinstance(parent, list):
        if last == "-":
            parent.append(value)
        elif last.isdigit() and int(last) <= len(parent):
            parent.insert(int(last), value)
        else:
            raise _unprocessable(f"add operation does not apply: doc is missing path: {path}")
    else:
        raise _unprocessable(f"add operation does not apply: doc is missing path: {path}")


def _remove(doc, parts, path):
    parent = _resolve(doc, parts[:-1], path)
    last = parts[-1]
    if isinstance(parent, dict) and last in parent:
        return parent.pop(last)
    if isinstance(parent, list) and last.isdigit() and int(last) < len(parent):
        return parent.pop(int(last))
    raise _unprocessable(f"remove operation does not apply: doc is missing path: {path}")


def json_patch(doc, operations):
    """RFC 6902, including `test`; a failed test is a 422 whose message says `testing value`."""
    if not isinstance(operations, list):
        raise bad_request("json patch must be a list of operations")
    doc = copy.deepcopy(doc)
    for op in operations:
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise bad_request(f"invalid json patch operation: {op!r}")
        kind, path = op["op"], op["path"]
        parts = _pointer(path)
        if kind == "test":
            if _resolve(doc, parts, path) != op.get("value"):
                raise _unprocessable(f"the server rejected our request due to an error in our request: "
                                     f"testing value {path} failed: test failed")
        elif kind == "add":
            if not parts:
                doc = copy.deepcopy(op.get("value"))
            else:
                _add(doc, parts, copy.deepcopy(op.get("value")), path)
        elif kind == "remove":
            _remove(doc, parts, path)
        elif kind == "replace":
            if not parts:
                doc = copy.deepcopy(op.get("value"))
                continue
            _resolve(doc, parts, path)
            _remove(doc, parts, path)
            _add(doc, parts, copy.deepcopy(op.get("value")), path)
        elif kind in ("move", "copy"):
            src = op.get("from", "")
            value = _resolve(doc, _pointer(src), src)
            if kind == "move":
                _remove(doc, _pointer(src), src)
            _add(doc, parts, copy.deepcopy(value), path)
        else:
            raise bad_request(f"unknown json patch operation {kind!r}")
    return doc


# Merge keys of the core list fields the simulator's kinds carry, as in the Go struct tags
# (patchMergeKey). Lists not named here are replaced whole, as for atomic lists upstream.
MERGE_KEYS = {
    "containers": "name", "initContainers": "name", "volumes": "name", "env": "name",
    "volumeMounts": "mountPath", "ports": "port", "conditions": "type", "finalizers": None,
    "ownerReferences": "uid", "imagePullSecrets": "name", "subsets": None, "tolerations": None,
}


def strategic_merge_patch(target, patch):
    """Strategic merge patch for the core kinds, as `kubectl` and the Python client send it.

    Maps merge like JSON merge patch; lists with a known merge key merge element by element;
    `$patch: replace|delete`, `$retainKeys`, `$setElementOrder/...` and `$deleteFromPrimitiveList/...`
    directives are honoured.
    """
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    if patch.get("$patch") == "delete":
        return None
    result = dict(target) if isinstance(target, dict) else {}
    retain = patch.get("$retainKeys")
    for key, value in patch.items():
        if key.startswith("$setElementOrder/") or key in ("$retainKeys", "$patch"):
            continue
        if key.startswith("$deleteFromPrimitiveList/"):
            name = key.split("/", 1)[1]
            result[name] = [v for v in result.get(name) or [] if v not in value]
            continue
        if value is None:
            result.pop(key, None)
        elif isinstance(value, list) and isinstance(result.get(key), list) and key in MERGE_KEYS:
            result[key] = _merge_list(result[key], value, MERGE_KEYS[key])
        else:
            result[key] = strategic_merge_patch(result.get(key), value)
    if retain is not None:
        result = {k: v for k, v in result.items() if k in retain}
    return result


def _merge_list(current: list, patch: list, merge_key: str | None) -> list:
    if merge_key is None:
        # A list of primitives with set semantics (finalizers) merges as a union.
        if all(not isinstance(v, dict) for v in patch):
            return list(current) + [v for v in patch if v not in current]
        return copy.deepcopy(patch)
    result = copy.deepcopy(current)
    for item in patch:
        if not isinstance(item, dict) or merge_key not in item:
            return copy.deepcopy(patch)
        index = next((i for i, c in enumerate(result)
                      if isinstance(c, dict) and c.get(merge_key) == item[merge_key]), None)
        if item.get("$patch") == "delete":
            if index is not None:
                result.pop(index)
        elif index is None:
            result.append({k: v for k, v in copy.deepcopy(item).items() if k != "$patch"})
        else:
            result[index] = strategic_merge_patch(result[index], item)
    return result


def apply_patch(content_type: str, target: dict, body) -> dict:
    ct = (content_type or "").split(";")[0].strip()
    if ct == "application/json-patch+json":
        return json_patch(target, body)
    if ct == "application/merge-patch+json":
        return merge_patch(target, body)
    if ct == "application/strategic-merge-patch+json":
        return strategic_merge_patch(target, body)
    raise ApiError(415, "UnsupportedMediaType", 'the body of the request was in an unknown format - '
                   'accepted media types include: application/json-patch+json, application/merge-patch+json, '
                   'application/strategic-merge-patch+json')
