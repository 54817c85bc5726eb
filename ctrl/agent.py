"""Training a learned speculation controller on trace replay and freezing it (`python -m ctrl.train` runs it).

PPO (MultiDiscrete K x W x λ x verification rule) over `expertspec/Replay-v0` vectorised with SB3's
DummyVecEnv, observations normalised by VecNormalize (folded into the frozen artefact), one run per seed.
Tracking: W&B, offline by default (`wandb.mode=online|offline|disabled`), metrics namespaced like cleanrl
(`charts/`, `losses/`). Each seed's frozen policy goes to `<out_dir>/seed<k>/` (ctrl.freeze).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

from ctrl.config import AlgoConf, WandbConf

ALGOS = ("ppo", "aggrevate", "aggrevate+ppo")


@dataclass
class TrainResult:
    policy_paths: list[Path]
    seconds: float
    curves: dict[int, list[float]]  # seed -> episode returns over training


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


def train_policy(
    make_env: Callable[[int], gym.Env],
    grid: Any,
    algo: AlgoConf,
    seed: int,
    out_dir: Path,
    wandb_conf: WandbConf | None = None,
    config: dict | None = None,
    progress: Callable[[int], None] | None = None,
) -> tuple[Path, list[float]]:
    """Train one seed; returns (frozen policy folder, episode returns). `make_env(rank)` builds one env."""
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.monitor import Monitor
    from stable_baselines3.common.vec_env import DummyVecEnv, VecNormalize

    from ctrl.freeze import freeze

    if algo.name not in ALGOS:
        raise ValueError(f"algo.name must be one of {ALGOS}, got {algo.name!r}")
    torch.manual_seed(seed)
    imitation = algo.name.startswith("aggrevate")
    raw = [make_env(seed * 1000 + r) for r in range(algo.n_envs)]
    venv = DummyVecEnv([lambda e=e: Monitor(e) for e in raw])
    # AggreVaTe fits the actor on the raw observation (already in [0, 1]); PPO alone normalises it
    venv = VecNormalize(venv, norm_obs=not imitation, norm_reward=algo.normalize_reward, gamma=algo.gamma)
    venv.seed(seed)
    run = _wandb_run(wandb_conf, out_dir, config or {}, seed) if wandb_conf is not None else None
    returns: list[float] = []

    class Track(BaseCallback):
        def _on_step(self) -> bool:
            for info in self.locals.get("infos", []):
                ep = info.get("episode")
                if ep is not None:
                    returns.append(float(ep["r"]))
                    if run is not None:
                        run.log({"charts/episodic_return": ep["r"], "charts/episodic_length": ep["l"]},
                                step=self.num_timesteps)  # fmt: skip
            if progress is not None:
                progress(self.training_env.num_envs)
            return True

        def _on_rollout_end(self) -> None:
            if run is not None:
                logs = {f"losses/{k.split('/')[-1]}": v for k, v in self.logger.name_to_value.items() if "train/" in k}
                if logs:
                    run.log(logs, step=self.num_timesteps)

    model = PPO(
        "MlpPolicy",
        venv,
        n_steps=algo.n_steps,
        batch_size=algo.batch_size,
        n_epochs=algo.n_epochs,
        learning_rate=algo.learning_rate,
        gamma=algo.gamma,
        gae_lambda=algo.gae_lambda,
        ent_coef=algo.ent_coef,
        policy_kwargs=dict(net_arch=dict(pi=list(algo.net_arch), vf=list(algo.net_arch))),
        seed=seed,
        device="cpu",
        verbose=0,
    )
    if imitation:
        from ctrl.aggrevate import aggrevate

        regrets = aggrevate(model.policy, raw, [e.unwrapped.requests for e in raw], iterations=algo.iterations,
                            epochs=algo.epochs, lr=algo.imitation_lr, seed=seed, progress=progress,
                            expert=algo.expert, entropy=algo.imitation_entropy)  # fmt: skip
        if run is not None:
            for i, r in enumerate(regrets):
                run.log({"losses/aggrevate_regret": r, "charts/iteration": i})
    if algo.name != "aggrevate":
        model.learn(total_timesteps=algo.total_timesteps, callback=Track())
    path = freeze(model, grid, out_dir / f"seed{seed}", vec_normalize=venv, name=algo.name, algo=algo.name, seed=seed,
                  total_timesteps=algo.total_timesteps, **(config or {}).get("card", {}))  # fmt: skip
    if run is not None:
        run.summary["charts/final_mean_return"] = float(np.mean(returns[-20:])) if returns else 0.0
        run.finish()
    venv.close()
    return path, returns


def train_seeds(make_env, grid, algo: AlgoConf, seeds: list[int], out_dir: Path, wandb_conf=None, config=None,
                progress=None) -> TrainResult:  # fmt: skip
    t0 = time.perf_counter()
    paths, curves = [], {}
    for s in seeds:
        p, r = train_policy(make_env, grid, algo, s, out_dir, wandb_conf, config, progress)
        paths.append(p)
        curves[s] = r
    return TrainResult(paths, time.perf_counter() - t0, curves)
