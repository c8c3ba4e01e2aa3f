#!/usr/bin/env bash
# Checks that a Kubernetes node can host KubeVirt workstations, as the design document's host
# preparation asks: hardware virtualisation, /dev/kvm, vhost-net, TUN, the kernel modules, and for
# a GPU passthrough node the IOMMU, its groups and the GPUs' binding to vfio-pci; and that a node
# where CDI's importer, cloner and upload pods may run (pool cdi) hands them Block volumes. Prints one row
# per check (PASS, WARN, FAIL or SKIP) with the fix for each failure; exits 1 when a check failed.
#
# On a node:        sudo deploy/host/check-node.sh --pool vm-gpu-pci
# In a DaemonSet:   check-node.sh --root /host --pool vm-cpu   (the host's /proc, /sys, /dev, /etc under /host)
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: check-node.sh [--pool POOL] [--root DIR] [--gpu-vendors IDS]

Check that this node can host KubeVirt workstations.

  --pool POOL         what the node is for (the design document's node pools):
                        vm-cpu         CPU workstations (default)
                        vm-gpu-pci     GPU passthrough workstations: GPUs bound to vfio-pci
                        container-gpu  GPUs for containers: no GPU may be bound to vfio-pci
                        cdi            any node where CDI's importer, cloner and upload pods may
                                       run (the CDI CR's workload placement): the container
                                       runtime only
  --root DIR          where the host's /proc, /sys, /dev and /etc are (default /; /host in the DaemonSet)
  --gpu-vendors IDS   PCI vendor IDs of the GPUs, comma-separated (default 10de,1002: NVIDIA, AMD)
  -h, --help          this help

Exit status: 0 when no check failed, 1 when one did, 2 on a usage error.
EOF
}

POOL=vm-cpu
ROOT=/
GPU_VENDORS=10de,1002
while [ $# -gt 0 ]; do
  case "$1" in
    --pool) POOL="${2:?--pool needs a value}"; shift 2 ;;
    --root) ROOT="${2:?--root needs a value}"; shift 2 ;;
    --gpu-vendors) GPU_VENDORS="${2:?--gpu-vendors needs a value}"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "check-node.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$POOL" in
  vm-cpu|vm-gpu-pci|container-gpu|cdi) ;;
  *) echo "check-node.sh: unknown pool $POOL: use vm-cpu, vm-gpu-pci, container-gpu or cdi" >&2; exit 2 ;;
esac
ROOT="${ROOT%/}"
if [ ! -r "$ROOT/proc/cpuinfo" ] || [ ! -d "$ROOT/sys" ]; then
  echo "check-node.sh: $ROOT/proc/cpuinfo or $ROOT/sys is missing: is --root the host's root?" >&2
  exit 2
fi

failed=0
row() {  # RESULT CHECK DETAIL [FIX]
  printf '%-5s %-22s %s\n' "$1" "$2" "$3"
  if [ "$1" = FAIL ]; then
    failed=1
    printf '%-5s %-22s fix: %s\n' "" "" "$4"
  elif [ "$1" = WARN ] && [ -n "${4:-}" ]; then
    printf '%-5s %-22s consider: %s\n' "" "" "$4"
  fi
}

module_present() {  # loaded or built in: both have /sys/module/NAME
  [ -d "$ROOT/sys/module/$1" ]
}

cpu_flag_count() {
  grep -Ec "^flags[[:space:]]*:.*\\b($1)\\b" "$ROOT/proc/cpuinfo" || true
}

printf '%-5s %-22s %s\n' RESULT CHECK DETAIL

