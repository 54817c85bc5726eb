"""engine.runtime.hold: a policy's plain decoding held unasked — the rule, the session applying it (no probe, no
choice, the same tokens), a failed step putting holds back, and the frozen card carrying it."""

from __future__ import annotations

import json

import pytest
import torch

import engine
from engine.paths import zoo_path
from engine.runtime.action_grid import ActionGrid
from engine.runtime.frozen import FrozenPolicy, stand_in_policy
from engine.runtime.hold import NO_HOLD, Hold
from engine.runtime.observation import OBS_DIM
from engine.workloads import code_prompts, encode

GRID = ActionGrid(widths=(1, 2, 3))


def test_hold_rule():
    """`held(depth, probe)`: K > 0 never holds; "plain" holds after every K = 0, "declined" only where the probe's
    confidences (the first KMAX values; then the match's source) proposed a draft; 0 rounds never; bad fields are
    clear errors."""
    proposed, nothing = [0.0, 0.4] + [0.0] * 6 + [0.5, 1.0], [0.0] * 8 + [0.5, 1.0]  # source values never count
    assert Hold(3, "plain").held(0, nothing) == 3 and Hold(3, "plain").held(0, []) == 3
    assert Hold(3, "declined").held(0, proposed) == 3 and Hold(3, "declined").held(0, nothing) == 0
    assert Hold(3, "declined").held(0, []) == 0 and Hold(3, "plain").held(2, proposed) == 0
    assert NO_HOLD.held(0, proposed) == 0 and not NO_HOLD and Hold(1)
    assert Hold.of(None) == NO_HOLD and Hold.of({"rounds": 2, "after": "declined"}) == Hold(2, "declined")
    assert Hold.of(Hold(2).to_dict()) == Hold(2)
    for bad, match in (({"rounds": -1}, "integer >= 0"), ({"rounds": 1.5}, "integer >= 0"),
                       ({"rounds": True}, "integer >= 0"), ({"after": "never"}, "after must be one of"),
                       ({"rounds": 1, "every": 2}, "unknown fields")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            Hold.of(bad)
    with pytest.raises(ValueError, match="must be a Hold"):
        Hold.of(3)


def _held(policy: FrozenPolicy, hold: Hold) -> FrozenPolicy:
    return FrozenPolicy(policy.module, {**policy.card, "hold": hold.to_dict()})


@pytest.mark.parametrize("after", ["plain", "declined"])
def test_the_session_holds_plain_decoding_unasked(after: str):
    """The plain stand-in (K = 0 always) on the prompt lookup with a hold of 3: after each round it is asked, the
    next 3 are held — no probe, no choice timed, the same plain action — unless, with "declined", its probe found
    nothing; the tokens are target-only greedy decoding's."""
    target = engine.load_model(zoo_path("tiny-moe"))
    prompts = encode(target.tokenizer, code_prompts(2), 40)
    ref = engine.Engine(target).generate(prompts, 24)
    eng = engine.Engine(target, drafter="ngram")
    policy = _held(stand_in_policy(GRID, probe=(8, 3)), Hold(3, after))
    assert policy.hold == Hold(3, after)
    for prompt, want in zip(prompts, ref):
        s = eng.start([prompt], 24, policy=policy)
        asked, probed = [], []
        while s.active:
            r = s.requests[s.active[0]]
            depth = min(8, r.max_new - len(r.new_tokens) - 1)
            conf = eng.drafter.lookup_probe(list(r.tokens), len(r.prompt), depth, 3)[0] if depth > 0 else []
            probed.append(any(conf))
            st = s.step()[0]
            asked.append(st.policy_seconds > 0)
            assert st.depth == 0 and (st.probe_seconds > 0) == (asked[-1] and depth > 0)
        assert s.requests[0].new_tokens == want.token_ids
        s.close()
        left = 0
        for i, was_asked in enumerate(asked):  # the rule, replayed round by round
            assert was_asked == (left == 0), (i, asked)
            left = (left - 1) if left else (3 if after == "plain" or probed[i] else 0)
        assert asked.count(False) >= 3


def test_a_failed_step_puts_the_holds_back(monkeypatch):
    """An exception in a step's work after the choice started a hold: the step is rolled back with the hold as it
    was, so the retried step asks the policy again and the run equals an uninterrupted one."""
    target = engine.load_model(zoo_path("tiny-moe"))
    prompt = encode(target.tokenizer, code_prompts(1), 40)[0]
    eng = engine.Engine(target, drafter="ngram")
    policy = _held(stand_in_policy(GRID, probe=(8, 3)), Hold(2, "plain"))

    def run(fail_at: int | None) -> tuple[list[bool], list[int]]:
        s = eng.start([prompt], 12, policy=policy)
        asked, n = [], 0
        real = eng._step
        while s.active:
            if n == fail_at:

                def boom(*a, **k):
                    raise RuntimeError("injected")

                before = s.requests[0].held
                monkeypatch.setattr(eng, "_step", boom)
                with pytest.raises(RuntimeError, match="injected"):
                    s.step()
                monkeypatch.setattr(eng, "_step", real)
                assert s.requests[0].held == before
            asked.append(s.step()[0].policy_seconds > 0)
            n += 1
        tokens = list(s.requests[0].new_tokens)
        s.close()
        return asked, tokens

    assert run(None) == run(0) == run(1) == run(3)


def test_the_card_carries_the_hold(tmp_path):
    """A frozen policy's `hold` comes from its card (none when absent); a bad entry is a clear error at load that
    names the card."""
    from engine.runtime.frozen import load_frozen_policy

    base = stand_in_policy(GRID)
    assert base.hold == NO_HOLD
    folder = tmp_path / "p"
    folder.mkdir()
    torch.jit.save(torch.jit.trace(base.module, torch.zeros(1, OBS_DIM)), str(folder / "policy.pt"))
    for entry, want in ((None, NO_HOLD), ({"rounds": 4, "after": "declined"}, Hold(4, "declined"))):
        (folder / "policy.json").write_text(json.dumps({**base.card, "hold": entry}))
        assert load_frozen_policy(folder).hold == want
    (folder / "policy.json").write_text(json.dumps({**base.card, "hold": {"rounds": -2}}))
    with pytest.raises(ValueError, match=r"policy\.json: hold rounds must be an integer >= 0"):
        load_frozen_policy(folder)
