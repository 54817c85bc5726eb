"""The checks of a request's arguments (`Engine.generate` / `Session.start` / `Session.add`): every bad input is a
clear error raised before any work."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.spec.config import SpecConfig
from engine.spec.sampling import SamplingParams


def check_request_inputs(
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: SamplingParams | Sequence[SamplingParams],
    spec: SpecConfig | None,
    eos_token_id: int | None,
    *,
    vocab_size: int,
    context_length: int,
    has_drafter: bool,
    allow_none: bool = False,
) -> list[SamplingParams]:
    """Validate prompts (token-id lists inside [0, vocab_size), each fitting `context_length` with its new tokens),
    max_new_tokens, sampling (one SamplingParams or one per prompt), spec and eos_token_id; returns the
    SamplingParams of each prompt. `allow_none`: an empty prompt list is allowed (an EP rank without work)."""
    V = vocab_size
    hint = {str: "a str: tokenize it first, e.g. [tokenizer.encode(text).ids]", torch.Tensor: "a tensor: pass "
            "tensor.tolist() ([tensor.tolist()] for one 1-D prompt)"}.get(type(prompts))  # fmt: skip
    if hint is None and isinstance(prompts, (list, tuple)) and any(isinstance(t, int) for t in prompts):
        hint = "a flat list of ints: one prompt is [[t0, t1, ...]]"
    if hint is not None or not isinstance(prompts, (list, tuple)) or (not prompts and not allow_none):
        raise ValueError(f"prompts must be a non-empty list of token-id lists, got {hint or repr(prompts)[:80]}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    for i, p in enumerate(prompts):
        if not isinstance(p, (list, tuple)):
            raise ValueError(f"prompt {i} must be a list of token ids, got {type(p).__name__} (tensor: .tolist())")
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            raise ValueError(f"prompt {i} must be a list of ints")
        lo, hi = min(p), max(p)
        if lo < 0 or hi >= V:
            raise ValueError(f"prompt {i} has token id {lo if lo < 0 else hi} outside the vocabulary [0, {V})")
        if len(p) + max_new_tokens > context_length:
            raise ValueError(
                f"prompt {i}: {len(p)} prompt tokens + max_new_tokens {max_new_tokens} exceed the "
                f"context length {context_length}"
            )
    if isinstance(sampling, SamplingParams):
        params = [sampling] * len(prompts)
    elif isinstance(sampling, dict) or not isinstance(sampling, (list, tuple)):
        raise TypeError(f"sampling must be an engine.SamplingParams (or a list, one per prompt), got a "
                        f"{type(sampling).__name__}: e.g. engine.SamplingParams(**{sampling!r:.60})")  # fmt: skip
    else:
        params = list(sampling)
        bad = [type(s).__name__ for s in params if not isinstance(s, SamplingParams)]
        if len(params) != len(prompts) or bad:
            raise ValueError(
                f"sampling must be one SamplingParams or a list with one per prompt "
                f"({len(prompts)}), got {len(params)} items" + (f" of type {bad[0]}" if bad else "")
            )
    if spec is not None and not isinstance(spec, SpecConfig):
        raise TypeError(f"spec must be an engine.SpecConfig or None, got {type(spec).__name__}")
    if spec is not None and spec.depth > 0 and not has_drafter:
        raise ValueError("spec.depth > 0 needs a drafter: Engine(target, drafter=...)")
    if eos_token_id is not None and not (isinstance(eos_token_id, int) and 0 <= eos_token_id < V):
        raise ValueError(f"eos_token_id must be None or an int in [0, {V}), got {eos_token_id!r}")
    return params
