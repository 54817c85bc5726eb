"""Which drafted nodes are verified: by path probability (λ = 0) or expert-cost-aware (λ > 0).

Every selection is prefix-closed (a node's parent is selected whenever the node is). With λ > 0 the node
scores use the marginal expert cost ΔC predicted by an expert predictor: EcoSpec's P_path / (λ·ΔC + 1)
(2607.12696) or log P_path − λ·ΔC, with the buffer of already-needed (layer, expert) pairs updated after
every pick.

Shape letters: N=nodes L=MoE layers E=experts.
"""

from __future__ import annotations

import torch

from engine.models.expert_predictor import ExpertPredictor
from engine.spec.config import SpecConfig
from engine.spec.draft_tree import DraftTree


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
) -> torch.Tensor:
    """λ > 0: greedy prefix-closed selection of `max_verify` nodes by path probability and predicted
    marginal expert cost ΔC (the (layer, expert) pairs a node adds to those already needed).

    tree.predicted_experts [N, L, E] bool; root_experts [L, E] bool (default: the root's prediction).
    Scores over the frontier of selectable nodes (parent already chosen), recomputed after each pick
    because the buffer of needed pairs grows:
      "ecospec" (2607.12696): P_path / (λ·ΔC + 1)   — λ = 0 is plain path probability
      "logp":                 log P_path − λ·ΔC
    Returns sorted node indices (root included).
    """
    pred = tree.predicted_experts
    if pred is None:
        raise ValueError("λ > 0 needs predicted experts per node (a drafter with an expert predictor)")
    n_nodes = tree.num_nodes
    needed = (root_experts if root_experts is not None else pred[0]).clone()  # [L, E]
    selected = torch.zeros(n_nodes, dtype=torch.bool)
    selected[0] = True
    parents = tree.parents.clamp(min=0)
    probs = tree.path_prob.double()
    for _ in range(min(max_verify, n_nodes - 1)):
        cand = (~selected) & selected[parents]
        cand[0] = False
        idx = cand.nonzero().squeeze(1)
        if idx.numel() == 0:
            break
        delta = (pred[idx] & ~needed).flatten(1).sum(1).double()  # [C] marginal pairs
        p = probs[idx]
        s = p / (lam * delta + 1.0) if score == "ecospec" else torch.log(p.clamp_min(1e-30)) - lam * delta
        node = int(idx[int(torch.argmax(s))])  # ties: lowest index
        selected[node] = True
        needed |= pred[node]
    return selected.nonzero().squeeze(1)


def annotate_tree(tree: DraftTree, node_features: torch.Tensor, predictor: ExpertPredictor) -> DraftTree:
    """Fill `tree.predicted_experts` [N, L, E] bool from node_features [N, D] (row i = node i, root 0)."""
    if node_features.shape[0] != tree.num_nodes:
        raise ValueError(f"{node_features.shape[0]} feature rows for a tree of {tree.num_nodes} nodes")
    tree.predicted_experts = predictor.predict(node_features).cpu()
    return tree


def select_verified(tree: DraftTree, spec: SpecConfig, drafted: bool) -> DraftTree:
    """Prefix-closed subset of `tree` to verify.

    Drafted (i.i.d.) children are never filtered. Otherwise λ > 0 with predicted experts: `max_verify`
    greedy expert-aware picks (`select_expert_aware`, `spec.score`; without max_verify every node is
    kept and λ changes nothing); else the `max_verify` nodes of highest path probability (EAGLE-2
    re-ranking, 2406.16858)."""
    if drafted or tree.num_nodes <= 1:
        return tree
    if spec.lam > 0 and tree.predicted_experts is not None:
        keep = select_expert_aware(tree, spec.max_verify or tree.num_nodes - 1, spec.lam, spec.score)
    elif spec.max_verify is not None:
        keep = select_by_probability(tree, spec.max_verify)
    else:
        keep = None
    if keep is not None and keep.numel() != tree.num_nodes:
        tree = tree.subtree(keep)
    if spec.verify_rule == "goodput" and spec.verify_costs:
        keep = goodput_keep(tree.parents, tree.path_prob, spec.verify_costs)
        if keep.numel() != tree.num_nodes:
            tree = tree.subtree(keep)
    return tree


def goodput_keep(parents: torch.Tensor, path_prob: torch.Tensor, verify_costs: tuple[float, ...]) -> torch.Tensor:
    """EVICT's verification cut (2605.00342): the m most probable nodes (a prefix-closed set, since a node's
    path probability never exceeds its parent's; ties broken by index), m maximising the expected committed
    tokens per cost (1 + Σ path prob) / verify_costs[m], m = 0 .. min(N - 1, len(verify_costs) - 1).

    parents, path_prob: [N] (node 0 = root). Returns the kept node indices [m + 1], root first, sorted."""
    N = int(parents.shape[0])
    order = sorted(range(1, N), key=lambda i: (-float(path_prob[i]), i))
    best_m, best, gain = 0, 1.0 / verify_costs[0], 1.0
    for m in range(1, min(N - 1, len(verify_costs) - 1) + 1):
        gain += float(path_prob[order[m - 1]])
        value = gain / verify_costs[m]
        if value > best:
            best_m, best = m, value
    return torch.tensor(sorted([0] + order[:best_m]), dtype=torch.long)
