"""Verification rules that read this round's draft: path-probability threshold, the calibrated rule (draft
probability x agreement with the prompt-lookup continuation) and EVICT goodput cut."""

from __future__ import annotations

import pytest
import torch

import engine
from engine.drafting.acceptance import AGREE, DISAGREE, NONE, AcceptanceModel, agreement
from engine.drafting.selection import goodput_keep
from engine.paths import zoo_path
from engine.spec.calibration import IsotonicCalibration
from engine.workloads import code_prompts, encode


def test_goodput_keep_known_answers():
    parents = torch.tensor([-1, 0, 1, 0, 3])
    path = torch.tensor([1.0, 0.9, 0.8, 0.05, 0.01])
    # cost grows slowly: verify all four; steeply: verify nothing; in between: the confident chain only
    assert goodput_keep(parents, path, (1.0, 1.0, 1.0, 1.0, 1.0)).tolist() == [0, 1, 2, 3, 4]
    assert goodput_keep(parents, path, (1.0, 3.0, 5.0, 7.0, 9.0)).tolist() == [0]
    assert goodput_keep(parents, path, (1.0, 1.2, 1.4, 2.5, 3.0)).tolist() == [0, 1, 2]
    assert goodput_keep(parents, path, (1.0, 1.01)).tolist() == [0, 1]  # the curve bounds the cut


@pytest.fixture(scope="module")
def zoo():
    target = engine.load_model(zoo_path("tiny-moe"))
    return target, engine.load_model(zoo_path("tiny-dense")), encode(target.tokenizer, code_prompts(2), 40)


@pytest.mark.parametrize("width", [1, 2])
@pytest.mark.parametrize("rule, threshold", [("threshold", 0.5), ("calibrated", 0.3)])
def test_stop_rules_prune_and_stay_exact(zoo, width, rule, threshold):
    """The raw path-probability threshold and the calibrated one (a hand-made acceptance model: 0.6 · 0.2 < 0.3,
    so a node the n-gram contradicts never survives below an unconfirmed parent) draft less, exactly."""
    target, drafter, prompts = zoo
    eng = engine.Engine(target, drafter=drafter, acceptance=_model(agree=0.95, disagree=0.2, none=0.6))
    base = [r.token_ids for r in eng.generate(prompts, 24)]
    full = eng.generate(prompts, 24, spec=engine.SpecConfig(depth=6, width=width))
    cut = eng.generate(prompts, 24, spec=engine.SpecConfig(depth=6, width=width, verify_rule=rule,
                                                          verify_threshold=threshold))  # fmt: skip
    assert [r.token_ids for r in cut] == base == [r.token_ids for r in full]
    rounds_full = [s for r in full for s in r.rounds]
    rounds_cut = [s for r in cut for s in r.rounds]
    mean = lambda rs, f: sum(f(s) for s in rs) / len(rs)  # noqa: E731
    assert mean(rounds_cut, lambda s: s.proposed) < mean(rounds_full, lambda s: s.proposed)
    assert any(s.built_depth < s.depth for s in rounds_cut)
    assert all(s.verify_rule == rule for s in rounds_cut)


def test_goodput_rule_in_the_engine_is_exact_and_cuts(zoo):
    target, drafter, prompts = zoo
    eng = engine.Engine(target, drafter=drafter)
    base = [r.token_ids for r in eng.generate(prompts, 24)]
    steep = tuple(1.0 + 0.6 * m for m in range(40))
    res = eng.generate(prompts, 24, spec=engine.SpecConfig(depth=6, width=2, verify_rule="goodput", verify_costs=steep))
    assert [r.token_ids for r in res] == base
    assert max(s.proposed for r in res for s in r.rounds) < 12  # a 6 x 2 tree has up to 12 nodes


# ---------------------------------------------------------------------------------------------- calibrated rule
def _model(agree: float, disagree: float, none: float) -> AcceptanceModel:
    """A hand-made acceptance model: a constant P per agreement state at every depth."""
    const = lambda p: IsotonicCalibration(((0.0, 1.0),), ((p, p),))  # noqa: E731
    return AcceptanceModel((const(none), const(agree), const(disagree)))


