"""env.shared: replay environments over the same tables share them and their list views, with the same results."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from conftest import SMALL_GRID  # tests/env is on sys.path while pytest runs its conftest

from env.costs import make_cost_model
from env.replay import ReplayEnv
from env.shared import live_views, view


def test_view_is_built_once_per_array_and_dropped_with_it():
    calls = []
    a, b = np.arange(5), np.arange(5)

    def make(x):
        calls.append(1)
        return x.tolist()

    first = view("list", a, make)
    assert view("list", a, make) is first and len(calls) == 1  # the same array: the same view
    assert view("list", b, make) == first and len(calls) == 2  # an equal array is another object: its own view
    assert view("other", a, lambda x: x.sum()) == 10 and len(calls) == 2  # tags are separate views
    held = live_views()
    del a
    gc.collect()
    assert live_views() == held - 2  # both views of `a` went with it


def _rollout(env, request: int, actions: list) -> list[tuple]:
    env.reset(options={"request": request})
    out, k, done = [], 0, False
    while not done:
        obs, reward, term, trunc, info = env.step(actions[k % len(actions)])
        out.append((obs.tolist(), reward, info["cost"], info["cost_ar"]))
        k, done = k + 1, term or trunc
    return out


@pytest.mark.parametrize("kind", ["roofline", "fitted"])
def test_envs_share_tables_views_and_the_fitted_cost_with_the_same_rollouts(ngram_trace, monkeypatch, tmp_path, kind):
    monkeypatch.setenv("EXPERTSPEC_CACHE", str(tmp_path))  # cached tables (shared once loaded), in a temp folder
    cost = {"kind": kind}
    a, b = (ReplayEnv(ngram_trace, grid=SMALL_GRID, cost=cost) for _ in range(2))
    assert a.tables is b.tables and a._cost is b._cost and a._conf is b._conf and a._pairs is b._pairs
    p, q = (ReplayEnv(ngram_trace, grid=SMALL_GRID, cost=cost, probe=True) for _ in range(2))
    assert p.tables is q.tables and p._cost is q._cost and p._probe_cost is q._probe_cost
    assert p._probe_rows is q._probe_rows
    assert p.tables is not a.tables and p._acc is a._acc  # the probe prices K = 0 apart; the outcomes are shared
    if kind == "fitted":
        assert a.cost_model is b.cost_model  # fitted once per trace
        assert make_cost_model(a.cost_conf, ngram_trace.meta["target"], trace=ngram_trace) is a.cost_model
    lone = ReplayEnv(ngram_trace, grid=SMALL_GRID, cost=cost, cache=False)  # its own tables and views
    lone_probe = ReplayEnv(ngram_trace, grid=SMALL_GRID, cost=cost, probe=True, cache=False)
    assert lone.tables is not a.tables and lone._cost is not a._cost
    a.action_space.seed(0)
    actions = [a.action_space.sample() for _ in range(7)]
    for i in range(ngram_trace.num_requests):
        assert _rollout(a, i, actions) == _rollout(b, i, actions) == _rollout(lone, i, actions)
        assert _rollout(p, i, actions) == _rollout(q, i, actions) == _rollout(lone_probe, i, actions)
