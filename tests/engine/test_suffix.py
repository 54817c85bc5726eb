"""SuffixIndex answers exactly what the prompt-lookup drafter's suffix matching answers."""

from __future__ import annotations

import random

from engine.drafting.suffix import SuffixIndex, suffix_continuations


def test_suffix_index_equals_the_reference_scan():
    rng = random.Random(1)
    for _ in range(5000):
        vocab = rng.choice([2, 3, 5, 20])
        ctx = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        path = [rng.randrange(vocab) for _ in range(rng.randint(0, 6))]
        ref = suffix_continuations(ctx + path, 1, 1, 4, 1)
        assert SuffixIndex(ctx).next_token(path, 4) == (ref[0][0] if ref else None), (ctx, path)


def test_suffix_continuations_known_answers():
    assert suffix_continuations([1, 2, 3, 1, 2], 2, 1) == [[3, 1]]  # "1 2" recurs: what followed it
    assert suffix_continuations([1, 2, 3], 2, 1) == []
    # width 2: distinct first tokens, most recent match first
    assert suffix_continuations([7, 1, 7, 2, 7], 1, 2) == [[2], [1]]
