"""The main job's stages as functions: record traces, build replay envs, train, evaluate.

    traces = record_traces(conf)                          # {workload: Trace}, cached by content
    envs   = replay_envs(traces, cost, requests="train")  # one ReplayEnv per workload
    paths  = train(conf, traces, cost, out_dir)           # frozen policies, one per seed
    rows   = evaluate(conf, traces, cost, policies)       # results.json rows

Split: the first `workloads.train` prompts of each workload train (and choose "static-best-train"), the
next `workloads.test` are held out for every reported figure. Every policy runs on the same traces under
the same cost model; in replay every policy commits the same tokens (greedy or drafter-invariant sampling),
so the policies differ only in cost.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

from ctrl.baselines import POLICY_FACTORIES, profile
from ctrl.config import CostSpecConf, MainConf
from ctrl.metrics import summarize
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
from engine.spec.config import SpecConfig


def grid_of(conf: MainConf) -> ActionGrid:
    g = conf.grid
    return ActionGrid(depths=tuple(g.depths), widths=tuple(g.widths), lams=tuple(g.lams),
                      rules=tuple((str(r), float(t)) for r, t in g.rules))  # fmt: skip


def check_conf(conf: MainConf) -> None:
    """Clear errors for a configuration that cannot run, before any model is loaded."""
    from engine.cost.roofline import load_hardware, load_model_spec

    w = conf.workloads
    from engine.workloads import BUILTIN

    unknown = [n for n in w.names if n not in BUILTIN and n != "mixed"]
    if unknown:
        raise ValueError(f"unknown workloads {unknown}; built-in: {sorted(BUILTIN)} (or workloads.prompts=PATH)")
    if not w.names and not w.prompts:
        raise ValueError("no workload: set workloads.names or workloads.prompts")
    if w.prompts and not Path(w.prompts).is_file():
        raise FileNotFoundError(f"workloads.prompts={w.prompts}: no such file")
    if w.train < 1 or w.test < 1:
        raise ValueError(f"workloads.train and workloads.test must be >= 1, got {w.train}, {w.test}")
    from env.costs import COST_KINDS

    names = [c.name for c in conf.costs]
    if len(set(names)) != len(names):
        raise ValueError(f"cost model names must be unique, got {names}")
    for c in conf.costs:
        if c.kind not in COST_KINDS:
            raise ValueError(f"cost {c.name}: kind must be one of {COST_KINDS}, got {c.kind!r}")
        if c.kind != "fitted":
            load_hardware(c.hardware)
            if c.model_spec != "target":
                load_model_spec(c.model_spec)
        if c.policies_from is not None:
            src = next((x for x in conf.costs if x.name == c.policies_from), None)
            if src is None or src.policies_from is not None or src is c:
                raise ValueError(f"cost {c.name}: policies_from={c.policies_from!r} must name another entry of "
                                 f"costs that trains its own policies (one of {names})")  # fmt: skip
    _check_regimes(conf)
    grid = grid_of(conf)
    if grid.max_depth > conf.models.kmax or not set(grid.widths) <= set(conf.models.widths):
        raise ValueError(f"grid depths/widths {grid.depths}/{grid.widths} exceed what is recorded "
                         f"(kmax {conf.models.kmax}, widths {conf.models.widths})")  # fmt: skip
    if not conf.seeds:
        raise ValueError("seeds must name at least one training seed")
    if conf.workers < 1:
        raise ValueError(f"workers must be >= 1 (processes for recording and the cost models), got {conf.workers}")
    from ctrl.agent import ALGOS
    from ctrl.aggrevate import EXPERTS

    for learner in conf.learners:
        if learner not in ALGOS:
            raise ValueError(f"unknown learner {learner!r}; choose from {ALGOS}")
    if conf.algo.expert not in EXPERTS:
        raise ValueError(f"algo.expert must be one of {EXPERTS}, got {conf.algo.expert!r}")
    if conf.algo.imitation_entropy < 0:
        raise ValueError(f"algo.imitation_entropy must be >= 0, got {conf.algo.imitation_entropy}")
    _check_algo(conf.algo)
    from env.models import NGRAM_DRAFTER

    if str(conf.models.drafter) == NGRAM_DRAFTER and conf.models.predictor:
        raise ValueError(f"models.drafter=ngram (prompt lookup) has no hidden states for the expert predictor "
                         f"{conf.models.predictor!r}: pass models.predictor=null")  # fmt: skip
    for name in conf.policies:
        if name not in POLICY_FACTORIES:
            raise ValueError(f"unknown policy {name!r}; choose from {sorted(POLICY_FACTORIES)}")
    if conf.policy_path:  # a given frozen policy: its artefact and its action grid must fit this evaluation
        from engine.runtime.frozen import load_frozen_policy

        fp = load_frozen_policy(conf.policy_path)  # missing / foreign observation layout: clear errors
        if fp.grid != grid:
            raise ValueError(f"policy_path={conf.policy_path}: the policy acts on the grid {fp.grid.to_dict()}, but "
                             f"this evaluation's grid is {grid.to_dict()}; set grid.* to match")  # fmt: skip


def _check_algo(a: Any) -> None:
    """The learners' numeric options: clear errors before any recording."""
    from ctrl.agent import ALGOS, VEC_ENVS

    if a.name not in ALGOS:
        raise ValueError(f"algo.name must be one of {ALGOS}, got {a.name!r}")
    if a.vec_env not in VEC_ENVS:
        raise ValueError(f"algo.vec_env must be one of {VEC_ENVS}, got {a.vec_env!r}")
    positive = ("total_timesteps", "n_envs", "n_steps", "batch_size", "n_epochs", "iterations", "epochs",
                "buffer_size", "train_freq")  # fmt: skip
    for k in positive:
        if getattr(a, k) < 1:
            raise ValueError(f"algo.{k} must be >= 1, got {getattr(a, k)}")
    if a.gradient_steps == 0 or a.gradient_steps < -1:
        raise ValueError(f"algo.gradient_steps must be >= 1, or -1 (one per transition), got {a.gradient_steps}")
    for k in ("learning_starts", "eval_every", "checkpoint_every"):
        if getattr(a, k) < 0:
            raise ValueError(f"algo.{k} must be >= 0 (0: {'none' if k == 'learning_starts' else 'off'}), "
                             f"got {getattr(a, k)}")  # fmt: skip
    if not 0 < a.tau <= 1 or a.action_noise < 0 or a.learning_rate <= 0:
        raise ValueError(f"algo.tau must be in (0, 1], algo.action_noise >= 0 and algo.learning_rate > 0; got "
                         f"{a.tau}, {a.action_noise}, {a.learning_rate}")  # fmt: skip


