"""Suffix matching over token sequences: what the prompt-lookup (n-gram) drafter proposes, and a per-context
index that answers the same question quickly for many short extensions (the calibrated verification rule
asks it for every drafted node, engine.drafting.acceptance)."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kernels import lookup


@dataclass(frozen=True)
class SuffixMatch:
    """What prompt lookup found: the continuations, the length n of the suffix that matched (0: none) and how
    often each token followed that suffix earlier (over every earlier occurrence, not only the chosen ones)."""

    continuations: list[list[int]]
    ngram: int
    followers: dict[int, int]


def suffix_match(
    tokens: list[int], depth: int, width: int, max_ngram: int = 4, min_ngram: int = 1, select_depth: int | None = None
) -> SuffixMatch:
    """Up to `width` continuations (at most `depth` tokens) with distinct first tokens of the longest suffix
    of `tokens` (n = max_ngram .. min_ngram) that occurred earlier; per first token the longest continuation
    (most recent on ties); none when no suffix of length >= min_ngram recurs.

    Lengths are compared up to `select_depth` (default `depth`) and the chosen continuations then cut to `depth`:
    with a fixed `select_depth` >= depth the depth-K result is the depth-K prefix of the deeper ones (the
    NGramDrafter's trees, which trace replay cuts by depth). Runs in C++ (kernels.lookup) when it is built;
    `suffix_match_py` is its reference twin."""
    fns = lookup.native()
    if fns is None:
        return suffix_match_py(tokens, depth, width, max_ngram, min_ngram, select_depth)
    cap = depth if select_depth is None else max(select_depth, depth)
    return SuffixMatch(*fns[0](tokens, depth, width, max_ngram, min_ngram, cap))


def suffix_match_py(
    tokens: list[int], depth: int, width: int, max_ngram: int = 4, min_ngram: int = 1, select_depth: int | None = None
) -> SuffixMatch:
    """`suffix_match` in Python (the C++ one's reference twin)."""
    if depth <= 0:
        return SuffixMatch([], 0, {})
    cap = depth if select_depth is None else max(select_depth, depth)
    T = len(tokens)
    if T < 2:
        return SuffixMatch([], 0, {})
    last = tokens[-1]
    ends = [e for e in range(T - 2, -1, -1) if tokens[e] == last]  # earlier occurrences of the last token, latest first
    for n in range(min(max_ngram, T - 1), min_ngram - 1, -1):
        suffix = tokens[T - n :]
        best: dict[int, list[int]] = {}
        followers: dict[int, int] = {}
        for e in ends:  # most recent earlier match first: the n-gram tokens[start : e + 1], its continuation after it
            start = e - n + 1
            if start >= 0 and tokens[start : e + 1] == suffix:
                cont = tokens[start + n : start + n + cap]
                followers[cont[0]] = followers.get(cont[0], 0) + 1
                if len(cont) > len(best.get(cont[0], [])):
                    if cont[0] not in best and len(best) == width:
                        continue
                    best[cont[0]] = cont
        if best:
            return SuffixMatch([c[:depth] for c in best.values()], n, followers)
    return SuffixMatch([], 0, {})


def match_source(tokens: Sequence[int], prompt_len: int, max_ngram: int = 4, min_ngram: int = 1) -> tuple[float, float]:
    """Where the prompt lookup's match comes from: (recency, in_output) of the most recent earlier occurrence of the
    longest suffix of `tokens` (n = max_ngram .. min_ngram) followed by at least one token — recency
    1 − min(log2(d + 1), 8) / 8 where d tokens separate its end from the end of `tokens`, in_output 1 when its
    continuation starts past the first `prompt_len` tokens (the model's own output), (0, 0) without a match.

    What the draft's confidence does not say: a small greedy model repeating its own recent output is accepted far
    more often than one copying its prompt (README, Results, session of 2026-12-06 e). Runs in C++ (kernels.lookup)
    when it is built; `match_source_py` is its reference twin."""
    if not 1 <= min_ngram <= max_ngram:
        raise ValueError(f"match_source: need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
    fns = lookup.native()
    if fns is None:
        return match_source_py(tokens, prompt_len, max_ngram, min_ngram)
    return fns[2](tokens, prompt_len, max_ngram, min_ngram)


def match_source_py(
    tokens: Sequence[int], prompt_len: int, max_ngram: int = 4, min_ngram: int = 1
) -> tuple[float, float]:
    """`match_source` in Python (the C++ one's reference twin)."""
    T = len(tokens)
    if T < 2:
        return 0.0, 0.0
    last, cap = tokens[T - 1], min(max_ngram, T - 1)
    best_n, best_e = 0, -1
    for e in range(T - 2, -1, -1):  # most recent first; a longer match wins, a tie keeps the more recent one
        if tokens[e] != last:
            continue
        n = 1
        while n < cap and n <= e and tokens[e - n] == tokens[T - 1 - n]:
            n += 1
        if n > best_n:
            best_n, best_e = n, e
            if n == cap:
                break
    if best_n < min_ngram:
        return 0.0, 0.0
    d = T - 1 - best_e
    return 1.0 - min(math.log2(d + 1), 8.0) / 8.0, 1.0 if best_e + 1 >= prompt_len else 0.0


def suffix_continuations(
    tokens: list[int], depth: int, width: int, max_ngram: int = 4, min_ngram: int = 1, select_depth: int | None = None
) -> list[list[int]]:
    """`suffix_match(...).continuations`."""
    return suffix_match(tokens, depth, width, max_ngram, min_ngram, select_depth).continuations


class SuffixIndex:
    """`suffix_continuations(context + path, 1, 1, max_ngram)` for many short `path`s over one `context`.

    Built once per context (token -> its positions), a query walks back over the occurrences of the last token
    only, instead of scanning the whole sequence once per n-gram length: the calibrated verification rule asks
    it for every drafted node of a round (engine.drafting.acceptance)."""

    def __init__(self, context: list[int]) -> None:
        self.context = context
        self.positions: dict[int, list[int]] = {}
        for i, t in enumerate(context):
            self.positions.setdefault(t, []).append(i)

    def next_token(self, path: list[int], max_ngram: int = 4) -> int | None:
        """The token after the most recent earlier occurrence of the longest recurring suffix (n <= max_ngram)
        of context + path, or None when not even its last token occurred before."""
        ctx, T = self.context, len(self.context)
        L = T + len(path)
        at = lambda i: ctx[i] if i < T else path[i - T]  # noqa: E731
        last = at(L - 1)
        # earlier occurrences j <= L - 2 of the last token, most recent first: in the path, then in the context
        occ = [T + k for k in range(len(path) - 2, -1, -1) if path[k] == last]
        ctx_occ = self.positions.get(last, ())
        hi = len(ctx_occ) if path else len(ctx_occ) - 1  # without a path the context's last token is the suffix
        for n in range(min(max_ngram, L - 1), 0, -1):
            for j in _chain_desc(occ, ctx_occ, hi):
                if j - n + 1 < 0:
                    continue
                if all(at(j - m) == at(L - 1 - m) for m in range(1, n)):
                    return at(j + 1)
        return None


def _chain_desc(first: list[int], ctx_occ: Sequence[int], hi: int) -> Iterator[int]:
    yield from first
    for i in range(hi - 1, -1, -1):
        yield ctx_occ[i]
