"""The HTTP side: an OpenAI-compatible FastAPI app over a Service.

Routes: GET /health, /ping, /v1/models; POST /v1/completions, /v1/chat/completions (JSON, or
server-sent events with `stream: true`, ended by `data: [DONE]`) and /invocations (SageMaker's
route: a body with "messages" is a chat request, else a completion). Every error, ours or the
framework's (404, 405, bad JSON, a body too large), is answered in OpenAI's error shape, and
nothing a client sends can stop the server.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import anyio

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serve import protocol
from serve.protocol import ApiError, ChatRequest, CompletionRequest
from serve.service import Delta, Job, Running, Service

CLIENT_CLOSED = 499   # nginx's status for a request its client abandoned (logged, never read)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class BodyLimit:
    """413 for a request body over `limit` bytes, by Content-Length or as it streams in."""

    def __init__(self, app: ASGIApp, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers", [])).get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.limit:
            return await self._too_large(send)
        seen, over = 0, False

        async def limited() -> Message:
            nonlocal seen, over
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                over = True
                raise ApiError(413, f"the request body is over {self.limit} bytes")
            return message

        async def sent(message: Message) -> None:
            # FastAPI answers an error inside its own body parsing with a 400 of its own ("There was an
            # error parsing the body": a chunked body past the limit, helper-35): the 413 replaces it.
            if not over:
                await send(message)
            elif message["type"] == "http.response.start":
                await self._too_large(send)

        try:
            await self.app(scope, limited, sent)
        except ApiError:       # raised inside the app's body read: nothing was sent yet
            await self._too_large(send)

    async def _too_large(self, send: Send) -> None:
        body = json.dumps(protocol.error_body(f"the request body is over {self.limit} bytes",
                                              "invalid_request_error", None, 413)).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _validation_message(errors: list[dict]) -> tuple[str, str | None]:
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":   # had read "0: JSON decode error", param "0"
        return f"the body is not valid JSON: {first.get('ctx', {}).get('error', 'decode error')}", None
    if first.get("type") == "missing" and tuple(first.get("loc", ())) == ("body",):   # had read "body: Field required"
        return "the body is empty: a JSON object is expected", None
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    return f"{param or 'body'}: {first.get('msg', 'invalid request')}", param


def create_app(service: Service) -> FastAPI:
    app = FastAPI(title="inference-agent server", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError) -> JSONResponse:
        return _error(e)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(list(e.errors()))
        return _error(ApiError(400, message, param))

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, e: HTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return _error(ApiError(e.status_code, str(e.detail), kind=kind, headers=dict(e.headers or {})))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, e: Exception) -> JSONResponse:
        return _error(ApiError(500, f"{type(e).__name__}: {e}", kind="server_error"))

    @app.get("/health")
    async def health():
        stats = service.scheduler.stats()
        dead = service.scheduler.dead
        body = {"status": "error" if dead else "ok", "model": service.name, "waiting": stats.waiting,
                "running": stats.live, "running_limit": stats.room or service.settings.max_batch}
        return JSONResponse(body, status_code=503) if dead else body

    @app.get("/ping")
    async def ping() -> dict:
        return {"status": "ok"}

    def card() -> dict:
        return {"id": service.name, "object": "model", "created": 0, "owned_by": "inference-agent",
                "max_model_len": service.model.max_context, "vocab_size": service.model.vocab_size}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model:path}")   # the client's models.retrieve: had been a 404 for the served model too
    async def model(model: str) -> dict:
        if model != service.name:
            raise ApiError(404, f"The model `{model}` does not exist.", "model", kind="not_found_error",
                           code="model_not_found")
        return card()

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await _completion(service, req, request)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request):
        return await _chat(service, req, request)

    @app.post("/invocations")
    async def invocations(request: Request):
        try:
            body = await request.json()
        except ValueError:
            raise ApiError(400, "the body is not JSON") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        try:
            if "messages" in body:
                return await _chat(service, ChatRequest.model_validate(body), request)
            return await _completion(service, CompletionRequest.model_validate(body), request)
        except ValidationError as e:
            message, param = _validation_message(list(e.errors()))
            raise ApiError(400, message, param) from None

    return BodyLimit(app, service.settings.max_body_bytes)


@dataclass(frozen=True)
class _Kind:
    """What tells a completion from a chat answer on the wire; `_respond` serves both."""
    id_prefix: str
    chunk_object: str              # the `object` of a streamed chunk (and of the usage chunk)
    first_delta: dict | None       # a chunk sent before any text (chat's role announcement)
    chunk: Callable[[str, str, int, Delta], dict]   # (id, model, created, delta) -> a streamed chunk
    response: Callable[[str, str, str, str, int, int], dict]


def _completion_chunk(rid: str, model: str, created: int, d: Delta) -> dict:
    return protocol.completion_chunk(rid, model, created, d.text, d.finish_reason)


def _chat_chunk(rid: str, model: str, created: int, d: Delta) -> dict:
    return protocol.chat_chunk(rid, model, created, {"content": d.text} if d.text else {}, d.finish_reason)


COMPLETION = _Kind("cmpl", "text_completion", None, _completion_chunk, protocol.completion_response)
CHAT = _Kind("chatcmpl", "chat.completion.chunk", {"role": "assistant", "content": ""}, _chat_chunk,
             protocol.chat_response)


# Jobs are made (templates rendered, prompts tokenized) on a worker thread: a prompt of megabytes
# takes a tokenizer seconds, which had stalled every other request's stream.
async def _completion(service: Service, req: CompletionRequest, request: Request):
    return await _respond(service, req, request, await asyncio.to_thread(service.completion_job, req), COMPLETION)


async def _chat(service: Service, req: ChatRequest, request: Request):
    return await _respond(service, req, request, await asyncio.to_thread(service.chat_job, req), CHAT)


async def _respond(service: Service, req: protocol.SamplingFields, request: Request, job: Job, kind: _Kind):
    """Submit `job`; answer with one JSON body, or with server-sent events if `req.stream`."""
    rid, model = protocol.new_id(kind.id_prefix), req.model or service.name
    running = service.submit(job)
    if req.stream:
        return _stream(running, job, rid, model, kind, _include_usage(req))
    text, finish, tokens = await _collect(running, request)
    return kind.response(rid, model, text, finish, len(job.prompt_ids), tokens)


def _include_usage(req: protocol.SamplingFields) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


async def _collect(running: Running, request: Request) -> tuple[str, str, int]:
    """The whole text of a non-streaming request; cancelled if the client disconnects first."""
    async def collect() -> tuple[str, str, int]:
        parts, last = [], None
        async for d in running.deltas():
            parts.append(d.text)
            last = d
        return "".join(parts), last.finish_reason, last.completion_tokens

    task = asyncio.ensure_future(collect())
    watch = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():    # the client left (or the server is shutting down)
            task.cancel()
            running.cancel()
    if not task.done():
        raise ApiError(CLIENT_CLOSED, "the client closed the request")   # nobody reads this
    return task.result()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _stream(running: Running, job: Job, rid: str, model: str, kind: _Kind,
            include_usage: bool) -> StreamingResponse:
    """Server-sent events, ended by `data: [DONE]`."""
    created = int(time.time())

    async def events() -> AsyncIterator[str]:
        if kind.first_delta is not None:
            yield _sse(protocol.chat_chunk(rid, model, created, kind.first_delta, None))
        last = None
        try:
            async for d in running.deltas():
                last = d
                yield _sse(kind.chunk(rid, model, created, d))
        except ApiError as e:   # the engine failed mid-stream: say so in the stream
            yield _sse(e.body())
        if include_usage and last is not None:
            yield _sse(protocol.usage_chunk(rid, model, created, kind.chunk_object, len(job.prompt_ids),
                                            last.completion_tokens))
        yield "data: [DONE]\n\n"

    return CancellingStream(events(), running.cancel)


class CancellingStream(StreamingResponse):
    """Server-sent events that stop, and cancel their request, as soon as the client
    disconnects: whether the server notices at a send (ASGI 2.4 servers) or by an
    http.disconnect message while the request is quiet (a byte-level model may generate many
    tokens that decode to no text, so there may be no send for a while)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:
                async def stream() -> None:
                    with contextlib.suppress(OSError):   # the client left mid-send
                        await self.stream_response(send)
                    group.cancel_scope.cancel()

                async def listen() -> None:
                    await _disconnected(receive)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                group.start_soon(listen)
        finally:
            self.on_close()


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"
