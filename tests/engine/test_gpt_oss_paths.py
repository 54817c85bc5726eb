"""gpt_oss on the other execution paths (issue 11 item 7): expert parallelism over 2 gloo ranks (the biases
sharded with their experts), the Triton expert kernels (interpreter on CPU) and expert offload give the
single-process torch tokens; virtual EP and the roofline cost model run on its biased router's routing."""

from __future__ import annotations

import textwrap

import pytest
import torch
from family_ckpt import (
    PROMPTS,
    TRITON_CHECK,
    check_offload_virtual_ep_and_cost,
    ep_check,
    run_triton_interpreter,
    run_two_ranks,
)

import engine
from engine.models.checkpoint import build_model, init_weights
from engine.offload.cache import ExpertOffload

MODEL = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, "tests/engine")
    import engine
    from engine.models.checkpoint import build_model, init_weights
    from test_gpt_oss import OSS
    target = init_weights(build_model(dict(OSS, model_type="gpt_oss", swiglu_limit=0.7)), seed=0, std=0.2)
    with torch.no_grad():  # routing that matters; biases that matter; activations the clamp cuts
        gen = torch.Generator().manual_seed(5)
        for block in target.moe_blocks:
            block.gate.weight.mul_(4.0)
            block.gate.bias.copy_(torch.randn(block.num_experts, generator=gen))
            block.experts.gate_up_proj_bias.copy_(torch.randn(block.experts.gate_up_proj_bias.shape, generator=gen))
            block.experts.down_proj_bias.copy_(torch.randn(block.experts.down_proj_bias.shape, generator=gen) * 0.3)
    prompts = [[5, 7, 9, 11], [1, 2, 3], [40, 41, 42, 43, 44, 45]]
    """
)

TRITON = MODEL + TRITON_CHECK
EP = MODEL + ep_check(
    """
    ex = target.moe_blocks[0].experts
    assert ex.gate_up_proj_bias.shape[0] == ex.gate_up_proj.shape[0] == 4, "biases not sharded with their experts"
    """
)


@pytest.mark.dist
def test_expert_parallel_two_ranks_match_one_process(tmp_path):
    run_two_ranks(EP, tmp_path)


@pytest.mark.slow
def test_triton_interpreter_backend_matches_torch():
    run_triton_interpreter(TRITON)


def _target():
    from test_gpt_oss import OSS

    target = init_weights(build_model(dict(OSS, model_type="gpt_oss", swiglu_limit=0.7)), seed=1, std=0.2)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(6)
        for block in target.moe_blocks:
            block.gate.weight.mul_(4.0)
            block.experts.gate_up_proj_bias.copy_(torch.randn(block.experts.gate_up_proj_bias.shape, generator=gen))
            block.experts.down_proj_bias.copy_(torch.randn(block.experts.down_proj_bias.shape, generator=gen) * 0.3)
    return target


def test_offload_virtual_ep_and_modelled_cost_in_process():
    """Expert offload keeps the tokens (biases resident, indexed by expert); virtual EP and the roofline cost
    model (spec from the HF config) run on the biased router's routing."""
    check_offload_virtual_ep_and_cost(_target())


def test_offload_buffer_rows_pick_each_experts_own_biases():
    """Copy-mode offload computes from a slot-ordered buffer: `local_experts(rows=)` must index the biases by the
    expert each row holds, not by the row (checked on CPU by calling the block as the buffer path does)."""
    block = _target().moe_blocks[0]
    ex = block.experts
    x = torch.randn(5, ex.gate_up_proj.shape[-1])
    ids = torch.tensor([[3, 6], [6, 1], [1, 3], [3, 1], [6, 6]])
    w = torch.softmax(torch.randn(5, 2), dim=-1)
    want = block.local_experts(x, ex.gate_up_proj, ex.down_proj, ids, w)
    held = torch.tensor([6, 1, 3])  # buffer rows 0, 1, 2 hold experts 6, 1, 3
    slot = torch.full((block.num_experts,), -1, dtype=torch.long)
    slot[held] = torch.arange(3)
    got = block.local_experts(x, ex.gate_up_proj[held], ex.down_proj[held], slot[ids], w, rows=held)
    torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="b_gate_up must be"):  # rows forgotten: all E biases for 3 rows, refused
        block.local_experts(x, ex.gate_up_proj[held], ex.down_proj[held], slot[ids], w)


def test_offload_copy_mode_computes_from_the_buffer_with_each_experts_biases():
    """Copy mode (weights moved to host, a slot-ordered device buffer; runnable on CPU) keeps the greedy tokens."""
    target = _target()
    ref = [r.token_ids for r in engine.Engine(target).generate(PROMPTS, 12)]
    with ExpertOffload(target, 2, mode="copy") as off:
        assert [r.token_ids for r in engine.Engine(target).generate(PROMPTS, 12)] == ref
        assert off.stats.misses > 0
