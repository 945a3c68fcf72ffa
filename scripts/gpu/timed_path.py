"""Which of the worker's per-trace steps make a timed run longer than the official method's: the steps added one at a time, in one process.

    python3 -m scripts.gpu timed-path [--engine PATH | --plan NAME] [--rounds 7]
        [--cases prefill,decode,mixed] [--out DIR]

Why: the judge times an engine in its worker (evaluator/worker.py `trace`), and the worker's own
clock read 1.0-1.5 ms more than the official in-process method on the 0.7 ms prefill case and
0.4-1.5 ms more on the others (docs/benchmarks.md, thirteenth and thirty-fourth sessions). The
agent ranks candidates on that clock, so a fixed cost inside it hides most of a prefill gain.
Here the same engine is timed (a fresh engine a run, as the official method) with the worker's
steps added one at a time to the official timed region:

  official  tokens drawn on the device before the clock, one tensor a prompt (the course's method)
  views     each call's tokens one device tensor made before the clock; prompts are its split views
  unmask    the tokens masked and on the device before the clock (evaluator/worker.py
            MaskedTokens), each call's unmasked inside it as the call is made
  staging   + each call's logits copied into fp32 staging rows as it returns
  worker    the worker's `trace` since the thirty-fourth session: keys, buffers and the allocator
            made ready before the clock (its `arm`), inside it the tokens masked into pinned
            memory and copied to the device, the calls and their staging copies, one sync, the
            keyed digest of every row read back into pinned memory
  before    the worker's `trace` before then: the keys, the masking and a pageable copy to the
            device inside the clock, its buffers first allocated there, the digest in its
            nine-kernel form read back into pageable memory
  idle      `worker`, with the device idle IDLE_SECONDS before the clock, as a worker's is while the
            judge's arm answer and timed request travel. It, `worker` and `warm` also report the
            calls' device time (two CUDA events, from the tokens' arrival to the last staging
            copy), which inside a real worker read 0.82 ms on the prefill case whose official run
            takes 0.69 (thirty-fifth session)
  warm      `idle`, with a tiny kernel launched every WARM_EVERY_SECONDS through the idle gap (the
            device kept busy, as after create_engine in the official method): if `idle` reads
            longer than `worker` and `warm` does not, the device's clocks drop while it waits

Variants rotate within a round; medians over rounds. On a CPU it only checks that it runs.
Writes timed_path.json.
"""
from __future__ import annotations

import argparse
import itertools
import json
import secrets
import statistics
import time
from pathlib import Path

import torch

from evaluator.benchmark_throughput import release_device_memory
from evaluator.common import load_config, load_engine_module, make_generator, synchronize
from evaluator.guards import digest_key, output_digest
from evaluator.session import draw_op_tokens
from evaluator.traces import DECODE, PREFILL, benchmark_trace
from evaluator.worker import MaskedTokens, warm_trace_buffers
from scripts.gpu.common import PUBLIC_CONFIG, PUBLIC_WEIGHTS, add_engine_arguments, engine_file, ensure_toy_weights, out_dir

VARIANTS = ("official", "views", "unmask", "staging", "worker", "before", "idle", "warm")
IDLE_SECONDS = 0.005
WARM_EVERY_SECONDS = 50e-6
DEVICE_TIMED = ("worker", "idle", "warm")   # variants whose calls' device time is read too


def _call(engine, op, prompts):
    """The engine call of `op`: prefill takes the list of prompts, decode its one tensor."""
    ids = list(op.request_ids)
    if op.kind == PREFILL:
        return engine.prefill(ids, prompts)
    if op.kind == DECODE:
        return engine.decode(ids, prompts[0])
    engine.remove(ids)
    return None


def _before_digest(rows, key):
    """output_digest before the thirty-fourth session: masks and shifts, nine kernels (the same
    key, read as its [2, vocab] halves)."""
    bits = rows.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    low, high = key.view(2, -1)
    return ((bits & 0xFFFF) * low).sum(dim=1) + ((bits >> 16) * high).sum(dim=1)


def _before_upload(payload: bytes, device: str, counts: list[int]):
    """The worker's tokens before the thirty-fourth session, made inside the clock: (keys, starts,
    masked tokens on the device)."""
    host = torch.frombuffer(bytearray(payload), dtype=torch.int64)
    keys = [secrets.randbits(62) for _ in counts]
    mask = torch.repeat_interleave(torch.tensor(keys, dtype=torch.int64), torch.tensor(counts, dtype=torch.int64))
    return keys, [0, *itertools.accumulate(counts)], (host ^ mask).to(device)


