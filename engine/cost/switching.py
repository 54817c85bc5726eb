"""The switching surcharge: a round that runs a different kind of forward than the round before it, a part of the
measured cost.

On the CPU we measured (AMD EPYC, the zoo target, prompt-lookup and EAGLE traces) a round costs more when the round
before it was of the other kind — a verification (more than one token in the forward) after a single-token round
(K = 0, or a draft cut to its root), or a single-token round after a verification — than the same round after one of
its own kind: in place, the first tree after single-token rounds paid +30 µs of host work (packing, the tree's mask,
acceptance, the round's record) and +5–15 µs of forward, and the first single-token round after a tree +20 µs of
forward and +10 µs of host work, against ~220 µs single-token rounds (README, Results, session m). The code paths
and data the other kind of round uses have gone cold. A price by position × action cannot see it, and it falls on a
policy that alternates between plain decoding and speculation, which is what a learned controller does. So the
measured cost adds, by the kind of the round before:

    switch(previous, this) = to_verify   a verification after a single-token round
                             to_single   a single-token round after a verification
                             0           otherwise, and for a request's first round (after its prefill: the
                                         warm-up surcharge, engine.cost.warmup, prices that one)

Fitted from the timed live rounds (env.host_calibration; their stand-in runs of static prompt-lookup or thresholded
actions switch whenever the draft is cut to its root): each steady round (index >= STEADY_FROM) whose predecessor
was of the other kind, minus the median of the same run's steady rounds with the same verified-token count after a
round of their own kind; the median of those residuals per direction, >= 0, and 0 where fewer than MIN_SWITCHES
rounds switched. Target-only decoding never switches; the roofline has no such term.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine.cost.warmup import MIN_SAMPLES, STEADY_FROM

MIN_SWITCHES = 8  # switching rounds a direction needs before it is fitted

NONE, SINGLE, VERIFY = 0, 1, 2  # the kind of the previous round: none (the request's first round), one token, more


@dataclass(frozen=True)
class SwitchCost:
    """Seconds added to a round by the kind of the round before it (module docstring); zeros: none."""

    to_verify: float = 0.0
    to_single: float = 0.0

    @property
    def any(self) -> bool:
        return self.to_verify > 0.0 or self.to_single > 0.0

    def at(self, previous: int, verifying: bool) -> float:
        """The surcharge of a round that verifies (`verifying`: more than one token in its forward) or not, after a
        round of kind `previous` (NONE, SINGLE or VERIFY)."""
        if previous == SINGLE and verifying:
            return self.to_verify
        if previous == VERIFY and not verifying:
            return self.to_single
        return 0.0

    def table(self) -> np.ndarray:
        """[3, 2] the surcharge by (previous kind NONE / SINGLE / VERIFY, this round verifies 0 / 1)."""
        return np.array([[0.0, 0.0], [0.0, self.to_verify], [self.to_single, 0.0]])


def kind_of(verified_tokens: int) -> int:
    """SINGLE or VERIFY: the kind of a round with `verified_tokens` tokens in its forward (the next round's
    `previous`)."""
    return VERIFY if verified_tokens > 1 else SINGLE


def kinds(verified: np.ndarray) -> np.ndarray:
    """`kind_of` of every entry of `verified` [S] (verified tokens per round) -> [S] SINGLE / VERIFY."""
    return np.where(np.asarray(verified) > 1, VERIFY, SINGLE)


def previous_kinds(run: np.ndarray, round_index: np.ndarray, verified: np.ndarray) -> np.ndarray:
    """[S] the kind of each timed live round's predecessor in its request (NONE for a first round or where the
    round before is not the previous row: the rows of one run of one request are consecutive, env.host_calibration)."""
    prev = np.full(len(run), NONE, dtype=np.int64)
    follows = (round_index[1:] == round_index[:-1] + 1) & (run[1:] == run[:-1])
    prev[1:][follows] = kinds(verified[:-1][follows])
    return prev


def fit_switch_cost(
    run: Sequence[int],
    round_index: Sequence[int],
    verified: Sequence[int],
    seconds: Sequence[float],
    steady_from: int = STEADY_FROM,
) -> SwitchCost:
    """Fit SwitchCost to timed live rounds [S] in recording order: `run` the engine and action a round ran with,
    `round_index` its index in its request, `verified` its verified tokens, `seconds` its whole wall time."""
    run_a, idx, n = (np.asarray(x, dtype=np.int64) for x in (run, round_index, verified))
    y = np.asarray(seconds, dtype=np.float64)
    if not (len(run_a) == len(idx) == len(n) == len(y)):
        raise ValueError(f"run, round_index, verified and seconds differ in length "
                         f"({len(run_a)}, {len(idx)}, {len(n)}, {len(y)})")  # fmt: skip
    prev, this = previous_kinds(run_a, idx, n), kinds(n)
    usable = (idx >= steady_from) & (prev != NONE)
    residual = np.full(len(y), np.nan)
    for key in set(zip(run_a[usable].tolist(), n[usable].tolist())):
        group = usable & (run_a == key[0]) & (n == key[1])
        ref = group & (prev == this)
        if ref.sum() >= MIN_SAMPLES:
            switched = group & (prev != this)
            residual[switched] = y[switched] - np.median(y[ref])
    out = []
    for kind in (VERIFY, SINGLE):
        r = residual[(this == kind) & ~np.isnan(residual)]
        out.append(max(float(np.median(r)), 0.0) if len(r) >= MIN_SWITCHES else 0.0)
    return SwitchCost(to_verify=out[0], to_single=out[1])


def switched_rounds(run: Sequence[int], round_index: Sequence[int], verified: Sequence[int]) -> np.ndarray:
    """[S] bool: the timed live rounds whose predecessor was of the other kind (left out of the other live fits while
    a switching surcharge prices them)."""
    n = np.asarray(verified, dtype=np.int64)
    prev = previous_kinds(np.asarray(run, dtype=np.int64), np.asarray(round_index, dtype=np.int64), n)
    return (prev != NONE) & (prev != kinds(n))
