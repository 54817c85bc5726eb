"""Live-v0: the Gymnasium / SB3 contract, and replay == live for static policies (greedy and seeded sampling)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from conftest import SMALL_GRID, TRACE_TOKENS  # noqa: E402
from gymnasium.utils.env_checker import check_env as gym_check_env
from stable_baselines3.common.env_checker import check_env as sb3_check_env

import env  # noqa: F401
from engine.spec.config import SpecConfig
from env.live import LiveEnv
from env.replay import ReplayEnv

COSTS = {
    "roofline-target": {"kind": "roofline", "model_spec": "target", "hardware": "h100"},
    "roofline-qwen3-30b": {"kind": "roofline", "model_spec": "qwen3_30b_a3b", "hardware": "h200"},
}
FIELDS = (
    "accepted",
    "committed",
    "verified_tokens",
    "built_depth",
    "distinct_experts",
    "bonus",
    "rejection_depth",
    "attempted_by_depth",
    "accepted_by_depth",
    "new_pairs_per_node",
    "reuse",
    "overlap_prev",
    "cost",
    "cost_ar",
)


@pytest.fixture
def live_factory(zoo_models):
    made = []

    def make(**kw):
        for e in made:  # the envs share one drafter: only one open session at a time
            e.close()
        kw.setdefault("grid", SMALL_GRID)
        kw.setdefault("cost", COSTS["roofline-target"])
        e = LiveEnv(models=zoo_models, num_prompts=2, max_new_tokens=TRACE_TOKENS, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


@pytest.mark.parametrize("kind", ["multidiscrete", "box"])
def test_gymnasium_and_sb3_checkers(live_factory, kind):
    e = live_factory(action_kind=kind)
    gym_check_env(e, skip_render_check=True)
    sb3_check_env(e, warn=True)


@pytest.fixture(scope="module")
def acceptance(greedy_trace):
    from env.calibration import fit_acceptance

    return fit_acceptance([(greedy_trace, list(range(greedy_trace.num_requests)))], min_samples=5)


def _static_policies(replay, acceptance=None):
    costs = replay.cost_model.verify_costs(24)
    calibrated = [] if acceptance is None else [
        (f"K8 W{w} calibrated {t}", SpecConfig(depth=8, width=w, verify_rule="calibrated", verify_threshold=t,
                                               acceptance=acceptance))
        for w, t in ((1, 0.3), (3, 0.2), (2, 0.6))
    ]  # fmt: skip
    return calibrated + [
        ("K4 W2 all", np.array([3, 1, 0, 0])),
        ("K8 W3 threshold 0.1", np.array([4, 2, 0, 1])),
        ("K1 W1", np.array([1, 0, 0, 0])),
        ("K6 W3 λ=1 budget 6", SpecConfig(depth=6, width=3, lam=1.0, max_verify=6)),
        ("K8 W2 goodput", SpecConfig(depth=8, width=2, verify_rule="goodput", verify_costs=costs)),
    ]


@pytest.mark.parametrize("trace_name", ["greedy_trace", "sampled_trace"])
@pytest.mark.parametrize("cost_name", list(COSTS))
def test_replay_equals_live(request, live_factory, trace_name, cost_name, acceptance):
    trace = request.getfixturevalue(trace_name)
    cost = COSTS[cost_name]
    s = trace.meta["sampling"]
    sampling = None if s["temperature"] == 0 else {"temperature": s["temperature"], "seed": s["seed"]}
    replay = ReplayEnv(trace, grid=SMALL_GRID, cost=cost, cache=False)
    live = live_factory(cost=cost, sampling=sampling)
    assert live.prompts == [trace.prompt(i).tolist() for i in range(trace.num_requests)]
    for name, action in _static_policies(replay, acceptance):
        _same_episodes(replay, live, trace, name, [action], tol=(1e-4, 1e-6, 1e-5))


def _same_episodes(replay, live, trace, name, actions, tol) -> list:
    """Every request of `trace` in both envs, round i of each taking `actions[i % len(actions)]` (one action: a
    static policy): the same rounds, rewards and observations (draft confidence and observation to `tol` = (rel, abs,
    obs atol)); returns replay's rounds of every episode, in order."""
    rounds = []
    for req in range(trace.num_requests):
        o1, _ = replay.reset(options={"request": req})
        o2, _ = live.reset(options={"request": req})
        assert np.array_equal(o1, o2)
        for i in itertools.count():
            action = actions[i % len(actions)]
            o1, r1, t1, u1, _ = replay.step(action)
            o2, r2, t2, u2, _ = live.step(action)
            a, b = replay.rounds[-1], live.session.requests[0].rounds[-1]
            for f in FIELDS:
                assert getattr(a, f) == getattr(b, f), (name, req, len(replay.rounds), f)
            assert a.draft_confidence == pytest.approx(b.draft_confidence, rel=tol[0], abs=tol[1])
            assert (r1, t1, u1) == (r2, t2, u2), (name, req)
            np.testing.assert_allclose(o1, o2, atol=tol[2])
            rounds.append(a)
            if t1 or u1:
                break
        assert live.session.results()[0].token_ids == trace.continuation_of(req).tolist()
    return rounds


