"""SSH into a workstation through the hub, end to end on the fast lane: the real OpenSSH client
with the Host block `kubevirt-spawner ssh-config` prints, its ProxyCommand (`kubevirt-spawner
tunnel`) through configurable-http-proxy to the server's `sshd/` websocket (jupyter-server-proxy's
raw socket relay), the process guest's sshd, which asks the guest's keys command for the user's
keys at every login, as the golden image's sshd does (AuthorizedKeysCommand), and the keys
managed once in the workstations service. Upstream: jupyter-server-proxy
jupyter_server_proxy/rawsocket.py (the relay), OpenSSH sshd_config(5) (AuthorizedKeysCommand)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote

import pytest
import requests
from conftest import SERVICE_API, Hub, hub_with_service, tunnel_handshake

from simtools import wait_for

USER, OTHER = "sofia", "mallory"


@pytest.fixture(scope="module")
def hub(e2e_sim, tmp_path_factory):
    yield from hub_with_service(e2e_sim, tmp_path_factory, 'c.KubeVirtSpawner.start_timeout = 60\n'
                                                             'c.KubeVirtSpawner.clone_stall_timeout = 30\n')


def token_of(hub: Hub, user: str) -> str:
    hub.ensure_user(user)
    r = hub.api("POST", f"/users/{user}/tokens", json={"note": "ssh test"})
    assert r.status_code == 201, r.text
    return r.json()["token"]


def keys_api(hub: Hub, token: str, method: str, user: str = USER, rest: str = "", json=None) -> requests.Response:
    """The service's SSH keys API of `user`, as the token's owner calls it."""
    return requests.request(method, f"{hub.url}{SERVICE_API}/users/{quote(user, safe='')}/ssh-keys{rest}",
                            headers={"Authorization": f"token {token}"}, json=json, timeout=60)


def keygen(path: Path) -> tuple[str, str]:
    """A new ed25519 key at `path`: its public line and ssh-keygen's fingerprint."""
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "laptop", "-f", str(path)], check=True)
    fingerprint = subprocess.run(["ssh-keygen", "-l", "-E", "sha256", "-f", f"{path}.pub"], capture_output=True,
                                 text=True, check=True).stdout.split()[1]
    return Path(f"{path}.pub").read_text().strip(), fingerprint


