"""engine.runtime.frozen.stand_in_policy: a learned controller's shape that always decodes plainly (what the host
calibration times a choice with, env.host_calibration); and a frozen policy's two ways through the session, its bound
C++ chooser and the fallback to `act_history`, choosing alike."""

from __future__ import annotations

import numpy as np
import pytest

import engine
from engine.paths import zoo_path
from engine.runtime.action_grid import ActionGrid
from engine.runtime.frozen import stand_in_policy
from engine.runtime.observation import OBS_DIM
from engine.workloads import code_prompts, encode

GRID = ActionGrid(widths=(1, 2, 3))


def test_the_stand_in_always_picks_k0_through_the_cpp_actor():
    policy = stand_in_policy(GRID, probe=(8, 3))
    assert policy._native is not None and policy.probe == (8, 3) and policy.nvec == GRID.nvec
    rng = np.random.default_rng(0)
    picks = [policy.act_index(rng.uniform(-1, 2, OBS_DIM).tolist()) for _ in range(200)]
    assert {p[0] for p in picks} == {GRID.depths.index(0)}
    assert len({p for p in picks}) > 1  # the other heads still compute (random weights): a real actor's work
    assert all(policy.act_vector(rng.uniform(0, 1, OBS_DIM)).depth == 0 for _ in range(20))


def test_hidden_widths_reads_the_actors_layers():
    assert stand_in_policy(GRID).hidden_widths == (64, 64)
    assert stand_in_policy(GRID, hidden=(32, 16, 8)).hidden_widths == (32, 16, 8)


def test_the_stand_in_needs_depth_0():
    with pytest.raises(ValueError, match="depth 0"):
        stand_in_policy(ActionGrid(depths=(2, 4), widths=(1,)))


def test_deployed_it_decodes_plainly_and_times_its_choice():
    """In the engine's session it probes (its `probe` shape), chooses K = 0 every round, and each round records the
    choice's seconds (RoundStats.policy_seconds); the tokens are target-only greedy decoding's."""
    target = engine.load_model(zoo_path("tiny-moe"))
    prompts = encode(target.tokenizer, code_prompts(2), 40)
    eng = engine.Engine(target, drafter="ngram")
    out = eng.generate(prompts, 12, policy=stand_in_policy(GRID, probe=(8, 3)))
    plain = engine.Engine(target).generate(prompts, 12)
    for res, ref in zip(out, plain):
        assert res.token_ids == ref.token_ids
        assert all(r.depth == 0 and r.verified_tokens == 1 for r in res.rounds)
        assert all(r.policy_seconds > 0 for r in res.rounds)
        assert all(r.probe_seconds > 0 for r in res.rounds[:-1])  # the last round can draft nothing: no probe


def test_the_sessions_fallback_chooses_as_its_cpp_chooser(monkeypatch):
    """A History the bound C++ chooser does not take goes to the policy's `act_history` (here made to take its Python
    twin too): the same action every round as the chooser's, and the same tokens as target-only greedy decoding.
    Every head of this actor is random, so K, W and the rule all vary."""
    import torch

    from engine.runtime.frozen import FrozenPolicy

    base = stand_in_policy(GRID, probe=(8, 3), seed=3)
    with torch.no_grad():
        base.module.action_net.bias.zero_()  # the depth head no longer pinned to K = 0
    target = engine.load_model(zoo_path("tiny-moe"))
    prompts = encode(target.tokenizer, code_prompts(2), 40)
    eng = engine.Engine(target, drafter="ngram")

    def actions(policy: FrozenPolicy) -> list[list[tuple]]:
        out = eng.generate(prompts, 24, policy=policy)
        assert [r.token_ids for r in out] == [r.token_ids for r in engine.Engine(target).generate(prompts, 24)]
        return [[(s.depth, s.width, s.verify_rule, s.verified_tokens) for s in r.rounds] for r in out]

    fast = FrozenPolicy(base.module, base.card)
    assert fast.chooser(None) is not None
    want = actions(fast)
    assert len({a[0] for req in want for a in req}) > 1  # real decisions, not one action

    def refuse(*args):
        raise TypeError("a History the C++ reader does not take")

    slow = FrozenPolicy(base.module, base.card)
    monkeypatch.setattr(slow, "chooser", lambda calibration=None: refuse)
    monkeypatch.setattr(slow._native, "choose", refuse)  # act_history's own C++ path refused too: the Python twin
    assert actions(slow) == want


