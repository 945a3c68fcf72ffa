"""Kernel by kernel, where one decode step and one prefill pass of a warm engine go on the GPU.

    python3 scripts/gpu_step_timeline.py [--engine PATH | --plan NAME --params JSON] [--batch 8]
        [--prompt 32] [--prefill 4x128] [--out DIR]

Why: the benchmark says how long a step takes, not whether the time is in kernel bodies or in
the gaps between them (launch latency inside a CUDA graph). This builds one engine, prefills
`batch` prompts of `prompt` tokens, and profiles (torch.profiler, CUDA activity) a few decode
steps and one more prefill call of the --prefill shape on their own warm graphs. For the middle
decode step and for the prefill call it prints every GPU activity in order: its duration and the
idle gap since the previous one ended; then per kernel name: count, total, mean duration, mean
gap before. The step's span (first start to last end) = sum of durations + sum of gaps.

Before the profile it also times whole calls without the profiler, with the tokens on the device
as the benchmark draws them: how long the host takes to return from a call (a call's host work
that the GPU cannot hide when it is longer than the call's kernels) and the call's wall time to
the end of its kernels, for a warm engine's decode step and prefill, and for the first prefill of
a fresh engine (what the benchmark's prefill case times), whose host functions it then lists
by their own time under cProfile (another fresh engine).

The engine is --engine, else --plan (one of scripts/gpu_engine_check.library_plans; default
"lib split linear", run.sh's usual final plan) with --params added to its params.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch.profiler import ProfilerActivity, profile

from agent.plan import Plan
from evaluator.common import load_config, load_engine_module
from scripts.gpu_engine_check import library_plans, render_to_file
from scripts.gpu_profile import GPU_CATS

DECODE_STEPS = 5
IDLE_S = 0.002
CALL_REPEATS = 7
HOST_PROFILE_ROWS = 15


def engine_path(engine: str | None, plan: str, params: str) -> Path:
    """--engine as given, else the named library plan with the extra params rendered to a file."""
    if engine:
        return Path(engine)
    base = library_plans()[plan]
    chosen = Plan(base.engine, base.slots, {**base.params, **json.loads(params)})
    print("plan:", chosen.describe())
    return render_to_file(chosen, f"timeline {chosen.describe()}")


def gpu_events(prof) -> list[dict]:
    """GPU activities of a profile, sorted by start (us)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    return sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATS), key=lambda e: e["ts"])


def split_into_bursts(events: list[dict], gap_us: float) -> list[list[dict]]:
    """Activities grouped into bursts separated by idle gaps over gap_us (one burst = one call)."""
    bursts: list[list[dict]] = []
    end = None
    for e in events:
        if end is None or e["ts"] - end > gap_us:
            bursts.append([])
        bursts[-1].append(e)
        end = max(end or 0.0, e["ts"] + e["dur"])
    return bursts


def short(name: str) -> str:
    return name if len(name) <= 70 else name[:67] + "..."


def report(title: str, burst: list[dict]) -> dict:
    rows, prev_end = [], burst[0]["ts"]
    for e in burst:
        rows.append((short(e["name"]), e["dur"], max(0.0, e["ts"] - prev_end)))
        prev_end = max(prev_end, e["ts"] + e["dur"])
    span = prev_end - burst[0]["ts"]
    busy, gaps = sum(r[1] for r in rows), sum(r[2] for r in rows)
    print(f"\n== {title}: {len(rows)} GPU activities, span {span:.1f} us = kernels {busy:.1f} + gaps {gaps:.1f}")
    for name, dur, gap in rows:
        print(f"  {gap:6.2f} gap  {dur:7.2f} us  {name}")
    by = defaultdict(list)
    for name, dur, gap in rows:
        by[name].append((dur, gap))
    print(f"-- {title} by kernel (count, total us, mean us, mean gap before)")
    for name, v in sorted(by.items(), key=lambda kv: -sum(d for d, _ in kv[1])):
        print(f"  {len(v):4d} {sum(d for d, _ in v):8.1f} {sum(d for d, _ in v) / len(v):7.2f} "
              f"{sum(g for _, g in v) / len(v):6.2f}  {name}")
    return {"span_us": span, "kernels_us": busy, "gaps_us": gaps, "count": len(rows),
            "rows": [{"name": n, "us": d, "gap_us": g} for n, d, g in rows]}


