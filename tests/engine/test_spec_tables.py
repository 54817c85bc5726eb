"""Known-answer greedy tables with forced one-hot logits (mock target and drafter)."""

from __future__ import annotations

import pytest
from mocks import ScriptedDrafter, ScriptedTarget

import engine

SCRIPT = [(7 * i + 3) % 97 for i in range(200)]
PROMPT = SCRIPT[:5]


def _run(miss, depth, n=12, tree=False, eos=None, prompts=None, spec=None):
    target = ScriptedTarget(SCRIPT)
    eng = engine.Engine(target, drafter=ScriptedDrafter(SCRIPT, miss, tree=tree), instrument=False, check_kv=True)
    res = eng.generate(
        prompts or [PROMPT],
        n,
        spec=spec or engine.SpecConfig(depth=depth, width=2 if tree else 1),
        eos_token_id=eos,
    )
    eng.kv.check_quiescent()
    return res


@pytest.mark.parametrize("miss", [1, 2, 3, 4])
@pytest.mark.parametrize("tree", [False, True])
def test_mismatch_at_each_depth(miss, tree):
    res = _run(miss, 4, tree=tree)[0]
    assert res.token_ids == SCRIPT[5:17]
    first = res.rounds[0]
    assert first.accepted == miss - 1
    assert first.committed == miss  # accepted + recovered
    assert first.rejection_depth == miss
    assert not first.bonus
    assert first.accepted_by_depth == [1 if d < miss else 0 for d in range(1, 5)]
    assert first.attempted_by_depth == [1 if d <= miss else 0 for d in range(1, 5)]


@pytest.mark.parametrize("tree", [False, True])
def test_full_accept_plus_bonus(tree):
    res = _run(None, 4, n=15, tree=tree)[0]
    assert res.token_ids == SCRIPT[5:20]
    assert [r.committed for r in res.rounds] == [5, 5, 5]
    assert all(r.bonus and r.accepted == 4 for r in res.rounds)
    assert res.acceptance_length == 5.0


def test_k0_is_plain_decoding():
    res = _run(None, 0, n=6)[0]
    assert res.token_ids == SCRIPT[5:11]
    assert [(r.depth, r.proposed, r.committed) for r in res.rounds] == [(0, 0, 1)] * 6


def test_mixed_k_in_one_batch_via_policy():
    prompts = [SCRIPT[:5], SCRIPT[:9], SCRIPT[:3]]
    depths = {5: 3, 9: 0, 3: 1}

    def policy(obs):
        return (depths[obs.prompt_len], 1, 0.0)

    target = ScriptedTarget(SCRIPT)
    eng = engine.Engine(target, drafter=ScriptedDrafter(SCRIPT, None), instrument=False, check_kv=True)
    res = eng.generate(prompts, 8, policy=policy)
    for p, r in zip(prompts, res):
        assert r.token_ids == SCRIPT[len(p) : len(p) + 8]
        K = depths[len(p)]
        assert r.rounds[0].committed == K + 1
    eng.kv.check_quiescent()


def test_eos_inside_an_accepted_block():
    eos = SCRIPT[7]  # third new token, inside the first accepted block of 5
    res = _run(None, 4, n=12, eos=eos)[0]
    assert res.token_ids == SCRIPT[5:8]
    assert res.finish_reason == "eos"
    assert res.rounds[0].committed == 3


def test_max_tokens_inside_a_block():
    res = _run(None, 4, n=7)[0]
    assert res.token_ids == SCRIPT[5:12]
    assert sum(r.committed for r in res.rounds) == 7
