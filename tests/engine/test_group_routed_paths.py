"""deepseek_v3 and glm4_moe (sigmoid, group-limited routers with a correction bias) on the other execution paths:
expert parallelism over 2 gloo ranks and the Triton expert kernels (interpreter on CPU) give the single-process
torch tokens (the group-limited router is what placement sees); offload, virtual EP and the roofline cost model."""

from __future__ import annotations

import textwrap

import pytest
from family_ckpt import (
    TRITON_CHECK,
    check_offload_virtual_ep_and_cost,
    ep_check,
    run_triton_interpreter,
    run_two_ranks,
    save_pair,
)
from test_deepseek_v3 import DS
from test_glm4_moe import GLM

FAMILIES = {"deepseek_v3": ("test_deepseek_v3", "DS", DS), "glm4_moe": ("test_glm4_moe", "GLM", GLM)}


def model_snippet(family: str) -> str:
    """A random checkpoint of `family` with routing that matters (router rows scaled, random correction biases)."""
    module, name, _ = FAMILIES[family]
    return textwrap.dedent(
        f"""
        import sys, torch
        sys.path.insert(0, "tests/engine")
        import engine
        from engine.models.checkpoint import build_model, init_weights
        from {module} import {name}
        target = init_weights(build_model(dict({name}, model_type="{family}")), seed=0, std=0.2)
        with torch.no_grad():
            gen = torch.Generator().manual_seed(5)
            for block in target.moe_blocks:
                block.gate.weight.mul_(4.0)
                block.gate.e_score_correction_bias.copy_(torch.randn(block.num_experts, generator=gen) * 0.3)
        prompts = [[5, 7, 9, 11], [1, 2, 3], [40, 41, 42, 43, 44, 45]]
        """
    )


@pytest.mark.dist
@pytest.mark.parametrize("family", list(FAMILIES))
def test_expert_parallel_two_ranks_match_one_process(tmp_path, family):
    run_two_ranks(model_snippet(family) + ep_check(), tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_triton_interpreter_backend_matches_torch(family):
    run_triton_interpreter(model_snippet(family) + TRITON_CHECK)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_offload_virtual_ep_and_modelled_cost_in_process(tmp_path, family):
    """Expert offload keeps the tokens; virtual EP and the roofline cost model (spec from the HF config; MLA priced
    for deepseek_v3) run on the group-limited routing."""
    _, target = save_pair(family, tmp_path, seed=6, **FAMILIES[family][2])
    check_offload_virtual_ep_and_cost(target)
