"""The storage side: PVC binding and expansion (the Ceph RBD CSI driver), and CDI's DataVolume
controller (clones between PVCs, blank disks)."""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import shutil

from ..objects import field_value
from ..quantity import parse_quantity
from . import errors
from .admission import admit
from .attachdetach import attachments
from .conditions import condition, set_condition
from .guests import not_on_disk
from .instances import VMI, claim_names
from .qemu import sparse_copy
from .resources import BY_KIND

log = logging.getLogger(__name__)

PVC = BY_KIND["PersistentVolumeClaim"]
PV = BY_KIND["PersistentVolume"]
DV = BY_KIND["DataVolume"]
SC = BY_KIND["StorageClass"]
PVC_PROTECTION = "kubernetes.io/pvc-protection"
PRE_POPULATED = "cdi.kubevirt.io/storage.prePopulated"
POPULATED_FOR = "cdi.kubevirt.io/storage.populatedFor"
PROFILE = BY_KIND["StorageProfile"]
VSCLASS = BY_KIND["VolumeSnapshotClass"]
# What CDI knows of provisioners (pkg/storagecapabilities/storagecapabilities.go): Ceph RBD.
RBD_CAPABILITIES = {"claimPropertySets": [{"accessModes": ["ReadWriteMany"], "volumeMode": "Block"},
                                          {"accessModes": ["ReadWriteOnce"], "volumeMode": "Block"},
                                          {"accessModes": ["ReadWriteOnce"], "volumeMode": "Filesystem"}],
                    "cloneStrategy": "csi-clone"}
KNOWN_PROVISIONERS = {"rbd.csi.ceph.com": RBD_CAPABILITIES}
PROGRESS_NA = "N/A"
# The DataVolume phase while a clone runs, by strategy (CDI's populator phase map).
CLONE_PHASES = {"csi-clone": "CSICloneInProgress", "snapshot": "SnapshotForSmartCloneInProgress",
                "copy": "CloneInProgress"}


def default_storage_class(store) -> dict | None:
    for sc in store.list(SC):
        if (sc["metadata"].get("annotations") or {}).get("storageclass.kubernetes.io/is-default-class") == "true":
            return sc
    return None


