"""EVICT-style goodput verification (arXiv 2605.00342): draft a tree, verify only its best-paying prefix.

After drafting, EVICT verifies the k most probable nodes with

    k* = argmax_k  E[A(T_k)] / C(k)        E[A(T_k)] = 1 + Σ_{i<k} p_i   (p_i: i-th largest path probability)

where C(k) is the profiled cost of verifying k drafted nodes plus the root, relative to one target-only step.
Taking nodes in decreasing path probability keeps the set prefix-closed (a child is never more probable
than its parent). The engine applies this rule to each round's draft (`SpecConfig.verify_rule="goodput"`,
`verify_costs[m] = T(m + 1 tokens) / T_AR`); this policy chooses the tree (K, W, frontier, λ) before
drafting and hands the cost curve over. `goodput_prefix` is the same argmax, for tests and analysis.

Depth: by default the deepest tree whose every node the curve prices (EVICT drafts a fixed tree and cuts
it). With `adaptive_depth=True` (our addition, not in EVICT) K is the depth maximising the *predicted*
goodput (1 + Σ_{d<=K} Π_{j<=d} a_j) / C(nodes(K)) from the observation's acceptance-by-depth EMA a_d, plus
`headroom` depths so that a confident draft can still be verified deeper; at least `min_depth`.
"""

from __future__ import annotations

from collections.abc import Sequence

from ctrl.policies.base import check_bool, check_costs, check_int, check_lam, check_width, make_spec
from engine import SpecConfig
from engine.runtime.observation import KMAX, Observation


def goodput_values(path_probs: Sequence[float], verify_costs: Sequence[float]) -> list[float]:
    """(1 + Σ of the m largest path probabilities) / verify_costs[m] for m = 0..min(N, len(costs) - 1)."""
    p = sorted((float(x) for x in path_probs), reverse=True)
    out, expected = [], 1.0
    for m in range(min(len(p), len(verify_costs) - 1) + 1):
        if m > 0:
            expected += p[m - 1]
        out.append(expected / verify_costs[m])
    return out


def goodput_prefix(path_probs: Sequence[float], verify_costs: Sequence[float]) -> int:
    """k*: how many drafted nodes (most probable first) to verify; ties -> fewer nodes (EVICT 2605.00342)."""
    g = goodput_values(path_probs, verify_costs)
    return max(range(len(g)), key=lambda m: (g[m], -m))


def tree_nodes(depth: int, width: int, frontier: int | None = None) -> int:
    """Drafted nodes of a bounded-frontier tree: depth d keeps min(W · nodes(d-1), frontier) nodes."""
    keep = frontier if frontier is not None else width
    total, level = 0, 1
    for _ in range(depth):
        level = min(level * width, keep)
        total += level
    return total


class GoodputPolicy:
    """EVICT-style policy (2605.00342): fixed or predicted tree shape + the engine's goodput verification.

    cost_curve[n-1] = T_verify(n tokens) / T_AR for n = 1..N (n counts the root; cost_curve[0] ~ 1).
    """

    name = "goodput"

    def __init__(
        self,
        cost_curve: Sequence[float],
        depth: int | None = None,
        width: int = 1,
        lam: float = 0.0,
        frontier: int | None = None,
        adaptive_depth: bool = False,
        headroom: int = 1,
        min_depth: int = 1,
    ) -> None:
        self.verify_costs = check_costs("cost_curve", cost_curve)
        if len(self.verify_costs) < 2:
            raise ValueError("cost_curve must price at least the root and one drafted node (>= 2 entries)")
        self.width = check_width(width)
        self.lam = check_lam(lam)
        self.frontier = None if frontier is None else check_int("frontier", frontier, 1)
        self.adaptive_depth = check_bool("adaptive_depth", adaptive_depth)
        self.headroom = check_int("headroom", headroom, 0, KMAX)
        fit = max(d for d in range(KMAX + 1) if tree_nodes(d, self.width, self.frontier) < len(self.verify_costs))
        self.max_depth = fit if depth is None else check_int(f"depth (the curve prices K <= {fit})", depth, 0, fit)
        self.min_depth = check_int("min_depth", min_depth, 0, self.max_depth)

    def reset(self) -> None:
        pass

    def predicted_depth(self, acceptance: Sequence[float]) -> int:
        """argmax_K (1 + Σ_{d<=K} Π_{j<=d} a_j) / C(nodes(K)), K in 0..max_depth; ties -> smaller K."""
        best_k, best_g, expected, path = 0, 1.0 / self.verify_costs[0], 1.0, 1.0
        for k in range(1, self.max_depth + 1):
            path *= min(max(float(acceptance[k - 1]), 0.0), 1.0)
            expected += path
            g = expected / self.verify_costs[tree_nodes(k, self.width, self.frontier)]
            if g > best_g:
                best_k, best_g = k, g
        return best_k

    def act(self, obs: Observation) -> SpecConfig:
        k = self.max_depth
        if self.adaptive_depth:
            k = min(self.max_depth, max(self.min_depth, self.predicted_depth(obs.acceptance_ema) + self.headroom))
        return make_spec(
            k,
            self.width,
            self.lam,
            frontier=self.frontier,
            verify_rule="goodput",
            verify_costs=self.verify_costs,
        )
