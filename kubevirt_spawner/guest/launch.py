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
4. It mounts the VM's shared data (virtiofs filesystems, KUBEVIRT_SHARED_DATA gives each tag's
   path and whether it is read-only); one that fails is reported in the journal and skipped.
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
from collections.abc import Callable, Sequence

from ..objects import (
    ARGS_KEY,
    ENV_DISK_SERIAL,
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

def shared_data(env: dict[str, str]) -> list[dict]:
    """The shared data entries of KUBEVIRT_SHARED_DATA (the spawner's JSON list of tag, path and
    readOnly); an entry that is not one is an error, as the whole list is the hub's."""
    try:
        entries = json.loads(env.get(SHARED_DATA_ENV) or "[]")
    except ValueError:
        raise LaunchError(f"{SHARED_DATA_ENV} is not JSON") from None
    if not isinstance(entries, list):
        raise LaunchError(f"{SHARED_DATA_ENV} is not a list")
    out = []
    for entry in entries:
        tag = entry.get("tag") if isinstance(entry, dict) else None
        if not isinstance(tag, str) or not SHARE_TAG.match(tag):
            raise LaunchError(f"{SHARED_DATA_ENV}: {entry!r} has no valid tag")
        try:
            path = check_mount_path(entry.get("path"))
        except ValueError as err:
            raise LaunchError(f"{SHARED_DATA_ENV}: {err}") from None
        out.append({"tag": tag, "path": path, "readOnly": entry.get("readOnly") is True})
    return out


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
        prepare_scratch()
        shares = shared_data(env)
        account = ensure_user(linux_name(env["JUPYTERHUB_USER"]), opts.homes, groups=existing_groups([ADMIN_GROUP]))
        command = server_command(args, os.path.dirname(sys.executable))
    except LaunchError as err:
        print(f"kubevirt-workstation: {err}", file=sys.stderr)
        return 1
    if opts.print:
        print(json.dumps({"user": account.pw_name, "home": account.pw_dir, "command": command}))
        return 0
    for problem in mount_shared_data(shares):
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
