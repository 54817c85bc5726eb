"""Calibrated draft confidence fitted on a trace's held-out split, used by both environments alike."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from conftest import SMALL_GRID  # noqa: E402

from engine.drafting.acceptance import AGREE, DISAGREE, NONE, AcceptanceModel
from env.calibration import (
    IsotonicCalibration,
    acceptance_error,
    calibration_error,
    fit_acceptance,
    fit_calibration,
    node_samples,
)
from env.replay import ReplayEnv


def test_isotonic_calibration_fits_its_samples(greedy_trace):
    cal = fit_calibration(greedy_trace, min_samples=5)
    rep = calibration_error(greedy_trace, cal, [0, 1])  # in sample: the isotonic fit can only help
    assert rep["samples"] > 10 and rep["ece_calibrated"] < rep["ece_raw"]
    xs = np.linspace(0, 1, 11)
    for d in range(1, 9):
        ys = [cal(float(x), d) for x in xs]
        assert all(0.0 <= y <= 1.0 for y in ys) and all(b >= a for a, b in zip(ys, ys[1:]))  # monotone
    back = IsotonicCalibration.from_dict(cal.to_dict())
    assert back(0.3, 2) == cal(0.3, 2) and pickle.loads(pickle.dumps(cal))(0.3, 2) == cal(0.3, 2)


@pytest.mark.slow
def test_calibration_helps_on_held_out_requests():
    from env.default import default_trace

    tr = default_trace()
    train, held = list(range(0, tr.num_requests, 2)), list(range(1, tr.num_requests, 2))
    rep = calibration_error(tr, fit_calibration(tr, train), held)
    assert rep["ece_calibrated"] < rep["ece_raw"]


def test_calibrated_observation(greedy_trace):
    cal = fit_calibration(greedy_trace, min_samples=5)
    e = ReplayEnv(
        greedy_trace, grid=SMALL_GRID, cost={"kind": "roofline", "model_spec": "target"}, calibration=cal, cache=False
    )
    e.reset(seed=0)
    e.step(np.array([3, 0, 0, 0]))
    obs = e._observe()
    raw = obs.confidence_last[: e.rounds[-1].built_depth]
    assert obs.confidence_cal_last[: len(raw)] == tuple(cal(c, d + 1) for d, c in enumerate(raw))


def test_acceptance_model_separates_agreement_states(greedy_trace):
    reqs = list(range(greedy_trace.num_requests))
    model = fit_acceptance([(greedy_trace, reqs)], min_samples=5)
    s = node_samples(greedy_trace, reqs)
    assert len(s["label"]) > 20 and set(np.unique(s["state"])) <= {NONE, AGREE, DISAGREE}
    rep = acceptance_error(greedy_trace, model, reqs)  # in sample: per-state isotonic fits can only help
    assert rep["brier_model"] < rep["brier_raw"]
    assert rep["accept_agree"] > rep["accept_disagree"]  # the n-gram confirming a draft is a signal
    for state in (NONE, AGREE, DISAGREE):
        ys = [model(float(x), d, state) for d in range(1, 9) for x in np.linspace(0, 1, 11)]
        assert all(0.0 <= y <= 1.0 for y in ys)
    assert AcceptanceModel.from_dict(model.to_dict()) == model
    assert pickle.loads(pickle.dumps(model)).digest == model.digest


def test_replay_needs_the_acceptance_model_of_a_calibrated_grid(greedy_trace):
    grid = {**SMALL_GRID, "rules": [["all", 0.0], ["calibrated", 0.2]]}
    with pytest.raises(ValueError, match="acceptance model"):
        ReplayEnv(greedy_trace, grid=grid, cost={"kind": "roofline", "model_spec": "target"}, cache=False)
    model = fit_acceptance([(greedy_trace, [0, 1])], min_samples=5)
    e = ReplayEnv(greedy_trace, grid=grid, cost={"kind": "roofline", "model_spec": "target"}, acceptance=model,
                  cache=False)  # fmt: skip
    e.reset(options={"request": 0})
    *_, info = e.step(np.array([4, 0, 0, 1]))  # K = 8, W = 1, calibrated 0.2
    assert e.rounds[-1].verify_rule == "calibrated" and e.rounds[-1].built_depth <= 8
