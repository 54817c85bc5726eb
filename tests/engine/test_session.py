"""The steppable session (Engine.start / Session.step / close): equal to generate, continuous batching,
failed steps and prefills rolled back (the session goes on, equal to an uninterrupted run), KV release after
errors, clear errors that leave the session usable."""

from __future__ import annotations

import time

import pytest

import engine
from engine.models.kv_cache import KVCacheFull
from engine.paths import zoo_path
from engine.runtime.observation import Observation
from engine.workloads import code_prompts, encode, prose_prompts

CHAIN = engine.SpecConfig(depth=4, width=1)
TREE = engine.SpecConfig(depth=3, width=2, frontier=3)


@pytest.fixture(scope="module")
def zoo():
    target = engine.load_model(zoo_path("tiny-moe"))
    drafter = engine.load_model(zoo_path("tiny-dense"))
    prompts = encode(target.tokenizer, code_prompts(2) + prose_prompts(1), 40)
    return target, drafter, prompts


def _sampling(kind: str, n: int):
    if kind == "greedy":
        return engine.SamplingParams()
    return [engine.SamplingParams(temperature=0.8, top_p=0.95, seed=11 + i) for i in range(n)]


def _stepped(eng, prompts, n, sampling, actions_for):
    session = eng.start(prompts, n, sampling=sampling)
    try:
        step = 0
        while not session.done:
            session.step([actions_for(rid, step) for rid in session.active])
            step += 1
        return session.results()
    finally:
        session.close()


@pytest.mark.parametrize("kind", ["greedy", "sampled"])
@pytest.mark.parametrize("spec", [CHAIN, TREE], ids=["chain", "tree"])
def test_stepping_by_hand_equals_generate(zoo, kind, spec):
    target, drafter, prompts = zoo
    eng = engine.Engine(target, drafter=drafter)
    ref = eng.generate(prompts, 20, sampling=_sampling(kind, len(prompts)), spec=spec)
    got = _stepped(eng, prompts, 20, _sampling(kind, len(prompts)), lambda rid, step: spec)
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    assert [[s.committed for s in r.rounds] for r in got] == [[s.committed for s in r.rounds] for r in ref]
    eng.kv.check_quiescent()


def test_per_request_actions_equal_a_policy(zoo):
    """Different (K, W) per request and per round by hand == the same choices through generate(policy=...)."""
    target, drafter, prompts = zoo
    eng = engine.Engine(target, drafter=drafter)

    def choice(prompt_len: int, round_index: int):
        return ((prompt_len + round_index) % 5, 1 + round_index % 2, 0.0)

    def policy(obs: Observation):
        return choice(obs.prompt_len, obs.round_index)

    sampling = _sampling("sampled", len(prompts))
    ref = eng.generate(prompts, 18, sampling=sampling, policy=policy)
    session = eng.start(prompts, 18, sampling=sampling)
    try:
        while not session.done:
            acts = {}
            for rid in session.active:
                obs = session.observation(rid)
                acts[rid] = choice(obs.prompt_len, obs.round_index)
            stats = session.step(acts)
            assert len(stats) == len(acts)
        got = session.results()
    finally:
        session.close()
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    assert [[s.depth for s in r.rounds] for r in got] == [[s.depth for s in r.rounds] for r in ref]


@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_adding_a_request_mid_session_leaves_the_others_unchanged(zoo, kind):
    target, drafter, prompts = zoo
    eng = engine.Engine(target, drafter=drafter)
    first, late = prompts[:2], prompts[2:]
    s_first, s_late = _sampling(kind, 2), _sampling(kind, 1)
    if kind == "sampled":
        s_late = [engine.SamplingParams(temperature=0.8, top_p=0.95, seed=99)]
    ref_first = [r.token_ids for r in eng.generate(first, 16, sampling=s_first, spec=TREE)]
    ref_late = [r.token_ids for r in eng.generate(late, 12, sampling=s_late, spec=CHAIN)]
    session = eng.start(first, 16, sampling=s_first, spec=TREE, reserve_tokens=len(late[0]) + 12)
    try:
        session.step()
        session.step()
        (rid,) = session.add(late, 12, sampling=s_late)
        assert rid == 2 and session.active[-1] == 2
        while not session.done:
            session.step([CHAIN if r == rid else TREE for r in session.active])
        got = [r.token_ids for r in session.results()]
    finally:
        session.close()
    assert got[:2] == ref_first and got[2:] == ref_late
    eng.kv.check_quiescent()


def test_add_beyond_capacity_is_refused_without_side_effects(zoo):
    target, drafter, prompts = zoo
    eng = engine.Engine(target, drafter=drafter)
    session = eng.start(prompts[:1], 8, spec=CHAIN)
    try:
        free = session.kv.num_free_blocks
        with pytest.raises(KVCacheFull, match="cannot admit"):
            session.add(prompts * 4, 200)
        assert session.kv.num_free_blocks == free and session.active == [0]
        while not session.done:
            session.step()
    finally:
        session.close()
    eng.kv.check_quiescent()


