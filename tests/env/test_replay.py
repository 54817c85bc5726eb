"""Replay-v0: the Gymnasium / SB3 contract, determinism, errors, validation, vectorisation, off-grid actions."""

from __future__ import annotations

import itertools

import gymnasium as gym
import numpy as np
import pytest
from conftest import SMALL_GRID  # noqa: E402  (tests/env is on sys.path while pytest runs its conftest)
from gymnasium.utils.env_checker import check_env as gym_check_env
from stable_baselines3.common.env_checker import check_env as sb3_check_env

import env  # noqa: F401  (registers the ids)
from engine.runtime.observation import OBS_DIM
from engine.spec.config import SpecConfig
from env.costs import live_fit_rounds
from env.replay import ReplayEnv

ROOFLINE_TARGET = {"kind": "roofline", "model_spec": "target", "hardware": "h100"}


def make(trace, **kw) -> ReplayEnv:
    kw.setdefault("grid", SMALL_GRID)
    kw.setdefault("cost", ROOFLINE_TARGET)
    return ReplayEnv(trace, cache=False, **kw)


@pytest.mark.parametrize("kind", ["multidiscrete", "box"])
def test_gymnasium_and_sb3_checkers(greedy_trace, kind):
    e = make(greedy_trace, action_kind=kind)
    gym_check_env(e, skip_render_check=True)
    sb3_check_env(e, warn=True)
    via_make = gym.make(
        "expertspec/Replay-v0", trace=greedy_trace, grid=SMALL_GRID, cost=ROOFLINE_TARGET, action_kind=kind, cache=False
    )
    gym_check_env(via_make.unwrapped, skip_render_check=True)


def _rollout(e, seed: int, episodes: int = 3):
    e.action_space.seed(seed)
    out = []
    for ep in range(episodes):
        e.reset(seed=seed if ep == 0 else None)
        done = False
        while not done:
            obs, r, term, trunc, info = e.step(e.action_space.sample())
            assert np.isfinite(r) and e.observation_space.contains(obs)
            out.append((obs.copy(), r, term, trunc, info["cost"]))
            done = term or trunc
    return out


def test_fixed_seed_rollouts_are_identical(greedy_trace):
    a, b = _rollout(make(greedy_trace), 7), _rollout(make(greedy_trace), 7)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert np.array_equal(x[0], y[0]) and x[1:] == y[1:]


def test_plain_decoding_scores_zero_and_sums_to_speedup(greedy_trace):
    e = make(greedy_trace, cost={"kind": "roofline"})  # synthetic routing of Qwen3-30B-A3B
    e.reset(seed=0, options={"request": 0})
    total = 0.0
    while True:
        _, r, term, trunc, info = e.step(np.array([0, 0, 0, 0]))
        assert r == 0.0 and info["committed"] == 1 and info["cost"] == info["cost_ar"]
        total += r
        if term or trunc:
            break
    assert total == 0.0 and e.position == len(greedy_trace.positions_of(0))


def test_out_of_space_actions_are_refused(greedy_trace):
    e = make(greedy_trace)
    e.reset(seed=0)
    for bad in ([99, 0, 0, 0], [-1, 0, 0, 0], [1.5, 0, 0, 0], [1, 0, 0], "K=2"):
        with pytest.raises(ValueError):
            e.step(bad)
    b = make(greedy_trace, action_kind="box")
    b.reset(seed=0)
    for bad in ([1.5, 0, 0, 0], [np.nan, 0, 0, 0], [0, 0]):
        with pytest.raises(ValueError):
            b.step(bad)
    with pytest.raises(ValueError, match="width"):
        make(greedy_trace, grid={"widths": [1, 5]})
    with pytest.raises(ValueError, match="action kind"):
        make(greedy_trace, action_kind="continuous")


