"""When triton was imported before TRITON_INTERPRET=1 could be set (whole-suite runs, GPU machines),
rerun the interpreter-based kernel tests in a fresh process that sets it first."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels._launch import interpreter_active
from kernels.moe_align import _moe_align_kernel

ROOT = Path(__file__).resolve().parents[2]


def test_interpreter_tests_in_subprocess(request: pytest.FixtureRequest) -> None:
    if interpreter_active(_moe_align_kernel):
        pytest.skip("interpreter active in this process: the kernel tests ran here")
    markexpr = request.config.getoption("markexpr") or ""
    select = f"({markexpr}) and not gpu" if markexpr else "not gpu"
    files = ["tests/kernels/test_moe_align.py", "tests/kernels/test_fused_moe.py"]
    cmd = [sys.executable, "-m", "pytest", *files, "-q", "-p", "no:cacheprovider", "-m", select]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
