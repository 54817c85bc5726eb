"""The hindsight oracle: the best any controller could do on a trace, by dynamic programming over positions.

In replay an action's outcome at a position (committed tokens, cost) does not depend on the history
(env.tables), so for one request with continuation length T

    best[T] = 0
    best[t] = max_a  r(t, a) + best[t + committed(t, a)]        objective "return": r = R − T_spec / T_AR
    best[t] = min_a  T_spec(t, a) + best[t + committed(t, a)]   objective "cost":   least total seconds

(committed >= 1, so the recursion runs backwards over t). Under a cost with a warm-up surcharge (the fitted kind:
a request's first R rounds after its prefill cost w(i) more, engine.cost.warmup) and a switching surcharge (a round
of the other kind than the one before it costs more, engine.cost.switching) the state is (t, round index i ≤ R, the
previous round's kind: `RoundStates`) and every round adds its state's surcharge: still exact. best[0] bounds the
episode return (or time) of every policy over the grid: no controller can beat it on its trace. It reads the future,
so it is a policy only in replay: `HindsightOracle(env)` looks up the running episode's position.

Under a stateful cost model (roofline-offload: a round's transfers depend on the episode's device cache) the
DP plans on the tables' stateless proxy (transfers against the cache plain decoding holds at each position,
env.tables), a DP over cache states being intractable: the plan is then a strong hindsight policy, not a
bound, and its episodes are priced by the env with the true stateful cost. `static_returns` simulates each
static action's episode with its own cache, so the best static action is chosen on the true cost.

Shape letters: T=positions of a request A=grid actions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.cost.switching import NONE, SINGLE, VERIFY, kind_of
from engine.spec.config import SpecConfig

OBJECTIVES = ("return", "cost")


@dataclass(frozen=True)
class RoundStates:
    """The DPs' state beyond the position: the round index i capped at R (the cost model's warm-up length,
    engine.cost.warmup; R = 0 without one) and, under a switching surcharge (engine.cost.switching), the kind of the
    previous round (NONE / SINGLE / VERIFY; one kind without one). State s = i·P + previous, P = 1 or 3."""

    surcharge: np.ndarray  # [S, 2] seconds a round at state s adds, by whether it verifies (0 / 1)
    after: np.ndarray  # [S, 2] int64 the next round's state
    kinds: int  # P

    @property
    def size(self) -> int:
        return len(self.after)

    def of(self, round_index: int, previous: int = NONE) -> int:
        """The state of a request's round `round_index` after a round of kind `previous`."""
        R = self.size // self.kinds - 1
        return min(round_index, R) * self.kinds + (previous if self.kinds > 1 else 0)

    def of_episode(self, env: Any) -> int:
        """The state of a ReplayEnv's running episode's next round."""
        rounds = env.rounds
        return self.of(len(rounds), kind_of(rounds[-1].verified_tokens) if rounds else NONE)


def round_states(env: Any) -> RoundStates:
    """The RoundStates of a ReplayEnv's cost model: its warm-up surcharge w(i) (0 from R on) and switching surcharge."""
    cm = env.unwrapped.cost_model
    warm = cm.warmup_cost().padded()  # [R + 1]
    switch = cm.switch_cost()
    R = len(warm) - 1
    P = 3 if switch.any else 1
    i = np.repeat(np.arange(R + 1), P)  # [S] each state's round index
    prev = np.tile(np.arange(P), R + 1)  # [S] ... and previous kind
    surcharge = np.repeat(warm[i][:, None], 2, axis=1)
    if P > 1:
        surcharge += switch.table()[prev]
        after = np.minimum(i + 1, R)[:, None] * P + np.array([SINGLE, VERIFY])[None, :]
    else:
        after = np.repeat(np.minimum(i + 1, R)[:, None], 2, axis=1)
    return RoundStates(surcharge, after.astype(np.int64), P)


@dataclass(frozen=True)
class OraclePlan:
    """The DP's solution for one request over (local position t, round state s: `RoundStates`)."""

    request: int
    objective: str
    value: np.ndarray  # [T + 1, S] best return-to-go (or least cost-to-go) from position t at state s
    action: np.ndarray  # [T, S] flat grid action achieving it
    committed: np.ndarray  # [T, A] committed tokens of every action (the DP's transitions)
    verifying: np.ndarray  # [T, A] bool: the action verifies more than one token there
    states: RoundStates

    @property
    def best(self) -> float:
        return float(self.value[0, 0])

    def action_at(self, t: int, state: int) -> int:
        """The flat action at local position t, round state `state` (RoundStates.of)."""
        return int(self.action[t, state])

    def path(self) -> list[tuple[int, int]]:
        """(position, flat action) along the optimal episode."""
        out, t, s = [], 0, 0
        while t < len(self.action):
            a = self.action_at(t, s)
            out.append((t, a))
            s = int(self.states.after[s, int(self.verifying[t, a])])
            t += int(self.committed[t, a])
        return out


