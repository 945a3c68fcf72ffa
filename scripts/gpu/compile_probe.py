"""Which Triton kernels an engine compiles, how long each takes, and whether threads compile them faster.

    python3 -m scripts.gpu compile-probe [--plan NAME] [--models N] [--threads 4,8,16] [--out DIR]
    python3 -m scripts.gpu compile-probe --verdicts N [--plan NAME] [--out DIR]

Why: issue 24 asks for 3 candidates judged a minute, and compiling is most of what is left: a
screen's public phase is 2-17 s of compiling the changed slot's kernels, a final's stress suite
27-40 s of compiling every kernel again for each random model's shapes (63-97 kernels;
docs/benchmarks.md, twenty-eighth and twenty-ninth sessions). Two questions decide the lever:
  1. what is compiled: each create_engine (the public config, then --models random stress models)
     runs on a fresh Triton cache with Triton's compile hooks recording every kernel's
     specialisation (its constexprs and argument attributes) and seconds; duplicates of one
     function that differ only in an integer argument's specialisation are the cheap cut;
  2. whether compiles overlap: the recorded specialisations are compiled again on fresh caches
     through `JITFunction.preload`, one after another and then under Triton's AsyncCompileMode
     on a thread pool of each --threads size. Threads help only where Triton's compile releases
     the GIL (its MLIR/LLVM passes, ptxas in a subprocess).
Writes compile_probe.json.

--verdicts N instead asks the judge for N pairs of a final's verdict on the engine (the public
sequence, the quick stress suite, the benchmark's five cases; `python3 -m evaluator.evaluate`),
each on an empty Triton cache, one with --compile-ahead auto and one with off, in ABBA order,
and prints each verdict's stage seconds and % of the floor: what compiling ahead saves, and
whether the benchmark after it is any slower. Writes verdicts.json.
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from evaluator.benchmark_throughput import release_device_memory
from evaluator.common import load_config, load_engine_module
from evaluator.stress import stress_models
from evaluator.weights import random_weights, save_weights
from scripts.gpu.common import FINAL_PLAN, PUBLIC_CONFIG, PUBLIC_WEIGHTS, ensure_toy_weights, library_plans, \
    out_dir, render_to_file


class CompileLog:
    """Triton's jit_cache_hook (before a compile) and jit_post_compile_hook (after it), recording
    each compile's function, specialisation and seconds. The hooks return None: nothing is skipped."""

    def __init__(self):
        from triton import knobs
        self.runtime = knobs.runtime
        self.model = ""   # the model whose create_engine is running: each row names it
        self.rows: list[dict] = []
        self.started: dict = {}
        self.functions: dict[str, object] = {}
        self.runtime.jit_cache_hook = self.before
        self.runtime.jit_post_compile_hook = self.after

    def before(self, *, key, repr, fn, compile, **_):
        self.started[str(key)] = time.perf_counter()
        self.functions[fn.name] = fn.jit_function
        self.rows.append({"fn": fn.name, "repr": repr, "spec": compile.get("specialization_data"),
                          "seconds": None, "model": self.model})
        return None

    def after(self, *, key, fn, **_):
        start = self.started.pop(str(key), None)
        for row in reversed(self.rows):
            if row["fn"] == fn.name and row["seconds"] is None:
                row["seconds"] = time.perf_counter() - start if start else None
                break
        return None


def fresh_cache() -> str:
    """Point Triton at an empty cache directory and forget every kernel compiled in memory."""
    from triton import knobs
    knobs.cache.dir = tempfile.mkdtemp(prefix="compile-probe-cache-")
    return knobs.cache.dir


def forget(functions) -> None:
    for fn in functions:
        fn.device_caches.clear()


def create(module, config: dict, weight_dir: str) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine = module.create_engine(config, weight_dir, "cuda")
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    del engine
    release_device_memory("cuda")
    return seconds


def recompile(log: CompileLog, threads: int) -> float:
    """Every recorded specialisation compiled again on a fresh cache: serially (threads 0) or
    under AsyncCompileMode on a pool of `threads`."""
    from triton.runtime._async_compile import AsyncCompileMode
    fresh_cache()
    forget(log.functions.values())
    specs = [(log.functions[r["fn"]], r["spec"]) for r in log.rows if r["spec"]]
    start = time.perf_counter()
    if threads == 0:
        for fn, spec in specs:
            fn.preload(spec)
    else:
        with ThreadPoolExecutor(threads) as pool, AsyncCompileMode(pool):
            for fn, spec in specs:
                fn.preload(spec)
    return time.perf_counter() - start


def _specialised(spec: str | None) -> str:
    """What tells one specialisation from another: the specialization_data minus the function's
    name and options (the same for every launch of it)."""
    if not spec:
        return "-"
    data = json.loads(spec)
    return json.dumps({k: v for k, v in data.items() if k not in ("name", "options", "key")})[:400]


