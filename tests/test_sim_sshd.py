"""The process guests' sshd (kubevirt_spawner/sim/sshd.py): public keys of the account only, a
command in the account's home, sftp on the machine's files, a host key kept on the root disk.
It stands in for the golden image's OpenSSH sshd (deploy/golden-image), so it refuses what that
refuses: passwords, other accounts, keys neither the workstations service (through the guest's
keys command) nor ~/.ssh/authorized_keys gives."""

from __future__ import annotations

import pytest

asyncssh = pytest.importorskip("asyncssh", reason="asyncssh is in the [test] extra")

from kubevirt_spawner.sim import sshd  # noqa: E402

from simtools import KeysService  # noqa: E402


@pytest.fixture
async def machine(tmp_path, monkeypatch):
    monkeypatch.setattr(sshd, "SSHD_PORT", 0)
    root = tmp_path / "machine"
    (root / "home" / "alice" / ".ssh").mkdir(parents=True)
    key = asyncssh.generate_private_key("ssh-ed25519")
    (root / "home" / "alice" / ".ssh" / "authorized_keys").write_bytes(key.export_public_key())
    server = await sshd.start("127.0.0.1", str(root), "alice")
    port = server.sockets[0].getsockname()[1]
    yield root, port, key
    server.close()
    await server.wait_closed()


async def test_the_accounts_key_runs_a_command_in_its_home_and_copies_files(machine):
    root, port, key = machine
    async with asyncssh.connect("127.0.0.1", port, username="alice", client_keys=[key], known_hosts=None) as conn:
        done = await conn.run("pwd; echo hello > made.txt; exit 3")
        assert done.stdout.strip() == str(root / "home" / "alice") and done.exit_status == 3
        async with conn.start_sftp_client() as sftp:
            async with sftp.open("/home/alice/made.txt") as f:
                assert await f.read() == "hello\n"
    assert (root / "etc" / "ssh" / "ssh_host_ed25519_key").exists()  # kept on the machine's disk


@pytest.mark.parametrize("who, key_kind", [("alice", "other"), ("root", "own")])
async def test_another_key_or_another_account_is_refused(machine, who, key_kind):
    _, port, key = machine
    client_key = key if key_kind == "own" else asyncssh.generate_private_key("ssh-ed25519")
    with pytest.raises(asyncssh.PermissionDenied):
        await asyncssh.connect("127.0.0.1", port, username=who, client_keys=[client_key], known_hosts=None)


async def test_a_password_is_never_asked_for(machine):
    _, port, _ = machine
    with pytest.raises(asyncssh.PermissionDenied):
        await asyncssh.connect("127.0.0.1", port, username="alice", password="secret", client_keys=None,
                               known_hosts=None)


async def test_keys_from_the_workstations_service_log_in_until_they_are_deleted(tmp_path, monkeypatch, keys_service):
    service = keys_service
    """As the image's sshd does (deploy/golden-image/sshd.conf): at every login the keys command
    asks the service for the user's keys; a key the service no longer lists is refused at the
    next login, and a key in ~/.ssh/authorized_keys still logs in (AuthorizedKeysFile)."""
    monkeypatch.setattr(sshd, "SSHD_PORT", 0)
    root = tmp_path / "machine"
    (root / "home" / "alice").mkdir(parents=True)
    env = {"JUPYTERHUB_USER": "Alice Smith", "JUPYTERHUB_API_TOKEN": "s3cret", "KUBEVIRT_WORKSTATIONS_URL": service}
    access = sshd.write_keys_access(str(root), env, "alice")
    from_service = asyncssh.generate_private_key("ssh-ed25519")
    KeysService.answers = {"/services/workstations/api/v1/users/Alice%20Smith/ssh-keys":
                       (200, {"ssh_keys": [{"key": from_service.export_public_key().decode().strip()}]})}
    server = await sshd.start("127.0.0.1", str(root), "alice", keys_access=access)
    port = server.sockets[0].getsockname()[1]
    try:
        async with asyncssh.connect("127.0.0.1", port, username="alice", client_keys=[from_service],
                                    known_hosts=None) as conn:
            assert (await conn.run("echo in")).stdout == "in\n"
        KeysService.answers = {"/services/workstations/api/v1/users/Alice%20Smith/ssh-keys": (200, {"ssh_keys": []})}
        with pytest.raises(asyncssh.PermissionDenied):
            await asyncssh.connect("127.0.0.1", port, username="alice", client_keys=[from_service], known_hosts=None)
        own = asyncssh.generate_private_key("ssh-ed25519")
        (root / "home" / "alice" / ".ssh").mkdir()
        (root / "home" / "alice" / ".ssh" / "authorized_keys").write_bytes(own.export_public_key())
        async with asyncssh.connect("127.0.0.1", port, username="alice", client_keys=[own], known_hosts=None) as conn:
            assert (await conn.run("echo own")).stdout == "own\n"
        # SSH turned off by the hub: the next start leaves no access, and the service is not asked
        sshd.write_keys_access(str(root), {**env, "KUBEVIRT_SSH_ENABLED": "0"}, "alice")
        KeysService.answers = {"/services/workstations/api/v1/users/Alice%20Smith/ssh-keys":
                           (200, {"ssh_keys": [{"key": from_service.export_public_key().decode().strip()}]})}
        with pytest.raises(asyncssh.PermissionDenied):
            await asyncssh.connect("127.0.0.1", port, username="alice", client_keys=[from_service], known_hosts=None)
    finally:
        server.close()
        await server.wait_closed()
