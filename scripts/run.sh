#!/usr/bin/env bash
# Set up .venv (first run only) and run the main job: record traces -> train a controller -> evaluate it
# against every baseline (python -m ctrl). Any Hydra override passes through, e.g. `bash scripts/run.sh seeds=[0]`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >/tmp/expertspec-setup.log 2>&1 || { cat /tmp/expertspec-setup.log; exit 1; }
exec .venv/bin/python -m ctrl "$@"
