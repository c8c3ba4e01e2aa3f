#!/bin/bash
# build.sh's customize step, run by mmdebstrap on the build machine once the target's packages are
# installed: ROOT is the image's root directory (with /dev, /proc and /sys mounted into it).
#
#   customize.sh ROOT      (settings from build.sh's environment: KVS_*)
#
# It installs the recipe's files, /opt/jupyter from the wheels build.sh downloaded for the
# target's Python, code-server (code-server.sh), GRUB's boot images made by the target's own GRUB, the NVIDIA module built
# for the target's kernel (with --gpu nvidia), and seals the image last.
set -euo pipefail
root=${1:?usage: customize.sh ROOT}
here=${KVS_HERE:?customize.sh runs from build.sh}
in_root() { chroot "$root" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin "$@"; }

# the target's Python is the one the wheels were downloaded for (their ABI must match)
target_python=$(in_root python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [ "$target_python" != "$KVS_PYTHON" ]; then
  echo "customize.sh: this suite's python3 is $target_python, the wheels are for $KVS_PYTHON: fix the suite's Python in build.sh" >&2
  exit 1
fi

# the recipe's files
install -m 0644 "$here/kubevirt-workstation.service" "$here/ssh-host-keys.service" "$root/etc/systemd/system/"
install -m 0755 "$here/verify-clone.sh" "$here/seal.sh" "$root/usr/local/sbin/"
install -m 0644 "$here/cloud.cfg" "$root/etc/cloud/cloud.cfg.d/90-kubevirt-workstation.cfg"
install -m 0644 "$here/network.network" "$root/etc/systemd/network/20-workstation.network"
install -m 0440 "$here/sudoers" "$root/etc/sudoers.d/kubevirt-workstation"
install -m 0644 "$here/sshd.conf" "$root/etc/ssh/sshd_config.d/10-kubevirt-workstation.conf"
# sshd's AuthorizedKeysCommandUser: an account for nothing else, which (through its group) reads
# the launcher's access file of each boot, the server's token with it (guest/keys.py)
in_root useradd --system --user-group --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin kubevirt-keys
sed -e "s/@ROOT_UUID@/$KVS_ROOT_UUID/" -e "s/@ESP_ID@/${KVS_ESP_ID:0:4}-${KVS_ESP_ID:4:4}/" "$here/fstab" > "$root/etc/fstab"
mkdir -p "$root/boot/efi" "$root/etc/kubevirt-workstation" "$root/usr/share/doc/kubevirt-workstation"
install -m 0644 "$here/README.md" "$root/usr/share/doc/kubevirt-workstation/README.md"
echo kubevirt-workstation > "$root/etc/hostname"

# /opt/jupyter, offline, from the wheels downloaded on the host
mkdir -p "$root/tmp/wheels"
cp "$KVS_WHEELS"/* "$root/tmp/wheels/"
in_root python3 -m venv /opt/jupyter
in_root /opt/jupyter/bin/pip install --quiet --no-index --find-links /tmp/wheels \
  -r /tmp/wheels/requirements.txt "/tmp/wheels/$(cd "$root/tmp/wheels" && ls kubevirt_spawner-*.whl)[guest]"
rm -rf "$root/tmp/wheels"

# VS Code in the browser (unless build.sh --no-code-server)
[ "${KVS_CODE_SERVER:-no}" = no ] || "$here/code-server.sh" "$root"

# networking by systemd-networkd for whatever the NIC is called (the VM's network data names
# none). qemu-guest-agent needs no enabling: udev starts it when its virtio port appears
in_root systemctl enable kubevirt-workstation.service ssh-host-keys.service systemd-timesyncd.service \
  systemd-networkd.service systemd-resolved.service
ln -sf ../run/systemd/resolve/stub-resolv.conf "$root/etc/resolv.conf"
for unit in cloud-init cloud-config cloud-final; do
  install -D -m 0644 "$here/cloud-init-background.conf" "$root/etc/systemd/system/$unit.service.d/50-background.conf"
done
install -D -m 0644 "$here/qemu-guest-agent-early.conf" "$root/etc/systemd/system/qemu-guest-agent.service.d/50-early.conf"

# A small initramfs (36 MB with Debian's MODULES=most, read by GRUB and unpacked at every boot):
# only what finds and mounts the root of a KubeVirt VM, on each disk bus KubeVirt offers (virtio,
# sata, scsi). Kept for the kernels users install later.
install -m 0644 "$here/initramfs.conf" "$root/etc/initramfs-tools/conf.d/90-kubevirt-workstation.conf"
cat "$here/initramfs-modules" >> "$root/etc/initramfs-tools/modules"
in_root update-initramfs -u -k all

# The kernel: the newest the image has, with its initramfs.
kernel_version=$(find "$root/boot" -maxdepth 1 -name 'vmlinuz-*' -printf '%f\n' | sed 's/^vmlinuz-//' | sort -V | tail -1)
if [ -z "$kernel_version" ] || [ ! -s "$root/boot/initrd.img-$kernel_version" ]; then
  echo "customize.sh: the image has no kernel and initramfs in /boot" >&2; exit 1
fi
mkdir -p "$KVS_GRUB_OUT"
echo "$kernel_version" > "$KVS_GRUB_OUT/kernel-version"
cp "$root/boot/vmlinuz-$kernel_version" "$KVS_GRUB_OUT/vmlinuz"

# NVIDIA: the DKMS module built for the image's kernel (not the build machine's) and checked there
echo '[]' > "$KVS_GRUB_OUT/modules.json"
if [ "${KVS_GPU:-}" = nvidia ]; then
  in_root dkms autoinstall -k "$kernel_version"
  modules=()
  for module in nvidia-current nvidia-current-uvm; do
    info=$(in_root modinfo -k "$kernel_version" -F vermagic "$module") || {
      echo "customize.sh: the $module module was not built for $kernel_version (dkms status: $(in_root dkms status))" >&2; exit 1; }
    case $info in "$kernel_version "*) ;; *) echo "customize.sh: $module is for ${info%% *}, not $kernel_version" >&2; exit 1;; esac
    modules+=("\"$module\"")
  done
  (IFS=,; echo "[${modules[*]}]") > "$KVS_GRUB_OUT/modules.json"
  in_root sh -c "command -v nvidia-smi" >/dev/null || { echo "customize.sh: nvidia-smi is not on the PATH" >&2; exit 1; }
fi

# GRUB, from the target's packages: /boot/grub holds its modules and the configuration, both
# boot images carry an early configuration that finds the root filesystem by its UUID.
for platform in i386-pc x86_64-efi; do
  mkdir -p "$root/boot/grub/$platform"
  cp "$root/usr/lib/grub/$platform/"*.mod "$root/usr/lib/grub/$platform/"*.lst "$root/boot/grub/$platform/"
done
# shellcheck disable=SC2016  # ($root is GRUB's variable)
printf 'search --no-floppy --fs-uuid --set=root %s\nset prefix=($root)/boot/grub\n' "$KVS_ROOT_UUID" > "$root/tmp/early.cfg"
in_root grub-mkimage -O i386-pc -c /tmp/early.cfg -p /boot/grub -o /tmp/core.img \
  biosdisk part_gpt ext2 search search_fs_uuid
in_root grub-mkimage -O x86_64-efi -c /tmp/early.cfg -p /boot/grub -o /tmp/BOOTX64.EFI \
  part_gpt ext2 search search_fs_uuid
mv "$root/tmp/core.img" "$root/tmp/BOOTX64.EFI" "$KVS_GRUB_OUT/"
cp "$root/usr/lib/grub/i386-pc/boot.img" "$KVS_GRUB_OUT/"
rm -f "$root/tmp/early.cfg"
# Debian keeps the kernel's links in /, Ubuntu in /boot (kernel-img.conf's link_in_boot); the
# kernel package moves them on every upgrade, so the configuration never names a version.
link=/vmlinuz; [ -e "$root$link" ] || link=/boot/vmlinuz
sed -e "s|@ROOT_UUID@|$KVS_ROOT_UUID|g" -e "s|@LINK_DIR@|${link%/vmlinuz}|g" "$here/grub.cfg" > "$root/boot/grub/grub.cfg"

in_root /usr/local/sbin/seal.sh /
