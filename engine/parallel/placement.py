"""Expert placement for expert parallelism (EP) and the per-rank load of a (virtual) EP layout.

    placement = place_experts(64, world_size=16, strategy="load_balanced", ranks_per_node=8,
                              expert_counts=recorded_counts)           # [E] tokens per expert
    loads = rank_loads(expert_ids, placement)                           # expert_ids [T, r]
    loads.imbalance, loads.cross_node_ratio

Strategies (one placement per MoE layer; node k holds ranks k·ranks_per_node .. (k+1)·ranks_per_node − 1):

    contiguous     rank w holds experts [w·E/W, (w+1)·E/W)           (W must divide E)
    round_robin    expert e on rank e mod W                          (W must divide E)
    load_balanced  greedy longest-processing-time bin packing (Graham 1969) of recorded counts, ceil(E/W)
                   experts per rank at most so that weight memory stays balanced
    replicated     the top-h hot experts on every rank, the rest load_balanced (redundant experts as in
                   DeepSeek-V3's EPLB, 2412.19437)

The single-process engine reports `rank_loads` of a virtual layout each round (DESIGN §2 "Expert
parallelism"); the torch.distributed EP reuses the same `ExpertPlacement` and `assign_ranks`.
"""

# T=tokens r=top-r E=experts W=EP ranks (world size) L=MoE layers
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

STRATEGIES = ("contiguous", "round_robin", "load_balanced", "replicated")


