"""A whole cached CPU forward in one C++ call: `kernels/decoder_stack.h`'s `DecoderStack` over a model's layers.

    stack = CpuStack.get(model, batch, kv, expert_budget, Attention)    # None: take the per-op path
    out = stack.forward(model, batch, kv, record_routing, keep_router_logits, feature_layers)

`Model.forward_batch`'s per-op path calls ~12 native ops per layer (fused QKV, attention, o_proj, two norms, the fused
router + shared input, routing, experts) from Python, and the Python between them — module attribute lookups, the
fused and packed weights' validity checks, argument checks — costs ~100 µs per layer, a third of a decode step at
hidden 256 (README, issue 12). The stack runs the same ops (kernels/decode_ops.h: the same functions, so the same
bits; tested) for every layer in one call, with the weights resolved once: the fused QKV and router + shared input
matrices and every strip-packed copy are the per-op path's own caches (`fused_weight`, `kernels.small_m.packed`), so
the stack adds no weight memory.

It applies to CPU fp32 MoE targets whose every layer is standard attention (no qkv clip; per-head qk-norm, OLMoE's
over the whole projection and partial RoPE are fine) with a softmax-routed MoE block (Qwen2/3-MoE, Mixtral, OLMoE),
for forwards of at most 32 tokens (MAX_MOE_TOKENS: beyond, the experts take grouped GEMMs) without a phase timer, an
active expert budget, expert parallelism or offload (`expert_fn`), or the Triton backend. Otherwise — and with
EXPERTSPEC_LAYER_STACK=0 — the per-op path runs. The stack is rebuilt when any parameter's storage or in-place
version changes (`DecoderStack.valid`), or packing is switched. `DecoderStack.forward` releases the GIL.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from engine.models.moe import MoEBlock
from engine.models.routing import budget_applies
from kernels import cpu_decode, small_m


def _linear_spec(w: torch.Tensor, b: torch.Tensor | None) -> dict:
    """How `kernels.small_m.linear(x, w, b, pack=True)` reads w (decoder_stack.h's `Linear`): its packed copy when
    there is one, else the small-M sweep when it takes w (input-major) for <= 16 rows, else F.linear."""
    x = torch.empty(1, w.shape[-1])
    p = small_m.packed(w) if small_m.supports(x, w, b, small_m.MAX_PACKED_ROWS, packed=True) else None
    return {"weight": w, "packed": p, "sweep": small_m.supports(x, w, b), "bias": b}


def _packing() -> bool | None:
    return small_m._packs["on"]


def _weights_state(model, blocks: list) -> tuple:
    """What decides whether the stack takes a model's weights: their dtypes and device, each block's stored experts."""
    dtypes = frozenset(p.dtype for p in model.parameters())
    return dtypes, model.device, tuple(b.experts.gate_up_proj.shape[0] for b in blocks)


class _Refused:
    """A model whose weights the stack does not take as they are (not CPU fp32, or only this rank's experts, EP):
    asked again once their dtype, device or stored experts, or the packing switch, change."""

    def __init__(self, model, blocks: list) -> None:
        self.blocks, self.state, self.packing = blocks, _weights_state(model, blocks), _packing()

    def stale(self, model) -> bool:
        return self.packing != _packing() or _weights_state(model, self.blocks) != self.state


class CpuStack:
    """A model's `DecoderStack` and what decides whether it still applies (see the module docstring)."""

    def __init__(self, native, blocks: list, num_experts: int, top_r: int, packing: bool | None) -> None:
        self.native, self.blocks, self.packing = native, blocks, packing  # packing: small_m's switch when built
        self.num_experts, self.top_r = num_experts, top_r

    def stale(self, model) -> bool:
        """A parameter's storage or in-place version, or the packing switch, changed since the stack was built."""
        return self.packing != _packing() or not self.native.valid()

    @staticmethod
    def build(model, attention: type) -> CpuStack | _Refused | bool:
        """The stack of `model`; False when its layers are not ones the stack takes (for good), `_Refused` when its
        weights are not (for now). attention: the standard attention class (`engine.models.transformer.Attention`;
        its variants, MLA and gpt_oss's, are not taken)."""
        cfg = model.config
        module = cpu_decode.load()
        if module is None or cfg.clip_qkv is not None:
            return False
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if type(attn) is not attention or not isinstance(mlp, MoEBlock) or mlp.router != "softmax":
                return False
        blocks = [layer.mlp for layer in model.model.layers]
        if len({(b.num_experts, b.top_r) for b in blocks}) != 1:
            return False
        if (
            model.device.type != "cpu"
            or any(p.dtype != torch.float32 for p in model.parameters())
            or any(b.experts.gate_up_proj.shape[0] != b.num_experts for b in blocks)  # EP shards
        ):
            return _Refused(model, blocks)
        layers, sources = [], []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv = _linear_spec(*attn._fused_qkv())
            o = _linear_spec(attn.o_proj.weight, attn.o_proj.bias)
            fused_in = _linear_spec(mlp._fused_input(), None)
            se = mlp.shared_expert
            shared_down = se.down_proj.weight if se is not None else None
            gu, down = mlp.experts.gate_up_proj, mlp.experts.down_proj
            layers.append({
                "in_norm": layer.input_layernorm.weight, "in_eps": layer.input_layernorm.eps,
                "post_norm": layer.post_attention_layernorm.weight, "post_eps": layer.post_attention_layernorm.eps,
                "qkv": qkv, "o": o, "fused_in": fused_in,
                "q_norm": attn.q_norm.weight if cfg.qk_norm == "head" else None,
                "k_norm": attn.k_norm.weight if cfg.qk_norm == "head" else None,
                "q_norm_full": attn.q_norm.weight if cfg.qk_norm == "full" else None,
                "k_norm_full": attn.k_norm.weight if cfg.qk_norm == "full" else None,
                "qk_eps": attn.q_norm.eps if attn.q_norm is not None else 0.0,
                "gu": gu, "down": down, "gu_packed": small_m.packed(gu), "down_packed": small_m.packed(down),
                "shared_down": shared_down,
                "shared_down_packed": small_m.packed(shared_down) if shared_down is not None else None,
                "num_experts": mlp.num_experts, "top_r": mlp.top_r, "norm_topk": mlp.norm_topk_prob,
                "shared_gated": mlp.shared_expert_gate is not None,
            })  # fmt: skip
            sources += list(layer.parameters())
        head = {"norm": model.model.norm.weight, "eps": model.model.norm.eps,
                "lm_head": _linear_spec(model.lm_head.weight, None)}  # fmt: skip
        sources += [model.model.norm.weight, model.lm_head.weight]
        native = module.DecoderStack(layers, head, sources, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        return CpuStack(native, blocks, blocks[0].num_experts, blocks[0].top_r, _packing())

    @staticmethod
    def get(model, batch, kv, expert_budget: int | None, attention: type) -> CpuStack | None:
        """The model's stack when it applies to this forward (built, or rebuilt, on demand), else None."""
        n = batch.input_ids.shape[0]
        if (
            kv.k.device.type != "cpu"
            or os.environ.get("EXPERTSPEC_LAYER_STACK", "1") == "0"
            or torch.is_grad_enabled()
            or n > cpu_decode.MAX_MOE_TOKENS
        ):
            return None
        cached = model.__dict__.get("_cpu_stack")
        if cached is False:  # the model's layers are not ones the stack takes
            return None
        blocks = cached.blocks if isinstance(cached, CpuStack) else [layer.mlp for layer in model.model.layers]
        if any(getattr(b, "expert_fn", None) is not None or getattr(b, "backend", None) == "triton" for b in blocks):
            return None  # EP / offload compute the experts, or Triton does
        if cached is None or cached.stale(model):
            cached = model.__dict__["_cpu_stack"] = CpuStack.build(model, attention)
        if (
            not isinstance(cached, CpuStack)
            or kv.k.dtype != torch.float32
            or budget_applies(n, cached.num_experts, expert_budget, cached.top_r)
        ):
            return None
        return cached

    def forward(self, model, batch, kv, record_routing: bool, keep_router_logits: bool,
                feature_layers: tuple[int, ...] | None):  # fmt: skip
        """-> (logits [N, V], hidden [N, D], h [N, D] before the final norm, features or None, routing lists (ids,
        weights, router logits) or None)."""
        h = F.embedding(batch.input_ids, model.model.embed_tokens.weight)  # [N, D]
        cos, sin = model._rope_table(h.dtype)
        capture = sorted(set(feature_layers)) if feature_layers else []
        mask = None if batch.attn_mask is None else batch.attn_mask.contiguous()
        logits, hidden, h, captured, ids, weights, router_logits = self.native.forward(
            h, batch.positions.contiguous(), cos, sin, kv.k, kv.v, batch.write_slots.contiguous(),
            batch.pad_index.contiguous(), batch.read_slots.contiguous(), mask, capture, record_routing,
            keep_router_logits,
        )  # fmt: skip
        features = None
        if feature_layers:
            by_layer = dict(zip(capture, captured))
            features = torch.cat([by_layer[i] for i in feature_layers], dim=-1)
        routing = (ids, weights, router_logits) if record_routing else None
        return logits, hidden, h, features, routing
