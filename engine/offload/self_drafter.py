"""SpecMoE-style self-assisted drafter (2604.10152): draft with the target's own layers, using only
the experts already in the offload cache, so drafting never waits on the PCIe link.

    draft forward, MoE layer l, token routed to expert e:
        e cached    -> e
        e absent    -> stand_in_l[e] = argmax over cached c of similarity_l[e, c]
        none cached -> -1 (the routed experts contribute 0; the shared expert still runs)

Similarity per MoE layer, precomputed once [E, E]: cosine of router (gate) rows ("router") or of
the flattened expert weights ("weights"). Stand-in tables are rebuilt at the start of every draft
from the cache as it is then; the cache only changes in verification (or prefetch), never while
drafting.

Expert loads are deferred to verification and deduplicated: the draft forwards call
`ExpertOffload.compute_cached` (which refuses an uncached expert and touches neither the cache nor
the hit/miss counters); the verification forward through the offloaded target loads the union of
the experts the verified tokens need, once per layer (`OffloadStats.misses`). Draft routing is
counted in `OffloadStats.draft_assignments` / `draft_substituted`. With `prefetch=True` the experts
the draft routed to (root and expanded nodes, originals before substitution) are prefetched after
drafting, so verification finds them cached (`prefetch_used`).

Everything else (its own paged KV cache aligned with the committed sequence, depth-by-depth tree
expansion with a bounded frontier, drafted vs deterministic children) is `ModelDrafter` run over the
target `Model`. Verification goes through the real target, so greedy output is exact; a full cache
makes the drafter the target itself.

Shape letters: L=MoE layers E=experts T=tokens r=top-r D=hidden F=expert dim.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F_nn

from engine.drafting.model_drafter import ModelDrafter
from engine.models.batching import PackItem
from engine.models.moe import MoEBlock
from engine.offload.cache import ExpertOffload
from engine.spec.config import SpecConfig
from engine.spec.draft_tree import DraftTree
from engine.spec.sampling import SamplingParams

SIMILARITIES = ("router", "weights")


def expert_similarity(block: MoEBlock, kind: str = "router") -> torch.Tensor:
    """Cosine similarity [E, E] of a layer's experts: router rows [E, D] ("router") or flattened
    gate/up/down weights [E, 3DF] ("weights")."""
    if kind == "router":
        v = block.gate.weight.detach()  # [E, D]
    elif kind == "weights":
        ex = block.experts
        v = torch.cat([ex.gate_up_proj.detach().flatten(1), ex.down_proj.detach().flatten(1)], dim=1)
    else:
        raise ValueError(f"similarity must be one of {SIMILARITIES}, got {kind!r}")
    v = F_nn.normalize(v.float().cpu(), dim=1)
    return v @ v.T


def stand_in_table(similarity: torch.Tensor, cached: list[int]) -> torch.Tensor:
    """similarity [E, E], cached expert ids -> [E] long: each expert's most similar cached expert
    (cached experts map to themselves; all -1 when nothing is cached)."""
    E = similarity.shape[0]
    if not cached:
        return torch.full((E,), -1, dtype=torch.long)
    idx = torch.tensor(cached, dtype=torch.long)
    table = idx[similarity[:, idx].argmax(dim=1)]  # [E]
    table[idx] = idx
    return table


class _DraftExpertFn:
    """`MoEBlock.expert_fn` of one layer during draft forwards: route to cached stand-ins."""

    def __init__(self, drafter: SelfDrafter, layer: int) -> None:
        self.drafter, self.layer = drafter, layer

    def __call__(
        self,
        x: torch.Tensor,
        w_gate_up: torch.Tensor,
        w_down: torch.Tensor,
        expert_ids: torch.Tensor,
        topk_weights: torch.Tensor,
    ) -> torch.Tensor:
        """x [T, D], expert_ids / topk_weights [T, r] (routed) -> [T, D] computed with the stand-ins."""
        d, layer = self.drafter, self.layer
        table = d.stand_ins[layer].to(expert_ids.device)
        draft_ids = torch.where(expert_ids >= 0, table[expert_ids.clamp(min=0)], -1)  # [T, r]
        st = d.offload.stats
        st.draft_assignments += int((expert_ids >= 0).sum())
        st.draft_substituted += int(((draft_ids != expert_ids) & (expert_ids >= 0)).sum())
        if d.prefetch:
            rows = expert_ids if d._record_rows is None else expert_ids[d._record_rows.to(expert_ids.device)]
            d.routed[layer] += torch.bincount(rows[rows >= 0].cpu(), minlength=d.offload.num_experts)
        return d.offload.compute_cached(layer, x, draft_ids, topk_weights)


class SelfDrafter(ModelDrafter):
    """Self-assisted drafter over an installed `ExpertOffload` (see the module docstring).

    similarity: "router" | "weights" (stand-in choice). prefetch: prefetch the draft's routed experts
    for verification. block_size / num_blocks: the drafter's own paged KV cache.
    """

    def __init__(
        self,
        offload: ExpertOffload,
        similarity: str = "router",
        prefetch: bool = False,
        block_size: int = 16,
        num_blocks: int = 256,
    ) -> None:
        if not offload.installed:
            raise ValueError("SelfDrafter needs an installed ExpertOffload (call offload.install())")
        super().__init__(offload.model, block_size, num_blocks, backend=offload.blocks[0].backend)
        self.offload = offload
        self.similarity = [expert_similarity(b, similarity) for b in offload.blocks]  # L x [E, E]
        self.prefetch = prefetch
        self._fns = [_DraftExpertFn(self, i) for i in range(offload.num_layers)]
        E = offload.num_experts
        self.stand_ins = [torch.full((E,), -1, dtype=torch.long) for _ in offload.blocks]  # L x [E]
        self.routed = [torch.zeros(E, dtype=torch.long) for _ in offload.blocks]  # L x [E] draft routing
        self._catch_up_next = False
        self._record_rows: torch.Tensor | None = None  # rows of the current draft forward to record

    def refresh_stand_ins(self) -> None:
        """Rebuild the stand-in tables from the offload cache as it is now."""
        self.stand_ins = [stand_in_table(sim, self.offload.cached_experts(i)) for i, sim in enumerate(self.similarity)]

    @contextmanager
    def _substituting(self) -> Iterator[None]:
        """Swap the target's offload expert_fn for the stand-in one for the duration of a draft forward."""
        blocks = self.offload.blocks
        saved = [b.expert_fn for b in blocks]
        for b, fn in zip(blocks, self._fns):
            b.expert_fn = fn
        try:
            yield
        finally:
            for b, fn in zip(blocks, saved):
                b.expert_fn = fn

    @torch.inference_mode()
    def _forward(self, items: list[PackItem]) -> tuple[torch.Tensor, torch.Tensor]:
        if self._catch_up_next:  # the first forward of a drafting round: only each root gets verified
            self._record_rows = torch.tensor([it.tokens.shape[0] for it in items]).cumsum(0) - 1
            self._catch_up_next = False
        else:
            self._record_rows = None
        with self._substituting():
            return super()._forward(items)

    @torch.inference_mode()
    def draft_many(
        self, requests: list[tuple[int, list[int], SpecConfig, SamplingParams, torch.Generator]]
    ) -> list[DraftTree]:
        """`ModelDrafter.draft_many` with the stand-in experts of the cache as it is now (then, with
        `prefetch`, prefetch the experts the draft routed the roots and expanded nodes to)."""
        self.refresh_stand_ins()
        for counts in self.routed:
            counts.zero_()
        self._catch_up_next = True
        trees = super().draft_many(requests)
        if self.prefetch and any(t.num_nodes > 1 for t in trees):
            for layer, counts in enumerate(self.routed):
                order = counts.argsort(descending=True, stable=True)  # most assigned first
                self.offload.prefetch(layer, order[: int((counts > 0).sum())])
        return trees
