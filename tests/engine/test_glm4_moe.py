"""glm4_moe (GLM-4.5): partial rotary, optional qk-norm, q/k/v bias, sigmoid routing with correction bias,
shared experts, dense first layers. Parity with transformers in float32, cached path, generate, speculation."""

from __future__ import annotations

import pytest
import torch
import transformers
from family_ckpt import PROMPTS, cached_logits, hf_greedy, save_pair

import engine
from engine.models.checkpoint import build_model, save_model
from engine.models.config import ModelConfigError, parse_config

GLM = dict(vocab_size=97, hidden_size=48, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=3,
           num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
           n_group=2, topk_group=1, first_k_dense_replace=1, max_position_embeddings=256,
           routed_scaling_factor=1.5)  # fmt: skip

CASES = {
    "half-rotary-groups": {},
    "qk-norm-bias": dict(use_qk_norm=True, attention_bias=True),
    "full-rotary-unnormalised": dict(partial_rotary_factor=1.0, norm_topk_prob=False, n_group=1, topk_group=1),
    "quarter-rotary-yarn": dict(partial_rotary_factor=0.25, rope_scaling=dict(rope_type="yarn", factor=4.0,
                                                                              original_max_position_embeddings=64)),
    "all-moe-2-shared": dict(first_k_dense_replace=0, n_shared_experts=2, num_experts_per_tok=3, topk_group=2),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(tmp_path, case):
    ref, ours = save_pair("glm4_moe", tmp_path, **{**GLM, **CASES[case]})
    ids = torch.randint(0, 97, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids, attention_mask=torch.ones_like(ids)).logits
    torch.testing.assert_close(ours.logits(ids), want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(cached_logits(ours, ids[0].tolist(), [6, 1, 5, 1]), want[0], atol=1e-4, rtol=1e-4)


def test_partial_rotary_default_is_half():
    cfg = parse_config(dict(GLM, model_type="glm4_moe"))
    assert (cfg.rotary_dim, cfg.head_dim, cfg.moe_layers, cfg.router) == (8, 16, (1, 2), "sigmoid")
    assert cfg.shared_expert_intermediate_size == 24 and not cfg.shared_expert_gated


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_pair("glm4_moe", tmp_path_factory.mktemp("glm"), seed=2, **{**GLM, "use_qk_norm": True})


def test_greedy_generate_matches_transformers(pair):
    ref, ours = pair
    res = engine.Engine(ours).generate(PROMPTS, 64)  # a mixed-length batch
    for prompt, r in zip(PROMPTS, res):
        assert r.token_ids == hf_greedy(ref, prompt, 64)
    assert engine.Engine(ours).generate([PROMPTS[2]], 64)[0].token_ids == res[2].token_ids  # batch 1


def test_speculative_greedy_equals_target_only(pair):
    _, ours = pair
    base = engine.Engine(ours).generate(PROMPTS, 40)
    spec = engine.Engine(ours, drafter="ngram", check_kv=True).generate(
        PROMPTS, 40, spec=engine.SpecConfig(depth=4, width=2, max_verify=8)
    )
    assert [r.token_ids for r in spec] == [r.token_ids for r in base]


@pytest.mark.parametrize("model_type", ["glm4_moe", "deepseek_v3"])
def test_our_saved_folder_loads_in_transformers(tmp_path, model_type):
    """save_model writes the hub layout (per-expert keys, `shared_experts`, the correction bias)."""
    from test_deepseek_v3 import DS

    model = build_model(dict(GLM if model_type == "glm4_moe" else DS, model_type=model_type), seed=3)
    with torch.no_grad():
        for block in model.moe_blocks:
            block.gate.e_score_correction_bias.normal_(0, 0.3)
    save_model(model, tmp_path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).float().eval()
    ids = torch.randint(0, 97, (1, 9))
    with torch.no_grad():
        want = ref(ids, attention_mask=torch.ones_like(ids)).logits
    torch.testing.assert_close(model.logits(ids), want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(engine.load_model(tmp_path).logits(ids), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("over", "match"),
    [
        (dict(partial_rotary_factor=0.3125), "rotary dims"),
        (dict(rope_scaling=dict(rope_type="dynamic", factor=2.0)), "rope type 'dynamic'"),
        (dict(n_group=16), "n_group"),
    ],
)
def test_bad_configs_are_rejected(over, match):
    with pytest.raises(ModelConfigError, match=match):
        parse_config(dict(GLM, model_type="glm4_moe", **over))
