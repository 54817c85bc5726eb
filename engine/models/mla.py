"""Multi-head latent attention (MLA; DeepSeek-V2 2405.04434 §2.1, DeepSeek-V3 2412.19437) over the paged cache.

    q      = q_b(RMSNorm(q_a(x)))  (or q_proj(x) when q_lora_rank is None)   [.., H, dn + dr]
    c, kr  = kv_a_proj_with_mqa(x) split [r | dr];  c <- RMSNorm(c)          latent [r], shared rope key [dr]
    k_h    = [W_UK_h c ; RoPE(kr)],  v_h = W_UV_h c                          kv_b_proj = [W_UK ; W_UV] per head
    scores = (q_nope_h . k_nope_h + RoPE(q_rope_h) . RoPE(kr)) * scale

Cache layout (what `PagedKVCache.for_model` allocates for MLA, one "head" per token and layer):

    k[layer][slot] = [ c (kv_lora_rank, normalised) | RoPE(kr) (qk_rope_head_dim) ]      v: empty

DeepSeek-V3: (512 + 64) values x 2 bytes (bf16) = 1,152 bytes per token per layer, 70,272 over its 61
layers; caching the expanded per-head K/V instead would take 128 x (192 + 128) values = 81,920 bytes per
layer (71x more). The cached path absorbs W_UK into the query and W_UV into the output ("weight
absorption", the serving form):

    q_lat_h = W_UK_h^T q_nope_h                  [.., H, r]
    o_lat_h = softmax([q_lat_h ; q_rope_h] . [c ; kr] * scale) @ c      one SDPA, the latent as K and V
    out_h   = W_UV_h o_lat_h                     [.., H, dv]   -> o_proj

`forward_plain` (no cache) expands K and V per head as transformers does: the reference the absorbed
path is tested against. DeepSeek's interleaved RoPE is applied as rotate-half RoPE on de-interleaved
rope dims (`engine.models.rope.deinterleave`), q and k alike.

Shape letters: B=requests T=tokens N=packed tokens S=key slots H=heads D=hidden r=kv_lora_rank
dn=qk_nope_head_dim dr=qk_rope_head_dim dv=v_head_dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.config import ModelConfig
from engine.models.layers import RMSNorm, apply_rope, apply_rope_signed, pad_queries, unpad_queries
from engine.models.rope import deinterleave, mla_softmax_scale
from kernels.small_m import linear

_LORA_EPS = 1e-6  # transformers builds q_a_layernorm / kv_a_layernorm with the default eps, not rms_norm_eps


class MLAttention(nn.Module):
    """Parameter names follow the hub layout (`q_a_proj`, `kv_a_proj_with_mqa`, `kv_b_proj`, ...)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        H, D = cfg.num_heads, cfg.hidden_size
        dn, dr, dv, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(D, cfg.q_lora_rank, bias=cfg.qkv_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, _LORA_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * (dn + dr), bias=False)
        else:
            self.q_proj = nn.Linear(D, H * (dn + dr), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, r + dr, bias=cfg.qkv_bias)
        self.kv_a_layernorm = RMSNorm(r, _LORA_EPS)
        self.kv_b_proj = nn.Linear(r, H * (dn + dv), bias=False)
        self.o_proj = nn.Linear(H * dv, D, bias=cfg.o_bias)
        self.scale = mla_softmax_scale(cfg)

    def _project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope) -> tuple[torch.Tensor, ...]:
        """x [..., D] -> q_nope [..., H, dn], q_rope [..., H, dr], latent c [..., r], k_rope [..., dr]."""
        cfg = self.cfg
        dn, dr, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if cfg.q_lora_rank else self.q_proj(x)
        q_nope, q_rope = q.view(*x.shape[:-1], cfg.num_heads, dn + dr).split([dn, dr], dim=-1)
        c, k_rope = self.kv_a_proj_with_mqa(x).split([r, dr], dim=-1)
        if cfg.rope_interleave:
            q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
        q_rope = rope(q_rope, cos, sin)
        k_rope = rope(k_rope.unsqueeze(-2), cos, sin).squeeze(-2)
        return q_nope, q_rope, self.kv_a_layernorm(c), k_rope

    def forward_plain(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, T, D] causal self-attention without cache (K and V expanded per head)."""
        cfg = self.cfg
        B, T, _ = x.shape
        H, dn, dv = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
        q_nope, q_rope, c, k_rope = self._project(x, cos, sin, apply_rope)
        k_nope, v = self.kv_b_proj(c).view(B, T, H, dn + dv).split([dn, dv], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)  # [B, T, H, dn + dr]
        k = torch.cat([k_nope, k_rope.unsqueeze(2).expand(B, T, H, -1)], dim=-1)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=self.scale
        )  # [B, H, T, dv]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, H * dv))

    def forward_cached(self, x: torch.Tensor, cos, sin_signed, batch, kv, layer: int) -> torch.Tensor:
        """x [N, D] packed tokens -> [N, D]; writes their latents into the cache first (absorbed form)."""
        cfg = self.cfg
        N = x.shape[0]
        H, dn, dv, r = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        q_nope, q_rope, c, k_rope = self._project(x, cos, sin_signed, apply_rope_signed)
        kv.write(layer, batch.write_slots, torch.cat([c, k_rope], dim=-1).unsqueeze(1), c.new_zeros(N, 1, 0))
        latent, _ = kv.read(layer, batch.read_slots, batch.read_start)  # [B, S, 1, r + dr]
        w = self.kv_b_proj.weight.view(H, dn + dv, r)
        q_lat = torch.einsum("nhd,hdr->nhr", q_nope, w[:, :dn])  # [N, H, r]
        q = pad_queries(torch.cat([q_lat, q_rope], dim=-1), batch)  # [B, Tq, H, r + dr]
        lat = latent.transpose(1, 2)  # [B, 1, S, r + dr]
        mask = None if batch.attn_mask is None else batch.attn_mask[:, None]
        o_lat = F.scaled_dot_product_attention(
            q.transpose(1, 2), lat, lat[..., :r], attn_mask=mask, scale=self.scale, enable_gqa=True
        )  # [B, H, Tq, r]
        o_lat = unpad_queries(o_lat.transpose(1, 2), batch)  # [N, H, r]
        out = torch.einsum("nhr,hvr->nhv", o_lat, w[:, dn:])  # [N, H, dv]
        return linear(out.reshape(N, H * dv), self.o_proj.weight, self.o_proj.bias, pack=True)
