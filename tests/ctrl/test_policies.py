"""Policies other than Cascade: known answers per rule, valid actions on random observations, make_policy errors."""

from __future__ import annotations

import math
import random

import pytest

from ctrl.policies import (
    POLICIES,
    GoodputPolicy,
    SGLangAdaptivePolicy,
    StaticPolicy,
    UCBPolicy,
    VLLMGoodputPolicy,
    VLLMTablePolicy,
    as_callable,
    check_action,
    make_policy,
)
from ctrl.policies.goodput import goodput_prefix, goodput_values, tree_nodes
from engine import SpecConfig
from engine.runtime.observation import KMAX, Observation

CURVE = (1.0, 1.05, 1.1, 1.5, 2.0)  # T(n)/T_AR for n = 1..5 verified tokens
BATCH_STATS = {
    1: {0: 1.0, 1: 1.1, 2: 1.2, 3: 1.6, 4: 2.0},
    8: {0: 1.5, 1: 3.0, 2: 4.5, 3: 6.0, 4: 7.5},
}
PRIOR = (0.8, 0.6, 0.4, 0.2)
KWARGS = {
    "goodput": {"cost_curve": CURVE},
    "evict": {"cost_curve": CURVE, "adaptive_depth": True},
    "vllm-table": {"table": [[1, 64, 3], [65, 128, 1], [129, 512, 0]]},
    "vllm-goodput": {"batch_stats": BATCH_STATS, "acceptance_rate_per_pos": PRIOR},
    "disco": {"adapt": True},
}


def after(i: int, depth: int, accepted: int, utility: float = 1.0, batch_size: int = 1) -> Observation:
    """The observation before round i + 1, after round i ran with K = depth."""
    return Observation(
        round_index=i + 1,
        depth_last=depth,
        accepted_last=accepted,
        committed_last=accepted + 1,
        utility_last=utility,
        batch_size=batch_size,
    )


# ---------------------------------------------------------------------------- static
def test_static_returns_its_config():
    p = StaticPolicy(depth=3, width=2, lam=0.5, verify_rule="goodput", verify_costs=CURVE)
    a = p.act(Observation())
    assert (a.depth, a.width, a.lam, a.verify_rule, a.verify_costs) == (3, 2, 0.5, "goodput", CURVE)
    assert p.act(after(5, 3, 1)) is a


# ---------------------------------------------------------------------------- UCB
def test_ucb_plays_every_arm_once_then_the_best():
    arms = [(0, 1), (1, 1), (2, 1)]
    reward = {(0, 1): 1.0, (1, 1): 1.4, (2, 1): 1.2}
    p = UCBPolicy(arms=arms, exploration=0.0)
    obs, played = Observation(), []
    for i in range(10):
        a = p.act(obs)
        played.append((a.depth, a.width))
        obs = after(i, a.depth, 0, utility=reward[played[-1]])
    assert played[:3] == arms
    assert played[3:] == [(1, 1)] * 7
    assert p.counts == [1, 7, 1]  # the 10th round's reward is still pending


def test_ucb_exploration_and_deterministic_ties():
    p = UCBPolicy(arms=[(1, 1), (2, 1)], exploration=math.sqrt(2))
    obs, played = Observation(), []
    for i in range(200):
        a = p.act(obs)
        played.append(a.depth)
        obs = after(i, a.depth, 0, utility=1.5 if a.depth == 1 else 1.0)
    assert played.count(1) > 3 * played.count(2) > 3  # UCB1 keeps exploring the worse arm, rarely
    tie = UCBPolicy(arms=[(1, 1), (2, 1), (3, 1)])
    tie.counts, tie.sums = [2, 2, 2], [2.0, 3.0, 3.0]
    assert tie.select() == 1  # equal indices -> the earlier arm


def test_ucb_learning_across_requests():
    p = UCBPolicy(arms=[(1, 1), (2, 1)])
    p.act(Observation())
    p.act(after(0, 1, 1, utility=2.0))
    p.reset()  # pending arm dropped, statistics kept
    assert p.counts == [1, 0]
    p.act(Observation(round_index=0, utility_last=9.0))  # first round of a new request: nothing credited
    assert p.counts == [1, 0]
    q = UCBPolicy(arms=[(1, 1), (2, 1)], reset_per_request=True)
    q.act(Observation())
    q.act(after(0, 1, 1, utility=2.0))
    q.reset()
    assert q.counts == [0, 0]


