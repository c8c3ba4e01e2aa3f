"""What makes a workstation busy besides Jupyter itself: logins with recent input (SSH, console),
busy GPUs, and (optionally) user processes using the CPU.

Pure readers of a Linux machine's files below a root directory (`/` in a real guest, a machine
directory in the simulator), and `WorkstationActivity`, which samples them every `interval` on the
Jupyter server and, while anything is active, sets `web_app.settings["workstation_last_activity"]`:
jupyter-server's `last_activity()` takes every setting ending in `_last_activity`, and
jupyterhub-singleuser reports that to the hub, so the idle culler sees the machine as in use.

Sources:
    jupyter  what jupyter-server itself counts (API use, kernel messages, terminal I/O), less this module's
             own key.
    kernels  kernels busy running a cell (a long silent cell sends no messages).
    tunnels  SSH tunnels through the hub open now (guest.sshd): an editor's remote session may send
             nothing for minutes and has no terminal, yet someone works through it.
    logins   utmp (`/run/utmp`, glibc's `struct utmp`), USER_PROCESS records; the idle time is
             now - atime of the login's tty (`/dev/pts/0`), as `w` computes it (the kernel bumps
             a tty's atime on input, its mtime on output, in 8-second steps).
    GPUs     `nvidia-smi --query-gpu=index,name,utilization.gpu --format=csv,noheader,nounits`, read every
             `gpu_sample_seconds` and averaged over the interval (one reading covers well under a second).
    CPU      `/proc/<pid>/stat` utime+stime of processes with uid >= min_uid between two samples,
             against `/proc/stat`'s total (both in USER_HZ ticks, so the tick rate cancels out).
A source that fails is skipped (never counted as activity) and its reason logged once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import struct
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from tornado.ioloop import IOLoop, PeriodicCallback
from traitlets import Float, Integer, Unicode, default
from traitlets.config import LoggingConfigurable

if TYPE_CHECKING:
    from jupyter_server.serverapp import ServerApp

# The settings keys this module writes on the Jupyter server's web application.
LAST_ACTIVITY_KEY = "workstation_last_activity"  # ends in _last_activity: jupyter-server's last_activity() takes it
REASONS_KEY = "workstation_activity_reasons"
# Written by the SSH tunnel (guest.sshd): id -> {"from": address, "since": epoch seconds}, one per open tunnel.
TUNNELS_KEY = "workstation_ssh_tunnels"

# glibc bits/utmp.h `struct utmp` on x86_64 (32-bit ut_session and ut_tv, __WORDSIZE_TIME64_COMPAT32):
# ut_type, pad, ut_pid, ut_line[32], ut_id[4], ut_user[32], ut_host[256], ut_exit{short, short},
# ut_session, ut_tv{tv_sec, tv_usec}, ut_addr_v6[4], __glibc_reserved[20].
UTMP = struct.Struct("<h2xi32s4s32s256shhiii4i20s")
assert UTMP.size == 384, UTMP.size
USER_PROCESS = 7
UTMP_PATHS = ("run/utmp", "var/run/utmp")

NVIDIA_SMI_QUERY = ["--query-gpu=index,name,utilization.gpu", "--format=csv,noheader,nounits"]
NOT_A_VALUE = frozenset({"[N/A]", "[Not Supported]", "[Insufficient Permissions]", "[Unknown Error]"})
# nvidia-smi's documented exit codes (man nvidia-smi, RETURN VALUE) worth a name in a log line.
NVIDIA_SMI_EXITS = {
    2: "invalid argument",
    3: "operation not available on this device",
    4: "no permission",
    12: "NVML library not found",
    14: "infoROM corrupted",
    15: "GPU fell off the bus",
}

# nvidia-smi's exits on a machine without a usable GPU (man nvidia-smi, RETURN VALUE): 6 "the query was
# unsuccessful" (no devices were found), 9 "the NVIDIA driver is not loaded" (a CPU-only VM from a CUDA image).
NVIDIA_SMI_NO_GPU = frozenset({6, 9})

# libutempter's host for a terminal multiplexer's window, e.g. `tmux(1234).%0`: local, not a remote login.
MULTIPLEXER_HOST = re.compile(r"^[\w.-]+\(\d+\)")

NOBODY_UID = 65534  # uid >= min_uid, but nobody's processes are no one's work


class SourceError(Exception):
    """An activity source could not be read; the message is one sentence saying why."""


def _text(field: bytes) -> str:
    """A utmp string: NUL-padded, not necessarily NUL-terminated."""
    return field.split(b"\0", 1)[0].decode("utf-8", "replace")


def _iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, timezone.utc).isoformat()


# ---------------------------------------------------------------------------------------------- logins

@dataclass(frozen=True)
class Login:
    """A logged-in session from utmp; `idle` is seconds since the last input on its tty, None when
    the tty cannot be seen (then it does not count as recently used)."""

    user: str
    line: str  # pts/0, tty1
    host: str  # where an SSH login came from; empty for a console
    pid: int
    login_time: float  # seconds since the epoch
    idle: float | None

    @property
    def kind(self) -> str:
        # `:0` (a local X display's terminal) or `tmux(123).%0` (a multiplexer's window): local
        local = not self.host or self.host.startswith(":") or MULTIPLEXER_HOST.match(self.host)
        return "console" if local else "ssh"


def read_logins(root: str, now: float) -> list[Login]:
    """The USER_PROCESS records of `<root>/run/utmp` (or `<root>/var/run/utmp`); [] without one.

    A record whose process is gone from `<root>/proc` is stale (a crashed session) and left out,
    as `w` does; without a `<root>/proc` directory nothing is left out for that."""
    for rel in UTMP_PATHS:
        path = os.path.join(root, rel)
        try:
            with open(path, "rb") as f:
                data = f.read()
            break
        except FileNotFoundError:
            continue
        except OSError as err:
            raise SourceError(f"cannot read {path}: {err.strerror or err}") from err
    else:
        return []
    proc = os.path.join(root, "proc")
    check_pids = os.path.isdir(proc)
    logins = []
    for offset in range(0, len(data) - UTMP.size + 1, UTMP.size):  # a torn last record is ignored
        (ut_type, pid, line, _id, user, host, _term, _exit, _session, tv_sec, _tv_usec,
         *_rest) = UTMP.unpack_from(data, offset)
        if ut_type != USER_PROCESS:
            continue
        user_s, line_s = _text(user), _text(line)
        if not user_s or (check_pids and not os.path.exists(os.path.join(proc, str(pid)))):
            continue
        logins.append(Login(user=user_s, line=line_s, host=_text(host), pid=pid, login_time=float(tv_sec),
                            idle=_tty_idle(root, line_s, now)))
    return logins


def _tty_idle(root: str, line: str, now: float) -> float | None:
    """now - atime of `<root>/dev/<line>` (procps w.c idletime()); None when there is no such device."""
    if not line or ".." in line.split("/"):
        return None
    try:
        atime = os.stat(os.path.join(root, "dev", line.lstrip("/"))).st_atime
    except OSError:
        return None
    return max(0.0, now - atime)


# ------------------------------------------------------------------------------------------------ GPUs

@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    utilization: float | None  # percent; None when nvidia-smi does not know it (MIG, no permission)


def read_gpus(nvidia_smi: str | None, timeout: float) -> list[Gpu] | None:
    """Every GPU's utilisation from nvidia-smi (`nvidia_smi`: its path; None: found on PATH).

    None when there is no nvidia-smi on PATH or it finds no GPU or driver (no GPU source); raises
    SourceError when it is configured but missing, fails otherwise, takes longer than `timeout` s or
    prints something else."""
    if nvidia_smi is None:
        exe = shutil.which("nvidia-smi")
        if exe is None:
            return None
    else:
        exe = nvidia_smi
        if not (os.path.isfile(exe) and os.access(exe, os.X_OK)):
            raise SourceError(f"{exe} is not an executable file")
    try:
        done = subprocess.run([exe, *NVIDIA_SMI_QUERY], capture_output=True, timeout=timeout,
                              stdin=subprocess.DEVNULL, check=False)
    except subprocess.TimeoutExpired as err:
        raise SourceError(f"{exe} did not answer within {timeout:g} s") from err
    except OSError as err:
        raise SourceError(f"cannot run {exe}: {err.strerror or err}") from err
    out = done.stdout.decode("utf-8", "replace")
    if done.returncode in NVIDIA_SMI_NO_GPU:
        return None
    if done.returncode != 0:
        said = (done.stderr.decode("utf-8", "replace").strip() or out.strip()).splitlines()
        meaning = NVIDIA_SMI_EXITS.get(done.returncode)
        reason = f"{exe} exited with {done.returncode}" + (f" ({meaning})" if meaning else "")
        raise SourceError(reason + (f": {said[0].strip()[:200]}" if said else ""))
    return [_gpu_line(exe, line) for line in out.splitlines() if line.strip()]


def _gpu_line(exe: str, line: str) -> Gpu:
    """`0, NVIDIA A100-SXM4-40GB, 87`: index first, utilisation last, the name whatever is between."""
    parts = line.split(",", 1)
    rest = parts[1].rsplit(",", 1) if len(parts) == 2 else []
    if len(rest) != 2:
        raise SourceError(f"{exe} printed an unexpected line: {line.strip()[:200]!r}")
    index_s, (name, util_s) = parts[0].strip(), (rest[0].strip(), rest[1].strip())
    try:
        index = int(index_s)
        utilization = None if util_s in NOT_A_VALUE else float(util_s)
    except ValueError as err:
        raise SourceError(f"{exe} printed an unexpected line: {line.strip()[:200]!r}") from err
    return Gpu(index=index, name=name, utilization=utilization)


# ------------------------------------------------------------------------------------------------- CPU

@dataclass(frozen=True)
class BusyProcess:
    pid: int
    uid: int
    user: str
    command: str
    cpu: float  # percent of one CPU between the last two samples


class BusyProcesses:
    """User processes (uid >= min_uid) using the CPU: each `read()` compares with the previous
    one, so the first finds nothing."""

    def __init__(self, root: str, min_uid: int) -> None:
        self.root = root
        self.min_uid = min_uid
        self._previous: tuple[int, int, dict[tuple[int, int], int]] | None = None

    def read(self, threshold: float) -> list[BusyProcess]:
        """The processes above `threshold` percent of one CPU since the last read."""
        total, cpus = self._machine_ticks()
        procs = self._processes()
        ticks = {key: used for key, (used, _uid, _comm) in procs.items()}
        previous, self._previous = self._previous, (total, cpus, ticks)
        if previous is None or total <= previous[0]:
            return []
        per_cpu = (total - previous[0]) / max(cpus, 1)  # ticks one CPU had in between
        names = self._user_names()
        busy = []
        for key, (used, uid, comm) in sorted(procs.items()):
            before = previous[2].get(key)
            if before is None:
                continue  # new since the last read (or its pid was reused): next time
            share = 100.0 * (used - before) / per_cpu
            if share > threshold:
                busy.append(BusyProcess(pid=key[0], uid=uid, user=names.get(uid, str(uid)), command=comm,
                                        cpu=share))
        return busy

    def _machine_ticks(self) -> tuple[int, int]:
        """All CPUs' ticks (user..steal; guest time is already in user) and the number of CPUs."""
        path = os.path.join(self.root, "proc", "stat")
        try:
            with open(path) as f:
                lines = f.read().splitlines()
            total = sum(int(v) for v in lines[0].split()[1:9]) if lines[0].startswith("cpu ") else -1
        except (OSError, ValueError, IndexError) as err:
            raise SourceError(f"cannot read the CPU time in {path}: {err}") from err
        if total < 0:
            raise SourceError(f"{path} does not start with the total cpu line")
        cpus = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
        return total, cpus

    def _processes(self) -> dict[tuple[int, int], tuple[int, int, str]]:
        """(pid, start time) -> (utime + stime, uid, command) of every process of uid >= min_uid."""
        proc = os.path.join(self.root, "proc")
        try:
            pids = [int(name) for name in os.listdir(proc) if name.isdigit()]
        except OSError as err:
            raise SourceError(f"cannot list {proc}: {err.strerror or err}") from err
        found = {}
        for pid in pids:
            try:
                uid = self._uid(os.path.join(proc, str(pid), "status"))
                if uid is None or uid < self.min_uid or uid == NOBODY_UID:
                    continue
                with open(os.path.join(proc, str(pid), "stat")) as f:
                    stat = f.read()
            except OSError:
                continue  # gone in between
            # `pid (comm) state ppid ...`: comm may hold spaces and parentheses, so split at the last ')'
            head, _, tail = stat.rpartition(")")
            fields = tail.split()
            try:
                utime, stime, start = int(fields[11]), int(fields[12]), int(fields[19])
            except (IndexError, ValueError):
                continue
            found[(pid, start)] = (utime + stime, uid, head.partition("(")[2])
        return found

    @staticmethod
    def _uid(status_path: str) -> int | None:
        with open(status_path) as f:
            for line in f:
                if line.startswith("Uid:"):
                    return int(line.split()[1])  # the real uid
        return None

    def _user_names(self) -> dict[int, str]:
        """uid -> name from /etc/passwd; without one, processes are shown with their uid."""
        names: dict[int, str] = {}
        with contextlib.suppress(OSError):
            with open(os.path.join(self.root, "etc", "passwd")) as f:
                for line in f:
                    parts = line.split(":")
                    if len(parts) > 2 and parts[2].isdigit():
                        names.setdefault(int(parts[2]), parts[0])
        return names


