"""Python code the acceptance suite runs in a test workstation's kernel (through the hub), as its
owner would in a notebook. Each snippet prints one JSON line last.

The owner administers the machine (the image's sudoers lets them use sudo without a password), so
system paths are written with `sudo -n`. The simulator's process guests run on the host, on their
disk's directory ($KUBEVIRT_SIM_MACHINE_ROOT): there every path is under that directory, and what
would change the host (packages, systemd units) is not done: SIMULATED says so."""

from __future__ import annotations

import json

PRELUDE = r'''
import base64, hashlib, json, os, shutil, subprocess, sys, tempfile, time, zipfile
ROOT = os.environ.get("KUBEVIRT_SIM_MACHINE_ROOT") or "/"
SIMULATED = ROOT != "/"

def at(path):
    """A path of the machine (the home is the machine's already)."""
    if path.startswith("~"):
        return os.path.expanduser(path)
    return os.path.join(ROOT, path.lstrip("/"))

def as_root(*cmd, data=None):
    return subprocess.run(["sudo", "-n", *cmd], input=data, capture_output=True, check=True)

def owned_dir(path):
    """A directory of the machine the owner may write in (made by root where it must be)."""
    path = at(path)
    try:
        os.makedirs(path, exist_ok=True)
    except PermissionError:
        as_root("mkdir", "-p", path)
    if not os.access(path, os.W_OK):
        as_root("chown", f"{os.getuid()}:{os.getgid()}", path)
    return path

def put(path, text):
    path = at(path)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    except PermissionError:
        as_root("mkdir", "-p", os.path.dirname(path))
        as_root("tee", path, data=text.encode())

def get(path):
    path = at(path)
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return None
    except PermissionError:
        done = subprocess.run(["sudo", "-n", "cat", path], capture_output=True)
        return done.stdout.decode() if done.returncode == 0 else None
'''

# Where the persistence experiment writes (the design document's list): system directories on the
# root disk, the home on the workspace disk, and a Python environment in /opt as Conda's would be.
MARKERS = ("/etc/kvs-acceptance/marker", "/opt/kvs-acceptance/marker", "/usr/local/share/kvs-acceptance/marker",
           "~/kvs-acceptance/marker", "/opt/kvs-acceptance/venv/kvs-marker")
VENV = "/opt/kvs-acceptance/venv"
PACKAGE = "kvs-acceptance-probe"
UNIT = "kvs-acceptance-probe.service"
RESET_ROOT_MARKER = "/opt/kvs-acceptance/reset-marker"
RESET_HOME_MARKER = "~/kvs-acceptance/reset-marker"
CHANGED_AFTER_SNAPSHOT = "/opt/kvs-acceptance/after-snapshot"
RESTORE_HOME_MARKER = "~/kvs-acceptance/before-snapshot"  # (the workspace disk, where there is one)


def probe() -> str:
    """What kind of machine this is and what it has."""
    return PRELUDE + r'''
facts = {"simulated": SIMULATED, "user": os.environ.get("USER") or "", "home": os.path.expanduser("~"),
         "sudo": (not SIMULATED) and subprocess.run(["sudo", "-n", "true"], capture_output=True).returncode == 0,
         "dpkg": (not SIMULATED) and bool(shutil.which("dpkg-deb")),
         "systemd": (not SIMULATED) and os.path.isdir("/run/systemd/system"),
         "git": bool(shutil.which("git")), "nvidia_smi": bool(shutil.which("nvidia-smi")),
         "boot_id": None if SIMULATED else open("/proc/sys/kernel/random/boot_id").read().strip()}
print(json.dumps(facts))
'''


def _literal(value) -> str:
    return repr(json.loads(json.dumps(value)))


