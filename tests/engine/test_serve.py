"""The OpenAI-compatible server (engine.serve) over real HTTP on 127.0.0.1: greedy and seeded output ==
Engine.generate token for token under concurrency with a deployed policy, streaming == non-streaming, the
openai client, every bad input (and every unsupported feature) a 400 naming the field, disconnects / errors
free every KV block (checked through the engine), a request whose engine step raises fails alone while the
others equal Engine.generate, a burst beyond capacity gets 429/503 and never hangs, metrics (utility priced
by the default cost model), SIGTERM drains. A frozen learned policy over HTTP: tests/ctrl/test_serve_policy.py."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from http_server import free_port as _free_port
from http_server import serving as _server

import engine
from engine.drafting.model_drafter import ModelDrafter
from engine.paths import REPO_ROOT, zoo_path
from engine.serve.scheduler import Scheduler
from engine.workloads import code_prompts, encode, prose_prompts

uvicorn = pytest.importorskip("uvicorn")
EOS = 0
FAIL_LEN = 13  # the test policy raises for prompts of exactly this many tokens
POISON = 4095  # the test drafter raises inside the engine step for prompts starting with this token


class BatchPolicy:
    """Speculate deeper when the batch is small (a stand-in for a frozen policy: any callable works)."""

    def __init__(self) -> None:
        self.batch_sizes: set[int] = set()

    def __call__(self, obs):
        self.batch_sizes.add(obs.batch_size)
        if obs.prompt_len == FAIL_LEN:
            raise RuntimeError("policy exploded on purpose")
        return engine.SpecConfig(depth=4 if obs.batch_size <= 2 else 1)


class PoisonDrafter:
    """The zoo drafter, except that `commit` raises inside the batched step for a request whose prompt starts with
    POISON, after the requests before it in the batch have committed their round (a fault mid-step)."""

    def __init__(self, inner, gate: threading.Event | None = None) -> None:
        self.inner, self.raised, self.gate = inner, 0, gate
        self.predicts_experts = inner.predicts_experts

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def commit(self, seq_id, tokens, *args, **kwargs):
        if tokens[0] == POISON:
            self.raised += 1
            raise RuntimeError("drafter exploded on purpose")
        if self.gate is not None:  # the step waits until the test opens the gate (at most 60 s)
            self.gate.wait(60)
        return self.inner.commit(seq_id, tokens, *args, **kwargs)


@pytest.fixture(scope="module")
def zoo():
    target = engine.load_model(zoo_path("tiny-moe"))
    drafter = engine.load_model(zoo_path("tiny-dense"))
    prompts = encode(target.tokenizer, code_prompts(8) + prose_prompts(8), 48)
    prompts = [p[: 8 + 3 * i] for i, p in enumerate(prompts)]  # mixed lengths 8 .. 53
    assert FAIL_LEN not in {len(p) for p in prompts}
    return target, drafter, prompts


@pytest.fixture(scope="module")
def served(zoo):
    target, drafter, _ = zoo
    policy = BatchPolicy()
    eng = engine.Engine(target, drafter, num_blocks=96)
    sched = Scheduler(eng, target.tokenizer, policy=policy, max_batch=6, max_queue=32, eos_token_id=EOS)
    with _server(sched) as url:
        yield url, sched, policy


def _complete(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def _stream_ids(url: str, body: dict) -> list[int]:
    ids = []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                ids += chunk["choices"][0].get("token_ids") or []
    return ids


def _wait_for(ready, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def _reference(target, prompt, n, **kw):
    return engine.Engine(target).generate([prompt], n, eos_token_id=EOS, **kw)[0].token_ids


def _quiescent(sched: Scheduler) -> None:
    assert sched.wait_idle(20)
    time.sleep(0.05)  # the loop closes an idle session right after its last round
    sched.engine.kv.check_quiescent()


def test_concurrent_greedy_equals_target_only_generate(zoo, served):
    """16 simultaneous requests of mixed lengths, 6 running at most (the rest queue and join between rounds),
    speculating under a policy that sees the batch size == target-only greedy, token for token."""
    target, _, prompts = zoo
    url, sched, policy = served
    lengths = [6 + (5 * i) % 19 for i in range(len(prompts))]
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(_complete, url, prompt=p, max_tokens=n, temperature=0, return_token_ids=True)
                   for p, n in zip(prompts, lengths)]  # fmt: skip
        responses = [f.result() for f in futures]
    for p, n, r in zip(prompts, lengths, responses):
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        ref = _reference(target, p, n)
        assert choice["token_ids"] == ref
        assert choice["text"] == target.tokenizer.decode(ref)
        assert r.json()["usage"]["completion_tokens"] == len(ref)
    assert max(policy.batch_sizes) > 2  # the policy saw the load (K=1 there, K=4 at batch <= 2)
    _quiescent(sched)


def test_seeded_sampling_equals_engine(zoo, served):
    target, drafter, prompts = zoo
    url, sched, policy = served
    r = _complete(url, prompt=prompts[3], max_tokens=20, temperature=0.8, top_p=0.9, seed=7, return_token_ids=True)
    sp = engine.SamplingParams(temperature=0.8, top_p=0.9, seed=7)
    ref = engine.Engine(target, drafter).generate([prompts[3]], 20, sampling=sp, policy=BatchPolicy(), eos_token_id=EOS)
    assert r.json()["choices"][0]["token_ids"] == ref[0].token_ids


def test_openai_client_streaming_equals_non_streaming(zoo, served):
    openai = pytest.importorskip("openai")
    url, _, _ = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny-moe"]
    kw = dict(model="tiny-moe", prompt="def fibonacci(n):", max_tokens=24, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    chunks = [c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices]
    assert len(chunks) > 2 and "".join(chunks) == full
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a list?"}]
    chat = client.chat.completions.create(model="tiny-moe", messages=msgs, max_tokens=16, temperature=0)
    stream = client.chat.completions.create(model="tiny-moe", messages=msgs, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True})  # fmt: skip
    parts, use = [], None
    for c in stream:
        use = c.usage or use
        parts += [c.choices[0].delta.content or ""] if c.choices else []
    assert "".join(parts) == chat.choices[0].message.content and chat.choices[0].finish_reason == "length"
    assert use.completion_tokens == chat.usage.completion_tokens == 16


def test_stop_string_cuts_the_text(zoo, served):
    target, _, prompts = zoo
    url, sched, _ = served
    full = target.tokenizer.decode(_reference(target, prompts[0], 24))
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    r = _complete(url, prompt=prompts[0], max_tokens=24, temperature=0, stop=[stop]).json()["choices"][0]
    assert r["finish_reason"] == "stop" and r["text"] == full[: full.find(stop)]
    with httpx.stream("POST", url + "/v1/completions", json=dict(prompt=prompts[0], max_tokens=24, temperature=0,
                      stop=stop, stream=True), timeout=60) as s:  # fmt: skip
        texts = [httpx.Response(200, content=line[6:]).json()["choices"][0]["text"]
                 for line in s.iter_lines() if line.startswith("data: {")]  # fmt: skip
    assert "".join(texts) == r["text"]
    _quiescent(sched)


BAD = [
    ("malformed", b'{"prompt": "x", ', "JSON"),
    ("unknown field", {"prompt": "x", "frobnicate": 1}, "frobnicate"),
    ("max_tokens 0", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("temperature", {"prompt": "x", "temperature": 2.5}, "temperature"),
    ("top_p", {"prompt": "x", "top_p": 0}, "top_p"),
    ("n", {"prompt": "x", "n": 2}, "'n'"),
    ("seed", {"prompt": "x", "seed": -1}, "seed"),
    ("stop", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("missing prompt", {"max_tokens": 4}, "prompt"),
    ("token id", {"prompt": [1, 99999]}, "vocabulary"),
    ("empty prompt", {"prompt": ""}, "empty"),
    ("over-long", {"prompt": [5] * 1020, "max_tokens": 10}, "context length"),
]


@pytest.mark.parametrize("body,needle", [(b, n) for _, b, n in BAD], ids=[i for i, _, _ in BAD])
def test_bad_input_is_400_before_any_work(served, body, needle):
    url, sched, _ = served
    rounds, prompt_tokens = sched.rounds, sched.metrics.prompt_tokens._value.get()
    if isinstance(body, bytes):
        r = httpx.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    else:
        r = httpx.post(url + "/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
    assert sched.rounds == rounds and sched.metrics.prompt_tokens._value.get() == prompt_tokens


UNSUPPORTED = [
    ("completions", {"prompt": "x", "n": 2}, "n"),
    ("completions", {"prompt": "x", "logprobs": 1}, "logprobs"),
    ("completions", {"prompt": "x", "logprobs": 0}, "logprobs"),
    ("completions", {"prompt": "x", "echo": True}, "echo"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 3}, "n"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True}, "logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
]


@pytest.mark.parametrize("route,body,field", UNSUPPORTED, ids=[f"{r}-{f}" for r, _, f in UNSUPPORTED])
def test_unsupported_features_are_400_naming_the_field(served, route, body, field):
    """n > 1, log-probabilities and echo are not served: a 400 that names the field and says so."""
    url, sched, _ = served
    rounds = sched.rounds
    r = httpx.post(f"{url}/v1/{route}", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and f"field '{field}'" in err["message"] and "not supported" in err["message"]
    assert sched.rounds == rounds
    ok = {k: v for k, v in body.items() if k != field}
    assert httpx.post(f"{url}/v1/{route}", json={**ok, "max_tokens": 2, "logprobs": None}).status_code == 200


def test_bad_chat_input_is_400(served):
    url, _, _ = served
    for body, needle in [({"messages": []}, "messages"), ({"messages": [{"role": "robot", "content": "x"}]}, "role")]:
        r = httpx.post(url + "/v1/chat/completions", json=body)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_disconnects_and_failures_free_every_block(zoo, served, monkeypatch):
    """A client leaving mid-stream, a request whose policy raises (500 alone) and a lone request whose engine
    step raises (500): the others finish correctly and every KV block is free."""
    target, _, prompts = zoo
    url, sched, _ = served
    aborted = sched.metrics.success.labels(finished_reason="abort")._value.get()
    with ThreadPoolExecutor(3) as pool:
        ok = pool.submit(_complete, url, prompt=prompts[5], max_tokens=30, temperature=0, return_token_ids=True)
        bad = pool.submit(_complete, url, prompt=[7] * FAIL_LEN, max_tokens=30, temperature=0)
        with httpx.stream("POST", url + "/v1/completions", json=dict(prompt=prompts[2], max_tokens=200,
                          temperature=0, stream=True), timeout=60) as s:  # fmt: skip
            next(s.iter_lines())  # the first chunk, then hang up
        assert bad.result().status_code == 500 and "policy exploded" in bad.result().json()["error"]["message"]
        assert ok.result().json()["choices"][0]["token_ids"] == _reference(target, prompts[5], 30)
    _quiescent(sched)
    assert sched.metrics.success.labels(finished_reason="abort")._value.get() == aborted + 1

    calls = {"n": 0}
    real = sched.engine._step

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected step failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(sched.engine, "_step", flaky)
    r = _complete(url, prompt=prompts[1], max_tokens=10, temperature=0)
    assert r.status_code == 500 and "injected step failure" in r.json()["error"]["message"]
    _quiescent(sched)
    r = _complete(url, prompt=prompts[1], max_tokens=10, temperature=0, return_token_ids=True)
    assert r.json()["choices"][0]["token_ids"] == _reference(target, prompts[1], 10)
    _quiescent(sched)


def test_a_request_whose_step_raises_fails_alone(zoo):
    """17 concurrent requests (8 running at most, half of them streaming), one of which makes the batched engine
    step raise mid-commit: the session rolls the step back and the scheduler bisects it, so only that request
    gets a 500 with the error; every other output equals target-only Engine.generate token for token (nothing
    committed or streamed twice), and every target and drafter KV block is free afterwards."""
    target, drafter, prompts = zoo
    assert all(p[0] != POISON for p in prompts)
    lengths = [6 + (7 * i) % 17 for i in range(len(prompts))]
    bodies = [dict(prompt=p, max_tokens=n, temperature=0, return_token_ids=True) for p, n in zip(prompts, lengths)]
    culprit = dict(prompt=[POISON] + prompts[0][1:], max_tokens=20, temperature=0)
    gate = threading.Event()
    poison = PoisonDrafter(ModelDrafter(drafter), gate)
    eng = engine.Engine(target, poison, num_blocks=160)
    sched = Scheduler(eng, target.tokenizer, spec=engine.SpecConfig(depth=3), max_batch=8, eos_token_id=EOS)
    order = [0, 1, 2, len(bodies), *range(3, len(bodies))]  # the culprit 4th: others commit before it

    def arrived() -> int:  # requests the scheduler holds (none finishes while the gate is shut)
        with sched.cond:
            return len(sched.queue) + len(sched.running)

    def call(k: int):
        # requests arrive one by one in `order` while the first step waits at the gate; once all are in, the gate
        # opens and the culprit is admitted in FIFO order beside the requests before and after it, so its first
        # step is a batched one, whatever the threads' timing
        _wait_for(lambda: arrived() >= k, f"request {k} of {len(order)} to be queued")
        i = order[k]
        if i == len(bodies):
            return _complete(url, **culprit)
        return _stream_ids(url, bodies[i]) if i % 2 else _complete(url, **bodies[i])

    def open_gate() -> None:
        _wait_for(lambda: arrived() == len(order), "all requests")
        gate.set()

    with _server(sched) as url, ThreadPoolExecutor(len(bodies) + 2) as pool:
        opened = pool.submit(open_gate)
        results = dict(zip(order, pool.map(call, range(len(order)))))
        opened.result()  # the gate opened once every request was queued
        bad = results.pop(len(bodies))
        assert bad.status_code == 500, bad.text
        assert "generation failed for this request" in bad.json()["error"]["message"]
        assert "drafter exploded" in bad.json()["error"]["message"]
        for i, got in results.items():
            if not i % 2:
                assert got.status_code == 200, got.text
                got = got.json()["choices"][0]["token_ids"]
            assert got == _reference(target, prompts[i], lengths[i]), i
        assert poison.raised >= 2  # the batched step and the culprit's step alone (bisection)
        assert sched.metrics.errors.labels(code="500")._value.get() == 1
        _quiescent(sched)
        assert eng.kv.num_free_blocks == eng.kv.num_blocks
        poison.inner.kv.check_quiescent()


def test_burst_beyond_capacity_is_refused_not_hung(zoo):
    target, _, prompts = zoo
    eng = engine.Engine(target, num_blocks=64)
    scratch = Scheduler(eng, target.tokenizer).scratch_blocks
    eng = engine.Engine(target, num_blocks=7 + scratch + 2)  # room for one request of 64 + 40 tokens at a time
    sched = Scheduler(eng, target.tokenizer, max_batch=4, max_queue=2, queue_timeout=0.3, eos_token_id=EOS)
    with _server(sched) as url, ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(_complete, url, prompt=[5 + i] * 64, max_tokens=40, temperature=0) for i in range(8)]
        codes = sorted(f.result().status_code for f in futures)  # httpx's 60 s timeout bounds any hang
        assert 200 in codes and set(codes) <= {200, 429, 503} and (429 in codes or 503 in codes), codes
        refused = [f.result().json()["error"]["message"] for f in futures if f.result().status_code != 200]
        assert all("queue is full" in m or "no KV capacity" in m for m in refused)
        r = _complete(url, prompt=[5] * 64, max_tokens=200)
        assert r.status_code == 400 and "KV blocks" in r.json()["error"]["message"]
        _quiescent(sched)


def _metric(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(f"expertspec:{name} "))


def test_metrics_exposed(served):
    url, sched, _ = served
    before = _metric(httpx.get(url + "/metrics").text, "request_utility_count")
    _complete(url, prompt=[3, 4, 5, 6], max_tokens=12, temperature=0)
    text = httpx.get(url + "/metrics").text
    assert sched.round_cost is not None and sched.round_cost.name.startswith("roofline:cpu:target")  # the default
    assert _metric(text, "request_utility_count") == before + 1 and _metric(text, "request_utility_sum") > 0
    assert _metric(text, "spec_round_cost_seconds_total") > 0 and _metric(text, "spec_round_cost_ar_steps_total") > 0
    for name in ["num_requests_running", "num_requests_waiting", "kv_blocks_in_use", "kv_cache_usage_perc",
                 "time_to_first_token_seconds_bucket", "request_time_per_output_token_seconds_bucket",
                 "inter_token_latency_seconds_bucket", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_per_pos_total{position=\"0\"}", "spec_rounds_total",
                 "spec_committed_tokens_total", "request_tau_bucket", "distinct_experts_per_layer_bucket",
                 "policy_depth_bucket", "request_success_total{finished_reason=\"length\"}"]:  # fmt: skip
        assert f"expertspec:{name}" in text, name
    assert httpx.get(url + "/health").json() == {"status": "ok"}


def test_entry_point_serves_and_sigterm_drains(zoo):
    """`python -m engine.serve` (static speculation): SIGTERM mid-stream finishes the request, then exits 0."""
    target, _, prompts = zoo
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "engine.serve", f"port={port}", "policy=static-3",
                             "kv_tokens=2048"], cwd=REPO_ROOT, env=env)  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(300):
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health").status_code == 200:
                    break
            time.sleep(0.1)
        body = dict(prompt=prompts[4], max_tokens=120, temperature=0, stream=True, return_token_ids=True)
        ids, reason = [], None
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as s:
            for i, line in enumerate(s.iter_lines()):
                if i == 0:
                    proc.send_signal(signal.SIGTERM)
                if line.startswith("data: {"):
                    choice = httpx.Response(200, content=line[6:]).json()["choices"][0]
                    ids += choice["token_ids"]
                    reason = choice["finish_reason"] or reason
        assert reason == "length" and ids == _reference(target, prompts[4], 120)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_session_cancel_frees_blocks_and_leaves_the_others_alone(zoo):
    """Session.cancel (the scheduler's disconnect path): the cancelled request's blocks are free at once and
    the other request's tokens are those of running alone."""
    target, _, prompts = zoo
    eng = engine.Engine(target, num_blocks=64)
    session = eng.start([prompts[0]], 16, reserve_tokens=256)
    (other,) = session.add([prompts[1]], 16)
    free = eng.kv.num_free_blocks
    session.step()
    session.cancel(0)
    assert session.active == [other] and eng.kv.num_free_blocks == free + eng.kv.blocks_needed(len(prompts[0]) + 16)
    while not session.done:
        session.step()
    assert session.results()[other].token_ids == _reference(target, prompts[1], 16)
    assert session.results()[0].finish_reason == "abort"
    session.close()
    eng.kv.check_quiescent()
