"""What the judge/worker split costs: one engine timed in-process and through the worker.

    python3 -m scripts.gpu judge-split [--engine PATH | --plan NAME] [--rounds 3]
        [--cases prefill,decode,mixed,decode128,mixed128] [--out DIR]

Why: since the candidate left the judge's process (evaluator/remote.py), a timed run is the
judge's clock around one request to the worker, every output copied into the judge's memory
before the clock stops. This prints, per case and side by side in interleaved rounds, the
median elapsed time of the same engine under the official in-process method
(evaluator/benchmark_throughput.py) and through the worker (the judge's clock less the channel's
round trip, as the agent scores it; the clock as read; the worker's own clock around the same
calls), the overhead in %, the % of the physical floor each gives,
where the judge's extra time goes (with the worker thread's CPU time a step and its calls' time on the
device), and the worker's isolation layers. Writes split.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from evaluator.benchmark_throughput import run_benchmark
from evaluator.common import load_config
from evaluator.remote import TRACE_MOMENTS, WORKER_STEPS, RemoteModule, Worker
from scripts.gpu.common import (PUBLIC_CASES, PUBLIC_CONFIG, PUBLIC_WEIGHTS, add_engine_arguments, engine_file,
                                ensure_toy_weights, geomean, out_dir, print_table)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_arguments(p)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cases", default=PUBLIC_CASES)
    p.add_argument("--out", default=out_dir("judge-split-out"))
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ensure_toy_weights()
    engine = engine_file(a)
    config = load_config(PUBLIC_CONFIG)
    cases = [c for c in a.cases.split(",") if c]
    runs: dict[str, dict[str, list[float]]] = {
        c: {"inproc": [], "judge": [], "raw": [], "worker": [], "floor": []} for c in cases}
    layers, round_trip = None, None
    for r in range(a.rounds):
        local = run_benchmark(engine, config, PUBLIC_WEIGHTS, "cuda", cases, warmup=1, repeat=3)
        with Worker("cuda", log=lambda line: None, diagnose=True) as worker:
            worker.request({"op": "load", "engine": worker.readable(engine)}, what="import")
            remote = run_benchmark(RemoteModule(worker), config, PUBLIC_WEIGHTS, "cuda", cases, warmup=1, repeat=3, seed=r + 1)
            layers, round_trip = worker.layers, worker.round_trip
        for lo, re in zip(local, remote):
            c = runs[lo["case_name"]]
            c["inproc"].append(lo["elapsed_ms"])
            c["judge"].append(re["elapsed_ms"])
            c["raw"].append(statistics.median(re["judge_clock_ms"]))
            c["worker"].append(statistics.median(re["worker_runs_ms"]))
            c["floor"].append(lo["floor_ms"])
            c.setdefault("split", []).extend(re["split_ms"])
            c.setdefault("cpu", []).extend(re["split_cpu_ms"])
            c.setdefault("device_calls", []).extend(re["device_calls_ms"])
        print(f"round {r + 1} done", flush=True)
    print(layers)
    print(f"the channel's round trip (subtracted): {round_trip * 1e3:.3f} ms")
    fractions = {"inproc": [], "judge": []}
    rows = []
    for case, c in runs.items():
        ip, jd, raw, wk, fl = (statistics.median(c[k]) for k in ("inproc", "judge", "raw", "worker", "floor"))
        fractions["inproc"].append(fl / ip)
        fractions["judge"].append(fl / jd)
        rows.append([case, f"{ip:.3f}", f"{jd:.3f}", f"{raw:.3f}", f"{wk:.3f}", f"{100 * (jd / ip - 1):.1f}%",
                     f"{100 * fl / ip:.1f}%", f"{100 * fl / jd:.1f}%"])
    print_table(["case", "in-process ms", "judge ms", "clock ms", "worker ms", "overhead", "% floor in-proc",
                 "% floor judge"], rows)
    print("where the judge's extra time goes (median ms from the moment before; the worker's steps are its claim):")
    print_table(["case", *(f"->{m}" for m in TRACE_MOMENTS[1:])],
                [[case, *(f"{statistics.median(p[i] for p in c['split']):.3f}" for i in range(len(TRACE_MOMENTS) - 1))]
                 for case, c in runs.items()])
    print("of which the worker's thread ran on a CPU (median CPU ms a step; a step it spent waiting or descheduled "
          "reads less than above), and the calls' time on the device (two CUDA events, the worker's claim):")
    print_table(["case", *(f"->{m}" for m in WORKER_STEPS), "calls on the device"],
                [[case, *(f"{statistics.median(p[i] for p in c['cpu']):.3f}" for i in range(len(WORKER_STEPS))),
                  f"{statistics.median(c['device_calls']):.3f}"] for case, c in runs.items()])
    print(f"geometric mean % of floor: in-process {100 * geomean(fractions['inproc']):.1f}, "
          f"through the worker {100 * geomean(fractions['judge']):.1f}")
    (out / "split.json").write_text(json.dumps({"engine": engine, "layers": layers,
                                                "runs": runs}, indent=2))

