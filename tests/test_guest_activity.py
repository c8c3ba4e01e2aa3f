"""The guest's activity sources (kubevirt_spawner.guest.activity) on fake machine roots: utmp and
ttys, a fake nvidia-smi, fake /proc trees, and the wiring into a Jupyter server's settings."""

from __future__ import annotations

import logging
import os
import re
import stat
import time
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from traitlets.config import Config, LoggingConfigurable

from kubevirt_spawner.guest import activity as act
from kubevirt_spawner.guest.activity import (
    USER_PROCESS,
    UTMP,
    BusyProcesses,
    Gpu,
    SourceError,
    WorkstationActivity,
    read_gpus,
    read_logins,
)

NOW = 1_750_000_000.0
DEAD_PROCESS = 8
LOGIN_PROCESS = 6
SINCE = re.compile(r"since (\d{4}-\d\d-\d\d )?\d\d:\d\d UTC ")
NVML_FAILED = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
               "Make sure that the latest NVIDIA driver is installed and running.")


def utmp_record(ut_type: int, pid: int, line: str, user: str, host: str = "", tv_sec: int = 0) -> bytes:
    return UTMP.pack(ut_type, pid, line.encode(), line[-4:].encode(), user.encode(), host.encode(),
                     0, 0, 0, tv_sec, 123456, 0, 0, 0, 0, b"")


def machine(root: Path, records: list[bytes], ttys: dict[str, float | None], utmp: str = "run/utmp",
            now: float = NOW) -> Path:
    """A machine directory: `utmp` with `records`, and `/dev/<line>` with atime `ttys[line]`
    (seconds before `now`; None: no such device) and an mtime (output) long before."""
    path = root / utmp
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(records))
    for line, ago in ttys.items():
        if ago is None:
            continue
        dev = root / "dev" / line
        dev.parent.mkdir(parents=True, exist_ok=True)
        dev.touch()
        os.utime(dev, (now - ago, now - 3 * 3600))
    return root


def standard_machine(root: Path, ssh_ago: float | None = 30, console_ago: float | None = 5000,
                     now: float = NOW) -> Path:
    """alice over SSH on pts/0, bob on tty1, and a DEAD_PROCESS record of a closed pts/1 session."""
    records = [
        utmp_record(2, 0, "~", "reboot", "6.1.0", int(now) - 86400),  # BOOT_TIME
        utmp_record(LOGIN_PROCESS, 700, "tty2", "LOGIN", "", int(now) - 86400),
        utmp_record(USER_PROCESS, 1234, "pts/0", "alice", "10.0.0.5", int(now) - 3600),
        utmp_record(USER_PROCESS, 800, "tty1", "bob", "", int(now) - 7200),
        utmp_record(DEAD_PROCESS, 999, "pts/1", "", "", int(now) - 600),
    ]
    return machine(root, records, {"pts/0": ssh_ago, "tty1": console_ago, "pts/1": 1, "tty2": 1}, now=now)


def script(tmp_path: Path, body: str, name: str = "nvidia-smi") -> str:
    path = tmp_path / "bin" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return str(path)


def smi_printing(tmp_path: Path, csv: str) -> str:
    """A fake nvidia-smi printing `csv` and recording its arguments in bin/args."""
    return script(tmp_path, f'echo "$@" > "$(dirname "$0")/args"\nprintf \'{csv}\'')


@pytest.fixture
def no_gpu_path(tmp_path, monkeypatch):
    """A PATH without nvidia-smi (the test machine's own must not be found)."""
    empty = tmp_path / "empty-path"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))


# ------------------------------------------------------------------------------------------------ utmp

