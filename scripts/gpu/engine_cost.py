"""What one engine costs a candidate's evaluation on a GPU: create_engine by part, the public sequence, the benchmark.

    python3 -m scripts.gpu engine-cost [--plan NAME | --engine PATH] [--repeat 3] [--triton-cache DIR] [--out DIR]
    python3 -m scripts.gpu engine-cost --judge [--plan NAME] [--other-plan NAME] [--out DIR]

Why: a screen on the H100 takes ~70 s (public ~25 s, benchmark ~33 s: results.log's
`[judge start, setup, worker, public, benchmark]`), and issue 24 asks for 3 candidates a minute.
The benchmark builds 20 engines (5 cases x a warm-up engine and 3 fresh ones); this says what
one create_engine costs and where (the engine's own methods timed by wrapping them: weights and
probes, the prefill and decode graph captures, the warm-up), first in the process (with the
Triton cache cold: a fresh directory, or --triton-cache, as a worker starts from the judge's
shared one) and then again, and what the public sequence and a one-case benchmark take beyond
it. Writes engine_cost.json.

--judge asks the same of the judge: the engine's verdict (public sequence, no stress, no
benchmark: `python3 -m evaluator.evaluate ... --triton-cache C --triton-cache-update`) twice on a
shared cache that starts empty, then once for --other-plan (another variant in one slot: Triton
keys a kernel by its starting line, so every kernel below that slot's block moves), and prints
each verdict's stage_seconds and the cache's entries. If the second verdict's public phase is
not near a warm create_engine, the judge's cache is not being hit. Writes judge_cost.json.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from evaluator.benchmark_throughput import release_device_memory, run_benchmark
from evaluator.common import load_config, load_engine_module
from evaluator.test_correctness import run_public_sequence
from scripts.gpu.common import (PUBLIC_CONFIG, PUBLIC_WEIGHTS, add_engine_arguments, engine_file, ensure_toy_weights,
                                library_plans, out_dir, render_to_file, run)

WRAPPED = ("_capture_prefill", "_capture_decode", "_warm_up")   # Engine methods timed by part
OTHER_PLAN = "lib split"   # the final plan with the torch linear variant: one slot's block differs


def timed_parts(module) -> dict[str, float]:
    """Wrap the engine class's capture and warm-up methods so that each call adds its seconds
    (after a device synchronize) to the returned dict."""
    parts: dict[str, float] = {}
    engine_class = module.Engine
    for name in WRAPPED:
        method = getattr(engine_class, name)

        @functools.wraps(method)
        def wrapped(self, *args, _method=method, _name=name, **kwargs):
            start = time.perf_counter()
            result = _method(self, *args, **kwargs)
            torch.cuda.synchronize()
            parts[_name] = parts.get(_name, 0.0) + time.perf_counter() - start
            return result
        setattr(engine_class, name, wrapped)
    return parts


def create_once(module, config: dict, parts: dict[str, float]) -> dict[str, float]:
    """One create_engine on the public config, timed whole and by part, then released as the
    benchmark releases an engine. "rest" is all that is not a capture or the warm-up: weights,
    slot probes, the KV pool, table, RoPE tables and mailboxes."""
    parts.clear()
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine = module.create_engine(config, PUBLIC_WEIGHTS, "cuda")
    torch.cuda.synchronize()
    total = time.perf_counter() - start
    row = {"total": total, **parts, "rest": total - sum(parts.values()),
           "graphs": len(engine.prefill_graphs) + len(engine.decode_graphs)}
    del engine
    release_device_memory("cuda")
    return row


def judge_costs(plan: str, other_plan: str, out: Path, device: str) -> dict:
    """Three verdicts on one shared Triton cache (see --judge): `plan` twice, then `other_plan`."""
    cache = Path(tempfile.mkdtemp(prefix="engine-cost-judge-cache-"))
    engines = {name: render_to_file(library_plans()[name], f"judge {name}") for name in (plan, other_plan)}
    rows = []
    for i, name in enumerate((plan, plan, other_plan)):
        verdict = out / f"verdict-{i}.json"
        code = run([sys.executable, "-m", "evaluator.evaluate", "--engine", str(engines[name]), "--model-config",
                    PUBLIC_CONFIG, "--weight-dir", PUBLIC_WEIGHTS, "--device", device, "--stress", "off",
                    "--no-benchmark", "--triton-cache", str(cache), "--triton-cache-update", "--out", str(verdict)],
                   out / f"verdict-{i}.txt")
        result = json.loads(verdict.read_text()) if verdict.is_file() else {}
        rows.append({"plan": name, "exit": code, "status": result.get("status"), "error": result.get("error"),
                     "stage_seconds": result.get("stage_seconds"), "cache_entries": len(list(cache.iterdir()))})
        print(f"verdict {i} ({name}): exit {code}, {result.get('status')}, stages "
              + ", ".join(f"{k} {v:.1f} s" for k, v in (result.get("stage_seconds") or {}).items())
              + f"; shared cache {rows[-1]['cache_entries']} entries", flush=True)
    shutil.rmtree(cache, ignore_errors=True)
    return {"verdicts": rows}


def main(argv: list[str] | None = None) -> None:
    """Time create_engine (--repeat + 1 times), the public sequence, and the mixed case at repeat 3 and 1;
    with --judge, the judge's verdicts on a shared cache instead."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_arguments(p)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--triton-cache", help="a Triton cache to start from (default: a fresh one, cold)")
    p.add_argument("--judge", action="store_true", help="the judge's verdicts on a shared cache (see above)")
    p.add_argument("--other-plan", default=OTHER_PLAN, help="with --judge: the third verdict's plan")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="with --judge: cpu checks the plumbing")
    p.add_argument("--out", default=out_dir("engine-cost-out"))
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.judge:
        ensure_toy_weights()
        (out / "judge_cost.json").write_text(json.dumps(judge_costs(a.plan, a.other_plan, out, a.device), indent=1))
        return
    cold = None if a.triton_cache else tempfile.mkdtemp(prefix="engine-cost-triton-")
    os.environ["TRITON_CACHE_DIR"] = a.triton_cache or cold
    ensure_toy_weights()
    engine_path = engine_file(a)
    config = load_config(PUBLIC_CONFIG)
    module = load_engine_module(engine_path)
    parts = timed_parts(module)
    report: dict = {"device": torch.cuda.get_device_name(), "engine": engine_path, "create_engine": []}
    for i in range(a.repeat + 1):   # the first in this process: kernels compiled or read from the cache
        report["create_engine"].append(create_once(module, config, parts))
        print(f"create_engine {'first' if i == 0 else 'again'}: " + ", ".join(
            f"{k} {v}" if k == "graphs" else f"{k} {v:.3f} s" for k, v in report["create_engine"][-1].items()),
            flush=True)
    start = time.perf_counter()
    run_public_sequence(module, config, PUBLIC_WEIGHTS, "cuda")
    report["public_sequence_s"] = time.perf_counter() - start
    print(f"public sequence (one create_engine, the reference's steps): {report['public_sequence_s']:.2f} s",
          flush=True)
    for repeat in (3, 1):
        start = time.perf_counter()
        run_benchmark(module, config, PUBLIC_WEIGHTS, "cuda", ["mixed"], warmup=1, repeat=repeat)
        report[f"benchmark_mixed_repeat{repeat}_s"] = seconds = time.perf_counter() - start
        print(f"benchmark, mixed, warm-up 1, repeat {repeat}: {seconds:.2f} s", flush=True)
    again = report["create_engine"][1:]
    report["create_engine_again_median_s"] = statistics.median(r["total"] for r in again) if again else None
    (out / "engine_cost.json").write_text(json.dumps(report, indent=1))
    if cold:
        shutil.rmtree(cold, ignore_errors=True)


if __name__ == "__main__":
    main()
