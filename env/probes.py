"""The probe values a replayed policy observes, computed from a trace's tokens as a deployed engine computes them:
where the prompt lookup's match comes from (`probed_sources`) and the context probe (`context_probes`) per position.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence

from engine.drafting.suffix import match_source
from engine.runtime.context_probe import ContextProbe
from env.trace import Trace


def _prefixes(trace: Trace) -> Iterator[tuple[list[int], int]]:
    """Per position [P], in order: (the prompt and the committed tokens before it, the prompt's length)."""
    for i in range(trace.num_requests):
        prompt = [int(x) for x in trace.prompt(i)]
        tokens = prompt + [int(x) for x in trace.continuation_of(i)]
        P = len(prompt)
        for t in range(len(trace.positions_of(i))):
            yield tokens[: P + t], P


def probed_sources(trace: Trace) -> list[tuple[float, float]]:
    """Per position [P]: where the prompt lookup's match at that position comes from, (recency, in_output) of
    engine.drafting.suffix.match_source over the prompt and the committed tokens before it — what
    `NGramDrafter.probed_source` gives a deployed policy (the drafter's n-gram bounds from its digest)."""
    m = re.search(r"max(\d+)-min(\d+)", str(trace.meta["drafter"].get("digest", "")))
    hi, lo = (int(m.group(1)), int(m.group(2))) if m else (4, 1)
    return [match_source(tokens, P, hi, lo) for tokens, P in _prefixes(trace)]


def context_probes(trace: Trace, depth: Sequence[int], width: int) -> list[list[float]]:
    """Per position [P]: the context probe's values (engine.runtime.context_probe: the prompt lookup over the prompt
    and the committed tokens before it, a `depth[p]` × `width` tree; [] where depth[p] <= 0), what `Session.probe`
    gives a deployed policy whose drafter has no probe."""
    probe = ContextProbe()
    return [probe.probe(tokens, P, int(d), width) for (tokens, P), d in zip(_prefixes(trace), depth, strict=True)]
