"""Depth-by-depth growth of one draft tree from drafter logits, shared by the model and feature-head drafters.

Top-W children per frontier node (deterministic), W i.i.d. samples (drafted), or, for a request in
position mode, the top-W of (log q + g_p) under the public noise g_p of the children's position
(engine.spec.gumbel); the `frontier` best kept per depth (bounded frontier, EAGLE-2 2406.16858), within
the node budget.

Shape letters: N=nodes V=vocab F=frontier W=width.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.drafting.protocol import MAX_TREE_NODES
from engine.drafting.suffix import SuffixIndex
from engine.spec.config import SpecConfig
from engine.spec.draft_tree import DraftTree
from engine.spec.gumbel import coupled_probs, gumbel_top_w, position_gumbel_many
from engine.spec.sampling import SamplingParams, process_logits, sample_from_probs


def _node_budget(spec: SpecConfig) -> int:
    return min(spec.max_verify or MAX_TREE_NODES, MAX_TREE_NODES)


def stored_cond(path_prob: float, parent_path_prob: float) -> float:
    """The conditional probability a trace stores for a node (env.request_recorder): float32 path
    probabilities divided in float64, rounded to float32. The calibrated rule reads this value, so the
    engine and replay of a trace compare the very same number against the threshold."""
    pp, parent = np.float64(np.float32(path_prob)), np.float64(np.float32(parent_path_prob))
    return float(np.float32(pp / parent if parent > 0 else pp))


def kept_by_score(
    order: list[int], score: list[float], threshold: float, parents: list[int], depths: list[int], cond: list[float]
) -> tuple[list[int], list[float]]:
    """The threshold / calibrated verification rule on an already grown tree: (the nodes of `order` — drafting
    order, root first — whose score clears `threshold` and whose parent was kept, the confidence per depth = the
    largest conditional probability kept there, up to the first depth with none). Node-indexed lists; the
    prompt-lookup drafter and trace replay (env.tables) both apply the rule through this one function."""
    kept, keep, best = {order[0]}, [order[0]], {}
    for j in order[1:]:
        if score[j] >= threshold and parents[j] in kept:
            kept.add(j)
            keep.append(j)
            d = depths[j]
            if cond[j] > best.get(d, -1.0):
                best[d] = cond[j]
    confidence = []
    while len(confidence) + 1 in best:
        confidence.append(best[len(confidence) + 1])
    return keep, confidence


def drafts_iid(spec: SpecConfig, params: SamplingParams) -> bool:
    """Children drawn i.i.d. from the drafter, verified by min(1, p/q): sampling, generator mode, drafted."""
    return spec.use_drafted_children and not params.greedy and not params.position_keyed


class TreeGrowth:
    """Depth-by-depth growth of one draft tree from drafter logits (shared by model and feature drafters).

    `grow(d)` turns the current frontier's logits (`node_logits`) into depth-d nodes: top-W children per
    frontier node (deterministic), W i.i.d. samples (drafted) or the Gumbel-top-W under the public noise
    (position mode; `position` = absolute position of the depth-1 children = len(committed tokens); path
    probabilities are then products of `coupled_probs`), the `frontier` best kept (EAGLE-2 2406.16858;
    drafted mode keeps whole sibling groups), within the node budget. It returns the nodes to run through
    the drafter next (their logits feed depth d + 1), or None when the tree is complete.
    """

    def __init__(
        self,
        root_token: int,
        root_logits: torch.Tensor,
        spec: SpecConfig,
        params: SamplingParams,
        generator: torch.Generator,
        position: int | None = None,
        context: list[int] | None = None,
    ) -> None:
        self.spec, self.generator = spec, generator
        self.calibrated = spec.verify_rule == "calibrated" and spec.depth > 0
        if self.calibrated and (spec.acceptance is None or context is None):
            raise ValueError("verify_rule 'calibrated' needs spec.acceptance (an AcceptanceModel) and the context")
        self.context = context  # committed tokens (root last): the calibrated rule's agreement feature
        self._index: SuffixIndex | None = None
        self.drafted = drafts_iid(spec, params)
        self.q_params = params if not params.greedy else SamplingParams(temperature=1.0)
        self.noise = None  # [K, V] position mode: row d - 1 = public noise of the depth-d children
        if params.position_keyed and spec.depth > 0:
            if position is None:
                raise ValueError("position mode needs `position`: the absolute position of the depth-1 children")
            positions = range(position, position + spec.depth)
            self.noise = position_gumbel_many(params.seed, positions, root_logits.shape[-1], root_logits.device)
        self.budget = _node_budget(spec)
        self.frontier_cap = spec.frontier or spec.width
        self.tok, self.par, self.dep, self.path = [root_token], [-1], [0], [1.0]
        self.cal = [1.0]  # per node: calibrated path probability (the calibrated rule)
        self.kept: list[int] | None = None  # tree(): growth indices of the tree's nodes (None: all, same order)
        self.qrows: list[torch.Tensor | None] = [None]
        self.confidence: list[float] = []
        self.frontier = [0]
        self.node_logits = {0: root_logits}
        self.done = spec.depth == 0

    def grow(self, d: int) -> list[int] | None:
        spec = self.spec
        cand: list[tuple[float, int, int, float]] = []  # (path prob, parent, token, cond prob)
        for f in self.frontier:
            q = process_logits(self.node_logits[f], self.q_params)  # [V]
            self.qrows[f] = q
            if self.drafted:
                kids = [sample_from_probs(q, self.generator) for _ in range(spec.width)]
            elif self.noise is not None:
                kids = gumbel_top_w(q.log().unsqueeze(0), self.noise[d - 1 : d], spec.width)[0].tolist()
            else:
                kids = torch.topk(q, spec.width).indices.tolist()
            # position mode ranks nodes by how likely the target's Gumbel-max choice is each child, not by q
            score = q if self.noise is None else coupled_probs(q.log().unsqueeze(0), self.noise[d - 1 : d])[0]
            for k in kids:
                cp = float(score[k])
                cand.append((self.path[f] * cp, f, k, cp))
        room = self.budget - (len(self.tok) - 1)
        if self.drafted:  # keep whole sibling groups: i.i.d. children may not be filtered by value
            keep: list = []
            for f in dict.fromkeys(c[1] for c in cand):
                group = [c for c in cand if c[1] == f]
                if len(keep) + len(group) > room:
                    break
                keep.extend(group)
            cand = keep
        else:
            cand.sort(key=lambda c: -c[0])
            cand = cand[: min(self.frontier_cap, room)]
        if spec.verify_rule == "threshold" and cand:  # stop drafting below the path-probability threshold
            t = spec.verify_threshold
            # i.i.d. children may not be filtered by value (min(1, p/q) needs them all): all or nothing
            cand = ([] if max(c[0] for c in cand) < t else cand) if self.drafted else [c for c in cand if c[0] >= t]
        cal = [1.0] * len(cand)
        if self.calibrated and cand:  # stop at the first depth with no node above the threshold
            model = spec.acceptance
            if self._index is None:
                self._index = SuffixIndex(self.context)
            cal = [
                self.cal[f] * model.node(self._index, self._path(f), k, stored_cond(pp, self.path[f]), d)
                for pp, f, k, _ in cand
            ]
            if max(cal) < spec.verify_threshold:
                cand = []
        if not cand:
            self.done = True
            return None
        t = spec.verify_threshold
        self.confidence.append(max(c[3] for c, q in zip(cand, cal) if not self.calibrated or q >= t))
        new_ids = []
        for (pp, f, k, _), q in zip(cand, cal):
            new_ids.append(len(self.tok))
            self.tok.append(k)
            self.par.append(f)
            self.dep.append(d)
            self.path.append(pp)
            self.cal.append(q)
            self.qrows.append(None)
        if d >= spec.depth or len(self.tok) - 1 >= self.budget:
            self.done = True
            return None
        # which new nodes to expand next (drafted mode: the most probable ones)
        return sorted(new_ids, key=lambda i: -self.path[i])[: self.frontier_cap] if self.drafted else new_ids

    def _path(self, node: int) -> list[int]:
        """Tokens from depth 1 to `node` (inclusive)."""
        out = []
        while node > 0:
            out.append(self.tok[node])
            node = self.par[node]
        return out[::-1]

    def tree(self, vocab_size: int) -> DraftTree:
        """The grown tree (the calibrated rule keeps its nodes above the threshold; `kept` maps them back)."""
        keep = list(range(len(self.tok)))
        if self.calibrated and not self.drafted:  # the calibrated rule verifies only nodes above its threshold
            # (prefix-closed: a calibrated path probability never exceeds its parent's); i.i.d. children keep
            # whole depths, as the threshold rule does
            keep = [j for j, q in enumerate(self.cal) if j == 0 or q >= self.spec.verify_threshold]
            self.kept = keep if len(keep) < len(self.tok) else None
        new = {j: i for i, j in enumerate(keep)}
        tree = DraftTree(
            tokens=torch.tensor([self.tok[j] for j in keep]),
            parents=torch.tensor([new[self.par[j]] if j else -1 for j in keep]),
            depths=torch.tensor([self.dep[j] for j in keep]),
            path_prob=torch.tensor([self.path[j] for j in keep], dtype=torch.float32),
            confidence=self.confidence,
        )
        if self.drafted:
            tree.draft_probs = torch.stack([r if r is not None else torch.zeros(vocab_size) for r in self.qrows])
        return tree
