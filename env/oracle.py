"""The hindsight oracle: the best any controller could do on a trace, by dynamic programming over positions.

In replay an action's outcome at a position (committed tokens, cost) does not depend on the history
(env.tables), so for one request with continuation length T

    best[T] = 0
    best[t] = max_a  r(t, a) + best[t + committed(t, a)]        objective "return": r = R − T_spec / T_AR
    best[t] = min_a  T_spec(t, a) + best[t + committed(t, a)]   objective "cost":   least total seconds

(committed >= 1, so the recursion runs backwards over t). Under a cost with a warm-up surcharge (the fitted kind:
a request's first R rounds after its prefill cost w(i) more, engine.cost.warmup) the state is (t, round index i ≤ R)
and every round adds w(i): still exact. best[0] bounds the episode return (or time)
of every policy over the grid: no controller can beat it on its trace. It reads the future, so it is a
policy only in replay: `HindsightOracle(env)` looks up the running episode's position.

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

from engine.spec.config import SpecConfig

OBJECTIVES = ("return", "cost")


@dataclass(frozen=True)
class OraclePlan:
    """The DP's solution for one request. The state is (local position t, round index i) with i capped at R, the
    length of the cost model's warm-up surcharge (engine.cost.warmup; R = 0 without one: the position alone)."""

    request: int
    objective: str
    value: np.ndarray  # [T + 1, R + 1] best return-to-go (or least cost-to-go) from position t at round index i
    action: np.ndarray  # [T, R + 1] flat grid action achieving it
    committed: np.ndarray  # [T, A] committed tokens of every action (the DP's transitions)

    @property
    def best(self) -> float:
        return float(self.value[0, 0])

    @property
    def rounds(self) -> int:
        """R: round indices from R on are one state (no surcharge)."""
        return self.value.shape[1] - 1

    def action_at(self, t: int, round_index: int) -> int:
        """The flat action at local position t, round index `round_index`."""
        return int(self.action[t, min(round_index, self.rounds)])

    def path(self) -> list[tuple[int, int]]:
        """(position, flat action) along the optimal episode."""
        out, t, i = [], 0, 0
        while t < len(self.action):
            a = self.action_at(t, i)
            out.append((t, a))
            t += int(self.committed[t, a])
            i += 1
        return out


