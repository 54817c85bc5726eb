"""The cost-model interface the environments price rounds with, and the resident roofline.

Both environments price a round from the same few numbers, so under a deterministic cost model
they agree exactly (replay == live):

    n               verified tokens (root + verified nodes)
    distinct_total  Σ_l U_l, distinct (layer, expert) pairs of the verification (of the priced model's routing)
    context_len     tokens already in the KV cache (committed tokens before the round, minus the root)
    drafted_depth   depth the drafter grew: min(K, remaining - 1), 0 when nothing is drafted
    width, expert_aware   the action's W and whether λ > 0 ran the expert predictor
    counts, routing tokens per expert [L, E] where an expert may turn compute-bound (`needs_counts`); the
                    verified nodes' routing ids [n, L, r] for models that price which experts (`needs_routing`)

`CostModel` is the interface (T_spec = T_draft + T_verify + T_book, and T_AR); `RooflineCostModel` the
"roofline" kind: engine.cost.roofline's per-layer roofline for a hardware profile × model spec (conf/hardware,
conf/model_spec; "target" = the recorded target's own shape), the drafter priced by a drafter spec
(conf/drafter_spec: "<model spec>_eagle3" or "_mtp"; engine.cost.drafter_cost). Verify cost equals
RooflineCost.forward_cost(routing, context_len).total (no EP layout); every routed expert of a decode-sized
forward is memory-bound, so only Σ_l U_l matters unless some expert could receive more than `hbm·flops`
tokens, where the per-expert token counts are used. T_AR = the root alone (r experts per layer), T_book = 0 (the
fitted kind measures it).
The other kinds (env.costs.make_cost_model) build on it: fitted (env.costs), roofline-offload
(env.cost_offload), roofline-ep (env.cost_ep).

Shape letters: L=MoE layers E=experts r=top-r n=verified tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import numpy as np

from engine.cost.drafter_cost import DrafterRoofline, DrafterSpec, load_drafter_spec
from engine.cost.roofline import LAUNCHES_PER_FORWARD, LAUNCHES_PER_LAYER, ModelSpec, load_hardware
from engine.cost.switching import SwitchCost
from engine.cost.warmup import WarmupCost

NO_WARMUP = WarmupCost()
NO_SWITCH = SwitchCost()

LOOKUP_SPEC = "prompt_lookup"  # conf/drafter_spec of the model-free n-gram drafter, whatever the priced model


@dataclass(frozen=True)
class RoundCost:
    """Seconds of one round under a cost model; `ar` = T_AR, one target-only step at the same context."""

    draft: float
    verify: float
    book: float
    ar: float
    choice: float = 0.0  # a learned controller's choice before the round (CostModel.choice), where it is priced
    warmup: float = 0.0  # the surcharge of a request's first rounds after its prefill (CostModel.warmup)
    switch: float = 0.0  # the surcharge of a round of the other kind than the one before (CostModel.switch)

    @property
    def total(self) -> float:
        return self.draft + self.verify + self.book + self.choice + self.warmup + self.switch


class CostModel:
    """Prices rounds; subclasses implement verify / ar / draft. `routing_shape` = (L, E, r) of the priced model."""

    name: str = "cost"
    routing_shape: tuple[int, int, int]
    deterministic: bool = True
    stateful: bool = False  # True: a round's cost also depends on the episode's history (roofline-offload)
    needs_routing: bool = False  # True: verify / ar need the verified nodes' routing ids [n, L, r] (roofline-ep)

    def needs_counts(self, n: int) -> bool:
        """True when `verify` needs the per-expert token counts (not only Σ_l U_l) for n tokens."""
        return False

    def verify(
        self,
        n: int,
        distinct_total: int,
        context_len: int,
        counts: np.ndarray | None = None,
        routing: np.ndarray | None = None,
    ) -> float:
        raise NotImplementedError

    def ar(self, context_len: int, routing: np.ndarray | None = None) -> float:
        """T_AR at `context_len`; `routing` [1, L, r]: the root's own routing (used where it matters: roofline-ep)."""
        L, _, r = self.routing_shape
        counts = np.ones((L, r), dtype=np.int64) if self.needs_counts(1) else None
        return self.verify(1, L * r, context_len, counts) + self.book_ar()

    def draft(self, drafted_depth: int, width: int, expert_aware: bool, context_len: int, rule: str = "all") -> float:
        """T_draft of `drafted_depth` drafter forwards at width W; `rule` (env.costs.draft_rule): what scores the
        nodes as they grow, which only a measured cost prices (the fitted kind)."""
        raise NotImplementedError

    def book_ar(self) -> float:
        """The host work of a target-only engine's step, a part of T_AR (0 unless measured: the fitted kind)."""
        return 0.0

    def probe(self, context_len: int, depth: int, width: int) -> float:
        """A drafter's probe of a depth × width tree before the choice (Session.probe; what a round that then drafts
        nothing still pays): the price of drafting that tree (the fitted kind: the timed probes' fit)."""
        return self.draft(depth, width, False, context_len) if depth > 0 else 0.0

    def context_probe(self, context_len: int) -> float:
        """The context probe a policy runs before the choice when the drafter has no probe (the prompt lookup over
        the request's tokens on the host, engine.runtime.context_probe): priced as the prompt lookup's drafting round
        (conf/drafter_spec/prompt_lookup: its host seconds); the fitted kind: its timed probes' fit."""
        return _lookup_host_seconds()

    def choice(self) -> float:
        """A learned controller's choice before a round (the frozen policy in the engine's session: observation values,
        calibration, actor, action check; host work while the device waits): CHOICE_HOST_SECONDS; the fitted kind:
        its timings in place (env.host_calibration). What env.replay and env.live add to each round of a policy
        priced with its choice (their `choice=True`)."""
        return CHOICE_HOST_SECONDS

    def book(self, n: int) -> float:
        """T_book: the engine's host work of a round verifying n tokens (0 unless measured: the fitted kind)."""
        return 0.0

    def warmup_cost(self) -> WarmupCost:
        """The warm-up surcharge of a request's first rounds after its prefill (engine.cost.warmup): none unless
        measured (the fitted kind). Every round pays `warmup(round index)`, target-only decoding's too (its round i is
        position i: the T_AR of env.tables); env.replay, env.live and the DPs of env.oracle add it."""
        return NO_WARMUP

    def warmup(self, round_index: int) -> float:
        """`warmup_cost().at(round_index)`: seconds added to a request's round `round_index` (0 = the first)."""
        return self.warmup_cost().at(round_index)

    def switch_cost(self) -> SwitchCost:
        """The switching surcharge of a round whose kind (verifying or single-token) differs from the round before it
        (engine.cost.switching): none unless measured (the fitted kind). env.replay, env.live and the DPs of env.oracle
        add it; target-only decoding never switches."""
        return NO_SWITCH

    def switch(self, previous: int, verifying: bool) -> float:
        """`switch_cost().at(previous, verifying)` (previous: engine.cost.switching.NONE / SINGLE / VERIFY)."""
        return self.switch_cost().at(previous, verifying)

    def price(
        self,
        n: int,
        distinct_total: int,
        context_len: int,
        drafted_depth: int,
        width: int,
        expert_aware: bool,
        counts: np.ndarray | None = None,
        rule: str = "all",
    ) -> RoundCost:
        return RoundCost(
            draft=self.draft(drafted_depth, width, expert_aware, context_len, rule) if drafted_depth > 0 else 0.0,
            verify=self.verify(n, distinct_total, context_len, counts),
            book=self.book(n),
            ar=self.ar(context_len),
        )

    def verify_costs(self, max_nodes: int, context_len: int = 256) -> tuple[float, ...]:
        """(T_verify + T_book)(m + 1) / T_AR for m = 0..max_nodes under uniform independent routing (the goodput
        rule's profile; fixed per environment so live and replay select alike)."""
        L, E, r = self.routing_shape
        ar = self.ar(context_len)
        out = []
        for m in range(max_nodes + 1):
            n = m + 1
            distinct = L * E * (1.0 - (1.0 - r / E) ** n)
            verify = self.verify(
                n, int(round(distinct)), context_len, None if not self.needs_counts(n) else _uniform_counts(L, E, r, n)
            )
            out.append((verify + self.book(n)) / ar)
        return tuple(float(x) for x in out)