# ---------------------------------------------------------------------------- SGLang
def test_sglang_routes_batch_sizes_to_slots():
    p = SGLangAdaptivePolicy()
    assert [p.slot_key(b) for b in (1, 7, 8, 31, 32, 63, 64, 1000)] == [1, 1, 8, 8, 32, 32, 64, 64]
    # initial_steps = 3 where it is a candidate, else the middle candidate
    assert [p.act(Observation(batch_size=b)).depth for b in (1, 8, 32, 64)] == [3, 3, 1, 0]
    assert all(p.act(Observation(batch_size=b)).width == 1 for b in (1, 64))
    g = SGLangAdaptivePolicy(cuda_graph_bs=[1, 2, 4, 8, 16])
    assert [g.slot_key(b) for b in (3, 5, 9, 17)] == [1, 8, 8, 8]  # padded to 4, 8, 16; 17 stays 17


def _feed(p: SGLangAdaptivePolicy, accepted_of_k, n: int, batch_size: int = 1) -> list[int]:
    obs, ks = Observation(batch_size=batch_size), []
    for i in range(n):
        k = p.act(obs).depth
        ks.append(k)
        obs = after(i, k, accepted_of_k(k), batch_size=batch_size)
    return ks


def test_sglang_ema_moves_down_a_tier():
    p = SGLangAdaptivePolicy()
    ks = _feed(p, lambda k: 0, 16)
    # EMA 2.0 -> 2·0.8^15 = 0.070 after warmup 10 + interval 5; <= 1 - 0.5 - 0.25 -> steps 3 -> 1
    assert ks[:15] == [3] * 15 and ks[15] == 1
    assert p.slots[1].ema_accept_len == pytest.approx(2.0 * 0.8**15)


def test_sglang_ema_moves_up_a_tier():
    p = SGLangAdaptivePolicy()
    ks = _feed(p, lambda k: k, 21)
    # EMA -> 3 - 0.8^15 = 2.965 > 3 - 0.5 -> 5; then not > 4.5 -> stays 5 (one tier per crossing)
    assert ks[:15] == [3] * 15 and ks[15:20] == [5] * 5
    ema = 3 - 0.8**15
    for _ in range(5):
        ema = 0.8 * ema + 0.2 * 5
    assert p.slots[1].ema_accept_len == pytest.approx(ema)
    assert ema == pytest.approx(4.333, abs=1e-3) and ks[20] == 5  # 2.25 < 4.33 <= 5 - 0.5: stays


def test_sglang_zero_step_tier_and_probe():
    cfg = {"1": {"candidate_steps": [0, 2]}, "warmup_batches": 0, "update_interval": 1}
    p = SGLangAdaptivePolicy(config=cfg, initial_steps=2)
    ks = _feed(p, lambda k: 0, 10)
    # EMA 1.0·0.8^n <= 0.5 - 0.25 first at n = 7 -> steps 0; at steps 0 the EMA freezes and the next
    # recompute probes the next candidate
    assert ks[:8] == [2] * 7 + [0]
    assert ks[8] == 2
    assert p.slots[1].ema_accept_len == pytest.approx(0.8**8)


def test_sglang_feedback_goes_to_the_slot_that_chose():
    p = SGLangAdaptivePolicy()
    p.act(Observation(batch_size=1))
    p.act(after(0, 3, 3, batch_size=40))  # round 0 ran in slot 1; now the batch has 40 requests
    assert p.slots[1].batch_count == 1 and p.slots[32].batch_count == 0
    p.reset()
    assert p.slots[1].batch_count == 1  # server-wide state survives a new request


# ---------------------------------------------------------------------------- vLLM
def test_vllm_table_matches_the_documented_example():
    p = VLLMTablePolicy([[1, 64, 3], [65, 128, 1], [129, 512, 0]])
    got = [p.act(Observation(batch_size=b)).depth for b in (1, 64, 65, 128, 129, 512, 4096)]
    assert got == [3, 3, 1, 1, 0, 0, 0]


def test_vllm_table_gaps_and_cap():
    p = VLLMTablePolicy([[1, 4, 3], [10, 20, 1]], num_speculative_tokens=5)
    assert [p.act(Observation(batch_size=b)).depth for b in (4, 5, 9, 10, 21)] == [3, 3, 3, 1, 1]
    for bad in ([[1, 4, 3], [4, 8, 1]], [[2, 4, 3]], [[1, 4, 1, 100, 3]], [[1, 4, 9]], [], [[4, 1, 3]]):
        with pytest.raises(ValueError):
            VLLMTablePolicy(bad)
    with pytest.raises(ValueError, match="exceeds num_speculative_tokens"):
        VLLMTablePolicy([[1, 4, 3]], num_speculative_tokens=2)


def _goodput_argmax(rates, itl) -> int:
    g = [(1 + sum(rates[:k])) / itl[k] for k in range(len(rates) + 1)]
    return g.index(max(g))


