"""`python -m ctrl.wallclock`: the policies' wall-clock speed-up on the live engine, held-out prompts, this machine.

    python -m ctrl.wallclock                                   # measured-cpu policies, the default (EAGLE) job
    python -m ctrl.wallclock +experiment=ngram                 # the prompt-lookup job
    python -m ctrl.wallclock wallclock.cost=roofline-h200-qwen3_30b_a3b wallclock.repeats=5

The replay tables price rounds with a cost model; "this machine's measured cost" is fitted to timed forwards,
drafting rounds and the engine's host work per round (env.costs, "fitted"), and a learned policy's rounds carry its
choice too (timed in place by the recording's stand-in, `algo.price_choice`). This entry point checks it against the
clock: it deploys, in the real engine, static-best-test (the grid action of
least modelled cost on the held-out prompts under `wallclock.cost`, as the evaluation picks it) and every cached
learned seed trained under that cost (trained now if absent, as `python -m ctrl` does), each interleaved with
target-only decoding (an engine without routing instrumentation, the fastest plain one) on the same held-out
prompt at batch 1, `wallclock.repeats` times. Decoding is timed from
the first round to the last (the prefill is the same for every policy, and replay does not price it); a policy's
speed-up = Σ over prompts of target-only's fastest repeat ÷ Σ of its own fastest, and every run's tokens must
equal target-only's (exact methods). Next to it, the same policy's speed-up in replay under `wallclock.cost` (what
the evaluation reports). The static action runs twice: on the instrumented engine every policy shares (a learned
policy's observation reads the routing footprint), and as `static-best-test-bare` on one without instrumentation,
as a static deployment would run it (its replay figure is static-best-test's: the measured cost prices the
instrumented engine). Prints the table and writes `wallclock.json` into the run directory.

Steady state (`wallclock.steady_from`, default 16 tokens): the same speed-ups over the tokens from that position on
only. A round's time, on the clock or in replay, counts pro rata to its committed tokens at or past it
(`steady_share`). On a CPU the first rounds after a prefill run up to three times slower, for every policy; the
measured cost prices that as a warm-up surcharge by round index (engine.cost.warmup, since trace format 10), and a
round of the other kind than the one before it (a verification right after a round that verified nothing, or the
reverse) as a switching surcharge (engine.cost.switching). What replay still leaves out (the session's own work
between rounds, outside RoundStats) shows in both tables alike.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import hydra
from omegaconf import OmegaConf
from tqdm import tqdm

from ctrl.config import MainConf
from ctrl.metrics import summarize
from ctrl.pipeline import calibrate, check_conf, fit_acceptance_model, grid_of, record_traces, replay_env, split
from ctrl.rollout import frozen_runner, run_requests, static_runner


def _static_best_test(env: Any, requests: list[int], acceptance: Any) -> tuple[tuple[int, ...], Any]:
    """(grid indices, SpecConfig) of the grid action of least modelled cost over `requests` in `env`, the
    evaluation's static-best-test (ctrl.aggrevate.best_static_action)."""
    from ctrl.aggrevate import best_static_action

    e = env.unwrapped
    idx = tuple(int(v) for v in e.codec.unflat(best_static_action(env, requests)))
    spec = e.grid.spec(idx)
    return idx, (replace(spec, acceptance=acceptance) if spec.verify_rule == "calibrated" else spec)


BARE = "static-best-test-bare"  # the same static action on an engine without routing instrumentation


def steady_share(position: int, committed: int, steady_from: int) -> float:
    """The share of a round that commits `committed` tokens from `position` on that lies at or past `steady_from`."""
    if committed <= 0:
        return 0.0
    return min(max(position + committed - max(position, steady_from), 0), committed) / committed


def decode(engine: Any, prompt: list[int], max_new_tokens: int, steady_from: int = 0,
           **kw: Any) -> tuple[float, list[int], float]:  # fmt: skip
    """(seconds from the first round to the last, new tokens, the seconds of the tokens from `steady_from` on:
    `steady_share` of each round) of one request at batch 1; `kw`: spec / policy."""
    session = engine.start([prompt], max_new_tokens, **kw)  # admits the request: its prefill is not timed
    try:
        clock, position, steady = time.perf_counter, 0, 0.0
        t0 = t = clock()
        while not session.done:
            stats = session.step()[0]
            now = clock()
            steady += (now - t) * steady_share(position, stats.committed, steady_from)
            position, t = position + stats.committed, now
        return t - t0, session.results()[0].token_ids, steady
    finally:
        session.close()