def request_tables(env: Any, request: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(committed [T, A] int64, cost [T, A], T_AR [T]) of `request`'s positions in a ReplayEnv's tables."""
    tables = env.unwrapped.tables
    positions = env.unwrapped.trace.positions_of(request)
    p0, T = positions.start, len(positions)
    return tables.committed_pa[p0 : p0 + T].astype(np.int64), tables.cost[p0 : p0 + T], tables.ar[p0 : p0 + T]


def warmup_of(env: Any) -> np.ndarray:
    """[R + 1] the env's cost model's warm-up surcharge of round indices 0..R−1, then 0 (engine.cost.warmup)."""
    return env.unwrapped.cost_model.warmup_cost().padded()


def round_states(env: Any) -> tuple[np.ndarray, np.ndarray]:
    """(w [R + 1]: `warmup_of`, the next round's index state [R + 1]: min(i + 1, R)) of the DPs' round index i."""
    warm = warmup_of(env)
    R = len(warm) - 1
    return warm, np.minimum(np.arange(R + 1) + 1, R)


def plan(env: Any, request: int, objective: str = "return") -> OraclePlan:
    """The DP of the module docstring for `request` of a ReplayEnv's trace and grid, over (position, round index):
    a round at index i also pays the warm-up surcharge w(i) (0 from R on), so the round index is part of the state."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    committed, cost, ar = request_tables(env, request)
    warm, nxt_i = round_states(env)
    R = len(warm) - 1
    T = len(committed)
    reward = committed - cost / ar[:, None]
    value = np.zeros((T + 1, R + 1))
    action = np.zeros((T, R + 1), dtype=np.int64)
    for t in range(T - 1, -1, -1):
        nxt = np.minimum(t + committed[t], T)  # [A]
        ahead = value[nxt][:, nxt_i].T  # [R + 1, A]
        if objective == "return":
            total = reward[t][None] - (warm / ar[t])[:, None] + ahead
            a = np.argmax(total, axis=1)
        else:
            total = cost[t][None] + warm[:, None] + ahead
            a = np.argmin(total, axis=1)
        value[t] = total[np.arange(R + 1), a]
        action[t] = a
    return OraclePlan(request=request, objective=objective, value=value, action=action, committed=committed)


def span_cost(env: Any, request: int, span: int) -> float:
    """Least total cost of `request` when the action may change only at the first round that starts in a new span
    of `span` tokens (positions [s·span, (s+1)·span)), chosen in hindsight: span 1 is the oracle's least cost
    (`plan(..., "cost")`), span >= T the best static action of this request (`static_returns`). A DP over the
    decision positions and round indices (the warm-up surcharge, as `plan`); stateless costs only (the tables' costs;
    under a stateful one they are its proxy).

        best[t, i] = min_a  Σ_{rounds of a from t while in t's span} (T_spec + w(round index))
                            + best[first round start past it, i + those rounds]"""
    if span < 1:
        raise ValueError(f"span must be >= 1 token, got {span}")
    committed, cost, _ = request_tables(env, request)
    warm = warmup_of(env)
    R = len(warm) - 1
    cum = np.concatenate([[0.0], np.cumsum(warm)])  # cum[k] = Σ_{j<k} w(j); w(j) = 0 for j >= R
    T, A = committed.shape
    # every (start t, action a) at once: the rounds of a from t while they start in t's span -> their cost, their
    # count, the first round start past the span (each round commits >= 1 token: at most `span` steps)
    at = np.repeat(np.arange(T)[:, None], A, axis=1)  # [T, A]
    end = np.minimum((np.arange(T) // span + 1) * span, T)[:, None]  # [T, 1]
    total = np.zeros((T, A))
    rounds = np.zeros((T, A), dtype=np.int64)
    live = np.ones((T, A), dtype=bool)
    while live.any():
        i, j = np.nonzero(live)
        total[i, j] += cost[at[i, j], j]
        rounds[i, j] += 1
        at[i, j] += committed[at[i, j], j]
        live &= at < end
    idx = np.arange(R + 1)[:, None]  # [R + 1, 1] round index state at t
    best = np.zeros((T + 1, R + 1))
    for t in range(T - 1, -1, -1):
        after = np.minimum(idx + rounds[t][None], R)  # [R + 1, A]
        surcharge = cum[after] - cum[idx]  # w of the rounds idx .. idx + m − 1
        best[t] = np.min(total[t][None] + surcharge + best[np.minimum(at[t], T)[None], after], axis=1)
    return float(best[0, 0])


def static_returns(env: Any, request: int) -> tuple[np.ndarray, np.ndarray]:
    """(episode return [A], total cost [A]) of every static grid action on `request` (vectorised), each round with
    its warm-up surcharge by round index (engine.cost.warmup)."""
    tables = env.unwrapped.tables
    positions = env.unwrapped.trace.positions_of(request)
    p0, T = positions.start, len(positions)
    A = tables.cost.shape[1]
    if env.unwrapped.cost_model.stateful:
        return _stateful_static_returns(env.unwrapped, p0, T)
    warm = warmup_of(env)
    R = len(warm) - 1
    t = np.zeros(A, dtype=np.int64)
    i = np.zeros(A, dtype=np.int64)  # each action's round index
    ret, total = np.zeros(A), np.zeros(A)
    cols = np.arange(A)
    while True:
        live = t < T
        if not live.any():
            break
        p = p0 + t[live]
        c = cols[live]
        com = tables.committed_pa[p, c].astype(np.int64)
        cost = tables.cost[p, c] + warm[np.minimum(i[live], R)]
        ret[live] += com - cost / tables.ar[p]
        total[live] += cost
        t[live] += com
        i[live] += 1
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
    warm = model.warmup_cost()
    for a in range(A):
        state = model.new_state()
        t = i = 0
        while t < T:
            p = p0 + t
            o = int(tables.outcome[p, a])
            mask = masks.get(o)
            if mask is None:
                mask = masks[o] = unpack_pairs(tables.o_pairs[o], L, E)
            verify = float(tables.o_verify[o]) + model.transfer(int(state.access(mask).sum()))
            cost = float(tables.draft_cost[p, a]) + verify + float(tables.o_book[o]) + warm.at(i)
            com = int(tables.committed_pa[p, a])
            ret[a] += com - cost / tables.ar[p]
            total[a] += cost
            t += com
            i += 1
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
        return e.codec.unflat(p.action_at(e.position, len(e.rounds)))

    def action(self, obs: Any = None) -> np.ndarray:
        return self.env.codec.encode(self._index())

    def act(self, obs: Any = None) -> SpecConfig:
        return self.env.grid.spec(self._index())