def test_utmp_layout_and_logins(tmp_path):
    """utmp layout: glibc bits/utmp.h `struct utmp`, 384 bytes on x86_64 (32-bit ut_session/ut_tv),
    USER_PROCESS = 7, DEAD_PROCESS = 8; NUL-padded strings. Idle as `w` computes it (procps w.c
    idletime(): now - st_atime of /dev/<ut_line>)."""
    assert UTMP.size == 384 and USER_PROCESS == 7
    # the offsets glibc's struct has: ut_line at 8, ut_user at 44, ut_host at 76, ut_tv at 340
    rec = utmp_record(USER_PROCESS, 1, "pts/0", "alice", "h", 77)
    assert rec[8:13] == b"pts/0" and rec[44:49] == b"alice" and rec[76:77] == b"h"
    assert int.from_bytes(rec[340:344], "little") == 77
    root = standard_machine(tmp_path / "m")
    # a torn record at the end (utmp being written) is ignored
    with open(root / "run" / "utmp", "ab") as f:
        f.write(utmp_record(USER_PROCESS, 5, "pts/9", "eve", "x")[:100])
    logins = read_logins(str(root), NOW)
    assert [(x.user, x.line, x.host, x.kind, x.pid, x.login_time) for x in logins] == [
        ("alice", "pts/0", "10.0.0.5", "ssh", 1234, NOW - 3600),
        ("bob", "tty1", "", "console", 800, NOW - 7200),
    ]
    assert [round(x.idle or -1) for x in logins] == [30, 5000]
    with pytest.raises(AttributeError):  # frozen
        logins[0].user = "mallory"  # type: ignore[misc]


def test_utmp_full_width_strings_and_display_host(tmp_path):
    """utmp strings are NUL-padded, not necessarily NUL-terminated (glibc bits/utmp.h: char arrays of
    UT_NAMESIZE 32); a `:0` host is a local X display's terminal (libutempter), as `w` shows FROM :0."""
    user = "u" * 32
    root = machine(tmp_path, [utmp_record(USER_PROCESS, 1, "pts/3", user, ":0", 1)], {"pts/3": 0})
    (login,) = read_logins(str(root), NOW)
    assert login.user == user and login.kind == "console" and login.idle == 0


def test_utmp_missing_device_and_fallback_path(tmp_path):
    """utmp location: /run/utmp, /var/run/utmp on older layouts (research notes §3; systemd
    tmpfiles.d/systemd.conf); Debian 13 may have none at all. A tty that cannot be stat()ed gives no idle time."""
    root = machine(tmp_path / "old", [utmp_record(USER_PROCESS, 1, "pts/0", "alice", "h", 1)], {"pts/0": None},
                   utmp="var/run/utmp")
    (login,) = read_logins(str(root), NOW)
    assert login.user == "alice" and login.idle is None
    assert read_logins(str(tmp_path / "nothing"), NOW) == []


def test_utmp_stale_records_dropped_when_proc_is_there(tmp_path):
    """`w` drops utmp entries whose process is gone (procps w.c checks the pid; research notes §3)."""
    root = standard_machine(tmp_path)
    (root / "proc" / "1234").mkdir(parents=True)  # alice's sshd session lives; bob's login (800) does not
    assert [x.user for x in read_logins(str(root), NOW)] == ["alice"]


def test_utmp_unreadable_is_a_source_error(tmp_path):
    """A utmp that exists but cannot be read (here: a directory) is a failure, not 'nobody logged in'."""
    (tmp_path / "run" / "utmp").mkdir(parents=True)
    with pytest.raises(SourceError, match="cannot read"):
        read_logins(str(tmp_path), NOW)


# ---------------------------------------------------------------------------------------------- nvidia-smi

def test_nvidia_smi_csv(tmp_path):
    """nvidia-smi --query-gpu=... --format=csv,noheader,nounits: one line per GPU, fields in the asked
    order separated by ", ", no header, no units (research notes §4)."""
    smi = smi_printing(tmp_path, "0, NVIDIA A100-SXM4-40GB, 87\\n1, NVIDIA A100-SXM4-40GB, 3\\n")
    assert read_gpus(smi, 5) == [Gpu(0, "NVIDIA A100-SXM4-40GB", 87.0), Gpu(1, "NVIDIA A100-SXM4-40GB", 3.0)]
    assert (tmp_path / "bin" / "args").read_text().split() == [
        "--query-gpu=index,name,utilization.gpu", "--format=csv,noheader,nounits"]