@dataclass(frozen=True)
class ExpertPlacement:
    """Which EP ranks hold a copy of each expert: `expert_ranks[e]`, a tuple of ranks (several = replicas)."""

    num_experts: int
    world_size: int
    ranks_per_node: int
    expert_ranks: tuple[tuple[int, ...], ...]
    strategy: str = "custom"

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.ranks_per_node < 1:
            raise ValueError(f"world_size ({self.world_size}) and ranks_per_node ({self.ranks_per_node}) must be >= 1")
        if len(self.expert_ranks) != self.num_experts:
            raise ValueError(f"placement lists {len(self.expert_ranks)} experts, expected {self.num_experts}")
        dropped = [e for e, ranks in enumerate(self.expert_ranks) if len(ranks) == 0]
        if dropped:
            raise ValueError(f"placement drops expert(s) {dropped}: every expert needs at least one rank")
        outside = sorted({w for ranks in self.expert_ranks for w in ranks if not 0 <= w < self.world_size})
        if outside:
            raise ValueError(f"placement names rank(s) {outside} outside the world [0, {self.world_size})")
        doubled = [e for e, ranks in enumerate(self.expert_ranks) if len(set(ranks)) != len(ranks)]
        if doubled:
            raise ValueError(f"expert(s) {doubled} list the same rank twice")
        if self.strategy in ("contiguous", "round_robin") and self.num_experts % self.world_size:
            raise ValueError(
                f"{self.strategy} placement needs the world size ({self.world_size}) to divide the expert "
                f"count ({self.num_experts}); use load_balanced or replicated"
            )

    @property
    def num_nodes(self) -> int:
        return -(-self.world_size // self.ranks_per_node)

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    @property
    def rank_experts(self) -> tuple[tuple[int, ...], ...]:
        """Experts held by each rank."""
        held: list[list[int]] = [[] for _ in range(self.world_size)]
        for e, ranks in enumerate(self.expert_ranks):
            for w in ranks:
                held[w].append(e)
        return tuple(tuple(h) for h in held)

    @property
    def replicated_experts(self) -> tuple[int, ...]:
        return tuple(e for e, ranks in enumerate(self.expert_ranks) if len(ranks) > 1)


def _lpt(experts: Sequence[int], loads: Sequence[float], world_size: int, capacity: int) -> dict[int, int]:
    """Greedy longest-processing-time: heaviest expert first onto the least-loaded rank with room left."""
    rank_load = [0.0] * world_size
    rank_fill = [0] * world_size
    owner = {}
    for e in sorted(experts, key=lambda e: (-loads[e], e)):
        w = min((w for w in range(world_size) if rank_fill[w] < capacity), key=lambda w: (rank_load[w], w))
        owner[e] = w
        rank_load[w] += loads[e]
        rank_fill[w] += 1
    return owner


def place_experts(
    num_experts: int,
    world_size: int,
    strategy: str = "contiguous",
    *,
    ranks_per_node: int = 8,
    expert_counts: torch.Tensor | Sequence[float] | None = None,
    num_replicated: int = 0,
) -> ExpertPlacement:
    """Place E experts on W ranks. expert_counts [E]: recorded assignments per expert (load_balanced,
    replicated; uniform when None). num_replicated h: hot experts copied to every rank (replicated)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown placement strategy {strategy!r}; available: {', '.join(STRATEGIES)}")
    E, W = num_experts, world_size
    if strategy in ("contiguous", "round_robin"):
        if W < 1 or E % W:
            raise ValueError(
                f"{strategy} placement needs the world size ({W}) to divide the expert count ({E}); "
                "use load_balanced or replicated"
            )
        per_rank = E // W
        owner = [e // per_rank if strategy == "contiguous" else e % W for e in range(E)]
        return ExpertPlacement(E, W, ranks_per_node, tuple((w,) for w in owner), strategy)
    counts = [1.0] * E if expert_counts is None else [float(c) for c in expert_counts]
    if len(counts) != E:
        raise ValueError(f"expert_counts has {len(counts)} entries for {E} experts")
    hot: list[int] = []
    if strategy == "replicated":
        if not 0 < num_replicated <= E:
            raise ValueError(f"replicated placement needs 0 < num_replicated <= {E}, got {num_replicated}")
        hot = sorted(range(E), key=lambda e: (-counts[e], e))[:num_replicated]
    cold = [e for e in range(E) if e not in set(hot)]
    owner = _lpt(cold, counts, W, capacity=-(-len(cold) // W)) if cold else {}
    all_ranks = tuple(range(W))
    expert_ranks = tuple(all_ranks if e in hot else (owner[e],) for e in range(E))
    return ExpertPlacement(E, W, ranks_per_node, expert_ranks, strategy)


def assign_ranks(
    expert_ids: torch.Tensor, placement: ExpertPlacement, token_rank: torch.Tensor | None = None
) -> torch.Tensor:
    """Serving rank of every assignment: LongTensor [T, r] for expert_ids [T, r].

    token_rank [T]: the rank each token lives on (default: rank 0, one request). A replicated expert is
    served on the token's own rank if it holds a replica, else on the least-loaded replica of the token's
    node, else on the least-loaded replica anywhere (ties: lowest rank). Loads count this call's
    assignments, single-copy experts first, then replicated ones in token order.
    """
    T = expert_ids.shape[0]
    ids = expert_ids.long()
    if token_rank is None:
        token_rank = torch.zeros(T, dtype=torch.long)
    if token_rank.shape != (T,):
        raise ValueError(f"token_rank has shape {tuple(token_rank.shape)}, expected ({T},)")
    primary = torch.tensor([ranks[0] for ranks in placement.expert_ranks], dtype=torch.long)
    serving = primary[ids]  # [T, r]
    replicated = placement.replicated_experts
    if not replicated:
        return serving
    is_rep = torch.isin(ids, torch.tensor(replicated, dtype=torch.long))  # [T, r]
    load = torch.bincount(serving[~is_rep], minlength=placement.world_size).tolist()
    for t, k in is_rep.nonzero().tolist():
        home = int(token_rank[t])
        ranks = placement.expert_ranks[int(ids[t, k])]
        if home in ranks:
            w = home
        else:
            near = [w for w in ranks if placement.node_of(w) == placement.node_of(home)]
            w = min(near or ranks, key=lambda w: (load[w], w))
        serving[t, k] = w
        load[w] += 1
    return serving


@dataclass(frozen=True)
class RankLoads:
    """Per-rank load of one MoE layer under a placement.

    imbalance = max over ranks of assignments / mean over ranks (1.0 when balanced or empty);
    cross_node_ratio = share of assignments served on another node than the token's rank (0.0 when empty);
    cross_rank_ratio = share served on another rank.
    """

    assignments: tuple[int, ...]
    imbalance: float
    cross_node_ratio: float
    cross_rank_ratio: float


def rank_loads(
    expert_ids: torch.Tensor, placement: ExpertPlacement, token_rank: torch.Tensor | None = None
) -> RankLoads:
    """Assignments per rank, rank imbalance and cross-node ratio for expert_ids [T, r]."""
    T = expert_ids.shape[0]
    if token_rank is None:
        token_rank = torch.zeros(T, dtype=torch.long)
    serving = assign_ranks(expert_ids, placement, token_rank)  # [T, r]
    counts = torch.bincount(serving.reshape(-1), minlength=placement.world_size)
    total = int(counts.sum())
    if total == 0:
        return RankLoads(tuple(counts.tolist()), 1.0, 0.0, 0.0)
    home = token_rank[:, None].expand_as(serving)
    rpn = placement.ranks_per_node
    cross_node = float(((serving // rpn) != (home // rpn)).float().mean())
    cross_rank = float((serving != home).float().mean())
    imbalance = float(counts.max()) / (total / placement.world_size)
    return RankLoads(tuple(counts.tolist()), imbalance, cross_node, cross_rank)


@dataclass(frozen=True)
class EPLayoutStats:
    """Rank loads of every MoE layer of one forward, summarised as DESIGN §1 reports them."""

    per_layer: tuple[RankLoads, ...]
    imbalance_mean: float
    imbalance_max: float
    cross_node_ratio: float  # pooled over layers


def layout_stats(
    routing: Sequence[torch.Tensor],
    placement: ExpertPlacement | Sequence[ExpertPlacement],
    token_rank: torch.Tensor | None = None,
) -> EPLayoutStats:
    """rank_loads of each layer (routing: L x [T, r]; one placement, or one per layer) and their summary."""
    placements = [placement] * len(routing) if isinstance(placement, ExpertPlacement) else list(placement)
    if len(placements) != len(routing):
        raise ValueError(f"{len(placements)} placements for {len(routing)} MoE layers")
    per_layer = tuple(rank_loads(e, p, token_rank) for e, p in zip(routing, placements))
    if not per_layer:
        return EPLayoutStats((), 1.0, 1.0, 0.0)
    weights = [sum(x.assignments) for x in per_layer]
    pooled = sum(x.cross_node_ratio * w for x, w in zip(per_layer, weights)) / max(sum(weights), 1)
    imbalances = [x.imbalance for x in per_layer]
    return EPLayoutStats(per_layer, sum(imbalances) / len(imbalances), max(imbalances), pooled)
