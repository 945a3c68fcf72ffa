"""--host-breakdown of the profile subcommand: host µs of each call by the callable it spent them in.

    python3 -m scripts.gpu profile --host-breakdown [--engine PATH] [--cases ...] [--repeat 3]
        [--device cuda|cpu] [--out DIR]

Where the host microseconds of each call go, on fresh
engines built and timed as the benchmark builds them (SPEC §5). torch.profiler's CUPTI callbacks
inflate host times, so this mode never starts it: it wraps the callables a paged engine calls in
prefill/decode (its helper methods on the instance, its module's Mailbox.post and metadata
builders; and, while its engine is measured, torch.cat, torch.frombuffer, CUDAGraph.replay,
Event.synchronize, Tensor.clone/copy_/to) and sums time.perf_counter_ns per callable per call.
Per case: `repeat` fresh-engine runs wrapped and as many plain (to see what the wrappers cost);
for the median wrapped run, per call, the sections it called directly, other = whole - their sum
(the engine's own Python: loops, list building, slicing), until_copy (entry to the metadata's way
to the device, a mailbox post or a copy: the bookkeeping before it) and when the GPU finished; then, on that engine, a warm call of the
trace's first prefill and the same call once more (steady state), each after a synchronize, so
first-call effects show. GPU syncs stay outside the measured calls; only the engine's own (its
mailbox polls inside post, or staging-event waits, ev_sync) fall inside. --device cpu runs the engine's CPU path (no graphs,
no GPU times): a check of the wrapping on a machine without a GPU. Numbers go to --out/profile.json.
"""
from __future__ import annotations

import functools
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from evaluator.benchmark_throughput import BENCHMARK_SEED, _calls, _draw_trace, release_device_memory
from evaluator.common import make_generator, synchronize
from evaluator.traces import DECODE, PREFILL, Op, benchmark_trace


def describe(op: Op) -> tuple[str, int, int]:
    """(kind, requests, tokens) of one trace call."""
    tokens = sum(op.lengths) if op.kind == PREFILL else len(op.request_ids) if op.kind == DECODE else 0
    return op.kind, len(op.request_ids), tokens


# Engine methods wrapped on the instance, and the section each is reported under. An engine
# without one of them (another template, an LLM's rewrite) just lacks that section.
ENGINE_METHODS = {
    "_ensure_positions": "ensure_pos", "_allocate_row": "alloc_row", "_allocate_blocks": "alloc_blk",
    "_prefill_bucket": "bucket", "_decode_graph_key": "bucket",
    "_capture_prefill": "capture", "_capture_decode": "capture",
    "_to_device": "to_device", "_copy_to_device": "h2d_meta", "_input": "input",
    "_prefill_step": "eager_step", "_decode_step": "eager_step",
}
MODULE_FUNCTIONS = {"prefill_metadata": "meta_build", "decode_metadata": "meta_build"}   # engine-module globals, looked up at call time
METADATA_COPIES = ("post", "h2d_meta", "to_device")     # until_copy ends where the first of these starts
# Table columns in this order; labels not listed follow in order of appearance.
SECTION_ORDER = ("ensure_pos", "alloc_row", "alloc_blk", "input", "bucket", "capture", "to", "cat", "meta_build",
                 "copy_", "post", "to_device", "h2d_meta", "eager_step", "replay", "clone")

# (labels from the outermost wrapped callable down to this one, start ns, end ns)
Span = tuple[tuple[str, ...], int, int]
_MISSING = object()


def torch_targets() -> list[tuple[Any, str, str]]:
    """(owner, attribute, label) of the torch callables wrapped: process-wide, so installed only
    after the engine is built and removed once its measurements are done. CUDAGraph.replay at class
    level covers graphs the engine recaptures (after its KV pool grows) as well as the first ones."""
    return [(torch, "cat", "cat"), (torch.cuda.CUDAGraph, "replay", "replay"),
            (torch.cuda.Event, "synchronize", "ev_sync"), (torch.Tensor, "clone", "clone"),
            (torch.Tensor, "copy_", "copy_"), (torch.Tensor, "to", "to"), (torch, "frombuffer", "frombuffer")]


