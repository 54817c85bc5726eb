"""The C++ prompt lookup (kernels.lookup) against its Python reference twins: engine.drafting.suffix.suffix_match_py,
engine.drafting.suffix.match_source_py and NGramDrafter.probe_py — the same continuations, n-gram length, followers
in the same order, the same float32 confidences and the same match sources."""

from __future__ import annotations

import random

import pytest

from engine.drafting.ngram import NGramDrafter
from engine.drafting.protocol import MAX_TREE_NODES
from engine.drafting.suffix import SuffixMatch, match_source, match_source_py, suffix_match, suffix_match_py
from engine.spec.config import MAX_DEPTH
from kernels import lookup

pytestmark = pytest.mark.skipif(lookup.load() is None, reason=f"C++ lookup {lookup.status()}")


def _fields(m):
    return m.continuations, m.ngram, list(m.followers.items())  # the followers' order too


def _cases(seed, n=3000):
    rng = random.Random(seed)
    for _ in range(n):
        tokens = [rng.randrange(rng.choice([2, 4, 9, 50])) for _ in range(rng.randrange(0, 90))]
        max_ngram = rng.randrange(1, 6)
        yield tokens, rng.randrange(0, 12), rng.randrange(0, 5), max_ngram, rng.randrange(1, max_ngram + 1)


def test_match_equals_its_python_twin():
    rng = random.Random(1)
    for tokens, depth, width, max_ngram, min_ngram in _cases(0):
        sel = rng.choice([None, 4, 8, 16])
        got = suffix_match(tokens, depth, width, max_ngram, min_ngram, select_depth=sel)
        want = suffix_match_py(tokens, depth, width, max_ngram, min_ngram, select_depth=sel)
        assert _fields(got) == _fields(want), (tokens, depth, width, max_ngram, min_ngram, sel)


def test_match_source_equals_its_python_twin():
    rng = random.Random(4)
    seen = set()
    for tokens, _, _, max_ngram, min_ngram in _cases(5):
        prompt_len = rng.randrange(0, len(tokens) + 2)
        got = match_source(tokens, prompt_len, max_ngram, min_ngram)
        assert got == match_source_py(tokens, prompt_len, max_ngram, min_ngram), (tokens, prompt_len, max_ngram)
        seen.add(got[1])
    assert seen == {0.0, 1.0}  # matches in the prompt and in the output both met


def test_probe_equals_its_python_twin_and_keeps_the_same_match():
    rng = random.Random(6)
    for tokens, depth, width, max_ngram, min_ngram in _cases(2):
        if depth <= 0 or width <= 0:
            continue
        fast, slow = NGramDrafter(64, max_ngram, min_ngram), NGramDrafter(64, max_ngram, min_ngram)
        prompt = tokens[: rng.randrange(0, len(tokens) + 1)]
        fast.start(0, prompt)
        slow.start(0, prompt)
        assert fast.probe(0, tokens, depth, width) == slow.probe_py(0, tokens, depth, width), (tokens, depth, width)
        (n1, d1, w1, m1), (n2, d2, w2, m2) = fast._probed[0], slow._probed[0]
        assert (n1, d1, w1, _fields(m1)) == (n2, d2, w2, _fields(m2))
        assert fast.probed_source(0) == slow.probed_source(0) == match_source_py(tokens, len(prompt), max_ngram,
                                                                                 min_ngram)  # fmt: skip


@pytest.mark.parametrize("native", [True, False])
def test_probe_with_source_is_probe_and_its_source_in_one_call(native):
    """`probe_with_source` (Session.probe's path) = (probe, probed_source) of the Python twin, with or without the C++
    lookup, and keeps the same match for the round's draft; `lookup_probe_source` = lookup_probe_py less the match."""
    rng = random.Random(7)
    for tokens, depth, width, max_ngram, min_ngram in _cases(3):
        if depth <= 0 or width <= 0:
            continue
        fast, slow = NGramDrafter(64, max_ngram, min_ngram), NGramDrafter(64, max_ngram, min_ngram)
        if not native:
            fast._native_probe = None
        prompt = tokens[: rng.randrange(0, len(tokens) + 1)]
        fast.start(0, prompt)
        slow.start(0, prompt)
        conf, recency, in_output = fast.probe_with_source(0, tokens, depth, width)
        assert conf == slow.probe_py(0, tokens, depth, width), (tokens, depth, width)
        assert (recency, in_output) == slow.probed_source(0) == fast.probed_source(0)
        (n1, d1, w1, m1), (n2, d2, w2, m2) = fast._probed[0], slow._probed[0]
        m1 = SuffixMatch(*m1) if isinstance(m1, tuple) else m1
        assert (n1, d1, w1, _fields(m1)) == (n2, d2, w2, _fields(m2))
        want_conf, _, want_source = slow.lookup_probe_py(tokens, len(prompt), depth, width)
        assert fast.lookup_probe_source(tokens, len(prompt), depth, width) == (want_conf, *want_source)


def test_probe_respects_the_node_budget(monkeypatch):
    """Deep continuations of several widths fill more than a small node budget: both stop where it runs out."""
    rng = random.Random(3)
    tokens = [t for _ in range(60) for t in (0, 1, rng.randrange(2, 6), 6)] + [0, 1]
    for budget in (1, 3, 7, 20, MAX_TREE_NODES):
        monkeypatch.setattr("engine.drafting.ngram.MAX_TREE_NODES", budget)
        fast, slow = NGramDrafter(8), NGramDrafter(8)
        got = fast.probe(0, tokens, MAX_DEPTH, 4)
        assert got == slow.probe_py(0, tokens, MAX_DEPTH, 4) and len(got) == min(budget, MAX_DEPTH)
        assert len(fast._probed[0][3].continuations) == 4


def test_bad_tokens_and_arguments_raise():
    match, probe, source = lookup.native()
    with pytest.raises(TypeError):
        match([1, "a", 1], 2, 1, 4, 1, 2)
    with pytest.raises(TypeError):
        match(5, 2, 1, 4, 1, 2)
    with pytest.raises(TypeError):
        probe([1, 2, 1], 2, 1, 4, 1, 2, 8)  # no prompt length
    with pytest.raises(TypeError):
        source([1, 2, 1], 3, 4)
    with pytest.raises(ValueError, match="min_ngram"):
        match_source([1, 2, 1], 3, 2, 3)


def test_switched_off_by_the_environment(switched_off):
    code = (
        "from kernels import lookup; from engine.drafting.suffix import suffix_match; "
        "print(lookup.status(), lookup.native(), suffix_match([1, 2, 3, 1, 2], 2, 1).continuations)"
    )
    assert switched_off("EXPERTSPEC_NATIVE_LOOKUP", code) == "off (EXPERTSPEC_NATIVE_LOOKUP=0) None [[3, 1]]"


def test_a_drafter_loads_it_when_made_never_inside_a_timed_round(switched_off):
    """The first `native()` builds or imports the extension (seconds, then milliseconds): a recording's first timed
    probe must not carry it, so an NGramDrafter looks it up when it is made."""
    code = (
        "from kernels import lookup; from engine.drafting.ngram import NGramDrafter; "
        "print(lookup._FNS, end=' '); NGramDrafter(8); print(lookup._FNS)"
    )
    assert switched_off("EXPERTSPEC_NATIVE_LOOKUP", code) == "[] [None]"  # looked up (off here) before any probe
