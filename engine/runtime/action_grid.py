"""The discrete action grid shared by the environments, the learned policies and the frozen-policy loader.

An action index vector (k, w, l, v) -> SpecConfig(depth=depths[k], width=widths[w], lam=lams[l],
verify rule rules[v]). The verification rules read this round's draft (EAGLE-2 2406.16858 / EVICT
2605.00342 / DISCO 2405.04304): ("all", 0.0) verifies every drafted node, ("threshold", t) stops drafting
below and verifies only nodes of path probability >= t, ("calibrated", t) the same with the calibrated path
probability of engine.drafting.acceptance (the acceptance model travels beside the grid: Engine(acceptance=),
ReplayEnv(acceptance=), a frozen policy's card). The grid is stored with every trace and frozen
policy, so all three agree on what an index means.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from engine.spec.config import SpecConfig


@dataclass(frozen=True)
class ActionGrid:
    depths: tuple[int, ...] = (0, 1, 2, 3, 4, 5, 6, 7, 8)
    widths: tuple[int, ...] = (1, 2, 3)
    lams: tuple[float, ...] = (0.0,)
    rules: tuple[tuple[str, float], ...] = (("all", 0.0), ("threshold", 0.1), ("threshold", 0.3))
    frontier: int | None = None  # bounded frontier per depth (None = W, EAGLE-2)

    def __post_init__(self) -> None:
        for name in ("depths", "widths", "lams", "rules"):
            if not getattr(self, name):
                raise ValueError(f"ActionGrid.{name} must not be empty")
        for d in self.depths:
            SpecConfig(depth=d, width=1)  # validates the range
        for w in self.widths:
            SpecConfig(depth=1, width=w)
        for rule, t in self.rules:
            SpecConfig(depth=1, width=1, verify_rule=rule, verify_threshold=t)
        if any(rule == "goodput" for rule, _ in self.rules):
            raise ValueError("the goodput rule needs a cost curve per round: use it from a policy, not the grid")

    @property
    def nvec(self) -> list[int]:
        """MultiDiscrete sizes [K, W, λ, rule]."""
        return [len(self.depths), len(self.widths), len(self.lams), len(self.rules)]

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    @property
    def needs_acceptance(self) -> bool:
        """True when a rule of the grid is "calibrated" (its users must be given the AcceptanceModel)."""
        return any(rule == "calibrated" for rule, _ in self.rules)

    def check(self, index: Sequence[int]) -> tuple[int, int, int, int]:
        """A valid index vector as ints, or a ValueError naming the bad entry and the space."""
        try:
            idx = [int(i) for i in index]
        except (TypeError, ValueError) as err:
            raise ValueError(f"action {index!r} is not a vector of 4 integers (K, W, λ, rule indices)") from err
        if len(idx) != 4 or any(float(a) != float(b) for a, b in zip(idx, index)):
            raise ValueError(f"action {index!r} must be 4 integer indices (K, W, λ, rule) into {self.nvec}")
        for name, i, n in zip(("K", "W", "λ", "rule"), idx, self.nvec):
            if not 0 <= i < n:
                raise ValueError(f"action {list(index)!r}: {name} index {i} outside 0..{n - 1} (space {self.nvec})")
        return tuple(idx)  # type: ignore[return-value]

    def spec(self, index: Sequence[int]) -> SpecConfig:
        k, w, l, v = self.check(index)
        rule, t = self.rules[v]
        return SpecConfig(
            depth=self.depths[k],
            width=self.widths[w],
            lam=float(self.lams[l]),
            frontier=self.frontier,
            verify_rule=rule,
            verify_threshold=float(t),
        )

    def index(self, spec: SpecConfig) -> tuple[int, int, int, int]:
        """Inverse of `spec` for a SpecConfig on the grid (ValueError otherwise)."""
        try:
            return (
                self.depths.index(spec.depth),
                self.widths.index(spec.width),
                self.lams.index(spec.lam),
                self.rules.index((spec.verify_rule, float(spec.verify_threshold))),
            )
        except ValueError as err:
            raise ValueError(f"{spec} is not on the action grid {self.to_dict()}") from err

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["rules"] = [list(r) for r in self.rules]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ActionGrid:
        return cls(
            depths=tuple(int(x) for x in d["depths"]),
            widths=tuple(int(x) for x in d["widths"]),
            lams=tuple(float(x) for x in d["lams"]),
            rules=tuple((str(r), float(t)) for r, t in d["rules"]),
            frontier=d.get("frontier"),
        )
