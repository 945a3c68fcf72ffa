"""One device call: the GPU tests, run.sh on the public config, its engine judged against recompute.

    python3 -m scripts.gpu session [--budget 420] [--stress-seconds 150] [--skip-tests]
        [--recompute-json FILE] [--out DIR]

Answers "does the agent work on a GPU, and how fast is what it writes" (how docs/benchmarks.md
is measured):
  1. the GPU unit tests (kernel variants, paged engine), unless --skip-tests;
  2. `bash run.sh` on the public config within --budget seconds (offline, builtin proposer);
  3. the public tests, the full stress suite (cut at --stress-seconds) and all five benchmark
     cases on the engine it wrote;
  4. the same benchmark on the recompute engine, the baseline every ratio is read against
     (--recompute-json: an earlier run's numbers instead; the baseline does not change); beside
     each case's % of floor, the one the run's judge read for the same engine (its clock around
     the worker: what the search ranked by).
Everything lands in --out ($OUT when set: results.log, results.json, bench_*.json, logs); a short
table is printed last. Device tool: carry [".whl"] (pytest wheels; the device image has none).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from agent.plan import Plan
from scripts.gpu.common import (PUBLIC_CASES, bench_rows, harness, out_dir, prelude, render_to_file, run)

GPU_TESTS = ["tests/test_kernels_gpu.py", "tests/test_engine_paged.py"]
RUN_LOGS = ("results.log", "results.json")


def judged_fractions(results_json: Path) -> dict[str, float]:
    """Per case, the % of floor the run's judge read for the engine it left (its clock around a
    worker's timed trace: the number the search ranked it by), from results.json."""
    if not results_json.is_file():
        return {}
    run = json.loads(results_json.read_text())
    best = next((c for c in run.get("candidates", []) if c.get("index") == run.get("best")), None)
    bench = ((best or {}).get("result") or {}).get("benchmark") or []
    return {r["case_name"]: 100 * r["floor_fraction"] for r in bench if "floor_fraction" in r}


def print_speedups(final: list[dict], base: list[dict], judged: dict[str, float]) -> None:
    """Per case: recompute and final tok/s, % of floor, the judge's reading of it, speedup, peak memory."""
    by_case = {r["case_name"]: r for r in base}
    print(f"{'case':10} {'recompute tok/s':>16} {'final tok/s':>12} {'% floor':>8} {'as judged':>9} {'speedup':>8} "
          f"{'peak MiB':>9}")
    for r in final:
        b = by_case.get(r["case_name"], {})
        seen = judged.get(r["case_name"])
        print(f"{r['case_name']:10} {b.get('tokens_per_second', 0):16.0f} {r['tokens_per_second']:12.0f} "
              f"{100 * r['floor_fraction']:7.1f}% {'-' if seen is None else f'{seen:.1f}%':>9} "
              f"{r['tokens_per_second'] / max(b.get('tokens_per_second', 1), 1):7.0f}x {r['peak_memory_mb']:9.0f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget", type=int, default=420, help="run.sh's budget in seconds")
    p.add_argument("--stress-seconds", type=int, default=150, help="the full stress suite is cut here")
    p.add_argument("--skip-tests", action="store_true", help="leave out the GPU unit tests")
    p.add_argument("--recompute-json", help="an earlier run's bench_recompute.json, used instead of timing it")
    p.add_argument("--out", default=out_dir("/tmp/gpu_session"))
    a = p.parse_args(argv)
    out = Path(a.out)
    prelude(out)
    py = sys.executable
    if not a.skip_tests:
        print("== GPU tests", flush=True)
        run([py, "-m", "pytest", "-q", "-x", *GPU_TESTS], out / "tests.txt", tail=15)

    print(f"== run.sh (budget {a.budget}s)", flush=True)
    shutil.rmtree("workspace", ignore_errors=True)
    code = run(["bash", "run.sh", "--device", "cuda", "--budget", str(a.budget)], out / "runsh.txt")
    print(f"run.sh exit code {code}")
    for name in RUN_LOGS:
        if Path("workspace", name).is_file():
            shutil.copy(Path("workspace", name), out / name)
    if (out / "results.log").is_file():
        print("\n".join((out / "results.log").read_text().splitlines()[-30:]), flush=True)

    engine = "workspace/engine.py"
    print(f"== public tests + full stress on {engine}", flush=True)
    run([py, "evaluator/test_correctness.py", "--engine", engine, *harness()], out / "public.txt", tail=3)
    code = run([py, "evaluator/stress.py", "--engine", engine, "--full", *harness()], out / "stress_full.txt",
               timeout=a.stress_seconds, tail=3)
    print(f"stress exit code {code} (124: cut at {a.stress_seconds}s)")

    print("== benchmarks", flush=True)
    bench = [py, "evaluator/benchmark_throughput.py", *harness(), "--cases", PUBLIC_CASES]
    run([*bench, "--engine", engine], out / "bench_final.json", err=out / "bench_final.err")
    if a.recompute_json:
        shutil.copy(a.recompute_json, out / "bench_recompute.json")
    else:
        recompute = render_to_file(Plan("recompute"), "recompute")
        run([*bench, "--engine", str(recompute), "--warmup", "0", "--repeat", "1"], out / "bench_recompute.json",
            err=out / "bench_recompute.err")
    print_speedups(bench_rows(out / "bench_final.json"), bench_rows(out / "bench_recompute.json"),
                   judged_fractions(out / "results.json"))
    return 0
