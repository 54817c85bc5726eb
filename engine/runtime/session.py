"""A steppable engine session: one speculative round per active request per `step`.

    session = eng.start(prompts, max_new_tokens, sampling=..., eos_token_id=...)
    while not session.done:
        stats = session.step(actions)       # one action per active request (session.active order), or None
    results = session.results()            # list[GenerationResult], in the order requests were added
    session.close()                        # every KV block free again (also after an exception)

`Engine.generate` is exactly this loop. Requests may join a running session between steps
(`session.add(...)`, continuous batching) and leave early (`session.cancel(rid)`, a client gone): a
request's tokens and random stream depend only on its own prompt, sampling parameters and actions, never
on the other requests in the batch.

Actions: None -> the session's `spec` (or its `policy`, consulted per request with the request's
Observation, with its observation vector when the policy has `act_vector`, or with its History when it has
`act_history`: `engine.runtime.policy`; a policy with a `probe` (depth, width) first gets this round's probe
values, as its observation's `confidence_now` and `match_now`: from a drafter that has `probe`, else from the
context probe, the prompt lookup over the request's tokens, engine.runtime.context_probe); a
list with one action per active request; or a dict {request id: action}, which steps only the requests it
names (the others wait a round). A policy with a `hold` (engine.runtime.hold) that chooses plain decoding may hold
it: the request's next rounds then decode plainly, neither probed nor asked (a failed step puts holds back too).
An action is anything `coerce_action` takes (SpecConfig, dict, (K, W, λ)).
Every action is validated before any work of the step, so a bad action leaves the session
as it was (`check_action` validates one ahead of time).

Failures are rolled back. An exception during a step's work is re-raised after every request of that step
is put back as it was before the step: committed tokens, rounds, observation history and random stream
(`torch.Generator` state) restored, scratch KV released, drafter state rebuilt from the committed tokens.
The step never writes the committed KV (it writes the root's slot, scratch slots, and copies accepted
nodes past the committed length), so target-only KV stays bit for bit; with a drafter the committed tokens
are prefilled again, as a fresh session would, for the drafter's target features. The session stays
usable: retry, step a subset (a dict) to find the request that fails, cancel it. A failed prefill in `add`
fails only the requests being added. Only when the rollback itself raises, or under expert parallelism
(collective), is the session marked failed: `close()` then still releases every KV block.

Under expert parallelism (`Engine(ep=...)`) `step` and `done` are collective: call them in lockstep on
every rank (a rank with no active request runs the idle collectives).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from engine.models.kv_cache import KVCacheFull
from engine.runtime.context_probe import ContextProbe
from engine.runtime.hold import Hold
from engine.runtime.observation import KMAX, History, Observation, observation_values, probe_values, probe_values_of
from engine.runtime.policy import Policy, coerce_action
from engine.runtime.stats import GenerationResult, RoundStats
from engine.spec.config import NO_SPEC, SpecConfig
from engine.spec.sampling import SamplingParams, make_generator


def _held_round(r: Any) -> SpecConfig:
    """Count down a request's hold (`r.held` > 0) and return the plain action that started it."""
    r.held -= 1
    return r.held_spec


def _start_hold(r: Any, hold: Hold, spec: SpecConfig, probe: list[float]) -> None:
    """After the choice of plain decoding `spec` with this round's probe values, hold it if `hold` says so."""
    r.held, r.held_spec = hold.held(0, probe), spec


def _unhold(held: list[tuple[Any, int, SpecConfig | None]]) -> None:
    """Put the requests' holds back as they were before a failed step's choice."""
    for r, n, spec in held:
        r.held, r.held_spec = n, spec


@dataclass(frozen=True)
class _Saved:
    """What a step changes in one request record (engine.runtime.engine._Request), to undo a failed step."""

    num_tokens: int
    num_new: int
    num_rounds: int
    finish_reason: str | None
    prev_pairs: Any
    history: History
    rng_state: torch.Tensor

    @classmethod
    def of(cls, r: Any) -> _Saved:
        h = r.history
        return cls(len(r.tokens), len(r.new_tokens), len(r.rounds), r.finish_reason, r.prev_pairs,
                   replace(h, acc=list(h.acc), tries=list(h.tries)), r.generator.get_state())  # fmt: skip

    def restore(self, r: Any) -> None:
        del r.tokens[self.num_tokens :], r.new_tokens[self.num_new :], r.rounds[self.num_rounds :]
        r.finish_reason, r.prev_pairs, r.history = self.finish_reason, self.prev_pairs, self.history
        r.generator.set_state(self.rng_state)


