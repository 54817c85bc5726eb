"""OpenAI-compatible request / response schemas, validated before any work, and the error body.

Requests are pydantic models with `extra="forbid"`: an unknown field, a wrong type or an out-of-range
parameter is a 400 naming the field (`validation_message`), never a 422 and never a partial run.
Not served, each a 400 naming the field and saying so: `n` other than 1, `logprobs` (completions: any
value; chat: true) and `top_logprobs`, `echo=true`. `return_token_ids` is vLLM's extension: the choice then
carries the committed token ids, so a client can compare the server's output with `Engine.generate` token
for token.

Chat requests go through `chat_prompt`, a plain-text template ("System: ...", "User: ...",
"Assistant:"): the zoo checkpoints ship no chat template.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP = 4  # OpenAI's limit on stop sequences
_NO_LOGPROBS = "log-probabilities are not supported: this server returns tokens only (omit the field)"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """Fields shared by both endpoints (OpenAI defaults: temperature 1, top_p 1)."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    n: int = Field(1, description="only n=1 is served")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    return_token_ids: bool = False

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences, got {len(items)}")
        if any(not s for s in items):
            raise ValueError("stop sequences must be non-empty strings")
        return v

    @field_validator("n")
    @classmethod
    def _only_one(cls, v: int) -> int:
        if v != 1:
            raise ValueError(f"n={v} is not supported: one choice per request (n=1); send separate requests instead")
        return v

    def stop_list(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    """POST /v1/completions: one prompt, a string or a list of token ids."""

    prompt: str | list[int]
    max_tokens: int = Field(16, ge=1)  # OpenAI's completions default
    echo: bool = False
    logprobs: int | None = None

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo=true is not supported: the output never repeats the prompt")
        return v

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: int | None) -> int | None:
        if v is not None:
            raise ValueError(_NO_LOGPROBS)
        return v


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions (`max_completion_tokens` is the newer name of `max_tokens`)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None

    @field_validator("logprobs", "top_logprobs")
    @classmethod
    def _no_logprobs(cls, v: bool | int | None) -> bool | int | None:
        if v is not None and v is not False:
            raise ValueError(_NO_LOGPROBS)
        return v

    def new_tokens(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default


def chat_prompt(messages: list[ChatMessage]) -> str:
    """The simple chat template: one "Role: content" paragraph per message, then "Assistant:"."""
    parts = [f"{m.role.capitalize()}: {m.content}" for m in messages]
    return "\n\n".join(parts) + "\n\nAssistant:"


# ---------------------------------------------------------------------- responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def finish_reason(engine_reason: str | None) -> str | None:
    """Engine finish reasons -> OpenAI's: eos / stop string -> "stop", length -> "length"."""
    return None if engine_reason is None else {"eos": "stop", "stop": "stop"}.get(engine_reason, engine_reason)


def completion_body(
    rid: str, model: str, text: str, reason: str | None, token_ids: list[int] | None, use: dict | None, chunk: bool
) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason(reason)}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    body = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model, "choices": [choice]}
    if use is not None:
        body["usage"] = use
    return body


def chat_body(
    rid: str, model: str, text: str, reason: str | None, token_ids: list[int] | None, use: dict | None, chunk: bool,
    first: bool = False,
) -> dict[str, Any]:  # fmt: skip
    if chunk:
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason(reason)}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason(reason)}  # fmt: skip
        obj = "chat.completion"
    if token_ids is not None:
        choice["token_ids"] = token_ids
    body = {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [choice]}
    if use is not None:
        body["usage"] = use
    return body


# ---------------------------------------------------------------------- errors
def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    kind = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error", 503: "service_unavailable"}
    return {"error": {"message": message, "type": kind.get(status, "server_error"), "param": param, "code": status}}


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """pydantic / FastAPI validation errors -> (one message naming every bad field, the first field)."""
    msgs, first = [], None
    for e in errors:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        field = ".".join(loc) or None
        first = first or field
        if e.get("type") == "json_invalid":
            msgs.append(f"malformed JSON body: {e.get('ctx', {}).get('error', e.get('msg'))}")
        elif field is None and e.get("type") in ("model_attributes_type", "dict_type"):
            msgs.append("the request body must be a JSON object (malformed JSON or a wrong content type)")
        elif e.get("type") == "extra_forbidden":
            msgs.append(f"unknown field '{field}'")
        elif e.get("type") == "missing":
            msgs.append(f"missing field '{field}'")
        else:
            msgs.append(f"field '{field}': {e.get('msg')}" if field else str(e.get("msg")))
    return "; ".join(msgs) or "invalid request", first