def _check_regimes(conf: MainConf) -> None:
    """The offload / EP options of every cost model, checked by building its cost model on the spec alone."""
    from env.costs import make_cost_model
    from env.replay import as_cost_conf

    for c in conf.costs:
        if c.kind in ("roofline-offload", "roofline-ep") and c.model_spec != "target":
            make_cost_model(as_cost_conf(env_cost(c)), {})  # ValueError: bad fraction, policy, ranks, placement


# ---------------------------------------------------------------------------------------------- traces
def record_traces(conf: MainConf, on_position: Callable[[], None] | None = None) -> dict[str, Any]:
    """One trace per workload (train + test prompts), recorded once and cached by content; the requests of
    every workload not cached yet are shared among `conf.workers` processes (env.record_pool)."""
    from env.models import load_models
    from env.record import RecordConf, SamplingConf, WorkloadConf
    from env.record_pool import record_many

    m, w = conf.models, conf.workloads
    models = load_models(m.target, m.drafter, m.predictor)
    names = list(w.names) + ([str(w.prompts)] if w.prompts else [])
    confs = []
    for name in names:
        is_file = name == w.prompts
        confs.append(RecordConf(
            target=m.target, drafter=m.drafter, predictor=m.predictor, kmax=m.kmax, widths=list(m.widths),
            max_new_tokens=w.max_new_tokens, max_prompt_tokens=w.max_prompt_tokens,
            workload=WorkloadConf(name="mixed" if is_file else name, n=w.train + w.test,
                                  prompts=name if is_file else None),
            sampling=SamplingConf(temperature=w.temperature), progress=False,
        ))  # fmt: skip
    traces = {}
    for name, trace in zip(names, record_many(confs, conf.workers, models, on_position)):
        if trace.num_requests < w.train + 1:
            raise ValueError(f"workload {name}: {trace.num_requests} usable prompts, need > workloads.train={w.train}")
        traces[Path(name).stem if name == w.prompts else name] = trace
    return traces


def split(trace: Any, conf: MainConf) -> tuple[list[int], list[int]]:
    n = trace.num_requests
    train = list(range(min(conf.workloads.train, n - 1)))
    test = list(range(len(train), min(n, len(train) + conf.workloads.test)))
    return train, test


def replay_env(trace: Any, cost: CostSpecConf, grid: ActionGrid, requests: Sequence[int] | None = None,
               calibration: Any = None, acceptance: Any = None, action_kind: str = "multidiscrete",
               probe: bool = False, choice: bool = False):  # fmt: skip
    from env.replay import ReplayEnv

    return ReplayEnv(trace, grid=grid, cost=env_cost(cost), requests=requests, calibration=calibration,
                     acceptance=acceptance, action_kind=action_kind, probe=probe, choice=choice)  # fmt: skip


