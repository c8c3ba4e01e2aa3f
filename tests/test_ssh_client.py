"""The SSH client's pure parts (kubevirt_spawner/ssh.py): where the hub and the token come from,
what a workstation is called, the ProxyCommand and the ~/.ssh/config block it writes."""

from __future__ import annotations

import json
import os
import shlex
import stat

import pytest

from kubevirt_spawner import cli, ssh


@pytest.mark.parametrize("given, url", [
    ("https://hub.example.org", "https://hub.example.org/"),
    ("https://hub.example.org/hub/home", "https://hub.example.org/"),
    ("https://hub.example.org/user/alice/lab?x=1", "https://hub.example.org/"),
    ("https://example.org/jupyter/hub/token", "https://example.org/jupyter/"),
    ("http://127.0.0.1:8000/", "http://127.0.0.1:8000/"),
])
def test_the_hub_url_is_the_address_users_open(given, url):
    assert ssh.hub_url(given) == url


@pytest.mark.parametrize("bad", ["hub.example.org", "ftp://hub.example.org/", "", "https://"])
def test_a_hub_url_that_is_no_url_is_refused_with_a_sentence(bad):
    with pytest.raises(ssh.ClientError, match="is not a hub URL; give the address you open JupyterHub at"):
        ssh.hub_url(bad)


def test_flags_then_environment_then_the_login_file(tmp_path):
    env = {"XDG_CONFIG_HOME": str(tmp_path)}
    ssh.write_config(ssh.config_path(env), ssh.Login("https://hub.example.org/", "saved"))
    path = tmp_path / "kubevirt-spawner" / "hub.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and json.loads(path.read_text())["token"] == "saved"
    assert ssh.resolve_login(None, None, env) == ssh.Login("https://hub.example.org/", "saved")
    assert ssh.resolve_login(None, None, {**env, "JUPYTERHUB_API_TOKEN": "env"}).token == "env"
    assert ssh.resolve_login(None, "flag", {**env, "JUPYTERHUB_API_TOKEN": "env"}).token == "flag"
    # the saved token is for the saved hub only: never sent to another
    with pytest.raises(ssh.ClientError, match="No token for https://other.example.org/"):
        ssh.resolve_login("https://other.example.org", None, env)
    with pytest.raises(ssh.ClientError, match="Say which hub"):
        ssh.resolve_login(None, None, {"XDG_CONFIG_HOME": str(tmp_path / "none")})


def test_a_login_file_others_can_read_is_refused(tmp_path):
    env = {"XDG_CONFIG_HOME": str(tmp_path)}
    ssh.write_config(ssh.config_path(env), ssh.Login("https://hub.example.org/", "saved"))
    os.chmod(ssh.config_path(env), 0o644)
    with pytest.raises(ssh.ClientError, match=r"can be read by others \(mode 644\); run chmod 600"):
        ssh.resolve_login(None, None, env)


@pytest.mark.parametrize("given, me, expected", [
    (None, "alice", ("alice", "")), ("bob", "alice", ("bob", "")), ("alice/gpu", "x", ("alice", "gpu")),
])
def test_which_workstation(given, me, expected):
    assert ssh.target(given, me) == expected


@pytest.mark.parametrize("bad", ["/gpu", "alice/", "alice/gpu/x"])
def test_a_workstation_that_is_no_name_is_refused(bad):
    with pytest.raises(ssh.ClientError, match="names no workstation; write USER or USER/SERVER"):
        ssh.target(bad, "alice")


def test_the_proxy_command_is_quoted_and_its_percent_signs_are_not_tokens(monkeypatch):
    monkeypatch.setattr(ssh, "own_command", lambda: ["/opt/k s/kubevirt-spawner"])
    command = ssh.proxy_command("https://hub.example.org/", "100%$(id)/gpu")
    assert "%%" in command and "%$" not in command.replace("%%", "")
    assert shlex.split(command.replace("%%", "%")) == ["/opt/k s/kubevirt-spawner", "tunnel", "100%$(id)/gpu",
                                                       "--hub-url", "https://hub.example.org/"]


def test_the_config_block_names_each_workstation_safely_and_holds_no_token(monkeypatch):
    monkeypatch.setattr(ssh, "own_command", lambda: ["kubevirt-spawner"])
    block = ssh.config_block("https://hub.example.org/", [("alice", ""), ("alice", "gpu"), ("Ève *", "")])
    hosts = [line.split()[1] for line in block.splitlines() if line.startswith("Host ")]
    assert hosts[:2] == ["kubevirt.alice", "kubevirt.alice--gpu"]
    assert all(h.replace(".", "").replace("-", "").isalnum() and h.isascii() for h in hosts)  # no ssh patterns
    assert "  User alice\n" in block and "HostKeyAlias kubevirt.alice--gpu.hub.example.org" in block
    assert "token" not in block.replace("the token stays", "")


