"""VS Code in the browser: `<base_url>vscode/` on this Jupyter server is code-server (the golden
image's /usr/local/bin/code-server), started on the first request and proxied by
jupyter-server-proxy, like its configured server processes (`jupyter_server_proxy.config.ServerProcess`,
`handlers.SuperviseAndProxyHandler`: HTTP and websockets, the server's activity on each request).

code-server listens on a unix socket in a directory only this server's user can open (the
proxy's `mkdtemp`), with its own authentication off: the only way in is through this handler, so
Jupyter's authentication (under JupyterHub: a token or cookie with `access:servers` for this
server) and, on top of it, the owner check decide who gets in. As with the SSH tunnel, an admin or a
user this server is shared with may open the server, but its VS Code is its owner's.

The Workstation panel's JupyterLab extension shows the launcher tile when `workstation/api/info`
says where VS Code is (`vscode_url`); jupyter-server-proxy's own launcher never hears of it, so
there is no second tile that bypasses the owner check.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jupyter_server.utils import url_path_join
from jupyter_server_proxy.config import ServerProcess
from jupyter_server_proxy.handlers import AddSlashHandler
from tornado import web

from .proxy import owner_refusal

if TYPE_CHECKING:
    from jupyter_server.serverapp import ServerApp

    from .proxy import WorkstationGuest

NAME = "vscode"  # the path under the server's base_url


def code_server_command(executable: str, folder: str) -> list[str]:
    """code-server on the proxy's unix socket (`{unix_socket}`, filled in by jupyter-server-proxy),
    without its password (this server authenticates) and without calls home; it opens `folder`
    the first time, then the folder the user last had open (its user data lives in their home)."""
    return [executable, "--socket", "{unix_socket}", "--auth", "none",
            "--disable-telemetry", "--disable-update-check", folder]


def handler_class(guest: WorkstationGuest, folder: str) -> tuple[type, dict[str, Any]]:
    """jupyter-server-proxy's handler for a supervised code-server, with the owner check added."""
    process = ServerProcess(name=NAME, command=code_server_command(guest.code_server, folder), unix_socket=True,
                            timeout=guest.code_server_timeout, absolute_url=False,
                            launcher_entry={"enabled": False})  # (our extension's tile: see above)
    proxied, kwargs = process.make_proxy_handler()
    assert proxied is not None  # (a command is given: always the supervising handler)

    class VSCodeHandler(proxied):  # type: ignore[misc,valid-type]
        async def prepare(self, *args: Any, **kwargs: Any) -> None:
            # Jupyter's authentication: 403, or a redirect to the login page (then finished)
            await super().prepare(*args, **kwargs)
            if self._finished:
                return
            refused = owner_refusal(self.current_user, guest.user, "use this workstation's VS Code")
            if refused:
                raise web.HTTPError(403, refused)

    return VSCodeHandler, kwargs


def setup_handlers(serverapp: ServerApp, guest: WorkstationGuest) -> None:
    if not guest.code_server:
        serverapp.log.info("VS Code: not offered (no code-server; c.WorkstationGuest.code_server)")
        return
    base = serverapp.web_app.settings["base_url"]
    handler, kwargs = handler_class(guest, serverapp.root_dir)
    serverapp.web_app.add_handlers(".*$", [
        (url_path_join(base, NAME, "(.*)"), handler, kwargs),
        (url_path_join(base, NAME), AddSlashHandler),
    ])
    serverapp.log.info("VS Code: %s%s/ runs %s", base, NAME, guest.code_server)