class Session:
    """Requests being generated together over the engine's paged KV cache (see the module docstring)."""

    def __init__(self, engine: Any, kv: Any, spec: SpecConfig | None, policy: Policy | None) -> None:
        """engine: the `engine.runtime.engine.Engine` that opened the session (it owns the model and caches;
        not imported here, so the session module sits below the engine module)."""
        self.engine = engine
        self.spec = spec
        self.policy = policy
        self.requests: list[Any] = []  # every request ever added, by id
        self._active: list[Any] = []
        self.failed: BaseException | None = None
        self.closed = False
        self.kv = kv  # the engine's PagedKVCache, sized by Engine.start
        self._policy_seconds: dict[int, float] = {}  # request id -> choosing its action this step
        self._probe_seconds: dict[int, float] = {}  # request id -> the drafter's probe before that choice
        # what the choice needs each round, looked up once: the policy's probe shape, the frozen policy's bound
        # chooser (FrozenPolicy.chooser), and the actions already validated against this engine (id -> action)
        self._probe_shape = getattr(policy, "probe", None)
        make = getattr(policy, "chooser", None)
        self._chooser = make(engine.calibration) if make is not None else None
        self._checked: dict[int, SpecConfig] = {}
        self._hold = Hold.of(getattr(policy, "hold", None))  # plain decoding held unasked (engine.runtime.hold)
        # the prompt lookup probing for a drafter without a probe (engine.runtime.context_probe), built before a round
        drafter = engine.drafter
        self._context = ContextProbe() if drafter is not None and getattr(drafter, "probe", None) is None else None
        self._probe_with_source = getattr(drafter, "probe_with_source", None)  # the lookup's probe in one call
        self._probe_fn = getattr(drafter, "probe", None)  # a drafter's own probe
        self._probed_source = getattr(drafter, "probed_source", None)  # ... and where its match comes from

    # ------------------------------------------------------------------ membership
    @property
    def active(self) -> list[int]:
        """Ids of the requests that take part in the next step, in the order `step` expects actions."""
        return [r.index for r in self._active]

    @property
    def done(self) -> bool:
        """True when no request is active (collective under EP: every rank must ask together)."""
        return not self.engine._any_active(bool(self._active))

    @torch.inference_mode()
    def add(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        eos_token_id: int | None = None,
    ) -> list[int]:
        """Admit requests (prefill them) and return their ids. Raises KVCacheFull, changing nothing, when
        the cache cannot hold them; validation errors are raised before any work."""
        self._check_usable()
        eng = self.engine
        sampling = eng.default_sampling if sampling is None else sampling
        params = eng._validate(prompts, max_new_tokens, sampling, self.spec, eos_token_id)
        kv = self.kv
        need = sum(kv.blocks_needed(len(p) + max_new_tokens) for p in prompts)
        scratch = sum(kv.blocks_needed(eng.scratch_tokens) + 1 for _ in self._active)  # next round's trees
        if need + scratch > kv.num_free_blocks:
            raise KVCacheFull(
                f"cannot admit {len(prompts)} request(s): {need} KV blocks needed, {kv.num_free_blocks - scratch} "
                f"free of {kv.num_blocks}; wait for running requests to finish or size the cache with "
                "Engine(num_blocks=...) / start(..., reserve_tokens=...)"
            )
        shared = isinstance(sampling, SamplingParams)
        new = []
        for j, (p, sp) in enumerate(zip(prompts, params)):
            rid = len(self.requests)
            gen = make_generator(sp.seed, j if shared else 0, eng.target.device)
            r = eng._new_request(rid, p, max_new_tokens, sp, gen)
            r.eos_token_id = eos_token_id
            kv.add_sequence(rid)
            kv.reserve(rid, len(p) + max_new_tokens)
            r.slot_table = kv.slots(rid, range(len(p) + max_new_tokens)).to(eng.target.device)
            self.requests.append(r)
            new.append(r)
        try:
            eng._admit(new, kv)
        except Exception as err:  # the running requests' KV is untouched: only the new ones fail
            for r in new:
                r.finish_reason = "error"
                self._release(r)
            if eng.ep is not None:  # a collective prefill failed on this rank: the ranks are out of step
                self.failed = err
            raise
        except BaseException as err:
            self.failed = err
            raise
        self._active.extend(new)
        return [r.index for r in new]

    # ------------------------------------------------------------------ stepping
    def observation(self, request_id: int, probe: Sequence[float] = ()) -> Observation:
        """The Observation a policy gets before the next round of request `request_id` (`probe`: its
        `confidence_now`, from `probe`)."""
        r = self.requests[request_id]
        return self.engine.observe_request(r, batch_size=len(self._active), probe=probe)

    def probe(self, request_id: int, depth: int, width: int) -> list[float]:
        """This round's probe values of request `request_id` before its action is chosen (a tree of at most `depth`,
        never past the request's token budget, as drafting, and `width`): from the drafter's `probe` its confidence
        per depth, with a drafter that has `probed_source` its `probe_values` (then the match's source); from a
        drafter without a probe the context probe's `probe_values` (the prompt lookup over the request's tokens,
        engine.runtime.context_probe); [] without a drafter or when nothing can be drafted. Timed into the round's
        `RoundStats.probe_seconds`; a drafter's own probe keeps what it found for this round's draft
        (NGramDrafter.probe)."""
        return self._probe(self.requests[request_id], depth, width)

    def _probe(self, r: Any, depth: int, width: int) -> list[float]:
        """`probe` of the request itself (the choice's hot path: no lookup by id)."""
        depth = min(int(depth), r.max_new - len(r.new_tokens) - 1)
        if depth <= 0 or width <= 0 or self.engine.drafter is None:
            return []
        fn, fused, source = self._probe_fn, self._probe_with_source, self._probed_source
        t0 = time.perf_counter()
        if fused is not None:  # the lookup's confidences and source in one call
            out = probe_values_of(*fused(r.index, r.tokens, depth, int(width)))
        elif fn is None:
            out = self._context.probe(r.tokens, len(r.prompt), depth, int(width))
        else:
            out = fn(r.index, r.tokens, depth, int(width))
            # the lookup's: where its match comes from, after the confidences (more than KMAX values: probe values)
            out = probe_values(out, source(r.index)) if source is not None else list(out)[:KMAX]
        self._probe_seconds[r.index] = self._probe_seconds.get(r.index, 0.0) + time.perf_counter() - t0
        return out

    def _choose(self, r: Any) -> Any:
        """The policy's action for request `r`'s next round; a policy with `act_history` gets the request's History,
        one with `act_vector` the observation vector's values straight from it (its calibrated block from the
        policy's own map, if it has one)."""
        shape = self._probe_shape
        return self._decide(r, self._probe(r, *shape) if shape else [])

    def _decide(self, r: Any, probe: list[float]) -> Any:
        """`_choose` after the probe (`probe`: this round's probe values)."""
        eng = self.engine
        top_k, layers = eng._obs_model
        act_history = getattr(self.policy, "act_history", None)
        if act_history is not None:  # the frozen policy: values and decision in one native call where it can
            return act_history(r.history, position=len(r.new_tokens), max_new_tokens=r.max_new,
                               batch_size=len(self._active), top_k=top_k, num_moe_layers=layers,
                               calibration=eng.calibration, probe=probe)  # fmt: skip
        act_vector = getattr(self.policy, "act_vector", None)
        if act_vector is None:
            return self.policy(self.observation(r.index, probe))
        cal = getattr(self.policy, "calibration", None)
        v = observation_values(r.history, position=len(r.new_tokens), max_new_tokens=r.max_new,
                               batch_size=len(self._active), calibration=eng.calibration if cal is None else cal,
                               top_k=top_k, num_moe_layers=layers, probe=probe)  # fmt: skip
        return act_vector(v)

    def _chosen(self, active: list[Any]) -> list[SpecConfig]:
        """The frozen policy's validated actions for `active` through its bound C++ chooser (FrozenPolicy.chooser):
        `_choose`'s chooser path with the per-request work the loop can hoist hoisted (the request's round is timed
        into `policy_seconds` as there, the probe apart), each action object validated once. A History the C++ reader
        does not take goes to `act_history`, its Python twin."""
        choose, checked, seconds, probed = self._chooser, self._checked, self._policy_seconds, self._probe_seconds
        top_k, layers = self.engine._obs_model
        shape, probe, n, clock, probe_of = self._probe_shape, [], len(self._active), time.perf_counter, self._probe
        depth, width = shape or (0, 0)
        # the lookup's probe in one call, inlined: `_probe`'s fused path without its frame and lookups (this loop is
        # the choice's hot path, and what runs here before the choose call is charged to it)
        fused = self._probe_with_source if shape and depth > 0 and width > 0 else None
        specs = []
        hold = self._hold
        for r in active:
            if r.held:  # a held round: plain decoding, neither probed nor asked (engine.runtime.hold)
                specs.append(_held_round(r))
                continue
            t0 = clock()
            if fused is not None:
                cap = r.max_new - len(r.new_tokens) - 1
                if cap > 0:
                    t1 = clock()
                    probe = probe_values_of(*fused(r.index, r.tokens, depth if depth < cap else cap, width))
                    probed[r.index] = probed.get(r.index, 0.0) + clock() - t1
                else:
                    probe = []
            elif shape:
                probe = probe_of(r, depth, width)
            try:
                action = choose(r.history, len(r.new_tokens), r.max_new, n, top_k, layers, probe)
            except (TypeError, ValueError, OverflowError):  # act_history, its Python twin
                action = self._decide(r, probe)
            spec = checked.get(id(action))
            if spec is not action:  # validated once per action object (the policy's cached ones)
                spec = self.check_action(action)
                if spec is action:  # a bounded set: one per grid action at most
                    checked[id(action)] = action  # kept alive here, so its id is never reused meanwhile
            specs.append(spec)
            seconds[r.index] = clock() - t0 - probed.get(r.index, 0.0)
            if hold and spec.depth == 0:
                _start_hold(r, hold, spec, probe)
        return specs

    def check_action(self, action: Any) -> SpecConfig:
        """`action` as the SpecConfig a step would run, or a ValueError saying why this engine cannot run it."""
        spec = coerce_action(action)
        self.engine._check_spec(spec)
        return spec

    def _specs(self, actions: Any) -> tuple[list[Any], list[SpecConfig]]:
        """(requests that take this step, their validated actions)."""
        active = list(self._active)
        if actions is None:
            if self.policy is None or self.engine.drafter is None:
                return active, [self.spec or NO_SPEC] * len(active)
            if self._chooser is not None:
                return active, self._chosen(active)
            specs = []
            for r in active:  # the controller's cost per request-round: RoundStats.policy_seconds (the probe apart)
                if r.held:  # a held round (engine.runtime.hold)
                    specs.append(_held_round(r))
                    continue
                t0 = time.perf_counter()
                shape = self._probe_shape
                probe = self._probe(r, *shape) if shape else []
                specs.append(self.check_action(self._decide(r, probe)))
                self._policy_seconds[r.index] = time.perf_counter() - t0 - self._probe_seconds.get(r.index, 0.0)
                if self._hold and specs[-1].depth == 0:
                    _start_hold(r, self._hold, specs[-1], probe)
            return active, specs
        if isinstance(actions, Mapping):
            ids = set(self.active)
            if not actions or not set(actions) <= ids:
                raise ValueError(f"actions name requests {sorted(actions)} but the active ones are {sorted(ids)}")
            stepping = [r for r in active if r.index in actions]
            return stepping, [self.check_action(actions[r.index]) for r in stepping]
        if isinstance(actions, (SpecConfig, str, bytes)) or not isinstance(actions, Sequence):
            raise ValueError(
                f"step(actions) takes None, a list with one action per active request ({len(active)}), or a dict "
                f"{{request id: action}}; got {type(actions).__name__}"
            )
        if len(actions) != len(active):
            raise ValueError(f"step got {len(actions)} actions for {len(active)} active requests {self.active}")
        specs = [coerce_action(a) for a in actions]
        for s in specs:
            self.engine._check_spec(s)
        return active, specs

    @torch.inference_mode()
    def step(self, actions: Any = None) -> list[RoundStats]:
        """One round for every active request (or those a dict of actions names); returns their RoundStats in
        `active` order. Finished requests leave the active set and free their KV blocks. An exception of the
        step's work is re-raised after rolling the step back (module docstring)."""
        self._check_usable()
        if not self._active:
            if self.engine.ep is not None:
                self.engine.ep.idle_step()
            return []
        started = time.perf_counter()  # the step's host work counts from here (RoundStats.host_seconds)
        self._policy_seconds.clear()
        held = [(r, r.held, r.held_spec) for r in self._active]  # the choice below may start or count down holds
        # probes made since the last step (`probe`, or the policy's choice below) belong to this step's rounds
        try:
            active, specs = self._specs(actions)  # validated before any work: a bad action leaves the session usable
        except Exception:
            _unhold(held)
            raise
        saved = [_Saved.of(r) for r in active]
        probing = {r.index: self._probe_seconds.pop(r.index) for r in active if r.index in self._probe_seconds}
        try:
            self.engine._step(active, self.kv, specs, started=started, choosing=sum(self._policy_seconds.values()),
                              probing=probing)  # fmt: skip
        except Exception as err:
            _unhold(held)
            self._roll_back(active, saved, err)
            raise
        except BaseException as err:
            self.failed = err
            raise
        for r in active:
            if r.index in self._policy_seconds:
                r.rounds[-1].policy_seconds = self._policy_seconds.pop(r.index)
            if r.finish_reason is not None:
                self._release(r)
        self._active = [r for r in self._active if r.finish_reason is None]
        return [r.rounds[-1] for r in active]

    def _roll_back(self, active: list[Any], saved: list[_Saved], err: BaseException) -> None:
        """Put the requests of a failed step back as they were before it (module docstring); mark the session
        failed when that is impossible."""
        for r, s in zip(active, saved):
            s.restore(r)
        eng = self.engine
        if eng.ep is not None:  # the ranks' collectives may be out of step: no way back
            self.failed = err
            return
        try:
            for r in active:
                if r.index in self.kv.scratch:
                    self.kv.release_scratch(r.index)
            if eng.drafter is not None:  # restart its state from the committed tokens (with their target features)
                for r in active:
                    eng.drafter.finish(r.index)
                eng._admit(active, self.kv)
        except Exception:  # noqa: BLE001 - the original error is the one raised; the session is unusable
            self.failed = err

    def cancel(self, request_id: int, reason: str = "abort") -> None:
        """Stop request `request_id` between steps (a client left, a stop string matched): it leaves the
        active set and its KV blocks are free now; its tokens so far stay in `results()`. Idempotent."""
        r = self.requests[request_id]
        if r.finish_reason is None:
            r.finish_reason = reason
        self._release(r)
        self._active = [a for a in self._active if a is not r]

    # ------------------------------------------------------------------ results / teardown
    def results(self) -> list[GenerationResult]:
        """Every request's result so far (new tokens only), in the order they were added."""
        return [
            GenerationResult(
                token_ids=list(r.new_tokens),
                rounds=list(r.rounds),
                finish_reason=r.finish_reason or "length",
                prompt_len=len(r.prompt),
            )
            for r in self.requests
        ]

    def _release(self, r: Any) -> None:
        if self.kv is not None and r.index in self.kv.seqs:
            self.kv.release(r.index)
        if self.engine.drafter is not None:
            self.engine.drafter.finish(r.index)

    def close(self) -> None:
        """Release every KV block (target scratch included) and the drafter's state; idempotent."""
        if self.closed:
            return
        for r in self.requests:
            self._release(r)
        if self.kv is not None:
            for seq_id in list(self.kv.scratch):
                self.kv.release_scratch(seq_id)
        self._active = []
        self.closed = True
        self.engine._session = None

    def _check_usable(self) -> None:
        if self.closed:
            raise RuntimeError("this session is closed; start a new one with Engine.start(...)")
        if self.failed is not None:
            raise RuntimeError(f"this session failed ({self.failed!r}); close() it and start a new one")

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
