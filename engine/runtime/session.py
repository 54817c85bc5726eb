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
Observation); a list with one action per active request; or a dict {request id: action}. An action is
anything `coerce_action` takes (SpecConfig, dict, (K, W, λ)). Every action is validated before any work
of the step, so a bad action leaves the session as it was. An exception during a step's work marks the
session failed: `close()` then still releases every KV block.

Under expert parallelism (`Engine(ep=...)`) `step` and `done` are collective: call them in lockstep on
every rank (a rank with no active request runs the idle collectives).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from engine.models.kv_cache import KVCacheFull
from engine.runtime.observation import Observation
from engine.runtime.policy import Policy, coerce_action
from engine.runtime.stats import GenerationResult, RoundStats
from engine.spec.config import NO_SPEC, SpecConfig
from engine.spec.sampling import SamplingParams, make_generator


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
        except BaseException as err:
            self.failed = err
            raise
        self._active.extend(new)
        return [r.index for r in new]

    # ------------------------------------------------------------------ stepping
    def observation(self, request_id: int) -> Observation:
        """The Observation a policy gets before the next round of request `request_id`."""
        r = self.requests[request_id]
        return self.engine.observe_request(r, batch_size=len(self._active))

    def _specs(self, actions: Any) -> list[SpecConfig]:
        active = self._active
        if actions is None:
            if self.policy is None or self.engine.drafter is None:
                return [self.spec or NO_SPEC] * len(active)
            return [coerce_action(self.policy(self.observation(r.index))) for r in active]
        if isinstance(actions, Mapping):
            ids = set(self.active)
            if set(actions) != ids:
                raise ValueError(f"actions name requests {sorted(actions)} but the active ones are {sorted(ids)}")
            actions = [actions[r.index] for r in active]
        elif isinstance(actions, (SpecConfig, str, bytes)) or not isinstance(actions, Sequence):
            raise ValueError(
                f"step(actions) takes None, a list with one action per active request ({len(active)}), or a dict "
                f"{{request id: action}}; got {type(actions).__name__}"
            )
        if len(actions) != len(active):
            raise ValueError(f"step got {len(actions)} actions for {len(active)} active requests {self.active}")
        specs = [coerce_action(a) for a in actions]
        for s in specs:
            self.engine._check_spec(s)
        return specs

    @torch.inference_mode()
    def step(self, actions: Any = None) -> list[RoundStats]:
        """One round for every active request; returns its RoundStats per request (`active` order before the
        step). Finished requests leave the active set and free their KV blocks."""
        self._check_usable()
        active = list(self._active)
        if not active:
            if self.engine.ep is not None:
                self.engine.ep.idle_step()
            return []
        specs = self._specs(actions)  # validated before any work: a bad action leaves the session usable
        try:
            self.engine._step(active, self.kv, specs)
        except BaseException as err:
            self.failed = err
            raise
        for r in active:
            if r.finish_reason is not None:
                self._release(r)
        self._active = [r for r in self._active if r.finish_reason is None]
        return [r.rounds[-1] for r in active]

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
