"""The context probe: the prompt lookup probing for a drafter without a probe (engine.runtime.context_probe).

Its C++ path equals its Python twin; a session with such a drafter (the zoo's dense draft model, an EAGLE head)
gives a probing policy the context probe's values of the request's own tokens and times them, and decodes exactly as
without the probe (nothing drafts from it)."""

from __future__ import annotations

import random

import pytest

import engine
from engine.drafting.ngram import NGramDrafter
from engine.paths import zoo_path
from engine.runtime.context_probe import ContextProbe
from engine.runtime.observation import KMAX, probe_values
from engine.workloads import code_prompts, encode, prose_prompts
from kernels import lookup


def test_the_lookup_probe_equals_its_python_twin():
    """`lookup_probe` (one C++ call) equals `lookup_probe_py` on random token streams: the confidences, the
    continuations and the match's source, for every prompt length (the source's in_output reads it)."""
    if lookup.native() is None:
        pytest.skip("the C++ lookup is not built here")
    rng = random.Random(0)
    d = NGramDrafter(vocab_size=8)
    for _ in range(1500):
        T = rng.randint(1, 60)
        tokens = [rng.randint(0, 5) for _ in range(T)]
        P, K, W = rng.randint(1, T), rng.randint(1, 8), rng.randint(1, 3)
        a, b = d.lookup_probe(tokens, P, K, W), d.lookup_probe_py(tokens, P, K, W)
        assert a[0] == b[0] and a[2] == b[2] and a[1].continuations == b[1].continuations, (tokens, P, K, W)


def test_context_probe_values():
    """The context probe gives `probe_values`: the lookup's confidences padded to KMAX, then its match's
    (recency, in_output); nothing when there is nothing to draft; (0, 0) where nothing recurs."""
    cp, d = ContextProbe(), NGramDrafter(vocab_size=8)
    tokens = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2]
    conf, _, source = d.lookup_probe(tokens, 4, 4, 2)
    got = cp.probe(tokens, 4, 4, 2)
    assert got == probe_values(conf, source) and len(got) == KMAX + 2
    assert got[KMAX + 1] == 1.0  # the match "1 2" nearest the end follows the prompt: the model's own output
    assert cp.probe(tokens, 4, 0, 2) == [] and cp.probe(tokens, 4, 3, 0) == []
    assert cp.probe([1, 2, 3], 3, 4, 1)[KMAX:] == [0.0, 0.0]


class _Probing:
    """A static policy that asks for a probe and records what it saw."""

    probe = (4, 2)

    def __init__(self) -> None:
        self.seen: list[tuple[float, ...]] = []

    def __call__(self, obs):
        self.seen.append(obs.confidence_now + obs.match_now)
        return engine.SpecConfig(depth=3, width=2)


@pytest.mark.parametrize("drafter", ["tiny-dense", "eagle-head"])
def test_a_session_probes_the_context_for_a_drafter_without_a_probe(drafter):
    """A drafter without a probe: Session.probe gives the context probe's values of the request's tokens (capped by
    its token budget, as drafting), times them into the round's `probe_seconds`, and a probing policy's output equals
    the same actions' output without it."""
    target = engine.load_model(zoo_path("tiny-moe"))
    prompts = encode(target.tokenizer, code_prompts(1) + prose_prompts(1), 40)
    draft = engine.load_model(zoo_path(drafter)) if drafter == "tiny-dense" else zoo_path(drafter)
    eng = engine.Engine(target, drafter=draft)
    assert getattr(eng.drafter, "probe", None) is None
    policy, n = _Probing(), 24
    sess = eng.start(prompts, n, policy=policy)
    cp, found = ContextProbe(), 0
    try:
        while not sess.done:
            for rid in sess.active:
                r = sess.requests[rid]
                depth = min(4, r.max_new - len(r.new_tokens) - 1)
                want = cp.probe(list(r.tokens), len(r.prompt), depth, 2)
                assert sess.probe(rid, 4, 2) == want
                found += bool(want) and want[KMAX] > 0
            sess.step()
            assert all(sess.requests[rid].rounds[-1].probe_seconds > 0 for rid in sess.active)
        probed = sess.results()
    finally:
        sess.close()
    assert found > 0 and len(policy.seen) > 0 and any(any(v) for v in policy.seen)
    plain = eng.generate(prompts, n, spec=engine.SpecConfig(depth=3, width=2))
    assert [r.token_ids for r in probed] == [r.token_ids for r in plain]
    assert eng.generate(prompts, n)[0].token_ids == probed[0].token_ids  # and target-only's (greedy)
