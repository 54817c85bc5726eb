"""Cost kind "roofline-offload": experts in host memory, a per-layer device cache, misses priced over PCIe.

The regime SpecMoE (2604.10152) targets: the routed experts live in host memory and each MoE layer keeps a
device cache of C expert slots. A round then costs the resident roofline (env.cost_model.RooflineCostModel: the
cached expert weights are read from HBM as usual) plus, for every (layer, expert) pair the verification touches
that is not cached, one host -> device copy of that expert:

    T_verify = roofline T_verify(n, Σ_l U_l, context) + misses · transfer_seconds(expert bytes, hardware)

`transfer_seconds` is engine.offload.cache's (bytes / PCIe bandwidth + PCIe latency, the hardware profile's);
demand misses are exposed in full (no prefetch, no overlap with compute: the engine's timing model for demand
loads). The drafter stays resident (priced by its roofline, as for "roofline").

Cache state (`ExpertCacheState`): the numpy twin of engine.offload.cache.ExpertOffload.access over one round's
(layer, expert) pairs — hits refresh recency, misses are loaded in ascending expert id, the victim is the least
recently (LRU) or least frequently, ties least recently (LFU) used cached expert the round does not need, and
a miss finds no slot when every slot holds a needed expert: it is streamed (moved, used, not cached). A test
proves it equal to ExpertOffload on random access sequences. The state is per request (per episode): empty at
the episode's start (prefill is not modelled), updated with every verification's pairs.

T_AR (the plain decode step that speed-ups and rewards divide by) is priced in the same regime with the cache
plain decoding would have: at position p of a request, the root's r experts per layer against the cache that has
served exactly the roots of positions 0..p−1 from empty (env.tables builds it position by position). It depends
on the position only, not on the policy, so every policy of a table is measured against the same plain-decoding
time, and target-only decoding (whose own cache *is* that cache) prices every round at exactly T_AR. (The
alternative, pricing T_AR against the policy's current cache — what Cascade's K = 0 measurements see — would give
each policy its own denominator.)

Replay (env.tables / env.replay / env.oracle): a round's cost now depends on the episode's history, so
  - the replay env keeps an ExpertCacheState per episode and adds the round's transfer time at step time
    (deterministic: the same actions give the same costs after every reset);
  - the tables' `cost[p, a]` (what the hindsight DP plans on) prices the transfers against the plain-decoding
    cache at p, a stateless proxy: the oracle is then a strong hindsight planner, no longer an upper bound;
  - static actions are simulated exactly (env.oracle.static_returns), so static-best is chosen on true cost.

Shape letters: L=MoE layers E=experts C=cache slots per layer r=top-r n=verified tokens.
"""

from __future__ import annotations

import numpy as np

from engine.cost.roofline import ModelSpec
from engine.offload.cache import POLICIES, transfer_seconds
from env.cost_model import RooflineCostModel

_BIG = np.int64(1) << np.int64(40)  # LFU victim key = frequency · _BIG + recency stamp


