"""Logit parity with transformers (float32) for every supported model type."""

from __future__ import annotations

import pytest
import torch
import transformers  # a test dependency (pyproject [test]): a broken install fails, not skips
from hf_configs import PARITY_CASES, tiny_config

import engine


@pytest.mark.parametrize(
    ("model_type", "over"), PARITY_CASES, ids=[f"{m}-{i}" for i, (m, _) in enumerate(PARITY_CASES)]
)
def test_logits_match_transformers(tmp_path, model_type, over):
    cfg = transformers.AutoConfig.for_model(**tiny_config(model_type, **over))
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.2)
    ref.save_pretrained(tmp_path)
    ours = engine.load_model(tmp_path)
    ids = torch.randint(0, cfg.vocab_size, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(ids, attention_mask=torch.ones_like(ids)).logits
    torch.testing.assert_close(ours.logits(ids), want, atol=1e-4, rtol=1e-4)


def test_our_saved_folder_loads_in_transformers(tmp_path):
    from engine.models.checkpoint import build_model, save_model

    for mt in ("qwen2_moe", "mixtral", "qwen3"):
        model = build_model(tiny_config(mt), seed=3)
        save_model(model, tmp_path / mt)
        ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / mt).float().eval()
        ids = torch.randint(0, 97, (1, 9))
        with torch.no_grad():
            want = ref(ids, attention_mask=torch.ones_like(ids)).logits
        torch.testing.assert_close(model.logits(ids), want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(engine.load_model(tmp_path / mt).logits(ids), want, atol=1e-4, rtol=1e-4)


def test_routing_is_recorded_per_moe_layer(tiny_moe_dir):
    from engine.models.batching import chain_item, pack
    from engine.models.kv_cache import PagedKVCache

    model = engine.load_model(tiny_moe_dir)
    cfg = model.config
    kv = PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 4, 16)
    kv.add_sequence(0)
    kv.reserve(0, 5)
    slots = kv.slots(0, range(5))
    out = model.forward_batch(
        pack([chain_item([1, 2, 3, 4, 5], slots[:0], slots)], model.device), kv, record_routing=True
    )
    assert out.routing.layers == list(cfg.moe_layers)
    for ids, w in zip(out.routing.expert_ids, out.routing.topk_weights):
        assert ids.shape == (5, cfg.top_r) and w.shape == (5, cfg.top_r)
        assert int(ids.min()) >= 0 and int(ids.max()) < cfg.num_experts
    torch.testing.assert_close(out.logits, model.logits(torch.tensor([[1, 2, 3, 4, 5]]))[0])


def test_inference_caches_follow_weight_updates():
    from engine.models.checkpoint import build_model

    model = build_model(tiny_config("qwen2_moe"), seed=1)
    ids = torch.randint(0, 97, (1, 6))
    from engine.models.batching import chain_item, pack
    from engine.models.kv_cache import PagedKVCache

    def cached_logits():
        cfg = model.config
        kv = PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 2, 16)
        kv.add_sequence(0)
        kv.reserve(0, 6)
        slots = kv.slots(0, range(6))
        with torch.inference_mode():
            return model.forward_batch(pack([chain_item(ids[0], slots[:0], slots)], model.device), kv).logits

    before = cached_logits()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    after = cached_logits()
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, model.logits(ids)[0], atol=1e-4, rtol=1e-4)