class FlakyDrafter:
    """A real drafter whose `commit` raises once for request `culprit` (after the requests before it in the
    batch have committed their round): a failure in the middle of a step's work."""

    def __init__(self, inner, culprit: int, times: int = 1) -> None:
        self.inner, self.culprit, self.left = inner, culprit, times
        self.predicts_experts = inner.predicts_experts

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def commit(self, seq_id, *args, **kwargs):
        if seq_id == self.culprit and self.left > 0:
            self.left -= 1
            raise RuntimeError("injected commit failure")
        return self.inner.commit(seq_id, *args, **kwargs)


@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_a_failed_step_is_rolled_back_and_the_session_goes_on(zoo, kind):
    """A step that raises mid-commit (request 0 committed, request 1 raised) is undone for every request in it:
    tokens, rounds and random streams as before, no scratch held; the session carries on == uninterrupted."""
    from engine.drafting.model_drafter import ModelDrafter

    target, drafter, prompts = zoo
    sampling = _sampling(kind, len(prompts))
    ref = engine.Engine(target, drafter=drafter).generate(prompts, 16, sampling=sampling, spec=TREE)
    eng = engine.Engine(target, drafter=FlakyDrafter(ModelDrafter(drafter), culprit=1, times=0))
    with eng.start(prompts, 16, sampling=sampling, spec=TREE) as session:
        session.step()
        eng.drafter.left = 1
        before = [(list(r.new_tokens), len(r.rounds), r.generator.get_state()) for r in session.requests]
        with pytest.raises(RuntimeError, match="injected commit failure"):
            session.step()
        assert session.failed is None and not session.kv.scratch
        after = [(list(r.new_tokens), len(r.rounds), r.generator.get_state()) for r in session.requests]
        assert [a[:2] for a in after] == [b[:2] for b in before]
        assert all(a[2].equal(b[2]) for a, b in zip(after, before))
        while not session.done:
            session.step()
        got = session.results()
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    assert [[s.committed for s in r.rounds] for r in got] == [[s.committed for s in r.rounds] for r in ref]
    eng.kv.check_quiescent()
    eng.drafter.kv.check_quiescent()


def test_stepping_a_subset_isolates_the_failing_request(zoo):
    """A dict of actions steps only the requests it names: the culprit fails alone, the others run on and
    equal target-only decoding; cancelling the culprit frees its blocks."""
    from engine.drafting.model_drafter import ModelDrafter

    target, drafter, prompts = zoo
    ref = [r.token_ids for r in engine.Engine(target).generate(prompts, 12)]
    eng = engine.Engine(target, drafter=FlakyDrafter(ModelDrafter(drafter), culprit=2, times=10**6))
    with eng.start(prompts, 12, spec=CHAIN) as session:
        with pytest.raises(RuntimeError, match="injected"):
            session.step()
        with pytest.raises(RuntimeError, match="injected"):
            session.step({2: CHAIN})
        stats = session.step({0: CHAIN, 1: TREE})
        assert len(stats) == 2 and [len(r.rounds) for r in session.requests] == [1, 1, 0]
        session.cancel(2, "error")
        while not session.done:
            session.step()
        got = session.results()
    assert [r.token_ids for r in got[:2]] == ref[:2] and got[2].finish_reason == "error"
    eng.kv.check_quiescent()