@pytest.mark.parametrize(
    "cost, match",
    [
        ({"hardware": "tpu9"}, "unknown hardware"),
        ({"model_spec": "gpt5"}, "unknown model_spec"),
        ({"drafter_spec": "nope"}, "unknown drafter_spec"),
        ({"kind": "magic"}, "unknown cost kind"),
    ],
)
def test_bad_cost_model_fails_before_work(greedy_trace, cost, match, monkeypatch):
    import env.replay as replay

    monkeypatch.setattr(replay, "load_or_build_tables", lambda *a, **k: pytest.fail("tables were built"))
    with pytest.raises(ValueError, match=match):
        ReplayEnv(greedy_trace, cost=cost, grid=SMALL_GRID)


def test_validate_replays_an_episode(greedy_trace):
    e = make(greedy_trace)
    _rollout(e, 3, episodes=1)
    state = e.episode_state()
    assert e.validate(state)["ok"]
    state["rewards"][1] += 1e-3
    state["committed"][0] += 1
    res = e.validate(state)
    assert not res["ok"] and {m[1] for m in res["mismatches"]} == {"rewards", "committed"}


def test_spec_actions_replay_like_grid_actions(greedy_trace):
    e, f = make(greedy_trace), make(greedy_trace)
    e.reset(seed=0, options={"request": 1})
    f.reset(seed=0, options={"request": 1})
    rng = np.random.default_rng(0)
    while True:
        idx = tuple(int(x) for x in rng.integers(e.codec.nvec))
        o1, r1, t1, u1, _ = e.step(np.array(idx))
        o2, r2, t2, u2, _ = f.step(f.grid.spec(idx))
        assert np.array_equal(o1, o2) and (r1, t1, u1) == (r2, t2, u2)
        if t1 or u1:
            break
    # off-grid: verify budgets with expert-aware selection, goodput
    f.reset(seed=0)
    _, r, *_ = f.step(SpecConfig(depth=6, width=3, lam=1.0, max_verify=5))
    assert f.rounds[-1].verified_tokens <= 6 and np.isfinite(r)
    _, r, *_ = f.step(SpecConfig(depth=6, width=2, verify_rule="goodput", verify_costs=f.cost_model.verify_costs(16)))
    assert np.isfinite(r)


def test_vectorised_envs(greedy_trace):
    from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv

    path = str(greedy_trace.path)
    fns = [lambda: ReplayEnv(path, grid=SMALL_GRID, cost=ROOFLINE_TARGET, cache=False) for _ in range(2)]
    for cls, kw in ((DummyVecEnv, {}), (SubprocVecEnv, {"start_method": "fork"})):
        venv = cls(fns, **kw)
        venv.seed(0)
        obs = venv.reset()
        for _ in range(30):
            obs, rew, done, info = venv.step(np.stack([venv.action_space.sample() for _ in range(2)]))
            assert obs.shape == (2, OBS_DIM) and np.all(np.isfinite(rew))
        venv.close()
    vec = gym.vector.SyncVectorEnv(fns)
    obs, _ = vec.reset(seed=0)
    obs, rew, term, trunc, _ = vec.step(vec.action_space.sample())
    assert obs.shape == (2, OBS_DIM)
    vec.close()


