"""The golden image's sshd AuthorizedKeysCommand (kubevirt_spawner.guest.keys): what the launcher
leaves it, what it asks the workstations service, what it prints. OpenSSH runs the command for
the login's user name (%u) as AuthorizedKeysCommandUser and takes each line of its standard
output as an authorized_keys line; a non-zero exit gives no keys (sshd_config(5), OpenSSH
auth2-pubkey.c user_key_command_allowed2)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest

from kubevirt_spawner.guest import keys
from kubevirt_spawner.guest.keys import KeysError, authorized_keys, read_access, write_access

from simtools import KeysService

ED = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIE0XyWqN0+tvfGKjAzGaVH9d6HyGzm6pqUBDfvzzrBRL alice@laptop"
RSA = "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABgQC7 work"
ENV = {"JUPYTERHUB_USER": "Alice Smith", "JUPYTERHUB_API_TOKEN": "s3cret",
       "KUBEVIRT_WORKSTATIONS_URL": "http://hub:10101/services/workstations/"}


def test_the_launcher_leaves_the_access_for_root_and_the_keys_group_only(tmp_path):
    directory = tmp_path / "run" / "keys"
    gid = os.getgid()
    path = write_access(ENV, "alice-smith-1a2b3c4d", gid, str(directory))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640 and os.stat(path).st_gid == gid
    assert stat.S_IMODE(directory.stat().st_mode) == 0o750
    assert read_access(path) == {"url": ENV["KUBEVIRT_WORKSTATIONS_URL"], "token": "s3cret", "user": "Alice Smith",
                                 "login": "alice-smith-1a2b3c4d"}
    assert [p.name for p in directory.iterdir()] == ["service.json"]  # (no temporary file left)
    # SSH turned off by the hub, or no service to ask: no access, so no key logs in
    assert write_access({**ENV, "KUBEVIRT_SSH_ENABLED": "0"}, "alice", gid, str(directory)) is None
    assert not os.path.exists(path)
    write_access(ENV, "alice", gid, str(directory))
    assert write_access({k: v for k, v in ENV.items() if k != "KUBEVIRT_WORKSTATIONS_URL"}, "alice", gid,
                        str(directory)) is None and not os.path.exists(path)


@pytest.mark.parametrize("content, says", [
    (None, "is missing: SSH is off"),
    ("not json", "cannot read"),
    ('{"url": "http://x/", "token": "", "user": "a", "login": "a"}', "does not say url, token"),
    ('["url"]', "does not say url, token"),
])
def test_a_missing_or_broken_access_file_gives_no_keys(tmp_path, content, says):
    path = tmp_path / "service.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(KeysError, match=says):
        read_access(str(path))


ACCESS = {"url": "http://hub:10101/services/workstations/", "token": "s3cret", "user": "Alice Smith",
          "login": "alice"}


def test_the_owners_keys_for_the_owners_login_only():
    asked = []

    def get(url, token, timeout):
        asked.append((url, token))
        return json.dumps({"ssh_keys": [{"key": ED}, {"key": RSA}]}).encode()

    assert authorized_keys("alice", ACCESS, get) == [ED, RSA]
    assert asked == [("http://hub:10101/services/workstations/api/v1/users/Alice%20Smith/ssh-keys", "s3cret")]
    assert authorized_keys("root", ACCESS, get) == [] and authorized_keys("bob", ACCESS, get) == []
    assert len(asked) == 1  # (another login asks nothing)


def test_only_plain_key_lines_are_printed():
    """A line break or an option in what the service says would be sshd's to obey: such a line is left out."""
    lines = [ED, f"{ED}\nssh-ed25519 AAAAinjected", f'command="sh" {ED}', "ssh-dss AAAAB3Nz", f"{ED} a\x1b[2J",
             12, {"key": ED}]
    answer = json.dumps({"ssh_keys": [{"key": line} for line in lines]}).encode()
    assert authorized_keys("alice", ACCESS, lambda *a: answer) == [ED]
    for bad in (b"<html>", b'{"keys": []}', b'{"ssh_keys": [1]}'):
        with pytest.raises(KeysError, match="not a list of SSH keys"):
            authorized_keys("alice", ACCESS, lambda *a, bad=bad: bad)


def run_command(access_path, login: str) -> subprocess.CompletedProcess:
    """The command as sshd runs it: its own process, the login as its argument."""
    return subprocess.run([sys.executable, "-m", "kubevirt_spawner.guest.keys", "--access", str(access_path), login],
                          capture_output=True, text=True, timeout=60)


def test_the_command_prints_the_keys_sshd_takes_and_fails_closed(tmp_path, keys_service):
    service = keys_service
    path = tmp_path / "service.json"
    path.write_text(json.dumps({**ACCESS, "url": service}))
    KeysService.answers = {"/services/workstations/api/v1/users/Alice%20Smith/ssh-keys": (200, {"ssh_keys": [{"key": ED}]})}
    done = run_command(path, "alice")
    assert done.returncode == 0 and done.stdout == ED + "\n" and done.stderr == ""
    assert run_command(path, "mallory").stdout == ""
    # the service refuses (a stale token of an earlier start): no keys, and why, for sshd's log
    path.write_text(json.dumps({**ACCESS, "url": service, "token": "old"}))
    done = run_command(path, "alice")
    assert done.returncode == 1 and done.stdout == ""
    assert "answered 403: This token may not use the workstations service." in done.stderr
    # the service does not answer at all
    path.write_text(json.dumps({**ACCESS, "url": "http://127.0.0.1:9/services/workstations/"}))
    done = run_command(path, "alice")
    assert done.returncode == 1 and done.stdout == "" and "does not answer" in done.stderr
    path.unlink()
    done = run_command(path, "alice")
    assert done.returncode == 1 and "SSH is off for this workstation" in done.stderr


def test_the_image_asks_the_command_and_takes_no_password():
    """deploy/golden-image/sshd.conf, installed where Debian's sshd_config Include reads it first
    (the first value of a setting wins: sshd_config(5)), with the keys account customize.sh makes."""
    from pathlib import Path
    recipe = Path(__file__).resolve().parents[1] / "deploy" / "golden-image"
    settings = dict(line.split(None, 1) for line in (recipe / "sshd.conf").read_text().splitlines()
                    if line.strip() and not line.startswith("#"))
    assert settings == {"LogLevel": "VERBOSE", "PasswordAuthentication": "no", "KbdInteractiveAuthentication": "no", "PermitRootLogin": "no",
                        "PubkeyAuthentication": "yes",
                        "AuthorizedKeysCommand": "/opt/jupyter/bin/kubevirt-workstation-keys %u",
                        "AuthorizedKeysCommandUser": keys.KEYS_GROUP}
    customize = (recipe / "customize.sh").read_text()
    assert '"$root/etc/ssh/sshd_config.d/10-kubevirt-workstation.conf"' in customize
    assert f"--user-group --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin {keys.KEYS_GROUP}" in customize
