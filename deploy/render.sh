#!/usr/bin/env bash
# Fills deploy/settings.env (or another settings file) into deploy/'s manifests: every YAML file
# under rbac/, host/, cluster/, jupyterhub/ and guardrails/, written to the same place under the
# output directory (default deploy/rendered/). Only the settings' ${NAMES} are replaced; a setting
# that is missing or empty (GPU_DEVICES may be empty) stops it before anything is written.
#
#   deploy/render.sh                       # deploy/settings.env -> deploy/rendered/
#   deploy/render.sh --settings prod.env --out /tmp/prod
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
settings="$here/settings.env"
out="$here/rendered"
while [ $# -gt 0 ]; do
  case "$1" in
    --settings) settings="${2:?--settings needs a file}"; shift 2 ;;
    --out) out="${2:?--out needs a directory}"; shift 2 ;;
    -h|--help) sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "render.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
if ! command -v envsubst >/dev/null 2>&1; then
  echo "render.sh: envsubst is missing: install gettext-base (Debian, Ubuntu) or gettext" >&2
  exit 2
fi
[ -r "$settings" ] || { echo "render.sh: cannot read $settings" >&2; exit 2; }

names=(KUBEVIRT_VERSION CDI_VERSION KUBEVIRT_NODE_LABEL ACCELERATOR_LABEL GPU_DEVICES KUBEVIRT_FEATURE_GATES
       STORAGE_CLASS CEPH_CLUSTER_ID CEPH_POOL CEPH_CSI_SECRET CEPH_CSI_SECRET_NAMESPACE SNAPSHOT_CLASS
       GOLDEN_NAMESPACE GOLDEN_IMAGE GOLDEN_IMAGE_URL GOLDEN_IMAGE_SIZE GOLDEN_IMAGE_FIRMWARE
       HUB_NAMESPACE HUB_RELEASE HUB_IMAGE HUB_IMAGE_TAG PUBLIC_HOSTNAME OIDC_ISSUER OIDC_CLIENT_ID
       USER_NAMESPACE_PREFIX CLUSTER_DOMAIN VM_EXTRA_LABEL_PREFIXES VM_EXTRA_ANNOTATION_PREFIXES
       VM_EXTRA_TOLERATION_KEYS VM_PRIORITY_CLASSES NAMESPACE_EXTRA_LABEL_PREFIXES NAMESPACE_EXTRA_ANNOTATION_PREFIXES)
# (these may be empty; they must still be set)
optional=(GPU_DEVICES VM_EXTRA_LABEL_PREFIXES VM_EXTRA_ANNOTATION_PREFIXES VM_EXTRA_TOLERATION_KEYS
          VM_PRIORITY_CLASSES NAMESPACE_EXTRA_LABEL_PREFIXES NAMESPACE_EXTRA_ANNOTATION_PREFIXES)
# Only the settings file decides: no value leaks in from the caller's environment.
unset "${names[@]}"
set -a
# shellcheck source=/dev/null
. "$settings"
set +a
missing=()
for name in "${names[@]}"; do
  # (GPU_DEVICES may be empty: a cluster without GPU passthrough; it must still be set)
  if [[ " ${optional[*]} " == *" $name "* ]]; then [ -n "${!name+set}" ] || missing+=("$name"); continue; fi
  [ -n "${!name:-}" ] || missing+=("$name")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "render.sh: $settings does not set ${missing[*]}" >&2
  exit 2
fi

case $GOLDEN_IMAGE_FIRMWARE in
  bios|efi) ;;
  *) echo "render.sh: GOLDEN_IMAGE_FIRMWARE=$GOLDEN_IMAGE_FIRMWARE is bios or efi (what the image's bootloader is built for)" >&2
     exit 2;;