def test_vllm_goodput_picks_argmax_per_batch_size():
    p = VLLMGoodputPolicy(BATCH_STATS, PRIOR)
    # bs 1: goodputs 1.0, 1.64, 2.0, 1.75, 1.5 -> K = 2; bs 8: 0.67, 0.6, 0.53, ... -> K = 0
    assert p.act(Observation(batch_size=1)).depth == 2 == _goodput_argmax(PRIOR, BATCH_STATS[1])
    assert p.act(Observation(batch_size=8)).depth == 0 == _goodput_argmax(PRIOR, BATCH_STATS[8])
    # bs 4: ITL interpolated 3/7 of the way from bs 1 to bs 8
    itl4 = {k: BATCH_STATS[1][k] + 3 / 7 * (BATCH_STATS[8][k] - BATCH_STATS[1][k]) for k in range(5)}
    assert p.stats_for(4) == pytest.approx(itl4)
    assert p.optimal_k(4) == _goodput_argmax(PRIOR, itl4)
    # profiled K interpolated: {0, 1, 4} -> K = 2 at 1/3 of the way from 1 to 4
    assert VLLMGoodputPolicy.itl({0: 1.0, 1: 1.3, 4: 2.2}, 2) == pytest.approx(1.6)


def test_vllm_goodput_learns_acceptance_after_warmup():
    p = VLLMGoodputPolicy(BATCH_STATS, PRIOR, warmup_steps=3)
    obs, ks = Observation(), []
    for i in range(6):
        k = p.act(obs).depth
        ks.append(k)
        obs = after(i, k, k)  # every drafted token accepted
    assert ks[:3] == [2, 2, 2]  # prior, during warmup
    # after warmup: positions 1, 2 always accepted, 3 and 4 never drafted -> rates [1, 1, 0, 0]
    assert p.acceptance_rate_per_pos == [1.0, 1.0, 0.0, 0.0]
    assert ks[3:] == [_goodput_argmax([1.0, 1.0, 0.0, 0.0], BATCH_STATS[1])] * 3
    p.reset()
    assert p.steps == 6  # engine-wide counters survive requests


# ---------------------------------------------------------------------------- EVICT goodput
def test_goodput_prefix_is_the_argmax_on_a_known_curve():
    probs = [0.5, 0.9, 0.1, 0.8]  # sorted: 0.9, 0.8, 0.5, 0.1
    g = goodput_values(probs, CURVE)
    assert g == pytest.approx([1 / 1.0, 1.9 / 1.05, 2.7 / 1.1, 3.2 / 1.5, 3.3 / 2.0])
    assert goodput_prefix(probs, CURVE) == 2
    assert goodput_prefix([0.01, 0.01], CURVE) == 0  # nothing worth its cost
    assert goodput_prefix([0.9] * 10, (1.0,) * 5) == 4  # a 5-entry curve prices at most 4 drafted nodes
    assert goodput_prefix([0.0], (1.0, 1.0)) == 0  # tie -> fewer nodes


def test_goodput_policy_hands_the_curve_to_the_engine():
    p = GoodputPolicy(CURVE)
    a = p.act(Observation())
    assert (a.depth, a.width, a.verify_rule, a.verify_costs) == (4, 1, "goodput", CURVE)
    assert GoodputPolicy(CURVE, width=2).act(Observation()).depth == 2  # 2 nodes per depth: 4 priced nodes
    assert tree_nodes(3, 2) == 6 and tree_nodes(3, 2, frontier=4) == 2 + 4 + 4 and tree_nodes(0, 3) == 0


def test_goodput_adaptive_depth_from_acceptance():
    p = GoodputPolicy(CURVE, adaptive_depth=True, headroom=1)
    acc = (0.9, 0.8, 0.1) + (0.5,) * (KMAX - 3)
    # predicted goodput: K1 1.9/1.05, K2 2.62/1.1, K3 2.692/1.5 -> K* = 2, + 1 headroom
    assert p.predicted_depth(acc) == 2
    assert p.act(Observation(acceptance_ema=acc)).depth == 3
    low = (0.01,) * KMAX
    assert p.predicted_depth(low) == 0 and p.act(Observation(acceptance_ema=low)).depth == 1  # min_depth