# ------------------------------------------------------------------------------------------ the sampler

def _since(login_time: float, now: float) -> str:
    """`09:10 UTC`, or `2024-05-01 09:10 UTC` when not today (the texts are read in browsers in any
    time zone, so they say theirs)."""
    then, today = time.gmtime(login_time), time.gmtime(now)
    fmt = "%H:%M UTC" if then[:3] == today[:3] else "%Y-%m-%d %H:%M UTC"
    return time.strftime(fmt, then)


def _ago(seconds: float) -> str:
    return "just now" if seconds < 60 else f"{round(seconds / 60)} min ago"


def _clock(ts: float) -> str:
    return time.strftime("%H:%M UTC", time.gmtime(ts))


def average_gpus(readings: list[list[Gpu]]) -> list[Gpu]:
    """Each GPU's mean utilisation over `readings` (those that knew it), in index order."""
    seen: dict[int, tuple[str, list[float]]] = {}
    for reading in readings:
        for gpu in reading:
            values = seen.setdefault(gpu.index, (gpu.name, []))[1]
            if gpu.utilization is not None:
                values.append(gpu.utilization)
    return [Gpu(index=index, name=name, utilization=sum(values) / len(values) if values else None)
            for index, (name, values) in sorted(seen.items())]


def jupyter_last_activity(settings: Mapping[str, Any]) -> datetime | None:
    """When Jupyter itself was last used, as jupyter-server's `last_activity()` counts it (API
    requests, kernel messages, terminal I/O: every `*_last_activity` setting and
    `last_activity_times`), without the server's start and this module's own key."""
    moments = [v for k, v in settings.items() if k.endswith("_last_activity") and k != LAST_ACTIVITY_KEY]
    moments += list((settings.get("last_activity_times") or {}).values())
    kernels = settings.get("kernel_manager")
    moments.append(getattr(kernels, "last_kernel_activity", None))
    return max((m for m in moments if isinstance(m, datetime)), default=None)


