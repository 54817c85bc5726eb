"""`Engine(expert_budget=B)`: MoE-Spec's approximate cap on distinct experts per layer (2602.16052).

B = E is exact; a small B caps the footprint of every verification at B experts per MoE layer and leaves
forwards that verify no draft (prefill, plain decoding, also batched) exact.
"""

from __future__ import annotations

import pytest
import torch
from hf_configs import tiny_config

import engine
from engine.models.checkpoint import build_model
from engine.models.moe import MoEBlock

PROMPTS = [[5, 7, 9, 11, 3, 5, 7, 9], [1, 2, 3], [40, 41, 42, 43, 44]]
SPEC = engine.SpecConfig(depth=4, width=2)


@pytest.fixture(scope="module")
def target(tiny_moe_dir):
    return engine.load_model(tiny_moe_dir)


@pytest.fixture(scope="module")
def drafter(tiny_moe_dir):  # the target's own weights: long accepted paths, many verified tokens per round
    return engine.load_model(tiny_moe_dir)


def _rounds(res):
    return [r for x in res for r in x.rounds]


def test_budget_of_all_experts_is_exact(target, drafter):
    E = target.config.num_experts
    base = engine.Engine(target, drafter=drafter).generate(PROMPTS, 16, spec=SPEC)
    capped = engine.Engine(target, drafter=drafter, expert_budget=E).generate(PROMPTS, 16, spec=SPEC)
    assert [r.token_ids for r in capped] == [r.token_ids for r in base]
    assert [r.distinct_experts for r in _rounds(capped)] == [r.distinct_experts for r in _rounds(base)]


def test_small_budget_caps_the_verification_footprint(target, drafter):
    B = target.config.top_r
    free = _rounds(engine.Engine(target, drafter=drafter).generate(PROMPTS, 16, spec=SPEC))
    capped = _rounds(engine.Engine(target, drafter=drafter, expert_budget=B).generate(PROMPTS, 16, spec=SPEC))
    assert max(max(r.distinct_experts) for r in free if r.verified_tokens > 1) > B  # the cap has work to do
    multi = [r for r in capped if r.verified_tokens > 1]
    assert multi and all(max(r.distinct_experts) <= B for r in multi)


def test_budget_leaves_plain_decoding_alone(target):
    prompts = PROMPTS[:2]
    base = engine.Engine(target).generate(prompts, 8)  # batch of 2: two tokens per forward, none verified
    capped = engine.Engine(target, expert_budget=target.config.top_r).generate(prompts, 8)
    assert [r.token_ids for r in capped] == [r.token_ids for r in base]


def test_route_keeps_the_top_budget_experts_by_summed_probability():
    torch.manual_seed(0)
    block = MoEBlock(hidden=8, num_experts=6, top_r=2, moe_inter=4, norm_topk_prob=True)
    x = torch.randn(5, 8)
    logits = block.gate(x)
    keep = set(torch.softmax(logits.float(), -1).sum(0).topk(3).indices.tolist())
    _, weights, ids = block.route(x, logits, expert_budget=3)
    assert set(ids.flatten().tolist()) <= keep
    torch.testing.assert_close(weights.sum(-1), torch.ones(5))
    one = block.route(x[:1], logits[:1], expert_budget=3)  # one token: nothing to share, exact routing
    exact = block.route(x[:1], logits[:1])
    assert torch.equal(one[2], exact[2])


@pytest.mark.parametrize("budget", [1, 7, 2.5, True])
def test_bad_budget_is_rejected(target, budget):
    with pytest.raises(ValueError, match="expert_budget"):
        engine.Engine(target, expert_budget=budget)


def test_budget_needs_an_moe_target():
    dense = build_model(tiny_config("llama"), seed=0)
    with pytest.raises(ValueError, match="MoE target"):
        engine.Engine(dense, expert_budget=2)