class HostClock:
    """Wrappers that, while `active`, record a Span per call of the wrapped callable. A wrapped
    call inside another (Tensor.to inside _input) gets the path of labels above it."""

    def __init__(self) -> None:
        self.active = False
        self.spans: list[Span] = []
        self._stack: list[str] = []

    def wrap(self, label: str, fn: Callable) -> Callable:
        stack, spans, now = self._stack, self.spans, time.perf_counter_ns

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.active:
                return fn(*args, **kwargs)
            stack.append(label)
            path = tuple(stack)
            t0 = now()
            try:
                return fn(*args, **kwargs)
            finally:
                spans.append((path, t0, now()))
                stack.pop()
        return timed

    def take(self) -> list[Span]:
        """The spans recorded since the last take (the list object stays: the wrappers hold it)."""
        out = list(self.spans)
        self.spans.clear()
        return out


def wrapper_overhead_us(reps: int = 20000) -> float:
    """What one active wrapped call adds to the call around it (best of 3), to read `whole`
    against: it holds about wrapped_calls times this more than an unwrapped call."""
    clock, bare = HostClock(), lambda: None
    timed = clock.wrap("calibration", bare)
    best = float("inf")
    for _ in range(3):
        clock.active = True
        t0 = time.perf_counter_ns()
        for _ in range(reps):
            timed()
        t1 = time.perf_counter_ns()
        for _ in range(reps):
            bare()
        t2 = time.perf_counter_ns()
        clock.active = False
        clock.take()
        best = min(best, ((t1 - t0) - (t2 - t1)) / reps / 1e3)
    return best


def instrument(engine: Any, clock: HostClock) -> list[tuple[Any, str, Callable]]:
    """(owner, attribute, wrapper) for `patched`: the engine's methods on the instance (shadowing
    the class's, so the template is untouched), its staging buffers' copy (older engines) or its
    module's Mailbox.post (at class level: every mailbox), its module's metadata builders, and the
    torch callables of torch_targets."""
    module = sys.modules[type(engine).__module__]
    targets = [(engine, name, clock.wrap(label, getattr(engine, name)))
               for name, label in ENGINE_METHODS.items() if callable(getattr(engine, name, None))]
    staging = getattr(engine, "staging", None)
    if callable(getattr(staging, "copy", None)):
        targets.append((staging, "copy", clock.wrap("staging", staging.copy)))
    mailbox = getattr(module, "Mailbox", None)
    if callable(getattr(mailbox, "post", None)):
        targets.append((mailbox, "post", clock.wrap("post", mailbox.post)))
    targets += [(module, name, clock.wrap(label, getattr(module, name)))
                for name, label in MODULE_FUNCTIONS.items() if callable(getattr(module, name, None))]
    targets += [(owner, name, clock.wrap(label, getattr(owner, name)))
                for owner, name, label in torch_targets() if hasattr(owner, name)]
    return targets


@contextmanager
def patched(targets: list[tuple[Any, str, Callable]]) -> Iterator[None]:
    """setattr every (owner, name, value); on exit put back the owner's own attribute, or delete
    ours where the attribute was inherited (a Tensor method, an instance's bound method)."""
    saved = []
    try:
        for owner, name, value in targets:
            old = vars(owner).get(name, _MISSING)
            setattr(owner, name, value)
            saved.append((owner, name, old))
        yield
    finally:
        for owner, name, old in reversed(saved):
            if old is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, old)


def call_row(op: Op, start_ns: int, end_ns: int, spans: list[Span], gpu_done_ms: float | None) -> dict:
    """One call's breakdown in µs: `sections_us`, the wrapped callables the call made directly;
    `other_us` = whole - their sum; `until_copy_us`, entry to the first metadata copy (overlaps
    the sections before it); `nested_us`, wrapped callables inside those, by path."""
    kind, batch, tokens = describe(op)
    sections: dict[str, float] = defaultdict(float)
    nested: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for path, s, e in spans:
        key = "/".join(path)
        (sections if len(path) == 1 else nested)[key] += (e - s) / 1e3
        counts[key] += 1
    whole = (end_ns - start_ns) / 1e3
    copy_at = min((s for path, s, _ in spans if len(path) == 1 and path[0] in METADATA_COPIES), default=None)
    return {"op": kind, "batch": batch, "tokens": tokens, "whole_us": round(whole, 2),
            "sections_us": {k: round(v, 2) for k, v in sections.items()},
            "other_us": round(whole - sum(sections.values()), 2),
            "until_copy_us": None if copy_at is None else round((copy_at - start_ns) / 1e3, 2),
            "nested_us": {k: round(v, 2) for k, v in nested.items()}, "counts": dict(counts),
            "wrapped_calls": len(spans), "gpu_done_ms": gpu_done_ms}