def test_nvidia_smi_not_available_values(tmp_path):
    """nvidia-smi prints `[N/A]` (e.g. utilization on MIG) or `[Not Supported]` for a value it
    cannot give (research notes §4: nvidia_gpu_exporter #203 and others)."""
    smi = smi_printing(tmp_path, "0, NVIDIA A100 MIG, [N/A]\\n1, Tesla K80, [Not Supported]\\n2, T4, 55\\n")
    assert read_gpus(smi, 5) == [Gpu(0, "NVIDIA A100 MIG", None), Gpu(1, "Tesla K80", None), Gpu(2, "T4", 55.0)]


def test_nvidia_smi_without_a_gpu_or_driver_is_no_gpu_source(tmp_path):
    """nvidia-smi RETURN VALUE (man nvidia-smi): 6 = the query was unsuccessful ("No devices were
    found"), 9 = the NVIDIA driver is not loaded ('NVIDIA-SMI has failed because it couldn't
    communicate with the NVIDIA driver'): what a CPU-only VM cloned from a CUDA image answers.
    No GPU, no source, and nothing to warn about."""
    assert read_gpus(script(tmp_path, f'echo "{NVML_FAILED}"\nexit 9'), 5) is None
    assert read_gpus(script(tmp_path, 'echo "No devices were found"\nexit 6'), 5) is None


def test_nvidia_smi_failures(tmp_path):
    """nvidia-smi RETURN VALUE (man nvidia-smi): 15 = a GPU fell off the bus, a failure worth a
    warning; unknown output is not guessed at."""
    smi = script(tmp_path, 'echo "Unable to determine the device handle for GPU0000:3B:00.0: GPU is lost."\nexit 15')
    with pytest.raises(SourceError) as err:
        read_gpus(smi, 5)
    assert str(err.value) == (f"{smi} exited with 15 (GPU fell off the bus): Unable to determine the device handle "
                              "for GPU0000:3B:00.0: GPU is lost.")
    garbage = smi_printing(tmp_path, "this is not csv\\n")
    with pytest.raises(SourceError, match="unexpected line: 'this is not csv'"):
        read_gpus(garbage, 5)
    with pytest.raises(SourceError, match="unexpected line"):
        read_gpus(smi_printing(tmp_path, "zero, A100, 5\\n"), 5)


def test_nvidia_smi_timeout(tmp_path):
    """A hung nvidia-smi (driver trouble) is killed after the timeout (subprocess.run kills the child)."""
    smi = script(tmp_path, "exec sleep 30")
    start = time.monotonic()
    with pytest.raises(SourceError, match=r"did not answer within 0\.3 s"):
        read_gpus(smi, 0.3)
    assert time.monotonic() - start < 5


def test_nvidia_smi_absent(tmp_path, no_gpu_path):
    """No nvidia-smi on PATH (shutil.which): no GPU source, not an error; a configured path that is
    not there is a misconfiguration, so an error."""
    assert read_gpus(None, 5) is None
    with pytest.raises(SourceError, match="is not an executable file"):
        read_gpus(str(tmp_path / "nope"), 5)


def test_nvidia_smi_found_on_path(tmp_path, monkeypatch):
    """Without a configured path nvidia-smi is looked up on PATH like a shell would (shutil.which)."""
    smi = smi_printing(tmp_path, "0, T4, 12\\n")
    monkeypatch.setenv("PATH", os.path.dirname(smi))
    assert read_gpus(None, 5) == [Gpu(0, "T4", 12.0)]


# -------------------------------------------------------------------------------------------------- sample

