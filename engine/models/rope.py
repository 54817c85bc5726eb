"""Rotary position embeddings: the default RoPE, linear scaling, Llama-3's and YaRN (2309.00071), over all
or part of each head.

    inv_freq [rd/2]  default: theta^(-2i/rd)
                     linear:  theta^(-2i/rd) / factor
                     llama3:  wavelengths longer than original/low_freq_factor divided by factor, shorter than
                              original/high_freq_factor kept, a smooth blend in between
                     yarn:    blend of theta^(-2i/rd) (extrapolation, fast dims) and the same divided by
                              `factor` (interpolation, slow dims) with a linear ramp between the dims that
                              turn beta_fast and beta_slow times over the original context
    cos, sin [.., rd] = cat(freqs, freqs).cos() * attention_factor   (HF rotate-half layout)

`attention_factor` multiplies cos and sin, so it scales q and k (their rotated parts) and the logits by
its square; YaRN's default is 0.1 ln(factor) + 1 (or mscale(factor, mscale) / mscale(factor,
mscale_all_dim) when both are set, DeepSeek's form). MLA further multiplies its softmax scale by
mscale(factor, mscale_all_dim)^2 (`mla_softmax_scale`). rd = `ModelConfig.rotary_dim` may be smaller
than the head (glm4_moe's partial_rotary_factor, MLA's decoupled qk_rope_head_dim): only the first rd
dims of a head rotate (`engine.models.transformer.apply_rope`).

Numbers follow transformers 5 `modeling_rope_utils` (the parity oracle). Shape letters: rd=rotary dims.
"""

from __future__ import annotations

import math

import torch

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
ROPE_KEYS = {  # the parameters each type reads (from rope_parameters / rope_scaling)
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "truncate"),
}  # fmt: skip


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(rd: int, theta: float, params: dict, max_positions: int, device) -> tuple[torch.Tensor, float]:
    factor = params.get("factor")
    original = params.get("original_max_position_embeddings") or max_positions
    if factor is None:
        factor = max_positions / original
    factor = float(factor)
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dim that turns `rotations` times over `original`
        return rd * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rd - 1)
    if low == high:
        high += 0.001  # the ramp needs a non-empty interval
    pos_freqs = theta ** (torch.arange(0, rd, 2, device=device).float() / rd)
    ramp = ((torch.arange(rd // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1 on the fast dims (kept), 0 on the slow ones (interpolated)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    factor, low, high = float(params["factor"]), float(params["low_freq_factor"]), float(params["high_freq_factor"])
    original = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(medium, smoothed, scaled)


def rope_inv_freq(cfg, device=None) -> tuple[torch.Tensor, float]:
    """`ModelConfig` -> (inv_freq [rd/2] float32, attention_factor)."""
    rd, theta = cfg.rotary_dim or cfg.head_dim, cfg.rope_theta
    params = dict(cfg.rope_scaling)
    if cfg.rope_type == "yarn":
        return _yarn_inv_freq(rd, theta, params, cfg.max_position_embeddings, device)
    inv_freq = 1.0 / (theta ** (torch.arange(0, rd, 2, device=device).float() / rd))
    if cfg.rope_type == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if cfg.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params), 1.0
    return inv_freq, 1.0


def rope_table(cfg, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [...] -> cos, sin [..., rd] (rotate-half layout, attention factor folded in)."""
    inv_freq, factor = rope_inv_freq(cfg, positions.device)
    freqs = positions.float()[..., None] * inv_freq  # [..., rd/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    if factor == 1.0:
        return emb.cos().to(dtype), emb.sin().to(dtype)
    return (emb.cos() * factor).to(dtype), (emb.sin() * factor).to(dtype)


def mla_softmax_scale(cfg) -> float:
    """MLA's softmax scale: qk_head_dim^-1/2, times mscale(factor, mscale_all_dim)^2 under YaRN."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    params = dict(cfg.rope_scaling)
    if cfg.rope_type != "default" and params.get("mscale_all_dim"):
        m = yarn_mscale(float(params["factor"]), params["mscale_all_dim"])
        scale = scale * m * m
    return scale


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., rd] pairs (x0, x1), (x2, x3), ... -> (x0, x2, ..., x1, x3, ...): DeepSeek's interleaved RoPE
    equals rotate-half RoPE on the de-interleaved dims (q and k permuted alike: their dot product is
    unchanged)."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
