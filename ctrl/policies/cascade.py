"""Cascade: utility-driven test-and-set choice of K (Saxena et al., arXiv 2506.20675, MICRO 2025).

Speculation utility, measured per request:

    U = ETR / (t_spec / t_base)

ETR = tokens committed per round (accepted + 1), t_spec = round time at K > 0, t_base = round time at K = 0,
measured by this policy in its own K = 0 rounds. U is the speed-up over target-only decoding
(TPOT_spec = TPOT_base / U): U < 1 means speculation slows the request down, so K = 0 is a real choice.

One request, in rounds:

    | base |---- test: <= 4 trials x 4 rounds ----|------ set: 16 rounds at the best K ------|-- test --|- set -| ...
      K=0     K=1      K=2      K=3                                      (a set at K=0 lasts 16, 32, 64, ... rounds)

Sources. We could read the paper's abstract (arxiv.org/html/2506.20675v1) and a detailed public summary of
its method section (uni042/llm-paper-summary, papers/inference/05-speculative-decoding-moe/
2025-2506.20675-cascade.md), not the full text; no public code of the authors was found (vLLM PR #44520
claims a "Cascade" but uses a modelled cost 1 + αk, not measured utility, so we did not follow it).
[P] = rule stated by the paper (as summarised), [C] = our choice where the text available is silent.

    branch                                   rule
    base phase: K = 0 for `base_rounds`      [P] t_base from K = 0 rounds at the start of each request
                                             [C] `base_rounds` = 2 ("a few iterations")
    t_base refresh                           [P] refreshed about every 100 rounds (`base_refresh`)
                                             [C] a refresh runs at the end of a set phase once >= base_refresh
                                                 rounds passed since the last K = 0 round; every K = 0 round
                                                 (also in a K = 0 set phase) is a t_base sample; t_base = mean
                                                 of the last `base_rounds` samples
    trial utility                            [P] U = ETR / (t_spec / t_base) over a trial's t = 4 rounds
                                             [C] ratio of sums: Σ committed · t_base / Σ T_spec
    first trial's K                          [P] the non-zero K with the highest utility measured so far in
                                                 this request; [C] K = 1 (`k_init`) before any measurement,
                                                 "highest" uses the latest measurement of each K, ties -> smaller K
    next trial's K (hill climbing)           [P] keep the direction of the last K change while U rises
                                             [C] first step: up if U >= 1 else down (K = 0 has U = 1 by
                                                 definition, so this is the same hill-climbing rule)
    early stop 1: within 10 %                [P] |U_k - U_prev| <= 10 % (`tolerance`) of U_prev between
                                                 consecutive trials
    early stop 2: passed a local maximum     [P] U fell against the previous trial
    early stop 3: K reached 0                [P] the next K would be 0 (e.g. U < 1 at K = 1: even the smallest
                                                 speculation loses)
    other stops                              [P] at most M = 4 trials (`max_trials`); [C] the next K would
                                                 exceed `k_max`
    set phase K                              [P] the best K observed; [C] K = 0 (U = 1) is always a candidate,
                                                 so a test where every trial had U < 1 sets K = 0; ties -> smaller K
    set phase length                         [P] S = 16 rounds, doubled on each switch to K = 0 (exponential
                                                 back-off of the costly tests): the j-th consecutive K = 0 set
                                                 phase lasts 16·2^j (the first 16, as in the paper's U < 1 at
                                                 K = 1 example); [C] back to 16 once a test picks K > 0
    what resets with reset()                 [P] everything: Cascade decides per request

Without cost information (T_spec <= 0, or no K = 0 sample and no T_AR) U falls back to ETR ([C]); with no
K = 0 sample yet, the observation's T_AR (`cost_ar`) stands in for t_base ([C]).
"""

from __future__ import annotations

from collections import deque

from ctrl.policies.base import check_float, check_int, check_lam, check_width, make_spec
from engine import SpecConfig
from engine.runtime.observation import KMAX, Observation


