"""The KV invariant, checked after a round (`Engine(check_kv=True)`, a debugging aid): no scratch block is held
between rounds, and each request's committed slots hold exactly the K/V a fresh prefill of its committed tokens
produces (no unverified token ever reaches the committed cache)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from engine.models.batching import chain_item, pack
from engine.models.kv_cache import PagedKVCache
from engine.models.transformer import Model


def check_kv_invariant(target: Model, kv: PagedKVCache, requests: Sequence[Any]) -> None:
    """AssertionError naming the request and K or V that break the invariant. `requests`: the engine's requests
    (cached_len, tokens, slot_table, index)."""
    if kv.scratch:
        raise AssertionError(f"scratch blocks still held after the round: {kv.scratch}")
    for r in requests:
        n = r.cached_len
        fresh = PagedKVCache.for_model(target.config, -(-n // 16) + 1, 16, kv.k.dtype, kv.k.device)
        fresh.add_sequence(0)
        fresh.reserve(0, n)
        slots = fresh.slots(0, range(n))
        target.forward_batch(pack([chain_item(r.tokens[:n], slots[:0], slots)], target.device), fresh)
        mine = r.slot_table[:n]
        for name, a, b in (("K", kv.k, fresh.k), ("V", kv.v, fresh.v)):
            if not torch.allclose(a[:, mine], b[:, slots.to(b.device)], atol=1e-4, rtol=1e-4):
                raise AssertionError(f"request {r.index}: committed {name} cache differs from a fresh prefill")
