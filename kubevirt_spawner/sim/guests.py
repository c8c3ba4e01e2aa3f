"""The simulated guests: one local process per running VMI whose machine root is its root disk.

`process` mode runs a real Jupyter server (by default `jupyterhub-singleuser` when the VM got a
JupyterHub environment, else `jupyter-server`) bound to the VMI's own loopback address.
`null` mode runs no process: one tiny shared responder answers Jupyter's `/api` on each address,
which is enough for scale tests.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import signal
import stat
import struct
import sys
import time
import uuid

from ..objects import EXTRA_DISKS_ENV, SHARED_DATA_ENV, check_mount_path
from . import sshd as sim_sshd

log = logging.getLogger(__name__)

JUPYTER_PORT = 8888
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def guest_environment(secret_datas: list[dict[str, str]]) -> dict[str, str]:
    """Env vars a VM receives through its Secret disks: keys that are valid variable names, and
    `KEY=VALUE` lines of keys ending in `.env`."""
    env: dict[str, str] = {}
    for data in secret_datas:
        for key, value in data.items():
            if key.endswith(".env"):
                for line in value.splitlines():
                    line = line.strip()
                    if line and not line.startswith("#") and "=" in line:
                        k, v = line.split("=", 1)
                        env[k.strip()] = v.strip().strip('"')
            elif _ENV_NAME.match(key):
                env[key] = value
    return env


def guest_arguments(secret_datas: list[dict[str, str]]) -> list[str]:
    """Extra Jupyter command-line arguments a VM receives as `args.json` (a JSON list) in a Secret;
    the golden image's unit appends them to the jupyterhub-singleuser command."""
    for data in secret_datas:
        if "args.json" in data:
            try:
                args = json.loads(data["args.json"])
            except ValueError:
                log.warning("args.json in the VM's Secret is not JSON: ignored")
                return []
            if isinstance(args, list) and all(isinstance(a, str) for a in args):
                return args
            log.warning("args.json in the VM's Secret is not a list of strings: ignored")
    return []


def first_boot(root: str):
    """What cloud-init does on a clone's first boot: a fresh machine-id."""
    path = os.path.join(root, "etc", "machine-id")
    try:
        with open(path) as f:
            current = f.read().strip()
    except FileNotFoundError:
        current = "uninitialized"
    if current in ("", "uninitialized"):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(uuid.uuid4().hex + "\n")


# Where a Linux guest mounts filesystems that live in memory: tmpfs on /run, devtmpfs (with devpts)
# on /dev, procfs on /proc. The simulator writes them under the machine root, yet they are not on
# the disk: each boot starts without them, and no snapshot or clone of the disk carries them.
RUNTIME_MOUNTS = ("run", "dev", "proc")


def clear_runtime(root: str):
    """A power-on or power-off: what the guest kept in memory is gone."""
    for name in RUNTIME_MOUNTS:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def not_on_disk(src: str):
    """A `shutil.copytree` ignore for a copy of volume `src`: when it holds a machine root
    filesystem (it has /etc), the runtime mounts are left out; any other volume is copied whole."""
    def ignore(directory: str, names: list[str]) -> list[str]:
        if directory == src and "etc" in names:
            return [name for name in names if name in RUNTIME_MOUNTS]
        return []
    return ignore


# The login records a Linux guest keeps: glibc's struct utmp on x86_64 (bits/utmp.h), 384 bytes;
# `who` and `w` read them from /run/utmp, `w` the idle time from the atime of the tty device.
UTMP = struct.Struct("<h2xi32s4s32s256shhiii4i20s")
USER_PROCESS = 7
NVIDIA_SMI_QUERY = "--query-gpu=index,name,utilization.gpu"
NVIDIA_SMI_NO_DRIVER = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
                        "Make sure that the latest NVIDIA driver is installed and running.")


def write_logins(root: str, users: list[dict], now: float | None = None):
    """The guest's login records for the users the fault API gives it: {"userName", "loginTime"
    (epoch seconds), "host" (an SSH client's address; none: a console login), "tty" (default
    pts/N), "idleSeconds" (since the last input on the tty)}."""
    now = time.time() if now is None else now
    records = []
    for n, user in enumerate(users):
        line = user.get("tty") or f"pts/{n}"
        login = float(user.get("loginTime") or now)
        records.append(UTMP.pack(USER_PROCESS, 2000 + n, line.encode()[:32], str(n).encode()[:4],
                                 str(user.get("userName", "")).encode()[:32], str(user.get("host") or "").encode()[:256],
                                 0, 0, 2000 + n, int(login), int((login % 1) * 1e6), 0, 0, 0, 0, b""))
        device = os.path.join(root, "dev", line)
        os.makedirs(os.path.dirname(device), exist_ok=True)
        if not os.path.exists(device):
            open(device, "w").close()  # the terminal device (its times are what `w` reads)
        input_at = now - float(user.get("idleSeconds") or 0)
        os.utime(device, (input_at, input_at))
    os.makedirs(os.path.join(root, "run"), exist_ok=True)
    with open(os.path.join(root, "run", "utmp"), "wb") as f:
        f.write(b"".join(records))


