"""SamplingParams(mode="position") in the engine: drafter-invariant seeded sampling (2408.07978).

On the shipped zoo (skipped without it): the committed text is the target's Gumbel-max sample at every
position (checked against uncached target forwards), identical with no drafter, for K in {0, 1, 4, 8},
W in {1, 3}, chain and tree, with every shipped drafter, alone and in a batch, and under a policy that
changes (K, W) every round; the shipped dense drafter's acceptance at T = 0.7 is far above that of
deterministic top-W children. Run: pytest tests/engine/test_position_sampling.py
"""

from __future__ import annotations

import pytest
import torch

import engine
from engine.drafting.tree_growth import TreeGrowth
from engine.spec.gumbel import gumbel_argmax, position_gumbel
from engine.spec.sampling import SamplingParams, process_logits
from engine.workloads import code_prompts, encode, prose_prompts
from engine.zoo.build import zoo_path

NEW_TOKENS = 24
DRAFTERS = ["tiny-dense", "ngram", "eagle-head", "mtp-head"]
SPECS = [
    engine.SpecConfig(depth=0, width=1),
    engine.SpecConfig(depth=1, width=1),
    engine.SpecConfig(depth=4, width=1),
    engine.SpecConfig(depth=8, width=1),
    engine.SpecConfig(depth=4, width=1, drafted_children=False),
    engine.SpecConfig(depth=1, width=3),
    engine.SpecConfig(depth=4, width=3),
    engine.SpecConfig(depth=8, width=3),
    engine.SpecConfig(depth=4, width=3, frontier=5, max_verify=6),
]


def _params(seeds, temperature=0.7, top_p=0.9):
    return [SamplingParams(temperature=temperature, top_p=top_p, seed=s, mode="position") for s in seeds]


@pytest.fixture(scope="module")
def zoo():
    try:
        target = engine.load_model(zoo_path("tiny-moe"))
    except FileNotFoundError:
        pytest.skip("zoo not built")
    prompts = encode(target.tokenizer, code_prompts(2) + prose_prompts(1), 48)
    params = _params([11, 12, 13])
    base = [r.token_ids for r in engine.Engine(target).generate(prompts, NEW_TOKENS, sampling=params)]
    return target, prompts, params, base


def _drafter(name: str, target):
    if name == "tiny-dense":
        return engine.load_model(zoo_path(name))
    return name if name == "ngram" else str(zoo_path(name))


def test_engine_commits_the_position_by_position_gumbel_sample(zoo):
    """Plain decoding in position mode = argmax(log p_target + g_p) from full, uncached target forwards."""
    target, prompts, params, base = zoo
    for prompt, sp, tokens in zip(prompts, params, base):
        seq = list(prompt)
        for _ in range(NEW_TOKENS):
            target_probs = process_logits(target.logits(torch.tensor([seq]))[0, -1], sp)
            noise = position_gumbel(sp.seed, len(seq), target.vocab_size)
            seq.append(int(gumbel_argmax(target_probs.log().unsqueeze(0), noise.unsqueeze(0))[0]))
        assert seq[len(prompt) :] == tokens


@pytest.mark.parametrize("name", DRAFTERS)
def test_text_is_the_same_for_every_k_w_drafter_and_batch(zoo, name):
    target, prompts, params, base = zoo
    eng = engine.Engine(target, drafter=_drafter(name, target))
    checked = engine.Engine(target, drafter=eng.drafter, check_kv=True)  # same drafter object, KV proven per step
    for spec in SPECS:
        label = f"{name} K={spec.depth} W={spec.width}"
        batch = checked.generate(prompts, NEW_TOKENS, sampling=params, spec=spec)
        assert [r.token_ids for r in batch] == base, f"{label}: batch"
        for prompt, sp, tokens in zip(prompts, params, base):
            alone = eng.generate([prompt], NEW_TOKENS, sampling=[sp], spec=spec)[0]
            assert alone.token_ids == tokens, f"{label}: alone"
    calls = iter(range(10_000))

    def policy(obs):  # a different (K, W) every round, K = 0 included
        i = next(calls)
        return ((0, 1, 4, 8)[i % 4], (1, 3)[i % 2], 0.0)

    res = eng.generate(prompts, NEW_TOKENS, sampling=params, policy=policy)
    assert [r.token_ids for r in res] == base, f"{name}: per-round policy"
    eng.kv.check_quiescent()


