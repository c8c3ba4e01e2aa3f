"""The KubeVirt side of the cluster, split the way KubeVirt is: the VirtualMachine controller
(vm_controller.py), the VirtualMachineInstance controller (vmi_controller.py), virt-api's
start/stop/restart (virtapi.py), the node lifecycle (nodes.py), virt-handler and the kubelet
(handler.py), the guest agent (agent.py) and the fault API's facts inside guests (facts.py).
`Compute` builds them around one registry of running guests and is what the rest of the
simulator calls."""

from __future__ import annotations

from .agent import GuestAgent
from .facts import GuestFacts
from .guest_disks import GuestDisks
from .guests import Guest
from .handler import Handler
from .launcher import Launchers
from .machines import QemuGuest
from .nodes import NodeLifecycle
from .virtapi import VirtApi
from .vm_controller import VmController
from .vmi_controller import VmiController


class Compute:
    def __init__(self, cluster):
        # The machines running now, by VMI key: virt-handler's, which the agent and the facts read.
        self.guests: dict[tuple[str, str], Guest | QemuGuest] = {}
        self.launchers = Launchers(cluster)
        self.facts = GuestFacts(cluster, self.guests)
        self.disks = GuestDisks(cluster)
        self.handler = Handler(cluster, self.launchers, self.disks, self.facts, self.guests)
        self.agent = GuestAgent(cluster, self.guests, self.facts, self.disks)
        self.vms = VmController(cluster)
        self.vmis = VmiController(cluster, self.launchers, self.handler, self.agent)
        self.api = VirtApi(cluster.store, self.handler)
        self.nodes = NodeLifecycle(cluster, self.launchers)

        # What the cluster's work queues run
        self.reconcile_vm = self.vms.reconcile
        self.reconcile_vmi = self.vmis.reconcile
        self.reconcile_node = self.nodes.reconcile
        self.reconcile_pod = self.handler.reconcile_pod
        # What the API server's subresources and the fault API call
        self.vm_action = self.api.vm_action
        self.agent_call = self.agent.call
        self.agent_connected = self.agent.connected
        self.node_lost = self.nodes.lost
        self.node_fenced = self.nodes.fenced
        self.node_recovered = self.nodes.recovered
        self.write_guest_facts = self.facts.write
        self.refresh_guest_facts_forever = self.facts.refresh_forever
        # The state they keep, which the fault API reads and sets (the same objects)
        self.agents = self.facts.agents
        self.users = self.facts.users
        self.gpu_utilization = self.facts.gpu_utilization
        self.processes = self.facts.processes
        self.guest_behaviour = self.facts.guest_behaviour
        self.violations = self.handler.violations
        self.shutdowns = self.handler.shutdowns

    async def _shut_down(self, guest: Guest | QemuGuest, vmi: dict):
        """A guest's graceful shutdown, on its own (the tests drive it directly)."""
        await self.handler.shut_down(guest, vmi)
