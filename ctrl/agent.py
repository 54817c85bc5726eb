"""Training a learned speculation controller on trace replay and freezing it (`python -m ctrl.train` runs it).

    ppo             PPO on the MultiDiscrete action (K x W x λ x verification rule)
    aggrevate       cost-sensitive imitation of an exact expert (ctrl/aggrevate.py); `aggrevate+ppo` then PPO
    sac | td3       SAC / TD3 on the Box([-1, 1]^4) variant of the same action (env.actions), tanh actors so the
                    frozen artefact is the same plain MLP (ctrl.freeze.box_cells maps the Box to grid cells)

Environments: `expertspec/Replay-v0` vectorised with SB3's DummyVecEnv (`algo.vec_env=subproc`: SubprocVecEnv, one
process per env, for envs whose step costs more than the pipe; a replay step is a table lookup: 8,192 PPO steps over
4 replay envs take ~3.5x as long with it, spawn included), observations
normalised by VecNormalize (folded into the frozen artefact). Callbacks (ctrl.callbacks): W&B tracking, offline by
default (`wandb.mode=online|offline|disabled`, metrics namespaced like cleanrl: `charts/`, `losses/`, `eval/`), an
evaluation on the held-out prompts every `algo.eval_every` steps (logged only), SB3 checkpoints every
`algo.checkpoint_every` steps and at the end under `<out_dir>/checkpoints/seed<k>/`. Each seed's frozen policy goes to
`<out_dir>/seed<k>/` (ctrl.freeze) and, with W&B on, into the run as a `policy` artifact.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

from ctrl.config import AlgoConf, WandbConf

ALGOS = ("ppo", "aggrevate", "aggrevate+ppo", "sac", "td3")
BOX_ALGOS = ("sac", "td3")  # act on the Box variant of the action space
VEC_ENVS = ("dummy", "subproc")


def progress_steps(algo: AlgoConf, learner: str) -> int:
    """The units one seed of `learner` reports to `progress`: AggreVaTe iterations, then RL environment steps."""
    return (algo.iterations if learner.startswith("aggrevate") else 0) + (
        algo.total_timesteps if learner != "aggrevate" else 0)  # fmt: skip


def action_kind(algo: str) -> str:
    """The env action kind an algorithm trains on (env.actions.ACTION_KINDS)."""
    return "box" if algo in BOX_ALGOS else "multidiscrete"


@dataclass
class TrainResult:
    policy_paths: list[Path]
    seconds: float
    curves: dict[int, list[float]]  # seed -> episode returns over training
    held_out: dict[int, list[tuple[int, dict[str, float]]]] = field(default_factory=dict)  # seed -> eval history


def _wandb_run(conf: WandbConf, out_dir: Path, config: dict, seed: int):
    if conf.mode == "disabled":
        return None
    if conf.mode not in ("online", "offline"):
        raise ValueError(f"wandb.mode must be online, offline or disabled, got {conf.mode!r}")
    import wandb

    wdir = Path(conf.dir) if conf.dir else out_dir
    wdir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("WANDB_SILENT", "true")
    return wandb.init(project=conf.project, mode=conf.mode, dir=str(wdir), config=config, name=f"seed{seed}",
                      reinit="create_new")  # fmt: skip


def _log_artifact(run: Any, path: Path, name: str, seed: int) -> None:
    """The frozen policy folder as a W&B `policy` artifact of the run (kept in the offline run directory)."""
    import wandb

    art = wandb.Artifact(f"{name.replace('+', '-')}-seed{seed}", type="policy",
                         metadata={"algo": name, "seed": seed})  # fmt: skip
    art.add_dir(str(path))
    run.log_artifact(art)


def _agent(algo: AlgoConf, venv: Any, seed: int) -> Any:
    """The SB3 model of `algo.name` over `venv` (PPO for the imitation learners: its actor is what they fit)."""
    from torch import nn

    common = dict(learning_rate=algo.learning_rate, gamma=algo.gamma, seed=seed, device="cpu", verbose=0)
    if algo.name in BOX_ALGOS:
        from stable_baselines3 import SAC, TD3
        from stable_baselines3.common.noise import NormalActionNoise

        # tanh hidden layers: the frozen actor is then the engine's plain tanh MLP (engine.runtime.frozen)
        kw = dict(policy_kwargs=dict(net_arch=list(algo.net_arch), activation_fn=nn.Tanh), buffer_size=algo.buffer_size,
                  learning_starts=algo.learning_starts, batch_size=algo.batch_size, tau=algo.tau,
                  train_freq=algo.train_freq, gradient_steps=algo.gradient_steps, **common)  # fmt: skip
        if algo.name == "sac":
            return SAC("MlpPolicy", venv, **kw)
        dim = venv.action_space.shape[0]
        noise = NormalActionNoise(np.zeros(dim), algo.action_noise * np.ones(dim))
        return TD3("MlpPolicy", venv, action_noise=noise, **kw)
    from stable_baselines3 import PPO

    return PPO("MlpPolicy", venv, n_steps=algo.n_steps, batch_size=algo.batch_size, n_epochs=algo.n_epochs,
               gae_lambda=algo.gae_lambda, ent_coef=algo.ent_coef,
               policy_kwargs=dict(net_arch=dict(pi=list(algo.net_arch), vf=list(algo.net_arch))), **common)  # fmt: skip


def train_policy(
    make_env: Callable[[int], gym.Env],
    grid: Any,
    algo: AlgoConf,
    seed: int,
    out_dir: Path,
    wandb_conf: WandbConf | None = None,
    config: dict | None = None,
    progress: Callable[[int], None] | None = None,
    make_eval_envs: Callable[[], dict[str, gym.Env]] | None = None,
    held_out: list | None = None,
) -> tuple[Path, list[float]]:
    """Train one seed; returns (frozen policy folder, episode returns). `make_env(rank)` builds one env with the
    action kind of `algo.name` (`action_kind`); `make_eval_envs()` the held-out replay envs by workload (used when
    `algo.eval_every > 0`; their history is appended to `held_out` when given)."""
    import torch
    from stable_baselines3.common.callbacks import CallbackList, CheckpointCallback
    from stable_baselines3.common.monitor import Monitor
    from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv, VecNormalize

    from ctrl.callbacks import HeldOutEval, Track
    from ctrl.freeze import freeze

    if algo.name not in ALGOS:
        raise ValueError(f"algo.name must be one of {ALGOS}, got {algo.name!r}")
    if algo.vec_env not in VEC_ENVS:
        raise ValueError(f"algo.vec_env must be one of {VEC_ENVS}, got {algo.vec_env!r}")
    torch.manual_seed(seed)
    imitation = algo.name.startswith("aggrevate")
    ranks = [seed * 1000 + r for r in range(algo.n_envs)]
    raw = [make_env(r) for r in ranks] if imitation or algo.vec_env == "dummy" else []
    want = action_kind(algo.name)
    probe = raw[0] if raw else make_env(ranks[0])
    if probe.unwrapped.action_kind != want:
        raise ValueError(f"{algo.name} trains on the {want} action space; make_env built a "
                         f"{probe.unwrapped.action_kind} env")  # fmt: skip
    if algo.vec_env == "subproc":
        venv = SubprocVecEnv([lambda r=r: Monitor(make_env(r)) for r in ranks], start_method="spawn")
    else:
        venv = DummyVecEnv([lambda e=e: Monitor(e) for e in raw])
    # AggreVaTe fits the actor on the raw observation (already in [0, 1]); the RL learners normalise it
    venv = VecNormalize(venv, norm_obs=not imitation, norm_reward=algo.normalize_reward, gamma=algo.gamma)
    venv.seed(seed)
    run = _wandb_run(wandb_conf, out_dir, config or {}, seed) if wandb_conf is not None else None
    returns: list[float] = []
    callbacks: list[Any] = [Track(run, returns, progress)]
    evaluation = None
    if algo.eval_every > 0 and make_eval_envs is not None:
        evaluation = HeldOutEval(make_eval_envs(), max(algo.eval_every // algo.n_envs, 1) * algo.n_envs, run)
        callbacks.append(evaluation)
    if algo.checkpoint_every > 0:
        callbacks.append(CheckpointCallback(max(algo.checkpoint_every // algo.n_envs, 1),
                                            str(out_dir / "checkpoints" / f"seed{seed}"), name_prefix=algo.name,
                                            save_vecnormalize=True))  # fmt: skip
    model = _agent(algo, venv, seed)
    # SB3's default logger makes an empty /tmp/SB3-<time> folder per learn(); ours keeps its values (Track reads
    # them) and writes nowhere
    from stable_baselines3.common.logger import Logger

    model.set_logger(Logger(folder=None, output_formats=[]))
    if imitation:
        from ctrl.aggrevate import aggrevate

        candidates: list[tuple[int, float]] = []  # (iteration, -1: the clone; return on the training requests)
        regrets = aggrevate(model.policy, raw, [e.unwrapped.requests for e in raw], iterations=algo.iterations,
                            epochs=algo.epochs, lr=algo.imitation_lr, seed=seed, progress=progress,
                            expert=algo.expert, entropy=algo.imitation_entropy,
                            on_return=lambda i, r: candidates.append((i, r)))  # fmt: skip
        if run is not None:
            for i, r in enumerate(regrets):
                run.log({"losses/aggrevate_regret": r, "charts/iteration": i})
            for i, r in candidates:
                run.log({"charts/aggrevate_train_return": r, "charts/iteration": i})
    if algo.name != "aggrevate":
        model.learn(total_timesteps=algo.total_timesteps, callback=CallbackList(callbacks))
    elif evaluation is not None:  # no SB3 learn to call it back: the fitted actor once
        evaluation.record(model, algo.iterations, wandb_step=False)
    if algo.checkpoint_every > 0:  # the trained agent itself (the last periodic one predates the last update)
        ckpt = out_dir / "checkpoints" / f"seed{seed}"
        ckpt.mkdir(parents=True, exist_ok=True)
        model.save(ckpt / f"{algo.name}_final.zip")
        venv.save(str(ckpt / f"{algo.name}_vecnormalize_final.pkl"))
    path = freeze(model, grid, out_dir / f"seed{seed}", vec_normalize=venv, name=algo.name, algo=algo.name, seed=seed,
                  total_timesteps=algo.total_timesteps, **(config or {}).get("card", {}))  # fmt: skip
    if evaluation is not None and held_out is not None:
        held_out.append(evaluation.history)
    if run is not None:
        run.summary["charts/final_mean_return"] = float(np.mean(returns[-20:])) if returns else 0.0
        _log_artifact(run, path, algo.name, seed)
        run.finish()
    venv.close()
    return path, returns


def train_seeds(make_env, grid, algo: AlgoConf, seeds: list[int], out_dir: Path, wandb_conf=None, config=None,
                progress=None, make_eval_envs=None) -> TrainResult:  # fmt: skip
    t0 = time.perf_counter()
    paths, curves, held = [], {}, {}
    for s in seeds:
        hist: list = []
        p, r = train_policy(make_env, grid, algo, s, out_dir, wandb_conf, config, progress, make_eval_envs, hist)
        paths.append(p)
        curves[s] = r
        held[s] = hist[0] if hist else []
    return TrainResult(paths, time.perf_counter() - t0, curves, held)
