"""Draft trees: depth-by-depth expansion with a bounded frontier, then node selection for verification.

    root (last committed token, depth 0)
     ├── a (d1) ── c (d2) ── e (d3)          expand: top-W children per frontier node,
     └── b (d1) ── d (d2)                    keep the `frontier` best nodes per depth (EAGLE-2, 2406.16858)

Selection keeps a prefix-closed subset (every kept node's parent is kept):
- λ = 0: the `max_verify` nodes of highest path probability (a parent's path probability is never
  below its child's, so the top-m set is prefix-closed by construction, ties broken by index);
- λ > 0: greedy picks over the nodes whose parent is already selected, scored with the predicted
  marginal expert cost ΔC (new (layer, expert) pairs a node adds to those already needed):
  EcoSpec (2607.12696) `P_path / (ΔC + ε)` with the needed-pairs buffer updated after each pick, or
  `log P_path − λ·ΔC`. Picking stops when the best score's node is worth less than its cost
  (EcoSpec: when ΔC-weighted score falls under λ; logp: when the score falls under log P of a
  no-cost node minus λ·r·L), or at `max_verify`.

Shape letters: N=nodes V=vocab L=MoE layers E=experts r=top-r.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DraftTree:
    """A drafted tree; node 0 is the root. Parents precede children (topological order)."""

    tokens: torch.Tensor  # [N] int64
    parents: torch.Tensor  # [N] int64, parents[0] = -1
    depths: torch.Tensor  # [N] int64
    path_prob: torch.Tensor  # [N] float32, drafter probability of the path root -> node (root 1)
    draft_probs: torch.Tensor | None = None  # [N, V] law each node's children were drawn from (drafted mode)
    draft_seconds: float = 0.0
    confidence: list[float] = field(default_factory=list)  # [K] best node's conditional prob per depth
    predicted_experts: torch.Tensor | None = None  # [N, L, E] bool, from an expert predictor (λ > 0)

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def max_depth(self) -> int:
        return int(self.depths.max()) if self.num_nodes else 0

    @staticmethod
    def root_only(token: int) -> DraftTree:
        return DraftTree(
            tokens=torch.tensor([token]),
            parents=torch.tensor([-1]),
            depths=torch.tensor([0]),
            path_prob=torch.tensor([1.0]),
        )

    def subtree(self, keep: torch.Tensor) -> DraftTree:
        """The prefix-closed node subset `keep` (sorted indices, containing 0), re-indexed."""
        keep = keep.sort().values
        remap = torch.full((self.num_nodes,), -1, dtype=torch.long)
        remap[keep] = torch.arange(keep.numel())
        parents = self.parents[keep]
        new_parents = torch.where(parents >= 0, remap[parents.clamp(min=0)], parents)
        if bool((new_parents[1:] < 0).any()):
            raise ValueError("node selection is not prefix-closed")
        return DraftTree(
            tokens=self.tokens[keep],
            parents=new_parents,
            depths=self.depths[keep],
            path_prob=self.path_prob[keep],
            draft_probs=None if self.draft_probs is None else self.draft_probs[keep],
            draft_seconds=self.draft_seconds,
            confidence=self.confidence,
            predicted_experts=None if self.predicted_experts is None else self.predicted_experts[keep],
        )


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """parents [N] (topological) -> bool [N, N], mask[i, j] = j is i or an ancestor of i."""
    n = parents.shape[0]
    mask = torch.eye(n, dtype=torch.bool)
    plist = parents.tolist()
    for i in range(1, n):
        p = plist[i]
        if p >= 0:
            mask[i] |= mask[p]
    return mask


def select_by_probability(tree: DraftTree, max_verify: int) -> torch.Tensor:
    """λ = 0: root + the `max_verify` drafted nodes of highest path probability (prefix-closed)."""
    n = tree.num_nodes - 1
    if n <= max_verify:
        return torch.arange(tree.num_nodes)
    # Stable descending sort: ties go to the lower index, and a parent has a lower index than its
    # child with probability >= the child's, so the chosen set is prefix-closed.
    order = torch.sort(tree.path_prob[1:], descending=True, stable=True).indices + 1
    return torch.cat([torch.tensor([0]), order[:max_verify]]).sort().values


def select_expert_aware(
    tree: DraftTree,
    max_verify: int,
    lam: float,
    score: str = "ecospec",
    root_experts: torch.Tensor | None = None,
    eps: float = 1.0,
) -> torch.Tensor:
    """λ > 0: greedy prefix-closed selection by probability and predicted marginal expert cost.

    tree.predicted_experts [N, L, E] bool: the (layer, expert) pairs each node is predicted to touch.
    root_experts [L, E] bool: pairs the root already needs (always verified).
    EcoSpec score P/(ΔC + ε) with the buffer of needed pairs updated after each pick; a node is taken
    only while P·(1 − λ·ΔC / (r·L)) > 0 keeps it worth verifying. logp score: log P − λ·ΔC, picking
    while the score beats log P_min − λ... (no threshold beyond max_verify).
    """
    pred = tree.predicted_experts
    if pred is None:
        raise ValueError("λ > 0 needs predicted experts per node (an expert predictor on the drafter)")
    n_nodes = tree.num_nodes
    needed = root_experts.clone() if root_experts is not None else pred[0].clone()  # [L, E]
    per_token = max(int(pred[0].sum()), 1)  # r * L: pairs one token needs
    chosen = [0]
    selected = torch.zeros(n_nodes, dtype=torch.bool)
    selected[0] = True
    parents = tree.parents
    probs = tree.path_prob.double()
    while len(chosen) - 1 < max_verify:
        cand = (~selected) & selected[parents.clamp(min=0)]
        cand[0] = False
        idx = cand.nonzero().squeeze(1)
        if idx.numel() == 0:
            break
        delta = (pred[idx] & ~needed).flatten(1).sum(1).double()  # [C] marginal pairs
        p = probs[idx]
        if score == "ecospec":
            s = p / (delta + eps)
            # value of a node in committed tokens vs its expert cost in token-equivalents (λ-weighted)
            worth = p - lam * delta / per_token
        else:
            s = torch.log(p.clamp_min(1e-30)) - lam * delta
            worth = s - torch.log(torch.tensor(1e-30, dtype=torch.float64))
        best = int(torch.argmax(s))
        if float(worth[best]) <= 0:
            break
        node = int(idx[best])
        chosen.append(node)
        selected[node] = True
        needed |= pred[node]
    return torch.tensor(sorted(chosen))
