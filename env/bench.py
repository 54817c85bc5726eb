"""`python -m env.bench`: steps per second of Replay-v0 (random actions, one process) and Live-v0 (zoo models).

    python -m env.bench                         # default trace and grid, 100k replay steps, 200 live steps
    python -m env.bench steps=20000 live_steps=0 trace=/path/to/trace.npz out=bench.json

Replay is timed after its tables are built (they are cached); the random actions are drawn up front in
one batch from a seeded generator (uniform over the MultiDiscrete grid), and also with
`action_space.sample()` inside the loop, which costs as much as a replay step. Live steps run the
engine on the zoo models at the same grid (roofline pricing, which adds no measurable work).
Not a timed test: numbers go to stdout (and `out`), for the README.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass
class BenchConf:
    steps: int = 100_000  # replay steps (random actions)
    live_steps: int = 200  # live steps (0: skip)
    trace: str | None = None  # None: the default trace
    seed: int = 0
    out: str | None = None  # JSON results
    headroom: bool = True  # the oracle's advantage over the best static action, per cost model
    headroom_costs: list[str] = field(
        default_factory=lambda: [
            "roofline:h100:qwen3_30b_a3b",
            "roofline:h100:target",
            "roofline:h200:qwen3_235b_a22b",
            "fitted",
        ]
    )


def bench_replay(env, steps: int, seed: int) -> dict[str, float]:
    """Replay steps/s with pre-drawn uniform random actions and with action_space.sample() per step."""
    rng = np.random.default_rng(seed)
    nvec = np.asarray(env.codec.nvec)
    actions = [a for a in rng.integers(0, nvec, size=(steps, len(nvec)))]
    env.reset(seed=seed)
    episodes = 0
    t0 = time.perf_counter()
    for a in actions:
        *_, term, trunc, _ = env.step(a)
        if term or trunc:
            env.reset()
            episodes += 1
    pre = steps / (time.perf_counter() - t0)
    n = max(steps // 5, 1)
    env.action_space.seed(seed)
    env.reset(seed=seed)
    t0 = time.perf_counter()
    for _ in range(n):
        *_, term, trunc, _ = env.step(env.action_space.sample())
        if term or trunc:
            env.reset()
    sampled = n / (time.perf_counter() - t0)
    return {"replay_steps_per_s": pre, "replay_steps_per_s_sampling_in_loop": sampled, "replay_episodes": episodes}


def bench_live(env, steps: int, seed: int) -> dict[str, float]:
    env.action_space.seed(seed)
    env.reset(seed=seed)
    env.step(env.action_space.sample())  # warm-up
    t0 = time.perf_counter()
    for _ in range(steps):
        *_, term, trunc, _ = env.step(env.action_space.sample())
        if term or trunc:
            env.reset()
    return {"live_steps_per_s": steps / (time.perf_counter() - t0)}


def run(conf: BenchConf) -> dict[str, float]:
    import torch

    from env.live import LiveEnv
    from env.replay import ReplayEnv

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    replay = ReplayEnv(conf.trace)
    res: dict = {
        "setup_seconds": time.perf_counter() - t0,
        "trace": str(replay.trace.path),
        "actions": int(replay.codec.num_actions),
        "cost": replay.cost_model.name,
    }
    res.update(bench_replay(replay, conf.steps, conf.seed))
    if conf.headroom:
        from env.oracle import headroom

        for name in conf.headroom_costs:
            kind, *rest = name.split(":")
            cost = {"kind": kind} if not rest else {"kind": kind, "hardware": rest[0], "model_spec": rest[1]}
            h = headroom(ReplayEnv(replay.trace, cost=cost))
            res[f"headroom[{name}]"] = (
                f"oracle speed-up {h['oracle_speedup']:.3f} vs best static {h['best_static_speedup']:.3f} "
                f"{h['fastest_static_action']} (x{h['headroom_speedup']:.3f}); return {h['oracle_return']:.1f} vs "
                f"{h['best_static_return']:.1f}"
            )
    if conf.live_steps > 0:
        live = LiveEnv()
        res.update(bench_live(live, conf.live_steps, conf.seed))
        live.close()
    return res


def main() -> None:
    import hydra
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from engine.cli import quiet_hydra_argv

    ConfigStore.instance().store(name="env_bench", node=BenchConf)
    quiet_hydra_argv()

    @hydra.main(config_path=None, config_name="env_bench", version_base=None)
    def entry(cfg) -> None:
        conf = BenchConf(**OmegaConf.to_container(cfg))
        res = run(conf)
        for k, v in res.items():
            print(
                f"{k:40s} {v:,.0f}"
                if isinstance(v, float) and v > 100
                else f"{k:40s} {v:.3g}"
                if isinstance(v, float)
                else f"{k:40s} {v}"
            )
        if conf.out:
            with open(conf.out, "w") as f:
                json.dump({**res, "config": asdict(conf)}, f, indent=2)

    entry()


if __name__ == "__main__":
    main()
