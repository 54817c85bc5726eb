"""Lean decoder-only transformer for the supported HF families (MoE targets and dense drafters).

One implementation with feature switches from `ModelConfig`: RoPE, GQA, qkv bias, qk-norm (per head
for qwen3*, over the whole projection for olmoe), tied embeddings, dense or MoE MLP per layer
(`decoder_sparse_step` / `mlp_only_layers`), shared expert with sigmoid gate (qwen2_moe). DeepSeek-V3-style
families add multi-head latent attention (`engine.models.mla`), the sigmoid group-limited router
(`engine.models.routing`), ungated shared experts, dense first layers, and partial / YaRN RoPE
(`engine.models.rope`).

Module names mirror transformers 5 (`model.layers.{i}.self_attn.q_proj`, `mlp.experts.gate_up_proj`,
...) so checkpoints map with a handful of renames (see `engine/checkpoint.py`).

Two entry points:
- `Model.logits(input_ids [B, T])`: plain causal forward, no cache (parity tests, training).
- `Model.forward_batch(batch, kv)`: packed tokens of several requests over the paged KV cache with an
  arbitrary attention mask (prefill, decode, draft-tree verification all use it).

Shape letters: B=requests Tq=padded query length N=packed tokens S=key slots per request
D=hidden H=heads Hkv=kv heads hd=head dim V=vocab E=experts r=top-r.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.config import ModelConfig
from engine.models.cpu_stack import CpuStack
from engine.models.gpt_oss import GptOssAttention, GptOssMoE
from engine.models.layers import RMSNorm, add_norm, apply_rope, apply_rope_signed, sign_sin, unpad_index
from engine.models.mla import MLAttention
from engine.models.moe import DenseMLP, MoEBlock, RoutingRecord, fused_weight, load_balancing_loss
from engine.models.rope import rope_table
from engine.timing import PhaseTimer, maybe_phase
from kernels import cpu_decode
from kernels.small_m import linear


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """positions [...] -> cos, sin [..., hd] (HF rotate-half layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim))
    freqs = positions.float()[..., None] * inv_freq  # [..., hd/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@dataclass
