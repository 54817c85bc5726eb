"""The hindsight oracle: a DP no static or random policy beats on its trace, and a replay-only policy."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from conftest import SMALL_GRID  # noqa: E402

from env.oracle import HindsightOracle, headroom, plan, span_cost, static_returns
from env.replay import ReplayEnv

COSTS = [{"kind": "roofline", "model_spec": "target"}, {"kind": "roofline"}, {"kind": "fitted"}]


def _episode(e, req, act) -> tuple[float, list[dict]]:
    """(return, every step's info) of one episode of request `req`, act(obs) -> env action."""
    obs, _ = e.reset(options={"request": req})
    total, infos = 0.0, []
    while True:
        obs, r, term, trunc, info = e.step(act(obs))
        total += r
        infos.append(info)
        if term or trunc:
            return total, infos


def _check_the_oracle_bounds(e, req, rng, random_policies: int) -> None:
    """No static or random policy beats the oracle's return on `req`, the oracle as a policy reaches it, and the
    best static action's return equals stepping it."""
    best = plan(e, req, "return").best
    fastest = plan(e, req, "cost").best
    rets, costs = static_returns(e, req)
    assert np.all(rets <= best + 1e-9) and np.all(costs >= fastest - 1e-12)
    for _ in range(random_policies):
        assert _episode(e, req, lambda obs: rng.integers(e.codec.nvec))[0] <= best + 1e-9
    assert _episode(e, req, HindsightOracle(e).action)[0] == pytest.approx(best, abs=1e-9)
    a = int(np.argmax(rets))
    assert _episode(e, req, lambda obs: e.codec.encode(e.codec.unflat(a)))[0] == pytest.approx(rets[a], abs=1e-9)


@pytest.mark.parametrize("cost", COSTS, ids=["target", "qwen3-30b", "fitted"])
def test_no_policy_beats_the_oracle(greedy_trace, cost):
    e = ReplayEnv(greedy_trace, grid={**SMALL_GRID, "lams": [0.0, 1.0]}, cost=cost, cache=False)
    rng = np.random.default_rng(0)
    for req in range(greedy_trace.num_requests):
        _check_the_oracle_bounds(e, req, rng, 20)


def test_span_cost_spans_the_static_best_to_the_oracle(greedy_trace):
    """span 1 = the oracle's least cost, a span over the whole request = its best static action; in between a
    brute force over every per-span schedule of actions (a round starting at t plays the action of span t // span)
    agrees, and finer spans (divisors) never cost more."""
    e = ReplayEnv(greedy_trace, grid=SMALL_GRID, cost={"kind": "roofline"}, cache=False)
    tables, A = e.tables, e.tables.cost.shape[1]
    for req in range(greedy_trace.num_requests):
        pos = greedy_trace.positions_of(req)
        T = len(pos)
        assert span_cost(e, req, 1) == pytest.approx(plan(e, req, "cost").best, rel=1e-12)
        assert span_cost(e, req, T) == pytest.approx(static_returns(e, req)[1].min(), rel=1e-12)
        span = (T + 1) // 2  # two spans: every schedule is A ** 2
        brute = np.inf
        for sched in itertools.product(range(A), repeat=2):
            t, total = 0, 0.0
            while t < T:
                a = sched[t // span]
                total += float(tables.cost[pos.start + t, a])
                t += int(tables.committed_pa[pos.start + t, a])
            brute = min(brute, total)
        assert span_cost(e, req, span) == pytest.approx(brute, rel=1e-12)
        costs = [span_cost(e, req, s) for s in (1, 2, 4, 8, 16)]
        assert all(a <= b * (1 + 1e-12) for a, b in zip(costs, costs[1:]))
    with pytest.raises(ValueError, match="span"):
        span_cost(e, 0, 0)


def test_headroom_report(greedy_trace):
    e = ReplayEnv(greedy_trace, grid=SMALL_GRID, cost={"kind": "roofline"}, cache=False)
    h = headroom(e)
    assert h["oracle_return"] >= h["best_static_return"]
    assert h["oracle_speedup"] >= h["best_static_speedup"] > 0 and h["headroom_speedup"] >= 1.0


def test_oracle_needs_replay():
    with pytest.raises(TypeError, match="Replay-v0"):
        HindsightOracle(object())


WARMUP = (4e-4, 2e-4, 1e-4, 5e-5)  # seconds: a request's rounds 0..3 after its prefill cost this much more


@pytest.fixture
def warm_fitted(monkeypatch):
    """The fitted cost with a warm-up surcharge (engine.cost.warmup), whatever the short test traces measure."""
    from engine.cost.warmup import WarmupCost
    from env.costs import FittedCostModel

    monkeypatch.setattr(FittedCostModel, "warmup_cost", lambda self: WarmupCost(WARMUP))
    return {"kind": "fitted"}


def test_the_warm_up_is_priced_by_round_index_and_the_dps_stay_exact(greedy_trace, warm_fitted):
    """Each round pays w(its index in the episode), T_AR at position t plain decoding's w(t); the oracle's DP over
    (position, round index) is still a bound every policy meets with equality only by following it, static_returns
    equals stepping each action, and span_cost equals a brute force that prices the surcharge per round."""
    e = ReplayEnv(greedy_trace, grid=SMALL_GRID, cost=warm_fitted, cache=False)
    rng = np.random.default_rng(1)
    A = e.tables.cost.shape[1]
    for req in range(greedy_trace.num_requests):
        pos = greedy_trace.positions_of(req)
        T = len(pos)
        surcharge = [e.tables.ar[p] - e.cost_model.ar(int(e.tables.context[p])) for p in pos]
        assert surcharge == pytest.approx([*WARMUP, *[0.0] * (T - len(WARMUP))], abs=1e-15)
        _check_the_oracle_bounds(e, req, rng, 10)
        rets, costs = static_returns(e, req)
        for a in range(A):  # stepping a static action: every round pays its index's surcharge
            total, infos = _episode(e, req, lambda obs, a=a: e.codec.encode(e.codec.unflat(a)))
            assert [i["cost_warmup"] for i in infos] == [*WARMUP, *[0.0] * len(infos)][: len(infos)]
            assert total == pytest.approx(rets[a], abs=1e-9)
            assert sum(i["cost"] for i in infos) == pytest.approx(costs[a], rel=1e-12)
        assert span_cost(e, req, 1) == pytest.approx(plan(e, req, "cost").best, rel=1e-12)
        assert span_cost(e, req, T) == pytest.approx(costs.min(), rel=1e-12)
        span = (T + 1) // 2
        brute = np.inf
        for sched in itertools.product(range(A), repeat=2):
            t, total, i = 0, 0.0, 0
            while t < T:
                a = sched[t // span]
                total += float(e.tables.cost[pos.start + t, a]) + (WARMUP[i] if i < len(WARMUP) else 0.0)
                t += int(e.tables.committed_pa[pos.start + t, a])
                i += 1
            brute = min(brute, total)
        assert span_cost(e, req, span) == pytest.approx(brute, rel=1e-12)


SWITCH = (3e-4, 2e-4)  # seconds: a verification after a single-token round, a single-token round after a verification


@pytest.mark.parametrize("warm", [False, True], ids=["switching", "switching+warm-up"])
def test_the_switching_surcharge_is_priced_by_the_previous_round_and_the_dps_stay_exact(greedy_trace, monkeypatch,
                                                                                        warm):  # fmt: skip
    """Each round pays the switching surcharge of its kind after the previous round's (none for the first), alone and
    with a warm-up surcharge; the oracle's DP over (position, round index, previous kind) is still a bound that only
    following it meets, static_returns equals stepping each action, and span_cost equals a brute force that prices
    both surcharges round by round."""
    from engine.cost.switching import SwitchCost
    from engine.cost.warmup import WarmupCost
    from env.costs import FittedCostModel

    warmup = WARMUP if warm else ()  # none: whatever the test trace's own timings fit
    monkeypatch.setattr(FittedCostModel, "switch_cost", lambda self: SwitchCost(*SWITCH))
    monkeypatch.setattr(FittedCostModel, "warmup_cost", lambda self: WarmupCost(warmup))
    e = ReplayEnv(greedy_trace, grid=SMALL_GRID, cost={"kind": "fitted"}, cache=False)
    rng = np.random.default_rng(2)
    A = e.tables.cost.shape[1]
    tables = e.tables

    def surcharge(i: int, prev: bool | None, verifies: bool) -> float:
        s = warmup[i] if i < len(warmup) else 0.0
        if prev is not None and prev != verifies:
            s += SWITCH[0] if verifies else SWITCH[1]
        return s

    switched = 0
    for req in range(greedy_trace.num_requests):
        pos = greedy_trace.positions_of(req)
        T = len(pos)
        _check_the_oracle_bounds(e, req, rng, 10)
        rets, costs = static_returns(e, req)
        for a in range(A):
            total, infos = _episode(e, req, lambda obs, a=a: e.codec.encode(e.codec.unflat(a)))
            kinds = [i["verified"] > 1 for i in infos]
            want = [surcharge(i, kinds[i - 1] if i else None, v) - (warmup[i] if i < len(warmup) else 0.0)
                    for i, v in enumerate(kinds)]  # fmt: skip
            assert [i["cost_switch"] for i in infos] == pytest.approx(want, abs=1e-15)
            switched += sum(w > 0 for w in want)
            assert total == pytest.approx(rets[a], abs=1e-9)
            assert sum(i["cost"] for i in infos) == pytest.approx(costs[a], rel=1e-12)
        for _ in range(5):  # random policies switch often
            _, infos = _episode(e, req, lambda obs: rng.integers(e.codec.nvec))
            switched += sum(i["cost_switch"] > 0 for i in infos)
        assert span_cost(e, req, 1) == pytest.approx(plan(e, req, "cost").best, rel=1e-12)
        assert span_cost(e, req, T) == pytest.approx(costs.min(), rel=1e-12)
        span = (T + 1) // 2
        brute = np.inf
        for sched in itertools.product(range(A), repeat=2):
            t, total, i, prev = 0, 0.0, 0, None
            while t < T:
                a = sched[t // span]
                p = pos.start + t
                verifies = bool(tables.o_n[tables.outcome[p, a]] > 1)
                total += float(tables.cost[p, a]) + surcharge(i, prev, verifies)
                t += int(tables.committed_pa[p, a])
                i, prev = i + 1, verifies
            brute = min(brute, total)
        assert span_cost(e, req, span) == pytest.approx(brute, rel=1e-12)
    assert switched > 0  # the surcharge was exercised
