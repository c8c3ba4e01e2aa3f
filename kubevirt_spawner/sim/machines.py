"""The `qemu` guests: a running VMI is a QEMU virtual machine booting its root disk's image, as
virt-launcher runs one, with the configuration disks KubeVirt builds and the real guest agent.

- A volume's disk is the file `disk.img` in the volume's directory: a Block volume's device (the RBD
  image) or a Filesystem volume's image. An empty one is created sparse at the claim's size, and one
  smaller than its claim is grown to it, as virt-launcher does for a Filesystem PVC (kubevirt
  pkg/host-disk/host-disk.go: createSparseRaw, and the ExpandDisks resize); the guest grows its
  partition at boot (growpart).
- The golden image is `deploy/golden-image/build.sh`'s output: its disk.raw fills the golden PVC,
  and every machine boots its root disk through the firmware its VMI asks for (SeaBIOS or OVMF),
  as KubeVirt boots a PVC: GRUB, the kernel and the initramfs are on the disk. The image's kernel
  file beside it only serves the KVM probe.
- The guest agent is polled as virt-handler polls it (pkg/virt-handler/agent-poller: os info,
  users and filesystems every 10 s); it is connected while it answers.
- A stop is libvirt's default shutdown (virDomainShutdown with no flags): through the agent when it
  is connected, else an ACPI power button (QMP system_powerdown); at the end of the grace period
  QEMU is terminated, then killed (virDomainDestroyFlags GRACEFUL, then plain).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..quantity import parse_quantity
from .guests import in_mount_namespace
from .qemu import Agent, AgentError, Disk, Firmware, Machine, Share, accelerator, command, ovmf_firmware, vmi_firmware

log = logging.getLogger(__name__)

DISK_IMAGE = "disk.img"  # virt-launcher's name of a Filesystem PVC's image (host-disk.go)
AGENT_POLL_SECONDS = 10.0  # virt-handler's agent poller: sysInfo, users and filesystems
AGENT_PROBE_SECONDS = 2.0  # how often a silent agent is tried again
KILL_AFTER_TERM_SECONDS = 5.0
VIRTIOFSD_LISTEN_SECONDS = 10.0
# QEMU 7.2's virtiofsd (Debian's qemu-system-common); later Debian releases ship the Rust one
# (package virtiofsd) in /usr/libexec. Both take the options used here.
VIRTIOFSD_PATHS = ("/usr/libexec/virtiofsd", "/usr/lib/qemu/virtiofsd")
# The ports forwarded when the interface lists none: masquerade then forwards every port, the
# workstation uses these (Jupyter, SSH).
DEFAULT_PORTS = (8888, 22)


@dataclass(frozen=True)
class GoldenImage:
    """What build.sh made: the disk, the firmware it boots with, and a copy of its kernel (for the
    KVM probe only)."""
    disk: str
    probe_kernel: str
    firmware: tuple[str, ...] = ("bios", "efi")

    @classmethod
    def load(cls, directory: str) -> GoldenImage:
        path = os.path.join(directory, "image.json")
        try:
            with open(path) as f:
                meta = json.load(f)
        except (OSError, ValueError) as err:
            raise ValueError(f"{directory} is not a golden image build.sh made (no readable image.json: "
                             f"{err}); build one with deploy/golden-image/build.sh") from err
        if not meta.get("firmware"):
            raise ValueError(f"the golden image in {directory} boots by no firmware (an image from before "
                             "images had a bootloader); build it again with deploy/golden-image/build.sh")
        disk, probe_kernel = (os.path.join(directory, meta.get(k) or "") for k in ("disk", "probe_kernel"))
        image = cls(disk, probe_kernel, firmware=tuple(meta["firmware"]))
        for file in (image.disk, image.probe_kernel):
            if not os.path.isfile(file):
                raise ValueError(f"the golden image in {directory} lacks {os.path.basename(file) or 'a file'}; "
                                 "build it again with deploy/golden-image/build.sh")
        return image


def volume_image(directory: str, size_bytes: int) -> str:
    """The volume's disk image: created sparse at `size_bytes` when missing, grown to it when smaller
    (never shrunk: a claim cannot shrink)."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, DISK_IMAGE)
    with open(path, "ab") as f:
        if f.tell() < size_bytes:
            f.truncate(size_bytes)
    return path