def test_sample_idle_machine(tmp_path, no_gpu_path):
    """Idle as `w` computes it (procps w.c, tty atime): input long ago, or no tty to stat, is not
    activity; no nvidia-smi on PATH is no GPU source and no warning."""
    root = standard_machine(tmp_path, ssh_ago=3600, console_ago=None)
    a = WorkstationActivity(root=str(root))
    assert a.sample(NOW) == []
    assert a._warned == set()


def test_sample_recent_ssh_and_console(tmp_path, no_gpu_path):
    """The kernel bumps a tty's atime on input (drivers/tty/tty_io.c tty_update_time), so a login
    whose tty was read from within login_idle_seconds is in use."""
    root = standard_machine(tmp_path, ssh_ago=130, console_ago=5000)
    a = WorkstationActivity(root=str(root))
    (reason,) = a.sample(NOW)
    assert reason["source"] == "ssh"
    assert reason["text"].startswith("SSH session of alice from 10.0.0.5 since ")
    assert SINCE.search(reason["text"]) and reason["text"].endswith("(input 2 min ago)")
    assert datetime.fromisoformat(reason["since"]).timestamp() == NOW - 3600
    a.login_idle_seconds = 6000
    console = a.sample(NOW)[1]
    assert console["source"] == "console"
    assert console["text"].startswith("Console session of bob on tty1 since ")
    assert console["text"].endswith("(input 83 min ago)")


def test_sample_gpus(tmp_path):
    """GPU utilisation from nvidia-smi (research notes §4): above gpu_threshold counts, below or
    unknown (`[N/A]`) does not; the text says when."""
    root = standard_machine(tmp_path, ssh_ago=None, console_ago=None)
    smi = smi_printing(tmp_path, "0, NVIDIA A100, 87\\n1, NVIDIA A100, 3\\n2, NVIDIA A100, [N/A]\\n")
    a = WorkstationActivity(root=str(root), nvidia_smi=smi)
    at = time.strftime("%H:%M UTC", time.gmtime(NOW))
    assert a.sample(NOW) == [{"source": "gpu", "text": f"GPU 0 (NVIDIA A100) 87 % busy at {at}", "since": None}]
    a.gpu_threshold = 90
    assert a.sample(NOW) == []


def test_the_gpu_counts_by_its_mean_over_the_interval(tmp_path):
    """nvidia-smi's utilization.gpu covers well under a second (man nvidia-smi: "over the past sample
    period ... between 1 second and 1/6 second"), so the readings taken every gpu_sample_seconds
    between two samples are averaged: a GPU busy in bursts counts by its mean, and the next
    interval starts afresh."""
    root = standard_machine(tmp_path, ssh_ago=None, console_ago=None)
    values = tmp_path / "values"
    values.write_text("100\n0\n20\n")
    # each run prints the next value (the first line) and drops it
    smi = script(tmp_path, f'v=$(head -n1 {values}); sed -i 1d {values}; echo "0, NVIDIA T4, $v"')
    a = WorkstationActivity(root=str(root), nvidia_smi=smi, gpu_threshold=30)
    a.read_gpus()
    a.read_gpus()
    (reason,) = a.sample(NOW)  # (100 + 0 + 20) / 3 = 40
    assert reason["text"].startswith("GPU 0 (NVIDIA T4) 40 % busy at ")
    values.write_text("35\n")
    (reason,) = a.sample(NOW)  # only the reading since the last sample
    assert reason["text"].startswith("GPU 0 (NVIDIA T4) 35 % busy at ")
    assert act.average_gpus([[Gpu(0, "T4", None)], [Gpu(0, "T4", None)]]) == [Gpu(0, "T4", None)]


