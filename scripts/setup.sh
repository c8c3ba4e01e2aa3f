#!/usr/bin/env bash
# Install (idempotently) what the demo and the tests need: the Python package with its test
# extras, and configurable-http-proxy from npm (into ./node_modules).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet --disable-pip-version-check -e '.[test]'
if ! command -v npm >/dev/null 2>&1; then
  echo "npm (Node.js 18 or newer) is needed for configurable-http-proxy" >&2
  exit 1
fi
if [ ! -x node_modules/.bin/configurable-http-proxy ]; then
  npm ci --no-audit --no-fund --loglevel=error
fi
