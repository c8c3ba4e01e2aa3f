"""The golden image's network on the pod networks KubeVirt's masquerade binding gives a VM, dual-stack
and IPv6-only: the image's networkd configuration (deploy/golden-image/network.network) with no
network data from the VM, the guest answering from both families.

What virt-launcher puts on the pod's side (kubevirt v1.9):
- the VM network 10.0.2.0/24 and fd10:0:2::/120 (pkg/virt-launcher/virtwrap/api/defaults.go),
  the gateway on its first address and the VM on its second (pkg/network/link/address.go,
  GenerateMasqueradeGatewayAndVmIPAddrs);
- a DHCPv4 server when the pod has IPv4 (pkg/network/dhcp/masquerade.go) and, when it has IPv6,
  a single-client DHCPv6 server that answers a Solicit (with rapid commit or without) and every
  other request with one IA_NA address (pkg/network/dhcp/serverv6/serverv6.go). Nothing in
  KubeVirt sends router advertisements: the guest's IPv6 default route is its own;
- inbound traffic DNATed to the VM with its source kept (the hub's pod address, off the VM's
  network), so the guest answers through its default routes.

Here a network namespace plays the pod: a tap device as the bridge's end with the gateway
addresses, dnsmasq as the DHCP servers (the one address each, router advertisements off), the
hub's addresses on the namespace's loopback, off the VM's network. QEMU runs the simulator's
machine (kubevirt_spawner.sim.qemu, SeaBIOS) in the namespace on that tap. The guest's sshd must
answer the hub's addresses over each family the pod has.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import time

import pytest
from guests import BOOT_TIMEOUT

from kubevirt_spawner.sim import qemu

pytestmark = pytest.mark.guests  # one after another on one xdist worker (tests/conftest.py)

GATEWAY4, GUEST4 = "10.0.2.1", "10.0.2.2"
GATEWAY6, GUEST6 = "fd10:0:2::1", "fd10:0:2::2"
HUB4, HUB6 = "10.9.0.7", "fd10:9::7"  # another pod's addresses: off the VM's network
TAP = "tap0"
_names = itertools.count()


def in_namespace(namespace: str, *command: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", "netns", "exec", namespace, *command], capture_output=True, text=True,
                          check=check, timeout=60)


def ssh_banner(namespace: str, source: str, guest: str) -> str:
    """The first line the guest's sshd sends to a connection from `source` ('' when none came)."""
    probe = ("import socket, sys\n"
             "try:\n"
             f"    s = socket.create_connection(({guest!r}, 22), timeout=3, source_address=({source!r}, 0))\n"
             "    s.settimeout(5); print(s.recv(64).decode(errors='replace').strip())\n"
             "except OSError as e:\n"
             "    print('', file=sys.stderr); sys.exit(0)\n")
    return in_namespace(namespace, "python3", "-c", probe, check=False).stdout.strip()


@pytest.fixture
def pod(tmp_path):
    """A network namespace with the tap device the VM's NIC will use (its addresses come once QEMU
    holds the tap: an IPv6 address on a device without carrier stays tentative)."""
    name = f"kvs-pod-{os.getpid()}-{next(_names)}"
    subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
    try:
        for command in (["link", "set", "lo", "up"], ["tuntap", "add", "dev", TAP, "mode", "tap"],
                        ["link", "set", TAP, "up"], ["addr", "add", f"{HUB4}/32", "dev", "lo"],
                        ["addr", "add", f"{HUB6}/128", "dev", "lo"]):
            subprocess.run(["ip", "-n", name, *command], check=True, capture_output=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


@pytest.mark.parametrize("families", [("ipv4", "ipv6"), ("ipv6",)], ids=["dual-stack", "ipv6-only"])
def test_the_guest_takes_its_addresses_from_dhcp_and_answers_the_hub_over_each_family(golden_image, pod, tmp_path,
                                                                                      families):
    console = tmp_path / "console.log"
    machine = qemu.Machine(name="alice-workstation", cpus=2, memory_mib=1024,
                           disks=(qemu.Disk(str(golden_image / "disk.raw"), "rootdisk", boot_order=1),),
                           forwards=(), agent_socket=str(tmp_path / "qga.sock"),
                           monitor_socket=str(tmp_path / "qmp.sock"), console_log=str(console), tap=TAP)
    vm = subprocess.Popen(["ip", "netns", "exec", pod, *qemu.command(machine), "-snapshot"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    dhcp = None
    try:
        deadline = time.monotonic() + 30
        while "NO-CARRIER" in in_namespace(pod, "ip", "link", "show", TAP).stdout:
            assert vm.poll() is None, vm.stderr.read().decode()
            assert time.monotonic() < deadline, "QEMU did not take the tap device"
            time.sleep(0.2)
        ranges = []
        if "ipv4" in families:
            in_namespace(pod, "ip", "addr", "add", f"{GATEWAY4}/24", "dev", TAP)
            ranges += [f"--dhcp-range={GUEST4},{GUEST4},255.255.255.0,infinite", f"--dhcp-option=option:router,{GATEWAY4}"]
        in_namespace(pod, "ip", "addr", "add", f"{GATEWAY6}/120", "dev", TAP, "nodad")
        ranges.append(f"--dhcp-range={GUEST6},{GUEST6},120,infinite")
        log = tmp_path / "dnsmasq.log"
        dhcp = subprocess.Popen(
            ["ip", "netns", "exec", pod, "dnsmasq", "--keep-in-foreground", "--conf-file=/dev/null", "--port=0",
             f"--interface={TAP}", "--bind-interfaces", "--user=root", *ranges,
             "--dhcp-rapid-commit", "--dhcp-authoritative",
             f"--dhcp-leasefile={tmp_path / 'leases'}", "--log-dhcp", f"--log-facility={log}",
             f"--pid-file={tmp_path / 'dnsmasq.pid'}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wanted = {"ipv4": (HUB4, GUEST4), "ipv6": (HUB6, GUEST6)}
        answered: dict[str, str] = {}
        deadline = time.monotonic() + BOOT_TIMEOUT
        while set(answered) != set(families) and time.monotonic() < deadline:
            assert vm.poll() is None, vm.stderr.read().decode()
            assert dhcp.poll() is None, dhcp.stderr.read().decode()
            for family in families:
                if family not in answered and (banner := ssh_banner(pod, *wanted[family])).startswith("SSH-2.0-"):
                    answered[family] = banner
            time.sleep(2)
        tail = console.read_text(errors="replace")[-3000:] if console.exists() else ""
        assert set(answered) == set(families), (answered, tail)
        leases = log.read_text()
        # the addresses came from the pod's DHCP servers (not from router advertisements: none is sent)
        assert f"DHCPREPLY({TAP}) {GUEST6}" in leases, leases[-3000:]
        assert (f"DHCPACK({TAP}) {GUEST4}" in leases) == ("ipv4" in families), leases[-3000:]
    finally:
        for proc in (dhcp, vm):
            if proc is not None:
                proc.kill()
                proc.wait()
