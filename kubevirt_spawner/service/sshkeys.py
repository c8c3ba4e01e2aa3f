"""Users' SSH public keys, kept by the workstations service for all of a user's workstations.

A key is checked as OpenSSH would take it from a `.pub` file (`TYPE BASE64 [COMMENT]`): a type
current OpenSSH accepts by default, a blob that is that type's key, an RSA modulus of at least
2048 bits, a comment of printable characters. Keys live in a table of their own in the hub's
database (`c.Workstations.ssh_keys_db_url`, by default the hub's own `db_url`): they belong to the
JupyterHub account, not to a machine, so a reset or a new workstation keeps them, nothing is
written to a disk, and a removed key is refused at the next login (the guest's sshd asks the
service at every login: `guest/keys.py`). Each key records the account's creation time: the keys
of an earlier account of the same name are never the new account's.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
import struct
import threading
from dataclasses import dataclass
from datetime import datetime, timezone

import sqlalchemy as sa
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.serialization import load_ssh_public_key

# The key types OpenSSH 9 accepts by default (ssh-dss is off since 7.0, gone in 10.0), FIDO
# security keys (sk-*) included.
KEY_TYPES = ("ssh-ed25519", "ecdsa-sha2-nistp256", "ecdsa-sha2-nistp384", "ecdsa-sha2-nistp521", "ssh-rsa",
             "sk-ssh-ed25519@openssh.com", "sk-ecdsa-sha2-nistp256@openssh.com")
MIN_RSA_BITS = 2048  # NIST SP 800-131A; OpenSSH's own floor (RequiredRSASize) is 1024
MAX_KEY_CHARS = 16 * 1024  # an RSA 16384-bit key (OpenSSH's largest) is about 2.8 KB
MAX_COMMENT_CHARS = 200
MAX_KEYS_PER_USER = 50


class BadKey(ValueError):
    """A key that is not one: one sentence for the user (HTTP 400)."""


class KeyConflict(ValueError):
    """A key the account has already, or one more than it may keep: one sentence (HTTP 409)."""


@dataclass(frozen=True)
class PublicKey:
    type: str
    blob: bytes
    comment: str

    @property
    def fingerprint(self) -> str:
        """As `ssh-keygen -l` prints it: SHA256 of the blob, base64 without padding."""
        return "SHA256:" + base64.b64encode(hashlib.sha256(self.blob).digest()).decode().rstrip("=")

    @property
    def line(self) -> str:
        """The authorized_keys line (no options)."""
        text = f"{self.type} {base64.b64encode(self.blob).decode()}"
        return f"{text} {self.comment}" if self.comment else text


def parse_public_key(text: object) -> PublicKey:
    """The key in `text` (one line, as a .pub file holds it), or BadKey with what is wrong."""
    if not isinstance(text, str) or not text.strip():
        raise BadKey('"key" is an SSH public key, as the .pub file ssh-keygen writes holds it.')
    if len(text) > MAX_KEY_CHARS:
        raise BadKey(f"The key is longer than {MAX_KEY_CHARS // 1024} KiB: no SSH public key is.")
    text = text.strip()
    if "\n" in text or "\r" in text:
        raise BadKey("Give one key, on one line.")
    parts = text.split(None, 2)
    kind = parts[0]
    if kind not in KEY_TYPES:
        if len(parts) > 1 and parts[1] in KEY_TYPES or "=" in kind or "," in kind:
            raise BadKey("Give the key alone, as ssh-keygen writes it: no options (command=, from=...) before it.")
        raise BadKey(f"{_shown(kind)} is not a key type OpenSSH accepts; use one of {', '.join(KEY_TYPES)} "
                        "(ssh-keygen -t ed25519 makes one).")
    if len(parts) < 2:
        raise BadKey(f"The {kind} key has no key data after its type.")
    try:
        blob = base64.b64decode(parts[1], validate=True)
    except (binascii.Error, ValueError):
        raise BadKey(f"The {kind} key's data is not base64.") from None
    comment = parts[2].strip() if len(parts) > 2 else ""
    if len(comment) > MAX_COMMENT_CHARS or any(not ch.isprintable() for ch in comment):
        raise BadKey(f"The key's comment must be printable text of at most {MAX_COMMENT_CHARS} characters.")
    _check_blob(kind, blob)
    return PublicKey(kind, blob, comment)


def _check_blob(kind: str, blob: bytes) -> None:
    fields = _ssh_strings(blob)
    if not fields:
        raise BadKey(f"The {kind} key's data is cut short or is no SSH key: copy the whole line of the .pub file.")
    if fields[0] != kind.encode():
        raise BadKey(f"The key's data is a {_shown(fields[0])} key, not a {kind} key.")
    if kind.startswith("sk-"):  # (cryptography loads no security keys: OpenSSH's PROTOCOL.u2f layout)
        expected = {"sk-ssh-ed25519@openssh.com": 3, "sk-ecdsa-sha2-nistp256@openssh.com": 4}[kind]
        if len(fields) != expected or (kind.startswith("sk-ssh-ed25519") and len(fields[1]) != 32) or \
                not fields[-1].startswith(b"ssh:"):
            raise BadKey(f"The {kind} key's data is not a security key's (a public key and an ssh: application).")
        return
    try:
        key = load_ssh_public_key(f"{kind} {base64.b64encode(blob).decode()}".encode())
    except (ValueError, UnsupportedAlgorithm):
        raise BadKey(f"The {kind} key's data is damaged: it is not a valid {kind} key.") from None
    if isinstance(key, rsa.RSAPublicKey) and key.key_size < MIN_RSA_BITS:
        raise BadKey(f"The RSA key has {key.key_size} bits; at least {MIN_RSA_BITS} are needed "
                        "(ssh-keygen -t ed25519 makes a smaller, stronger key).")


def _ssh_strings(blob: bytes) -> list[bytes]:
    """The length-prefixed strings of an SSH key blob (RFC 4251 section 5); [] if it is not one."""
    out, at = [], 0
    while at < len(blob):
        if at + 4 > len(blob):
            return []
        (size,) = struct.unpack(">I", blob[at:at + 4])
        if at + 4 + size > len(blob):
            return []
        out.append(blob[at + 4:at + 4 + size])
        at += 4 + size
    return out


def _shown(value: str | bytes) -> str:
    """A user's text, quoted, short and printable, for a sentence."""
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    return repr(re.sub(r"[^\x20-\x7e]", "?", text)[:40])


