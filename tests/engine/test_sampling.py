"""engine.sampling: SamplingParams validation, process_logits known answers, the one-uniform sampler.

Run: pytest tests/engine/test_sampling.py
"""

from __future__ import annotations

import math

import pytest
import scipy.stats
import torch

import engine.spec.sampling as sampling
from engine.spec.sampling import SamplingParams, make_generator, process_logits, sample_from_probs

# V=vocab


def _probs(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


# --- SamplingParams -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": "1.0"}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": -0.5}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"seed": -1}, "seed"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_sampling_params_rejects_bad_values(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field) as info:
        SamplingParams(**kwargs)
    assert repr(next(iter(kwargs.values()))) in str(info.value)


def test_sampling_params_defaults_and_greedy() -> None:
    assert SamplingParams().greedy
    assert SamplingParams(temperature=0, top_k=5, top_p=0.5, seed=3).greedy
    assert not SamplingParams(temperature=0.7).greedy
    assert SamplingParams(temperature=1, top_p=1).top_p == 1  # ints accepted


# --- process_logits -------------------------------------------------------------------------------


def test_process_logits_temperature() -> None:
    logits = torch.tensor([1.0, 2.0, 3.0])
    got = process_logits(logits, SamplingParams(temperature=0.5))
    torch.testing.assert_close(got, torch.softmax(torch.tensor([2.0, 4.0, 6.0]), dim=-1))
    assert got.dtype == torch.float32


def test_process_logits_top_k_and_ties() -> None:
    got = process_logits(torch.tensor([1.0, 3.0, 2.0, 0.0]), SamplingParams(temperature=1.0, top_k=2))
    expected = torch.zeros(4)
    expected[[1, 2]] = torch.softmax(torch.tensor([3.0, 2.0]), dim=-1)
    torch.testing.assert_close(got, expected)
    # Ties at the boundary: the lower token id wins, exactly k tokens survive.
    got = process_logits(torch.tensor([1.0, 1.0, 1.0, 0.0]), SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(got, _probs(0.5, 0.5, 0.0, 0.0))
    # top_k >= V is off.
    logits = torch.tensor([0.3, -1.0, 2.0])
    torch.testing.assert_close(
        process_logits(logits, SamplingParams(temperature=1.0, top_k=7)), torch.softmax(logits, dim=-1)
    )


def test_process_logits_top_p() -> None:
    logits = torch.log(_probs(0.5, 0.3, 0.15, 0.05))
    keep_two = process_logits(logits, SamplingParams(temperature=1.0, top_p=0.75))
    torch.testing.assert_close(keep_two, _probs(0.625, 0.375, 0.0, 0.0))
    keep_three = process_logits(logits, SamplingParams(temperature=1.0, top_p=0.81))
    torch.testing.assert_close(keep_three, _probs(0.5, 0.3, 0.15, 0.0) / 0.95)
    # Tiny top_p still keeps the most likely token.
    keep_one = process_logits(logits, SamplingParams(temperature=1.0, top_p=1e-9))
    torch.testing.assert_close(keep_one, _probs(1.0, 0.0, 0.0, 0.0))
    # Ties: uniform mass, top_p = 0.5 keeps exactly the two lowest ids.
    uniform = process_logits(torch.zeros(4), SamplingParams(temperature=1.0, top_p=0.5))
    torch.testing.assert_close(uniform, _probs(0.5, 0.5, 0.0, 0.0))


def test_process_logits_top_k_applies_before_top_p() -> None:
    logits = torch.log(_probs(0.4, 0.3, 0.2, 0.1))
    got = process_logits(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.75))
    # top-k first: (4/9, 3/9, 2/9); mass before the third token is 7/9 >= 0.75 -> two tokens.
    # (top-p first would have kept three: 0.7 < 0.75.)
    torch.testing.assert_close(got, _probs(4 / 7, 3 / 7, 0.0, 0.0))


def test_process_logits_greedy_one_hot_batched() -> None:
    logits = torch.tensor([[[0.0, 2.0, 2.0, 1.0], [5.0, -1.0, 5.0, 0.0]], [[-3.0, -2.0, -1.0, -4.0]] * 2])
    got = process_logits(logits.to(torch.bfloat16), SamplingParams())  # [2, 2, V]
    assert got.dtype == torch.float32 and got.shape == logits.shape
    assert got.argmax(dim=-1).tolist() == [[1, 0], [2, 2]]  # first index on ties
    torch.testing.assert_close(got.sum(dim=-1), torch.ones(2, 2))
    assert set(got.unique().tolist()) == {0.0, 1.0}


def test_process_logits_masked_and_tiny_temperature() -> None:
    logits = torch.tensor([0.0, -math.inf, 1.0, 1.0])
    got = process_logits(logits, SamplingParams(temperature=1e-30))
    torch.testing.assert_close(got, _probs(0.0, 0.0, 0.5, 0.5))
    got = process_logits(logits, SamplingParams(temperature=2.0, top_k=3, top_p=0.99))
    assert got[1] == 0 and torch.isfinite(got).all()
    torch.testing.assert_close(got.sum(), torch.tensor(1.0))


# --- sample_from_probs ----------------------------------------------------------------------------


def test_sample_consumes_exactly_one_float64_uniform() -> None:
    probs = _probs(0.1, 0.2, 0.7)
    generator = make_generator(11, 0)
    reference = make_generator(11, 0)
    u = torch.rand((), generator=reference, dtype=torch.float64).item()
    token = sample_from_probs(probs, generator)
    assert torch.equal(generator.get_state(), reference.get_state())
    assert token == int(torch.searchsorted(probs.double().cumsum(0), u, right=True))


def test_sample_law_and_zero_weights_never_drawn() -> None:
    probs = _probs(0.0, 0.3, 0.0, 0.05, 0.4, 0.0, 0.25, 0.0)  # [V], unnormalised is fine too
    generator = make_generator(0, 0)
    samples = torch.tensor([sample_from_probs(probs * 3.0, generator) for _ in range(20_000)])
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    support = probs > 0
    assert counts[~support].sum() == 0
    expected = probs[support].double() / probs[support].double().sum() * counts.sum()
    assert scipy.stats.chisquare(counts[support].numpy(), expected.numpy()).pvalue > 1e-6


def test_sample_rounding_guards(monkeypatch: pytest.MonkeyPatch) -> None:
    probs = _probs(0.0, 0.0, 0.6, 0.4, 0.0)
    monkeypatch.setattr(sampling, "draw_uniform", lambda generator: 0.0)
    assert sample_from_probs(probs, None) == 2  # u = 0 -> first non-zero token, not token 0
    # u * total at (or past) the last cumulative sum, as rounding could produce -> last non-zero.
    monkeypatch.setattr(sampling, "draw_uniform", lambda generator: 1.0)
    assert sample_from_probs(probs, None) == 3


@pytest.mark.parametrize(
    "probs",
    [_probs(0.5, -0.1, 0.6), _probs(0.5, math.nan, 0.5), _probs(0.0, 0.0), torch.ones(2, 3), torch.ones(0)],
)
def test_sample_rejects_bad_weights_without_consuming(probs: torch.Tensor) -> None:
    generator = make_generator(1, 0)
    state = generator.get_state()
    with pytest.raises(ValueError, match="sample_from_probs"):
        sample_from_probs(probs, generator)
    assert torch.equal(generator.get_state(), state)


# --- make_generator -------------------------------------------------------------------------------


def test_make_generator_streams() -> None:
    def first_draws(generator: torch.Generator) -> list[float]:
        return torch.rand(4, generator=generator, dtype=torch.float64).tolist()

    assert first_draws(make_generator(5, 2)) == first_draws(make_generator(5, 2))
    assert first_draws(make_generator(5, 2)) == first_draws(make_generator(7, 0))  # seed + index
    assert first_draws(make_generator(5, 0)) != first_draws(make_generator(5, 1))
    assert first_draws(make_generator(2**64 - 1, 1)) == first_draws(make_generator(0, 0))  # mod 2**64

    global_state = torch.get_rng_state()
    unseeded = [first_draws(make_generator(None, 0)) for _ in range(2)]
    assert unseeded[0] != unseeded[1]
    assert torch.equal(torch.get_rng_state(), global_state)  # the global generator is untouched


def test_process_logits_at_temperature_one_is_the_shifted_softmax_bit_for_bit() -> None:
    """T = 1 without truncation skips the explicit max shift and division: the same bits as the general path."""
    g = torch.Generator().manual_seed(0)
    for shape, scale in [((4096,), 1.0), ((7, 4096), 30.0), ((3, 33), 100.0)]:
        x = torch.randn(*shape, generator=g) * scale
        x[..., 3] = -math.inf
        shifted = x - x.amax(dim=-1, keepdim=True)
        assert torch.equal(process_logits(x, SamplingParams(temperature=1.0)), torch.softmax(shifted / 1.0, dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_row_argmax_equals_torch_argmax_ties_and_nan_included(dtype) -> None:
    """The greedy path's argmax (numpy for CPU float32 / float64 rows): torch.argmax's answer on random rows, on
    rows with tied maxima (the first index) and with NaN (the first NaN), for [N, V] and [V]."""
    from engine.spec.sampling import row_argmax

    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 4096, generator=g).to(dtype)
    x[1, [7, 300, 4000]] = 50.0  # ties
    x[2, [11, 12]] = float("nan")
    x[3, :] = 0.0
    want = torch.argmax(x, dim=-1).tolist()
    assert row_argmax(x) == want and want[1] == 7 and want[2] == 11 and want[3] == 0
    assert row_argmax(x[4]) == int(torch.argmax(x[4])) and isinstance(row_argmax(x[4]), int)
