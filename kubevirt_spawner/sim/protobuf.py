"""Protobuf request bodies, for the few kinds whose `kubectl create` generators send them.

kubectl sends `application/vnd.kubernetes.protobuf` for `kubectl create namespace`, `create
serviceaccount`, `create configmap`, `create secret generic` and `create token`, and the
DeleteOptions of its deletes (`kubectl drain --disable-eviction` deletes each pod with one). The
envelope is the magic `k8s\\0` followed by a
runtime.Unknown (staging/src/k8s.io/apimachinery/pkg/runtime/types.go: typeMeta = 1, raw = 2),
whose `raw` is the object in the field numbers of its generated.proto. Only the fields those
generators fill are decoded; anything else is refused as an unsupported media type.
"""

from __future__ import annotations

import base64

from . import errors

MAGIC = b"k8s\x00"

# field number -> (JSON name, type); a type is "string", "int64", "bool", a nested schema (dict),
# or ("repeated", type) / ("map",) for map<string, string> entries / ("map", "bytes") for
# map<string, bytes> (base64 in JSON).
_OBJECT_META = {1: ("name", "string"), 2: ("generateName", "string"), 3: ("namespace", "string"),
                11: ("labels", ("map",)), 12: ("annotations", ("map",))}
_TYPE_META = {1: ("apiVersion", "string"), 2: ("kind", "string")}
_UNKNOWN = {1: ("typeMeta", _TYPE_META), 2: ("raw", "bytes"), 3: ("contentEncoding", "string"),
            4: ("contentType", "string")}
_BOUND_OBJECT_REF = {1: ("kind", "string"), 2: ("apiVersion", "string"), 3: ("name", "string"),
                     4: ("uid", "string")}
SCHEMAS: dict[str, dict] = {
    "Namespace": {1: ("metadata", _OBJECT_META)},
    "ServiceAccount": {1: ("metadata", _OBJECT_META), 4: ("automountServiceAccountToken", "bool")},
    # (binaryData, field 3, holds files that are not UTF-8: refused below, not decoded)
    "ConfigMap": {1: ("metadata", _OBJECT_META), 2: ("data", ("map",)), 4: ("immutable", "bool")},
    # (staging/src/k8s.io/api/core/v1/generated.proto: data = 2, type = 3, immutable = 5)
    "Secret": {1: ("metadata", _OBJECT_META), 2: ("data", ("map", "bytes")), 3: ("type", "string"),
               5: ("immutable", "bool")},
    # (staging/src/k8s.io/apimachinery/pkg/apis/meta/v1/generated.proto)
    "DeleteOptions": {1: ("gracePeriodSeconds", "int64"), 2: ("preconditions", {1: ("uid", "string"),
                                                                                 2: ("resourceVersion", "string")}),
                      3: ("orphanDependents", "bool"), 4: ("propagationPolicy", "string"),
                      5: ("dryRun", ("repeated", "string"))},
    "TokenRequest": {1: ("metadata", _OBJECT_META),
                     2: ("spec", {1: ("audiences", ("repeated", "string")), 3: ("boundObjectRef", _BOUND_OBJECT_REF),
                                  4: ("expirationSeconds", "int64")})},
}


def _unsupported(what: str) -> errors.ApiError:
    return errors.ApiError(415, "UnsupportedMediaType", f"the simulator decodes protobuf bodies of Namespace, "
                           f"ServiceAccount, ConfigMap, Secret, TokenRequest and DeleteOptions only, not {what}; send JSON or YAML")


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data):
            raise errors.bad_request("the protobuf body is truncated")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def _fields(data: bytes):
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        value: int | bytes
        if wire == 0:
            value, pos = _varint(data, pos)
        elif wire == 2:
            size, pos = _varint(data, pos)
            value, pos = data[pos:pos + size], pos + size
        elif wire == 1:
            value, pos = data[pos:pos + 8], pos + 8
        elif wire == 5:
            value, pos = data[pos:pos + 4], pos + 4
        else:
            raise errors.bad_request(f"the protobuf body has an unknown wire type {wire}")
        yield number, value


def _decode(data: bytes, schema: dict) -> dict:
    out: dict = {}
    for number, value in _fields(data):
        if number not in schema:
            continue  # a field the generators leave empty
        name, kind = schema[number]
        if isinstance(kind, dict):
            out[name] = _decode(value, kind)
        elif kind == "string":
            out[name] = value.decode()
        elif kind == "bytes":
            out[name] = value
        elif kind == "int64":  # (two's complement in ten bytes when negative)
            out[name] = value - (1 << 64) if value >= 1 << 63 else value
        elif kind == "bool":
            out[name] = bool(value)
        elif kind[0] == "repeated":
            out.setdefault(name, []).append(value.decode())
        elif kind[0] == "map":
            entry = _decode(value, {1: ("key", "string"), 2: ("value", kind[1] if len(kind) > 1 else "string")})
            item = entry.get("value", b"" if len(kind) > 1 else "")
            out.setdefault(name, {})[entry.get("key", "")] = \
                base64.b64encode(item).decode() if isinstance(item, bytes) else item
    return out


def decode(body: bytes) -> dict:
    """The JSON form of a protobuf-encoded object of one of the kinds in SCHEMAS."""
    if not body.startswith(MAGIC):
        raise errors.bad_request("the protobuf body does not start with the Kubernetes magic number")
    envelope = _decode(body[len(MAGIC):], _UNKNOWN)
    type_meta = envelope.get("typeMeta") or {}
    kind = type_meta.get("kind", "")
    if kind not in SCHEMAS or envelope.get("contentEncoding"):
        raise _unsupported(kind or "an object without a kind")
    if kind == "ConfigMap" and any(number == 3 for number, _ in _fields(envelope.get("raw", b""))):
        raise _unsupported("a ConfigMap with binaryData")
    obj = _decode(envelope.get("raw", b""), SCHEMAS[kind])
    return {"apiVersion": type_meta.get("apiVersion", "v1"), "kind": kind, **obj}
