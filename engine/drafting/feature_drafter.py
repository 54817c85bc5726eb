"""EAGLE-style feature-head drafter (EAGLE 2401.15077; dynamic tree with a bounded frontier, EAGLE-2 2406.16858).

The head is one decoder layer (the target families' `Attention` + SwiGLU MLP from `engine.model`) over a
fusion of the target feature f_t (final hidden state after the norm) and the embedding of the next token:

    u_t   = fc([f_t ; emb(x_{t+1})])              [.., 2D] -> [.., D]
    f^_t+1 = layer(u_t)                           predicted target feature of position t+1
    draft logits = lm_head(f^_t+1)                the target's frozen lm_head (and embeddings): not saved

`FeatureHead` holds the shared machinery (layer, plain and cached forward, save/load); `EagleHead` is the
EAGLE fusion, `engine.mtp.MTPHead` the DeepSeek-V3 MTP module (same drafter, see engine/mtp.py).

Alignment of the head's own paged KV cache with the committed sequence (lazy catch-up, like
`ModelDrafter`, but fed with the target's features handed in by the engine):

    committed tokens      x_0   x_1   ...  x_{n-2}   x_{n-1} = root
    target features       f_0   f_1   ...  f_{n-2}                       (f_{n-1}: only after verification)
    head position t       (f_t, x_{t+1}) for t = 0 .. n-2   -> n-1 committed head slots
    head output at n-2    f^_{n-1}: the root's predicted feature -> depth-1 children
    tree node at depth d  head position n-2+d, input (feature of its parent, its own token)

At start the engine passes f_0..f_{n-2} (the prompt minus its last token); at commit the true features
of every verified node (`target_hidden[0]` = root, `target_hidden[accepted]`), so the positions of the
root and the accepted nodes are recomputed with true features at the next draft: the committed head
KV never holds a drafted feature, and tree nodes only ever live in scratch slots (released at commit).
A sequence with no known feature yet (one-token prompt) drafts nothing in its first round.

Tree: depth by depth, top-W children per frontier node, the `frontier` most probable new nodes kept
per depth (deterministic children) or W i.i.d. children per expanded node with whole sibling groups
(drafted children, `draft_probs` filled: see engine.drafters). With deterministic children the whole
expanded pool (<= 64 nodes) is then re-ranked (EAGLE-2): λ > 0 with an expert predictor ->
`select_expert_aware` on `predicted_experts`; otherwise `max_verify` keeps the most probable paths.
Without a predictor λ is ignored (as in `ModelDrafter`).

Shape letters: B=batch T=tokens N=tree nodes D=hidden V=vocab L=MoE layers E=experts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from engine.drafting.protocol import MAX_TREE_NODES, DraftRequest
from engine.drafting.selection import annotate_tree, select_verified
from engine.drafting.tree_growth import TreeGrowth, drafts_iid
from engine.models.batching import PackItem, chain_item, expansion_item, pack
from engine.models.expert_predictor import ExpertPredictor
from engine.models.feature_heads import FeatureHead, MTPHead
from engine.models.kv_cache import PagedKVCache
from engine.models.layout import use_decode_layout
from engine.models.transformer import Model
from engine.spec.config import MAX_DEPTH, SpecConfig
from engine.spec.draft_tree import DraftTree
from engine.spec.sampling import SamplingParams
from kernels.small_m import linear

# ---------------------------------------------------------------------------------------------- drafter


@dataclass
class _HeadSeq:
    length: int = 0  # committed tokens the state accounts for (len(tokens) at the last start/commit)
    cached: int = 0  # head positions with committed K/V
    pending_features: list[torch.Tensor] = field(default_factory=list)  # true target features not yet fed
    pending_tokens: list[int] = field(default_factory=list)  # x_{t+1} paired with each pending feature
    root_feature: torch.Tensor | None = None  # [D] head output at the last cached position
    fed_slots: dict[int, int] = field(default_factory=dict)  # tree node -> scratch slot (this round)


@dataclass
class _Round:
    """One request's drafting round inside `draft_many`."""

    seq_id: int
    spec: SpecConfig
    growth: TreeGrowth
    feature: dict[int, torch.Tensor]  # node -> head output (its predicted feature) [D]