esac
dns_label='^[a-z0-9]([-a-z0-9]*[a-z0-9])?$'
for name in HUB_NAMESPACE GOLDEN_NAMESPACE STORAGE_CLASS SNAPSHOT_CLASS GOLDEN_IMAGE HUB_RELEASE; do
  value="${!name}"
  if ! [[ "$value" =~ $dns_label ]] || [ ${#value} -gt 63 ]; then
    echo "render.sh: $name=${!name} is not a DNS label (lower-case letters, digits and '-')" >&2
    exit 2
  fi
done

# Lists the YAML takes in flow style, so that they fit on the template's line.
gates=()
IFS=',' read -r -a gate_list <<<"$KUBEVIRT_FEATURE_GATES"
for gate in "${gate_list[@]}"; do
  gate="${gate// /}"
  [ -n "$gate" ] && gates+=("\"$gate\"")
done
KUBEVIRT_FEATURE_GATES_JSON="[$(IFS=','; echo "${gates[*]}")]"
devices=()
gpu_names=()
for device in $GPU_DEVICES; do
  selector="${device%%=*}"; resource="${device#*=}"
  if ! [[ "$selector" =~ ^[0-9A-Fa-f]{4}:[0-9A-Fa-f]{4}$ ]] || [ "$resource" = "$device" ] || [ -z "$resource" ]; then
    echo "render.sh: GPU_DEVICES entry '$device' is not VENDOR:DEVICE=RESOURCE_NAME (10DE:20B0=nvidia.com/A100-PCIE-40GB)" >&2
    exit 2
  fi
  devices+=("{\"pciVendorSelector\": \"$selector\", \"resourceName\": \"$resource\"}")
  gpu_names+=("'$resource'")
done
KUBEVIRT_PCI_HOST_DEVICES_JSON="[$(IFS=','; echo "${devices[*]}")]"
# the same resource names as a CEL list, for the admission policy's check of a VM's GPUs
GPU_RESOURCE_NAMES_CEL="[$(IFS=','; echo "${gpu_names[*]}")]"
# What the admission policy lets a VM's template give its launcher pod beyond this project's own:
# space-separated words as CEL lists of strings
cel_list() {
  local words=() word
  for word in $1; do
    if ! [[ "$word" =~ ^[A-Za-z0-9./_-]+$ ]]; then
      echo "render.sh: $2 entry '$word' is not a label key or prefix (letters, digits, '.', '/', '_', '-')" >&2
      exit 2
    fi
    words+=("'$word'")
  done
  echo "[$(IFS=','; echo "${words[*]}")]"
}
VM_EXTRA_LABEL_PREFIXES_CEL="$(cel_list "$VM_EXTRA_LABEL_PREFIXES" VM_EXTRA_LABEL_PREFIXES)"
VM_EXTRA_ANNOTATION_PREFIXES_CEL="$(cel_list "$VM_EXTRA_ANNOTATION_PREFIXES" VM_EXTRA_ANNOTATION_PREFIXES)"
VM_EXTRA_TOLERATION_KEYS_CEL="$(cel_list "$VM_EXTRA_TOLERATION_KEYS" VM_EXTRA_TOLERATION_KEYS)"
VM_PRIORITY_CLASSES_CEL="$(cel_list "$VM_PRIORITY_CLASSES" VM_PRIORITY_CLASSES)"
NAMESPACE_EXTRA_LABEL_PREFIXES_CEL="$(cel_list "$NAMESPACE_EXTRA_LABEL_PREFIXES" NAMESPACE_EXTRA_LABEL_PREFIXES)"
NAMESPACE_EXTRA_ANNOTATION_PREFIXES_CEL="$(cel_list "$NAMESPACE_EXTRA_ANNOTATION_PREFIXES" \
  NAMESPACE_EXTRA_ANNOTATION_PREFIXES)"
export KUBEVIRT_FEATURE_GATES_JSON KUBEVIRT_PCI_HOST_DEVICES_JSON GPU_RESOURCE_NAMES_CEL \
  VM_EXTRA_LABEL_PREFIXES_CEL VM_EXTRA_ANNOTATION_PREFIXES_CEL VM_EXTRA_TOLERATION_KEYS_CEL VM_PRIORITY_CLASSES_CEL \
  NAMESPACE_EXTRA_LABEL_PREFIXES_CEL NAMESPACE_EXTRA_ANNOTATION_PREFIXES_CEL
names+=(KUBEVIRT_FEATURE_GATES_JSON KUBEVIRT_PCI_HOST_DEVICES_JSON GPU_RESOURCE_NAMES_CEL
        VM_EXTRA_LABEL_PREFIXES_CEL VM_EXTRA_ANNOTATION_PREFIXES_CEL VM_EXTRA_TOLERATION_KEYS_CEL
        VM_PRIORITY_CLASSES_CEL NAMESPACE_EXTRA_LABEL_PREFIXES_CEL NAMESPACE_EXTRA_ANNOTATION_PREFIXES_CEL)

shell_format=""
for name in "${names[@]}"; do shell_format+="\${$name} "; done
mkdir -p "$out"
count=0
while IFS= read -r -d '' template; do
  rel="${template#"$here"/}"
  mkdir -p "$out/$(dirname "$rel")"
  envsubst "$shell_format" <"$template" >"$out/$rel"
  count=$((count + 1))
done < <(find "$here/rbac" "$here/host" "$here/cluster" "$here/jupyterhub" "$here/guardrails" \
           -name '*.yaml' -type f -print0 | sort -z)
echo "rendered $count files from $settings into $out"