def measured_region(calls: list[tuple], ops: list[Op], device: str, clock: HostClock | None) -> tuple[float, list[dict]]:
    """The SPEC §5 timed region over `calls` (synchronize, clock, every call, synchronize, clock),
    each call's interval read by perf_counter_ns around it, the clock's wrappers active only inside
    it; on CUDA an event after each call, outside its interval. Returns elapsed ms, one row a call."""
    cuda, now = device == "cuda", time.perf_counter_ns
    start = torch.cuda.Event(enable_timing=True) if cuda else None
    raw = []
    with torch.no_grad():
        synchronize(device)
        region = now()
        if start is not None:
            start.record()
        for op, (fn, args, _) in zip(ops, calls):
            if clock is not None:
                clock.active = True
            t0 = now()
            fn(*args)
            t1 = now()
            if clock is not None:
                clock.active = False
            event = None
            if cuda:
                event = torch.cuda.Event(enable_timing=True)
                event.record()
            raw.append((op, t0, t1, clock.take() if clock is not None else [], event))
        synchronize(device)
        elapsed_ms = (now() - region) / 1e6
    return elapsed_ms, [call_row(op, t0, t1, spans, None if ev is None else round(start.elapsed_time(ev), 4))
                        for op, t0, t1, spans, ev in raw]


def steady_prefill(engine: Any, trace: list[Op], tokens: list[list[torch.Tensor]], device: str,
                   clock: HostClock) -> dict | None:
    """The trace's first prefill again on this engine, its requests removed after each call:
    once as a warm call, then once more (steady state), each its own region after a synchronize."""
    index = next((i for i, op in enumerate(trace) if op.kind == PREFILL), None)
    if index is None:
        return None
    op = trace[index]
    ids = list(op.request_ids)
    out = {}
    for key in ("warm", "steady"):
        out[key] = measured_region([(engine.prefill, (ids, tokens[index]), True)], [op], device, clock)[1][0]
        engine.remove(ids)
    return out


def breakdown_run(module: Any, config: dict, weight_dir: str, trace: list[Op], gen: torch.Generator,
                  device: str, wrapped: bool) -> dict:
    """As one benchmark repeat: a fresh engine, tokens drawn, the timed region. `wrapped`: with the
    HostClock's wrappers installed (after create_engine, so its captures run bare), then
    steady_prefill on the same engine."""
    release_device_memory(device)
    engine = module.create_engine(config, weight_dir, device)
    tokens = _draw_trace(trace, gen, int(config["vocab_size"]), device)
    calls = _calls(engine, trace, tokens)
    if not wrapped:
        elapsed_ms, rows = measured_region(calls, trace, device, None)
        return {"elapsed_ms": round(elapsed_ms, 4), "whole_us": [r["whole_us"] for r in rows]}
    clock = HostClock()
    with patched(instrument(engine, clock)):
        elapsed_ms, rows = measured_region(calls, trace, device, clock)
        steady = steady_prefill(engine, trace, tokens, device, clock)
    return {"elapsed_ms": round(elapsed_ms, 4), "calls": rows, "first_prefill_again": steady}


