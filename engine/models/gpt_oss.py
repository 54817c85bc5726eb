"""gpt_oss (gpt-oss-20b / -120b): attention sinks, alternating sliding-window / full attention, biased router and
experts with a clamped SwiGLU, MXFP4 expert weights dequantised on load.

Attention (per head h, sink logit s_h a learned scalar; window W on "sliding_attention" layers):

    p(q -> k) = exp(l_qk) / (sum_k' exp(l_qk') + exp(s_h)),   l_qk = q.k / sqrt(hd),   visible iff q - k < W
    (the sink absorbs probability mass; it has no value, so outputs of weakly attending heads shrink to 0)

Over the paged cache the window needs key positions: `PagedKVCache.positions` holds each slot's position
(written by sliding layers, copied with the accepted path), so tree nodes, scratch slots and several
requests are windowed by true positions, not slot order.

MoE: router = Linear(D, E, bias); experts = top-r of the logits, weights = softmax over those r logits.

    h = x W_gu_e^T + b_gu_e;  g = min(h_gate, limit);  u = clamp(h_up, -limit, limit)
    y_e = ((u + 1) * g * sigmoid(alpha * g)) W_down_e^T + b_down_e

Layouts. Hub (transformers 5): `mlp.router.{weight,bias}`, `mlp.experts.gate_up_proj [E, D, 2F]` with gate /
up interleaved in the last dim, `gate_up_proj_bias [E, 2F]` (interleaved), `down_proj [E, F, D]`,
`down_proj_bias [E, D]`; released checkpoints store the two matrices as MXFP4 `*_blocks [E, out, in/32, 16]`
(two e2m1 values per byte, low nibble first) and `*_scales [E, out, in/32]` (e8m0 exponents, bias 127).
Ours: `mlp.gate.{weight,bias}`, `mlp.experts.gate_up_proj [E, 2F, D]` (gate rows, then up rows; the
`kernels.fused_moe` layout), `gate_up_proj_bias [E, 2F]` (same order), `down_proj [E, D, F]`,
`down_proj_bias [E, D]`. The expert compute is `kernels.fused_moe` with the biases and `ClampedSwiGLU` (torch
reference or its Triton twin, `backend=`); expert parallelism shards the biases with the weights and offload
keeps them resident (`GptOssMoE.local_experts`).

Shape letters: B=requests Tq=padded queries S=key slots N=packed tokens T=tokens H=heads Hkv=kv heads
hd=head dim D=hidden E=experts F=expert dim r=top-r.
"""

from __future__ import annotations

import torch
from torch import nn

import kernels
from engine.models.config import ModelConfig
from engine.models.layers import apply_rope, apply_rope_signed, pad_queries, unpad_queries
from engine.models.moe import MoEBlock, RoutingRecord
from engine.models.routing import budget_dropped
from engine.timing import PhaseTimer, maybe_phase
from kernels.small_m import linear

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # e2m1


# ---------------------------------------------------------------------------------------------- attention


