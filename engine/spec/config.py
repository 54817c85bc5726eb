"""Speculation settings of a request: depth K, width W, expert-cost weight λ, tree selection."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

MAX_DEPTH = 16
MAX_WIDTH = 8
SCORES = ("ecospec", "logp")
VERIFY_RULES = ("all", "threshold", "calibrated", "goodput")


@dataclass(frozen=True)
class SpecConfig:
    """Per-request (or per-round, via a policy) speculation settings.

    depth K: tree depth (0 = no speculation, plain decode). width W: children kept per node.
    lam λ: weight of the predicted marginal expert cost when choosing nodes to verify (0 = path prob).
    max_verify: cap on drafted nodes sent to the target (None = every expanded node).
    frontier: nodes kept per depth (bounded frontier, EAGLE-2 2406.16858); None = W.
    score: λ > 0 node score, "ecospec" P/(ΔC + ε) (2607.12696) or "logp" log P − λ·ΔC.
    drafted_children: with sampling, draw children i.i.d. from the drafter and accept with
      min(1, p/q) (2211.17192 / SpecInfer 2305.09781); False = deterministic top-W children verified by
      target sampling. None = True for chains (W = 1), False for trees.
    verify_rule: how this round's draft decides what is verified, after (K, W, λ) were chosen:
      "all" every selected node; "threshold" stop drafting below, and verify only, nodes whose draft path
      probability is >= verify_threshold (EAGLE-2 2406.16858, DISCO-style stop 2405.04304); "calibrated" grow
      tree(K, W) as "all" does, stop at the first depth none of whose nodes has a calibrated path probability
      >= verify_threshold, and verify only the nodes that have (`acceptance`, an
      engine.drafting.acceptance.AcceptanceModel: Π P(accepted | depth, draft probability, agreement with the
      prompt-lookup continuation); the Engine attaches its own when None); "goodput" verify
      the most probable prefix-closed set of m nodes maximising (1 + Σ path prob) / verify_costs[m]
      (EVICT 2605.00342), verify_costs[m] = T_verify(m + 1 tokens) / T_AR for m = 0..len-1.
    """

    depth: int = 4
    width: int = 2
    lam: float = 0.0
    max_verify: int | None = None
    frontier: int | None = None
    score: str = "ecospec"
    drafted_children: bool | None = None
    verify_rule: str = "all"
    verify_threshold: float = 0.0
    verify_costs: tuple[float, ...] | None = None
    acceptance: Any = field(default=None, compare=False, repr=False)  # "calibrated": the AcceptanceModel

    def __post_init__(self) -> None:
        if not isinstance(self.depth, int) or not 0 <= self.depth <= MAX_DEPTH:
            raise ValueError(f"SpecConfig.depth (K) must be an int in 0..{MAX_DEPTH}, got {self.depth!r}")
        if not isinstance(self.width, int) or not 1 <= self.width <= MAX_WIDTH:
            raise ValueError(f"SpecConfig.width (W) must be an int in 1..{MAX_WIDTH}, got {self.width!r}")
        if not isinstance(self.lam, (int, float)) or not math.isfinite(self.lam) or self.lam < 0:
            raise ValueError(f"SpecConfig.lam (λ) must be a finite number >= 0, got {self.lam!r}")
        if self.max_verify is not None and (not isinstance(self.max_verify, int) or self.max_verify < 1):
            raise ValueError(f"SpecConfig.max_verify must be None or an int >= 1, got {self.max_verify!r}")
        if self.frontier is not None and (not isinstance(self.frontier, int) or self.frontier < 1):
            raise ValueError(f"SpecConfig.frontier must be None or an int >= 1, got {self.frontier!r}")
        if self.score not in SCORES:
            raise ValueError(f"SpecConfig.score must be one of {SCORES}, got {self.score!r}")
        if self.verify_rule not in VERIFY_RULES:
            raise ValueError(f"SpecConfig.verify_rule must be one of {VERIFY_RULES}, got {self.verify_rule!r}")
        t = self.verify_threshold
        if not isinstance(t, (int, float)) or not 0.0 <= t <= 1.0:
            raise ValueError(f"SpecConfig.verify_threshold must be a probability in [0, 1], got {t!r}")
        if self.verify_rule == "goodput":
            c = self.verify_costs
            if not c or any(not isinstance(x, (int, float)) or not x > 0 for x in c):
                raise ValueError("SpecConfig(verify_rule='goodput') needs verify_costs: positive T(m+1)/T_AR, m=0..")

    @property
    def use_drafted_children(self) -> bool:
        return self.width == 1 if self.drafted_children is None else self.drafted_children


NO_SPEC = SpecConfig(depth=0, width=1)
