"""One tiny chat interface for every model provider, and the layers every call goes through.

A provider module (openai.py, anthropic.py) only turns `messages` into one SDK call and the
answer into a `Reply`, mapping the SDK's exceptions onto `ChatError` kinds. Everything
else is shared and stacked around it, innermost first:

    SDK adapter → RecordingClient (transcript, one JSONL line per attempt)
                → MeteredClient   (budgets: calls, tokens, cost, wall time)
                → RetryingClient  (backoff on rate limits, server errors, timeouts, empty answers)

The replay provider replaces the first two layers with the transcript of a past run, so a
replayed run goes through the same budget and retry code and makes the same decisions.
"""
from __future__ import annotations

import datetime
import email.utils
import hashlib
import json
import re
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Protocol

Message = dict[str, str]  # {"role": "system" | "user" | "assistant", "content": "..."}
Log = Callable[[str], None]

# Error kinds. Retrying helps with the first group; the others end the call at once.
RATE_LIMIT, SERVER, TIMEOUT, UNREACHABLE, EMPTY = "rate_limit", "server", "timeout", "unreachable", "empty"
AUTH, BAD_REQUEST, BUDGET, REPLAY = "auth", "bad_request", "budget", "replay"
RETRYABLE = frozenset({RATE_LIMIT, SERVER, TIMEOUT, UNREACHABLE, EMPTY})


@dataclass(frozen=True)
class Reply:
    text: str
    input_tokens: int | None     # as the server reported them; None where it did not (budget.counted)
    output_tokens: int | None
    model: str
    finish_reason: str = ""


# Of an error's message (the server's own text, as the SDK hands it on), in the log and the transcript:
# a 429 carrying 5 MB of message wrote 5 MB to each, per attempt (red-team helper, thirty-eighth session).
ERROR_CHARS = 2000


def cut(text: str, limit: int) -> str:
    """`text`, or its first `limit` characters and how many more there were: what a server or a
    verdict sends at any length, as the log, the transcript or the next prompt may hold it."""
    return text if len(text) <= limit else text[:limit] + f"… ({len(text) - limit} more characters cut)"


class ChatError(Exception):
    """A call that produced no usable answer, classified so the caller can decide."""

    def __init__(self, kind: str, message: str, retry_after: float | None = None):
        message = cut(message, ERROR_CHARS)
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message
        self.retry_after = retry_after

    @property
    def retryable(self) -> bool:
        return self.kind in RETRYABLE


class ChatClient(Protocol):
    provider: str  # "openai", "anthropic", "replay"
    model: str

    def complete(self, messages: list[Message], max_tokens: int) -> Reply:
        """One answer to `messages`, or ChatError."""


# The most characters an answer of `max_tokens` tokens is taken to hold (code runs 3-4 a token): a
# server that ignored the limit sent megabytes, which the repair round sent back, whose request the
# token budget then refused as a worst case past the limit, and a refusal stops the model for the run.
CHARS_PER_TOKEN_AT_MOST = 10


class DeadlineClient:
    """One attempt within `seconds` in all (LLM_TIMEOUT_S, which the run's deadline checks take
    a request to last at most): an SDK's timeout bounds each read of the socket, not the answer,
    and a server sending a byte every few seconds held one request for 560 s against a 10 s
    timeout, a serial run 735 s past its budget (red-team helper, twenty-ninth session). The
    attempt runs in a daemon thread; past the deadline it is a TIMEOUT, and the thread is left to
    its socket (it holds no lock of ours and writes nowhere; the budget counts the attempt's
    worst case: agent/providers/budget.py). An answer longer than `max_tokens` could be is cut
    there (CHARS_PER_TOKEN_AT_MOST), before the transcript records it."""

    def __init__(self, inner: ChatClient, seconds: float):
        self.inner, self.seconds = inner, seconds
        self.provider, self.model = inner.provider, inner.model

    def complete(self, messages: list[Message], max_tokens: int) -> Reply:
        outcome: dict = {}

        def attempt() -> None:
            try:
                outcome["reply"] = self.inner.complete(messages, max_tokens)
            except BaseException as e:  # noqa: BLE001 - handed to the caller as it is
                outcome["error"] = e
        worker = threading.Thread(target=attempt, name="llm-request", daemon=True)
        worker.start()
        worker.join(self.seconds)
        if worker.is_alive():
            raise ChatError(TIMEOUT, f"no whole answer within {self.seconds:.0f}s")
        if "error" in outcome:
            raise outcome["error"]
        reply, most = outcome["reply"], max_tokens * CHARS_PER_TOKEN_AT_MOST
        if len(reply.text) > most:   # past what `max_tokens` could hold: cut, as a server would have
            reply = replace(reply, text=reply.text[:most], finish_reason="length")
        return reply


