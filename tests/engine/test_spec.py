"""Exact speculative decoding on real (tiny random) models: greedy equality, seeds, batching, KV."""

from __future__ import annotations

import pytest
import torch

import engine
from engine.spec.sampling import SamplingParams
from engine.zoo.train_lm import use_bf16_autocast

PROMPTS = [[5, 7, 9, 11, 3, 5, 7, 9, 11], [1, 2], [40, 41, 42, 43, 44, 45, 46, 47, 48], [60]]
SPECS = [
    engine.SpecConfig(depth=4, width=1),
    engine.SpecConfig(depth=3, width=2),
    engine.SpecConfig(depth=5, width=3, max_verify=8),
    engine.SpecConfig(depth=2, width=4, frontier=2),
]


@pytest.fixture(scope="module")
def target(tiny_moe_dir):
    return engine.load_model(tiny_moe_dir)


@pytest.fixture(scope="module")
def baseline(target):
    return [r.token_ids for r in engine.Engine(target).generate(PROMPTS, 24)]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"K{s.depth}W{s.width}")
def test_self_drafter_accepts_everything(target, tiny_moe_dir, baseline, spec):
    eng = engine.Engine(target, drafter=engine.load_model(tiny_moe_dir), check_kv=True)
    res = eng.generate(PROMPTS, 24, spec=spec)
    assert [r.token_ids for r in res] == baseline
    full = [r for x in res for r in x.rounds if r.built_depth == spec.depth and r.proposed > 0]
    if spec.width == 1:  # a chain of the target's own argmaxes: every round commits K + 1
        assert all(r.accepted == r.built_depth == r.depth and r.bonus for r in full)
    else:  # a bounded frontier may prune the argmax path; most rounds still accept a whole path
        assert sum(r.bonus for r in full) >= 0.6 * len(full)
    eng.kv.check_quiescent()


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"K{s.depth}W{s.width}")
def test_random_drafter_is_exact_and_rarely_accepted(target, tiny_dense_dir, baseline, spec):
    eng = engine.Engine(target, drafter=engine.load_model(tiny_dense_dir), check_kv=True)
    res = eng.generate(PROMPTS, 24, spec=spec)
    assert [r.token_ids for r in res] == baseline
    rounds = [r for x in res for r in x.rounds]
    assert sum(r.accepted for r in rounds) / sum(r.proposed for r in rounds) < 0.2
    eng.kv.check_quiescent()


@pytest.mark.parametrize("spec", SPECS[:2], ids=lambda s: f"K{s.depth}W{s.width}")
def test_ngram_drafter_is_exact(target, baseline, spec):
    eng = engine.Engine(target, drafter="ngram", check_kv=True)
    res = eng.generate(PROMPTS, 24, spec=spec)
    assert [r.token_ids for r in res] == baseline


def test_ngram_accepts_on_repetitive_text(target):
    # a target that repeats a cycle is predicted perfectly by prompt lookup once the cycle is seen
    base = engine.Engine(target).generate([PROMPTS[0]], 60)[0].token_ids
    res = engine.Engine(target, drafter="ngram").generate([PROMPTS[0]], 60, spec=engine.SpecConfig(depth=4))[0]
    assert res.token_ids == base
    if len(set(base[-20:])) < 10:  # the random model fell into a loop: lookup must profit
        assert res.acceptance_length > 1.5


def test_zero_draft_rounds_consume_randomness_like_plain_decoding(target, tiny_dense_dir):
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=123)
    plain = engine.Engine(target).generate(PROMPTS, 20, sampling=params)
    k0 = engine.Engine(target, drafter=engine.load_model(tiny_dense_dir)).generate(
        PROMPTS, 20, sampling=params, spec=engine.SpecConfig(depth=0)
    )
    assert [r.token_ids for r in k0] == [r.token_ids for r in plain]


@pytest.mark.parametrize("spec", SPECS[:2], ids=lambda s: f"K{s.depth}W{s.width}")
def test_seeded_speculative_sampling_is_bit_identical_and_batch_independent(target, tiny_dense_dir, spec):
    eng = engine.Engine(target, drafter=engine.load_model(tiny_dense_dir), check_kv=True)
    params = [SamplingParams(temperature=0.8, top_k=30, top_p=0.9, seed=7 + i) for i in range(len(PROMPTS))]
    a = eng.generate(PROMPTS, 20, sampling=params, spec=spec)
    b = eng.generate(PROMPTS, 20, sampling=params, spec=spec)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    for i, p in enumerate(PROMPTS):
        assert eng.generate([p], 20, sampling=[params[i]], spec=spec)[0].token_ids == a[i].token_ids
    eng.kv.check_quiescent()