def probes(conf: MainConf, traces: dict[str, Any]) -> list[bool]:
    """Whether learned policies observe each round's probe, as the variants to train: conf.algo.probe: the drafter's
    own (the prompt lookup), or for a drafter without one the context probe (engine.runtime.context_probe), then both
    with and without it when conf.algo.probe_select (`train` keeps the one that does better on the training prompts)."""
    if not conf.algo.probe:
        return [False]
    if conf.algo.probe_select and probe_source(traces) == "context":
        return [True, False]
    return [True]


def probe_source(traces: dict[str, Any]) -> str:
    """Where a learned policy's probe comes from (its card's `probe_source`): "drafter" when every trace's drafter has
    its own (the prompt lookup's: nothing probed, nothing to draft), else "context" (the context probe)."""
    from env.costs import drafter_probes

    return "drafter" if all(drafter_probes(t) for t in traces.values()) else "context"


def train_steps(conf: MainConf, traces: dict[str, Any], learner: str) -> int:
    """The progress units `train` reports for `learner` (ctrl.agent.progress_steps per seed and probe variant)."""
    from ctrl.agent import progress_steps

    return progress_steps(conf.algo, learner) * len(conf.seeds) * len(probes(conf, traces))


def env_cost(cost: CostSpecConf) -> dict[str, Any]:
    """The environments' `cost` argument (env.costs.CostConf fields) of a cost model of the main job."""
    out = dict(kind=cost.kind, hardware=cost.hardware, model_spec=cost.model_spec, drafter_spec=cost.drafter_spec)
    if cost.kind == "roofline-offload":
        out.update(offload_cache=cost.offload_cache, offload_policy=cost.offload_policy)
    if cost.kind == "roofline-ep":
        out.update(ep_ranks=cost.ep_ranks, ep_placement=cost.ep_placement)
    return out


def calibrate(conf: MainConf, traces: dict[str, Any]) -> Any:
    """One isotonic confidence calibration per depth over every workload's training requests (env.calibration)."""
    from env.calibration import fit_calibration_many

    return fit_calibration_many([(traces[n], split(traces[n], conf)[0]) for n in sorted(traces)])


def fit_acceptance_model(conf: MainConf, traces: dict[str, Any]) -> Any:
    """The calibrated verification rule's AcceptanceModel over every workload's training requests
    (env.calibration.fit_acceptance: draft probability × depth × agreement with the prompt-lookup continuation)."""
    from env.calibration import fit_acceptance

    return fit_acceptance([(traces[n], split(traces[n], conf)[0]) for n in sorted(traces)])


def row(policy: str, workload: str, cost: CostSpecConf, requests: list[list[Any]], backend: str = "replay",
        exact: bool = True, **extra: Any) -> dict[str, Any]:  # fmt: skip
    s = summarize(requests).as_dict()
    s.pop("acceptance_by_depth")
    return dict(policy=policy, workload=workload, backend=backend, cost_model=cost.name, exact=exact, **s, **extra)


def per_policy_plot_data(requests: list[list[Any]]) -> dict[str, Any]:
    s = summarize(requests)
    return {
        "acceptance_by_depth": [0.0 if math.isnan(a) else a for a in s.acceptance_by_depth],
        "request_speedups": s.request_speedups,
        "actions": [(r.depth, r.width) for r in requests[0]],
        "footprint": [(r.verified_tokens, float(np.mean(r.distinct_experts))) for q in requests for r in q
                      if len(r.distinct_experts)],
    }  # fmt: skip