def request_tables(env: Any, request: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(committed [T, A] int64, cost [T, A], T_AR [T], verifying [T, A] int64: 1 where the action verifies more than
    one token) of `request`'s positions in a ReplayEnv's tables."""
    tables = env.unwrapped.tables
    positions = env.unwrapped.trace.positions_of(request)
    p0, T = positions.start, len(positions)
    verifying = (tables.o_n[tables.outcome[p0 : p0 + T]] > 1).astype(np.int64)
    return (tables.committed_pa[p0 : p0 + T].astype(np.int64), tables.cost[p0 : p0 + T], tables.ar[p0 : p0 + T],
            verifying)  # fmt: skip


def plan(env: Any, request: int, objective: str = "return") -> OraclePlan:
    """The DP of the module docstring for `request` of a ReplayEnv's trace and grid, over (position, round state):
    a round also pays the warm-up and switching surcharges of its state (RoundStates), so they are part of the state."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    committed, cost, ar, verifying = request_tables(env, request)
    st = round_states(env)
    T = len(committed)
    reward = committed - cost / ar[:, None]
    value = np.zeros((T + 1, st.size))
    action = np.zeros((T, st.size), dtype=np.int64)
    rows = np.arange(st.size)
    for t in range(T - 1, -1, -1):
        nxt = np.minimum(t + committed[t], T)  # [A]
        v = verifying[t]
        ahead = value[nxt[None, :], st.after[:, v]]  # [S, A]
        if objective == "return":
            total = reward[t][None] - st.surcharge[:, v] / ar[t] + ahead
            a = np.argmax(total, axis=1)
        else:
            total = cost[t][None] + st.surcharge[:, v] + ahead
            a = np.argmin(total, axis=1)
        value[t] = total[rows, a]
        action[t] = a
    return OraclePlan(request, objective, value, action, committed, verifying.astype(bool), st)


def span_cost(env: Any, request: int, span: int) -> float:
    """Least total cost of `request` when the action may change only at the first round that starts in a new span
    of `span` tokens (positions [s·span, (s+1)·span)), chosen in hindsight: span 1 is the oracle's least cost
    (`plan(..., "cost")`), span >= T the best static action of this request (`static_returns`). A DP over the
    decision positions and round states (the warm-up and switching surcharges, as `plan`); stateless costs only (the
    tables' costs; under a stateful one they are its proxy).

        best[t, s] = min_a  Σ_{rounds of a from t while in t's span} (T_spec + surcharge(state, verifies))
                            + best[first round start past it, the state after those rounds]"""
    if span < 1:
        raise ValueError(f"span must be >= 1 token, got {span}")
    committed, cost, _, verifying = request_tables(env, request)
    st = round_states(env)
    T, A = committed.shape
    # every (start t, action a, start state s) at once: the rounds of a from t while they start in t's span -> their
    # cost with their surcharges, the state after them, the first round start past the span (each round commits
    # >= 1 token: at most `span` steps)
    at = np.repeat(np.arange(T)[:, None], A, axis=1)  # [T, A]
    end = np.minimum((np.arange(T) // span + 1) * span, T)[:, None]  # [T, 1]
    total = np.zeros((st.size, T, A))
    state = np.repeat(np.arange(st.size)[:, None, None], T, axis=1).repeat(A, axis=2)  # [S, T, A]
    live = np.ones((T, A), dtype=bool)
    while live.any():
        i, j = np.nonzero(live)
        v = verifying[at[i, j], j]
        total[:, i, j] += cost[at[i, j], j][None] + st.surcharge[state[:, i, j], v[None]]
        state[:, i, j] = st.after[state[:, i, j], v[None]]
        at[i, j] += committed[at[i, j], j]
        live &= at < end
    best = np.zeros((T + 1, st.size))
    for t in range(T - 1, -1, -1):
        best[t] = np.min(total[:, t] + best[np.minimum(at[t], T)[None], state[:, t]], axis=1)
    return float(best[0, 0])


def static_returns(env: Any, request: int) -> tuple[np.ndarray, np.ndarray]:
    """(episode return [A], total cost [A]) of every static grid action on `request` (vectorised), each round with
    its warm-up and switching surcharges (RoundStates)."""
    if env.unwrapped.cost_model.stateful:
        positions = env.unwrapped.trace.positions_of(request)
        return _stateful_static_returns(env.unwrapped, positions.start, len(positions))
    committed, costs, ar, verifying = request_tables(env, request)
    st = round_states(env)
    T, A = committed.shape
    t = np.zeros(A, dtype=np.int64)
    s = np.zeros(A, dtype=np.int64)  # each action's round state
    ret, total = np.zeros(A), np.zeros(A)
    cols = np.arange(A)
    while True:
        live = t < T
        if not live.any():
            break
        p, c = t[live], cols[live]
        com, v = committed[p, c], verifying[p, c]
        cost = costs[p, c] + st.surcharge[s[live], v]
        ret[live] += com - cost / ar[p]
        total[live] += cost
        t[live] += com
        s[live] = st.after[s[live], v]
    return ret, total


def _stateful_static_returns(e: Any, p0: int, T: int) -> tuple[np.ndarray, np.ndarray]:
    """static_returns under a stateful cost: each action's episode with its own device cache (env.cost_offload),
    priced as ReplayEnv.step prices it."""
    from env.cost_offload import unpack_pairs

    tables, model = e.tables, e.cost_model
    L, E, _ = model.routing_shape
    A = tables.cost.shape[1]
    ret, total = np.zeros(A), np.zeros(A)
    masks: dict[int, np.ndarray] = {}
    st = round_states(e)
    for a in range(A):
        state = model.new_state()
        t = s = 0
        while t < T:
            p = p0 + t
            o = int(tables.outcome[p, a])
            mask = masks.get(o)
            if mask is None:
                mask = masks[o] = unpack_pairs(tables.o_pairs[o], L, E)
            verify = float(tables.o_verify[o]) + model.transfer(int(state.access(mask).sum()))
            v = int(tables.o_n[o] > 1)
            cost = float(tables.draft_cost[p, a]) + verify + float(tables.o_book[o]) + float(st.surcharge[s, v])
            com = int(tables.committed_pa[p, a])
            ret[a] += com - cost / tables.ar[p]
            total[a] += cost
            t += com
            s = int(st.after[s, v])
    return ret, total


def headroom(env: Any, requests: list[int] | None = None) -> dict[str, float]:
    """The oracle's advantage over the best static grid action (one action for the whole workload).

    Returns totals over `requests` (default: all): oracle / best-static return, and speed-up over
    target-only decoding (Σ T_AR of every committed position / total time) of the least-cost oracle and
    of the fastest static action."""
    e = env.unwrapped
    requests = list(range(e.trace.num_requests)) if requests is None else requests
    oracle_ret = oracle_cost = ar_total = 0.0
    static_ret, static_cost = 0.0, 0.0
    for i in requests:
        oracle_ret += plan(env, i, "return").best
        oracle_cost += plan(env, i, "cost").best
        r, c = static_returns(env, i)
        static_ret = static_ret + r
        static_cost = static_cost + c
        pos = e.trace.positions_of(i)
        ar_total += float(e.tables.ar[pos.start : pos.stop].sum())
    best_static = int(np.argmax(static_ret))
    fastest = int(np.argmin(static_cost))
    return {
        "oracle_return": oracle_ret,
        "best_static_return": float(static_ret[best_static]),
        "best_static_action": list(e.codec.unflat(best_static)),
        "oracle_speedup": ar_total / oracle_cost,
        "best_static_speedup": ar_total / float(static_cost[fastest]),
        "fastest_static_action": list(e.codec.unflat(fastest)),
        "headroom_speedup": float(static_cost[fastest]) / oracle_cost,
    }


class HindsightOracle:
    """The oracle as a policy for a ReplayEnv (it reads the env's running episode: replay only).

    `action(obs)` returns the env action (MultiDiscrete / Box) for the env's current position; `act(obs)`
    the SpecConfig (ctrl.policies interface)."""

    name = "oracle"

    def __init__(self, env: Any, objective: str = "return") -> None:
        e = getattr(env, "unwrapped", env)
        if not hasattr(e, "tables") or not hasattr(e, "trace"):
            raise TypeError("the hindsight oracle needs a Replay-v0 environment (it reads the recorded future)")
        self.env, self.objective = e, objective
        self._plans: dict[int, OraclePlan] = {}

    def reset(self) -> None:
        pass

    def _index(self) -> tuple[int, int, int, int]:
        e = self.env
        if e.request is None:
            raise RuntimeError("reset the environment before asking the oracle")
        p = self._plans.get(e.request)
        if p is None:
            p = self._plans[e.request] = plan(e, e.request, self.objective)
        return e.codec.unflat(p.action_at(e.position, p.states.of_episode(e)))

    def action(self, obs: Any = None) -> np.ndarray:
        return self.env.codec.encode(self._index())

    def act(self, obs: Any = None) -> SpecConfig:
        return self.env.grid.spec(self._index())
