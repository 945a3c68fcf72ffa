"""Where the benchmark's timed region goes on CUDA: host vs GPU, call by call (or host µs by callable).

    python3 -m scripts.gpu profile [--engine PATH] [--cases prefill,decode,mixed] [--out DIR]

Why: a 4x128 prefill graph replays in ~0.8 ms on a warm engine, yet the benchmark's prefill
case measures ~2 ms. This script reproduces the SPEC §5 timing method (all warm-up engines
first, each running its trace once; then per run a fresh `create_engine`, tokens drawn before
the clock, synchronize -> perf_counter -> every call -> synchronize) and reports per case:
- elapsed of 3 fresh-engine runs, and for the median one, per call: when the host got the call
  back and when the GPU finished it (a CUDA event recorded right after the call, timed from one
  recorded at the clock's start);
- one more fresh-engine run under torch.profiler (CPU + CUDA): a chrome trace per case in --out,
  the top kernels by self CUDA time, the CPU ops over 20 us, and the gap from the clock's
  start to the first GPU activity;
- (a) the same run after 50 ms of GPU busy work vs after a 200 ms idle sleep (do clocks drop
  while the GPU idles before the clock starts?);
- (b) prefill only: the bucket's graph replay alone vs the full prefill call, 20 times each on
  the same engine, synchronized after each.
Default engine: the library plan the builtin search jumps to (PREFERRED, triton_split decode).
--host-breakdown: where the host microseconds of each call go instead (scripts/gpu/profile_host.py).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from evaluator.benchmark_throughput import BENCHMARK_SEED, _calls, _draw_trace, release_device_memory
from evaluator.common import load_config, load_engine_module, make_generator, resolve_device
from evaluator.traces import benchmark_trace
from scripts.gpu.common import PUBLIC_CONFIG, PUBLIC_WEIGHTS, library_plans, out_dir, render_to_file
from scripts.gpu.profile_host import describe, host_breakdown, print_host_breakdown

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATS = ("cpu_op", "cuda_runtime", "cuda_driver")
REGION = "timed_region"
GAP_US, GAPS_KEPT = 20.0, 12   # idle stretches of the GPU reported: longer than this, this many


def timed_run(engine, trace, tokens, before=None, profiled=False) -> dict:
    """The benchmark's timed region, plus a host timestamp and a CUDA event after every call;
    `before` runs just ahead of it; `profiled` marks the region for the profiler."""
    calls = _calls(engine, trace, tokens)
    start, events, host = torch.cuda.Event(enable_timing=True), [], []
    with torch.no_grad():
        if before:
            before()
        torch.cuda.synchronize()
        with record_function(REGION) if profiled else nullcontext():
            t0 = time.perf_counter()
            start.record()
            for fn, args, _ in calls:
                fn(*args)
                host.append(time.perf_counter() - t0)
                events.append(torch.cuda.Event(enable_timing=True))
                events[-1].record()
            torch.cuda.synchronize()
            elapsed = time.perf_counter() - t0
    rows, prev = [], 0.0
    for op, h, ev in zip(trace, host, events):
        kind, batch, ntok = describe(op)
        rows.append({"op": kind, "batch": batch, "tokens": ntok, "host_ms": (h - prev) * 1e3,
                     "host_done_ms": h * 1e3, "gpu_done_ms": start.elapsed_time(ev)})
        prev = h
    return {"elapsed_ms": elapsed * 1e3, "calls": rows}


def fresh_run(module, config, weight_dir, trace, gen, before=None, profiler=None) -> dict:
    """A fresh engine, tokens drawn, then the timed region (optionally under the profiler)."""
    release_device_memory("cuda")
    engine = module.create_engine(config, weight_dir, "cuda")
    tokens = _draw_trace(trace, gen, int(config["vocab_size"]), "cuda")
    if profiler is None:
        return timed_run(engine, trace, tokens, before)
    torch.cuda.synchronize()
    with profiler:
        return timed_run(engine, trace, tokens, before, profiled=True)


def trace_facts(path: Path) -> dict:
    """From a chrome trace: gap from the region's start to the first GPU activity, GPU busy time
    inside the region, and the host ops over 20 us (offset from the region's start)."""
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    region = next(e for e in events if e.get("name") == REGION and e.get("cat") == "user_annotation")
    t0, t1 = region["ts"], region["ts"] + region["dur"]
    gpu = [e for e in events if e.get("cat") in GPU_CATS]   # the profiler ran the timed region alone
    slow = [{"name": e["name"], "at_us": round(e["ts"] - t0, 1), "us": round(e["dur"], 1)}
            for e in sorted(events, key=lambda e: e["ts"])
            if e.get("cat") in HOST_CATS and t0 <= e["ts"] <= t1 and e["dur"] > 20]
    return {"region_us": region["dur"], "first_gpu_us": round(min(e["ts"] for e in gpu) - t0, 1) if gpu else None,
            "last_gpu_end_us": round(max(e["ts"] + e["dur"] for e in gpu) - t0, 1) if gpu else None,
            "gpu_busy_us": round(sum(e["dur"] for e in gpu), 1), "gpu_ops": len(gpu), "host_ops_over_20us": slow,
            **idle_gaps(gpu, t0)}


def idle_gaps(gpu: list[dict], t0: float) -> dict:
    """Where the GPU waits inside the region: every gap over GAP_US between one GPU activity's end
    and the next one's start (offsets from the region's start), the largest GAPS_KEPT of them with
    the activities on either side, and their sum. A launch-bound stretch shows as many small
    gaps, a host sync or a slow host op as one long one."""
    ops = sorted(gpu, key=lambda e: e["ts"])
    gaps, end, before = [], None, None
    for e in ops:
        if end is not None and e["ts"] - end > GAP_US:
            gaps.append({"at_us": round(end - t0, 1), "us": round(e["ts"] - end, 1),
                         "after": before["name"][:60], "before": e["name"][:60]})
        if end is None or e["ts"] + e["dur"] > end:
            end, before = e["ts"] + e["dur"], e
    return {"idle_gaps_us": round(sum(g["us"] for g in gaps), 1), "idle_gaps": len(gaps),
            "largest_gaps": sorted(gaps, key=lambda g: -g["us"])[:GAPS_KEPT]}


def sleep_cycles_per_ms() -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)   # loads the kernel
    start.record()
    torch.cuda._sleep(20_000_000)
    end.record()
    torch.cuda.synchronize()
    return 20_000_000 / start.elapsed_time(end)