def _random_policy(probe_source: str | None):
    """A stand-in whose every head is random (K, W and the rule all vary), its card naming `probe_source`."""
    import torch

    from engine.runtime.frozen import FrozenPolicy

    base = stand_in_policy(GRID, probe=(8, 3), seed=3)
    with torch.no_grad():
        base.module.action_net.bias.zero_()  # the depth head no longer pinned to K = 0
    return FrozenPolicy(base.module, {**base.card, "probe_source": probe_source})


def test_a_lookup_policy_decodes_plainly_unasked_when_its_probe_proposes_nothing(monkeypatch):
    """With `probe_source` "drafter" (the prompt lookup's own probe) every round whose probe found no match is plain
    decoding — the same weights without it draft there (the rule is what makes them plain) — through the bound C++
    chooser and through the Python twin alike, and elsewhere the actor decides as before; the tokens stay
    target-only greedy decoding's. A context probe (or none named) never skips."""
    from engine.runtime.frozen import NOW_SLICE

    assert _random_policy("context").plain_index is None and _random_policy(None).plain_index is None
    target = engine.load_model(zoo_path("tiny-moe"))
    prompts = encode(target.tokenizer, code_prompts(3), 40)
    eng = engine.Engine(target, drafter="ngram")
    ref = engine.Engine(target).generate(prompts, 32)

    def rounds(policy) -> list[tuple[bool, int, int, str]]:
        """(the probe proposed nothing, K, W, rule) of every round, stepping each request alone."""
        out = []
        for prompt, want in zip(prompts, ref):
            s = eng.start([prompt], 32, policy=policy)
            while s.active:
                r = s.requests[s.active[0]]
                depth = min(8, r.max_new - len(r.new_tokens) - 1)
                conf = eng.drafter.lookup_probe(list(r.tokens), len(r.prompt), depth, 3)[0] if depth > 0 else []
                st = s.step()[0]
                out.append((not any(conf), st.depth, st.width, st.verify_rule))
            assert s.requests[0].new_tokens == want.token_ids
            s.close()
        return out

    plain, skip = _random_policy(None), _random_policy("drafter")
    assert skip.plain_index == (GRID.depths.index(0), 0, 0, 0) and skip.chooser(None) is not None
    was, now = rounds(plain), rounds(skip)
    assert any(nothing for nothing, *_ in was) and any(k > 0 for nothing, k, *_ in was if nothing)
    assert all(k == 0 for nothing, k, *_ in now if nothing)
    assert len({a[1] for a in now if not a[0]}) > 1  # elsewhere the actor still decides
    monkeypatch.setattr(skip, "chooser", lambda calibration=None: None)  # the session's act_history path
    monkeypatch.setattr(skip, "_native", None)  # ... and its Python twin
    assert rounds(skip) == now
    v = np.random.default_rng(0).uniform(0, 1, OBS_DIM)
    v[NOW_SLICE] = 0.0
    assert skip.act_index(v) == skip.plain_index and plain.act_index(v) != skip.plain_index


@pytest.mark.parametrize("plain", [False, True])
def test_the_choice_sees_the_probe_values_session_probe_gives(plain: bool):
    """The session's choice loop runs the lookup's probe inline (its hot path): each round the C++ chooser is given
    exactly the values `Session.probe` returns for the request at that point — the confidences padded to KMAX, then
    the match's source; the depth capped by the token budget, and [] where nothing can be drafted (one token left:
    reached by the plain stand-in, one token a round)."""
    policy = stand_in_policy(GRID, probe=(8, 3)) if plain else _random_policy("drafter")
    target = engine.load_model(zoo_path("tiny-moe"))
    prompts = encode(target.tokenizer, code_prompts(2), 40)
    eng = engine.Engine(target, drafter="ngram")
    for prompt in prompts:
        s = eng.start([prompt], 20, policy=policy)
        seen, want, left = [], [], []
        choose = s._chooser

        def recording(h, position, max_new, n, top_k, layers, probe, seen=seen, left=left, choose=choose):
            seen.append(list(probe))
            left.append(max_new - position)
            return choose(h, position, max_new, n, top_k, layers, probe)

        s._chooser = recording
        while s.active:
            rid = s.active[0]
            want.append(s.probe(rid, 8, 3))  # what a caller of Session.probe gets (the same match: idempotent)
            s.step()
        s.close()
        assert seen == want and len(want) > 3
        assert all((v == []) == (n <= 1) and len(v) in (0, 10) for v, n in zip(want, left))
        assert (left[-1] == 1) == plain
