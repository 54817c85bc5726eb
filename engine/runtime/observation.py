"""The one observation function: a request's `RoundStats` history -> what a policy sees.

The engine owns its telemetry, so the live environment, the replay environment and a policy deployed
in the engine all call `observe` and can never compute the observation differently (DESIGN.md §3).
It reads only RoundStats fields (duck-typed), never an engine object.

Vector layout (`Observation.vector()`, float32, Kmax = `KMAX`; all entries bounded, see `BOUNDS`):

    index             field                     meaning
    0 .. K-1          acceptance_ema[d]         EMA of a_d = P(depth d accepted | parent accepted); prior 0.5
    K                 accepted_last / KMAX      drafted nodes accepted last round
    K+1               committed_ema / (KMAX+1)  EMA of committed tokens per round
    K+2 .. 2K+1       confidence_last[d]        raw draft confidence per depth, last round (0 = not drafted)
    2K+2 .. 3K+1      confidence_cal_last[d]    the same, calibrated (P(accepted | confidence))
    3K+2              footprint_frac            mean_l U_l / (n·r) of the last verification (1 = no reuse)
    3K+3              new_pairs_per_node / r·L  (layer, expert) pairs added per drafted node, normalised
    3K+4              overlap_prev              share of last round's pairs also used by the verification of a
                                                tree before it (0 after a one-token round: not observed)
    3K+5              rank_imbalance - 1        max/mean EP rank load − 1 (0 without an EP layout), clipped
    3K+6              cross_node_ratio          share of assignments on another node
    3K+7              utility_last / 4          R · T_AR / T_spec of the last round, clipped to [0, 4]
    3K+8              utility_ema / 4
    3K+9              cost_ratio_last / 8       T_spec / T_AR of the last round, clipped to [0, 8]
    3K+10             position_frac             new tokens so far / max_new_tokens
    3K+11             log2(batch_size) / 8      requests in the batch this request is verified with
    3K+12             depth_last / KMAX         depth actually built last round
    3K+13             first_round               1 before the first round, else 0
    3K+14 .. 4K+13    confidence_now[d]         this round's draft confidence per depth, probed before the choice:
                                                the drafter's own (the lookup's), or for a drafter without `probe`
                                                the context probe's, the prompt lookup's (0 = not probed)
    4K+14             match_recency             the probed lookup match's recency, 1 − log2(d + 1) / 8 for a match
                                                ending d tokens back (engine.drafting.suffix.match_source; 0: none)
    4K+15             match_in_output           1 when that match's continuation lies in the generated tokens

`confidence_now` is DESIGN.md §3's "draft confidence of this round": a drafter whose proposals cost next to nothing
(the prompt lookup, `NGramDrafter.probe`) drafts the round's widest, deepest tree of the policy's grid before the
policy chooses, and the round then drafts from that probe (the lookup keeps its match), so a round pays for it once;
a round that then drafts nothing still pays the probe (the trace's `probe_seconds`, env.replay). A drafter without a
probe (an EAGLE head, MTP, a dense model) would need a forward for it; there the context probe runs the prompt lookup
on the host instead (engine.runtime.context_probe), and every round pays it. A probe's values
(`probe=` below) are its confidences per depth, or `probe_values(confidences, source)`: the confidences padded to
Kmax, then the match's (recency, in_output) (`NGramDrafter.probed_source`; a small greedy model repeating its own
recent output is accepted far more often than one copying its prompt, README Results, session 2026-12-06 e).

`OBS_SIGNATURE` names this layout; a frozen policy stores it and refuses another layout.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

KMAX = 8
EMA = 0.3  # weight of the newest round in every EMA
PRIOR_ACCEPTANCE = 0.5
OBS_FIELDS = (
    [f"acceptance_ema_{d}" for d in range(1, KMAX + 1)]
    + ["accepted_last", "committed_ema"]
    + [f"confidence_last_{d}" for d in range(1, KMAX + 1)]
    + [f"confidence_cal_last_{d}" for d in range(1, KMAX + 1)]
    + ["footprint_frac", "new_pairs_per_node", "overlap_prev", "rank_imbalance", "cross_node_ratio"]
    + ["utility_last", "utility_ema", "cost_ratio_last", "position_frac", "batch_size", "depth_last", "first_round"]
    + [f"confidence_now_{d}" for d in range(1, KMAX + 1)]
    + ["match_recency", "match_in_output"]
)
OBS_DIM = len(OBS_FIELDS)
# v2: a one-token round's overlap is not observed (engine.runtime.round_record); v3: the probed match's source;
# v4: drafters without a probe observe the context probe's values (engine.runtime.context_probe) where v3 had zeros
OBS_SIGNATURE = "expertspec-obs-v4:" + hashlib.sha256(",".join(OBS_FIELDS).encode()).hexdigest()[:12]

Calibration = Callable[[float, int], float]  # (raw confidence, depth 1..K) -> P(accepted)


@dataclass(frozen=True)
class Observation:
    """What a policy sees before a round of one request. Raw fields plus `vector()` for learned agents."""

    acceptance_ema: tuple[float, ...] = (PRIOR_ACCEPTANCE,) * KMAX  # [KMAX]
    attempts_by_depth: tuple[int, ...] = (0,) * KMAX  # [KMAX] rounds in which depth d was tried
    accepted_last: int = 0
    committed_last: int = 0
    committed_ema: float = 1.0
    depth_last: int = 0
    width_last: int = 0
    confidence_last: tuple[float, ...] = (0.0,) * KMAX  # [KMAX]
    confidence_cal_last: tuple[float, ...] = (0.0,) * KMAX  # [KMAX]
    footprint_frac: float = 0.0
    new_pairs_per_node: float = 0.0
    overlap_prev: float = 0.0
    rank_imbalance: float = 1.0
    cross_node_ratio: float = 0.0
    utility_last: float = 1.0
    utility_ema: float = 1.0
    cost_last: float = 0.0  # T_spec of the last round (seconds under the engine's cost source)
    cost_ar: float = 0.0  # T_AR: one target-only decode step under the same cost source
    cost_ratio_last: float = 1.0  # T_spec / T_AR
    position: int = 0  # new tokens committed so far
    max_new_tokens: int = 1
    prompt_len: int = 0
    batch_size: int = 1
    round_index: int = 0  # rounds completed so far
    request_id: int = -1  # the request this observation is about (stateful policies key their state on it)
    top_k: int = 0  # routing top-r of the target (0 = dense / unknown)
    num_moe_layers: int = 0
    confidence_now: tuple[float, ...] = (0.0,) * KMAX  # [KMAX] this round's probed draft confidence (0: none)
    match_now: tuple[float, float] = (0.0, 0.0)  # the probed match's (recency, in_output); (0, 0): none / not probed
    extras: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def position_frac(self) -> float:
        return min(self.position / max(self.max_new_tokens, 1), 1.0)

    def vector(self) -> np.ndarray:
        """The Box observation [OBS_DIM] float32 (layout in the module docstring)."""
        rL = max(self.top_k * self.num_moe_layers, 1)
        v = [
            *self.acceptance_ema,
            self.accepted_last / KMAX,
            self.committed_ema / (KMAX + 1),
            *self.confidence_last,
            *self.confidence_cal_last,
            self.footprint_frac,
            self.new_pairs_per_node / rL,
            self.overlap_prev,
            self.rank_imbalance - 1.0,
            self.cross_node_ratio,
            self.utility_last / 4.0,
            self.utility_ema / 4.0,
            self.cost_ratio_last / 8.0,
            self.position_frac,
            math.log2(max(self.batch_size, 1)) / 8.0,
            self.depth_last / KMAX,
            1.0 if self.round_index == 0 else 0.0,
            *self.confidence_now,
            *self.match_now,
        ]
        x = np.asarray(v, dtype=np.float32)
        return np.minimum(np.maximum(x, 0.0, out=x), 1.0, out=x)  # np.clip, without its ~2 µs wrapper


BOUNDS = (0.0, 1.0)  # every vector entry is clipped into this box


def _pad(xs: Sequence[float], fill: float = 0.0) -> tuple[float, ...]:
    xs = [float(x) for x in list(xs)[:KMAX]]
    return tuple(xs + [fill] * (KMAX - len(xs)))


def probe_values(confidence: Sequence[float], source: Sequence[float]) -> list[float]:
    """A probe's values: its draft confidence per depth padded to KMAX, then its match's (recency, in_output)."""
    return [*_pad(confidence), float(source[0]), float(source[1])]


_ZEROS = (0.0,) * KMAX


def probe_values_of(confidence: list[float], recency: float, in_output: float) -> list[float]:
    """`probe_values(confidence, (recency, in_output))` for values that are floats already (the C++ lookup's): the
    same list, without converting each value again (a probing policy's hot path, every round)."""
    return [*confidence[:KMAX], *_ZEROS[len(confidence) :], recency, in_output]


def _probe_parts(probe: Sequence[float]) -> tuple[tuple[float, ...], tuple[float, float]]:
    """(confidence_now [KMAX], match_now) of a probe's values: confidences alone, or `probe_values`."""
    if len(probe) > KMAX:
        return _pad(probe), (float(probe[KMAX]), float(probe[KMAX + 1]))
    return _pad(probe), (0.0, 0.0)


def round_cost(stats: Any) -> tuple[float, float]:
    """(T_spec, T_AR) of a round: its `cost` / `cost_ar` if set, else measured seconds and no T_AR."""
    cost = getattr(stats, "cost", None)
    cost_ar = getattr(stats, "cost_ar", None)
    if cost is None:
        cost = float(stats.round_seconds)
    return float(cost), float(cost_ar or 0.0)


@dataclass
class History:
    """The running folds `observe` needs over a request's rounds, updated one round at a time (O(1) per round).

    `observe(rounds, ...)` folds a whole list; environments and the engine may keep a History per request and
    call `observe_history` instead: both run the same `add`, so they agree exactly."""

    acc: list[float] = field(default_factory=lambda: [PRIOR_ACCEPTANCE] * KMAX)
    tries: list[int] = field(default_factory=lambda: [0] * KMAX)
    committed_ema: float = 1.0
    utility_ema: float = 1.0
    rounds: int = 0
    last: Any = None

    def add(self, s: Any) -> None:
        att, ok = s.attempted_by_depth, s.accepted_by_depth
        for d in range(min(len(att), KMAX)):
            if att[d]:
                self.tries[d] += 1
                self.acc[d] += EMA * (float(ok[d]) - self.acc[d])
        self.committed_ema += EMA * (s.committed - self.committed_ema)
        cost, cost_ar = round_cost(s)
        u = s.committed * cost_ar / cost if cost > 0 and cost_ar > 0 else 1.0
        self.utility_ema += EMA * (u - self.utility_ema)
        self.rounds += 1
        self.last = s


def observation_values(
    h: History,
    *,
    position: int,
    max_new_tokens: int,
    batch_size: int = 1,
    calibration: Calibration | None = None,
    top_k: int = 0,
    num_moe_layers: int = 0,
    probe: Sequence[float] = (),
) -> np.ndarray:
    """The OBS_DIM values of `observe_history(h, ...).vector()` as a list of floats straight from the History,
    before its float32 rounding and [0, 1] clip (`as_vector`), without building the Observation or calling numpy: a
    deployed policy's path between two rounds, where every numpy call starts with cold caches (engine.bench
    policy)."""
    s = h.last
    v = list(h.acc)
    if s is None:
        v += (0.0, h.committed_ema / (KMAX + 1))
        v += _ZEROS_2K
        v += (0.0, 0.0, 0.0, 0.0, 0.0, 0.25, h.utility_ema / 4.0, 0.125)
        depth = 0
    else:
        raw = list(s.draft_confidence)[:KMAX]
        conf = [float(c) for c in raw]
        pad = _ZEROS_2K[: KMAX - len(conf)]
        v.append(int(s.accepted) / KMAX)
        v.append(h.committed_ema / (KMAX + 1))
        v += conf
        v += pad
        v += [float(calibration(c, d + 1)) for d, c in enumerate(raw)] if calibration is not None else conf
        v += pad
        cost, cost_ar = round_cost(s)
        n = max(int(s.verified_tokens), 1)
        U = s.distinct_experts
        v.append(float(sum(U) / (len(U) * n * top_k)) if len(U) and top_k else 0.0)
        new_pairs = getattr(s, "new_pairs_per_node", None)
        v.append(float(new_pairs or 0.0) / max(top_k * num_moe_layers, 1))
        v.append(float(s.overlap_prev or 0.0))
        v.append(float(s.rank_imbalance_mean or 1.0) - 1.0)
        v.append(float(s.cross_node_ratio or 0.0))
        v.append(float(s.committed * cost_ar / cost if cost > 0 and cost_ar > 0 else 1.0) / 4.0)
        v.append(h.utility_ema / 4.0)
        v.append((cost / cost_ar if cost_ar > 0 else 1.0) / 8.0)
        depth = int(getattr(s, "built_depth", s.depth))
    v.append(min(position / max(max_new_tokens, 1), 1.0))
    v.append(math.log2(max(batch_size, 1)) / 8.0)
    v.append(depth / KMAX)
    v.append(1.0 if h.rounds == 0 else 0.0)
    conf, source = _probe_parts(probe)
    v += conf
    v += source
    return v


def as_vector(values: Sequence[float] | np.ndarray) -> np.ndarray:
    """Observation values -> the observation vector [OBS_DIM] float32 clipped to [0, 1] (idempotent)."""
    x = np.array(values, dtype=np.float32)
    return np.minimum(np.maximum(x, 0.0, out=x), 1.0, out=x)


def observation_vector(h: History, **context: Any) -> np.ndarray:
    """`observe_history(h, ...).vector()` [OBS_DIM] float32 straight from the History, equal bit for bit (tested);
    `context` as `observation_values`."""
    return as_vector(observation_values(h, **context))


_ZEROS_2K = (0.0,) * (2 * KMAX)


def observe(rounds: Sequence[Any], **context: Any) -> Observation:
    """Observation before the next round of a request whose previous rounds are `rounds` (RoundStats).

    A pure function of its arguments: replaying the same RoundStats gives the same observation. `context`:
    position, max_new_tokens, prompt_len, batch_size, calibration, top_k, num_moe_layers, request_id (see
    `observe_history`)."""
    h = History()
    for s in rounds:
        h.add(s)
    return observe_history(h, **context)


def observe_history(
    h: History,
    *,
    position: int,
    max_new_tokens: int,
    prompt_len: int = 0,
    batch_size: int = 1,
    calibration: Calibration | None = None,
    top_k: int = 0,
    num_moe_layers: int = 0,
    request_id: int = -1,
    probe: Sequence[float] = (),
) -> Observation:
    """`observe` from a running History (same result as folding its rounds again). `probe`: this round's draft
    confidence per depth (`confidence_now`; empty: not probed), or its `probe_values`."""
    conf_now, match_now = _probe_parts(probe)
    common = dict(
        acceptance_ema=tuple(h.acc),
        attempts_by_depth=tuple(h.tries),
        committed_ema=h.committed_ema,
        utility_ema=h.utility_ema,
        position=position,
        max_new_tokens=max_new_tokens,
        prompt_len=prompt_len,
        batch_size=batch_size,
        round_index=h.rounds,
        request_id=request_id,
        top_k=top_k,
        num_moe_layers=num_moe_layers,
        confidence_now=conf_now,
        match_now=match_now,
    )
    if h.last is None:
        return Observation(**common)
    s = h.last
    conf = list(s.draft_confidence)[:KMAX]
    cal = [calibration(c, d + 1) for d, c in enumerate(conf)] if calibration is not None else conf
    cost, cost_ar = round_cost(s)
    u_last = s.committed * cost_ar / cost if cost > 0 and cost_ar > 0 else 1.0
    n = max(int(s.verified_tokens), 1)
    U = list(s.distinct_experts)
    footprint = sum(U) / (len(U) * n * top_k) if U and top_k else 0.0
    new_pairs = getattr(s, "new_pairs_per_node", None)
    if new_pairs is None:
        new_pairs = 0.0
    return Observation(
        **common,
        accepted_last=int(s.accepted),
        committed_last=int(s.committed),
        depth_last=int(getattr(s, "built_depth", s.depth)),
        width_last=int(s.width),
        confidence_last=_pad(conf),
        confidence_cal_last=_pad(cal),
        footprint_frac=float(footprint),
        new_pairs_per_node=float(new_pairs),
        overlap_prev=float(s.overlap_prev or 0.0),
        rank_imbalance=float(s.rank_imbalance_mean or 1.0),
        cross_node_ratio=float(s.cross_node_ratio or 0.0),
        utility_last=float(u_last),
        cost_last=cost,
        cost_ar=cost_ar,
        cost_ratio_last=cost / cost_ar if cost_ar > 0 else 1.0,
    )
