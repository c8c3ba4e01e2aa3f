#!/usr/bin/env bash
# Puts nodes into a workstation node pool as the design document does: the label that KubeVirt's
# node placement and the workstations' nodeSelector use, the pool's accelerator mode, and the taint
# that keeps other workloads off. Refuses a node that still runs other workloads (drain it first)
# unless --force; checks every node before it changes any.
#
#   deploy/host/label-nodes.sh --pool vm-gpu-pci gpu-node-1 gpu-node-2
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: label-nodes.sh --pool POOL [--force] [--dry-run] NODE...

Label and taint NODEs for a workstation node pool.

  --pool POOL   vm-cpu      CPU workstations
                vm-gpu-pci  GPU passthrough workstations (GPUs bound to vfio-pci)
  --force       label nodes that still run pods other than DaemonSets' and KubeVirt's
  --dry-run     print the kubectl commands instead of running them
  -h, --help    this help

The label keys come from the environment (deploy/settings.env):
  KUBEVIRT_NODE_LABEL   (default workload.example.com/kubevirt)     set to "true", also the taint's key
  ACCELERATOR_LABEL     (default accelerator.example.com/mode)      set to "vfio" on vm-gpu-pci nodes
EOF
}

POOL=""
FORCE=0
DRY_RUN=0
NODES=()
while [ $# -gt 0 ]; do
  case "$1" in
    --pool) POOL="${2:?--pool needs a value}"; shift 2 ;;
    --force) FORCE=1; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "label-nodes.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) NODES+=("$1"); shift ;;
  esac
done
case "$POOL" in
  vm-cpu|vm-gpu-pci) ;;
  "") echo "label-nodes.sh: --pool is required (vm-cpu or vm-gpu-pci)" >&2; exit 2 ;;
  *) echo "label-nodes.sh: unknown pool $POOL: use vm-cpu or vm-gpu-pci" >&2; exit 2 ;;
esac
if [ ${#NODES[@]} -eq 0 ]; then
  echo "label-nodes.sh: name the nodes to label (see --help)" >&2
  exit 2
fi
NODE_LABEL="${KUBEVIRT_NODE_LABEL:-workload.example.com/kubevirt}"
MODE_LABEL="${ACCELERATOR_LABEL:-accelerator.example.com/mode}"

# Pods that may stay: DaemonSets' (they run on every node), the node's static pods (their mirror
# pods' owner is the Node) and KubeVirt's own launchers. Tab-separated: a pod without an owner or
# label leaves its field empty.
other_workloads() {
  kubectl get pods --all-namespaces --field-selector "spec.nodeName=$1,status.phase!=Succeeded,status.phase!=Failed" \
    -o jsonpath='{range .items[*]}{.metadata.namespace}/{.metadata.name}{"\t"}{.metadata.ownerReferences[0].kind}{"\t"}{.metadata.labels.kubevirt\.io}{"\n"}{end}' |
    awk -F '\t' '$1 != "" && $2 != "DaemonSet" && $2 != "Node" && $3 != "virt-launcher" { print $1 }'
}

refused=0
for node in "${NODES[@]}"; do
  if ! kubectl get node "$node" -o name >/dev/null; then
    refused=1
    continue
  fi
  others=$(other_workloads "$node")
  if [ -n "$others" ] && [ "$FORCE" -eq 0 ]; then
    echo "label-nodes.sh: $node still runs other workloads: $(paste -sd ' ' - <<<"$others")" >&2
    echo "  drain it first (kubectl drain $node --ignore-daemonsets --delete-emptydir-data), or pass --force" >&2
    refused=1
  fi
done
if [ "$refused" -ne 0 ]; then
  echo "label-nodes.sh: no node was changed" >&2
  exit 1
fi

run() {
  if [ "$DRY_RUN" -eq 1 ]; then echo "$*"; else "$@"; fi
}
for node in "${NODES[@]}"; do
  run kubectl label node "$node" "$NODE_LABEL=true" --overwrite
  if [ "$POOL" = vm-gpu-pci ]; then
    run kubectl label node "$node" "$MODE_LABEL=vfio" --overwrite
  else
    run kubectl label node "$node" "$MODE_LABEL-"  # a CPU pool node has no accelerator mode
  fi
  run kubectl taint node "$node" "$NODE_LABEL=true:NoSchedule" --overwrite
  # The taint keeps other workloads off from now on: a node drained for the pool takes pods again
  # (workstations' launcher pods; DaemonSets ignore the cordon and would hide it).
  run kubectl uncordon "$node"
done