# ---------------------------------------------------------------------------- DISCO / SpecDec++
def test_disco_threshold_rule_and_adaptation():
    p = make_policy("disco", threshold=0.4, adapt=True, step=0.1)
    a = p.act(Observation())
    assert (a.depth, a.verify_rule, a.verify_threshold) == (KMAX, "threshold", 0.4)
    a = p.act(after(0, 3, 3))  # full path accepted: drafter underconfident -> lower threshold
    assert a.verify_threshold == pytest.approx(0.4 - 0.1 * 0.6)
    a = p.act(after(1, 3, 0))  # rejected: raise it
    assert a.verify_threshold == pytest.approx(0.34 + 0.1 * 0.4)
    for i in range(100):
        a = p.act(after(i + 2, 3, 0))
    assert a.verify_threshold == pytest.approx(0.99)  # clipped at max_threshold
    p.reset()
    assert p.act(Observation()).verify_threshold == pytest.approx(0.4)
    fixed = make_policy("disco", threshold=0.4)
    assert fixed.act(after(0, 3, 0)).verify_threshold == 0.4


# ---------------------------------------------------------------------------- every policy
def _random_obs(rng: random.Random) -> Observation:
    depth = rng.randint(0, KMAX)
    accepted = rng.randint(0, depth)
    return Observation(
        acceptance_ema=tuple(rng.random() for _ in range(KMAX)),
        accepted_last=accepted,
        committed_last=accepted + 1,
        depth_last=depth,
        width_last=rng.randint(0, 4),
        confidence_last=tuple(rng.random() for _ in range(KMAX)),
        utility_last=rng.choice([0.0, rng.uniform(0, 4), 1.0]),
        cost_last=rng.choice([0.0, rng.uniform(1e-4, 1.0)]),
        cost_ar=rng.choice([0.0, rng.uniform(1e-4, 0.1)]),
        position=rng.randint(0, 500),
        max_new_tokens=512,
        batch_size=rng.choice([1, 2, 7, 8, 33, 64, 200, 600]),
        round_index=rng.choice([0, rng.randint(1, 300)]),
    )


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_actions_valid_on_random_observations(name):
    rng = random.Random(sum(map(ord, name)))
    policy = make_policy(name, **KWARGS.get(name, {}))
    fn = as_callable(policy)
    for _ in range(200):
        a = fn(_random_obs(rng))
        assert isinstance(a, SpecConfig) and 0 <= a.depth <= KMAX and a.width >= 1
        assert check_action(a) is a


def test_check_action_rejects_invalid():
    with pytest.raises(ValueError):
        check_action(SpecConfig(depth=KMAX + 1, width=1))
    with pytest.raises(ValueError):
        check_action({"depth": 2})


# ---------------------------------------------------------------------------- make_policy
def test_make_policy_names_and_alias():
    assert isinstance(make_policy("evict", cost_curve=CURVE), GoodputPolicy)
    assert make_policy("static").name == "static"
    with pytest.raises(ValueError, match="cascade") as e:
        make_policy("nope")
    assert "vllm-goodput" in str(e.value) and "sglang-adaptive" in str(e.value)


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("cascade", {"kmax": 3}),  # unknown argument name
        ("cascade", {"k_max": 0}),
        ("cascade", {"tolerance": -0.1}),
        ("cascade", {"k_init": 5, "k_max": 4}),
        ("static", {"depth": KMAX + 1}),
        ("static", {"verify_rule": "goodput"}),  # needs verify_costs
        ("static", {"verify_costs": ["a"]}),
        ("ucb", {"arms": []}),
        ("ucb", {"arms": [(KMAX + 1, 1)]}),
        ("ucb", {"arms": [(1, 1), (1, 1)]}),
        ("ucb", {"exploration": -1.0}),
        ("goodput", {}),  # cost curve is required
        ("goodput", {"cost_curve": [1.0]}),
        ("goodput", {"cost_curve": [1.0, -2.0]}),
        ("goodput", {"cost_curve": CURVE, "depth": 5}),  # the curve prices K <= 4
        ("sglang-adaptive", {"config": {"1": {"candidate_steps": [KMAX + 1]}}}),
        ("sglang-adaptive", {"config": {"x": 1}}),
        ("sglang-adaptive", {"config": {"strategy": "throughput_aware", "1": {"candidate_steps": [1]}}}),
        ("vllm-table", {"table": [[1, 4, 3], [3, 8, 1]]}),
        ("vllm-goodput", {"batch_stats": {8: {0: 1.0, 1: 1.1, 4: 2.0}}, "acceptance_rate_per_pos": PRIOR}),
        ("vllm-goodput", {"batch_stats": {1: {0: 1.0, 1: 1.1}}, "acceptance_rate_per_pos": PRIOR}),
        ("vllm-goodput", {"batch_stats": BATCH_STATS, "acceptance_rate_per_pos": [1.5]}),
        ("disco", {"threshold": 1.5}),
        ("disco", {"depth": 0}),
        ("disco", {"adapt": "yes"}),
    ],
)
def test_make_policy_bad_arguments(name, kwargs):
    with pytest.raises(ValueError):
        make_policy(name, **kwargs)
