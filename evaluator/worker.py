"""The worker: the only process that imports a candidate engine (docs/reliability.md).

    python3 -I evaluator/worker.py <channel fd> <jail spec JSON>      (started by evaluator/remote.py)

First it confines itself (evaluator/isolation.py: own uid, no network, limits, death with the
judge), then it imports torch (and on a GPU makes its context and imports Triton), says hello
with the layers it holds, and serves the judge's
requests one at a time: load the candidate, create an engine, run one call, run a whole timed
trace, run a profiled pass (evaluator/slot_profile.py), release an engine, start and stop the
compile-ahead process beside it (evaluator/compile_ahead.py). Token ids arrive with each request; logits go into the output buffer
the judge lent it. Nothing here is trusted by the judge: a candidate can rewrite any of it in
this process, and all it gains is a worker that answers wrongly, which the judge checks.
"""
from __future__ import annotations

import gc
import itertools
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # isolated mode (-I) adds no path

from evaluator.isolation import JailSpec, enter  # noqa: E402  (the standard library only)

PREFILL, DECODE, REMOVE = "prefill", "decode", "remove"   # evaluator/traces.py's kinds
AHEAD_SCRIPT = str(Path(__file__).with_name("compile_ahead.py"))   # started by `ahead`
AHEAD_LOG_BYTES = 2000     # of what the compile-ahead process said, in stop_ahead's answer
WARM_OUTPUT_DTYPES = ("float16", "bfloat16", "float32")   # an engine's logits, copied into the fp32 staging rows


class Refusal(Exception):
    """A request the worker answers with an error verdict: (error_kind, message)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def _token_count(op: dict) -> int:
    """The tokens one call of a trace carries: its prompts', or one a decoded request."""
    if op["kind"] == PREFILL:
        return sum(op["lengths"])
    return len(op["ids"]) if op["kind"] == DECODE else 0


class MaskedTokens:
    """A trace's tokens on the device, each call's XOR-ed with a random key of its own that stays
    in this process's memory; a call gets its tokens unmasked into a new tensor (`of`) only when
    it is made. So no tensor an engine is handed, nor any device memory it could read by address
    (a Triton kernel can load from any address near its inputs), holds the tokens of a call still
    to come. Views of one token tensor had handed an engine every later call's tokens through
    untyped_storage(), and an engine reading ahead there was timed ~9x faster on decode by answering
    later steps from one pass over their tokens (a red-team helper, twenty-ninth session). The keys
    ride to the device as kernel arguments (a scalar XOR): one small kernel a call, as a copy.

    Made in two steps so that a timed trace pays only the second inside the judge's clock: the
    keys, their per-token mask and the buffers (pinned on the host, on the device) are made from
    the calls' token counts before the clock (`arm`); `fill` then masks the payload into the pinned
    buffer, one XOR, and copies it to the device (a DMA from pinned memory, no staging). Made inside the clock, with a
    pageable copy, that had cost a timed trace 0.66-0.80 ms in the worker on an H200, most of the
    prefill case's 0.7 ms (python3 -m scripts.gpu judge-split, thirty-fourth session)."""

    def __init__(self, torch, device: str, counts: list[int]):
        self.keys = [secrets.randbits(62) for _ in counts]
        self.starts = [0, *itertools.accumulate(counts)]
        self.mask = torch.repeat_interleave(torch.tensor(self.keys, dtype=torch.int64),
                                            torch.tensor(counts, dtype=torch.int64))
        on_device = device != "cpu"
        self.host = torch.empty(self.starts[-1], dtype=torch.int64, pin_memory=on_device)
        self.masked = torch.empty(self.starts[-1], dtype=torch.int64, device=device) if on_device else self.host

    def fill(self, torch, payload: bytes) -> "MaskedTokens":
        """The calls' tokens (int64 bytes, the counts' total) masked into place."""
        if len(payload) != 8 * self.host.numel():
            raise ValueError(f"{len(payload)} bytes of tokens for {self.host.numel()} tokens")
        if payload:
            torch.bitwise_xor(torch.frombuffer(bytearray(payload), dtype=torch.int64), self.mask, out=self.host)
        if self.masked is not self.host:
            # From pinned memory, and synchronous: on the device before any call, whatever stream
            # an engine then makes current (an asynchronous copy is ordered on one stream only).
            self.masked.copy_(self.host)
        return self

    def of(self, index: int):
        return self.masked[self.starts[index]:self.starts[index + 1]] ^ self.keys[index]


