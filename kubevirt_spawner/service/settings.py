"""The workstations service's settings: `c.Workstations.*` in the hub's config (the service loads
the same file). `core.Workstations` is the configurable; its parts read these."""

from __future__ import annotations

from traitlets import Bool, Dict, Float, Integer, List, TraitError, Unicode, default, validate
from traitlets.config import LoggingConfigurable

from .access import SERVER_TOKEN_ACTIONS
from .metering import check_prices


class WorkstationsSettings(LoggingConfigurable):
    """The settings of `core.Workstations` (its section of the config is `c.Workstations`)."""

    snapshot_limit = Integer(20, config=True, help="""
        Most snapshots a user may keep, over all their workstations (safety snapshots included);
        0: no limit. Taking one more is refused with a sentence that says so.""")
    safety_snapshot = Bool(True, config=True, help="""
        Take a snapshot of the current state before every restore and reset.""")
    server_token_actions = List(Unicode(), default_value=["restore", "reset"], config=True, help="""
        What a workstation's own token may do beyond snapshots, stops, keep-alives and activity
        reports: any of "restore", "reset" and "delete-snapshot". That token is the one its server
        holds ($JUPYTERHUB_API_TOKEN), so whoever has a terminal in the workstation can read it:
        every user the server is shared with, and every admin who opens it; the panel acts with
        it. Restores and resets take a safety snapshot first (`safety_snapshot`); deleting a
        snapshot cannot be undone, so by default only the owner's own login does that (the
        workstations page, where the panel's Delete leads). [] keeps all three to the owner.""")
    keepalive_max_minutes = Integer(240, config=True, help="Longest keep-alive a user may ask for.")
    keepalive_interval = Float(60.0, config=True, help="""
        Seconds between the activity reports the service sends the hub while a keep-alive lasts.""")
    operation_timeout = Float(1800.0, config=True, help="Seconds each step of a restore or reset may take.")
    idle_timeout = Integer(0, config=True, help="""
        Seconds without activity after which the hub's idle culler stops a workstation
        (`register_idle_culler()` sets it with the culler's own timeout). 0: no idle stops.""")
    idle_cull_every = Integer(0, config=True, help="""
        Seconds between the culler's checks: a stop comes up to this long after the deadline.""")
    idle_warn_before = Integer(600, config=True, help="""
        Seconds before an idle stop at which the Lab warns, with a "Keep running" button.""")
    drain_grace = Integer(600, config=True, help="""
        Seconds a workstation on a node being drained keeps running after its user is warned (the
        Lab shows the node's reason, the time left and "Stop now"); then it is stopped through the
        hub, its disks kept, and its next start goes to another node. A drain is `kubectl drain`
        (KubeVirt marks the VMI for evacuation: the VMs' evictionStrategy is External) or
        `kubevirt-spawner admin drain NODE`.""")
    drain_check_every = Float(5.0, config=True, help="Seconds between the service's looks for drained nodes.")
    prices = Dict(config=True, help="""
        What workstations cost, for their status, the Lab panel and the admins' reports:
        {"currency": "EUR", "cpu_hour": 0.02, "memory_gib_hour": 0.004, "gpu_hour":
        {"nvidia.com/A100-PCIE-40GB": 1.2}, "disk_gib_month": 0.08, "snapshot_gib_month": 0.05}
        (any may be left out). CPU, memory and GPUs count while a machine runs, disks and snapshots
        always, at their configured size. Empty: the figures are given in those units only.""")
    meter_every = Float(60.0, config=True, help="""
        Seconds between the service's records of what each workstation holds (its machine's, disks'
        and snapshots' lifetimes, kept in the database of ssh_keys_db_url).""")

    @validate("drain_grace", "meter_every", "drain_check_every")
    def _check_seconds(self, proposal):
        name = proposal.trait.name
        least = "0 or more" if name == "drain_grace" else "above 0"  # (a grace may be none; a period not)
        if proposal.value < 0 or (proposal.value == 0 and name != "drain_grace"):
            raise TraitError(f"c.Workstations.{name} must be {least} seconds")
        return proposal.value

    @validate("prices")
    def _check_prices(self, proposal):
        try:
            return check_prices(proposal.value)
        except ValueError as err:
            raise TraitError(str(err)) from None

    ssh_keys_db_url = Unicode(config=True, help="""
        The database that keeps users' SSH public keys (a table kubevirt_spawner_ssh_keys, made on
        first use) and the lifetimes of workstations' machines, disks and snapshots that costs are
        counted from (kubevirt_spawner_lifetimes). Default: the hub's own `c.JupyterHub.db_url`, so
        they live and are backed up with the hub's users.""")

    @default("ssh_keys_db_url")
    def _default_ssh_keys_db_url(self):
        hub = self.config.JupyterHub if "JupyterHub" in self.config else {}
        return hub.get("db_url") or "sqlite:///jupyterhub.sqlite"  # (JupyterHub's own default)

    @validate("server_token_actions")
    def _check_server_token_actions(self, proposal):
        unknown = sorted(set(proposal.value) - set(SERVER_TOKEN_ACTIONS))
        if unknown:
            raise TraitError(f"c.Workstations.server_token_actions: {', '.join(unknown)} is not one of "
                             f"{', '.join(SERVER_TOKEN_ACTIONS)}")
        return proposal.value