def test_a_failed_prefill_fails_only_the_new_requests(zoo, monkeypatch):
    target, drafter, prompts = zoo
    eng = engine.Engine(target, drafter=drafter)
    ref = eng.generate(prompts[:1], 12, spec=CHAIN)[0].token_ids
    with eng.start(prompts[:1], 12, spec=CHAIN, reserve_tokens=256) as session:
        session.step()
        free = eng.kv.num_free_blocks
        real = eng.target.forward_batch
        monkeypatch.setattr(eng.target, "forward_batch", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
        with pytest.raises(RuntimeError, match="boom"):
            session.add(prompts[1:], 12)
        monkeypatch.setattr(eng.target, "forward_batch", real)
        assert session.failed is None and eng.kv.num_free_blocks == free and session.active == [0]
        assert [r.finish_reason for r in session.requests[1:]] == ["error"] * (len(prompts) - 1)
        while not session.done:
            session.step()
        assert session.results()[0].token_ids == ref
    eng.kv.check_quiescent()


def test_close_releases_every_block_also_after_an_exception(zoo, monkeypatch):
    """A target that keeps raising: the rollback's prefill raises too, so the session is marked failed; close()
    still frees every block and the engine works again."""
    target, drafter, prompts = zoo
    eng = engine.Engine(target, drafter=drafter)
    session = eng.start(prompts, 16, spec=TREE)
    session.step()
    real = eng.target.forward_batch

    def failing(*args, **kwargs):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(eng.target, "forward_batch", failing)
    with pytest.raises(RuntimeError, match="injected"):
        session.step()
    assert session.failed is not None
    with pytest.raises(RuntimeError, match="failed"):
        session.step()
    session.close()
    eng.kv.check_quiescent()
    monkeypatch.setattr(eng.target, "forward_batch", real)
    assert eng.generate(prompts[:1], 4)[0].token_ids  # the engine is usable again
    session.close()  # idempotent


def test_context_manager_closes(zoo):
    target, drafter, prompts = zoo
    eng = engine.Engine(target, drafter=drafter)
    with eng.start(prompts, 8, spec=CHAIN) as session:
        session.step()
        with pytest.raises(RuntimeError, match="open session"):
            eng.start(prompts, 8)
    eng.kv.check_quiescent()
    with pytest.raises(RuntimeError, match="closed"):
        session.step()


@pytest.mark.parametrize(
    ("actions", "match"),
    [
        ("wrong-count", "2 actions for 3 active"),
        ((99, 1, 0.0), "action 99: expected a SpecConfig"),
        ("bad-K", r"depth \(K\) must be"),
        ("width-0", r"width \(W\) must be"),
        ("string", "expected a SpecConfig"),
        ("unknown-id", "active ones are"),
        ("lam-no-predictor", "expert predictor"),
    ],
)
def test_invalid_actions_are_clear_errors_and_leave_the_session_usable(zoo, actions, match):
    target, drafter, prompts = zoo
    eng = engine.Engine(target, drafter=drafter)
    ref = eng.generate(prompts, 10, spec=CHAIN)
    bad = {
        "wrong-count": [CHAIN, CHAIN],
        "bad-K": [(99, 1, 0.0)] * 3,
        "width-0": [(2, 0, 0.0)] * 3,
        "string": ["4"] * 3,
        "unknown-id": {0: CHAIN, 1: CHAIN, 7: CHAIN},
        "lam-no-predictor": [(2, 1, 1.0)] * 3,
    }.get(actions, actions)
    with eng.start(prompts, 10, spec=CHAIN) as session:
        session.step()
        before = [list(r.new_tokens) for r in session.requests]
        with pytest.raises(ValueError, match=match):
            session.step(bad)
        assert [list(r.new_tokens) for r in session.requests] == before
        while not session.done:
            session.step()
        got = session.results()
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]


def test_policy_gets_the_shared_observation(zoo):
    target, drafter, prompts = zoo
    seen: list[Observation] = []

    def policy(obs):
        seen.append(obs)
        return CHAIN

    (res,) = engine.Engine(target, drafter=drafter).generate(prompts[:1], 10, policy=policy)
    assert all(isinstance(o, Observation) for o in seen) and len(seen) == len(res.rounds)
    committed = [0]
    for r in res.rounds:
        committed.append(committed[-1] + r.committed)
    assert [o.round_index for o in seen] == list(range(len(seen)))
    assert [o.position for o in seen] == committed[:-1]  # new tokens before each round
    assert [o.accepted_last for o in seen[1:]] == [r.accepted for r in res.rounds[:-1]]
    assert seen[-1].vector().shape == seen[0].vector().shape
    assert all(r.policy_seconds > 0 for r in res.rounds)  # the choice of every round is timed
    (plain,) = engine.Engine(target, drafter=drafter).generate(prompts[:1], 10, spec=CHAIN)
    assert all(r.policy_seconds == 0 for r in plain.rounds)  # no policy, no controller cost


def test_round_seconds_are_drafting_forward_and_host_work_without_the_choice(zoo):
    """RoundStats.round_seconds = drafting + the target's forward + host_seconds; a slow controller's choice is
    its policy_seconds, never host work."""
    target, drafter, prompts = zoo

    def slow(obs):
        time.sleep(0.02)
        return CHAIN

    (res,) = engine.Engine(target, drafter=drafter).generate(prompts[:1], 10, policy=slow)
    for r in res.rounds:
        assert r.policy_seconds >= 0.02 and 0.0 < r.host_seconds < 0.02
        assert r.round_seconds == pytest.approx(r.time["draft"] + r.time["forward"] + r.host_seconds)
        assert r.host_seconds >= r.time["sampling"]  # verification and commit after the forward are a part of it
    wall = time.perf_counter()
    (alone,) = engine.Engine(target).generate(prompts[:1], 10)
    wall = time.perf_counter() - wall
    assert all(r.host_seconds > 0 for r in alone.rounds) and sum(r.round_seconds for r in alone.rounds) < wall