def replay_steady_speedup(requests: list[list[Any]], steady_from: int) -> float:
    """ctrl.metrics' speed-up over plain decoding (Σ committed / Σ T_spec/T_AR) of replayed requests' rounds over
    the tokens from `steady_from` on: each round weighted by its `steady_share`."""
    committed = units = 0.0
    for rounds in requests:
        position = 0
        for r in rounds:
            f = steady_share(position, int(r.committed), steady_from)
            committed += f * r.committed
            units += f * float(r.cost) / float(r.cost_ar)
            position += int(r.committed)
    return committed / units if units > 0 else 0.0


def measure(conf: MainConf, traces: dict[str, Any], cost_name: str, repeats: int, progress=None,
            steady_from: int = 16) -> dict[str, Any]:  # fmt: skip
    """{workload: {"speedup" / "replay_speedup" / "steady_speedup" / "replay_steady_speedup": {"static-best-test",
    BARE, "<learner>-seed<k>": ×}, ...}}: wall-clock speed-ups and the replay's, over all tokens and from
    `steady_from` on (module docstring)."""
    import engine
    from ctrl.stages import learned_policies
    from engine.runtime.frozen import load_frozen_policy
    from env.models import load_models

    cost = next(c for c in conf.costs if c.name == cost_name)  # check_wallclock: it exists
    calibration, acceptance = calibrate(conf, traces), fit_acceptance_model(conf, traces)
    learned = learned_policies(conf, traces, cost)
    m = conf.models
    target, drafter, _ = load_models(m.target, m.drafter, m.predictor)
    base = engine.Engine(target, instrument=False)  # the fastest plain engine: no routing records (policies need them)
    spec_engine = engine.Engine(target, drafter=drafter, calibration=calibration, acceptance=acceptance)
    bare_engine = engine.Engine(
        target, drafter=drafter, calibration=calibration, acceptance=acceptance, instrument=False
    )  # what a static action needs: no policy reads the footprint
    out: dict[str, Any] = {}
    for name in sorted(traces):
        trace = traces[name]
        _, test_ids = split(trace, conf)
        prompts = [trace.prompt(int(i)).tolist() for i in test_ids]
        env = replay_env(trace, cost, grid_of(conf), test_ids, calibration, acceptance)
        idx, spec = _static_best_test(env, test_ids, acceptance)
        runs: dict[str, tuple[Any, dict]] = {"static-best-test": (spec_engine, {"spec": spec}),
                                              BARE: (bare_engine, {"spec": spec})}  # fmt: skip
        for learner, paths in learned.items():
            for p in paths:
                runs[f"{learner}-{p.name}"] = (spec_engine, {"policy": load_frozen_policy(p)})
        n_new = conf.workloads.max_new_tokens
        base.generate(prompts[:1], 4)  # warm every engine and every policy once
        for eng, kw in runs.values():
            eng.generate(prompts[:1], 4, **kw)
        best_base = [float("inf")] * len(prompts)
        steady_base = [float("inf")] * len(prompts)
        best = {k: [float("inf")] * len(prompts) for k in runs}
        steady = {k: [float("inf")] * len(prompts) for k in runs}
        for _ in range(repeats):
            for i, p in enumerate(prompts):
                seconds, ref, warm = decode(base, p, n_new, steady_from)
                best_base[i], steady_base[i] = min(best_base[i], seconds), min(steady_base[i], warm)
                for k, (eng, kw) in runs.items():
                    seconds, got, warm = decode(eng, p, n_new, steady_from, **kw)
                    best[k][i], steady[k][i] = min(best[k][i], seconds), min(steady[k][i], warm)
                    if got != ref:
                        raise AssertionError(f"{name} request {test_ids[i]}: {k} committed other tokens than "
                                             "target-only decoding")  # fmt: skip
                if progress is not None:
                    progress(1)
        # a learned policy replays as the evaluation replays it: where it pays its probe and its choice, as it runs
        learned_envs = {(p, h): replay_env(trace, cost, grid_of(conf), test_ids, calibration, acceptance, probe=p,
                                           choice=conf.algo.price_choice, hold=h)
                        for p, h in {(bool(kw["policy"].probe), kw["policy"].hold) for _, kw in runs.values()
                                     if "policy" in kw}}  # fmt: skip
        actors = {}
        for k, (_, kw) in runs.items():
            if k != BARE:
                e = learned_envs[bool(kw["policy"].probe), kw["policy"].hold] if "policy" in kw else env
                actors[k] = (e, static_runner(e, idx) if "policy" not in kw else frozen_runner(kw["policy"], e))
        replayed = {k: run_requests(e, test_ids, a, "index") for k, (e, a) in actors.items()}
        replay = {k: summarize(reqs).speedup_vs_ar for k, reqs in replayed.items()}
        steady_replay = {k: replay_steady_speedup(reqs, steady_from) for k, reqs in replayed.items()}
        for figures in (replay, steady_replay):  # the same action, priced on the instrumented engine
            figures[BARE] = figures["static-best-test"]
        out[name] = {
            "replay_speedup": replay,
            "target_only_seconds": sum(best_base),
            "static_best_test_action": dict(
                depth=spec.depth, width=spec.width, lam=spec.lam, rule=spec.verify_rule, threshold=spec.verify_threshold
            ),  # fmt: skip
            "speedup": {k: sum(best_base) / sum(v) for k, v in best.items()},
            "replay_steady_speedup": steady_replay,
            "steady_speedup": {k: sum(steady_base) / sum(v) for k, v in steady.items()},
        }
    return out


