"""Expert offload: experts in host memory, a per-layer device cache of C expert slots, prefetch.

    host memory (pinned)   MoE layer l: experts 0 .. E-1     gate_up [E, 2F, D], down [E, D, F]
            │   PCIe: one expert = 3·D·F·dtype bytes, bytes / pcie_bandwidth + pcie_latency
            ▼
    device cache           MoE layer l: slot 0 .. C-1 -> expert id   (LRU or LFU eviction)

`ExpertOffload(model, C).install()` sets `MoEBlock.expert_fn` on every MoE layer. Each forward of
MoE layer l (l = position in `model.moe_blocks`, the order of `RoutingRecord`):
  1. needed = distinct routed experts of the forward (ascending id); one (layer, expert) pair of
     one forward is one access, so hits + misses = Σ_l U_l, the verification footprint;
  2. hits update recency (LRU) / frequency (LFU); misses are loaded on demand, the victim chosen by
     the policy among cached experts this forward does not need; when every slot holds a needed
     expert the miss is *streamed* (loaded into a staging buffer, used, not cached);
  3. the experts are computed with exactly the model's math (the same kernel dispatch as
     `MoEBlock.forward`), so outputs are bit-identical to the un-offloaded model.
`prefetch(layer, experts)` loads predicted experts ahead of need (from the next round's draft tree,
or from `predictor(l + 1, hidden of layer l)` called by layer l's forward, before its compute).

Modes. "copy" (default on CUDA): the experts really move from pinned host memory into per-layer
device buffers [C, 2F, D] / [C, D, F] on a side stream; expert ids are remapped to slots.
"simulate" (default without CUDA): the weights stay where they are, but cache state, bytes and
modelled times are tracked exactly as if moved. "copy" also runs on CPU tensors (tests).

Timing model (modelled, never measured transfers). One link carries prefetches in issue order;
a prefetch for layer l lands at max(issue, link free) + transfer. When layer l needs its experts:
    exposed_l = max(0, landed_l − now) + Σ demand transfers of layer l
so a prefetch issued at layer l−1 is hidden behind the measured wall clock of the compute between
(layer l−1's experts + layer l's attention): exposed = max(0, transfer − compute of the previous
layer); demand misses are exposed in full. Exposed time is a stall: the modelled timeline is the
measured clock plus every stall so far. Without CUDA the compute clock is the CPU's; on CUDA it is
host time (kernels run asynchronously), so overlap is under-estimated unless the caller synchronises.

SpecMoE (2604.10152) pairs this cache with a self-assisted drafter (engine/self_drafter.py).
`next_router_predictor` applies layer l's router to layer l−1's input (Pre-gated MoE, 2308.12066).

Shape letters: L=MoE layers E=experts C=cache slots per layer T=tokens r=top-r D=hidden F=expert dim.
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F_nn
from torch import nn

from engine.cost.roofline import HardwareProfile, load_hardware
from engine.models.moe import MoEBlock
from engine.models.transformer import Model

POLICIES = ("lru", "lfu")
MODES = ("copy", "simulate")
# (MoE layer to predict, hidden [T, D] entering the previous MoE layer) -> expert ids
Predictor = Callable[[int, torch.Tensor], "Sequence[int] | torch.Tensor"]


@dataclass
class OffloadStats:
    """Expert-offload counters since the last `reset()` (the engine attaches one per round).

    Access unit: one (MoE layer, distinct expert) pair of one forward. Bytes are host -> device.
    Times are modelled from the hardware profile's PCIe link (see the module docstring), except
    `compute_seconds`, the measured wall clock of the offloaded expert compute.
    """

    hits: int = 0
    misses: int = 0  # demand loads, streamed ones included
    streamed: int = 0  # misses with every slot holding a needed expert: loaded, used, not cached
    evictions: int = 0
    bytes_moved: int = 0  # demand + prefetch
    prefetch_loads: int = 0
    prefetch_bytes: int = 0
    prefetch_used: int = 0  # prefetched experts used before eviction
    prefetch_wasted: int = 0  # prefetched experts evicted unused
    wasted_prefetch_bytes: int = 0
    draft_assignments: int = 0  # routed (token, expert) assignments of self-drafter forwards
    draft_substituted: int = 0  # ... of which served by a cached stand-in (engine/self_drafter.py)
    transfer_seconds: float = 0.0  # modelled link time of every load
    exposed_seconds: float = 0.0  # modelled stalls: transfer not hidden behind compute
    compute_seconds: float = 0.0  # measured expert compute of offloaded layers
    layer_forwards: int = 0
    misses_by_layer: list[int] = field(default_factory=list)  # [L]
    exposed_by_layer: list[float] = field(default_factory=list)  # [L]
    # gauges: kept by reset()
    prefetch_pending: int = 0  # prefetched experts still cached and not used yet
    gpu: bool = False
    timing_note: str = ""

    _GAUGES = ("prefetch_pending", "gpu", "timing_note")

    @property
    def hit_rate(self) -> float | None:
        """hits / accesses; None before any access."""
        n = self.hits + self.misses
        return self.hits / n if n else None

    @property
    def prefetch_accuracy(self) -> float | None:
        """used / (used + wasted) over resolved prefetches (pending ones excluded); None if none."""
        n = self.prefetch_used + self.prefetch_wasted
        return self.prefetch_used / n if n else None

    def reset(self) -> None:
        """Zero every counter (per-layer lists keep their length); gauges stay."""
        for f in dataclasses.fields(self):
            if f.name in self._GAUGES:
                continue
            v = getattr(self, f.name)
            setattr(self, f.name, [type(x)() for x in v] if isinstance(v, list) else type(v)())

    def snapshot(self) -> OffloadStats:
        """An independent copy (lists copied)."""
        return dataclasses.replace(
            self, misses_by_layer=list(self.misses_by_layer), exposed_by_layer=list(self.exposed_by_layer)
        )


@dataclass
class LayerAccess:
    """Outcome of one `ExpertOffload.access` (expert ids, ascending within each list)."""

    hits: list[int]
    misses: list[int]
    evicted: list[int]
    streamed: list[int]


def transfer_seconds(num_bytes: float, hardware: HardwareProfile) -> float:
    """Modelled host -> device copy of one transfer: bytes / PCIe bandwidth + PCIe latency."""
    return num_bytes / hardware.pcie_bandwidth + hardware.pcie_latency


def next_router_predictor(model: Model, top_k: int | None = None) -> Predictor:
    """Predictor for `ExpertOffload`: layer l's router applied to the hidden entering layer l−1
    (adjacent hidden states are close; Pre-gated MoE, 2308.12066). Returns the union over tokens of
    each token's top-k (default top-r) experts."""
    blocks = model.moe_blocks

    def predict(layer: int, hidden: torch.Tensor) -> list[int]:
        block = blocks[layer]
        logits = F_nn.linear(hidden, block.gate.weight)  # [T, E]
        return logits.topk(top_k or block.top_r, dim=-1).indices.unique().tolist()

    return predict


