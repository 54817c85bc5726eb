"""The host-work term of the measured cost (engine.cost.host_cost): two regimes, non-negative, clear errors."""

from __future__ import annotations

import numpy as np
import pytest

from engine.cost.host_cost import HostCost, fit_host_cost


def _samples(rng, host: HostCost, noise: float = 0.0):
    n = np.concatenate([np.ones(60, dtype=int), rng.integers(2, 26, 200), np.ones(50, dtype=int)])
    plain = np.r_[np.zeros(260, dtype=bool), np.ones(50, dtype=bool)]
    y = np.array([host.plain if p else host.book(k) for k, p in zip(n, plain)])
    return n, y + noise * rng.standard_normal(len(y)), plain


def test_fit_recovers_both_regimes_and_the_plain_step():
    truth = HostCost(single=100e-6, per_round=250e-6, per_node=7e-6, plain=90e-6)
    got = fit_host_cost(*_samples(np.random.default_rng(0), truth))
    for k in ("single", "per_round", "per_node", "plain"):
        assert getattr(got, k) == pytest.approx(getattr(truth, k), rel=1e-9), k
    assert got.book(1) == pytest.approx(100e-6) and got.book(9) == pytest.approx(250e-6 + 7 * 7e-6)


def test_fit_is_the_mean_and_never_negative():
    rng = np.random.default_rng(1)
    truth = HostCost(single=100e-6, per_round=250e-6, per_node=0.0, plain=90e-6)
    n, y, plain = _samples(rng, truth, noise=40e-6)
    got = fit_host_cost(n, np.abs(y), plain)
    y, single = np.abs(y), ~plain & (n == 1)
    # the one-token rounds of both engines: their pooled mean (what a total accumulates), their medians' difference
    pooled = (got.single * single.sum() + got.plain * plain.sum()) / (single.sum() + plain.sum())
    assert pooled == pytest.approx(y[single | plain].mean(), rel=1e-9)
    assert got.single - got.plain == pytest.approx(np.median(y[single]) - np.median(y[plain]), rel=1e-9)
    assert min(got.single, got.per_round, got.per_node, got.plain) >= 0.0
    falling = fit_host_cost([1, 2, 10, 20, 1], [1e-4, 3e-4, 2e-4, 1e-4, 9e-5], [False, False, False, False, True])
    assert falling.per_node == 0.0 and falling.per_round == pytest.approx(2e-4)  # more nodes never cost less


def test_a_missing_regime_borrows_the_other():
    got = fit_host_cost([1, 1, 1], [1e-4, 1e-4, 5e-5], [False, False, True])
    assert got.book(1) == got.book(12) == pytest.approx(1e-4) and got.per_node == 0.0


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (([1, 2], [1e-4, 2e-4], [False, False]), "target-only engine and of a speculating one"),
        (([1, 1], [1e-4, 2e-4], [True, True]), "target-only engine and of a speculating one"),
        (([1, 2], [1e-4, -2e-4], [False, True]), "finite and >= 0"),
        (([1, 2], [1e-4], [False, True]), "differ in length"),
    ],
)
def test_bad_samples_are_refused(args, match):
    with pytest.raises(ValueError, match=match):
        fit_host_cost(*args)


def test_a_spike_in_one_engines_rounds_is_charged_to_both():
    """One slow target-only step (12 ms among 50) raises book(1) and plain alike: the difference stays theirs."""
    truth = HostCost(single=100e-6, per_round=250e-6, per_node=7e-6, plain=90e-6)
    n, y, plain = _samples(np.random.default_rng(0), truth)
    y[np.flatnonzero(plain)[7]] += 12e-3
    got = fit_host_cost(n, y, plain)
    assert got.single - got.plain == pytest.approx(10e-6, rel=1e-9)
    assert got.plain == pytest.approx(90e-6 + 12e-3 / 110, rel=1e-9) and got.per_round == pytest.approx(250e-6)
