"""Production JupyterHub config for a hub run without Zero-to-JupyterHub: the hub runs in a pod of
the cluster, the proxy in its own pod (as the chart lays them out), and every user gets a KubeVirt
workstation. With Zero-to-JupyterHub, use deploy/jupyterhub/values.yaml instead: the chart sets what
this file sets here and runs kubevirt_spawner_config.py the same way.

Environment: POD_NAMESPACE (the hub pod's namespace), CLUSTER_DOMAIN (default cluster.local), and
what kubevirt_spawner_config.py lists. The hub's ServiceAccount needs the RBAC in deploy/rbac/.
Authentication is site-specific: set c.JupyterHub.authenticator_class below.
"""

import os
from pathlib import Path

c = get_config()  # noqa: F821 (provided by JupyterHub)
hub_namespace = os.environ.get("POD_NAMESPACE", "jupyterhub")
cluster_domain = os.environ.get("CLUSTER_DOMAIN", "cluster.local")

# --- hub and proxy, as in Zero-to-JupyterHub: the proxy runs in its own pod
c.JupyterHub.ip = "0.0.0.0"
c.JupyterHub.hub_ip = "0.0.0.0"
c.ConfigurableHTTPProxy.should_start = False
c.ConfigurableHTTPProxy.api_url = f"http://proxy-api.{hub_namespace}.svc.{cluster_domain}:8001"
c.JupyterHub.allow_named_servers = True
c.JupyterHub.named_server_limit_per_user = 3
c.JupyterHub.db_url = "sqlite:////srv/jupyterhub/jupyterhub.sqlite"
c.JupyterHub.cookie_secret_file = "/srv/jupyterhub/jupyterhub_cookie_secret"
# c.JupyterHub.authenticator_class = "generic-oauth"  # your identity provider

# --- kubevirt-spawner's part, run against this config (it adds to its services and roles)
fragment = str(Path(__file__).with_name("kubevirt_spawner_config.py"))
exec(compile(Path(fragment).read_text(), fragment, "exec"), {"c": c, "__file__": fragment, "get_config": lambda: c})
