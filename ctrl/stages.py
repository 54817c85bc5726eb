"""The main job's per-cost-model stage, and the cache of the policies it trains.

    learned = learned_policies(conf, traces, cost)     # {learner: [frozen policy folders]}, cached by content
    stages  = run_cost_stages(conf, traces)            # [(learned, rows, plot data, extras)] per cost model

With conf.workers > 1 the cost models run side by side in spawned processes (the traces are sent to them);
a cost model that evaluates another's policies (`policies_from`) runs in a second wave, after them.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm

from ctrl.config import MainConf
from ctrl.evaluation import evaluate
from ctrl.pipeline import train, train_steps
from engine.paths import cache_dir

POLICY_CACHE_VERSION = 15  # bump when a cached policy would differ (2: calibrated observations, 3: numpy actor card,
# 4: AggreVaTe warm-started by behaviour cloning, best iteration kept, 5: the probe observation, 6: one-token rounds'
# overlap not observed, 7: the probed match's source, 8: one robust single-token forward fit for K = 0 and T_AR,
# 9: the context probe for drafters without a probe, 10: learned policies pay their choice, algo.price_choice,
# 11: the measured cost's warm-up surcharge, AggreVaTe's Q by (position, round index), 12: its switching
# surcharge, the round state's previous kind, 13: the card's probe_source, a lookup policy's plain rounds unasked,
# 14: the choice's cooling, the one-token host rounds apart by their medians, 15: algo.hold_rounds / hold_after)


LOGGING_ONLY = ("eval_every", "checkpoint_every", "vec_env")  # AlgoConf fields that leave the trained policy as is
REGIME_FIELDS = {"roofline-offload": ("offload_cache", "offload_policy"), "roofline-ep": ("ep_ranks", "ep_placement")}


def _cost_key(cost) -> dict:
    """What of a cost model determines its trained policies (the fields of its kind only: the roofline and
    fitted keys stay those of before the offload / EP kinds existed)."""
    keep = ("name", "kind", "hardware", "model_spec", "drafter_spec", *REGIME_FIELDS.get(cost.kind, ()))
    return {k: v for k, v in asdict(cost).items() if k in keep}


def _policy_cache(conf: MainConf, traces, cost) -> Path:
    algo = {k: v for k, v in asdict(conf.algo).items() if k not in LOGGING_ONLY}
    key = json.dumps([POLICY_CACHE_VERSION, sorted((n, t.digest) for n, t in traces.items()), _cost_key(cost),
                      algo, list(conf.seeds), asdict(conf.grid), conf.workloads.train],
                     sort_keys=True)  # fmt: skip
    return cache_dir() / "policies" / hashlib.sha256(key.encode()).hexdigest()[:16]


def learned_policies(conf: MainConf, traces, cost, position: int = 0) -> dict[str, list[Path]]:
    """The frozen policies evaluated under `cost`: conf.policy_path, else every learner's seeds trained under
    `cost` (or under `cost.policies_from`), from the cache or trained now."""
    if conf.policy_path:
        return {"learned": [Path(conf.policy_path)]}
    if cost.policies_from:
        cost = next(c for c in conf.costs if c.name == cost.policies_from)  # check_conf: it exists
    cache = _policy_cache(conf, traces, cost)
    learned: dict[str, list[Path]] = {}
    for learner in conf.learners:
        paths = sorted(cache.glob(f"{cost.name}/{learner}/seed*"))
        if len(paths) != len(conf.seeds):
            tb = tqdm(total=train_steps(conf, traces, learner), desc=f"train {learner} ({cost.name})",
                      disable=not conf.progress, position=position)  # fmt: skip
            paths = train(conf, traces, cost, cache, progress=lambda n, tb=tb: tb.update(n), learner=learner)
            tb.close()
        learned[learner] = paths
    return learned


def cost_stage(conf: MainConf, index: int, traces, position: int = 0, worker: bool = False) -> tuple:
    """Train (or reuse) the learned policies under conf.costs[index] and evaluate every policy under it:
    (learned paths, rows, plot data, extras). In a worker process when conf.workers > 1 (`traces` pickled to it:
    plain arrays, a few MB per workload, so no model is loaded there)."""
    cost = conf.costs[index]
    if worker:  # one intra-op thread each, as the parent runs after recording
        import torch

        torch.set_num_threads(1)
    learned = learned_policies(conf, traces, cost, position)
    paths = [p for v in learned.values() for p in v]
    n_eval = len(traces) * (len(conf.policies) + 4 + len(paths))
    eb = tqdm(total=n_eval, desc=f"evaluate ({cost.name})", disable=not conf.progress, position=position)
    rows, plots, extras = evaluate(conf, traces, cost, learned, on_policy=lambda name: eb.update(1))
    eb.close()
    return learned, rows, plots, extras


def run_cost_stages(conf: MainConf, traces) -> list[tuple]:
    """`cost_stage` of every cost model, in conf.costs order: side by side in conf.workers processes, those
    trained under another cost model's policies (policies_from) after the ones they take them from."""
    n = len(conf.costs)
    if conf.workers <= 1 or n == 1:
        return [cost_stage(conf, i, traces) for i in range(n)]
    out: dict[int, tuple] = {}
    waves = [[i for i, c in enumerate(conf.costs) if not c.policies_from],
             [i for i, c in enumerate(conf.costs) if c.policies_from]]  # fmt: skip
    with ProcessPoolExecutor(max_workers=min(conf.workers, n), mp_context=mp.get_context("spawn")) as pool:
        for wave in waves:
            futures = {i: pool.submit(cost_stage, conf, i, traces, k % conf.workers, True) for k, i in enumerate(wave)}
            out.update({i: f.result() for i, f in futures.items()})
    return [out[i] for i in range(n)]
