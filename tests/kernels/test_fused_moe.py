"""fused_moe: the reference against a naive per-token loop (values and gradients), the Triton kernel
(interpreter on CPU) against the reference, the dispatcher, and launcher input validation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F_nn

import kernels
from kernels.fused_moe import (
    MoeBlockConfig,
    fused_moe,
    fused_moe_configured,
    fused_moe_ref,
    get_config,
)

# E=experts D=hidden F=expert dim T=tokens r=top-r

FP32 = dict(rtol=1e-3, atol=1e-5)


def make_inputs(
    T: int,
    E: int,
    r: int,
    D: int = 72,
    F: int = 40,
    local_frac: float = 1.0,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    only_experts: int | None = None,
) -> tuple[torch.Tensor, ...]:
    """Random MoE inputs; `only_experts=k` routes every token to the first k experts (the rest get
    zero tokens); a share 1 - local_frac of the slots is -1 (expert on another EP rank)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, D, generator=gen)
    w_gate_up = torch.randn(E, 2 * F, D, generator=gen) * D**-0.5
    w_down = torch.randn(E, D, F, generator=gen) * F**-0.5
    pool = only_experts or E
    expert_ids = torch.rand(T, pool, generator=gen).topk(r, dim=1).indices
    expert_ids = expert_ids.masked_fill(torch.rand(T, r, generator=gen) >= local_frac, -1)
    topk_weights = torch.softmax(torch.randn(T, r, generator=gen), dim=1)
    return (hidden.to(dtype), w_gate_up.to(dtype), w_down.to(dtype), expert_ids, topk_weights.to(dtype))


def naive_moe(hidden, w_gate_up, w_down, expert_ids, topk_weights, b_gate_up=None, b_down=None, clamp=None):
    """The contract read literally: a loop over tokens and slots (differentiable); with biases and `clamp`,
    gpt_oss's expert formula."""
    F = w_down.shape[-1]
    rows = []
    for t in range(hidden.shape[0]):
        acc = hidden.new_zeros(hidden.shape[1])
        for s in range(expert_ids.shape[1]):
            e = int(expert_ids[t, s])
            if e < 0:
                continue
            h = w_gate_up[e] @ hidden[t] + (0 if b_gate_up is None else b_gate_up[e])
            gate, up = h[:F], h[F:]
            if clamp is None:
                act = F_nn.silu(gate) * up
            else:
                gate, up = gate.clamp(max=clamp.limit), up.clamp(-clamp.limit, clamp.limit)
                act = (up + 1) * gate * torch.sigmoid(clamp.alpha * gate)
            acc = acc + topk_weights[t, s] * (w_down[e] @ act + (0 if b_down is None else b_down[e]))
        rows.append(acc)
    return torch.stack(rows)


# ---- reference vs naive loop (cheap: the full grid) ----


@pytest.mark.parametrize("T", [1, 2, 7, 33, 64])
@pytest.mark.parametrize("E,r", [(8, 1), (8, 8), (16, 2), (16, 4), (60, 4), (60, 8)])
@pytest.mark.parametrize("local_frac", [1.0, 0.6])
def test_ref_matches_naive(T: int, E: int, r: int, local_frac: float) -> None:
    args = make_inputs(T, E, r, local_frac=local_frac, seed=T * E + r, dtype=torch.float64)
    torch.testing.assert_close(fused_moe_ref(*args), naive_moe(*args), rtol=1e-10, atol=1e-12)
    args32 = [a.float() if a.is_floating_point() else a for a in args]
    torch.testing.assert_close(fused_moe_ref(*args32), naive_moe(*args).float(), **FP32)


def test_ref_zero_token_experts_and_all_remote() -> None:
    args = make_inputs(9, 16, 2, only_experts=3)
    torch.testing.assert_close(fused_moe_ref(*args), naive_moe(*args), **FP32)
    hidden, w_gate_up, w_down, expert_ids, topk_weights = make_inputs(5, 8, 2)
    out = fused_moe_ref(hidden, w_gate_up, w_down, torch.full_like(expert_ids, -1), topk_weights)
    assert torch.equal(out, torch.zeros(5, 72))


