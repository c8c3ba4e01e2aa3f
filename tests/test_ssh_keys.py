"""Users' SSH public keys in the workstations service: what a key must be (as OpenSSH takes it
from a .pub file: PROTOCOL.key and sshkey.c's types, RFC 4251/4253's wire format, PROTOCOL.u2f
for security keys), who may read, add and delete them, and that an account made again under an
earlier account's name never gets that account's keys. Keys made here by ssh-keygen itself."""

from __future__ import annotations

import base64
import struct
import subprocess

import aiohttp
import pytest
from traitlets.config import Config

from kubevirt_spawner.service.access import Caller, ServiceError
from kubevirt_spawner.service.core import Workstations
from kubevirt_spawner.service.sshkeys import MAX_KEYS_PER_USER, BadKey, KeyStore, normal_fingerprint, parse_public_key


@pytest.fixture(scope="module")
def keygen(tmp_path_factory):
    """ssh-keygen's public keys: `keygen(type, bits)` -> (the .pub line, ssh-keygen -l's fingerprint)."""
    made: dict = {}

    def make(kind: str, bits: int | None = None, comment: str = "alice@laptop") -> tuple[str, str]:
        if (kind, bits, comment) not in made:
            path = tmp_path_factory.mktemp("keys") / "id"
            subprocess.run(["ssh-keygen", "-q", "-t", kind, *(["-b", str(bits)] if bits else []), "-N", "",
                            "-C", comment, "-f", str(path)], check=True)
            line = path.with_suffix(".pub").read_text().strip()
            fingerprint = subprocess.run(["ssh-keygen", "-l", "-E", "sha256", "-f", str(path.with_suffix(".pub"))],
                                         capture_output=True, text=True, check=True).stdout.split()[1]
            made[(kind, bits, comment)] = (line, fingerprint)
        return made[(kind, bits, comment)]
    return make


def wire(*fields: bytes) -> str:
    return base64.b64encode(b"".join(struct.pack(">I", len(f)) + f for f in fields)).decode()


@pytest.mark.parametrize("kind,bits", [("ed25519", None), ("ecdsa", 256), ("ecdsa", 521), ("rsa", 3072)])
def test_keys_ssh_keygen_makes_are_taken_with_its_fingerprint(keygen, kind, bits):
    line, fingerprint = keygen(kind, bits)
    key = parse_public_key(line + "\n")
    assert key.fingerprint == fingerprint and key.line == line and key.comment == "alice@laptop"
    assert normal_fingerprint(fingerprint[len("SHA256:"):] + "=") == fingerprint


def test_a_security_keys_public_key_is_taken():
    """sk-ssh-ed25519@openssh.com: the type, the 32-byte key, the application (PROTOCOL.u2f)."""
    line = f"sk-ssh-ed25519@openssh.com {wire(b'sk-ssh-ed25519@openssh.com', bytes(range(32)), b'ssh:')} yubikey"
    assert parse_public_key(line).type == "sk-ssh-ed25519@openssh.com"
    with pytest.raises(BadKey, match="not a security key's"):
        parse_public_key(f"sk-ssh-ed25519@openssh.com {wire(b'sk-ssh-ed25519@openssh.com', b'short', b'ssh:')}")


def bad_inputs(keygen) -> list[tuple[object, str]]:
    ed, _ = keygen("ed25519")
    rsa_small, _ = keygen("rsa", 1024)
    kind, data, comment = ed.split(" ", 2)
    return [
        (None, "is an SSH public key"),
        ("", "is an SSH public key"),
        (["ssh-ed25519"], "is an SSH public key"),
        ("x" * 20000, "longer than 16 KiB"),
        (f"{ed}\n{ed}", "one key, on one line"),
        (f'command="rm -rf /" {ed}', "no options"),
        (f"from=10.0.0.1 {ed}", "no options"),
        (f"ssh-dss {data}", "not a key type OpenSSH accepts"),
        ("hello world", "not a key type OpenSSH accepts"),
        ("ssh-ed25519", "no key data"),
        ("ssh-ed25519 not*base64!", "not base64"),
        (f"ssh-rsa {data}", "is a 'ssh-ed25519' key, not a ssh-rsa key"),  # an ed25519 blob called RSA
        (f"ssh-ed25519 {wire(b'ssh-ed25519', b'tooshort')}", "damaged"),
        (f"ssh-ed25519 {base64.b64encode(b'junk').decode()}", "cut short or is no SSH key"),
        (rsa_small, "1024 bits; at least 2048"),
        (f"{kind} {data} evil\x1b[2Jcomment", "printable"),
        (f"{kind} {data} {'c' * 300}", "at most 200"),
    ]


def test_bad_keys_are_refused_with_a_sentence(keygen):
    for text, says in bad_inputs(keygen):
        with pytest.raises(BadKey, match=says.replace("(", r"\(")):
            parse_public_key(text)


