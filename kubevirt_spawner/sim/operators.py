"""virt-operator and cdi-operator, as their CRs show them. The components they deploy are not
modelled (the simulator's controllers are those components): a CR is deployed at once.

- KubeVirt (pkg/virt-operator/kubevirt.go syncInstallation, pkg/virt-operator/util/client.go):
  one CR, in the operator's namespace `kubevirt`, becomes phase Deployed with Available,
  Progressing and Degraded (reason AllComponentsReady) and Created (AllResourcesCreated), the
  observed version, the observed generation and the finalizer; another CR is refused with
  Synchronized=False, reason ExistingDeployment.
- CDI (controller-lifecycle-operator-sdk's reconciler.go and cr-status.go): phase Deployed with
  Available (DeployCompleted), Progressing and Degraded False, the three versions and the finalizer.
- CDIConfig `config` (CDI's pkg/controller/config-controller.go): its spec is the CDI CR's
  spec.config, its status the scratch space class (when that StorageClass exists), the default pod
  resources, the filesystem overhead per StorageClass and empty import proxy settings.
"""

from __future__ import annotations

import copy
from typing import Any

from ..objects import field_value
from .resources import BY_KIND
from .timeutil import now_iso

KUBEVIRT = BY_KIND["KubeVirt"]
CDI = BY_KIND["CDI"]
CDI_CONFIG = BY_KIND["CDIConfig"]
SC = BY_KIND["StorageClass"]
KUBEVIRT_VERSION = "v1.9.0"
KUBEVIRT_REGISTRY = "quay.io/kubevirt"
KUBEVIRT_NAMESPACE = "kubevirt"
KUBEVIRT_FINALIZER = "kubevirt.io/foregroundDeleteKubeVirt"


def feature_gates(store) -> set[str]:
    """The feature gates virt-api and virt-controller act on: those of the KubeVirt CR in effect
    (the oldest in KubeVirt's namespace; pkg/virt-config/feature-gates.go reads
    spec.configuration.developerConfiguration.featureGates). None without a KubeVirt CR."""
    deployed = sorted((kv for kv in store.list(KUBEVIRT) if kv["metadata"]["namespace"] == KUBEVIRT_NAMESPACE),
                      key=lambda kv: kv["metadata"]["creationTimestamp"])
    if not deployed:
        return set()
    return set(field_value(deployed[0], "spec.configuration.developerConfiguration.featureGates") or [])
CDI_VERSION = "v1.66.0"
CDI_FINALIZER = "operator.cdi.kubevirt.io"
CDI_CONFIG_NAME = "config"
DEFAULT_FILESYSTEM_OVERHEAD = "0.06"  # CDI's pkg/common/common.go DefaultGlobalOverhead


def _conditions(old: list, wanted: list[tuple[str, str, str, str]], time_fields: tuple[str, str]) -> list:
    """Conditions with their times kept while unchanged (both operators stamp only changes)."""
    probe, transition = time_fields
    before = {c["type"]: c for c in old or []}
    out = []
    for ctype, status, reason, message in wanted:
        prior = before.get(ctype) or {}
        cond = {"type": ctype, "status": status}
        if reason:
            cond["reason"] = reason
        if message:
            cond["message"] = message
        same = bool(prior) and all(prior.get(f) == cond.get(f) for f in ("status", "reason", "message"))
        cond[probe] = prior[probe] if same and prior.get(probe) else now_iso()
        cond[transition] = prior[transition] if same and prior.get(transition) else now_iso()
        out.append(cond)
    return out