# --- every VM node -------------------------------------------------------------------------------
if [ "$POOL" != cdi ]; then  # (CDI's pods run no VM)
  virt_cpus=$(cpu_flag_count 'vmx|svm')
  on_hypervisor=$(cpu_flag_count hypervisor)
  if [ "$virt_cpus" -gt 0 ]; then
    row PASS cpu-virtualisation "$virt_cpus CPUs have vmx/svm"
  elif [ "$on_hypervisor" -gt 0 ]; then
    row FAIL cpu-virtualisation "this node is itself a virtual machine and its CPUs have no vmx/svm" \
      "enable nested virtualisation on the hypervisor that runs this node"
  else
    row FAIL cpu-virtualisation "no CPU has vmx (Intel VT-x) or svm (AMD-V)" \
      "enable VT-x / AMD-V in the BIOS or UEFI setup"
  fi

  if grep -q '^vendor_id.*AuthenticAMD' "$ROOT/proc/cpuinfo"; then kvm_vendor=kvm_amd; else kvm_vendor=kvm_intel; fi
  if module_present kvm && module_present "$kvm_vendor"; then
    row PASS kvm-modules "kvm and $kvm_vendor are loaded"
  else
    row FAIL kvm-modules "kvm or $kvm_vendor is not loaded" \
      "modprobe $kvm_vendor, and list it in /etc/modules-load.d/kvm.conf so it loads at boot"
  fi

  for dev in kvm vhost-net net/tun; do
    case "$dev" in
      kvm) fix="load $kvm_vendor (above); without /dev/kvm KubeVirt can only emulate, too slow for workstations" ;;
      vhost-net) fix="modprobe vhost_net, and list it in /etc/modules-load.d/vhost-net.conf" ;;
      net/tun) fix="modprobe tun, and list it in /etc/modules-load.d/tun.conf" ;;
    esac
    if [ -e "$ROOT/dev/$dev" ]; then
      row PASS "dev-${dev//\//-}" "/dev/$dev exists"
    else
      row FAIL "dev-${dev//\//-}" "/dev/$dev is missing" "$fix"
    fi
  done

  nested_param="$ROOT/sys/module/$kvm_vendor/parameters/nested"
  if [ -r "$nested_param" ]; then
    case "$(cat "$nested_param")" in
      Y|1) row PASS nested-virtualisation "$kvm_vendor nested=$(cat "$nested_param") (guests may run VMs)" ;;
      *) row PASS nested-virtualisation "$kvm_vendor nested=$(cat "$nested_param"): guests cannot run VMs themselves (not needed)" ;;
    esac
  else
    row SKIP nested-virtualisation "$kvm_vendor is not loaded"
  fi

  if [ "$ROOT" != "" ]; then
    row SKIP virt-host-validate "not run against another root ($ROOT): run it on the node"
  elif command -v virt-host-validate >/dev/null 2>&1; then
    if validate_out=$(virt-host-validate qemu 2>&1); then
      row PASS virt-host-validate "virt-host-validate qemu found nothing wrong"
    elif grep -q ': FAIL' <<<"$validate_out"; then
      row FAIL virt-host-validate "$(grep ': FAIL' <<<"$validate_out" | head -3 | tr -s ' ' | paste -sd ';' -)" \
        "follow the hints virt-host-validate qemu prints"
    else
      row WARN virt-host-validate "$(grep ': WARN' <<<"$validate_out" | head -3 | tr -s ' ' | paste -sd ';' -)"
    fi
  else
    row SKIP virt-host-validate "not installed (libvirt-clients); the checks above cover its KVM ones"
  fi
fi