class EagleDrafter:
    """A `FeatureHead` over a frozen target as an `engine.drafters.Drafter` (see the module docstring).

    predictor: optional `ExpertPredictor` trained on this head's features; fills
    `tree.predicted_experts` when λ > 0 so the node selection is expert-aware (EcoSpec 2607.12696).
    """

    def __init__(
        self,
        head: FeatureHead,
        target: Model,
        predictor: ExpertPredictor | None = None,
        block_size: int = 16,
        num_blocks: int = 256,
    ) -> None:
        if head.config.hidden_size != target.config.hidden_size or head.config.vocab_size != target.vocab_size:
            raise ValueError("the feature head was built for another target (hidden size / vocabulary differ)")
        if predictor is not None and predictor.config.input != head.feature_space:
            raise ValueError(
                f"the expert predictor was trained on {predictor.config.input!r} features, this head makes "
                f"{head.feature_space!r} features"
            )
        self.head = head.to(device=target.device, dtype=target.dtype).eval().requires_grad_(False)
        use_decode_layout(self.head)  # CPU: each weight in the layout its gemv reads fastest (as the target's)
        self.target = target
        self.predictor = None if predictor is None else predictor.to(target.device).eval().requires_grad_(False)
        self.block_size = block_size
        self.kv = self._new_cache(num_blocks)
        self.seqs: dict[int, _HeadSeq] = {}

    def _new_cache(self, num_blocks: int) -> PagedKVCache:
        cfg = self.head.config
        t = self.target
        return PagedKVCache(1, cfg.num_kv_heads, cfg.head_dim, num_blocks, self.block_size, t.dtype, t.device)

    @property
    def predicts_experts(self) -> bool:
        return self.predictor is not None

    def prepare(self, lengths: list[int]) -> None:
        """Size the cache for sequences of these maximal lengths (+ one round's scratch each: one
        allocation per depth, plus the leaves' features)."""
        bs = self.block_size
        scratch = MAX_DEPTH + 1 + -(-MAX_TREE_NODES // bs)
        need = sum(-(-n // bs) + scratch for n in lengths)
        if need > self.kv.num_blocks:
            self.kv.check_quiescent()
            self.kv = self._new_cache(need)

    # ------------------------------------------------------------------ protocol: alignment
    def start(self, seq_id: int, tokens: list[int], target_hidden: torch.Tensor | None = None) -> None:
        """target_hidden [len(tokens) - 1, D]: the target's features of the prompt minus its last token."""
        n = len(tokens) - 1
        if n > 0 and (target_hidden is None or target_hidden.shape[0] != n):
            got = None if target_hidden is None else tuple(target_hidden.shape)
            raise ValueError(f"EagleDrafter.start needs the target's features [{n}, D] of the prompt, got {got}")
        self.kv.add_sequence(seq_id)
        seq = self.seqs[seq_id] = _HeadSeq(length=len(tokens))
        if n > 0:
            seq.pending_features.append(target_hidden)
            seq.pending_tokens.extend(tokens[1:])

    def commit(
        self,
        seq_id: int,
        tokens: list[int],
        tree: DraftTree,
        accepted: list[int],
        target_hidden: torch.Tensor | None = None,
    ) -> None:
        """Queue (true feature, next token) for the root and the accepted nodes; release the scratch.

        target_hidden [tree.num_nodes, D]: the target's features of the verified nodes, in tree order."""
        seq = self.seqs[seq_id]
        new = tokens[seq.length :]  # accepted + recovered/bonus (fewer when the request just finished)
        self.kv.release_scratch(seq_id)
        seq.fed_slots = {}
        if not new:
            return
        if target_hidden is None:
            raise ValueError("EagleDrafter.commit needs the target's features of the verified nodes")
        kept = accepted[: len(new) - 1]
        if kept == list(range(1, len(kept) + 1)):  # the root and a chain's first nodes (a K = 0 round: the root)
            seq.pending_features.append(target_hidden[: len(kept) + 1].clone())  # a copy: the batch's buffer is freed
        else:
            seq.pending_features.append(target_hidden[torch.tensor([0, *kept], device=target_hidden.device)])
        seq.pending_tokens.extend(new)
        seq.length = len(tokens)

    def finish(self, seq_id: int) -> None:
        if seq_id in self.seqs:
            self.kv.release(seq_id)
            del self.seqs[seq_id]

    # ------------------------------------------------------------------ forward helpers
    def _run(self, items: list[PackItem], features: torch.Tensor) -> torch.Tensor:
        """One packed head forward: items' tokens with features [N, D] (packed order) -> outputs [N, D]."""
        batch = pack(items, self.target.device)
        token_emb = F.embedding(batch.input_ids, self.target.model.embed_tokens.weight)
        return self.head.forward_cached(features.to(self.target.dtype), token_emb, batch, self.kv)

    def _logits(self, out: torch.Tensor) -> torch.Tensor:
        """Head outputs [n, D] -> draft logits [n, V] (float32), the target's LM head as its forward reads it."""
        return linear(self.head.readout(out), self.target.lm_head.weight, pack=True).float()

    def catch_up(self, seq_ids: list[int]) -> list[torch.Tensor | None]:
        """Feed every queued (feature, token) pair of these sequences (one packed forward, causal chunk
        per sequence); return each root's predicted feature [D] (None before any feature is known)."""
        items, feats, owners = [], [], []
        for seq_id in seq_ids:
            seq = self.seqs[seq_id]
            if not seq.pending_tokens:
                continue
            k = len(seq.pending_tokens)
            self.kv.reserve(seq_id, seq.cached + k)
            slots = self.kv.slots(seq_id, range(seq.cached + k))
            items.append(chain_item(seq.pending_tokens, slots[: seq.cached], slots[seq.cached :]))
            feats.append(torch.cat(seq.pending_features).to(self.target.device))  # [k, D]
            owners.append(seq)
        if items:
            out = self._run(items, torch.cat(feats))
            end = 0
            for seq, f in zip(owners, feats):
                end += f.shape[0]
                seq.root_feature = out[end - 1]
                seq.cached += f.shape[0]
                seq.pending_features, seq.pending_tokens = [], []
        return [self.seqs[s].root_feature for s in seq_ids]

    def _expand_item(self, r: _Round, nodes: list[int]) -> PackItem:
        """PackItem running tree `nodes`: each sees the committed head slots and its fed ancestors."""
        seq = self.seqs[r.seq_id]
        g = r.growth
        ctx = self.kv.slots(r.seq_id, range(seq.cached))  # [c] committed head slots: depth d -> position n-2+d
        seq.fed_slots.update(zip(nodes, self.kv.scratch_slots(r.seq_id, len(nodes)).tolist()))
        return expansion_item(nodes, g.tok, g.par, g.dep, ctx, seq.fed_slots)

    def _expand(self, work: list[tuple[_Round, list[int]]]) -> list[torch.Tensor]:
        """One packed head forward over several trees' `nodes` (inputs: parents' features + own tokens);
        records each node's output as its feature; returns the outputs [len(nodes), D] per entry."""
        items = [self._expand_item(r, nodes) for r, nodes in work]
        parents = torch.stack([r.feature[r.growth.par[i]] for r, nodes in work for i in nodes])  # [n, D]
        out = self._run(items, parents)
        res, off = [], 0
        for r, nodes in work:
            res.append(out[off : off + len(nodes)])
            r.feature.update({i: out[off + j] for j, i in enumerate(nodes)})
            off += len(nodes)
        return res

    # ------------------------------------------------------------------ protocol: draft
    def draft(
        self, seq_id: int, tokens: list[int], spec: SpecConfig, params: SamplingParams, generator: torch.Generator
    ) -> DraftTree:
        return self.draft_many([(seq_id, tokens, spec, params, generator)])[0]

    @torch.inference_mode()
    def draft_many(self, requests: list[DraftRequest]) -> list[DraftTree]:
        """Draft trees for several requests with one head forward per depth (plus one catch-up).

        Each tree's `draft_seconds` is the batched drafting time (one cost shared by the batch)."""
        t0 = time.perf_counter()
        for seq_id, tokens, *_ in requests:
            if self.seqs[seq_id].length != len(tokens):
                raise RuntimeError(f"EagleDrafter out of step on sequence {seq_id}: "
                                   f"{self.seqs[seq_id].length} tokens accounted for, got {len(tokens)}")  # fmt: skip
            self.seqs[seq_id].fed_slots = {}
        roots = self.catch_up([seq_id for seq_id, *_ in requests])
        live = [i for i, (req, root) in enumerate(zip(requests, roots)) if root is not None and req[2].depth > 0]
        root_logits = self._logits(torch.stack([roots[i] for i in live])) if live else None
        rounds: dict[int, _Round] = {}
        for j, i in enumerate(live):
            seq_id, tokens, spec, params, generator = requests[i]
            drafted = drafts_iid(spec, params)
            # deterministic children are re-ranked after growth (EAGLE-2): grow the whole bounded pool
            grow_spec = spec if drafted else replace(spec, max_verify=None)
            growth = TreeGrowth(tokens[-1], root_logits[j], grow_spec, params, generator, len(tokens), tokens)
            rounds[i] = _Round(seq_id, spec, growth, {0: roots[i]})
        depth = 1
        while True:
            work = [(r, nxt) for r in rounds.values() if not r.growth.done and (nxt := r.growth.grow(depth))]
            if not work:
                break
            for (r, nodes), out in zip(work, self._expand(work)):
                logits = self._logits(out)
                r.growth.node_logits = {i: logits[j] for j, i in enumerate(nodes)}
                r.growth.frontier = nodes
            depth += 1
        trees = [DraftTree.root_only(tokens[-1]) for _, tokens, *_ in requests]
        for i, r in rounds.items():
            trees[i] = r.growth.tree(self.target.vocab_size)
        if self.predictor is not None:
            self._predict_experts(trees, {i: r for i, r in rounds.items() if r.spec.lam > 0 and not r.growth.drafted})
        for i, r in rounds.items():
            trees[i] = select_verified(trees[i], r.spec, r.growth.drafted)
        seconds = time.perf_counter() - t0
        for tree in trees:
            tree.draft_seconds = seconds
        return trees

    def _predict_experts(self, trees: list[DraftTree], wanted: dict[int, _Round]) -> None:
        """λ > 0: every node's predicted feature (one more head step for unexpanded nodes) -> the
        predictor's top-r experts per MoE layer in `tree.predicted_experts` [N, L, E]."""
        kept = {t: r.growth.kept or range(len(r.growth.tok)) for t, r in wanted.items()}  # tree node -> growth node
        work = [(r, [i for i in kept[t] if i and i not in r.feature]) for t, r in wanted.items()]
        work = [(r, nodes) for r, nodes in work if nodes]
        if work:
            self._expand(work)
        for t, r in wanted.items():
            annotate_tree(trees[t], torch.stack([r.feature[i] for i in kept[t]]), self.predictor)


class MTPDrafter(EagleDrafter):
    """`EagleDrafter` over an `MTPHead` (depth k by recursive application of the module)."""

    def __init__(self, head: MTPHead, target: Model, predictor: ExpertPredictor | None = None, **kv_options) -> None:
        if not isinstance(head, MTPHead):
            raise TypeError(f"MTPDrafter needs an MTPHead, got {type(head).__name__}")
        super().__init__(head, target, predictor, **kv_options)
