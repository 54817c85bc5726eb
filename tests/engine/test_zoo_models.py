"""The shipped trained zoo: exact speculation with the trained drafter, EAGLE and MTP heads."""

from __future__ import annotations

import pytest

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