class WorkstationActivity(LoggingConfigurable):
    """Whether someone uses this machine (`c.WorkstationActivity.*`)."""

    root = Unicode(help="The machine's root directory. Default: $KUBEVIRT_SIM_MACHINE_ROOT (the "
                        "simulator's machine directory), else /.").tag(config=True)
    interval = Float(60.0, min=1.0, max=3600.0, help="Seconds between samples (and reports to the workstations "
                                                     "service), 1 to 3600.").tag(config=True)
    login_idle_seconds = Float(600.0, help="A login (SSH, console) counts while its terminal had input "
                                           "within this many seconds.").tag(config=True)
    gpu_threshold = Float(10.0, help="A GPU counts while its mean utilisation over the interval is above this "
                                     "percentage.").tag(config=True)
    gpu_sample_seconds = Float(5.0, help="Seconds between GPU readings within an interval.").tag(config=True)
    cpu_threshold = Float(0.0, help="A user's process counts while it uses more than this percentage of one "
                                    "CPU between two samples; 0: processes are not looked at.").tag(config=True)
    min_uid = Integer(1000, help="The lowest uid of a user (for cpu_threshold).").tag(config=True)
    nvidia_smi = Unicode("", help="Path of nvidia-smi; empty: found on PATH (none there: no GPU is "
                                  "looked at).").tag(config=True)
    gpu_timeout = Float(10.0, help="Seconds nvidia-smi may take.").tag(config=True)

    @default("root")
    def _default_root(self) -> str:
        return os.environ.get("KUBEVIRT_SIM_MACHINE_ROOT") or "/"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._warned: set[tuple[str, str]] = set()
        self._processes: BusyProcesses | None = None
        self._periodics: list[PeriodicCallback] = []
        self._sampling = False
        self._gpu_lock = threading.Lock()  # readings come from executor threads
        self._gpu_readings: list[list[Gpu]] = []
        self._has_gpus = True  # until nvidia-smi says otherwise: then only each sample looks again
        # gets every sample's reasons and the interval (the workstations service shows them)
        self.reporter: Callable[[list[dict[str, Any]], float], Awaitable[None]] | None = None

    def _failed(self, source: str, err: SourceError) -> None:
        """Log a source's failure once per distinct reason, not every interval."""
        if (source, str(err)) not in self._warned:
            self._warned.add((source, str(err)))
            self.log.warning("Workstation activity: %s skipped: %s", source, err)

    def read_gpus(self) -> None:
        """One reading of the GPUs into those the next sample averages. Blocks."""
        try:
            gpus = read_gpus(self.nvidia_smi or None, self.gpu_timeout)
        except SourceError as err:  # (maybe passing: the readings between samples go on)
            self._failed("GPUs", err)
            return
        self._has_gpus = gpus is not None  # none: only each sample looks again
        if gpus:
            with self._gpu_lock:
                self._gpu_readings.append(gpus)

    def sample(self, now: float | None = None) -> list[dict[str, Any]]:
        """Why the machine counts as active outside Jupyter: `{"source", "text", "since"}` each; []
        when idle. Blocks (reads files, runs nvidia-smi): the server calls it off its event loop."""
        now = time.time() if now is None else now
        reasons: list[dict[str, Any]] = []
        try:
            logins = read_logins(self.root, now)
        except SourceError as err:
            self._failed("logins", err)
            logins = []
        for login in logins:
            if login.idle is None or login.idle > self.login_idle_seconds:
                continue
            where = f"from {login.host}" if login.kind == "ssh" else f"on {login.line}"
            what = "SSH session" if login.kind == "ssh" else "Console session"
            reasons.append({"source": login.kind,
                            "text": f"{what} of {login.user} {where} since {_since(login.login_time, now)} "
                                    f"(input {_ago(login.idle)})",
                            "since": _iso(login.login_time)})
        self.read_gpus()
        with self._gpu_lock:
            readings, self._gpu_readings = self._gpu_readings, []
        for gpu in average_gpus(readings):
            if gpu.utilization is not None and gpu.utilization > self.gpu_threshold:
                reasons.append({"source": "gpu", "text": f"GPU {gpu.index} ({gpu.name}) {gpu.utilization:.0f} % "
                                                         f"busy at {_clock(now)}", "since": None})
        if self.cpu_threshold > 0:
            if self._processes is None or self._processes.root != self.root:
                self._processes = BusyProcesses(self.root, self.min_uid)
            self._processes.min_uid = self.min_uid
            try:
                busy = self._processes.read(self.cpu_threshold)
            except SourceError as err:
                self._failed("processes", err)
                busy = []
            for p in busy:
                reasons.append({"source": "cpu", "text": f"{p.command} (pid {p.pid}) of {p.user} "
                                                         f"{p.cpu:.0f} % of a CPU", "since": None})
        return reasons

    def jupyter_in_use(self, settings: Mapping[str, Any], now: datetime) -> list[dict[str, Any]]:
        """Jupyter's own use within the last interval (it is in last_activity already)."""
        last = jupyter_last_activity(settings)
        if last is None or (now - last).total_seconds() > self.interval:
            return []
        return [{"source": "jupyter", "text": f"Jupyter in use, last at {_clock(last.timestamp())}", "since": None}]

    async def update(self, settings: MutableMapping[str, Any]) -> list[dict[str, Any]] | None:
        """One sample, off the event loop, into the web application's `settings`, then to the
        reporter; None when the previous sample is still running."""
        if self._sampling:
            return None
        self._sampling = True
        try:
            reasons = await asyncio.get_running_loop().run_in_executor(None, self.sample)
        except Exception:
            self.log.exception("Workstation activity: sampling failed")
            return None
        finally:
            self._sampling = False
        now = datetime.now(timezone.utc)  # tz-aware, like jupyter-server's own *_last_activity
        try:
            if settings.get("kernel_manager") is not None:
                reasons += busy_kernels(settings["kernel_manager"])
            reasons += open_tunnels(settings, now.timestamp())
            if reasons:
                settings[LAST_ACTIVITY_KEY] = now
            reasons = self.jupyter_in_use(settings, now) + reasons
        except Exception:  # (a kernel gone meanwhile, an extension's odd setting): what was found counts
            self.log.exception("Workstation activity: looking at Jupyter failed")
            if reasons:
                settings[LAST_ACTIVITY_KEY] = now
        previous = settings.get(REASONS_KEY)
        if bool(reasons) != bool(previous and previous.get("reasons")):
            self.log.info("Workstation activity: %s", "; ".join(r["text"] for r in reasons) or "idle")
        settings[REASONS_KEY] = {"time": now.isoformat(), "reasons": reasons}
        if self.reporter is not None:
            try:
                await self.reporter(reasons, self.interval)
            except Exception:
                self.log.exception("Workstation activity: reporting failed")
        return reasons

    async def _read_gpus_between_samples(self) -> None:
        if self._has_gpus and not self._sampling:
            await asyncio.get_running_loop().run_in_executor(None, self.read_gpus)

    def start(self, settings: MutableMapping[str, Any]) -> None:
        """Sample now, then every `interval`, into `settings`; read the GPUs in between."""
        self.stop()
        IOLoop.current().add_callback(self.update, settings)
        self._periodics = [PeriodicCallback(lambda: self.update(settings), self.interval * 1000)]
        if self.gpu_sample_seconds < self.interval:
            self._periodics.append(PeriodicCallback(self._read_gpus_between_samples, self.gpu_sample_seconds * 1000))
        for periodic in self._periodics:
            periodic.start()

    def stop(self) -> None:
        for periodic in self._periodics:
            periodic.stop()
        self._periodics = []


