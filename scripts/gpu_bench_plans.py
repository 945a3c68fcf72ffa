"""Time several plans side by side with the official benchmark, nothing else (one device call).

    python3 scripts/gpu_bench_plans.py --plans '{"name": {plan dict}, ...}' [--base NAME]
        [--engines '{"name": "path/to/engine.py", ...}'] [--repeat N]
        [--cases prefill,decode,mixed,decode128,mixed128] [--out DIR]

Why: a plan param or a variant is judged by the benchmark, not by a kernel timing; this is the
shortest way to put a few plans through it on the device (run.sh's search would also stress
each one, minutes a plan). Each plan is rendered, run through the public sequence, then
through evaluator/benchmark_throughput.py (SPEC.md §5 timing; its outputs checked against the
reference). A plan dict may leave out slots and params: --base (a name from
gpu_engine_check.library_plans, default "lib split linear") fills them in. --engines adds engine
files rendered beforehand (an older commit's engine, for an A/B in one call). --repeat N times
each N times, interleaved (plan 1, plan 2, ..., plan 1, ...), so that a slow stretch of the
machine does not land on one of them. Prints % of floor per case and the geometric mean per run;
writes bench_<i>.json under --out.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.plan import Plan  # noqa: E402
from scripts.gpu_engine_check import library_plans, render_to_file  # noqa: E402

CASES = "prefill,decode,mixed,decode128,mixed128"
HARNESS = ["--model-config", "target/model_config.json", "--weight-dir", "target/weights", "--device", "cuda"]


def merged(base: Plan, d: dict) -> Plan:
    return Plan(d.get("engine", base.engine), {**base.slots, **d.get("slots", {})},
                {**base.params, **d.get("params", {})})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plans", required=True, help="JSON {name: plan dict}")
    p.add_argument("--base", default="lib split linear")
    p.add_argument("--engines", default="{}", help="JSON {name: engine file}, benchmarked as they are")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--cases", default=CASES)
    p.add_argument("--out", default="bench-plans-out")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    base = library_plans()[a.base]
    if not Path("target/weights/model.pt").exists():
        subprocess.run([sys.executable, "scripts/generate_toy_weights.py", "--config", "target/model_config.json",
                        "--output", "target/weights/model.pt"], check=True, capture_output=True)
    engines = {}
    for name, d in json.loads(a.plans).items():
        plan = merged(base, d)
        engines[name] = str(render_to_file(plan, f"bench {name}"))
        print(f"{name}: {plan.describe()}", flush=True)
    for name, path in json.loads(a.engines).items():
        engines[name] = path
        print(f"{name}: {path}", flush=True)
    for name, engine in list(engines.items()):
        public = subprocess.run([sys.executable, "evaluator/test_correctness.py", "--engine", engine, *HARNESS],
                                capture_output=True, text=True)
        if public.returncode != 0:
            print(f"  {name}: public sequence failed: {public.stderr.strip().splitlines()[-1:]}")
            del engines[name]
    table = {}
    runs = [(r, name) for r in range(a.repeat) for name in engines]
    for i, (r, name) in enumerate(runs):
        bench = subprocess.run([sys.executable, "evaluator/benchmark_throughput.py", "--engine", engines[name],
                                *HARNESS, "--cases", a.cases], capture_output=True, text=True)
        if bench.returncode != 0:
            print(f"  {name}: benchmark failed: {bench.stderr.strip().splitlines()[-1:]}")
            continue
        (out / f"bench_{i}.json").write_text(bench.stdout)
        label = name if a.repeat == 1 else f"{name} #{r + 1}"
        table[label] = {row["case_name"]: row["floor_fraction"] for row in json.loads(bench.stdout)}
        print(f"  {label}: done", flush=True)
    cases = a.cases.split(",")
    print(f"\n{'plan':28}" + "".join(f"{c:>11}" for c in cases) + f"{'geomean':>9}")
    for name, row in table.items():
        geo = math.exp(sum(math.log(row[c]) for c in cases) / len(cases))
        print(f"{name:28}" + "".join(f"{100 * row[c]:10.1f}%" for c in cases) + f"{100 * geo:8.1f}%")


if __name__ == "__main__":
    main()
