"""Round pricing from RoundStats (engine.cost.round_cost): counts_cost == forward_cost on the same routing, a
round without drafts has utility 1, drafting costs what the drafter's roofline says, RoundStats.context_len."""

from __future__ import annotations

import pytest
import torch

import engine
from engine.cost.drafter_cost import DrafterRoofline, drafter_spec_from_hf_config
from engine.cost.roofline import RooflineCost, load_hardware, load_model_spec
from engine.cost.round_cost import default_hardware, serving_round_cost
from engine.paths import zoo_path


@pytest.mark.parametrize("spec_name", ["qwen3_30b_a3b", "deepseek_v3", "mixtral_8x7b"])
@pytest.mark.parametrize("n", [1, 3, 17])
def test_counts_cost_equals_forward_cost(spec_name, n):
    spec = load_model_spec(spec_name)
    cost = RooflineCost(load_hardware("h200"), spec)
    gen = torch.Generator().manual_seed(n)
    routing = [torch.rand(n, spec.num_experts, generator=gen).topk(spec.top_r, -1).indices
               for _ in range(spec.num_moe_layers)]  # fmt: skip
    counts = torch.stack([torch.bincount(e.reshape(-1), minlength=spec.num_experts) for e in routing])  # [L, E]
    assert cost.counts_cost(counts, n, 700) == pytest.approx(cost.forward_cost(routing, 700).total, rel=1e-12)
    assert cost.counts_cost(None, n, 700) == pytest.approx(cost.expected_cost(n, 700).total, rel=1e-12)
    with pytest.raises(ValueError, match="tokens_per_expert has shape"):
        cost.counts_cost(counts[:, :-1], n, 700)


@pytest.fixture(scope="module")
def zoo():
    return engine.load_model(zoo_path("tiny-moe")), engine.load_model(zoo_path("tiny-dense"))


def test_engine_rounds_are_priced(zoo):
    target, drafter = zoo
    eng = engine.Engine(target, drafter)
    price = serving_round_cost(eng, "h200")
    assert price.name == "roofline:h200:target:drafter"
    prompt = [5, 6, 7, 8, 9, 10, 11]
    for spec in (None, engine.SpecConfig(depth=3, width=2)):
        (res,) = eng.generate([prompt], 24, spec=spec)
        ctx = len(prompt) - 1
        for s in res.rounds:
            assert s.context_len == ctx  # before the round: committed tokens but the root
            ctx += s.committed
            t_spec, t_ar = price(s)
            assert t_ar == price.target.counts_cost(None, 1, s.context_len) > 0
            if s.built_depth == 0:
                assert s.committed * t_ar / t_spec == pytest.approx(1.0, rel=1e-12)  # plain decode: utility 1
            else:
                nbytes = float(drafter.dtype.itemsize)  # priced as served (float32 here)
                spec = drafter_spec_from_hf_config(drafter.config.raw, "dense", "drafter", nbytes)
                draft = DrafterRoofline(load_hardware("h200"), spec)
                verify = price.target.counts_cost(s.tokens_per_expert, s.verified_tokens, s.context_len)
                assert t_spec == pytest.approx(verify + draft.round_cost(s.built_depth, s.width, s.context_len))


def test_drafters_without_weights_draft_for_free_and_heads_are_priced(zoo):
    target, _ = zoo
    assert serving_round_cost(engine.Engine(target, "ngram")).drafter is None
    head = serving_round_cost(engine.Engine(target, str(zoo_path("eagle-head"))))
    assert head.drafter.spec.kind == "eagle3" and head.drafter.spec.hidden_size == target.config.raw["hidden_size"]
    assert default_hardware("cpu") == "cpu" and head.name.startswith("roofline:cpu:")
    with pytest.raises(ValueError, match="unknown|not found|available"):
        serving_round_cost(engine.Engine(target), "no-such-gpu")
