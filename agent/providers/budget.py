"""Hard limits on what the LLM path may spend in one run: calls, tokens, dollars, seconds.

A call is refused *before* it is made when its worst case (the prompt's estimated tokens
plus the full `max_tokens` answer) would cross a limit, so the totals never overshoot.
Failed attempts count as calls. Totals go to the log at the end of the run.
"""
from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass, field

from agent.providers.chat import BUDGET, TIMEOUT, ChatClient, ChatError, Message, Reply
from agent.providers.prices import Price

CHARS_PER_TOKEN = 3  # a conservative estimate of prompt tokens before the call (code is dense)
TOKENS_A_MESSAGE = 16   # a chat template's framing of one message (role, separators), generously
TOKENS_A_PROMPT = 64    # and of the whole prompt (a system preamble the server adds)


@dataclass
class Budget:
    max_calls: int = 40
    max_tokens: int = 1_000_000
    max_cost_usd: float = 5.0
    max_seconds: float | None = None  # wall time of the LLM path; None: only the run's own limit

    @staticmethod
    def from_env(env: dict | None = None) -> "Budget":
        """Defaults, overridden by LLM_MAX_CALLS, LLM_MAX_TOKENS, LLM_MAX_COST_USD, LLM_MAX_SECONDS."""
        env = os.environ if env is None else env
        b = Budget()
        if env.get("LLM_MAX_CALLS"):
            b.max_calls = int(env["LLM_MAX_CALLS"])
        if env.get("LLM_MAX_TOKENS"):
            b.max_tokens = int(env["LLM_MAX_TOKENS"])
        if env.get("LLM_MAX_COST_USD"):
            b.max_cost_usd = float(env["LLM_MAX_COST_USD"])
        if env.get("LLM_MAX_SECONDS"):
            b.max_seconds = float(env["LLM_MAX_SECONDS"])
        return b


@dataclass
class Usage:
    calls: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cost_usd: float = 0.0
    started: float = field(default_factory=time.monotonic)

    @property
    def tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    def summary(self) -> str:
        return (f"{self.calls} calls, {self.input_tokens} input + {self.output_tokens} output tokens, "
                f"${self.cost_usd:.4f}")


def counted(reported: object, estimate: int) -> int:
    """The tokens a server reported for a call, or `estimate` where what it reported cannot be a
    count (missing, null, negative, NaN, not a number): NaN or a negative number in the totals
    made every later limit check pass, and a null one raised (red-team helper, twenty-ninth session)."""
    if isinstance(reported, bool) or not isinstance(reported, (int, float)) or reported < 0:
        return estimate
    try:
        return int(reported) if math.isfinite(reported) else estimate
    except OverflowError:   # an integer past float's range (JSON holds any): it had raised out of the client
        return estimate


def most_input_tokens(messages: list[Message]) -> int:
    """What a call's prompt can honestly be billed at most: a byte-level tokenizer gives a token
    at least one byte, plus each message's framing. A server's usage past it (or output past the
    call's max_tokens) is not believed: 1e308 tokens had spent the budget in one call and stopped
    the model for the rest of the run (red-team helper, thirty-eighth session)."""
    return sum(len(str(m.get("content", "")).encode("utf-8", "replace")) + TOKENS_A_MESSAGE
               for m in messages) + TOKENS_A_PROMPT


def estimate_tokens(messages: list[Message]) -> int:
    return sum(len(m.get("content", "")) for m in messages) // CHARS_PER_TOKEN + 1


class MeteredClient:
    """Counts every attempt against the budget and refuses the one that would cross it."""

    def __init__(self, inner: ChatClient, budget: Budget, price: Price, usage: Usage | None = None):
        self.inner = inner
        self.provider = inner.provider
        self.model = inner.model
        self.budget = budget
        self.price = price
        self.usage = usage or Usage()
        # Calls in flight at once (agent/pipeline.py) each hold their worst case until they end,
        # so that parallel calls together never cross a limit either.
        self._lock = threading.Lock()
        self._held_tokens = 0
        self._held_cost = 0.0

    def refusal(self, messages: list[Message], max_tokens: int) -> str | None:
        """Why a call of this size may not be made now, or None."""
        b, u = self.budget, self.usage
        worst_in = estimate_tokens(messages)
        if u.calls >= b.max_calls:
            return f"call budget spent ({u.calls}/{b.max_calls} calls)"
        used = u.tokens + self._held_tokens
        if used + worst_in + max_tokens > b.max_tokens:
            return f"token budget: {used} used or held, this call may take {worst_in + max_tokens} more, limit {b.max_tokens}"
        worst_cost = self.price.cost(worst_in, max_tokens)
        spent = u.cost_usd + self._held_cost
        if spent + worst_cost > b.max_cost_usd:
            return (f"cost budget: ${spent:.4f} spent or held, this call may cost ${worst_cost:.4f}, "
                    f"limit ${b.max_cost_usd:.2f}")
        if b.max_seconds is not None and time.monotonic() - u.started > b.max_seconds:
            return f"time budget spent ({b.max_seconds:.0f}s)"
        return None

    def complete(self, messages: list[Message], max_tokens: int) -> Reply:
        worst_tokens = estimate_tokens(messages) + max_tokens
        worst_cost = self.price.cost(estimate_tokens(messages), max_tokens)
        with self._lock:
            why = self.refusal(messages, max_tokens)
            if why:
                raise ChatError(BUDGET, why)
            self.usage.calls += 1
            self._held_tokens += worst_tokens
            self._held_cost += worst_cost
        try:
            reply = self.inner.complete(messages, max_tokens)
        except ChatError as e:
            if e.kind == TIMEOUT:   # cut while the server may still be answering (and billing): its worst case
                with self._lock:
                    self.usage.input_tokens += estimate_tokens(messages)
                    self.usage.output_tokens += max_tokens
                    self.usage.cost_usd += worst_cost
            raise
        finally:
            with self._lock:
                self._held_tokens -= worst_tokens
                self._held_cost -= worst_cost
        used_in = min(counted(reply.input_tokens, estimate_tokens(messages)), most_input_tokens(messages))
        used_out = min(counted(reply.output_tokens, len(reply.text) // CHARS_PER_TOKEN + 1), max_tokens)
        with self._lock:
            self.usage.input_tokens += used_in
            self.usage.output_tokens += used_out
            self.usage.cost_usd += self.price.cost(used_in, used_out)
        return reply
