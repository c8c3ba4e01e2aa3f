"""The Eviction API (POST pods/NAME/eviction, what `kubectl drain` and the descheduler call), with
KubeVirt's eviction webhook in front of it for virt-launcher pods.

Upstream, read for this:
- kubernetes pkg/registry/core/pod/storage/eviction.go: an allowed eviction deletes the pod
  (gracefully, with the Eviction's deleteOptions) and answers 201 with a Success Status; a pod
  protected by a PodDisruptionBudget is refused with 429 TooManyRequests.
- kubevirt pkg/virt-api/webhooks/validating-webhook/admitters/pod-eviction-admitter.go (v1.9):
  for a launcher pod whose VMI's eviction strategy (the VMI's own, else the KubeVirt CR's
  spec.configuration.evictionStrategy; None when neither says: pkg/virt-config/configuration.go)
  is External, LiveMigrate (migratable VMI) or LiveMigrateIfPossible (migratable VMI), the webhook
  sets status.evacuationNodeName to the pod's node (not on a dry run) and denies with code 429;
  a VMI already marked is denied again ("Evacuation in progress"). It never lets the pod go.
- kubevirt pkg/virt-operator/resource/generate/components/webhooks.go: the webhook
  "virt-launcher-eviction-interceptor.kubevirt.io" matches pods named virt-launcher* and has
  failurePolicy Fail (whatever its comment says): while virt-api is down, the API server refuses
  their evictions. No PodDisruptionBudget stands behind it: virt-controller's disruption budget
  controller only deletes old ones (pkg/virt-controller/watch/drain/disruptionbudget).
- the same admitter (markVMI): an Eviction the descheduler sent (annotated requested-by:
  sigs.k8s.io/descheduler, descheduler PR 1753) also gets the VMI the annotation
  kubevirt.io/eviction-source: descheduler. Nothing else tells a descheduler's eviction from a
  drain's: the drain cordons the node first (kubectl pkg/drain/cordon.go).
- kubevirt pkg/virt-controller/watch/drain/evacuation/evacuation.go: for External the evacuation
  controller starts no migration (VMIMigratableOnEviction is false): an outside controller acts.
- the apiserver's webhook dispatcher (staging/src/k8s.io/apiserver/pkg/admission/plugin/webhook/
  errors/statuserror.go): a denial reads `admission webhook "NAME" denied the request: MESSAGE`,
  with the webhook's code. (docs/handling-eviction-requests.md still describes PDBs and a second
  eviction granted: the code wins.)

Simulated VMIs are never live-migratable (their root disks are ReadWriteOnce), so LiveMigrate
denies without marking, and LiveMigrateIfPossible lets the pod go."""

from __future__ import annotations

import copy

from ..objects import field_value
from . import errors
from .resources import BY_KIND

POD = BY_KIND["Pod"]
VMI = BY_KIND["VirtualMachineInstance"]
KUBEVIRT = BY_KIND["KubeVirt"]
WEBHOOK = "virt-launcher-eviction-interceptor.kubevirt.io"
REQUESTED_BY, DESCHEDULER = "requested-by", "sigs.k8s.io/descheduler"
EVICTION_SOURCE = "kubevirt.io/eviction-source"
DEFAULT_STRATEGY = "None"


def eviction_strategy(store, vmi: dict) -> str:
    """The VMI's own strategy, else the cluster's, else None (KubeVirt's default)."""
    own = field_value(vmi, "spec.evictionStrategy")
    if own:
        return own
    for kv in store.list(KUBEVIRT):
        configured = field_value(kv, "spec.configuration.evictionStrategy")
        if configured:
            return configured
    return DEFAULT_STRATEGY


def _is_launcher(pod: dict) -> bool:
    return (pod["metadata"].get("labels") or {}).get("kubevirt.io") == "virt-launcher" \
        and field_value(pod, "status.phase") not in ("Succeeded", "Failed")


def _denied(message: str) -> errors.ApiError:
    return errors.ApiError(429, "TooManyRequests", f'admission webhook "{WEBHOOK}" denied the request: {message}')


def _check_body(body, namespace: str, name: str) -> dict:
    if not isinstance(body, dict) or body.get("kind") != "Eviction":
        raise errors.bad_request("the request body must be a policy/v1 Eviction")
    meta = body.get("metadata") or {}
    if meta.get("name") and meta["name"] != name:
        raise errors.bad_request("name in URL does not match name in Eviction object")
    if meta.get("namespace") and meta["namespace"] != namespace:
        raise errors.bad_request("namespace in URL does not match namespace in Eviction object")
    return body


def evict(cluster, namespace: str, name: str, body, dry_run: bool) -> dict:
    """What the API server answers to an eviction of pod namespace/name: the Status of a
    granted eviction (the pod then goes as if deleted), or an ApiError."""
    store = cluster.store
    eviction = _check_body(body, namespace, name)
    pod = store.must_get(POD, namespace, name)
    dry_run = dry_run or "All" in (field_value(eviction, "deleteOptions.dryRun") or [])
    vmi_name = (pod["metadata"].get("annotations") or {}).get("kubevirt.io/domain")
    vmi = store.get(VMI, namespace, vmi_name) if vmi_name and _is_launcher(pod) else None
    strategy = eviction_strategy(store, vmi) if vmi is not None else DEFAULT_STRATEGY
    if name.startswith("virt-launcher"):  # (the webhook's match condition)
        cluster.faults.call_webhooks("Eviction")
        if vmi is not None and strategy != DEFAULT_STRATEGY:
            by_descheduler = (field_value(eviction, "metadata.annotations") or {}).get(REQUESTED_BY) == DESCHEDULER
            _admit_launcher(cluster, vmi, pod, strategy, dry_run, by_descheduler)
    if not dry_run:
        grace = field_value(eviction, "deleteOptions.gracePeriodSeconds")
        cluster.before_delete(POD, pod, None if grace is None else int(grace))
        store.delete(POD, namespace, name, grace_period=None if grace is None else int(grace))
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}


def _admit_launcher(cluster, vmi: dict, pod: dict, strategy: str, dry_run: bool, by_descheduler: bool):
    """KubeVirt's webhook: mark the VMI for evacuation and deny, or let the eviction through."""
    if strategy == "LiveMigrateIfPossible":
        return  # (never migratable here: the eviction goes through)
    if strategy == "LiveMigrate":
        raise _denied(f"VMI {vmi['metadata']['name']} is configured with an eviction strategy but is not "
                      "live-migratable")
    ns, vmi_name = vmi["metadata"]["namespace"], vmi["metadata"]["name"]
    triggered = f'Eviction triggered evacuation of VMI "{ns}/{vmi_name}"'
    if field_value(vmi, "status.evacuationNodeName"):
        raise _denied(f"Evacuation in progress: {triggered}")
    node = field_value(pod, "spec.nodeName") or ""
    if field_value(vmi, "status.nodeName") != node:
        raise _denied("Eviction request for target Pod")
    if not dry_run:
        marked = copy.deepcopy(vmi)
        marked.setdefault("status", {})["evacuationNodeName"] = node
        marked = cluster.store.update(VMI, marked, subresource="status", check_rv=False)
        if by_descheduler:  # (the same JSON patch, upstream)
            marked = copy.deepcopy(marked)
            marked["metadata"].setdefault("annotations", {})[EVICTION_SOURCE] = "descheduler"
            cluster.store.update(VMI, marked, check_rv=False)
    raise _denied(triggered)