def check_wallclock(conf: MainConf, cost_name: str, repeats: int, steady_from: int = 16) -> None:
    """Clear errors before any work: the cost model is one of `costs`, repeats >= 1, steady_from inside the
    requests, a drafter is configured."""
    check_conf(conf)
    names = [c.name for c in conf.costs]
    if cost_name not in names:
        raise ValueError(f"wallclock.cost={cost_name!r} is not one of costs {names}")
    if repeats < 1:
        raise ValueError(f"wallclock.repeats must be >= 1, got {repeats}")
    if not 0 <= steady_from < conf.workloads.max_new_tokens:
        raise ValueError(f"wallclock.steady_from must be in [0, workloads.max_new_tokens="
                         f"{conf.workloads.max_new_tokens}), got {steady_from}")  # fmt: skip
    if not conf.models.drafter:
        raise ValueError("wallclock needs a drafter (models.drafter): every policy here speculates")


def print_table(res: dict[str, Any], cost_name: str, steady_from: int | None = None) -> None:
    """The speed-ups, one row per policy, one column per workload: on the clock (replay's modelled one); with
    `steady_from`, a second table over the tokens from that position on."""
    names = sorted(res)
    policies = list(next(iter(res.values()))["speedup"]) if res else []
    tables = [("speedup", "replay_speedup", "")]
    if steady_from is not None:
        tables.append(("steady_speedup", "replay_steady_speedup", f", tokens from position {steady_from} on"))
    for clock, replay, what in tables:
        print(f"== speed-up over target-only decoding on the held-out prompts{what}: wall clock, live engine, batch 1 "
              f"(replay under {cost_name}, which chose / trained the policies) ==")  # fmt: skip
        print(f"{'policy':<24}" + "".join(f"{n:>20}" for n in names))
        for p in policies:
            cells = "".join(f"{res[n][clock][p]:>8.3f}x ({res[n][replay][p]:.3f}x)" for n in names)
            print(f"{p:<24}{cells}")


@hydra.main(config_path="../conf", config_name="main", version_base=None)
def main(cfg) -> None:
    conf: MainConf = OmegaConf.to_object(cfg)
    w = conf.wallclock
    check_wallclock(conf, w.cost, w.repeats, w.steady_from)
    out_dir = Path(hydra.core.hydra_config.HydraConfig.get().runtime.output_dir) / conf.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    traces = record_traces(conf)
    total = w.repeats * sum(len(split(t, conf)[1]) for t in traces.values())
    bar = tqdm(total=total, desc="wall-clock runs (prompt × repeat)", disable=not conf.progress)
    res = measure(conf, traces, w.cost, w.repeats, progress=bar.update, steady_from=w.steady_from)
    bar.close()
    print_table(res, w.cost, w.steady_from)
    (out_dir / "wallclock.json").write_text(json.dumps({"cost": w.cost, "repeats": w.repeats,
                                                        "steady_from": w.steady_from, "workloads": res},
                                                       indent=2))  # fmt: skip
    print(f"wrote {out_dir / 'wallclock.json'}")


if __name__ == "__main__":
    main()
