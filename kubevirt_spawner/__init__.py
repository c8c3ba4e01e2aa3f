"""kubevirt-spawner: persistent KubeVirt workstation VMs for JupyterHub users."""

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy, so `kubevirt-spawner sim` does not import JupyterHub.
    if name == "KubeVirtSpawner":
        from .spawner import KubeVirtSpawner
        return KubeVirtSpawner
    raise AttributeError(name)
