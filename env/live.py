"""`expertspec/Live-v0`: the real engine, one speculative round per step (a batch variant steps a batch).

    import gymnasium as gym, env
    e = gym.make("expertspec/Live-v0")                          # zoo target + EAGLE head + expert predictor
    obs, info = e.reset(seed=0)
    obs, reward, terminated, truncated, info = e.step(e.action_space.sample())

Each episode opens an `engine.Engine.start` session on one prompt of the workload (drawn with the env's
seed, or `reset(options={"request": i})`); `step` runs `session.step([spec])`, one draft -> verify ->
commit round, until EOS (terminated) or the token budget (truncated). With `batch_size` B > 1 an episode
is B prompts, one action applies to every active request, and the step is priced as one batched forward
over the union of the batch's experts (T_AR: one batched target-only step).

Spaces, observation and reward are those of `expertspec/Replay-v0` (env.replay): the same ActionGrid,
`engine.runtime.observation.observe` over the session's RoundStats, reward R_t − T_t/T_AR. Costs come
from env.costs through the engine's `round_cost` hook, computed from the same numbers replay uses, so
under a deterministic cost model (roofline, fitted) replay == live exactly; kind "measured" prices by
wall clock (the round's measured seconds, host work included; T_AR = the median measured step of a plain
engine at start), which
is not deterministic. For a model spec larger than the target the verified tree is re-routed with the
identity-keyed synthetic router (engine.cost.node_router) exactly as replay does, and the RoundStats'
footprint fields describe that routing.

Probe (`probe=True`): before every round the session probes the grid's tree(Kmax, max W) (Session.probe) and the
observation's `confidence_now` and `match_now` hold its values. With a drafter that has `probe` (the prompt lookup) a
round that then drafts nothing pays the probe (the cost model's `probe`); with any other drafter the session runs the
context probe (engine.runtime.context_probe) and every round pays it (the cost model's `context_probe`); kind
"measured": its measured seconds, in every round. As in expertspec/Replay-v0.

Choice (`choice=True`): every round also pays a learned controller's choice (the cost model's `choice`, whatever the
kind: the caller chooses, outside the env's timing), in `cost` and `info["cost_choice"]`. As in expertspec/Replay-v0.

Hold (`hold=Hold(rounds, after)`, engine.runtime.hold): a step whose action starts a hold also runs the plain rounds
held after it, neither probed nor paying the choice, as a deployed policy with that hold runs them. As in Replay-v0.

Sampling: greedy, or drafter-invariant seeded sampling (`sampling={"temperature": 0.7, "mode":
"position", "seed": s}`; request i uses seed s + i, as env.record does), so a live episode's text
matches its trace.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from gymnasium import spaces

import engine
from engine.cost.node_router import NodeRouter, child_key
from engine.cost.switching import NONE, kind_of
from engine.runtime.action_grid import ActionGrid
from engine.runtime.hold import Hold
from engine.runtime.observation import OBS_DIM, observe
from engine.runtime.stats import RoundStats
from engine.spec.sampling import SamplingParams
from engine.workloads import encode, workload
from env.actions import ActionCodec, as_grid
from env.capture import CaptureDrafter
from env.cost_model import CHOICE_HOST_SECONDS
from env.costs import (
    REPLAY_ONLY_KINDS,
    CostConf,
    RoundCost,
    as_cost_conf,
    draft_rule,
    drafter_steps,
    make_cost_model,
    uses_recorded_routing,
)
from env.held import merge_infos
from env.models import load_models
from env.tables import footprint_of, pairs_int

Calibration = Callable[[float, int], float]


class LiveEnv(gym.Env):
    """See the module docstring."""

    metadata = {"render_modes": []}

    def __init__(
        self,
        *,
        target: str = "tiny-moe",
        drafter: str | None = "eagle-head",
        predictor: str | None = "expert-predictor",
        workload_name: str = "mixed",
        num_prompts: int = 8,
        prompts_path: str | None = None,
        prompts: Sequence[Sequence[int]] | None = None,
        max_new_tokens: int = 64,
        max_prompt_tokens: int = 128,
        sampling: dict | SamplingParams | None = None,
        grid: ActionGrid | dict | None = None,
        action_kind: str = "multidiscrete",
        cost: CostConf | dict | str | None = None,
        fit_trace: Any = None,
        calibration: Calibration | None = None,
        acceptance: Any = None,
        batch_size: int = 1,
        eos: bool = True,
        models: tuple | None = None,
        probe: bool = False,
        choice: bool = False,
        hold: Hold | dict | None = None,
    ) -> None:
        super().__init__()
        grid = as_grid(grid)
        self.hold = Hold.of(hold)
        self._holding = False  # playing a held round (engine.runtime.hold): no choice to price
        self._probe_now: list[float] = []  # this round's probe values, as the observation holds them
        self.codec = ActionCodec(grid, action_kind)
        self.action_space = self.codec.space
        measured = (cost == "measured") or (isinstance(cost, Mapping) and cost.get("kind") == "measured")
        cost_conf = as_cost_conf(
            {**(dict(cost) if isinstance(cost, Mapping) else {}), "kind": "fitted"} if measured else cost
        )
        if cost_conf.kind in REPLAY_ONLY_KINDS:
            raise ValueError(
                f"cost kind {cost_conf.kind!r} prices replay only (stateful expert cache or routing-priced EP): "
                "use expertspec/Replay-v0, or kind roofline / fitted / measured here"
            )
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if max_new_tokens < 2:
            raise ValueError(f"max_new_tokens must be >= 2, got {max_new_tokens}")
        self.sampling = _as_sampling(sampling)
        if self.sampling.temperature > 0 and self.sampling.seed is None:
            self.sampling = replace(self.sampling, seed=0)
        target_model, drafter_obj, info = models if models is not None else load_models(target, drafter, predictor)
        if drafter_obj is None:
            raise ValueError("Live-v0 needs a drafter (the action chooses its speculation)")
        self.probe = (grid.max_depth, max(grid.widths)) if probe else None
        self._own_probe = hasattr(drafter_obj, "probe")  # else Session.probe runs the context probe
        if any(x > 0 for x in grid.lams) and not getattr(drafter_obj, "predicts_experts", False):
            raise ValueError(f"grid λ {grid.lams} has λ > 0 but the drafter has no expert predictor: use lams=(0.0,)")
        self.info_models = info
        meta = info.target_meta(target_model)
        self.cost_model = None
        if not measured or fit_trace is not None:  # measured: the fit (when given) only shapes the goodput profile
            self.cost_model = make_cost_model(cost_conf, meta, info.drafter_name, fit_trace)
        # the caller's choice before each round (`choice`): the cost model's price, measured without one: the constant
        self.choice_seconds = 0.0 if not choice else (
            self.cost_model.choice() if self.cost_model is not None else CHOICE_HOST_SECONDS)  # fmt: skip
        shape_model = self.cost_model
        self.recorded = shape_model is None or uses_recorded_routing(shape_model, meta)
        L, E, r = (
            (meta["num_moe_layers"], meta["num_experts"], meta["top_r"])
            if shape_model is None
            else shape_model.routing_shape
        )
        self.routing_shape = (L, E, r)
        self.router = None if self.recorded else NodeRouter(E, r, L, seed=cost_conf.router_seed)
        self.grid, self.action_kind = grid, action_kind
        self.measured = measured
        self.calibration = calibration
        self.batch_size = batch_size
        self.max_new_tokens = max_new_tokens
        self.target = target_model
        self.drafter = CaptureDrafter(drafter_obj)
        if acceptance is None and grid.needs_acceptance:
            raise ValueError("the grid has the 'calibrated' verification rule: pass its acceptance model")
        self.acceptance = acceptance  # engine.drafting.acceptance.AcceptanceModel of the "calibrated" rule
        self.engine = engine.Engine(
            target_model, drafter=self.drafter, round_cost=self._price, calibration=calibration, acceptance=acceptance,
            plain_routing=batch_size > 1 and not measured and self.router is None,  # the batch's union of experts
        )  # fmt: skip
        self.eos_token_id = None
        if eos and target_model.tokenizer is not None:
            self.eos_token_id = target_model.tokenizer.token_to_id("<|endoftext|>")
        if prompts is None:
            if target_model.tokenizer is None:
                raise ValueError("the target has no tokenizer.json: pass prompts as token ids")
            prompts = encode(
                target_model.tokenizer, workload(workload_name, num_prompts, prompts_path), max_prompt_tokens
            )
        self.prompts = [list(map(int, p)) for p in prompts if len(p) >= 2]
        if not self.prompts:
            raise ValueError("the workload has no usable prompts (need at least one prompt of >= 2 tokens)")
        self.observation_space = spaces.Box(0.0, 1.0, shape=(OBS_DIM,), dtype=np.float32)
        self.session = None
        self.request: int | None = None
        self._ar_measured = self._measure_ar() if measured else None
        self._ar_warmup: dict[int, float] = {}  # request id -> plain decoding's warm-up at its position (_price)

    # ------------------------------------------------------------------ pricing (engine round_cost hook)
    def _price(self, stats: RoundStats) -> tuple[float, float]:
        rid, ctx, remaining, spec = self._pending.pop(0)
        kd = min(spec.depth, remaining - 1) if spec.depth > 0 and remaining > 1 else 0
        n = stats.verified_tokens
        if self.router is not None:  # what-if routing of the priced model, keyed on node identity
            tree = self.drafter.trees.pop(rid, None) if kd > 0 else None
            toks = [self._root_token[rid]] if tree is None else tree.tokens.tolist()
            pars = [-1] if tree is None else tree.parents.tolist()
            ids, _, _ = self.router.route_tree(self._key[rid], self._latent[rid], toks, pars)
            fp = footprint_of(ids, self.routing_shape[1])
            pairs = pairs_int(fp)
            prev = self._prev_pairs.get(rid)
            stats.distinct_experts = fp.distinct_experts
            stats.tokens_per_expert = None
            stats.reuse = fp.reuse
            stats.new_pairs_per_node = fp.new_pairs_per_node
            if n > 1:  # a one-token round's overlap is not observed (engine.runtime.round_record)
                stats.overlap_prev = None if prev is None else (pairs & prev).bit_count() / max(pairs.bit_count(), 1)
                self._prev_pairs[rid] = pairs
            self._pairs[rid] = pairs
        if self.measured:
            cost = RoundCost(
                draft=stats.time.get("draft", 0.0) + stats.probe_seconds,
                verify=stats.time.get("forward", 0.0),
                book=stats.host_seconds,
                ar=self._ar_measured,
            )
        else:
            aware = spec.lam > 0 and self.drafter.predicts_experts
            counts = None
            if self.cost_model.needs_counts(n) and stats.tokens_per_expert is not None:
                counts = stats.tokens_per_expert.numpy()
            steps = drafter_steps(kd, stats.built_depth, spec) if kd > 0 else 0
            cost = self.cost_model.price(n, int(sum(stats.distinct_experts)), ctx, steps, spec.width, aware, counts,
                                         draft_rule(spec))  # fmt: skip
            if self.probe is not None and stats.probe_seconds > 0:  # probed: who pays, as env.replay's _set_probe
                K, W = self.probe
                if not self._own_probe:  # the context probe: every round, since nothing drafts from it
                    cost = replace(cost, draft=cost.draft + self.cost_model.context_probe(ctx))
                elif kd == 0:  # the drafter's own probe: a round that then drafted nothing
                    cost = replace(cost, draft=cost.draft + self.cost_model.probe(ctx, min(K, remaining - 1), W))
        if self.choice_seconds and not self._holding:  # the caller's choice before the round (module docstring)
            cost = replace(cost, choice=self.choice_seconds)
        if not self.measured:  # a request's first rounds after its prefill, as env.replay prices them; T_AR at its
            # position: plain decoding's round there (engine.cost.warmup)
            self._ar_warmup[rid] = self.cost_model.warmup(self.session.requests[rid].max_new - remaining)
            cost = replace(cost, warmup=self.cost_model.warmup(stats.round_index), ar=cost.ar + self._ar_warmup[rid])
            before = self.session.requests[rid].rounds  # this round is not in them yet (the engine's round_cost hook)
            previous = kind_of(before[-1].verified_tokens) if before else NONE
            cost = replace(cost, switch=self.cost_model.switch(previous, n > 1))  # engine.cost.switching
        self._costs[rid] = cost
        return cost.total, cost.ar

    def _measure_ar(self) -> float:
        """Median measured seconds of a plain-decode round (the measured T_AR) of the fastest plain engine: the
        target alone, without routing instrumentation, as env.host_calibration times T_AR for the fitted kind."""
        plain = engine.Engine(self.engine.target, instrument=False)
        res = plain.generate([self.prompts[0]], 12, sampling=self._params(0))
        secs = [r.round_seconds for r in res[0].rounds]
        return statistics.median(secs[2:] or secs)

    # ------------------------------------------------------------------ gymnasium API
    def _params(self, i: int) -> SamplingParams:
        s = self.sampling
        return s if s.greedy else replace(s, seed=int(s.seed) + i)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        options = options or {}
        if self.session is not None:
            self.session.close()
            self.session = None
        B = self.batch_size
        if "request" in options:
            first = int(options["request"])
            if not 0 <= first < len(self.prompts):
                raise ValueError(f"request {first} outside 0..{len(self.prompts) - 1}")
        else:
            first = int(self.np_random.integers(len(self.prompts)))
        self.request = first
        self.batch = [(first + j) % len(self.prompts) for j in range(B)]
        prompts = [self.prompts[i] for i in self.batch]
        params = [self._params(i) for i in self.batch]
        self.session = self.engine.start(prompts, self.max_new_tokens, sampling=params, eos_token_id=self.eos_token_id)
        self._pending: list[tuple] = []
        self._costs: dict[int, RoundCost] = {}
        self._prev_pairs: dict[int, int] = {}  # each request's last verification of a tree (overlap)
        self._pairs: dict[int, int] = {}  # each request's latest round (the batch's union of experts)
        self._key: dict[int, int] = {}
        self._latent: dict[int, np.ndarray] = {}
        self._root_token: dict[int, int] = {}
        for rid, p in zip(self.session.active, prompts):
            self._root_token[rid] = p[-1]
            if self.router is not None:
                self._key[rid] = self.router.sequence_key(p)
                self._latent[rid] = self.router.latent([self._key[rid]], None)[0]
        self._actions: list[list[int]] = []
        self._rewards: list[float] = []
        self._held: list[bool] = []  # per round: held unasked (engine.runtime.hold)
        self._stats: list[RoundStats] = []
        return self._observe(), {
            "request": first,
            "batch": list(self.batch),
            "position": 0,
            "prompt_len": len(prompts[0]),
        }

    def _observe(self) -> np.ndarray:
        L, _, r = self.routing_shape
        s = self.session
        rid = s.active[0] if s.active else 0
        req = s.requests[rid]
        probe = self._probe_now = s.probe(rid, *self.probe) if self.probe is not None and s.active else []
        obs = observe(
            req.rounds,
            position=len(req.new_tokens),
            max_new_tokens=req.max_new,
            prompt_len=len(req.prompt),
            batch_size=max(len(s.active), 1),
            calibration=self.calibration,
            top_k=r,
            num_moe_layers=L,
            probe=probe,
        )
        return obs.vector()

    def step(self, action: Any):
        if self.session is None or self.session.done:
            raise RuntimeError("call reset() before step() (and again after an episode ends)")
        if isinstance(action, engine.SpecConfig):  # any SpecConfig (heuristic policies); K, W checked by the engine
            spec, idx = action, action
        else:
            idx = self.codec.decode(action)
            spec = self.grid.spec(idx)
        reward, info = self._round(spec, idx)
        held = self.hold.held(spec.depth, self._probe_now) if self.hold else 0
        if held:  # the plain rounds held unasked after it (engine.runtime.hold), neither probed nor chosen
            infos = [info]
            self._holding = True
            try:
                while held and not self.session.done:
                    r, i = self._round(spec, idx)
                    reward += r
                    infos.append(i)
                    held -= 1
            finally:
                self._holding = False
            info = merge_infos(infos)
        s = self.session
        done = s.done
        terminated = done and all(s.requests[i].finish_reason == "eos" for i in range(len(s.requests)))
        truncated = done and not terminated
        obs = self._observe() if not done else self._final_obs(self._stepped[0])
        return obs, reward, terminated, truncated, info

    def _round(self, spec: Any, idx: Any) -> tuple[float, dict[str, Any]]:
        """One round of `spec` for the batch: (reward, info); a held round (`self._holding`) pays no choice."""
        s = self.session
        active = list(s.active)
        before = {rid: list(s.requests[rid].tokens) for rid in active}
        self._pending = [
            (rid, len(before[rid]) - 1, s.requests[rid].max_new - len(s.requests[rid].new_tokens), spec)
            for rid in active
        ]
        self._contexts = [ctx for _, ctx, _, _ in self._pending]
        stats = s.step([spec] * len(active))
        committed = 0
        for rid, st in zip(active, stats):
            committed += st.committed
            if self.router is not None:  # advance the identity chain over the committed tokens
                for tok in s.requests[rid].tokens[len(before[rid]) :]:
                    self._key[rid] = child_key(self._key[rid], tok)
                    self._latent[rid] = self.router.latent([self._key[rid]], self._latent[rid][None])[0]
            self._root_token[rid] = s.requests[rid].tokens[-1]
        costs = [self._costs.pop(rid) for rid in active]
        if len(active) == 1:
            cost = costs[0]
        else:
            cost = self._batch_cost(active, stats, costs)
        reward = committed - cost.total / cost.ar
        self._actions.append(idx if isinstance(idx, engine.SpecConfig) else list(idx))
        self._rewards.append(reward)
        self._held.append(self._holding)
        self._stats.extend(stats)
        self._stepped = active
        first = s.requests[active[0]]
        st0 = stats[0]
        info = {
            "committed": committed,
            "accepted": sum(x.accepted for x in stats),
            "verified": sum(x.verified_tokens for x in stats),
            "drafted": sum(x.proposed for x in stats),
            "cost": cost.total,
            "cost_draft": cost.draft,
            "cost_verify": cost.verify,
            "cost_book": cost.book,
            "cost_choice": cost.choice,
            "cost_warmup": cost.warmup,
            "cost_switch": cost.switch,
            "cost_ar": cost.ar,
            "distinct_experts": sum(st0.distinct_experts) if len(active) == 1 else self._last_union,
            "utility": committed * cost.ar / cost.total,
            "position": len(first.new_tokens),
            "request": self.request,
        }
        if self.measured:
            info["measured_seconds"] = st0.round_seconds
        info["held"] = int(self._holding)
        return reward, info

    def _final_obs(self, rid: int) -> np.ndarray:
        L, _, r = self.routing_shape
        req = self.session.requests[rid]
        return observe(
            req.rounds,
            position=len(req.new_tokens),
            max_new_tokens=req.max_new,
            prompt_len=len(req.prompt),
            batch_size=1,
            calibration=self.calibration,
            top_k=r,
            num_moe_layers=L,
        ).vector()

    def _batch_cost(self, active: list[int], stats: list[RoundStats], costs: list[RoundCost]) -> RoundCost:
        """One batched forward: Σ n tokens over the union of the batch's experts; drafting batched too."""
        self._last_union = 0
        if self.measured or self.cost_model is None:
            st = stats[0]
            return RoundCost(
                draft=st.time.get("draft", 0.0),
                verify=st.time.get("forward", 0.0),
                book=st.host_seconds,
                ar=self._ar_measured,
            )
        n = sum(x.verified_tokens for x in stats)
        if self.router is None:
            union = torch.zeros_like(stats[0].tokens_per_expert, dtype=torch.bool)
            counts = torch.zeros_like(stats[0].tokens_per_expert)
            for x in stats:
                union |= x.tokens_per_expert > 0
                counts += x.tokens_per_expert
            distinct, counts_np = int(union.sum()), counts.numpy()
        else:
            union_bits = 0
            for rid in active:
                union_bits |= self._pairs[rid]
            distinct, counts_np = union_bits.bit_count(), None
        self._last_union = distinct
        ctx = int(round(sum(self._contexts) / len(self._contexts)))  # attention priced at the mean context
        L, E, r = self.routing_shape
        B = len(active)
        verify = self.cost_model.verify(n, distinct, ctx, counts_np if self.cost_model.needs_counts(n) else None)
        roots = int(round(L * E * (1.0 - (1.0 - r / E) ** B)))  # B roots under independent routing
        ar = self.cost_model.verify(
            B, roots, ctx, None if not self.cost_model.needs_counts(B) else np.full((L, E), -(-B * r // E))
        )
        draft = max(c.draft for c in costs)  # one batched drafter forward per depth: priced as the deepest request's
        cm = self.cost_model  # host work: the batch-1 fit at the batch's tokens (env.costs: timed at batch 1)
        # one forward: its warm-up surcharge is the batch's earliest round's, T_AR's the earliest position's, its
        # switching surcharge the largest of its requests'
        warm, ar_warm = max(c.warmup for c in costs), max(self._ar_warmup.get(rid, 0.0) for rid in active)
        return RoundCost(draft=draft, verify=verify, book=cm.book(n), ar=ar + cm.book_ar() + ar_warm, warmup=warm,
                         switch=max(c.switch for c in costs))  # fmt: skip

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None

    # ------------------------------------------------------------------ states
    def episode_state(self) -> dict[str, Any]:
        """The episode as a state that Replay-v0's `validate` replays (same fields as its episode_state)."""
        return {
            "env": "expertspec/Live-v0",
            "trace": None,
            "prompt": list(self.prompts[self.request]) if self.request is not None else None,
            "sampling": None
            if self.sampling.greedy
            else {"temperature": self.sampling.temperature, "seed": self._params(self.request or 0).seed},
            "target_digest": self.info_models.target_digest,
            "drafter_digest": self.info_models.drafter_digest,
            "request": self.request,
            "actions": [a if isinstance(a, engine.SpecConfig) else list(a) for a in self._actions],  # per round
            "held": list(self._held),
            "rewards": list(self._rewards),
            "committed": [s.committed for s in self._stats],
            "accepted": [s.accepted for s in self._stats],
            "distinct_experts": [list(s.distinct_experts) for s in self._stats],
            "cost": [s.cost for s in self._stats],
        }


def _as_sampling(sampling: dict | SamplingParams | None) -> SamplingParams:
    if sampling is None:
        return SamplingParams()
    if isinstance(sampling, SamplingParams):
        return sampling
    if isinstance(sampling, Mapping):
        s = dict(sampling)
        if float(s.get("temperature", 0.0)) > 0:
            s.setdefault("mode", "position")
        return SamplingParams(**s)
    raise TypeError(f"sampling must be a dict, SamplingParams or None, got {type(sampling).__name__}")
