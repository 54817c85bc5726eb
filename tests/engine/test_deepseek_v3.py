"""deepseek_v3: MLA (with and without q_lora_rank), YaRN, group-limited sigmoid routing, dense first layers.

Parity with transformers in float32, the absorbed latent-cache path against the plain one, greedy
`Engine.generate` against transformers' generate, speculative greedy == target-only, the cache layout."""

from __future__ import annotations

import pytest
import torch
from family_ckpt import PROMPTS, cached_logits, hf_greedy, random_hf_model, save_pair

import engine
from engine.models.config import ModelConfigError, parse_config
from engine.models.kv_cache import PagedKVCache

DS = dict(vocab_size=97, hidden_size=48, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=3,
          num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
          topk_group=2, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10,
          first_k_dense_replace=1, max_position_embeddings=256, routed_scaling_factor=2.5)  # fmt: skip
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=0.8,
            beta_fast=32, beta_slow=1)  # fmt: skip

CASES = {
    "q_lora-groups": {},
    "no-q_lora": dict(q_lora_rank=None),
    "yarn": dict(rope_scaling=YARN),
    "yarn-attention-factor": dict(rope_scaling=dict(YARN, mscale_all_dim=None, mscale=None, factor=8.0)),
    "one-group-unnormalised": dict(n_group=1, topk_group=1, norm_topk_prob=False, rope_interleave=False),
    "bias-2-shared-topk3": dict(attention_bias=True, n_shared_experts=2, num_experts_per_tok=3, topk_group=3),
    "all-moe-tied": dict(first_k_dense_replace=0, tie_word_embeddings=True, n_group=2, topk_group=1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(tmp_path, case):
    ref, ours = save_pair("deepseek_v3", tmp_path, **{**DS, **CASES[case]})
    ids = torch.randint(0, 97, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids, attention_mask=torch.ones_like(ids)).logits
    torch.testing.assert_close(ours.logits(ids), want, atol=1e-4, rtol=1e-4)
    # the absorbed latent-cache path (prefill in chunks, then single-token decode) equals the plain forward
    tokens = ids[0].tolist()
    torch.testing.assert_close(cached_logits(ours, tokens, [5, 1, 4, 1, 1, 1]), want[0], atol=1e-4, rtol=1e-4)


def test_routing_is_group_limited_and_biased(tmp_path):
    """Every token's experts lie in topk_group groups; the correction bias changes the choice, not the weights."""
    _, ours = save_pair("deepseek_v3", tmp_path, **DS)
    block = ours.moe_blocks[0]
    x = torch.randn(64, DS["hidden_size"], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, weights, ids = block.route(x)
        groups = ids // (DS["n_routed_experts"] // DS["n_group"])  # [T, r]
        assert all(len(set(g)) <= DS["topk_group"] for g in groups.tolist())
        scores = torch.sigmoid(logits.float())
        torch.testing.assert_close(weights, DS["routed_scaling_factor"] * scores.gather(1, ids) /
                                   scores.gather(1, ids).sum(-1, keepdim=True))  # fmt: skip
        block.gate.e_score_correction_bias.zero_()
        assert not torch.equal(block.route(x)[2].sort(-1).values, ids.sort(-1).values)


def test_cache_stores_the_compressed_latent():
    """One [kv_lora_rank + qk_rope_head_dim] vector per token and layer, no separate V."""
    cfg = parse_config(dict(DS, model_type="deepseek_v3"))
    kv = PagedKVCache.for_model(cfg, 2, 4)
    assert tuple(kv.k.shape) == (3, 8, 1, 16 + 8) and kv.v.shape[-1] == 0
    assert kv.bytes_per_token == 3 * (16 + 8) * 4
    v3 = parse_config(dict(model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                           moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
                           n_routed_experts=256, num_experts_per_tok=8, kv_lora_rank=512, q_lora_rank=1536,
                           qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128))  # fmt: skip
    assert v3.kv_cache_layout == (1, 576, 0)
    assert PagedKVCache.for_model(v3, 1, 1, torch.bfloat16, "meta").bytes_per_token == 70272  # 61 x 576 x 2


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_pair("deepseek_v3", tmp_path_factory.mktemp("ds"), seed=3, **{**DS, "rope_scaling": YARN})


def test_greedy_generate_matches_transformers(pair):
    ref, ours = pair
    res = engine.Engine(ours).generate(PROMPTS, 64)
    for prompt, r in zip(PROMPTS, res):
        assert r.token_ids == hf_greedy(ref, prompt, 64)
    assert engine.Engine(ours).generate([PROMPTS[0]], 64)[0].token_ids == res[0].token_ids


def test_speculative_greedy_equals_target_only(pair):
    _, ours = pair
    base = engine.Engine(ours).generate(PROMPTS, 40)
    spec = engine.Engine(ours, drafter="ngram", check_kv=True).generate(
        PROMPTS, 40, spec=engine.SpecConfig(depth=3, width=2)
    )
    assert [r.token_ids for r in spec] == [r.token_ids for r in base]


@pytest.mark.parametrize(
    ("over", "match"),
    [
        (dict(rope_scaling=dict(rope_type="longrope", factor=2.0)), "rope type 'longrope'"),
        (dict(n_group=3), "n_group"),
        (dict(topk_group=5), "topk_group"),
        (dict(num_experts_per_tok=6, topk_group=1), "exceeds"),
        (dict(scoring_func="softmax"), "scoring_func"),
        (dict(qk_rope_head_dim=7), "qk_rope_head_dim"),
    ],
)
def test_bad_configs_are_rejected(over, match):
    with pytest.raises(ModelConfigError, match=match):
        parse_config(dict(DS, model_type="deepseek_v3", **over))


def test_random_bias_is_saved_and_loaded(tmp_path):
    ref = random_hf_model("deepseek_v3", **DS)
    ref.save_pretrained(tmp_path)
    ours = engine.load_model(tmp_path)
    want = ref.model.layers[1].mlp.gate.e_score_correction_bias
    assert want.abs().sum() > 0
    torch.testing.assert_close(ours.moe_blocks[0].gate.e_score_correction_bias, want)


def test_roofline_prices_mla_from_its_dims():
    """conf/model_spec/deepseek_v3: the latent cache, MLA's projections, absorbed-form score flops; and the same
    spec from the HF config of DeepSeek-V3."""
    from engine.cost.roofline import RooflineCost, load_hardware, load_model_spec, model_spec_from_hf_config

    s = load_model_spec("deepseek_v3")
    assert s.kv_bytes == (512 + 64) * 2 and s.attn_params == 187_105_280
    for n, ctx in [(1, 1024), (16, 4096), (64, 100)]:  # decode / verification: the absorbed form
        assert s.attention_flops(n, ctx) == 2.0 * n * s.attn_params + 2.0 * 128 * (2 * 512 + 64) * n * (ctx + n)
    kv_b = 512 * 128 * 256  # a long prefill decompresses the latents instead (cheaper there)
    n = 4096
    assert s.attention_flops(n, 0) == 2.0 * n * (s.attn_params - kv_b) + 2.0 * n * kv_b + 2.0 * 128 * 320 * n * n
    roof = RooflineCost(load_hardware("h100"), s)
    assert roof.decode_cost(8192).attention > roof.decode_cost(1024).attention > 0
    hf = dict(num_hidden_layers=61, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
              n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=3,
              num_attention_heads=128, num_key_value_heads=128, vocab_size=129280, kv_lora_rank=512,
              q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)  # fmt: skip
    t = model_spec_from_hf_config(hf, "v3", weight_bytes=2.0)
    assert (t.num_dense_layers, t.num_experts, t.num_shared_experts, t.shared_expert_dim) == (3, 256, 1, 2048)
    assert (t.kv_bytes, t.attn_params) == (s.kv_bytes, s.attn_params)


def test_block_fp8_checkpoint_is_dequantised_on_load(tmp_path):
    """DeepSeek-V3's release format: e4m3 `X.weight` + float32 `X.weight_scale_inv` per 8x8 block here (128x128
    there), W = W_fp8 * scale; compared with transformers on the dequantised weights."""
    import json

    from safetensors.torch import load_file, save_file

    ref = random_hf_model("deepseek_v3", **DS)
    ref.save_pretrained(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    params = dict(ref.named_parameters())
    b = 8
    for key in [k for k, t in state.items() if t.dim() == 2 and "proj" in k]:  # attention, MLPs, experts
        w = state[key]
        rows, cols = w.shape
        blocks = w.new_zeros(-(-rows // b), -(-cols // b))
        for i in range(blocks.shape[0]):
            for j in range(blocks.shape[1]):
                blocks[i, j] = w[i * b : (i + 1) * b, j * b : (j + 1) * b].abs().max() / 448.0
        full = blocks.repeat_interleave(b, 0)[:rows].repeat_interleave(b, 1)[:, :cols]
        q = (w / full).to(torch.float8_e4m3fn)
        state[key], state[key.removesuffix(".weight") + ".weight_scale_inv"] = q, blocks
        if key in params:
            with torch.no_grad():
                params[key].copy_(q.float() * full)
        else:  # per-expert hub key -> transformers' stacked experts
            layer, rest = key.split(".mlp.experts.")
            e, proj = rest.split(".")[:2]
            ex = dict(ref.named_modules())[layer + ".mlp.experts"]
            F_ = ex.down_proj.shape[-1]
            with torch.no_grad():
                if proj == "down_proj":
                    ex.down_proj[int(e)].copy_(q.float() * full)
                else:
                    ex.gate_up_proj[int(e), (0 if proj == "gate_proj" else F_) :][:F_].copy_(q.float() * full)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [b, b]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = ref(ids, attention_mask=torch.ones_like(ids)).logits
    torch.testing.assert_close(engine.load_model(tmp_path).logits(ids), want, atol=1e-4, rtol=1e-4)
