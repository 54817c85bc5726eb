"""gpt_oss: attention sinks, sliding windows shorter than the prompt (alternating with full attention) over the
paged cache, YaRN, biased router and experts, the clamped SwiGLU, MXFP4 experts dequantised on load."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from family_ckpt import PROMPTS, cached_logits, hf_greedy, random_hf_model, save_pair
from safetensors.torch import load_file, save_file

import engine
from engine.models.checkpoint import CheckpointError, build_model, save_model
from engine.models.config import ModelConfigError, parse_config
from engine.models.gpt_oss import dequantize_mxfp4

YARN = dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
            original_max_position_embeddings=64, rope_theta=150000.0)  # fmt: skip
OSS = dict(vocab_size=97, hidden_size=48, intermediate_size=24, num_hidden_layers=3, num_attention_heads=4,
           num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=4,
           max_position_embeddings=256, rope_parameters=YARN)  # fmt: skip

CASES = {
    "window4-yarn": {},
    "tight-clamp-top3": dict(swiglu_limit=0.5, swiglu_alpha=3.0, num_experts_per_tok=3),
    "full-sliding-full": dict(layer_types=["full_attention", "sliding_attention", "full_attention"], sliding_window=2),
    "default-rope-mha-tied": dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0), num_key_value_heads=4,
                                  tie_word_embeddings=True),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(tmp_path, case):
    ref, ours = save_pair("gpt_oss", tmp_path, **{**OSS, **CASES[case]})
    ids = torch.randint(0, 97, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids, attention_mask=torch.ones_like(ids)).logits
    torch.testing.assert_close(ours.logits(ids), want, atol=1e-4, rtol=1e-4)
    # over the paged cache: windows are cut by the slots' recorded positions
    torch.testing.assert_close(cached_logits(ours, ids[0].tolist(), [5, 1, 6, 1]), want[0], atol=1e-4, rtol=1e-4)


def test_sinks_and_window_change_the_output(tmp_path):
    """Guards against a silently ignored feature: zero sinks / an unbounded window give other logits."""
    ref, ours = save_pair("gpt_oss", tmp_path, **OSS)
    ids = torch.randint(0, 97, (1, 13), generator=torch.Generator().manual_seed(2))
    base = ours.logits(ids)
    with torch.no_grad():
        for layer in ours.model.layers:
            layer.self_attn.sinks.zero_()
    assert not torch.allclose(ours.logits(ids), base, atol=1e-3)
    ours = engine.load_model(tmp_path)
    for layer in ours.model.layers:
        layer.self_attn.window = 0
    assert not torch.allclose(ours.logits(ids), base, atol=1e-3)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_pair("gpt_oss", tmp_path_factory.mktemp("oss"), seed=4, **OSS)


def test_greedy_generate_matches_transformers(pair):
    ref, ours = pair
    res = engine.Engine(ours).generate(PROMPTS, 64)  # a mixed-length batch
    for prompt, r in zip(PROMPTS, res):
        assert r.token_ids == hf_greedy(ref, prompt, 64)
    assert engine.Engine(ours).generate([PROMPTS[2]], 64)[0].token_ids == res[2].token_ids  # batch 1


def test_speculative_greedy_equals_target_only(pair):
    """Trees in scratch slots, several requests: each token's window is measured in positions."""
    _, ours = pair
    base = engine.Engine(ours).generate(PROMPTS, 40)
    spec = engine.Engine(ours, drafter="ngram", check_kv=True).generate(
        PROMPTS, 40, spec=engine.SpecConfig(depth=4, width=2, max_verify=8)
    )
    assert [r.token_ids for r in spec] == [r.token_ids for r in base]


def _quantize_groups(gen: torch.Generator, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 blocks [..., G, 16] and scales [..., G] for a weight of `shape` [..., in]."""
    *lead, cols = shape
    blocks = torch.randint(0, 256, (*lead, cols // 32, 16), generator=gen).to(torch.uint8)
    scales = torch.randint(122, 127, (*lead, cols // 32), generator=gen).to(torch.uint8)
    return blocks, scales


def test_mxfp4_experts_are_dequantised_on_load(tmp_path):
    """A checkpoint in the released layout (`*_blocks` / `*_scales`, quantization_config mxfp4) loads, and
    matches transformers run on weights dequantised by transformers' own MXFP4 conversion."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    cfg = dict(OSS, hidden_size=64, intermediate_size=32)  # MXFP4 groups of 32 along each input dim
    ref = random_hf_model("gpt_oss", **cfg)
    ref.save_pretrained(tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    E, D, F_ = 8, 64, 32
    for i, layer in enumerate(ref.model.layers):
        for name, out_in in (("gate_up_proj", (E, 2 * F_, D)), ("down_proj", (E, D, F_))):
            key = f"model.layers.{i}.mlp.experts.{name}"
            blocks, scales = _quantize_groups(gen, out_in)
            del state[key]
            state[f"{key}_blocks"], state[f"{key}_scales"] = blocks, scales
            with torch.no_grad():  # transformers' dequantisation -> its parameter layout [E, in, out]
                getattr(layer.mlp.experts, name).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    ours = engine.load_model(tmp_path)
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ref(ids, attention_mask=torch.ones_like(ids)).logits
    torch.testing.assert_close(ours.logits(ids), want, atol=1e-4, rtol=1e-4)
    blocks, scales = _quantize_groups(gen, (3, 64))
    torch.testing.assert_close(dequantize_mxfp4(blocks, scales), convert_moe_packed_tensors(
        blocks[None], scales[None], dtype=torch.float32).transpose(1, 2)[0])  # fmt: skip
    del state["model.layers.0.mlp.experts.down_proj_scales"]
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="down_proj_scales"):
        engine.load_model(tmp_path)


def test_our_saved_folder_loads_in_transformers(tmp_path):
    model = build_model(dict(OSS, model_type="gpt_oss"), seed=3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                p.normal_(0, 0.3)
    save_model(model, tmp_path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).float().eval()
    ids = torch.randint(0, 97, (1, 9))
    with torch.no_grad():
        want = ref(ids, attention_mask=torch.ones_like(ids)).logits
    torch.testing.assert_close(model.logits(ids), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("over", "match"),
    [
        (dict(layer_types=["sliding_attention", "full_attention"]), "layer_types"),
        (dict(layer_types=["sliding_attention", "chunked_attention", "full_attention"]), "layer_types"),
        (dict(sliding_window=None), "sliding_window"),
        (dict(rope_parameters=dict(rope_type="longrope", factor=8.0)), "rope type .longrope."),
    ],
)
def test_bad_configs_are_rejected(over, match):
    with pytest.raises(ModelConfigError, match=match):
        parse_config(dict(OSS, model_type="gpt_oss", **over))
