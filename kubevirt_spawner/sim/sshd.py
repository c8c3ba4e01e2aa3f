"""The process guests' sshd: an SSH server (asyncssh) on the guest's own loopback address, as the
golden image's OpenSSH sshd is on the VM's 127.0.0.1:22 behind the guest's tunnel (guest/sshd.py).

Like the image's sshd (deploy/golden-image): public keys only, no password, no root; the machine's
one account (the JupyterHub user's Linux name); its host key kept on the machine's root disk
(`etc/ssh/`), so a reset of the system disk gives the machine a new one. The keys a login is
checked against are the account's `~/.ssh/authorized_keys` on the machine (sshd's
AuthorizedKeysFile). A command runs with bash in the account's home on the machine directory;
sftp (what OpenSSH's scp speaks) is rooted at the machine directory.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess

log = logging.getLogger(__name__)

SSHD_PORT = 2222  # (not 22: the simulator runs without root on a developer's machine)


def available() -> bool:
    try:
        import asyncssh  # noqa: F401
    except ImportError:
        return False
    return True


async def start(ip: str, root: str, account: str, home: str | None = None):
    """The machine's SSH server on ip:SSHD_PORT for `account` (whose home is `home`, by default
    home/ACCOUNT on the machine), or None without asyncssh (the guest then has no sshd)."""
    if not available():
        log.warning("process guests have no sshd: install asyncssh (pip install kubevirt-spawner[test])")
        return None
    import asyncssh

    key_path = os.path.join(root, "etc", "ssh", "ssh_host_ed25519_key")
    if not os.path.exists(key_path):
        os.makedirs(os.path.dirname(key_path), exist_ok=True)
        asyncssh.generate_private_key("ssh-ed25519").write_private_key(key_path)
    home = home or os.path.join(root, "home", account)

    class Server(asyncssh.SSHServer):
        def connection_made(self, conn):
            self.conn = conn

        def begin_auth(self, username: str) -> bool:
            keys = os.path.join(home, ".ssh", "authorized_keys")
            if username == account and os.path.exists(keys):
                self.conn.set_authorized_keys(keys)
            return True  # (no key fits any other name: the login fails)

        def password_auth_supported(self) -> bool:
            return False

    async def run(process) -> None:
        command = process.command or "exec bash -i"
        env = {**os.environ, "HOME": home, "USER": account, "LOGNAME": account}
        local = subprocess.Popen(["bash", "-c", command], cwd=home, env=env, stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        await process.redirect(stdin=local.stdin, stdout=local.stdout, stderr=local.stderr)
        status = await asyncio.get_running_loop().run_in_executor(None, local.wait)
        await process.stdout.drain()
        process.exit(status)

    return await asyncssh.create_server(
        Server, ip, SSHD_PORT, server_host_keys=[key_path], process_factory=run, encoding=None,
        sftp_factory=lambda chan: asyncssh.SFTPServer(chan, chroot=root.encode()), allow_scp=True)
