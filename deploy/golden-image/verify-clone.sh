#!/bin/sh
# Run inside a workstation (a clone of the golden image) to check it got its own identity: a
# machine-id, SSH host keys made after the image was sealed, and cloud-init's instance of this VM.
# Prints one line per check and exits 1 when any fails.
set -u
failed=0
check() {  # check NAME CONDITION-COMMAND...
  name=$1; shift
  if "$@" >/dev/null 2>&1; then echo "ok    $name"; else echo "FAIL  $name"; failed=1; fi
}
# cloud-init's later stages run in the background beside Jupyter: wait for them (2 minutes at most)
timeout 120 cloud-init status --wait >/dev/null 2>&1 || true
sealed=$(cat /etc/kubevirt-workstation/sealed-at 2>/dev/null || echo 0)
machine_id=$(cat /etc/machine-id 2>/dev/null || true)
check "machine-id is set (not the sealed image's 'uninitialized')" \
  sh -c "echo '$machine_id' | grep -Eq '^[0-9a-f]{32}$'"
check "SSH host keys exist" test -s /etc/ssh/ssh_host_ed25519_key
# shellcheck disable=SC2317  # (called through check)
newer_keys() {
  for key in /etc/ssh/ssh_host_*_key; do
    [ "$(stat -c %Y "$key")" -ge "$sealed" ] || return 1
  done
}
check "SSH host keys were made after the image was sealed" newer_keys
check "cloud-init ran for this instance" test -e /var/lib/cloud/instance/boot-finished
check "the guest agent runs (it is in the image: nothing is installed at boot)" \
  systemctl is-active --quiet qemu-guest-agent.service
check "no network config matches a MAC address" \
  sh -c "! grep -rqs 'macaddress\|hwaddress' /etc/netplan /etc/network/interfaces /etc/network/interfaces.d /etc/systemd/network"
echo "machine-id: $machine_id"
ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub 2>/dev/null | sed 's/^/ed25519 host key: /'
exit $failed
