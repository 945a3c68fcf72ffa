"""Continuous batching over the engine's public API, on one thread that owns the engine.

The engine API (create_engine, prefill, decode, remove; SPEC.md §2) is not thread-safe and
keeps device state, so exactly one thread calls it: the scheduler's. The asyncio side hands
requests over through `submit` (a bounded waiting queue) and `cancel`, and receives each
request's tokens on its own asyncio.Queue (filled with loop.call_soon_threadsafe).

Each step:
1. drops cancelled requests (waiting ones are forgotten, live ones `engine.remove`d);
2. admits waiting requests while the batch has room (--max-batch) and the step's prefill
   token budget lasts (at least one), and prefills them in one call. The engine API has no
   chunked prefill (`prefill` creates or replaces a request's whole state), so a long prompt
   is prefilled whole; the budget only keeps many prompts from landing in one step;
3. decodes every other live request in one call;
4. samples all rows at once on the device (serve/sampler.py), one `.tolist()` per step;
5. emits the tokens, and removes finished requests from the engine, freeing their ids.

Engine request ids are small integers from a free list, reused once `remove` has run. An
engine call that raises fails only the requests of that call (their clients get an error),
and the scheduler carries on.
"""
from __future__ import annotations

import asyncio
import heapq
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from serve.sampler import SamplingParams, make_generator, sample

log = logging.getLogger("serve.scheduler")

FINISH_STOP, FINISH_LENGTH = "stop", "length"


class QueueFull(Exception):
    """The waiting queue is at its bound (the API answers 503 with Retry-After)."""


@dataclass(frozen=True)
class GenerationRequest:
    """What the scheduler needs of a request; limits are checked by the API beforehand."""

    prompt_ids: list[int]
    max_tokens: int
    params: SamplingParams = SamplingParams()
    stop_ids: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Output:
    """One step's news for one request: a token, and/or how it ended."""

    token: int | None = None
    finish_reason: str | None = None     # "stop" | "length" | None (still running)
    error: str | None = None             # the engine failed this request


@dataclass(eq=False)
class Sequence:
    """A request inside the scheduler."""

    request: GenerationRequest
    emit: Callable[[Output], None]
    generator: torch.Generator | None = None
    engine_id: int = -1
    generated: int = 0
    last_token: int = -1
    cancelled: bool = False
    done: bool = False


@dataclass
class SchedulerStats:
    """Counters for /health and the tests."""

    waiting: int = 0
    live: int = 0
    steps: int = 0
    finished: int = 0
    engine_ids: list[int] = field(default_factory=list)


