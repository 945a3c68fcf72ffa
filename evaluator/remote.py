"""The judge's side of the worker: a candidate engine that lives in another process.

`RemoteModule(worker)` stands where an imported engine module stood: its `create_engine`
returns a `RemoteEngine` whose prefill/decode/remove send the call to the worker and return
the logits as a private fp32 CPU tensor, so the public sequence, the stress suite and the
benchmark's checked passes run unchanged on it. The benchmark's timed runs go through
`RemoteEngine.run_trace`: the whole trace in one request, the judge's clock around it, every
output in the judge's hands (copied out of the shared buffer) before the clock is read.
"""
from __future__ import annotations

import gc
import math
import secrets
import select
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from evaluator import channel, slot_profile
from evaluator.common import CRASH, EngineRaised, EvalFailure, WrongResult
from evaluator.guards import digest_key, output_digest
from evaluator.isolation import Jail
from evaluator.traces import DECODE, PREFILL, Op

WORKER_SCRIPT = Path(__file__).resolve().parent / "worker.py"
ROUND_TRIPS = 31               # empty timed traces whose median is the channel's round trip
ROUND_TRIP_CAP_SECONDS = 1e-3  # the most a timed run is credited for the channel (~0.13 ms on a quiet H100 host)
HELLO_SECONDS = 120.0          # the worker's start: its confinement and `import torch`
WATCH_SECONDS = 0.2            # how often a wait looks at the worker's health
MESSAGE_SECONDS = 60.0         # for the rest of a message once its first byte arrived
EXIT_GRACE_SECONDS = 2.0       # for a worker whose channel closed to show its exit code
FIRST_BUFFER_BYTES = 1 << 22
# The outputs' handover after a timed trace (`flush`): the time it takes past HANDOVER_FACTOR times
# what the same bytes' handover cost this worker before any candidate was imported, plus
# HANDOVER_SLACK_SECONDS, is charged to the timed run. The keyed digest alone does not bind the
# outputs to the clock: it is linear in each value's 16-bit halves, and a low half moves a value by
# less than 2**-7 of itself, inside rtol, so a worker that vouched for zeros inside the clock could
# compute every output in `flush` and set the low halves to match (red-team helper, thirty-sixth
# session). What the factor and the slack leave, a worker can still put off: a fifth of an honest
# handover and 0.2 ms a trace.
HANDOVER_FACTOR = 1.2
HANDOVER_SLACK_SECONDS = 0.2e-3
HANDOVER_CALIBRATION_VOCAB = 1024
HANDOVER_CALIBRATION_RUNS = 5
# A timed trace's moments: the judge's two ends around the worker's own (evaluator/worker.py `trace`);
# the steps between them are a verdict's split_ms (evaluator/benchmark_throughput.py).
TRACE_MOMENTS = ("judge sent", "worker received", "worker's clock starts", "tokens on the device", "calls returned",
                 "device synced", "digest read", "answer sent", "judge has the answer")
# The worker's own steps (from its receiving the request to its digest read), whose thread CPU time
# it reports when the judge diagnoses its clock (cpu_ms).
WORKER_STEPS = TRACE_MOMENTS[2:7]
NAN_BYTE = b"\xff"             # 0xFFFFFFFF is a NaN as fp32: rows the worker never wrote show


class WorkerDied(EvalFailure):
    """The worker exited, broke the channel, or passed the memory cap."""

    kind = CRASH


def timed_seconds(raw: float, round_trip: float) -> float:
    """A timed run's seconds: the judge's clock less the channel's round trip, never less than half
    the clock. A round trip measured on a loaded machine once came to 4.3 ms, more than a short
    case's whole trace: subtracted in full, it timed the case at zero (a crash of the benchmark) and
    credited every longer case with time the engine spent."""
    return max(raw - round_trip, raw / 2)


@dataclass
class TraceRun:
    """One timed trace as the judge saw it."""

    seconds: float                     # the judge's clock (request sent → answer in) less the channel's round trip
    raw_seconds: float                 # the judge's clock as it read
    inner_seconds: float               # what the worker measured around the same calls (its own claim)
    peak_memory_mb: float              # the worker's claim
    outputs: list[torch.Tensor | None]  # per op: [B, vocab] fp32 (CPU, the judge's copy), None for remove
    moments: list[float]               # TRACE_MOMENTS, on the machine-wide monotonic clock
    cpu_ms: list[float]                # with `Worker(diagnose=True)`, the worker's claims (else NaN): its
    device_calls_ms: float             # thread's CPU ms in each of WORKER_STEPS; the calls' device time


