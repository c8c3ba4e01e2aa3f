"""The process guests' sshd: an SSH server (asyncssh) on the guest's own loopback address, as the
golden image's OpenSSH sshd is on the VM's 127.0.0.1:22 behind the guest's tunnel (guest/sshd.py).

Like the image's sshd (deploy/golden-image): public keys only, no password, no root; the machine's
one account (the JupyterHub user's Linux name); its host key kept on the machine's root disk
(`etc/ssh/`), so a reset of the system disk gives the machine a new one. The keys a login is
checked against are, as the image's sshd_config says (deploy/golden-image/sshd.conf), what the
guest's keys command prints (`python -m kubevirt_spawner.guest.keys LOGIN`, run at every login
as OpenSSH runs its AuthorizedKeysCommand: the user's keys from the workstations service) and the
account's `~/.ssh/authorized_keys` on the machine (sshd's AuthorizedKeysFile). A command runs with bash in the account's home on the machine directory;
sftp (what OpenSSH's scp speaks) is rooted at the machine directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import subprocess
import sys

log = logging.getLogger(__name__)

SSHD_PORT = 2222  # (not 22: the simulator runs without root on a developer's machine)
KEYS_ACCESS = os.path.join("run", "kubevirt-workstation-keys", "service.json")  # (guest/keys.py's, on the machine)
KEYS_TIMEOUT = 30.0
AUTH_LOG = os.path.join("var", "log", "auth.log")  # (the machine's: where syslog puts sshd's lines)


def write_keys_access(root: str, env: dict[str, str], account: str) -> str:
    """What the image's workstation unit leaves the keys command at each start (guest.launch via
    guest.keys.write_access): the service's URL and the start's token; none when SSH is off."""
    path = os.path.join(root, KEYS_ACCESS)
    if env.get("KUBEVIRT_SSH_ENABLED", "1") == "0" or not env.get("KUBEVIRT_WORKSTATIONS_URL"):
        if os.path.exists(path):
            os.unlink(path)
        return path
    os.makedirs(os.path.dirname(path), mode=0o750, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump({"url": env["KUBEVIRT_WORKSTATIONS_URL"], "token": env.get("JUPYTERHUB_API_TOKEN", ""),
                   "user": env.get("JUPYTERHUB_USER", ""), "login": account}, f)
    return path


async def keys_command(access: str, login: str) -> str:
    """The keys command's output for `login` (empty when it fails: sshd logs and ignores it)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kubevirt_spawner.guest.keys", "--access", access, login,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), KEYS_TIMEOUT)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        log.warning("sshd: the keys command for %s took over %.0f s", login, KEYS_TIMEOUT)
        return ""
    if proc.returncode != 0:
        log.warning("sshd: the keys command for %s: %s", login, err.decode(errors="replace").strip())
        return ""
    return out.decode()


def available() -> bool:
    try:
        import asyncssh  # noqa: F401
    except ImportError:
        return False
    return True


async def start(ip: str, root: str, account: str, home: str | None = None, keys_access: str | None = None):
    """The machine's SSH server on ip:SSHD_PORT for `account` (whose home is `home`, by default
    home/ACCOUNT on the machine), or None without asyncssh (the guest then has no sshd).
    `keys_access`: the keys command's access file (no keys from the service without one)."""
    if not available():
        log.warning("process guests have no sshd: install asyncssh (pip install 'kubevirt-spawner[demo]')")
        return None
    import asyncssh

    key_path = os.path.join(root, "etc", "ssh", "ssh_host_ed25519_key")
    if not os.path.exists(key_path):
        os.makedirs(os.path.dirname(key_path), exist_ok=True)
        asyncssh.generate_private_key("ssh-ed25519").write_private_key(key_path)
    account_home = home or os.path.join(root, "home", account)

    auth_log = os.path.join(root, AUTH_LOG)

    class Server(asyncssh.SSHServer):
        def connection_made(self, conn):
            self.conn = conn
            # what the image's sshd logs for each connection (LogLevel VERBOSE), before a byte of SSH
            peer, local = conn.get_extra_info("peername") or ("?", 0), conn.get_extra_info("sockname") or ("?", 0)
            with contextlib.suppress(OSError):
                os.makedirs(os.path.dirname(auth_log), exist_ok=True)
                with open(auth_log, "a", encoding="utf-8") as f:
                    f.write(f"sshd: Connection from {peer[0]} port {peer[1]} on {local[0]} port {local[1]}\n")

        async def begin_auth(self, username: str) -> bool:
            if username != account:
                return True  # (no key fits any other name: the login fails)
            lines = await keys_command(keys_access, username) if keys_access else ""
            keys = os.path.join(account_home, ".ssh", "authorized_keys")
            if os.path.exists(keys):
                with open(keys, encoding="utf-8", errors="replace") as f:
                    lines += "\n" + f.read()
            if lines.strip():
                self.conn.set_authorized_keys(asyncssh.import_authorized_keys(lines))
            return True

        def password_auth_supported(self) -> bool:
            return False

    async def run(process) -> None:
        command = process.command or "exec bash -i"
        env = {**os.environ, "HOME": account_home, "USER": account, "LOGNAME": account}
        local = subprocess.Popen(["bash", "-c", command], cwd=account_home, env=env, stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        await process.redirect(stdin=local.stdin, stdout=local.stdout, stderr=local.stderr)
        status = await asyncio.get_running_loop().run_in_executor(None, local.wait)
        await process.stdout.drain()
        process.exit(status)

    return await asyncssh.create_server(
        Server, ip, SSHD_PORT, server_host_keys=[key_path], process_factory=run, encoding=None,
        sftp_factory=lambda chan: machine_sftp(asyncssh, chan, root, account_home), allow_scp=True)


def machine_sftp(asyncssh, chan, root: str, home: str):
    """sftp on the machine's files as its sftp-server sees them: rooted at the machine directory,
    starting in the account's home (relative paths are the home's, as OpenSSH's sftp-server
    chdirs there), and the simulator's mounts (a disk's directory linked in, as /home is the
    workspace disk's) reported under their mount point, not refused as outside the root."""
    chroot = os.path.realpath(root).encode()
    start = b"/" + os.path.relpath(home, root).encode()
    mounts = {}
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if os.path.islink(path) and os.path.isdir(path):
            mounts[os.path.realpath(path).encode()] = b"/" + name.encode()

    class MachineSftp(asyncssh.SFTPServer):
        def map_path(self, path: bytes) -> bytes:
            return super().map_path(path if path.startswith(b"/") else start + b"/" + path)

        def reverse_map_path(self, path: bytes) -> bytes:
            for target, point in mounts.items():
                if path == target or path.startswith(target + b"/"):
                    return point + path[len(target):]
            return super().reverse_map_path(path)

        def exit(self) -> None:
            # sshd reports sftp-server's exit status; asyncssh closes the channel without one, and
            # OpenSSH's scp (sftp underneath) then fails a copy that went well
            super().exit()
            with contextlib.suppress(Exception):
                chan.exit(0)

    return MachineSftp(chan, chroot=chroot)
