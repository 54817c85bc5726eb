"""ctrl.wallclock's steady-state accounting: a round's share at or past a position, and replay's speed-ups with it."""

from types import SimpleNamespace

import pytest

from ctrl.wallclock import replay_steady_speedup, steady_share


def test_steady_share_is_the_rounds_tokens_at_or_past_the_position():
    assert steady_share(0, 4, 16) == 0.0  # wholly before
    assert steady_share(14, 4, 16) == 0.5  # positions 14, 15 before; 16, 17 past
    assert steady_share(16, 3, 16) == 1.0  # starts there
    assert steady_share(20, 1, 16) == 1.0
    assert steady_share(15, 1, 16) == 0.0
    assert steady_share(5, 0, 16) == 0.0  # nothing committed
    assert steady_share(3, 2, 0) == 1.0  # from the start: every round counts whole


def _round(committed: int, cost: float, cost_ar: float = 1.0):
    return SimpleNamespace(committed=committed, cost=cost, cost_ar=cost_ar)


def test_replay_steady_speedup_weighs_each_round_by_its_steady_share():
    # positions 0-2 (3 tokens, 3 T_AR: plain), then 3-10 (8 tokens in 2 rounds of 2 T_AR: 2x)
    req = [_round(1, 1.0), _round(1, 1.0), _round(1, 1.0), _round(4, 2.0), _round(4, 2.0)]
    assert replay_steady_speedup([req], 3) == pytest.approx(2.0)
    # from the start it is ctrl.metrics' speedup_vs_ar: Σ committed / Σ T_spec/T_AR
    assert replay_steady_speedup([req], 0) == pytest.approx(11 / 7)
    # a round straddling the position counts pro rata: positions 1..4 committed by one round, half of it from 3 on
    assert replay_steady_speedup([[_round(1, 1.0), _round(4, 2.0), _round(2, 1.0)]], 3) == pytest.approx(
        (2 + 2) / (1.0 + 1.0)
    )
