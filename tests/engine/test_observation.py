"""observation_vector (the deployed policy's path) == observe_history(...).vector(), bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from engine.runtime.observation import KMAX, OBS_DIM, History, observation_vector, observe_history
from engine.runtime.stats import RoundStats
from engine.spec.calibration import IsotonicCalibration


def _round(rng: np.random.Generator, i: int) -> RoundStats:
    """A RoundStats with every field the observation reads drawn at random, optional ones sometimes absent."""
    built = int(rng.integers(0, KMAX + 3))  # deeper than KMAX too: the observation keeps the first KMAX
    acc = int(rng.integers(0, built + 1))
    n = int(rng.integers(1, 40))
    L = int(rng.integers(0, 5))
    experts = rng.integers(1, 30, size=L)
    return RoundStats(
        round_index=i, depth=built + int(rng.integers(0, 2)), width=int(rng.integers(1, 4)), lam=0.0,
        verified_tokens=n, proposed=n - 1, accepted=acc, committed=acc + 1, built_depth=built,
        attempted_by_depth=[int(d <= acc) for d in range(built)],
        accepted_by_depth=[int(d < acc) for d in range(built)],
        draft_confidence=[float(c) for c in rng.random(built)] if rng.random() < 0.5
        else list(rng.random(built).astype(np.float32)),  # numpy scalars, as some drafters give
        new_pairs_per_node=None if rng.random() < 0.3 else float(rng.random() * 40),
        distinct_experts=list(experts) if rng.random() < 0.5 else experts,
        overlap_prev=None if rng.random() < 0.3 else float(rng.random()),
        rank_imbalance_mean=None if rng.random() < 0.5 else float(1 + 3 * rng.random()),
        cross_node_ratio=None if rng.random() < 0.5 else float(rng.random()),
        round_seconds=float(rng.random() * 1e-2),
        cost=None if rng.random() < 0.3 else float(rng.random() * 1e-2),
        cost_ar=None if rng.random() < 0.3 else float(rng.random() * 1e-3),
    )  # fmt: skip


CAL = IsotonicCalibration(((0.0, 0.5, 1.0),) * 3, ((0.1, 0.4, 1.3),) * 3)  # ends outside [0, 1]: clipped


@pytest.mark.parametrize("calibration", [None, CAL, lambda c, d: 2 * c - 0.2 * d])
def test_observation_vector_equals_the_observation_s(calibration):
    rng = np.random.default_rng(0)
    for trial in range(60):
        h = History()
        for i in range(int(rng.integers(0, 6))):
            h.add(_round(rng, i))
        ctx = dict(position=int(rng.integers(0, 300)), max_new_tokens=int(rng.integers(0, 256)),
                   batch_size=int(rng.integers(0, 600)), calibration=calibration,
                   top_k=int(rng.choice([0, 2, 8])), num_moe_layers=int(rng.integers(0, 5)))  # fmt: skip
        v = observation_vector(h, **ctx)
        ref = observe_history(h, prompt_len=7, request_id=3, **ctx).vector()
        assert v.dtype == np.float32 and v.shape == (OBS_DIM,)
        assert np.array_equal(v, ref), (trial, np.flatnonzero(v != ref))
