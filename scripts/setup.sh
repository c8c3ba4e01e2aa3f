#!/usr/bin/env bash
# Install (idempotently) what the demo and the tests need: the Python package with its test
# extras (its build compiles the JupyterLab extension in labextension/ with jlpm, from the npm
# registry and the committed yarn.lock), and configurable-http-proxy from npm (into ./node_modules).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v npm >/dev/null 2>&1; then
  echo "Node.js 18 or newer with npm is needed (the JupyterLab extension's build, configurable-http-proxy)" >&2
  exit 1
fi
python3 -m pip install --quiet --disable-pip-version-check -e '.[test]'
python3 -m pip install --quiet --disable-pip-version-check -r docs/requirements.txt  # the docs site's build
if [ ! -x node_modules/.bin/configurable-http-proxy ]; then
  npm ci --no-audit --no-fund --loglevel=error
fi