class Worker:
    """A confined worker process and the channel to it. Use as a context manager: entering waits
    until it is `ready`.

    Constructing it only starts the process, so that a judge can do its own work while the worker
    confines itself and imports torch (evaluator/evaluate.py: the judge's margin); `ready` waits
    for its hello. Until then it runs only the worker's own start (evaluator/worker.py): no
    candidate code runs before the judge, waiting on it and watching its memory, asks it to load one."""

    def __init__(self, device: str, memory_bytes: int | None = None, log: Callable[[str], None] = lambda s: None,
                 triton_cache: Path | None = None, cache_scope: tuple[str, ...] = (), diagnose: bool = False):
        self.device = device
        self.diagnose = diagnose          # the worker reports its thread's CPU time a step and its calls'
                                          # device time (two events): a few us more inside the clock
        self.log = log
        self.jail = Jail(device, memory_bytes, triton_cache, tuple(cache_scope))
        self._readable: dict[str, str] = {}
        self.pending_release: list[int] = []
        self.buffer: channel.OutputBuffer | None = None
        self.layers: str | None = None    # set by `ready`: the layers its hello named
        self.round_trip = 0.0
        self.watched = time.monotonic()   # when its memory and disk use were last looked at (_watch_limits)
        self.handover = (0.0, 0.0)        # set by `ready`: an honest flush's seconds, fixed and per byte
        self.measured = False             # set by `ready`: round_trip holds the measurement
        ours, theirs = socket.socketpair()
        self.sock = ours
        try:
            self.proc = self.jail.spawn([str(WORKER_SCRIPT), str(theirs.fileno())], pass_fds=(theirs.fileno(),))
        except BaseException:   # no worker (a fork refused): nothing of this one is left behind
            ours.close()
            self.jail.close()
            raise
        finally:
            theirs.close()

    def started(self) -> "Worker":
        """Wait for the worker's hello (once). A worker started ahead of its verdict (the resident
        judge's spare) is waited for this way while another candidate's worker may still be alive:
        its round trip is measured only in `ready`, when it is taken."""
        if self.layers is None:
            # From now, not from its start: the judge's own setup (a margin on large weights) may have
            # taken longer than the worker's start, whose hello is then waiting already.
            hello, _ = self._answer(time.monotonic() + HELLO_SECONDS, "starting the worker")
            self.layers = self.jail.layers(list(hello.get("layers", [])))
            self.log(self.layers)
        return self

    def ready(self) -> "Worker":
        """Wait for the worker's hello (once), then measure the channel's round trip (once)."""
        self.started()
        if self.measured:
            return self
        measured = self._measure_round_trip()
        self.handover = self._measure_handover()
        self.measured = True
        self.round_trip = min(measured, ROUND_TRIP_CAP_SECONDS)
        if measured > ROUND_TRIP_CAP_SECONDS:
            self.log(f"the channel's round trip measured {measured * 1e6:.0f} us (a loaded machine?): at most "
                     f"{self.round_trip * 1e6:.0f} us is subtracted from a timed run")
        else:
            self.log(f"the channel's round trip, subtracted from every timed run: {self.round_trip * 1e6:.0f} us")
        return self

    def __enter__(self) -> "Worker":
        return self.ready()

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        try:
            channel.send(self.sock, {"op": "exit"})
        except channel.ChannelClosed:
            pass
        self.sock.close()
        self.jail.close()
        if self.buffer is not None:
            self.buffer.close()

    # ---- requests ----

    def _died(self, what: str, why: str) -> WorkerDied:
        try:
            code = self.proc.wait(timeout=EXIT_GRACE_SECONDS)   # a closed channel: it is exiting
        except subprocess.TimeoutExpired:
            code = None
        status = f"exited with code {code}" if code is not None else why
        tail = self.jail.log_tail()
        return WorkerDied(f"{what}: the worker {status}" + (f"; its last output:\n{tail}" if tail else ""))

    def _watch_limits(self, what: str) -> None:
        """The worker's memory against the cap, and the disks it can write (a crash past either)."""
        self.watched = time.monotonic()
        over = self.jail.over_limits()
        if over is not None:
            raise self._died(what, over)

    def _answer(self, deadline: float | None, what: str, spin: bool = False,
                max_payload: int = 0, watch: bool = True) -> tuple[dict, bytes]:
        """Wait for one answer, watching that the worker lives and stays under the memory cap
        (spinning instead of sleeping inside a timed trace's clock). The memory is looked at every
        WATCH_SECONDS of a wait and, with `watch` (not inside a clock), when an answer comes more
        than WATCH_SECONDS after the last look: a worker whose every answer came sooner was never
        looked at (red-team helper, thirty-ninth session)."""
        if spin:
            try:
                channel.spin_until_readable(self.sock, deadline, lambda: self.proc.poll() is None)
            except channel.ChannelClosed as e:
                raise self._died(what, str(e)) from e
        while True:
            wait = WATCH_SECONDS if deadline is None else min(WATCH_SECONDS, deadline - time.monotonic())
            if wait <= 0:
                raise self._died(what, "did not answer in time")
            ready, _, _ = select.select([self.sock], [], [], wait)
            if ready:
                break
            if self.proc.poll() is not None:
                raise self._died(what, "exited")
            self._watch_limits(what)
        if watch and time.monotonic() - self.watched > WATCH_SECONDS:
            self._watch_limits(what)
        try:
            header, payload, _ = channel.receive(self.sock, time.monotonic() + MESSAGE_SECONDS, max_payload)
        except channel.ChannelClosed as e:
            raise self._died(what, str(e)) from e
        return header, payload

    def request(self, header: dict, payload: bytes = b"", what: str = "", fds: tuple[int, ...] = (),
                watch: bool = True) -> dict:
        """Send one request, return its answer; a refusal becomes the EvalFailure it names."""
        return self.exchange(header, payload, what, fds, watch=watch)[0]

    def exchange(self, header: dict, payload: bytes = b"", what: str = "", fds: tuple[int, ...] = (),
                 spin: bool = False, max_payload: int = 0, watch: bool = True) -> tuple[dict, bytes]:
        """`request`, with the answer's payload (at most `max_payload` bytes)."""
        header = {**header, "release": self.pending_release}
        self.pending_release = []
        try:
            channel.send(self.sock, header, payload, fds)
        except channel.ChannelClosed as e:
            raise self._died(what, str(e)) from e
        answer, data = self._answer(None, what, spin, max_payload, watch)
        if answer.get("ok") is True:
            return answer, data
        kind, error = str(answer.get("kind", CRASH)), str(answer.get("error", "no reason given"))[:4000]
        if kind == "wrong_result":
            raise WrongResult(error)
        if kind in ("compile_error", "runtime_error"):
            raise EngineRaised(error, kind)
        raise WorkerDied(f"{what}: {error}")

    def _measure_round_trip(self) -> float:
        """The median judge's clock of an empty timed trace, measured exactly as a real one
        (arm, then the timed request, spinning on CUDA), before any candidate is imported: what
        the split itself costs a timed run, which the candidate cannot inflate."""
        times = []
        for _ in range(ROUND_TRIPS):
            self.request({"op": "arm", "engine": 0, "ops": [], "device": self.device, "vocab": 1, "rows": 0,
                          "what": "round trip"}, bytes(16), what="round trip")
            start = time.perf_counter()
            self.exchange({"op": "trace"}, what="round trip", spin=self.device == "cuda", watch=False)
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]

    def _flush_seconds(self, rows: int, vocab: int) -> float:
        """The median time of the flush after an empty timed trace whose staging holds rows x vocab."""
        self.output_rows(rows, vocab)
        times = []
        for _ in range(HANDOVER_CALIBRATION_RUNS):
            self.request({"op": "arm", "engine": 0, "ops": [], "device": self.device, "vocab": vocab, "rows": rows,
                          "what": "handover"}, bytes(16 * vocab), what="handover")
            self.exchange({"op": "trace"}, what="handover", spin=self.device == "cuda", watch=False)
            start = time.perf_counter()
            self.request({"op": "flush", "device": self.device}, what="handover", watch=False)
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]

    def _measure_handover(self) -> tuple[float, float]:
        """What the worker's own flush costs, before any candidate is imported: (fixed seconds, per byte)."""
        vocab = HANDOVER_CALIBRATION_VOCAB
        rows = FIRST_BUFFER_BYTES // (4 * vocab)
        one = self._flush_seconds(1, vocab)   # one row, not none: an empty copy issues no transfer at all
        full = self._flush_seconds(rows, vocab)
        per_byte = max(full - one, 0.0) / ((rows - 1) * vocab * 4)
        return max(one - per_byte * vocab * 4, 0.0), per_byte

    def handover_allowance(self, nbytes: int) -> float:
        """How long the handover of `nbytes` of outputs may take before the rest is charged to the clock."""
        base, per_byte = self.handover
        return HANDOVER_FACTOR * (base + per_byte * nbytes) + HANDOVER_SLACK_SECONDS

    def readable(self, path: str | Path) -> str:
        key = str(path)
        if key not in self._readable:
            self._readable[key] = self.jail.readable(path)
        return self._readable[key]

    def output_rows(self, rows: int, vocab: int) -> None:
        """Make the output buffer hold `rows` x `vocab` fp32 values."""
        need = max(rows * vocab * 4, 4)
        if self.buffer is not None and self.buffer.nbytes >= need:
            return
        size = max(need, FIRST_BUFFER_BYTES, 2 * (self.buffer.nbytes if self.buffer else 0))
        fresh = channel.OutputBuffer(size)
        self.request({"op": "buffer", "nbytes": size}, what="output buffer", fds=(fresh.fd,))
        if self.buffer is not None:
            self.buffer.close()
        self.buffer = fresh

    def poison_rows(self, rows: int, vocab: int) -> None:
        """Rows the worker does not write before it answers read as NaN."""
        self.buffer.map[:rows * vocab * 4] = NAN_BYTE * (rows * vocab * 4)

    def copy_rows(self, first: int, rows: int, vocab: int, into: torch.Tensor | None = None) -> torch.Tensor:
        """The judge's own fp32 copy of buffer rows [first, first + rows) (into `into` if given)."""
        view = torch.frombuffer(self.buffer.map, dtype=torch.float32, count=rows * vocab, offset=first * vocab * 4)
        if into is None:
            return view.view(rows, vocab).clone()
        return into.copy_(view.view(rows, vocab))


