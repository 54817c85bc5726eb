"""Static policy: the same (K, W, λ, verification rule) every round — the baseline every table starts from."""

from __future__ import annotations

from collections.abc import Sequence

from ctrl.policies.base import check_costs, make_spec
from engine import SpecConfig
from engine.runtime.observation import Observation


class StaticPolicy:
    """Always returns one SpecConfig, built (and validated) at construction.

    depth K (0 = target-only decoding), width W, lam λ, and the SpecConfig fields of the verification
    rule (verify_rule "all" | "threshold" | "goodput", verify_threshold, verify_costs) and tree selection
    (max_verify, frontier, score) passed through unchanged.
    """

    name = "static"

    def __init__(
        self,
        depth: int = 4,
        width: int = 1,
        lam: float = 0.0,
        max_verify: int | None = None,
        frontier: int | None = None,
        score: str = "ecospec",
        verify_rule: str = "all",
        verify_threshold: float = 0.0,
        verify_costs: Sequence[float] | None = None,
    ) -> None:
        costs = check_costs("verify_costs", verify_costs) if verify_costs is not None else None
        self.spec = make_spec(
            depth,
            width,
            lam,
            max_verify=max_verify,
            frontier=frontier,
            score=score,
            verify_rule=verify_rule,
            verify_threshold=verify_threshold,
            verify_costs=costs,
        )

    def reset(self) -> None:
        pass

    def act(self, obs: Observation) -> SpecConfig:
        return self.spec