def write_state(nonce: str, package: bool, unit: bool) -> str:
    """The persistence experiment's changes: marker files, a venv with a pip-installed package, a
    system package through dpkg and an enabled systemd unit (those two on real machines only).
    Offline: the package and the wheel are made here, as a user's own build would be."""
    return PRELUDE + f'''
NONCE = {nonce!r}
owned_dir("/opt/kvs-acceptance")
for path in {_literal(list(MARKERS[:4]))}:
    put(path, NONCE)
venv = at({VENV!r})
if not os.path.exists(os.path.join(venv, "bin", "python")):
    subprocess.run([sys.executable, "-m", "venv", venv], check=True, capture_output=True)
put({MARKERS[4]!r}, NONCE)
work = tempfile.mkdtemp()
name, version = "kvs_acceptance_probe", "1.0"
files = {{f"{{name}}/__init__.py": f"NONCE = {{NONCE!r}}\\n",
         f"{{name}}-{{version}}.dist-info/METADATA": f"Metadata-Version: 2.1\\nName: {PACKAGE}\\nVersion: {{version}}\\n",
         f"{{name}}-{{version}}.dist-info/WHEEL": "Wheel-Version: 1.0\\nGenerator: kubevirt-spawner\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n"}}
record = []
for path, text in files.items():
    digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
    record.append(f"{{path}},sha256={{digest}},{{len(text.encode())}}")
record.append(f"{{name}}-{{version}}.dist-info/RECORD,,")
files[f"{{name}}-{{version}}.dist-info/RECORD"] = "\\n".join(record) + "\\n"
wheel = os.path.join(work, f"{{name}}-{{version}}-py3-none-any.whl")
with zipfile.ZipFile(wheel, "w") as z:
    for path, text in files.items():
        z.writestr(path, text)
subprocess.run([os.path.join(venv, "bin", "python"), "-m", "pip", "install", "--no-index", "--no-deps", "-q",
                "--disable-pip-version-check", "--force-reinstall", wheel], check=True, capture_output=True)
if {package!r}:
    tree = os.path.join(work, "deb")
    os.makedirs(os.path.join(tree, "DEBIAN"))
    os.makedirs(os.path.join(tree, "usr", "share", "{PACKAGE}"))
    with open(os.path.join(tree, "DEBIAN", "control"), "w") as f:
        f.write("Package: {PACKAGE}\\nVersion: 1.0\\nArchitecture: all\\nMaintainer: kubevirt-spawner acceptance "
                "<root@localhost>\\nDescription: what the acceptance suite installs to see it kept\\n")
    with open(os.path.join(tree, "usr", "share", "{PACKAGE}", "nonce"), "w") as f:
        f.write(NONCE)
    subprocess.run(["dpkg-deb", "--root-owner-group", "--build", tree, os.path.join(work, "probe.deb")],
                   check=True, capture_output=True)
    as_root("dpkg", "-i", os.path.join(work, "probe.deb"))
if {unit!r}:
    put("/etc/systemd/system/{UNIT}", "[Unit]\\nDescription=kubevirt-spawner acceptance probe\\n[Service]\\n"
        "Type=oneshot\\nRemainAfterExit=yes\\nExecStart=/bin/sh -c 'cat /etc/kvs-acceptance/marker > "
        "/run/kvs-acceptance-probe'\\n[Install]\\nWantedBy=multi-user.target\\n")
    as_root("systemctl", "daemon-reload")
    as_root("systemctl", "enable", "--now", "{UNIT}")
shutil.rmtree(work, ignore_errors=True)
os.sync()
print(json.dumps({{"written": True}}))
'''


def read_state(package: bool, unit: bool) -> str:
    """What of the persistence experiment's changes the machine has now."""
    return PRELUDE + f'''
out = {{"files": {{path: get(path) for path in {_literal(list(MARKERS))}}}}}
venv_python = os.path.join(at({VENV!r}), "bin", "python")
done = subprocess.run([venv_python, "-c", "import kvs_acceptance_probe as p; print(p.NONCE)"], capture_output=True,
                      text=True) if os.path.exists(venv_python) else None
out["pip"] = done.stdout.strip() if done is not None and done.returncode == 0 else None
if {package!r}:
    status = subprocess.run(["dpkg-query", "-W", "-f=${{Status}}", "{PACKAGE}"], capture_output=True, text=True)
    out["package"] = {{"status": status.stdout.strip(), "nonce": get("/usr/share/{PACKAGE}/nonce")}}
if {unit!r}:
    def systemctl(*args):
        return subprocess.run(["systemctl", *args, "{UNIT}"], capture_output=True, text=True).stdout.strip()
    out["unit"] = {{"enabled": systemctl("is-enabled"), "active": systemctl("is-active"),
                   "ran": get("/run/kvs-acceptance-probe")}}
if not SIMULATED:
    out["boot_id"] = open("/proc/sys/kernel/random/boot_id").read().strip()
print(json.dumps(out))
'''