def verdicts(engine: Path, pairs: int, out: Path) -> list[dict]:
    """`pairs` pairs of final-like verdicts of `engine`, compiling ahead on and off (ABBA), each on an
    empty cache."""
    import subprocess
    import sys
    from scripts.gpu.common import PUBLIC_CASES, geomean
    rows = []
    for i in range(pairs):
        for ahead in (("auto", "off") if i % 2 == 0 else ("off", "auto")):
            verdict, cache = out / f"verdict-{len(rows)}.json", Path(tempfile.mkdtemp(prefix="compile-probe-judge-"))
            subprocess.run([sys.executable, "-m", "evaluator.evaluate", "--engine", str(engine),
                            "--model-config", PUBLIC_CONFIG, "--weight-dir", PUBLIC_WEIGHTS, "--device", "cuda",
                            "--stress", "quick", "--cases", PUBLIC_CASES, "--triton-cache", str(cache),
                            "--compile-ahead", ahead, "--out", str(verdict)], capture_output=True, timeout=400)
            result = json.loads(verdict.read_text()) if verdict.is_file() else {}
            floors = [c["floor_fraction"] for c in result.get("benchmark") or []]
            rows.append({"compile_ahead": ahead, "status": result.get("status"),
                         "stage_seconds": result.get("stage_seconds"),
                         "floor_percent": {c["case_name"]: round(100 * c["floor_fraction"], 1)
                                           for c in result.get("benchmark") or []},
                         "geomean_percent": round(100 * geomean(floors), 2) if floors else None})
            print(f"compile ahead {ahead:4}: {result.get('status')}, " + ", ".join(
                f"{k} {v:.1f} s" for k, v in (result.get("stage_seconds") or {}).items())
                + f"; {rows[-1]['geomean_percent']}% of floor {rows[-1]['floor_percent']}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--verdicts", type=int, default=0, help="pairs of final-like verdicts, compiling ahead on and off")
    p.add_argument("--plan", default=FINAL_PLAN, help="a name from scripts.gpu.common.library_plans")
    p.add_argument("--models", type=int, default=3, help="random stress models (quick suite's draw) after the public one")
    p.add_argument("--threads", default="4,8,16")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default=out_dir("compile-probe-out"))
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ensure_toy_weights()
    if a.verdicts:
        engine = render_to_file(library_plans()[a.plan], a.plan)
        (out / "verdicts.json").write_text(json.dumps(verdicts(engine, a.verdicts, out), indent=1))
        return
    fresh_cache()
    module = load_engine_module(str(render_to_file(library_plans()[a.plan], a.plan)))
    log = CompileLog()
    report: dict = {"device": torch.cuda.get_device_name(), "plan": a.plan, "models": []}
    targets = [("public", load_config(PUBLIC_CONFIG), PUBLIC_WEIGHTS)]
    for model in stress_models(random.Random(a.seed), True, "cuda")[:a.models]:
        weights = tempfile.mkdtemp(prefix="compile-probe-weights-")
        save_weights(random_weights(model.config, model.weight_seed, model.scale), Path(weights) / "model.pt")
        targets.append((model.name, model.config, weights))
    for name, config, weights in targets:
        log.model = name
        first = create(module, config, weights)
        again = create(module, config, weights)
        rows = [r for r in log.rows if r["model"] == name]
        compiled = sum(r["seconds"] or 0 for r in rows)
        report["models"].append({"model": name, "create_first_s": first, "create_again_s": again,
                                 "kernels": len(rows), "compile_s": compiled})
        print(f"{name}: create_engine {first:.2f} s first, {again:.2f} s again; {len(rows)} kernels compiled "
              f"in {compiled:.2f} s", flush=True)
        for fn, n in Counter(r["fn"] for r in rows).most_common():
            secs = [r["seconds"] or 0 for r in rows if r["fn"] == fn]
            print(f"    {n:3d} x {fn:<48} {sum(secs):6.2f} s (each {min(secs):.2f}-{max(secs):.2f})")
    report["kernels"] = [{k: r[k] for k in ("model", "fn", "repr", "seconds", "spec")} for r in log.rows]
    print("\nspecialisations of the public model (Triton's specialization_data: constexprs and argument attributes):")
    for r in log.rows:
        if r["model"] == "public":
            print(f"  {r['seconds'] or 0:5.2f} s  {r['fn']}  {_specialised(r['spec'])}")
    with_spec = sum(1 for r in log.rows if r["spec"])
    print(f"\n{with_spec} of {len(log.rows)} compiles carry specialization_data", flush=True)
    report["recompile"] = {}
    if with_spec:
        log.runtime.jit_cache_hook = None
        log.runtime.jit_post_compile_hook = None
        for threads in [0, *map(int, a.threads.split(","))]:
            try:
                seconds = recompile(log, threads)
            except Exception as e:   # noqa: BLE001 - a probe: say what failed and go on
                print(f"recompile with {threads} threads failed: {type(e).__name__}: {e}", flush=True)
                continue
            report["recompile"][threads] = seconds
            print(f"recompile {with_spec} kernels, {'serially' if threads == 0 else f'{threads} threads'}: "
                  f"{seconds:.2f} s", flush=True)
    (out / "compile_probe.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
