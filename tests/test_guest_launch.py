"""The workstation unit's program (kubevirt_spawner.guest.launch) on fake env disks and accounts.

What the env disk holds is what KubeVirt builds from the VM's Secret volume: xorrisofs grafts every
entry of kubelet's Secret mount into the image root (kubevirt pkg/config/config.go,
defaultCreateIsoImage over os.ReadDir), kubelet's AtomicWriter `..data` and `..<timestamp>` entries
included (kubernetes pkg/volume/util/atomic_writer.go)."""

from __future__ import annotations

import json
import os
import pwd
import stat

import pytest

from kubevirt_spawner.guest import launch
from kubevirt_spawner.guest.launch import (
    ENV_MOUNT_OPTIONS,
    LaunchError,
    ensure_user,
    linux_name,
    mount_env_disk,
    read_env_disk,
    server_environment,
)
from kubevirt_spawner.manifests import Identity, env_secret

ENV = {"JUPYTERHUB_USER": "alice", "JUPYTERHUB_API_TOKEN": "s3cret",
       "JUPYTERHUB_SERVICE_URL": "http://0.0.0.0:8888/user/alice/", "JUPYTERHUB_API_URL": "http://hub:8081/hub/api"}


def env_disk(tmp_path, secret: dict) -> str:
    """A Secret as the guest sees it on its env disk: kubelet's layout (the keys as links into a
    `..<timestamp>` directory through `..data`), grafted with links followed."""
    import base64
    root = tmp_path / "disk"
    payload = root / "..2026_11_30_10_00_00.123"
    payload.mkdir(parents=True)
    for key, value in secret["data"].items():
        (payload / key).write_bytes(base64.b64decode(value))
        (root / key).write_bytes(base64.b64decode(value))  # (-follow-links: files, not links)
    (root / "..data").mkdir()
    for key in secret["data"]:
        (root / "..data" / key).write_text("a copy")
    return str(root)


def ident(user: str = "alice") -> Identity:
    return Identity(user=user, server="", slug=user, user_slug=user, server_slug="", namespace=f"notebook-{user}",
                    vm=f"{user}-workstation", rootdisk=f"{user}-rootdisk", workspace=f"{user}-workspace",
                    secret=f"{user}-hub-env", service=f"{user}-workstation")


def test_the_env_disk_gives_jupyterhubs_environment_and_arguments(tmp_path):
    """The spawner's Secret (manifests.env_secret) read back as the guest reads it: every variable,
    the extra arguments from args.json; cloud-init's userdata and kubelet's entries are not variables."""
    secret = env_secret(ident(), ENV, ["--ContentsManager.allow_hidden=True"])
    env, args = read_env_disk(env_disk(tmp_path, secret))
    assert env == ENV
    assert args == ["--ContentsManager.allow_hidden=True"]


@pytest.mark.parametrize("files,says", [
    ({"JUPYTERHUB_USER": "alice"}, "has no JUPYTERHUB_USER or JUPYTERHUB_API_TOKEN"),
    ({**ENV, "args.json": "not json"}, "args.json on the env disk is not JSON"),
    ({**ENV, "args.json": '{"a": 1}'}, "args.json on the env disk must be a JSON list of strings"),
    ({**ENV, "args.json": "[1]"}, "args.json on the env disk must be a JSON list of strings"),
])
def test_a_bad_env_disk_is_refused_with_a_sentence(tmp_path, files, says):
    for name, value in files.items():
        (tmp_path / name).write_text(value)
    with pytest.raises(LaunchError, match=says):
        read_env_disk(str(tmp_path))
    with pytest.raises(LaunchError, match="cannot read the env disk"):
        read_env_disk(str(tmp_path / "missing"))


def test_linux_names():
    """useradd accepts [a-z_][a-z0-9_-]* up to 32 characters (its default NAME_REGEX); other hub
    names get a slug and a hash, so two of them never share an account."""
    assert linux_name("alice") == "alice" and linux_name("bob-2") == "bob-2"
    for hub_name in ("Alice", "alice@example.org", "9lives", "ünïcode", "x" * 40, "@@@"):
        name = linux_name(hub_name)
        assert launch.LINUX_NAME.match(name), (hub_name, name)
    assert linux_name("alice@example.org").startswith("alice-example-org-")
    assert linux_name("Alice") != linux_name("alice") and linux_name("A.b") != linux_name("a-b")


