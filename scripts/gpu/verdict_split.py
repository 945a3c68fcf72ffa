"""Where a screen's seconds go: each stage split into worker requests (by op) and the judge's own work.

    python3 -m scripts.gpu verdict-split [--plan NAME] [--screens 2] [--top 25] [--device cuda|cpu] [--out DIR]

Why: with compiling ahead, a screen still takes 15-18 s on the public config (an H200, thirtieth
session): its public phase 3-9 s with as few as one kernel compiled, its benchmark 8-10 s. Before
cutting either, this says what they are made of. One final-like verdict (public, quick stress,
benchmark) fills a fresh shared Triton cache, then `--screens` screen verdicts (public and
benchmark on one fresh engine a case after one shared warm-up engine, no stress, as agent/judge.py
asks for them, each in a worker started first, as the resident judge's spare) run on that cache,
in this process (the judge's side; the candidate still runs in its worker). Each Worker.request
is timed and summed by op and by stage (create, call, arm, trace, ...); what is left of a stage
is the judge's own work (the reference model, comparisons, drawing tokens). A cProfile of the
final-like verdict and of the last screen lists the judge's heaviest functions (in a final, the
stress suite's random models' weights, margins and references are the judge's too). Writes split.json.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import re
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from evaluator import evaluate as judge
from evaluator.common import freeze_imports
from evaluator.remote import Worker
from scripts.gpu.common import (FINAL_PLAN, PUBLIC_CASES, PUBLIC_CONFIG, PUBLIC_WEIGHTS, ensure_toy_weights,
                                library_plans, out_dir, render_to_file)


class RequestClock:
    """Worker.request wrapped: seconds per (stage, op), the stage read from the verdict as it goes."""

    def __init__(self):
        self.seconds: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.stage = "start"
        self.original = Worker.request

    def __enter__(self):
        clock = self

        def timed(worker, header, *args, **kwargs):
            start = time.perf_counter()
            try:
                return clock.original(worker, header, *args, **kwargs)
            finally:
                clock.seconds[clock.stage][header.get("op", "?")] += time.perf_counter() - start
                clock.counts[clock.stage][header.get("op", "?")] += 1
        Worker.request = timed
        return self

    def __exit__(self, *_):
        Worker.request = self.original


def one_verdict(engine: Path, cache: Path, stress: str, clock: RequestClock, device: str) -> dict:
    """A verdict as the resident judge gives it, its stages tracked through the log lines."""
    def log(line: str) -> None:
        if line.startswith("  | "):   # what the compile-ahead process said
            print(line, flush=True)
        if line.startswith("public:"):
            clock.stage = "stress" if stress != "off" else "benchmark"
        elif clock.stage == "stress" and re.match(r"\d+ passed, \d+ failed", line):
            clock.stage = "benchmark"
    clock.stage = "public"
    spare = None
    if stress == "off" and device == "cuda":   # a screen's worker: the resident judge's spare, started and ready
        spare = Worker(device, judge.default_memory_cap(), log, cache, ).started()
    return judge.evaluate(engine, PUBLIC_CONFIG, PUBLIC_WEIGHTS, device, stress=stress,
                          cases=PUBLIC_CASES.split(","), triton_cache=cache, update_cache=True, log=log,
                          warmup=1, repeat=1, shared_warm_up=stress == "off", fresh=spare)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plan", default=FINAL_PLAN, help="a name from scripts.gpu.common.library_plans")
    p.add_argument("--screens", type=int, default=2)
    p.add_argument("--top", type=int, default=25,
                   help="the judge's heaviest functions listed for the final-like verdict and the last screen")
    p.add_argument("--device", default="cuda", help="cpu: a check of the tool where there is no GPU")
    p.add_argument("--out", default=out_dir("verdict-split-out"))
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ensure_toy_weights()
    engine = render_to_file(library_plans()[a.plan], a.plan)
    freeze_imports()   # as the judge's own processes do (evaluator/resident.py, evaluate.py)
    judge.AHEAD_LOG_LINES = 40   # what the compile-ahead process said, all of it
    cache = Path(tempfile.mkdtemp(prefix="verdict-split-cache-"))
    rows = []
    for i in range(a.screens + 1):
        stress = "quick" if i == 0 else "off"
        profiler = cProfile.Profile() if i in (0, a.screens) else None   # the final-like one and the last screen
        with RequestClock() as clock:
            if profiler:
                profiler.enable()
            result = one_verdict(engine, cache, stress, clock, a.device)
            if profiler:
                profiler.disable()
        row = {"verdict": "final-like" if i == 0 else "screen", "status": result["status"],
               "error": result.get("error"), "stage_seconds": result["stage_seconds"],
               "worker_seconds": {s: {op: round(t, 3) for op, t in ops.items()} for s, ops in clock.seconds.items()},
               "requests": {s: dict(ops) for s, ops in clock.counts.items()},
               "kernels_compiled": result.get("triton_compiled")}
        rows.append(row)
        print(f"{row['verdict']}: {row['status']} {row['error'] or ''}\n  stages "
              + ", ".join(f"{k} {v:.2f}" for k, v in row["stage_seconds"].items()), flush=True)
        for stage, ops in row["worker_seconds"].items():
            heaviest = sorted(ops.items(), key=lambda x: -x[1])
            print(f"  {stage:10} worker " + ", ".join(f"{op} {t:.2f} s ({row['requests'][stage][op]}x)"
                                                      for op, t in heaviest))
        if profiler:
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(a.top)
            row["judge_profile"] = text.getvalue()
            print(text.getvalue(), flush=True)
    (out / "split.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
