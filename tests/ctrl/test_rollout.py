"""ctrl.rollout's pure helpers (the replay rollouts themselves run in the main job's smoke test)."""

import itertools

import numpy as np
import pytest

from ctrl.rollout import request_level_bound


def test_request_level_bound_is_best_action_per_request_over_best_action_for_all():
    # two requests, two actions: one action for all costs min(1 + 3, 2 + 1) = 3; per request 1 + 1 = 2
    assert request_level_bound(np.array([[1.0, 2.0], [3.0, 1.0]])) == pytest.approx(1.5)
    # one action best on every request: adapting per request wins nothing
    assert request_level_bound(np.array([[1.0, 2.0], [2.0, 5.0]])) == pytest.approx(1.0)
    # random costs against a brute force over every assignment of one action per request
    c = np.random.default_rng(0).uniform(0.5, 2.0, size=(4, 3))
    per_request = min(sum(c[i, a] for i, a in enumerate(pick)) for pick in itertools.product(range(3), repeat=4))
    one_for_all = min(c[:, a].sum() for a in range(3))
    assert request_level_bound(c) == pytest.approx(one_for_all / per_request) and request_level_bound(c) >= 1.0
