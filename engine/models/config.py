"""Normalised model configuration parsed from a Hugging Face `config.json`.

Every supported family (MoE targets `qwen2_moe`, `qwen3_moe`, `mixtral`, `olmoe`, `deepseek_v3`,
`glm4_moe`, `gpt_oss`; dense drafters `llama`, `qwen2`, `qwen3`) maps onto one flat `ModelConfig`, so the model code
has one path with a few feature switches (qkv bias, qk-norm per head or over the whole projection, shared
expert, multi-head latent attention, sigmoid group-limited router, partial / YaRN RoPE, ...).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.models.rope import ROPE_KEYS, ROPE_TYPES

MOE_TYPES = ("qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "deepseek_v3", "glm4_moe", "gpt_oss")
SIGMOID_ROUTED = ("deepseek_v3", "glm4_moe")  # DeepSeek-V3-style router, shared experts, dense first layers
DENSE_TYPES = ("llama", "qwen2", "qwen3")
SUPPORTED_MODEL_TYPES = MOE_TYPES[:4] + DENSE_TYPES + MOE_TYPES[4:]  # the DeepSeek-V3-era families listed last


class ModelConfigError(ValueError):
    """A config.json that expertspec cannot serve."""


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP width (dense layers and dense models)
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: str = "none"  # "none" | "head" (qwen3: RMSNorm over head_dim) | "full" (olmoe: over H*hd)
    clip_qkv: float | None = None
    # MoE
    num_experts: int = 0
    top_r: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    moe_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.0
    # RoPE: rotary_dim 0 = the whole head; rope_scaling holds the YaRN parameters as sorted (key, value) pairs
    rope_type: str = "default"  # "default" | "yarn"
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    rotary_dim: int = 0
    rope_interleave: bool = False  # deepseek_v3: rotary dims in (x0, x1) pairs
    # multi-head latent attention (deepseek_v3, 2405.04434): attention == "mla"
    attention: str = "gqa"  # "gqa" | "mla"
    q_lora_rank: int = 0  # 0 = a full-rank q_proj
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # router: "softmax" (top-r of softmax) | "sigmoid" (DeepSeek-V3: sigmoid scores + correction bias for the
    # choice, group-limited top-k, weights scaled by routed_scaling_factor)
    router: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_expert_gated: bool = True  # qwen2_moe's sigmoid gate; deepseek_v3 / glm4_moe add theirs ungated
    num_nextn_predict_layers: int = 0  # MTP modules stored after the decoder layers (deepseek_v3, glm4_moe)
    # gpt_oss: per-layer "sliding_attention" / "full_attention" (window in tokens), sinks, clamped SwiGLU
    sliding_window: int = 0
    layer_types: tuple[str, ...] = ()
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0 and len(self.moe_layers) > 0

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers

    @property
    def kv_cache_layout(self) -> tuple[int, int, int]:
        """(heads, key dim, value dim) of one cached token per layer. MLA caches its compressed latent:
        one "head" of kv_lora_rank + qk_rope_head_dim (normalised c_kv, then the roped shared key) and no
        separate value (the value is the latent itself, `engine.models.mla`)."""
        if self.attention == "mla":
            return 1, self.kv_lora_rank + self.qk_rope_head_dim, 0
        return self.num_kv_heads, self.head_dim, self.head_dim


def _get(cfg: dict, key: str, default: Any = ..., model_type: str = "?") -> Any:
    if key in cfg and cfg[key] is not None:
        return cfg[key]
    if default is ...:
        raise ModelConfigError(f"config.json of a {model_type!r} model lacks the required field {key!r}")
    return default


_DEFAULT_ROPE_THETA = {"mixtral": 1e6, "gpt_oss": 150000.0}  # transformers' family defaults when config.json is silent


_FAMILY_DEFAULTS = {  # transformers' defaults of the fields a hand-written config.json may leave out
    "deepseek_v3": dict(n_shared_experts=1, routed_scaling_factor=2.5, n_group=8, topk_group=4, norm_topk_prob=True,
                        first_k_dense_replace=3, rope_interleave=True, num_nextn_predict_layers=1),
    "glm4_moe": dict(n_shared_experts=1, routed_scaling_factor=1.0, n_group=1, topk_group=1, norm_topk_prob=True,
                     first_k_dense_replace=1, partial_rotary_factor=0.5, num_nextn_predict_layers=1, rms_norm_eps=1e-5,
                     max_position_embeddings=131072),
    "gpt_oss": dict(rms_norm_eps=1e-5, max_position_embeddings=131072, sliding_window=128, swiglu_alpha=1.702,
                    swiglu_limit=7.0, num_experts_per_tok=4,
                    rope_parameters=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                                         original_max_position_embeddings=4096)),
}  # fmt: skip


def _rope_theta(cfg: dict) -> float:
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0)) if params else cfg.get("rope_theta")
    return float(theta if theta is not None else _DEFAULT_ROPE_THETA.get(cfg.get("model_type"), 10000.0))


def _rope(cfg: dict, head_dim: int) -> dict:
    """RoPE fields of `ModelConfig`: theta, type ("default" | "yarn"), YaRN parameters, rotary dims."""
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters")  # transformers: rope_scaling wins
    params = params or _FAMILY_DEFAULTS.get(cfg.get("model_type"), {}).get("rope_parameters") or {}
    rope_type = params.get("rope_type", params.get("type", "default")) if params else "default"
    if rope_type not in ROPE_TYPES:
        raise ModelConfigError(
            f"rope type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)}); rope parameters: {params}"
        )
    out: dict[str, Any] = dict(rope_theta=_rope_theta(cfg), rope_type=rope_type)
    if rope_type != "default":
        scaling = {k: params[k] for k in ROPE_KEYS[rope_type] if params.get(k) is not None}
        if "original_max_position_embeddings" in ROPE_KEYS[rope_type]:  # transformers: the top-level field wins
            original = cfg.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
            scaling["original_max_position_embeddings"] = int(original or cfg.get("max_position_embeddings") or 4096)
        need = {"linear": ("factor",), "llama3": ROPE_KEYS["llama3"]}.get(rope_type, ())
        if any(k not in scaling for k in need) or float(scaling.get("factor", 1.0)) <= 0:
            raise ModelConfigError(f"{rope_type} rope needs a positive factor and {need}; rope parameters: {params}")
        out["rope_scaling"] = tuple(sorted(scaling.items()))
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if partial is None:
        partial = _FAMILY_DEFAULTS.get(cfg.get("model_type"), {}).get("partial_rotary_factor", 1.0)
    rotary = int(head_dim * float(partial))
    if not 0 < rotary <= head_dim or rotary % 2:
        raise ModelConfigError(
            f"rotary dims {rotary} (head_dim {head_dim} x partial_rotary_factor {partial}; qk_rope_head_dim for MLA) "
            f"must be even and in 2..{head_dim}"
        )
    out["rotary_dim"] = rotary
    return out


def _mla(cfg: dict, g, heads: int) -> dict:
    """Multi-head latent attention fields (deepseek_v3)."""
    nope, rope, v = int(g("qk_nope_head_dim")), int(g("qk_rope_head_dim")), int(g("v_head_dim"))
    kv_lora, q_lora = int(g("kv_lora_rank")), int(cfg.get("q_lora_rank") or 0)
    if min(nope, rope, v, kv_lora) <= 0 or rope % 2 or q_lora < 0:
        raise ModelConfigError(
            f"MLA needs positive qk_nope_head_dim, v_head_dim, kv_lora_rank and an even qk_rope_head_dim, got "
            f"{nope}, {v}, {kv_lora}, {rope} (q_lora_rank {q_lora})"
        )
    bias = bool(cfg.get("attention_bias", False))
    return dict(attention="mla", q_lora_rank=q_lora, kv_lora_rank=kv_lora, qk_nope_head_dim=nope,
                qk_rope_head_dim=rope, v_head_dim=v, head_dim=nope + rope, num_kv_heads=heads, rotary_dim=rope,
                rope_interleave=bool(g("rope_interleave")), qkv_bias=bias, o_bias=bias)  # fmt: skip


def _gpt_oss(cfg: dict, g, layers: int) -> dict:
    """gpt_oss fields: biases everywhere, layer types and the window, the clamped SwiGLU constants."""
    kinds = ("sliding_attention", "full_attention")
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    if len(types) != layers or any(t not in kinds for t in types):
        raise ModelConfigError(f"layer_types must list {layers} of {kinds}, got {types}")
    window = int(cfg.get("sliding_window") or 0) if "sliding_window" in cfg else int(g("sliding_window"))
    if "sliding_attention" in types and window <= 0:
        raise ModelConfigError(
            f"sliding_attention layers need a positive sliding_window, got {cfg.get('sliding_window')}"
        )
    bias = bool(cfg.get("attention_bias", True))
    return dict(layer_types=tuple(types), sliding_window=window, qkv_bias=bias, o_bias=bias,
                swiglu_alpha=float(g("swiglu_alpha")), swiglu_limit=float(g("swiglu_limit")))  # fmt: skip


def _sigmoid_router(cfg: dict, g, experts: int, top_r: int) -> dict:
    """DeepSeek-V3 router fields: groups, scaling, ungated shared experts."""
    for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if cfg.get(key) not in (None, want):
            raise ModelConfigError(f"{key}={cfg[key]!r} is not supported for {cfg['model_type']} (only {want!r})")
    n_group, topk_group = int(g("n_group")), int(g("topk_group"))
    if n_group < 1 or experts % n_group or experts // n_group < 2 or not 1 <= topk_group <= n_group:
        raise ModelConfigError(
            f"group-limited routing needs n_group dividing n_routed_experts={experts} into groups of >= 2 experts and "
            f"1 <= topk_group <= n_group, got n_group={n_group}, topk_group={topk_group}"
        )
    if top_r > topk_group * (experts // n_group):
        raise ModelConfigError(f"num_experts_per_tok={top_r} exceeds the {topk_group} groups' experts")
    return dict(router="sigmoid", n_group=n_group, topk_group=topk_group,
                routed_scaling_factor=float(g("routed_scaling_factor")),
                shared_expert_intermediate_size=int(g("n_shared_experts")) * int(g("moe_intermediate_size")),
                shared_expert_gated=False)  # fmt: skip


def _eos(cfg: dict) -> int | None:
    eos = cfg.get("eos_token_id")
    if isinstance(eos, list):
        return int(eos[0]) if eos else None
    return None if eos is None else int(eos)


def parse_config(cfg: dict) -> ModelConfig:
    """Map an HF config dict onto `ModelConfig`; raise `ModelConfigError` on anything unsupported."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelConfigError(f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    defaults = _FAMILY_DEFAULTS.get(model_type, {})
    g = lambda k, d=...: _get(cfg, k, defaults.get(k, d), model_type)  # noqa: E731
    hidden = int(g("hidden_size"))
    heads = int(g("num_attention_heads"))
    kv_heads = int(g("num_key_value_heads", heads))
    head_dim = int(g("head_dim", hidden // heads))
    layers = int(g("num_hidden_layers"))
    if model_type == "deepseek_v3":  # MLA: head_dim in config.json is the rope dim; K/V heads are the latent's
        head_dim, kv_heads = int(g("qk_nope_head_dim")) + int(g("qk_rope_head_dim")), heads
    if heads % kv_heads:
        raise ModelConfigError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    if cfg.get("use_sliding_window"):
        raise ModelConfigError("sliding-window attention (use_sliding_window=true) is not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(f"hidden_act {cfg.get('hidden_act')!r} is not supported (only silu)")
    common = dict(
        model_type=model_type,
        vocab_size=int(g("vocab_size")),
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=int(g("intermediate_size", 0)),
        rms_norm_eps=float(g("rms_norm_eps", 1e-6)),
        **_rope(cfg, int(g("qk_rope_head_dim")) if model_type == "deepseek_v3" else head_dim),
        max_position_embeddings=int(g("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=_eos(cfg),
        raw=dict(cfg),
    )
    if model_type in ("qwen2", "qwen2_moe"):
        common["qkv_bias"] = bool(cfg.get("qkv_bias", True))
    elif model_type in ("llama", "qwen3", "qwen3_moe", "olmoe", "mixtral"):
        common["qkv_bias"] = bool(cfg.get("attention_bias", False))
        common["o_bias"] = model_type in ("llama", "qwen3", "qwen3_moe", "olmoe") and bool(
            cfg.get("attention_bias", False)
        )
    if model_type == "llama":
        common["mlp_bias"] = bool(cfg.get("mlp_bias", False))
    if model_type in ("qwen3", "qwen3_moe"):
        common["qk_norm"] = "head"
    if model_type == "olmoe":
        common["qk_norm"] = "full"
        common["clip_qkv"] = cfg.get("clip_qkv")
    if model_type == "deepseek_v3":
        common.update(_mla(cfg, g, heads))
    if model_type == "glm4_moe":  # q/k/v bias, no o bias; optional per-head qk-norm before the partial RoPE
        common["qkv_bias"] = bool(cfg.get("attention_bias", False))
        common["qk_norm"] = "head" if cfg.get("use_qk_norm") else "none"
    if model_type in SIGMOID_ROUTED:
        common["num_nextn_predict_layers"] = int(g("num_nextn_predict_layers"))
    if model_type == "gpt_oss":
        common.update(_gpt_oss(cfg, g, layers))
    if model_type in MOE_TYPES:
        if model_type in ("mixtral", "gpt_oss"):
            experts, top_r = int(g("num_local_experts")), int(g("num_experts_per_tok"))
            moe_dim = int(g("intermediate_size"))
            norm_topk = True  # Mixtral always renormalises its top-r weights
            moe_layers = tuple(range(layers))
        elif model_type in SIGMOID_ROUTED:  # the first first_k_dense_replace layers are dense
            experts, top_r = int(g("n_routed_experts")), int(g("num_experts_per_tok"))
            moe_dim, norm_topk = int(g("moe_intermediate_size")), bool(g("norm_topk_prob"))
            moe_layers = tuple(range(min(int(g("first_k_dense_replace")), layers), layers))
        else:
            experts = int(cfg.get("num_experts") or g("num_local_experts"))
            top_r = int(g("num_experts_per_tok"))
            # OLMoE sizes its experts with intermediate_size (it has no dense layers)
            moe_dim = int(g("intermediate_size") if model_type == "olmoe" else g("moe_intermediate_size"))
            norm_topk = bool(cfg.get("norm_topk_prob", False))
            step = int(cfg.get("decoder_sparse_step", 1) or 1)
            mlp_only = set(cfg.get("mlp_only_layers", []) or [])
            moe_layers = tuple(i for i in range(layers) if i not in mlp_only and experts > 0 and (i + 1) % step == 0)
        if not 1 <= top_r <= experts:
            raise ModelConfigError(f"num_experts_per_tok={top_r} must lie in 1..{experts}")
        common.update(
            num_experts=experts,
            top_r=top_r,
            moe_intermediate_size=moe_dim,
            norm_topk_prob=norm_topk,
            moe_layers=moe_layers,
            router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.0) or 0.0),
        )
        if model_type == "qwen2_moe":
            common["shared_expert_intermediate_size"] = int(cfg.get("shared_expert_intermediate_size", 0) or 0)
        if model_type in SIGMOID_ROUTED:
            common.update(_sigmoid_router(cfg, g, experts, top_r))
        if len(moe_layers) < layers and common["intermediate_size"] <= 0:
            raise ModelConfigError("dense layers present but intermediate_size is missing")
    elif common["intermediate_size"] <= 0:
        raise ModelConfigError(f"config.json of a {model_type!r} model lacks intermediate_size")
    for name in ("hidden_size", "num_layers", "vocab_size", "head_dim"):
        if common[name] <= 0 or not math.isfinite(common[name]):
            raise ModelConfigError(f"{name} must be positive, got {common[name]}")
    return ModelConfig(**common)


def load_config(path: str | Path) -> ModelConfig:
    """Read and parse `<path>/config.json`."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"no config.json in {path}")
    try:
        cfg = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ModelConfigError(f"{file} is not valid JSON: {err}") from err
    return parse_config(cfg)
