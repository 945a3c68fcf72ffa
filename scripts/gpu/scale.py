"""One device call: the 1B GQA scale family (checked pass of named plans, timings, profiles).

    python3 -m scripts.gpu scale [--check-plans "torch,lib,lib split"] [--time-plans "lib,lib split"]
        [--time-engines FILE ...] [--repeat 1] [--profile-plans PLANS] [--profile-cases decode-wide]
        [--cases prefill-long,decode-wide] [--test-timeout 240] [--config C] [--weights DIR] [--out DIR]

Issue #4's scale family on a ~1B-parameter GQA config (scripts/configs/scale_1b_gqa.json,
docs/benchmarks-scale.md). First the CUDA engine tests (tests/test_engine_paged.py -k cuda), cut
at --test-timeout (0: skip them). Then, for each plan of --check-plans, the checked pass of
decode-wide (64 requests, 512-token prompts, 32 steps) against the reference: whose numerics hold
at this size. Then each plan of --time-plans timed (--no-verify: the checks above say which
pass) in --cases against the floor the benchmark reports; --time-engines (engine files rendered
beforehand, e.g. from another commit) are timed the same way, --repeat times interleaved. Last,
for each plan of --profile-plans, the profile subcommand over --profile-cases: the top kernels by
GPU time and each call's host/GPU times, in --out/profile_<plan>/. Plans are names of
scripts.gpu.common.library_plans (torch: every slot on its torch variant). Outputs under --out
($OUT when set). Device tool: carry [".whl"].
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from scripts.gpu.common import bench_rows, ensure_toy_weights, library_plans, out_dir, prelude, render_to_file, run

SCALE_CONFIG = "scripts/configs/scale_1b_gqa.json"


def names(text: str) -> list[str]:
    return [n for n in text.split(",") if n]


def print_timings(path: Path) -> None:
    for r in bench_rows(path):
        print(f"  {r['case_name']:13} {r['elapsed_ms']:9.2f} ms  {r['tokens_per_second']:11.0f} tok/s  "
              f"floor {r['floor_ms']:8.3f} ms  {100 * r['floor_fraction']:5.1f}% of floor  "
              f"peak {r['peak_memory_mb']:.0f} MiB", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=SCALE_CONFIG)
    p.add_argument("--weights", default="/tmp/scale_weights", help="weight dir (toy weights made if absent)")
    p.add_argument("--check-plans", default="torch,lib,lib split")
    p.add_argument("--time-plans", default="lib,lib split")
    p.add_argument("--time-engines", nargs="*", default=[], help="engine files rendered beforehand")
    p.add_argument("--repeat", type=int, default=1, help="rounds of --time-engines")
    p.add_argument("--profile-plans", default="")
    p.add_argument("--profile-cases", default="decode-wide")
    p.add_argument("--cases", default="prefill-long,decode-wide", help="the timed cases")
    p.add_argument("--test-timeout", type=int, default=240, help="seconds; 0 skips the CUDA engine tests")
    p.add_argument("--out", default=out_dir("/tmp/gpu_scale_check"))
    a = p.parse_args(argv)
    plans = library_plans()
    unknown = [n for n in names(a.check_plans) + names(a.time_plans) + names(a.profile_plans) if n not in plans]
    if unknown:
        p.error(f"unknown plan {unknown[0]!r}; known: {', '.join(plans)}")
    out = Path(a.out)
    prelude(out)
    py = sys.executable
    if a.test_timeout:
        print("== CUDA engine tests", flush=True)
        code = run([py, "-m", "pytest", "-q", "-rf", "tests/test_engine_paged.py", "-k", "cuda"], out / "tests.txt",
                   timeout=a.test_timeout, tail=5)
        print(f"pytest exit code {code} (124: cut at {a.test_timeout}s)")

    engines: dict[str, Path] = {}

    def engine(name: str) -> Path:
        if name not in engines:
            engines[name] = render_to_file(plans[name], f"scale {name}")
            print(f"{name}: {plans[name].describe()}", flush=True)
        return engines[name]

    model = ["--model-config", a.config, "--weight-dir", a.weights, "--device", "cuda"]
    bench = [py, "evaluator/benchmark_throughput.py", *model]
    print(f"== scale family on {a.config}", flush=True)
    ensure_toy_weights(a.config, a.weights)
    for name in names(a.check_plans):    # correctness: decode-wide's checked pass, one call at a time
        tag = name.replace(" ", "-")
        code = run([*bench, "--engine", str(engine(name)), "--cases", "decode-wide", "--warmup", "0", "--repeat", "1"],
                   out / f"check_{tag}.json", err=out / f"check_{tag}.err")
        print(f"{name}: decode-wide checked pass exit code {code}")
        print("\n".join([line for line in (out / f"check_{tag}.err").read_text().splitlines()
                         if "Error" in line or "differ" in line][-1:]), flush=True)

    def time_engine(tag: str, path: Path) -> None:
        code = run([*bench, "--engine", str(path), "--cases", a.cases, "--no-verify"], out / f"bench_{tag}.json",
                   err=out / f"bench_{tag}.err")
        print(f"{tag}: benchmark exit code {code}")
        print_timings(out / f"bench_{tag}.json")

    for name in names(a.time_plans):
        time_engine(name.replace(" ", "-"), engine(name))
    for round_ in range(1, a.repeat + 1):   # an A/B against engines of another commit
        for file in a.time_engines:
            time_engine(f"{Path(file).stem}-{round_}", Path(file))
    for name in names(a.profile_plans):  # where the time goes
        tag = name.replace(" ", "-")
        print(f"== profile {name}", flush=True)
        code = run([py, "-m", "scripts.gpu", "profile", "--engine", str(engine(name)), "--model-config", a.config,
                    "--weight-dir", a.weights, "--cases", a.profile_cases, "--repeat", "1",
                    "--out", str(out / f"profile_{tag}")], out / f"profile_{tag}.txt")
        print(f"profile exit code {code}")
        for trace in (out / f"profile_{tag}").glob("trace-*.json"):   # chrome traces: too large to bring back
            trace.unlink()
    return 0
