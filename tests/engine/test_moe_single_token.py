"""The CPU decode fast path of `engine.models.moe.expert_compute` (one token, no grad) against its spec,
`kernels.fused_moe_ref`: top-1 to top-E, odd and non-power-of-two sizes, remote (-1) slots."""

from __future__ import annotations

import pytest
import torch

import engine.models.moe as moe
import kernels

# E=experts r=top-r D=hidden F=expert dim
SHAPES = [  # (E, r, D, F)
    (1, 1, 1, 1),
    (4, 1, 16, 8),  # top-1
    (6, 2, 48, 24),  # the tiny test target
    (7, 3, 33, 17),  # odd, non-power-of-two
    (5, 5, 20, 12),  # every expert
]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _case(E: int, r: int, D: int, F: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, D, generator=gen).to(dtype)
    w_gate_up = (torch.randn(E, 2 * F, D, generator=gen) / D**0.5).to(dtype)  # [E, 2F, D]
    w_down = (torch.randn(E, D, F, generator=gen) / F**0.5).to(dtype)  # [E, D, F]
    expert_ids = torch.randperm(E, generator=gen)[:r].unsqueeze(0)  # [1, r]
    topk_weights = torch.rand(1, r, generator=gen).softmax(-1).to(dtype)  # [1, r]
    return x, w_gate_up, w_down, expert_ids, topk_weights


@pytest.fixture
def no_kernel(monkeypatch):
    """Fail if `expert_compute` leaves the fast path for `kernels.fused_moe`."""

    def refuse(*args, **kwargs):
        raise AssertionError("one CPU token under no_grad should take the single-token path")

    monkeypatch.setattr(moe.kernels, "fused_moe", refuse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "E{}r{}D{}F{}".format(*s))
def test_single_token_path_matches_reference(shape, dtype, no_kernel):
    for seed in range(3):
        x, gu, down, ids, w = _case(*shape, dtype, seed)
        want = kernels.fused_moe_ref(x, gu, down, ids, w)
        with torch.inference_mode():
            got = moe.expert_compute(x, gu, down, ids, w)
        assert got.shape == want.shape == x.shape and got.dtype == x.dtype
        torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("remote", ["some", "all"])
def test_single_token_path_skips_remote_slots(remote, no_kernel):
    x, gu, down, ids, w = _case(6, 3, 24, 10, torch.float32, seed=1)
    ids = ids.clone()
    if remote == "all":
        ids[:] = -1
    else:
        ids[0, 1] = -1
    want = kernels.fused_moe_ref(x, gu, down, ids, w)
    with torch.inference_mode():
        got = moe.expert_compute(x, gu, down, ids, w)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    if remote == "all":
        assert torch.equal(got, torch.zeros_like(x))


def test_fast_path_only_for_one_token_without_grad():
    """Two tokens, or autograd on, go through `kernels.fused_moe` (the path the twin above stands in for)."""
    x, gu, down, ids, w = _case(6, 2, 16, 8, torch.float32, seed=2)
    calls = []
    real = moe.kernels.fused_moe

    def spy(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(moe.kernels, "fused_moe", spy)
        with torch.inference_mode():
            moe.expert_compute(torch.cat([x, x]), gu, down, torch.cat([ids, ids]), torch.cat([w, w]))
        moe.expert_compute(x, gu, down, ids, w)  # grad enabled
    assert calls == [2, 1]
