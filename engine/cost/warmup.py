"""The warm-up surcharge of a request's first rounds after its prefill, a part of the measured cost.

On the CPUs we measured, the first rounds after a prompt's prefill run slower than the same rounds later in the
request, whatever they run: a target-only step, a K = 0 round with its probe and choice, a tree's verification
(AMD EPYC, prompt-lookup traces: +400–600 µs in round 0, +150–300 µs in round 1, tapering to ~0 by round 12, against
~210 µs steady single-token rounds; after a 4-token prompt the curve is flat). A price by position × action cannot see
it: a policy that commits one token per round early pays it on more tokens than one that commits several. So the
measured cost adds it per round by the round's index in its request (0 = the first round after the prefill):

    warmup(i) = seconds[i]   for i < R (= len(seconds)),   0 from round R on

— the same for every kind of round (measured within the spread of the per-kind estimates; README, Results). It is
fitted from the timed live rounds (env.host_calibration): each round's seconds minus the median of the steady rounds
(index >= STEADY_FROM) of the same run (engine and action) with the same verified-token count, over all requests;
the median of those residuals per round index, made non-increasing (pool adjacent violators) and >= 0. Target-only
decoding pays it too: its round i is position i (T_AR, env.tables). The mechanism is not established (cache state,
or the core's clock after the prefill's larger GEMMs); the roofline has no such term.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

STEADY_FROM = 16  # rounds from this index on are steady (the surcharge measured ~0 from ~12 on)
MIN_SAMPLES = 3  # a group's steady reference, and a round index's residuals, need at least this many rounds


@dataclass(frozen=True)
class WarmupCost:
    """Seconds added to a request's round i for i < len(seconds) (module docstring); empty: none."""

    seconds: tuple[float, ...] = ()

    def at(self, round_index: int) -> float:
        """The surcharge of a request's round `round_index` (0-based, after its prefill)."""
        return self.seconds[round_index] if 0 <= round_index < len(self.seconds) else 0.0

    def padded(self) -> np.ndarray:
        """[R + 1] seconds of rounds 0..R−1, then 0 (round R and later): what the DPs index with min(i, R)."""
        return np.asarray([*self.seconds, 0.0], dtype=np.float64)


def fit_warmup_cost(
    run: Sequence[int],
    round_index: Sequence[int],
    verified: Sequence[int],
    seconds: Sequence[float],
    steady_from: int = STEADY_FROM,
) -> WarmupCost:
    """Fit WarmupCost to timed live rounds [S]: `run` identifies the engine and action a round ran with (the same id
    across requests), `round_index` its index in its request, `verified` its verified tokens, `seconds` its whole
    wall time (drafting, forward, host work, probe and choice). Empty where no run has a steady reference."""
    run_a, idx, n = (np.asarray(x, dtype=np.int64) for x in (run, round_index, verified))
    y = np.asarray(seconds, dtype=np.float64)
    if not (len(run_a) == len(idx) == len(n) == len(y)):
        raise ValueError(f"run, round_index, verified and seconds differ in length "
                         f"({len(run_a)}, {len(idx)}, {len(n)}, {len(y)})")  # fmt: skip
    if steady_from < 1:
        raise ValueError(f"steady_from must be >= 1, got {steady_from}")
    residual = np.full(len(y), np.nan)
    steady = idx >= steady_from
    for key in set(zip(run_a.tolist(), n.tolist())):
        group = (run_a == key[0]) & (n == key[1])
        ref = group & steady
        if ref.sum() >= MIN_SAMPLES:
            early = group & ~steady
            residual[early] = y[early] - np.median(y[ref])
    est, weight = [], []
    for i in range(steady_from):
        r = residual[(idx == i) & ~np.isnan(residual)]
        est.append(float(np.median(r)) if len(r) >= MIN_SAMPLES else 0.0)
        weight.append(float(len(r)) if len(r) >= MIN_SAMPLES else 0.0)
    if not any(weight):
        return WarmupCost()
    out = np.maximum(non_increasing(np.asarray(est), np.asarray(weight)), 0.0)
    while len(out) and out[-1] <= 0.0:
        out = out[:-1]
    return WarmupCost(tuple(float(x) for x in out))


def non_increasing(y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The weighted least-squares non-increasing fit of y [n] (pool adjacent violators); weight-0 entries follow
    their predecessor (no data at that index)."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for v, wt in zip(y.tolist(), w.tolist()):
        blocks.append([v if wt > 0 else (blocks[-1][0] if blocks else v), wt, 1])
        while len(blocks) > 1 and blocks[-2][0] < blocks[-1][0]:
            m2, w2, c2 = blocks.pop()
            m1, w1, c1 = blocks[-1]
            total = w1 + w2
            blocks[-1] = [(m1 * w1 + m2 * w2) / total if total > 0 else max(m1, m2), total, c1 + c2]
    return np.concatenate([np.full(c, m) for m, _, c in blocks])