class _LayerCache:
    """Cache state of one MoE layer."""

    def __init__(self, capacity: int, num_experts: int) -> None:
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # expert -> slot; first = least recent
        self.free_slots = list(range(capacity - 1, -1, -1))
        self.freq = [0] * num_experts  # forwards that needed the expert (kept across evictions)
        self.unused_prefetch: set[int] = set()
        self.landed_at = 0.0  # modelled time the last prefetch for this layer is on the device
        self.write_event = None  # CUDA: last copy into this layer's buffer
        self.done_event = None  # CUDA: last compute reading this layer's buffer

    def victim(self, policy: str, protected: set[int]) -> int | None:
        """LRU: least recently used; LFU: least frequently used, ties least recently used."""
        candidates = [e for e in self.slot_of if e not in protected]  # recency order
        if not candidates:
            return None
        if policy == "lru":
            return candidates[0]
        return min(candidates, key=lambda e: self.freq[e])  # first minimum = least recent


class _OffloadFn:
    """`MoEBlock.expert_fn` of one MoE layer (see the module docstring, steps 1-3)."""

    def __init__(self, offload: ExpertOffload, layer: int) -> None:
        self.offload, self.layer = offload, layer

    def __call__(
        self,
        x: torch.Tensor,
        w_gate_up: torch.Tensor,
        w_down: torch.Tensor,
        expert_ids: torch.Tensor,
        topk_weights: torch.Tensor,
    ) -> torch.Tensor:
        """x [T, D], w_gate_up [E, 2F, D], w_down [E, D, F], expert_ids / topk_weights [T, r] -> [T, D]."""
        off, layer = self.offload, self.layer
        result = off.access(layer, expert_ids.unique().tolist())
        if off.predictor is not None and layer + 1 < off.num_layers:
            # issued before this layer's compute, so the transfer overlaps it
            off.prefetch(layer + 1, off.predictor(layer + 1, x))
        t0 = off.clock()
        out = off._compute(layer, x, w_gate_up, w_down, expert_ids, topk_weights, result.streamed)
        elapsed = off.clock() - t0
        off.stats.compute_seconds += elapsed
        off.stats.layer_forwards += 1
        return out