def _keep_busy(device: str, scratch, seconds: float) -> None:
    """A tiny kernel every WARM_EVERY_SECONDS for `seconds`, then the device drained."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        scratch.add_(0)
        next_launch = time.perf_counter() + WARM_EVERY_SECONDS
        while time.perf_counter() < next_launch:
            pass
    synchronize(device)


def timed(engine, trace, drawn, device: str, variant: str, key, staging, digest_host) -> tuple[float, float]:
    """(seconds of one run of `trace` as `variant` times it, its calls' device ms or NaN)."""
    level = VARIANTS.index(variant)
    events = ([torch.cuda.Event(enable_timing=True) for _ in range(2)]
              if variant in DEVICE_TIMED and device == "cuda" else None)
    for event in events or []:
        event.record()   # CUDA makes an event at its first record: here, not inside the clock
    counts = [sum(int(t.numel()) for t in tokens) for tokens in drawn]
    lengths = [[int(t.numel()) for t in tokens] for tokens in drawn]
    joined = [torch.cat(tokens) if tokens else torch.empty(0, dtype=torch.int64, device=device) for tokens in drawn]
    payload = torch.cat(joined).cpu().numpy().tobytes()
    rows = sum(len(op.request_ids) for op in trace if op.kind in (PREFILL, DECODE))
    masked = None
    if variant in ("unmask", "staging"):
        masked = MaskedTokens(torch, device, counts).fill(torch, payload)
    elif variant in ("worker", "idle", "warm"):   # the worker's arm
        masked = MaskedTokens(torch, device, counts)
        warm_trace_buffers(masked, output_digest, staging[:rows], key)
    synchronize(device)
    if variant == "idle":
        time.sleep(IDLE_SECONDS)
    elif variant == "warm":
        _keep_busy(device, staging[:1], IDLE_SECONDS)
    start = time.perf_counter()
    if variant in ("worker", "idle", "warm"):
        masked.fill(torch, payload)
    elif variant == "before":
        keys, starts, on_device = _before_upload(payload, device, counts)
    if events:
        events[0].record()
    row = 0
    for index, op in enumerate(trace):
        if variant == "official":
            prompts = drawn[index]   # one tensor a prompt, as the course's harness draws them
        else:
            if variant == "before":
                tokens = on_device[starts[index]:starts[index + 1]] ^ keys[index]
            else:
                tokens = masked.of(index) if masked is not None else joined[index]
            prompts = list(tokens.split(lengths[index])) if op.kind == PREFILL else [tokens]
        out = _call(engine, op, prompts)
        if out is not None and level >= VARIANTS.index("staging"):
            staging[row:row + out.shape[0]].copy_(out.detach())
            row += out.shape[0]
    if events:
        events[1].record()
    synchronize(device)
    if variant in ("worker", "idle", "warm"):
        digest_host[:row].copy_(output_digest(staging[:row], key), non_blocking=True)
        synchronize(device)
    elif variant == "before":
        _before_digest(staging[:row], key).cpu()
    seconds = time.perf_counter() - start
    return seconds, events[0].elapsed_time(events[1]) if events else float("nan")


def time_variant(module, config, weight_dir, device, case, variant, gen, key, staging,
                 digest_host) -> tuple[float, float]:
    """(milliseconds of one timed run of `case` on a fresh engine as `variant` times it, its calls'
    device ms or NaN)."""
    trace = benchmark_trace(case)
    engine = module.create_engine(config, weight_dir, device)
    drawn = [draw_op_tokens(op, gen, int(config["vocab_size"]), device) for op in trace]
    with torch.no_grad():
        seconds, device_ms = timed(engine, trace, drawn, device, variant, key, staging, digest_host)
    del engine
    release_device_memory(device)
    return seconds * 1e3, device_ms


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_arguments(p)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--cases", default="prefill,decode,mixed")
    p.add_argument("--device", default="cuda", help="cpu only checks that it runs")
    p.add_argument("--out", default=out_dir("timed-path-out"))
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ensure_toy_weights()
    config = load_config(PUBLIC_CONFIG)
    vocab = int(config["vocab_size"])
    module = load_engine_module(engine_file(a))
    gen = make_generator(0, a.device)
    key = digest_key(vocab, torch.Generator().manual_seed(1)).to(a.device)
    staging = torch.empty(4096, vocab, dtype=torch.float32, device=a.device)
    digest_host = torch.empty(4096, dtype=torch.int64, pin_memory=a.device != "cpu")
    output_digest(staging[:1], key).cpu()   # the digest's kernels loaded before any clock, as the worker's arm does
    results: dict[str, dict[str, list[float]]] = {}
    device_ms: dict[str, dict[str, list[float]]] = {}
    for case in [c for c in a.cases.split(",") if c]:
        runs = results[case] = {v: [] for v in VARIANTS}
        on_device = device_ms[case] = {v: [] for v in DEVICE_TIMED}
        for variant in VARIANTS:   # warm: every kernel and code path of every variant once
            time_variant(module, config, PUBLIC_WEIGHTS, a.device, case, variant, gen, key, staging, digest_host)
        for r in range(a.rounds):
            for i in range(len(VARIANTS)):
                variant = VARIANTS[(i + r) % len(VARIANTS)]
                ms, calls_ms = time_variant(module, config, PUBLIC_WEIGHTS, a.device, case, variant, gen, key,
                                            staging, digest_host)
                runs[variant].append(ms)
                if variant in on_device:
                    on_device[variant].append(calls_ms)
        base = statistics.median(runs["official"])
        print(f"{case}: " + "  ".join(f"{v} {statistics.median(runs[v]):.3f} ms ({statistics.median(runs[v]) - base:+.3f})"
                                       for v in VARIANTS), flush=True)
        print(f"{case}, the calls on the device: " + "  ".join(f"{v} {statistics.median(on_device[v]):.3f} ms"
                                                               for v in DEVICE_TIMED), flush=True)
    device = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    (out / "timed_path.json").write_text(json.dumps({"device": device, "runs_ms": results, "calls_on_device_ms": device_ms},
                                                    indent=1))


if __name__ == "__main__":
    main()
