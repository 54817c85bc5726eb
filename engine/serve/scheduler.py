"""Continuous batching: one background thread runs rounds of one engine `Session` for every HTTP request.

    HTTP handlers ──submit(Job)──> queue (bounded, FIFO) ──admit while KV + max_batch allow──> Session
                                                                                               │ step()
    handlers <──Job.emit(event)── decode committed tokens, stop strings, finish, metrics <─────┘

Each loop iteration, between rounds: drop cancelled jobs (a disconnected client's KV blocks are freed by
`Session.cancel` before the next step), refuse jobs that waited longer than `queue_timeout` (503), admit
queued jobs in arrival order while the cache holds them (`Session.add` raises KVCacheFull without side
effects, so a job that does not fit waits; nobody's committed tokens are ever evicted), ask the policy for
every running request (its Observation carries the batch size), run one `step`, emit what each request
committed. Only this thread touches the engine.

Failure isolation: a policy, invalid-action, decoding or stop-check error fails its own request (500) and the
others go on. An exception inside the batched `step` is rolled back by the session (engine.runtime.session:
every request of the step as before it, nothing committed, nothing emitted), so the loop bisects the step:
each half steps again on its own, recursively, and a request whose step fails alone gets a 500 while the others
commit this round. Only an unrecoverable session (its rollback failed) fails every running request; it is
closed (all KV blocks free) and queued requests get a new one.

Cost: every round is priced by `round_cost` (default: the roofline of the served target and drafter on this
machine's hardware profile, engine.cost.round_cost) for the per-request utility in /metrics: committed
tokens per target cost, Σ R / Σ (T_spec / T_AR) over the request's rounds.

Events sent to `Job.emit` (from this thread; the app hops them onto its event loop):
    ("delta", text, token_ids)   newly committed text (held back at a possible stop-string prefix)
    ("done", finish_reason)      "eos" | "length" | "stop"
    ("error", status, message)   429 / 503 / 500
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.cost.round_cost import serving_round_cost
from engine.models.kv_cache import KVCacheFull
from engine.runtime.policy import Policy
from engine.serve.metrics import ServeMetrics
from engine.spec.config import NO_SPEC, SpecConfig
from engine.spec.sampling import SamplingParams


class Refused(Exception):
    """A job refused at submission: `status` 429 (queue full), 503 (draining) or 400 (can never fit)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