def test_ref_gradients_match_naive() -> None:
    args = make_inputs(7, 8, 4, local_frac=0.7, seed=3)
    leaves = [a.clone().requires_grad_(a.is_floating_point()) for a in args]
    probe = torch.randn(7, 72)
    grads = []
    for fn in (fused_moe_ref, naive_moe):
        for leaf in leaves:
            leaf.grad = None
        (fn(*leaves) * probe).sum().backward()
        grads.append([leaves[i].grad.clone() for i in (0, 1, 2, 4)])
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, **FP32)


def test_ref_gradcheck_fp64() -> None:
    hidden, w_gate_up, w_down, expert_ids, topk_weights = make_inputs(3, 4, 2, D=6, F=5, dtype=torch.float64)
    inputs = [t.requires_grad_() for t in (hidden, w_gate_up, w_down, topk_weights)]
    fn = lambda h, wg, wd, w: fused_moe_ref(h, wg, wd, expert_ids, w)
    assert torch.autograd.gradcheck(fn, inputs)


def test_ref_bf16_accumulates_in_fp32() -> None:
    args = make_inputs(33, 16, 4)
    bf16 = [a.bfloat16() if a.is_floating_point() else a for a in args]
    out = fused_moe_ref(*bf16)
    assert out.dtype == torch.bfloat16
    exact = fused_moe_ref(*[a.float() if a.is_floating_point() else a for a in bf16])
    torch.testing.assert_close(out.float(), exact, rtol=1e-2, atol=1e-2)


# ---- Triton (interpreter) vs reference ----

# (T, E, r, D, F, local share, only_experts): every listed T, E and r at least once; D and F are not
# multiples of any block; zero-token experts (E=60 with few tokens, only_experts) and EP -1 slots.
CASES = [
    (1, 8, 1, 72, 40, 1.0, None),
    (2, 16, 2, 72, 40, 1.0, None),
    (7, 60, 4, 72, 40, 0.7, None),
    (33, 8, 8, 72, 40, 1.0, None),
    (64, 16, 4, 72, 40, 0.5, None),
    (64, 60, 8, 72, 40, 0.8, None),
    (33, 60, 2, 72, 40, 1.0, 3),
    (7, 16, 8, 130, 24, 1.0, None),
    (2, 8, 4, 24, 136, 0.0, None),
]


@pytest.mark.parametrize("T,E,r,D,F,local_frac,only", CASES)
def test_triton_matches_ref(triton_cpu: None, T, E, r, D, F, local_frac, only) -> None:
    args = make_inputs(T, E, r, D, F, local_frac, seed=T + E + r, only_experts=only)
    torch.testing.assert_close(fused_moe(*args), fused_moe_ref(*args), **FP32)


@pytest.mark.parametrize(
    "config",
    [MoeBlockConfig(16, 16, 16), MoeBlockConfig(32, 32, 64), MoeBlockConfig(64, 128, 32, num_warps=8)],
)
def test_triton_block_configs(triton_cpu: None, config: MoeBlockConfig) -> None:
    args = make_inputs(33, 16, 4, D=72, F=40, local_frac=0.8, seed=5)
    torch.testing.assert_close(fused_moe_configured(*args, config), fused_moe_ref(*args), **FP32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_half_precision(triton_cpu: None, dtype: torch.dtype) -> None:
    args = make_inputs(33, 16, 4, local_frac=0.8, dtype=dtype, seed=7)
    out = fused_moe(*args)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), fused_moe_ref(*args).float(), rtol=2e-2, atol=2e-2)


def test_triton_bf16_routing_weights_fp32(triton_cpu: None) -> None:
    *args, topk_weights = make_inputs(7, 8, 2, dtype=torch.bfloat16)
    out = fused_moe(*args, topk_weights.float())
    torch.testing.assert_close(out.float(), fused_moe_ref(*args, topk_weights.float()).float(), rtol=2e-2, atol=2e-2)