class Operators:
    def __init__(self, cluster):
        self.c = cluster
        self.store = cluster.store

    def _finalized(self, rt, obj: dict, finalizer: str) -> bool:
        """Add the operator's finalizer; on deletion, take it off (the components are gone at once).
        True when the object is being deleted."""
        meta = obj["metadata"]
        finalizers = list(meta.get("finalizers") or [])
        if meta.get("deletionTimestamp"):
            if finalizer in finalizers:
                new = copy.deepcopy(obj)
                new["metadata"]["finalizers"] = [f for f in finalizers if f != finalizer]
                self.store.update(rt, new, check_rv=False)
            return True
        if finalizer not in finalizers:
            new = copy.deepcopy(obj)
            new["metadata"]["finalizers"] = [*finalizers, finalizer]
            self.store.update(rt, new, check_rv=False)
        return False

    def _set_status(self, rt, name: str, namespace: str, status: dict):
        obj = self.store.get(rt, namespace, name)
        if obj is not None and obj.get("status") != status:
            new = copy.deepcopy(obj)
            new["status"] = status
            self.store.update(rt, new, subresource="status", check_rv=False)

    # ---------- KubeVirt
    def reconcile_kubevirt(self, namespace: str, name: str):
        kv = self.store.get(KUBEVIRT, namespace, name)
        if kv is None or self._finalized(KUBEVIRT, kv, KUBEVIRT_FINALIZER):
            return
        kv = self.store.get(KUBEVIRT, namespace, name)
        old = field_value(kv, "status.conditions") or []
        others = [o for o in self.store.list(KUBEVIRT) if o["metadata"]["uid"] != kv["metadata"]["uid"]
                  and o["metadata"]["creationTimestamp"] <= kv["metadata"]["creationTimestamp"]]
        status: dict[str, Any]
        if namespace != KUBEVIRT_NAMESPACE or others:
            status = {"conditions": _conditions(old, [("Synchronized", "False", "ExistingDeployment",
                                                       "There is an active KubeVirt deployment")],
                                                ("lastProbeTime", "lastTransitionTime"))}
        else:
            ready = ("AllComponentsReady", "All components are ready.")
            status = {
                "phase": "Deployed",
                "conditions": _conditions(old, [("Available", "True", *ready), ("Progressing", "False", *ready),
                                                ("Degraded", "False", *ready),
                                                ("Created", "True", "AllResourcesCreated", "All resources were created.")],
                                          ("lastProbeTime", "lastTransitionTime")),
                "operatorVersion": KUBEVIRT_VERSION,
                "targetKubeVirtRegistry": KUBEVIRT_REGISTRY, "targetKubeVirtVersion": KUBEVIRT_VERSION,
                "observedKubeVirtRegistry": KUBEVIRT_REGISTRY, "observedKubeVirtVersion": KUBEVIRT_VERSION,
                "observedGeneration": kv["metadata"].get("generation", 1),
                "defaultArchitecture": "amd64",
            }
        self._set_status(KUBEVIRT, name, namespace, status)

    # ---------- CDI
    def reconcile_cdi(self, name: str):
        cr = self.store.get(CDI, "", name)
        if cr is None or self._finalized(CDI, cr, CDI_FINALIZER):
            return
        cr = self.store.get(CDI, "", name)
        status = {
            "phase": "Deployed",
            "conditions": _conditions(field_value(cr, "status.conditions") or [],
                                      [("Available", "True", "DeployCompleted", "Deployment Completed"),
                                       ("Progressing", "False", "", ""), ("Degraded", "False", "", "")],
                                      ("lastHeartbeatTime", "lastTransitionTime")),
            "operatorVersion": CDI_VERSION, "targetVersion": CDI_VERSION, "observedVersion": CDI_VERSION,
        }
        self._set_status(CDI, name, "", status)
        self.reconcile_cdi_config()

    def reconcile_cdi_config(self):
        crs = [cr for cr in self.store.list(CDI) if not cr["metadata"].get("deletionTimestamp")]
        if not crs:
            return
        cr = crs[0]
        spec = copy.deepcopy(field_value(cr, "spec.config") or {})
        config = self.store.get(CDI_CONFIG, "", CDI_CONFIG_NAME)
        if config is None:
            config = self.store.create(CDI_CONFIG, {
                "apiVersion": "cdi.kubevirt.io/v1beta1", "kind": "CDIConfig",
                "metadata": {"name": CDI_CONFIG_NAME, "labels": {"cdi.kubevirt.io": "",
                                                                 "app.kubernetes.io/component": "storage",
                                                                 "app.kubernetes.io/managed-by": "cdi-controller"},
                             "ownerReferences": [self.c.owner_ref(cr)]},
                "spec": spec})
        elif config.get("spec") != spec:
            new = copy.deepcopy(config)
            new["spec"] = spec
            config = self.store.update(CDI_CONFIG, new, check_rv=False)
        classes = [sc["metadata"]["name"] for sc in self.store.list(SC)]
        overhead = spec.get("filesystemOverhead") or {}
        global_overhead = overhead.get("global") or DEFAULT_FILESYSTEM_OVERHEAD
        status: dict = {
            "importProxy": {"HTTPProxy": "", "HTTPSProxy": "", "noProxy": "", "trustedCAProxy": ""},
            "defaultPodResourceRequirements": {"limits": {"cpu": "750m", "memory": "600M"},
                                               "requests": {"cpu": "100m", "memory": "60M"}},
            "filesystemOverhead": {"global": global_overhead, "storageClass": {
                sc: (overhead.get("storageClass") or {}).get(sc, global_overhead) for sc in classes}},
            "preallocation": bool(spec.get("preallocation")),
        }
        if spec.get("scratchSpaceStorageClass") in classes:
            status["scratchSpaceStorageClass"] = spec["scratchSpaceStorageClass"]
        self._set_status(CDI_CONFIG, CDI_CONFIG_NAME, "", status)
