"""deepseek_v3 on the other execution paths: expert parallelism over 2 gloo ranks and the Triton expert kernels
(interpreter on CPU) give the single-process torch tokens (the group-limited router is what placement sees)."""

from __future__ import annotations

import textwrap

import pytest
import torch
from family_ckpt import PROMPTS, run_triton_interpreter, run_two_ranks, save_pair
from test_deepseek_v3 import DS

import engine
from engine.cost.roofline import RooflineCost, load_hardware, model_spec_from_hf_config
from engine.offload.cache import ExpertOffload
from engine.parallel.placement import place_experts

MODEL = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, "tests/engine")
    import engine
    from engine.models.checkpoint import build_model, init_weights
    from test_deepseek_v3 import DS
    target = init_weights(build_model(dict(DS, model_type="deepseek_v3")), seed=0, std=0.2)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(5)
        for block in target.moe_blocks:
            block.gate.weight.mul_(4.0)
            block.gate.e_score_correction_bias.copy_(torch.randn(block.num_experts, generator=gen) * 0.3)
    prompts = [[5, 7, 9, 11], [1, 2, 3], [40, 41, 42, 43, 44, 45]]
    """
)

TRITON = MODEL + textwrap.dedent(
    """
    ref = engine.Engine(target, backend="torch").generate(prompts, 6)
    tri = engine.Engine(target, backend="triton").generate(prompts, 6)
    assert [r.token_ids for r in ref] == [r.token_ids for r in tri], "triton backend changed the tokens"
    print("OK")
    """
)

EP = MODEL + textwrap.dedent(
    """
    from datetime import timedelta
    import torch.distributed as dist
    from engine.parallel.ep import EPGroup, shard_model
    from engine.parallel.placement import place_experts
    rank, store = int(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    ref = [r.token_ids for r in engine.Engine(target).generate(prompts, 12)]
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    placement = place_experts(target.config.num_experts, 2, "round_robin", ranks_per_node=1)
    ep = shard_model(target, EPGroup(rank, 2, placement, 1))
    mine = prompts[rank::2]  # different requests per rank: the lockstep idle steps are exercised too
    out = engine.Engine(target, ep=ep).generate(mine, 12)
    assert [r.token_ids for r in out] == ref[rank::2], "EP changed the tokens"
    out = engine.Engine(target, drafter="ngram", ep=ep).generate(mine, 12, spec=engine.SpecConfig(depth=3, width=2))
    assert [r.token_ids for r in out] == ref[rank::2], "EP speculation changed the tokens"
    dist.destroy_process_group()
    print("OK")
    """
)


@pytest.mark.dist
def test_expert_parallel_two_ranks_match_one_process(tmp_path):
    run_two_ranks(EP, tmp_path)


@pytest.mark.slow
def test_triton_interpreter_backend_matches_torch():
    run_triton_interpreter(TRITON)


def test_offload_virtual_ep_and_modelled_cost_in_process(tmp_path):
    """Expert offload keeps the tokens; virtual EP and the roofline cost model (spec from the HF config, MLA
    priced) run on the group-limited routing."""
    _, target = save_pair("deepseek_v3", tmp_path, seed=6, **DS)
    ref = [r.token_ids for r in engine.Engine(target).generate(PROMPTS, 16)]
    with ExpertOffload(target, 2) as off:
        assert [r.token_ids for r in engine.Engine(target).generate(PROMPTS, 16)] == ref
        assert off.stats.misses > 0
    cfg = target.config
    placement = place_experts(cfg.num_experts, 2, "contiguous", ranks_per_node=1)
    cost = RooflineCost(load_hardware("h200"), model_spec_from_hf_config(cfg.raw))
    eng = engine.Engine(target, drafter="ngram", virtual_ep=placement, cost_model=cost)
    res = eng.generate(PROMPTS, 16, spec=engine.SpecConfig(depth=3, width=2))
    assert [r.token_ids for r in res] == ref
    rounds = [s for r in res for s in r.rounds]
    assert all(len(s.distinct_experts) == len(cfg.moe_layers) and s.modelled_seconds > 0 for s in rounds)
    assert all(s.rank_imbalance_max >= 1.0 for s in rounds)
    assert torch.tensor([s.verified_tokens for s in rounds]).sum() > len(rounds)
