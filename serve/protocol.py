"""The OpenAI wire format: request bodies (validated by pydantic), responses, errors.

Unknown request fields are accepted and ignored (clients send user, ...), as the
OpenAI-compatible servers do; fields we read are validated, and a bad one is a 400 naming it.
Fields whose answer this server cannot give are a 400 naming them when a request asks for
them (`logprobs`, `top_logprobs`, `echo`, `response_format` other than text, `tools`, `functions`;
`n` > 1; completions' `best_of` > 1 and `suffix`), not ignored: a client would take the answer
for what it asked. `logit_bias`, `presence_penalty` and `frequency_penalty` are applied
(serve/sampler.py).
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

MAX_STOPS = 4        # as OpenAI: up to 4 stop sequences
MAX_LOGIT_BIAS = 100.0   # as OpenAI: a bias in [-100, 100] (±100 bans or forces a token)
MAX_PENALTY = 2.0        # as OpenAI: presence and frequency penalties in [-2, 2]
SEED_RANGE = (-2**63, 2**64 - 1)   # what torch.Generator.manual_seed takes


def _unicode(text: str) -> str:
    """`text`, if it is Unicode the tokenizer can encode (JSON's \\ud800 escapes decode to lone
    surrogates, which it cannot: a 500 before, helper-35)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text holds a lone surrogate (\\ud800-\\udfff escape): not valid Unicode") from None
    return text


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", headers: dict[str, str] | None = None,
                 code: str | int | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.headers = headers or {}
        self.code = status if code is None else code

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str, param: str | None, code: str | int) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """The fields /v1/completions and /v1/chat/completions share."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)           # 0 or -1: no top-k cut (vLLM spells it -1)
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    ignore_eos: bool = False               # vLLM's: generate max_tokens whatever (benchmarks)
    logit_bias: dict[str, float] | None = None   # token id (a string, JSON's keys) -> bias
    presence_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    # Asked for (true, a number: 0 too, OpenAI's "the sampled token's only"), these are a 400; absent,
    # null or false they are fine. Any: a 400 says "not supported", not that the type is wrong.
    logprobs: Any = None
    top_logprobs: Any = None
    echo: Any = None
    # Structured output and tool calls: a 400 when asked for (a client would parse the text as JSON
    # or wait for a tool call that never comes); `response_format` {"type": "text"} is plain text.
    response_format: Any = None
    tools: Any = None
    functions: Any = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @field_validator("logprobs", "top_logprobs", "echo")
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None or value is False or (info.field_name == "top_logprobs" and value == 0):
            return value
        raise ValueError(f"{info.field_name} is not supported by this server")

    @field_validator("response_format", "tools", "functions")
    @classmethod
    def _no_structure(cls, value: Any, info: ValidationInfo) -> Any:
        plain = value is None or value == [] or (info.field_name == "response_format" and isinstance(value, dict)
                                                 and value.get("type") == "text")
        if plain:
            return value
        raise ValueError(f"{info.field_name} is not supported by this server (plain text only)")

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (bias or {}).items():
            if not (key.isascii() and key.isdigit() and len(key) <= 12):
                raise ValueError(f"{key[:20]!r} is not a token id")
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise ValueError(f"the bias of token {key} is {value}, not in [-100, 100]")
        return bias

    def logit_biases(self) -> tuple[tuple[int, float], ...]:
        """The biases as (token id, bias) pairs, one a token ("07" and "7" are one)."""
        return tuple({int(k): v for k, v in (self.logit_bias or {}).items()}.items())

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOPS or any(not s for s in stops):
            raise ValueError(f"stop takes up to {MAX_STOPS} non-empty strings")
        for text in stops:
            _unicode(text)
        return stop

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str]
    # Completions' own fields this server cannot honour: ignored, best_of 3 had answered one plain
    # sample and a suffix had been dropped (no insertion), the client none the wiser.
    best_of: int | None = None
    suffix: Any = None

    @field_validator("best_of")
    @classmethod
    def _one_candidate(cls, best_of: int | None) -> int | None:
        if best_of not in (None, 1):
            raise ValueError("only best_of=1 is supported")
        return best_of

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: Any) -> Any:
        if suffix not in (None, ""):
            raise ValueError("suffix is not supported by this server (no insertion)")
        return suffix

    @field_validator("prompt")
    @classmethod
    def _single_prompt(cls, prompt: str | list[int] | list[str]) -> str | list[int] | list[str]:
        if isinstance(prompt, list) and not prompt:
            raise ValueError("the prompt is empty")
        if isinstance(prompt, list) and isinstance(prompt[0], str) and len(prompt) != 1:
            raise ValueError("one prompt per request (a list of several prompts is not supported)")
        for text in [prompt] if isinstance(prompt, str) else [t for t in prompt if isinstance(t, str)]:
            _unicode(text)
        return prompt


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str

    @field_validator("text")
    @classmethod
    def _text(cls, text: str) -> str:
        return _unicode(text)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")    # tool_calls, name, ...: handed to the template
    role: str
    content: str | list[TextPart] | None = None

    @field_validator("role", "content")
    @classmethod
    def _text(cls, value):
        return _unicode(value) if isinstance(value, str) else value

    def for_template(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {**self.model_dump(exclude_none=True), "content": content or ""}


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)   # the newer name of max_tokens
    chat_template_kwargs: dict[str, Any] | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_response(rid: str, model: str, text: str, finish: str, prompt_tokens: int, tokens: int) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
            "usage": usage(prompt_tokens, tokens)}


def chat_response(rid: str, model: str, text: str, finish: str, prompt_tokens: int, tokens: int) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": finish}],
            "usage": usage(prompt_tokens, tokens)}


def completion_chunk(rid: str, model: str, created: int, text: str, finish: str | None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish: str | None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def usage_chunk(rid: str, model: str, created: int, obj: str, prompt_tokens: int, tokens: int) -> dict:
    """The last chunk when stream_options.include_usage: no choices, the usage."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(prompt_tokens, tokens)}