def account(name: str, uid: int, home: str) -> pwd.struct_passwd:
    return pwd.struct_passwd((name, "x", uid, uid, "", home, "/bin/bash"))


def test_the_user_is_created_once_and_keeps_the_owner_of_an_existing_home(tmp_path):
    """A clone's first boot creates the account (useradd, home under /home); a later boot finds it.
    After a system reset the workspace disk still holds /home/alice, owned by the uid alice had:
    the new account gets that uid, so her files stay hers."""
    accounts: dict[str, pwd.struct_passwd] = {}
    commands: list[list[str]] = []

    def runner(command):
        commands.append(list(command))
        name = command[-1]
        uid = int(command[command.index("--uid") + 1]) if "--uid" in command else 1000
        accounts[name] = account(name, uid, command[command.index("--home-dir") + 1])

    def lookup(name):
        return accounts[name]

    alice = ensure_user("alice", str(tmp_path), runner, lookup)
    assert commands == [["useradd", "--create-home", "--home-dir", str(tmp_path / "alice"), "--shell", "/bin/bash",
                         "--user-group", "alice"]]
    assert ensure_user("alice", str(tmp_path), runner, lookup) is alice and len(commands) == 1

    # a reset: a fresh system disk (no account), the workspace disk with her home
    home = tmp_path / "bob"
    home.mkdir()
    unused = next(uid for uid in range(4321, 60000) if not _uid_exists(uid))
    os.chown(home, unused, unused)
    bob = ensure_user("bob", str(tmp_path), runner, lookup)
    assert commands[-1][-3:] == ["--uid", str(unused), "bob"] and bob.pw_uid == unused
    # a home owned by root (or by a uid another account has) gets no --uid
    (tmp_path / "carol").mkdir()
    # a hub user named like a system account is refused, never run as it
    accounts["root"] = account("root", 0, "/root")
    with pytest.raises(launch.LaunchError, match="system account root"):
        ensure_user("root", str(tmp_path), runner, lookup)
    # the owner administers the machine: in the group the image's sudoers drop-in names
    ensure_user("dora", str(tmp_path), runner, lookup, groups=["sudo"])
    assert commands[-1][-3:] == ["--groups", "sudo", "dora"]
    ensure_user("carol", str(tmp_path), runner, lookup)
    assert "--uid" not in commands[-1]


def test_an_account_whose_home_is_gone_gets_a_fresh_one(tmp_path):
    """A new, blank workspace disk under an account the system disk still has: the account gets
    the home useradd would make (the skeleton, its own, 0700), or Jupyter could never start in it."""
    skel = tmp_path / "skel"
    (skel / ".config").mkdir(parents=True)
    (skel / ".bashrc").write_text("# skel\n")
    uid = next(uid for uid in range(4321, 60000) if not _uid_exists(uid))  # (root, the tests' user, chowns)
    gone = account("erin", uid, str(tmp_path / "homes" / "erin"))
    (tmp_path / "homes").mkdir()
    launch.make_home(gone, str(skel))
    home = tmp_path / "homes" / "erin"
    assert (home / ".bashrc").read_text() == "# skel\n" and (home / ".config").is_dir()
    assert stat.S_IMODE(home.stat().st_mode) == 0o700 and home.stat().st_uid == uid
    # ensure_user makes it for an account it finds without a home, and leaves a home that is there
    (home / "notes.txt").write_text("mine")
    made: list = []
    erin = account("erin", uid, str(home))
    assert ensure_user("erin", str(tmp_path / "homes"), made.append, lambda name: erin) is erin
    assert (home / "notes.txt").read_text() == "mine" and made == []
    gone_again = account("erin", uid, str(tmp_path / "homes" / "new"))
    assert ensure_user("erin", str(tmp_path / "homes"), made.append, lambda name: gone_again) is gone_again
    assert (tmp_path / "homes" / "new").is_dir() and made == []  # (from the machine's own /etc/skel)


