#!/usr/bin/env bash
# Set up .venv (first run only) and run the whole test suite (slow tests included), then ruff.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >/tmp/expertspec-setup.log 2>&1 || { cat /tmp/expertspec-setup.log; exit 1; }
.venv/bin/ruff check .
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
