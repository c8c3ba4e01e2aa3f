#!/usr/bin/env bash
# Set up (idempotently) and run every check and test. Used by the README's quick start and by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
if ! command -v kubectl >/dev/null 2>&1; then
  echo "kubectl is needed by the kubectl contract tests; install kubectl 1.32" >&2
  exit 1
fi
# Debian packages the tests use: Chromium for the browser tests (never a browser Playwright
# downloads); xorriso for the configuration disks of QEMU guests; mmdebstrap, fdisk, dosfstools
# and mtools (the EFI partition) for the golden image; QEMU and OVMF (UEFI firmware; SeaBIOS comes
# with QEMU) to boot it; dnsmasq and iproute2 for a guest on a dual-stack pod network (the DHCP
# servers of virt-launcher's masquerade binding, a network namespace); shellcheck for the deploy
# scripts; g++, make and the Kerberos headers for code-server's native modules in the golden image.
needed=()
for pair in /usr/bin/chromium:chromium /usr/bin/xorrisofs:xorriso /usr/bin/mmdebstrap:mmdebstrap \
            /usr/sbin/sfdisk:fdisk /usr/sbin/mkfs.fat:dosfstools /usr/bin/mcopy:mtools \
            /usr/bin/qemu-system-x86_64:qemu-system-x86 /usr/bin/qemu-img:qemu-utils \
            /usr/share/OVMF/OVMF_CODE_4M.fd:ovmf /usr/sbin/dnsmasq:dnsmasq-base /usr/sbin/ip:iproute2 \
            /usr/bin/shellcheck:shellcheck /usr/bin/g++:g++ /usr/bin/make:make \
            /usr/include/gssapi/gssapi.h:libkrb5-dev; do
  [ -e "${pair%%:*}" ] || needed+=("${pair#*:}")
done
if [ ${#needed[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "== installing Debian packages the tests need: ${needed[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${needed[@]}" >/dev/null || {
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${needed[@]}" >/dev/null; }
  else
    echo "the tests need these Debian packages: apt-get install ${needed[*]}" >&2
    exit 1
  fi
fi
echo "== ruff (pyflakes, import order, bugbear)"
python3 -m ruff check .
echo "== mypy (production modules)"
python3 -m mypy
echo "== import contracts (production never imports the simulator)"
lint-imports --no-cache
echo "== documentation site (Sphinx, warnings as errors)"
docs_out=$(mktemp -d)
python3 -m sphinx -W --keep-going -q -b html docs "$docs_out"
rm -rf "$docs_out"
echo "== pytest"
# One pytest-xdist worker per CPU (at most four): the QEMU guests run on one of them while the others
# take the rest (tests/conftest.py groups them). The slowest tests are listed at the end, so what
# makes CI long shows in its log.
python3 -m pytest -q -n auto --maxprocesses 4 --dist loadgroup --durations=25 "$@"