def test_writing_the_block_replaces_this_hubs_block_only(tmp_path):
    path = tmp_path / ".ssh" / "config"
    path.parent.mkdir()
    path.write_text("Host other\n  User me\n")
    os.chmod(path, 0o640)
    one = ssh.config_block("https://hub.example.org/", [("alice", "")])
    ssh.write_ssh_config(str(path), "https://hub.example.org/", one)
    two = ssh.config_block("https://hub.example.org/", [("alice", ""), ("alice", "gpu")])
    ssh.write_ssh_config(str(path), "https://hub.example.org/", two)
    other = ssh.config_block("https://other.example.org/", [("bob", "")])
    ssh.write_ssh_config(str(path), "https://other.example.org/", other)
    text = path.read_text()
    assert text.startswith("Host other\n  User me\n\n") and text.count("Host kubevirt.alice\n") == 1
    assert "Host kubevirt.alice--gpu" in text and "Host kubevirt.bob" in text
    assert stat.S_IMODE(path.stat().st_mode) == 0o640  # the user's own mode is kept


@pytest.mark.parametrize("argv, sentence", [
    (["tunnel", "alice", "--hub-url", "not-a-url", "--token", "t"], "is not a hub URL"),
    (["tunnel", "alice", "--hub-url", "http://127.0.0.1:9", "--token", "t"], "Cannot reach the hub at http://127.0.0.1:9/"),
    (["ssh", "alice/", "--hub-url", "http://127.0.0.1:9", "--token", "t"], "Cannot reach the hub"),
    (["ssh-config", "--hub-url", "http://127.0.0.1:9"], "No token for http://127.0.0.1:9/"),
])
def test_the_commands_answer_bad_input_with_one_sentence_and_status_2(argv, sentence, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.delenv("JUPYTERHUB_API_TOKEN", raising=False)
    monkeypatch.delenv("JUPYTERHUB_URL", raising=False)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kubevirt-spawner: ") and sentence in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


class FakeHub:
    """A JupyterHub REST API that knows one token (alice's) and alice's stopped workstation, and
    records every request that would change something (a start)."""

    TOKEN = "alices-token"

    def __init__(self):
        import http.server
        import threading
        hub = self
        self.changes: list[str] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, status: int, body):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.headers.get("Authorization") != f"token {hub.TOKEN}":
                    return self._answer(403, {"status": 403, "message": "Missing or invalid credentials."})
                if self.path == "/hub/api/user":
                    return self._answer(200, {"kind": "user", "name": "alice"})
                if self.path.startswith("/hub/api/users/alice?"):
                    return self._answer(200, {"name": "alice", "servers": {
                        "": {"name": "", "ready": False, "pending": None, "url": "/user/alice/"}}})
                if self.path.startswith("/hub/api/users/"):
                    return self._answer(404, {"status": 404, "message": "Not Found"})
                return self._answer(404, {"status": 404, "message": "Not Found"})

            def do_POST(self):
                hub.changes.append(self.path)
                return self._answer(403, {"status": 403, "message": "not in this test"})

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_hub():
    hub = FakeHub()
    yield hub
    hub.close()


@pytest.mark.parametrize("argv, token, sentence", [
    (["tunnel", "alice"], "a-revoked-token", "refused the token (403): make a new one on {url}hub/token."),
    (["ssh", "alice"], "a-revoked-token", "refused the token (403)"),
    (["ssh-config"], "a-revoked-token", "refused the token (403)"),
    (["tunnel", "bob"], FakeHub.TOKEN, "The hub shows this token no user bob"),
    (["tunnel", "alice/gpu"], FakeHub.TOKEN, "alice has no server named gpu; start it once from the hub's home page."),
    (["tunnel", "alice", "--no-start"], FakeHub.TOKEN,
     "alice's workstation is stopped (--no-start); start it from the hub's home page or leave out --no-start."),
    (["tunnel", "alice/gpu/x"], FakeHub.TOKEN, "'alice/gpu/x' names no workstation; write USER or USER/SERVER."),
])
def test_a_bad_token_a_missing_workstation_and_no_start_are_one_sentence_and_change_nothing(
        argv, token, sentence, fake_hub, capsys, monkeypatch, tmp_path):
    """What the hub answers (JupyterHub's REST API: 403 for a token it does not know,
    jupyterhub/apihandlers/base.py; 404 for a user the token may not see) reaches the user as one
    sentence and exit status 2, and nothing was asked of the hub that changes anything (no start)."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", token)
    monkeypatch.setenv("JUPYTERHUB_URL", fake_hub.url)
    monkeypatch.setattr("os.execve", lambda *a: pytest.fail(f"ssh was run: {a}"))
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kubevirt-spawner: ") and "Traceback" not in err, err
    assert sentence.format(url=fake_hub.url) in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert fake_hub.changes == []


@pytest.mark.parametrize("after, options, command", [
    (["-L", "8888:localhost:8888", "-N"], ["-L", "8888:localhost:8888", "-N"], []),
    (["ls", "-la"], [], ["ls", "-la"]),
    (["-v", "-p", "2222", "uptime"], ["-v", "-p", "2222"], ["uptime"]),
    (["-oBatchMode=yes", "echo", "hi"], ["-oBatchMode=yes"], ["echo", "hi"]),
    (["-vvL", "1:h:2", "top"], ["-vvL", "1:h:2"], ["top"]),
    (["-A", "--", "-weird-command"], ["-A"], ["-weird-command"]),
])
def test_what_follows_the_double_dash_is_opensshs_options_then_its_command(after, options, command):
    """`kubevirt-spawner ssh alice -- ssh args`: ssh(1)'s options go before the host, the command
    after it (OpenSSH's getopt string in ssh.c says which options take a value)."""
    assert ssh.split_ssh_args(after) == (options, command)
