"""engine.cost.switching: the surcharge of a round of the other kind than the round before it, fitted from timed
live rounds."""

from __future__ import annotations

import numpy as np
import pytest

from engine.cost.switching import (
    NONE,
    SINGLE,
    VERIFY,
    SwitchCost,
    fit_switch_cost,
    kind_of,
    previous_kinds,
    switched_rounds,
)
from engine.cost.warmup import STEADY_FROM

BASE = {1: 2e-4, 3: 4e-4, 6: 7e-4}  # seconds of a round verifying n tokens after a round of its own kind


def _rounds(to_verify, to_single, requests=6, length=48, noise=0.0, seed=0, runs=(0, 1)):
    """Timed rounds in recording order: per run and request, rounds whose verified tokens cycle through a pattern of
    single-token rounds and verifications (as a static lookup action's cuts and trees), each paying the surcharge of
    its kind after the previous round's; the first rounds pay a warm-up that the fit must not mistake for switching."""
    rng = np.random.default_rng(seed)
    patterns = {0: [1, 1, 3, 3, 3, 1, 6, 6, 1, 1, 1, 3], 1: [6, 6, 6, 1, 1, 6, 1, 1, 1, 6, 6, 3, 3]}
    run, idx, n, y = [], [], [], []
    for r in runs:
        for q in range(requests):
            prev = None
            for i in range(length):
                tokens = patterns[r][(i + q) % len(patterns[r])]
                extra = 5e-4 / (1 + i) if i < STEADY_FROM else 0.0
                if prev is not None and (prev > 1) != (tokens > 1):
                    extra += to_verify if tokens > 1 else to_single
                run.append(r)
                idx.append(i)
                n.append(tokens)
                y.append(BASE[tokens] + extra + noise * rng.standard_normal())
                prev = tokens
    return run, idx, n, y


def test_the_fit_recovers_both_directions():
    fit = fit_switch_cost(*_rounds(3e-5, 5e-5))
    assert fit.to_verify == pytest.approx(3e-5, abs=1e-12) and fit.to_single == pytest.approx(5e-5, abs=1e-12)
    noisy = fit_switch_cost(*_rounds(3e-5, 5e-5, noise=5e-6, requests=12))
    assert noisy.to_verify == pytest.approx(3e-5, abs=4e-6) and noisy.to_single == pytest.approx(5e-5, abs=4e-6)
    assert fit_switch_cost(*_rounds(0.0, 0.0)) == SwitchCost()


def test_no_fit_without_enough_switches_or_steady_rounds_and_never_below_zero():
    assert fit_switch_cost(*_rounds(3e-5, 5e-5, length=STEADY_FROM)) == SwitchCost()  # no steady round
    assert fit_switch_cost(*_rounds(3e-5, 5e-5, requests=1, length=STEADY_FROM + 4, runs=(0,))) == SwitchCost()
    neg = fit_switch_cost(*_rounds(-3e-5, 5e-5))  # a switch that got faster: not priced as a discount
    assert neg.to_verify == 0.0 and neg.to_single == pytest.approx(5e-5, abs=1e-12)
    with pytest.raises(ValueError, match="differ in length"):
        fit_switch_cost([0], [0, 1], [1], [1.0])


def test_previous_kinds_follow_each_request_of_each_run():
    run = np.array([0, 0, 0, 0, 0, 1, 1])
    idx = np.array([0, 1, 2, 0, 1, 0, 1])
    n = np.array([1, 4, 1, 3, 3, 2, 1])
    assert previous_kinds(run, idx, n).tolist() == [NONE, SINGLE, VERIFY, NONE, VERIFY, NONE, VERIFY]
    assert switched_rounds(run, idx, n).tolist() == [False, True, True, False, False, False, True]
    assert kind_of(1) == SINGLE and kind_of(2) == VERIFY


def test_the_surcharge_by_previous_kind():
    s = SwitchCost(to_verify=3.0, to_single=2.0)
    assert [s.at(p, v) for p in (NONE, SINGLE, VERIFY) for v in (False, True)] == [0.0, 0.0, 0.0, 3.0, 2.0, 0.0]
    assert s.table().tolist() == [[0.0, 0.0], [0.0, 3.0], [2.0, 0.0]]
    assert s.any and not SwitchCost().any