def test_shared_params_key_request_j_on_seed_plus_j(zoo):
    target, prompts, _, _ = zoo
    eng = engine.Engine(target, drafter=engine.load_model(zoo_path("tiny-dense")))
    spec = engine.SpecConfig(depth=4, width=3)
    shared = eng.generate(prompts, 12, sampling=_params([40])[0], spec=spec)
    listed = engine.Engine(target).generate(prompts, 12, sampling=_params([40, 41, 42]))
    assert [r.token_ids for r in shared] == [r.token_ids for r in listed]


def test_unseeded_position_mode_drafts_with_the_drawn_seed(zoo):
    """seed=None draws a key per request; drafting and verification must both use it (else ~no acceptance)."""
    target, prompts, _, _ = zoo
    eng = engine.Engine(target, drafter=engine.load_model(zoo_path("tiny-dense")))
    params = SamplingParams(temperature=0.7, mode="position")
    res = eng.generate(prompts, NEW_TOKENS, sampling=params, spec=engine.SpecConfig(depth=4, width=1))
    rounds = [s for r in res for s in r.rounds if s.proposed > 0]
    depth1 = sum(s.accepted_by_depth[0] for s in rounds) / len(rounds)
    assert depth1 > 0.5, f"depth-1 acceptance {depth1:.2f}"


def test_greedy_position_mode_is_greedy(zoo):
    target, prompts, _, _ = zoo
    greedy = engine.Engine(target).generate(prompts, 12)
    eng = engine.Engine(target, drafter=engine.load_model(zoo_path("tiny-dense")))
    res = eng.generate(prompts, 12, sampling=SamplingParams(mode="position", seed=3), spec=engine.SpecConfig(4, 3))
    assert [r.token_ids for r in res] == [r.token_ids for r in greedy]


def _acceptance(res) -> tuple[float, float]:
    """(depth-1 acceptance a_1, mean committed per round τ) over rounds that drafted."""
    rounds = [s for r in res for s in r.rounds if s.proposed > 0]
    a1 = sum(s.accepted_by_depth[0] for s in rounds) / sum(s.attempted_by_depth[0] for s in rounds)
    return a1, sum(s.committed for s in rounds) / len(rounds)


def test_dense_drafter_acceptance_at_t07_beats_deterministic_children(zoo):
    target, _, _, _ = zoo
    prompts = encode(target.tokenizer, code_prompts(3) + prose_prompts(3), 48)
    eng = engine.Engine(target, drafter=engine.load_model(zoo_path("tiny-dense")))
    seeds = range(100, 100 + len(prompts))
    table, measured = [], {}
    for depth, width in ((4, 1), (4, 3)):
        for mode, drafted in (("generator", False), ("generator", True), ("position", None)):
            params = [SamplingParams(temperature=0.7, seed=s, mode=mode) for s in seeds]
            spec = engine.SpecConfig(depth=depth, width=width, drafted_children=drafted)
            a1, tau = _acceptance(eng.generate(prompts, 48, sampling=params, spec=spec))
            kind = {False: "top-W children", True: "drafted children (2211.17192)", None: "position (Gumbel)"}[drafted]
            table.append(f"K={depth} W={width} {kind}: a_1 {a1:.3f} tau {tau:.2f}")
            measured[(width, drafted)] = (a1, tau)
    report = "; ".join(table)
    for width in (1, 3):
        position_a1, position_tau = measured[(width, None)]
        deterministic_a1, deterministic_tau = measured[(width, False)]
        assert position_a1 >= deterministic_a1 + 0.2 and position_tau >= 1.5 * deterministic_tau, report
        assert position_a1 >= measured[(width, True)][0] - 0.1, report  # coupling bound: near speculative sampling


def test_mode_is_validated_and_growth_needs_the_position():
    for bad in ("Position", "", None, 1):
        with pytest.raises(ValueError, match="mode"):
            SamplingParams(temperature=1.0, mode=bad)
    params = SamplingParams(temperature=1.0, seed=0, mode="position")
    with pytest.raises(ValueError, match="position"):
        TreeGrowth(0, torch.zeros(8), engine.SpecConfig(depth=2, width=2), params, torch.Generator())