def test_sample_failing_source_warns_once_per_reason(tmp_path, caplog):
    """nvidia-smi exit 14 (infoROM corrupted, man nvidia-smi RETURN VALUE) is logged once, not every
    interval, and the other sources still count; a new reason is logged again."""
    root = standard_machine(tmp_path, ssh_ago=10)
    smi = script(tmp_path, 'echo "WARNING: infoROM is corrupted at gpu 0000:3B:00.0"\nexit 14')
    log = logging.getLogger("test_guest_activity")
    a = WorkstationActivity(root=str(root), nvidia_smi=smi, log=log)
    with caplog.at_level(logging.WARNING, logger=log.name):
        for _ in range(3):
            assert [r["source"] for r in a.sample(NOW)] == ["ssh"]
        Path(smi).write_text("#!/bin/sh\nexit 12\n")
        a.sample(NOW)
        a.sample(NOW)
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == [f"Workstation activity: GPUs skipped: {smi} exited with 14 (infoROM corrupted): "
                        "WARNING: infoROM is corrupted at gpu 0000:3B:00.0",
                        f"Workstation activity: GPUs skipped: {smi} exited with 12 (NVML library not found)"]


def test_root_default_from_simulator_env(monkeypatch):
    """The simulator points the guest at a machine directory with $KUBEVIRT_SIM_MACHINE_ROOT."""
    monkeypatch.setenv("KUBEVIRT_SIM_MACHINE_ROOT", "/sim/machines/alice")
    assert WorkstationActivity().root == "/sim/machines/alice"
    monkeypatch.delenv("KUBEVIRT_SIM_MACHINE_ROOT")
    assert WorkstationActivity().root == "/"


# -------------------------------------------------------------------------------------------- /proc (CPU)

class FakeProc:
    """A /proc tree: /proc/stat with 2 CPUs and processes with utime/stime (proc(5))."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "proc").mkdir(parents=True, exist_ok=True)
        (root / "etc").mkdir(exist_ok=True)
        (root / "etc" / "passwd").write_text("root:x:0:0::/root:/bin/sh\nalice:x:1000:1000::/home/alice:/bin/sh\n"
                                             "nobody:x:65534:65534::/:/usr/sbin/nologin\n")

    def machine(self, total: int) -> None:
        """`total` ticks over 2 CPUs: user nice system idle iowait irq softirq steal guest guest_nice."""
        half = total // 2
        (self.root / "proc" / "stat").write_text(
            f"cpu  {total // 4} 0 0 {total - total // 4} 0 0 0 0 {total // 8} 0\n"
            f"cpu0 {half // 4} 0 0 {half - half // 4} 0 0 0 0 0 0\ncpu1 {half // 4} 0 0 {half - half // 4} 0 0 0 0 0 0\n"
            "intr 1 2 3\nctxt 5\n")

    def process(self, pid: int, uid: int, comm: str, utime: int, stime: int, start: int = 500) -> None:
        d = self.root / "proc" / str(pid)
        d.mkdir(exist_ok=True)
        (d / "status").write_text(f"Name:\t{comm[:15]}\nState:\tR (running)\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n")
        fields = ["R", "1", str(pid), str(pid), "0", "-1", "4194304", "0", "0", "0", "0", str(utime), str(stime),
                  "0", "0", "20", "0", "1", "0", str(start), "1000000", "100"]
        (d / "stat").write_text(f"{pid} ({comm}) " + " ".join(fields) + "\n")


def test_busy_processes(tmp_path):
    """proc(5): /proc/<pid>/stat fields 14/15 utime/stime and 22 starttime in clock ticks, comm in
    parentheses (may hold spaces and ')'); /proc/<pid>/status `Uid:` real first; /proc/stat `cpu` line
    sums all CPUs in the same USER_HZ ticks (guest time already counted in user)."""
    proc = FakeProc(tmp_path)
    proc.machine(10_000)
    proc.process(100, 1000, "python3", 50, 10)
    proc.process(101, 1000, "bash", 5, 5)
    proc.process(102, 1000, "my (odd) job", 0, 0)
    proc.process(1, 0, "systemd", 0, 0)
    proc.process(103, 65534, "nobody's", 0, 0)
    busy = BusyProcesses(str(tmp_path), 1000)
    assert busy.read(10) == []  # nothing to compare with yet
    proc.machine(10_400)  # 400 ticks in all = 200 per CPU
    proc.process(100, 1000, "python3", 200, 40)  # +180 ticks: 90 % of one CPU
    proc.process(101, 1000, "bash", 6, 5)  # +1: 0.5 %
    proc.process(102, 1000, "my (odd) job", 30, 0)  # +30: 15 %
    proc.process(1, 0, "systemd", 200, 200)  # root: never a user's work
    proc.process(103, 65534, "nobody's", 200, 0)  # nobody: neither
    proc.process(104, 1000, "new", 100, 0)  # not there last time
    found = busy.read(10)
    assert [(p.pid, p.user, p.command, round(p.cpu)) for p in found] == [
        (100, "alice", "python3", 90), (102, "alice", "my (odd) job", 15)]
    proc.machine(10_800)
    proc.process(100, 1000, "python3", 200, 40, start=900)  # pid reused by a new process
    proc.process(102, 1000, "my (odd) job", 60, 0)
    assert [p.pid for p in busy.read(10)] == [102]


def test_sample_cpu_off_by_default_and_on(tmp_path, no_gpu_path):
    """cpu_threshold 0 leaves /proc alone; above 0, user processes above it count (proc(5) as above)."""
    proc = FakeProc(tmp_path)
    a = WorkstationActivity(root=str(tmp_path))
    assert a.sample(NOW) == []  # no /proc/stat at all, and no warning: not looked at
    assert a._warned == set()
    proc.machine(1000)
    proc.process(100, 1000, "python3", 0, 0)
    a.cpu_threshold = 50
    assert a.sample(NOW) == []
    proc.machine(1200)
    proc.process(100, 1000, "python3", 95, 0)
    assert a.sample(NOW) == [{"source": "cpu", "text": "python3 (pid 100) of alice 95 % of a CPU", "since": None}]


# -------------------------------------------------------------------------------------------------- wiring

class FakeServerApp(LoggingConfigurable):
    """What start() uses of jupyter-server's ServerApp: a configurable (config, log) with web_app.settings."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.web_app = SimpleNamespace(settings={"base_url": "/"})


