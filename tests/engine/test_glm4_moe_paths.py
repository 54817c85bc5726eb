"""glm4_moe (GLM-4.5) on the other execution paths: expert parallelism over 2 gloo ranks, the Triton expert kernels
(interpreter on CPU) and expert offload give the single-process torch tokens; virtual EP and the roofline cost
model run on its grouped sigmoid router's routing."""

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
from test_glm4_moe import GLM

MODEL = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, "tests/engine")
    import engine
    from engine.models.checkpoint import build_model, init_weights
    from test_glm4_moe import GLM
    target = init_weights(build_model(dict(GLM, model_type="glm4_moe")), seed=0, std=0.2)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(5)
        for block in target.moe_blocks:
            block.gate.weight.mul_(4.0)
            block.gate.e_score_correction_bias.copy_(torch.randn(block.num_experts, generator=gen) * 0.3)
    prompts = [[5, 7, 9, 11], [1, 2, 3], [40, 41, 42, 43, 44, 45]]
    """
)

TRITON = MODEL + TRITON_CHECK
EP = MODEL + ep_check()


@pytest.mark.dist
def test_expert_parallel_two_ranks_match_one_process(tmp_path):
    run_two_ranks(EP, tmp_path)


@pytest.mark.slow
def test_triton_interpreter_backend_matches_torch():
    run_triton_interpreter(TRITON)


def test_offload_virtual_ep_and_modelled_cost_in_process(tmp_path):
    _, target = save_pair("glm4_moe", tmp_path, seed=6, **GLM)
    check_offload_virtual_ep_and_cost(target)