def shown_url(url: str | None) -> str | None:
    """`url` as logs and transcripts may show it: whatever sits before an `@` in its authority
    (user:password, a key) replaced by ***, with or without a scheme."""
    if not url:
        return url
    return re.sub(r"^((?:[A-Za-z][A-Za-z0-9+.-]*:)?//)?[^/@]*@", lambda m: (m.group(1) or "") + "***@", url, count=1)


KEY_SHOWN_FROM = 8   # characters: a key shorter than this is no secret a server could echo by chance


def without_key(complete: Callable[[list[Message], int], "Reply"], key: str | None,
                messages: list[Message], max_tokens: int) -> "Reply":
    """`complete(messages, max_tokens)` with the API key, wherever the server wrote it back (an error
    message "Incorrect API key provided: sk-...", an answer's text), replaced by ***: it had gone
    into results.log and the transcript as the server sent it (red-team helper, thirty-eighth session)."""
    if not key or len(key) < KEY_SHOWN_FROM:
        return complete(messages, max_tokens)
    try:
        reply = complete(messages, max_tokens)
    except ChatError as e:
        if key not in e.message:
            raise
        raise ChatError(e.kind, e.message.replace(key, "***"), e.retry_after) from e.__cause__
    return replace(reply, text=reply.text.replace(key, "***")) if key in reply.text else reply


def clean_text(text: str) -> str:
    """An answer's text as valid UTF-8: a lone surrogate (JSON lets a server send one) cannot be
    sent back in the next request's messages, and the SDK's encoder raised there, ending the
    model's part of the run (a cold review, twenty-ninth session)."""
    return text.encode("utf-8", "replace").decode("utf-8")


