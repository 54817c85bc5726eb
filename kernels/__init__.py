"""Triton kernels for the MoE verification path, each with a pure-torch reference twin.

    from kernels import fused_moe
    out = fused_moe(hidden, w_gate_up, w_down, expert_ids, topk_weights)   # [T, D]

Dispatch happens here and only here: backend="auto" takes Triton for CUDA tensors and the torch
reference for CPU tensors, with its per-expert matmuls on the C++ small-M kernel (`kernels.small_m`, F.linear
where it does not apply), and the plain reference whenever autograd must flow (the Triton path is forward-only);
"torch" / "triton" force one. Triton on CPU tensors runs in the Triton interpreter and needs
TRITON_INTERPRET=1 in the environment before triton is imported (the kernel tests do this).

Note: `kernels.fused_moe` is the dispatching *function*; the Triton launcher and reference live in
the module of the same name, reachable as `from kernels.fused_moe import fused_moe_ref, ...`.
"""

from __future__ import annotations

import torch

from kernels import cpu_decode, small_m
from kernels.fused_moe import ClampedSwiGLU, MoeBlockConfig, fused_moe_ref, get_config
from kernels.fused_moe import fused_moe as fused_moe_triton
from kernels.moe_align import MoeAlignment, moe_align, moe_align_ref

__all__ = [
    "ClampedSwiGLU",
    "MoeAlignment",
    "MoeBlockConfig",
    "fused_moe",
    "fused_moe_ref",
    "fused_moe_triton",
    "get_config",
    "load_cpu_extensions",
    "moe_align",
    "moe_align_ref",
]

BACKENDS = ("auto", "torch", "triton")


def load_cpu_extensions() -> None:
    """Build / load the C++ CPU extensions of the forward (small-M linear, fused decode ops) now: an engine calls
    this when it is created, never lazily mid-step (EP ranks reaching a build at different times inside a
    collective time out)."""
    small_m.load()
    cpu_decode.load()


def _needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def fused_moe(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    expert_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    backend: str = "auto",
    b_gate_up: torch.Tensor | None = None,
    b_down: torch.Tensor | None = None,
    clamp: ClampedSwiGLU | None = None,
) -> torch.Tensor:
    """MoE expert compute. hidden [T, D], w_gate_up [E, 2F, D] (gate rows, then up rows),
    w_down [E, D, F], expert_ids [T, r] (-1 = expert not local: contributes 0), topk_weights [T, r]
    -> [T, D] in hidden's dtype:

        out[t] = sum_s topk_weights[t, s] * w_down[e] @ (silu(gate_e @ h[t]) * (up_e @ h[t])),
        e = expert_ids[t, s], gate_e = w_gate_up[e, :F], up_e = w_gate_up[e, F:]

    gpt_oss: expert biases b_gate_up [E, 2F], b_down [E, D] and its clamped SwiGLU (`ClampedSwiGLU`;
    kernels/fused_moe.py has the formula).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    args = (hidden, w_gate_up, w_down, expert_ids, topk_weights, b_gate_up, b_down, clamp)
    if backend == "auto":
        if not hidden.is_cuda:  # the reference's algorithm, its matmuls on the CPU small-M kernel where it applies
            return fused_moe_ref(*args, linear=small_m.linear)
        backend = "triton" if not _needs_grad(hidden, w_gate_up, w_down, topk_weights) else "torch"
    if backend == "torch":
        return fused_moe_ref(*args)
    if _needs_grad(hidden, w_gate_up, w_down, topk_weights):
        raise ValueError("backend='triton' is forward-only; use backend='torch' (or 'auto') to train")
    return fused_moe_triton(*args)
