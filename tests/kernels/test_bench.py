"""Smoke test of `python -m kernels.bench` at the smallest budget (CPU sanity table without a GPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def run_bench(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "kernels.bench", f"hydra.run.dir={tmp_path}", "hydra.output_subdir=null"]
    return subprocess.run([*cmd, *overrides], cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU path; the GPU path has its own test")
def test_bench_cpu_smoke(tmp_path: Path) -> None:
    proc = run_bench(tmp_path, "tokens=[1,2]", "iters=1", "rotations=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "No CUDA GPU present" in out and "GPU figures are pending" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("cpu_tiny")]
    assert [int(r[1]) for r in rows] == [1, 2]
    assert all(r[5] == "n/a" and float(r[8]) > 0 for r in rows)  # no Triton timing, a reference timing


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU path; the GPU path has its own test")
def test_bench_leaves_no_hydra_folder(tmp_path: Path) -> None:
    """Plain `python -m kernels.bench` runs where it is started and writes no outputs/ or .hydra/ there."""
    cmd = [sys.executable, "-m", "kernels.bench", "tokens=[1]", "iters=1", "rotations=1"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(tmp_path.iterdir()) == []


def test_bench_rejects_unknown_model(tmp_path: Path) -> None:
    proc = run_bench(tmp_path, "models=[nope]", "cpu_models=[nope]")
    assert proc.returncode != 0 and "unknown model shapes" in proc.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bench_gpu_smoke(tmp_path: Path) -> None:
    proc = run_bench(tmp_path, "models=[qwen3_30b_a3b]", "tokens=[8]", "iters=2", "rotations=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "qwen3_30b_a3b" in proc.stdout


def test_bench_gpu_table_logic_on_cpu(triton_cpu: None, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """The GPU table and tune output, driven on CPU tensors (interpreter) with eager timing."""
    from kernels import bench
    from kernels.fused_moe import MoeBlockConfig

    monkeypatch.setattr(bench, "time_graph", lambda fns, iters: (bench.time_eager(fns, 1, cuda=False), "graph"))
    monkeypatch.setattr(bench, "tune_grid", lambda T: [MoeBlockConfig(), MoeBlockConfig(BLOCK_N=32)])
    cfg = bench.BenchConfig(models=["cpu_tiny"], tokens=[1, 4], dtype="float32", iters=1, rotations=2, tune=True)
    bench.run_gpu(cfg, device="cpu")
    out = capsys.readouterr().out
    assert "unknown GPU 'cpu'" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("cpu_tiny")]
    assert [int(r[1]) for r in rows] == [1, 4]
    assert all(float(r[5]) > 0 and float(r[-1]) < 1e-4 for r in rows)  # Triton timed, matches reference
    assert '"max_tokens": 4' in out and out.count("tuned MoeBlockConfig") == 2
