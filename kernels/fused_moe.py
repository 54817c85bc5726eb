"""MoE expert compute for small verification batches: grouped GEMM over the active experts only.

    out[t] = sum_s topk_weights[t,s] * w_down[e] @ (silu(w_gate_up[e, :F] @ h[t]) * (w_gate_up[e, F:] @ h[t]))
    e = expert_ids[t, s]; e = -1 (expert not local under EP) contributes 0.

Rows 0..F-1 of `w_gate_up` are the gate projection, rows F..2F-1 the up projection (the layout of
transformers' fused `experts.gate_up_proj`). gpt_oss's experts add biases and clamp their SwiGLU
(`ClampedSwiGLU`; b_gate_up [E, 2F] in the same row order, b_down [E, D]):

    h = w_gate_up[e] @ x + b_gate_up[e];  g = min(h[:F], limit);  u = clamp(h[F:], -limit, limit)
    y_e = w_down[e] @ ((u + 1) * g * sigmoid(alpha * g)) + b_down[e]

`fused_moe_ref` is the spec and the CPU path: it groups assignments by expert and runs one pair of
matmuls per active expert (differentiable, fp32 accumulation). `fused_moe` is the Triton path:

    moe_align          expert-sorted, BLOCK_M-padded assignment order (kernels/moe_align.py)
    gate_up kernel     per (block of one expert, F tile): silu(h W_g^T) * (h W_u^T) -> inter [A, F] fp32
    down kernel        per (block, D tile): topk_weight * inter W_d^T -> partial [A, D] fp32
    combine kernel     out[t] = sum_s partial[t*r+s] over local slots, cast to hidden's dtype

Blocks past the padded length carry expert -1 and exit at once, so only the active experts' weights
are read: at decode sizes the cost is (distinct experts) x (expert bytes) / HBM bandwidth.
Block sizes come from `fused_moe_configs.json` keyed by (tokens, hidden, expert dim), else a default.
The Triton path is forward-only (inference); `kernels.fused_moe` dispatches training to the reference.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F_nn
import triton
import triton.language as tl

from kernels._launch import launch
from kernels.moe_align import check_expert_ids, moe_align

# E=experts D=hidden F=expert (intermediate) dim T=tokens r=top-r A=assignments (T*r)

_CONFIG_PATH = Path(__file__).with_name("fused_moe_configs.json")
_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class MoeBlockConfig:
    """Tile sizes of the grouped GEMM (BLOCK_* powers of two >= 16) and Triton launch options."""

    BLOCK_M: int = 16
    BLOCK_N: int = 64
    BLOCK_K: int = 64
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt_oss's expert activation (module docstring); alpha and limit as in its config (`swiglu_limit`)."""

    alpha: float = 1.702
    limit: float = 7.0


def check_expert_biases(b_gate_up: torch.Tensor | None, b_down: torch.Tensor | None, E: int, D: int, F: int,
                        hidden: torch.Tensor) -> None:  # fmt: skip
    """Both biases or neither; b_gate_up [E, 2F], b_down [E, D], hidden's dtype and device."""
    if (b_gate_up is None) != (b_down is None):
        raise ValueError("expert biases come in pairs: pass both b_gate_up [E, 2F] and b_down [E, D], or neither")
    if b_gate_up is None:
        return
    if tuple(b_gate_up.shape) != (E, 2 * F) or tuple(b_down.shape) != (E, D):
        raise ValueError(f"b_gate_up must be [E, 2F] = {(E, 2 * F)} and b_down [E, D] = {(E, D)}, got "
                         f"{tuple(b_gate_up.shape)} and {tuple(b_down.shape)}")  # fmt: skip
    for t in (b_gate_up, b_down):
        if t.dtype != hidden.dtype or t.device != hidden.device:
            raise ValueError(f"expert biases must have hidden's dtype and device ({hidden.dtype}, {hidden.device}), "
                             f"got {t.dtype}, {t.device}")  # fmt: skip


