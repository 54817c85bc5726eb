"""The main job's stages as functions: record traces, build replay envs, train, evaluate.

    traces = record_traces(conf)                          # {workload: Trace}, cached by content
    envs   = replay_envs(traces, cost, requests="train")  # one ReplayEnv per workload
    paths  = train(conf, traces, cost, out_dir)           # frozen policies, one per seed
    rows   = ctrl.evaluation.evaluate(conf, traces, cost, policies)   # results.json rows

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

from ctrl.baselines import POLICY_FACTORIES
from ctrl.config import CostSpecConf, MainConf
from ctrl.metrics import summarize
from ctrl.rollout import (
    frozen_runner,
    run_requests,
)
from engine.runtime.action_grid import ActionGrid
from engine.runtime.hold import Hold


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
        widths, timed = list(fp.hidden_widths), any(c.kind == "fitted" for c in conf.costs)  # a stand-in timed
        if conf.algo.price_choice and timed and widths != list(conf.algo.net_arch):
            raise ValueError(f"policy_path={conf.policy_path}: its actor's hidden layers are {widths}, but the "
                             f"recording prices the choice of a stand-in of algo.net_arch={list(conf.algo.net_arch)}; "
                             f"set algo.net_arch=[{','.join(map(str, widths))}]")  # fmt: skip


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
    from env.record import check_layer_widths

    check_layer_widths(a.net_arch, "algo.net_arch")  # the actor's, and the stand-in's whose choice is priced
    try:
        hold_of(a)
    except ValueError as err:
        raise ValueError(f"algo.hold_rounds / algo.hold_after: {err}") from None
    from ctrl.hold_select import candidates

    candidates(hold_of(a), list(a.hold_select))


def _check_regimes(conf: MainConf) -> None:
    """The offload / EP options of every cost model, checked by building its cost model on the spec alone."""
    from env.costs import as_cost_conf, make_cost_model

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
            policy_hidden=list(conf.algo.net_arch),  # the stand-in whose choice the measured cost prices
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
               probe: bool = False, choice: bool = False, hold: Any = None):  # fmt: skip
    from env.replay import ReplayEnv

    return ReplayEnv(trace, grid=grid, cost=env_cost(cost), requests=requests, calibration=calibration,
                     acceptance=acceptance, action_kind=action_kind, probe=probe, choice=choice,
                     hold=hold)  # fmt: skip


def hold_of(algo: Any) -> Hold:
    """The hold of a learner's policies (engine.runtime.hold) from its AlgoConf."""
    return Hold(algo.hold_rounds, algo.hold_after)


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
    hold = hold_of(conf.algo)

    def run(probe: bool, folder: Path) -> list[Path]:
        def make_env(rank: int):
            name = names[rank % len(names)]
            train_ids, _ = split(traces[name], conf)
            return replay_env(traces[name], cost, grid, train_ids, calibration, acceptance, kind, probe,
                              algo.price_choice, hold)  # fmt: skip

        def make_eval_envs():
            return {n: replay_env(traces[n], cost, grid, split(traces[n], conf)[1], calibration, acceptance, kind,
                                  probe, algo.price_choice, hold) for n in names}  # fmt: skip

        card = {"card": {"cost_model": cost.name, "workloads": names,
                         "trace_digests": [traces[n].digest for n in names], "train_requests": conf.workloads.train,
                         "calibration": calibration.to_dict(), "acceptance": acceptance.to_dict(),
                         "probe": [grid.max_depth, max(grid.widths)] if probe else None,
                         "probe_source": source if probe else None,
                         "hold": hold.to_dict() if hold else None}}  # fmt: skip
        config = {**card, "cost": asdict(cost), "algo": asdict(algo), "main": asdict(conf)}  # W&B: resolved config
        return train_seeds(make_env, grid, algo, list(conf.seeds), folder, conf.wandb, config, progress,
                           make_eval_envs).policy_paths  # fmt: skip

    if len(variants) == 1:
        return _select_hold(conf, traces, cost, grid, calibration, acceptance, run(variants[0], home), variants[0])
    # the context probe costs every round: trained with and without it, the variant whose policies commit more per
    # cost on the training prompts (geometric mean over workloads and seeds) is kept; held-out prompts decide nothing
    fits: dict[str, float] = {}
    trained: dict[str, list[Path]] = {}
    for probe in variants:
        label = "context-probe" if probe else "no-probe"
        trained[label] = run(probe, home / "variants" / label)
        fits[label] = _train_fit(conf, traces, cost, grid, calibration, acceptance, _frozen(trained[label]), probe)
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
    return _select_hold(conf, traces, cost, grid, calibration, acceptance, out, best == "context-probe")


def _select_hold(conf: MainConf, traces: dict[str, Any], cost: CostSpecConf, grid: ActionGrid, calibration: Any,
                 acceptance: Any, paths: list[Path], probe: bool) -> list[Path]:  # fmt: skip
    """With conf.algo.hold_select: the hold (engine.runtime.hold) the trained policies deploy with, chosen on the
    training prompts among their trained one and every candidate (ctrl.hold_select), written into their cards."""
    if not conf.algo.hold_select or not paths:
        return paths
    from ctrl.hold_select import candidates, set_card_hold

    trained, frozen = hold_of(conf.algo), _frozen(paths)
    fits = {h: _train_fit(conf, traces, cost, grid, calibration, acceptance, frozen, probe, h)
            for h in candidates(trained, conf.algo.hold_select)}  # fmt: skip
    best = max(fits, key=lambda h: fits[h])  # ties: the first, the trained hold
    for path in paths:
        set_card_hold(path, best)
    record = {"selected": best.to_dict(), "trained": trained.to_dict(),
              "train_committed_per_cost": [[h.to_dict(), f] for h, f in fits.items()]}  # fmt: skip
    (Path(paths[0]).parent / "hold_selection.json").write_text(json.dumps(record))
    return paths


def _frozen(paths: Sequence[Path]) -> list[Any]:
    """The frozen policies at `paths`."""
    from engine.runtime.frozen import load_frozen_policy

    return [load_frozen_policy(p) for p in paths]


def _train_fit(conf: MainConf, traces: dict[str, Any], cost: CostSpecConf, grid: ActionGrid, calibration: Any,
               acceptance: Any, frozen: Sequence[Any], probe: bool, hold: Hold | None = None) -> float:  # fmt: skip
    """Geometric mean over workloads and seeds of the frozen policies' committed per cost on the training prompts
    (deployed with `hold`, default the trained one)."""
    vals = []
    for n in sorted(traces):
        train_ids, _ = split(traces[n], conf)
        env = replay_env(traces[n], cost, grid, train_ids, calibration, acceptance, probe=probe,
                         choice=conf.algo.price_choice, hold=hold_of(conf.algo) if hold is None else hold)  # fmt: skip
        vals += [summarize(run_requests(env, train_ids, frozen_runner(fp, env), "index")).committed_per_cost
                 for fp in frozen]  # fmt: skip
    return float(np.exp(np.mean(np.log(vals))))  # geometric: every workload weighs alike
