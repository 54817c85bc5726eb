#!/usr/bin/env bash
# Create .venv and install expertspec with its test/benchmark extras.
# On a machine without an NVIDIA GPU, pin the local CPU build of torch first so that
# no multi-GB CUDA wheel is downloaded.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
STAMP=.venv/.expertspec-installed
if [ -f "$STAMP" ] && [ "$STAMP" -nt pyproject.toml ] && [ "$STAMP" -nt scripts/constraints.txt ]; then
  exit 0
fi
python -m pip install --quiet --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    python -m pip install --quiet "torch==2.13.0"
  else
    python -m pip install --quiet "torch==2.13.0" --extra-index-url https://download.pytorch.org/whl/cpu --timeout 10 --retries 0 \
      || python -m pip install --quiet "torch==2.13.0"
  fi
fi
# within the versions the suite last passed with (scripts/constraints.txt); from the ranges alone if those cannot
# install here (another Python, say) or with EXPERTSPEC_UNPINNED=1
if [ "${EXPERTSPEC_UNPINNED:-0}" = 1 ] || ! python -m pip install --quiet -e ".[test]" -c scripts/constraints.txt; then
  echo "setup: installing from pyproject.toml's version ranges, not scripts/constraints.txt" >&2
  python -m pip install --quiet -e ".[test]"
fi
# a venv that once held transformers >= 5.25 keeps Hugging Face's `kernels`, whose import name is ours
# (engine/bench/hf_reference.py); nothing of ours needs it
if python -c "import importlib.metadata as m; m.version('kernels')" 2>/dev/null; then
  python -m pip uninstall --quiet -y kernels
fi
# build the C++ CPU extensions once now (~80 s: kernels/small_m.py, kernels/cpu_decode.py, kernels/tanh_mlp.py,
# kernels/lookup.py), so no later run pays for them; never fatal (their Python twins run without them)
python -c "from kernels import small_m; print('CPU small-M kernel:', small_m.status())" || true
python -c "from kernels import cpu_decode; print('fused CPU decode ops:', cpu_decode.status())" || true
python -c "from kernels import tanh_mlp; print('C++ policy actor:', tanh_mlp.status())" || true
python -c "from kernels import lookup; print('C++ prompt lookup:', lookup.status())" || true
touch "$STAMP"
