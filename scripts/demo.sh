#!/usr/bin/env bash
# Set up (idempotently) and run the local demo: simulator + proxy + JupyterHub on port 8000.
# Extra arguments go to `kubevirt-spawner demo` (e.g. --port 8080 --speed 10).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec kubevirt-spawner demo --state ./demo-state "$@"