def test_kv_after_mixed_traffic(target, tiny_dense_dir):
    """Finishes, EOS, rejections and varying K: committed slots always hold committed K/V (check_kv),
    and all blocks of both caches are free at the end."""
    eng = engine.Engine(target, drafter=engine.load_model(tiny_dense_dir), block_size=4, check_kv=True)
    base = engine.Engine(target).generate(PROMPTS, 16)
    eos = base[0].token_ids[5]
    calls = iter(range(10_000))

    def policy(obs):
        i = next(calls)
        return (i % 4, 1 + i % 3, 0.0)

    params = [
        SamplingParams(),
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(),
        SamplingParams(temperature=0.5, seed=2),
    ]
    res = eng.generate(PROMPTS, 16, sampling=params, policy=policy, eos_token_id=eos)
    assert res[0].finish_reason == "eos"
    assert res[0].token_ids == base[0].token_ids[:6]
    eng.kv.check_quiescent()
    eng.drafter.kv.check_quiescent()


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: engine.SpecConfig(depth=17), "depth"),
        (lambda: engine.SpecConfig(depth=-1), "depth"),
        (lambda: engine.SpecConfig(width=0), "width"),
        (lambda: engine.SpecConfig(width=9), "width"),
        (lambda: engine.SpecConfig(lam=-0.5), "lam"),
        (lambda: SamplingParams(temperature=-0.1), "temperature"),
        (lambda: SamplingParams(top_p=0.0), "top_p"),
        (lambda: SamplingParams(top_p=1.01), "top_p"),
    ],
)
def test_bad_spec_and_sampling(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_policy_action_out_of_range_fails_before_any_token(target, tiny_dense_dir):
    eng = engine.Engine(target, drafter=engine.load_model(tiny_dense_dir))
    with pytest.raises(ValueError, match="depth"):
        eng.generate(PROMPTS, 8, policy=lambda obs: (99, 1, 0.0))
    eng.kv.check_quiescent()
    eng.drafter.kv.check_quiescent()


def test_round_stats_footprint_virtual_ep_and_modelled_cost(target, tiny_dense_dir):
    from engine.cost.roofline import RooflineCost, load_hardware, model_spec_from_hf_config
    from engine.parallel.placement import place_experts

    cfg = target.config
    placement = place_experts(cfg.num_experts, 2, "contiguous", ranks_per_node=1)
    cost = RooflineCost(load_hardware("h200"), model_spec_from_hf_config(cfg.raw))
    eng = engine.Engine(target, drafter=engine.load_model(tiny_dense_dir), virtual_ep=placement, cost_model=cost,
                        timing=True)  # fmt: skip
    res = eng.generate(PROMPTS[:2], 12, spec=engine.SpecConfig(depth=3, width=2))
    for r in (r for x in res for r in x.rounds):
        n = r.verified_tokens
        assert len(r.distinct_experts) == len(cfg.moe_layers)
        assert all(1 <= u <= min(cfg.num_experts, n * cfg.top_r) for u in r.distinct_experts)
        assert int(r.tokens_per_expert.sum()) == n * cfg.top_r * len(cfg.moe_layers)
        assert r.reuse == pytest.approx(1 - sum(r.distinct_experts) / (n * cfg.top_r * len(cfg.moe_layers)))
        assert r.rank_imbalance_mean >= 1.0 and r.rank_imbalance_max >= r.rank_imbalance_mean
        assert 0.0 <= r.cross_node_ratio <= 1.0
        assert r.modelled_seconds > 0
        for phase in ("draft", "attention", "router", "experts", "combine", "sampling", "forward"):
            assert phase in r.time  # timing=True: the forward's phases too
    later = [r for x in res for r in x.rounds[1:] if r.verified_tokens > 1]  # round 0 verified a tree
    assert later and all(r.overlap_prev is not None and 0 <= r.overlap_prev <= 1 for r in later)
    assert all(r.overlap_prev is None for x in res for r in x.rounds if r.verified_tokens == 1)  # not observed


def test_one_token_steps_record_no_routing_and_keep_the_last_tree(target, tiny_dense_dir, monkeypatch):
    """A step whose requests all verify one token (K = 0) records no routing unless asked (`plain_routing`): its
    footprint is still r experts per MoE layer, its overlap is not observed, and the next tree's overlap is with the
    tree before it. Tokens, footprints and overlaps equal an engine that records every step."""
    drafter = engine.load_model(tiny_dense_dir)
    depths = [3, 0, 0, 2, 0, 3, 0]

    def policy(obs):
        return engine.SpecConfig(depth=depths[min(obs.round_index, len(depths) - 1)], width=2)

    recorded: list[bool] = []
    forward = type(target).forward_batch

    def spy(self, *args, **kwargs):
        if self is target and "record_routing" in kwargs:  # the rounds' forwards (not the prefill, not the drafter)
            recorded.append(kwargs["record_routing"])
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(target), "forward_batch", spy)
    (lean,) = engine.Engine(target, drafter=drafter).generate(PROMPTS[:1], 16, policy=policy)
    lean_recorded, recorded[:] = list(recorded), []
    (full,) = engine.Engine(target, drafter=drafter, plain_routing=True).generate(PROMPTS[:1], 16, policy=policy)
    assert lean.token_ids == full.token_ids and len(lean.rounds) == len(full.rounds) >= 6
    assert lean_recorded == [r.verified_tokens > 1 for r in lean.rounds] and len(recorded) == len(full.rounds)
    assert all(recorded)
    (bare,) = engine.Engine(target, drafter=drafter, instrument=False).generate(PROMPTS[:1], 16, policy=policy)
    assert bare.token_ids == lean.token_ids and all(r.distinct_experts == [] for r in bare.rounds)  # no footprint
    L, r_top = len(target.config.moe_layers), target.config.top_r
    for a, b in zip(lean.rounds, full.rounds):
        assert (a.distinct_experts, a.overlap_prev, a.new_pairs_per_node) == (
            b.distinct_experts, b.overlap_prev, b.new_pairs_per_node)  # fmt: skip
        if a.verified_tokens == 1:
            assert a.distinct_experts == [r_top] * L and a.overlap_prev is None and a.reuse == 0.0
            assert a.tokens_per_expert is None and int(b.tokens_per_expert.sum()) == L * r_top
    trees = [i for i, x in enumerate(full.rounds) if x.verified_tokens > 1]
    assert trees[:3] == [0, 3, 5]
    for before, i in zip(trees, trees[1:]):  # overlap with the last tree, across the one-token rounds between
        now, prev = full.rounds[i].tokens_per_expert > 0, full.rounds[before].tokens_per_expert > 0
        assert lean.rounds[i].overlap_prev == pytest.approx(int((now & prev).sum()) / int(now.sum()))


