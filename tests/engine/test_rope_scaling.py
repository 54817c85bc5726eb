"""RoPE scaling types (linear, llama3, YaRN) and partial rotary on the existing families, against transformers."""

from __future__ import annotations

import pytest
import torch
from family_ckpt import save_pair
from hf_configs import tiny_config

from engine.models.config import ModelConfigError, parse_config

LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=32)  # fmt: skip
CASES = {
    "llama-llama3": ("llama", dict(rope_scaling=LLAMA3, rope_theta=500.0)),
    "llama-linear": ("llama", dict(rope_scaling=dict(rope_type="linear", factor=3.0))),
    "qwen3_moe-yarn": ("qwen3_moe", dict(rope_scaling=dict(rope_type="yarn", factor=4.0,
                                                           original_max_position_embeddings=32))),
    "qwen2-llama3": ("qwen2", dict(rope_scaling=LLAMA3)),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(tmp_path, case):
    model_type, over = CASES[case]
    config = tiny_config(model_type, **over)
    del config["model_type"]
    ref, ours = save_pair(model_type, tmp_path, **config)
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(1))  # past the original context
    with torch.no_grad():
        want = ref(ids, attention_mask=torch.ones_like(ids)).logits
    torch.testing.assert_close(ours.logits(ids), want, atol=1e-4, rtol=1e-4)


def test_incomplete_scaling_parameters_are_rejected():
    with pytest.raises(ModelConfigError, match="llama3 rope needs"):
        parse_config(tiny_config("llama", rope_scaling=dict(rope_type="llama3", factor=8.0)))
    with pytest.raises(ModelConfigError, match="rope type 'dynamic'"):
        parse_config(tiny_config("llama", rope_scaling=dict(rope_type="dynamic", factor=2.0)))
