"""The C++ policy actor (kernels.tanh_mlp, float32) against its numpy reference twin (engine.runtime.frozen's formula,
float64): logits within float32's error, the same decisions wherever a dimension's two best logits are further apart
than that."""

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


LOGIT_TOL = 1e-5  # float32 sums of ~64 terms of size ~1 and a tanh within 4e-7


def same_decisions(got: tuple[int, ...], ref: np.ndarray, dims: int, tol: float = LOGIT_TOL) -> bool:
    """`got` is the argmax of each dimension's row of the padded logits `ref` [dims * width], or a choice within
    `tol` of that row's maximum (a near-tie float32 may order either way)."""
    rows = ref.reshape(dims, -1)
    return all(rows[d, g] >= rows[d].max() - tol for d, g in enumerate(got))


@pytest.mark.parametrize("hidden, nvec", [((64, 64), (9, 3, 6)), ((7, 100, 33), (4, 2)), ((130,), (9, 3, 1, 6))])
def test_equals_its_numpy_twin(hidden, nvec):
    """Layers of every padded width (outputs padded to a multiple of 16, in blocks of up to 64): 64, 7, 100, 130."""
    rng = np.random.default_rng(0)
    lo, hi, layers, dims = _random_actor(rng, hidden=hidden, nvec=nvec)
    actor = tanh_mlp.actor(lo, hi, layers, dims)
    exact = 0
    for i in range(2000):  # in [0, 1], outside it (the [0, 1] clip), and float64 values (the float32 rounding)
        v = rng.random(46) if i % 3 == 0 else rng.normal(0.5, 1.0, 46)
        values = v.tolist() if i % 2 else v.astype(np.float32).tolist()
        ref = _twin(lo, hi, layers, values)
        got = np.asarray(actor.logits(values))
        real = np.isfinite(ref)
        assert np.array_equal(real, np.isfinite(got)) and np.all(got[~real] == ref[~real])  # the -inf padding
        np.testing.assert_allclose(got[real], ref[real], rtol=0, atol=LOGIT_TOL)
        idx = actor.act(values)
        assert same_decisions(idx, ref, dims)
        exact += idx == tuple(ref.reshape(dims, -1).argmax(1).tolist())
    assert exact >= 1990  # near-ties are rare: (almost) every decision is numpy's argmax itself


def test_fast_tanh_is_within_its_bound():
    """One hidden unit with identity-like weights: the actor's tanh against numpy's over [-10, 10], NaN included."""
    xs = np.concatenate([np.linspace(-10, 10, 4001), [0.0, 1e-30, -1e-30]])
    w_out = np.array([[1.0]])
    for x in xs:
        actor = tanh_mlp.actor(np.array([-1e9]), np.array([1e9]), [(np.array([[0.0]]), np.array([x])),
                                                                   (w_out, np.array([0.0]))], 1)  # fmt: skip
        got = actor.logits([0.5])[0]
        assert abs(got - np.tanh(np.float32(x))) <= 4e-7 + 1e-7 * abs(x), x
    nan = tanh_mlp.actor(np.zeros(1), np.ones(1), [(np.zeros((1, 1)), np.array([np.nan])), (w_out, np.zeros(1))], 1)
    assert np.isnan(nan.logits([0.5])[0])


def test_argmax_ties_and_nan_like_numpy():
    """First maximum wins, a NaN wins (numpy's argmax); padding at -inf never wins."""
    w = np.zeros((6, 2))
    for bias in ([1.0, 1.0, 0.0, 0.0, 2.0, -np.inf], [0.0, np.nan, 3.0, np.nan, 1.0, -np.inf]):
        actor = tanh_mlp.actor(np.zeros(2), np.ones(2), [(w, np.array(bias))], 2)
        assert actor.act([0.5, 0.5]) == tuple(np.array(bias).reshape(2, -1).argmax(1).tolist())


def test_the_action_table_refuses_a_nan_pick_past_a_dimension():
    """A NaN logit in a dimension's padding wins its argmax (numpy's rule) but names no action: a clear error, and
    the action maker is never asked for it."""
    from engine.runtime.observation import KMAX, OBS_DIM, History

    bias = np.full(2 * 4, -np.inf)
    bias[:3], bias[3], bias[4:6] = 0.0, np.nan, 1.0  # dimension 0: 3 actions, NaN in its padding; dimension 1: 2
    actor = tanh_mlp.actor(np.zeros(OBS_DIM), np.ones(OBS_DIM), [(np.zeros((8, OBS_DIM)), bias)], 2)
    actor.observe(KMAX)
    actor.set_actions([3, 2], lambda idx: pytest.fail(f"made {idx}"))
    with pytest.raises(ValueError, match="index 3 of dimension 0 is past its 3 actions"):
        actor.choose_action(History(), 0, 1, 1, 0, 0)


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
    for name in ("choose", "choose_action", "values"):  # a history call's arguments, checked in one place
        with pytest.raises(TypeError, match=rf"{name}\(actor, history, position, .*\[, probe\]\)"):
            getattr(actor, name)(object(), 0)


def test_switched_off_by_the_environment(switched_off):
    code = "from kernels import tanh_mlp; import numpy as np; print(tanh_mlp.status(), tanh_mlp.actor(np.zeros(1), np.ones(1), [(np.ones((1, 1)), np.zeros(1))], 1))"  # noqa: E501
    assert switched_off("EXPERTSPEC_NATIVE_ACTOR", code) == "off (EXPERTSPEC_NATIVE_ACTOR=0) None"