class RemoteModule:
    """Stands for the candidate's module: `create_engine` builds the engine in the worker."""

    def __init__(self, worker: Worker):
        self.worker = worker

    def create_engine(self, model_config: dict, weight_dir: str, device: str = "cuda") -> "RemoteEngine":
        w = self.worker
        answer = w.request({"op": "create", "config": model_config, "weight_dir": w.readable(weight_dir),
                            "device": device}, what="create_engine")
        return RemoteEngine(w, int(answer["engine"]), int(model_config["vocab_size"]), device)

    def profile(self, config: dict, weight_dir: str, trace: list[Op], tokens: list[list[torch.Tensor]]) -> dict:
        """The worker's profiled pass of `trace` on an engine of its own (evaluator/slot_profile.py):
        its slot_ms as the worker reports it, held to the pass's layout (slot_profile.claimed) but
        not checked further: for the model's prompt, never a score."""
        ops = [{"kind": op.kind, "ids": [int(i) for i in op.request_ids],
                "lengths": [int(t.numel()) for t in drawn] if op.kind == PREFILL else []}
               for op, drawn in zip(trace, tokens)]
        w = self.worker
        answer = w.request({"op": "profile", "ops": ops, "config": config, "weight_dir": w.readable(weight_dir),
                            "device": w.device}, _flat_tokens([t for drawn in tokens for t in drawn]),
                           what="profiled pass")
        return slot_profile.claimed(answer.get("slot_ms"))