def write_files(values: dict[str, str]) -> str:
    return PRELUDE + f'''
owned_dir("/opt/kvs-acceptance")
for path, text in {_literal(values)}.items():
    put(path, text)
os.sync()  # (on the disk before a power-off the suite may ask for next)
print(json.dumps({{"written": True}}))
'''


def read_files(paths: list[str]) -> str:
    return PRELUDE + f'''
print(json.dumps({{path: get(path) for path in {_literal(paths)}}}))
'''


def gpus() -> str:
    """The GPUs the machine sees (nvidia-smi -L), or None without nvidia-smi."""
    return PRELUDE + r'''
tool = shutil.which("nvidia-smi")
listed = subprocess.run([tool, "-L"], capture_output=True, text=True).stdout if tool else None
print(json.dumps(None if listed is None else [l for l in listed.splitlines() if l.startswith("GPU ")]))
'''


def credentials_scan(token_env: str = "JUPYTERHUB_API_TOKEN") -> str:
    """Kubernetes credentials and the hub's API token anywhere they must not be: ServiceAccount
    token mounts, kubeconfigs, and any file outside the machine's runtime tmpfs (/run: the env disk
    is mounted there) holding the token. Run as root on a real machine (the owner's sudo), so that
    /root and every file are read."""
    scanner = r'''
import json, os, sys
root, token = sys.argv[1], os.environ.get("KVS_TOKEN", "").encode()
found = []
for mount in ("var/run/secrets/kubernetes.io", "run/secrets/kubernetes.io"):
    if os.path.exists(os.path.join(root, mount)):
        found.append("/" + mount + " (a ServiceAccount token mount)")
SKIP = {"proc", "sys", "dev", "run", "var/run", "var/cache", "var/lib/apt", "usr/lib", "usr/share", "usr/include",
        "lib", "lib64", "bin", "sbin", "usr/bin", "usr/sbin", "boot", "snap", "lost+found"}
MARKERS = (b"client-certificate-data:", b"client-key-data:")
scanned = 0
# the machine's own disks only (the system disk, the workspace at /home): not shared data or
# another disk mounted in, whose files are not this machine's to read
own = {os.stat(root).st_dev} | ({os.stat(os.path.join(root, "home")).st_dev}
                                if os.path.isdir(os.path.join(root, "home")) else set())
for top, dirs, files in os.walk(root):
    rel = os.path.relpath(top, root)
    dirs[:] = [d for d in dirs if (d if rel == "." else rel + "/" + d) not in SKIP
               and os.lstat(os.path.join(top, d)).st_dev in own]
    for name in files:
        path = os.path.join(top, name)
        try:
            if os.path.islink(path) or os.path.getsize(path) > 4 << 20:
                continue
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            continue
        scanned += 1
        shown = "/" + os.path.relpath(path, root)
        if token and token in data:
            found.append(shown + " (holds the hub's API token)")
        elif name in ("config", "kubeconfig", "admin.conf") and any(m in data for m in MARKERS):
            found.append(shown + " (a kubeconfig with credentials)")
        if len(found) > 20:
            break
print(json.dumps({"found": found, "scanned": scanned}))
'''
    return PRELUDE + f'''
scanner = {scanner!r}
env = dict(os.environ, KVS_TOKEN=os.environ.get({token_env!r}, ""))
cmd = [sys.executable, "-c", scanner, ROOT]
if not SIMULATED and subprocess.run(["sudo", "-n", "true"], capture_output=True).returncode == 0:
    cmd = ["sudo", "-n", "--preserve-env=KVS_TOKEN", *cmd]
done = subprocess.run(cmd, capture_output=True, text=True, env=env)
if done.returncode != 0:
    raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "the scan failed")
result = json.loads(done.stdout.strip().splitlines()[-1])
result["kube_env"] = sorted(k for k in os.environ if k.startswith("KUBERNETES_") or k == "KUBECONFIG")
result["had_token"] = bool(os.environ.get({token_env!r}))
print(json.dumps(result))
'''


