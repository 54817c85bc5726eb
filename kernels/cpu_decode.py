"""The small ops of a CPU decode / verification step, fused in C++ (`cpu_decode.cpp`, AVX-512 or AVX2),
with the torch ops of `engine.models.transformer.Attention.forward_cached`, `F.rms_norm` and
`engine.models.moe.MoEBlock.forward` as their reference twins (same results to ~1e-6: tested).

    from kernels import cpu_decode
    out = cpu_decode.attention(proj, cos, sin_signed, q_norm, k_norm, eps, k_cache, v_cache,
                               write_slots, pad_index, read_slots, mask, H, Hkv)    # [n, H*hd]
    h, x = cpu_decode.add_rms_norm(h, delta, weight, eps)               # (h + delta, rms_norm(h + delta) * w)
    out = cpu_decode.moe_decode(x, gu, down, ids, weights, shared_in, shared_down, gated, pack=True)   # [T, D]
    weights, ids = cpu_decode.route_softmax(router_logits, r, norm)     # [T, r] fp32, [T, r] int64
    load().DecoderStack(layers, head, sources, H, Hkv, hd).forward(...)  # every layer at once: engine.models.cpu_stack

Why: at one request and a few tokens, a layer's attention (qk-norm, RoPE, K/V writes, SDPA and its transposes)
is ~15 ATen ops, each RMSNorm ~8 and a few tokens' experts and shared expert ~30 (with the permutation
bookkeeping of `kernels.fused_moe_ref` beyond one token), every one of them several µs with
the caches cold from the weight reads around them, which is more than reading the attention weights takes (README,
issue 12). Each becomes one call; `DecoderStack` (kernels/decoder_stack.h) then runs all of them, for every layer, in
one call, on the same raw ops (kernels/decode_ops.h), so with the same bits.
Built once like the small-M kernel (`kernels.cpp_build`); off when `EXPERTSPEC_CPU_DECODE=0`, without AVX2 or
AVX-512, without a compiler or on a failed build (`status()` says which), and the torch ops then run.
"""

from __future__ import annotations

import torch

from kernels import small_m
from kernels.cpp_build import CppExtension

_EXT = CppExtension("cpu_decode", "EXPERTSPEC_CPU_DECODE", ("-O3",), simd=True)
# above this many tokens kernels.fused_moe (grouped MKL GEMMs) is faster (measured: C++ 1.2-4.7x faster at 24-32
# tokens on three expert shapes, 0.7-0.9x at 64)
MAX_MOE_TOKENS = 32
load = _EXT.load  # the compiled extension (built on the first call), or None when it is off
status = _EXT.status  # 'on (AVX-512)', 'on (AVX2)' or 'off (<why>)'


def applies(x: torch.Tensor) -> bool:
    """Whether the fused ops take x: CPU fp32 without autograd, and the extension on."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and not (torch.is_grad_enabled() and x.requires_grad)
        and load() is not None
    )


def attention(
    proj: torch.Tensor,
    cos: torch.Tensor,
    sin_signed: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    write_slots: torch.Tensor,
    pad_index: torch.Tensor,
    read_slots: torch.Tensor,
    mask: torch.Tensor | None,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """The n packed tokens of B requests: proj [n, (H + 2Hkv) hd] (fused QKV output), cos / sin_signed [n, rd],
    per-head qk-norm weights [hd] (or None), cache storage k/v [slots, Hkv, hd] of one layer, write_slots [n],
    pad_index [B, Tq] (packed token of each request's query cell, n = padding), read_slots [B, S], mask [B, Tq, S]
    bool (None: every query sees every read slot of its request) -> attention output [n, H hd], the new K/V written
    into the cache. The caller checks `applies` first."""
    return load().attention(proj, cos, sin_signed, q_norm, k_norm, eps, k_cache, v_cache, write_slots, pad_index,
                            read_slots, mask, num_heads, num_kv_heads)  # fmt: skip


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, F.rms_norm(h + delta) * weight) for rows h [N, D] fp32 (delta None: h itself) in one call; the
    caller checks `applies(h)` (engine.models.layers.add_norm falls back to the torch ops)."""
    s, out = load().add_rms_norm(h.contiguous(), None if delta is None else delta.contiguous(), weight, eps)
    return s, out


def moe_decode(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    expert_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    shared_in: torch.Tensor | None = None,
    shared_down: torch.Tensor | None = None,
    shared_gated: bool = False,
    pack: bool = False,
) -> torch.Tensor:
    """T tokens x [T, D] (the engine sends T <= MAX_MOE_TOKENS) -> [T, D]:
    Σ_s w_s down_e(silu(gate_e x) * up_e x) over expert_ids [T, r] (-1: contributes 0), w_gate_up [E, 2F, D] and
    w_down [E, D, F] read in place, once per block of <= 16 of the tokens routed to e; plus, when shared_in
    [T, 2Fs (+1)] is given (the shared expert's gate / up projections and, gated, its gate logit),
    sigmoid(logit) * shared_down [D, Fs] (silu(g) * u). pack: read the weights' strip-packed copies
    (`kernels.small_m.packed`, cached on the weights; same bits) where there are. The caller checks `applies(x)`."""
    packs = [None, None, None]
    if pack:
        packs = [small_m.packed(w_gate_up), small_m.packed(w_down)]
        packs.append(small_m.packed(shared_down) if shared_down is not None else None)
    ids, weights = expert_ids.contiguous(), topk_weights.float().contiguous()
    return load().moe_decode(x.contiguous(), w_gate_up, w_down, ids, weights, shared_in, shared_down, shared_gated,
                             *packs)  # fmt: skip


def route_softmax(router_logits: torch.Tensor, top_r: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-r routing of T tokens, `MoEBlock.route`'s torch ops (softmax, topk, renormalisation) in one call:
    router_logits [T, E] fp32 (rows contiguous, may be a slice) -> topk_weights [T, r] fp32, expert_ids [T, r] int64:
    the r largest logits of each row in descending order (ties: lower id first). The caller checks `applies`."""
    w, ids = load().route_softmax(router_logits, top_r, norm)
    return w, ids


def routing_footprint(
    expert_ids: list[torch.Tensor], start: int, n: int, num_experts: int, prev: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, list[int], int, int, int] | None:
    """One request's routing footprint of a verification, in one call: expert_ids L x [N, r] (a forward's routing),
    rows start .. start + n - 1 (the request's verified tokens, root first), prev [L, E] bool (the previous round's
    pairs) or None -> (counts [L, E] int64, pairs [L, E] bool, U_l per layer, pairs used, the root's own pairs,
    pairs also in prev or -1 without prev); None when the ids are not contiguous int64 on the CPU or prev not a
    contiguous bool CPU tensor (the caller's numpy twin, `engine.runtime.footprint.footprint_numpy`, then runs).
    ValueError on an id outside [0, num_experts). The caller checks `load()`."""
    return load().routing_footprint(expert_ids, start, n, num_experts, prev)