def cli(*args: str, token: str, hub: Hub) -> subprocess.CompletedProcess:
    env = {**os.environ, "JUPYTERHUB_API_TOKEN": token, "JUPYTERHUB_URL": hub.url}
    return subprocess.run([sys.executable, "-m", "kubevirt_spawner.cli", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def ssh_config(hub: Hub, token: str, user: str, key: Path) -> Path:
    """The Host block `kubevirt-spawner ssh-config` prints, and what a test adds: this key, no
    known_hosts (each test's workstation has new host keys)."""
    block = cli("ssh-config", token=token, hub=hub)
    assert block.returncode == 0, block.stderr
    assert token not in block.stdout and f"Host kubevirt.{user}" in block.stdout
    config = key.parent / "ssh_config"
    config.write_text(block.stdout + f"\nHost *\n  IdentityFile {key}\n  IdentitiesOnly yes\n  BatchMode yes\n"
                      "  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n")
    return config


def ssh(config: Path, token: str, hub: Hub, *args: str, program: str = "ssh") -> subprocess.CompletedProcess:
    """OpenSSH as a user runs it: the ProxyCommand finds the token in the environment."""
    env = {**os.environ, "JUPYTERHUB_API_TOKEN": token, "JUPYTERHUB_URL": hub.url}
    return subprocess.run([program, "-F", str(config), *args], capture_output=True, text=True, env=env, timeout=300)


def test_a_key_from_the_hub_opens_ssh_and_scp_until_it_is_deleted(hub: Hub, tmp_path: Path):
    """sofia adds her key in the service once; OpenSSH with ssh-config's Host block starts her
    stopped workstation and logs in with it, scp copies both ways, a reset keeps the key, another
    user's token opens no tunnel, and the deleted key is refused at the next login."""
    token, other = token_of(hub, USER), token_of(hub, OTHER)
    public, fingerprint = keygen(tmp_path / "id_ed25519")

    # bad input changes nothing (the API's table; tests/test_ssh_keys.py has the keys' own)
    for caller, method, rest, body, status, says in [
        (token, "POST", "", {"key": "ssh-dss AAAAB3NzaC1kc3M="}, 400, "not a key type OpenSSH accepts"),
        (token, "POST", "", {"key": 42}, 400, "is an SSH public key"),
        (token, "POST", "", None, 400, "is an SSH public key"),
        (other, "POST", "", {"key": public}, 403, "your own SSH keys"),
        (other, "GET", "", None, 403, "your own workstations"),
        (token, "DELETE", "/SHA256%3Anone", None, 404, "no SSH key with the fingerprint"),
        (token, "DELETE", "", None, 405, "by its fingerprint"),
        (None, "GET", "", None, 401, "Log in to JupyterHub"),
    ]:
        r = keys_api(hub, caller or "", method, rest=rest, json=body) if caller else \
            requests.get(f"{hub.url}{SERVICE_API}/users/{USER}/ssh-keys", timeout=60)
        assert r.status_code == status and says in r.json()["error"], (method, rest, body, r.status_code, r.text)
    assert keys_api(hub, token, "GET").json() == {"ssh_keys": []}

    added = keys_api(hub, token, "POST", json={"key": public + "\n"})
    assert added.status_code == 201, added.text
    assert added.json()["fingerprint"] == fingerprint and added.json()["key"] == public
    assert keys_api(hub, token, "POST", json={"key": public}).status_code == 409

    config = ssh_config(hub, token, USER, tmp_path / "id_ed25519")

    # the workstation is stopped: the connection starts it through the hub, then runs the command
    assert not (hub.server_model(USER) or {}).get("ready")
    done = ssh(config, token, hub, f"kubevirt.{USER}", "echo hello in $PWD")
    assert done.returncode == 0, done.stderr
    # (a process guest's home is her directory on the simulated disk; its processes are the test's)
    assert done.stdout.startswith("hello in /") and done.stdout.rstrip().endswith(f"/{USER}"), done.stdout
    assert f"Starting {USER}'s workstation" in done.stderr and "Server ready" in done.stderr, done.stderr
    assert (hub.server_model(USER) or {}).get("ready")

    # scp both ways (OpenSSH 9's scp speaks sftp)
    (tmp_path / "up.txt").write_text("to the workstation\n")
    up = ssh(config, token, hub, str(tmp_path / "up.txt"), f"kubevirt.{USER}:up.txt", program="scp")  # (her home)
    assert up.returncode == 0, up.stderr
    assert ssh(config, token, hub, f"kubevirt.{USER}", "cat up.txt").stdout == "to the workstation\n"
    down = ssh(config, token, hub, f"kubevirt.{USER}:/home/{USER}/up.txt", str(tmp_path / "down.txt"), program="scp")
    assert down.returncode == 0 and (tmp_path / "down.txt").read_text() == "to the workstation\n", down.stderr

    # `kubevirt-spawner ssh` itself: OpenSSH with the tunnel as its ProxyCommand, what follows -- run there
    direct = cli("ssh", USER, "-o", "BatchMode=yes", "-o", f"IdentityFile={tmp_path / 'id_ed25519'}", "-o",
                 "IdentitiesOnly=yes", "--", "-o", "StrictHostKeyChecking=no", "-oUserKnownHostsFile=/dev/null",
                 "-q", "echo", "hello", "from", "ssh", token=token, hub=hub)
    assert direct.returncode == 0 and direct.stdout == "hello from ssh\n", (direct.stdout, direct.stderr)

    # a reset of the system disk keeps the keys (they are the hub's, not the disk's), and her home
    r = requests.post(f"{hub.url}{SERVICE_API}/workstations/{USER}/reset", json={"confirm": USER},
                      headers={"Authorization": f"token {token}"}, timeout=120)
    assert r.status_code == 202, r.text
    wait_for(lambda: (requests.get(f"{hub.url}{SERVICE_API}/workstations/{USER}", timeout=30,
                                   headers={"Authorization": f"token {token}"}).json().get("operation") or {})
             .get("state") == "done", 180, what="the reset")
    hub.wait_ready(USER, timeout=120)
    assert ssh(config, token, hub, f"kubevirt.{USER}", "cat up.txt").stdout == "to the workstation\n"

    # another user's token cannot open sofia's tunnel, nor can the hub's admin (who may open her
    # server): 403, and no connection reaches her sshd (its log, as the image's sshd at LogLevel
    # VERBOSE, has a line for each; her own empty tunnel shows the count moves)
    def connections() -> int:
        log = "open(os.path.join(os.environ['KUBEVIRT_SIM_MACHINE_ROOT'], 'var/log/auth.log')).read()"
        return int(hub.execute(USER, f"import os\nprint({log}.count('sshd: Connection from '))").strip())
    before = connections()
    opened, banner = tunnel_handshake(hub, USER, token)
    assert opened == 101 and banner.startswith("SSH-2.0-"), banner
    wait_for(lambda: connections() == before + 1, 30, what="her own tunnel's connection to her sshd")
    assert tunnel_handshake(hub, USER, other)[0] == 403
    admin = hub.http.headers["Authorization"].split()[1]
    assert tunnel_handshake(hub, USER, admin) == (403, f"Only {USER} can open this workstation's SSH tunnel, "
                                                       "not demo-admin.")
    time.sleep(2)
    assert connections() == before + 1
    refused = cli("tunnel", USER, "--no-start", token=other, hub=hub)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "Traceback" not in refused.stderr, \
        refused.stderr

    # the key deleted in the service: the next login is refused
    gone = keys_api(hub, token, "DELETE", rest="/" + quote(fingerprint, safe=""))
    assert gone.status_code == 200 and gone.json() == {"deleted": fingerprint}, gone.text
    again = ssh(config, token, hub, f"kubevirt.{USER}", "true")
    assert again.returncode == 255 and "Permission denied" in again.stderr, again.stderr


def test_keys_are_managed_on_the_workstations_page(hub: Hub, tmp_path: Path):
    """The page (the owner's own login, XSRF-protected forms) lists the user's keys, adds one
    and deletes one; a bad key is the page's sentence and changes nothing; a form without the
    page's XSRF token is refused."""
    from test_service import form_token, login

    token = token_of(hub, "paula")
    public, fingerprint = keygen(tmp_path / "id_ed25519")
    browser, page = login(hub, "paula")
    assert 'id="ssh-keys"' in page.text and "No SSH keys yet." in page.text
    added = browser.post(f"{hub.url}/services/workstations/", data={
        "action": "add-ssh-key", "key": public, "_xsrf": form_token(page.text)}, timeout=30)
    assert added.status_code == 200 and "SSH key added." in added.text and f'data-fingerprint="{fingerprint}"' in added.text
    assert [k["fingerprint"] for k in keys_api(hub, token, "GET", "paula").json()["ssh_keys"]] == [fingerprint]
    bad = browser.post(f"{hub.url}/services/workstations/", data={
        "action": "add-ssh-key", "key": "ssh-rsa AAAA", "_xsrf": form_token(added.text)}, timeout=30)
    assert bad.status_code == 400 and "The ssh-rsa key&#39;s data is cut short" in bad.text, bad.text
    forged = browser.post(f"{hub.url}/services/workstations/", data={
        "action": "delete-ssh-key", "fingerprint": fingerprint}, timeout=30)
    assert forged.status_code == 403
    assert len(keys_api(hub, token, "GET", "paula").json()["ssh_keys"]) == 1  # nothing changed
    gone = browser.post(f"{hub.url}/services/workstations/", data={
        "action": "delete-ssh-key", "fingerprint": fingerprint, "_xsrf": form_token(added.text)}, timeout=30)
    assert gone.status_code == 200 and "SSH key deleted." in gone.text and "No SSH keys yet." in gone.text
