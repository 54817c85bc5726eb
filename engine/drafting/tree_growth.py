"""Depth-by-depth growth of one draft tree from drafter logits, shared by the model and feature-head drafters.

Top-W children per frontier node (deterministic), W i.i.d. samples (drafted), or, for a request in
position mode, the top-W of (log q + g_p) under the public noise g_p of the children's position
(engine.spec.gumbel); the `frontier` best kept per depth (bounded frontier, EAGLE-2 2406.16858), within
the node budget.

Shape letters: N=nodes V=vocab F=frontier W=width.
"""

from __future__ import annotations

import torch

from engine.drafting.protocol import MAX_TREE_NODES
from engine.spec.config import SpecConfig
from engine.spec.draft_tree import DraftTree
from engine.spec.gumbel import coupled_probs, gumbel_top_w, position_gumbel_many
from engine.spec.sampling import SamplingParams, process_logits, sample_from_probs


def _node_budget(spec: SpecConfig) -> int:
    return min(spec.max_verify or MAX_TREE_NODES, MAX_TREE_NODES)


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
    ) -> None:
        self.spec, self.generator = spec, generator
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
        if not cand:
            self.done = True
            return None
        self.confidence.append(max(c[3] for c in cand))
        new_ids = []
        for pp, f, k, _ in cand:
            new_ids.append(len(self.tok))
            self.tok.append(k)
            self.par.append(f)
            self.dep.append(d)
            self.path.append(pp)
            self.qrows.append(None)
        if d >= spec.depth or len(self.tok) - 1 >= self.budget:
            self.done = True
            return None
        # which new nodes to expand next (drafted mode: the most probable ones)
        return sorted(new_ids, key=lambda i: -self.path[i])[: self.frontier_cap] if self.drafted else new_ids

    def tree(self, vocab_size: int) -> DraftTree:
        tree = DraftTree(
            tokens=torch.tensor(self.tok),
            parents=torch.tensor(self.par),
            depths=torch.tensor(self.dep),
            path_prob=torch.tensor(self.path, dtype=torch.float32),
            confidence=self.confidence,
        )
        if self.drafted:
            tree.draft_probs = torch.stack([r if r is not None else torch.zeros(vocab_size) for r in self.qrows])
        return tree