USER_HZ = 100  # the kernel's clock ticks per second in /proc (sysconf(_SC_CLK_TCK) on Linux)


def write_processes(root: str, processes: list[dict], logins: list[dict], booted: float, cpus: int,
                    now: float | None = None):
    """The guest's /proc as its process tools read it (proc(5)): the machine's CPU time in
    /proc/stat and, per process, its CPU time in /proc/PID/stat and its owner in /proc/PID/status.
    `processes`: {"pid", "uid", "command", "cpu" (percent of one CPU), "since" (epoch s)}; the login
    sessions' processes are there too (their records in utmp are not stale). No processes: no /proc."""
    proc = os.path.join(root, "proc")
    if not processes:
        shutil.rmtree(proc, ignore_errors=True)
        return
    now = time.time() if now is None else now
    up = max(0.0, now - booted) * USER_HZ
    busy = sum(max(0.0, now - float(p.get("since", now))) * float(p.get("cpu", 0)) / 100 * USER_HZ
               for p in processes)
    cpu_line = lambda user, idle: f"{int(user)} 0 0 {int(idle)} 0 0 0 0 0 0"  # noqa: E731
    lines = [f"cpu  {cpu_line(busy, max(0.0, up * cpus - busy))}"]
    lines += [f"cpu{i} {cpu_line(busy / cpus, max(0.0, up - busy / cpus))}" for i in range(cpus)]
    os.makedirs(proc, exist_ok=True)
    _write(os.path.join(proc, "stat"), "\n".join(lines) + "\n")
    sessions = [{"pid": 2000 + n, "uid": 1000, "command": "bash", "cpu": 0} for n in range(len(logins))]
    wanted = set()
    for p in [*processes, *sessions]:
        pid = int(p["pid"])
        wanted.add(str(pid))
        used = int(max(0.0, now - float(p.get("since", now))) * float(p.get("cpu", 0)) / 100 * USER_HZ)
        start = int(max(0.0, float(p.get("since", booted)) - booted) * USER_HZ)
        folder = os.path.join(proc, str(pid))
        os.makedirs(folder, exist_ok=True)
        _write(os.path.join(folder, "stat"), f"{pid} ({p.get('command', 'process')}) R 1 {pid} {pid} 0 -1 0 0 0 0 0 "
                                              f"{used} 0 0 0 20 0 1 0 {start} 0 0\n")
        uid = int(p.get("uid", 1000))
        _write(os.path.join(folder, "status"), f"Name:\t{p.get('command', 'process')}\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n")
    for name in os.listdir(proc):
        if name.isdigit() and name not in wanted:
            shutil.rmtree(os.path.join(proc, name), ignore_errors=True)


def _write(path: str, text: str):
    with open(path + ".new", "w") as f:
        f.write(text)
    os.replace(path + ".new", path)


