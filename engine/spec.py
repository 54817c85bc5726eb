"""Speculation settings of a request: depth K, width W, expert-cost weight λ, tree selection."""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_DEPTH = 16
MAX_WIDTH = 8
SCORES = ("ecospec", "logp")


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
    """

    depth: int = 4
    width: int = 2
    lam: float = 0.0
    max_verify: int | None = None
    frontier: int | None = None
    score: str = "ecospec"
    drafted_children: bool | None = None

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

    @property
    def use_drafted_children(self) -> bool:
        return self.width == 1 if self.drafted_children is None else self.drafted_children


NO_SPEC = SpecConfig(depth=0, width=1)
