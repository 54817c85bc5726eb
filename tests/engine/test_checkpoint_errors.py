"""Loading bad checkpoints fails with a clear message and builds nothing."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import engine
from engine.models.checkpoint import CheckpointError
from engine.models.config import ModelConfigError


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_unknown_model_type_lists_supported(tiny_moe_dir, tmp_path):
    d = _copy(tiny_moe_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match="supported: qwen2_moe, qwen3_moe, mixtral, olmoe, llama, qwen2, qwen3"):
        engine.load_model(d)


def test_missing_weights(tiny_moe_dir, tmp_path):
    d = _copy(tiny_moe_dir, tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        engine.load_model(d)


def test_truncated_safetensors(tiny_moe_dir, tmp_path):
    d = _copy(tiny_moe_dir, tmp_path / "m")
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        engine.load_model(d)


def test_shape_mismatch(tiny_moe_dir, tmp_path):
    d = _copy(tiny_moe_dir, tmp_path / "m")
    state = load_file(d / "model.safetensors")
    state["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(3, 3)
    save_file(state, d / "model.safetensors")
    with pytest.raises(CheckpointError, match="shape mismatch for model.layers.0.self_attn.q_proj.weight"):
        engine.load_model(d)


def test_missing_expert(tiny_moe_dir, tmp_path):
    d = _copy(tiny_moe_dir, tmp_path / "m")
    state = load_file(d / "model.safetensors")
    del state["model.layers.1.mlp.experts.2.up_proj.weight"]
    save_file(state, d / "model.safetensors")
    with pytest.raises(CheckpointError, match="experts \\[2\\] missing"):
        engine.load_model(d)


def test_missing_folder_and_config(tmp_path):
    with pytest.raises(FileNotFoundError):
        engine.load_model(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        engine.load_model(tmp_path / "empty")


def test_drafter_with_other_vocabulary_is_rejected(tiny_moe_dir, tmp_path):
    from hf_configs import tiny_config

    from engine.models.checkpoint import build_model

    target = engine.load_model(tiny_moe_dir)
    other = build_model(tiny_config("llama", vocab_size=50))
    with pytest.raises(ValueError, match="vocabulary"):
        engine.Engine(target, drafter=other)


@pytest.mark.parametrize(("name", "want"), [("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16),
                                            ("torch.float16", torch.float16), ("float32", torch.float32)])  # fmt: skip
def test_dtype_by_name(tiny_moe_dir, name, want):
    model = engine.load_model(tiny_moe_dir, dtype=name)
    assert model.dtype == want and all(p.dtype == want for p in model.parameters())


@pytest.mark.parametrize("bad", ["bfloat", "int8", torch.int8, 16])
def test_bad_dtype_lists_the_names(tiny_moe_dir, bad):
    with pytest.raises(ValueError, match=r"dtype must be a torch floating dtype or one of .*'bfloat16'"):
        engine.load_model(tiny_moe_dir, dtype=bad)