def sink_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [B, Tq, H, hd], k / v [B, S, Hkv, hd], mask [B, Tq, S] bool (True = visible) or None, sinks [H]
    -> [B, Tq, H * hd]. A row with no visible key puts all its mass on the sink (output 0, never NaN)."""
    B, Tq, H, hd = q.shape
    rep = H // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    logits = torch.einsum("bqhd,bshd->bhqs", q, k) * scale  # [B, H, Tq, S]
    if mask is not None:
        logits = logits.masked_fill(~mask[:, None], float("-inf"))
    sink = sinks.to(logits.dtype).view(1, H, 1, 1).expand(B, H, Tq, 1)
    probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("bhqs,bshd->bqhd", probs.to(v.dtype), v).reshape(B, Tq, H * hd)


class GptOssAttention(nn.Module):
    """GQA with q/k/v/o biases, per-head sinks and an optional sliding window (`layer_types[layer]`)."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.cfg = cfg
        H, Hkv, hd, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
        self.q_proj = nn.Linear(D, H * hd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(D, Hkv * hd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(D, Hkv * hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(H * hd, D, bias=cfg.o_bias)
        self.sinks = nn.Parameter(torch.zeros(H))
        self.window = cfg.sliding_window if cfg.layer_types[layer] == "sliding_attention" else 0
        self.scale = hd**-0.5

    def _qkv(self, x: torch.Tensor, cos, sin, rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., D] -> q [..., H, hd], k, v [..., Hkv, hd] (RoPE applied)."""
        cfg = self.cfg
        q = self.q_proj(x).view(*x.shape[:-1], cfg.num_heads, cfg.head_dim)
        k = self.k_proj(x).view(*x.shape[:-1], cfg.num_kv_heads, cfg.head_dim)
        v = self.v_proj(x).view(*x.shape[:-1], cfg.num_kv_heads, cfg.head_dim)
        return rope(q, cos, sin), rope(k, cos, sin), v

    def forward_plain(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        """x [B, T, D] causal (windowed) self-attention without cache."""
        B, T, _ = x.shape
        q, k, v = self._qkv(x, cos, sin, apply_rope)
        pos = torch.arange(T, device=x.device)
        diff = pos[:, None] - pos[None, :]  # [T, T] query - key
        mask = (diff >= 0) & ((diff < self.window) if self.window else True)
        return self.o_proj(sink_attention(q, k, v, mask.expand(B, T, T), self.sinks, self.scale))

    def forward_cached(self, x: torch.Tensor, cos, sin_signed, batch, kv, layer: int) -> torch.Tensor:
        """x [N, D] packed tokens -> [N, D], writing their K/V (and, windowed, their positions) first."""
        q, k, v = self._qkv(x, cos, sin_signed, apply_rope_signed)
        kv.write(layer, batch.write_slots, k, v)
        keys, values = kv.read(layer, batch.read_slots, batch.read_start)  # [B, S, Hkv, hd]
        mask = batch.attn_mask  # [B, Tq, S] or None
        if self.window:
            kv.write_positions(batch.write_slots, batch.positions)
            q_pos = pad_queries(batch.positions, batch)  # [B, Tq]
            near = (q_pos[:, :, None] - kv.positions[batch.read_slots][:, None, :]) < self.window  # [B, Tq, S]
            mask = near if mask is None else mask & near
        out = sink_attention(pad_queries(q, batch), keys, values, mask, self.sinks, self.scale)  # [B, Tq, H*hd]
        return linear(unpad_queries(out, batch), self.o_proj.weight, self.o_proj.bias, pack=True)


# ---------------------------------------------------------------------------------------------- experts


class GptOssMoE(MoEBlock):
    """`MoEBlock` with gpt_oss's biased router (softmax over the top-r logits) and biased clamped-SwiGLU experts."""

    def __init__(self, cfg: ModelConfig) -> None:
        D, E, F_ = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        super().__init__(D, E, cfg.top_r, F_, norm_topk_prob=True)
        self.gate = nn.Linear(D, E, bias=True)
        self.experts.gate_up_proj_bias = nn.Parameter(torch.zeros(E, 2 * F_))
        self.experts.down_proj_bias = nn.Parameter(torch.zeros(E, D))
        self.clamp = kernels.ClampedSwiGLU(alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)

    def local_experts(self, x, w_gate_up, w_down, expert_ids, topk_weights, rows=None) -> torch.Tensor:
        """`MoEBlock.local_experts` with this block's expert biases (rows [E']: their expert ids, for weights
        that are not the block's own storage, e.g. an offload buffer) and the clamped SwiGLU."""
        ex = self.experts
        b_gu, b_dn = ex.gate_up_proj_bias, ex.down_proj_bias
        if rows is not None:
            b_gu, b_dn = b_gu[rows.to(b_gu.device)], b_dn[rows.to(b_dn.device)]
        return kernels.fused_moe(x, w_gate_up, w_down, expert_ids, topk_weights, self.backend, b_gu.to(x.dtype),
                                 b_dn.to(x.dtype), self.clamp)  # fmt: skip

    def route(self, x: torch.Tensor, router_logits: torch.Tensor | None = None, expert_budget: int | None = None):
        """x [T, D] -> router_logits [T, E], topk_weights [T, r] (x.dtype), expert_ids [T, r].

        expert_budget B (approximate, MoE-Spec 2602.16052; T > 1, r <= B < E): top-r among the B experts of
        largest softmax probability summed over the T tokens."""
        if router_logits is None:
            router_logits = self.gate(x)
        logits = router_logits.float()
        dropped = budget_dropped(torch.softmax(logits, dim=-1), expert_budget, self.top_r)
        if dropped is not None:
            logits = logits.masked_fill(dropped, float("-inf"))
        top, expert_ids = logits.topk(self.top_r, dim=-1)  # [T, r]
        return router_logits, torch.softmax(top, dim=-1).to(x.dtype), expert_ids

    def forward(
        self,
        x: torch.Tensor,
        record: RoutingRecord | None = None,
        layer: int = -1,
        timer: PhaseTimer | None = None,
        expert_budget: int | None = None,
        fused: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> (out [T, D], router_logits [T, E]). fused: ignored (no fused CPU call for biased experts)."""
        with maybe_phase(timer, "router"):
            router_logits, topk_weights, expert_ids = self.route(x, None, expert_budget)
        with maybe_phase(timer, "experts"):
            ex = self.experts
            fn = self.expert_fn or self.local_experts  # EP / offload call back into local_experts
            out = fn(x, ex.gate_up_proj, ex.down_proj, expert_ids, topk_weights)
        if record is not None:
            record.layers.append(layer)
            record.expert_ids.append(expert_ids.detach())
            record.topk_weights.append(topk_weights.detach().float())
            if record.keep_logits:
                record.router_logits.append(router_logits.detach())
        return out, router_logits


# ---------------------------------------------------------------------------------------------- checkpoints


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """MXFP4 blocks [..., G, 16] uint8 (32 e2m1 values per group, low nibble first) and scales [..., G] uint8
    (power-of-two exponent + 127) -> [..., G * 32] in `dtype` (exact: every value is a small power-of-2 multiple)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 needs uint8 blocks [..., G, 16] and scales [..., G], got {blocks.dtype} "
                         f"{tuple(blocks.shape)} and {scales.dtype} {tuple(scales.shape)}")  # fmt: skip
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)  # [..., G, 16, 2]
    values = values.flatten(-2) * torch.exp2(scales.float() - 127)[..., None]  # [..., G, 32]
    return values.flatten(-2).to(dtype)


def _deinterleave_rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    """gate/up interleaved along `dim` (g0, u0, g1, u1, ...) -> (g0, g1, ..., u0, u1, ...)."""
    n = t.shape[dim]
    return t.index_select(dim, torch.cat([torch.arange(0, n, 2), torch.arange(1, n, 2)]).to(t.device))


def _interleave_rows(t: torch.Tensor, dim: int) -> torch.Tensor:
    gate, up = t.chunk(2, dim=dim)
    return torch.stack([gate, up], dim=dim + 1).flatten(dim, dim + 1)


def hub_to_internal(raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hub gpt_oss tensors (plain or MXFP4) -> our names and layouts (see the module docstring)."""
    out: dict[str, torch.Tensor] = {}
    for key, t in raw.items():
        if key.endswith(("_scales",)) and key.replace("_scales", "_blocks") in raw:
            continue
        if key.endswith("_blocks"):
            scales = raw.get(key.replace("_blocks", "_scales"))
            if scales is None:
                raise ValueError(f"MXFP4 tensor {key} has no {key.replace('_blocks', '_scales')}")
            w = dequantize_mxfp4(t, scales)  # [E, out, in]: gate_up [E, 2F, D] interleaved rows, down [E, D, F]
            key = key.removesuffix("_blocks")
            out[key] = _deinterleave_rows(w, 1) if key.endswith("gate_up_proj") else w
            continue
        if key.endswith("mlp.experts.gate_up_proj"):  # [E, D, 2F] interleaved columns
            t = _deinterleave_rows(t, 2).transpose(1, 2).contiguous()
        elif key.endswith("mlp.experts.gate_up_proj_bias"):
            t = _deinterleave_rows(t, 1)
        elif key.endswith("mlp.experts.down_proj"):  # [E, F, D]
            t = t.transpose(1, 2).contiguous()
        out[key.replace(".mlp.router.", ".mlp.gate.")] = t
    return out


def internal_to_hub(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of `hub_to_internal` (unquantised hub layout)."""
    out = {}
    for key, t in state.items():
        if key.endswith("mlp.experts.gate_up_proj"):
            t = _interleave_rows(t.transpose(1, 2), 2)
        elif key.endswith("mlp.experts.gate_up_proj_bias"):
            t = _interleave_rows(t, 1)
        elif key.endswith("mlp.experts.down_proj"):
            t = t.transpose(1, 2)
        out[key.replace(".mlp.gate.", ".mlp.router.")] = t.contiguous()
    return out