def storage_benchmark(mib: int, files: int) -> str:
    """Figures of the root disk as a user's work meets it: unpacking many small files (as Conda
    does), a cold and a warm import of a large Python package, a `git checkout` of a generated
    repository (when git is there), and sequential write and read throughput."""
    return PRELUDE + f'''
import io, tarfile
MIB, FILES = {mib}, {files}
work = os.path.join(owned_dir("/opt/kvs-acceptance"), "bench")
shutil.rmtree(work, ignore_errors=True)
os.makedirs(work)
out = {{}}
# many small files, as a Conda package's unpack: a .tar.gz built in memory
buf = io.BytesIO()
with tarfile.open(fileobj=buf, mode="w:gz") as tar:
    for i in range(FILES):
        data = (f"# file {{i}}\\n" + "x = 1\\n" * (i % 400)).encode()
        info = tarfile.TarInfo(f"pkg/mod{{i // 100}}/f{{i}}.py")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
archive = os.path.join(work, "pkg.tar.gz")
with open(archive, "wb") as f:
    f.write(buf.getvalue())
t = time.monotonic()
with tarfile.open(archive) as tar:
    tar.extractall(os.path.join(work, "unpacked"))
os.sync()
out["unpack_seconds"] = round(time.monotonic() - t, 3)
out["unpack_files_per_second"] = round(FILES / max(out["unpack_seconds"], 1e-6))
# a large package imported cold (a new process) and warm (again)
for label in ("import_cold_seconds", "import_warm_seconds"):
    t = time.monotonic()
    subprocess.run([sys.executable, "-c", "import jupyter_server.serverapp"], check=True, capture_output=True)
    out[label] = round(time.monotonic() - t, 3)
# git checkout of a generated repository
git = shutil.which("git")
if git:
    repo = os.path.join(work, "repo")
    env = dict(os.environ, GIT_AUTHOR_NAME="a", GIT_AUTHOR_EMAIL="a@b", GIT_COMMITTER_NAME="a",
               GIT_COMMITTER_EMAIL="a@b")
    def g(*args):
        subprocess.run([git, "-C", repo, *args], check=True, capture_output=True, env=env)
    os.makedirs(repo)
    g("init", "-q", "-b", "one")
    for i in range(FILES // 2):
        p = os.path.join(repo, f"d{{i // 100}}", f"f{{i}}.txt")
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "w") as f:
            f.write(f"one {{i}}\\n")
    g("add", "-A"); g("commit", "-q", "-m", "one")
    g("checkout", "-q", "-b", "two")
    for i in range(0, FILES // 2, 2):
        with open(os.path.join(repo, f"d{{i // 100}}", f"f{{i}}.txt"), "w") as f:
            f.write(f"two {{i}}\\n")
    g("commit", "-q", "-am", "two")
    t = time.monotonic()
    g("checkout", "-q", "one")
    out["git_checkout_seconds"] = round(time.monotonic() - t, 3)
else:
    out["git_checkout_seconds"] = None
# sequential throughput: written and synced, then read back after dropping it from the page cache
path = os.path.join(work, "sequential")
block = os.urandom(1 << 20)
t = time.monotonic()
with open(path, "wb") as f:
    for _ in range(MIB):
        f.write(block)
    f.flush()
    os.fsync(f.fileno())
out["write_mb_per_second"] = round(MIB * 1.048576 / max(time.monotonic() - t, 1e-6), 1)
fd = os.open(path, os.O_RDONLY)
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
t = time.monotonic()
while os.read(fd, 4 << 20):
    pass
os.close(fd)
out["read_mb_per_second"] = round(MIB * 1.048576 / max(time.monotonic() - t, 1e-6), 1)
shutil.rmtree(work, ignore_errors=True)
print(json.dumps(out))
'''