def warm_trace_buffers(tokens: MaskedTokens, output_digest, staging, key) -> None:
    """Allocate and free, before the clock, the buffers a timed trace's own steps will take inside
    it (each call's unmasked tokens, the digest's temporaries over every staging row), so that
    torch's caching allocator hands them back from its cache there: the judge's release before
    each engine empties that cache, and an allocation it then cannot serve asks CUDA for memory
    inside the clock (python3 -m scripts.gpu timed-path, docs/benchmarks.md thirty-fourth
    session). The unmasking is warmed with throwaway keys, never the calls' own: a call's real key
    applied to the buffer's stale bytes would leave, in a freed block an engine can read by
    address, what unmasks that call's tokens once they are filled in (a red-team helper, this
    session)."""
    for start, end in zip(tokens.starts, tokens.starts[1:]):
        tokens.masked[start:end] ^ secrets.randbits(62)   # of()'s kernel at of()'s sizes
    output_digest(staging, key)


class AheadProcess:
    """evaluator/compile_ahead.py beside the worker, on a request (the engine and the judge's plan)
    written to a file for it. In its own process group (`kill` kills the group: the assembler and
    C compiler processes its threads start), in the worker's session (the memory watch's)."""

    def __init__(self, engine: str, models: bytes):
        with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="compile-ahead-", delete=False) as f:
            json.dump({"engine": engine, "models": json.loads(models)}, f)
        self.request = Path(f.name)
        try:
            self.log = tempfile.TemporaryFile()   # what it says (stdout and stderr), for `kill`'s answer
            try:
                self.proc = subprocess.Popen([sys.executable, "-I", AHEAD_SCRIPT, f.name], stdin=subprocess.DEVNULL,
                                             stdout=self.log, stderr=subprocess.STDOUT, process_group=0)
            except BaseException:
                self.log.close()
                raise
        except BaseException:
            self.request.unlink(missing_ok=True)
            raise

    def kill(self) -> str:
        """Kill it and its group; the last AHEAD_LOG_BYTES of what it said."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.request.unlink(missing_ok=True)
        self.log.seek(max(self.log.seek(0, os.SEEK_END) - AHEAD_LOG_BYTES, 0))
        said = self.log.read().decode(errors="replace")
        self.log.close()
        return said


class Worker:
    def __init__(self, sock: socket.socket):
        import torch
        from evaluator import channel, common, guards
        if torch.cuda.is_available():   # the device's context and Triton before the hello, not in a verdict's
            torch.cuda.init()          # time: a spare worker (evaluator/resident.py) has them ready
            try:
                import triton  # noqa: F401
            except ImportError:
                pass
        self.torch, self.channel, self.common, self.guards = torch, channel, common, guards
        self.sock = sock
        self.module = None
        self.engine_path = None
        self.ahead_proc: AheadProcess | None = None   # evaluator/compile_ahead.py, while it runs
        self.engines: dict[int, object] = {}
        self.next_id = 0
        self.buffer = None
        self.host = None          # the buffer as an fp32 tensor
        self.staging = None       # a timed trace's outputs, on the device
        self.key = None           # its digest key
        self.trace_request = None  # its shape, from the arm request
        self.trace_tokens = None   # its tokens' keys and buffers (MaskedTokens), filled by the timed request
        self.diagnose = False      # arm's: the judge diagnoses its clock (CPU time a step, device time)
        self.trace_events = None   # arm's two CUDA events when it does, on CUDA
        self.digest_host = None    # its digests' pinned landing place
        self.armed = False        # spin for the next request (a timed trace is coming)

    # ---- requests ----

    def load(self, req: dict, _: bytes) -> dict:
        self.module = self.common.load_engine_module(req["engine"])
        self.engine_path = req["engine"]
        return {}

    def ahead(self, req: dict, payload: bytes) -> dict:
        """Start evaluator/compile_ahead.py beside this worker on the loaded engine and the judge's
        plan (the payload, JSON: its models and calls; a full stress suite's is ~100 KB, a tenth of
        a header's cap): it compiles their Triton kernels on a thread pool, into this worker's
        cache, while the judge's untimed stages run here. Stopped before anything is timed
        (`stop_ahead`)."""
        if self.engine_path is None:
            raise Refusal(self.common.CRASH, "compile ahead before load")
        self.stop_ahead()
        try:
            self.ahead_proc = AheadProcess(self.engine_path, payload)
        except Exception as e:  # noqa: BLE001 - best effort (no process left, an old Python): the verdict goes on
            return {"pid": None, "error": f"{type(e).__name__}: {e}"}
        return {"pid": self.ahead_proc.proc.pid}

    def stop_ahead(self, *_) -> dict:
        """Kill the compile-ahead process and its group, and wait for it: nothing of it runs beside
        a timing. The answer has the end of what it said (its progress, per model), for the log."""
        if self.ahead_proc is None:
            return {}
        said = self.ahead_proc.kill()
        self.ahead_proc = None
        return {"said": said}

    def set_buffer(self, req: dict, _: bytes, fds: list[int]) -> dict:
        if len(fds) != 1:
            raise Refusal(self.common.CRASH, "a buffer request must carry one descriptor")
        self.host = None
        if self.buffer is not None:
            self.buffer.close()
        self.buffer = self.channel.OutputBuffer(int(req["nbytes"]), fds[0])
        self.host = self.torch.frombuffer(self.buffer.map, dtype=self.torch.float32)
        # Its pages mapped now, untimed: a first write faults each one in, and the first handover
        # into a grown buffer would read as slower than this worker's honest one (evaluator/remote.py
        # HANDOVER_FACTOR), charging the engine for the judge's growing it.
        self.host.zero_()
        return {}

    def create(self, req: dict, _: bytes) -> dict:
        if self.module is None:
            raise Refusal(self.common.CRASH, "create before load")
        engine = self.common.call_engine("create_engine", self.module.create_engine, req["config"],
                                         req["weight_dir"], req["device"])
        self.next_id += 1
        self.engines[self.next_id] = engine
        return {"engine": self.next_id}

    def release(self, ids: list[int]) -> None:
        if not ids:
            return
        for i in ids:
            self.engines.pop(i, None)
        gc.collect()
        if self.torch.cuda.is_available():
            self.torch.cuda.empty_cache()

    def _tokens(self, payload: bytes, device: str, ops: list[dict]) -> "MaskedTokens":
        """The calls' tokens in one step, for an untimed request."""
        return MaskedTokens(self.torch, device, [_token_count(op) for op in ops]).fill(self.torch, payload)

    def _bind(self, engine, op: dict, tokens: "MaskedTokens", index: int):
        """(method, args, rows) of call `index` of a trace, its tokens unmasked into a tensor of
        their own (MaskedTokens.of)."""
        ids, lengths = list(op["ids"]), list(op["lengths"])
        if op["kind"] == PREFILL:
            prompts = list(tokens.of(index).split(lengths)) if lengths else []
            return engine.prefill, (ids, prompts), len(ids)
        if op["kind"] == DECODE:
            return engine.decode, (ids, tokens.of(index)), len(ids)
        return engine.remove, (ids,), 0

    def _validate(self, out, rows: int, vocab: int, what: str) -> None:
        torch = self.torch
        if type(out) is not torch.Tensor:
            raise Refusal(self.common.WRONG_RESULT, f"{what}: returned {type(out).__name__}, not a plain torch.Tensor")
        if out.layout != torch.strided or out.device.type == "meta":
            raise Refusal(self.common.WRONG_RESULT, f"{what}: returned a {out.layout} tensor on {out.device}")
        if tuple(out.shape) != (rows, vocab):
            raise Refusal(self.common.WRONG_RESULT, f"{what}: returned shape {tuple(out.shape)}, "
                                                    f"expected {(rows, vocab)}")
        if not out.is_floating_point():
            raise Refusal(self.common.WRONG_RESULT, f"{what}: returned dtype {out.dtype}, expected a floating dtype")

    def call(self, req: dict, payload: bytes) -> dict:
        """One engine call; its logits into the buffer's first rows (right away: the engine may
        overwrite a returned view on its next call)."""
        engine, device, vocab = self.engines[req["engine"]], req["device"], int(req["vocab"])
        what = req["what"]
        fn, args, rows = self._bind(engine, req, self._tokens(payload, device, [req]), 0)
        self.guards.poison_free_device_memory(device)
        with self.torch.no_grad():
            out = self.common.call_engine(what, fn, *args)
        if rows:
            self._validate(out, rows, vocab, what)
            self.host[:rows * vocab].view(rows, vocab).copy_(out.detach())
        return {}

    def arm(self, req: dict, payload: bytes) -> dict:
        """Before a timed trace, outside the judge's clock: its shape (engine, ops), the outputs'
        staging rows and the digest key (payload) on the device, peak memory reset, the device
        idle; the timed request (the tokens) is then awaited spinning, not asleep."""
        self.stop_ahead()
        torch, device = self.torch, req["device"]
        vocab = int(req["vocab"])
        self.staging = torch.empty(int(req["rows"]), vocab, dtype=torch.float32, device=device)
        self.key = torch.frombuffer(bytearray(payload), dtype=torch.int64).view(2 * vocab).to(device)
        # The judge's own kernels of the timed region run once here, outside the clock: CUDA loads a
        # kernel at its first use, and the digest's were first used inside a worker's first timed
        # trace, ~60 ms charged to the engine (a screen's prefill case on an H100, twenty-second
        # session). The staging copies here, the digest's in warm_trace_buffers.
        for dtype in WARM_OUTPUT_DTYPES:
            self.staging[:1].copy_(torch.zeros(1, vocab, dtype=getattr(torch, dtype), device=device))
        self.trace_tokens = MaskedTokens(torch, device, [_token_count(op) for op in req["ops"]])
        self.digest_host = torch.empty(int(req["rows"]), dtype=torch.int64, pin_memory=device != "cpu")
        warm_trace_buffers(self.trace_tokens, self.guards.output_digest, self.staging, self.key)
        self.trace_request = req   # the trace's shape now, its tokens with the timed request
        # scripts.gpu judge-split's diagnosis: the thread's CPU time at each moment and, on CUDA, the
        # calls' device time by two events, each recorded once here (CUDA makes an event at its first
        # record: not inside the clock).
        self.diagnose = bool(req.get("diagnose"))
        self.trace_events = None
        if self.diagnose and device == "cuda":
            self.trace_events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            for event in self.trace_events:
                event.record()
        self.common.synchronize(device)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        self.armed = device == "cuda"
        return {}

    def trace(self, _: dict, payload: bytes) -> tuple[dict, bytes]:
        """Every call of a trace back to back, each output copied into its staging rows as it
        returns, one device sync, then the digest of every row (evaluator.guards.output_digest):
        the official timed region plus those copies and the digest. The judge's clock runs
        around this request; the digests are its answer's payload, the outputs travel afterwards
        (`flush`)."""
        received = time.perf_counter()
        cpu_time = time.thread_time if self.diagnose else float   # float() is 0.0: no syscall inside the clock
        cpu = [cpu_time()]
        tokens, self.trace_tokens = self.trace_tokens, None   # one trace per arm, even if fill raises
        if tokens is None:
            raise Refusal(self.common.CRASH, "a trace request without its arm")
        torch, req = self.torch, self.trace_request
        engine, device, vocab = self.engines.get(req["engine"]), req["device"], int(req["vocab"])
        ops, staging, events = req["ops"], self.staging, self.trace_events
        with torch.no_grad():
            start = time.perf_counter()
            cpu.append(cpu_time())
            tokens.fill(torch, payload)
            uploaded = time.perf_counter()
            cpu.append(cpu_time())
            if events:
                events[0].record()
            row = 0
            for index, op in enumerate(ops):
                fn, args, rows = self._bind(engine, op, tokens, index)
                what = f"{req['what']} call {index + 1} ({op['kind']} of {len(op['ids'])})"
                out = self.common.call_engine(what, fn, *args)
                if rows:
                    self._validate(out, rows, vocab, what)
                    staging[row:row + rows].copy_(out.detach())
                    row += rows
            returned = time.perf_counter()
            cpu.append(cpu_time())
            if events:
                events[1].record()
            self.common.synchronize(device)
            synced = time.perf_counter()
            cpu.append(cpu_time())
            digests = self.digest_host[:row]
            digests.copy_(self.guards.output_digest(staging[:row], self.key), non_blocking=True)   # pinned
            self.common.synchronize(device)
            digests = digests.numpy().tobytes()
            seconds = time.perf_counter() - start
            cpu.append(cpu_time())
        # Moments on the machine-wide monotonic clock, for the judge's overhead breakdown (TRACE_MOMENTS);
        # the thread's CPU time at the worker's own (all but "answer sent"): a step it spent off the CPU shows.
        return {"inner_seconds": seconds, "moments": [received, start, uploaded, returned, synced, start + seconds,
                                                      time.perf_counter()],
                **({"cpu_moments": cpu} if self.diagnose else {}),
                **({"device_calls_ms": events[0].elapsed_time(events[1])} if events else {})}, digests

    def profile(self, req: dict, payload: bytes) -> dict:
        """The profiled pass of one trace on an engine of its own, created while the module's slot
        functions are wrapped in profiler ranges: once untimed, once under torch.profiler (on CUDA
        the creation and the untimed pass watched for the kernel names its graphs replay:
        evaluator/slot_profile.py). Its slot_ms is this worker's claim, reported, never scored."""
        from evaluator import slot_profile
        self.stop_ahead()
        torch, device = self.torch, req["device"]
        if self.module is None:
            raise Refusal(self.common.CRASH, "profile before load")
        namespace = vars(self.module)
        saved = slot_profile.wrap_slots(namespace, torch.profiler.record_function)
        seen: dict = {}   # on CUDA: kernel names and the slots that launched them, as its graphs are captured
        try:
            engine = slot_profile.watched(torch, lambda: self.common.call_engine(
                "create_engine", self.module.create_engine, req["config"], req["weight_dir"], device), device, seen)
        finally:
            namespace.update(saved)   # the engine keeps the wrappers it bound; the module is as it was
        tokens = self._tokens(payload, device, req["ops"])

        def run() -> None:
            with torch.no_grad():
                for index, op in enumerate(req["ops"]):
                    fn, args, _ = self._bind(engine, op, tokens, index)
                    self.common.call_engine(f"profiled pass, call {index + 1}", fn, *args)

        slot_profile.watched(torch, run, device, seen)   # untimed: a graph captured on demand is named too
        result = slot_profile.profile_trace(torch, run, device, seen)
        rows = getattr(getattr(engine, "kernels", None), "fused_rows", None)   # the paged engine's Kernels
        if isinstance(rows, int) and not isinstance(rows, bool):
            result["fused_rows"] = rows
        engine = None
        self.release([])
        gc.collect()
        return {"slot_ms": result}

    def flush(self, req: dict, _: bytes) -> dict:
        """After a timed trace, outside the clock: its outputs into the buffer, its peak memory."""
        rows, vocab = self.staging.shape
        self.host[:rows * vocab].view(rows, vocab).copy_(self.staging)
        cuda = req["device"] == "cuda"
        return {"peak_memory_mb": self.torch.cuda.max_memory_allocated() / 2**20 if cuda else 0.0}

    # ---- the loop ----

    def serve(self) -> None:
        handlers = {"load": self.load, "create": self.create, "call": self.call, "arm": self.arm,
                    "trace": self.trace, "flush": self.flush, "profile": self.profile, "ahead": self.ahead,
                    "stop_ahead": self.stop_ahead}
        while True:
            if self.armed:
                self.armed = False
                self.channel.spin_until_readable(self.sock, None)
            req, payload, fds = self.channel.receive(self.sock, want_fds=True)
            op = req.get("op")
            if op == "exit":
                self.stop_ahead()
                return
            try:
                self.release(req.get("release", []))
                if op == "release":
                    answer = {}
                elif op == "buffer":
                    answer = self.set_buffer(req, payload, fds)
                elif op in handlers:
                    answer = handlers[op](req, payload)
                else:
                    raise Refusal(self.common.CRASH, f"unknown request {op!r}")
                answer, data = answer if isinstance(answer, tuple) else (answer, b"")
                self.channel.send(self.sock, {"ok": True, **answer}, data)
            except Refusal as e:
                self.channel.send(self.sock, {"ok": False, "kind": e.kind, "error": str(e)})
            except self.common.EvalFailure as e:
                self.channel.send(self.sock, {"ok": False, "kind": e.kind, "error": str(e)})
            except Exception as e:  # noqa: BLE001 - the worker's own failure, reported as a crash
                self.channel.send(self.sock, {"ok": False, "kind": self.common.CRASH,
                                              "error": f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"})


def main() -> None:
    fd, spec = int(sys.argv[1]), JailSpec.from_json(sys.argv[2])
    held = enter(spec)
    sock = socket.socket(fileno=fd)
    worker = Worker(sock)
    worker.common.freeze_imports()   # before the candidate's code: what the start made, out of gc's walks
    from evaluator import channel
    channel.send(sock, {"ok": True, "layers": held, "pid": os.getpid(), "uid": os.getuid()})
    try:
        worker.serve()
    except channel.ChannelClosed:
        pass
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
