"""`kubevirt-workstation`: what the golden image's workstation unit runs at every boot to become
this user's Jupyter server (deploy/golden-image/kubevirt-workstation.service starts it as root).

1. It mounts the env disk (the VM's Secret volume `hubenv`, an ISO 9660 image found by its serial
   as /dev/disk/by-id/virtio-hubenv) read-only in a root-only directory under /run, a tmpfs: the
   hub's token never reaches the root disk.
2. It reads JupyterHub's environment from it: one file per variable at the image's root, the extra
   Jupyter arguments in `args.json`. KubeVirt grafts every entry of the Secret's mount into the
   image (pkg/config/config.go), kubelet's `..data` and `..<timestamp>` directories included,
   and cloud-init's `userdata` is no variable: those are skipped.
3. When the VM has a workspace disk, it waits for that disk on /home (a home made on the system
   disk first would be hidden by the mount, and lost to the user). It creates the Linux user for
   JUPYTERHUB_USER when there is none (a clone's first boot, or the first boot after a reset of
   the system disk), keeping the owner of a home that the workspace disk already holds, so the
   user's files stay theirs; an account whose home is missing (a new, blank workspace disk) gets
   a fresh one.
   When the VM has a scratch disk (an emptyDisk, blank at every start), it waits for it on
   /scratch too and opens it to everyone, sticky, as /tmp.
4. It mounts the VM's extra disks (KUBEVIRT_EXTRA_DISKS gives each disk's serial and path): a
   blank one gets an ext4 filesystem owned by the user, and each grows to its disk's size. One
   that cannot be mounted ends the launcher (the unit tries again): what the user writes there
   must land on the disk, not on the system disk under it. Then the shared data (virtiofs
   filesystems, KUBEVIRT_SHARED_DATA gives each tag's path and whether it is read-only); one
   that fails is reported in the journal and skipped. An entry of either list that is not one
   (a hub newer than the image, say) is reported and skipped.
5. It leaves the keys command of the machine's sshd (guest/keys.py) what it needs to ask the
   workstations service for the user's SSH keys: the service's URL and this start's token, in a
   file only root and that command's group read (none when the hub turned SSH off).
6. It runs jupyterhub-singleuser as that user in their home; JUPYTERHUB_SERVICE_URL (from the
   spawner) makes it listen on 0.0.0.0:8888. The unit restarts it whenever it ends.
"""

from __future__ import annotations

import argparse
import contextlib
import grp
import hashlib
import json
import os
import pwd
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

from ..objects import (
    ARGS_KEY,
    ENV_DISK_SERIAL,
    EXTRA_DISK_PREFIX,
    EXTRA_DISKS_ENV,
    SCRATCH_DISK_SERIAL,
    SCRATCH_MOUNT,
    SHARED_DATA_ENV,
    USERDATA_KEY,
    WORKSPACE_DISK_SERIAL,
    WORKSPACE_MOUNT,
    check_mount_path,
)
from . import keys

ENV_DEVICE = f"/dev/disk/by-id/virtio-{ENV_DISK_SERIAL}"  # systemd's 60-persistent-storage.rules
ENV_MOUNT = "/run/kubevirt-workstation/env"
# Rock Ridge keeps kubelet's modes (0644: readable by all) and Debian 12's kernel refuses isofs's
# overriderockperms, so the token is kept from users by the mount's root-only parent directory.
ENV_MOUNT_OPTIONS = "ro,nosuid,nodev,noexec"
SYS_BLOCK = "/sys/block"  # virtio_blk gives each disk's serial as /sys/block/vdX/serial
SKEL = "/etc/skel"
RUNTIME_BASE = "/run/jupyter"  # Jupyter's runtime directories, one per account, on the /run tmpfs
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
DISK_SERIAL = re.compile(r"^" + re.escape(EXTRA_DISK_PREFIX) + r"[a-z0-9]([-a-z0-9]{0,13}[a-z0-9])?$")  # 20 bytes
DEVICES = "/dev/disk/by-id"  # systemd's 60-persistent-storage.rules: virtio-SERIAL
DEVICE_WAIT = 60.0  # seconds for udev to link a disk the kernel has
SHARE_TAG = re.compile(r"^[a-z0-9]([-a-z0-9]{0,34}[a-z0-9])?$")  # a volume name of at most 36 bytes (virtio-fs)
# useradd's default NAME_REGEX (Debian's adduser.conf is stricter still): lower case, at most 32
LINUX_NAME = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
SHELL = "/bin/bash"
# The owner administers the machine (apt, /etc, /opt, systemd): the image's sudoers drop-in lets
# this group use sudo without a password, which the owner does not have.
ADMIN_GROUP = "sudo"
FIRST_USER_UID = 1000  # Debian's and Ubuntu's UID_MIN (login.defs): below it, system accounts

