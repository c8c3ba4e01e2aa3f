#!/bin/bash
# Build and seal a workstation golden image from distribution packages and pinned PyPI packages.
#
#   deploy/golden-image/build.sh [--suite bookworm] [--size 4G] [--out DIR] [--cache DIR] [--wheel FILE]
#
# Output (in DIR, default: the cache entry of this recipe; its path is the last line printed):
#   disk.raw      a GPT disk: partition 1 is the root filesystem (ext4, label kvs-root), sized --size
#   vmlinuz, initrd.img   the image's kernel and initramfs, for a direct kernel boot (the test image:
#                 qemu -kernel vmlinuz -initrd initrd.img -append "root=LABEL=kvs-root ro console=ttyS0")
#   image.json    what was built: suite, packages, Python pins, the recipe's hash, the build's duration
# A production image adds a bootloader (see README.md); KubeVirt imports disk.raw into the golden PVC.
#
# Needs root (mmdebstrap --mode=root, chroot), mmdebstrap, e2fsprogs (mkfs.ext4 -d), fdisk (sfdisk),
# and Python 3 with pip on the host: pip inside the image's chroot does not trust this machine's
# proxy CA, so wheels are downloaded on the host and installed offline in the image.
# Builds are cached by a hash of the recipe (this directory, the suite, the size, the apt sources
# and this project's wheel): the same recipe is built once.
# mmdebstrap's hooks get the root directory as "$1": they are single-quoted on purpose.
# shellcheck disable=SC2016
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
suite=bookworm
size=4G
out=""
cache=${KUBEVIRT_GOLDEN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kubevirt-spawner/golden-image}
wheel=""
sources=""
while [ $# -gt 0 ]; do
  case $1 in
    --suite) suite=$2; shift 2;;
    --size) size=$2; shift 2;;
    --out) out=$2; shift 2;;
    --cache) cache=$2; shift 2;;
    --wheel) wheel=$2; shift 2;;
    --sources) sources=$2; shift 2;;
    -h|--help) sed -n '2,20p' "$0"; exit 0;;
    *) echo "build.sh: unknown option $1 (see --help)" >&2; exit 2;;
  esac
done
[ "$(id -u)" = 0 ] || { echo "build.sh: run as root (mmdebstrap --mode=root and chroot need it)" >&2; exit 1; }
for tool in mmdebstrap mkfs.ext4 sfdisk; do
  command -v "$tool" >/dev/null || { echo "build.sh: $tool is missing: apt-get install mmdebstrap e2fsprogs fdisk" >&2; exit 1; }
done

# apt sources: the host's (a mirror or proxy it has), else Debian's own
if [ -z "$sources" ]; then
  for f in /etc/apt/sources.list.d/debian.sources /etc/apt/sources.list; do
    [ -s "$f" ] && { sources=$f; break; }
  done
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/golden-image.XXXXXX")
mkdir -p "$work/boot"
trap 'rm -rf "$work"' EXIT

# this project's guest package, as a wheel (built from the checkout unless given)
if [ -z "$wheel" ]; then
  python3 -m pip wheel --quiet --no-deps --wheel-dir "$work/own" "$repo"
  wheel=$(ls "$work"/own/kubevirt_spawner-*.whl)
fi

key=$( { cat "$here"/build.sh "$here"/seal.sh "$here"/requirements.txt "$here"/kubevirt-workstation.service \
               "$here"/ssh-host-keys.service "$here"/fstab "$here"/cloud.cfg "$here"/verify-clone.sh "$here"/sudoers;
         echo "$suite $size"; [ -n "$sources" ] && sed 's/#.*//' "$sources";
         unzip -p "$wheel" 2>/dev/null | sha256sum; } | sha256sum | cut -c1-16)
out=${out:-$cache/$key}
if [ -s "$out/image.json" ] && grep -q "\"recipe\": \"$key\"" "$out/image.json"; then
  echo "build.sh: $out is this recipe's image (cached)" >&2
  echo "$out"
  exit 0
fi
started=$(date +%s)

echo "build.sh: Python packages for the image (on the host)"
mkdir -p "$work/wheels"
cp "$wheel" "$work/wheels/"
cp "$here/requirements.txt" "$work/wheels/requirements.txt"
python3 -m pip download --quiet --dest "$work/wheels" --only-binary=:all: \
  --python-version 3.11 --implementation cp --abi cp311 --platform manylinux2014_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform any \
  -r "$here/requirements.txt" "$(basename "$wheel" | sed 's/-.*//; s/_/-/g')[guest] @ file://$wheel"

