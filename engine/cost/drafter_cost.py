"""Cost of drafting one round: a roofline for a drafter spec, and a least-squares fit to measured drafting.

    from engine.cost.drafter_cost import DrafterRoofline, load_drafter_spec
    drafter = DrafterRoofline(load_hardware("h100"), load_drafter_spec("qwen3_30b_a3b_eagle3"))
    t_draft = drafter.round_cost(depth=4, width=2, context_len=512)

T_spec = T_draft + T_verify + T_book (DESIGN §3): the target fit (engine.cost.fitted) leaves the drafter
out, and on GPUs a feature-head drafter is one decoder layer plus an LM head that dominates at 150k
vocabularies, so it is priced here. Drafter specs live in conf/drafter_spec/*.yaml (an EAGLE-3-style head
and an MTP layer per model spec).

Forwards of one drafting round of depth K, width W (bounded frontier: W nodes per depth, as
engine.drafting.tree_growth grows them): the root step (the committed tokens' catch-up; priced as one
token, since a drafter step reads its weights once whatever the handful of tokens) and K - 1 expansions
of the W frontier nodes; an expert-aware round (λ > 0 with a predictor) runs one more layer step over
the W never-expanded leaves for their features. K = 0 drafts nothing and costs 0. Per forward of t tokens:

    fusion    = max(fusion_inputs·D² bytes / HBM, 2 t fusion_inputs D² / peak)
    attention = max((attention weights + KV of context + new tokens) / HBM, projections + scores / peak)
    ffn       = max(3 D F bytes / HBM, 6 t D F / peak)
    lm_head   = max(V_draft D bytes / HBM, 2 t V_draft D / peak)
    launches  = (LAUNCHES_PER_LAYER · layers + LAUNCHES_PER_FORWARD) · launch_overhead

Shape letters: t=tokens of one drafter forward K=depth W=width D=hidden F=FFN dim V=vocab.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.cost.fitted import identifiable_columns, nonnegative_lstsq
from engine.cost.roofline import LAUNCHES_PER_FORWARD, LAUNCHES_PER_LAYER, HardwareProfile, _load_yaml_dataclass

DRAFTER_KINDS = ("eagle3", "mtp", "dense", "lookup")


@dataclass(frozen=True)
class DrafterSpec:
    """Shape of a drafter, enough to price its forwards.

    kind: "eagle3" (fusion of 3 target features, q/k/v over [embedding; feature] = 2D inputs, a reduced
    draft vocabulary) or "mtp" (DeepSeek-V3 multi-token prediction module: 2D -> D projection, the full
    shared LM head) or "dense" (a small independent model: no fusion) or "lookup" (prompt lookup / n-gram,
    engine.drafting.ngram: no device forward at all, `host_seconds` of host work per drafting round; the
    shape fields are unused). `intermediate_size` is the FFN read per step (an MoE MTP layer: its active
    experts' width).
    """

    name: str
    kind: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    lm_head_vocab: int
    fusion_inputs: int = 0
    attention_input_mult: int = 1
    weight_bytes: float = 2.0
    activation_bytes: float = 2.0
    compute_dtype: str = "bf16"
    attention_params: int | None = None  # per layer; default: GQA q/k/v/o over attention_input_mult·D inputs
    host_seconds: float = 0.0  # kind "lookup": host time of one drafting round (no device forward)
    notes: str = ""

    def __post_init__(self) -> None:
        if self.kind not in DRAFTER_KINDS:
            raise ValueError(f"{self.name}: kind must be one of {DRAFTER_KINDS}, got {self.kind!r}")
        if self.host_seconds < 0:
            raise ValueError(f"{self.name}: host_seconds must be >= 0, got {self.host_seconds}")
        if self.kind == "lookup":
            return
        if self.compute_dtype not in ("bf16", "fp8"):
            raise ValueError(f"{self.name}: compute_dtype must be 'bf16' or 'fp8', got {self.compute_dtype!r}")
        if min(self.num_layers, self.hidden_size, self.num_attention_heads, self.head_dim, self.lm_head_vocab) < 1:
            raise ValueError(f"{self.name}: layers, hidden size, heads, head_dim and vocabulary must be >= 1")


def load_drafter_spec(name_or_path: str) -> DrafterSpec:
    """A spec from conf/drafter_spec/<name>.yaml or a YAML path; ValueError names missing fields or the
    available specs."""
    return _load_yaml_dataclass(DrafterSpec, "drafter_spec", name_or_path)


def drafter_spec_from_hf_config(
    config: Mapping[str, Any], kind: str = "dense", name: str = "hf", weight_bytes: float = 2.0
) -> DrafterSpec:
    """DrafterSpec of a Hugging Face `config.json`: kind "dense", the model itself (a small independent drafter);
    kind "eagle3", a one-layer EAGLE-style head at that (target) model's size over its full vocabulary (the zoo
    heads: two fused features)."""
    heads = config["num_attention_heads"]
    hidden = config["hidden_size"]
    head = kind == "eagle3"
    return DrafterSpec(
        name=name,
        kind=kind,
        num_layers=1 if head else config["num_hidden_layers"],
        hidden_size=hidden,
        intermediate_size=config.get("intermediate_size") or 4 * hidden,
        num_attention_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or hidden // heads,
        lm_head_vocab=config["vocab_size"],
        fusion_inputs=2 if head else 0,
        weight_bytes=weight_bytes,
        activation_bytes=weight_bytes,
    )


DRAFT_RULES = ("all", "threshold", "calibrated")  # how a round's drafting is priced: what its nodes are scored by


def draft_forward_sizes(depth: int, width: int, expert_aware: bool = False) -> list[int]:
    """Tokens of each drafter forward of one round (module docstring): [1, W, ..., W (K - 1 times)] (+ [W])."""
    if depth <= 0:
        return []
    return [1] + [width] * (depth - 1) + ([width] if expert_aware else [])


class DrafterRoofline:
    """Prices drafter forwards on one hardware profile (module docstring)."""

    def __init__(self, hw: HardwareProfile, spec: DrafterSpec) -> None:
        self.hw, self.spec = hw, spec
        self.peak = hw.peak_flops_fp8 if spec.compute_dtype == "fp8" else hw.peak_flops_bf16

    def _roof(self, nbytes: float, flops: float) -> float:
        return max(nbytes / self.hw.hbm_bandwidth, flops / self.peak)

    def forward_cost(self, num_tokens: int, context_len: int, lm_head: bool = True) -> float:
        """Seconds of one drafter forward over `num_tokens` new tokens after `context_len` cached ones."""
        s, t = self.spec, float(num_tokens)
        D, wb = s.hidden_size, s.weight_bytes
        attn_params = s.attention_params
        if attn_params is None:
            q_o = (s.attention_input_mult + 1) * D * s.num_attention_heads * s.head_dim
            attn_params = q_o + 2 * s.attention_input_mult * D * s.num_kv_heads * s.head_dim
        kv_bytes = 2 * s.num_kv_heads * s.head_dim * s.activation_bytes
        total = 0.0
        if s.fusion_inputs:
            fusion = s.fusion_inputs * D * D
            total += self._roof(fusion * wb, 2.0 * t * fusion)
        for _ in range(s.num_layers):
            total += self._roof(
                attn_params * wb + (context_len + t) * kv_bytes,
                2.0 * t * attn_params + 4.0 * s.num_attention_heads * s.head_dim * t * (context_len + t),
            )
            total += self._roof(3 * D * s.intermediate_size * wb, 6.0 * t * D * s.intermediate_size)
        if lm_head:
            total += self._roof(s.lm_head_vocab * D * wb, 2.0 * t * s.lm_head_vocab * D)
        launches = LAUNCHES_PER_LAYER * s.num_layers + (LAUNCHES_PER_FORWARD if lm_head else 0)
        return total + launches * self.hw.launch_overhead

    def round_cost(self, depth: int, width: int, context_len: int, expert_aware: bool = False) -> float:
        """T_draft of one round drafting to `depth` with `width` (0 for depth 0)."""
        if self.spec.kind == "lookup":
            return self.spec.host_seconds if depth > 0 else 0.0
        sizes = draft_forward_sizes(depth, width, expert_aware)
        leaves = len(sizes) - 1 if expert_aware else None  # the leaves' feature step needs no LM head
        return sum(self.forward_cost(t, context_len + i, lm_head=(i != leaves)) for i, t in enumerate(sizes))


@dataclass(frozen=True)
class FittedDrafterCost:
    """Measured drafting seconds ≈ fixed + per_forward · forwards + per_token · tokens
    + [rule = threshold] (threshold_fixed + threshold_per_token · tokens)
    + [rule = calibrated] (calibrated_fixed + calibrated_per_token · tokens) (0 for depth 0).

    forwards and tokens count `draft_forward_sizes(depth, width)` (the catch-up row included); `rule` (DRAFT_RULES):
    the verification rule scores every node as the tree grows (threshold: its draft probability; calibrated: the
    acceptance model over the committed context's suffix index), which can cost a model-free drafter's round more
    than its lookup (measured 2.4× for the threshold rule with the prompt lookup on this CPU)."""

    fixed: float
    per_forward: float
    per_token: float
    threshold_fixed: float = 0.0
    threshold_per_token: float = 0.0
    calibrated_fixed: float = 0.0
    calibrated_per_token: float = 0.0

    def round_cost(
        self, depth: int, width: int, context_len: int = 0, expert_aware: bool = False, rule: str = "all"
    ) -> float:
        sizes = draft_forward_sizes(depth, width, expert_aware)
        if not sizes:
            return 0.0
        tokens = sum(sizes)
        extra = 0.0
        if rule == "threshold":
            extra = self.threshold_fixed + self.threshold_per_token * tokens
        elif rule == "calibrated":
            extra = self.calibrated_fixed + self.calibrated_per_token * tokens
        return self.fixed + self.per_forward * len(sizes) + self.per_token * tokens + extra


def fit_drafter_cost(samples: Sequence[tuple]) -> FittedDrafterCost:
    """Least squares of FittedDrafterCost to (depth >= 1, width, expert_aware, seconds[, rule]) samples (rule one
    of DRAFT_RULES, default "all"); constants the samples cannot identify are held at 0, and every constant is >= 0
    (drafting more never saves time: engine.cost.fitted.nonnegative_lstsq)."""
    rows = []
    for d, w, a, sec, *rest in samples:
        rule = rest[0] if rest else "all"
        if rule not in DRAFT_RULES:
            raise ValueError(f"drafting rule must be one of {DRAFT_RULES}, got {rule!r}")
        if z := draft_forward_sizes(d, w, a):
            t, c = float(rule == "threshold"), float(rule == "calibrated")
            rows.append((1.0, len(z), sum(z), t, t * sum(z), c, c * sum(z), sec))
    if not rows:
        raise ValueError("fit_drafter_cost needs samples with depth >= 1")
    X = np.array([r[:7] for r in rows])
    y = np.array([r[7] for r in rows])
    fitted = nonnegative_lstsq(X, y, identifiable_columns(X))
    return FittedDrafterCost(*(fitted.get(j, 0.0) for j in range(7)))