# ---------------------------------------------------------------------------------------------- training
def train(conf: MainConf, traces: dict[str, Any], cost: CostSpecConf, out_dir: Path, progress=None,
          learner: str | None = None) -> list[Path]:  # fmt: skip
    """`learner` (default conf.algo.name: ppo | aggrevate | aggrevate+ppo | sac | td3) over every workload's
    training requests (one replay env per workload, round-robin over the vectorised envs), one frozen policy per
    seed under `out_dir/<cost name>/<learner>/seed<k>`; the held-out evaluation callback (conf.algo.eval_every)
    replays every workload's held-out requests, logging only."""
    from ctrl.agent import action_kind, train_seeds

    grid = grid_of(conf)
    names = sorted(traces)
    calibration = calibrate(conf, traces)
    acceptance = fit_acceptance_model(conf, traces)
    kind = action_kind(learner or conf.algo.name)
    algo = replace(conf.algo, name=learner or conf.algo.name)
    variants = probes(conf, traces)
    home = out_dir / cost.name / algo.name
    source = probe_source(traces)

    def run(probe: bool, folder: Path) -> list[Path]:
        def make_env(rank: int):
            name = names[rank % len(names)]
            train_ids, _ = split(traces[name], conf)
            return replay_env(traces[name], cost, grid, train_ids, calibration, acceptance, kind, probe,
                              algo.price_choice)  # fmt: skip

        def make_eval_envs():
            return {n: replay_env(traces[n], cost, grid, split(traces[n], conf)[1], calibration, acceptance, kind,
                                  probe, algo.price_choice) for n in names}  # fmt: skip

        card = {"card": {"cost_model": cost.name, "workloads": names,
                         "trace_digests": [traces[n].digest for n in names], "train_requests": conf.workloads.train,
                         "calibration": calibration.to_dict(), "acceptance": acceptance.to_dict(),
                         "probe": [grid.max_depth, max(grid.widths)] if probe else None,
                         "probe_source": source if probe else None}}  # fmt: skip
        config = {**card, "cost": asdict(cost), "algo": asdict(algo), "main": asdict(conf)}  # W&B: resolved config
        return train_seeds(make_env, grid, algo, list(conf.seeds), folder, conf.wandb, config, progress,
                           make_eval_envs).policy_paths  # fmt: skip

    if len(variants) == 1:
        return run(variants[0], home)
    # the context probe costs every round: trained with and without it, the variant whose policies commit more per
    # cost on the training prompts (geometric mean over workloads and seeds) is kept; held-out prompts decide nothing
    fits: dict[str, float] = {}
    trained: dict[str, list[Path]] = {}
    for probe in variants:
        label = "context-probe" if probe else "no-probe"
        trained[label] = run(probe, home / "variants" / label)
        fits[label] = _train_fit(conf, traces, cost, grid, calibration, acceptance, trained[label], probe)
    best = max(fits, key=lambda k: fits[k])
    home.mkdir(parents=True, exist_ok=True)
    (home / "probe_selection.json").write_text(json.dumps({"selected": best, "train_committed_per_cost": fits}))
    out = []
    for path in trained[best]:
        dest = home / path.name
        if dest.exists():
            shutil.rmtree(dest)
        shutil.copytree(path, dest)
        out.append(dest)
    return out


def _train_fit(conf: MainConf, traces: dict[str, Any], cost: CostSpecConf, grid: ActionGrid, calibration: Any,
               acceptance: Any, paths: Sequence[Path], probe: bool) -> float:  # fmt: skip
    """Geometric mean over workloads and seeds of the frozen policies' committed per cost on the training prompts."""
    from engine.runtime.frozen import load_frozen_policy

    frozen = [load_frozen_policy(p) for p in paths]
    vals = []
    for n in sorted(traces):
        train_ids, _ = split(traces[n], conf)
        env = replay_env(traces[n], cost, grid, train_ids, calibration, acceptance, probe=probe,
                         choice=conf.algo.price_choice)  # fmt: skip
        vals += [summarize(run_requests(env, train_ids, frozen_runner(fp, env), "index")).committed_per_cost
                 for fp in frozen]  # fmt: skip
    return float(np.exp(np.mean(np.log(vals))))  # geometric: every workload weighs alike


# ---------------------------------------------------------------------------------------------- evaluation
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
        learned_envs: dict[bool, Any] = {}

        def learned_env(probe: bool, envs=learned_envs, trace=trace, env=env) -> Any:
            if probe not in envs:
                envs[probe] = replay_env(trace, cost, grid, calibration=calibration, acceptance=acceptance, probe=probe,
                                         choice=conf.algo.price_choice) if probe or conf.algo.price_choice else env
            return envs[probe]

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
                fenv = learned_env(bool(fp.probe))
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
            fenv = learned_env(bool(fps[0].probe))
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
              learned_replay: Callable[[bool], Any] | None = None) -> list[dict]:  # fmt: skip
    """The same held-out requests on the live engine (expertspec/Live-v0): target-only, static-best-train and
    the first learned seed, each with `replay_committed_per_cost`, replay's figure on the same requests (equal
    under a deterministic cost model: the live engine drafts, verifies and is priced as the trace says);
    `learned_replay(probe)`: the replay env a learned policy runs in (its probe, its choice priced)."""
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
                  acceptance=acceptance, choice=conf.algo.price_choice)  # fmt: skip
    local = list(range(len(requests)))
    out = []
    idx = tuple(static[f"{workload}/static-best-train"])
    actors = [("target-only", lambda v: env.codec.encode((0, 0, 0, 0)), False)] if grid.depths[0] == 0 else []
    actors.append(("static-best-train", static_runner(env, idx), False))
    if frozen:
        actors.append((f"{frozen[0].card.get('algo', 'learned')}-seed0", frozen_runner(frozen[0], env), True))
    shape, choice = env.probe, env.choice_seconds
    for label, act, learned in actors:
        # only the learned policy runs (and pays) the probe it observes, and pays its choice
        env.probe, env.choice_seconds = (shape, choice) if learned else (None, 0.0)
        twin = learned_replay(probe) if learned and learned_replay is not None else replay  # the replay env it ran in
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