def test_fitted_cost_and_synthetic_routing(greedy_trace):
    from env.costs import MIN_STEADY, bare_k0_rounds

    fitted = make(greedy_trace, cost={"kind": "fitted"})
    assert fitted.cost_model.name == "fitted" and fitted.routing == "recorded"
    a, cm = greedy_trace.arrays, fitted.cost_model  # T_book: fitted to the trace's timed live rounds of both engines
    plain = a["cal_live_plain"]
    assert plain.any() and (a["cal_live_verified"][~plain] >= 2).any() and (a["cal_live_draft_steps"] > 0).any()
    assert set(a["cal_live_rule"][a["cal_live_draft_steps"] > 0].tolist()) == {0, 1, 2}  # every drafting rule timed
    assert cm.book(1) > 0 and cm.book(5) > 0 and cm.book_ar() > 0
    L, _, r = cm.routing_shape
    assert cm.ar(10) == pytest.approx(cm.plain_step.seconds(1, L * r, L, 10) + cm.book_ar())  # + a plain step's host
    # T_AR's forward and a K = 0 round's are one fit to both engines' timed single-token forwards (the same code),
    # its mean the timed mean; the engines differ in their host work
    assert cm.plain_step is cm.target.decode
    one = (a["cal_live_draft_steps"] == 0) & live_fit_rounds(a)  # steady rounds that kept their kind (the surcharges)
    assert bare_k0_rounds(a, live_fit_rounds(a)).sum() >= MIN_STEADY  # format 11's bare K = 0 run ...
    one &= a["cal_live_policy_seconds"] == 0  # ... so not the rounds a stand-in chose (their cooling: the choice)
    fitted_mean = np.mean([cm.plain_step.seconds(1, L * r, L, int(c)) for c in a["cal_live_context"][one]])
    assert fitted_mean == pytest.approx(a["cal_live_forward_seconds"][one].mean(), rel=1e-6)
    assert cm.ar(10) - cm.verify(1, L * r, 10) == pytest.approx(cm.book_ar())
    p = cm.price(4, 3 * L * r, 10, 3, 1, False)
    assert p.book == cm.book(4) and p.total == pytest.approx(p.draft + p.verify + p.book)
    synthetic = make(greedy_trace, cost={"kind": "roofline", "model_spec": "qwen3_235b_a22b", "hardware": "h200"})
    assert synthetic.routing == "synthetic" and synthetic.routing_shape == (94, 128, 8)
    for e in (fitted, synthetic):
        _rollout(e, 1, episodes=1)
    assert len(synthetic.rounds[-1].distinct_experts) == 94


@pytest.mark.parametrize("cost", ["roofline", "fitted"])
def test_the_context_probe_for_a_drafter_without_one(greedy_trace, cost):
    """probe=True on a trace whose drafter has no probe (the EAGLE head): the observation's last KMAX + 2 entries are
    the context probe's values of the trace's tokens before each position (engine.runtime.context_probe, none where
    nothing could be drafted), and every round pays its price (the cost model's `context_probe`), drafted or not."""
    from engine.runtime.context_probe import ContextProbe
    from engine.runtime.observation import KMAX

    trace = greedy_trace
    probed = ReplayEnv(trace, grid=SMALL_GRID, cost=cost, probe=True, cache=False)
    plain = ReplayEnv(trace, grid=SMALL_GRID, cost=cost, cache=False)
    assert probed.probe == (probed.grid.max_depth, max(probed.grid.widths)) and not probed._own_probe
    K, W = probed.probe
    cm, cp, found = probed.cost_model, ContextProbe(), 0
    for req in range(trace.num_requests):
        prompt = trace.prompt(req).tolist()
        tokens = prompt + trace.continuation_of(req).tolist()
        obs, _ = probed.reset(options={"request": req})
        plain.reset(options={"request": req})
        for i in itertools.count():
            t, ctx = probed.position, len(prompt) + probed.position - 1
            depth = min(K, trace.meta["max_new_tokens"] - t - 1)
            want = cp.probe(tokens[: len(prompt) + t], len(prompt), depth, W)
            np.testing.assert_array_equal(obs[-KMAX - 2 :], np.clip(np.float32(want or [0.0] * (KMAX + 2)), 0, 1))
            found += bool(want) and want[KMAX] > 0
            action = probed.codec.encode((i % 3, 0, 0, 0))  # K = 0, 1, 2 in turn
            obs, _, term, trunc, info = probed.step(action)
            _, _, _, _, ref = plain.step(action)
            price = cm.context_probe(ctx) if depth > 0 else 0.0
            assert info["cost"] == pytest.approx(ref["cost"] + price, rel=1e-12)
            assert info["cost_draft"] == pytest.approx(ref["cost_draft"] + price, rel=1e-12)
            if term or trunc:
                break
    assert found > 0
    if cost == "roofline":
        assert cm.context_probe(100) == pytest.approx(1e-5)  # the prompt lookup's host seconds (conf/drafter_spec)
    else:  # timed in place before the live K = 0 rounds of the host calibration
        assert cm.probe_fit is not None and 0 < cm.context_probe(100) < 1e-3
