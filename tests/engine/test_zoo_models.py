"""The shipped trained zoo: exact speculation with the trained drafter, EAGLE and MTP heads, and the fine-grained
target tiny-moe-fine with its own MTP module (drafter="mtp")."""

from __future__ import annotations

import pytest
import torch

import engine
from engine.workloads import code_prompts, encode, prose_prompts
from engine.zoo.build import zoo_path


@pytest.fixture(scope="module")
def zoo():
    target = engine.load_model(zoo_path("tiny-moe"))  # zoo/ is tracked: missing is a failure, not a skip
    prompts = encode(target.tokenizer, code_prompts(2) + prose_prompts(1), 48)
    base = [r.token_ids for r in engine.Engine(target).generate(prompts, 24)]
    return target, prompts, base


@pytest.mark.parametrize("name", ["tiny-dense", "eagle-head", "mtp-head", "ngram"])
@pytest.mark.parametrize(
    "spec", [engine.SpecConfig(depth=4, width=1), engine.SpecConfig(depth=3, width=2)], ids=["chain", "tree"]
)
def test_trained_drafters_are_exact_and_accept(zoo, name, spec):
    target, prompts, base = zoo
    if name == "ngram":
        drafter = "ngram"
    elif name == "tiny-dense":
        drafter = engine.load_model(zoo_path(name))
    else:
        drafter = str(zoo_path(name))
    eng = engine.Engine(target, drafter=drafter, check_kv=True)
    res = eng.generate(prompts, 24, spec=spec)
    assert [r.token_ids for r in res] == base
    if name != "ngram":  # trained drafters agree with the target most of the time
        assert sum(r.acceptance_length for r in res) / len(res) > 1.5
    eng.kv.check_quiescent()


def test_lambda_selection_is_exact_with_the_expert_predictor(zoo):
    target, prompts, base = zoo
    drafter = engine.load_feature_drafter(zoo_path("eagle-head"), target, predictor=zoo_path("expert-predictor"))
    eng = engine.Engine(target, drafter=drafter)
    for score in ("ecospec", "logp"):
        spec = engine.SpecConfig(depth=4, width=2, frontier=4, max_verify=6, lam=2.0, score=score)
        assert [r.token_ids for r in eng.generate(prompts, 24, spec=spec)] == base


@pytest.fixture(scope="module")
def fine():
    target = engine.load_model(zoo_path("tiny-moe-fine"))
    prompts = encode(target.tokenizer, code_prompts(2) + prose_prompts(1), 48)
    base = [r.token_ids for r in engine.Engine(target).generate(prompts, 24)]
    return target, prompts, base


def test_fine_target_is_the_fine_grained_regime(fine):
    target, _, _ = fine
    cfg = target.config
    assert (cfg.model_type, cfg.attention, cfg.router) == ("deepseek_v3", "mla", "sigmoid")
    assert (cfg.num_experts, cfg.top_r, cfg.shared_expert_intermediate_size) == (64, 6, cfg.moe_intermediate_size)
    assert cfg.num_nextn_predict_layers == 1 and target.tokenizer.get_vocab_size() == target.vocab_size
    assert (zoo_path("tiny-moe-fine") / "tokenizer.json").read_bytes() == (
        zoo_path("tiny-moe") / "tokenizer.json"
    ).read_bytes()  # same token ids as tiny-moe: traces of both compare
    biases = torch.stack([b.gate.e_score_correction_bias for b in target.moe_blocks])
    assert biases.abs().sum() > 0  # trained with auxiliary-loss-free balancing
    assert (zoo_path("tiny-moe-fine") / "model.safetensors").stat().st_size < 12e6  # shipped small (bf16)


@pytest.mark.parametrize(
    "spec",
    [engine.SpecConfig(depth=1), engine.SpecConfig(depth=3), engine.SpecConfig(depth=3, width=2, max_verify=6)],
    ids=["K1", "chain-K3", "tree"],
)
def test_fine_target_mtp_drafter_is_exact_and_accepts(fine, spec):
    target, prompts, base = fine
    eng = engine.Engine(target, drafter="mtp", check_kv=True)
    res = eng.generate(prompts, 24, spec=spec)
    assert [r.token_ids for r in res] == base
    assert sum(r.acceptance_length for r in res) / len(res) > 1.3
    eng.kv.check_quiescent()


def test_fine_target_matches_transformers(fine):
    import transformers

    target, _, _ = fine
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(zoo_path("tiny-moe-fine")), dtype=torch.float32)
    ids = torch.randint(0, target.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = theirs.eval()(ids).logits.float()
    torch.testing.assert_close(target.logits(ids), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "spec",
    [engine.SpecConfig(depth=3), engine.SpecConfig(depth=4, width=2, frontier=4, max_verify=6, lam=2.0)],
    ids=["chain-K3", "tree-lambda"],
)
def test_fine_target_eagle_head_and_predictor_are_exact_and_accept(fine, spec):
    """zoo/eagle-head-fine and zoo/expert-predictor-fine: an EAGLE head and a 64-expert predictor trained on the
    fine-grained target (python -m engine.zoo.train_heads target=zoo/tiny-moe-fine)."""
    target, prompts, base = fine
    drafter = engine.load_feature_drafter(
        zoo_path("eagle-head-fine"), target, predictor=zoo_path("expert-predictor-fine")
    )
    eng = engine.Engine(target, drafter=drafter, check_kv=True)
    res = eng.generate(prompts, 24, spec=spec)
    assert [r.token_ids for r in res] == base
    assert sum(r.acceptance_length for r in res) / len(res) > 1.3
    eng.kv.check_quiescent()
