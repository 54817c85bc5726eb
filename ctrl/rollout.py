"""Running policies on a replay env: episodes, static action costs, the frozen learned policy as an actor, and
its two diagnostics — the fit on its own training prompts and the one-dimension-frozen ablation.

    rounds = run_requests(env, ids, act, "index")        # [request][round] RoundStats
    costs  = static_costs(env, ids)                      # [A] total cost of every grid action used statically
    bound  = request_level_bound(static_costs_by_request(env, ids))   # best action per request in hindsight
    spans  = span_bounds(env, ids, (16, 8), costs.min())  # best action per 16 / 8 tokens in hindsight
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ctrl.metrics import summarize
from engine.runtime.action_grid import ActionGrid


def run_request(env: Any, request: int, act: Callable[[Any], Any], kind: str, reset: Callable[[], None] | None = None):
    """One episode = one request; `act` takes the Observation ("spec": returns a SpecConfig) or the obs vector
    ("index": returns grid indices / an env action). Returns the episode's RoundStats."""
    e = env.unwrapped
    vec, _ = e.reset(options={"request": request})
    if reset is not None:
        reset()
    done = False
    while not done:
        a = act(e.observation()) if kind == "spec" else act(vec)
        vec, _, term, trunc, _ = e.step(a)
        done = term or trunc
    return list(e.rounds)


def run_requests(env, requests, act, kind, reset=None) -> list[list[Any]]:
    """`run_request` of every request, in order."""
    return [run_request(env, i, act, kind, reset) for i in requests]


def static_costs_by_request(env: Any, requests: Sequence[int]) -> np.ndarray:
    """Cost of every grid action used statically on each of `requests` [R, A] (env.oracle.static_returns)."""
    from env.oracle import static_returns

    return np.stack([static_returns(env, i)[1] for i in requests])


def static_costs(env: Any, requests: Sequence[int]) -> np.ndarray:
    """Total cost of every grid action used statically over `requests` [A]."""
    return static_costs_by_request(env, requests).sum(0)


def request_level_bound(costs: np.ndarray) -> float:
    """Committed per cost of the best static action *per request*, chosen in hindsight, ÷ that of the best one
    action for all (static-best on the same requests); `costs` [R, A] from `static_costs_by_request`.

    Every action commits the same tokens in replay, so this bounds any policy that holds one action per request,
    whatever it knows about the request (its workload, its acceptance rate, its future): what adapting per request
    can win at most. The rest of the oracle's headroom needs decisions that change within a request."""
    return float(costs.sum(0).min() / costs.min(1).sum())


def unflat(env, a: int) -> tuple[int, ...]:
    """Grid indices of the flat action `a` of `env`'s codec."""
    return env.unwrapped.codec.unflat(a)


def static_runner(env: Any, idx: Sequence[int]) -> Callable[[Any], Any]:
    """The static grid action `idx` (grid indices) as an env actor."""
    codec = env.unwrapped.codec
    return lambda vec: codec.encode(idx)


def frozen_runner(policy: Any, env: Any, freeze: dict[int, int] | None = None):
    """The frozen learned policy as an env actor; `freeze` pins action dimensions (ablation: {dim: index})."""

    def act(vec):
        idx = list(policy.act_index(vec))
        for d, i in (freeze or {}).items():
            idx[d] = i
        return env.unwrapped.codec.encode(idx)

    return act


def train_fit(env: Any, train_ids: Sequence[int], frozen: Sequence[Any], best_train: Sequence[int],
              policy_env: Any = None) -> list[float]:  # fmt: skip
    """Each seed's committed per cost on its own training prompts ÷ static-best-train's there (`best_train`, the
    grid indices of the action chosen on them): below 1 the learner does not even fit what it was trained on (the
    observation lacks what it needs), above 1 here but not on the held-out prompts it over-fits. `policy_env`: the
    env the learned policies run on (one with their probe), default `env`."""
    penv = env if policy_env is None else policy_env
    static = summarize(run_requests(env, train_ids, static_runner(env, best_train), "index"))
    return [summarize(run_requests(penv, train_ids, frozen_runner(fp, penv), "index")).committed_per_cost
            / static.committed_per_cost for fp in frozen]  # fmt: skip


def ablation(env, test_ids, frozen, grid: ActionGrid, k_best: int) -> list[dict[str, Any]]:
    """The learned policy with one action dimension frozen at a time (mean over seeds); `k_best`: the depth index
    of static-best-train, the "K fixed" variant's."""
    variants: list[tuple[str, dict[int, int]]] = [("all dimensions", {})]
    if len(grid.widths) > 1:
        variants.append(("W = 1", {1: grid.widths.index(1) if 1 in grid.widths else 0}))
    if len(grid.lams) > 1:
        variants.append(("λ = 0", {2: grid.lams.index(0.0) if 0.0 in grid.lams else 0}))
    if len(grid.rules) > 1:
        off = grid.rules.index(("all", 0.0)) if ("all", 0.0) in grid.rules else 0
        variants.append(("verification rule off", {3: off}))
    out = []
    for label, pin in variants:
        vals = []
        for fp in frozen:
            reqs = run_requests(env, test_ids, frozen_runner(fp, env, pin), "index")
            vals.append(summarize(reqs).committed_per_cost)
        out.append({"variant": label, "committed_per_cost": float(np.mean(vals))})
    # K fixed: the static-best-train depth, the rest as the policy chooses
    vals = [summarize(run_requests(env, test_ids, frozen_runner(fp, env, {0: k_best}), "index")).committed_per_cost
            for fp in frozen]  # fmt: skip
    out.append({"variant": f"K fixed = {grid.depths[k_best]}", "committed_per_cost": float(np.mean(vals))})
    return out


SPANS = (32, 16, 8, 4)  # tokens: the time scales at which the report splits the oracle's headroom


def span_bounds(env: Any, requests: Sequence[int], spans: Sequence[int], static_best: float) -> dict[str, float]:
    """{str(span): committed per cost ÷ static-best's} of the hindsight schedule that may change its action only
    once per `span` tokens (env.oracle.span_cost), over `requests`; `static_best`: the best one action's total cost
    on them. Empty under a stateful cost (the spans would be priced on its stateless proxy)."""
    from env.oracle import span_cost

    if env.unwrapped.cost_model.stateful:
        return {}
    return {str(s): float(static_best / sum(span_cost(env, i, s) for i in requests)) for s in spans}