def replay_vs_call(module, config, weight_dir, trace, gen, reps=20) -> dict:
    """(b): the prefill bucket's graph replayed alone vs the whole prefill call, synced each time."""
    release_device_memory("cuda")
    engine = module.create_engine(config, weight_dir, "cuda")
    if not hasattr(engine, "prefill_graphs"):
        return {}
    op = trace[0]
    prompts = _draw_trace([op], gen, int(config["vocab_size"]), "cuda")[0]
    bucket = engine._prefill_bucket(sum(op.lengths), len(op.lengths))
    if bucket not in engine.prefill_graphs:
        return {}

    def each(fn):
        out = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            out.append((time.perf_counter() - t) * 1e3)
        return {"median_ms": statistics.median(out), "min_ms": min(out), "first_ms": out[0]}

    with torch.no_grad():
        call = each(lambda: engine.prefill(list(op.request_ids), prompts))
        replay = each(engine.prefill_graphs[bucket].graph.replay)
    return {"bucket": bucket, "replay": replay, "prefill_call": call}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", help="an engine file (default: the builtin search's library plan)")
    p.add_argument("--model-config", default=PUBLIC_CONFIG)
    p.add_argument("--weight-dir", default=PUBLIC_WEIGHTS)
    p.add_argument("--cases", default="prefill,decode,mixed")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", default=out_dir("profile-out"))
    p.add_argument("--host-breakdown", action="store_true",
                   help="host µs of each call by wrapped callable, without the profiler (profile_host.py)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="with --host-breakdown: cpu checks the wrapping on the engine's CPU path")
    a = p.parse_args(argv)
    device = resolve_device(a.device)
    if device != "cuda" and not a.host_breakdown:
        p.error("without --host-breakdown this subcommand needs a GPU (--device cuda)")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    module = load_engine_module(a.engine or render_to_file(library_plans()["lib split"], "profile"))
    config, wd = load_config(a.model_config), a.weight_dir
    if a.host_breakdown:
        report = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
                  "host_breakdown": host_breakdown(module, config, wd, a.cases.split(","), a.repeat, device)}
        (out / "profile.json").write_text(json.dumps(report, indent=1))
        print_host_breakdown(report)
        return
    cases = {name: (benchmark_trace(name), make_generator(BENCHMARK_SEED, "cuda")) for name in a.cases.split(",")}
    for trace, gen in cases.values():   # all warm-ups first, as the benchmark does
        release_device_memory("cuda")
        engine = module.create_engine(config, wd, "cuda")
        timed_run(engine, trace, _draw_trace(trace, gen, int(config["vocab_size"]), "cuda"))
        del engine
    busy_cycles = int(50 * sleep_cycles_per_ms())
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": {}}
    for name, (trace, gen) in cases.items():
        runs = [fresh_run(module, config, wd, trace, gen) for _ in range(a.repeat)]
        median = sorted(runs, key=lambda r: r["elapsed_ms"])[len(runs) // 2]
        prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        profiled = fresh_run(module, config, wd, trace, gen, profiler=prof)
        trace_path = out / f"trace-{name}.json"
        prof.export_chrome_trace(str(trace_path))
        after = {"busy50ms": [], "idle200ms": []}
        befores = {"busy50ms": lambda: torch.cuda._sleep(busy_cycles), "idle200ms": lambda: time.sleep(0.2)}
        for _ in range(a.repeat):
            for key, before in befores.items():
                after[key].append(fresh_run(module, config, wd, trace, gen, before)["elapsed_ms"])
        report["cases"][name] = {
            "elapsed_ms": [r["elapsed_ms"] for r in runs], "median_run": median,
            "profiled_elapsed_ms": profiled["elapsed_ms"], "profile": trace_facts(trace_path),
            "top_kernels": prof.key_averages().table(sort_by="self_device_time_total", row_limit=15,
                                                     max_name_column_width=70),
            "before_clock": after,
            "replay_vs_call": replay_vs_call(module, config, wd, trace, gen) if name == "prefill" else None}
    (out / "profile.json").write_text(json.dumps(report, indent=1))
    print_summary(report)


def print_summary(report: dict) -> None:
    print(f"{report['device']}, torch {report['torch']}")
    for name, c in report["cases"].items():
        ms = lambda xs: " ".join(f"{x:.3f}" for x in xs)
        print(f"\n=== {name}: elapsed ms {ms(c['elapsed_ms'])}, profiled {c['profiled_elapsed_ms']:.3f}")
        print(f"{'op':8}{'batch':>6}{'tokens':>7}{'host ms':>9}{'host done':>10}{'gpu done':>9}")
        for r in c["median_run"]["calls"]:
            print(f"{r['op']:8}{r['batch']:>6}{r['tokens']:>7}{r['host_ms']:>9.3f}{r['host_done_ms']:>10.3f}"
                  f"{r['gpu_done_ms']:>9.3f}")
        f = c["profile"]
        print(f"profiled: region {f['region_us']:.0f} us, first GPU op at {f['first_gpu_us']} us, last GPU op ends "
              f"at {f['last_gpu_end_us']} us, GPU busy {f['gpu_busy_us']} us in {f['gpu_ops']} ops")
        print(f"before the clock: 50 ms GPU busy -> {ms(c['before_clock']['busy50ms'])}; "
              f"200 ms idle -> {ms(c['before_clock']['idle200ms'])}")
        if c["replay_vs_call"]:
            rv = c["replay_vs_call"]
            print(f"bucket {rv['bucket']}: replay alone {rv['replay']}; full prefill call {rv['prefill_call']}")
        print(f"GPU idle inside: {f['idle_gaps_us']} us in {f['idle_gaps']} gaps over {GAP_US:g} us; the largest "
              f"(at us, us, after -> before):")
        for g in f["largest_gaps"]:
            print(f"  {g['at_us']:>10} {g['us']:>8}  {g['after']} -> {g['before']}")
        print("host ops > 20 us in the profiled region (at us, us, name):")
        for op in f["host_ops_over_20us"][:40]:
            print(f"  {op['at_us']:>8} {op['us']:>8}  {op['name']}")
        print(c["top_kernels"])
