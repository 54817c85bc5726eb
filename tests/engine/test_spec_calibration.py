"""The calibration map's scalar interpolation is numpy's, bit for bit (a frozen policy, the engine and the
environments all apply it)."""

from __future__ import annotations

import random

import numpy as np

from engine.spec.calibration import IsotonicCalibration, interp


def test_interp_equals_numpy_bit_for_bit():
    rng = random.Random(0)
    for _ in range(3000):
        n = rng.randint(1, 9)
        xs = sorted(rng.choice([rng.random(), round(rng.random(), 1)]) for _ in range(n))
        if n > 1 and rng.random() < 0.3:
            xs[1] = xs[0]  # a repeated knot
        ys = sorted(rng.random() for _ in range(n))
        for x in (rng.random(), rng.choice(xs), -0.5, 1.5, 0.0, 1.0, float("nan")):
            want = float(np.interp(x, xs, ys))
            got = interp(x, tuple(xs), tuple(ys))
            assert got == want or (want != want and got != got), (xs, ys, x)


def test_calibration_clamps_depth_and_passes_through_empty_knots():
    cal = IsotonicCalibration(knots_x=((0.0, 1.0), ()), knots_y=((0.2, 0.8), ()))
    assert cal(0.5, 1) == float(np.interp(0.5, (0.0, 1.0), (0.2, 0.8)))
    assert cal(0.5, 0) == cal(0.5, 1)  # depths below 1 use depth 1
    assert cal(0.37, 2) == 0.37 and cal(0.37, 9) == 0.37  # no knots: the raw confidence
