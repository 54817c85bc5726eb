"""Smoke tests of the entry points at the smallest budget (subprocesses, fake zoo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def _run(args: list[str], zoo: Path, cwd: Path, timeout: int = 300, stderr: list | None = None) -> str:
    env = dict(os.environ, EXPERTSPEC_ZOO=str(zoo), PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-m", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    if stderr is not None:
        stderr.append(proc.stderr)
    return proc.stdout


def test_demo_smoke(fake_zoo, tmp_path):
    out = _run(["engine.demo", "new_tokens=8", "show_text=false"], fake_zoo, tmp_path)
    assert "target-only" in out and "dense drafter" in out and "n-gram" in out
    assert "False" not in out.split("identical")[-1]  # every speculative run reproduced the text


def test_bench_decode_smoke(fake_zoo, tmp_path):
    out = _run(
        ["engine.bench", "new_tokens=4", "repeats=1", "batch_sizes=[1,2]", "bound.enabled=false", "out=b.json"],
        fake_zoo,
        tmp_path,
    )
    assert "ratio" in out
    res = json.loads((tmp_path / "b.json").read_text())
    assert res["batch1"]["ours_tok_s"] > 0 and res["batch1"]["speedup"] > 0
    assert res["verify_curve"][0]["tokens"] == 1


def test_bench_spec_smoke(fake_zoo, tmp_path):
    out = _run(
        [
            "engine.bench",
            "spec",
            "new_tokens=6",
            "repeats=1",
            "num_prompts=1",
            "depths=[0,2]",
            "widths=[1,2]",
            "out=s.json",
        ],
        fake_zoo,
        tmp_path,
        stderr=(err := []),
    )
    assert "best exact" in out
    assert "settings: num_prompts=1 new_tokens=6 repeats=1 depths=[0,2] widths=[1,2]" in out
    assert "the README's table: python -m engine.bench spec num_prompts=4 new_tokens=64" in out
    assert "expected run time: ~" in out
    assert "spec sweep" in err[0]  # the progress bar
    assert "Loading" not in err[0] and "warn" not in err[0].lower()  # transformers is quiet
    res = json.loads((tmp_path / "s.json").read_text())
    assert all(row["exact"] for row in res["code"]["rows"])
    assert all(row["speedup"] == row["tok_s"] / row["base_tok_s"] for row in res["code"]["rows"])
    assert res["code"]["best"]["K"] > 0 and res["code"]["best_dense"]["K"] > 0
    assert res["code"]["assisted"]["same_tokens"]


def test_bad_bench_mode_is_rejected(fake_zoo, tmp_path):
    env = dict(os.environ, EXPERTSPEC_ZOO=str(fake_zoo), PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-m", "engine.bench", "mode=nope"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "unknown bench mode" in proc.stdout + proc.stderr


@pytest.mark.parametrize("missing", ["tiny-moe"])
def test_missing_zoo_says_how_to_build_it(tmp_path, missing):
    env = dict(os.environ, EXPERTSPEC_ZOO=str(tmp_path / "none"), PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-m", "engine.demo"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "python -m engine.zoo" in proc.stdout + proc.stderr


def test_bench_serve_smoke(tmp_path):
    """`python -m engine.bench serve` at the smallest budget: one policy, one rate, a tiny burst, real client."""
    out = tmp_path / "bs.json"
    cmd = [sys.executable, "-m", "engine.bench", "serve", "serve_bench.policies=[none,static-2]"]
    cmd += ["serve_bench.rates=[4]", "serve_bench.requests=2", "serve_bench.burst=2", "serve_bench.max_tokens=4"]
    cmd += ["serve_bench.plot=false", f"out={out}"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    for pol in ("none", "static-2"):
        scen = res["policies"][pol]["scenarios"]
        assert scen["burst"]["completed"] == 2 and scen["poisson 4/s"]["ttft"]["p50"] > 0
    assert res["policies"]["static-2"]["scenarios"]["burst"]["server"]["tau"] > 1.0
    # committed tokens per target cost: exactly 1 without drafts, priced per round on the H200 roofline
    assert res["policies"]["none"]["scenarios"]["burst"]["server"]["utility"] == pytest.approx(1.0)
    assert res["policies"]["static-2"]["scenarios"]["burst"]["server"]["utility"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_bench_graphs_refuses_without_cuda(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "engine.bench", "graphs"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode != 0 and "needs a CUDA GPU" in proc.stderr
