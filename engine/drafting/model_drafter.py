"""Drafters: propose a draft tree each round and keep their state aligned with the committed sequence.

- `ModelDrafter`: an independent small dense HF model (llama / qwen2 / qwen3) with its own paged KV
  cache, dtype, device and expert backend. Expands the tree depth by depth (one drafter forward per
  depth with a tree mask), top-W children per frontier node, bounded frontier (EAGLE-2, 2406.16858).
- `NGramDrafter`: prompt lookup (free): continuations of the longest earlier match of the suffix.

Alignment: at the start of every drafting round the drafter has the K/V of every committed token
(lazy catch-up: tokens committed in rounds that did not draft, e.g. K = 0, are fed in one chunk
then); after verification the accepted nodes' K/V are copied from scratch to committed positions.

Sampling modes (see engine.verify): `drafted` children are drawn i.i.d. from the processed drafter law
q and every child of an expanded node is kept (filtering them by value would break the i.i.d.
assumption of min(1, p/q) acceptance); deterministic children are the top-W of q and may be pruned.

Shape letters: N=nodes V=vocab F=frontier W=width.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from engine.drafting.protocol import MAX_TREE_NODES
from engine.drafting.selection import annotate_tree, select_verified
from engine.drafting.tree_growth import TreeGrowth, drafts_iid
from engine.models.batching import PackItem, chain_item, expansion_item, pack
from engine.models.cuda_graphs import GraphedForward
from engine.models.kv_cache import PagedKVCache
from engine.models.transformer import Model
from engine.spec.config import SpecConfig
from engine.spec.draft_tree import DraftTree
from engine.spec.sampling import SamplingParams


# ---------------------------------------------------------------------------------------- model drafter
@dataclass
class _DraftSeq:
    slots: list[int] = field(default_factory=list)  # committed slots (grown on demand)
    cached: int = 0  # committed positions with K/V in the drafter cache
    fed_slots: dict[int, int] = field(default_factory=dict)  # tree node -> scratch slot (this round)


class ModelDrafter:
    """Independent dense drafter model with its own paged KV cache."""

    def __init__(
        self,
        model: Model,
        block_size: int = 16,
        num_blocks: int = 256,
        backend: str = "auto",
        predictor: Any = None,
    ) -> None:
        """predictor: an `engine.expert_predictor.ExpertPredictor` (or its folder) trained on this drafter's
        hidden states (`input == "dense"`); with it, λ > 0 selects verified nodes by predicted expert cost."""
        self.model = model
        model.set_backend(backend)
        if isinstance(predictor, (str, os.PathLike)):
            from engine.models.expert_predictor import load_expert_predictor

            predictor = load_expert_predictor(predictor, model.device)
        if predictor is not None:
            if predictor.config.input != "dense" or predictor.config.in_features != model.config.hidden_size:
                raise ValueError(
                    f"the expert predictor reads {predictor.config.input!r} features of size "
                    f"{predictor.config.in_features}; this drafter needs one trained on its own hidden states "
                    f"(input 'dense', size {model.config.hidden_size}): python -m engine.zoo.train_heads "
                    "predictor.dense_drafter=<drafter folder>"
                )
            predictor = predictor.eval().requires_grad_(False)
        self.predictor = predictor
        self.block_size = block_size
        self.cuda_graphs = False  # set by Engine(cuda_graphs=True): forwards replayed from CUDA graphs
        self._graphed: GraphedForward | None = None
        self.kv = self._new_cache(num_blocks)
        self.seqs: dict[int, _DraftSeq] = {}

    def _new_cache(self, num_blocks: int) -> PagedKVCache:
        cfg, m = self.model.config, self.model
        return PagedKVCache.for_model(cfg, num_blocks + 1, self.block_size, m.dtype, m.device)  # +1: graph padding

    @property
    def predicts_experts(self) -> bool:
        return self.predictor is not None

    def prepare(self, lengths: list[int]) -> None:
        """Size the cache for sequences of these maximal lengths (+ one round's scratch each)."""
        need = sum(-(-(n + 1) // self.block_size) + -(-MAX_TREE_NODES // self.block_size) for n in lengths)
        if need > self.kv.num_blocks:
            self.kv.check_quiescent()
            self.kv = self._new_cache(need)

    def start(self, seq_id: int, tokens: list[int], target_hidden: torch.Tensor | None = None) -> None:
        self.kv.add_sequence(seq_id)
        self.seqs[seq_id] = _DraftSeq()

    def finish(self, seq_id: int) -> None:
        if seq_id in self.seqs:
            self.kv.release(seq_id)
            del self.seqs[seq_id]

    def _slots(self, seq_id: int, length: int) -> torch.Tensor:
        self.kv.reserve(seq_id, length)
        return self.kv.slots(seq_id, range(length))

    @torch.inference_mode()
    def _forward(self, items: list[PackItem]) -> tuple[torch.Tensor, torch.Tensor]:
        """-> logits [N, V] float32, final hidden states [N, D] of the packed tokens."""
        batch = pack(items, self.model.device)
        if self.cuda_graphs:
            if self._graphed is None or self._graphed.kv is not self.kv:
                self._graphed = GraphedForward(self.model, self.kv)
            out = self._graphed(batch, self.kv)
        else:
            out = self.model.forward_batch(batch, self.kv)
        return out.logits.float(), out.hidden

    @torch.inference_mode()
    def draft(
        self,
        seq_id: int,
        tokens: list[int],
        spec: SpecConfig,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> DraftTree:
        return self.draft_many([(seq_id, tokens, spec, params, generator)])[0]

    @torch.inference_mode()
    def draft_many(
        self, requests: list[tuple[int, list[int], SpecConfig, SamplingParams, torch.Generator]]
    ) -> list[DraftTree]:
        """Draft trees for several requests with one drafter forward per depth (plus one catch-up).

        Each tree's `draft_seconds` is the batched drafting time (one cost shared by the batch)."""
        t0 = time.perf_counter()
        # catch up every request's committed tokens in one packed forward; root logits = last row
        items = []
        for seq_id, tokens, *_ in requests:
            seq = self.seqs[seq_id]
            slots = self._slots(seq_id, len(tokens))
            items.append(chain_item(tokens[seq.cached :], slots[: seq.cached], slots[seq.cached : len(tokens)]))
            seq.cached = len(tokens)
            seq.fed_slots = {}
        logits, hidden = self._forward(items)
        ends = torch.tensor([it.tokens.shape[0] for it in items]).cumsum(0) - 1
        # λ > 0 with a predictor: grow the whole bounded pool, predict each node's experts, then select
        aware = [
            self.predictor is not None and spec.lam > 0 and not drafts_iid(spec, params)
            for _, _, spec, params, _ in requests
        ]
        states = [
            TreeGrowth(
                tokens[-1],
                logits[int(e)],
                replace(spec, max_verify=None) if a else spec,
                params,
                generator,
                len(tokens),
                tokens,
            )
            for (_, tokens, spec, params, generator), e, a in zip(requests, ends, aware)
        ]
        feats: list[dict[int, torch.Tensor]] = [{0: hidden[int(e)]} for e in ends]  # node -> drafter hidden
        ctx = [self._slots(seq_id, len(tokens)) for seq_id, tokens, *_ in requests]
        depth = 1
        while True:
            expand = []
            for i, st in enumerate(states):
                nxt = st.grow(depth) if not st.done else None
                if nxt:
                    seq_id = requests[i][0]
                    expand.append((i, nxt, self._expand_item(seq_id, ctx[i], st.tok, st.par, st.dep, nxt)))
            if not expand:
                break
            logits, hidden = self._forward([it for _, _, it in expand])
            off = 0
            for i, nxt, _ in expand:
                states[i].node_logits = {node: logits[off + j] for j, node in enumerate(nxt)}
                feats[i].update({node: hidden[off + j] for j, node in enumerate(nxt)})
                states[i].frontier = nxt
                off += len(nxt)
            depth += 1
        if any(aware):  # one more forward for the never-expanded leaves: their hidden states feed the predictor
            leaves = []
            for i, st in enumerate(states):
                todo = [n for n in range(1, len(st.tok)) if n not in feats[i]] if aware[i] else []
                if todo:
                    leaves.append((i, todo, self._expand_item(requests[i][0], ctx[i], st.tok, st.par, st.dep, todo)))
            if leaves:
                _, hidden = self._forward([it for _, _, it in leaves])
                off = 0
                for i, todo, _ in leaves:
                    feats[i].update({node: hidden[off + j] for j, node in enumerate(todo)})
                    off += len(todo)
        trees = []
        for (seq_id, _, spec, _, _), st, a, f in zip(requests, states, aware, feats):
            grown = st.tree(self.model.vocab_size)
            kept = st.kept or range(grown.num_nodes)  # grown node -> growth node (the calibrated rule prunes)
            if st.kept is not None:  # re-key the fed scratch slots to the pruned tree's indices
                fed = self.seqs[seq_id].fed_slots
                self.seqs[seq_id].fed_slots = {i: fed[g] for i, g in enumerate(st.kept) if g in fed}
            if a:
                annotate_tree(grown, torch.stack([f[g] for g in kept]), self.predictor)
            tree = select_verified(grown, spec, st.drafted)
            if tree is not grown:
                self.seqs[seq_id].fed_slots = {}  # indices changed: nothing to reuse
            trees.append(tree)
        seconds = time.perf_counter() - t0
        for tree in trees:
            tree.draft_seconds = seconds
        return trees

    def _expand_item(self, seq_id, ctx_slots, tok, par, dep, nodes: list[int]) -> PackItem:
        """PackItem running `nodes` (a new frontier) over the committed context (root included) and their
        fed ancestors, written to fresh scratch slots."""
        seq = self.seqs[seq_id]
        seq.fed_slots.update(zip(nodes, self.kv.scratch_slots(seq_id, len(nodes)).tolist()))
        return expansion_item(nodes, tok, par, dep, ctx_slots, seq.fed_slots)

    def commit(
        self,
        seq_id: int,
        tokens: list[int],
        tree: DraftTree,
        accepted: list[int],
        target_hidden: torch.Tensor | None = None,
    ) -> None:
        """Copy K/V of accepted (and fed) nodes to committed positions; release the scratch."""
        seq = self.seqs[seq_id]
        copied = 0
        for i in accepted:
            if i not in seq.fed_slots:
                break
            copied += 1
        if copied:
            dst = self._slots(seq_id, seq.cached + copied)[seq.cached : seq.cached + copied]
            src = torch.tensor([seq.fed_slots[i] for i in accepted[:copied]], dtype=torch.long)
            self.kv.copy_slots(src.to(self.kv.k.device), dst.to(self.kv.k.device))
            seq.cached += copied
        seq.fed_slots = {}
        self.kv.release_scratch(seq_id)


# ---------------------------------------------------------------------------------------- n-gram drafter
