"""Closed-form speculation formulas: expected committed tokens, utility, the uniform-routing footprint.

- E[committed | n verified, per-depth acceptance α] = (1 − α^n)/(1 − α) (Leviathan et al. 2211.17192);
- utility U(n) = E[committed | n] · T_AR / T(n) (Cascade 2506.20675): U > 1 means speculation saved time;
- uniform independent routing touches M·[1 − (1 − r/M)^t] experts for t tokens (M experts, top-r).
"""

from __future__ import annotations

from collections.abc import Sequence


def expected_committed(n: int, alpha: float) -> float:
    """E[committed] of a chain of n − 1 drafts with per-depth acceptance α: (1 − α^n)/(1 − α)."""
    return float(n) if alpha >= 1.0 else (1.0 - alpha**n) / (1.0 - alpha)


def utilities(ratio: Sequence[float], alpha: float, draft_cost: float = 0.0) -> list[float]:
    """U(n) = E[committed | n] / (T(n)/T_AR + draft_cost·(n − 1)) for n = 1..len(ratio); ratio[0] = 1."""
    return [expected_committed(n, alpha) / (r + draft_cost * (n - 1)) for n, r in enumerate(ratio, start=1)]


def utility_threshold(ratio: Sequence[float], alpha: float, draft_cost: float = 0.0) -> int:
    """Largest n with U(n) > 1 (1 when no speculation pays). ratio[i] = T(i + 1)/T_AR."""
    ok = [n for n, u in enumerate(utilities(ratio, alpha, draft_cost), start=1) if n > 1 and u > 1.0 + 1e-12]
    return max(ok) if ok else 1


def expected_distinct_experts(num_experts: int, top_r: int, num_tokens: float) -> float:
    """Distinct experts t independent uniformly routed tokens touch: M·[1 − (1 − r/M)^t]."""
    return num_experts * (1.0 - (1.0 - top_r / num_experts) ** num_tokens)
