"""kubevirt-spawner: persistent KubeVirt workstation VMs for JupyterHub users."""

__version__ = "0.1.0"
