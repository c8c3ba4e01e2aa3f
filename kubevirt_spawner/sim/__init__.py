"""A wire-level simulator of the slice of Kubernetes, KubeVirt and CDI that kubevirt-spawner uses.

For development and tests only: no production module imports it.
"""

from .app import Simulator, SimulatorThread, write_kubeconfig

__all__ = ["Simulator", "SimulatorThread", "write_kubeconfig"]
