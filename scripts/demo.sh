#!/usr/bin/env bash
# Set up .venv (first run only) and run the expertspec demo with its default configuration.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >/tmp/expertspec-setup.log 2>&1 || { cat /tmp/expertspec-setup.log; exit 1; }
exec .venv/bin/python -m engine.demo "$@"
