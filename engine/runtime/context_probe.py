"""The context probe: the prompt lookup run beside a drafter that has no probe of its own.

A policy that observes `confidence_now` and `match_now` (engine.runtime.observation) gets them before its choice
from the drafter's own probe when it has one: the prompt lookup drafts its round from the match it probed
(`NGramDrafter.probe`). Any other drafter (an EAGLE head, an MTP module, a dense draft model) would need a forward
to say anything about this round. For those, the context probe runs the prompt lookup over the request's tokens on
the host instead (one C++ call, ~10 µs): the lookup's confidence per depth and where its match comes from. Nothing
it finds is drafted; the round's drafter drafts as it would without it.

Why it helps a policy choosing K for another drafter: on the zoo's EAGLE traces the head's own first-token
confidence barely predicts how much it will have accepted (correlation 0.05–0.19), while the lookup's match recency
does, before any drafting (0.10–0.32); whether the lookup's continuation agrees with the head's first token predicts
it strongly (0.28–0.61; README, Results, session 2026-12-06 f).

Its values are `probe_values` (the lookup's confidences padded to KMAX, then (recency, in_output)), the layout the
lookup's own probe gives; replay computes the same values from a trace's tokens (env.replay.context_probes).
"""

from __future__ import annotations

from engine.drafting.ngram import NGramDrafter
from engine.runtime.observation import probe_values_of


class ContextProbe:
    """The prompt lookup's probe of a request's tokens, for a policy whose drafter has no probe (module docstring)."""

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1) -> None:
        self._lookup = NGramDrafter(vocab_size=1, max_ngram=max_ngram, min_ngram=min_ngram)  # never drafts

    def probe(self, tokens: list[int], prompt_len: int, depth: int, width: int) -> list[float]:
        """`probe_values` [KMAX + 2] of the lookup's depth × width probe of `tokens` (prompt + committed; the first
        `prompt_len` of them the prompt); [] when depth or width is not positive."""
        if depth <= 0 or width <= 0:
            return []
        return probe_values_of(*self._lookup.lookup_probe_source(tokens, prompt_len, depth, width))