# a learned controller's choice on the host of a modelled machine: priced as the prompt lookup's host work (10 µs);
# measured in place on 2 CPU cores (`python -m engine.bench mode=policy`): 6–7 µs with the lookup, 9–33 µs with the
# EAGLE head (README, Controllers)
CHOICE_HOST_SECONDS = 1.0e-5


@functools.cache
def _lookup_host_seconds() -> float:
    return float(load_drafter_spec(LOOKUP_SPEC).host_seconds)


def _uniform_counts(L: int, E: int, r: int, n: int) -> np.ndarray:
    active = max(1, int(round(E * (1.0 - (1.0 - r / E) ** n))))
    counts = np.zeros((L, E), dtype=np.int64)
    counts[:, :active] = -(-(n * r) // active)
    return counts


class RooflineCostModel(CostModel):
    """Roofline target (engine.cost.roofline, no EP layout) + roofline drafter (module docstring)."""

    def __init__(self, hardware: str, spec: ModelSpec, drafter_spec: str | DrafterSpec) -> None:
        self.hw = load_hardware(hardware)
        self.spec = spec
        if isinstance(drafter_spec, str):
            drafter_spec = load_drafter_spec(drafter_spec)
        self.drafter = DrafterRoofline(self.hw, drafter_spec)
        self.name = f"roofline:{self.hw.name}:{spec.name}:{self.drafter.spec.name}"
        self.params = [dataclasses.asdict(self.hw), dataclasses.asdict(spec), dataclasses.asdict(drafter_spec)]
        self.routing_shape = (spec.num_moe_layers, spec.num_experts, spec.top_r)
        hw, s = self.hw, spec
        self.peak = hw.peak_flops_fp8 if s.compute_dtype == "fp8" else hw.peak_flops_bf16
        self._expert_mem = s.expert_bytes / hw.hbm_bandwidth
        self._expert_flops_per_token = 6.0 * s.hidden_size * s.expert_dim / self.peak
        # an expert with t tokens is memory-bound iff t * flops_per_token <= mem
        self._membound_tokens = math.floor(self._expert_mem / self._expert_flops_per_token)

    def _roof(self, nbytes: float, flops: float) -> float:
        return max(nbytes / self.hw.hbm_bandwidth, flops / self.peak)

    def needs_counts(self, n: int) -> bool:
        return n > self._membound_tokens

    def verify(
        self,
        n: int,
        distinct_total: int,
        context_len: int,
        counts: np.ndarray | None = None,
        routing: np.ndarray | None = None,
    ) -> float:
        s, hw = self.spec, self.hw
        launch = LAUNCHES_PER_LAYER * hw.launch_overhead
        attn = self._roof(
            s.attn_params * s.dense_weight_bytes + (context_len + n) * s.kv_bytes,
            s.attention_flops(n, context_len),  # MLA-aware (engine.cost.roofline.ModelSpec)
        )
        dense_ffn = self._roof(
            3 * s.hidden_size * s.dense_ffn_dim * s.dense_weight_bytes, 6.0 * n * s.hidden_size * s.dense_ffn_dim
        )
        router = self._roof(
            s.hidden_size * s.num_experts * s.dense_weight_bytes, 2.0 * n * s.hidden_size * s.num_experts
        )
        shared = 0.0
        if n > 0 and s.num_shared_experts:
            params = 3 * s.hidden_size * s.shared_expert_dim * s.num_shared_experts
            shared = self._roof(params * s.dense_weight_bytes, 2.0 * n * params)
        if self.needs_counts(n):
            if counts is None:
                raise ValueError(f"{self.name}: {n} verified tokens can make an expert compute-bound; pass counts")
            t = np.asarray(counts, dtype=np.float64)
            t = t[t > 0]
            experts = float(np.maximum(self._expert_mem, self._expert_flops_per_token * t).sum())
        else:
            experts = distinct_total * self._expert_mem
        lm_head = self._roof(
            s.vocab_size * s.hidden_size * s.dense_weight_bytes, 2.0 * n * s.vocab_size * s.hidden_size
        )
        return (
            s.num_dense_layers * (attn + dense_ffn + launch)
            + s.num_moe_layers * (attn + router + shared + launch)
            + experts
            + lm_head
            + LAUNCHES_PER_FORWARD * hw.launch_overhead
        )

    def draft(self, drafted_depth: int, width: int, expert_aware: bool, context_len: int, rule: str = "all") -> float:
        return self.drafter.round_cost(drafted_depth, width, context_len, expert_aware)
