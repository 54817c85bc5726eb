"""Shared fixtures: tiny random HF checkpoints written once per session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "engine"))

torch.set_num_threads(1)


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
    from engine.checkpoint import build_model, save_model
    from hf_configs import tiny_config

    path = tmp_path_factory.mktemp("tiny_dense")
    save_model(build_model(tiny_config("llama"), seed=7), path)
    return path
