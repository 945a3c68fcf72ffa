"""Continuous batching over the engine's public API, on one thread that owns the engine.

The engine API (create_engine, prefill, decode, remove; SPEC.md §2) is not thread-safe and
keeps device state, so exactly one thread calls it: the scheduler's. The asyncio side hands
requests over through `submit` (a bounded waiting queue) and `cancel`, and receives each
request's tokens on its own asyncio.Queue (filled with loop.call_soon_threadsafe).

Each step:
1. drops cancelled requests (waiting ones are forgotten, live ones `engine.remove`d);
2. admits waiting requests while the batch has room (--max-batch, or fewer after the engine ran
   out of memory: below) and the step's prefill token budget lasts (at least one), and
   prefills them in one call. The engine API has no chunked prefill (`prefill` creates or
   replaces a request's whole state), so a long prompt is prefilled whole; the budget only
   keeps many prompts from landing in one step;
3. decodes every other live request in one call;
4. samples all rows at once on the device (serve/sampler.py), one `.tolist()` per step;
5. emits the tokens, and removes finished requests from the engine, freeing their ids.

Engine request ids are small integers from a free list, reused once `remove` has run. An
engine call that raises fails only the requests of that call (their clients get an error),
and the scheduler carries on.

Memory: the engine API says nothing of capacity; an engine whose KV cache cannot grow raises
torch.OutOfMemoryError (the paged engine grows its pool on demand: templates/engine/paged/
kv_pool.py.j2), which is no fault of the requests. A call that runs out of memory hands its
requests back: they leave the engine (`remove`: a failed call may have half-written their
state, so it is rebuilt by a prefill of the prompt and the tokens generated so far) and go to
the head of the waiting queue, and the scheduler caps the requests it holds at once (`room`):
those still running after a prefill ran out, half the engine's after a decode did (every
request of a decode that failed must be prefilled again: halving keeps that rare). The cap
grows by one each time as many requests as it allows have finished, and is lifted when the
engine empties. A request that runs out of memory alone in the engine can never be served:
it fails alone, with a 400 that says so.
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
OUT_OF_MEMORY = "out_of_memory"     # the error code of a request the engine cannot hold even alone
CPU_OUT_OF_MEMORY = "DefaultCPUAllocator: can't allocate memory"   # torch's CPU allocator: a plain RuntimeError


def out_of_memory(e: BaseException) -> bool:
    """Whether `e` is the engine running out of memory: torch.OutOfMemoryError (CUDA, and any device
    since torch 2.5), MemoryError, or the CPU allocator's untyped RuntimeError. An engine that wraps
    the error in its own (the tensor-parallel engine, which stops for good after any failure) is
    not retried: its requests fail as for any other error."""
    if isinstance(e, (torch.OutOfMemoryError, MemoryError)):
        return True
    return type(e) is RuntimeError and str(e).startswith("[enforce fail") and CPU_OUT_OF_MEMORY in str(e)


class QueueFull(Exception):
    """The waiting queue is at its bound (the API answers 503 with Retry-After)."""


class SchedulerEnded(Exception):
    """The scheduler thread has ended (stopped, or died): no request can be served (503)."""


ENDED = "the server's engine thread has stopped; restart the server"


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
    status: int = 500                    # with an error: its HTTP status (400: it cannot fit, ever)
    code: str | None = None              # with an error: OpenAI's `code` (OUT_OF_MEMORY)


@dataclass(eq=False)
class Sequence:
    """A request inside the scheduler."""

    request: GenerationRequest
    emit: Callable[[Output], None]
    generator: torch.Generator | None = None
    engine_id: int = -1
    output_ids: list[int] = field(default_factory=list)   # generated so far
    cancelled: bool = False
    done: bool = False

    def context_ids(self) -> list[int]:
        """What a prefill of this request feeds: its prompt, and the tokens it generated before
        running out of memory took it out of the engine (prefilled again, it continues from them)."""
        return self.request.prompt_ids + self.output_ids if self.output_ids else self.request.prompt_ids


@dataclass
class SchedulerStats:
    """Counters for /health and the tests."""

    waiting: int = 0
    live: int = 0
    steps: int = 0
    finished: int = 0
    engine_ids: list[int] = field(default_factory=list)
    room: int | None = None      # the cap on requests held at once after running out of memory
    requeued: int = 0            # requests handed back to the queue by out-of-memory errors


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
        self._room: int | None = None   # requests the engine may hold at once (None: max_batch)
        self._freed = 0                 # requests finished since the cap last moved
        self._requeued = 0
        self._stopping = False
        self._ended = False             # the thread has left its loop: submit refuses, nothing is served
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
            if self._ended:
                raise SchedulerEnded(ENDED)
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
                                  sorted(self._live), self._room, self._requeued)

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
        try:
            self._loop()
        finally:   # stopped, or killed by what the step's guard cannot catch (an engine calling sys.exit)
            self._end()

    def _end(self) -> None:
        """Fail every request still held: one in flight when the thread died had waited with no end
        (its client hung, its stream stayed open)."""
        with self._wake:
            self._ended = True
            held = [s for s in [*self._waiting, *self._live.values()] if not s.done]
            self._waiting.clear()
            self._live.clear()
            for seq in held:
                seq.done = True
                seq.emit(Output(error=ENDED, status=503))

    def _loop(self) -> None:
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
        limit = self.max_batch if self._room is None else min(self._room, self.max_batch)
        while self._waiting and len(self._live) + len(admitted) < limit:
            n = len(self._waiting[0].context_ids())
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
            prompts = [torch.tensor(s.context_ids(), dtype=torch.long, device=self.device) for s in admitted]
            out = self._call(admitted, "prefill", prompts)
            if out is not None:
                logits.append(out)
                rows += admitted
        if decoding:
            tokens = torch.tensor([s.output_ids[-1] for s in decoding], dtype=torch.long, device=self.device)
            out = self._call(decoding, "decode", tokens)
            if out is not None:
                logits.append(out)
                rows += decoding
        if not rows:
            return
        try:
            next_tokens = sample(torch.cat([x.float() for x in logits]), [s.request.params for s in rows],
                                 [s.generator for s in rows], [s.output_ids for s in rows]).tolist()
        except Exception as e:  # noqa: BLE001 - bad logits (wrong shape, NaN) from the engine
            self._fail(rows, f"sampling failed: {type(e).__name__}: {e}")
            return
        finished = []
        for seq, token in zip(rows, next_tokens):
            seq.output_ids.append(token)
            reason = (FINISH_STOP if token in seq.request.stop_ids
                      else FINISH_LENGTH if len(seq.output_ids) >= seq.request.max_tokens else None)
            seq.emit(Output(token, reason))
            if reason is not None:
                finished.append(seq)
        with self._wake:
            self._steps += 1
            self._remove(finished)

    def _call(self, seqs: list[Sequence], method: str, arg: Any) -> torch.Tensor | None:
        """One engine call; if it raises or returns the wrong shape, its requests fail alone (or,
        out of memory, go back to the queue: `_out_of_memory`)."""
        ids = [s.engine_id for s in seqs]
        try:
            out = getattr(self.engine, method)(ids, arg)
            if not isinstance(out, torch.Tensor) or tuple(out.shape) != (len(ids), self.vocab):
                raise ValueError(f"expected logits [{len(ids)}, {self.vocab}], got "
                                 f"{tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}")
            if not bool(torch.isfinite(out).all()):   # NaN had been sampled as token 0
                raise ValueError("the logits hold NaN or inf")
            return out
        except Exception as e:  # noqa: BLE001 - whatever the engine raises
            if out_of_memory(e):
                self._out_of_memory(seqs, method, e)
            else:
                log.exception("engine.%s failed", method)
                self._fail(seqs, f"engine.{method} failed: {type(e).__name__}: {e}")
            return None

    def _out_of_memory(self, seqs: list[Sequence], method: str, error: BaseException) -> None:
        """engine.`method` ran out of memory for `seqs`: they leave the engine and wait at the head of
        the queue, and the engine holds fewer requests at once until some finish (the module's
        docstring). One that ran out alone in the engine fails: it can never fit."""
        why = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:200]}"   # CUDA's is long
        with self._wake:
            held = len(self._live)    # the call's requests among them
            if held == 1:
                seq = seqs[0]
                prompt, generated = len(seq.request.prompt_ids), len(seq.output_ids)
                log.warning("engine.%s ran out of memory for a lone request of %d tokens: failed (%s)",
                            method, prompt + generated, why)
                message = (f"The engine ran out of memory holding this request alone ({prompt} prompt tokens"
                           + (f" and {generated} generated" if generated else "")
                           + f", of max_tokens {seq.request.max_tokens}): it needs more KV-cache memory than this "
                           f"server has. Please reduce the length of the prompt or max_tokens. ({why})")
                seq.emit(Output(error=message, status=400, code=OUT_OF_MEMORY))
                self._remove(seqs)
                return
            self._release(seqs)   # whatever the failed call left of their state goes
            self._waiting.extendleft(reversed(seqs))   # at the head, in the order they came
            others = held - len(seqs)
            self._room = max(1, others if method == "prefill" and others else held // 2)
            self._freed = 0
            self._requeued += len(seqs)
            log.warning("engine.%s ran out of memory with %d requests held: %d back to the queue, "
                        "at most %d held at once until requests finish (%s)",
                        method, held, len(seqs), self._room, why)

    def _release(self, seqs: list[Sequence]) -> None:
        """Under the lock: `seqs` out of the engine and the live set, their ids back to the free
        list (engine_id -1: they hold none)."""
        try:
            self.engine.remove([s.engine_id for s in seqs])
        except Exception:  # noqa: BLE001 - the ids are still retired; a fresh prefill replaces state
            log.exception("engine.remove failed")
        for seq in seqs:
            self._live.pop(seq.engine_id, None)
            heapq.heappush(self._free_ids, seq.engine_id)
            seq.engine_id = -1

    def _fail(self, seqs: list[Sequence], message: str) -> None:
        seqs = [s for s in seqs if s.engine_id >= 0 and not s.done]   # not those sent back to the queue
        for seq in seqs:
            seq.emit(Output(error=message))
        with self._wake:
            self._remove(seqs)

    def _remove(self, seqs: list[Sequence]) -> None:
        """Under the lock: out of the engine and the live set; ids back to the free list. (One that
        running out of memory sent back to the queue holds no id: it is not removed again.)"""
        seqs = [s for s in seqs if not s.done and s.engine_id >= 0]
        if not seqs:
            return
        self._release(seqs)
        for seq in seqs:
            seq.done = True
        self._finished += len(seqs)
        if self._room is not None:   # memory freed: the cap after an out-of-memory error grows back
            self._freed += len(seqs)
            if not self._live:
                self._room = None
            elif self._freed >= self._room:
                self._room, self._freed = self._room + 1, 0
                if self._room >= self.max_batch:
                    self._room = None
