"""engine.cost.warmup: the surcharge of a request's first rounds after its prefill, fitted from timed live rounds."""

from __future__ import annotations

import numpy as np
import pytest

from engine.cost.warmup import STEADY_FROM, WarmupCost, fit_warmup_cost, non_increasing


def _rounds(surcharge, runs=((0, 1, 2e-4), (1, 1, 2.2e-4), (2, 5, 6e-4)), requests=6, length=24, noise=0.0, seed=0):
    """Timed rounds of `requests` requests per run (run id, verified tokens, steady seconds), `length` rounds each,
    round i paying surcharge[i]."""
    rng = np.random.default_rng(seed)
    run, idx, n, y = [], [], [], []
    for r, tokens, base in runs:
        for _ in range(requests):
            for i in range(length):
                run.append(r)
                idx.append(i)
                n.append(tokens)
                extra = surcharge[i] if i < len(surcharge) else 0.0
                y.append(base + extra + noise * rng.standard_normal())
    return run, idx, n, y


def test_the_fit_recovers_a_surcharge_of_every_kind_of_round():
    true = (5e-4, 2.5e-4, 1.5e-4, 1e-4, 5e-5, 2e-5)
    fit = fit_warmup_cost(*_rounds(true))
    assert fit.seconds == pytest.approx(true, abs=1e-12)
    assert fit.at(0) == pytest.approx(5e-4) and fit.at(len(true)) == 0.0 and fit.at(100) == 0.0 and fit.at(-1) == 0.0
    assert list(fit.padded()) == pytest.approx([*true, 0.0])
    noisy = fit_warmup_cost(*_rounds(true, noise=2e-5, requests=12))
    assert np.allclose(noisy.seconds[:4], true[:4], atol=2e-5)
    assert all(a >= b >= 0 for a, b in zip(noisy.seconds, noisy.seconds[1:]))  # non-increasing, >= 0


def test_no_surcharge_and_too_short_requests_fit_none():
    assert fit_warmup_cost(*_rounds(())).seconds == ()
    assert fit_warmup_cost(*_rounds((3e-4,), length=STEADY_FROM)).seconds == ()  # no steady round: no reference
    assert WarmupCost().at(0) == 0.0 and list(WarmupCost().padded()) == [0.0]


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="differ in length"):
        fit_warmup_cost([0], [0, 1], [1], [1.0])
    with pytest.raises(ValueError, match="steady_from"):
        fit_warmup_cost([0], [0], [1], [1.0], steady_from=0)


def test_non_increasing_pools_adjacent_violators():
    assert non_increasing(np.array([3.0, 1.0, 2.0, 0.0]), np.ones(4)).tolist() == [3.0, 1.5, 1.5, 0.0]
    assert non_increasing(np.array([1.0, 2.0]), np.array([1.0, 3.0])).tolist() == [1.75, 1.75]
    no_data = np.array([1.0, 0.0, 1.0])  # index 1 takes its predecessor's value
    assert non_increasing(np.array([4.0, 0.0, 1.0]), no_data).tolist() == [4.0, 4.0, 1.0]
