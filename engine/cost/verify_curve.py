"""Measured T(n)/T(1): what one target forward over n tokens costs relative to one token (DESIGN §8).

Two measurements, for two questions:

- `cached_verify_curve`: the real verification forward of `python -m engine.bench` (decode mode): n new
  chain tokens over a paged KV cache already holding `context` tokens; median seconds per size.
- `uncached_forward_curve`: a plain forward over n tokens with no cache (no prefix, so attention is
  understated), one thread, best of `repeats`: the cheap proxy `python -m engine.zoo` reports for the
  shipped target, comparable across machines and builds.

Shape letters: n=new tokens c=context tokens.
"""

from __future__ import annotations

import statistics
import time

import torch

from engine.models.batching import chain_item, pack
from engine.models.kv_cache import PagedKVCache
from engine.models.transformer import ForwardBatch, Model


class CachedChain:
    """One sequence's paged KV cache holding `context` random tokens (seeded), and the ForwardBatch of the next
    n <= max_new chain tokens after them: what a verification forward of n tokens runs. `close()` (or `with`)
    releases the cache."""

    @torch.inference_mode()
    def __init__(self, model: Model, context: int, max_new: int, seed: int = 0, block_size: int = 16) -> None:
        cfg = model.config
        total = context + max_new
        self.model, self.context = model, context
        self.kv = PagedKVCache.for_model(cfg, -(-total // block_size), block_size, model.dtype, model.device)
        self.kv.add_sequence(0)
        self.kv.reserve(0, total)
        self.slots = self.kv.slots(0, range(total))
        self.tokens = torch.randint(0, cfg.vocab_size, (total,), generator=torch.Generator().manual_seed(seed))
        model.forward_batch(pack([chain_item(self.tokens[:context], self.slots[:0], self.slots[:context])],
                                 model.device), self.kv)  # fmt: skip

    def batch(self, n: int) -> ForwardBatch:
        """The next n chain tokens [n] as one request's ForwardBatch (reading the context, writing past it)."""
        c, s = self.context, self.slots
        return pack([chain_item(self.tokens[c : c + n], s[:c], s[c : c + n])], self.model.device)

    def close(self) -> None:
        self.kv.release(0)

    def __enter__(self) -> CachedChain:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@torch.inference_mode()
def cached_verify_curve(model: Model, sizes: list[int], repeats: int = 3, context: int = 128) -> list[dict]:
    """Median seconds of one cached target forward over n new chain tokens after `context` cached tokens,
    and T(n)/T(sizes[0]): rows {"tokens": n, "seconds": s, "ratio": s / s_0}."""
    rows = []
    with CachedChain(model, context, max(sizes)) as chain:
        for n in sizes:
            batch = chain.batch(n)
            times = []
            for _ in range(max(repeats, 3) * 3):
                t0 = time.perf_counter()
                model.forward_batch(batch, chain.kv)
                times.append(time.perf_counter() - t0)
            rows.append({"tokens": n, "seconds": statistics.median(times)})
    base = rows[0]["seconds"]
    for r in rows:
        r["ratio"] = r["seconds"] / base
    return rows


@torch.inference_mode()
def uncached_forward_curve(model: Model, sizes: list[int], repeats: int = 20, seed: int = 0) -> dict[str, float]:
    """T(n)/T(sizes[0]) of a plain forward over n tokens without a KV cache, 1 thread, best of `repeats`:
    {"n=<n>": ratio, ..., "ms_n=<n>": milliseconds, ...}."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(seed)
    try:
        best: dict[int, float] = {}
        for n in sizes:
            ids = torch.randint(0, model.vocab_size, (1, n), generator=gen)
            model(ids)  # warm-up
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                model(ids)
                times.append(time.perf_counter() - t0)
            best[n] = min(times)
    finally:
        torch.set_num_threads(threads)
    base = best[sizes[0]]
    return {f"n={n}": best[n] / base for n in sizes} | {f"ms_n={n}": best[n] * 1e3 for n in sizes}
