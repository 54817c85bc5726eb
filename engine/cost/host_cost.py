"""The engine's host work per round, T_book of DESIGN §3, fitted to timed live rounds.

A round's host work is its wall time minus the actions' choice, the drafting and the target's forward
(`RoundStats.host_seconds`): packing the tree, acceptance, KV commit and rollback, the drafter's state update
(an EAGLE head keeps the target's features of every committed token, even at K = 0), the session's bookkeeping.
On a small target it is comparable to a verification, so a measured cost model that leaves it out overstates
every speed-up (`python -m ctrl.wallclock` measured 15–25 % with the prompt-lookup drafter). Fitted here:

    book(1) = single                          a round of a speculating engine that verifies the root alone (K = 0,
                                              or nothing drafted): the engine's plain path, drafter state kept
    book(n) = per_round + per_node·(n − 2)    one verifying n >= 2 tokens (tree verification, KV commit of the
                                              accepted nodes, rollback of the rest)
    plain                                     a step of a target-only engine (no drafter): a part of T_AR

— two regimes, as the target's own forward has (engine.cost.fitted.DecodeVerifyCost): with the prompt-lookup
drafter on the zoo target a root-only round took ~100 µs of host work and a two-token one ~250 µs —
fitted by least squares with every constant >= 0 (engine.cost.fitted.nonnegative_lstsq). Least squares fits the mean,
and the mean is what a request's total time accumulates, occasional slow rounds included. book(1) and plain, the
one-token rounds of both engines, keep their pooled mean but differ by the difference of their medians: a timing spike
in one engine's rounds (one 12 ms step among 768 adds 16 µs to a mean) is the machine's, not that engine's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine.cost.fitted import identifiable_columns, nonnegative_lstsq


@dataclass(frozen=True)
class HostCost:
    """Seconds of host work: `book(n)` per speculating-engine round, `plain` per target-only step."""

    single: float
    per_round: float
    per_node: float
    plain: float

    def book(self, n: int) -> float:
        """Host seconds of a round verifying n tokens (root + verified draft nodes)."""
        return self.single if n <= 1 else self.per_round + self.per_node * (int(n) - 2)


def fit_host_cost(verified: Sequence[int], seconds: Sequence[float], plain: Sequence[bool]) -> HostCost:
    """Fit HostCost to timed rounds: verified [S] tokens per round, seconds [S] of host work, plain [S] True for a
    target-only engine's step. Needs target-only and speculating rounds; a regime without samples takes the
    other's constant (no n >= 2 round: the root-only one), and with one n >= 2 only, per_node is held at 0."""
    n = np.asarray(verified, dtype=np.float64)
    y = np.asarray(seconds, dtype=np.float64)
    is_plain = np.asarray(plain, dtype=bool)
    if not (len(n) == len(y) == len(is_plain)):
        raise ValueError(f"verified, seconds and plain differ in length ({len(n)}, {len(y)}, {len(is_plain)})")
    if not np.all(np.isfinite(y)) or (y < 0).any():
        raise ValueError("host seconds must be finite and >= 0")
    if not is_plain.any() or is_plain.all():
        raise ValueError(
            f"fitting the host work needs rounds of a target-only engine and of a speculating one, got "
            f"{int(is_plain.sum())} and {int((~is_plain).sum())}"
        )
    root_only, tree = ~is_plain & (n <= 1), ~is_plain & (n >= 2)
    if tree.any():
        X = np.stack([np.ones(int(tree.sum())), n[tree] - 2.0], axis=1)  # [S, 2]
        c = nonnegative_lstsq(X, y[tree], identifiable_columns(X))
        per_round, per_node = c.get(0, 0.0), c.get(1, 0.0)
    single, plain = (_one_token(y, root_only, is_plain) if root_only.any() else
                     (per_round, float(y[is_plain].mean())))  # fmt: skip
    if not tree.any():
        per_round, per_node = single, 0.0
    return HostCost(single=single, per_round=per_round, per_node=per_node, plain=plain)


def _one_token(y: np.ndarray, single: np.ndarray, plain: np.ndarray) -> tuple[float, float]:
    """(book(1), plain) of the one-token rounds of both engines (masks `single`, `plain` over seconds `y`): apart by
    the difference of their medians, so a timing spike in one engine's rounds does not make that engine dearer, and
    together at the pooled mean, so the spikes are charged to both alike (as the one single-token forward fit,
    engine.cost.fitted.fit_cost_model_robust)."""
    med_single, med_plain = float(np.median(y[single])), float(np.median(y[plain]))
    pooled = single | plain
    excess = float(y[pooled].mean() - np.where(plain[pooled], med_plain, med_single).mean())
    return max(med_single + excess, 0.0), max(med_plain + excess, 0.0)


@dataclass(frozen=True)
class ProbeCost:
    """Seconds of a drafter's probe before a choice (NGramDrafter.probe: a suffix scan of the context), linear in the
    context length."""

    fixed: float
    per_token: float

    def seconds(self, context_len: int) -> float:
        return self.fixed + self.per_token * max(int(context_len), 0)


def fit_probe_cost(context: Sequence[int], seconds: Sequence[float]) -> ProbeCost | None:
    """Fit ProbeCost to timed probes (context [S] tokens, seconds [S]; constants >= 0); None without any."""
    x = np.asarray(context, dtype=np.float64)
    y = np.asarray(seconds, dtype=np.float64)
    if len(x) != len(y):
        raise ValueError(f"context and seconds differ in length ({len(x)}, {len(y)})")
    if not len(y):
        return None
    if not np.all(np.isfinite(y)) or (y < 0).any():
        raise ValueError("probe seconds must be finite and >= 0")
    X = np.stack([np.ones(len(x)), x], axis=1)  # [S, 2]
    c = nonnegative_lstsq(X, y, identifiable_columns(X))
    return ProbeCost(fixed=c.get(0, 0.0), per_token=c.get(1, 0.0))
