"""Production JupyterHub config: the hub runs in a pod of the cluster (Zero-to-JupyterHub style)
and gives every user a KubeVirt workstation. Environment it reads:

  POD_NAMESPACE       namespace of the hub pod (Zero-to-JupyterHub sets it from the downward API;
                      the Service `hub` there is how guests reach the hub)
  CLUSTER_DOMAIN      the cluster's DNS domain (default cluster.local)
  GOLDEN_IMAGE        golden image PVC as namespace/name (default vm-images/ubuntu-24-04-cuda-golden)
  STORAGE_CLASS       RBD StorageClass (default ceph-rbd)

The hub's ServiceAccount needs the RBAC in deploy/rbac/ (exactly the calls the spawner and the
workstations service make, and clone permission in the golden image's namespace).
Authentication is site-specific: set c.JupyterHub.authenticator_class below.
"""

import os

c = get_config()  # noqa: F821 (provided by JupyterHub)
hub_namespace = os.environ.get("POD_NAMESPACE", "jupyterhub")
cluster_domain = os.environ.get("CLUSTER_DOMAIN", "cluster.local")

# --- hub and proxy, as in Zero-to-JupyterHub: the proxy runs in its own pod
c.JupyterHub.ip = "0.0.0.0"
c.JupyterHub.hub_ip = "0.0.0.0"
c.JupyterHub.hub_connect_url = f"http://hub.{hub_namespace}.svc.{cluster_domain}:8081"
c.ConfigurableHTTPProxy.should_start = False
c.ConfigurableHTTPProxy.api_url = f"http://proxy-api.{hub_namespace}.svc.{cluster_domain}:8001"
c.JupyterHub.cleanup_servers = False  # workstations keep running across hub restarts and upgrades
c.JupyterHub.allow_named_servers = True
# Activity is what the workstation's server reports (API use, kernels, terminals), not any traffic
# through the proxy: an open tab's polling (the Workstation panel's included) would keep it "active".
c.JupyterHub.last_activity_interval = 0
c.JupyterHub.named_server_limit_per_user = 3
c.JupyterHub.db_url = "sqlite:////srv/jupyterhub/jupyterhub.sqlite"
c.JupyterHub.cookie_secret_file = "/srv/jupyterhub/jupyterhub_cookie_secret"
# c.JupyterHub.authenticator_class = "generic-oauth"  # your identity provider

# --- the spawner
c.JupyterHub.spawner_class = "kubevirt"
c.KubeVirtSpawner.kubeconfig = None  # in-cluster ServiceAccount
c.KubeVirtSpawner.url_mode = "dns"
c.KubeVirtSpawner.cluster_domain = cluster_domain
c.KubeVirtSpawner.namespace_template = "notebook-{user}"
c.KubeVirtSpawner.golden_image = os.environ.get("GOLDEN_IMAGE", "vm-images/ubuntu-24-04-cuda-golden")
c.KubeVirtSpawner.storage_class = os.environ.get("STORAGE_CLASS", "ceph-rbd")
c.KubeVirtSpawner.root_disk_size = "150Gi"
c.KubeVirtSpawner.workspace_disk_size = "100Gi"
c.KubeVirtSpawner.termination_grace_period = 120
c.KubeVirtSpawner.max_concurrent_clones = 4
c.KubeVirtSpawner.gpu_unavailable = "wait"
c.KubeVirtSpawner.retention_days = 30
c.KubeVirtSpawner.start_timeout = 1800  # a first start clones 150 GiB
c.KubeVirtSpawner.http_timeout = 300
c.KubeVirtSpawner.args = ["--ContentsManager.allow_hidden=True"]
c.KubeVirtSpawner.server_token_scopes = ["users:activity!user", "access:servers!server"]
# Zero-to-JupyterHub's hub NetworkPolicy admits pods with this label (from any namespace with
# interNamespaceAccessLabels: accept, deploy/jupyterhub/values.yaml): the workstations' launcher
# pods carry it, so their guests reach the hub and the workstations service.
c.KubeVirtSpawner.extra_labels = {"hub.jupyter.org/network-access-hub": "true"}

# --- what a user's namespace gets with their first workstation: only the hub's and the proxy's
# pods (Zero-to-JupyterHub's labels) reach the workstations, which do not reach each other; and
# what one user may hold in all (three servers at most, see named_server_limit_per_user).
c.KubeVirtSpawner.network_policy_ingress_from = [
    {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": hub_namespace}},
     "podSelector": {"matchLabels": {"app": "jupyterhub"},
                     "matchExpressions": [{"key": "component", "operator": "In", "values": ["hub", "proxy"]}]}},
]
c.KubeVirtSpawner.namespace_resource_quota = {
    "requests.cpu": "24", "requests.memory": "160Gi", "requests.storage": "1Ti", "persistentvolumeclaims": "12",
    "requests.nvidia.com/A100-PCIE-40GB": "1",
}
c.KubeVirtSpawner.namespace_limit_range = [{"type": "PersistentVolumeClaim", "max": {"storage": "500Gi"}}]

vm_nodes = {
    "node_selector": {"workload.example.com/kubevirt": "true"},
    "tolerations": [{"key": "workload.example.com/kubevirt", "operator": "Equal", "value": "true",
                     "effect": "NoSchedule"}],
}
gpu_nodes = {
    "node_selector": {"workload.example.com/kubevirt": "true", "accelerator.example.com/mode": "vfio"},
    "tolerations": vm_nodes["tolerations"],
}
c.KubeVirtSpawner.profile_list = [
    {"display_name": "Workstation: 4 CPUs, 16 GiB", "slug": "cpu-4", "default": True, "version": "1",
     "description": "CPU-only machine for notebooks, builds and data preparation.",
     "kubevirt_override": {"cpu_guarantee": 4, "mem_guarantee": "16G", **vm_nodes}},
    {"display_name": "GPU workstation: 1x A100 40GB, 8 CPUs, 64 GiB", "slug": "gpu-a100-1", "version": "1",
     "description": "One NVIDIA A100 passed through to the VM (VFIO).",
     "kubevirt_override": {"cpu_guarantee": 8, "mem_guarantee": "64G",
                           "gpus": {"nvidia.com/A100-PCIE-40GB": 1}, **gpu_nodes}},
]

# --- the workstations service (snapshots, restore, reset, keep-alive, the rescue page); it reads
# this same file for the spawner's settings, with the environment named here.
from kubevirt_spawner.service import register  # noqa: E402

# It listens on the hub pod's address: the proxy and the workstations' Lab panels reach it through
# the Service `hub` (which must expose port 10101 beside 8081).
register(c, __file__, pass_env=("POD_NAMESPACE", "CLUSTER_DOMAIN", "GOLDEN_IMAGE", "STORAGE_CLASS"),
         ip="0.0.0.0", host=f"hub.{hub_namespace}.svc.{cluster_domain}")
c.Workstations.snapshot_limit = 20
c.Workstations.keepalive_max_minutes = 240

# --- idle stops: the standard jupyterhub-idle-culler, after an hour without activity, with a
# warning in the Lab ten minutes before (a stop keeps every disk; the next start resumes).
from kubevirt_spawner.service import register_idle_culler  # noqa: E402

register_idle_culler(c, timeout=3600, warn_before=600)

# Last: a bad setting stops the hub here, with a message naming it.
from kubevirt_spawner import KubeVirtSpawner  # noqa: E402

KubeVirtSpawner.validate_config(c)
