#!/usr/bin/env bash
# Set up (idempotently) and run every check and test. Used by the README's quick start and by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
if ! command -v kubectl >/dev/null 2>&1; then
  echo "kubectl is needed by the kubectl contract tests; install kubectl 1.32" >&2
  exit 1
fi
# The browser tests drive Debian's Chromium (never a browser Playwright downloads).
if [ ! -x /usr/bin/chromium ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "== installing Debian's chromium for the browser tests"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null || {
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }
  else
    echo "/usr/bin/chromium is needed by the browser tests: apt-get install chromium" >&2
    exit 1
  fi
fi
echo "== ruff (pyflakes, import order, bugbear)"
python3 -m ruff check .
echo "== mypy (production modules)"
python3 -m mypy
echo "== import contracts (production never imports the simulator)"
lint-imports --no-cache
echo "== pytest"
python3 -m pytest -q "$@"
