"""ctrl.rollout's pure helpers (the replay rollouts themselves run in the main job's smoke test)."""

import numpy as np
import pytest

from ctrl.rollout import request_level_bound


def test_request_level_bound_is_best_action_per_request_over_best_action_for_all():
    # two requests, two actions: one action for all costs min(1 + 3, 2 + 1) = 3; per request 1 + 1 = 2
    assert request_level_bound(np.array([[1.0, 2.0], [3.0, 1.0]])) == pytest.approx(1.5)
    # one action best on every request: adapting per request wins nothing
    assert request_level_bound(np.array([[1.0, 2.0], [2.0, 5.0]])) == pytest.approx(1.0)
    rng = np.random.default_rng(0)
    c = rng.uniform(0.5, 2.0, size=(16, 9))
    b = request_level_bound(c)
    assert 1.0 <= b <= c.sum(0).min() / c.min(1).sum() + 1e-12 and b == pytest.approx(c.sum(0).min() / c.min(1).sum())
