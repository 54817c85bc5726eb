"""Round pricing shared by the live and the replay environment: T_spec = T_draft + T_verify + T_book and T_AR.

Both environments price a round from the same few numbers, so under a deterministic cost model
they agree exactly (replay == live):

    n               verified tokens (root + verified nodes)
    distinct_total  Σ_l U_l, distinct (layer, expert) pairs of the verification (of the priced model's routing)
    context_len     tokens already in the KV cache (committed tokens before the round, minus the root)
    drafted_depth   depth the drafter grew: min(K, remaining - 1), 0 when nothing is drafted
    width, expert_aware   the action's W and whether λ > 0 ran the expert predictor

Cost models (`make_cost_model`):

- "roofline": engine.cost.roofline's per-layer roofline for a hardware profile × model spec
  (conf/hardware, conf/model_spec; "target" = the recorded target's own shape), the drafter priced by a
  drafter spec (conf/drafter_spec: "<model spec>_eagle3" or "_mtp"; engine.cost.drafter_cost). Verify
  cost equals RooflineCost.forward_cost(routing, context_len).total (no EP layout); every routed expert
  of a decode-sized forward is memory-bound, so only Σ_l U_l matters unless some expert could receive more
  than `hbm·flops` tokens, where the per-expert token counts are used. T_AR = the root alone (r experts
  per layer), T_book = 0.
- "fitted": the measured cost of this machine: engine.cost.fitted's two-regime linear fit of target
  seconds (fixed + per token + per active expert + per layer·context) plus the drafter's own fitted
  seconds (engine.cost.drafter_cost.FittedDrafterCost), both fitted to a trace's calibration samples.

Routing for a model spec whose (MoE layers, experts, top-r) differ from the recorded target's comes from
`engine.cost.node_router.NodeRouter` (identity-keyed synthetic routing); `routing` says which.

Shape letters: L=MoE layers E=experts r=top-r n=verified tokens.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.cost.drafter_cost import (
    DrafterRoofline,
    DrafterSpec,
    FittedDrafterCost,
    drafter_spec_from_hf_config,
    fit_drafter_cost,
    load_drafter_spec,
)
from engine.cost.fitted import CostSample, DecodeVerifyCost, fit_two_regimes
from engine.cost.roofline import (
    LAUNCHES_PER_FORWARD,
    LAUNCHES_PER_LAYER,
    ModelSpec,
    load_hardware,
    load_model_spec,
    model_spec_from_hf_config,
)

COST_KINDS = ("roofline", "fitted")


@dataclass(frozen=True)
class RoundCost:
    """Seconds of one round under a cost model; `ar` = T_AR, one target-only step at the same context."""

    draft: float
    verify: float
    book: float
    ar: float

    @property
    def total(self) -> float:
        return self.draft + self.verify + self.book


@dataclass(frozen=True)
class CostConf:
    """Which cost model an environment prices rounds with (mirrored by conf/env/*.yaml `cost`)."""

    kind: str = "roofline"  # roofline | fitted
    hardware: str = "h100"  # conf/hardware/<name>.yaml (roofline)
    model_spec: str = "qwen3_30b_a3b"  # conf/model_spec/<name>.yaml, or "target" (the recorded target)
    drafter_spec: str = "auto"  # conf/drafter_spec/<name>.yaml; auto: <model_spec>_eagle3 (or _mtp for MTP heads)
    router_seed: int = 0  # identity-keyed synthetic routing (model spec != target shape)


def drafter_steps(depth_cap: int, built_depth: int, spec: Any) -> int:
    """Drafter forwards a round takes: one per depth grown. Under the threshold rule growth stops at the first
    depth with no node above the threshold (engine.drafting.tree_growth), after built_depth + 1 forwards."""
    if spec.verify_rule == "threshold":
        return min(depth_cap, built_depth + 1)
    return depth_cap


class CostModel:
    """Prices rounds; subclasses implement verify / ar / draft. `routing_shape` = (L, E, r) of the priced model."""

    name: str = "cost"
    routing_shape: tuple[int, int, int]
    deterministic: bool = True

    def needs_counts(self, n: int) -> bool:
        """True when `verify` needs the per-expert token counts (not only Σ_l U_l) for n tokens."""
        return False

    def verify(self, n: int, distinct_total: int, context_len: int, counts: np.ndarray | None = None) -> float:
        raise NotImplementedError

    def ar(self, context_len: int) -> float:
        L, _, r = self.routing_shape
        return self.verify(1, L * r, context_len, np.ones((L, r), dtype=np.int64) if self.needs_counts(1) else None)

    def draft(self, drafted_depth: int, width: int, expert_aware: bool, context_len: int) -> float:
        raise NotImplementedError

    def book(self, n: int) -> float:
        return 0.0

    def price(
        self,
        n: int,
        distinct_total: int,
        context_len: int,
        drafted_depth: int,
        width: int,
        expert_aware: bool,
        counts: np.ndarray | None = None,
    ) -> RoundCost:
        return RoundCost(
            draft=self.draft(drafted_depth, width, expert_aware, context_len) if drafted_depth > 0 else 0.0,
            verify=self.verify(n, distinct_total, context_len, counts),
            book=self.book(n),
            ar=self.ar(context_len),
        )

    def verify_costs(self, max_nodes: int, context_len: int = 256) -> tuple[float, ...]:
        """T_verify(m + 1) / T_AR for m = 0..max_nodes under uniform independent routing (the goodput rule's
        profile; fixed per environment so live and replay select alike)."""
        L, E, r = self.routing_shape
        ar = self.ar(context_len)
        out = []
        for m in range(max_nodes + 1):
            n = m + 1
            distinct = L * E * (1.0 - (1.0 - r / E) ** n)
            out.append(
                self.verify(
                    n,
                    int(round(distinct)),
                    context_len,
                    None if not self.needs_counts(n) else _uniform_counts(L, E, r, n),
                )
                / ar
            )
        return tuple(float(x) for x in out)


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

    def verify(self, n: int, distinct_total: int, context_len: int, counts: np.ndarray | None = None) -> float:
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

    def draft(self, drafted_depth: int, width: int, expert_aware: bool, context_len: int) -> float:
        return self.drafter.round_cost(drafted_depth, width, context_len, expert_aware)


class FittedCostModel(CostModel):
    """Measured cost of this machine: fitted target seconds + fitted drafter seconds (module docstring)."""

    deterministic = True

    def __init__(
        self, target: DecodeVerifyCost, drafter: FittedDrafterCost, routing_shape: tuple[int, int, int]
    ) -> None:
        self.target, self.drafter_fit = target, drafter
        self.routing_shape = routing_shape
        self.name = "fitted"
        self.params = [
            dataclasses.asdict(target.decode),
            dataclasses.asdict(target.verify),
            dataclasses.asdict(drafter),
        ]

    def verify(self, n: int, distinct_total: int, context_len: int, counts: np.ndarray | None = None) -> float:
        m = self.target.decode if n <= 1 else self.target.verify
        L = self.routing_shape[0]
        return m.fixed + m.per_token * n + m.per_active_expert * distinct_total + m.per_layer_context * L * context_len

    def draft(self, drafted_depth: int, width: int, expert_aware: bool, context_len: int) -> float:
        return self.drafter_fit.round_cost(drafted_depth, width, context_len, expert_aware)

    @classmethod
    def from_trace(cls, trace: Any) -> FittedCostModel:
        """Fit both parts to a trace's calibration samples (env.record)."""
        a = trace.arrays
        if len(a["cal_target_seconds"]) < 8 or len(a["cal_draft_seconds"]) < 3:
            raise ValueError(
                f"trace {trace.path} has too few calibration samples for the fitted cost model "
                f"({len(a['cal_target_seconds'])} target, {len(a['cal_draft_seconds'])} drafting): record with "
                "calibrate_every > 0 and more positions, or use cost kind 'roofline'"
            )
        samples = []
        offsets = a["cal_target_offsets"]
        node_offsets = a["node_offsets"]
        cont_offsets = a["cont_offsets"]
        prompt_offsets = a["prompt_offsets"]
        for s, p in enumerate(a["cal_target_position"]):
            nodes = a["cal_target_nodes"][offsets[s] : offsets[s + 1]].astype(np.int64)
            routing = a["node_routing"][node_offsets[p] + nodes]  # [n, L, r]
            req = int(np.searchsorted(cont_offsets, p, side="right") - 1)
            t = int(p - cont_offsets[req])
            context = int(prompt_offsets[req + 1] - prompt_offsets[req]) + t - 1
            samples.append(
                CostSample(
                    [torch.from_numpy(routing[:, l].astype(np.int64)) for l in range(routing.shape[1])],
                    context,
                    float(a["cal_target_seconds"][s]),
                )
            )
        target = fit_two_regimes(samples)
        drafter = fit_drafter_cost(
            list(
                zip(
                    a["cal_draft_depth"].tolist(),
                    a["cal_draft_width"].tolist(),
                    a["cal_draft_aware"].tolist(),
                    a["cal_draft_seconds"].tolist(),
                )
            )
        )
        return cls(target, drafter, (trace.num_moe_layers, trace.num_experts, trace.top_r))


def drafter_spec_name(conf: CostConf, drafter_name: str | None, model_spec: str) -> str:
    if conf.drafter_spec != "auto":
        return conf.drafter_spec
    kind = "mtp" if drafter_name and "mtp" in drafter_name else "eagle3"
    return f"{model_spec}_{kind}"


def make_cost_model(
    conf: CostConf, target_meta: dict[str, Any], drafter_name: str | None = None, trace: Any = None
) -> CostModel:
    """The CostModel of `conf` for a target described by `target_meta` (a trace's meta["target"]).

    Unknown hardware / model / drafter specs raise ValueError before any work; "fitted" needs `trace`."""
    if conf.kind not in COST_KINDS:
        raise ValueError(f"unknown cost kind {conf.kind!r}; use one of {COST_KINDS}")
    if conf.kind == "fitted":
        if trace is None:
            raise ValueError("the fitted cost model is fitted to a trace's calibration samples: pass a trace")
        return FittedCostModel.from_trace(trace)
    if conf.model_spec == "target":
        cfg = json.loads((Path(target_meta["path"]) / "config.json").read_text())
        spec = model_spec_from_hf_config(cfg, name="target")
        head = drafter_spec_from_hf_config(cfg, "eagle3", "target_head")  # a one-layer head at the target's size (zoo)
        drafter = conf.drafter_spec if conf.drafter_spec != "auto" else head
    else:
        spec = load_model_spec(conf.model_spec)
        drafter = drafter_spec_name(conf, drafter_name, conf.model_spec)
    return RooflineCostModel(conf.hardware, spec, drafter)


def uses_recorded_routing(model: CostModel, target_meta: dict[str, Any]) -> bool:
    """True when the priced model has the recorded target's routing shape (its own routing is used)."""
    shape = (int(target_meta["num_moe_layers"]), int(target_meta["num_experts"]), int(target_meta["top_r"]))
    return tuple(model.routing_shape) == shape
