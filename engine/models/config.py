"""Normalised model configuration parsed from a Hugging Face `config.json`.

Every supported family (MoE targets `qwen2_moe`, `qwen3_moe`, `mixtral`, `olmoe`; dense drafters
`llama`, `qwen2`, `qwen3`) maps onto one flat `ModelConfig`, so the model code has one path with a
few feature switches (qkv bias, qk-norm per head or over the whole projection, shared expert, ...).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MOE_TYPES = ("qwen2_moe", "qwen3_moe", "mixtral", "olmoe")
DENSE_TYPES = ("llama", "qwen2", "qwen3")
SUPPORTED_MODEL_TYPES = MOE_TYPES + DENSE_TYPES


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
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0 and len(self.moe_layers) > 0

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers


def _get(cfg: dict, key: str, default: Any = ..., model_type: str = "?") -> Any:
    if key in cfg and cfg[key] is not None:
        return cfg[key]
    if default is ...:
        raise ModelConfigError(f"config.json of a {model_type!r} model lacks the required field {key!r}")
    return default


_DEFAULT_ROPE_THETA = {"mixtral": 1e6}  # transformers' family defaults when config.json is silent


def _rope_theta(cfg: dict) -> float:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default")) if params else "default"
    if rope_type not in ("default", None):
        raise ModelConfigError(
            f"rope type {rope_type!r} is not supported (only the default RoPE); rope parameters: {params}"
        )
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0)) if params else cfg.get("rope_theta")
    return float(theta if theta is not None else _DEFAULT_ROPE_THETA.get(cfg.get("model_type"), 10000.0))


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
    g = lambda k, d=...: _get(cfg, k, d, model_type)  # noqa: E731
    hidden = int(g("hidden_size"))
    heads = int(g("num_attention_heads"))
    kv_heads = int(g("num_key_value_heads", heads))
    head_dim = int(g("head_dim", hidden // heads))
    layers = int(g("num_hidden_layers"))
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
        rope_theta=_rope_theta(cfg),
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
    if model_type in MOE_TYPES:
        if model_type == "mixtral":
            experts, top_r = int(g("num_local_experts")), int(g("num_experts_per_tok"))
            moe_dim = int(g("intermediate_size"))
            norm_topk = True  # Mixtral always renormalises its top-r weights
            moe_layers = tuple(range(layers))
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
