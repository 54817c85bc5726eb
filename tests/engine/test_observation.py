"""observation_vector (the deployed policy's path) == observe_history(...).vector(), bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from engine.runtime.observation import (
    KMAX,
    OBS_DIM,
    History,
    observation_values,
    observation_vector,
    observe_history,
    probe_values,
)
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


def _probe(rng: np.random.Generator) -> list[float]:
    """A probe's values: its confidence per depth (none, shorter than KMAX, KMAX) alone or as `probe_values` with a
    match source; numpy float32 scalars as the lookup gives, values outside [0, 1] (clipped)."""
    n = int(rng.choice([0, 3, KMAX]))
    raw = rng.normal(0.5, 0.5, n)
    conf = list(raw.astype(np.float32)) if rng.random() < 0.5 else [float(x) for x in raw]
    return probe_values(conf, (float(rng.random()), float(rng.integers(0, 2)))) if rng.random() < 0.5 else conf


def _probe_parts(probe: list[float]) -> tuple[list[float], list[float]]:
    """(confidences, match source) a probe's values stand for."""
    return (list(probe[:KMAX]), list(probe[KMAX:])) if len(probe) > KMAX else (list(probe), [0.0, 0.0])


@pytest.mark.parametrize("calibration", [None, CAL, lambda c, d: 2 * c - 0.2 * d])
def test_observation_vector_equals_the_observation_s(calibration):
    rng = np.random.default_rng(0)
    for trial in range(60):
        h = History()
        for i in range(int(rng.integers(0, 6))):
            h.add(_round(rng, i))
        ctx = dict(position=int(rng.integers(0, 300)), max_new_tokens=int(rng.integers(0, 256)),
                   batch_size=int(rng.integers(0, 600)), calibration=calibration,
                   top_k=int(rng.choice([0, 2, 8])), num_moe_layers=int(rng.integers(0, 5)),
                   probe=_probe(rng))  # fmt: skip
        v = observation_vector(h, **ctx)
        ref = observe_history(h, prompt_len=7, request_id=3, **ctx).vector()
        conf, source = _probe_parts(ctx["probe"])
        now = v[-KMAX - 2 : -2]
        assert np.array_equal(now[: len(conf)], np.clip(np.float32(conf), 0, 1)) and not now[len(conf) :].any()
        assert np.array_equal(v[-2:], np.float32(source))
        assert v.dtype == np.float32 and v.shape == (OBS_DIM,)
        assert np.array_equal(v, ref), (trial, np.flatnonzero(v != ref))


RAGGED = IsotonicCalibration(((0.2, 0.7), (), (0.5,)), ((0.3, 0.9), (), (0.6,)))  # an empty and a one-knot depth


@pytest.mark.parametrize("calibration", [None, CAL, RAGGED])
def test_the_native_choice_reads_the_same_values(calibration):
    """kernels.tanh_mlp `values` / `choose` (the frozen policy's one call between two rounds) == observation_values
    bit for bit, and `choose` == `act` on them, over random histories (numpy confidences and experts, absent
    optional fields, KMAX overflow, isotonic maps with empty and one-knot depths)."""
    from kernels import tanh_mlp

    if tanh_mlp.load() is None:
        pytest.skip(f"C++ actor {tanh_mlp.status()}")
    rng = np.random.default_rng(1)
    w = [(rng.normal(0, 0.5, (16, OBS_DIM)), rng.normal(0, 0.1, 16)), (rng.normal(0, 0.5, (18, 16)), np.zeros(18))]
    actor = tanh_mlp.actor(np.full(OBS_DIM, -1.0), np.full(OBS_DIM, 2.0), w, 2)
    actor.observe(KMAX, calibration)
    made: list[tuple[int, ...]] = []
    actor.set_actions([9, 9], lambda idx: made.append(idx) or ("action", idx))  # choose_action's table
    for trial in range(80):
        h = History()
        for i in range(int(rng.integers(0, 6))):
            h.add(_round(rng, i))
        ctx = (int(rng.integers(0, 300)), int(rng.integers(0, 256)), int(rng.integers(0, 600)),
               int(rng.choice([0, 2, 8])), int(rng.integers(0, 5)))  # fmt: skip
        keys = ("position", "max_new_tokens", "batch_size", "top_k", "num_moe_layers")
        probe = _probe(rng)
        ref = observation_values(h, calibration=calibration, probe=probe, **dict(zip(keys, ctx)))
        got = actor.values(h, *ctx, probe) if probe or rng.random() < 0.5 else actor.values(h, *ctx)  # 7 args: none
        assert [float(x).hex() for x in got] == [float(x).hex() for x in ref], trial
        assert actor.choose(h, *ctx, probe) == actor.act(ref)
        action = actor.choose_action(h, *ctx, probe)
        assert action == ("action", actor.act(ref)) and actor.choose_action(h, *ctx, probe) is action  # kept
    assert len(made) == len(set(made)) > 1  # each action made once, on its first choice
    with pytest.raises(TypeError, match="not a sequence"):
        actor.values(History(), 0, 1, 1, 0, 0, 0.5)
    assert actor.values(History(), 0, 1, 1, 0, 0, None)[-KMAX:] == [0.0] * KMAX