def test_virtual_ep_must_match_the_target(target):
    from engine.parallel.placement import place_experts

    with pytest.raises(ValueError, match="experts"):
        engine.Engine(target, virtual_ep=place_experts(8, 2, "contiguous"))


@pytest.mark.skipif(
    not use_bf16_autocast("auto"),
    reason="bf16 CPU matmuls without native bf16 dot products (avx512_bf16 / amx_bf16) are not batch-invariant: "
    "verifying n tokens can flip a near-tie that decoding one token does not (fails with the C++ kernels off too)",
)
def test_bf16_target_with_fp32_drafter_on_another_backend(tiny_moe_dir, tiny_dense_dir):
    target16 = engine.load_model(tiny_moe_dir, dtype=torch.bfloat16)
    base = engine.Engine(target16).generate(PROMPTS, 16)
    eng = engine.Engine(target16, drafter=engine.load_model(tiny_dense_dir, dtype=torch.float32), backend="torch")
    res = eng.generate(PROMPTS, 16, spec=engine.SpecConfig(depth=3, width=2))
    assert [r.token_ids for r in res] == [r.token_ids for r in base]
    assert eng.drafter.kv.k.dtype == torch.float32 and eng.kv.k.dtype == torch.bfloat16


def _dense_predictor(target, drafter, input_kind="dense"):
    from engine.models.expert_predictor import ExpertPredictor, ExpertPredictorConfig

    cfg = target.config
    torch.manual_seed(0)
    return ExpertPredictor(
        ExpertPredictorConfig(
            in_features=drafter.config.hidden_size,
            hidden_size=32,
            num_experts=cfg.num_experts,
            top_r=cfg.top_r,
            moe_layers=tuple(cfg.moe_layers),
            input=input_kind,
        )
    )


def test_dense_drafter_with_expert_predictor_selects_and_stays_exact(target, tiny_dense_dir, baseline):
    from engine.drafting.model_drafter import ModelDrafter

    drafter_model = engine.load_model(tiny_dense_dir)
    drafter = ModelDrafter(drafter_model, predictor=_dense_predictor(target, drafter_model))
    eng = engine.Engine(target, drafter=drafter, check_kv=True)
    for score in ("ecospec", "logp"):
        spec = engine.SpecConfig(depth=3, width=2, frontier=3, max_verify=4, lam=1.0, score=score)
        res = eng.generate(PROMPTS, 24, spec=spec)
        assert [r.token_ids for r in res] == baseline
        assert all(r.verified_tokens <= 5 for x in res for r in x.rounds)
        assert any(r.verified_tokens == 5 for x in res for r in x.rounds)
    eng.kv.check_quiescent()
    drafter.kv.check_quiescent()


def test_dense_drafter_rejects_a_predictor_of_other_features(target, tiny_dense_dir):
    from engine.drafting.model_drafter import ModelDrafter

    drafter_model = engine.load_model(tiny_dense_dir)
    with pytest.raises(ValueError, match="hidden states"):
        ModelDrafter(drafter_model, predictor=_dense_predictor(target, drafter_model, "eagle"))