def test_a_workspace_disk_is_on_home_before_any_home_is_made(tmp_path):
    """fstab mounts the workspace disk nofail, which systemd orders before nothing (systemd.mount(5)),
    so the launcher waits for it whenever the kernel has a disk with the workspace serial (virtio_blk's
    /sys/block/vdX/serial; KubeVirt gives the disk's `serial` to QEMU: pkg/virt-launcher/virtwrap/
    converter/converter.go). The CI run whose home was made on the system disk, then hidden by the
    late mount, failed on exactly this."""
    sys_block = tmp_path / "block"
    for name, serial in (("vda", ""), ("vdb", "hubenv"), ("sr0", None)):
        (sys_block / name).mkdir(parents=True)
        if serial is not None:
            (sys_block / name / "serial").write_text(serial + "\n")
    mounted: set[str] = set()
    commands: list[list[str]] = []

    def systemctl(command):
        commands.append(list(command))
        mounted.add(command[-1])

    def is_mount(path):
        return path in mounted

    # no workspace disk: /home stays on the system disk, nothing is asked of systemd
    launch.wait_for_workspace("/home", str(sys_block), systemctl, is_mount)
    assert commands == [] and not launch.has_disk("workspace", str(sys_block))
    # a workspace disk: systemd mounts it (its unit waits for the device and makes a filesystem)
    (sys_block / "vdc").mkdir()
    (sys_block / "vdc" / "serial").write_text("workspace\n")
    launch.wait_for_workspace("/home", str(sys_block), systemctl, is_mount)
    assert commands == [["systemctl", "start", "/home"]] and "/home" in mounted
    # already mounted: nothing to do
    launch.wait_for_workspace("/home", str(sys_block), systemctl, is_mount)
    assert len(commands) == 1
    # a mount that does not come: the launcher stops with a sentence, and the unit tries again
    with pytest.raises(LaunchError, match="workspace disk is not mounted at /srv/homes"):
        launch.wait_for_workspace("/srv/homes", str(sys_block), lambda command: None, is_mount)
    def refused(command):
        raise LaunchError("systemctl start /home failed (1): Job for home.mount failed.")

    with pytest.raises(LaunchError, match="systemctl start /home failed"):
        launch.wait_for_workspace("/home", str(sys_block), refused, lambda path: False)


