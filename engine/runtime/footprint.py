"""Per-round expert footprint of one verification: U_l, tokens per expert, reuse, overlap, new pairs.

One function used by the engine (live rounds) and by trace replay, so both report the same numbers.
Vocabulary of DESIGN.md §1: U_l = distinct experts touched in MoE layer l by one verification of n tokens;
reuse = 1 − Σ_l U_l / Σ_l (n·r); overlap = share of this round's (layer, expert) pairs used last round.

Shape letters: L=MoE layers n=verified tokens r=top-r E=experts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.parallel.placement import ExpertPlacement, layout_stats


@dataclass
class Footprint:
    distinct_experts: list[int]  # [L] U_l
    tokens_per_expert: torch.Tensor  # [L, E] assignment counts
    pairs: torch.Tensor  # [L, E] bool: (layer, expert) pairs touched
    reuse: float
    overlap_prev: float | None  # None without a previous round
    new_pairs_per_node: float  # (layer, expert) pairs beyond the root's own, per drafted node (0 if n = 1)


def round_footprint(expert_ids: Sequence[torch.Tensor], num_experts: int, prev_pairs: torch.Tensor | None) -> Footprint:
    """expert_ids: L x [n, r] routing of the verified tokens (root first) -> Footprint."""
    counts = torch.stack([torch.bincount(e.reshape(-1), minlength=num_experts) for e in expert_ids]).cpu()  # [L, E]
    pairs = counts > 0
    distinct = pairs.sum(1).tolist()
    total = sum(e.numel() for e in expert_ids)
    n = int(expert_ids[0].shape[0]) if expert_ids else 0
    overlap = None
    if prev_pairs is not None:
        overlap = float((pairs & prev_pairs).sum()) / max(int(pairs.sum()), 1)
    new_per_node = 0.0
    if n > 1:
        root = sum(int(torch.unique(e[0]).numel()) for e in expert_ids)
        new_per_node = (int(pairs.sum()) - root) / (n - 1)
    return Footprint(
        distinct_experts=distinct,
        tokens_per_expert=counts,
        pairs=pairs,
        reuse=1.0 - sum(distinct) / max(total, 1),
        overlap_prev=overlap,
        new_pairs_per_node=new_per_node,
    )


def virtual_rank_loads(placement: Any, num_experts: int) -> Callable[[list[torch.Tensor]], tuple[float, float, float]]:
    """RoundStats' rank imbalance / cross-node ratio of a virtual EP layout (engine.parallel.placement):
    L x expert_ids [n, r] -> (imbalance mean, imbalance max, cross-node ratio)."""

    if not isinstance(placement, ExpertPlacement):
        raise TypeError(f"virtual_ep must be an engine.placement.ExpertPlacement, got {type(placement).__name__}")
    if placement.num_experts != num_experts:
        raise ValueError(f"virtual_ep places {placement.num_experts} experts but the target has {num_experts}")

    def loads(ids: list[torch.Tensor]) -> tuple[float, float, float]:
        s = layout_stats(ids, placement)
        return s.imbalance_mean, s.imbalance_max, s.cross_node_ratio

    return loads