class ForwardBatch:
    """Packed tokens of B requests for one cached forward.

    input_ids [N], positions [N]: the new tokens of all requests, request-major.
    pad_index [B, Tq]: packed index of each (request, query) cell; N marks padding.
    write_slots [N]: KV-cache slot receiving each new token's key/value.
    read_slots [B, S]: slots each request's queries attend over (includes its new tokens' slots).
    attn_mask [B, Tq, S] bool or None (None = every query sees every key: single-token decode).
    read_start: for B = 1 whose read slots are one ascending run, its first slot (attention then reads the
    cache storage in place, `PagedKVCache.read`); None otherwise.
    unpad_order [N] or None: flat [B*Tq] cell of each packed token (None: derived from pad_index, a host sync;
    CUDA-graph buckets precompute it, engine.models.cuda_graphs).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    pad_index: torch.Tensor
    write_slots: torch.Tensor
    read_slots: torch.Tensor
    attn_mask: torch.Tensor | None
    read_start: int | None = None
    unpad_order: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [N, V]
    hidden: torch.Tensor  # [N, D] final hidden state before the LM head (after the last norm)
    routing: RoutingRecord | None
    pre_norm_hidden: torch.Tensor | None = None  # [N, D] last layer output before the final norm
    # [N, k*D] residual streams entering the `feature_layers` of forward_batch (EAGLE-3's auxiliary features)
    features: torch.Tensor | None = None


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        H, Hkv, hd, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
        self.q_proj = nn.Linear(D, H * hd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(D, Hkv * hd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(D, Hkv * hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(H * hd, D, bias=cfg.o_bias)
        if cfg.qk_norm == "head":
            self.q_norm, self.k_norm = RMSNorm(hd, cfg.rms_norm_eps), RMSNorm(hd, cfg.rms_norm_eps)
        elif cfg.qk_norm == "full":
            self.q_norm, self.k_norm = RMSNorm(H * hd, cfg.rms_norm_eps), RMSNorm(Hkv * hd, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def _fused_qkv(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Concatenated q/k/v weights (and biases) for one matmul at inference."""
        w = fused_weight(self, "_qkv_w", [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight])
        b = None
        if self.q_proj.bias is not None:
            b = fused_weight(self, "_qkv_b", [self.q_proj.bias, self.k_proj.bias, self.v_proj.bias])
        return w, b

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [..., D] -> q [..., H, hd], k, v [..., Hkv, hd] with qk-norm and RoPE applied."""
        cfg = self.cfg
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if cfg.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if cfg.clip_qkv is not None:
            q, k, v = (t.clamp(-cfg.clip_qkv, cfg.clip_qkv) for t in (q, k, v))
        q = q.view(*x.shape[:-1], cfg.num_heads, cfg.head_dim)
        k = k.view(*x.shape[:-1], cfg.num_kv_heads, cfg.head_dim)
        v = v.view(*x.shape[:-1], cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def qkv_inference(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor):
        """Same as `qkv` for packed tokens x [N, D] with one fused projection and one RoPE call for q and k."""
        cfg = self.cfg
        H, Hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        w, b = self._fused_qkv()
        proj = linear(x, w, b, pack=True)  # [N, (H + 2Hkv) hd]
        if cfg.qk_norm == "none" and cfg.clip_qkv is None:
            heads = proj.view(x.shape[0], H + 2 * Hkv, hd)
            qk = apply_rope_signed(heads[:, : H + Hkv], cos, sin_signed)
            return qk[:, :H], qk[:, H:], heads[:, H + Hkv :]
        q, k, v = proj.split([H * hd, Hkv * hd, Hkv * hd], dim=-1)
        if cfg.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if cfg.clip_qkv is not None:
            q, k, v = (t.clamp(-cfg.clip_qkv, cfg.clip_qkv) for t in (q, k, v))
        q, k, v = q.reshape(-1, H, hd), k.reshape(-1, Hkv, hd), v.reshape(-1, Hkv, hd)
        if cfg.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope_signed(q, cos, sin_signed), apply_rope_signed(k, cos, sin_signed), v

    def _sdpa(self, q, k, v, mask, causal=False):
        """q [B, Tq, H, hd], k/v [B, S, Hkv, hd], mask [B, Tq, S] -> [B, Tq, H*hd]."""
        gqa = self.cfg.num_heads != self.cfg.num_kv_heads
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=None if mask is None else mask[:, None],
            is_causal=causal,
            enable_gqa=gqa,
        )
        return out.transpose(1, 2).reshape(q.shape[0], q.shape[1], -1)

    def forward_plain(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        """x [B, T, D] causal self-attention without cache."""
        q, k, v = self.qkv(x, cos, sin)
        return self.o_proj(self._sdpa(q, k, v, None, causal=True))

    def _fused_cpu(self, x: torch.Tensor, kv) -> bool:
        """Whether the packed tokens take the fused C++ attention (kernels.cpu_decode): CPU fp32, an fp32 cache, no
        qkv clip (a qk-norm over the whole projection, OLMoE's, runs as F.rms_norm on the projection first)."""
        cfg = self.cfg
        return cfg.clip_qkv is None and kv.k.dtype == torch.float32 and cpu_decode.applies(x)

    def forward_cached(self, x: torch.Tensor, cos, sin, batch: ForwardBatch, kv, layer: int) -> torch.Tensor:
        """x [N, D] packed tokens -> [N, D], writing their K/V into the cache first."""
        if self._fused_cpu(x, kv):  # qk-norm, RoPE, K/V write and attention in one call
            w, b = self._fused_qkv()
            proj = linear(x, w, b, pack=True)  # [N, (H + 2Hkv) hd]
            qn = kn = None
            if self.cfg.qk_norm == "full":  # over the whole q and k projections, before the call
                q, k = self.cfg.num_heads * self.cfg.head_dim, self.cfg.num_kv_heads * self.cfg.head_dim
                proj[:, :q] = self.q_norm(proj[:, :q])
                proj[:, q : q + k] = self.k_norm(proj[:, q : q + k])
            elif self.q_norm is not None:
                qn, kn = self.q_norm.weight, self.k_norm.weight
            eps = self.q_norm.eps if self.q_norm is not None else 0.0
            mask = None if batch.attn_mask is None else batch.attn_mask.contiguous()
            out = cpu_decode.attention(proj, cos, sin, qn, kn, eps, kv.k[layer], kv.v[layer],
                                       batch.write_slots, batch.pad_index.contiguous(), batch.read_slots.contiguous(),
                                       mask, self.cfg.num_heads, self.cfg.num_kv_heads)  # fmt: skip
            return linear(out, self.o_proj.weight, self.o_proj.bias, pack=True)
        q, k, v = self.qkv_inference(x, cos, sin)  # [N, H, hd], [N, Hkv, hd]
        kv.write(layer, batch.write_slots, k, v)
        keys, values = kv.read(layer, batch.read_slots, batch.read_start)  # [B, S, Hkv, hd]
        B, Tq = batch.pad_index.shape
        if B == 1 and Tq == q.shape[0]:
            q_pad = q.unsqueeze(0)
        else:
            q_pad = torch.cat([q, q.new_zeros(1, *q.shape[1:])])[batch.pad_index]  # [B, Tq, H, hd]
        out = self._sdpa(q_pad, keys, values, batch.attn_mask)  # [B, Tq, H*hd]
        if not (B == 1 and Tq == q.shape[0]):
            out = out.reshape(B * Tq, -1)[unpad_index(batch)]
        else:
            out = out[0]
        return linear(out, self.o_proj.weight, self.o_proj.bias, pack=True)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.self_attn = MLAttention(cfg) if cfg.attention == "mla" else Attention(cfg)
        if cfg.model_type == "gpt_oss":  # sinks, sliding windows, biased router and clamped-SwiGLU experts
            self.self_attn, self.mlp = GptOssAttention(cfg, layer), GptOssMoE(cfg)
        elif cfg.is_moe_layer(layer):
            self.mlp: nn.Module = MoEBlock(
                cfg.hidden_size,
                cfg.num_experts,
                cfg.top_r,
                cfg.moe_intermediate_size,
                cfg.norm_topk_prob,
                cfg.shared_expert_intermediate_size,
                router=cfg.router,
                n_group=cfg.n_group,
                topk_group=cfg.topk_group,
                routed_scaling_factor=cfg.routed_scaling_factor,
                shared_gated=cfg.shared_expert_gated,
            )
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def mlp_forward(self, h: torch.Tensor, record, router_logits: list | None, timer, expert_budget=None,
                    fused: bool = False):  # fmt: skip
        """h [N, D] -> [N, D]. fused: the MoE block may take the fused CPU call (the cached forward)."""
        if isinstance(self.mlp, MoEBlock):
            out, logits = self.mlp.forward(h, record=record, layer=self.layer, timer=timer, expert_budget=expert_budget,
                                           fused=fused)  # fmt: skip
            if router_logits is not None:
                router_logits.append(logits)
            return out
        with maybe_phase(timer, "mlp"):
            return self.mlp.forward(h)


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Model(nn.Module):
    """A causal LM (`engine.load_model` returns one). See the module docstring for the entry points."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.tokenizer = None  # a `tokenizers.Tokenizer` when the checkpoint folder has tokenizer.json
        self.path: str | None = None

    # ------------------------------------------------------------------ properties
    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def moe_blocks(self) -> list[MoEBlock]:
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, MoEBlock)]

    def set_backend(self, backend: str) -> None:
        """Expert GEMM backend for every MoE block: "auto" (Triton on CUDA), "torch" or "triton"."""
        if backend not in ("auto", "torch", "triton"):
            raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
        for block in self.moe_blocks:
            block.backend = backend

    # ------------------------------------------------------------------ plain forward
    def forward(self, input_ids: torch.Tensor, return_aux: bool = False):
        """input_ids [B, T] -> logits [B, T, V] (and the load-balancing loss if return_aux)."""
        cfg = self.config
        B, T = input_ids.shape
        h = self.model.embed_tokens(input_ids)
        pos = torch.arange(T, device=input_ids.device)
        cos, sin = rope_table(cfg, pos, h.dtype)
        router_logits: list[torch.Tensor] | None = [] if return_aux else None
        for layer in self.model.layers:
            h = h + layer.self_attn.forward_plain(layer.input_layernorm(h), cos, sin)
            x = layer.post_attention_layernorm(h).reshape(B * T, -1)
            h = h + layer.mlp_forward(x, None, router_logits, None).view(B, T, -1)
        logits = self.lm_head(self.model.norm(h))
        if not return_aux:
            return logits
        aux = load_balancing_loss(router_logits, cfg.num_experts, cfg.top_r) if router_logits else logits.new_zeros(())
        return logits, aux

    @torch.inference_mode()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Plain causal forward without cache: LongTensor [B, T] -> FloatTensor [B, T, V]."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.vocab_size}), got {int(input_ids.max())}")
        return self.forward(input_ids.to(self.device)).float()

    def _rope_table(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sign-folded sin [max_position_embeddings, rd] (see apply_rope_signed), once per dtype."""
        table = self.__dict__.get("_rope")
        if table is None or table[0].dtype != dtype or table[0].device != self.device:
            cfg = self.config
            pos = torch.arange(cfg.max_position_embeddings, device=self.device)
            cos, sin = rope_table(cfg, pos, dtype)
            table = self.__dict__["_rope"] = (cos, sign_sin(sin))
        return table

    # ------------------------------------------------------------------ cached forward
    def forward_batch(
        self,
        batch: ForwardBatch,
        kv,
        record_routing: bool = False,
        timer: PhaseTimer | None = None,
        keep_router_logits: bool = False,
        expert_budget: int | None = None,
        feature_layers: tuple[int, ...] | None = None,
    ) -> ForwardOutput:
        """Packed forward over the paged KV cache (see `ForwardBatch`). Returns logits for every token.

        expert_budget: MoE-Spec's approximate cap on distinct experts per layer (`MoEBlock.route`).
        feature_layers: fill `features` with the hidden states entering these layers, concatenated in this
        order (layer i's input = layer i-1's output, transformers' `hidden_states[i]`; i = num_layers is the
        last layer's output before the final norm), as SGLang / vLLM capture EAGLE-3's auxiliary states."""
        record = RoutingRecord(keep_logits=keep_router_logits) if record_routing else None
        stack = CpuStack.get(self, batch, kv, expert_budget, Attention) if timer is None else None
        if stack is not None:  # every layer in one C++ call (engine.models.cpu_stack): the same ops and bits
            logits, hidden, h, features, routing = stack.forward(self, batch, kv, record_routing, keep_router_logits,
                                                                 feature_layers)  # fmt: skip
            if record is not None:
                ids, weights, router_logits = routing
                record.layers.extend(layer.layer for layer in self.model.layers)
                record.expert_ids.extend(ids)
                record.topk_weights.extend(weights)
                record.router_logits.extend(router_logits)
            return ForwardOutput(logits=logits, hidden=hidden, routing=record, pre_norm_hidden=h, features=features)
        captured: dict[int, torch.Tensor] = {}
        with maybe_phase(timer, "embed"):
            h = self.model.embed_tokens(batch.input_ids)  # [N, D]
            cos_table, sin_table = self._rope_table(h.dtype)
            cos, sin = cos_table[batch.positions], sin_table[batch.positions]
        delta = None  # the last layer's MLP output, added to h by the next norm (add_norm: one call on CPU)
        for i, layer in enumerate(self.model.layers):  # .forward(): skip nn.Module hook dispatch
            with maybe_phase(timer, "attention"):
                h, x = add_norm(layer.input_layernorm, h, delta)
                if feature_layers and i in feature_layers:
                    captured[i] = h
                h, x = add_norm(layer.post_attention_layernorm, h, layer.self_attn.forward_cached(x, cos, sin, batch,
                                                                                                  kv, i))  # fmt: skip
            delta = layer.mlp_forward(x, record, None, timer, expert_budget, fused=True)
        with maybe_phase(timer, "lm_head"):
            h, hidden = add_norm(self.model.norm, h, delta)
            logits = linear(hidden, self.lm_head.weight, pack=True)
        captured[len(self.model.layers)] = h
        features = torch.cat([captured[i] for i in feature_layers], dim=-1) if feature_layers else None
        return ForwardOutput(logits=logits, hidden=hidden, routing=record, pre_norm_hidden=h, features=features)