def cache_slots(fraction: float, num_experts: int) -> int:
    """C = round(fraction · E) expert slots per MoE layer, at least 1."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"offload_cache must be a fraction of the experts per layer in (0, 1], got {fraction}")
    return max(1, int(round(fraction * num_experts)))


class ExpertCacheState:
    """Device cache of C experts per MoE layer over host-resident experts (module docstring).

    `access(needed)` takes the round's (layer, expert) pairs as bool [L, E], updates the state and returns the
    misses per layer [L] (streamed ones included); `peek(needed)` counts the misses without changing anything.
    """

    def __init__(self, num_layers: int, num_experts: int, capacity: int, policy: str = "lru") -> None:
        if policy not in POLICIES:
            raise ValueError(f"offload_policy must be one of {POLICIES}, got {policy!r}")
        if not 1 <= capacity <= num_experts:
            raise ValueError(f"cache capacity must be in 1..{num_experts}, got {capacity}")
        self.num_layers, self.num_experts, self.capacity, self.policy = num_layers, num_experts, capacity, policy
        self.cached = np.zeros((num_layers, num_experts), dtype=bool)
        self.stamp = np.zeros((num_layers, num_experts), dtype=np.int64)  # recency: larger = more recent
        self.freq = np.zeros((num_layers, num_experts), dtype=np.int64)  # rounds that needed the expert
        self.rounds = 0
        self._ids = np.arange(num_experts, dtype=np.int64)

    def copy(self) -> ExpertCacheState:
        other = ExpertCacheState(self.num_layers, self.num_experts, self.capacity, self.policy)
        other.cached, other.stamp, other.freq = self.cached.copy(), self.stamp.copy(), self.freq.copy()
        other.rounds = self.rounds
        return other

    def cached_experts(self, layer: int) -> list[int]:
        """Experts of MoE layer `layer` on the device now, ascending (ExpertOffload.cached_experts)."""
        return np.flatnonzero(self.cached[layer]).tolist()

    def peek(self, needed: np.ndarray) -> int:
        """Misses of an access to `needed` [L, E] without changing the state."""
        return int(np.count_nonzero(needed & ~self.cached))

    def access(self, needed: np.ndarray) -> np.ndarray:
        """One verification needs `needed` [L, E] bool: returns misses per layer [L] and updates the cache."""
        E, C = self.num_experts, self.capacity
        hit = needed & self.cached  # [L, E]
        miss = needed & ~self.cached  # [L, E]
        m = miss.sum(1)  # [L]
        inserted_n = np.minimum(m, C - hit.sum(1))  # the rest find every slot holding a needed expert: streamed
        evict_n = np.maximum(0, inserted_n - (C - self.cached.sum(1)))  # beyond the free slots
        self.freq += needed
        base = np.int64(self.rounds) * 2 * E
        if evict_n.any():
            key = self.stamp if self.policy == "lru" else self.freq * _BIG + self.stamp
            candidate = self.cached & ~needed
            key = np.where(candidate, key, np.iinfo(np.int64).max)
            order = np.argsort(key, axis=1, kind="stable")  # victims first
            rank = np.empty_like(order)
            np.put_along_axis(rank, order, np.broadcast_to(self._ids, order.shape), axis=1)
            self.cached &= ~(candidate & (rank < evict_n[:, None]))
        inserted = miss & (np.cumsum(miss, axis=1) <= inserted_n[:, None])  # misses load in ascending id
        self.cached |= inserted
        # recency as ExpertOffload's OrderedDict: hits move to the end in id order, then the loaded misses
        self.stamp = np.where(hit, base + self._ids, np.where(inserted, base + E + self._ids, self.stamp))
        self.rounds += 1
        return m


def unpack_pairs(packed: np.ndarray, num_layers: int, num_experts: int) -> np.ndarray:
    """A ReplayTables `o_pairs` row (packed bits of the [L, E] pair mask) -> bool [L, E]."""
    bits = np.unpackbits(packed)[: num_layers * num_experts]
    return bits.reshape(num_layers, num_experts).astype(bool)


def pairs_mask(pairs: int, num_layers: int, num_experts: int) -> np.ndarray:
    """An Outcome's `pairs` bitset (env.tables.pairs_int) -> bool [L, E]."""
    nbytes = -(-(num_layers * num_experts) // 8)
    return unpack_pairs(np.frombuffer(pairs.to_bytes(nbytes, "big"), dtype=np.uint8), num_layers, num_experts)


def root_mask(root_ids: np.ndarray, num_experts: int) -> np.ndarray:
    """The root's routing [L, r] -> its (layer, expert) pairs bool [L, E]."""
    L = root_ids.shape[0]
    mask = np.zeros((L, num_experts), dtype=bool)
    mask[np.arange(L)[:, None], root_ids.astype(np.int64)] = True
    return mask


class OffloadCostModel(RooflineCostModel):
    """Roofline of hardware × model spec with host-resident experts and a device cache (module docstring)."""

    stateful = True

    def __init__(
        self, hardware: str, spec: ModelSpec, drafter_spec, cache_fraction: float = 0.25, policy: str = "lru"
    ) -> None:
        super().__init__(hardware, spec, drafter_spec)
        if policy not in POLICIES:
            raise ValueError(f"offload_policy must be one of {POLICIES}, got {policy!r}")
        self.capacity = cache_slots(cache_fraction, spec.num_experts)
        self.policy = policy
        self.miss_seconds = transfer_seconds(spec.expert_bytes, self.hw)  # one expert host -> device
        self.name = f"roofline-offload:{self.hw.name}:{spec.name}:{self.drafter.spec.name}:C{self.capacity}:{policy}"
        self.params = [*self.params, {"capacity": self.capacity, "policy": policy, "miss_seconds": self.miss_seconds}]

    def new_state(self) -> ExpertCacheState:
        """An empty device cache (the start of an episode)."""
        L, E, _ = self.routing_shape
        return ExpertCacheState(L, E, self.capacity, self.policy)

    def transfer(self, misses: int) -> float:
        """Seconds to load `misses` experts over PCIe (exposed: demand loads)."""
        return misses * self.miss_seconds
