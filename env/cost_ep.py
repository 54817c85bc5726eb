"""Cost kind "roofline-ep": expert parallelism over one node of W GPUs, rank imbalance and all-to-alls priced.

The roofline of hardware × model spec (env.cost_model.RooflineCostModel) with the routed experts placed over W EP
ranks by engine.parallel.placement (default contiguous: rank w holds experts [w·E/W, (w+1)·E/W)). One request,
so every token lives on rank 0, which also runs attention, router, shared experts and the LM head. Per MoE layer

    layer experts = max over ranks w of Σ_{active e on w} max(expert bytes / HBM, 6·D·F·t_e / peak)
                    (+ the shared experts on rank 0)                      the slowest rank: rank imbalance
    dispatch      = max(busiest send, busiest receive) of the (token, remote rank) pairs · D · activation bytes
                    / link bandwidth + link latency                       one DeepEP-style all-to-all
    combine       = dispatch                                              the reverse all-to-all

exactly engine.cost.roofline.RooflineCost(hw, spec, layout=placement).forward_cost (a test proves the two equal
on random routings), in numpy so replay tables of thousands of outcomes build in seconds. A token is sent once
to every remote rank that serves one of its experts; NVLink within the node (the profile's intra-node link),
the inter-node link only when W exceeds hardware.gpus_per_node.

It needs the verified nodes' routing ids [n, L, r] (not only Σ_l U_l): which experts, hence which ranks, each
token uses. The replay tables keep that per node (env.tables: the recorded target's routing, or identity-keyed
synthetic routing of the priced model), so it is exact in replay. T_AR = the same forward over the round's root
alone with its own routing (the plain decode step at that position: which ranks its r experts land on).
Placements with replicated experts (assign_ranks' load-dependent choice) are not supported here.

Shape letters: n=verified tokens L=MoE layers E=experts r=top-r W=EP ranks.
"""

from __future__ import annotations

import numpy as np

from engine.cost.roofline import ModelSpec
from engine.parallel.placement import ExpertPlacement, place_experts
from env.cost_model import RooflineCostModel

EP_PLACEMENTS = ("contiguous", "round_robin", "load_balanced")