@pytest.mark.parametrize("cost_name", list(COSTS))
def test_replay_equals_live_across_one_token_rounds(greedy_trace, live_factory, cost_name):
    """Trees with one-token rounds between them: neither env observes a one-token round's overlap, and both take
    the next tree's overlap against the tree before (engine.runtime.round_record); recorded routing and the what-if
    router (another model spec) alike."""
    cycle = [np.array(a) for a in ([3, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [2, 2, 0, 1], [0, 0, 0, 0])]
    replay = ReplayEnv(greedy_trace, grid=SMALL_GRID, cost=COSTS[cost_name], cache=False)
    live = live_factory(cost=COSTS[cost_name])
    rounds = _same_episodes(replay, live, greedy_trace, cost_name, cycle, tol=(1e-4, 1e-6, 1e-5))
    assert all(r.overlap_prev is None for r in rounds if r.verified_tokens == 1)
    # a tree two one-token rounds after the last one (its depth-2 action), its overlap observed
    assert any(r.depth == 2 and r.verified_tokens > 1 and r.overlap_prev is not None for r in rounds)


def test_live_episode_validates_in_replay(greedy_trace, live_factory):
    live = live_factory(cost=COSTS["roofline-qwen3-30b"])
    replay = ReplayEnv(greedy_trace, grid=SMALL_GRID, cost=COSTS["roofline-qwen3-30b"], cache=False)
    live.action_space.seed(4)
    live.reset(seed=4)
    while True:
        *_, term, trunc, _ = live.step(live.action_space.sample())
        if term or trunc:
            break
    state = live.episode_state()
    res = replay.validate(state)
    assert res["ok"], res["mismatches"][:3]


def test_batch_variant_prices_the_union(live_factory):
    e = live_factory(batch_size=2)
    e.reset(seed=0)
    _, r, term, trunc, info = e.step(np.array([3, 1, 0, 0]))
    assert np.isfinite(r) and info["committed"] >= 2
    rounds = [req.rounds[-1] for req in e.session.requests]
    assert info["distinct_experts"] <= sum(sum(x.distinct_experts) for x in rounds)
    assert info["verified"] == sum(x.verified_tokens for x in rounds)
    while not (term or trunc):
        *_, term, trunc, info = e.step(e.action_space.sample())


def test_replay_equals_live_with_the_prompt_lookup_drafter(ngram_models, ngram_trace):
    """The n-gram drafter's trees, scores and verification rules (threshold, calibrated) in the live engine are
    exactly what replay cuts from its recorded trees."""
    from env.calibration import fit_acceptance

    trace = ngram_trace
    acceptance = fit_acceptance([(trace, list(range(trace.num_requests)))], min_samples=5)
    cost = COSTS["roofline-qwen3-30b"]
    replay = ReplayEnv(trace, grid=SMALL_GRID, cost=cost, cache=False)
    live = LiveEnv(models=ngram_models, num_prompts=2, max_new_tokens=TRACE_TOKENS, grid=SMALL_GRID, cost=cost,
                   workload_name="code")  # fmt: skip
    try:
        assert live.prompts == [trace.prompt(i).tolist() for i in range(trace.num_requests)]
        assert replay.cost_model.drafter.spec.kind == "lookup"
        policies = [p for p in _static_policies(replay, acceptance) if "λ" not in p[0]]  # no expert predictor
        policies += [
            (f"K8 W{w} threshold {t}", SpecConfig(depth=8, width=w, verify_rule="threshold", verify_threshold=t))
            for w, t in ((1, 0.3), (2, 0.05))
        ]
        tol = (1e-6, 1e-7, 1e-6)
        accepted = sum(r.accepted for name, action in policies
                       for r in _same_episodes(replay, live, trace, name, [action], tol))  # fmt: skip
        assert accepted > 0
    finally:
        live.close()


def test_replay_equals_live_with_the_lookup_s_probe(ngram_models, ngram_trace):
    """probe=True: the observation's `confidence_now` (the engine's Session.probe of tree(Kmax, max W) before the
    choice) is what replay reads from the trace, its `match_now` what replay computes from the trace's tokens
    (probed_sources), both equal to live's; and a round that then drafts nothing pays the probe's price in both
    (K = 0 rounds dearer than without the probe, drafted rounds not)."""
    from engine.runtime.observation import KMAX
    from env.probes import probed_sources

    trace = ngram_trace
    cost = COSTS["roofline-qwen3-30b"]
    replay = ReplayEnv(trace, grid=SMALL_GRID, cost=cost, cache=False, probe=True)
    plain = ReplayEnv(trace, grid=SMALL_GRID, cost=cost, cache=False)
    live = LiveEnv(models=ngram_models, num_prompts=2, max_new_tokens=TRACE_TOKENS, grid=SMALL_GRID, cost=cost,
                   workload_name="code", probe=True)  # fmt: skip
    try:
        assert replay.probe == live.probe == (8, 3)
        policies = [
            ("K0", SpecConfig(depth=0)),
            ("K4 W2", SpecConfig(depth=4, width=2)),
            ("K8 W1 threshold", SpecConfig(depth=8, width=1, verify_rule="threshold", verify_threshold=0.1)),
        ]
        for name, action in policies:
            _same_episodes(replay, live, trace, name, [action], tol=(1e-6, 1e-7, 1e-6))
        probed = found = 0
        sources = probed_sources(trace)
        for req in range(trace.num_requests):
            obs, _ = replay.reset(options={"request": req})
            plain.reset(options={"request": req})
            while True:
                p, t = replay.current_position, replay.position
                row = trace.confidence[p, trace.widths.index(3), :KMAX]
                assert np.array_equal(obs[-KMAX - 2 : -2], np.clip(row, 0, 1)), (req, p)
                # then where the lookup's match comes from (none where nothing could be drafted: no probe)
                source = sources[p] if trace.meta["max_new_tokens"] - t - 1 > 0 else (0.0, 0.0)
                assert np.array_equal(obs[-2:], np.float32(source)), (req, p)
                probed += bool(row.any())
                found += source[0] > 0
                obs, _, term, trunc, info = replay.step(SpecConfig(depth=0))
                _, _, _, _, ref = plain.step(SpecConfig(depth=0))
                if trace.meta["max_new_tokens"] - t - 1 > 0:  # a probe (none where nothing could be drafted)
                    assert info["cost"] > ref["cost"], (req, p)
                else:
                    assert info["cost"] == ref["cost"]
                assert info["cost_draft"] == pytest.approx(info["cost"] - ref["cost"] + ref["cost_draft"])
                if term or trunc:
                    break
        assert probed > 0 and found > 0
        drafted = replay.codec.encode((3, 1, 0, 0))  # K = 4, W = 2: the probe's match is its drafting's
        replay.reset(options={"request": 0})
        plain.reset(options={"request": 0})
        assert replay.step(drafted)[4]["cost"] == plain.step(drafted)[4]["cost"]
    finally:
        live.close()


@pytest.mark.parametrize("cost_name", ["roofline-qwen3-30b", "fitted"])
def test_replay_equals_live_with_the_context_probe(greedy_trace, live_factory, cost_name):
    """probe=True with a drafter without a probe (the EAGLE head): live's Session.probe runs the context probe
    (engine.runtime.context_probe) over the request's tokens, replay recomputes it from the trace's tokens; the
    observations, rounds and rewards agree, every round paying the probe's price in both (the fitted kind: the
    cost model's price, as replay, not the measured seconds)."""
    from engine.runtime.observation import KMAX

    cost = COSTS.get(cost_name, {"kind": "fitted"})
    replay = ReplayEnv(greedy_trace, grid=SMALL_GRID, cost=cost, cache=False, probe=True)
    live = live_factory(cost=cost, probe=True, fit_trace=greedy_trace) if cost_name == "fitted" else live_factory(
        cost=cost, probe=True)  # fmt: skip
    assert replay.probe == live.probe and not replay._own_probe and not live._own_probe
    cycle = [SpecConfig(depth=0), SpecConfig(depth=3, width=2), SpecConfig(depth=2, width=1)]
    rounds = _same_episodes(replay, live, greedy_trace, cost_name, cycle, tol=(1e-4, 1e-6, 1e-5))
    assert rounds and live.session.requests[0].rounds[-2].probe_seconds > 0
    assert any(v and v[KMAX] > 0 for v in replay._probe_rows)  # a match was found (and observed alike) somewhere


def test_the_probe_is_priced_from_its_timing_in_place(ngram_trace, greedy_trace):
    """The lookup's probe is timed where a probing policy runs it: before each live K = 0 round of the host
    calibration (Session.probe after the previous round's forward), and the fitted cost prices it from those samples;
    a drafter without a probe (the EAGLE head) has the context probe timed so (engine.runtime.context_probe)."""
    from engine.cost.host_cost import fit_probe_cost
    from env.costs import FittedCostModel, live_fit_rounds

    a = ngram_trace.arrays
    probed = a["cal_live_probe_seconds"] > 0
    k0 = ~a["cal_live_plain"] & (a["cal_live_draft_steps"] == 0) & (a["cal_live_verified"] == 1)
    assert probed.sum() >= 3 and not (probed & ~k0).any()  # K = 0 rounds only (the last one of a request: no probe)
    cm = FittedCostModel.from_trace(ngram_trace)
    probed &= live_fit_rounds(a)  # steady rounds that kept their kind: the others carry the surcharges
    assert cm.probe_fit == fit_probe_cost(a["cal_live_context"][probed], a["cal_live_probe_seconds"][probed])
    g = greedy_trace.arrays
    timed = g["cal_live_probe_seconds"] > 0
    assert timed.sum() >= 3 and not (timed & ~(~g["cal_live_plain"] & (g["cal_live_draft_steps"] == 0))).any()
    timed &= live_fit_rounds(g)
    assert FittedCostModel.from_trace(greedy_trace).probe_fit == fit_probe_cost(
        g["cal_live_context"][timed], g["cal_live_probe_seconds"][timed])  # fmt: skip


def test_the_choice_is_priced_from_its_timing_in_place(ngram_trace, greedy_trace):
    """A learned controller's choice is timed where the engine's session makes it: before each live K = 0 round of
    the host calibration, after the probe, by a stand-in of its shape (engine.runtime.frozen.stand_in_policy); the
    fitted cost prices it at their mean plus what those rounds cost more than the bare K = 0 run's
    (env.costs.fit_choice: the caches the probe and choice cooled), and the roofline at CHOICE_HOST_SECONDS. Both
    drafters time it (the EAGLE head's policies choose too)."""
    from env.cost_model import CHOICE_HOST_SECONDS
    from env.costs import FittedCostModel, bare_k0_rounds, fit_choice, live_fit_rounds

    for trace in (ngram_trace, greedy_trace):
        a = trace.arrays
        chose = a["cal_live_policy_seconds"] > 0
        k0 = ~a["cal_live_plain"] & (a["cal_live_draft_steps"] == 0) & (a["cal_live_verified"] == 1)
        assert chose.sum() >= 3 and not (chose & ~k0).any()  # the K = 0 action's rounds (K > 0 ends with one too)
        chose &= live_fit_rounds(a)  # its steady rounds that kept their kind
        cm = FittedCostModel.from_trace(trace)
        assert cm.choice_seconds == pytest.approx(float(a["cal_live_policy_seconds"][chose].astype(np.float64).mean()))
        rows = live_fit_rounds(a)
        bare = bare_k0_rounds(a, rows)
        assert bare.any() and (a["cal_live_policy_seconds"][bare] == 0).all()
        assert (cm.choice_seconds, cm.choice_cooling) == fit_choice(a, rows, bare) and cm.choice_cooling >= 0
        assert cm.choice() == pytest.approx(cm.choice_seconds + cm.choice_cooling) and 0 < cm.choice() < 1e-3
    roof = ReplayEnv(greedy_trace, grid=SMALL_GRID, cost=COSTS["roofline-qwen3-30b"], cache=False)
    assert roof.cost_model.choice() == CHOICE_HOST_SECONDS


@pytest.mark.parametrize("cost_name", ["roofline-qwen3-30b", "fitted"])
def test_choice_true_adds_the_choice_to_every_round_in_replay_and_live(ngram_models, ngram_trace, cost_name):
    """choice=True: every round costs the cost model's `choice` more than without it, on the grid and off it, in
    replay and live alike (`info["cost_choice"]`), and the rest of the round is unchanged."""
    trace = ngram_trace
    cost = COSTS.get(cost_name, {"kind": "fitted"})
    priced = ReplayEnv(trace, grid=SMALL_GRID, cost=cost, cache=False, choice=True, probe=True)
    plain = ReplayEnv(trace, grid=SMALL_GRID, cost=cost, cache=False, probe=True)
    c = priced.cost_model.choice()
    assert c > 0 and priced.choice_cost == c and plain.choice_cost == 0.0
    actions = [priced.codec.encode((0, 0, 0, 0)), priced.codec.encode((3, 1, 0, 0)), SpecConfig(depth=5, width=2)]
    for req in range(trace.num_requests):
        priced.reset(options={"request": req})
        plain.reset(options={"request": req})
        for i in itertools.count():
            a = actions[i % len(actions)]
            _, r1, t1, u1, i1 = priced.step(a)
            _, r2, t2, u2, i2 = plain.step(a)
            assert i1["committed"] == i2["committed"] and i1["cost_choice"] == c and i2["cost_choice"] == 0.0
            assert i1["cost"] == pytest.approx(i2["cost"] + c, rel=1e-12)
            assert r1 == pytest.approx(r2 - c / i2["cost_ar"], rel=1e-9, abs=1e-12)
            if t1 or u1:
                break
    live = LiveEnv(models=ngram_models, num_prompts=2, max_new_tokens=TRACE_TOKENS, grid=SMALL_GRID,
                   cost=cost, workload_name="code", probe=True, choice=True,
                   fit_trace=trace if cost_name == "fitted" else None)  # fmt: skip
    try:
        assert live.choice_seconds == pytest.approx(c)
        if cost_name == "roofline-qwen3-30b":  # deterministic prices: the same rounds and costs as replay
            _same_episodes(priced, live, trace, "K4 W2", [SpecConfig(depth=4, width=2)], (1e-6, 1e-7, 1e-6))
        live.reset(options={"request": 0})
        assert live.step(SpecConfig(depth=0))[4]["cost_choice"] == pytest.approx(c)
    finally:
        live.close()


def test_replay_equals_live_under_the_warm_up_and_switching_surcharges(greedy_trace, live_factory, monkeypatch):
    """The fitted cost's warm-up surcharge (engine.cost.warmup) and switching surcharge (engine.cost.switching): live
    prices each round by its index in the request, by the kind of the request's round before it, and T_AR by its
    position as replay does, so a static policy and one alternating K = 0 with trees get the same rewards in both, and
    the rounds carry the surcharges (`info["cost_warmup"]`, `info["cost_switch"]`)."""
    from engine.cost.switching import SwitchCost
    from engine.cost.warmup import WarmupCost
    from env.costs import FittedCostModel

    warm, switch = (4e-4, 2e-4, 1e-4), SwitchCost(to_verify=3e-4, to_single=2e-4)
    monkeypatch.setattr(FittedCostModel, "warmup_cost", lambda self: WarmupCost(warm))
    monkeypatch.setattr(FittedCostModel, "switch_cost", lambda self: switch)
    cost = {"kind": "fitted"}
    replay = ReplayEnv(greedy_trace, grid=SMALL_GRID, cost=cost, cache=False)
    live = live_factory(cost=cost, fit_trace=greedy_trace)
    for name, actions in (("K4 W2", [np.array([3, 1, 0, 0])]),
                          ("K0 / K8 W3", [np.array([0, 0, 0, 0]), np.array([4, 2, 0, 1])])):  # fmt: skip
        _same_episodes(replay, live, greedy_trace, name, actions, tol=(1e-4, 1e-6, 1e-5))
    replay.reset(options={"request": 0})
    live.reset(options={"request": 0})
    seen = []
    for i, a in enumerate(([0, 0, 0, 0], [4, 2, 0, 1], [0, 0, 0, 0])):
        info = [e.step(np.array(a))[4] for e in (replay, live)]
        assert info[0]["cost_warmup"] == info[1]["cost_warmup"] == warm[i]
        assert info[0]["cost_switch"] == info[1]["cost_switch"] and info[0]["verified"] == info[1]["verified"]
        seen.append((info[0]["verified"], info[0]["cost_switch"]))
    assert seen[0][1] == 0.0  # the request's first round: no previous kind
    if seen[1][0] > 1:  # a tree after a K = 0 round, then K = 0 after it
        assert seen[1][1] == switch.to_verify and seen[2][1] == switch.to_single
