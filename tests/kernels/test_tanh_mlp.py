"""The C++ policy actor (kernels.tanh_mlp) against its numpy reference twin (engine.runtime.frozen's formula)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.runtime.observation import as_vector
from kernels import tanh_mlp

pytestmark = pytest.mark.skipif(tanh_mlp.load() is None, reason=f"C++ actor {tanh_mlp.status()}")


def _random_actor(rng, n_in=46, hidden=(64, 64), nvec=(9, 3, 6)):
    """(lo, hi, layers, dims) shaped like a frozen policy's folded, padded actor."""
    width, sizes = max(nvec), [n_in, *hidden]
    layers = [(rng.normal(0, 0.5, (o, i)), rng.normal(0, 0.1, o)) for i, o in zip(sizes, sizes[1:])]
    w_out, b_out = np.zeros((len(nvec) * width, sizes[-1])), np.full(len(nvec) * width, -np.inf)
    for d, n in enumerate(nvec):
        w_out[d * width : d * width + n] = rng.normal(0, 0.5, (n, sizes[-1]))
        b_out[d * width : d * width + n] = rng.normal(0, 0.1, n)
    mean, std = rng.random(n_in), rng.random(n_in) + 0.1
    return mean - 2 * std, mean + 2 * std, [*layers, (w_out, b_out)], len(nvec)


def _twin(lo, hi, layers, values):
    """engine.runtime.frozen.FrozenPolicy._mlp_logits' formula in numpy."""
    x = np.minimum(np.maximum(as_vector(values), lo), hi)
    for w, b in layers[:-1]:
        x = np.tanh(np.dot(w, x) + b)
    w, b = layers[-1]
    return np.dot(w, x) + b


def test_equals_its_numpy_twin():
    rng = np.random.default_rng(0)
    lo, hi, layers, dims = _random_actor(rng)
    actor = tanh_mlp.actor(lo, hi, layers, dims)
    for i in range(300):  # in [0, 1], outside it (the [0, 1] clip), and float64 values (the float32 rounding)
        v = rng.random(46) if i % 3 == 0 else rng.normal(0.5, 1.0, 46)
        values = v.tolist() if i % 2 else v.astype(np.float32).tolist()
        ref = _twin(lo, hi, layers, values)
        np.testing.assert_allclose(actor.logits(values), ref, rtol=1e-12, atol=1e-12)
        assert actor.act(values) == tuple(ref.reshape(dims, -1).argmax(1).tolist())


def test_argmax_ties_and_nan_like_numpy():
    """First maximum wins, a NaN wins (numpy's argmax); padding at -inf never wins."""
    w = np.zeros((6, 2))
    for bias in ([1.0, 1.0, 0.0, 0.0, 2.0, -np.inf], [0.0, np.nan, 3.0, np.nan, 1.0, -np.inf]):
        actor = tanh_mlp.actor(np.zeros(2), np.ones(2), [(w, np.array(bias))], 2)
        assert actor.act([0.5, 0.5]) == tuple(np.array(bias).reshape(2, -1).argmax(1).tolist())


def test_bad_shapes_are_refused_with_a_message():
    rng = np.random.default_rng(1)
    lo, hi, layers, dims = _random_actor(rng, n_in=5, hidden=(4,), nvec=(3, 2))
    actor = tanh_mlp.actor(lo, hi, layers, dims)
    with pytest.raises(ValueError, match="4 observation values, expected 5"):
        actor.act([0.0] * 4)
    with pytest.raises(ValueError, match=r"layer 1 is not \[6, 4\]"):
        tanh_mlp.actor(lo, hi, [layers[0], (np.zeros((6, 3)), np.zeros(6))], 2)
    with pytest.raises(ValueError, match="dims \\* width"):
        tanh_mlp.actor(lo, hi, layers, 4)


def test_switched_off_by_the_environment(switched_off):
    code = "from kernels import tanh_mlp; import numpy as np; print(tanh_mlp.status(), tanh_mlp.actor(np.zeros(1), np.ones(1), [(np.ones((1, 1)), np.zeros(1))], 1))"  # noqa: E501
    assert switched_off("EXPERTSPEC_NATIVE_ACTOR", code) == "off (EXPERTSPEC_NATIVE_ACTOR=0) None"