class ExpertOffload:
    """Per-layer device cache of `cache_experts_per_layer` experts over host-resident experts.

    model: the target; its MoE blocks get the offload `expert_fn` on `install()`.
    policy: "lru" | "lfu". device: the cache device (default: the model's). mode: "copy" | "simulate"
    (default: "copy" on CUDA, else "simulate"). hardware: a `HardwareProfile` or a profile name
    (default "h100") whose PCIe bandwidth and latency time the transfers. predictor: optional
    `(layer, hidden [T, D]) -> experts` called by MoE layer l−1 to prefetch for layer l.
    clock: seconds, for the overlap model (tests inject a fake one).
    """

    def __init__(
        self,
        model: Model,
        cache_experts_per_layer: int,
        policy: str = "lru",
        device: torch.device | str | None = None,
        hardware: HardwareProfile | str | None = None,
        predictor: Predictor | None = None,
        mode: str | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        blocks = model.moe_blocks
        if not blocks:
            raise ValueError("model has no MoE layer to offload")
        E = blocks[0].num_experts
        C = cache_experts_per_layer
        if isinstance(C, bool) or not isinstance(C, int) or not 1 <= C <= E:
            raise ValueError(f"cache_experts_per_layer must be an int in 1..{E}, got {C!r}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.device = torch.device(device) if device is not None else model.device
        mode = mode or ("copy" if self.device.type == "cuda" else "simulate")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if mode == "copy" and model.device != self.device:
            raise ValueError(f"mode 'copy' needs the model on the cache device {self.device}, it is on {model.device}")
        self.model, self.blocks, self.policy, self.mode = model, blocks, policy, mode
        self.capacity, self.num_experts, self.num_layers = C, E, len(blocks)
        self.hardware = hardware if isinstance(hardware, HardwareProfile) else load_hardware(hardware or "h100")
        self.predictor = predictor
        self.clock = clock
        w = blocks[0].experts.gate_up_proj
        D, F = w.shape[2], w.shape[1] // 2
        self.expert_bytes = 3 * D * F * w.element_size()
        self._transfer = transfer_seconds(self.expert_bytes, self.hardware)
        gpu = self.device.type == "cuda"
        hw = self.hardware
        note = f"timed with {hw.name} PCIe bandwidth ({hw.pcie_bandwidth / 1e9:g} GB/s), "
        if not gpu:
            note += "no GPU present"
        else:
            note += "weights moved over the real link" if mode == "copy" else "transfers simulated on the GPU"
        L = self.num_layers
        self.stats = OffloadStats(misses_by_layer=[0] * L, exposed_by_layer=[0.0] * L, gpu=gpu, timing_note=note)
        self._caches = [_LayerCache(C, E) for _ in blocks]
        self._stall = 0.0  # modelled stalls so far: modelled time = clock() + stall
        self._link_free = 0.0  # modelled time the link finishes its queued prefetches
        self._host: list[tuple[torch.Tensor, torch.Tensor]] = []  # copy mode: [E, 2F, D], [E, D, F]
        self._buffers: list[tuple[torch.Tensor, torch.Tensor]] = []  # copy mode: [C, 2F, D], [C, D, F]
        self._home: list[torch.device] = []
        self._copy_stream = torch.cuda.Stream(self.device) if mode == "copy" and gpu else None
        self.installed = False

    # ------------------------------------------------------------------ install
    def install(self) -> ExpertOffload:
        """Set the offload `expert_fn` on every MoE block ("copy": move the experts to host memory)."""
        if self.installed:
            raise ValueError("ExpertOffload is already installed")
        for i, block in enumerate(self.blocks):
            if block.expert_fn is not None:
                raise ValueError(f"MoE layer {i} already has an expert_fn (EP or a second offload?)")
        for i, block in enumerate(self.blocks):
            if self.mode == "copy":
                self._setup_copy(block)
            block.expert_fn = _OffloadFn(self, i)
        self.installed = True
        return self

    def remove(self) -> None:
        """Restore local expert compute (and the experts on their original device)."""
        for block in self.blocks:
            block.expert_fn = None
        for block, (gu, dn), home in zip(self.blocks, self._host, self._home):
            if gu.device != home:
                block.experts.gate_up_proj = nn.Parameter(gu.to(home), requires_grad=False)
                block.experts.down_proj = nn.Parameter(dn.to(home), requires_grad=False)
        self._host, self._buffers, self._home = [], [], []
        self._caches = [_LayerCache(self.capacity, self.num_experts) for _ in self.blocks]
        self.installed = False

    def __enter__(self) -> ExpertOffload:
        return self if self.installed else self.install()

    def __exit__(self, *exc) -> None:
        self.remove()

    def _setup_copy(self, block: MoEBlock) -> None:
        ex = block.experts
        gu, dn = ex.gate_up_proj.detach(), ex.down_proj.detach()
        self._home.append(gu.device)
        if gu.device.type == "cuda":  # the host copy is the only copy: device memory is freed
            gu, dn = gu.cpu().pin_memory(), dn.cpu().pin_memory()
            ex.gate_up_proj = nn.Parameter(gu, requires_grad=False)
            ex.down_proj = nn.Parameter(dn, requires_grad=False)
        elif self.device.type == "cuda":
            gu, dn = gu.pin_memory(), dn.pin_memory()
        self._host.append((gu, dn))
        C = self.capacity
        self._buffers.append(
            (
                torch.zeros(C, *gu.shape[1:], dtype=gu.dtype, device=self.device),
                torch.zeros(C, *dn.shape[1:], dtype=dn.dtype, device=self.device),
            )
        )

    # ------------------------------------------------------------------ cache state
    def cached_experts(self, layer: int) -> list[int]:
        """Experts of MoE layer `layer` on the device now, ascending."""
        return sorted(self._caches[layer].slot_of)

    def warm(self, experts: Sequence[Sequence[int]] | None = None) -> None:
        """Load `experts[l]` (default: the first C ids) into every layer, then reset the stats."""
        for layer in range(self.num_layers):
            self.access(layer, list(experts[layer]) if experts is not None else list(range(self.capacity)))
        self.stats.reset()
        self._stall = self._link_free = 0.0
        for cache in self._caches:
            cache.landed_at = 0.0

    def _now(self) -> float:
        return self.clock() + self._stall

    def _insert(self, layer: int, expert: int, protected: set[int]) -> tuple[int | None, int | None]:
        """Give `expert` a slot, evicting by policy outside `protected` -> (slot, evicted); slot None
        when every cached expert is protected."""
        cache = self._caches[layer]
        evicted = None
        if cache.free_slots:
            slot = cache.free_slots.pop()
        else:
            evicted = cache.victim(self.policy, protected)
            if evicted is None:
                return None, None
            slot = cache.slot_of.pop(evicted)
            self.stats.evictions += 1
            if evicted in cache.unused_prefetch:
                cache.unused_prefetch.discard(evicted)
                self.stats.prefetch_wasted += 1
                self.stats.wasted_prefetch_bytes += self.expert_bytes
                self.stats.prefetch_pending -= 1
        cache.slot_of[expert] = slot
        if self.mode == "copy":
            self._copy_in(layer, expert, slot)
        return slot, evicted

    def access(self, layer: int, experts: Sequence[int]) -> LayerAccess:
        """One forward of MoE layer `layer` needs `experts` (-1 ignored, duplicates merged): count hits
        and misses, load misses (evicting by policy), model the exposed transfer time."""
        cache, st = self._caches[layer], self.stats
        needed = sorted({int(e) for e in experts if int(e) >= 0})
        now = self._now()
        wait = max(0.0, cache.landed_at - now)  # this layer's prefetches still on the link
        hits = [e for e in needed if e in cache.slot_of]
        misses = [e for e in needed if e not in cache.slot_of]
        for e in hits:
            cache.slot_of.move_to_end(e)
            if e in cache.unused_prefetch:
                cache.unused_prefetch.discard(e)
                st.prefetch_used += 1
                st.prefetch_pending -= 1
        for e in needed:
            cache.freq[e] += 1
        protected = set(needed)
        evicted, streamed = [], []
        for e in misses:
            slot, victim = self._insert(layer, e, protected)
            if slot is None:
                streamed.append(e)
            elif victim is not None:
                evicted.append(victim)
        demand = len(misses) * self._transfer
        st.hits += len(hits)
        st.misses += len(misses)
        st.streamed += len(streamed)
        st.bytes_moved += len(misses) * self.expert_bytes
        st.transfer_seconds += demand
        st.misses_by_layer[layer] += len(misses)
        exposed = wait + demand
        st.exposed_seconds += exposed
        st.exposed_by_layer[layer] += exposed
        self._stall += exposed
        self._link_free = max(self._link_free, now + wait) + demand  # queued prefetches go after
        return LayerAccess(hits=hits, misses=misses, evicted=sorted(evicted), streamed=streamed)

    def prefetch(self, layer: int, experts: Sequence[int] | torch.Tensor) -> list[int]:
        """Load predicted experts of MoE layer `layer` ahead of need (best effort: the first C distinct
        ids; cached ones are left alone) -> the experts actually loaded."""
        if isinstance(experts, torch.Tensor):
            experts = experts.reshape(-1).tolist()
        cache, st = self._caches[layer], self.stats
        want = list(dict.fromkeys(int(e) for e in experts if 0 <= int(e) < self.num_experts))[: self.capacity]
        protected = set(want)
        now = self._now()
        loaded = []
        for e in want:
            if e in cache.slot_of:
                continue
            slot, _ = self._insert(layer, e, protected)
            if slot is None:
                continue
            cache.unused_prefetch.add(e)
            loaded.append(e)
            self._link_free = max(now, self._link_free) + self._transfer
            cache.landed_at = self._link_free
        st.prefetch_loads += len(loaded)
        st.prefetch_pending += len(loaded)
        st.prefetch_bytes += len(loaded) * self.expert_bytes
        st.bytes_moved += len(loaded) * self.expert_bytes
        st.transfer_seconds += len(loaded) * self._transfer
        return loaded

    # ------------------------------------------------------------------ data movement and compute
    def _copy_in(self, layer: int, expert: int, slot: int) -> None:
        """Host expert -> device slot. CUDA: on the copy stream, after the last compute that read the
        layer's buffer; the next compute waits for `write_event`."""
        (host_gu, host_dn), (buf_gu, buf_dn) = self._host[layer], self._buffers[layer]
        cache = self._caches[layer]
        stream = self._copy_stream
        if stream is None:
            buf_gu[slot].copy_(host_gu[expert])
            buf_dn[slot].copy_(host_dn[expert])
            return
        if cache.done_event is not None:
            stream.wait_event(cache.done_event)
        with torch.cuda.stream(stream):
            buf_gu[slot].copy_(host_gu[expert], non_blocking=True)
            buf_dn[slot].copy_(host_dn[expert], non_blocking=True)
            cache.write_event = torch.cuda.Event()
            cache.write_event.record(stream)

    def _buffer_rows(
        self, layer: int, expert_ids: torch.Tensor, extra: Sequence[int] = ()
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The device buffer's row of every assignment and the expert of every row, from one pass over the cache:
        expert_ids [T, r] -> (rows [T, r], -1 stays -1; experts [C + len(extra)], 0 for an empty slot, which no id
        maps to). `extra` experts get rows C, C+1, ... (the staging rows)."""
        table = torch.full((self.num_experts,), -1, dtype=torch.long)
        held = torch.zeros(self.capacity + len(extra), dtype=torch.long)
        for e, s in [*self._caches[layer].slot_of.items(), *((e, self.capacity + j) for j, e in enumerate(extra))]:
            table[e], held[s] = s, e
        table = table.to(expert_ids.device)
        rows = torch.where(expert_ids >= 0, table[expert_ids.clamp(min=0)], expert_ids)
        return rows, held.to(expert_ids.device)

    def _compute(self, layer, x, w_gate_up, w_down, expert_ids, topk_weights, streamed) -> torch.Tensor:
        block = self.blocks[layer]
        if self.mode == "simulate":
            return block.local_experts(x, w_gate_up, w_down, expert_ids, topk_weights)  # the block's own expert math
        return self._run_buffer(layer, block, x, expert_ids, topk_weights, streamed)

    def _run_buffer(self, layer, block, x, expert_ids, topk_weights, streamed=()) -> torch.Tensor:
        """Copy mode: compute from the layer's device buffer once its pending copies have landed;
        `streamed` experts are staged in rows C, C+1, ... of a temporary buffer."""
        cache = self._caches[layer]
        cuda = self._copy_stream is not None
        if cuda and cache.write_event is not None:
            torch.cuda.current_stream(self.device).wait_event(cache.write_event)
        buf_gu, buf_dn = self._buffers[layer]
        if streamed:
            host_gu, host_dn = self._host[layer]
            idx = torch.tensor(list(streamed))
            buf_gu = torch.cat([buf_gu, host_gu[idx].to(self.device)])
            buf_dn = torch.cat([buf_dn, host_dn[idx].to(self.device)])
        ids, held = self._buffer_rows(layer, expert_ids, streamed)  # held: the expert of each row (gpt_oss's biases)
        out = block.local_experts(x, buf_gu, buf_dn, ids, topk_weights, held)
        if cuda:
            cache.done_event = torch.cuda.Event()
            cache.done_event.record(torch.cuda.current_stream(self.device))
        return out

    def compute_cached(
        self, layer: int, x: torch.Tensor, expert_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """Expert compute with cached experts only, no cache or stats change (self-drafting):
        x [T, D], expert_ids [T, r] (all cached, or -1 = contributes 0) -> [T, D].
        Raises ValueError on an uncached expert: a draft never triggers a load."""
        cache = self._caches[layer]
        used = [e for e in expert_ids.unique().tolist() if e >= 0]
        absent = [e for e in used if e not in cache.slot_of]
        if absent:
            raise ValueError(f"experts {absent} of MoE layer {layer} are not cached")
        block = self.blocks[layer]
        if self.mode == "simulate":
            ex = block.experts
            return block.local_experts(x, ex.gate_up_proj, ex.down_proj, expert_ids, topk_weights)
        return self._run_buffer(layer, block, x, expert_ids, topk_weights)
