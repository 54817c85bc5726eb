"""CUDA graphs for the cached forward: capture `Model.forward_batch` once per shape bucket, replay it every step.

On a GPU a decode step of an MoE target is hundreds of small kernel launches; replaying a captured graph
removes the launch overhead (vLLM, SGLang and gpt-fast do the same). A graph has fixed shapes and fixed
memory, so every batch is padded into a bucket of static buffers:

    bucket (B, Tq, N, S): requests, query length per request, packed tokens, key slots per request
    input_ids / positions [N]   real tokens first; padding tokens repeat real token 0 (same id, position)
    write_slots [N]             padding tokens write into `pad_slot`, a cache slot no sequence owns
    read_slots [B, S]           padded with slot 0, masked out in attn_mask [B, Tq, S]
    pad_index [B, Tq]           the real cells; the rest point at the zero row (index N)
    unpad_order [N]             packed token -> its flat cell; padding tokens reuse token 0's cell

A padding token is token 0 again in every respect (embedding, position, attention output via its cell),
so it routes to token 0's experts: padding adds no distinct expert and no weight read, only rows. Its K/V
land in the pad slot, and its outputs are dropped. `GraphedForward` on a CPU model runs the same padded
forward eagerly (no capture), which is how the padding is tested without a GPU; on CUDA it captures
lazily, one graph per bucket, sharing one memory pool. Calls it cannot serve (routing records, phase
timers, expert budgets, batches beyond the largest bucket) run eagerly and are counted in `stats`.

Shape letters as in engine.models.transformer.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch

from engine.models.kv_cache import PagedKVCache
from engine.models.transformer import ForwardBatch, ForwardOutput, Model


@dataclass(frozen=True)
class GraphBuckets:
    """Bucket edges; a batch goes to the smallest bucket that holds it in every dimension."""

    batch: tuple[int, ...] = (1, 2, 4, 8, 16)
    query: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    tokens: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    keys: tuple[int, ...] = (256, 1024, 4096)


@dataclass
class GraphStats:
    captured: int = 0
    replayed: int = 0
    eager: int = 0  # calls served eagerly (unsupported arguments or no bucket)
    buckets: dict = field(default_factory=dict)  # bucket -> replays


def _ceil(edges: tuple[int, ...], n: int) -> int | None:
    i = bisect.bisect_left(edges, n)
    return edges[i] if i < len(edges) else None


@dataclass
class _Graph:
    batch: ForwardBatch  # static inputs
    out: ForwardOutput | None = None  # static outputs
    graph: object | None = None  # torch.cuda.CUDAGraph


class GraphedForward:
    """`Model.forward_batch(batch, kv)` served from per-bucket CUDA graphs (eagerly padded on CPU).

    model, kv: the model and the cache every call uses (graphs hold its storage's addresses; a call with
    another cache runs eagerly). The cache gives up one block for the padding tokens' writes.
    """

    def __init__(self, model: Model, kv: PagedKVCache, buckets: GraphBuckets | None = None) -> None:
        self.model, self.kv = model, kv
        self.buckets = buckets or GraphBuckets()
        self.pad_slot = kv.hold_pad_block() * kv.block_size
        self.graphs: dict[tuple[int, int, int, int], _Graph] = {}
        self.pool = None
        self.stats = GraphStats()
        self.capture = model.device.type == "cuda"

    def bucket(self, batch: ForwardBatch) -> tuple[int, int, int, int] | None:
        """(B, Tq, N, S) of the smallest bucket holding `batch`, or None."""
        B, Tq = batch.pad_index.shape
        S = batch.read_slots.shape[1]
        b = self.buckets
        key = (_ceil(b.batch, B), _ceil(b.query, Tq), _ceil(b.tokens, batch.num_tokens), _ceil(b.keys, S))
        return None if None in key else key  # type: ignore[return-value]

    def __call__(self, batch: ForwardBatch, kv: PagedKVCache, **kwargs) -> ForwardOutput:
        """Same contract as `Model.forward_batch`; keyword arguments other than `feature_layers` run eagerly."""
        key = self.bucket(batch)
        eager = kv is not self.kv or key is None or any(v for k, v in kwargs.items() if k != "feature_layers")
        features = kwargs.get("feature_layers")
        if eager:
            self.stats.eager += 1
            return self.model.forward_batch(batch, kv, **kwargs)
        g = self.graphs.get((*key, features))  # type: ignore[arg-type]
        if g is None:
            g = self._capture(key, features)
        self._fill(g.batch, batch)
        if g.graph is not None:
            g.graph.replay()
            out = g.out
        else:  # CPU: the padded forward, eagerly
            out = self.model.forward_batch(g.batch, kv, feature_layers=features)
        self.stats.replayed += 1
        self.stats.buckets[key] = self.stats.buckets.get(key, 0) + 1
        n = batch.num_tokens
        # a replay's outputs live in static buffers the next replay overwrites: hand out copies
        cut = (lambda t: t[:n].clone()) if g.graph is not None else (lambda t: t[:n])
        return ForwardOutput(
            logits=cut(out.logits),
            hidden=cut(out.hidden),
            routing=None,
            pre_norm_hidden=None if out.pre_norm_hidden is None else cut(out.pre_norm_hidden),
            features=None if out.features is None else cut(out.features),
        )

    # ------------------------------------------------------------------ static buffers
    def _static(self, key: tuple[int, int, int, int]) -> ForwardBatch:
        B, Tq, N, S = key
        dev = self.model.device
        long = dict(dtype=torch.long, device=dev)
        return ForwardBatch(
            input_ids=torch.zeros(N, **long),
            positions=torch.zeros(N, **long),
            pad_index=torch.full((B, Tq), N, **long),
            write_slots=torch.full((N,), self.pad_slot, **long),
            read_slots=torch.zeros(B, S, **long),
            attn_mask=torch.zeros(B, Tq, S, dtype=torch.bool, device=dev),
            unpad_order=torch.zeros(N, **long),
        )

    def _fill(self, static: ForwardBatch, batch: ForwardBatch) -> None:
        """Copy `batch` into the bucket's static buffers (module docstring), in place."""
        B, Tq = batch.pad_index.shape
        n, S = batch.num_tokens, batch.read_slots.shape[1]
        Bs, Tqs = static.pad_index.shape
        N = static.num_tokens
        static.input_ids.copy_(torch.cat([batch.input_ids, batch.input_ids[:1].expand(N - n)]))
        static.positions.copy_(torch.cat([batch.positions, batch.positions[:1].expand(N - n)]))
        static.write_slots.fill_(self.pad_slot)
        static.write_slots[:n] = batch.write_slots
        static.read_slots.zero_()
        static.read_slots[:B, :S] = batch.read_slots
        mask = torch.zeros(Bs, Tqs, static.read_slots.shape[1], dtype=torch.bool, device=static.attn_mask.device)
        if batch.attn_mask is None:
            mask[:B, :Tq, :S] = True
        else:
            mask[:B, :Tq, :S] = batch.attn_mask
        pad = torch.full((Bs, Tqs), N, dtype=torch.long, device=static.pad_index.device)
        real = batch.pad_index < n
        pad[:B, :Tq] = torch.where(real, batch.pad_index, torch.full_like(batch.pad_index, N))
        mask[..., 0] |= pad == N  # padding cells attend somewhere; their output is dropped
        static.attn_mask.copy_(mask)
        static.pad_index.copy_(pad)
        flat = pad.reshape(-1)
        order = torch.zeros(N, dtype=torch.long, device=flat.device)
        cells = (flat < N).nonzero().squeeze(1)  # host-side work of the replay, outside the graph
        order[flat[cells]] = cells
        order[n:] = order[0]  # padding tokens reuse token 0's cell: they are token 0 again
        static.unpad_order.copy_(order)

    # ------------------------------------------------------------------ capture
    def _capture(self, key: tuple[int, int, int, int], features) -> _Graph:
        static = self._static(key)
        g = _Graph(batch=static)
        if self.capture:
            # a valid batch for the warm-up and capture: every cell of request 0 at token 0, all pad writes
            static.pad_index[0, 0] = 0
            static.attn_mask[..., 0] = True
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s), torch.inference_mode():
                for _ in range(2):  # warm-up: Triton autotuning and allocator state outside the graph
                    self.model.forward_batch(static, self.kv, feature_layers=features)
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.inference_mode(), torch.cuda.graph(graph, pool=self.pool):
                g.out = self.model.forward_batch(static, self.kv, feature_layers=features)
            self.pool = graph.pool()
            g.graph = graph
            self.stats.captured += 1
        self.graphs[(*key, features)] = g  # type: ignore[index]
        return g
