#!/bin/sh
# Seal a golden image: leave nothing that must differ between two clones, and nothing secret.
# Run it as root inside the image as the last step before it is captured: in a chroot (build.sh
# does), or in a booted template VM, which is then shut down and never booted again before it is
# imported (the design document, 7.1). Usage: seal.sh [ROOT]  (default /: the running system)
set -eu
root=${1:-/}
in_root() { chroot "$root" "$@"; }

# cloud-init: a clone's first boot is a new instance (KubeVirt's instance-id differs per VM name);
# `--configs all` (cloud-init 23.4 and later) removes what it rendered, older versions are helped below.
if in_root cloud-init clean --help 2>/dev/null | grep -q -- '--configs'; then
  in_root cloud-init clean --logs --machine-id --configs all
else
  in_root cloud-init clean --logs
  # what 23.4's --configs all removes: rendered network configs, SSH drop-ins, the network flag
  rm -f "$root/etc/network/interfaces.d/50-cloud-init" "$root/etc/network/interfaces.d/50-cloud-init.cfg" \
        "$root/etc/netplan/50-cloud-init.yaml" "$root"/etc/systemd/network/10-cloud-init-*.network \
        "$root/etc/ssh/sshd_config.d/50-cloud-init.conf" "$root/etc/sudoers.d/90-cloud-init-users" \
        "$root/etc/cloud/cloud.cfg.d/99-installer.cfg"
fi
# systemd makes a fresh machine-id at the next boot (ConditionFirstBoot; machine-id(5))
printf 'uninitialized\n' > "$root/etc/machine-id"
rm -f "$root/var/lib/dbus/machine-id"
# no host keys: each clone makes its own (cloud-init's cc_ssh, else ssh-host-keys.service)
rm -f "$root"/etc/ssh/ssh_host_*
# no network config that matches a MAC: the VM's NIC is named enp1s0, whatever its MAC
if grep -rqs 'macaddress\|hwaddress' "$root/etc/netplan" "$root/etc/network/interfaces" \
     "$root/etc/network/interfaces.d" "$root/etc/systemd/network"; then
  echo "seal: a network config still matches a MAC address; remove it (see the design document, 7.1)" >&2
  exit 1
fi
# no secrets, histories, logs or caches of the build
rm -f "$root"/root/.bash_history "$root"/home/*/.bash_history "$root"/root/.python_history \
      "$root"/root/.lesshst "$root"/root/.wget-hsts "$root/etc/kubevirt-workstation/build-secrets"
rm -rf "$root"/root/.cache "$root"/root/.ssh "$root"/tmp/* "$root"/var/tmp/* "$root"/var/lib/apt/lists/* \
       "$root"/var/cache/apt/*.bin "$root"/var/lib/cloud/*
find "$root/var/log" -type f \( -name '*.gz' -o -name '*.[0-9]' -o -name '*.old' \) -delete
find "$root/var/log" -type f -exec truncate -s 0 {} +
# the sealed image records when it was sealed: a clone's keys and machine-id are newer
date -u +%s > "$root/etc/kubevirt-workstation/sealed-at"
echo "seal: sealed $root"
