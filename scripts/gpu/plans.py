"""Several plans timed side by side through the public sequence and the official benchmark.

    python3 -m scripts.gpu plans --plans '{"name": {plan dict}, ...}' [--base NAME]
        [--engines '{"name": "path/to/engine.py", ...}'] [--repeat N]
        [--cases prefill,decode,mixed,decode128,mixed128] [--out DIR]

Why: a plan param or a variant is judged by the benchmark, not by a kernel timing; this is the
shortest way to put a few plans through it on the device (run.sh's search would also stress
each one, minutes a plan). Each plan is rendered, run through the public sequence, then
through evaluator/benchmark_throughput.py (SPEC.md §5 timing; its outputs checked against the
reference). A plan dict may leave out slots and params: --base (a name from
scripts.gpu.common.library_plans, default "lib split linear") fills them in. --engines adds engine
files rendered beforehand (an older commit's engine, for an A/B in one call). --repeat N times
each N times, interleaved (plan 1, plan 2, ..., plan 1, ...), so that a slow stretch of the
machine does not land on one of them. Prints % of floor per case and the geometric mean per run;
writes bench_<i>.json under --out.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from agent.plan import Plan
from scripts.gpu.common import (FINAL_PLAN, PUBLIC_CASES, ensure_toy_weights, geomean, harness, library_plans,
                                out_dir, print_table, render_to_file)


def merged(base: Plan, d: dict) -> Plan:
    return Plan(d.get("engine", base.engine), {**base.slots, **d.get("slots", {})},
                {**base.params, **d.get("params", {})})


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plans", required=True, help="JSON {name: plan dict}")
    p.add_argument("--base", default=FINAL_PLAN)
    p.add_argument("--engines", default="{}", help="JSON {name: engine file}, benchmarked as they are")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--cases", default=PUBLIC_CASES)
    p.add_argument("--out", default=out_dir("bench-plans-out"))
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    base = library_plans()[a.base]
    ensure_toy_weights()
    engines = {}
    for name, d in json.loads(a.plans).items():
        plan = merged(base, d)
        engines[name] = str(render_to_file(plan, f"bench {name}"))
        print(f"{name}: {plan.describe()}", flush=True)
    for name, path in json.loads(a.engines).items():
        engines[name] = path
        print(f"{name}: {path}", flush=True)
    for name, engine in list(engines.items()):
        public = subprocess.run([sys.executable, "evaluator/test_correctness.py", "--engine", engine, *harness()],
                                capture_output=True, text=True)
        if public.returncode != 0:
            print(f"  {name}: public sequence failed: {public.stderr.strip().splitlines()[-1:]}")
            del engines[name]
    table = {}
    runs = [(r, name) for r in range(a.repeat) for name in engines]
    for i, (r, name) in enumerate(runs):
        bench = subprocess.run([sys.executable, "evaluator/benchmark_throughput.py", "--engine", engines[name],
                                *harness(), "--cases", a.cases], capture_output=True, text=True)
        if bench.returncode != 0:
            print(f"  {name}: benchmark failed: {bench.stderr.strip().splitlines()[-1:]}")
            continue
        (out / f"bench_{i}.json").write_text(bench.stdout)
        label = name if a.repeat == 1 else f"{name} #{r + 1}"
        table[label] = {row["case_name"]: row["floor_fraction"] for row in json.loads(bench.stdout)}
        print(f"  {label}: done", flush=True)
    cases = a.cases.split(",")
    print()
    print_table(["plan", *cases, "geomean"],
                [[name, *(f"{100 * row[c]:.1f}%" for c in cases), f"{100 * geomean([row[c] for c in cases]):.1f}%"]
                 for name, row in table.items()])