# --- the container runtime ------------------------------------------------------------------------
# CDI's importer and the workstations' launchers are not root: they open Block volumes only when the
# runtime hands devices to the pod's runAsUser (CDI's doc/block_cri_ownership_config.md). The
# importer runs where the CDI CR's workload placement lets it, not on the (tainted) VM pools:
# every such node needs it too (pool cdi).
if [ "$POOL" != container-gpu ]; then
  runtime_configs=()
  for conf in "$ROOT"/etc/containerd/config.toml "$ROOT"/etc/containerd/conf.d/*.toml \
              "$ROOT"/etc/crio/crio.conf "$ROOT"/etc/crio/crio.conf.d/*; do
    [ -f "$conf" ] && runtime_configs+=("$conf")
  done
  if [ ${#runtime_configs[@]} -eq 0 ]; then
    row WARN block-device-owner "no containerd or CRI-O config under $ROOT/etc: check the runtime's by hand" \
      "set device_ownership_from_security_context = true in the container runtime's CRI config"
  elif grep -Eqs '^[[:space:]]*device_ownership_from_security_context[[:space:]]*=[[:space:]]*true' "${runtime_configs[@]}"; then
    row PASS block-device-owner "device_ownership_from_security_context = true"
  else
    row FAIL block-device-owner "the runtime gives Block volumes to root only: CDI imports and non-root VMs fail" \
      "set device_ownership_from_security_context = true (containerd: [plugins.\"io.containerd.grpc.v1.cri\"], or [plugins.\"io.containerd.cri.v1.runtime\"] in containerd 2; CRI-O: [crio.runtime]) and restart the runtime"
  fi
fi

# --- GPUs ----------------------------------------------------------------------------------------
gpus=()
for dev in "$ROOT"/sys/bus/pci/devices/*; do
  [ -r "$dev/class" ] || continue
  class=$(cat "$dev/class"); vendor=$(cat "$dev/vendor")
  case "$class" in 0x0300*|0x0302*) ;; *) continue ;; esac  # VGA or 3D controller
  [[ ",$GPU_VENDORS," == *",${vendor#0x},"* ]] && gpus+=("$dev")
done

driver_of() {  # the driver a PCI device is bound to, or "none"
  if [ -L "$1/driver" ]; then basename "$(readlink "$1/driver")"; else echo none; fi
}

describe() {  # 0000:3b:00.0 (10de:20b0)
  echo "$(basename "$1") ($(sed 's/^0x//' "$1/vendor"):$(sed 's/^0x//' "$1/device"))"
}

# Counted without a pipeline: under set -e and pipefail, a find in a missing directory would end
# the script. The kernel makes /sys/kernel/iommu_groups at boot (iommu_init, drivers/iommu/iommu.c)
# and leaves it empty when the IOMMU is off; a kernel built without IOMMU support has none.
iommu_groups=0
for group in "$ROOT"/sys/kernel/iommu_groups/*; do
  if [ -d "$group" ]; then iommu_groups=$((iommu_groups + 1)); fi
done
cmdline=$(cat "$ROOT/proc/cmdline" 2>/dev/null || true)

if [ "$POOL" = vm-gpu-pci ]; then
  if [ "$iommu_groups" -gt 0 ]; then
    row PASS iommu "$iommu_groups IOMMU groups"
  else
    fix="enable VT-d / AMD-Vi in the BIOS and boot with intel_iommu=on iommu=pt (Intel) or iommu=pt (AMD)"
    if [ -d "$ROOT/sys/kernel/iommu_groups" ]; then
      row FAIL iommu "no IOMMU groups: the IOMMU is off" "$fix"
    else
      row FAIL iommu "no /sys/kernel/iommu_groups: the kernel has no IOMMU support" \
        "boot a kernel built with CONFIG_INTEL_IOMMU / CONFIG_AMD_IOMMU (distribution kernels are), then $fix"
    fi
  fi
  if [[ " $cmdline " == *" iommu=pt "* ]]; then
    row PASS iommu-passthrough "the kernel boots with iommu=pt"
  else
    row WARN iommu-passthrough "the kernel command line lacks iommu=pt" \
      "add iommu=pt to the kernel command line (host devices not passed through keep their speed)"
  fi
  missing=()
  for mod in vfio vfio_pci vfio_iommu_type1; do module_present "$mod" || missing+=("$mod"); done
  if [ ${#missing[@]} -eq 0 ]; then
    row PASS vfio-modules "vfio, vfio_pci and vfio_iommu_type1 are loaded"
  else
    row FAIL vfio-modules "${missing[*]} not loaded" \
      "modprobe ${missing[*]}, and list them in /etc/modules-load.d/vfio.conf"
  fi
  if [ ${#gpus[@]} -eq 0 ]; then
    row FAIL gpus "no GPU of vendor $GPU_VENDORS on the PCI bus" \
      "label this node for the vm-cpu pool, or pass --gpu-vendors with your GPUs' vendor ID"
  fi
  for gpu in "${gpus[@]}"; do
    driver=$(driver_of "$gpu")
    if [ "$driver" = vfio-pci ]; then
      row PASS gpu-binding "$(describe "$gpu") is bound to vfio-pci"
    else
      row FAIL gpu-binding "$(describe "$gpu") is bound to $driver, not vfio-pci" \
        "drain the node, then bind its GPUs to vfio-pci at boot: options vfio-pci ids=$(sed 's/^0x//' "$gpu/vendor"):$(sed 's/^0x//' "$gpu/device") and softdep $driver pre: vfio-pci in /etc/modprobe.d/vfio.conf, update the initramfs, reboot"
    fi
    if [ -L "$gpu/iommu_group" ]; then
      group=$(basename "$(readlink "$gpu/iommu_group")")
      others=()
      for member in "$ROOT/sys/kernel/iommu_groups/$group/devices/"*; do
        [ -e "$member" ] || continue  # the group's devices/ missing or empty: the pattern itself
        [ "$(basename "$member")" = "$(basename "$gpu")" ] && continue
        case "$(cat "$member/class" 2>/dev/null)" in 0x0604*) continue ;; esac  # PCI bridges stay with the host
        member_driver=$(driver_of "$member")
        case "$member_driver" in vfio-pci|none) ;; *) others+=("$(basename "$member") ($member_driver)") ;; esac
      done
      if [ ${#others[@]} -eq 0 ]; then
        row PASS iommu-group "$(basename "$gpu") is alone in IOMMU group $group (but for bridges and vfio-pci devices)"
      else
        row FAIL iommu-group "IOMMU group $group of $(basename "$gpu") also holds ${others[*]}" \
          "bind every device of group $group to vfio-pci too (its audio function, say), or move the GPU to a slot of its own group"
      fi
    elif [ "$iommu_groups" -gt 0 ]; then
      row FAIL iommu-group "$(basename "$gpu") is in no IOMMU group" "check that the IOMMU covers this slot"
    fi
  done
  conflicting=()
  for mod in nvidia nouveau amdgpu radeon; do module_present "$mod" && conflicting+=("$mod"); done
  if [ ${#conflicting[@]} -eq 0 ]; then
    row PASS driver-conflicts "no host GPU driver is loaded"
  else
    row WARN driver-conflicts "host GPU drivers are loaded: ${conflicting[*]}" \
      "blacklist ${conflicting[*]} on passthrough nodes so that no GPU is taken from vfio-pci at boot"
  fi
elif [ "$POOL" = container-gpu ]; then
  for gpu in "${gpus[@]}"; do
    driver=$(driver_of "$gpu")
    if [ "$driver" = vfio-pci ]; then
      row FAIL gpu-binding "$(describe "$gpu") is bound to vfio-pci on a container GPU node" \
        "unbind it from vfio-pci (remove its ids from /etc/modprobe.d/vfio.conf) or label the node for vm-gpu-pci"
    else
      row PASS gpu-binding "$(describe "$gpu") is bound to $driver"
    fi
  done
  [ ${#gpus[@]} -gt 0 ] || row WARN gpus "no GPU of vendor $GPU_VENDORS on the PCI bus"
elif [ "$POOL" = vm-cpu ]; then
  vfio_gpus=()
  for gpu in "${gpus[@]}"; do [ "$(driver_of "$gpu")" = vfio-pci ] && vfio_gpus+=("$(basename "$gpu")"); done
  if [ ${#vfio_gpus[@]} -gt 0 ]; then
    row WARN gpus "GPUs bound to vfio-pci on a CPU workstation node: ${vfio_gpus[*]}" \
      "label this node for the vm-gpu-pci pool so that the GPUs are used"
  fi
fi

if [ "$failed" -eq 0 ]; then
  echo "node ready for pool $POOL"
else
  echo "node NOT ready for pool $POOL: fix the FAIL rows above and run this again"
fi
exit "$failed"
