"""Shared fixtures: tiny random HF checkpoints written once per session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "engine"))

torch.set_num_threads(1)


def pytest_configure(config) -> None:
    """Stop before any test where transformers (the parity reference) cannot load beside our `kernels` package."""
    from engine.bench.hf_reference import kernels_conflict

    message = kernels_conflict()
    if message:
        raise pytest.UsageError(message)


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory) -> Path:
    """A random qwen2_moe checkpoint saved by transformers itself (hub layout), scaled for sharp logits."""
    import transformers
    from hf_configs import tiny_config

    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(**tiny_config("qwen2_moe"))
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    path = tmp_path_factory.mktemp("tiny_moe")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_dense_dir(tmp_path_factory) -> Path:
    """A random llama drafter with the same vocabulary as tiny_moe_dir."""
    from hf_configs import tiny_config

    from engine.models.checkpoint import build_model, save_model

    path = tmp_path_factory.mktemp("tiny_dense")
    save_model(build_model(tiny_config("llama"), seed=7), path)
    return path


@pytest.fixture(scope="session")
def fake_zoo(tmp_path_factory) -> Path:
    """A zoo folder of zoo-shaped random models with a quickly trained tokenizer (entry-point smoke tests)."""
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from engine.models.checkpoint import build_model, save_model

    root = tmp_path_factory.mktemp("zoo")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(list(topics.values())[:200], trainer)
    tok.save(str(root / "tokenizer.json"))
    common = dict(
        vocab_size=tok.get_vocab_size(),
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
    )
    target = dict(
        common,
        model_type="qwen2_moe",
        num_hidden_layers=2,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        intermediate_size=128,
    )
    drafter = dict(common, model_type="qwen2", num_hidden_layers=1, intermediate_size=96)
    save_model(build_model(target, seed=0), root / "tiny-moe", tokenizer_json=root / "tokenizer.json")
    save_model(build_model(drafter, seed=1), root / "tiny-dense", tokenizer_json=root / "tokenizer.json")
    return root