class EPCostModel(RooflineCostModel):
    """Roofline under an EP layout of `ranks` GPUs of one node (module docstring)."""

    needs_routing = True

    def __init__(
        self, hardware: str, spec: ModelSpec, drafter_spec, ranks: int = 8, placement: str = "contiguous"
    ) -> None:
        super().__init__(hardware, spec, drafter_spec)
        if placement not in EP_PLACEMENTS:
            raise ValueError(f"ep_placement must be one of {EP_PLACEMENTS} (one rank per expert), got {placement!r}")
        if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
            raise ValueError(f"ep_ranks must be an int >= 1, got {ranks!r}")
        self.placement: ExpertPlacement = place_experts(
            spec.num_experts, ranks, placement, ranks_per_node=self.hw.gpus_per_node
        )
        self.ranks = ranks
        self.owner = np.asarray([r[0] for r in self.placement.expert_ranks], dtype=np.int64)  # [E] serving rank
        self._onehot = np.zeros((spec.num_experts, ranks))  # [E, W]
        self._onehot[np.arange(spec.num_experts), self.owner] = 1.0
        node = np.arange(ranks) // self.placement.ranks_per_node
        self._remote = np.arange(ranks) != 0  # tokens live on rank 0
        self._inter = node != node[0]
        self._intra_link = self.hw.intra_node_link()
        s = spec
        self._shared_params = 3 * s.hidden_size * s.shared_expert_dim * s.num_shared_experts
        self.name = f"roofline-ep{ranks}:{self.hw.name}:{spec.name}:{self.drafter.spec.name}:{placement}"
        self.params = [*self.params, {"ranks": ranks, "placement": placement}]

    def needs_counts(self, n: int) -> bool:
        return False  # verify reads the routing itself

    def _shared(self, n: int) -> float:
        if n <= 0 or not self._shared_params:
            return 0.0
        return self._roof(self._shared_params * self.spec.dense_weight_bytes, 2.0 * n * self._shared_params)

    def moe_terms(self, routing: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per MoE layer [L]: (slowest rank's expert time incl. rank 0's shared experts, one all-to-all's seconds)
        for routing ids [n, L, r]."""
        ids = np.asarray(routing, dtype=np.int64)
        n, L, r = ids.shape
        E, W = self.spec.num_experts, self.ranks
        counts = np.zeros((L, E))
        np.add.at(counts, (np.broadcast_to(np.arange(L)[None, :, None], ids.shape), ids), 1.0)  # [L, E]
        per_expert = np.where(counts > 0, np.maximum(self._expert_mem, self._expert_flops_per_token * counts), 0.0)
        rank_time = per_expert @ self._onehot  # [L, W]
        rank_time[:, 0] += self._shared(n)
        experts = rank_time.max(axis=1)
        need = np.zeros((n, L, W), dtype=bool)  # token t needs rank w in layer l
        need[np.arange(n)[:, None, None], np.arange(L)[None, :, None], self.owner[ids]] = True
        need &= self._remote
        msg = self.spec.hidden_size * self.spec.activation_bytes
        worst = np.zeros(L)
        any_pair = need.any(axis=(0, 2))
        for cls, bw in ((~self._inter, self._intra_link[0]), (self._inter, self.hw.internode_bandwidth)):
            per_dst = need[:, :, cls].sum(axis=0)  # [L, W_cls] tokens received by each destination
            if per_dst.size == 0:
                continue
            out_b = per_dst.sum(axis=1) * msg  # every pair leaves rank 0
            in_b = per_dst.max(axis=1) * msg
            worst = np.maximum(worst, np.maximum(out_b, in_b) / bw)
        has_inter = need[:, :, self._inter].any(axis=(0, 2)) if self._inter.any() else np.zeros(L, dtype=bool)
        latency = np.where(has_inter, self.hw.internode_latency, self._intra_link[1])
        dispatch = np.where(any_pair, worst + latency, 0.0)
        return experts, dispatch

    def verify(
        self,
        n: int,
        distinct_total: int,
        context_len: int,
        counts: np.ndarray | None = None,
        routing: np.ndarray | None = None,
    ) -> float:
        if routing is None:
            raise ValueError(f"{self.name} prices a verification from its routing ids [n, L, r]: pass routing")
        if routing.shape[0] != n:
            raise ValueError(f"routing has {routing.shape[0]} tokens, n = {n}")
        base = RooflineCostModel.verify(self, n, 0, context_len)  # everything but the routed experts
        experts, dispatch = self.moe_terms(routing)
        # base holds every MoE layer's shared experts on top of attention etc.; EP puts them inside rank 0's time
        return base - self.spec.num_moe_layers * self._shared(n) + float(experts.sum() + 2.0 * dispatch.sum())

    def ar(self, context_len: int, routing: np.ndarray | None = None) -> float:
        if routing is None:  # no root routing known: the mean over uniform routings (fixed seed)
            return float(np.mean([self.verify(1, 0, context_len, routing=g) for g in self._uniform(1, 16)]))
        return self.verify(1, 0, context_len, routing=routing)

    def _uniform(self, n: int, samples: int) -> list[np.ndarray]:
        L, E, r = self.routing_shape
        rng = np.random.default_rng(0)
        return [np.argsort(rng.random((n, L, E)), axis=-1)[..., :r] for _ in range(samples)]

    def verify_costs(self, max_nodes: int, context_len: int = 256) -> tuple[float, ...]:
        """T_verify(m + 1) / T_AR under uniform independent routing (mean of 8 fixed-seed routings)."""
        ar = self.ar(context_len)
        return tuple(
            float(np.mean([self.verify(m + 1, 0, context_len, routing=g) for g in self._uniform(m + 1, 8)]) / ar)
            for m in range(max_nodes + 1)
        )