def check_moe_inputs(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    expert_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    check_values: bool = True,
) -> tuple[int, int, int, int, int]:
    """Validate the fused-MoE arguments; returns (T, D, E, F, r). Raises ValueError on bad input.

    `check_values=False` leaves the expert-id range to `moe_align` (checked on the device on CUDA).
    """
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [T, D], got shape {tuple(hidden.shape)}")
    if w_gate_up.dim() != 3 or w_down.dim() != 3:
        raise ValueError(
            f"w_gate_up must be [E, 2F, D] and w_down [E, D, F], got {tuple(w_gate_up.shape)} and {tuple(w_down.shape)}"
        )
    T, D = hidden.shape
    E, F2, D_w = w_gate_up.shape
    if F2 % 2:
        raise ValueError(f"w_gate_up must be [E, 2F, D] (gate rows then up rows), got odd dim 1 = {F2}")
    F = F2 // 2
    if D_w != D:
        raise ValueError(f"w_gate_up hidden dim {D_w} != hidden's {D}")
    if tuple(w_down.shape) != (E, D, F):
        raise ValueError(f"w_down must be [E, D, F] = {(E, D, F)}, got {tuple(w_down.shape)}")
    if expert_ids.dim() != 2 or expert_ids.shape[0] != T:
        raise ValueError(f"expert_ids must be [T={T}, r], got {tuple(expert_ids.shape)}")
    r = expert_ids.shape[1]
    if tuple(topk_weights.shape) != (T, r):
        raise ValueError(f"topk_weights must be [T, r] = {(T, r)}, got {tuple(topk_weights.shape)}")
    if not (hidden.is_floating_point() and topk_weights.is_floating_point()):
        raise ValueError(f"hidden and topk_weights must be floating, got {hidden.dtype}, {topk_weights.dtype}")
    if w_gate_up.dtype != hidden.dtype or w_down.dtype != hidden.dtype:
        raise ValueError(f"weights must have hidden's dtype {hidden.dtype}, got {w_gate_up.dtype} and {w_down.dtype}")
    devices = {t.device for t in (hidden, w_gate_up, w_down, expert_ids, topk_weights)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    check_expert_ids(expert_ids, E, check_values)
    return T, D, E, F, r


def fused_moe_ref(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    expert_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    clamp: ClampedSwiGLU | None = None,
    linear: Callable[..., torch.Tensor] = F_nn.linear,
) -> torch.Tensor:
    """Pure-torch MoE expert compute: hidden [T, D], w_gate_up [E, 2F, D], w_down [E, D, F],
    expert_ids [T, r] (-1 = not local), topk_weights [T, r] -> [T, D] in hidden's dtype; optional expert
    biases b_gate_up [E, 2F], b_down [E, D] and gpt_oss's clamped activation (module docstring). `linear`:
    the per-expert matmul (F.linear; `kernels.fused_moe` passes the CPU small-M kernel, `kernels.small_m`).

    One matmul pair per *active* expert on its gathered tokens; no per-token loop, inactive experts are
    never touched. Differentiable w.r.t. hidden, both weights and topk_weights; accumulates in fp32
    (fp64 stays fp64).
    """
    T, D, E, F, r = check_moe_inputs(hidden, w_gate_up, w_down, expert_ids, topk_weights)
    check_expert_biases(b_gate_up, b_down, E, D, F, hidden)
    acc_dtype = torch.promote_types(hidden.dtype, torch.float32)
    flat = expert_ids.reshape(-1)  # [A]
    # one host sync for the grouping: counts[0] = remote (-1) slots, counts[1 + e] = expert e's slots
    counts = torch.bincount(flat + 1, minlength=E + 1).tolist()
    if counts[0] == flat.numel():
        return hidden.new_zeros(T, D)
    assign = flat.argsort(stable=True)[counts[0] :]  # [A_local] grouped by expert, flat order inside
    tokens = assign // r

    x = hidden.index_select(0, tokens).to(acc_dtype)  # [A_local, D]
    ys, start = [], 0
    for e in range(E):
        n = counts[1 + e]
        if n == 0:
            continue
        bias_gu, bias_dn = (None, None) if b_gate_up is None else (b_gate_up[e].to(acc_dtype), b_down[e].to(acc_dtype))
        gate, up = linear(x[start : start + n], w_gate_up[e].to(acc_dtype), bias_gu).chunk(2, dim=-1)  # [n, F]
        if clamp is None:
            act = F_nn.silu(gate) * up
        else:
            gate, up = gate.clamp(max=clamp.limit), up.clamp(-clamp.limit, clamp.limit)
            act = (up + 1) * gate * torch.sigmoid(gate * clamp.alpha)
        ys.append(linear(act, w_down[e].to(acc_dtype), bias_dn))  # [n, D]
        start += n
    weights = topk_weights.reshape(-1).index_select(0, assign).to(acc_dtype)  # [A_local]
    y = (ys[0] if len(ys) == 1 else torch.cat(ys)) * weights[:, None]
    out = torch.zeros(T, D, dtype=acc_dtype, device=hidden.device)
    return out.index_add_(0, tokens, y).to(hidden.dtype)


@triton.jit
def _fused_moe_gate_up_kernel(
    hidden_ptr,
    w_gate_up_ptr,
    inter_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    bias_ptr,
    num_assign,
    top_r,
    D,
    F,
    stride_ht,
    stride_we,
    stride_wn,
    stride_wk,
    stride_it,
    stride_be,
    alpha,
    limit,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    CLAMP: tl.constexpr,
):
    # program = (block of BLOCK_M assignments of one expert) x (BLOCK_N columns of F)
    pid = tl.program_id(0)
    num_n = tl.cdiv(F, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:  # past the padded length: nothing to read
        return

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    assign = tl.load(sorted_ids_ptr + rows).to(tl.int64)  # [BLOCK_M], sentinel = num_assign
    row_mask = assign < num_assign
    token = assign // top_r
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < F
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = hidden_ptr + token[:, None] * stride_ht + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    # gate rows n and up rows F + n of this expert, read transposed as [BLOCK_K, BLOCK_N]
    g_ptrs = w_gate_up_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    up_shift = F * stride_wn

    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        k_mask = offs_k < D - k0
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        w_gate = tl.load(g_ptrs, mask=w_mask, other=0.0)
        w_up = tl.load(g_ptrs + up_shift, mask=w_mask, other=0.0)
        if UPCAST:  # Triton interpreter: no bf16 dot (it would multiply bit patterns); exact in fp32
            a, w_gate, w_up = a.to(tl.float32), w_gate.to(tl.float32), w_up.to(tl.float32)
        acc_gate = tl.dot(a, w_gate, acc=acc_gate, input_precision=DOT_PRECISION)
        acc_up = tl.dot(a, w_up, acc=acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K * stride_wk

    if HAS_BIAS:  # gpt_oss: gate bias n, up bias F + n of this expert
        b_ptrs = bias_ptr + expert * stride_be + offs_n
        acc_gate += tl.load(b_ptrs, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        acc_up += tl.load(b_ptrs + F, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    # fused activation-and-multiply; kept in fp32 (A x F is tiny next to the weights)
    if CLAMP:  # gpt_oss's clamped SwiGLU
        acc_gate = tl.minimum(acc_gate, limit)
        acc_up = tl.minimum(tl.maximum(acc_up, -limit), limit)
        inter = (acc_up + 1.0) * acc_gate * tl.sigmoid(acc_gate * alpha)
    else:
        inter = acc_gate * tl.sigmoid(acc_gate) * acc_up
    out_ptrs = inter_ptr + assign[:, None] * stride_it + offs_n[None, :]
    tl.store(out_ptrs, inter, mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _fused_moe_down_kernel(
    inter_ptr,
    w_down_ptr,
    topk_weights_ptr,
    partial_ptr,
    sorted_ids_ptr,
    block_expert_ptr,
    bias_ptr,
    num_assign,
    D,
    F,
    stride_it,
    stride_we,
    stride_wn,
    stride_wk,
    stride_pt,
    stride_be,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    # program = (block of BLOCK_M assignments of one expert) x (BLOCK_N columns of D)
    pid = tl.program_id(0)
    num_n = tl.cdiv(D, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    assign = tl.load(sorted_ids_ptr + rows).to(tl.int64)
    row_mask = assign < num_assign
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < D
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = inter_ptr + assign[:, None] * stride_it + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_down_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk  # [K, N]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, F, BLOCK_K):
        k_mask = offs_k < F - k0
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        # tensor cores want both operands in the weight dtype (a no-op in fp32)
        a = a.to(w.dtype)
        if UPCAST:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, w, acc=acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk

    if HAS_BIAS:  # the expert's output bias, before its routing weight
        acc += tl.load(bias_ptr + expert * stride_be + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    # routing weight folded in here, so the combine is a plain sum over slots
    route_w = tl.load(topk_weights_ptr + assign, mask=row_mask, other=0.0).to(tl.float32)
    acc = acc * route_w[:, None]
    out_ptrs = partial_ptr + assign[:, None] * stride_pt + offs_n[None, :]
    tl.store(out_ptrs, acc, mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _moe_combine_kernel(
    partial_ptr,
    expert_ids_ptr,
    out_ptr,
    top_r,
    D,
    stride_pt,
    stride_ot,
    BLOCK_D: tl.constexpr,
):
    # program = (token, BLOCK_D columns); slots with expert -1 were never written: skip them
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for s in range(0, top_r):
        slot = t * top_r + s
        expert = tl.load(expert_ids_ptr + slot)
        local = d_mask & (offs_d * 0 + expert >= 0)  # broadcast as a block (the interpreter wants one)
        acc += tl.load(partial_ptr + slot * stride_pt + offs_d, mask=local, other=0.0)
    tl.store(out_ptr + t * stride_ot + offs_d, acc.to(out_ptr.dtype.element_ty), mask=d_mask)


@functools.cache
def _tuned_configs() -> tuple[dict, ...]:
    if not _CONFIG_PATH.exists():
        return ()
    return tuple(json.loads(_CONFIG_PATH.read_text())["configs"])


def get_config(num_tokens: int, hidden: int, expert_dim: int) -> MoeBlockConfig:
    """Block sizes for (T, D, F): the entry of fused_moe_configs.json with this (D, F) and the
    smallest `max_tokens` >= T (else the largest), or the default in code."""
    entries = [c for c in _tuned_configs() if (c["hidden"], c["expert_dim"]) == (hidden, expert_dim)]
    if entries:
        fitting = [c for c in entries if c["max_tokens"] >= num_tokens]
        entry = min(fitting, key=lambda c: c["max_tokens"]) if fitting else max(entries, key=lambda c: c["max_tokens"])
        return MoeBlockConfig(**{k: v for k, v in entry.items() if k in MoeBlockConfig.__dataclass_fields__})
    # decode-sized batches: few assignments per expert, so a short BLOCK_M wastes the fewest rows
    return MoeBlockConfig(BLOCK_M=16 if num_tokens <= 64 else 64)


def fused_moe_configured(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    expert_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    config: MoeBlockConfig,
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    clamp: ClampedSwiGLU | None = None,
) -> torch.Tensor:
    """`fused_moe` with explicit block sizes (tests and tuning); same shapes and result."""
    T, D, E, F, r = check_moe_inputs(hidden, w_gate_up, w_down, expert_ids, topk_weights, check_values=False)
    check_expert_biases(b_gate_up, b_down, E, D, F, hidden)
    if hidden.dtype not in _TRITON_DTYPES:
        raise ValueError(f"Triton fused_moe supports {_TRITON_DTYPES}, got {hidden.dtype}")
    if not hidden.is_contiguous():
        raise ValueError("hidden must be contiguous")  # the weights may have any strides (engine.models.layout)
    if not (expert_ids.is_contiguous() and topk_weights.is_contiguous()):
        raise ValueError("expert_ids and topk_weights must be contiguous")
    for name, v in asdict(config).items():
        if name.startswith("BLOCK_") and (v < 16 or v & (v - 1)):
            raise ValueError(f"{name} must be a power of two >= 16, got {v}")
    out = torch.empty(T, D, dtype=hidden.dtype, device=hidden.device)
    if T == 0:
        return out

    align = moe_align(expert_ids, E, config.BLOCK_M)
    num_assign = T * r
    num_blocks = align.block_expert_ids.numel()
    inter = torch.empty(num_assign, F, dtype=torch.float32, device=hidden.device)  # [A, F]
    partial = torch.empty(num_assign, D, dtype=torch.float32, device=hidden.device)  # [A, D]
    precision = "ieee" if hidden.dtype == torch.float32 else "tf32"  # fp32 tests stay exact
    tiles = dict(BLOCK_M=config.BLOCK_M, BLOCK_N=config.BLOCK_N, BLOCK_K=config.BLOCK_K)
    upcast = hidden.device.type == "cpu" and hidden.dtype == torch.bfloat16  # interpreter lacks bf16 dot
    opts = dict(DOT_PRECISION=precision, UPCAST=upcast, num_warps=config.num_warps, num_stages=config.num_stages)
    has_bias = b_gate_up is not None
    b_gu = b_gate_up.contiguous() if has_bias else inter  # a placeholder pointer when unused
    b_dn = b_down.contiguous() if has_bias else partial
    act = clamp or ClampedSwiGLU()

    grid = (num_blocks * triton.cdiv(F, config.BLOCK_N),)
    launch(
        _fused_moe_gate_up_kernel, grid,
        hidden, w_gate_up, inter, align.sorted_ids, align.block_expert_ids, b_gu,
        num_assign, r, D, F,
        hidden.stride(0), *w_gate_up.stride(), inter.stride(0), b_gu.stride(0), float(act.alpha), float(act.limit),
        **tiles, **opts, HAS_BIAS=has_bias, CLAMP=clamp is not None,
    )  # fmt: skip
    grid = (num_blocks * triton.cdiv(D, config.BLOCK_N),)
    launch(
        _fused_moe_down_kernel, grid,
        inter, w_down, topk_weights, partial, align.sorted_ids, align.block_expert_ids, b_dn,
        num_assign, D, F,
        inter.stride(0), *w_down.stride(), partial.stride(0), b_dn.stride(0),
        **tiles, **opts, HAS_BIAS=has_bias,
    )  # fmt: skip
    block_d = min(1024, triton.next_power_of_2(D))
    launch(
        _moe_combine_kernel, (T, triton.cdiv(D, block_d)),
        partial, expert_ids, out, r, D, partial.stride(0), out.stride(0),
        BLOCK_D=block_d, num_warps=4,
    )  # fmt: skip
    return out


def fused_moe(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    expert_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    clamp: ClampedSwiGLU | None = None,
) -> torch.Tensor:
    """Triton twin of `fused_moe_ref` (forward only): same arguments and result, block sizes from
    `get_config`. Needs fp32/bf16/fp16 tensors (hidden contiguous; weights of any strides) on CUDA
    (or CPU under TRITON_INTERPRET=1)."""
    T, D = hidden.shape if hidden.dim() == 2 else (0, 0)
    F = w_down.shape[-1] if w_down.dim() == 3 else 0
    return fused_moe_configured(hidden, w_gate_up, w_down, expert_ids, topk_weights, get_config(T, D, F),
                                b_gate_up, b_down, clamp)  # fmt: skip