class Storage:
    def __init__(self, cluster):
        self.c = cluster
        self.store = cluster.store
        self.broken_clones: set[tuple[str, str]] = set()  # DataVolumes whose clone cannot proceed

    # ================= CDI StorageProfiles
    def storage_profile(self, sc_name: str) -> dict | None:
        """The StorageProfile CDI keeps for a StorageClass (pkg/controller/storageprofile-controller.go),
        created on first need. The clone strategy: spec.cloneStrategy, else the class's
        cdi.kubevirt.io/clone-strategy annotation, else what CDI knows of the provisioner, else
        snapshot when the driver has a VolumeSnapshotClass, else copy."""
        sc = self.store.get(SC, "", sc_name)
        if sc is None:
            return None
        profile = self.store.get(PROFILE, "", sc_name)
        if profile is None:
            profile = self.store.create(PROFILE, {"apiVersion": "cdi.kubevirt.io/v1beta1", "kind": "StorageProfile",
                                                  "metadata": {"name": sc_name, "ownerReferences": [
                                                      self.c.owner_ref(sc)]}, "spec": {}})
        provisioner = sc.get("provisioner", "")
        known = KNOWN_PROVISIONERS.get(provisioner, {})
        snapshot_class = next((v["metadata"]["name"] for v in self.store.list(VSCLASS) if v.get("driver") == provisioner),
                              None)
        strategy = (field_value(profile, "spec.cloneStrategy")
                    or (sc["metadata"].get("annotations") or {}).get("cdi.kubevirt.io/clone-strategy")
                    or known.get("cloneStrategy") or ("snapshot" if snapshot_class else "copy"))
        status = {"storageClass": sc_name, "provisioner": provisioner, "cloneStrategy": strategy,
                  "claimPropertySets": field_value(profile, "spec.claimPropertySets")
                  or copy.deepcopy(known.get("claimPropertySets") or [])}
        if snapshot_class:
            status["snapshotClass"] = snapshot_class
        if profile.get("status") != status:
            new = copy.deepcopy(profile)
            new["status"] = status
            profile = self.store.update(PROFILE, new, subresource="status", check_rv=False)
        return profile

    # ================= PersistentVolumeClaims
    async def reconcile_pvc(self, key):
        ns, name = key
        pvc = self.store.get(PVC, ns, name)
        if pvc is None:
            return
        meta = pvc["metadata"]
        if meta.get("deletionTimestamp"):
            if PVC_PROTECTION in (meta.get("finalizers") or []) and not attachments(self.store, ns, name):
                new = copy.deepcopy(pvc)
                new["metadata"]["finalizers"] = [f for f in meta["finalizers"] if f != PVC_PROTECTION]
                self.store.update(PVC, new, check_rv=False)
            return
        phase = field_value(pvc, "status.phase")
        if phase != "Bound":
            sc_name = field_value(pvc, "spec.storageClassName")
            sc = self.store.get(SC, "", sc_name) if sc_name else None
            if sc is None:
                self.c.events.record(pvc, "Warning", "ProvisioningFailed",
                                     f'storageclass.storage.k8s.io "{sc_name}" not found',
                                     "persistentvolume-controller")
                return
            if sc.get("volumeBindingMode") == "WaitForFirstConsumer" and not self._has_consumer(pvc):
                self.c.events.record(pvc, "Normal", "WaitForFirstConsumer",
                                     "waiting for first consumer to be created before binding",
                                     "persistentvolume-controller")
                return
            if self.c.step_due(self.c.pvc_queue, key, "bind"):
                self._bind(pvc, sc)
            return
        self.ensure_volume(pvc)
        requested = parse_quantity(field_value(pvc, "spec.resources.requests.storage") or 0)
        capacity = parse_quantity(field_value(pvc, "status.capacity.storage") or 0)
        if requested > capacity:
            new = copy.deepcopy(pvc)
            new["status"]["capacity"]["storage"] = field_value(pvc, "spec.resources.requests.storage")
            new["status"].pop("conditions", None)
            self.store.update(PVC, new, subresource="status", check_rv=False)
            self.c.events.record(pvc, "Normal", "FileSystemResizeSuccessful",
                                 f"MountVolume.NodeExpandVolume succeeded for volume \"{field_value(pvc, 'spec.volumeName')}\"",
                                 "kubelet")

    def _has_consumer(self, pvc: dict) -> bool:
        ns, name = pvc["metadata"]["namespace"], pvc["metadata"]["name"]
        return any(name in (c for _, c in claim_names(v.get("spec") or {})) for v in self.store.list(VMI, ns))

    def _bind(self, pvc: dict, sc: dict):
        new = copy.deepcopy(pvc)
        volume = new["spec"].get("volumeName") or f"pvc-{pvc['metadata']['uid']}"
        new["spec"]["volumeName"] = volume
        new["metadata"].setdefault("annotations", {})["pv.kubernetes.io/bind-completed"] = "yes"
        new["metadata"]["annotations"]["volume.kubernetes.io/storage-provisioner"] = sc.get("provisioner", "")
        os.makedirs(self.c.volume_dir(new), exist_ok=True)
        new = self.store.update(PVC, new, check_rv=False)
        status = {"phase": "Bound", "accessModes": list(field_value(pvc, "spec.accessModes") or ["ReadWriteOnce"]),
                  "capacity": {"storage": field_value(pvc, "spec.resources.requests.storage") or "1Gi"}}
        new = copy.deepcopy(new)
        new["status"] = status
        new = self.store.update(PVC, new, subresource="status", check_rv=False)
        self.ensure_volume(new, sc)
        self.c.events.record(pvc, "Normal", "ProvisioningSucceeded",
                             f"Successfully provisioned volume {volume}", sc.get("provisioner", "csi"))

    # ================= PersistentVolumes
    def ensure_volume(self, pvc: dict, sc: dict | None = None):
        """The PersistentVolume the CSI external-provisioner makes for a bound claim
        (kubernetes-csi/external-provisioner pkg/controller/controller.go: named after the claim's
        volumeName, reclaim policy from the StorageClass, Delete when it says nothing), Bound to it."""
        volume = field_value(pvc, "spec.volumeName")
        if not volume or self.store.get(PV, "", volume) is not None:
            return
        if sc is None:
            sc_name = field_value(pvc, "spec.storageClassName")
            sc = (self.store.get(SC, "", sc_name) if sc_name else None) or {}
        driver = sc.get("provisioner", "rbd.csi.ceph.com")
        params = sc.get("parameters") or {}
        meta, spec = pvc["metadata"], pvc.get("spec") or {}
        pv = self.store.create(PV, {
            "apiVersion": "v1", "kind": "PersistentVolume",
            "metadata": {"name": volume, "annotations": {"pv.kubernetes.io/provisioned-by": driver}},
            "spec": {"accessModes": list(spec.get("accessModes") or ["ReadWriteOnce"]),
                     "capacity": {"storage": field_value(pvc, "status.capacity.storage")
                                  or field_value(pvc, "spec.resources.requests.storage") or "1Gi"},
                     "claimRef": {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "name": meta["name"],
                                  "namespace": meta["namespace"], "uid": meta.get("uid", "")},
                     "csi": {"driver": driver, "volumeHandle": f"0001-0024-{params.get('clusterID', 'sim')}-{volume}",
                             "volumeAttributes": {"clusterID": params.get("clusterID", ""),
                                                  "pool": params.get("pool", ""), "imageName": f"csi-vol-{volume}"}},
                     "persistentVolumeReclaimPolicy": sc.get("reclaimPolicy") or "Delete",
                     "storageClassName": spec.get("storageClassName") or "",
                     "volumeMode": spec.get("volumeMode") or "Filesystem"}})
        pv = copy.deepcopy(pv)
        pv["status"] = {"phase": "Bound"}
        self.store.update(PV, pv, subresource="status", check_rv=False)

    def pvc_deleted(self, pvc: dict):
        """A deleted claim releases its volume (pkg/controller/volume/persistentvolume/
        pv_controller.go): `Retain` keeps the volume and its data, Released, until an admin deletes
        it or sets its policy to Delete; `Delete` removes both."""
        volume = field_value(pvc, "spec.volumeName")
        pv = self.store.get(PV, "", volume) if volume else None
        if pv is None or field_value(pv, "spec.persistentVolumeReclaimPolicy") != "Retain":
            self._delete_volume(volume, pv is not None)
            return
        new = copy.deepcopy(pv)
        new["status"] = {"phase": "Released"}
        self.store.update(PV, new, subresource="status", check_rv=False)

    def reconcile_volume(self, name: str):
        """A Released volume whose policy became Delete is deleted, data and all."""
        pv = self.store.get(PV, "", name)
        if pv is not None and field_value(pv, "status.phase") == "Released" \
                and field_value(pv, "spec.persistentVolumeReclaimPolicy") == "Delete":
            self._delete_volume(name, True)

    def _delete_volume(self, volume: str | None, has_object: bool):
        if not volume:
            return
        if has_object:
            self.store.delete(PV, "", volume)
        path = self.c.volume_dir({"spec": {"volumeName": volume}})
        if path and os.path.isdir(path):
            asyncio.get_running_loop().run_in_executor(None, shutil.rmtree, path, True)

    # ================= CDI DataVolumes
    async def reconcile_dv(self, key):
        ns, name = key
        dv = self.store.get(DV, ns, name)
        if dv is None or dv["metadata"].get("deletionTimestamp"):
            return
        pvc = self.store.get(PVC, ns, name)
        annotations = dv["metadata"].get("annotations") or {}
        if pvc is not None and (pvc["metadata"].get("annotations") or {}).get(POPULATED_FOR) == name \
                and not any(r.get("kind") == "DataVolume" for r in pvc["metadata"].get("ownerReferences") or []):
            # A claim populated for this DataVolume (a restore in place): adopted, not cloned again.
            new = copy.deepcopy(pvc)
            new["metadata"]["ownerReferences"] = [*(pvc["metadata"].get("ownerReferences") or []), self.c.owner_ref(dv)]
            self.store.update(PVC, new, check_rv=False)
            return
        phase = field_value(dv, "status.phase")
        if phase in ("Succeeded", "Failed"):
            return
        if pvc is None and PRE_POPULATED in annotations:
            return  # someone else fills the claim (a restore); nothing to import or clone
        spec = dv.get("spec") or {}
        source = spec.get("source") or {}
        if pvc is None:
            if "pvc" in source:
                src_ns = source["pvc"].get("namespace") or ns
                src = self.store.get(PVC, src_ns, source["pvc"]["name"])
                if src is None:
                    return self._dv_status(dv, "Pending", "N/A", bound=("False", "CloneWithoutSource",
                                           f"The source pvc {src_ns}/{source['pvc']['name']} doesn't exist"),
                                           event=("Warning", "CloneWithoutSource",
                                                  f"The source PVC {src_ns}/{source['pvc']['name']} doesn't exist"),
                                           retry=True)
            try:
                claim = self._pvc_for(dv)
                admit(self.store, PVC, claim, None)  # CDI's create goes through quota admission too
                pvc = self.store.create(PVC, claim)
            except errors.ApiError as err:
                reason = "ErrExceededQuota" if err.code == 403 else "ErrClaimNotValid"
                return self._dv_status(dv, "Pending", "N/A", bound=("False", reason, err.message),
                                       event=("Warning", reason, err.message), retry=True)
            return self._dv_status(dv, "Pending", "N/A", bound=("False", "Pending", "PVC Pending"))
        if field_value(pvc, "status.phase") != "Bound":
            return self._dv_status(dv, "Pending", "N/A", bound=("False", "Pending", "PVC Pending"))
        clone = "pvc" in source
        strategy = field_value(self.storage_profile(field_value(pvc, "spec.storageClassName") or ""),
                               "status.cloneStrategy") if clone else None
        scheduled, in_progress = ("CloneScheduled", CLONE_PHASES.get(strategy or "", "CloneInProgress")) if clone \
            else ("ImportScheduled", "ImportInProgress")
        if clone and phase in (None, "", "Pending"):
            problem = self._clone_problem(dv, pvc)
            if problem:
                # CDI keeps the phase and says why on the conditions and in an Event; it never fails
                # the DataVolume for this (pkg/controller/datavolume/pvc-clone-controller.go).
                return self._dv_status(dv, phase or "", PROGRESS_NA, bound=("False", "CloneValidationFailed", problem),
                                       event=("Warning", "CloneValidationFailed", problem), retry=True)
        if phase in (None, "", "Pending"):
            if clone:
                src = source["pvc"]
                self.c.events.record(dv, "Normal", "CloneScheduled", f"Cloning from {src.get('namespace') or ns}/"
                                     f"{src['name']} into {ns}/{name} scheduled", "datavolume-pvc-clone-controller")
            self.c.step_due(self.c.dv_queue, key, "clone_schedule")
            return self._dv_status(dv, scheduled, "N/A", bound=("True", "Bound", "PVC " + name + " Bound"))
        if phase == scheduled:
            if not self.c.step_due(self.c.dv_queue, key, "clone_schedule"):
                return
            if self.c.faults.take_clone_failure():
                self.broken_clones.add(key)
            host_assisted = not clone or strategy == "copy"
            src_name = f"{source['pvc'].get('namespace') or ns}/{source['pvc']['name']}" if clone else ""
            message = (f"Cloning from {src_name} into {ns}/{name} in progress" if host_assisted and clone
                       else f"CSI Volume clone in progress (for pvc {src_name})" if strategy == "csi-clone"
                       else f"Smart clone in progress (for pvc {src_name})" if clone else f"Import into {name} started")
            self._dv_status(dv, in_progress, "0.00%" if host_assisted else PROGRESS_NA,
                            running=("True", "Pod is running" if host_assisted else "", ""),
                            event=("Normal", in_progress, message))
            if clone:
                src_pvc = self.store.get(PVC, source["pvc"].get("namespace") or ns, source["pvc"]["name"])
                if src_pvc is not None:
                    await asyncio.get_running_loop().run_in_executor(
                        None, copy_tree, self.c.volume_dir(src_pvc), self.c.volume_dir(pvc))
            self.c.step_due(self.c.dv_queue, key, "clone-step", self.c.t("clone") / 10)
            return
        if phase == in_progress:
            if key in self.broken_clones:
                return self._stuck(dv, pvc, strategy)
            if strategy in ("csi-clone", "snapshot"):
                return self._fast_clone(dv)
            self._progress(dv)

    def _clone_problem(self, dv: dict, target: dict) -> str | None:
        """CDI's clone validation: a target smaller than its source cannot be cloned into."""
        src = field_value(dv, "spec.source.pvc") or {}
        source = self.store.get(PVC, src.get("namespace") or dv["metadata"]["namespace"], src.get("name", ""))
        if source is None:
            return None
        want = parse_quantity(field_value(target, "spec.resources.requests.storage") or 0)
        have = parse_quantity(field_value(source, "status.capacity.storage")
                              or field_value(source, "spec.resources.requests.storage") or 0)
        if want < have:
            return ("The clone doesn't meet the validation requirements: target resources requests storage size is "
                    f"smaller than the source {int(want)} < {int(have)}")
        return None

    def _stuck(self, dv: dict, pvc: dict, strategy: str | None):
        """A clone that fails, as CDI shows it: no progress and Warning events, never phase Failed.
        A CSI clone fails in the driver (the claim is not provisioned), a host-assisted one in its
        clone pod, which is restarted."""
        ns, name = dv["metadata"]["namespace"], dv["metadata"]["name"]
        if not self.c.step_due(self.c.dv_queue, (ns, name), "schedule_retry"):
            return
        if strategy in ("csi-clone", "snapshot"):
            self.c.events.record(pvc, "Warning", "ProvisioningFailed",
                                 'failed to provision volume with StorageClass "{}": rpc error: code = Internal desc = '
                                 "image clone failed (injected by the simulator)".format(
                                     field_value(pvc, "spec.storageClassName")), "rbd.csi.ceph.com")
        else:
            new = copy.deepcopy(dv)
            new["status"]["restartCount"] = int(field_value(dv, "status.restartCount") or 0) + 1
            self.store.update(DV, new, subresource="status", check_rv=False)
            self.c.events.record(dv, "Warning", "CloneFailed", "clone pod failed: the source volume could not be "
                                 "read (injected by the simulator)", "datavolume-pvc-clone-controller")
        self.c.step_due(self.c.dv_queue, (ns, name), "schedule_retry")

    def _fast_clone(self, dv: dict):
        """A CSI or snapshot clone: copy-on-write, done in one step, no progress to report."""
        ns, name = dv["metadata"]["namespace"], dv["metadata"]["name"]
        if not self.c.step_due(self.c.dv_queue, (ns, name), "csi_clone"):
            return
        src = field_value(dv, "spec.source.pvc") or {}
        self._dv_status(dv, "Succeeded", "100.0%", running=("False", "Completed", "Clone Complete"), ready=True,
                        event=("Normal", "CloneSucceeded", f"Successfully cloned from {src.get('namespace') or ns}/"
                                                           f"{src.get('name')} into {ns}/{name}"))

    def _progress(self, dv: dict):
        """Ten progress updates over the clone time, then Succeeded."""
        ns, name = dv["metadata"]["namespace"], dv["metadata"]["name"]
        if not self.c.step_due(self.c.dv_queue, (ns, name), "clone-step", self.c.t("clone") / 10):
            return
        try:
            step = int(float((field_value(dv, "status.progress") or "0").rstrip("%")) // 10) + 1
        except ValueError:
            step = 1
        if step >= 10:
            src = (field_value(dv, "spec.source.pvc") or {})
            self._dv_status(dv, "Succeeded", "100.0%", running=("False", "Completed", ""), ready=True,
                            event=("Normal", "CloneSucceeded" if src else "ImportSucceeded",
                                   f"Successfully cloned from {src.get('namespace') or ns}/{src.get('name')} into "
                                   f"{ns}/{name}" if src else "Import Successful"))
            return
        self._dv_status(dv, field_value(dv, "status.phase"), f"{step * 10:.2f}%")
        self.c.step_due(self.c.dv_queue, (ns, name), "clone-step", self.c.t("clone") / 10)

    def _pvc_for(self, dv: dict) -> dict:
        spec = dv.get("spec") or {}
        base = copy.deepcopy(spec.get("pvc") or spec.get("storage") or {})
        sc_name = base.get("storageClassName")
        if not sc_name:
            sc = default_storage_class(self.store)
            sc_name = sc["metadata"]["name"] if sc else None
        # spec.storage leaves access and volume mode to the StorageProfile's first property set.
        profile = self.storage_profile(sc_name) if sc_name else None
        defaults = (field_value(profile, "status.claimPropertySets") or [{}])[0]
        pvc_spec = {"accessModes": base.get("accessModes") or list(defaults.get("accessModes") or ["ReadWriteOnce"]),
                    "volumeMode": base.get("volumeMode") or defaults.get("volumeMode") or "Filesystem",
                    "resources": base.get("resources") or {"requests": {"storage": "1Gi"}},
                    "storageClassName": sc_name}
        meta = dv["metadata"]
        return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                "metadata": {"name": meta["name"], "namespace": meta["namespace"],
                             "labels": {**(meta.get("labels") or {}), "app": "containerized-data-importer",
                                        "app.kubernetes.io/component": "storage",
                                        "app.kubernetes.io/managed-by": "cdi-controller"},
                             # the DataVolume's annotations, then CDI's own (newPersistentVolumeClaim
                             # in CDI's pkg/controller/datavolume/controller-base.go)
                             "annotations": {**(meta.get("annotations") or {}),
                                             "cdi.kubevirt.io/storage.contentType": "kubevirt",
                                             "cdi.kubevirt.io/createdForDataVolume": meta["uid"]},
                             "ownerReferences": [self.c.owner_ref(dv)],
                             "finalizers": [PVC_PROTECTION]},
                "spec": pvc_spec, "status": {"phase": "Pending"}}

    def _dv_status(self, dv, phase, progress, bound=None, running=None, ready=False, event=None, retry=False):
        status = copy.deepcopy(dv.get("status") or {})
        status["phase"] = phase
        status["progress"] = progress
        status.setdefault("restartCount", 0)
        if bound:
            set_condition(status, condition("Bound", bound[0], bound[1], bound[2]))
        else:
            status.setdefault("conditions", [])
        if running:
            set_condition(status, condition("Running", running[0], running[1], running[2]))
        set_condition(status, condition("Ready", "True" if ready else "False"))
        if phase == "Succeeded" and not bound:
            set_condition(status, condition("Bound", "True", "Bound", f"PVC {dv['metadata']['name']} Bound"))
        for c in status["conditions"]:
            c.pop("lastProbeTime", None)
            c["lastHeartbeatTime"] = c.get("lastTransitionTime")
        if status != dv.get("status"):
            new = copy.deepcopy(dv)
            new["status"] = status
            self.store.update(DV, new, subresource="status", check_rv=False)
        if event:
            self.c.events.record(dv, event[0], event[1], event[2], "datavolume-controller")
        if retry:
            self.c.dv_queue.add((dv["metadata"]["namespace"], dv["metadata"]["name"]), self.c.t("schedule_retry"))


def copy_tree(src: str, dst: str):
    """Copy a volume's contents into another volume (what a CSI clone does): what is on the disk,
    not a running guest's in-memory /run, /dev and /proc the simulator keeps beside it."""
    os.makedirs(dst, exist_ok=True)
    if src and os.path.isdir(src):
        shutil.copytree(src, dst, dirs_exist_ok=True, symlinks=True, ignore=not_on_disk(src), copy_function=_copy_file)


DISK_IMAGE_SUFFIXES = (".img", ".raw")  # a QEMU guest's volume holds its disk as one image file


def _copy_file(src: str, dst: str):
    """A file of a volume: a disk image (a QEMU guest's volume) stays sparse, as a CSI clone's
    copy-on-write does; anything else as shutil copies it."""
    if src.endswith(DISK_IMAGE_SUFFIXES):
        sparse_copy(src, dst)
    else:
        shutil.copy2(src, dst)


def replace_tree(src: str, dst: str):
    """Make `dst` an exact copy of `src` (what restoring a volume from a snapshot does)."""
    if os.path.isdir(dst):
        shutil.rmtree(dst)
    copy_tree(src, dst)