def write_nvidia_smi(bindir: str, gpus: list[str], utilization: float):
    """The golden image's `nvidia-smi` (man nvidia-smi). With GPUs passed through: the query the
    guest package makes, answered as the NVIDIA driver's tool does (one `index, name, utilization`
    line per GPU); any other query fails as an unsupported one would. Without: the CUDA image ships
    it anyway, and with no device the driver is not loaded, so it fails with its message and
    RETURN VALUE 9."""
    path = os.path.join(bindir, "nvidia-smi")
    os.makedirs(bindir, exist_ok=True)
    if gpus:
        lines = "".join(f"{i}, {name}, {round(utilization)}\n" for i, name in enumerate(gpus))
        script = ("#!/bin/sh\n"
                  f'case "$*" in *{NVIDIA_SMI_QUERY}*) ;; *) echo "simulated nvidia-smi: unsupported query: $*" >&2; '
                  "exit 2;; esac\n"
                  f"cat <<'EOF'\n{lines}EOF\n")
    else:
        script = f"#!/bin/sh\ncat >&2 <<'EOF'\n{NVIDIA_SMI_NO_DRIVER}\nEOF\nexit 9\n"
    with open(path + ".new", "w") as f:
        f.write(script)
    os.chmod(path + ".new", stat.S_IRWXU | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
    os.replace(path + ".new", path)


def boot_problem(root: str) -> str | None:
    """Why the machine on this root filesystem would not come up, as a Linux guest would fail:
    systemd drops to its emergency shell when /etc/fstab has a line it cannot parse (no network
    services, no guest agent, no Jupyter). None when it boots."""
    try:
        with open(os.path.join(root, "etc", "fstab")) as f:
            lines = f.read().splitlines()
    except OSError:
        return None  # no fstab: nothing to mount beyond the root
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if text and not text.startswith("#") and len(text.split()) < 4:
            return f"/etc/fstab line {number} cannot be parsed: emergency mode"
    return None


def default_command(env: dict[str, str]) -> list[str]:
    bindir = os.path.dirname(sys.executable)
    if env.get("JUPYTERHUB_API_TOKEN"):
        exe = shutil.which("jupyterhub-singleuser", path=bindir + os.pathsep + os.environ.get("PATH", ""))
        cmd = [exe or "jupyterhub-singleuser"]
    else:
        exe = shutil.which("jupyter-server", path=bindir + os.pathsep + os.environ.get("PATH", ""))
        cmd = [exe or "jupyter-server", "--IdentityProvider.token=", "--ServerApp.password=",
               "--ServerApp.disable_check_xsrf=True"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    return cmd


class Guest:
    def __init__(self, key, ip: str, root: str, env: dict[str, str], args: list[str], log_path: str,
                 command: list[str] | None):
        self.key, self.ip, self.root, self.env, self.args = key, ip, root, env, args
        self.log_path = log_path
        self.bindir = os.path.join(os.path.dirname(log_path), f"{key[0]}_{key[1]}.bin")  # on its PATH
        self.booted = time.time()
        self.command = command
        self.proc: asyncio.subprocess.Process | None = None
        self.null_server: asyncio.AbstractServer | None = None
        self.sshd: asyncio.AbstractServer | None = None  # (sim.sshd's server: asyncssh's SSHAcceptor)
        self.uid = ""  # of the VMI it runs for
        self.grace_override: int | None = None  # a shorter grace period asked for during the shutdown
        self.hurried = asyncio.Event()  # set when grace_override changes
        self.mounts: list[tuple[str, str, bool]] = []  # (source, target, read-only) bind mounts: shared data

    async def start_process(self):
        user = self.env.get("JUPYTERHUB_USER") or "jovyan"
        home = os.path.join(self.root, "home", user)
        os.makedirs(home, exist_ok=True)
        env = dict(os.environ)
        env.update(self.env)
        prefix = self.env.get("JUPYTERHUB_SERVICE_PREFIX", "/")
        env["PATH"] = self.bindir + os.pathsep + env.get("PATH", "")  # (its nvidia-smi)
        env.update({"HOME": home, "USER": user, "JUPYTER_RUNTIME_DIR": os.path.join(home, ".local/share/jupyter/runtime"),
                    "JUPYTERHUB_SERVICE_URL": f"http://{self.ip}:{JUPYTER_PORT}{prefix}",
                    "KUBEVIRT_SIM_MACHINE_ROOT": self.root})
        cmd = list(self.command) if self.command else default_command(self.env) + list(self.args)
        cmd += [f"--ip={self.ip}", f"--port={JUPYTER_PORT}", f"--ServerApp.root_dir={self.root}",
                "--ServerApp.open_browser=False"]
        if self.mounts:
            cmd = in_mount_namespace(self.mounts, cmd)
        if self.env.get("JUPYTERHUB_USER"):  # a workstation: its sshd, behind the guest's tunnel
            # (the account is the hub's name, as this guest's home is: the image's unit would make
            # guest.launch.linux_name of it, the same for every name a Linux account may have)
            access = sim_sshd.write_keys_access(self.root, self.env, user)
            self.sshd = await sim_sshd.start(self.ip, self.root, user, home, access)
            if self.sshd is not None and not self.command:
                cmd += [f"--WorkstationGuest.sshd_host={self.ip}", f"--WorkstationGuest.sshd_port={sim_sshd.SSHD_PORT}"]
        os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
        logfile = open(self.log_path, "ab")
        try:
            self.proc = await asyncio.create_subprocess_exec(*cmd, cwd=self.root, env=env, stdout=logfile,
                                                             stderr=asyncio.subprocess.STDOUT,
                                                             start_new_session=True)
        finally:
            logfile.close()

    async def start_null(self):
        self.null_server = await asyncio.start_server(_null_responder, self.ip, JUPYTER_PORT)

    @property
    def alive(self) -> bool:
        if self.null_server is not None:
            return self.null_server.is_serving()
        return self.proc is not None and self.proc.returncode is None

    async def wait(self) -> int:
        if self.proc is not None:
            return await self.proc.wait()
        if self.null_server is not None:
            await self.null_server.wait_closed()
        return 0

    def hurry(self, grace: int):
        self.grace_override = grace
        self.hurried.set()

    def _stop_sshd(self):
        if self.sshd is not None:
            self.sshd.close()
            self.sshd = None

    async def stop(self, grace: float):
        """The end of an ACPI shutdown: SIGTERM, then SIGKILL when the grace period is over."""
        self._stop_sshd()
        if self.null_server is not None:
            self.null_server.close()
            return 0
        if self.proc is None or self.proc.returncode is not None:
            return self.proc.returncode if self.proc else 0
        _signal_group(self.proc.pid, signal.SIGTERM)
        try:
            return await asyncio.wait_for(self.proc.wait(), max(grace, 0.1))
        except asyncio.TimeoutError:
            _signal_group(self.proc.pid, signal.SIGKILL)
            return await self.proc.wait()

    def kill(self):
        self._stop_sshd()
        if self.null_server is not None:
            self.null_server.close()
        elif self.proc is not None and self.proc.returncode is None:
            _signal_group(self.proc.pid, signal.SIGKILL)


def listed_mounts(env: dict[str, str], variable: str) -> list[tuple[dict, str]]:
    """The entries of one of the hub's JSON lists (KUBEVIRT_SHARED_DATA, KUBEVIRT_EXTRA_DISKS)
    with their mount points; entries the launcher cannot use are left out, as it leaves them."""
    try:
        entries = json.loads(env.get(variable) or "[]")
    except ValueError:
        return []
    out = []
    for entry in entries if isinstance(entries, list) else []:
        try:
            out.append((entry, check_mount_path(entry.get("path"))))
        except (ValueError, AttributeError):
            continue
    return out


def shared_data_mounts(env: dict[str, str], shares: dict[str, tuple[str, bool]], root: str
                       ) -> list[tuple[str, str, bool]]:
    """What the golden image's launcher mounts (guest/launch.py, mount_shared_data): each entry
    of KUBEVIRT_SHARED_DATA whose tag the machine serves, at its path under the machine's root;
    read-only when virt-launcher serves it so (`shares`: tag -> (directory, read-only)) or the
    entry asks."""
    out = []
    for entry, path in listed_mounts(env, SHARED_DATA_ENV):
        if entry.get("tag") in shares:
            source, read_only = shares[entry["tag"]]
            out.append((source, os.path.join(root, path.lstrip("/")), read_only or bool(entry.get("readOnly"))))
    return out


def extra_disk_mounts(env: dict[str, str], disks: dict[str, str], root: str) -> list[tuple[str, str, bool]]:
    """What the golden image's launcher mounts (guest/launch.py, mount_extra_disks): each entry
    of KUBEVIRT_EXTRA_DISKS whose serial the machine has (`disks`: serial -> the claim's
    directory), read-write at its path under the machine's root."""
    return [(disks[entry["serial"]], os.path.join(root, path.lstrip("/")), False)
            for entry, path in listed_mounts(env, EXTRA_DISKS_ENV) if entry.get("serial") in disks]


def in_mount_namespace(mounts: list[tuple[str, str, bool]], cmd: list[str]) -> list[str]:
    """`cmd` run in a mount namespace of its own where each source is bound on its target
    (read-only ones remounted so: the kernel refuses writes, even root's), as virtiofsd serves a
    claim to a real guest; nothing is mounted in the simulator's own namespace."""
    script = ["set -e"]
    for n, (_source, _target, read_only) in enumerate(mounts):
        src, dst = f'"$KVS_MOUNT_SRC_{n}"', f'"$KVS_MOUNT_DST_{n}"'
        script += [f"mkdir -p {dst}", f"mount --bind {src} {dst}"]
        if read_only:
            script.append(f"mount -o remount,bind,ro {dst}")
    script.append("unset " + " ".join(f"KVS_MOUNT_SRC_{n} KVS_MOUNT_DST_{n}" for n in range(len(mounts))))
    script.append('exec "$@"')
    # (the paths travel as environment variables: nothing of them is parsed by the shell)
    env_args = [f"KVS_MOUNT_{side}_{n}={path}" for n, (source, target, _) in enumerate(mounts)
                for side, path in (("SRC", source), ("DST", target))]
    return ["unshare", "--mount", "--propagation", "private", "--", "env", *env_args,
            "sh", "-c", "\n".join(script), "sh", *cmd]


def _signal_group(pid: int, sig):
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


async def _null_responder(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
    """Answers any HTTP request the way Jupyter answers `GET /api`."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            if length:
                await reader.readexactly(length)
            body = json.dumps({"version": "2.0.0-sim-null-guest"}).encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                         + str(len(body)).encode() + b"\r\n\r\n" + body)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
        pass
    finally:
        writer.close()