def median_by_elapsed(runs: list[dict]) -> dict:
    return sorted(runs, key=lambda r: r["elapsed_ms"])[len(runs) // 2]


def host_breakdown(module: Any, config: dict, weight_dir: str, case_names: list[str], repeat: int,
                   device: str) -> dict:
    """All warm-up engines first (each runs its trace once), then per case `repeat` times a plain
    fresh-engine run and a wrapped one; the median wrapped run (by elapsed) is the one reported."""
    cases = {name: (benchmark_trace(name), make_generator(BENCHMARK_SEED, device)) for name in case_names}
    for trace, gen in cases.values():
        breakdown_run(module, config, weight_dir, trace, gen, device, wrapped=False)
    out: dict = {"wrapper_overhead_us": round(wrapper_overhead_us(), 3), "cases": {}}
    for name, (trace, gen) in cases.items():
        plain, wrapped = [], []
        for _ in range(repeat):
            plain.append(breakdown_run(module, config, weight_dir, trace, gen, device, wrapped=False))
            wrapped.append(breakdown_run(module, config, weight_dir, trace, gen, device, wrapped=True))
        out["cases"][name] = {"elapsed_ms": [r["elapsed_ms"] for r in wrapped],
                              "plain_elapsed_ms": [r["elapsed_ms"] for r in plain],
                              "median_run": median_by_elapsed(wrapped), "plain_median_run": median_by_elapsed(plain),
                              "runs": wrapped}
    return out


def print_host_breakdown(report: dict) -> None:
    """Per case, one row a call of the median wrapped run, then the warm and steady repeats of its
    first prefill; below, the nested sections of the first and last call of each kind and of
    those two."""
    hb = report["host_breakdown"]
    print(f"{report['device']}, torch {report['torch']}: host µs per call (perf_counter_ns; no profiler). "
          f"plain = the call in the median unwrapped run; until_copy = entry to the metadata copy (overlaps "
          f"the sections); other = whole - sections; each wrapped call adds ~{hb['wrapper_overhead_us']:.2f} µs "
          f"to whole (nwrap of them)")
    for name, c in hb["cases"].items():
        med, plain = c["median_run"], c["plain_median_run"]
        rows = [(f"{i} {r['op']}", r, plain["whole_us"][i]) for i, r in enumerate(med["calls"])]
        if med["first_prefill_again"]:
            rows += [(f"{key} prefill", r, None) for key, r in med["first_prefill_again"].items()]
        seen = {k for _, r, _ in rows for k in r["sections_us"]}
        labels = [k for k in SECTION_ORDER if k in seen] + sorted(seen - set(SECTION_ORDER))
        fmt = lambda v, w: f" {'-':>{w - 1}}" if v is None else f" {v:>{w - 1}.1f}"   # never runs into its left
        widths = [max(len(k), 6) + 1 for k in labels]
        print(f"\n=== {name}: elapsed ms wrapped {' '.join(f'{x:.3f}' for x in c['elapsed_ms'])}, "
              f"plain {' '.join(f'{x:.3f}' for x in c['plain_elapsed_ms'])}")
        print(f"{'call':16}{'batch':>6}{'tok':>6}{'whole':>8}{'plain':>8}{'until_copy':>11}"
              + "".join(f"{k:>{w}}" for k, w in zip(labels, widths)) + f"{'other':>8}{'nwrap':>6}{'gpu_ms':>9}")
        for label, r, p in rows:
            gpu = "-" if r["gpu_done_ms"] is None else f"{r['gpu_done_ms']:.3f}"
            print(f"{label:16}{r['batch']:>6}{r['tokens']:>6}{fmt(r['whole_us'], 8)}{fmt(p, 8)}"
                  f"{fmt(r['until_copy_us'], 11)}"
                  + "".join(fmt(r["sections_us"].get(k), w) for k, w in zip(labels, widths))
                  + f"{fmt(r['other_us'], 8)}{r['wrapped_calls']:>6}{gpu:>9}")
        trace_rows = [r for _, r, p in rows if p is not None]
        ends = {id(next(r for r in seq if r["op"] == op)) for seq in (trace_rows, trace_rows[::-1])
                for op in {r["op"] for r in trace_rows}}   # the first and last call of each kind
        for label, r, p in rows:
            if r["nested_us"] and (p is None or id(r) in ends):
                inner = ", ".join(f"{k} {v:.1f}" + (f" (x{r['counts'][k]})" if r["counts"][k] > 1 else "")
                                  for k, v in r["nested_us"].items())
                print(f"  nested in {label}: {inner}")