def busy_kernels(kernel_manager: Any) -> list[dict[str, Any]]:
    """Kernels running a cell: busy without output is still work (jupyter-server counts only
    kernel messages as activity, so a long silent cell would look idle)."""
    reasons = []
    for kernel_id in list(kernel_manager.list_kernel_ids()):
        kernel = kernel_manager.get_kernel(kernel_id)
        if getattr(kernel, "execution_state", None) == "busy":
            name = getattr(kernel, "kernel_name", "") or "kernel"
            reasons.append({"source": "kernel", "text": f"a {name} kernel running a cell", "since": None})
    return reasons


def open_tunnels(settings: Mapping[str, Any], now: float) -> list[dict[str, Any]]:
    """The SSH tunnels open now, oldest first: each is someone connected (guest.sshd keeps them)."""
    tunnels = sorted(dict(settings.get(TUNNELS_KEY) or {}).values(), key=lambda t: t["since"])
    return [{"source": "ssh-tunnel", "text": f"SSH through the hub from {t['from']} since {_since(t['since'], now)}",
             "since": _iso(t["since"])} for t in tunnels]


def start(serverapp: ServerApp, reporter: Callable[[list[dict[str, Any]], float], Awaitable[None]] | None = None
          ) -> WorkstationActivity:
    """Sample the machine's activity every `c.WorkstationActivity.interval` on this server;
    `reporter` gets every sample's reasons (the workstations service shows them)."""
    activity = WorkstationActivity(parent=serverapp)  # parent: c.WorkstationActivity.* applies, logs go to its log
    activity.reporter = reporter
    activity.start(serverapp.web_app.settings)
    activity.log.info("Workstation activity: logins, GPUs%s of %s every %g s", " and processes"
                      if activity.cpu_threshold > 0 else "", activity.root, activity.interval)
    return activity
