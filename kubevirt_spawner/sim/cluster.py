"""The simulated cluster: the store, the API server's hooks and every controller, wired together."""

from __future__ import annotations

import asyncio
import base64
import collections
import fcntl
import ipaddress
import json
import logging
import os
import random
import resource
import socket
import tempfile
import time

from ..objects import field_value
from .auth import Authenticator
from .compute import Compute
from .faults import Faults
from .instances import NODE, VM, VMI
from .launcher import POD
from .machines import GoldenImage
from .mutation import default_fields
from .network import SERVICE, Network
from .operators import Operators
from .policies import Policies
from .rbac import ensure_bootstrap_policy
from .resources import BY_KIND
from .restores import RESTORE, Restores
from .runtime import EventRecorder, WorkQueue
from .schema import SchemaRegistry, schema_not_found_message
from .seed import label_virt_handler_nodes, put_cpu_nodes_in_pool, seed_cluster
from .server import RequestCounter
from .snapshots import SNAP, VS, Snapshots
from .storage import DV, PVC, PVC_PROTECTION, Storage, default_storage_class
from .store import Store

log = logging.getLogger(__name__)

NAMESPACE = BY_KIND["Namespace"]

# Seconds each step takes at --speed 1, close to what a real cluster shows.
GUEST_MODES = ("process", "null", "qemu")
DEFAULT_TIMING = {
    "bind": 1.0,             # CSI provisioning of a new RBD image
    "clone_schedule": 2.0,   # DataVolume CloneScheduled -> CloneInProgress
    "clone": 30.0,           # a host-assisted (copy) clone, reported in ten progress steps
    "csi_clone": 3.0,        # a CSI (copy-on-write) clone: no progress reported
    "schedule": 0.5,         # VMI Scheduling -> Scheduled
    "schedule_retry": 2.0,   # how often unschedulable or waiting work is retried
    "launch": 3.0,           # Scheduled -> Running (virt-launcher up, volumes attached)
    "agent": 5.0,            # Running -> AgentConnected (the guest has booted and its agent started)
    "eviction": 300.0,       # pods on an unreachable node are evicted after the default tolerationSeconds
    "heartbeat_timeout": 300.0,  # virt-handler's missed heartbeat before KubeVirt marks its node
    "bookmark": 60.0,        # watch BOOKMARK interval (the API server's watch cache: once a minute)
    "shutdown": 4.0,         # a clean guest shutdown (ACPI) takes this long, bounded by the grace period
    "snapshot": 2.0,
    "restore": 2.0,
}


def _networks(state_dir: str):
    """The loopback ranges of this cluster's VMIs and Services, and the lock that holds them. Each
    state directory draws its pair once (kept in network.json), among the pairs no other simulator
    on this machine holds now (a lock file per pair, held while this one runs): two simulators that
    drew the same pair at random (pytest-xdist's workers run several at once) took each other's
    Service addresses."""
    path = os.path.join(state_dir, "network.json")
    locks = os.path.join(tempfile.gettempdir(), "kubevirt-spawner-sim-networks")
    os.makedirs(locks, exist_ok=True)
    try:
        with open(path) as f:
            octets = json.load(f)
        lock = _hold(locks, octets["vmi"])
        if lock is None:
            log.warning("another simulator on this machine holds the addresses 127.%s.0.0/16 this state "
                        "directory uses: their Services may collide", octets["vmi"])
    except (OSError, ValueError, KeyError):
        picks = list(range(10, 120))
        random.SystemRandom().shuffle(picks)
        lock = None
        for pick in picks:
            lock = _hold(locks, pick)
            if lock is not None:
                break
        else:
            raise RuntimeError("every simulator address range of this machine is in use") from None
        octets = {"vmi": pick, "service": pick + 120}
        with open(path, "w") as f:
            json.dump(octets, f)
    return (ipaddress.ip_network(f"127.{octets['vmi']}.0.0/16"),
            ipaddress.ip_network(f"127.{octets['service']}.0.0/16"), lock)


def _hold(locks: str, pick: int):
    """The open lock file of the address pair `pick`, or None when another process holds it."""
    f = open(os.path.join(locks, f"{pick}.lock"), "a")  # (held open while the cluster runs)
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        return None
    return f


