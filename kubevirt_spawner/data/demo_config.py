"""JupyterHub config of the local demo (and the end-to-end tests): KubeVirtSpawner, unchanged,
against the simulator's kubeconfig. `kubevirt-spawner demo` sets the environment it reads.

Package data (not an importable module), so that the demo runs from an installed wheel."""

import os
import signal

from kubevirt_spawner.demo import DEMO_PASSWORD

# The hub stops its managed services (the workstations service, the idle culler) with SIGINT. A hub
# started from a background job inherits SIGINT ignored and hands that down to them, so they would
# only go at the SIGTERM that follows 10 s later, and a hub stopped meanwhile leaves them behind.
# Handling SIGINT here makes it the default again in every process the hub starts.
signal.signal(signal.SIGINT, signal.default_int_handler)

c = get_config()  # noqa: F821 (provided by JupyterHub)
state = os.environ["KUBEVIRT_DEMO_STATE"]

# --- hub, proxy (started by the demo, so it survives hub restarts), login
c.JupyterHub.ip = "127.0.0.1"
c.JupyterHub.port = int(os.environ["KUBEVIRT_DEMO_PORT"])
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.hub_port = int(os.environ["KUBEVIRT_DEMO_HUB_PORT"])
c.ConfigurableHTTPProxy.should_start = False
c.ConfigurableHTTPProxy.api_url = os.environ["CONFIGPROXY_API_URL"]  # the token comes from CONFIGPROXY_AUTH_TOKEN
c.JupyterHub.db_url = f"sqlite:///{state}/hub/jupyterhub.sqlite"
c.JupyterHub.cookie_secret_file = f"{state}/hub/jupyterhub_cookie_secret"
c.JupyterHub.pid_file = f"{state}/hub/jupyterhub.pid"
c.JupyterHub.cleanup_servers = False  # workstations keep running across hub restarts
c.JupyterHub.allow_named_servers = True
# Activity is what the workstation's server reports (API use, kernels, terminals), not any traffic
# through the proxy: an open tab's polling (the Workstation panel's included) would keep it "active".
c.JupyterHub.last_activity_interval = 0
# Users' pages on the hub's origin: the demo and the tests that drive it with HTTP clients reach
# the hub at 127.0.0.1, and those clients resolve names through the C library, which does not map
# NAME.hub.localhost to this machine as browsers do. (The browser test of origins,
# tests/e2e/test_origins.py, runs a hub with subdomains; a production hub refuses this setting.)
c.KubeVirtSpawner.allow_shared_origin = True
c.JupyterHub.authenticator_class = "dummy"
c.DummyAuthenticator.password = DEMO_PASSWORD
c.Authenticator.allow_all = True
c.Authenticator.admin_users = {"admin"}
# (The workstations service reads this file too, without the demo's admin token.)
c.JupyterHub.services = [{"name": "demo-admin", "api_token": os.environ.get("KUBEVIRT_DEMO_ADMIN_TOKEN", "")}]
c.JupyterHub.load_roles = [{"name": "admin", "users": ["admin"], "services": ["demo-admin"]}]

# --- the spawner
c.JupyterHub.spawner_class = "kubevirt"
c.KubeVirtSpawner.kubeconfig = os.environ["KUBEVIRT_SPAWNER_KUBECONFIG"]
c.KubeVirtSpawner.url_mode = "cluster-ip"  # no cluster DNS on this machine
c.KubeVirtSpawner.golden_image = "vm-images/ubuntu-24-04-cuda-golden"
c.KubeVirtSpawner.root_disk_size = "60Gi"
c.KubeVirtSpawner.workspace_disk_size = "20Gi"  # /home: kept by a system reset
c.KubeVirtSpawner.args = ["--ContentsManager.allow_hidden=True"]  # dotfiles are part of a workstation
c.KubeVirtSpawner.start_timeout = 300
c.KubeVirtSpawner.clone_stall_timeout = 120
c.KubeVirtSpawner.http_timeout = 60

# On the workstation pool's nodes only (the demo's cluster has them labelled and tainted as
# deploy/host/label-nodes.sh leaves them), as hub-config/'s profiles: GPU machines on the VFIO nodes,
# CPU machines off them (else the scheduler favours the GPU nodes' many free CPUs and the GPUs wait).
pool_tolerations = [{"key": "workload.example.com/kubevirt", "operator": "Equal", "value": "true",
                     "effect": "NoSchedule"}]
cpu_placement = {
    "node_selector": {"workload.example.com/kubevirt": "true"}, "tolerations": pool_tolerations,
    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "accelerator.example.com/mode", "operator": "DoesNotExist"}]}]}}},
}
gpu_placement = {
    "node_selector": {"workload.example.com/kubevirt": "true", "accelerator.example.com/mode": "vfio"},
    "tolerations": pool_tolerations,
}
c.KubeVirtSpawner.profile_list = [
    {"display_name": "CPU workstation: 2 CPUs, 4 GiB", "slug": "cpu", "default": True,
     "description": "For notebooks, data wrangling and builds.",
     "kubevirt_override": {"cpu_guarantee": 2, "mem_guarantee": "4G", **cpu_placement}},
    {"display_name": "GPU workstation: 1x A100, 8 CPUs, 64 GiB", "slug": "gpu-a100-1",
     "description": "One NVIDIA A100 passed through (VFIO).",
     "kubevirt_override": {"cpu_guarantee": 8, "mem_guarantee": "64G", "root_disk_size": "150Gi",
                           "gpus": {"nvidia.com/A100-PCIE-40GB": 1}, **gpu_placement}},
    {"display_name": "GPU workstation: 2x A100, 16 CPUs, 128 GiB", "slug": "gpu-a100-2",
     "description": "Two NVIDIA A100s passed through (VFIO).",
     "kubevirt_override": {"cpu_guarantee": 16, "mem_guarantee": "128G", "root_disk_size": "150Gi",
                           "gpus": {"nvidia.com/A100-PCIE-40GB": 2}, **gpu_placement}},
]

# --- the workstations service: snapshots, restore, reset, stop, keep-alive, the rescue page.
# It loads this same file (the hub's config) for the spawner's settings.
from kubevirt_spawner.service import register  # noqa: E402

register(c, __file__, port=int(os.environ["KUBEVIRT_DEMO_SERVICE_PORT"]))

# Tests (and curious users) can add settings without editing this file.
if os.environ.get("KUBEVIRT_DEMO_EXTRA_CONFIG"):
    load_subconfig(os.environ["KUBEVIRT_DEMO_EXTRA_CONFIG"])  # noqa: F821

# Idle stops: the standard jupyterhub-idle-culler after an hour without activity, warned in the Lab
# ten minutes before; extra settings may change the policy (c.Workstations.idle_*).
from kubevirt_spawner.service import register_idle_culler  # noqa: E402

policy = c.Workstations
register_idle_culler(c, timeout=policy.idle_timeout if "idle_timeout" in policy else 3600,
                     cull_every=policy.idle_cull_every if "idle_cull_every" in policy else None,
                     warn_before=policy.idle_warn_before if "idle_warn_before" in policy else 600)

# Last: a bad setting stops the hub here, with a message naming it.
from kubevirt_spawner import KubeVirtSpawner  # noqa: E402

KubeVirtSpawner.validate_config(c)