Runner = Callable[[Sequence[str]], None]


class LaunchError(Exception):
    """Why the workstation cannot start its Jupyter server, in one sentence for the journal."""


def run(command: Sequence[str]) -> None:
    """Run a system command; its failure is a LaunchError naming the command and what it said."""
    done = subprocess.run(list(command), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()
        raise LaunchError(f"{' '.join(command)} failed ({done.returncode})" + (f": {said[-1]}" if said else ""))


# --------------------------------------------------------------------------------------- the env disk

def mount_env_disk(device: str = ENV_DEVICE, target: str = ENV_MOUNT, runner: Runner = run) -> None:
    """Mount the env disk at `target` (once: a restart of the unit finds it mounted)."""
    if os.path.ismount(target):
        return
    if not os.path.exists(device):
        raise LaunchError(f"{device} is missing: this VM has no {ENV_DISK_SERIAL} disk (the Secret volume "
                          "the spawner gives every workstation), so there is no JupyterHub environment")
    parent = os.path.dirname(target)
    os.makedirs(parent, mode=0o700, exist_ok=True)
    os.chmod(parent, 0o700)  # nobody but root reaches the token, whatever the image's modes
    os.makedirs(target, mode=0o700, exist_ok=True)
    runner(["mount", "-t", "iso9660", "-o", ENV_MOUNT_OPTIONS, device, target])


def read_env_disk(directory: str) -> tuple[dict[str, str], list[str]]:
    """JupyterHub's environment (file name -> content) and the extra Jupyter arguments."""
    env: dict[str, str] = {}
    args: list[str] = []
    try:
        names = sorted(os.listdir(directory))
    except OSError as err:
        raise LaunchError(f"cannot read the env disk at {directory}: {err.strerror or err}") from err
    for name in names:
        path = os.path.join(directory, name)
        if name.startswith("..") or name == USERDATA_KEY or not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as f:
            value = f.read()
        if name == ARGS_KEY:
            args = _arguments(value)
        elif ENV_NAME.match(name):
            env[name] = value
    if not env.get("JUPYTERHUB_USER") or not env.get("JUPYTERHUB_API_TOKEN"):
        raise LaunchError(f"the env disk at {directory} has no JUPYTERHUB_USER or JUPYTERHUB_API_TOKEN: "
                          "it was not written by a JupyterHub spawner")
    return env, args


def _arguments(text: str) -> list[str]:
    try:
        args = json.loads(text)
    except ValueError as err:
        raise LaunchError(f"{ARGS_KEY} on the env disk is not JSON: {err}") from err
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise LaunchError(f"{ARGS_KEY} on the env disk must be a JSON list of strings")
    return args


# ------------------------------------------------------------------------------------ the workspace disk

def has_disk(serial: str, sys_block: str = SYS_BLOCK) -> bool:
    """Whether the kernel has a virtio disk with this serial (the VM's disk `serial`, which KubeVirt
    passes to QEMU). The kernel finds every virtio disk when its driver loads, in the initramfs,
    long before udev makes the /dev/disk/by-id links that fstab's mount waits for."""
    try:
        names = os.listdir(sys_block)
    except OSError:
        return False
    for name in names:
        with contextlib.suppress(OSError), open(os.path.join(sys_block, name, "serial"), encoding="ascii") as f:
            if f.read().strip() == serial:
                return True
    return False


def wait_for_disk(mount: str, serial: str, what: str, sys_block: str = SYS_BLOCK, runner: Runner = run,
                  is_mount: Callable[[str], bool] = os.path.ismount) -> bool:
    """When the VM has the disk of `serial`, `mount` must be that disk before it is used. fstab
    mounts it `nofail` (a VM without it still boots), and systemd orders a nofail mount before
    nothing: this asks systemd for the mount and waits for it (the device, a filesystem on a
    blank disk, the mount). A failure ends the launcher, and the unit tries again. Whether the
    disk is there."""
    if is_mount(mount):
        return True
    if not has_disk(serial, sys_block):
        return False
    runner(["systemctl", "start", mount])  # (systemctl takes a path for its mount unit)
    if not is_mount(mount):
        raise LaunchError(f"the {what} is not mounted at {mount}: systemd started its mount unit "
                          f"but nothing is mounted there (see `systemctl status {mount}`)")
    return True


def wait_for_workspace(homes: str = WORKSPACE_MOUNT, sys_block: str = SYS_BLOCK, runner: Runner = run,
                       is_mount: Callable[[str], bool] = os.path.ismount) -> None:
    """The workspace disk on `homes` before a home is made or used (one made on the system disk
    first would be hidden by the mount, and lost to the user)."""
    wait_for_disk(homes, WORKSPACE_DISK_SERIAL, "workspace disk", sys_block, runner, is_mount)


def prepare_scratch(scratch: str = SCRATCH_MOUNT, sys_block: str = SYS_BLOCK, runner: Runner = run,
                    is_mount: Callable[[str], bool] = os.path.ismount) -> None:
    """The scratch disk (blank at every start: fstab makes its filesystem) on `scratch`, open to
    everyone with the sticky bit, as /tmp."""
    if wait_for_disk(scratch, SCRATCH_DISK_SERIAL, "scratch disk", sys_block, runner, is_mount):
        try:
            os.chmod(scratch, 0o1777)
        except OSError as err:
            raise LaunchError(f"the scratch disk at {scratch} cannot be opened to everyone: {err}") from None


# ------------------------------------------------------------------------------------------ shared data

def _entries(env: dict[str, str], variable: str, key: str, pattern: re.Pattern) -> tuple[list[dict], list[str]]:
    """The entries of a JSON list the hub gives (shared data, extra disks): each a dict whose `key`
    matches `pattern` and whose `path` is a mount point. Those that are not are left out and said
    (one sentence each): a hub newer than the image may give what this launcher does not know."""
    try:
        entries = json.loads(env.get(variable) or "[]")
    except ValueError:
        return [], [f"{variable} is not JSON: none of it is mounted"]
    if not isinstance(entries, list):
        return [], [f"{variable} is not a list: none of it is mounted"]
    out, problems = [], []
    for entry in entries:
        name = entry.get(key) if isinstance(entry, dict) else None
        if not isinstance(name, str) or not pattern.match(name):
            problems.append(f"{variable}: {entry!r} has no valid {key}: left out")
            continue
        try:
            path = check_mount_path(entry.get("path"))
        except ValueError as err:
            problems.append(f"{variable}: {name}: {err}: left out")
            continue
        out.append({**entry, key: name, "path": path})
    return out, problems


def shared_data(env: dict[str, str]) -> tuple[list[dict], list[str]]:
    """The shared data entries of KUBEVIRT_SHARED_DATA (the spawner's JSON list of tag, path and
    readOnly), and the problems with those left out."""
    entries, problems = _entries(env, SHARED_DATA_ENV, "tag", SHARE_TAG)
    return [{"tag": e["tag"], "path": e["path"], "readOnly": e.get("readOnly") is True} for e in entries], problems


def extra_disks(env: dict[str, str]) -> tuple[list[dict], list[str]]:
    """The extra disks of KUBEVIRT_EXTRA_DISKS (the spawner's JSON list of serial and path), and
    the problems with those left out."""
    entries, problems = _entries(env, EXTRA_DISKS_ENV, "serial", DISK_SERIAL)
    return [{"serial": e["serial"], "path": e["path"]} for e in entries], problems


def has_signature(device: str) -> bool:
    """Whether the disk holds anything blkid knows (a filesystem, a partition table, RAID, LVM):
    only a disk without any gets a filesystem. blkid -p exits 2 when it finds nothing."""
    done = subprocess.run(["blkid", "-p", device], capture_output=True, text=True, check=False)
    if done.returncode in (0, 2):
        return done.returncode == 0
    raise LaunchError(f"blkid -p {device} failed ({done.returncode}): {(done.stderr or done.stdout).strip()}")


def wait_for_device(device: str, timeout: float = DEVICE_WAIT, sleep: Callable[[float], None] = time.sleep) -> None:
    """udev links a disk under /dev/disk/by-id soon after the kernel finds it; wait for that."""
    waited = 0.0
    while not os.path.exists(device):
        if waited >= timeout:
            raise LaunchError(f"{device} did not appear within {timeout:.0f} s: the VM has no such disk, though the "
                              "hub says it should")
        sleep(0.5)
        waited += 0.5


def mount_extra_disks(entries: list[dict], account: pwd.struct_passwd, runner: Runner = run,
                      is_mount: Callable[[str], bool] = os.path.ismount,
                      probe: Callable[[str], bool] = has_signature,
                      devices: str = DEVICES, wait: Callable[[str], None] = wait_for_device) -> list[str]:
    """Mount each extra disk at its path (once: a restart of the unit finds them mounted): a
    blank disk gets an ext4 filesystem whose top directory is the user's; every disk grows to
    its size (a profile made it larger). A disk that cannot be mounted is a LaunchError; a
    filesystem that cannot grow is a problem said (one sentence each)."""
    problems = []
    for entry in entries:
        path, device = entry["path"], os.path.join(devices, f"virtio-{entry['serial']}")
        if is_mount(path):
            continue
        wait(device)
        made = False
        if not probe(device):
            runner(["mkfs.ext4", "-q", "-L", entry["serial"][len(EXTRA_DISK_PREFIX):], device])
            made = True
        try:
            os.makedirs(path, mode=0o755, exist_ok=True)
        except OSError as err:
            raise LaunchError(f"the extra disk {entry['serial']} cannot be mounted at {path}: {err}") from None
        runner(["mount", "-o", "nosuid,nodev", device, path])
        if made:  # (a disk that held files keeps its owners: it may be a clone of a prepared one)
            os.chown(path, account.pw_uid, account.pw_gid)
        try:
            runner(["resize2fs", device])
        except LaunchError as err:
            problems.append(f"the extra disk {entry['serial']} at {path} does not grow to its disk's size: {err}")
    return problems


def mount_shared_data(entries: list[dict], runner: Runner = run,
                      is_mount: Callable[[str], bool] = os.path.ismount) -> list[str]:
    """Mount each virtiofs share at its path (once: a restart of the unit finds them mounted).
    A share that cannot be mounted is reported and skipped: the machine starts without it rather
    than not at all. The problems, one sentence each."""
    problems = []
    for entry in entries:
        path = entry["path"]
        if is_mount(path):
            continue
        options = "ro,nosuid,nodev" if entry["readOnly"] else "nosuid,nodev"
        try:
            os.makedirs(path, mode=0o755, exist_ok=True)
            runner(["mount", "-t", "virtiofs", "-o", options, entry["tag"], path])
        except (LaunchError, OSError) as err:
            problems.append(f"the shared data {entry['tag']} is not mounted at {path}: {err}")
    return problems


# ---------------------------------------------------------------------------------------------- the user

def linux_name(hub_user: str) -> str:
    """The Linux account of a JupyterHub user: the same name when Linux allows it, else a
    readable slug with a hash of the full name (so two hub names never share an account)."""
    if LINUX_NAME.match(hub_user):
        return hub_user
    slug = re.sub(r"[^a-z0-9_-]+", "-", hub_user.lower()).strip("-")[:23]
    if not slug or not re.match(r"[a-z_]", slug):
        slug = "u" + slug[:22]
    return f"{slug}-{hashlib.sha256(hub_user.encode()).hexdigest()[:8]}"


def ensure_user(name: str, homes: str = WORKSPACE_MOUNT, runner: Runner = run,
                lookup: Callable[[str], pwd.struct_passwd] = pwd.getpwnam,
                groups: Sequence[str] = ()) -> pwd.struct_passwd:
    """The account `name`, created when missing: with its home under `homes`, in `groups`; when
    that home is already there (the workspace disk outlived a system reset) with the uid that owns it."""
    with contextlib.suppress(KeyError):  # (a clone's first boot has no such account yet)
        account = lookup(name)
        if account.pw_uid < FIRST_USER_UID:  # root, daemon, mail...: never a hub user's server
            raise LaunchError(f"The hub user {name} has the name of the system account {name} (uid "
                              f"{account.pw_uid}); give the user another name in JupyterHub.")
        if not os.path.isdir(account.pw_dir):
            make_home(account)
        return account
    home = os.path.join(homes, name)
    command = ["useradd", "--create-home", "--home-dir", home, "--shell", SHELL, "--user-group"]
    if groups:
        command += ["--groups", ",".join(groups)]
    try:
        owner = os.stat(home).st_uid
    except FileNotFoundError:
        owner = None
    if owner not in (None, 0) and not _uid_taken(owner):
        command += ["--uid", str(owner)]
    runner([*command, name])
    return lookup(name)


def make_home(account: pwd.struct_passwd, skel: str = SKEL) -> None:
    """A fresh home for an account whose home is gone (the VM has a new, blank workspace disk): what
    useradd --create-home makes, the skeleton's files owned by the account, the home 0700."""
    if os.path.isdir(skel):
        shutil.copytree(skel, account.pw_dir, symlinks=True)
    else:
        os.makedirs(account.pw_dir)
    for directory, dirs, files in os.walk(account.pw_dir):
        for name in [directory, *(os.path.join(directory, n) for n in dirs + files)]:
            os.lchown(name, account.pw_uid, account.pw_gid)
    os.chmod(account.pw_dir, 0o700)


def existing_groups(names: Sequence[str]) -> list[str]:
    found = []
    for name in names:
        with contextlib.suppress(KeyError):
            grp.getgrnam(name)
            found.append(name)
    return found


def group_id(name: str) -> int | None:
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        return None


def _uid_taken(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


# ------------------------------------------------------------------------------------------ the server

def runtime_dir(account: pwd.struct_passwd, base: str = RUNTIME_BASE) -> str:
    """Jupyter's runtime directory for the account, on the /run tmpfs: jupyter-server writes its
    jpserver-PID.json there, with its token (JupyterHub's API token), and kernels their
    connection files. In the home (jupyter_core's default) the token would reach the workspace
    disk and stay in its free blocks after the file is gone. Fresh at every boot; only the
    account enters it (not /run/user/UID: logind removes that when the user's last login ends)."""
    os.makedirs(base, mode=0o755, exist_ok=True)
    path = os.path.join(base, str(account.pw_uid))
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chown(path, account.pw_uid, account.pw_gid)
    os.chmod(path, 0o700)
    return path


def server_environment(env: dict[str, str], account: pwd.struct_passwd, base: dict[str, str],
                       runtime: str) -> dict[str, str]:
    """What jupyterhub-singleuser runs with: a login's basics, then JupyterHub's environment."""
    keep = {k: base[k] for k in ("PATH", "LANG", "LC_ALL", "TZ") if k in base}
    return {**keep, "HOME": account.pw_dir, "USER": account.pw_name, "LOGNAME": account.pw_name,
            "SHELL": account.pw_shell or SHELL, "JUPYTER_RUNTIME_DIR": runtime, **env}


def server_command(args: list[str], bindir: str) -> list[str]:
    """jupyterhub-singleuser from this Python environment (the image's), with the extra arguments."""
    exe = shutil.which("jupyterhub-singleuser", path=bindir + os.pathsep + os.environ.get("PATH", ""))
    if exe is None:
        raise LaunchError(f"jupyterhub-singleuser is not installed in {bindir} or on PATH")
    return [exe, *args]


def become(account: pwd.struct_passwd) -> None:
    """Drop root for the account (its groups, its gid, its uid) and go to its home."""
    os.initgroups(account.pw_name, account.pw_gid)
    os.setgid(account.pw_gid)
    os.setuid(account.pw_uid)
    os.chdir(account.pw_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kubevirt-workstation", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=ENV_DEVICE, help="the env disk (default: %(default)s)")
    parser.add_argument("--mount", default=ENV_MOUNT, help="where to mount it (default: %(default)s)")
    parser.add_argument("--homes", default=WORKSPACE_MOUNT, help="where homes live (default: %(default)s)")
    parser.add_argument("--print", action="store_true",
                        help="print the account and command it would run (without the environment) and stop")
    opts = parser.parse_args(argv)
    try:
        mount_env_disk(opts.device, opts.mount)
        env, args = read_env_disk(opts.mount)
        wait_for_workspace(opts.homes)
        shares, problems = shared_data(env)
        disks, disk_problems = extra_disks(env)
        account = ensure_user(linux_name(env["JUPYTERHUB_USER"]), opts.homes, groups=existing_groups([ADMIN_GROUP]))
        command = server_command(args, os.path.dirname(sys.executable))
        if opts.print:
            print(json.dumps({"user": account.pw_name, "home": account.pw_dir, "command": command}))
            return 0
        prepare_scratch()
        problems += disk_problems + mount_extra_disks(disks, account)
    except LaunchError as err:
        print(f"kubevirt-workstation: {err}", file=sys.stderr)
        return 1
    for problem in problems + mount_shared_data(shares):
        print(f"kubevirt-workstation: {problem}", file=sys.stderr)
    try:
        keys.write_access(env, account.pw_name, group_id(keys.KEYS_GROUP))
    except OSError as err:  # (Jupyter starts all the same: SSH is the one thing missing)
        print(f"kubevirt-workstation: SSH keys cannot be looked up at login: {err}", file=sys.stderr)
    print(f"kubevirt-workstation: starting Jupyter for {env['JUPYTERHUB_USER']} as {account.pw_name}", flush=True)
    environment = server_environment(env, account, dict(os.environ), runtime_dir(account))
    become(account)
    os.execve(command[0], command, environment)


if __name__ == "__main__":
    sys.exit(main())