@dataclass
class Job:
    """One HTTP request inside the scheduler."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    emit: Callable[[tuple], None]  # thread-safe sink of events (module docstring)
    stop: tuple[str, ...] = ()
    arrival: float = field(default_factory=time.perf_counter)
    rid: int | None = None  # session request id once admitted
    cancelled: bool = False
    finished: bool = False
    text: str = ""  # committed text, cut at a stop string
    sent: int = 0  # characters of `text` already emitted
    tokens_sent: int = 0
    first_time: float | None = None
    last_time: float | None = None
    priced_committed: int = 0  # committed tokens of the priced rounds
    cost_units: float = 0.0  # Σ T_spec / T_AR over them: utility = priced_committed / cost_units


class Scheduler:
    """The continuous-batching loop over `engine` (an `engine.Engine` with a fixed `num_blocks`).

    spec: the action of every round when there is no policy (None: target-only). policy: a callable
    Observation -> action (a frozen policy, or any plain function), consulted per request per round.
    max_batch: running requests at most; max_queue: waiting requests at most (beyond: 429);
    queue_timeout: seconds a job may wait for KV capacity before a 503. round_cost: RoundStats -> (T_spec, T_AR)
    for the utility metric, or a conf/hardware profile name for `serving_round_cost` ("auto": this machine's),
    or None (only rounds the engine priced itself, `Engine(round_cost=...)`, count).
    """

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        *,
        spec: SpecConfig | None = None,
        policy: Policy | None = None,
        max_batch: int = 16,
        max_queue: int = 64,
        queue_timeout: float = 30.0,
        eos_token_id: int | None = None,
        metrics: ServeMetrics | None = None,
        round_cost: Callable[[Any], tuple[float, float]] | str | None = "auto",
    ) -> None:
        if engine.num_blocks is None:
            raise ValueError("the server needs a fixed KV cache: Engine(target, num_blocks=...)")
        if policy is not None and engine.drafter is None:
            raise ValueError("a policy chooses speculation settings and needs a drafter")
        if spec is not None and spec.depth > 0 and engine.drafter is None:
            raise ValueError(f"static speculation {spec} needs a drafter")
        if max_batch < 1 or max_queue < 0 or queue_timeout <= 0:
            raise ValueError(f"need max_batch >= 1, max_queue >= 0, queue_timeout > 0; got {max_batch}, "
                             f"{max_queue}, {queue_timeout}")  # fmt: skip
        self.engine, self.tokenizer = engine, tokenizer
        self.spec, self.policy = spec, policy
        self.max_batch, self.max_queue, self.queue_timeout = max_batch, max_queue, queue_timeout
        self.eos_token_id = eos_token_id
        self.metrics = metrics or ServeMetrics()
        if isinstance(round_cost, str):
            try:
                round_cost = serving_round_cost(engine, round_cost)
            except ValueError:
                if round_cost != "auto":  # a named profile that does not exist; "auto" on a dense target: no cost
                    raise
                round_cost = None
        self.round_cost = round_cost
        self.context = engine.target.config.max_position_embeddings
        bs = engine.block_size
        self.scratch_blocks = -(-engine.scratch_tokens // bs) + 1  # one round's tree per running request
        if engine.drafter is not None:  # size the drafter's cache once for a full batch of full contexts
            engine.drafter.prepare([self.context] * max_batch)
        self.session = None
        self.queue: deque[Job] = deque()
        self.running: dict[int, Job] = {}
        self.cond = threading.Condition()
        self.draining = False
        self.stopped = False
        self.thread: threading.Thread | None = None
        self.rounds = 0

    # ------------------------------------------------------------------ handler side (any thread)
    def check_fits(self, n_prompt: int, max_tokens: int) -> None:
        """Raise Refused(400) for a request that no amount of waiting could serve."""
        if n_prompt + max_tokens > self.context:
            raise Refused(400, f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) exceeds the context "
                          f"length {self.context}", "prompt")  # fmt: skip
        kv = self.engine
        need = -(-(n_prompt + max_tokens) // kv.block_size) + self.scratch_blocks
        if need > kv.num_blocks:
            raise Refused(400, f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) needs {need} KV blocks but "
                          f"the server's cache has {kv.num_blocks}; lower max_tokens", "max_tokens")  # fmt: skip

    def submit(self, job: Job) -> None:
        """Queue a job or raise Refused (429 queue full, 503 draining, 400 never fits)."""
        self.check_fits(len(job.prompt_ids), job.max_tokens)
        with self.cond:
            if self.draining or self.stopped:
                self.metrics.rejected.labels(reason="draining").inc()
                raise Refused(503, "the server is shutting down and accepts no new requests")
            if len(self.queue) >= self.max_queue:
                self.metrics.rejected.labels(reason="queue_full").inc()
                raise Refused(429, f"the request queue is full ({self.max_queue} waiting for KV capacity, "
                              f"{len(self.running)} running); retry later")  # fmt: skip
            self.queue.append(job)
            self.metrics.waiting.set(len(self.queue))
            self.cond.notify()

    def cancel(self, job: Job) -> None:
        """The client left: the job's KV blocks are freed before the next round."""
        with self.cond:
            job.cancelled = True
            self.cond.notify()

    def start(self) -> None:
        self.thread = threading.Thread(target=self._loop, name="expertspec-scheduler", daemon=True)
        self.thread.start()

    def stop(self, drain: bool = True, timeout: float = 60.0) -> None:
        """Refuse new jobs; with `drain` finish queued and running ones first; then close the session."""
        with self.cond:
            self.draining = True
            if not drain:
                for job in list(self.queue) + list(self.running.values()):
                    job.cancelled = True
            self.cond.notify()
        if self.thread is not None:
            self.thread.join(timeout)
        with self.cond:
            self.stopped = True

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Block until nothing is queued or running (tests, drains)."""
        end = time.monotonic() + timeout
        with self.cond:
            while self.queue or self.running:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(min(left, 0.05))
        return True

    def kv_blocks_in_use(self) -> int:
        kv = self.engine.kv
        return 0 if kv is None else kv.num_blocks - kv.num_free_blocks

    # ------------------------------------------------------------------ the loop (scheduler thread)
    def _loop(self) -> None:
        try:
            while True:
                with self.cond:
                    while not (self.queue or self.running or self.draining):
                        self.cond.wait()
                    if self.draining and not self.queue and not self.running:
                        break
                self._iteration()
        finally:
            self._close_session()
            with self.cond:
                self.cond.notify_all()

    def _iteration(self) -> None:
        self._drop_cancelled()
        self._expire_queued()
        self._admit()
        if self.running:
            self._round()
        elif self.queue:  # waiting for capacity that nothing running will free: only the timeout helps
            time.sleep(0.005)
        self._gauges()

    def _drop_cancelled(self) -> None:
        with self.cond:
            gone = [j for j in self.queue if j.cancelled]
            for j in gone:
                self.queue.remove(j)
            running = [j for j in self.running.values() if j.cancelled]
        for j in running:
            self._end(j)
            self.session.cancel(j.rid, "abort")
            self.metrics.success.labels(finished_reason="abort").inc()

    def _expire_queued(self) -> None:
        now = time.perf_counter()
        with self.cond:
            late = [j for j in self.queue if now - j.arrival > self.queue_timeout]
            for j in late:
                self.queue.remove(j)
        for j in late:
            self.metrics.rejected.labels(reason="kv_timeout").inc()
            self._fail(j, 503, f"no KV capacity for this request within {self.queue_timeout:g} s "
                       f"({len(self.running)} running); retry later")  # fmt: skip

    def _admit(self) -> None:
        while len(self.running) < self.max_batch:
            with self.cond:
                if not self.queue:
                    return
                job = self.queue[0]
            try:
                if self.session is None:
                    self.session = self.engine.start([job.prompt_ids], job.max_tokens, sampling=job.sampling,
                                                     eos_token_id=self.eos_token_id)  # fmt: skip
                    rid = self.session.active[-1]
                else:
                    (rid,) = self.session.add([job.prompt_ids], job.max_tokens, job.sampling, self.eos_token_id)
            except KVCacheFull:
                return  # it waits (FIFO) until running requests free blocks, or its queue timeout
            except Exception as err:  # noqa: BLE001 - fails this job alone; a failed prefill also resets the session
                with self.cond:
                    self.queue.popleft()
                self._fail(job, 500, f"admission failed: {err!r}")
                if self.session is not None and self.session.failed is not None:
                    self._session_failed(self.session.failed)
                continue
            with self.cond:
                self.queue.popleft()
                job.rid = rid
                self.running[rid] = job
            self.metrics.prompt_tokens.inc(len(job.prompt_ids))

    def _actions(self) -> dict[int, SpecConfig]:
        if self.policy is None:
            return {rid: self.spec or NO_SPEC for rid in self.session.active}
        actions = {}
        for rid in list(self.session.active):
            try:
                actions[rid] = self.session.check_action(self.policy(self.session.observation(rid)))
            except Exception as err:  # noqa: BLE001 - a policy error or an action this engine cannot run: this one
                job = self.running[rid]
                self._end(job)
                self.session.cancel(rid, "error")
                self._fail(job, 500, f"the policy failed for this request: {err!r}")
        return actions

    def _round(self) -> None:
        actions = self._actions()
        if actions:
            self._step(actions)

    def _step(self, actions: dict[int, SpecConfig]) -> None:
        """One round for the requests of `actions`; a failed (rolled-back) step is bisected (module docstring)."""
        try:
            stats = self.session.step(actions)
        except Exception as err:  # noqa: BLE001
            if self.session.failed is not None:  # the rollback failed too: nothing to isolate
                self._session_failed(err)
                return
            if len(actions) == 1:  # it fails alone: the culprit
                (rid,) = actions
                job = self.running[rid]
                self._end(job)
                self.session.cancel(rid, "error")
                self._fail(job, 500, f"generation failed for this request: {err!r}")
                return
            items = list(actions.items())
            for half in (items[: len(items) // 2], items[len(items) // 2 :]):
                if self.session is not None:
                    self._step(dict(half))
            return
        self.rounds += 1
        now = time.perf_counter()
        for rid, s in zip(actions, stats):
            job = self.running.get(rid)
            cost = self._price(s)
            self.metrics.observe_round(s, cost)
            if job is None:
                continue
            if cost is not None:
                job.priced_committed += s.committed
                job.cost_units += cost[0] / cost[1]
            try:
                self._publish(job, now)
            except Exception as err:  # noqa: BLE001 - decoding / stop check: this request alone
                self._end(job)
                self.session.cancel(rid, "error")
                self._fail(job, 500, f"decoding the output failed: {err!r}")

    def _price(self, s: Any) -> tuple[float, float] | None:
        """(T_spec, T_AR) of a round: the engine's own pricing if it has one, else `round_cost`; None without."""
        if s.cost is not None and s.cost_ar:
            return s.cost, s.cost_ar
        if self.round_cost is None:
            return None
        try:
            t_spec, t_ar = self.round_cost(s)
        except Exception:  # noqa: BLE001 - a metric never fails a request: this round stays unpriced
            return None
        return (t_spec, t_ar) if t_spec > 0 and t_ar > 0 else None

    def _publish(self, job: Job, now: float) -> None:
        """Emit what `job` committed this round; finish it on EOS, length or a stop string."""
        r = self.session.requests[job.rid]
        tokens = list(r.new_tokens)
        text = self.tokenizer.decode(tokens)
        reason = r.finish_reason
        if job.stop:
            hits = [i for i in (text.find(s) for s in job.stop) if i >= 0]
            if hits:
                text, reason = text[: min(hits)], "stop"
        done = reason is not None
        safe = len(text)
        if not done:  # hold back an incomplete UTF-8 character and a possible stop-string prefix
            if text.endswith("\ufffd"):
                safe = len(text.rstrip("\ufffd"))
            if job.stop:
                safe = min(safe, max(len(text) - max(len(s) for s in job.stop) + 1, job.sent))
        new_ids = tokens[job.tokens_sent :]
        if len(tokens) > job.tokens_sent:
            if job.first_time is None:
                job.first_time = now
                self.metrics.ttft.observe(now - job.arrival)
            else:
                self.metrics.itl.observe(now - job.last_time)
            job.last_time = now
        if safe > job.sent or new_ids:
            job.emit(("delta", text[job.sent : safe], new_ids))
            job.sent, job.tokens_sent = max(safe, job.sent), len(tokens)
        job.text = text
        if done:
            if r.finish_reason is None:
                self.session.cancel(job.rid, "stop")
            self._end(job)
            n = len(tokens)
            if n > 1 and job.first_time is not None:
                self.metrics.tpot.observe((job.last_time - job.first_time) / (n - 1))
            self.metrics.e2e.observe(now - job.arrival)
            utility = job.priced_committed / job.cost_units if job.cost_units > 0 else None
            self.metrics.observe_finished(r.rounds, "stop" if reason in ("eos", "stop") else reason, utility)
            job.emit(("done", reason))

    # ------------------------------------------------------------------ bookkeeping
    def _end(self, job: Job) -> None:
        with self.cond:
            job.finished = True
            self.running.pop(job.rid, None)
            self.cond.notify_all()

    def _fail(self, job: Job, status: int, message: str) -> None:
        job.finished = True
        self.metrics.errors.labels(code=str(status)).inc()
        if not job.cancelled:
            job.emit(("error", status, message))

    def _session_failed(self, err: BaseException) -> None:
        """The batched step raised: fail every running request, free every block, start afresh."""
        for job in list(self.running.values()):
            self._end(job)
            self._fail(job, 500, f"generation failed in the batched engine step: {err!r}")
        self._close_session()

    def _close_session(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None

    def _gauges(self) -> None:
        if self.session is not None and not self.running and not self.queue:
            self._close_session()  # idle: drop the finished requests' records, every block is free
        m = self.metrics
        m.running.set(len(self.running))
        m.waiting.set(len(self.queue))
        used = self.kv_blocks_in_use()
        m.kv_blocks.set(used)
        m.kv_usage.set(used / self.engine.num_blocks)
