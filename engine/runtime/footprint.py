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

import numpy as np
import torch

from engine.parallel.placement import ExpertPlacement, layout_stats
from kernels import cpu_decode


@dataclass
class Footprint:
    distinct_experts: list[int]  # [L] U_l
    tokens_per_expert: torch.Tensor  # [L, E] assignment counts
    pairs: torch.Tensor  # [L, E] bool: (layer, expert) pairs touched
    reuse: float
    overlap_prev: float | None  # None without a previous round
    new_pairs_per_node: float  # (layer, expert) pairs beyond the root's own, per drafted node (0 if n = 1)


def round_footprint(
    expert_ids: Sequence[torch.Tensor] | torch.Tensor,
    num_experts: int,
    prev_pairs: torch.Tensor | None,
    rows: tuple[int, int] | None = None,
) -> Footprint:
    """expert_ids: L x [n, r] routing of the verified tokens (root first), or them stacked [n, L, r] -> Footprint.
    rows (start, n): expert_ids is a whole forward's routing L x [N, r] and the round's tokens are its rows
    start .. start + n - 1 (a batched step's request; no slicing needed).

    Every round of an instrumented engine pays this. For CPU int64 routing it is one C++ call
    (`kernels.cpu_decode.routing_footprint`, ~3 µs); else the numpy twin `footprint_numpy` (~11 µs at one token in
    a loop on an AMD EPYC, ~35 µs in situ after a forward, ~100 µs on a slower Xeon: cold caches)."""
    native = None
    if not isinstance(expert_ids, torch.Tensor) and expert_ids and cpu_decode.load() is not None:
        start, n = rows if rows is not None else (0, int(expert_ids[0].shape[0]))
        native = cpu_decode.routing_footprint(expert_ids, start, n, num_experts, prev_pairs)
    if native is not None:
        counts, pairs, distinct, used, root, overlap = native
        return Footprint(
            distinct_experts=distinct,
            tokens_per_expert=counts,
            pairs=pairs,
            reuse=1.0 - used / max(n * len(distinct) * int(expert_ids[0].shape[1]), 1),
            overlap_prev=None if overlap < 0 else overlap / max(used, 1),
            new_pairs_per_node=(used - root) / (n - 1) if n > 1 else 0.0,
        )
    if rows is not None:
        start, n = rows
        expert_ids = [e[start : start + n] for e in expert_ids]
    return footprint_numpy(expert_ids, num_experts, prev_pairs)


def footprint_numpy(
    expert_ids: Sequence[torch.Tensor] | torch.Tensor, num_experts: int, prev_pairs: torch.Tensor | None
) -> Footprint:
    """`round_footprint` in numpy, for any device and id dtype (the C++ call's reference twin; tested equal)."""
    if isinstance(expert_ids, torch.Tensor):
        ids = expert_ids
    elif all(e.dim() == 2 for e in expert_ids):
        ids = torch.stack(list(expert_ids), 1)  # [n, L, r]
    else:
        ids = torch.stack([e.reshape(e.shape[0], -1) for e in expert_ids], 1)
    if ids.device.type != "cpu":
        ids = ids.cpu()
    a = ids.numpy().astype(np.int64, copy=False)  # numpy for the integer bookkeeping, where torch ops cost more
    n, L = a.shape[0], a.shape[1]
    E = num_experts
    if a.size and (a.min() < 0 or a.max() >= E):
        bad = int(a.min()) if a.min() < 0 else int(a.max())
        raise ValueError(f"round_footprint: expert id {bad} outside [0, {E}) (a -1 'not local' id has no expert: "
                         "take global ids)")  # fmt: skip
    flat = a + _layer_offsets(L, E)  # (layer, expert) -> layer * E + expert: one bincount
    counts = np.bincount(flat.ravel(), minlength=L * E).reshape(L, E)  # [L, E] int64
    pairs = counts > 0
    per_layer = pairs.sum(1)
    distinct = per_layer.tolist()
    used = int(per_layer.sum())
    overlap = None
    if prev_pairs is not None:
        prev = prev_pairs.numpy() if prev_pairs.device.type == "cpu" else prev_pairs.cpu().numpy()
        overlap = float(np.count_nonzero(pairs & prev)) / max(used, 1)
    new_per_node = 0.0
    if n > 1:
        root = len(np.unique(flat[0]))  # the root's own pairs
        new_per_node = (used - root) / (n - 1)
    return Footprint(
        distinct_experts=distinct,
        tokens_per_expert=torch.from_numpy(counts),
        pairs=torch.from_numpy(pairs),
        reuse=1.0 - used / max(a.size, 1),
        overlap_prev=overlap,
        new_pairs_per_node=new_per_node,
    )


_OFFSETS: dict[tuple[int, int], np.ndarray] = {}


def _layer_offsets(L: int, E: int) -> np.ndarray:
    """[1, L, 1] int64: l·E, the flat index of layer l's expert 0 (cached per shape)."""
    off = _OFFSETS.get((L, E))
    if off is None:
        off = _OFFSETS[(L, E)] = (np.arange(L, dtype=np.int64) * E).reshape(1, L, 1)
    return off


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
