"""Confidence-based stopping of drafting: DISCO (arXiv 2405.04304) / SpecDec++ (arXiv 2405.19715) style.

Both papers draft until a predicted acceptance probability says the next token is not worth proposing:
DISCO with a classifier over draft features and a tuned threshold, SpecDec++ stopping once the predicted
probability that at least one drafted token is rejected exceeds h, i.e. once Π_i p_accept(i) < 1 - h.
Here the engine applies the stop inside the round: drafting stops below, and only nodes are verified whose
estimated path acceptance is >= `threshold` (EAGLE-2 2406.16858 style). The estimate is the drafter's own path
probability (`rule="threshold"`; SpecDec++'s rule with h = 1 - threshold) or, in place of DISCO's classifier
over draft features, the engine's calibrated acceptance model (`rule="calibrated"`: draft probability × depth ×
agreement with the prompt-lookup continuation, engine.drafting.acceptance). The evaluation tunes the rule and
threshold on the training prompts. K is only a cap (default KMAX) and W the tree width (default 1, a chain as
in both papers).

Optional adaptation (`adapt=True`; our addition, in neither paper): a stochastic-approximation step moves
the threshold so that the share of rounds whose whole drafted path is accepted approaches
`target_acceptance` (default: the initial threshold, i.e. "path probabilities are calibrated"):

    threshold <- clip(threshold + step · (target_acceptance - 1[accepted_last == depth_last]), lo, hi)

applied after every round that drafted. An overconfident drafter (full paths accepted less often than
predicted) so gets a higher threshold and shallower drafts, an underconfident one a lower threshold.
The threshold returns to its initial value on `reset()` unless `keep_across_requests=True`.
"""

from __future__ import annotations

from ctrl.policies.base import check_bool, check_float, check_int, check_lam, check_width, make_spec
from engine import SpecConfig
from engine.runtime.observation import KMAX, Observation


class ConfidencePolicy:
    """Draft while the path probability stays >= threshold (DISCO 2405.04304 / SpecDec++ 2405.19715)."""

    name = "disco"

    def __init__(
        self,
        threshold: float = 0.3,
        depth: int = KMAX,
        width: int = 1,
        lam: float = 0.0,
        adapt: bool = False,
        target_acceptance: float | None = None,
        step: float = 0.05,
        min_threshold: float = 0.01,
        max_threshold: float = 0.99,
        keep_across_requests: bool = False,
        rule: str = "threshold",
    ) -> None:
        if rule not in ("threshold", "calibrated"):
            raise ValueError(f"disco: rule must be 'threshold' or 'calibrated', got {rule!r}")
        self.rule = rule
        self.depth = check_int("depth K", depth, 1, KMAX)
        self.width = check_width(width)
        self.lam = check_lam(lam)
        self.adapt = check_bool("adapt", adapt)
        self.min_threshold = check_float("min_threshold", min_threshold, 0.0, 1.0)
        self.max_threshold = check_float("max_threshold", max_threshold, self.min_threshold, 1.0)
        self.initial_threshold = check_float(
            f"threshold (in [min_threshold, max_threshold] = [{self.min_threshold}, {self.max_threshold}])",
            threshold,
            self.min_threshold,
            self.max_threshold,
        )
        if target_acceptance is None:
            target_acceptance = self.initial_threshold
        self.target_acceptance = check_float("target_acceptance", target_acceptance, 0.0, 1.0)
        self.step = check_float("step", step, 0.0, 1.0)
        self.keep_across_requests = check_bool("keep_across_requests", keep_across_requests)
        self.threshold = self.initial_threshold
        self._pending = False

    def reset(self) -> None:
        self._pending = False
        if not self.keep_across_requests:
            self.threshold = self.initial_threshold

    def act(self, obs: Observation) -> SpecConfig:
        if self.adapt and self._pending and obs.round_index > 0 and obs.depth_last > 0:
            full = 1.0 if obs.accepted_last >= obs.depth_last else 0.0
            t = self.threshold + self.step * (self.target_acceptance - full)
            self.threshold = min(max(t, self.min_threshold), self.max_threshold)
        self._pending = True
        return make_spec(
            self.depth, self.width, self.lam, verify_rule=self.rule, verify_threshold=float(self.threshold)
        )
