"""`gymnasium.make(id)` with no arguments, the benchmark entry point, distributed recording."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

import env  # noqa: F401
from env.live import LiveEnv
from env.trace import load_trace

REPO = Path(__file__).resolve().parents[2]


def test_live_make_without_arguments():
    e = gym.make("expertspec/Live-v0")
    obs, info = e.reset(seed=0)
    assert e.observation_space.contains(obs)
    obs, r, term, trunc, info = e.step(e.action_space.sample())
    assert np.isfinite(r) and info["cost_ar"] > 0
    e.close()


def test_live_measured_cost(zoo_models):
    e = LiveEnv(models=zoo_models, num_prompts=1, max_new_tokens=6, cost="measured")
    e.reset(seed=0)
    *_, info = e.step(np.array([2, 1, 0, 0]))
    assert info["measured_seconds"] > 0 and info["cost_ar"] > 0
    # the round is priced as it ran: drafting + the target's forward + the engine's host work (T_book > 0)
    assert info["cost_book"] > 0
    assert info["cost_draft"] + info["cost_verify"] + info["cost_book"] == pytest.approx(info["measured_seconds"])
    e.close()


@pytest.mark.slow
def test_replay_make_without_arguments():
    """Records the default trace into the user's cache on first use (about a minute on 2 cores), then reuses it."""
    e = gym.make("expertspec/Replay-v0")
    obs, _ = e.reset(seed=0)
    steps = 0
    while steps < 200:
        obs, r, term, trunc, _ = e.step(e.action_space.sample())
        steps += 1
        assert np.isfinite(r)
        if term or trunc:
            e.reset()


@pytest.mark.slow
def test_bench_entry_point(greedy_trace, tmp_path):
    env_vars = dict(os.environ, PYTHONPATH=str(REPO), EXPERTSPEC_CACHE=str(tmp_path / "cache"))
    cmd = [sys.executable, "-m", "env.bench", "steps=500", "live_steps=3", f"trace={greedy_trace.path}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env_vars, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "replay_steps_per_s" in proc.stdout and "live_steps_per_s" in proc.stdout


@pytest.mark.slow
@pytest.mark.dist
def test_torchrun_sharded_recording(tmp_path):
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun not installed")
    out = tmp_path / "dist.npz"
    # TMPDIR: the elastic agent's log folder stays out of the machine's /tmp
    env_vars = dict(os.environ, PYTHONPATH=str(REPO), EXPERTSPEC_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1",
                    TMPDIR=str(tmp_path))  # fmt: skip
    cmd = [
        torchrun,
        "--nproc_per_node=2",
        "--master_port=29533",
        "-m",
        "env.record",
        "max_new_tokens=3",
        "kmax=2",
        "widths=[1,2]",
        "workload.n=3",
        "calibrate_every=0",
        f"out={out}",
        "progress=false",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env_vars, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert load_trace(out).num_requests == 3


@pytest.mark.parametrize("name", ["replay", "live"])
def test_env_config_mirrors_every_constructor_argument(name):
    """conf/env/<name>.yaml names every constructor argument of its env, and nothing else (README, Environments)."""
    import inspect

    import yaml

    from env.replay import ReplayEnv

    cls = {"replay": ReplayEnv, "live": LiveEnv}[name]
    conf = yaml.safe_load((Path(__file__).resolve().parents[2] / "conf" / "env" / f"{name}.yaml").read_text())
    params = set(inspect.signature(cls.__init__).parameters) - {"self", "models", "prompts"}  # objects, not config
    assert set(conf) - {"_target_"} == params