async def test_start_sets_tz_aware_last_activity(tmp_path, no_gpu_path):
    """jupyter-server's ServerWebApplication.last_activity() takes max() over every setting ending in
    `_last_activity` (must be tz-aware: mixing naive raises TypeError), and jupyterhub-singleuser's
    notify_activity() reports it to the hub (research notes §2)."""
    now = time.time()
    root = standard_machine(tmp_path / "m", ssh_ago=3600, console_ago=None, now=now)
    config = Config()
    config.WorkstationActivity.root = str(root)
    config.WorkstationActivity.interval = 3600.0
    app = FakeServerApp(config=config, log=logging.getLogger("test_guest_activity"))
    a = act.start(cast(Any, app))
    try:
        assert a.root == str(root) and a.parent is app
        settings = app.web_app.settings
        assert await a.update(settings) == []
        assert act.LAST_ACTIVITY_KEY not in settings  # idle: nothing to report
        assert settings[act.REASONS_KEY]["reasons"] == []
        os.utime(root / "dev" / "pts" / "0", (now - 1, now - 1))  # alice types
        reasons = await a.update(settings)
        assert [r["source"] for r in reasons or []] == ["ssh"]
        last = settings[act.LAST_ACTIVITY_KEY]
        assert last.tzinfo is not None and abs(last.timestamp() - time.time()) < 60
        assert settings[act.REASONS_KEY]["reasons"] == reasons
        assert datetime.fromisoformat(settings[act.REASONS_KEY]["time"]) == last
        max([last, datetime.fromisoformat("2026-01-01T00:00:00+00:00")])  # comparable with jupyter's own
    finally:
        a.stop()