def test_the_store_keeps_an_accounts_keys_and_not_an_earlier_accounts(tmp_path, keygen):
    store = KeyStore(f"sqlite:///{tmp_path / 'hub.sqlite'}")
    one = parse_public_key(keygen("ed25519")[0])
    two = parse_public_key(keygen("ecdsa", 256)[0])
    store.add("alice", "2026-01-01", one)
    store.add("alice", "2026-01-01", two)
    assert [k["fingerprint"] for k in store.keys("alice", "2026-01-01")] == [one.fingerprint, two.fingerprint]
    assert store.keys("bob", "2026-01-01") == []
    # alice deleted and made again: a new account, none of the old one's keys
    assert store.keys("alice", "2026-06-01") == []
    assert not store.delete("alice", "2026-06-01", one.fingerprint)
    store.add("alice", "2026-06-01", two)  # (and the old account's keys go)
    assert store.keys("alice", "2026-01-01") == [] and len(store.keys("alice", "2026-06-01")) == 1
    assert store.delete("alice", "2026-06-01", two.fingerprint[len("SHA256:"):])  # ssh-keygen's form or without
    assert store.keys("alice", "2026-06-01") == []
    store.close()
    # the table is in the database, so a restarted service finds the keys
    store.add("carol", "t", one)
    again = KeyStore(store.url)
    assert again.keys("carol", "t")[0]["key"] == one.line


class FakeHub:
    down = False

    def __init__(self):
        self.users = {"alice": {"name": "alice", "created": "2026-01-01T00:00:00Z"},
                      "bob": {"name": "bob", "created": "2026-01-02T00:00:00Z"}}

    async def user(self, name):
        if self.down:
            raise aiohttp.ClientConnectionError("Cannot connect to host hub:8081")
        return self.users.get(name)


@pytest.fixture
def core(tmp_path):
    service = Workstations(hub=FakeHub(), ssh_keys_db_url=f"sqlite:///{tmp_path / 'keys.sqlite'}")
    yield service
    service.keystore.close()


ALICE = Caller("alice", False)
ALICE_SERVER = Caller("alice", False, frozenset({"alice/"}))  # the workstation's own token
BOB = Caller("bob", False)
ADMIN = Caller("root", True)


async def test_who_may_read_add_and_delete_keys(core, keygen):
    line, fingerprint = keygen("ed25519")
    added = await core.add_ssh_key(ALICE, "alice", line)
    assert added["fingerprint"] == fingerprint and added["type"] == "ssh-ed25519"
    # her workstation's sshd asks with the server's own token; admins see them too
    for caller in (ALICE, ALICE_SERVER, ADMIN):
        assert [k["key"] for k in (await core.ssh_keys(caller, "alice"))["ssh_keys"]] == [line]
    refusals = [
        (core.ssh_keys(BOB, "alice"), 403, "your own workstations"),
        (core.add_ssh_key(ALICE_SERVER, "alice", keygen("ecdsa", 256)[0]), 403, "workstation's own token may not add"),
        (core.add_ssh_key(BOB, "alice", keygen("ecdsa", 256)[0]), 403, "your own SSH keys"),
        (core.add_ssh_key(ADMIN, "alice", keygen("ecdsa", 256)[0]), 403, "your own SSH keys"),
        (core.delete_ssh_key(ALICE_SERVER, "alice", fingerprint), 403, "may not delete"),
        (core.delete_ssh_key(BOB, "alice", fingerprint), 403, "your own SSH keys"),
        (core.add_ssh_key(ALICE, "alice", line), 409, "have this key already"),
        (core.add_ssh_key(ALICE, "alice", "ssh-dss AAAA"), 400, "not a key type"),
        (core.delete_ssh_key(ALICE, "alice", "SHA256:nosuchkey"), 404, "no SSH key with the fingerprint"),
        (core.ssh_keys(ADMIN, "nobody"), 404, "JupyterHub has no user nobody"),
    ]
    for call, status, says in refusals:
        with pytest.raises(ServiceError, match=says) as refused:
            await call
        assert refused.value.status == status
    assert len((await core.ssh_keys(ALICE, "alice"))["ssh_keys"]) == 1  # nothing changed
    # an admin may take a key away (a lost laptop)
    assert await core.delete_ssh_key(ADMIN, "alice", fingerprint) == {"deleted": fingerprint}
    assert (await core.ssh_keys(ALICE, "alice"))["ssh_keys"] == []


async def test_an_account_made_again_does_not_inherit_keys(core, keygen):
    """The hub deletes alice and someone registers the name again: the new account (another
    `created`) sees none of the old account's keys, so none of them opens the new workstations."""
    await core.add_ssh_key(ALICE, "alice", keygen("ed25519")[0])
    core.hub.users["alice"] = {"name": "alice", "created": "2026-09-09T00:00:00Z"}
    assert (await core.ssh_keys(ALICE, "alice"))["ssh_keys"] == []


async def test_a_user_keeps_at_most_so_many_keys(core, keygen):
    blob = parse_public_key(keygen("ed25519")[0]).blob
    for n in range(MAX_KEYS_PER_USER):
        other = wire(b"ssh-ed25519", bytes([n]) * 32)
        await core.add_ssh_key(ALICE, "alice", f"ssh-ed25519 {other} k{n}")
    with pytest.raises(ServiceError, match="the most one may keep") as refused:
        await core.add_ssh_key(ALICE, "alice", f"ssh-ed25519 {base64.b64encode(blob).decode()}")
    assert refused.value.status == 409


def test_the_keys_database_is_the_hubs_by_default():
    c = Config()
    c.JupyterHub.db_url = "postgresql://hub@db/jupyterhub"
    assert Workstations(hub=None, config=c).ssh_keys_db_url == "postgresql://hub@db/jupyterhub"
    assert Workstations(hub=None).ssh_keys_db_url == "sqlite:///jupyterhub.sqlite"


async def test_a_hub_that_does_not_answer_is_a_sentence(core):
    core.hub.down = True
    with pytest.raises(ServiceError, match="The hub does not answer") as refused:
        await core.ssh_keys(ALICE, "alice")
    assert refused.value.status == 503

