"""Which machines hold which volumes: what Kubernetes' attach/detach controller
(pkg/controller/volume/attachdetach) and a CSI driver's external-attacher keep track of."""

from __future__ import annotations

import hashlib

from ..objects import field_value
from .instances import PVC, VMI, claim_names
from .resources import BY_KIND
from .store import Store

PV = BY_KIND["PersistentVolume"]
VOLUME_ATTACHMENT = BY_KIND["VolumeAttachment"]
ATTACHED = ("Running",)


def attachments(store: Store, ns: str, claim: str, exclude_uid: str | None = None) -> list[dict]:
    """VMIs that hold a claim attached now (a VMI on a lost node still holds it)."""
    out = []
    for v in store.list(VMI, ns):
        if v["metadata"]["uid"] == exclude_uid or field_value(v, "status.phase") not in ATTACHED:
            continue
        if claim in (c for _, c in claim_names(v.get("spec") or {})):
            out.append(v)
    return out


def sync_volume_attachments(store: Store):
    """What the attach/detach controller and ceph-csi's external-attacher keep: one
    VolumeAttachment per CSI volume and node while a machine there holds it (a lost node's
    until its pod is gone), named as kubernetes pkg/volume/csi/csi_attacher.go names it
    (csi-<sha256(volume handle, driver, node)>), status.attached once attached."""
    desired: dict[str, dict] = {}
    for vmi in store.list(VMI):
        node = field_value(vmi, "status.nodeName")
        if not node or field_value(vmi, "status.phase") not in ATTACHED:
            continue
        for _, claim in claim_names(vmi.get("spec") or {}):
            pvc = store.get(PVC, vmi["metadata"]["namespace"], claim or "")
            pv = store.get(PV, "", field_value(pvc, "spec.volumeName") or "") if pvc else None
            csi = field_value(pv, "spec.csi") if pv else None
            if pv is None or not csi:
                continue
            digest = hashlib.sha256(f"{csi['volumeHandle']}{csi['driver']}{node}".encode()).hexdigest()
            desired[f"csi-{digest}"] = {"attacher": csi["driver"], "nodeName": node,
                                        "source": {"persistentVolumeName": pv["metadata"]["name"]}}
    current = {va["metadata"]["name"] for va in store.list(VOLUME_ATTACHMENT)}
    for name in sorted(set(desired) - current):
        store.create(VOLUME_ATTACHMENT, {"apiVersion": "storage.k8s.io/v1", "kind": "VolumeAttachment",
                                         "metadata": {"name": name}, "spec": desired[name],
                                         "status": {"attached": True}})
    for name in sorted(current - set(desired)):
        store.delete(VOLUME_ATTACHMENT, "", name)
