"""The published and shipped rules as the main job configures them: each from a profile of the training prompts
(`profile`: the verification cost curve, the round cost per K, acceptance by draft position, the best static chain
and stop rule), bounded by the action grid (`POLICY_FACTORIES`: name -> factory(profile, grid)).

    prof = profile(env, train_ids, grid, static_costs(env, train_ids))
    policy = POLICY_FACTORIES["evict"](prof, grid)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ctrl.metrics import summarize
from ctrl.policies import make_policy
from ctrl.rollout import unflat
from engine.runtime.action_grid import ActionGrid
from engine.spec.config import SpecConfig


def profile(env: Any, requests: Sequence[int], grid: ActionGrid, static: np.ndarray) -> dict[str, Any]:
    """What the published rules are configured with, measured on training prompts only: the verification cost
    curve T_verify(n)/T_AR (EVICT's profiled C(k)), the round cost ITL(K)/T_AR (vLLM's profiled ITL at batch
    size 1), acceptance per draft position (vLLM's prior) and the best static K (a vLLM batch-size table)."""
    e = env.unwrapped
    kmax = grid.max_depth
    verify: dict[int, list[float]] = {}
    itl = {0: 1.0}
    acc_rounds = []
    for k in range(0, kmax + 1):
        full = []
        for i in requests:
            e.reset(options={"request": i})
            done = False
            while not done:
                _, _, term, trunc, info = e.step(SpecConfig(depth=k, width=1))
                done = term or trunc
                verify.setdefault(info["verified"], []).append(info["cost_verify"] / info["cost_ar"])
                if info["verified"] == k + 1:
                    full.append(info["cost"] / info["cost_ar"])
            if k == kmax:
                acc_rounds.append(list(e.rounds))
        if k > 0:
            itl[k] = float(np.mean(full)) if full else float("nan")
    curve = [float(np.mean(verify[n])) if n in verify else float("nan") for n in range(1, kmax + 2)]
    for n in range(1, len(curve)):  # fill sizes never seen (end of requests) by the last known ratio
        if curve[n] != curve[n]:
            curve[n] = curve[n - 1]
    for k in range(1, kmax + 1):
        if itl[k] != itl[k]:
            itl[k] = itl[k - 1]
    acc = summarize(acc_rounds).acceptance_by_depth
    acc = [0.0 if a != a else float(a) for a in acc] + [0.0] * (kmax - len(acc))
    # vLLM's batch-size table holds one K per batch size for chains with every draft verified: the best such K
    chain_all = [a for a in range(len(static)) if (s := grid.spec(unflat(env, a))).width == 1
                 and s.verify_rule == "all" and s.lam == 0]  # fmt: skip
    best = grid.spec(unflat(env, min(chain_all or range(len(static)), key=lambda a: static[a])))
    # DISCO / SpecDec++: a chain to Kmax stopped by the grid's stop rule (raw or calibrated acceptance estimate)
    # and threshold that give the lowest cost on the training prompts
    codec, chain = e.codec, grid.widths.index(1) if 1 in grid.widths else None
    stop_rules = [(v, rule, t) for v, (rule, t) in enumerate(grid.rules) if rule in ("threshold", "calibrated")]
    k_top = grid.depths.index(kmax)
    stops = [(static[codec.flat((k_top, chain, 0, v))], rule, t) for v, rule, t in stop_rules if chain is not None]
    disco = min(stops)[1:] if stops else ("threshold", 0.3)
    return {"verify_curve": curve, "itl": itl, "acceptance": acc[:kmax], "best_static_k": best.depth,
            "disco_rule": list(disco)}  # fmt: skip


def _sglang(prof: dict, grid: ActionGrid):
    from ctrl.policies.sglang import DEFAULT_ADAPTIVE_CONFIG

    kmax = grid.max_depth
    cfg = {bs: {**slot, "candidate_steps": [k for k in slot["candidate_steps"] if k <= kmax] or [0]}
           for bs, slot in DEFAULT_ADAPTIVE_CONFIG.items()}  # fmt: skip
    return make_policy("sglang-adaptive", config=cfg, initial_steps=min(3, kmax))


def _ucb(prof: dict, grid: ActionGrid):
    from ctrl.policies.ucb import DEFAULT_ARMS

    arms = [(k, w) for k, w in DEFAULT_ARMS if k <= grid.max_depth and w in grid.widths]
    return make_policy("ucb", arms=arms)


# name -> factory(profile measured on the training prompts, action grid); the grid bounds what they may choose
POLICY_FACTORIES: dict[str, Callable[[dict, ActionGrid], Any]] = {
    "cascade": lambda p, g: make_policy("cascade", k_max=g.max_depth),
    "evict": lambda p, g: make_policy("goodput", cost_curve=p["verify_curve"]),
    "ucb": _ucb,
    "disco": lambda p, g: make_policy("disco", depth=g.max_depth, rule=p["disco_rule"][0],
                                      threshold=p["disco_rule"][1]),
    "sglang-adaptive": _sglang,
    "vllm-table": lambda p, g: make_policy("vllm-table", table=[[1, 1, p["best_static_k"]]],
                                           num_speculative_tokens=max(p["best_static_k"], 1)),
    "vllm-goodput": lambda p, g: make_policy("vllm-goodput", batch_stats={1: p["itl"]},
                                             acceptance_rate_per_pos=p["acceptance"],
                                             num_speculative_tokens=g.max_depth),
}  # fmt: skip