def request_hash(messages: list[Message], max_tokens: int) -> str:
    """Identity of a request, so a replay can tell when the run has diverged from the recording."""
    payload = json.dumps({"messages": messages, "max_tokens": max_tokens}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


class RecordingClient:
    """Writes every attempt (request, answer or error) to a JSONL transcript, flushed at once,
    so a crashed run still leaves its transcript behind."""

    def __init__(self, inner: ChatClient, path: Path, meta: dict | None = None):
        """`meta`: what a replay needs to make the same decisions (settings, budget, base URL)."""
        self.inner = inner
        self.provider = inner.provider
        self.model = inner.model
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.seq = 0
        self._lock = threading.Lock()   # requests may come from several threads (agent/pipeline.py)
        self._write({"type": "start", "provider": self.provider, "model": self.model,
                     "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **(meta or {})})

    def _write(self, record: dict) -> None:
        with self._lock, self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def complete(self, messages: list[Message], max_tokens: int) -> Reply:
        record = {"type": "call", "seq": self.seq, "provider": self.provider, "model": self.model,
                  "request_hash": request_hash(messages, max_tokens), "max_tokens": max_tokens,
                  "messages": messages, "reply": None, "error": None}
        with self._lock:
            record["seq"] = self.seq
            self.seq += 1
        start = time.monotonic()
        try:
            reply = self.inner.complete(messages, max_tokens)
            record["reply"] = asdict(reply)
            return reply
        except ChatError as e:
            record["error"] = {"kind": e.kind, "message": e.message, "retry_after": e.retry_after}
            raise
        finally:
            record["seconds"] = round(time.monotonic() - start, 3)
            self._write(record)


class RetryingClient:
    """Retries what may succeed a moment later, with exponential backoff (or the server's
    Retry-After), and turns an empty answer into a retryable error. Each retry is logged."""

    def __init__(self, inner: ChatClient, log: Log, retries: int = 3, base_delay: float = 2.0,
                 max_delay: float = 60.0, sleep: Callable[[float], None] = time.sleep,
                 request_timeout: float = 0.0):
        self.inner = inner
        self.request_timeout = request_timeout   # the longest one attempt may take
        self.deadline: float | None = None       # time.monotonic() by which every attempt must be over
        self.provider = inner.provider
        self.model = inner.model
        self.log = log
        self.retries = retries
        self.base_delay = base_delay
        self.max_delay = max_delay
        self.sleep = sleep

    def complete(self, messages: list[Message], max_tokens: int) -> Reply:
        attempt = 0
        while True:
            try:
                reply = self.inner.complete(messages, max_tokens)
                if not reply.text.strip():
                    raise ChatError(EMPTY, f"empty answer (finish reason {reply.finish_reason or '?'})")
                return reply
            except ChatError as e:
                if not e.retryable or attempt >= self.retries:
                    raise
                delay = min(self.max_delay, e.retry_after if e.retry_after is not None
                            else self.base_delay * 2 ** attempt)
                if self.deadline is not None and time.monotonic() + delay + self.request_timeout > self.deadline:
                    raise ChatError(e.kind, f"{e.message} (no retry: it could outlive the run)") from e
                attempt += 1
                self.log(f"llm: {self.provider} {e.kind} ({e.message}); retry {attempt}/{self.retries} "
                         f"in {delay:.1f}s")
                self.sleep(delay)


def status_error(status: int, message: str, retry_after: float | None = None) -> ChatError:
    """An HTTP error status as a ChatError (both SDKs expose the status code)."""
    if status == RATE_LIMITED_STATUS:
        return ChatError(RATE_LIMIT, f"HTTP 429: {message}", retry_after)
    if status >= 500:  # includes Anthropic's 529 "overloaded"
        return ChatError(SERVER, f"HTTP {status}: {message}", retry_after)
    if status in (401, 403):
        return ChatError(AUTH, f"HTTP {status}: {message}")
    return ChatError(BAD_REQUEST, f"HTTP {status}: {message}")


def shape_error(e: Exception) -> ChatError:
    """A 200 answer that parsed but is not a chat answer (`message: null`, `choices` a string, a
    proxy's HTML page, content a list or a number): a server error, retried. Reading it had raised
    AttributeError or TypeError out of the client, which stopped the model for the rest of the run
    as an internal error (red-team helper, thirty-eighth session)."""
    return ChatError(SERVER, f"the answer is not a chat answer ({type(e).__name__}: {str(e)[:200]})")


# How long a server asks a client to wait, in the order trusted: OpenAI's and Anthropic's
# millisecond header, the standard one (seconds or an HTTP date), then the reset times of the
# exhausted rate limits (OpenAI: durations such as "1s", "6m0s", "20ms"; Anthropic: RFC 3339 times).
RATE_LIMITED_STATUS = 429
RESET_HEADERS = ("x-ratelimit-reset-requests", "x-ratelimit-reset-tokens",
                 "anthropic-ratelimit-requests-reset", "anthropic-ratelimit-tokens-reset")
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_UNIT_SECONDS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def retry_after(headers, now: float | None = None, rate_limited: bool = True) -> float | None:
    """Seconds to wait before retrying, from a response's headers (a case-insensitive mapping);
    None when they say nothing usable. `now`: time.time(), for the headers that give a time.
    The reset headers count only for a rate limit (429): OpenAI sends them with every answer."""
    now = time.time() if now is None else now
    value = headers.get("retry-after-ms")
    if value is not None:
        try:
            return max(0.0, float(value) / 1000)
        except ValueError:
            pass
    value = headers.get("retry-after")
    if value is not None:
        try:
            return max(0.0, float(value))
        except ValueError:
            at = _time_of(value, email.utils.parsedate_to_datetime)
            if at is not None:
                return max(0.0, at - now)
    if not rate_limited:
        return None
    resets = [_reset_seconds(headers[name], now) for name in RESET_HEADERS if headers.get(name)]
    resets = [r for r in resets if r is not None]
    return max(resets) if resets else None


def _reset_seconds(value: str, now: float) -> float | None:
    parts = _DURATION.findall(value)
    if parts and "".join(n + u for n, u in parts) == value.strip():
        return sum(float(n) * _UNIT_SECONDS[u] for n, u in parts)
    at = _time_of(value, lambda v: datetime.datetime.fromisoformat(v.replace("Z", "+00:00")))
    return None if at is None else max(0.0, at - now)


def _time_of(value: str, parse) -> float | None:
    try:
        return parse(value).timestamp()
    except (TypeError, ValueError, IndexError):
        return None


def retry_after_of(error: Exception) -> float | None:
    """How long the server asked to wait (retry_after) in an SDK status error's response."""
    response = getattr(error, "response", None)
    if response is None:
        return None
    return retry_after(response.headers, rate_limited=getattr(error, "status_code", None) == RATE_LIMITED_STATUS)
