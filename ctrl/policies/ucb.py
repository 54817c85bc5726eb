"""UCB bandit over (K, W) arms (BanditSpec, arXiv 2505.15141; UCB1, Auer et al. 2002).

BanditSpec casts the choice of speculation hyperparameters as a multi-armed bandit played once per round
(its UCBSpec is UCB over configurations). Here an arm is a (K, W) pair and the reward of a round is the
utility of the arm played, `utility_last` = R · T_AR / T_spec (so the expert cost of a wide or deep tree
counts, DESIGN.md §1; it needs the engine's T_AR, without which the observation reports 1). Index:

    UCB_i = mean_i + c · sqrt(ln t / n_i)        t = rounds played, n_i = rounds of arm i; c = sqrt(2): UCB1

Every arm is played once first, in the given order; then the largest index wins, ties -> the earlier arm,
so the policy is deterministic. By default the statistics survive `reset()` (the bandit keeps learning
across requests, as an online serving bandit would; only the pending arm is dropped so that no reward is
credited across requests); `reset_per_request=True` starts every request from scratch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ctrl.policies.base import check_bool, check_float, check_int, check_lam, check_width, make_spec
from engine import SpecConfig
from engine.runtime.observation import KMAX, Observation

DEFAULT_ARMS: tuple[tuple[int, int], ...] = ((0, 1), (1, 1), (2, 1), (3, 1), (4, 1), (6, 1), (8, 1), (2, 2), (4, 2))


class UCBPolicy:
    """UCB1 over (K, W) arms with reward utility_last; see the module docstring."""

    shared = True  # state is kept across requests (see the docstring); as_callable does not copy it

    name = "ucb"

    def __init__(
        self,
        arms: Sequence[Sequence[int]] = DEFAULT_ARMS,
        exploration: float = math.sqrt(2.0),
        lam: float = 0.0,
        reset_per_request: bool = False,
    ) -> None:
        if isinstance(arms, (str, bytes)) or not isinstance(arms, Sequence) or len(arms) == 0:
            raise ValueError(f"arms must be a non-empty sequence of (K, W) pairs, got {arms!r}")
        parsed: list[tuple[int, int]] = []
        for i, arm in enumerate(arms):
            if isinstance(arm, (str, bytes)) or not isinstance(arm, Sequence) or len(arm) != 2:
                raise ValueError(f"arms[{i}] must be a (K, W) pair, got {arm!r}")
            parsed.append((check_int(f"arms[{i}] K", arm[0], 0, KMAX), check_width(arm[1], f"arms[{i}] W")))
        if len(set(parsed)) != len(parsed):
            raise ValueError(f"arms must be distinct, got {parsed}")
        self.arms = tuple(parsed)
        self.exploration = check_float("exploration", exploration, 0.0)
        self.lam = check_lam(lam)
        self.reset_per_request = check_bool("reset_per_request", reset_per_request)
        self.counts = [0] * len(self.arms)
        self.sums = [0.0] * len(self.arms)
        self._last: int | None = None

    def reset(self) -> None:
        self._last = None
        if self.reset_per_request:
            self.counts = [0] * len(self.arms)
            self.sums = [0.0] * len(self.arms)

    def means(self) -> list[float]:
        return [s / n if n else 0.0 for s, n in zip(self.sums, self.counts)]

    def select(self) -> int:
        """Index of the arm to play next."""
        for i, n in enumerate(self.counts):
            if n == 0:
                return i
        log_t = math.log(sum(self.counts))
        best, best_index = 0, -math.inf
        for i, (s, n) in enumerate(zip(self.sums, self.counts)):
            index = s / n + self.exploration * math.sqrt(log_t / n)
            if index > best_index:
                best, best_index = i, index
        return best

    def act(self, obs: Observation) -> SpecConfig:
        if self._last is not None and obs.round_index > 0:
            reward = obs.utility_last
            if math.isfinite(reward):
                self.counts[self._last] += 1
                self.sums[self._last] += reward
        self._last = self.select()
        k, w = self.arms[self._last]
        return make_spec(k, w, self.lam)
