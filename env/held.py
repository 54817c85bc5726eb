"""Holds in the environments (engine.runtime.hold): a held step's info (one decision, then the plain rounds held
unasked after it, as one step of Replay-v0 and Live-v0), and what a hold adds to a request's DP (HeldTables)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

SUMMED = ("committed", "accepted", "verified", "drafted", "cost", "cost_draft", "cost_verify", "cost_book",
          "cost_choice", "cost_warmup", "cost_switch", "distinct_experts", "held", "measured_seconds")  # fmt: skip


def merge_infos(infos: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The step's info from its rounds' infos (the decided round first): counts and costs summed (`held`: the held
    rounds), `cost_ar` the decided round's T_AR, `utility` committed tokens per cost in units of each round's own T_AR
    (Σ committed ÷ Σ cost/T_AR), position and request the last round's."""
    out = dict(infos[-1])
    for key in SUMMED:
        if key in infos[0]:
            out[key] = sum(i[key] for i in infos)
    out["cost_ar"] = infos[0]["cost_ar"]
    out["utility"] = out["committed"] / sum(i["cost"] / i["cost_ar"] for i in infos)
    return out


@dataclass(frozen=True)
class HeldTables:
    """What a hold adds to one request's DP (ctrl.aggrevate's Q rows) in a ReplayEnv with a hold, over local
    positions t and round states s (env.oracle.RoundStates):

        starts [T, A] bool     the action at t starts a hold (its probe at t, its depth)
        gain   [T + 1, S]      the return Σ (1 − (T_plain + surcharge)/T_AR) of the plain rounds held from t at state s
        land_t [T + 1] int     the position after them
        land_s [T + 1, S] int  the round state after them"""

    starts: np.ndarray
    gain: np.ndarray
    land_t: np.ndarray
    land_s: np.ndarray

    def ahead(self, value: np.ndarray) -> np.ndarray:
        """[T + 1, S]: the value-to-go at (t, s) after a round that started a hold, for a value-to-go `value`
        [T + 1, S] after the held rounds: their gain, then `value` where they land."""
        return self.gain + value[self.land_t[:, None], self.land_s]


def held_tables(env: Any, request: int) -> HeldTables | None:
    """The HeldTables of `request` in a ReplayEnv (None when it holds nothing): held rounds play the grid's plain
    action priced as the env's tables price it without probe and choice, as Replay-v0's step does."""
    from env.oracle import round_states

    e = env.unwrapped
    hold = e.hold
    if not hold:
        return None
    positions = e.trace.positions_of(request)
    p0, T = positions.start, len(positions)
    a0 = e.codec.flat(e._plain)
    plain = e._plain_tables.cost[p0 : p0 + T, a0]
    ar = e.tables.ar[p0 : p0 + T]
    plain_action = np.array([e.grid.depths[e.codec.unflat(a)[0]] == 0 for a in range(e.codec.num_actions)])  # [A]
    rows = e._probe_rows
    holds = np.array([hold.held(0, rows[p0 + t] if rows is not None else []) > 0 for t in range(T)])  # [T]
    starts = holds[:, None] & plain_action[None, :]
    st = round_states(e)
    S = st.size
    gain = np.zeros((T + 1, S))
    land_t = np.arange(T + 1)
    land_s = np.tile(np.arange(S), (T + 1, 1))
    for t0 in range(T):
        s, t = np.arange(S), t0
        while t < min(t0 + hold.rounds, T):
            gain[t0] += 1.0 - (plain[t] + st.surcharge[s, 0]) / ar[t]
            s, t = st.after[s, 0], t + 1
        land_t[t0], land_s[t0] = t, s
    return HeldTables(starts, gain, land_t, land_s)
