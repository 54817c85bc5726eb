"""Holds in the environments (engine.runtime.hold, env.held): a held step plays the held plain rounds priced
without probe and choice, the episode state validates round by round, and AggreVaTe's Q rows price a hold exactly
(the return still to come of the action, then the held rounds, then the expert)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import SMALL_GRID  # noqa: E402  (tests/env is on sys.path while pytest runs its conftest)

from engine.cost.switching import SwitchCost
from engine.cost.warmup import WarmupCost
from engine.runtime.hold import Hold
from env.cost_model import CostModel
from env.replay import ReplayEnv


def _env(trace, hold=None, learned=True):
    return ReplayEnv(trace, grid=SMALL_GRID, cache=False, probe=learned, choice=learned, hold=hold)


@pytest.fixture
def surcharged(monkeypatch):
    """The roofline with a warm-up and a switching surcharge, so the round state matters (env.oracle.RoundStates)."""
    monkeypatch.setattr(CostModel, "warmup_cost", lambda self: WarmupCost((4e-4, 2e-4)))
    monkeypatch.setattr(CostModel, "switch_cost", lambda self: SwitchCost(3e-4, 2e-4))


def test_a_held_step_plays_the_held_rounds_without_probe_and_choice(ngram_trace, surcharged):
    """K = 0 with a hold of 3: one step, four rounds; the first priced as the learned env prices it (probe and
    choice), the held ones as the bare env prices plain rounds at those positions; the reward and the merged info
    sum the rounds; the episode state validates round by round; no hold after a drafting action."""
    plain_idx = (0, 0, 0, 0)
    bare, learned, held = _env(ngram_trace, learned=False), _env(ngram_trace), _env(ngram_trace, Hold(3))
    for e in (bare, learned, held):
        e.reset(options={"request": 0})
    want = [bare.step(bare.codec.encode(plain_idx))[1] for _ in range(4)]
    first = learned.step(learned.codec.encode(plain_idx))
    _, reward, _, _, info = held.step(held.codec.encode(plain_idx))
    assert held.position == 4 and info["held"] == 3 and info["committed"] == 4
    assert [r.cost for r in held.rounds] == [learned.rounds[0].cost] + [r.cost for r in bare.rounds[1:]]
    assert held.rounds[0].cost > bare.rounds[0].cost  # the decided round pays probe and choice
    assert reward == pytest.approx(first[1] + sum(want[1:]))
    assert info["cost"] == pytest.approx(sum(r.cost for r in held.rounds))
    assert info["cost_choice"] == pytest.approx(learned.choice_cost) and info["position"] == 4
    _, _, _, _, info = held.step(held.codec.encode((3, 0, 0, 0)))  # K = 4 drafts: asked again next round
    assert info["held"] == 0 and len(held.rounds) == 5
    state = held.episode_state()
    assert state["held"] == [False, True, True, True, False]
    assert held.validate(state)["ok"]


def test_declined_holds_only_where_the_probe_proposed(ngram_trace):
    """ "declined": a K = 0 step holds exactly where this round's probe values proposed a draft."""
    env = _env(ngram_trace, Hold(2, "declined"))
    seen = set()
    for i in range(ngram_trace.num_requests):
        env.reset(options={"request": i})
        done = False
        while not done:
            proposed, left = any(c > 0 for c in env._probed()[:8]), env._T - env.position - 1
            _, _, term, trunc, info = env.step(env.codec.encode((0, 0, 0, 0)))
            done = term or trunc
            assert info["held"] == (min(2, left) if proposed else 0)
            seen.add(proposed)
    assert seen == {True, False}


@pytest.mark.parametrize("hold", [Hold(3, "plain"), Hold(2, "declined")])
def test_aggrevate_q_rows_price_the_hold(ngram_trace, surcharged, hold):
    """Q_s(0, s0, b) of the static expert a_s is the return of playing b and then a_s to the end in the env with the
    hold (its held rounds included, whoever starts them), for every first action b, a_s plain decoding or not."""
    from ctrl.aggrevate import static_q

    env = _env(ngram_trace, hold)
    codec = env.codec
    for i in range(ngram_trace.num_requests):
        for a_s in (codec.flat((0, 0, 0, 0)), codec.flat((2, 1, 0, 0))):
            q = static_q(env, i, a_s)
            for b in range(0, codec.num_actions, 5):
                env.reset(options={"request": i})
                total, action, done = 0.0, b, False
                while not done:
                    _, r, term, trunc, _ = env.step(codec.encode(codec.unflat(action)))
                    total, action, done = total + r, a_s, term or trunc
                assert q[0, 0, b] == pytest.approx(total, abs=1e-9), (i, a_s, b)
    assert np.isfinite(q).all()


@pytest.mark.parametrize("after", ["plain", "declined"])
def test_replay_equals_live_with_a_hold(ngram_models, ngram_trace, after):
    """Replay-v0 and Live-v0 with the same hold, probe and choice: the same held rounds after the same steps, the
    same round costs, rewards and observations; the live session's held rounds are neither probed nor charged the
    choice; the tokens stay the trace's."""
    from env.live import LiveEnv

    cost = {"kind": "roofline", "model_spec": "qwen3_30b_a3b", "hardware": "h200"}
    hold = Hold(2, after)
    replay = ReplayEnv(ngram_trace, grid=SMALL_GRID, cost=cost, cache=False, probe=True, choice=True, hold=hold)
    live = LiveEnv(models=ngram_models, num_prompts=2, max_new_tokens=ngram_trace.meta["max_new_tokens"],
                   grid=SMALL_GRID, cost=cost, workload_name="code", probe=True, choice=True, hold=hold)  # fmt: skip
    cycle = [(0, 0, 0, 0), (3, 1, 0, 0), (0, 1, 0, 1), (2, 0, 0, 0)]
    held = 0
    try:
        for req in range(ngram_trace.num_requests):
            o1, _ = replay.reset(options={"request": req})
            o2, _ = live.reset(options={"request": req})
            for i in range(10_000):
                a = replay.codec.encode(cycle[i % len(cycle)])
                o1, r1, t1, u1, i1 = replay.step(a)
                o2, r2, t2, u2, i2 = live.step(a)
                assert i1["held"] == i2["held"] and (t1, u1) == (t2, u2), (req, i)
                assert r1 == pytest.approx(r2, rel=1e-9, abs=1e-12) and i1["cost"] == pytest.approx(i2["cost"])
                np.testing.assert_allclose(o1, o2, atol=1e-6)
                held += i1["held"]
                if t1 or u1:
                    break
            lr = live.session.requests[0].rounds
            assert [r.cost for r in replay.rounds] == pytest.approx([r.cost for r in lr], rel=1e-9)
            assert [r.committed for r in replay.rounds] == [r.committed for r in lr]
            flags = replay.episode_state()["held"]
            assert all(r.probe_seconds == 0 for r, f in zip(lr, flags) if f)
            assert live.session.results()[0].token_ids == ngram_trace.continuation_of(req).tolist()
    finally:
        live.close()
    assert held > 0