class Scheduler:
    def __init__(self, engine: Any, device: str, max_batch: int, max_queue: int, max_prefill_tokens: int,
                 vocab: int):
        self.engine = engine
        self.device = device
        self.vocab = vocab
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.max_prefill_tokens = max_prefill_tokens
        self._wake = threading.Condition()
        self._waiting: deque[Sequence] = deque()
        self._live: dict[int, Sequence] = {}
        self._free_ids: list[int] = []     # a heap of engine ids that `remove` released
        self._next_id = 0
        self._steps = 0
        self._finished = 0
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="serve-scheduler", daemon=True)

    # ---- the asyncio side ----

    def submit(self, request: GenerationRequest) -> tuple[Sequence, asyncio.Queue[Output]]:
        """Queue a request; its outputs arrive on the returned queue (of the running loop)."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[Output] = asyncio.Queue()

        def emit(out: Output) -> None:
            try:
                loop.call_soon_threadsafe(outputs.put_nowait, out)
            except RuntimeError:   # the loop is closed: nobody is listening any more
                pass

        seq = Sequence(request, emit, make_generator(request.params.seed, self.device))
        with self._wake:
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting (--max-queue {self.max_queue})")
            self._waiting.append(seq)
            self._wake.notify()
        return seq, outputs

    def cancel(self, seq: Sequence) -> None:
        """Stop generating for `seq` (its client left, or a stop string ended it); the next
        step drops it and frees its engine state. Harmless when it has already finished."""
        with self._wake:
            seq.cancelled = True
            self._wake.notify()

    @property
    def dead(self) -> bool:
        """Whether the scheduler thread ended without being stopped: /health says so, and a request
        to a dead one is a 503, not a wait with no end. (Not yet started is not dead: requests queue.)"""
        return self._thread.ident is not None and not self._thread.is_alive() and not self._stopping

    def stats(self) -> SchedulerStats:
        with self._wake:
            return SchedulerStats(len(self._waiting), len(self._live), self._steps, self._finished,
                                  sorted(self._live))

    # ---- lifecycle ----

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join()

    # ---- the scheduler thread ----

    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                with self._wake:
                    while not (self._stopping or self._waiting or self._live):
                        self._wake.wait()
                    if self._stopping:
                        break
                    self._drop_cancelled()
                    admitted = self._admit()
                    decoding = [s for s in self._live.values() if s not in admitted]
                    for seq in admitted:
                        self._live[seq.engine_id] = seq
                if admitted or decoding:
                    try:
                        self._step(admitted, decoding)
                    except Exception as e:  # noqa: BLE001 - ours or the engine's: those requests fail, serving goes on
                        log.exception("a scheduler step failed")
                        self._fail([*admitted, *decoding], f"the server's step failed: {type(e).__name__}: {e}")

    def _drop_cancelled(self) -> None:
        """Under the lock: forget cancelled waiting requests, remove cancelled live ones."""
        if any(s.cancelled for s in self._waiting):
            self._waiting = deque(s for s in self._waiting if not s.cancelled)
        gone = [s for s in self._live.values() if s.cancelled]
        if gone:
            self._remove(gone)

    def _admit(self) -> list[Sequence]:
        """Under the lock: the waiting requests this step prefills, with engine ids."""
        admitted, tokens = [], 0
        while self._waiting and len(self._live) + len(admitted) < self.max_batch:
            n = len(self._waiting[0].request.prompt_ids)
            if admitted and tokens + n > self.max_prefill_tokens:
                break
            seq = self._waiting.popleft()
            seq.engine_id = heapq.heappop(self._free_ids) if self._free_ids else self._new_id()
            admitted.append(seq)
            tokens += n
        return admitted

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def _step(self, admitted: list[Sequence], decoding: list[Sequence]) -> None:
        logits, rows = [], []
        if admitted:
            prompts = [torch.tensor(s.request.prompt_ids, dtype=torch.long, device=self.device) for s in admitted]
            out = self._call(admitted, self.engine.prefill, [s.engine_id for s in admitted], prompts)
            if out is not None:
                logits.append(out)
                rows += admitted
        if decoding:
            tokens = torch.tensor([s.last_token for s in decoding], dtype=torch.long, device=self.device)
            out = self._call(decoding, self.engine.decode, [s.engine_id for s in decoding], tokens)
            if out is not None:
                logits.append(out)
                rows += decoding
        if not rows:
            return
        try:
            next_tokens = sample(torch.cat([x.float() for x in logits]),
                                 [s.request.params for s in rows], [s.generator for s in rows]).tolist()
        except Exception as e:  # noqa: BLE001 - bad logits (wrong shape, NaN) from the engine
            self._fail(rows, f"sampling failed: {type(e).__name__}: {e}")
            return
        finished = []
        for seq, token in zip(rows, next_tokens):
            seq.generated += 1
            seq.last_token = token
            reason = (FINISH_STOP if token in seq.request.stop_ids
                      else FINISH_LENGTH if seq.generated >= seq.request.max_tokens else None)
            seq.emit(Output(token, reason))
            if reason is not None:
                finished.append(seq)
        with self._wake:
            self._steps += 1
            self._remove(finished)

    def _call(self, seqs: list[Sequence], fn: Callable, ids: list[int], arg: Any) -> torch.Tensor | None:
        """One engine call; if it raises or returns the wrong shape, its requests fail alone."""
        try:
            out = fn(ids, arg)
            if not isinstance(out, torch.Tensor) or tuple(out.shape) != (len(ids), self.vocab):
                raise ValueError(f"expected logits [{len(ids)}, {self.vocab}], got "
                                 f"{tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}")
            if not bool(torch.isfinite(out).all()):   # NaN had been sampled as token 0
                raise ValueError("the logits hold NaN or inf")
            return out
        except Exception as e:  # noqa: BLE001 - whatever the engine raises
            log.exception("engine.%s failed", fn.__name__)
            self._fail(seqs, f"engine.{fn.__name__} failed: {type(e).__name__}: {e}")
            return None

    def _fail(self, seqs: list[Sequence], message: str) -> None:
        for seq in seqs:
            seq.emit(Output(error=message))
        with self._wake:
            self._remove(seqs)

    def _remove(self, seqs: list[Sequence]) -> None:
        """Under the lock: out of the engine and the live set; ids back to the free list."""
        seqs = [s for s in seqs if not s.done]
        if not seqs:
            return
        ids = [s.engine_id for s in seqs]
        try:
            self.engine.remove(ids)
        except Exception:  # noqa: BLE001 - the ids are still retired; a fresh prefill replaces state
            log.exception("engine.remove failed")
        for seq in seqs:
            seq.done = True
            self._live.pop(seq.engine_id, None)
            heapq.heappush(self._free_ids, seq.engine_id)
            self._finished += 1