def test_triton_deterministic_and_empty(triton_cpu: None) -> None:
    args = make_inputs(7, 8, 4, seed=9)
    assert torch.equal(fused_moe(*args), fused_moe(*args))
    hidden, w_gate_up, w_down, expert_ids, topk_weights = make_inputs(1, 8, 2)
    out = fused_moe(hidden[:0], w_gate_up, w_down, expert_ids[:0], topk_weights[:0])
    assert out.shape == (0, 72)
    assert fused_moe_ref(hidden[:0], w_gate_up, w_down, expert_ids[:0], topk_weights[:0]).shape == (0, 72)


@pytest.mark.slow
@pytest.mark.parametrize("T", [1, 2, 7, 33, 64])
@pytest.mark.parametrize("E", [8, 16, 60])
@pytest.mark.parametrize("r", [1, 2, 4, 8])
def test_triton_sweep(triton_cpu: None, T: int, E: int, r: int) -> None:
    args = make_inputs(T, E, r, local_frac=0.8, seed=T * 7 + E + r)
    torch.testing.assert_close(fused_moe(*args), fused_moe_ref(*args), **FP32)


# ---- dispatch ----


def test_dispatch(triton_cpu: None) -> None:
    hidden, w_gate_up, w_down, expert_ids, topk_weights = make_inputs(7, 8, 2, local_frac=0.8, seed=11)
    args = (hidden, w_gate_up, w_down, expert_ids.int(), topk_weights)  # int32 ids work too
    ref = fused_moe_ref(*args)
    assert torch.equal(ref, fused_moe_ref(hidden, w_gate_up, w_down, expert_ids, topk_weights))
    assert torch.equal(kernels.fused_moe(*args), ref)  # auto on CPU = reference
    assert torch.equal(kernels.fused_moe(*args, backend="torch"), ref)
    torch.testing.assert_close(kernels.fused_moe(*args, backend="triton"), ref, **FP32)
    with pytest.raises(ValueError, match="backend"):
        kernels.fused_moe(*args, backend="cuda")


def test_dispatch_training_takes_reference() -> None:
    hidden, *rest = make_inputs(7, 8, 2, seed=12)
    hidden.requires_grad_()
    kernels.fused_moe(hidden, *rest).sum().backward()  # auto: reference, differentiable
    assert hidden.grad is not None and hidden.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="forward-only"):
        kernels.fused_moe(hidden, *rest, backend="triton")


# ---- validation ----


def test_bad_input(triton_cpu: None) -> None:
    hidden, w_gate_up, w_down, expert_ids, topk_weights = make_inputs(4, 8, 2)
    cases = {
        "T, D": (hidden[0], w_gate_up, w_down, expert_ids, topk_weights),
        "E, 2F, D": (hidden, w_gate_up[0], w_down, expert_ids, topk_weights),
        "odd": (hidden, w_gate_up[:, :-1], w_down, expert_ids, topk_weights),
        "hidden dim": (hidden[:, :-1], w_gate_up, w_down, expert_ids, topk_weights),
        r"w_down must be \[E, D, F\]": (hidden, w_gate_up, w_down[:-1], expert_ids, topk_weights),
        "expert_ids must be": (hidden, w_gate_up, w_down, expert_ids[:-1], topk_weights),
        "topk_weights must be": (hidden, w_gate_up, w_down, expert_ids, topk_weights[:, :1]),
        r"\[-1, 8\)": (hidden, w_gate_up, w_down, expert_ids + 8, topk_weights),
        "dtype": (hidden, w_gate_up.double(), w_down, expert_ids, topk_weights),
    }
    for backend in ("torch", "triton"):
        for match, args in cases.items():
            with pytest.raises(ValueError, match=match):
                kernels.fused_moe(*args, backend=backend)
    with pytest.raises(ValueError, match="hidden must be contiguous"):
        fused_moe(hidden.t().contiguous().t(), w_gate_up, w_down, expert_ids, topk_weights)
    with pytest.raises(ValueError, match="supports"):
        fused_moe(*[a.double() if a.is_floating_point() else a for a in make_inputs(4, 8, 2)])
    with pytest.raises(ValueError, match="power of two"):
        fused_moe_configured(hidden, w_gate_up, w_down, expert_ids, topk_weights, MoeBlockConfig(BLOCK_K=24))