def vcpus(domain: dict) -> int:
    """The guest's vCPUs: the domain's CPU topology, else the CPU limit, else the request, rounded up
    (kubevirt pkg/virt-launcher/virtwrap/converter/vcpu/vcpu.go)."""
    cpu = domain.get("cpu") or {}
    if any(cpu.get(k) for k in ("cores", "sockets", "threads")):
        return max(1, int(cpu.get("cores") or 1) * int(cpu.get("sockets") or 1) * int(cpu.get("threads") or 1))
    resources = domain.get("resources") or {}
    for part in ("limits", "requests"):
        value = (resources.get(part) or {}).get("cpu")
        if value:
            return max(1, math.ceil(float(parse_quantity(str(value)))))
    return 1


def memory_mib(domain: dict) -> int:
    value = (domain.get("memory") or {}).get("guest") or ((domain.get("resources") or {}).get("requests") or {}).get("memory")
    return max(256, int(parse_quantity(str(value or "1Gi")) // 2**20))


def forwarded_ports(spec: dict) -> list[int]:
    ports = [int(p["port"]) for i in field_list(spec, "domain", "devices", "interfaces") for p in i.get("ports") or []
             if (p.get("protocol") or "TCP").upper() == "TCP"]
    return ports or list(DEFAULT_PORTS)


def field_list(obj: dict, *path: str) -> list:
    for part in path:
        obj = (obj or {}).get(part) or {}
    return obj if isinstance(obj, list) else []


class QemuGuest:
    """One VMI's QEMU process and its guest agent."""

    def __init__(self, key: tuple[str, str], machine: Machine, workdir: str, log_path: str,
                 on_agent_change: Callable[[], None] = lambda: None, file_servers: Sequence[list[str]] = ()):
        self.key = key
        self.file_servers = list(file_servers)  # virtiofsd commands, one per share, started before QEMU
        self.file_procs: list[asyncio.subprocess.Process] = []
        self.machine = machine
        self.workdir = workdir  # the machine's sockets and configuration disks; removed when it ends
        self.log_path = log_path
        self.root: str | None = None  # (no directory tree: the disk is an image)
        self.uid = ""
        self.booted = time.time()
        self.grace_override: int | None = None
        self.hurried = asyncio.Event()
        self.agent = Agent(machine.agent_socket)
        self.agent_connected = False
        self.on_agent_change = on_agent_change  # the agent connected or went, or its OS info changed
        self.frozen = False  # its filesystems frozen by the agent (an online snapshot)
        self.agent_info: dict = {}  # the agent's latest answers: osinfo, hostname, timezone, users, fsinfo
        self.proc: asyncio.subprocess.Process | None = None
        self._poller: asyncio.Task | None = None

    async def start(self):
        os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
        with open(self.log_path, "ab") as out:
            await self._serve_files(out)
            self.proc = await asyncio.create_subprocess_exec(*_ending_with_parent(command(self.machine)),
                                                             stdin=asyncio.subprocess.DEVNULL, stdout=out,
                                                             stderr=asyncio.subprocess.STDOUT, start_new_session=True)
        self._poller = asyncio.get_running_loop().create_task(self._poll_agent())

    async def _serve_files(self, out):
        """virtiofsd for each share, listening before QEMU connects to it (as virt-launcher's
        virtiofs containers start before the domain); each ends when QEMU lets go of it."""
        for cmd in self.file_servers:
            self.file_procs.append(await asyncio.create_subprocess_exec(
                *_ending_with_parent(cmd), stdin=asyncio.subprocess.DEVNULL, stdout=out,
                stderr=asyncio.subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + VIRTIOFSD_LISTEN_SECONDS
        for share in self.machine.shares:
            while not os.path.exists(share.socket):
                if time.monotonic() > deadline or any(p.returncode is not None for p in self.file_procs):
                    self._stop_file_servers()
                    raise RuntimeError(f"virtiofsd did not serve the filesystem {share.tag} (see {self.log_path})")
                await asyncio.sleep(0.05)

    def _stop_file_servers(self):
        for proc in self.file_procs:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def wait(self) -> int:
        code = await self.proc.wait() if self.proc is not None else 0
        self._ended()
        return code

    async def exited(self) -> int:
        """QEMU's exit code once it has ended (without ending anything of this guest's)."""
        return await asyncio.shield(self.proc.wait()) if self.proc is not None else 0

    def _ended(self):
        self.agent_connected = False
        self.discard()

    def discard(self):
        """The machine is off (or never started): its agent poller and working directory go."""
        if self._poller is not None:
            self._poller.cancel()
        self._stop_file_servers()
        shutil.rmtree(self.workdir, ignore_errors=True)

    async def _poll_agent(self):
        while self.alive:
            if self.frozen:  # a frozen agent answers only fsfreeze-status/thaw, sync, ping and info
                await asyncio.sleep(AGENT_PROBE_SECONDS)
                continue
            before = (self.agent_connected, self.agent_info.get("osinfo"))
            try:
                await self.refresh_agent_info()
                self.agent_connected = True
            except AgentError:
                self.agent_connected = False
            if (self.agent_connected, self.agent_info.get("osinfo")) != before:
                self.on_agent_change()
            await asyncio.sleep(AGENT_POLL_SECONDS if self.agent_connected else AGENT_PROBE_SECONDS)

    async def refresh_agent_info(self):
        info = {}
        for name, call in (("osinfo", "guest-get-osinfo"), ("hostname", "guest-get-host-name"),
                           ("timezone", "guest-get-timezone"), ("users", "guest-get-users"),
                           ("fsinfo", "guest-get-fsinfo"), ("info", "guest-info")):
            info[name] = await self.agent.call(call, timeout=5.0)
        self.agent_info = info

    def hurry(self, grace: int):
        self.grace_override = grace
        self.hurried.set()

    async def request_shutdown(self):
        """libvirt's default shutdown: the agent's guest-shutdown when it is connected, else the
        ACPI power button."""
        if self.agent_connected:
            try:
                await self.agent.call("guest-shutdown", {"mode": "powerdown"}, reply=False, timeout=5.0)
                log.info("%s/%s: shutting down through the guest agent", *self.key)
                return
            except AgentError as err:
                log.info("%s/%s: %s; pressing the power button instead", *self.key, err)
        try:
            await monitor_command(self.machine.monitor_socket, "system_powerdown")
            log.info("%s/%s: the power button pressed", *self.key)
        except (OSError, ValueError, asyncio.TimeoutError) as err:
            log.info("%s/%s: the power button could not be pressed: %s", *self.key, err)

    async def stop(self, grace: float) -> int:
        """The end of the grace period: QEMU is terminated, then killed."""
        proc = self.proc
        if proc is None or not self.alive:
            return proc.returncode if proc and proc.returncode is not None else 0
        if grace > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                return await asyncio.wait_for(asyncio.shield(proc.wait()), grace)
        log.info("%s/%s: the grace period is over: QEMU is terminated", *self.key)
        self._signal(signal.SIGTERM)
        try:
            return await asyncio.wait_for(asyncio.shield(proc.wait()), KILL_AFTER_TERM_SECONDS)
        except asyncio.TimeoutError:
            self._signal(signal.SIGKILL)
            return await proc.wait()

    def kill(self):
        if self.alive:
            self._signal(signal.SIGKILL)
        self._stop_file_servers()

    def _signal(self, sig):
        if self.proc is not None:  # (its callers check it runs)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    async def freeze(self):
        """Freeze the guest's filesystems (KubeVirt's online snapshot: guest-fsfreeze-freeze)."""
        self.frozen = True
        try:
            await self.agent.call("guest-fsfreeze-freeze", timeout=60.0)
        except AgentError:
            await self.thaw()  # (a freeze that timed out may have frozen some of them)
            raise

    async def thaw(self):
        try:
            await self.agent.call("guest-fsfreeze-thaw", timeout=60.0)
        finally:
            self.frozen = False


def _ending_with_parent(args: list[str]) -> list[str]:
    """QEMU's command, run so that the kernel sends it SIGTERM when the simulator's thread ends,
    however it ends (util-linux setpriv --pdeathsig, prctl(2) PR_SET_PDEATHSIG): no machine
    outlives the simulator."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "TERM", "--", *args] if setpriv else args


async def monitor_command(socket_path: str, name: str, timeout: float = 5.0) -> dict:
    """One QMP command on QEMU's monitor socket (after the capabilities handshake)."""
    async def run():
        reader, writer = await asyncio.open_unix_connection(socket_path)
        try:
            json.loads(await reader.readline())  # the greeting
            answer: dict = {}
            for execute in ("qmp_capabilities", name):
                writer.write(json.dumps({"execute": execute}).encode() + b"\n")
                await writer.drain()
                while True:  # (events may come before the answer)
                    answer = json.loads(await reader.readline())
                    if "return" in answer or "error" in answer:
                        break
                if "error" in answer:
                    raise ValueError(f"QEMU refused {execute}: {answer['error'].get('desc')}")
            return answer
        finally:
            writer.close()
    return await asyncio.wait_for(run(), timeout)


def workdir_for(key: tuple[str, str]) -> str:
    """A short private directory for the machine's sockets (a socket path has at most 107 bytes)."""
    return tempfile.mkdtemp(prefix=f"kvs-{key[1][:20]}-")


_accel: dict[str, str] = {}


def machine_accelerator(kernel: str) -> str:
    """KVM where a KVM guest boots here, else TCG; probed once per kernel."""
    if kernel not in _accel:
        _accel[kernel] = accelerator(kernel)
        log.info("QEMU guests use %s", _accel[kernel])
    return _accel[kernel]


def file_servers(shares: dict[str, tuple[str, bool]], workdir: str) -> tuple[tuple[Share, ...], list[list[str]]]:
    """The machine's virtiofs shares (tag -> (directory, read-only)) and the virtiofsd commands
    that serve them. A read-only one is served from a read-only bind mount of the directory in a
    mount namespace of its own: the launcher pod's readOnly mount, which the guest cannot undo."""
    if not shares:
        return (), []
    virtiofsd = next((p for p in VIRTIOFSD_PATHS if os.access(p, os.X_OK)), None)
    if virtiofsd is None:
        raise RuntimeError(f"no virtiofsd ({' or '.join(VIRTIOFSD_PATHS)}): apt-get install qemu-system-x86")
    machine_shares, commands = [], []
    for tag, (directory, read_only) in sorted(shares.items()):
        share = Share(tag, os.path.join(workdir, f"fs-{tag}.sock"))
        served = os.path.join(workdir, f"fs-{tag}") if read_only else directory
        cmd = [virtiofsd, f"--socket-path={share.socket}", "-o", f"source={served}", "-o", "sandbox=chroot",
               "-o", "cache=auto"]
        commands.append(in_mount_namespace([(directory, served, True)], cmd) if read_only else cmd)
        machine_shares.append(share)
    return tuple(machine_shares), commands


def new_machine(name: str, spec: dict, disks: list[Disk], ip: str, workdir: str, console_log: str,
                accel: str, shares: tuple[Share, ...] = ()) -> Machine:
    """The VMI's machine; with EFI, its own copy of OVMF's variable store in `workdir`."""
    domain = spec.get("domain") or {}
    efi, secure_boot = vmi_firmware(spec)
    firmware = ovmf_firmware(secure_boot, os.path.join(workdir, f"{name}_VARS.fd")) if efi else Firmware()
    return Machine(name=name, cpus=vcpus(domain), memory_mib=memory_mib(domain), disks=tuple(disks),
                   forwards=tuple((ip, port, port) for port in forwarded_ports(spec)),
                   agent_socket=os.path.join(workdir, "agent.sock"), monitor_socket=os.path.join(workdir, "qmp.sock"),
                   console_log=console_log, accel=accel, firmware=firmware, shares=shares,
                   uuid=(domain.get("firmware") or {}).get("uuid"), serial=(domain.get("firmware") or {}).get("serial"))
