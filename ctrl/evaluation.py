"""The main job's evaluation stage: every policy on every workload's held-out requests, in replay and, for a few
requests, on the live engine (ctrl.pipeline builds the traces, envs and trained policies it takes).

    rows, plots, extras = evaluate(conf, traces, cost, policies)   # results.json rows
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ctrl.baselines import POLICY_FACTORIES, profile
from ctrl.config import CostSpecConf, MainConf
from ctrl.metrics import summarize
from ctrl.pipeline import (
    calibrate,
    env_cost,
    fit_acceptance_model,
    grid_of,
    per_policy_plot_data,
    replay_env,
    row,
    split,
)
from ctrl.rollout import (
    SPANS,
    ablation,
    frozen_runner,
    request_level_bound,
    run_requests,
    span_bounds,
    static_costs,
    static_costs_by_request,
    static_runner,
    train_fit,
    unflat,
)
from engine.runtime.action_grid import ActionGrid
from engine.runtime.hold import NO_HOLD, Hold
from engine.spec.config import SpecConfig


def evaluate(
    conf: MainConf,
    traces: dict[str, Any],
    cost: CostSpecConf,
    policy_paths: dict[str, Sequence[Path]],
    on_policy: Callable[[str], None] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]], dict[str, Any]]:
    """Every policy on every workload's held-out requests, replay under `cost`.

    Returns (rows, plot data per workload, extras: headroom shares, ablation, profiles)."""
    from engine.runtime.frozen import load_frozen_policy
    from env.oracle import HindsightOracle

    grid = grid_of(conf)
    rows: list[dict[str, Any]] = []
    plots: dict[str, dict[str, Any]] = {}
    extras: dict[str, Any] = {"headroom": {}, "ablation": {}, "profile": {}, "static": {}, "train_fit": {},
                              "hindsight": {}}  # fmt: skip
    frozen = {learner: [load_frozen_policy(p) for p in paths] for learner, paths in policy_paths.items() if paths}
    tick = on_policy or (lambda name: None)
    trained = cost.policies_from or cost.name  # the cost model the learned policies were trained under
    calibration = calibrate(conf, traces)
    acceptance = fit_acceptance_model(conf, traces)
    extras["calibration"], extras["acceptance"] = {}, {}
    extras["probe_selection"] = {
        learner: json.loads(f.read_text())
        for learner, paths in policy_paths.items()
        if paths and (f := Path(paths[0]).parent / "probe_selection.json").is_file()
    }
    for name in sorted(traces):
        trace = traces[name]
        train_ids, test_ids = split(trace, conf)
        env = replay_env(trace, cost, grid, calibration=calibration, acceptance=acceptance)
        # the learned policies' envs: with the probe they observe (and pay for) when they were trained with one, and
        # their choice priced (conf.algo.price_choice)
        learned_envs: dict[tuple, Any] = {}

        def learned_env(probe: bool, hold: Hold = NO_HOLD, envs=learned_envs, trace=trace, env=env) -> Any:
            key = (probe, hold)
            if not (probe or conf.algo.price_choice or hold):  # nothing to price apart: the rules' env
                return env
            if key not in envs:
                envs[key] = replay_env(trace, cost, grid, calibration=calibration, acceptance=acceptance, probe=probe,
                                       choice=conf.algo.price_choice, hold=hold)  # fmt: skip
            return envs[key]

        from env.calibration import acceptance_error, calibration_error

        extras["calibration"][name] = calibration_error(trace, calibration, test_ids)
        extras["acceptance"][name] = acceptance_error(trace, acceptance, test_ids)
        plot: dict[str, Any] = {}
        runs: dict[str, list[list[Any]]] = {}

        def add(policy: str, reqs: list[list[Any]], runs=runs, name=name, rows=rows, **extra: Any) -> None:
            runs[policy] = reqs
            rows.append(row(policy, name, cost, reqs, **extra))
            tick(policy)

        # static: the best action of the whole grid, chosen on the training prompts and on the test prompts
        c_train, c_by_request = static_costs(env, train_ids), static_costs_by_request(env, test_ids)
        c_test = c_by_request.sum(0)
        extras["hindsight"][name] = {"request": request_level_bound(c_by_request),
                                     **span_bounds(env, test_ids, SPANS, float(c_test.min()))}  # fmt: skip
        best_train, best_test = unflat(env, int(np.argmin(c_train))), unflat(env, int(np.argmin(c_test)))
        for label, idx in (("static-best-train", best_train), ("static-best-test", best_test)):
            spec = grid.spec(idx)
            add(label, run_requests(env, test_ids, static_runner(env, idx), "index"),
                action=f"K={spec.depth} W={spec.width} rule={spec.verify_rule}:{spec.verify_threshold:g}")  # fmt: skip
            extras["static"][f"{name}/{label}"] = list(idx)
        add("target-only", run_requests(env, test_ids, lambda obs: SpecConfig(depth=0, width=1), "spec"))
        # published / shipped adaptive rules, configured from the training prompts
        prof = profile(env, train_ids, grid, c_train)
        extras["profile"][name] = prof
        for pname in conf.policies:
            pol = POLICY_FACTORIES[pname](prof, grid)
            add(pname, run_requests(env, test_ids, pol.act, "spec", reset=pol.reset))
        # the hindsight oracle (replay only): the upper bound
        oracle = HindsightOracle(env, objective="cost")
        bound = {} if not env.unwrapped.cost_model.stateful else {"bound": False}  # plans on a proxy (env.oracle)
        add("oracle", run_requests(env, test_ids, lambda v, o=oracle: o.action(), "index"), **bound)
        # learned: every algorithm, every seed, and their mean over seeds
        for learner, fps in frozen.items():
            seed_rows = []
            for k, fp in enumerate(fps):
                fenv = learned_env(bool(fp.probe), fp.hold)
                reqs = run_requests(fenv, test_ids, frozen_runner(fp, fenv), "index")
                r = row(f"{learner}-seed{k}", name, cost, reqs, seed=fp.card.get("seed"), trained_under=trained)
                rows.append(r)
                seed_rows.append(r)
                runs.setdefault(learner, reqs)
                tick(learner)
            numeric = [k for k, v in seed_rows[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
            mean = {key: float(np.mean([r[key] for r in seed_rows])) for key in numeric}
            mean.update(policy=learner, workload=name, backend="replay", cost_model=cost.name, exact=True,
                        trained_under=trained, seeds=len(seed_rows),
                        request_speedups=np.mean([r["request_speedups"] for r in seed_rows], axis=0).tolist(),
                        seed_min=min(r["committed_per_cost"] for r in seed_rows),
                        seed_max=max(r["committed_per_cost"] for r in seed_rows))  # fmt: skip
            rows.append(mean)
            base = next(r for r in rows if r["workload"] == name and r["cost_model"] == cost.name
                        and r["policy"] == "static-best-test")  # fmt: skip
            orc = next(r for r in rows if r["workload"] == name and r["cost_model"] == cost.name
                       and r["policy"] == "oracle")  # fmt: skip
            gap = orc["committed_per_cost"] - base["committed_per_cost"]  # < 0.1 % of the baseline: no headroom
            extras["headroom"].setdefault(learner, {})[name] = [
                (r["committed_per_cost"] - base["committed_per_cost"]) / gap
                if gap > 1e-3 * base["committed_per_cost"]
                else float("nan")
                for r in seed_rows
            ]
            fenv = learned_env(bool(fps[0].probe), fps[0].hold)
            extras["train_fit"].setdefault(learner, {})[name] = train_fit(env, train_ids, fps, best_train, fenv)
            if conf.ablation:
                extras["ablation"].setdefault(learner, {})[name] = ablation(fenv, test_ids, fps, grid, best_train[0])
        if conf.live_requests > 0 and cost.kind in ("roofline", "fitted"):  # the other kinds price replay only
            first = next(iter(frozen.values()), [])[:1]
            rows += live_rows(conf, trace, name, cost, grid, test_ids[: conf.live_requests], extras["static"], first,
                              env, calibration, acceptance, learned_env)  # fmt: skip
        for pol_name, reqs in runs.items():
            if pol_name in (*frozen, "static-best-train", "cascade", "evict", "oracle", "target-only"):
                plot[pol_name] = per_policy_plot_data(reqs)
        plots[name] = plot
    return rows, plots, extras


_MODELS: dict[tuple, Any] = {}


def live_rows(conf: MainConf, trace: Any, workload: str, cost: CostSpecConf, grid: ActionGrid,
              requests: Sequence[int], static: dict, frozen: Sequence[Any], replay: Any,
              calibration: Any = None, acceptance: Any = None,
              learned_replay: Callable[[bool, Hold], Any] | None = None) -> list[dict]:  # fmt: skip
    """The same held-out requests on the live engine (expertspec/Live-v0): target-only, static-best-train and
    the first learned seed, each with `replay_committed_per_cost`, replay's figure on the same requests (equal
    under a deterministic cost model: the live engine drafts, verifies and is priced as the trace says);
    `learned_replay(probe, hold)`: the replay env a learned policy runs in (its probe, its choice priced, its
    hold)."""
    from env.live import LiveEnv
    from env.models import load_models

    m = conf.models
    key = (m.target, m.drafter, m.predictor)
    if key not in _MODELS:
        _MODELS[key] = load_models(m.target, m.drafter, m.predictor)
    sampling = {"temperature": conf.workloads.temperature, "seed": 0} if conf.workloads.temperature > 0 else None
    probe = bool(frozen and frozen[0].probe)
    env = LiveEnv(models=_MODELS[key], prompts=[trace.prompt(i) for i in requests], probe=probe,
                  max_new_tokens=conf.workloads.max_new_tokens, sampling=sampling, grid=grid,
                  cost=env_cost(cost),
                  fit_trace=trace if cost.kind == "fitted" else None, calibration=calibration,
                  acceptance=acceptance, choice=conf.algo.price_choice,
                  hold=frozen[0].hold if frozen else None)  # fmt: skip
    local = list(range(len(requests)))
    out = []
    idx = tuple(static[f"{workload}/static-best-train"])
    actors = [("target-only", lambda v: env.codec.encode((0, 0, 0, 0)), False)] if grid.depths[0] == 0 else []
    actors.append(("static-best-train", static_runner(env, idx), False))
    if frozen:
        actors.append((f"{frozen[0].card.get('algo', 'learned')}-seed0", frozen_runner(frozen[0], env), True))
    shape, choice, hold = env.probe, env.choice_seconds, env.hold
    for label, act, learned in actors:
        # only the learned policy runs (and pays) the probe it observes, and pays its choice and holds
        env.probe, env.choice_seconds, env.hold = (shape, choice, hold) if learned else (None, 0.0, NO_HOLD)
        twin = learned_replay(probe, hold) if learned and learned_replay is not None else replay  # its replay env
        same = summarize(run_requests(twin, list(requests), act, "index")).committed_per_cost
        reqs = []
        for i in local:
            vec, _ = env.reset(options={"request": i})
            done = False
            while not done:
                vec, _, term, trunc, _ = env.step(act(vec))
                done = term or trunc
            reqs.append(list(env.session.results()[0].rounds))
        out.append(row(label, workload, cost, reqs, backend="live", replay_committed_per_cost=same))
    env.close()
    return out