def test_triton_reads_weights_of_any_layout(triton_cpu: None) -> None:
    """The engine's CPU decode layout (engine.models.layout) stores weights input-major: no copy, same result."""
    hidden, w_gate_up, w_down, expert_ids, topk_weights = make_inputs(7, 8, 2)
    relaid = [w.transpose(1, 2).contiguous().transpose(1, 2) for w in (w_gate_up, w_down)]
    assert not relaid[0].is_contiguous() and not relaid[1].is_contiguous()
    ref = fused_moe_ref(hidden, w_gate_up, w_down, expert_ids, topk_weights)
    torch.testing.assert_close(fused_moe(hidden, *relaid, expert_ids, topk_weights), ref, rtol=1e-5, atol=1e-5)


def test_get_config() -> None:
    assert get_config(8, 72, 40) == MoeBlockConfig()  # not in the JSON: default in code
    assert get_config(256, 72, 40).BLOCK_M == 64
    small, big = get_config(1, 2048, 768), get_config(4096, 2048, 768)  # Qwen3-30B-A3B rows of the JSON
    assert isinstance(small, MoeBlockConfig) and isinstance(big, MoeBlockConfig)


# ---- GPU (skipped without CUDA) ----


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_ref(dtype: torch.dtype) -> None:
    for T, E, r, D, F, local_frac, only in CASES:
        args = [a.cuda() for a in make_inputs(T, E, r, D, F, local_frac, dtype=dtype, only_experts=only)]
        out, ref = kernels.fused_moe(*args), fused_moe_ref(*args)
        tol = FP32 if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(out.float(), ref.float(), **tol)


# ---- gpt_oss: expert biases and the clamped SwiGLU ----

CLAMP = kernels.ClampedSwiGLU(alpha=1.702, limit=0.5)  # a limit the random activations cross in both directions


def biased_inputs(T: int, E: int, r: int, D: int = 72, F: int = 40, local_frac: float = 1.0, seed: int = 0):
    args = make_inputs(T, E, r, D, F, local_frac, seed=seed)
    gen = torch.Generator().manual_seed(seed + 99)
    return (*args, torch.randn(E, 2 * F, generator=gen), torch.randn(E, D, generator=gen))


@pytest.mark.parametrize("T,E,r,local_frac", [(1, 8, 2, 1.0), (7, 16, 4, 0.6), (33, 60, 4, 1.0)])
def test_ref_biases_and_clamp_match_naive(T, E, r, local_frac) -> None:
    *args, b_gu, b_dn = biased_inputs(T, E, r, local_frac=local_frac, seed=T + E)
    want = naive_moe(*args, b_gu, b_dn, CLAMP)
    torch.testing.assert_close(fused_moe_ref(*args, b_gu, b_dn, CLAMP), want, **FP32)
    plain = fused_moe_ref(*args, b_gu, b_dn)  # biases with the plain SiLU: a different function
    assert not torch.allclose(plain, want)


@pytest.mark.parametrize("T,E,r,local_frac", [(1, 8, 2, 1.0), (7, 16, 4, 0.6), (33, 60, 4, 1.0), (2, 8, 4, 0.0)])
def test_triton_biases_and_clamp_match_ref(triton_cpu: None, T, E, r, local_frac) -> None:
    *args, b_gu, b_dn = biased_inputs(T, E, r, local_frac=local_frac, seed=T + r)
    torch.testing.assert_close(fused_moe(*args, b_gu, b_dn, CLAMP), fused_moe_ref(*args, b_gu, b_dn, CLAMP), **FP32)
    torch.testing.assert_close(fused_moe(*args, clamp=CLAMP), fused_moe_ref(*args, clamp=CLAMP), **FP32)


def test_bias_input_is_checked() -> None:
    *args, b_gu, b_dn = biased_inputs(3, 8, 2)
    with pytest.raises(ValueError, match="pairs"):
        fused_moe_ref(*args, b_gu, None)
    with pytest.raises(ValueError, match="b_gate_up must be"):
        fused_moe_ref(*args, b_gu[:, :-1], b_dn)
    with pytest.raises(ValueError, match="dtype and device"):
        fused_moe_ref(*args, b_gu.double(), b_dn.double())
