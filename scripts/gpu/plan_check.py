"""One device call: one plan re-judged without the search (public sequence, full stress, benchmark).

    python3 -m scripts.gpu plan-check --plan '{...}'|NAME [--seed N] [--stress-seconds 200] [--out DIR]

Renders the plan (a plan dict as JSON, e.g. results.json's best plan, or a name of
scripts.gpu.common.library_plans such as "lib split linear"), runs the public sequence,
the full stress suite (--seed replays a failure the agent's run or a previous check printed; cut at
--stress-seconds) and the five benchmark cases with their geometric mean of % of floor. Outputs
under --out ($OUT when set). Device tool: carry [".whl"].
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from agent.plan import Plan
from agent.render import render_engine
from scripts.gpu.common import (PUBLIC_CASES, bench_rows, ensure_toy_weights, harness, library_plans, out_dir,
                                prelude, print_floor_table, run)


def parse_plan(text: str) -> Plan:
    """A library plan's name, else a plan dict as JSON; ValueError names what is wrong."""
    named = library_plans()
    if text in named:
        return named[text]
    try:
        return Plan.from_dict(json.loads(text))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"--plan is neither a plan name ({', '.join(named)}) nor a plan dict: {e}") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plan", required=True, help="a plan dict as JSON, or a library plan's name")
    p.add_argument("--seed", type=int, help="the stress suite's seed (default: drawn)")
    p.add_argument("--stress-seconds", type=int, default=200)
    p.add_argument("--out", default=out_dir("/tmp/gpu_plan_check"))
    a = p.parse_args(argv)
    try:
        plan = parse_plan(a.plan)
    except ValueError as e:
        p.error(str(e))
    out = Path(a.out)
    prelude(out)
    ensure_toy_weights()
    engine = out / "engine.py"
    engine.write_text(render_engine(plan))
    print("plan:", plan.describe(), flush=True)
    py = sys.executable
    code = run([py, "evaluator/test_correctness.py", "--engine", str(engine), *harness()], out / "public.txt")
    print(f"public sequence exit code {code}")
    seed = ["--seed", str(a.seed)] if a.seed is not None else []
    code = run([py, "evaluator/stress.py", "--engine", str(engine), "--full", *seed, *harness()], out / "stress.txt",
               timeout=a.stress_seconds)
    print(f"stress exit code {code} (124: cut at {a.stress_seconds}s)")
    lines = (out / "stress.txt").read_text().splitlines()
    print(f"stress cases passed: {sum(line.startswith('PASS') for line in lines)}")
    fails = [i for i, line in enumerate(lines) if line.startswith("FAIL")][:3]
    print("\n".join(line for i in fails for line in lines[i:i + 2]))
    run([py, "evaluator/benchmark_throughput.py", "--engine", str(engine), *harness(), "--cases", PUBLIC_CASES],
        out / "bench.json", err=out / "bench.err")
    print_floor_table(bench_rows(out / "bench.json"))
    return 0
