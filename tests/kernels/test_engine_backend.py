"""The engine forced onto the Triton expert kernels (interpreter on CPU) decodes like the torch reference."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, "tests/engine")
    import engine
    from engine.models.checkpoint import build_model
    from hf_configs import tiny_config
    target = build_model(tiny_config("qwen2_moe", num_experts=5, num_experts_per_tok=2), seed=3)
    prompts = [[5, 7, 9, 11], [1, 2, 3]]
    ref = engine.Engine(target, backend="torch").generate(prompts, 6)
    tri = engine.Engine(target, backend="triton").generate(prompts, 6)
    assert [r.token_ids for r in ref] == [r.token_ids for r in tri], "triton backend changed the tokens"
    print("OK")
    """
)


@pytest.mark.slow
def test_engine_triton_backend_matches_torch_reference():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
