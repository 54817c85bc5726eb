"""SpecMoE-style self drafter: exact greedy output, acceptance vs cache size, cached-only substitution,
deferred loads, KV invariants."""

from __future__ import annotations

import pytest
import torch
from hf_configs import tiny_config

import engine
from engine.models.checkpoint import build_model
from engine.offload.cache import ExpertOffload
from engine.offload.self_drafter import SelfDrafter, expert_similarity, stand_in_table

PROMPTS = [[5, 7, 9, 11, 3], [1, 2], [60, 61, 62]]
CHAIN = engine.SpecConfig(depth=4, width=1)
TREE = engine.SpecConfig(depth=3, width=2)


@pytest.fixture(scope="module")
def target() -> engine.Model:
    """Tiny random mixtral (6 experts, top-2, no shared expert) with sharp logits."""
    model = build_model(tiny_config("mixtral"), seed=0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


@pytest.fixture(scope="module")
def reference(target) -> list[list[int]]:
    return [r.token_ids for r in engine.Engine(target).generate(PROMPTS, 24)]


def _run(target, C, spec, policy="lru", warm=False, **drafter_options):
    with ExpertOffload(target, C, policy=policy) as off:
        if warm:
            off.warm()
        drafter = SelfDrafter(off, **drafter_options)
        eng = engine.Engine(target, drafter=drafter)
        out = eng.generate(PROMPTS, 24, spec=spec)
        eng.kv.check_quiescent()
        drafter.kv.check_quiescent()  # drafter KV blocks all free after generation
        return out, off.stats.snapshot()


@pytest.mark.parametrize("spec", [CHAIN, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize(("C", "policy"), [(6, "lru"), (2, "lru"), (1, "lfu"), (3, "lfu")])
def test_greedy_identical_to_target_only(target, reference, spec, C, policy):
    out, st = _run(target, C, spec, policy)
    assert [r.token_ids for r in out] == reference
    assert st.draft_assignments > 0 and st.misses > 0


def test_full_cache_accepts_almost_everything_small_cache_less(target):
    def rates(out):
        rounds = [r for res in out for r in res.rounds if r.proposed]
        full = sum(r.accepted == r.built_depth for r in rounds) / len(rounds)  # whole drafted path accepted
        return full, sum(r.accepted for r in rounds) / sum(r.proposed for r in rounds)

    full_out, full_st = _run(target, 6, CHAIN, warm=True)
    small_out, small_st = _run(target, 1, CHAIN)
    assert full_st.draft_substituted == 0  # every expert cached: the drafter is the target
    full_paths, full_acc = rates(full_out)
    small_paths, small_acc = rates(small_out)
    assert full_paths >= 0.9 and full_acc >= 0.9
    assert small_acc < full_acc - 0.2 and small_st.draft_substituted > 0
    # trees: with an unpruned frontier the target's greedy path is in the tree and reaches full depth
    tree_out, _ = _run(target, 6, engine.SpecConfig(depth=3, width=2, frontier=8), warm=True)
    assert rates(tree_out)[0] >= 0.9
    tau_full = sum(r.acceptance_length for r in full_out)
    assert tau_full > sum(r.acceptance_length for r in small_out)


def test_substitution_only_uses_cached_experts_and_never_loads(target, monkeypatch):
    calls = []
    with ExpertOffload(target, 2) as off:
        drafter = SelfDrafter(off)
        real_compute = off.compute_cached

        def spy(layer, x, expert_ids, topk_weights):
            used = {e for e in expert_ids.unique().tolist() if e >= 0}
            calls.append((layer, used, set(off.cached_experts(layer))))
            return real_compute(layer, x, expert_ids, topk_weights)

        monkeypatch.setattr(off, "compute_cached", spy)
        real_draft = drafter.draft_many

        def checked_draft(requests):
            before = ([off.cached_experts(i) for i in range(off.num_layers)], off.stats.snapshot())
            trees = real_draft(requests)
            after = ([off.cached_experts(i) for i in range(off.num_layers)], off.stats)
            assert before[0] == after[0]  # the drafter never changes the cache ...
            for name in ("hits", "misses", "bytes_moved", "prefetch_loads"):  # ... nor loads anything
                assert getattr(before[1], name) == getattr(after[1], name)
            return trees

        monkeypatch.setattr(drafter, "draft_many", checked_draft)
        engine.Engine(target, drafter=drafter).generate(PROMPTS, 16, spec=TREE)
        st = off.stats
    assert calls and all(used <= cached for _, used, cached in calls)
    assert any(len(cached) == 2 for _, _, cached in calls)
    # verification loads the union of needed experts once per layer and forward: bytes = misses x expert
    assert st.misses > 0 and st.bytes_moved == st.misses * off.expert_bytes


def test_stand_in_table_known_answer():
    sim = torch.tensor(
        [
            [1.0, 0.9, 0.1, 0.0],
            [0.9, 1.0, 0.2, 0.3],
            [0.1, 0.2, 1.0, 0.8],
            [0.0, 0.3, 0.8, 1.0],
        ]
    )
    assert stand_in_table(sim, [1, 2]).tolist() == [1, 1, 2, 2]
    assert stand_in_table(sim, [3]).tolist() == [3, 3, 3, 3]
    assert stand_in_table(sim, []).tolist() == [-1, -1, -1, -1]


def test_similarity_kinds(target):
    block = target.moe_blocks[0]
    for kind in ("router", "weights"):
        sim = expert_similarity(block, kind)
        E = block.num_experts
        assert sim.shape == (E, E)
        torch.testing.assert_close(sim.diagonal(), torch.ones(E))
        torch.testing.assert_close(sim, sim.T)
    with pytest.raises(ValueError, match="similarity"):
        expert_similarity(block, "cosine")


def test_weights_similarity_and_prefetch_stay_exact(target, reference):
    out, st = _run(target, 3, TREE, similarity="weights", prefetch=True)
    assert [r.token_ids for r in out] == reference
    assert st.prefetch_loads > 0 and st.prefetch_used > 0
    assert st.prefetch_used + st.prefetch_wasted + st.prefetch_pending == st.prefetch_loads


def test_seeded_sampling_is_deterministic(target):
    params = engine.SamplingParams(temperature=0.9, seed=4)
    runs = []
    for _ in range(2):
        with ExpertOffload(target, 2) as off:
            out = engine.Engine(target, drafter=SelfDrafter(off)).generate(PROMPTS, 12, sampling=params, spec=CHAIN)
            runs.append([r.token_ids for r in out])
    assert runs[0] == runs[1]


def test_needs_installed_offload(target):
    with pytest.raises(ValueError, match="installed"):
        SelfDrafter(ExpertOffload(target, 2))