def test_agreement_states():
    ctx = [5, 6, 7, 9, 5, 6]  # "5 6" occurred before, followed by 7
    assert agreement(ctx, 7) == AGREE
    assert agreement(ctx, 8) == DISAGREE
    assert agreement([1, 2, 3], 4) == NONE  # no suffix recurs


def test_calibrated_path_probabilities_multiply_along_the_path():
    m = _model(agree=0.9, disagree=0.1, none=0.5)
    # context "1 2 3 1 2": n-gram says 3 next, then (after "... 2 3") says 1
    out = m.tree([1, 2, 3, 1, 2], tokens=[2, 3, 1, 4], parents=[-1, 0, 1, 0], cond=[1.0, 0.5, 0.5, 0.5])
    assert out == pytest.approx([1.0, 0.9, 0.81, 0.1])
    assert AcceptanceModel.from_dict(m.to_dict()) == m
    with pytest.raises(ValueError, match="not an acceptance model"):
        AcceptanceModel.from_dict({"kind": "isotonic"})


def test_calibrated_rule_needs_a_model(zoo):
    target, drafter, prompts = zoo
    eng = engine.Engine(target, drafter=drafter)
    spec = engine.SpecConfig(depth=4, width=1, verify_rule="calibrated", verify_threshold=0.3)
    with pytest.raises(ValueError, match="needs an acceptance model"):
        eng.generate(prompts, 8, spec=spec)
    # a model riding on the action is enough
    model = _model(0.9, 0.1, 0.5)
    spec = engine.SpecConfig(depth=4, width=1, verify_rule="calibrated", verify_threshold=0.3, acceptance=model)
    res = eng.generate(prompts, 8, spec=spec)
    assert [r.token_ids for r in res] == [r.token_ids for r in eng.generate(prompts, 8)]


def test_calibrated_pruning_keeps_the_drafters_kv_reuse_right(zoo):
    """The model drafter copies the K/V of accepted nodes it already ran from scratch slots; a pruned tree has
    new node indices, so the slots must follow them. Reusing them must draft exactly what recomputing does."""
    target, drafter_model, _ = zoo
    prompts = encode(target.tokenizer, code_prompts(4), 40)
    spec = engine.SpecConfig(depth=6, width=2, verify_rule="calibrated", verify_threshold=0.3)
    runs = []
    for reuse in (True, False):
        eng = engine.Engine(target, drafter=drafter_model, acceptance=_model(agree=0.95, disagree=0.2, none=0.6))
        if not reuse:  # forget the fed slots: every accepted node's K/V is recomputed at commit
            commit = eng.drafter.commit

            def fresh(seq_id, *a, _commit=commit, _d=eng.drafter, **k):
                _d.seqs[seq_id].fed_slots = {}
                return _commit(seq_id, *a, **k)

            eng.drafter.commit = fresh
        res = eng.generate(prompts, 48, spec=spec)
        runs.append([[(s.proposed, s.accepted, s.built_depth) for s in r.rounds] for r in res])
    assert runs[0] == runs[1]
    assert any(p < 12 for r in runs[0] for p, _, _ in r)  # some trees were pruned


def test_calibrated_rule_with_expert_aware_selection_is_exact(zoo):
    """λ > 0 annotates the pruned tree's nodes with their predicted experts (growth -> tree indices)."""
    target, _, prompts = zoo
    model = _model(agree=0.95, disagree=0.2, none=0.6)
    eng = engine.Engine(target, drafter=str(zoo_path("eagle-head")), predictor=str(zoo_path("expert-predictor")),
                        acceptance=model)  # fmt: skip
    base = [r.token_ids for r in eng.generate(prompts, 24)]
    spec = engine.SpecConfig(depth=6, width=2, lam=1.0, max_verify=6, verify_rule="calibrated", verify_threshold=0.3)
    res = eng.generate(prompts, 24, spec=spec)
    assert [r.token_ids for r in res] == base
    assert any(s.built_depth < 6 for r in res for s in r.rounds)
