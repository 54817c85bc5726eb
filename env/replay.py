"""`expertspec/Replay-v0`: speculative decoding replayed from a recorded trace, one round per step.

    import gymnasium as gym, env
    e = gym.make("expertspec/Replay-v0")                        # default trace (built once, cached)
    e = gym.make("expertspec/Replay-v0", trace=path, cost={"kind": "roofline", "hardware": "h200"})
    obs, info = e.reset(seed=0)
    obs, reward, terminated, truncated, info = e.step(e.action_space.sample())

One step = one round (draft -> verify -> commit) of one request; an episode = one request of the trace
(drawn with the env's seed, or `reset(options={"request": i})`) until EOS (terminated) or its token budget (truncated).
Greedy and drafter-invariant seeded sampling traces replay exactly: every action's outcome at every position was
precomputed (env.tables), so a step is a lookup plus the observation.

Observation (Box [0, 1]^OBS_DIM, float32): `engine.runtime.observation.observe` over the RoundStats this env builds,
the function the live env and a policy deployed in the engine call (its fields in that module: acceptance by depth,
draft confidence, expert footprint and reuse, rank imbalance, utility, position, batch size, ...).

Action: env.actions.ActionGrid — MultiDiscrete [K 0..Kmax, W index, λ index, rule index] or its Box variant
(`action_kind="box"`). Out-of-space actions raise ValueError.

Reward: R_t − T_t / T_AR,t (tokens gained over plain decoding in the same time; deterministic). Its sum over an episode
of N tokens is N − Σ T_t/T_AR,t, so K = 0 everywhere scores exactly 0. `info` carries the raw parts: committed,
accepted, verified, drafted, cost (T_spec), cost_draft, cost_verify, cost_book, cost_ar, distinct_experts (Σ_l U_l),
utility, position, request.

Probe (`probe=True`): the observation's `confidence_now` and `match_now` are this round's probe values, as a
policy deployed with `probe` sees them (Session.probe). With a drafter that has a probe (the prompt lookup) the
engine drafts tree(Kmax, max W) of the grid before the choice; the trace recorded that tree's confidence at every
position, so it is a lookup; the probe's cost (the cost model's `probe`: the fitted kind's timed probes, otherwise the
price of drafting that tree) is added to every action that then drafts nothing (K = 0; a drafted round takes the
probe's match and pays it once, inside its drafting). With any other drafter the context probe runs the prompt lookup
on the host (engine.runtime.context_probe), recomputed here from the trace's tokens (`context_probes`); its cost (the
cost model's `context_probe`) is added to every action, drafted or not, since nothing drafts from it.

Choice (`choice=True`): every round also pays a learned controller's choice before it (the cost model's `choice`:
the fitted kind's timings in place of a stand-in of its shape, env.host_calibration; otherwise 10 µs of host work),
in `cost` and `info["cost_choice"]`: what the engine's session spends choosing (RoundStats.policy_seconds) while the
round waits. The learned policies' envs price it; rules and static actions, which cost next to nothing to choose,
and the hindsight oracle (a bound) do not.

Constructor (all optional): trace (path / Trace; default: env.default.default_trace()), grid (ActionGrid or its fields;
widths must be recorded in the trace), action_kind, cost (env.costs.CostConf or its fields), routing ("auto" |
"recorded" | "synthetic"), calibration (confidence -> P(accepted)), acceptance
(engine.drafting.acceptance.AcceptanceModel of the grid's "calibrated" verification rule), requests (indices to draw
from), target_digest / drafter_digest (checked against the trace), probe and choice (above), hold (below).

Hold (`hold=Hold(rounds, after)`, engine.runtime.hold): a step whose action starts a hold also plays the plain rounds
held after it, priced as the tables price them (neither the probe nor the choice), as a deployed policy with that hold
runs them; the step's reward is the rounds' sum, its info theirs merged (env.held; `info["held"]` counts them).
`validate(state)` replays a recorded episode state (`episode_state()`, or one from the live env).

A cost with a warm-up (the fitted kind, engine.cost.warmup) charges each round by its index (`info["cost_warmup"]`),
one with a switching surcharge (engine.cost.switching) by the kind of the round before it (`info["cost_switch"]`).
Under a stateful cost model (cost kind "roofline-offload", env.cost_offload) the env keeps the episode's device expert
cache, empty at every reset, and adds each round's expert transfers at step time (`cost`, `cost_verify`); everything
else is still a lookup, and the same actions give the same costs after any reset.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from gymnasium import spaces

from engine.cost.switching import NONE, kind_of
from engine.drafting.acceptance import AcceptanceModel
from engine.runtime.action_grid import ActionGrid
from engine.runtime.hold import Hold
from engine.runtime.observation import OBS_DIM, History, observation_vector, observe_history, probe_values
from engine.runtime.stats import RoundStats
from engine.spec.config import SpecConfig
from env.actions import ActionCodec, as_grid
from env.cost_offload import pairs_mask
from env.costs import CostConf, as_cost_conf, drafter_probes, make_cost_model, uses_recorded_routing
from env.held import merge_infos
from env.probes import context_probes, probed_sources
from env.shared import view
from env.tables import PositionReplayer, ReplayTables, load_or_build_tables, routing_for
from env.trace import Trace, load_trace

Calibration = Callable[[float, int], float]


def check_grid_against_trace(grid: ActionGrid, trace: Trace) -> None:
    missing = [w for w in grid.widths if w not in trace.widths]
    if missing:
        raise ValueError(f"grid widths {missing} were not recorded in the trace (widths {trace.widths})")
    if grid.max_depth > trace.kmax:
        raise ValueError(f"grid depth {grid.max_depth} exceeds the trace's recorded Kmax {trace.kmax}")
    if grid.frontier not in (None,):
        raise ValueError(f"the trace recorded frontier = W trees; grid frontier {grid.frontier} is not replayable")
    if any(x > 0 for x in grid.lams) and not trace.has_predictions:
        raise ValueError(
            f"grid λ {grid.lams} has λ > 0 but the trace has no predicted experts (its drafter had no expert "
            "predictor): use lams=(0.0,) or record with a predictor"
        )


class ReplayEnv(gym.Env):
    """See the module docstring."""

    metadata = {"render_modes": []}

    def __init__(
        self,
        trace: str | Path | Trace | None = None,
        *,
        grid: ActionGrid | dict | None = None,
        action_kind: str = "multidiscrete",
        cost: CostConf | dict | str | None = None,
        routing: str = "auto",
        calibration: Calibration | None = None,
        acceptance: AcceptanceModel | None = None,
        requests: Sequence[int] | None = None,
        target_digest: str | None = None,
        drafter_digest: str | None = None,
        cache: bool = True,
        probe: bool = False,
        choice: bool = False,
        hold: Hold | dict | None = None,
    ) -> None:
        super().__init__()
        cost_conf = as_cost_conf(cost)
        grid = as_grid(grid)
        self.hold = Hold.of(hold)
        if self.hold and 0 not in grid.depths:
            raise ValueError(f"hold {self.hold.to_dict()} holds plain decoding: the grid needs depth 0 ({grid.depths})")
        if routing not in ("auto", "recorded", "synthetic"):
            raise ValueError(f"routing must be 'auto', 'recorded' or 'synthetic', got {routing!r}")
        self.codec = ActionCodec(grid, action_kind)  # validates action_kind before any work
        self.action_space = self.codec.space
        if trace is None:
            from env.default import default_trace

            trace = default_trace()
        elif not isinstance(trace, Trace):
            trace = load_trace(trace)
        trace.check_models(target_digest, drafter_digest)
        self.trace = trace
        self.cost_model = make_cost_model(cost_conf, trace.meta["target"], trace.meta["drafter"]["name"], trace)
        recorded = uses_recorded_routing(self.cost_model, trace.meta["target"])
        if routing == "recorded" and not recorded:
            raise ValueError(
                f"routing 'recorded' needs the priced model to have the target's shape; "
                f"{self.cost_model.name} routes {self.cost_model.routing_shape}"
            )
        self.routing = "recorded" if (recorded and routing != "synthetic") else "synthetic"
        check_grid_against_trace(grid, trace)
        self.grid, self.action_kind = grid, action_kind
        self.cost_conf = cost_conf
        self.calibration = calibration
        self.acceptance = acceptance
        self.observation_space = spaces.Box(0.0, 1.0, shape=(OBS_DIM,), dtype=np.float32)
        n_req = trace.num_requests
        self.requests = list(range(n_req)) if requests is None else [int(i) for i in requests]
        if not self.requests or any(not 0 <= i < n_req for i in self.requests):
            raise ValueError(f"requests must be indices in 0..{n_req - 1}, got {requests}")
        self.tables: ReplayTables = load_or_build_tables(
            trace, grid, self.cost_model, self.routing, cost_conf.router_seed, cache, acceptance=acceptance
        )
        self._plain_tables = self.tables  # a held round's price: neither probe nor choice (engine.runtime.hold)
        self.probe: tuple[int, int] | None = None  # (depth, width) of the probed tree
        self._probe_rows: list[list[float]] | None = None
        if probe:
            self._set_probe()
        self.choice_cost = 0.0  # T_choice each round pays (`choice`)
        if choice:
            self._set_choice()
        self._prepare_lookups()
        self.max_new_tokens = int(trace.meta["max_new_tokens"])
        self.request: int | None = None
        self._replayers: dict[int, PositionReplayer] = {}  # off-grid SpecConfig actions, built on demand
        self._cache = cache
        self._routing = None

    def _set_probe(self) -> None:
        """`probe=True` (module docstring): the probe values per position, and the tables' columns of the rounds that
        pay for the probe priced with it (a copy: the cached tables stay those of every other env)."""
        trace, grid = self.trace, self.grid
        own = self._own_probe = drafter_probes(trace)  # the drafter's own probe (the lookup), else the context probe
        K, W = grid.max_depth, max(grid.widths)
        self.probe = (K, W)

        def priced(_cost: np.ndarray) -> tuple[ReplayTables, list[float], list[list[float]]]:
            t, _ = trace.position_steps()
            depth = np.minimum(K, trace.meta["max_new_tokens"] - t - 1)  # as the engine (and the recorder) caps it
            if own:
                rows = trace.confidence[:, trace.widths.index(W), :K]  # [P, K]: tree(Kmax, W) cut to the grid's K
                cost = np.array([self.cost_model.probe(int(c), int(d), W) for c, d in zip(self.tables.context, depth)])
                values = [probe_values(r.tolist(), src) if d > 0 else r.tolist()
                          for r, src, d in zip(rows, probed_sources(trace), depth)]  # fmt: skip
            else:
                cost = np.array([self.cost_model.context_probe(int(c)) if d > 0 else 0.0
                                 for c, d in zip(self.tables.context, depth)])  # fmt: skip
                values = context_probes(trace, depth.tolist(), W)
            # who pays: with the drafter's own probe a round drafting nothing (a drafted one drafts from the probe),
            # with the context probe every round
            paid = [f for f in range(self.codec.num_actions) if not own or grid.depths[self.codec.unflat(f)[0]] == 0]
            tab = copy.copy(self.tables)
            tab.cost, tab.draft_cost = tab.cost.copy(), tab.draft_cost.copy()
            o = tab.outcome[:, paid]  # [P, A'] those rounds' outcomes: their verification and host work
            draft = tab.draft_cost[:, paid] + cost[:, None]  # as a live round's RoundCost: (draft + verify) + book
            tab.draft_cost[:, paid] = draft
            tab.cost[:, paid] = (draft + tab.o_verify[o]) + tab.o_book[o]
            return tab, cost.tolist(), values

        # once per tables in this process (env.shared): their key fixes the trace, the grid and the cost model
        self.tables, self._probe_cost, self._probe_rows = view(f"probe:{K},{W}", self.tables.cost, priced)

    def _set_choice(self) -> None:
        """`choice=True` (module docstring): every column of the tables' cost plus the choice (a copy)."""
        c = self.choice_cost = float(self.cost_model.choice())

        def priced(cost: np.ndarray) -> ReplayTables:
            tab = copy.copy(self.tables)
            tab.cost = cost + c
            return tab

        self.tables = view(f"choice:{c!r}", self.tables.cost, priced)

    # ------------------------------------------------------------------ fast lookups
    def _prepare_lookups(self) -> None:
        t = self.tables  # list views, shared by every env over these tables in this process (env.shared)
        as_list = lambda a: a.tolist()  # noqa: E731
        self._pairs = view("ints", t.o_pairs, lambda _: t.pair_ints())
        self._popcount = view("popcount", t.o_pairs, lambda _: [p.bit_count() for p in self._pairs])
        self._acc, self._com, self._n = (view("list", a, as_list) for a in (t.o_accepted, t.o_committed, t.o_n))
        self._built, self._bonus, self._rej = (view("list", a, as_list) for a in (t.o_built, t.o_bonus, t.o_rejection))
        self._tried, self._reuse, self._new = (view("list", a, as_list) for a in (t.o_tried, t.o_reuse, t.o_new_pairs))
        self._distinct = view("list", t.o_distinct, as_list)
        self._verify, self._book = view("list", t.o_verify, as_list), view("list", t.o_book, as_list)
        self._conf = view("built", t.o_confidence, lambda c: [r[:b].tolist() for r, b in zip(c, self._built)])
        self._tpe = t.o_tokens_per_expert if t.o_tokens_per_expert.size else None
        self._outcome, self._cost, self._draft = (view("list", a, as_list) for a in (t.outcome, t.cost, t.draft_cost))
        self._ar = view("list", t.ar, as_list)
        base = self._plain_tables
        self._cost_plain, self._draft_plain = view("list", base.cost, as_list), view("list", base.draft_cost, as_list)
        self._plain = (self.grid.depths.index(0), 0, 0, 0) if 0 in self.grid.depths else None
        self._specs = {}
        self.routing_shape = tuple(self.cost_model.routing_shape)
        self._stateful = bool(self.cost_model.stateful)
        self._warmup = self.cost_model.warmup_cost()
        self._switch = self.cost_model.switch_cost()
        self._device_cache = None  # roofline-offload: the episode's expert cache (env.cost_offload)

    def _spec_fields(self, idx: tuple[int, int, int, int]) -> tuple[int, int, float, str]:
        s = self._specs.get(idx)
        if s is None:
            spec = self.grid.spec(idx)
            s = self._specs[idx] = (spec.depth, spec.width, spec.lam, spec.verify_rule)
        return s

    def _off_grid(self, spec: SpecConfig, p: int):
        """(outcome record, T_spec, T_draft, T_AR) of any SpecConfig at position p, computed on demand."""
        rp = self._replayers.get(p)
        if rp is None:
            if self._routing is None:
                self._routing = routing_for(
                    self.trace, self.cost_model, self.routing, self.cost_conf.router_seed, self._cache
                )
            req = self.request
            rp = self._replayers[p] = PositionReplayer(
                self.trace,
                p,
                req,
                p - self._p0,
                self._routing,
                self.cost_model,
                self.routing == "recorded",
                self.acceptance,
            )
        if spec.lam > 0 and not self.trace.has_predictions:
            raise ValueError(f"λ = {spec.lam} > 0 needs predicted experts; this trace has none")
        o = rp.outcome(spec)
        d = rp.draft_cost(spec, self.trace.has_predictions)
        if self.probe is not None and (not self._own_probe or rp.drafted_depth(spec) <= 0):  # who pays: _set_probe
            d += self._probe_cost[p]
        total = d + o.verify + self.cost_model.book(o.n) + self.choice_cost
        return o, total, d, self._ar[p]  # T_AR: the tables' (plain decoding's)

    # ------------------------------------------------------------------ gymnasium API
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        options = options or {}
        if "request" in options:
            req = int(options["request"])
            if not 0 <= req < self.trace.num_requests:
                raise ValueError(f"request {req} outside 0..{self.trace.num_requests - 1}")
        else:
            req = self.requests[int(self.np_random.integers(len(self.requests)))]
        self.request = req
        self._p0 = self.trace.positions_of(req).start
        self._T = len(self.trace.positions_of(req))
        self._finish_eos = bool(self.trace.finish_eos[req])
        self._prompt_len = len(self.trace.prompt(req))
        self.position = 0
        self.rounds: list[RoundStats] = []
        self._history = History()  # the observation's running folds (engine.runtime.observation)
        self._prev_pairs: int | None = None
        self._actions: list[list[int]] = []
        self._rewards: list[float] = []
        self._held: list[bool] = []  # per round: held unasked (engine.runtime.hold)
        self.total_cost = 0.0
        if self._stateful:
            self._device_cache = self.cost_model.new_state()  # empty at the start of every episode
        return self._vector(), {"request": req, "position": 0, "prompt_len": self._prompt_len}

    def observation(self):
        """The current `engine.runtime.observation.Observation` (what `obs` is the vector of)."""
        return self._observe()

    def _observe(self):
        L, _, r = self.routing_shape
        return observe_history(
            self._history,
            position=self.position,
            max_new_tokens=self.max_new_tokens,
            prompt_len=self._prompt_len,
            batch_size=1,
            calibration=self.calibration,
            top_k=r,
            num_moe_layers=L,
            probe=self._probed(),
        )

    def _probed(self) -> list[float]:
        """This round's probed draft confidence per depth ([] without a probe, or past the request's end)."""
        if self._probe_rows is None or self.position >= self._T:
            return []
        return self._probe_rows[self._p0 + self.position]

    def _vector(self) -> np.ndarray:
        """`self._observe().vector()`, computed as the deployed engine computes it (observation_vector)."""
        L, _, r = self.routing_shape
        return observation_vector(self._history, position=self.position, max_new_tokens=self.max_new_tokens,
                                  calibration=self.calibration, top_k=r, num_moe_layers=L,
                                  probe=self._probed())  # fmt: skip

    def step(self, action: Any):
        if self.request is None or self.position >= self._T:
            raise RuntimeError("call reset() before step() (and again after an episode ends)")
        hold = self.hold
        probe = self._probed() if hold else ()
        reward, info = self._round(action)
        held = hold.held(self.rounds[-1].depth, probe) if hold else 0
        if held:  # the plain rounds held unasked after it (engine.runtime.hold), neither probed nor chosen
            plain = self.codec.encode(self._plain)  # the grid's plain action, as env.held.HeldTables prices it
            infos = [info]
            while held and self.position < self._T:
                r, i = self._round(plain, held=True)
                reward += r
                infos.append(i)
                held -= 1
            info = merge_infos(infos)
        done = self.position >= self._T
        return self._vector(), reward, done and self._finish_eos, done and not self._finish_eos, info

    def _round(self, action: Any, held: bool = False) -> tuple[float, dict[str, Any]]:
        """One round of `action` at the current position: (reward, info); `held`: a held plain round, priced without
        the probe and the choice (the tables' own cost)."""
        p = self._p0 + self.position
        if isinstance(action, SpecConfig):  # any SpecConfig the trace covers (heuristic policies), not precomputed
            rec, cost, draft, ar = self._off_grid(action, p)
            k, width, lam, rule = action.depth, action.width, action.lam, action.verify_rule
            built, acc, com, n, tried = rec.built, rec.accepted, rec.committed, rec.n, rec.tried
            pairs, popcount, rej = rec.pairs, rec.pairs.bit_count(), rec.rejection
            bonus, conf, new_pairs, distinct = rec.bonus, list(rec.confidence), rec.new_pairs, list(rec.distinct)
            tpe = None if rec.tokens_per_expert is None else torch.from_numpy(rec.tokens_per_expert)
            reuse, verify, book = rec.reuse, rec.verify, self.cost_model.book(rec.n)
            idx: Any = action
        else:
            idx = self.codec.decode(action)
            a = self.codec.flat(idx)
            o = self._outcome[p][a]
            if held:
                cost, ar, draft = self._cost_plain[p][a], self._ar[p], self._draft_plain[p][a]
            else:
                cost, ar, draft = self._cost[p][a], self._ar[p], self._draft[p][a]
            k, width, lam, rule = self._spec_fields(idx)
            built, acc, com, n, tried = self._built[o], self._acc[o], self._com[o], self._n[o], self._tried[o]
            pairs, popcount, rej = self._pairs[o], self._popcount[o], self._rej[o]
            bonus, conf, new_pairs, distinct = self._bonus[o], self._conf[o], self._new[o], self._distinct[o]
            tpe = None if self._tpe is None else torch.from_numpy(self._tpe[o])
            reuse, verify, book = self._reuse[o], self._verify[o], self._book[o]
        if self._stateful:  # the round's expert transfers against this episode's cache (env.cost_offload)
            L, E, _ = self.routing_shape
            transfer = self.cost_model.transfer(int(self._device_cache.access(pairs_mask(pairs, L, E)).sum()))
            verify = verify + transfer
            cost = draft + verify + book + (0.0 if held else self.choice_cost)
        warm = self._warmup.at(len(self.rounds))  # the request's first rounds after its prefill (engine.cost.warmup)
        switch = self._switch.at(kind_of(self.rounds[-1].verified_tokens) if self.rounds else NONE, n > 1)
        cost = cost + warm + switch  # in RoundCost.total's order: replay == live to the bit
        overlap = None  # a one-token round's overlap is not observed (engine.runtime.round_record)
        if self._prev_pairs is not None and n > 1:
            overlap = (pairs & self._prev_pairs).bit_count() / max(popcount, 1)
        stats = RoundStats(
            round_index=len(self.rounds),
            depth=k,
            width=width,
            lam=lam,
            verified_tokens=n,
            proposed=n - 1,
            accepted=acc,
            committed=com,
            bonus=bonus,
            rejection_depth=None if rej < 0 else rej,
            built_depth=built,
            attempted_by_depth=[1] * tried + [0] * (built - tried),
            accepted_by_depth=[1] * acc + [0] * (built - acc),
            draft_confidence=conf,
            verify_rule=rule,
            new_pairs_per_node=new_pairs,
            distinct_experts=distinct,
            tokens_per_expert=tpe,
            reuse=reuse,
            overlap_prev=overlap,
            round_seconds=cost,
            cost=cost,
            cost_ar=ar,
        )
        self.rounds.append(stats)
        self._history.add(stats)
        if n > 1:  # the next round's overlap is with the last verification of a tree
            self._prev_pairs = pairs
        self.position += com
        self.total_cost += cost
        reward = com - cost / ar
        self._actions.append(list(idx) if not isinstance(idx, SpecConfig) else idx)
        self._rewards.append(reward)
        self._held.append(held)
        info = {
            "committed": com,
            "accepted": acc,
            "verified": n,
            "drafted": n - 1,
            "cost": cost,
            "cost_draft": draft,
            "cost_verify": verify,
            "cost_book": book,
            "cost_choice": 0.0 if held else self.choice_cost,
            "cost_warmup": warm,
            "cost_switch": switch,
            "cost_ar": ar,
            "distinct_experts": sum(distinct),
            "utility": com * ar / cost,
            "position": self.position,
            "request": self.request,
            "held": int(held),
        }
        return reward, info

    # ------------------------------------------------------------------ states and validation
    def episode_state(self) -> dict[str, Any]:
        """The current (or last) episode as a replayable state (CompilerGym-style)."""
        return {
            "env": "expertspec/Replay-v0",
            "trace": self.trace.digest,
            "request": self.request,
            "actions": [a if isinstance(a, SpecConfig) else list(a) for a in self._actions],  # per round
            "held": list(self._held),
            "rewards": list(self._rewards),
            "committed": [s.committed for s in self.rounds],
            "accepted": [s.accepted for s in self.rounds],
            "distinct_experts": [list(s.distinct_experts) for s in self.rounds],
            "cost": [s.cost for s in self.rounds],
        }

    def validate(self, state: dict[str, Any], rtol: float = 0.0) -> dict[str, Any]:
        """Replay `state` (episode_state() of this or the live env) and compare every recorded field.

        Returns {"ok", "steps", "mismatches": [(step, field, recorded, replayed)]}; leaves this env reset to
        a fresh episode of the state's request. Costs compare with relative tolerance `rtol`."""
        if state.get("trace") not in (None, self.trace.digest):
            raise ValueError(f"state was recorded on trace {state.get('trace')}, this env replays {self.trace.digest}")
        self.trace.check_models(state.get("target_digest"), state.get("drafter_digest"))
        req = int(state["request"])
        if state.get("prompt") is not None and list(state["prompt"]) != self.trace.prompt(req).tolist():
            raise ValueError(f"the state's prompt is not request {req}'s prompt in this trace (another workload?)")
        self.reset(options={"request": req})
        mismatches = []
        fields_exact = ("committed", "accepted", "distinct_experts")
        held = state.get("held") or [False] * len(state["actions"])
        for i, a in enumerate(state["actions"]):  # round by round, a held round as held (engine.runtime.hold)
            action = a if isinstance(a, SpecConfig) else self.codec.encode(a)
            reward, _ = self._round(action, held=bool(held[i]))
            term = trunc = self.position >= self._T
            s = self.rounds[-1]
            got = {"committed": s.committed, "accepted": s.accepted, "distinct_experts": list(s.distinct_experts)}
            for f in fields_exact:
                if f in state and i < len(state[f]) and state[f][i] != got[f]:
                    mismatches.append((i, f, state[f][i], got[f]))
            for f, value in (("rewards", reward), ("cost", s.cost)):
                if f in state and i < len(state[f]) and not math.isclose(state[f][i], value, rel_tol=rtol, abs_tol=0.0):
                    mismatches.append((i, f, state[f][i], value))
            if term or trunc:
                if i + 1 != len(state["actions"]):
                    mismatches.append((i, "length", len(state["actions"]), i + 1))
                break
        return {"ok": not mismatches, "steps": len(self.rounds), "mismatches": mismatches}

    # ------------------------------------------------------------------ oracle access
    @property
    def current_position(self) -> int:
        """Global trace position of the next round of the running episode."""
        return self._p0 + self.position
