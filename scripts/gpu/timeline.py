"""Kernel by kernel, where one decode step and one prefill pass of a warm engine go on the GPU.

    python3 -m scripts.gpu timeline [--engine PATH | --plan NAME --params JSON [--params JSON ...]]
        [--batch 8] [--prompt 32] [--prefill 4x128] [--out DIR]

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

The engine is --engine, else --plan (one of scripts.gpu.common.library_plans; default
"lib split linear", run.sh's usual final plan) with --params added to its params. Several --params
(e.g. `--params '{"pdl": false}' --params '{}'`, pdl being on by default; `--params '{}' --params '{"fused_reduce": true}'`
for the split reductions done in the split kernels' last programs) profile each set in a child
process of its own (cut at PLAN_TIMEOUT_S), full output in --out/planN.txt, and print each one's
spans, whole calls, fresh-engine host functions and heaviest kernels side by side.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import re
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from agent.plan import Plan
from evaluator.common import load_config, load_engine_module
from scripts.gpu.common import (FINAL_PLAN, PUBLIC_CONFIG, PUBLIC_WEIGHTS, ensure_toy_weights, library_plans,
                                out_dir, render_to_file, run)
from scripts.gpu.profile_run import GPU_CATS

DECODE_STEPS = 5
IDLE_S = 0.002
CALL_REPEATS = 7
HOST_PROFILE_ROWS = 15
PLAN_TIMEOUT_S = 240
# The lines of each child's output printed side by side when several --params run (regex, lines after it).
HIGHLIGHTS = ((r"^(plan:|== )", 0), (r"^== whole calls", 3), (r"^== a fresh engine", 12), (r"^-- decode", 8),
              (r"^-- prefill", 8))


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


def highlights(text: str) -> list[str]:
    """The HIGHLIGHTS lines of one child's output."""
    lines, out = text.splitlines(), []
    for pattern, after in HIGHLIGHTS:
        for i, line in enumerate(lines):
            if re.search(pattern, line):
                out += lines[i:i + 1 + after]
    return out


def each_params(a: argparse.Namespace, argv: list[str]) -> int:
    """Every --params set in a child of its own, then the highlights of each."""
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ensure_toy_weights(a.model_config, a.weight_dir)
    keep, skip = [], False
    for arg in argv:    # the child gets every argument but --params and --out
        if skip:
            skip = False
        elif arg in ("--params", "--out"):
            skip = True
        elif not arg.startswith(("--params=", "--out=")):
            keep.append(arg)
    for i, params in enumerate(a.params, 1):
        log = out / f"plan{i}.txt"
        code = run([sys.executable, "-m", "scripts.gpu", "timeline", *keep, "--params", params,
                    "--out", str(out / f"plan{i}")], log, timeout=PLAN_TIMEOUT_S)
        print(f"plan{i} {params}: exit {code}")
        print("\n".join(highlights(log.read_text())), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", help="an engine file (default: --plan rendered)")
    p.add_argument("--plan", default=FINAL_PLAN, help="a plan of scripts.gpu.common.library_plans")
    p.add_argument("--params", action="append", help="JSON params added to --plan's, e.g. '{\"pdl\": true}'; "
                   "repeat it to profile several sets (default: none added)")
    p.add_argument("--model-config", default=PUBLIC_CONFIG)
    p.add_argument("--weight-dir", default=PUBLIC_WEIGHTS)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--prefill", default="4x128", help="prompts x tokens of the profiled prefill call")
    p.add_argument("--out", default=out_dir("timeline-out"))
    argv = sys.argv[1:] if argv is None else argv
    a = p.parse_args(argv)
    if a.params and len(a.params) > 1:
        return each_params(a, argv)
    ensure_toy_weights(a.model_config, a.weight_dir)
    config = load_config(a.model_config)
    module = load_engine_module(engine_path(a.engine, a.plan, (a.params or ["{}"])[0]))
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
    return 0