def call_time(fn, *args) -> tuple[float, float]:
    """(host us until fn returns, wall us until its kernels end) of one call from an idle GPU."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn(*args)
    returned = time.perf_counter()
    torch.cuda.synchronize()
    return (returned - start) * 1e6, (time.perf_counter() - start) * 1e6


def median_call_time(fn, *args) -> tuple[float, float]:
    times = sorted(call_time(fn, *args) for _ in range(CALL_REPEATS))
    return times[len(times) // 2]


def report_call_times(module, engine, config, weight_dir, ids, tokens, prompts) -> dict:
    """Host and wall time of whole calls (tokens on the device, no profiler)."""
    pre_ids = list(range(3000, 3000 + len(prompts)))
    out = {"decode": median_call_time(engine.decode, ids, tokens),
           "prefill": median_call_time(engine.prefill, pre_ids, prompts)}
    fresh = module.create_engine(config, weight_dir, "cuda")
    out["fresh prefill"] = call_time(fresh.prefill, pre_ids, prompts)
    again = module.create_engine(config, weight_dir, "cuda")
    profiler = cProfile.Profile()
    profiler.runcall(again.prefill, pre_ids, prompts)
    torch.cuda.synchronize()
    print("\n== a fresh engine's first prefill under cProfile (host functions by own time, us)")
    for (file, line, func), (_, calls, own, cumulative, _) in sorted(
            pstats.Stats(profiler).stats.items(), key=lambda kv: -kv[1][2])[:HOST_PROFILE_ROWS]:
        print(f"  {own * 1e6:8.1f} own {cumulative * 1e6:8.1f} cum {calls:5d}x  {func} ({Path(file).name}:{line})")
    del fresh, again
    print("\n== whole calls (host us until the call returns / wall us until its kernels end)")
    for name, (host, wall) in out.items():
        print(f"  {name:14} host {host:8.1f}  wall {wall:8.1f}")
    return {name: {"host_us": host, "wall_us": wall} for name, (host, wall) in out.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", help="an engine file (default: --plan rendered)")
    p.add_argument("--plan", default="lib split linear", help="a plan of gpu_engine_check.library_plans")
    p.add_argument("--params", default="{}", help="JSON params added to --plan's, e.g. '{\"pdl\": true}'")
    p.add_argument("--model-config", default="target/model_config.json")
    p.add_argument("--weight-dir", default="target/weights")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--prefill", default="4x128", help="prompts x tokens of the profiled prefill call")
    p.add_argument("--out", default="timeline-out")
    a = p.parse_args()
    config = load_config(a.model_config)
    module = load_engine_module(engine_path(a.engine, a.plan, a.params))
    engine = module.create_engine(config, a.weight_dir, "cuda")
    vocab = int(config["vocab_size"])
    gen = torch.Generator().manual_seed(0)
    ids = list(range(a.batch))
    with torch.no_grad():
        engine.prefill(ids, [torch.randint(vocab, (a.prompt,), generator=gen) for _ in ids])
        tokens = torch.randint(vocab, (a.batch,), generator=gen)
        for _ in range(3):   # warm
            engine.decode(ids, tokens)
        n, length = (int(x) for x in a.prefill.split("x"))
        pre_ids = list(range(1000, 1000 + n))
        prompts = [torch.randint(vocab, (length,), generator=gen) for _ in pre_ids]
        engine.prefill(pre_ids, prompts)   # warm the bucket
        calls = report_call_times(module, engine, config, a.weight_dir, ids, tokens.cuda(),
                                  [t.cuda() for t in prompts])
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(DECODE_STEPS):
                engine.decode(ids, tokens)
                torch.cuda.synchronize()
                time.sleep(IDLE_S)   # an idle GPU between calls separates their bursts
            time.sleep(IDLE_S)
            engine.prefill([2000 + i for i in range(n)], prompts)
            torch.cuda.synchronize()
    bursts = split_into_bursts(gpu_events(prof), gap_us=IDLE_S * 1e6 / 2)
    if len(bursts) != DECODE_STEPS + 1:
        print(f"warning: {len(bursts)} bursts of GPU activity, expected {DECODE_STEPS + 1} (one per call)")
    out = {"calls": calls, "decode": report(f"decode step, batch {a.batch}", bursts[DECODE_STEPS // 2]),
           "prefill": report(f"prefill {a.prefill}", bursts[-1])}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "timeline.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
