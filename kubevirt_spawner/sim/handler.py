"""The node's side of a VMI: virt-handler (pkg/virt-handler/vm.go) and virt-launcher start its
machine once the pod is placed, report it Running, shut it down gracefully when it is deleted,
and record how it ended; the kubelet stops a launcher pod being deleted. The machines running
now are the `guests` registry, by VMI key."""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import shutil

from ..objects import field_value
from .attachdetach import attachments, sync_volume_attachments
from .conditions import condition, set_condition
from .facts import GuestFacts
from .guest_disks import GuestDisks
from .guests import (
    Guest,
    boot_problem,
    clear_runtime,
    extra_disk_mounts,
    first_boot,
    guest_arguments,
    guest_environment,
    shared_data_mounts,
)
from .instances import DEFAULT_GRACE_SECONDS, NODE, PVC, VMI, claim_names, set_phase, write_vmi_status
from .launcher import POD, Launchers
from .machines import QemuGuest, file_servers, machine_accelerator, new_machine, workdir_for
from .scheduler import node_ready
from .timeutil import now_iso

log = logging.getLogger(__name__)


class Handler:
    def __init__(self, cluster, launchers: Launchers, disks: GuestDisks, facts: GuestFacts,
                 guests: dict[tuple[str, str], Guest | QemuGuest]):
        self.c = cluster
        self.store = cluster.store
        self.launchers = launchers
        self.disks = disks
        self.facts = facts
        self.guests = guests
        self.violations: list[dict] = []  # two machines that held one ReadWriteOnce claim at once
        self.stopping: set[tuple[str, str]] = set()
        self.booting: set[tuple[str, str]] = set()  # QEMU machines being set up (their disks made)
        self.shutdowns: set[asyncio.Task] = set()  # guests shutting down, each on its own time

    # ================= boot
    async def boot(self, vmi: dict, pod: dict):
        """The launcher pod is placed and its volumes attached: the VMI runs, and its machine starts."""
        ns, name = vmi["metadata"]["namespace"], vmi["metadata"]["name"]
        key = (ns, name)
        for vol, claim in claim_names(vmi.get("spec") or {}):
            modes = field_value(self.store.get(PVC, ns, claim), "spec.accessModes") or []
            if "ReadWriteMany" in modes or "ReadOnlyMany" in modes:
                continue  # (shared data: many machines at once is what it is for)
            for other in attachments(self.store, ns, claim, vmi["metadata"]["uid"]):
                self.violations.append({"time": now_iso(), "namespace": ns, "claim": claim, "volume": vol,
                                        "vmis": [other["metadata"]["name"], name],
                                        "nodes": [field_value(other, "status.nodeName"),
                                                  field_value(vmi, "status.nodeName")]})
        ip = self.c.allocate_ip("vmi", vmi["metadata"]["uid"])
        self.launchers.running(pod, ip)
        root = self.disks.root_dir(vmi)
        status = copy.deepcopy(vmi["status"])
        set_phase(status, "Running")
        status["interfaces"] = [{"name": "default", "ipAddress": ip, "ipAddresses": [ip], "mac": _mac(ip),
                                 "infoSource": "domain, guest-agent", "interfaceName": "enp1s0",
                                 "podInterfaceName": "eth0", "queueCount": 1}]
        status["guestOSInfo"] = {}
        status["launcherContainerImageVersion"] = "quay.io/kubevirt/virt-launcher:v1.9.0"
        status["volumeStatus"] = [{"name": vol, "target": f"vd{chr(97 + i)}",
                                   **({"persistentVolumeClaimInfo": {"claimName": claim}} if claim else {})}
                                  for i, (vol, claim) in enumerate(claim_names(vmi.get("spec") or {}))]
        set_condition(status, condition("Ready", "True"))
        set_condition(status, condition("LiveMigratable", "False", "DisksNotLiveMigratable",
                                        "cannot migrate VMI: PVC is not shared, live migration requires that all "
                                        "PVCs must be shared (using ReadWriteMany access mode)"))
        write_vmi_status(self.store, vmi, status)
        sync_volume_attachments(self.store)  # (its disks are attached to its node)
        self.c.events.record(vmi, "Normal", "Started", "VirtualMachineInstance started.", "virt-handler")
        if root is not None and self.c.guest_mode == "qemu":
            if key not in self.booting:
                self.booting.add(key)
                await self._boot_machine(vmi, ip)
        elif root is not None:
            first_boot(root)
            self.disks.mount_workspace(vmi, root)
            self.disks.mount_scratch(vmi, root)
            await self._start_guest(vmi, ip, root)
        self.c.vmi_queue.add(key, self.c.t("agent"))

    def revive(self, vmi: dict):
        """The simulator restarted under a running VMI, whose machine went with it: it boots again."""
        ns, name = vmi["metadata"]["namespace"], vmi["metadata"]["name"]
        if (ns, name) not in self.guests and self.c.started and self.c.guest_mode == "qemu":
            if (ns, name) not in self.booting:
                self.booting.add((ns, name))
                ip = field_value(vmi, "status.interfaces")[0]["ipAddress"]
                asyncio.get_running_loop().create_task(self._boot_machine(vmi, ip))
        elif (ns, name) not in self.guests and self.c.started:
            root = self.disks.root_dir(vmi)
            if root is not None and boot_problem(root) is None:
                guest = self._register_guest(vmi, field_value(vmi, "status.interfaces")[0]["ipAddress"], root)
                asyncio.get_running_loop().create_task(self._launch(guest))

    async def _start_guest(self, vmi: dict, ip: str, root: str):
        problem = boot_problem(root)
        if problem:  # the VMI runs (QEMU does) while the guest sits in its emergency shell
            log.info("%s/%s does not boot: %s", vmi["metadata"]["namespace"], vmi["metadata"]["name"], problem)
            return
        await self._launch(self._register_guest(vmi, ip, root))

    def _register_guest(self, vmi: dict, ip: str, root: str) -> Guest:
        """The guest is known before its process starts, so a second reconcile does not start it twice."""
        key = (vmi["metadata"]["namespace"], vmi["metadata"]["name"])
        old = self.guests.pop(key, None)
        if old is not None:
            old.kill()
        datas = self.disks.secret_datas(vmi)
        guest = Guest(key, ip, root, guest_environment(datas), guest_arguments(datas),
                      os.path.join(self.c.state_dir, "guests", f"{key[0]}_{key[1]}.log"), self.c.guest_command)
        guest.uid = vmi["metadata"]["uid"]
        guest.mounts = extra_disk_mounts(guest.env, self.disks.extra_disk_dirs(vmi), root) + shared_data_mounts(
            guest.env, self.disks.shared_dirs(vmi), root)
        self.guests[key] = guest
        clear_runtime(root)  # a boot: nothing of the last one's memory is there
        self.facts.write(key)
        return guest

    async def _boot_machine(self, vmi: dict, ip: str):
        """Set the machine up and start it; the VMI's key is in `booting` meanwhile, so another
        reconcile does not start a second machine on the same disks."""
        key = (vmi["metadata"]["namespace"], vmi["metadata"]["name"])
        try:
            guest = await self._register_machine(vmi, ip)
        except Exception as exc:  # (ISO tools, disk images, the accelerator probe: any of them)
            log.error("%s/%s: its machine could not be set up: %s", *key, exc)
            self.c.events.record(vmi, "Warning", "SyncFailed", f"the domain could not be defined: {exc}",
                                 "virt-handler")
            return
        finally:
            self.booting.discard(key)
        current = self.store.get(VMI, *key)
        if current is None or current["metadata"]["uid"] != guest.uid or current["metadata"].get("deletionTimestamp"):
            self.powered_off(guest)  # stopped while its disks were set up
            return
        await self._launch(guest)

    async def _register_machine(self, vmi: dict, ip: str) -> QemuGuest:
        """A QEMU machine for the VMI, with its disks and configuration disks as virt-launcher
        attaches them; known before it starts, so a second reconcile does not start it twice."""
        key = (vmi["metadata"]["namespace"], vmi["metadata"]["name"])
        old = self.guests.pop(key, None)
        if old is not None:
            old.kill()
        workdir = workdir_for(key)
        try:
            disks = await asyncio.get_running_loop().run_in_executor(None, self.disks.machine_disks, vmi, workdir)
        except (OSError, RuntimeError):
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        if self.guests.get(key) is not None:  # (a stop, or the node lost, meanwhile: nothing to boot)
            shutil.rmtree(workdir, ignore_errors=True)
            raise RuntimeError("a machine runs already")
        console = os.path.join(self.c.state_dir, "guests", f"{key[0]}_{key[1]}.console.log")
        accel = await asyncio.get_running_loop().run_in_executor(None, machine_accelerator, self.c.golden.probe_kernel)
        try:
            shares, servers = file_servers(self.disks.shared_dirs(vmi), workdir)
            machine = new_machine(key[1], vmi.get("spec") or {}, disks, ip, workdir, console, accel, shares)
        except (OSError, RuntimeError):
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        guest = QemuGuest(key, machine, workdir, os.path.join(self.c.state_dir, "guests", f"{key[0]}_{key[1]}.log"),
                          on_agent_change=lambda: self.c.vmi_queue.add(key), file_servers=servers)
        guest.uid = vmi["metadata"]["uid"]
        self.guests[key] = guest
        return guest

    async def _launch(self, guest: Guest | QemuGuest):
        key = guest.key
        try:
            if isinstance(guest, QemuGuest):
                await guest.start()
                if self.guests.get(key) is not guest:  # stopped while QEMU was starting
                    guest.kill()
                    return
            elif self.c.guest_mode == "null":
                await guest.start_null()
            else:
                await guest.start_process()
        except (OSError, ValueError, RuntimeError) as exc:  # (RuntimeError: a virtiofsd that did not listen)
            log.error("guest %s/%s could not start: %s", *key, exc)
            self._guest_exited(guest, 1)
            return
        asyncio.get_running_loop().create_task(self._watch_guest(guest))

    async def _watch_guest(self, guest: Guest | QemuGuest):
        code = await guest.wait()
        self._guest_exited(guest, code)

    def _guest_exited(self, guest: Guest | QemuGuest, code: int):
        ns, name = guest.key
        if isinstance(guest, QemuGuest):
            log.info("%s/%s: QEMU ended (%s)", ns, name, code)
        self.powered_off(guest)
        if guest.key in self.stopping or not self.c.started:
            return  # a requested shutdown (the VMI controller finishes the VMI) or the simulator stopping
        vmi = self.store.get(VMI, ns, name)
        if vmi is None or vmi["metadata"]["uid"] != guest.uid or field_value(vmi, "status.phase") != "Running":
            return
        status = copy.deepcopy(vmi["status"])
        set_phase(status, "Succeeded" if code == 0 else "Failed")
        set_condition(status, condition("Ready", "False", "PodTerminating" if code == 0 else "PodFailed"))
        write_vmi_status(self.store, vmi, status)
        self.c.events.record(vmi, "Normal" if code == 0 else "Warning", "Stopped" if code == 0 else "Failed",
                             "The VirtualMachineInstance was shut down." if code == 0 else
                             f"The VirtualMachineInstance crashed (guest exited with {code}).", "virt-handler")

    # ================= power off and shutdown
    def powered_off(self, guest: Guest | QemuGuest):
        """The machine is off: its guest is let go, and what it kept in memory (/run, /dev, /proc)
        is gone; not when a newer boot of the VMI has taken its place meanwhile."""
        if isinstance(guest, QemuGuest):
            guest.discard()  # (its configuration disks hold the hub's token)
        if self.guests.get(guest.key) is guest:
            del self.guests[guest.key]
            if guest.root:
                clear_runtime(guest.root)

    def pull_plug(self, key: tuple[str, str]):
        """The launcher pod is gone: its machine is powered off with it."""
        guest = self.guests.get(key)
        if guest is not None:
            self.stopping.add(key)
            self.powered_off(guest)
            guest.kill()
            self.stopping.discard(key)

    def hurry(self, vmi: dict, grace: int):
        """A shorter grace period for the guest, should it be shutting down."""
        g = self.guests.get((vmi["metadata"]["namespace"], vmi["metadata"]["name"]))
        if g is not None:
            g.hurry(grace)

    def begin_shutdown(self, guest: Guest | QemuGuest, vmi: dict):
        """The guest shuts down on its own time (each virt-handler drives its VMIs in parallel);
        its key is in `stopping` until it is off, and the VMI is requeued then."""
        self.stopping.add(guest.key)
        task = asyncio.get_running_loop().create_task(self._shut_down_then_finish(guest, vmi))
        self.shutdowns.add(task)
        task.add_done_callback(self.shutdowns.discard)

    async def _shut_down_then_finish(self, guest: Guest | QemuGuest, vmi: dict):
        key = guest.key
        try:
            await self.shut_down(guest, vmi)
        finally:
            self.stopping.discard(key)
            self.powered_off(guest)
            self.c.vmi_queue.add(key)

    async def shut_down(self, guest: Guest | QemuGuest, vmi: dict):
        """An ACPI shutdown as virt-handler drives it (pkg/virt-handler/vm.go): the guest takes its
        shutdown time; once the grace period is over (a stop may shorten it meanwhile) it is
        powered off."""
        began = asyncio.get_running_loop().time()
        shutdown = self.facts.guest_seconds(guest.key, "shutdown") or 0.0
        if isinstance(guest, QemuGuest):  # the guest really shuts down: until QEMU ends, at most the grace period
            await guest.request_shutdown()
            shutdown = float("inf")

        def grace() -> float:
            value = guest.grace_override
            if value is None:
                value = vmi["metadata"].get("deletionGracePeriodSeconds")
            if value is None:
                value = field_value(vmi, "spec.terminationGracePeriodSeconds")
            return float(DEFAULT_GRACE_SECONDS if value is None else value)

        ended = asyncio.ensure_future(guest.exited()) if isinstance(guest, QemuGuest) else None
        try:
            while ended is None or not ended.done():
                remaining = began + min(shutdown, grace()) - asyncio.get_running_loop().time()
                if remaining <= 0:
                    break
                guest.hurried.clear()
                hurried = asyncio.ensure_future(guest.hurried.wait())
                done, _ = await asyncio.wait({hurried, *([ended] if ended else [])}, timeout=remaining,
                                             return_when=asyncio.FIRST_COMPLETED)
                hurried.cancel()
                if not done:
                    break
        finally:
            if ended is not None:
                ended.cancel()
        left = began + grace() - asyncio.get_running_loop().time()
        await guest.stop(max(left, 0.0))

    # ================= the kubelet
    async def reconcile_pod(self, key):
        """The kubelet, for launcher pods being deleted on a node that answers: the container is
        stopped (virt-launcher shuts the guest down) and the pod goes."""
        pod = self.store.get(POD, *key)
        if pod is None or not pod["metadata"].get("deletionTimestamp"):
            return
        node = self.store.get(NODE, "", field_value(pod, "spec.nodeName") or "")
        if node is None or not node_ready(node):
            return
        owner = next((r for r in pod["metadata"].get("ownerReferences") or [] if r.get("kind") == "VirtualMachineInstance"),
                     None)
        vm_key = (key[0], owner["name"]) if owner else None
        guest = self.guests.get(vm_key) if vm_key else None
        if guest is not None and guest.uid == (owner or {}).get("uid"):
            self.stopping.add(guest.key)
            try:
                grace = pod["metadata"].get("deletionGracePeriodSeconds")
                await guest.stop(float(DEFAULT_GRACE_SECONDS if grace is None else grace))
            finally:
                self.stopping.discard(guest.key)
                self.guests.pop(guest.key, None)
        self.launchers.remove(pod)


def _mac(ip: str) -> str:
    parts = [int(p) for p in ip.split(".")]
    return "02:00:%02x:%02x:%02x:%02x" % tuple(parts)