def _uid_exists(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


def test_the_env_disk_is_mounted_read_only_where_only_root_reaches_it(tmp_path):
    """isofs keeps Rock Ridge's modes (kubelet's 0644, Linux Documentation/filesystems/isofs.rst),
    so the token is kept from users by the parent directory, which is root's alone."""
    commands: list[list[str]] = []
    device = tmp_path / "virtio-hubenv"
    device.touch()
    target = tmp_path / "run" / "kubevirt-workstation" / "env"
    mount_env_disk(str(device), str(target), commands.append)
    assert commands == [["mount", "-t", "iso9660", "-o", ENV_MOUNT_OPTIONS, str(device), str(target)]]
    assert "ro" in ENV_MOUNT_OPTIONS.split(",")
    assert stat.S_IMODE(os.stat(target.parent).st_mode) == 0o700
    with pytest.raises(LaunchError, match="has no hubenv disk"):
        mount_env_disk(str(tmp_path / "absent"), str(tmp_path / "elsewhere"), commands.append)
    mount_env_disk(str(tmp_path / "absent"), "/proc", commands.append)  # already mounted: nothing to do
    assert len(commands) == 1


def test_a_failing_command_says_what_failed():
    with pytest.raises(LaunchError, match=r"sh -c echo nope >&2; exit 3 failed \(3\): nope"):
        launch.run(["sh", "-c", "echo nope >&2; exit 3"])


def test_the_server_runs_with_a_logins_basics_and_jupyterhubs_environment():
    alice = account("alice", 1000, "/home/alice")
    env = server_environment(ENV, alice, {"PATH": "/usr/bin", "LANG": "C.UTF-8", "SECRET_OF_ROOT": "x"},
                             "/run/jupyter/1000")
    assert env == {"PATH": "/usr/bin", "LANG": "C.UTF-8", "HOME": "/home/alice", "USER": "alice",
                   "LOGNAME": "alice", "SHELL": "/bin/bash", "JUPYTER_RUNTIME_DIR": "/run/jupyter/1000", **ENV}


def test_jupyters_runtime_files_stay_off_the_disks(tmp_path):
    """jupyter-server writes jpserver-PID.json with its token, JupyterHub's API token
    (jupyter_server serverapp.py write_server_info_file), into jupyter_core's runtime directory,
    by default under the home: on the workspace disk. The server gets one on /run (a tmpfs) that
    only its account enters."""
    me = pwd.getpwuid(os.getuid())
    path = launch.runtime_dir(me, str(tmp_path / "run" / "jupyter"))
    assert path == str(tmp_path / "run" / "jupyter" / str(me.pw_uid))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700 and os.stat(path).st_uid == me.pw_uid
    assert stat.S_IMODE(os.stat(tmp_path / "run" / "jupyter").st_mode) == 0o755
    assert launch.runtime_dir(me, str(tmp_path / "run" / "jupyter")) == path  # (a restart of the unit)


def test_print_shows_the_account_and_command(tmp_path, monkeypatch, capsys):
    """`kubevirt-workstation --print` (for a look from the console) stops before starting anything."""
    for name, value in {**ENV, "args.json": '["--debug"]'}.items():
        (tmp_path / name).write_text(value)
    monkeypatch.setattr(launch, "mount_env_disk", lambda device, target: None)
    monkeypatch.setattr(launch, "wait_for_workspace", lambda homes: None)
    monkeypatch.setattr(launch, "prepare_scratch", lambda: None)
    monkeypatch.setattr(launch, "ensure_user", lambda name, homes, groups=(): account(name, 1000, f"{homes}/{name}"))
    assert launch.main(["--mount", str(tmp_path), "--print"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["user"] == "alice" and shown["home"] == "/home/alice"
    assert shown["command"][0].endswith("jupyterhub-singleuser") and shown["command"][1:] == ["--debug"]
    (tmp_path / "JUPYTERHUB_API_TOKEN").unlink()
    assert launch.main(["--mount", str(tmp_path), "--print"]) == 1
    assert "kubevirt-workstation: the env disk" in capsys.readouterr().err


def test_a_scratch_disk_is_on_scratch_open_to_everyone(tmp_path):
    """The scratch disk (serial `scratch`, an emptyDisk the image's fstab formats at every boot) is
    waited for as the workspace disk is, and opened like /tmp: everyone, sticky."""
    sys_block, scratch = tmp_path / "block", tmp_path / "scratch"
    (sys_block / "vdb").mkdir(parents=True)
    scratch.mkdir(mode=0o755)
    commands = []
    launch.prepare_scratch(str(scratch), str(sys_block), commands.append, lambda path: False)
    assert commands == [] and (scratch.stat().st_mode & 0o7777) == 0o755  # no scratch disk: nothing
    (sys_block / "vdb" / "serial").write_text("scratch\n")
    mounted = set()
    launch.prepare_scratch(str(scratch), str(sys_block), lambda c: (commands.append(c), mounted.add(c[-1])),
                           lambda path: path in mounted)
    assert commands == [["systemctl", "start", str(scratch)]] and (scratch.stat().st_mode & 0o7777) == 0o1777
    with pytest.raises(LaunchError, match="scratch disk is not mounted at"):
        launch.prepare_scratch(str(tmp_path / "other"), str(sys_block), lambda c: None, lambda path: False)


def test_shared_data_is_mounted_by_tag_at_its_path(tmp_path):
    """KUBEVIRT_SHARED_DATA (the spawner's) gives each virtiofs tag its path; each is mounted
    `mount -t virtiofs TAG PATH` (the tag is KubeVirt's filesystem name: pkg/virt-launcher/virtwrap/
    converter), ro when asked (the launcher pod's readOnly mount refuses writes anyway). One that
    fails is reported and the rest go on; an entry that is not one (a hub newer than the image)
    is reported and left out, and the rest are mounted."""
    data = tmp_path / "data"
    env = {"KUBEVIRT_SHARED_DATA": json.dumps([
        {"tag": "datasets", "path": f"/srv/{data.name}/datasets", "readOnly": True},
        {"tag": "team", "path": "/srv/team", "readOnly": False}])}
    entries, problems = launch.shared_data(env)
    assert entries == [{"tag": "datasets", "path": "/srv/data/datasets", "readOnly": True},
                       {"tag": "team", "path": "/srv/team", "readOnly": False}] and problems == []
    assert launch.shared_data({}) == ([], [])
    for entry in entries:  # (here, under tmp_path)
        entry["path"] = str(tmp_path) + entry["path"]
    commands = []

    def mount(command):
        commands.append(command)
        if command[-2] == "team":
            raise LaunchError("mount failed (32): wrong fs type")

    problems = launch.mount_shared_data(entries, mount, lambda path: False)
    assert commands == [["mount", "-t", "virtiofs", "-o", "ro,nosuid,nodev", "datasets", entries[0]["path"]],
                        ["mount", "-t", "virtiofs", "-o", "nosuid,nodev", "team", entries[1]["path"]]]
    assert os.path.isdir(entries[0]["path"])
    assert problems == [f"the shared data team is not mounted at {entries[1]['path']}: mount failed (32): wrong fs type"]
    assert launch.mount_shared_data(entries, mount, lambda path: True) == [] and len(commands) == 2  # (mounted)
    for bad, says in (("{", "not JSON"), ('{"tag": "x"}', "not a list"),
                      ('[{"tag": "../x", "path": "/data/x"}]', "has no valid tag"),
                      ('[{"tag": "x", "path": "/etc/ssh"}]', "inside /etc"),
                      ('[{"tag": "x", "path": "/data/../etc"}]', "is not a mount point")):
        good = '{"tag": "ok", "path": "/data/ok"}'
        listed = bad.replace("[", "[" + good + ", ", 1) if bad.startswith("[") else bad
        kept, problems = launch.shared_data({"KUBEVIRT_SHARED_DATA": listed})
        assert kept == ([{"tag": "ok", "path": "/data/ok", "readOnly": False}] if bad.startswith("[") else [])
        assert len(problems) == 1 and says in problems[0]


def test_extra_disks_get_a_filesystem_when_blank_and_are_mounted_at_their_paths(tmp_path):
    """KUBEVIRT_EXTRA_DISKS (the spawner's) gives each extra disk's serial (/dev/disk/by-id/
    virtio-SERIAL, systemd's 60-persistent-storage.rules) and path. A disk blkid finds nothing on
    gets ext4 and its top directory is the user's; one with a filesystem (a clone, or the disk of
    an earlier boot) is mounted as it is; each grows to its disk's size. A disk that cannot be
    mounted ends the launcher (the unit tries again), as a resize that fails does not."""
    env = {"KUBEVIRT_EXTRA_DISKS": json.dumps([{"serial": "disk-models", "path": "/data/models"},
                                               {"serial": "disk-ref", "path": "/data/ref"},
                                               {"serial": "models", "path": "/data/x"},
                                               {"serial": "disk-x", "path": "/usr/local"}])}
    entries, problems = launch.extra_disks(env)
    assert entries == [{"serial": "disk-models", "path": "/data/models"}, {"serial": "disk-ref", "path": "/data/ref"}]
    assert len(problems) == 2 and "has no valid serial" in problems[0] and "inside /usr" in problems[1]
    assert launch.extra_disks({}) == ([], [])
    for entry in entries:
        entry["path"] = str(tmp_path) + entry["path"]
    me = pwd.getpwuid(os.getuid())
    commands, waited = [], []

    def runner(command):
        commands.append(command)
        if command[0] == "resize2fs" and command[1].endswith("ref"):
            raise LaunchError("resize2fs failed (1): Bad magic number in super-block")
    blank = {"/dev/disk/by-id/virtio-disk-models"}
    problems = launch.mount_extra_disks(entries, me, runner, lambda path: False, lambda dev: dev not in blank,
                                        wait=waited.append)
    models, ref = "/dev/disk/by-id/virtio-disk-models", "/dev/disk/by-id/virtio-disk-ref"
    assert waited == [models, ref]
    assert commands == [["mkfs.ext4", "-q", "-L", "models", models],
                        ["mount", "-o", "nosuid,nodev", models, entries[0]["path"]], ["resize2fs", models],
                        ["mount", "-o", "nosuid,nodev", ref, entries[1]["path"]], ["resize2fs", ref]]
    assert problems == [f"the extra disk disk-ref at {entries[1]['path']} does not grow to its disk's size: "
                        "resize2fs failed (1): Bad magic number in super-block"]
    assert os.path.isdir(entries[0]["path"]) and os.stat(entries[0]["path"]).st_uid == me.pw_uid
    commands.clear()
    assert launch.mount_extra_disks(entries, me, runner, lambda path: True) == [] and commands == []  # (mounted)

    def refused(command):
        if command[0] == "mount":
            raise LaunchError("mount failed (32): wrong fs type")
    with pytest.raises(LaunchError, match="wrong fs type"):
        launch.mount_extra_disks(entries[:1], me, refused, lambda path: False, lambda dev: True, wait=lambda d: None)
    with pytest.raises(LaunchError, match="did not appear within 1 s"):
        launch.wait_for_device(str(tmp_path / "virtio-disk-none"), timeout=1.0, sleep=lambda s: None)
