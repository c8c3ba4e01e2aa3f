"""The `workstations` hub service: snapshots, restore, reset, stop and keep-alive for users and
admins, over a REST API and a rescue page, on the same lifecycle code as the spawner.

Hub configs register it with `register(c)`: the hub then starts `kubevirt-spawner service`, which
loads the hub's own config file (the one JupyterHub was started with) as the hub does, with the
hub's environment, so the two see the same merged settings and never disagree: a setting made
after the registration (Zero-to-JupyterHub's `hub.config` and every `hub.extraConfig` snippet)
reaches both.
"""

from __future__ import annotations

import os
import re
import sys

SERVICE_NAME = "workstations"
# The hub's environment variables the service is not given: the proxy's token, cookie secrets,
# passwords, keys (the service authenticates with its own token, which JupyterHub gives it)
SECRET_NAME = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|PWD|_KEY|KEYS)$", re.IGNORECASE)
# ...except the hub's database password: the service keeps users' SSH keys in the hub's database
# (c.Workstations.ssh_keys_db_url). Zero-to-JupyterHub's hub.db.password reaches the hub as one of
# these (jupyterhub/templates/hub/deployment.yaml), which the database drivers read themselves.
DATABASE_PASSWORDS = ("PGPASSWORD", "MYSQL_PWD")
CONFIG_ENV = "KUBEVIRT_SPAWNER_HUB_CONFIG"
# What the service may do through the hub's API: read users and their servers, start and stop
# servers (restore and reset do, so the hub's view stays true), and record activity (keep-alive).
SERVICE_SCOPES = ["list:users", "read:users", "read:servers", "servers", "users:activity"]


def hub_config_file() -> str:
    """The config file of the JupyterHub whose config is being loaded (its --config); in the
    service's own process, the one it was given; else JupyterHub's default, ./jupyterhub_config.py."""
    from jupyterhub.app import JupyterHub
    if JupyterHub.initialized():
        return os.path.abspath(JupyterHub.instance().config_file)
    return os.environ.get(CONFIG_ENV) or os.path.abspath(JupyterHub.config_file.default_value)


def register(c, config_file: str | None = None, port: int = 10101, ip: str = "127.0.0.1",
             host: str | None = None):
    """Add the service to a hub config `c` (call it from the hub's config, or a file it runs).

    The service loads `config_file`, the hub's whole config (default: the file the running
    JupyterHub loads, never a fragment of it), with the environment the hub's config is loaded
    in, less the variables that hold secrets (a hub-managed service otherwise starts with a bare
    one; Zero-to-JupyterHub's config reads its secrets from files in the hub's container, which
    the service shares). Users (through the
    `user` role) and each server's own token get access to it; the service's role holds only
    SERVICE_SCOPES. The service listens on `ip`:`port`; the proxy and the workstations' Lab
    panels reach it at `host` (default `ip`): in a cluster, the hub pod's Service name with
    `ip="0.0.0.0"`."""
    # (not JupyterHub's own JUPYTERHUB_* of the hub's process: a service's environment goes over
    # what JupyterHub sets for the service, jupyterhub/spawner.py get_env)
    env = {name: value for name, value in os.environ.items()
           if (not SECRET_NAME.search(name) or name in DATABASE_PASSWORDS) and not name.startswith("JUPYTERHUB_")}
    env[CONFIG_ENV] = os.path.abspath(config_file) if config_file else hub_config_file()
    services = list(c.JupyterHub.services) if "services" in c.JupyterHub else []
    url = f"http://{host or ip}:{port}"
    services.append({"name": SERVICE_NAME, "url": url, "oauth_no_confirm": True,
                     "command": [sys.executable, "-m", "kubevirt_spawner.cli", "service", "--ip", ip,
                                 "--port", str(port)],
                     "environment": env, "display": True})
    c.JupyterHub.services = services
    access = f"access:services!service={SERVICE_NAME}"
    # Users reach it through the `user` role: extra_user_scopes adds to JupyterHub's default one,
    # but a config that defines the role's scopes itself replaces them (JupyterHub's app.py
    # init_role_creation ignores extra_user_scopes then), so such a role gets the scope too.
    roles = [{**role, "scopes": [*role["scopes"], access]}
             if role.get("name") == "user" and "scopes" in role and access not in role["scopes"] else role
             for role in (c.JupyterHub.load_roles if "load_roles" in c.JupyterHub else [])]
    roles.append({"name": f"{SERVICE_NAME}-service", "description": "The workstations service",
                  "scopes": list(SERVICE_SCOPES), "services": [SERVICE_NAME]})
    c.JupyterHub.load_roles = roles
    extra = set(c.JupyterHub.extra_user_scopes) if "extra_user_scopes" in c.JupyterHub else set()
    c.JupyterHub.extra_user_scopes = extra | {access}
    # The server's own token (the guest holds it) may call the service too, for its own machine;
    # the rest is what the config gives that token, else JupyterHub's default (the `server` role).
    scopes = ["users:activity!user", "access:servers!server"]
    for section in ("Spawner", "KubeVirtSpawner"):
        if section in c and "server_token_scopes" in c[section]:
            scopes = list(c[section].server_token_scopes)
    c.KubeVirtSpawner.server_token_scopes = [*scopes, access] if access not in scopes else scopes
    c.KubeVirtSpawner.workstations_url = f"{url}/services/{SERVICE_NAME}/"


CULLER_NAME = "idle-culler"
# What jupyterhub-idle-culler needs to stop idle servers (its README's "Permissions"); no
# admin:users: it never deletes users.
CULLER_SCOPES = ["list:users", "read:users:activity", "read:servers", "delete:servers"]


def register_idle_culler(c, timeout: int, cull_every: int | None = None, warn_before: int = 600):
    """Run the standard jupyterhub-idle-culler as a hub-managed service: servers without activity
    for `timeout` seconds are stopped (the spawner's graceful stop: disks kept), checked every
    `cull_every` seconds (default: a tenth of the timeout, at least 30 s, at most the timeout). Users and named servers are
    never deleted. The workstations service learns the same policy, so the Lab can warn
    `warn_before` seconds before a stop."""
    if timeout < 10 or (cull_every is not None and not 1 <= cull_every <= timeout) or not 0 <= warn_before < timeout:
        raise ValueError("idle culling: timeout is at least 10 s, cull_every from 1 s to the timeout, and "
                         "warn_before from 0 to less than the timeout")
    every = cull_every or min(timeout, max(30, timeout // 10))
    # Called again on the same config, it replaces the policy.
    services = [s for s in (c.JupyterHub.services if "services" in c.JupyterHub else []) if s["name"] != CULLER_NAME]
    services.append({"name": CULLER_NAME, "command": [
        sys.executable, "-m", "jupyterhub_idle_culler", f"--timeout={timeout}", f"--cull-every={every}",
        "--cull-users=false", "--remove-named-servers=false"]})
    c.JupyterHub.services = services
    roles = [r for r in (c.JupyterHub.load_roles if "load_roles" in c.JupyterHub else []) if r["name"] != CULLER_NAME]
    roles.append({"name": CULLER_NAME, "description": "Stops idle servers", "scopes": list(CULLER_SCOPES),
                  "services": [CULLER_NAME]})
    c.JupyterHub.load_roles = roles
    c.Workstations.idle_timeout = timeout
    c.Workstations.idle_cull_every = every
    c.Workstations.idle_warn_before = warn_before