def normal_fingerprint(text: str) -> str:
    """A fingerprint as a user may give it: with or without "SHA256:", with or without padding."""
    text = text.strip()
    body = text[len("SHA256:"):] if text.startswith("SHA256:") else text
    return "SHA256:" + body.rstrip("=")


# ------------------------------------------------------------------------------------------ the store

METADATA = sa.MetaData()
KEYS = sa.Table(
    "kubevirt_spawner_ssh_keys", METADATA,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("user", sa.Unicode(255), nullable=False, index=True),
    # the JupyterHub account's creation time: a later account of the same name has another
    sa.Column("account_created", sa.Unicode(64), nullable=False),
    sa.Column("fingerprint", sa.Unicode(64), nullable=False),
    sa.Column("key", sa.UnicodeText, nullable=False),
    sa.Column("added", sa.Unicode(32), nullable=False),
    sa.UniqueConstraint("user", "fingerprint", name="kubevirt_spawner_ssh_keys_user_fingerprint"),
)


class KeyStore:
    """The keys table. Its calls block (the database driver): the service runs them in a thread."""

    def __init__(self, url: str):
        self.url = url
        self._engine: sa.Engine | None = None
        self._making = threading.Lock()  # (two first calls in two threads make one engine and table)

    @property
    def engine(self) -> sa.Engine:
        with self._making:
            if self._engine is None:  # (made on first use: a hub that keeps no keys gets no table)
                engine = sa.create_engine(self.url, future=True)
                METADATA.create_all(engine)
                self._engine = engine
        return self._engine

    def keys(self, user: str, account_created: str) -> list[dict]:
        """The account's keys, oldest first."""
        with self.engine.connect() as db:
            rows = db.execute(sa.select(KEYS).where(KEYS.c.user == user, KEYS.c.account_created == account_created)
                              .order_by(KEYS.c.id)).mappings().all()
        return [_view(row) for row in rows]

    def add(self, user: str, account_created: str, key: PublicKey) -> dict:
        """Add the key; an earlier account's keys of the same name are dropped first. KeyConflict when
        the account has it already or has as many keys as it may."""
        with self.engine.begin() as db:
            db.execute(sa.delete(KEYS).where(KEYS.c.user == user, KEYS.c.account_created != account_created))
            have = db.execute(sa.select(KEYS.c.fingerprint).where(KEYS.c.user == user)).scalars().all()
            if key.fingerprint in have:
                raise KeyConflict(f"You have this key already ({key.fingerprint}).")
            if len(have) >= MAX_KEYS_PER_USER:
                raise KeyConflict(f"You have {len(have)} SSH keys, the most one may keep; delete one first.")
            added = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
            db.execute(sa.insert(KEYS).values(user=user, account_created=account_created, fingerprint=key.fingerprint,
                                              key=key.line, added=added))
        return _view({"key": key.line, "fingerprint": key.fingerprint, "added": added})

    def delete(self, user: str, account_created: str, fingerprint: str) -> bool:
        """Whether the account had the key (now gone)."""
        with self.engine.begin() as db:
            done = db.execute(sa.delete(KEYS).where(KEYS.c.user == user, KEYS.c.account_created == account_created,
                                                    KEYS.c.fingerprint == normal_fingerprint(fingerprint)))
        return bool(done.rowcount)

    def close(self) -> None:
        if self._engine is not None:
            self._engine.dispose()


def _view(row) -> dict:
    key = parse_public_key(row["key"])
    return {"fingerprint": row["fingerprint"], "type": key.type, "comment": key.comment, "key": row["key"],
            "added": row["added"]}
