"""The hindsight oracle: a DP no static or random policy beats on its trace, and a replay-only policy."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import SMALL_GRID  # noqa: E402

from env.oracle import HindsightOracle, headroom, plan, static_returns
from env.replay import ReplayEnv

COSTS = [{"kind": "roofline", "model_spec": "target"}, {"kind": "roofline"}, {"kind": "fitted"}]


@pytest.mark.parametrize("cost", COSTS, ids=["target", "qwen3-30b", "fitted"])
def test_no_policy_beats_the_oracle(greedy_trace, cost):
    e = ReplayEnv(greedy_trace, grid={**SMALL_GRID, "lams": [0.0, 1.0]}, cost=cost, cache=False)
    rng = np.random.default_rng(0)
    for req in range(greedy_trace.num_requests):
        best = plan(e, req, "return").best
        fastest = plan(e, req, "cost").best
        rets, costs = static_returns(e, req)
        assert np.all(rets <= best + 1e-9) and np.all(costs >= fastest - 1e-12)
        for _ in range(20):  # random policies
            e.reset(options={"request": req})
            total = 0.0
            while True:
                _, r, term, trunc, _ = e.step(rng.integers(e.codec.nvec))
                total += r
                if term or trunc:
                    break
            assert total <= best + 1e-9
        # the oracle as a policy reaches its value
        oracle = HindsightOracle(e)
        obs, _ = e.reset(options={"request": req})
        total = 0.0
        while True:
            obs, r, term, trunc, _ = e.step(oracle.action(obs))
            total += r
            if term or trunc:
                break
        assert total == pytest.approx(best, abs=1e-9)
        # static returns agree with stepping the env
        a = int(np.argmax(rets))
        e.reset(options={"request": req})
        total = 0.0
        while True:
            _, r, term, trunc, _ = e.step(e.codec.encode(e.codec.unflat(a)))
            total += r
            if term or trunc:
                break
        assert total == pytest.approx(rets[a], abs=1e-9)


def test_headroom_report(greedy_trace):
    e = ReplayEnv(greedy_trace, grid=SMALL_GRID, cost={"kind": "roofline"}, cache=False)
    h = headroom(e)
    assert h["oracle_return"] >= h["best_static_return"]
    assert h["oracle_speedup"] >= h["best_static_speedup"] > 0 and h["headroom_speedup"] >= 1.0


def test_oracle_needs_replay():
    with pytest.raises(TypeError, match="Replay-v0"):
        HindsightOracle(object())
