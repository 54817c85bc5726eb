"""Tiny random HF configs of every supported model type (shared by the parity tests)."""

from __future__ import annotations

BASE = dict(
    vocab_size=97,
    hidden_size=48,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def tiny_config(model_type: str, **over) -> dict:
    cfg = dict(BASE, model_type=model_type)
    if model_type in ("qwen2_moe", "qwen3_moe", "olmoe"):
        cfg.update(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=False)
    if model_type == "olmoe":
        cfg.update(intermediate_size=24, eos_token_id=1, pad_token_id=0)
    if model_type == "qwen2_moe":
        cfg.update(shared_expert_intermediate_size=40)
    if model_type == "mixtral":
        cfg.update(num_local_experts=6, num_experts_per_tok=2, intermediate_size=24)
    if model_type in ("qwen3", "qwen3_moe"):
        cfg.update(head_dim=16)
    cfg.update(over)
    return cfg


# (model_type, overrides) covering top-1/2/3, both norm_topk_prob values, GQA/MHA, qk-norm, tied/untied
PARITY_CASES = [
    ("qwen2_moe", {}),
    ("qwen2_moe", dict(num_experts_per_tok=1, norm_topk_prob=True, tie_word_embeddings=True)),
    ("qwen2_moe", dict(decoder_sparse_step=2, num_hidden_layers=3)),
    ("qwen2_moe", dict(mlp_only_layers=[0], num_experts_per_tok=3)),
    ("qwen3_moe", {}),
    ("qwen3_moe", dict(num_experts_per_tok=3, norm_topk_prob=True, num_key_value_heads=4)),
    ("qwen3_moe", dict(num_experts_per_tok=1, tie_word_embeddings=True)),
    ("mixtral", {}),
    ("mixtral", dict(num_experts_per_tok=3, num_key_value_heads=1)),
    ("mixtral", dict(num_experts_per_tok=1, tie_word_embeddings=True)),
    ("olmoe", {}),
    ("olmoe", dict(num_experts_per_tok=3, norm_topk_prob=True)),
    ("olmoe", dict(num_experts_per_tok=1, num_key_value_heads=4, tie_word_embeddings=True)),
    ("llama", {}),
    ("llama", dict(tie_word_embeddings=True, attention_bias=True, num_key_value_heads=4)),
    ("qwen2", {}),
    ("qwen2", dict(tie_word_embeddings=True, num_key_value_heads=1)),
    ("qwen3", {}),
    ("qwen3", dict(tie_word_embeddings=True)),
]
