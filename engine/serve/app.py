"""The FastAPI app: OpenAI-compatible routes over a `Scheduler` (engine.serve.scheduler).

    POST /v1/completions        prompt (str | token ids) -> text; stream=true: SSE chunks, then [DONE]
    POST /v1/chat/completions   messages -> the simple chat template (engine.serve.protocol) -> text
    GET  /v1/models             the one served model
    GET  /health                200 while serving, 503 while draining
    GET  /metrics               Prometheus text (engine.serve.metrics)

Everything a request can get wrong is a 400 before any engine work (schema, prompt tokens, context length,
KV capacity); a full queue is a 429 and draining a 503. A streaming client that disconnects, or a
non-streaming one whose connection closes, is cancelled in the scheduler: its KV blocks are free the
next round. The app's lifespan starts the scheduler thread and, on shutdown (uvicorn's SIGTERM handling
stops accepting and waits for open requests first), drains it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_body,
    chat_prompt,
    completion_body,
    error_body,
    new_id,
    usage,
    validation_message,
)
from engine.serve.scheduler import Job, Refused, Scheduler
from engine.spec.sampling import SamplingParams

DISCONNECT_POLL = 0.25  # seconds between disconnect checks of a non-streaming request


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status)


def make_app(scheduler: Scheduler, model_name: str, drain_timeout: float = 60.0) -> FastAPI:
    """The server app over `scheduler` (started and drained by the app's lifespan)."""
    tok = scheduler.tokenizer
    vocab = scheduler.engine.target.vocab_size

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        yield
        await asyncio.to_thread(scheduler.stop, True, drain_timeout)

    app = FastAPI(title="expertspec", lifespan=lifespan)
    app.state.scheduler = scheduler

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(exc.errors()))
        return _error(400, message, param)

    @app.get("/health")
    async def health() -> Response:
        if scheduler.draining:
            return _error(503, "draining")
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": model_name, "object": "model", "created": 0, "owned_by": "expertspec",
                "max_model_len": scheduler.context}  # fmt: skip
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(scheduler.metrics.render(), media_type="text/plain; version=0.0.4")

    def _prepare(body, prompt: str | list[int], max_tokens: int) -> tuple[Job, asyncio.Queue] | JSONResponse:
        if body.model is not None and body.model != model_name:
            return _error(404, f"model {body.model!r} is not served here; this server serves {model_name!r}", "model")
        if isinstance(prompt, str):
            ids = tok.encode(prompt).ids
        else:
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                return _error(400, f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})", "prompt")
        if not ids:
            return _error(400, "the prompt is empty: it needs at least one token", "prompt")
        sampling = SamplingParams(temperature=body.temperature, top_p=body.top_p, seed=body.seed)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emit(event: tuple) -> None:
            with contextlib.suppress(RuntimeError):  # the event loop is gone (shutdown): nobody listens
                loop.call_soon_threadsafe(events.put_nowait, event)

        job = Job(prompt_ids=ids, max_tokens=max_tokens, sampling=sampling, emit=emit, stop=body.stop_list())
        try:
            scheduler.submit(job)
        except Refused as err:
            return _error(err.status, err.message, err.param)
        return job, events

    async def _serve(request: Request, body, prompt, max_tokens: int, chat: bool) -> Response:
        prepared = _prepare(body, prompt, max_tokens)
        if isinstance(prepared, JSONResponse):
            return prepared
        job, events = prepared
        rid = new_id("chatcmpl" if chat else "cmpl")
        shape = chat_body if chat else completion_body
        ids = body.return_token_ids
        if body.stream:
            return StreamingResponse(_stream(job, events, rid, shape, ids, body.include_usage(), chat),
                                     media_type="text/event-stream")  # fmt: skip
        text, token_ids = [], []
        try:
            while True:
                try:
                    event = await asyncio.wait_for(events.get(), DISCONNECT_POLL)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        scheduler.cancel(job)
                        return Response(status_code=499)
                    continue
                if event[0] == "delta":
                    text.append(event[1])
                    token_ids.extend(event[2])
                elif event[0] == "error":
                    return _error(event[1], event[2])
                else:
                    use = usage(len(job.prompt_ids), len(token_ids))
                    return JSONResponse(shape(rid, model_name, "".join(text), event[1], token_ids if ids else None,
                                              use, False))  # fmt: skip
        finally:
            if not job.finished:
                scheduler.cancel(job)

    async def _stream(job, events, rid, shape, ids, include_usage, chat) -> AsyncIterator[str]:
        n_tokens = 0
        try:
            if chat:  # the role chunk first, as OpenAI sends it
                yield _sse(shape(rid, model_name, "", None, None, None, True, first=True))
            while True:
                event = await events.get()
                if event[0] == "delta":
                    n_tokens += len(event[2])
                    extra = {"first": False} if chat else {}
                    yield _sse(shape(rid, model_name, event[1], None, event[2] if ids else None, None, True, **extra))
                elif event[0] == "error":
                    yield _sse(error_body(event[2], event[1]))
                    break
                else:
                    extra = {"first": False} if chat else {}
                    yield _sse(shape(rid, model_name, "", event[1], [] if ids else None, None, True, **extra))
                    if include_usage:
                        body = shape(rid, model_name, "", None, None, usage(len(job.prompt_ids), n_tokens), True,
                                     **extra)  # fmt: skip
                        body["choices"] = []
                        yield _sse(body)
                    break
            yield "data: [DONE]\n\n"
        finally:  # the client disconnected (the generator was closed) or we are done
            if not job.finished:
                scheduler.cancel(job)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _serve(request, body, body.prompt, body.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _serve(request, body, chat_prompt(body.messages), body.new_tokens(16), chat=True)

    return app


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body)}\n\n"
