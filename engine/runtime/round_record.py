"""A round's RoundStats from what the engine's step knows: the action, the tree, the verification and the
verified nodes' routing. The step adds the timings (`time`, `host_seconds`, `round_seconds`) once it ends.

Shape letters: L=MoE layers n=verified tokens r=top-r.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from engine.runtime.footprint import round_footprint
from engine.runtime.stats import RoundStats


def round_stats(
    r: Any,
    tree: Any,
    spec: Any,
    action: Any,
    result: Any,
    committed: int,
    routing: list[torch.Tensor] | None,
    num_experts: int,
    rank_loads: Callable | None = None,
    cost_model: Callable | None = None,
    start: int = 0,
    shape: tuple[int, int] = (0, 0),
) -> RoundStats:
    """RoundStats of request `r`'s round (`_commit` already advanced it): `spec` the round's SpecConfig (after
    the end-of-request cap), `action` the one chosen, `result` the verification, `routing` the step's forward's
    routing L x [N, r] when the engine recorded it (footprint, rank loads and the modelled cost need it), whose
    rows start .. start + n - 1 are this round's verified nodes; `shape` (L, r) of the target.

    A one-token round (n = 1, K = 0) has a known footprint without routing: r distinct experts in each of the L
    MoE layers, no reuse, no drafted node. Its overlap with the previous round is never observed (None) and it does
    not become the next round's "previous round" (`r.prev_pairs` stays the last verification of a tree's), whether
    or not its routing was recorded: the engine need not record one-token steps (`Engine(plain_routing=False)`), and
    a request's observation never depends on whether its batch mates drafted (env.replay does the same)."""
    n = tree.num_nodes
    K = int(tree.max_depth) if n > 1 else 0
    acc = result.accepted_len
    tried = len(result.children_tried) if n > 1 else 0
    stats = RoundStats(
        round_index=len(r.rounds),
        depth=action.depth,
        built_depth=K,
        width=spec.width,
        lam=float(spec.lam),
        verified_tokens=n,
        proposed=n - 1,
        accepted=acc,
        committed=committed,
        bonus=result.bonus and n > 1,
        rejection_depth=result.rejection_depth,
        attempted_by_depth=[1 if d <= tried else 0 for d in range(1, K + 1)],
        accepted_by_depth=[1 if d <= acc else 0 for d in range(1, K + 1)],
        draft_confidence=list(tree.confidence)[:K],
        verify_rule=spec.verify_rule,
        context_len=r.cached_len - committed,
    )
    if n == 1 and shape[1] > 0:
        L, top_r = shape
        stats.distinct_experts = [top_r] * L
        stats.new_pairs_per_node = 0.0
        if routing is not None:
            stats.tokens_per_expert = round_footprint(routing, num_experts, None, rows=(start, n)).tokens_per_expert
    elif routing is not None:
        fp = round_footprint(routing, num_experts, r.prev_pairs, rows=(start, n))
        stats.tokens_per_expert = fp.tokens_per_expert
        stats.distinct_experts = fp.distinct_experts
        stats.reuse = fp.reuse
        stats.overlap_prev = fp.overlap_prev
        stats.new_pairs_per_node = fp.new_pairs_per_node
        r.prev_pairs = fp.pairs
    if routing is not None:
        ids = [e[start : start + n] for e in routing] if rank_loads is not None or cost_model is not None else []
        if rank_loads is not None:
            stats.rank_imbalance_mean, stats.rank_imbalance_max, stats.cross_node_ratio = rank_loads(ids)
        if cost_model is not None:
            stats.modelled_seconds = float(cost_model(ids, stats.context_len))
    return stats