def _free(ip: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((ip, port))
            return True
        except OSError:
            return False


class Cluster:
    def __init__(self, state_dir: str, speed: float = 1.0, schemas_dir: str | None = None,
                 guest_mode: str = "process", guest_command: list[str] | None = None, timing: dict | None = None,
                 golden_image: str | None = None, node_pools: bool = False):
        """`node_pools`: the CPU nodes start in the workstation pool, labelled and tainted as
        deploy/README.md has a platform team do (seed.put_cpu_nodes_in_pool)."""
        if guest_mode not in GUEST_MODES:
            raise ValueError(f"guest mode must be 'process', 'null' or 'qemu', not {guest_mode!r}")
        if guest_mode == "qemu" and not golden_image:
            raise ValueError("qemu guests boot a golden image: give the directory deploy/golden-image/build.sh "
                             "made (--golden-image)")
        # qemu guests: what every machine boots (the golden PVC's disk, the kernel)
        self.golden = GoldenImage.load(golden_image) if guest_mode == "qemu" and golden_image else None
        if speed <= 0:
            raise ValueError("speed must be a positive factor")
        self.state_dir = os.path.abspath(state_dir)
        os.makedirs(self.state_dir, exist_ok=True)
        self.speed = speed
        self.timing = {**DEFAULT_TIMING, **(timing or {})}
        self.guest_mode = guest_mode
        self.node_pools = node_pools
        self.guest_command = guest_command
        self.schemas = SchemaRegistry(schemas_dir)
        self.store = Store(self.state_dir)
        self.fresh = self.store.rv == 0
        self.requests = RequestCounter()
        self.events = EventRecorder(self.store)
        self.faults = Faults(self)
        self.policies = Policies(self.store)
        self.auth = Authenticator(self.store, self.state_dir)
        # What RBAC allowed, by (user, verb, API group, resource[/subresource]): a summary of the
        # API server's audit log, which shows which permissions a client really uses.
        self.authorized: collections.Counter = collections.Counter()
        self.compute = Compute(self)
        self.storage = Storage(self)
        self.snapshots = Snapshots(self)
        self.restores = Restores(self)
        self.network = Network(self)
        self.operators = Operators(self)
        self.started = False
        self._ips: dict[str, dict[str, str]] = {"vmi": {}, "svc": {}}
        self._tasks: list[asyncio.Task] = []
        self._due: dict[tuple, float] = {}
        self.vmi_network, self.service_network, self._network_lock = _networks(self.state_dir)

    def t(self, name: str) -> float:
        return self.timing[name] / self.speed

    def step_due(self, queue: WorkQueue, key, step: str, delay: float | None = None) -> bool:
        """Whether a timed step of `key` is done. The first call starts its clock; until it is due
        the key is requeued for then. Reconciles triggered by other writes meanwhile see False."""
        now = time.monotonic()
        clock = (queue.name, key, step)
        due = self._due.get(clock)
        if due is None:
            due = self._due[clock] = now + (self.t(step) if delay is None else delay)
        if now >= due:
            del self._due[clock]
            return True
        queue.add(key, due - now)
        return False

    def forget_step(self, queue: WorkQueue, key, step: str):
        """Stop the clock of a timed step that no longer applies (a lost node that is back)."""
        self._due.pop((queue.name, key, step), None)

    # ---------- lifecycle
    async def start(self):
        _raise_file_limit()
        if not self.schemas.available:
            log.warning("%s", schema_not_found_message())
        self.vm_queue = WorkQueue("vm", self.compute.reconcile_vm)
        self.vmi_queue = WorkQueue("vmi", self.compute.reconcile_vmi)
        self.pvc_queue = WorkQueue("pvc", self.storage.reconcile_pvc)
        self.dv_queue = WorkQueue("datavolume", self.storage.reconcile_dv)
        self.snapshot_queue = WorkQueue("vmsnapshot", self.snapshots.reconcile_snapshot)
        self.restore_queue = WorkQueue("vmrestore", self.restores.reconcile_restore)
        self.service_queue = WorkQueue("service", self.network.reconcile_service)
        self.node_queue = WorkQueue("node", self.compute.reconcile_node)
        self.pod_queue = WorkQueue("pod", self.compute.reconcile_pod)
        self.queues = [self.vm_queue, self.vmi_queue, self.pvc_queue, self.dv_queue, self.snapshot_queue,
                       self.restore_queue, self.service_queue, self.node_queue, self.pod_queue]
        if self.fresh:
            seed_cluster(self)
        label_virt_handler_nodes(self.store)
        if self.node_pools:
            put_cpu_nodes_in_pool(self.store)
        ensure_bootstrap_policy(self.store)
        for sc in self.store.list(BY_KIND["StorageClass"]):
            self.storage.storage_profile(sc["metadata"]["name"])
        for kv in self.store.list(BY_KIND["KubeVirt"]):
            self.operators.reconcile_kubevirt(kv["metadata"]["namespace"], kv["metadata"]["name"])
        for cdi in self.store.list(BY_KIND["CDI"]):
            self.operators.reconcile_cdi(cdi["metadata"]["name"])
        for vmi in self.store.list(VMI):
            ip = (field_value(vmi, "status.interfaces") or [{}])[0].get("ipAddress")
            if ip and field_value(vmi, "status.phase") not in ("Succeeded", "Failed"):
                self._ips["vmi"][vmi["metadata"]["uid"]] = ip
        for svc in self.store.list(SERVICE):
            ip = field_value(svc, "spec.clusterIP")
            if ip and ip != "None":
                self._ips["svc"][svc["metadata"]["uid"]] = ip
        self.store.listeners.append(self._on_change)
        for q in self.queues:
            q.start()
        self.started = True
        for rt, queue in ((VM, self.vm_queue), (VMI, self.vmi_queue), (PVC, self.pvc_queue), (DV, self.dv_queue),
                          (SNAP, self.snapshot_queue), (RESTORE, self.restore_queue),
                          (SERVICE, self.service_queue), (NODE, self.node_queue), (POD, self.pod_queue)):
            for obj in self.store.list(rt):
                queue.add(_key(obj))
        self._tasks.append(asyncio.get_running_loop().create_task(self.store.flush_forever()))
        self._tasks.append(asyncio.get_running_loop().create_task(self.compute.refresh_guest_facts_forever()))

    async def stop(self):
        # The machines keep running while the simulator is down: nothing that happens to the
        # guest processes during shutdown is written to the cluster.
        self.started = False
        for task in self._tasks:
            task.cancel()
        for q in getattr(self, "queues", []):
            await q.stop()
        shutdowns = list(self.compute.shutdowns)
        for task in shutdowns:
            task.cancel()
        await asyncio.gather(*shutdowns, return_exceptions=True)
        await self.network.close_all()
        guests = list(self.compute.guests.values())
        self.compute.guests.clear()
        await asyncio.gather(*(g.stop(2.0) for g in guests), return_exceptions=True)
        self.store.cut_watches()
        self.store.flush()
        if self._network_lock is not None:  # (the addresses are another simulator's to draw again)
            self._network_lock.close()
            self._network_lock = None

    def _on_change(self, kind, rt, obj, old):
        key = _key(obj)
        ns = obj["metadata"].get("namespace", "")
        if rt is VM:
            self.vm_queue.add(key)
        elif rt is VMI:
            self.vmi_queue.add(key)
            self.vm_queue.add(key)
            for svc in self.store.list(SERVICE, ns):
                self.service_queue.add(_key(svc))
            for snap in self.store.list(SNAP, ns):
                if field_value(snap, "status.phase") not in ("Succeeded", "Failed"):
                    self.snapshot_queue.add(_key(snap))
            for restore in self.store.list(RESTORE, ns):
                if not field_value(restore, "status.complete"):
                    self.restore_queue.add(_key(restore))
            if kind == "DELETED" or field_value(obj, "status.phase") in ("Succeeded", "Failed"):
                for pvc in self.store.list(PVC, ns):
                    if pvc["metadata"].get("deletionTimestamp"):
                        self.pvc_queue.add(_key(pvc))
        elif rt is DV:
            if kind == "DELETED":
                self.storage.broken_clones.discard(key)  # a new disk of that name clones afresh
            self.dv_queue.add(key)
            for vm in self.store.list(VM, ns):
                self.vm_queue.add(_key(vm))
        elif rt is PVC:
            if kind == "DELETED":
                self.storage.pvc_deleted(obj)
            else:
                self.pvc_queue.add(key)
            for ref in obj["metadata"].get("ownerReferences") or []:
                if ref.get("kind") == "DataVolume":
                    self.dv_queue.add((ns, ref["name"]))
            for vmi in self.store.list(VMI, ns):
                if field_value(vmi, "status.phase") in ("Pending", None):
                    self.vmi_queue.add(_key(vmi))
            for dv in self.store.list(DV, None):
                if field_value(dv, "status.phase") in (None, "Pending"):
                    self.dv_queue.add(_key(dv))
        elif rt is SERVICE:
            self.service_queue.add(key)
        elif rt.kind == "PersistentVolume" and kind != "DELETED":
            asyncio.get_running_loop().call_soon(self.storage.reconcile_volume, obj["metadata"]["name"])
        elif rt.kind in ("StorageClass", "StorageProfile"):
            loop = asyncio.get_running_loop()
            if kind != "DELETED":
                # CDI's storage profile controller follows its StorageClass and its own spec.
                loop.call_soon(self.storage.storage_profile, obj["metadata"]["name"])
            if rt.kind == "StorageClass":  # CDI's config lists every class's filesystem overhead
                loop.call_soon(self.operators.reconcile_cdi_config)
        elif rt.kind == "KubeVirt":
            asyncio.get_running_loop().call_soon(self.operators.reconcile_kubevirt, ns, obj["metadata"]["name"])
        elif rt.kind == "CDI":
            asyncio.get_running_loop().call_soon(self.operators.reconcile_cdi, obj["metadata"]["name"])
        elif rt is NODE:
            self.node_queue.add(key)
            for vmi in self.store.list(VMI):
                if field_value(vmi, "status.nodeName") == obj["metadata"]["name"]:
                    self.vmi_queue.add(_key(vmi))
        elif rt is POD:
            self.pod_queue.add(key)
            for ref in obj["metadata"].get("ownerReferences") or []:
                if ref.get("kind") == "VirtualMachineInstance":
                    self.vmi_queue.add((ns, ref["name"]))
        elif rt is SNAP:
            self.snapshot_queue.add(key)
        elif rt is RESTORE:
            self.restore_queue.add(key)
        elif rt is VS and kind == "DELETED":
            self.snapshots.volume_snapshot_deleted(obj)

    # ---------- API server hooks
    def defaults(self, rt, obj: dict):
        """What the API server's registries fill in on create (PrepareForCreate, allocations) and
        its DefaultStorageClass admission plugin; the scheme's defaults of every write are
        mutation.default_fields."""
        default_fields(rt.kind, obj)
        if rt is NAMESPACE:
            obj.setdefault("spec", {"finalizers": ["kubernetes"]})  # pkg/registry/core/namespace/strategy.go
            obj["status"] = {"phase": "Active"}
        elif rt is SERVICE:
            spec = obj.setdefault("spec", {})
            if not spec.get("clusterIP"):
                spec["clusterIP"] = self._next_ip("svc")
            if spec["clusterIP"] != "None":
                spec["clusterIPs"] = [spec["clusterIP"]]
        elif rt is PVC:
            spec = obj.setdefault("spec", {})
            if spec.get("storageClassName") is None:
                sc = default_storage_class(self.store)
                if sc is not None:
                    spec["storageClassName"] = sc["metadata"]["name"]
            obj["metadata"].setdefault("finalizers", [])
            if PVC_PROTECTION not in obj["metadata"]["finalizers"]:
                obj["metadata"]["finalizers"].append(PVC_PROTECTION)
            obj["status"] = {"phase": "Pending"}
        elif rt is VM:
            obj["status"] = {}
        elif rt is DV:
            obj.setdefault("status", {})

    def before_delete(self, rt, obj: dict, grace: int | None):
        if rt is VMI and grace is not None:
            guest = self.compute.guests.get(_key(obj))
            if guest is not None:
                guest.hurry(grace)
        if rt is NAMESPACE:
            name = obj["metadata"]["name"]
            for other in BY_KIND.values():
                if other.namespaced:
                    for child in list(self.store.list(other, name)):
                        self.store.delete(other, name, child["metadata"]["name"])

    def vm_action(self, ns, name, action, body):
        return self.compute.vm_action(ns, name, action, body)

    def agent_call(self, ns, name, call):
        return self.compute.agent_call(ns, name, call)

    # ---------- helpers for controllers
    def owner_ref(self, obj: dict) -> dict:
        return {"apiVersion": obj["apiVersion"], "kind": obj["kind"], "name": obj["metadata"]["name"],
                "uid": obj["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}

    def volume_dir(self, pvc: dict) -> str | None:
        volume = field_value(pvc, "spec.volumeName")
        return os.path.join(self.state_dir, "volumes", volume) if volume else None

    def secret_data(self, secret: dict) -> dict[str, str]:
        out = {}
        for k, v in (secret.get("data") or {}).items():
            try:
                out[k] = base64.b64decode(v).decode()
            except (ValueError, UnicodeDecodeError):
                continue
        out.update(secret.get("stringData") or {})
        return out

    def allocate_ip(self, pool: str, uid: str) -> str:
        if uid not in self._ips[pool]:
            self._ips[pool][uid] = self._next_ip(pool)
        return self._ips[pool][uid]

    def release_ip(self, pool: str, uid: str):
        self._ips[pool].pop(uid, None)

    def _next_ip(self, pool: str) -> str:
        network = self.vmi_network if pool == "vmi" else self.service_network
        used = set(self._ips[pool].values())
        if pool == "svc":
            used |= {field_value(s, "spec.clusterIP") for s in self.store.list(SERVICE)}
        for host in network.hosts():
            ip = str(host)
            if ip.endswith(".0") or ip.endswith(".1") or ip in used:
                continue
            if pool == "vmi" and not _free(ip, 8888):
                continue  # someone else (another simulator's guest) holds it
            return ip
        raise RuntimeError(f"the simulator ran out of {pool} addresses")


def _key(obj: dict) -> tuple[str, str]:
    return (obj["metadata"].get("namespace", ""), obj["metadata"]["name"])


def _raise_file_limit():
    """Hundreds of guests and service listeners need more than the default 1024 descriptors."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass
