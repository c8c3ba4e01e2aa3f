"""kubevirt-spawner's part of a production hub config: the spawner, what a user's namespace gets,
the profiles, the workstations service and the idle culler. The hub and proxy settings (database,
cookie secret, proxy API, authenticator) are the site's: Zero-to-JupyterHub's chart sets them, or
hub-config/jupyterhub_config.py for a hub run by hand.

It is *executed against the hub's own config* (`c`), so it adds to the services and roles already
there instead of replacing them (traitlets' load_subconfig would merge a fresh config over them):

    path = "/usr/local/etc/jupyterhub/kubevirt_spawner_config.py"
    exec(compile(open(path).read(), path, "exec"), {"c": c, "__file__": path, "get_config": lambda: c})

The workstations service loads the hub's whole config (the file JupyterHub is started with, which
runs this one), so settings made elsewhere (the chart's `hub.config`, a later `hub.extraConfig`
snippet) reach the spawner and the service alike.

Environment it reads (deploy/jupyterhub/values.yaml passes deploy/settings.env's values as hub.extraEnv):

  POD_NAMESPACE          the hub pod's namespace (Zero-to-JupyterHub sets it from the downward
                         API; the Service `hub` there is how guests reach the hub)
  CLUSTER_DOMAIN         the cluster's DNS domain (default cluster.local)
  GOLDEN_IMAGE           golden image PVC as namespace/name (default vm-images/ubuntu-24-04-cuda-golden)
  GOLDEN_IMAGE_FIRMWARE  the firmware its bootloader is built for and the VMs boot with: bios or efi
                         (default bios)
  STORAGE_CLASS          RBD StorageClass (default ceph-rbd)
  USER_NAMESPACE_PREFIX  users' namespaces are PREFIX + user name (default notebook-)
  KUBEVIRT_NODE_LABEL    the VM node pool's label, "true" on its nodes, and its taint's key
                         (default workload.example.com/kubevirt; deploy/host/label-nodes.sh sets both)
  ACCELERATOR_LABEL      "vfio" on the pool's GPU passthrough nodes (default accelerator.example.com/mode)
  GPU_DEVICES            the GPUs KubeVirt passes through, space-separated VENDOR:DEVICE=RESOURCE_NAME
                         (default 10DE:20B0=nvidia.com/A100-PCIE-40GB): one GPU profile per resource
  SUBDOMAIN_HOST         the hub's public URL (https://jupyter.example.org), whose subdomains are the
                         users' (c.JupyterHub.subdomain_host, when the site does not set it itself):
                         without it the hub refuses to start (KubeVirtSpawner.allow_shared_origin)
"""

import os
import re

c = get_config()  # noqa: F821 (provided by JupyterHub, or the exec above)
# What the site set before this file runs (Zero-to-JupyterHub applies hub.config first): it wins
# over the values below, which are this project's defaults, and is put back before the service is
# registered.
site_settings = {section: dict(c[section]) for section in ("KubeVirtSpawner", "Workstations") if section in c}
hub_namespace = os.environ.get("POD_NAMESPACE", "jupyterhub")
cluster_domain = os.environ.get("CLUSTER_DOMAIN", "cluster.local")
node_label = os.environ.get("KUBEVIRT_NODE_LABEL", "workload.example.com/kubevirt")
accelerator_label = os.environ.get("ACCELERATOR_LABEL", "accelerator.example.com/mode")
gpu_resources = [device.split("=", 1)[1] for device in
                 os.environ.get("GPU_DEVICES", "10DE:20B0=nvidia.com/A100-PCIE-40GB").split() if "=" in device]

# Guests live in other namespaces: they reach the hub by the Service's full DNS name (the chart's
# own hub_connect_url, http://hub:8081, resolves only in the hub's namespace).
c.JupyterHub.hub_connect_url = f"http://hub.{hub_namespace}.svc.{cluster_domain}:8081"
c.JupyterHub.cleanup_servers = False  # workstations keep running across hub restarts and upgrades
# Activity is what the workstation's server reports (API use, kernels, terminals), not any traffic
# through the proxy: an open tab's polling (the Workstation panel's included) would keep it "active".
c.JupyterHub.last_activity_interval = 0

# Users are root in their workstations and serve what they like under /user/NAME/: each user's
# pages get an origin of their own (NAME.jupyter.example.org), never the hub's, and the hub's
# cookies the __Host- prefix, which a user's subdomain cannot set (cookie tossing).
# KubeVirtSpawner.validate_config, last below, refuses a hub without it.
if not c.JupyterHub.get("subdomain_host") and os.environ.get("SUBDOMAIN_HOST"):
    c.JupyterHub.subdomain_host = os.environ["SUBDOMAIN_HOST"]
if c.JupyterHub.get("subdomain_host") and "cookie_host_prefix_enabled" not in c.JupyterHub:
    c.JupyterHub.cookie_host_prefix_enabled = True

