"""Requests → token ids within the model's limits → the scheduler → text increments.

The asyncio half of the server: everything here runs on the event loop. It tokenizes, checks
the context limit, submits to the scheduler thread and turns the tokens it sends back into
text (serve/detokenizer.py), cancelling the request when a stop string ends it or its
consumer goes away (a client that disconnected).
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from serve.detokenizer import Detokenizer
from serve.model import LoadedModel
from serve.protocol import ApiError, ChatRequest, CompletionRequest, SamplingFields
from serve.sampler import SamplingParams
from serve.settings import ServeSettings
from serve.scheduler import (ENDED, FINISH_STOP, GenerationRequest, Output, QueueFull, Scheduler, SchedulerEnded,
                             Sequence)
from serve.tokenizer import ChatTemplateError

COMPLETION_DEFAULT_MAX_TOKENS = 16   # OpenAI's default for /v1/completions; chat: the context left


@dataclass(frozen=True)
class Job:
    """A validated request: what to generate and how."""

    prompt_ids: list[int]
    max_tokens: int
    params: SamplingParams
    stops: list[str]
    ignore_eos: bool = False


@dataclass(frozen=True)
class Delta:
    """New text of a running request; finish_reason on the last one."""

    text: str
    finish_reason: str | None
    completion_tokens: int


class Service:
    def __init__(self, model: LoadedModel, settings: ServeSettings):
        self.model = model
        self.settings = settings
        self.scheduler = Scheduler(model.engine, model.device, settings.max_batch, settings.max_queue,
                                   settings.max_prefill_tokens, model.vocab_size)

    @property
    def name(self) -> str:
        return self.model.source.name

    def start(self) -> None:
        self.scheduler.start()

    def stop(self) -> None:
        self.scheduler.stop()

    # ---- requests → jobs ----

    def completion_job(self, req: CompletionRequest) -> Job:
        prompt = req.prompt[0] if isinstance(req.prompt, list) and isinstance(req.prompt[0], str) else req.prompt
        if isinstance(prompt, str):
            ids = self.model.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            ids = list(prompt)
            bad = [i for i in ids if not 0 <= i < self.model.vocab_size]
            if bad:
                raise ApiError(400, f"token id {bad[0]} is outside the vocabulary (0..{self.model.vocab_size - 1})",
                               "prompt")
        return self._job(ids, req.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, req, "prompt")

    def chat_job(self, req: ChatRequest) -> Job:
        options = {**self.settings.chat_template_kwargs, **(req.chat_template_kwargs or {})}
        try:
            text = self.model.tokenizer.render_chat([m.for_template() for m in req.messages], options)
        except ChatTemplateError as e:
            raise ApiError(400, str(e), "messages") from None
        ids = self.model.tokenizer.encode(text, add_special_tokens=False)
        return self._job(ids, req.max_completion_tokens or req.max_tokens, None, req, "messages")

    def _job(self, ids: list[int], max_tokens: int | None, default: int | None, req: SamplingFields,
             what: str) -> Job:
        limit = self.model.max_context
        if not ids:
            raise ApiError(400, f"the {what} is empty after tokenization", what)
        room = limit - len(ids)
        if max_tokens is None and room >= 1:
            max_tokens = room if default is None else min(default, room)
        if room < 1 or max_tokens > room:
            asked = f"{max_tokens} in the completion" if max_tokens else "at least 1 in the completion"
            raise ApiError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                           f"{len(ids) + (max_tokens or 1)} tokens ({len(ids)} in the {what}, {asked}). "
                           f"Please reduce the length of the {what} or max_tokens.",
                           "max_tokens" if room >= 1 else what, code="context_length_exceeded")
        bias = req.logit_biases()
        outside = [t for t, _ in bias if t >= self.model.vocab_size]
        if outside:
            raise ApiError(400, f"logit_bias: token id {outside[0]} is outside the vocabulary "
                           f"(0..{self.model.vocab_size - 1})", "logit_bias")
        params = SamplingParams(req.temperature, req.top_p, max(req.top_k, 0), req.seed, bias,
                                req.presence_penalty, req.frequency_penalty)
        return Job(ids, max_tokens, params, req.stop_strings(), req.ignore_eos)

    # ---- running ----

    def submit(self, job: Job) -> Running:
        """Queue `job` (503 when the queue is full); iterate the result for its text."""
        if self.scheduler.dead:
            raise ApiError(503, ENDED, kind="server_error")
        eos = frozenset() if job.ignore_eos else self.model.tokenizer.eos_ids
        request = GenerationRequest(job.prompt_ids, job.max_tokens, job.params, eos)
        try:
            seq, outputs = self.scheduler.submit(request)
        except QueueFull as e:
            raise ApiError(503, f"the server is busy: {e}; retry later", kind="server_overloaded",
                           headers={"Retry-After": str(self.settings.retry_after_s)}) from None
        except SchedulerEnded as e:   # it died (or stopped) since the check above
            raise ApiError(503, str(e), kind="server_error") from None
        return Running(self.scheduler, seq, outputs, Detokenizer(self.model.tokenizer, job.prompt_ids, job.stops))


@dataclass
class Running:
    """A queued request: `deltas()` yields its text; `cancel()` (idempotent, a no-op once it
    finished) drops it and frees its engine state, whoever stops listening."""

    scheduler: Scheduler
    seq: Sequence
    outputs: asyncio.Queue[Output]
    detok: Detokenizer

    def cancel(self) -> None:
        self.scheduler.cancel(self.seq)

    async def deltas(self) -> AsyncIterator[Delta]:
        """The text increments, the last with its finish_reason."""
        tokens, stop_ids = 0, self.seq.request.stop_ids
        try:
            while True:
                out = await self.outputs.get()
                if out.error is not None:
                    raise ApiError(out.status, out.error, kind="server_error" if out.status >= 500 else
                                   "invalid_request_error", code=out.code)
                tokens += 1
                finish = out.finish_reason
                text = "" if out.token in stop_ids else self.detok.push(out.token)
                if self.detok.stopped:
                    finish = FINISH_STOP
                if finish is not None:
                    yield Delta(text + self.detok.finish(), finish, tokens)
                    return
                if text or tokens == 1:   # the first token always: clients see time to first token
                    yield Delta(text, None, tokens)
        finally:
            self.cancel()