class CascadePolicy:
    """Cascade's test-and-set controller (2506.20675); see the module docstring for each rule's source.

    Inspect `phase` ("base" | "test" | "set"), `depth`, `t_base`, `trials` [(K, U)] of the current test,
    `stop_reason` of the last test and `blocks` [(phase, K, rounds)] started in this request.
    """

    name = "cascade"

    def __init__(
        self,
        width: int = 1,
        lam: float = 0.0,
        k_init: int = 1,
        k_max: int = KMAX,
        base_rounds: int = 2,
        base_refresh: int = 100,
        trial_rounds: int = 4,
        max_trials: int = 4,
        set_rounds: int = 16,
        tolerance: float = 0.10,
    ) -> None:
        self.width = check_width(width)
        self.lam = check_lam(lam)
        self.k_max = check_int("k_max", k_max, 1, KMAX)
        self.k_init = check_int("k_init", k_init, 1, self.k_max)
        self.base_rounds = check_int("base_rounds", base_rounds, 1)
        self.base_refresh = check_int("base_refresh", base_refresh, 1)
        self.trial_rounds = check_int("trial_rounds", trial_rounds, 1)
        self.max_trials = check_int("max_trials", max_trials, 1)
        self.set_rounds = check_int("set_rounds", set_rounds, 1)
        self.tolerance = check_float("tolerance", tolerance, 0.0, 1.0)
        self.reset()

    # ------------------------------------------------------------------ interface
    def reset(self) -> None:
        self.t_base = 0.0
        self._base_samples: deque[float] = deque(maxlen=self.base_rounds)
        self._since_base = 0  # rounds since the last K = 0 round
        self.history: dict[int, float] = {}  # latest measured U per K
        self.trials: list[tuple[int, float]] = []
        self.stop_reason: str | None = None
        self.zero_streak = 0  # consecutive set phases at K = 0
        self.blocks: list[tuple[str, int, int]] = []
        self._pending = False
        self._start("base", 0, self.base_rounds)

    def act(self, obs: Observation) -> SpecConfig:
        if self._pending and obs.round_index > 0:
            self._record(obs)
            if self._done >= self._length:
                self._advance(obs)
        self._pending = True
        return make_spec(self.depth, self.width, self.lam)

    # ------------------------------------------------------------------ bookkeeping
    def _start(self, phase: str, depth: int, length: int) -> None:
        self.phase, self.depth, self._length, self._done = phase, depth, length, 0
        self._sum_committed, self._sum_cost = 0.0, 0.0
        self.blocks.append((phase, depth, length))

    def _record(self, obs: Observation) -> None:
        """Add the outcome of the round this policy issued last (a round of the current block)."""
        self._done += 1
        self._sum_committed += obs.committed_last
        self._sum_cost += max(obs.cost_last, 0.0)
        if self.depth == 0:
            if obs.cost_last > 0:
                self._base_samples.append(obs.cost_last)
                self.t_base = sum(self._base_samples) / len(self._base_samples)
            self._since_base = 0
        else:
            self._since_base += 1

    def _utility(self, obs: Observation) -> float:
        """U = ETR / (t_spec / t_base) of the block that just ended."""
        n = max(self._done, 1)
        etr, t_spec = self._sum_committed / n, self._sum_cost / n
        t_base = self.t_base if self.t_base > 0 else obs.cost_ar
        if t_spec <= 0 or t_base <= 0:
            return etr
        return etr * t_base / t_spec

    def _advance(self, obs: Observation) -> None:
        if self.phase == "test":
            self._end_trial(obs)
        elif self.phase == "set" and self._since_base >= self.base_refresh:
            self._start("base", 0, self.base_rounds)  # periodic t_base refresh
        else:  # base measured, or set phase over: test again
            self._start_test()

    # ------------------------------------------------------------------ test-and-set
    def _start_test(self) -> None:
        measured = {k: u for k, u in self.history.items() if k > 0}
        k = min(measured, key=lambda k: (-measured[k], k)) if measured else self.k_init
        self.trials = []
        self._start("test", min(k, self.k_max), self.trial_rounds)

    def _end_trial(self, obs: Observation) -> None:
        k, u = self.depth, self._utility(obs)
        self.history[k] = u
        self.trials.append((k, u))
        reason = None
        if len(self.trials) == 1:
            step = 1 if u >= 1.0 else -1  # against K = 0, whose utility is 1 by definition
        else:
            k_prev, u_prev = self.trials[-2]
            step = 1 if k > k_prev else -1
            if abs(u - u_prev) <= self.tolerance * u_prev:
                reason = "within tolerance"
            elif u < u_prev:
                reason = "passed local maximum"
        if reason is None:
            if k + step == 0:
                reason = "reached K=0"
            elif k + step > self.k_max:
                reason = "reached k_max"
            elif len(self.trials) >= self.max_trials:
                reason = "max trials"
        if reason is None:
            self._start("test", k + step, self.trial_rounds)
            return
        self.stop_reason = reason
        best_k, _ = max([(0, 1.0), *self.trials], key=lambda t: (t[1], -t[0]))
        if best_k == 0:
            length = self.set_rounds * 2**self.zero_streak
            self.zero_streak += 1
        else:
            length = self.set_rounds
            self.zero_streak = 0
        self._start("set", best_k, length)