packages=(
  linux-image-amd64 systemd-sysv systemd-timesyncd udev dbus
  cloud-init cloud-guest-utils ifupdown isc-dhcp-client
  qemu-guest-agent openssh-server sudo logrotate
  python3 python3-venv ca-certificates less nano
  e2fsprogs
)
echo "build.sh: the $suite root filesystem (mmdebstrap)"
mmdebstrap --mode=root --variant=important --include="$(IFS=,; echo "${packages[*]}")" \
  --customize-hook="copy-in $work/wheels /tmp" \
  --customize-hook="copy-in $here/kubevirt-workstation.service $here/ssh-host-keys.service /etc/systemd/system" \
  --customize-hook="copy-in $here/verify-clone.sh $here/seal.sh /usr/local/sbin" \
  --customize-hook="upload $here/fstab /etc/fstab" \
  --customize-hook="upload $here/cloud.cfg /etc/cloud/cloud.cfg.d/90-kubevirt-workstation.cfg" \
  --customize-hook="upload $here/sudoers /etc/sudoers.d/kubevirt-workstation" \
  --customize-hook='chmod 0440 "$1/etc/sudoers.d/kubevirt-workstation"' \
  --customize-hook='chroot "$1" python3 -m venv /opt/jupyter' \
  --customize-hook='chroot "$1" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin /opt/jupyter/bin/pip install --quiet --no-index --find-links /tmp/wheels \
      -r /tmp/wheels/requirements.txt "/tmp/wheels/$(cd "$1/tmp/wheels" && ls kubevirt_spawner-*.whl)[guest]"' \
  --customize-hook='chroot "$1" systemctl enable kubevirt-workstation.service ssh-host-keys.service \
      systemd-timesyncd.service' \
  --customize-hook='mkdir -p "$1/etc/kubevirt-workstation" "$1/usr/share/doc/kubevirt-workstation"' \
  --customize-hook="upload $here/README.md /usr/share/doc/kubevirt-workstation/README.md" \
  --customize-hook='echo kubevirt-workstation > "$1/etc/hostname"' \
  --customize-hook="sync-out /boot $work/boot" \
  --customize-hook='chroot "$1" /usr/local/sbin/seal.sh /' \
  "$suite" "$work/root" ${sources:+"$sources"}

echo "build.sh: the disk image"
mkdir -p "$out"
truncate -s 0 "$out/disk.raw.new"
truncate -s "$size" "$out/disk.raw.new"
# GPT, one Linux partition from 1 MiB to the end; built in a file, no loop device
printf 'label: gpt\nstart=2048, type=0FC63DAF-8483-4772-8E79-3D69D8477DE4, name=root\n' | sfdisk --quiet "$out/disk.raw.new"
start=$(sfdisk --json "$out/disk.raw.new" | python3 -c 'import json,sys; print(json.load(sys.stdin)["partitiontable"]["partitions"][0]["start"])')
sectors=$(sfdisk --json "$out/disk.raw.new" | python3 -c 'import json,sys; print(json.load(sys.stdin)["partitiontable"]["partitions"][0]["size"])')
mkfs.ext4 -q -F -L kvs-root -d "$work/root" -E offset=$((start * 512)) "$out/disk.raw.new" $((sectors / 2))k
cp "$work"/boot/vmlinuz-* "$out/vmlinuz"
cp "$work"/boot/initrd.img-* "$out/initrd.img"
mv "$out/disk.raw.new" "$out/disk.raw"
python3 - "$out/image.json" "$key" "$suite" "$size" "$(( $(date +%s) - started ))" "${packages[*]}" "$here/requirements.txt" <<'PY'
import json, sys
path, key, suite, size, seconds, packages, requirements = sys.argv[1:]
pins = [line.strip() for line in open(requirements) if line.strip() and not line.startswith("#")]
json.dump({"recipe": key, "suite": suite, "size": size, "build_seconds": int(seconds),
           "packages": packages.split(), "python": pins, "disk": "disk.raw", "kernel": "vmlinuz",
           "initrd": "initrd.img", "cmdline": "root=LABEL=kvs-root ro console=ttyS0"}, open(path, "w"), indent=1)
PY
echo "build.sh: built $out in $(( $(date +%s) - started )) s" >&2
echo "$out"
