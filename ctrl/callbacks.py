"""SB3 callbacks of `ctrl.agent`: W&B tracking, the held-out evaluation, and the progress count.

    Track(run, returns, progress)       episode returns -> `charts/`, SB3's train/* values -> `losses/`
    HeldOutEval(envs, every, run)       every `every` steps: the deterministic policy on every held-out request,
                                        committed tokens per cost ÷ plain decoding's -> `eval/speedup[/<workload>]`

The held-out evaluation only *logs*: it selects nothing (no best-checkpoint pick, no early stop), so the held-out
prompts stay unseen by training. Checkpoints are SB3's own `CheckpointCallback` (agent zip + VecNormalize
statistics), assembled in `ctrl.agent`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from stable_baselines3.common.callbacks import BaseCallback


class Track(BaseCallback):
    """Episode returns into `returns` (and W&B `charts/`), SB3's `train/*` values into W&B `losses/`, and
    `progress(n)` after every vectorised step of n transitions."""

    def __init__(self, run: Any, returns: list[float], progress: Callable[[int], None] | None = None) -> None:
        super().__init__()
        self.run, self.returns, self.progress = run, returns, progress

    def _on_step(self) -> bool:
        for info in self.locals.get("infos", []):
            ep = info.get("episode")
            if ep is not None:
                self.returns.append(float(ep["r"]))
                if self.run is not None:
                    self.run.log({"charts/episodic_return": ep["r"], "charts/episodic_length": ep["l"]},
                                 step=self.num_timesteps)  # fmt: skip
        if self.progress is not None:
            self.progress(self.training_env.num_envs)
        return True

    def _on_rollout_end(self) -> None:
        if self.run is not None:
            logs = {f"losses/{k.split('/')[-1]}": v for k, v in self.logger.name_to_value.items() if "train/" in k}
            if logs:
                self.run.log(logs, step=self.num_timesteps)


def held_out_speedup(model: Any, envs: Mapping[str, Any]) -> dict[str, float]:
    """{workload: speedup_vs_ar} of `model`'s deterministic actions over every request of each replay env (its
    `requests`; ctrl.metrics: Σ committed / Σ (T_spec / T_AR), committed tokens per cost ÷ plain decoding's), and
    "all" over them together."""
    from ctrl.metrics import summarize
    from ctrl.rollout import run_requests

    vn = model.get_vec_normalize_env()

    def act(vec):
        x = vn.normalize_obs(vec[None]) if vn is not None else vec[None]
        return model.predict(x, deterministic=True)[0][0]

    runs = {name: run_requests(env, [int(i) for i in env.unwrapped.requests], act, "index")
            for name, env in envs.items()}  # fmt: skip
    out = {name: summarize(reqs).speedup_vs_ar for name, reqs in runs.items()}
    out["all"] = summarize([q for reqs in runs.values() for q in reqs]).speedup_vs_ar
    return out


class HeldOutEval(BaseCallback):
    """Every `every` environment steps (and at the end of training), `held_out_speedup` on `envs` into W&B
    `eval/` and `self.history` [(step, {workload: speed-up})]. Logging only (module docstring)."""

    def __init__(self, envs: Mapping[str, Any], every: int, run: Any = None) -> None:
        super().__init__()
        if every <= 0:
            raise ValueError(f"held-out evaluation every {every} steps: must be > 0")
        self.envs, self.every, self.run = dict(envs), int(every), run
        self.history: list[tuple[int, dict[str, float]]] = []
        self._next = self.every

    def record(self, model: Any, step: int, wandb_step: bool = True) -> dict[str, float]:
        """Evaluate `model` now (also outside SB3's learn: AggreVaTe alone) into the history at `step`; W&B logs it
        at `step`, or at its own next step (`wandb_step=False`: a run whose steps are not environment steps)."""
        res = held_out_speedup(model, self.envs)
        self.history.append((step, res))
        if self.run is not None:
            logs = {f"eval/speedup/{k}": v for k, v in res.items() if k != "all"}
            self.run.log({"eval/speedup": res["all"], **logs}, step=step if wandb_step else None)
        return res

    def _evaluate(self) -> None:
        self.logger.record("eval/speedup", self.record(self.model, self.num_timesteps)["all"])

    def _on_step(self) -> bool:
        if self.num_timesteps >= self._next:
            self._next += self.every
            self._evaluate()
        return True

    def _on_training_end(self) -> None:
        if not self.history or self.history[-1][0] != self.num_timesteps:
            self._evaluate()


def final_speedups(callback: HeldOutEval | None) -> dict[str, float]:
    """The last held-out evaluation's speed-ups ({} without one)."""
    return dict(callback.history[-1][1]) if callback is not None and callback.history else {}
