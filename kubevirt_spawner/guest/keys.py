"""`kubevirt-workstation-keys LOGIN`: the golden image's sshd asks it for the public keys that may
log in as LOGIN (OpenSSH's AuthorizedKeysCommand, run as the AuthorizedKeysCommandUser at every
login; sshd_config(5)).

The keys are the JupyterHub user's, kept by the workstations service for all their workstations
(`GET <service>/api/v1/users/USER/ssh-keys`): none is written to a disk, a key removed there is
refused at the next login, and a reset of the system disk keeps them. It asks with this server's
own token, which the workstation unit's launcher (guest/launch.py) leaves at every start in an
access file that only root and the keys command's account read.

It prints one key a line for the machine's owner and nothing for any other login. Whatever goes
wrong (no access file: SSH off or the server not started yet; the service down) prints no key,
says why on stderr (sshd logs it) and exits 1: sshd then lets nobody in by a key from here.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable
from urllib.parse import quote

ACCESS_DIR = "/run/kubevirt-workstation-keys"  # on the /run tmpfs: gone at every stop
ACCESS_FILE = os.path.join(ACCESS_DIR, "service.json")
KEYS_GROUP = "kubevirt-keys"  # the AuthorizedKeysCommandUser's group (deploy/golden-image/customize.sh)
TIMEOUT_SECONDS = 10.0
# One key a line, as the service checked it: a type OpenSSH takes, base64, a comment without
# control characters. Nothing else is printed: a line break or an option would be sshd's to obey.
KEY_LINE = re.compile(r"^(ssh-ed25519|ecdsa-sha2-nistp(256|384|521)|ssh-rsa|sk-ssh-ed25519@openssh\.com|"
                      r"sk-ecdsa-sha2-nistp256@openssh\.com) [A-Za-z0-9+/]+={0,2}( [^\x00-\x1f\x7f]{0,200})?$")


class KeysError(Exception):
    """Why no key is given, in one sentence for sshd's log."""


def write_access(env: dict[str, str], account: str, gid: int | None, directory: str = ACCESS_DIR) -> str | None:
    """Leave what the keys command needs (the service's URL, this server's token, whose keys, the
    owner's login) for this boot, readable by root and `gid` only; remove it when the hub turned
    SSH off or named no service (then no key logs in). The path written, or None."""
    path = os.path.join(directory, os.path.basename(ACCESS_FILE))
    enabled = env.get("KUBEVIRT_SSH_ENABLED", "1") != "0"
    if not (enabled and env.get("KUBEVIRT_WORKSTATIONS_URL") and env.get("JUPYTERHUB_API_TOKEN")):
        if os.path.exists(path):
            os.unlink(path)
        return None
    os.makedirs(directory, mode=0o750, exist_ok=True)
    if gid is not None:
        os.chown(directory, -1, gid)
    os.chmod(directory, 0o750)
    access = {"url": env["KUBEVIRT_WORKSTATIONS_URL"], "token": env["JUPYTERHUB_API_TOKEN"],
              "user": env.get("JUPYTERHUB_USER", ""), "login": account}
    fd, temporary = tempfile.mkstemp(dir=directory, prefix=".service.")
    try:
        os.fchmod(fd, 0o640)  # (from the first byte: the token is never readable by others)
        if gid is not None:
            os.fchown(fd, -1, gid)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(access, f)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise
    return path


def read_access(path: str = ACCESS_FILE) -> dict[str, str]:
    try:
        with open(path, encoding="utf-8") as f:
            access = json.load(f)
    except FileNotFoundError:
        raise KeysError(f"{path} is missing: SSH is off for this workstation, or its server has not "
                        "started") from None
    except (OSError, ValueError) as err:
        raise KeysError(f"cannot read {path}: {err}") from None
    if not isinstance(access, dict) or not all(isinstance(access.get(k), str) and access.get(k)
                                               for k in ("url", "token", "user", "login")):
        raise KeysError(f"{path} does not say url, token, user and login")
    return access


Fetch = Callable[[str, str, float], bytes]


def fetch(url: str, token: str, timeout: float) -> bytes:
    request = urllib.request.Request(url, headers={"Authorization": f"token {token}", "Accept": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.read(1024 * 1024)
    except urllib.error.HTTPError as err:
        said = ""
        with contextlib.suppress(ValueError, AttributeError):  # (a body that is no JSON object says nothing)
            said = json.loads(err.read(4096)).get("error", "")
        raise KeysError(f"the workstations service answered {err.code}" + (f": {said}" if said else "")) from None
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", None) or err
        raise KeysError(f"the workstations service at {url} does not answer ({reason})") from None


def authorized_keys(login: str, access: dict[str, str], get: Fetch = fetch,
                    timeout: float = TIMEOUT_SECONDS) -> list[str]:
    """The key lines that may log in as `login`: the owner's keys from the service, for the
    owner's login only."""
    if login != access["login"]:
        return []
    url = access["url"].rstrip("/") + f"/api/v1/users/{quote(access['user'], safe='')}/ssh-keys"
    try:
        answer = json.loads(get(url, access["token"], timeout))
        keys = answer["ssh_keys"]
        lines = [key["key"] for key in keys]
    except (ValueError, KeyError, TypeError):
        raise KeysError("the workstations service's answer is not a list of SSH keys") from None
    return [line for line in lines if isinstance(line, str) and KEY_LINE.match(line)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kubevirt-workstation-keys", description=__doc__.split("\n\n")[0])
    parser.add_argument("login", help="the account sshd is asked to log in to (sshd_config's %%u)")
    parser.add_argument("--access", default=ACCESS_FILE, help="the launcher's access file (default: %(default)s)")
    opts = parser.parse_args(argv)
    try:
        lines = authorized_keys(opts.login, read_access(opts.access))
    except KeysError as err:
        print(f"kubevirt-workstation-keys: {err}", file=sys.stderr)
        return 1
    sys.stdout.write("".join(line + "\n" for line in lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