def _flat_tokens(tensors: list[torch.Tensor]) -> bytes:
    if not tensors:
        return b""
    return torch.cat([t.reshape(-1) for t in tensors]).to("cpu", torch.int64).numpy().tobytes()


class RemoteEngine:
    """prefill/decode/remove of an engine that lives in the worker."""

    def __init__(self, worker: Worker, engine_id: int, vocab: int, device: str):
        self.worker, self.id, self.vocab, self.device = worker, engine_id, vocab, device

    def __del__(self):
        # Not a request here (a collection may run in the middle of one): the next one carries it.
        self.worker.pending_release.append(self.id)

    def _call(self, kind: str, request_ids: list[int], tokens: list[torch.Tensor], lengths: list[int]):
        rows = len(request_ids) if kind != "remove" else 0
        w = self.worker
        w.output_rows(rows, self.vocab)
        w.poison_rows(rows, self.vocab)
        w.request({"op": "call", "engine": self.id, "kind": kind, "ids": [int(i) for i in request_ids],
                   "lengths": lengths, "device": self.device, "vocab": self.vocab,
                   "what": f"{kind} of {len(request_ids)}"}, _flat_tokens(tokens), what=kind)
        return w.copy_rows(0, rows, self.vocab) if rows else None

    def prefill(self, request_ids: list[int], input_ids: list[torch.Tensor]) -> torch.Tensor:
        return self._call(PREFILL, request_ids, list(input_ids), [int(t.numel()) for t in input_ids])

    def decode(self, request_ids: list[int], token_ids: torch.Tensor) -> torch.Tensor:
        return self._call(DECODE, request_ids, [token_ids], [])

    def remove(self, request_ids: list[int]) -> None:
        self._call("remove", request_ids, [], [])

    def run_trace(self, trace: list[Op], tokens: list[list[torch.Tensor]], what: str) -> TraceRun:
        """The whole trace as one timed request. The clock starts when the request (with every
        token of the trace: the worker sees none before) is sent, and stops when its answer is
        in: a keyed digest of every output row (evaluator.guards.output_digest; the key is fresh
        per trace). The outputs travel after the clock (`flush`) and must match those digests; a
        handover slower than this worker's own honest one is charged to the clock, since the
        digests alone can be fitted afterwards (HANDOVER_FACTOR)."""
        ops, flat, rows = [], [], 0
        for op, drawn in zip(trace, tokens):
            lengths = [int(t.numel()) for t in drawn] if op.kind == PREFILL else []
            ops.append({"kind": op.kind, "ids": [int(i) for i in op.request_ids], "lengths": lengths})
            flat += drawn
            rows += len(op.request_ids) if op.kind in (PREFILL, DECODE) else 0
        payload = _flat_tokens(flat)
        w = self.worker
        w.output_rows(rows, self.vocab)
        key = digest_key(self.vocab, torch.Generator().manual_seed(secrets.randbits(62)))
        # The judge's garbage collected before the arm, not between it and the clock: a collection walks
        # the judge's whole heap and leaves the processor's shared cache cold for the worker's and the
        # judge's steps inside the clock (0.2 ms more on a trace's delivery alone, thirty-fifth session).
        gc.collect()
        # The trace's shape goes before the clock (also freeing released engines); only its tokens,
        # the secret part, go with the timed request.
        w.request({"op": "arm", "engine": self.id, "ops": ops, "device": self.device, "vocab": self.vocab,
                   "rows": rows, "what": what, "diagnose": w.diagnose}, key.numpy().tobytes(), what=what)
        spin = self.device == "cuda"   # on a CPU the judge's spinning would take a core from the engine
        gc_was = gc.isenabled()
        gc.disable()   # no collection of the judge's garbage inside its clock, nor in the handover it watches
        try:
            start = time.perf_counter()
            answer, digests = w.exchange({"op": "trace"}, payload, what=what, spin=spin, max_payload=8 * rows,
                                         watch=False)
            end = time.perf_counter()
            flushed = w.request({"op": "flush", "device": self.device}, what=what, watch=False)
            handed = time.perf_counter()
        finally:
            if gc_was:
                gc.enable()
        # Work done after the answer, before the outputs were handed over, is the engine's too.
        seconds = (timed_seconds(end - start, w.round_trip)
                   + max(0.0, handed - end - w.handover_allowance(rows * self.vocab * 4)))
        everything = w.copy_rows(0, rows, self.vocab)
        if len(digests) != 8 * rows or output_digest(everything, key).numpy().tobytes() != digests:
            raise WrongResult(f"{what}: the outputs the worker handed over after the clock are not the ones it "
                              "vouched for when it answered (digest mismatch)")
        peak = flushed.get("peak_memory_mb")
        outputs, at = [], 0
        for op in trace:
            if op.kind in (PREFILL, DECODE):
                n = len(op.request_ids)
                outputs.append(everything[at:at + n])
                at += n
            else:
                outputs.append(None)
        inner = answer.get("inner_seconds")
        theirs = answer.get("moments")
        mine = len(TRACE_MOMENTS) - 2   # the worker's: all but the judge's two ends
        cpu = _numbers(answer.get("cpu_moments"), len(WORKER_STEPS) + 1)
        calls_ms = _numbers([answer.get("device_calls_ms")], 1)[0]
        return TraceRun(seconds, end - start, _numbers([inner], 1)[0],
                        0.0 if math.isnan(peak := _numbers([peak], 1)[0]) else peak, outputs,
                        [start, *_numbers(theirs, mine), end], [(b - a) * 1e3 for a, b in zip(cpu, cpu[1:])], calls_ms)


def _numbers(claimed, count: int) -> list[float]:
    """A worker's claimed list of `count` finite numbers, or NaNs where it is not one. (Compared,
    not converted: JSON carries integers too large for a float, and math.isfinite raised on them.)"""
    if isinstance(claimed, list) and len(claimed) == count and all(
            isinstance(t, (int, float)) and not isinstance(t, bool) and abs(t) <= sys.float_info.max for t in claimed):
        return [float(t) for t in claimed]
    return [math.nan] * count