async def test_a_kernel_running_a_cell_counts_and_every_sample_is_reported(tmp_path, no_gpu_path):
    """A kernel whose last status message said busy (jupyter-server's MappingKernelManager records
    `execution_state` from iopub status messages, services/kernels/kernelmanager.py) is running a
    cell, output or not: the machine is busy. Each sample's reasons go to the reporter."""
    root = standard_machine(tmp_path / "m", ssh_ago=3600, console_ago=None, now=time.time())
    config = Config()
    config.WorkstationActivity.root = str(root)
    config.WorkstationActivity.interval = 3600.0
    app = FakeServerApp(config=config, log=logging.getLogger("test_guest_activity"))
    kernels = {"k1": SimpleNamespace(execution_state="idle", kernel_name="python3"),
               "k2": SimpleNamespace(execution_state="busy", kernel_name="python3")}
    app.web_app.settings["kernel_manager"] = SimpleNamespace(
        list_kernel_ids=lambda: list(kernels), get_kernel=kernels.__getitem__)
    reported: list = []

    async def reporter(reasons, every):
        reported.append(reasons)
        assert every == 3600.0

    a = act.start(cast(Any, app), reporter)
    try:
        reasons = await a.update(app.web_app.settings)
        assert reasons == [{"source": "kernel", "text": "a python3 kernel running a cell", "since": None}]
        assert act.LAST_ACTIVITY_KEY in app.web_app.settings
        kernels["k2"].execution_state = "idle"
        assert await a.update(app.web_app.settings) == []
        assert reported[-2:] == [reasons, []]
    finally:
        a.stop()


def test_jupyter_own_use_is_named_without_this_modules_key(tmp_path, no_gpu_path):
    """Jupyter's own activity, as jupyter-server's ServerWebApplication.last_activity() counts it
    (serverapp.py: every `*_last_activity` setting such as api_last_activity and
    terminal_last_activity, last_activity_times, the kernel manager's last_kernel_activity), is a
    source while it is within the interval; the server's start and this module's own key are not."""
    from datetime import timedelta, timezone
    now = datetime.now(timezone.utc)
    a = WorkstationActivity(root=str(tmp_path), interval=60)
    settings: dict = {"started": now, act.LAST_ACTIVITY_KEY: now, "last_activity_times": {},
                      "kernel_manager": SimpleNamespace(last_kernel_activity=now - timedelta(hours=1))}
    assert a.jupyter_in_use(settings, now) == []
    settings["terminal_last_activity"] = now - timedelta(seconds=30)
    (reason,) = a.jupyter_in_use(settings, now)
    clock = (now - timedelta(seconds=30)).strftime("%H:%M UTC")
    assert reason == {"source": "jupyter", "text": f"Jupyter in use, last at {clock}", "since": None}
    settings["terminal_last_activity"] = now - timedelta(seconds=61)
    assert a.jupyter_in_use(settings, now) == []
    settings["last_activity_times"] = {"GET /api/contents": now - timedelta(seconds=5)}
    assert len(a.jupyter_in_use(settings, now)) == 1


def test_a_multiplexers_window_is_local_not_ssh():
    """libutempter records a tmux/screen window with the multiplexer as its host (`tmux(1234).%0`),
    and a local X terminal with the display (`:0`): console sessions, not remote logins."""
    def kind(host: str) -> str:
        return act.Login(user="a", line="pts/3", host=host, pid=1, login_time=NOW, idle=1).kind
    assert kind("tmux(1234).%0") == "console" and kind(":0") == "console" and kind("") == "console"
    assert kind("10.0.0.5") == "ssh" and kind("laptop.example.org") == "ssh"


def test_the_interval_is_one_second_to_an_hour():
    """The service ages a report by the interval it names and takes 1 to 3600 s: a guest set
    outside that is a configuration error at start, not refused reports all day."""
    from traitlets import TraitError
    for bad in (0.5, 3601):
        with pytest.raises(TraitError):
            WorkstationActivity(interval=bad)