def test_the_native_choice_refuses_a_foreign_layout():
    from kernels import tanh_mlp

    if tanh_mlp.load() is None:
        pytest.skip(f"C++ actor {tanh_mlp.status()}")
    actor = tanh_mlp.actor(np.zeros(5), np.ones(5), [(np.ones((2, 5)), np.zeros(2))], 1)
    with pytest.raises(ValueError, match="not the observation layout"):
        actor.observe(KMAX)
    actor = tanh_mlp.actor(np.zeros(OBS_DIM), np.ones(OBS_DIM), [(np.ones((2, OBS_DIM)), np.zeros(2))], 1)
    with pytest.raises(ValueError, match="set_observation"):
        actor.choose(History(), 0, 1, 1, 0, 0)
    actor.observe(KMAX)
    with pytest.raises(RuntimeError, match="set_actions"):
        actor.choose_action(History(), 0, 1, 1, 0, 0)
    with pytest.raises(ValueError, match="3 dimensions, the actor 1"):
        actor.set_actions([1, 1, 1], tuple)
    with pytest.raises(ValueError, match="of size 3 .the padded width is 2"):
        actor.set_actions([3], tuple)
    actor.set_actions([2], tuple)
    assert actor.choose_action(History(), 0, 1, 1, 0, 0) == (0,)


def test_the_native_choice_answers_plain_decoding_unasked_when_the_probe_proposes_nothing():
    """kernels.tanh_mlp `set_plain`: `choose` / `choose_action` answer its indices when the probe's first KMAX values
    are all 0 (or it has none: the depth capped to 0), without reading the History (here one it could not read);
    any other probe, or none given, still goes to the actor. `set_plain(None)` turns it off."""
    from kernels import tanh_mlp

    if tanh_mlp.load() is None:
        pytest.skip(f"C++ actor {tanh_mlp.status()}")
    rng = np.random.default_rng(2)
    w = [(rng.normal(0, 0.5, (16, OBS_DIM)), rng.normal(0, 0.1, 16)), (rng.normal(0, 0.5, (18, 16)), np.zeros(18))]
    actor = tanh_mlp.actor(np.full(OBS_DIM, -1.0), np.full(OBS_DIM, 2.0), w, 2)
    actor.observe(KMAX)
    actor.set_actions([9, 9], lambda idx: ("action", idx))
    with pytest.raises(ValueError, match="one index per action dimension"):
        actor.set_plain([0])
    with pytest.raises(ValueError, match="out of range"):
        actor.set_plain([0, 9])
    actor.set_plain([5, 7])
    ctx = (3, 64, 1, 2, 4)
    for nothing in ([0.0] * KMAX, [0.0] * KMAX + [0.5, 1.0], [], [0.0] * 3):
        assert actor.choose(None, *ctx, nothing) == (5, 7)  # None: no History read at all
        assert actor.choose_action(None, *ctx, nothing) == ("action", (5, 7))
    h = History()
    h.add(_round(rng, 0))
    picks = set()
    for _ in range(40):
        probe = [0.0] * KMAX
        probe[int(rng.integers(0, KMAX))] = float(rng.uniform(0.01, 1.0))  # one depth proposes something
        ref = observation_values(h, position=3, max_new_tokens=64, batch_size=1, top_k=2, num_moe_layers=4,
                                 probe=probe)  # fmt: skip
        assert actor.choose(h, *ctx, probe) == actor.act(ref)
        picks.add(actor.choose(h, *ctx, probe))
    assert picks != {(5, 7)}
    with pytest.raises(AttributeError):  # not probed (7 arguments, or None): the actor reads the History
        actor.choose(None, *ctx)
    with pytest.raises(AttributeError):
        actor.choose(None, *ctx, None)
    actor.set_plain(None)
    with pytest.raises(AttributeError):
        actor.choose(None, *ctx, [0.0] * KMAX)
