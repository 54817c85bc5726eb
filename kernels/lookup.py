"""Prompt lookup in C++ (`lookup.cpp`): the suffix match, the match's source and the n-gram drafter's probe in one
call each. Reference twins, in Python: `engine.drafting.suffix.suffix_match_py`,
`engine.drafting.suffix.match_source_py` and `engine.drafting.ngram.NGramDrafter.probe_py` (the same matches,
followers in the same order, float32 confidences and sources: tests/kernels/test_lookup.py).

    from kernels import lookup
    fns = lookup.native()    # (match, probe, source) raw C functions, or None when the extension is off
    conts, ngram, followers = match(tokens, depth, width, max_ngram, min_ngram, cap)
    confidence, conts, ngram, followers, recency, in_output = probe(tokens, depth, width, max_ngram, min_ngram, cap,
                                                                    node_budget, prompt_len)
    recency, in_output = source(tokens, prompt_len, max_ngram, min_ngram)

Why: a learned policy that observes this round's draft (`confidence_now`) pays the probe before every lookup round,
also before the rounds it then drafts nothing; in Python it cost 26–33 µs in place after a forward (README, issue 10),
and the match's source, a second scan in Python, brought it back from ~10 to ~26 µs (session 2026-12-06 e).
Plain CPython, no torch headers: built on first use in about a second; off when `EXPERTSPEC_NATIVE_LOOKUP=0`,
without a compiler or on a failed build (`status()` says which), and the Python twins then run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kernels.cpp_build import CppExtension

_EXT = CppExtension("lookup", "EXPERTSPEC_NATIVE_LOOKUP", cflags=("-O2",))
load = _EXT.load  # the compiled extension (built on the first call), or None when it is off
status = _EXT.status  # 'on' or 'off (<why>)'
_FNS: list[Any] = []


def native() -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]] | None:
    """The raw `(match, probe, source)` functions, or None when the extension is off (looked up once per process)."""
    if not _FNS:
        module = load()
        _FNS.append(None if module is None else (module.match, module.probe, module.source))
    return _FNS[0]