# --- the spawner
c.JupyterHub.spawner_class = "kubevirt"
c.KubeVirtSpawner.kubeconfig = None  # in-cluster ServiceAccount
c.KubeVirtSpawner.url_mode = "dns"
c.KubeVirtSpawner.cluster_domain = cluster_domain
c.KubeVirtSpawner.namespace_template = os.environ.get("USER_NAMESPACE_PREFIX", "notebook-") + "{user}"
c.KubeVirtSpawner.golden_image = os.environ.get("GOLDEN_IMAGE", "vm-images/ubuntu-24-04-cuda-golden")
c.KubeVirtSpawner.firmware = os.environ.get("GOLDEN_IMAGE_FIRMWARE", "bios")
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
# what one user may hold in all (three servers at most, hub.namedServerLimitPerUser).
c.KubeVirtSpawner.network_policy_ingress_from = [
    {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": hub_namespace}},
     "podSelector": {"matchLabels": {"app": "jupyterhub"},
                     "matchExpressions": [{"key": "component", "operator": "In", "values": ["hub", "proxy"]}]}},
]
# Storage: per workstation (three at most) its system and workspace disks, and while its system disk
# is cloned (a first start, a reset) CDI's temporary copy of it in the same namespace (the prime
# claim of CDI's clone populator): 3 x (150 + 100 + 150) Gi; claims, with room: 3 x 3 at least.
c.KubeVirtSpawner.namespace_resource_quota = {
    "requests.cpu": "24", "requests.memory": "160Gi", "requests.storage": "1200Gi", "persistentvolumeclaims": "12",
    **{f"requests.{resource}": "1" for resource in gpu_resources},
}
c.KubeVirtSpawner.namespace_limit_range = [{"type": "PersistentVolumeClaim", "max": {"storage": "500Gi"}}]

# On the pool's nodes only, which label-nodes.sh taints so nothing else lands there.
vm_nodes = {
    "node_selector": {node_label: "true"},
    "tolerations": [{"key": node_label, "operator": "Equal", "value": "true", "effect": "NoSchedule"}],
}
gpu_nodes = {**vm_nodes, "node_selector": {node_label: "true", accelerator_label: "vfio"}}
# A CPU workstation keeps off the GPU nodes (label-nodes.sh gives vm-cpu nodes no accelerator mode):
# otherwise the scheduler favours their many free CPUs and the GPUs wait behind it.
cpu_nodes = {**vm_nodes, "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
    "nodeSelectorTerms": [{"matchExpressions": [{"key": accelerator_label, "operator": "DoesNotExist"}]}]}}}}
c.KubeVirtSpawner.profile_list = [
    {"display_name": "Workstation: 4 CPUs, 16 GiB", "slug": "cpu-4", "default": True, "version": "1",
     "description": "CPU-only machine for notebooks, builds and data preparation.",
     "kubevirt_override": {"cpu_guarantee": 4, "mem_guarantee": "16G", **cpu_nodes}},
    *({"display_name": f"GPU workstation: 1x {resource.rsplit('/', 1)[-1]}, 8 CPUs, 64 GiB",
       "slug": "gpu-" + re.sub(r"[^a-z0-9]+", "-", resource.rsplit("/", 1)[-1].lower()).strip("-") + "-1",
       "version": "1", "description": "One GPU passed through to the VM (VFIO).",
       "kubevirt_override": {"cpu_guarantee": 8, "mem_guarantee": "64G", "gpus": {resource: 1}, **gpu_nodes}}
      for resource in gpu_resources),
]

c.KubeVirtSpawner.update(site_settings.get("KubeVirtSpawner", {}))

# --- the workstations service (snapshots, restore, reset, keep-alive, the rescue page); it loads
# the hub's whole config, as the hub does, for the spawner's settings.
from kubevirt_spawner.service import register  # noqa: E402

# It listens on the hub pod's address: the proxy and the workstations' Lab panels reach it through
# the Service `hub` (which must expose port 10101 beside 8081).
register(c, ip="0.0.0.0", host=f"hub.{hub_namespace}.svc.{cluster_domain}")
c.Workstations.snapshot_limit = 20
c.Workstations.keepalive_max_minutes = 240
c.Workstations.update(site_settings.get("Workstations", {}))

# --- idle stops: the standard jupyterhub-idle-culler, after an hour without activity, with a
# warning in the Lab ten minutes before (a stop keeps every disk; the next start resumes).
from kubevirt_spawner.service import register_idle_culler  # noqa: E402

register_idle_culler(c, timeout=3600, warn_before=600)

# Last: a bad setting stops the hub here, with a message naming it.
from kubevirt_spawner import KubeVirtSpawner  # noqa: E402

KubeVirtSpawner.validate_config(c)
