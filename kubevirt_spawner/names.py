"""JupyterHub user and server names to collision-free Kubernetes names and label values.

A name that is already a safe slug stays as it is. Anything else becomes a sanitised stem, `---`
and a hash of the raw name. Safe slugs never contain `--`, so:
- a slug with `---` is always a hashed one (no raw name can produce it unchanged);
- `user--server` joins two slugs unambiguously (a run of exactly two dashes is the separator).
Different raw names therefore never give the same slug short of a hash collision, and the hash
(80 bits of SHA-256 in base32) makes finding one a computation nobody can afford; the spawner and
the service also act on an object only when its raw-name annotations match (`manifests.belongs_to`).
Workstations made with the earlier 32-bit hash keep their names: they are found by those annotations.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .manifests import Identity

# A DNS-1035 label (also a DNS-1123 label and a label value) without `--`: it starts with a
# letter so every object name built from it (Services included) is valid.
_SAFE = re.compile(r"^[a-z](?:[a-z0-9]|-(?!-))*(?<!-)$")
_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")

HASH_LENGTH = 16  # base32 characters: 80 bits
USER_SLUG_MAX = 30
SERVER_SLUG_MAX = 20
WORKSTATION_SLUG_MAX = 40


def _hash(*parts: str) -> str:
    # \x00 cannot occur in a user or server name, so ("a", "b") and ("a\x00b",) hash differently.
    digest = hashlib.sha256("\x00".join(parts).encode("utf-8")).digest()
    return base64.b32encode(digest).decode("ascii").lower()[:HASH_LENGTH]


def _stem(raw: str, max_length: int) -> str:
    stem = re.sub(r"[^a-z0-9]+", "-", raw.lower()).strip("-")
    if not stem or not stem[0].isalpha():
        stem = "x-" + stem if stem else "x"
    return stem[:max_length].rstrip("-")


def is_safe_slug(name: str, max_length: int = 63) -> bool:
    return 0 < len(name) <= max_length and bool(_SAFE.match(name))


def safe_slug(raw: str, max_length: int = USER_SLUG_MAX) -> str:
    """`raw` itself when it is a safe slug no longer than `max_length`, else `stem---hash`."""
    if is_safe_slug(raw, max_length):
        return raw
    return f"{_stem(raw, max_length - HASH_LENGTH - 3)}---{_hash(raw)}"


def workstation_slug(user: str, server: str = "") -> str:
    """`alice` for a default server, `alice--gpu` for the named server `gpu`."""
    user_slug = safe_slug(user, USER_SLUG_MAX)
    if not server:
        return user_slug
    joined = f"{user_slug}--{safe_slug(server, SERVER_SLUG_MAX)}"
    if len(joined) <= WORKSTATION_SLUG_MAX:
        return joined
    # Too long to join: one hash over both raw names keeps object names within 63 characters.
    return f"{_stem(user, WORKSTATION_SLUG_MAX - HASH_LENGTH - 3)}---{_hash(user, server)}"


def printable(text: object) -> str:
    """`text` with every character that is not printable (newline, carriage return, terminal
    escapes, line separators) written as its Python escape: a name a user chose cannot start a
    forged log line or hide one."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def printable_args(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Log arguments with every one but a number made `printable` (numbers keep %d and %f)."""
    return tuple(a if isinstance(a, (int, float)) or a is None else printable(a) for a in args)


class PrintableArgs(logging.Filter):
    """A logger's filter that makes the arguments of each of its lines `printable`."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = printable_args(record.args)
        return True


def confine_log_arguments(log: logging.Logger | logging.LoggerAdapter[Any]) -> None:
    """Every line `log` writes gets printable arguments (once, however often it is asked)."""
    logger = log
    while isinstance(logger, logging.LoggerAdapter):
        logger = logger.logger
    if not any(isinstance(f, PrintableArgs) for f in logger.filters):
        logger.addFilter(PrintableArgs())


def is_dns1123_label(name: str) -> bool:
    return len(name) <= 63 and bool(_DNS1123_LABEL.match(name))


def is_dns1035_label(name: str) -> bool:
    return len(name) <= 63 and bool(_DNS1035_LABEL.match(name))


def render(template: str, what: str, *, service: bool = False, **fields: str) -> str:
    """Fill a name template such as `{user_server}-rootdisk` and check the result is a valid
    object name; a template that cannot give one is a configuration error naming the setting."""
    try:
        name = template.format(**fields)
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"{what} = {template!r} is not a valid name template: unknown field {exc}; "
                         f"use {', '.join('{' + k + '}' for k in sorted(fields))}") from None
    check = is_dns1035_label if service else is_dns1123_label
    if not check(name):
        kind = "DNS-1035 label (a letter first)" if service else "DNS-1123 label"
        raise ValueError(f"{what} = {template!r} gives {name!r}, which is not a valid {kind} of at most "
                         f"63 characters")
    return name


DEFAULT_TEMPLATES = {
    "namespace": "notebook-{user}",
    "vm": "{user_server}-workstation",
    "rootdisk": "{user_server}-rootdisk",
    "workspace": "{user_server}-workspace",
    "secret": "{user_server}-hub-env",
    "service": "{user_server}-notebook",
}


def identity(user: str, server: str = "", templates: dict[str, str] | None = None,
             settings: dict[str, str] | None = None, user_created: str = "") -> "Identity":
    """The names of a new workstation's objects from the name templates ({user}, {server},
    {user_server}). `settings` maps each template to its configuration key, for error messages."""
    from .manifests import Identity  # names are the lower layer; Identity is only a record of them

    templates = {**DEFAULT_TEMPLATES, **(templates or {})}
    user_slug = safe_slug(user)
    server_slug = safe_slug(server, SERVER_SLUG_MAX) if server else ""
    slug = workstation_slug(user, server)
    fields = {"user": user_slug, "server": server_slug, "user_server": slug}
    rendered = {key: render(t, (settings or {}).get(key, key), service=key == "service", **fields) for key, t in templates.items()}
    return Identity(user=user, server=server or "", slug=slug, user_slug=user_slug, server_slug=server_slug,
                    user_created=user_created, **rendered)
