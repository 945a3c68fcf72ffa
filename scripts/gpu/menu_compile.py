"""What compiling the builtin walk's next engines ahead would take off their screens' public phase.

    python3 -m scripts.gpu menu-compile [--limit 6] [--device cuda|cpu] [--out DIR]

Why: a screen on the public config is 9-15 s, and 6-9 s of it is the public phase whenever its
engine brings 10-50 kernels the run has not compiled (1.5-1.9 s with none; docs/benchmarks.md,
thirty-second session). The compile-ahead process of a verdict cannot land them in time: it
needs ~4 s to start and a ~3 s pass before its compiles begin, while the worker compiles what it
needs first itself. Compiling the walk's next engines across verdicts (in the untimed windows of
earlier ones) would; before building that, this measures both sides of the trade on the GPU:

  1. a screen of the library plan (public sequence and benchmark, as agent/judge.py asks for a
     screen) fills a Triton cache, as a run's first screens do;
  2. for each of the walk's first `--limit` engines after it (each one change from the library
     plan, agent/search.py walk), on a copy of that cache: a screen as run.sh has it today
     (its public phase, seconds and kernels compiled), then, on another copy, the engine's
     kernels compiled ahead (evaluator/compile_ahead.py on its own, the target's public and
     benchmark calls, wall seconds) and the same screen after it.

The saving per screen is the first public phase less the second; the cost is the precompile's
seconds, which would run beside other verdicts' untimed stages. The engines are the
repository's own templates (no model-written code). Writes menu_compile.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from evaluator import compile_ahead
from evaluator.common import REPO_ROOT, freeze_imports, load_config
from scripts.gpu.common import PUBLIC_CASES, PUBLIC_CONFIG, PUBLIC_WEIGHTS, ensure_toy_weights, out_dir, \
    render_to_file
from scripts.gpu.verdict_split import RequestClock, one_verdict

PRECOMPILE_TIMEOUT_SECONDS = 300
SAID_LINES = 40   # the process's lines kept: ready (its start), each pass through, compiles done (their times)


def screen(engine: Path, cache: Path, device: str) -> dict:
    """A screen as the resident judge gives it (verdict-split's: public sequence, one shared
    warm-up engine, one timed engine a case, no stress, in a worker started first), on `cache`;
    its stage seconds and kernels compiled."""
    result = one_verdict(engine, cache, "off", RequestClock(), device)   # its requests not timed here
    return {"status": result["status"], "error": result.get("error"), "stage_seconds": result["stage_seconds"],
            "kernels_compiled": result.get("triton_compiled")}


def precompile(engine: Path, cache: Path, device: str) -> dict:
    """The engine's kernels for the target's public and benchmark calls compiled into `cache` by
    evaluator/compile_ahead.py on its own (as a worker starts it, minus the jail): wall seconds
    from its start, and what it said (its start, its pass and its compiles each have a time there:
    what a precompile beside other verdicts would have to fit into their untimed stages)."""
    models = compile_ahead.plan(load_config(PUBLIC_CONFIG), PUBLIC_WEIGHTS, True, PUBLIC_CASES.split(","),
                                "off", 0, device)
    request = Path(tempfile.mkdtemp(prefix="menu-compile-")) / "request.json"
    request.write_text(json.dumps({"engine": str(engine), "models": models}))
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-I", str(REPO_ROOT / "evaluator" / "compile_ahead.py"), str(request)],
                          env={**os.environ, "TRITON_CACHE_DIR": str(cache)}, capture_output=True, text=True,
                          timeout=PRECOMPILE_TIMEOUT_SECONDS)
    return {"seconds": round(time.perf_counter() - start, 2), "exit": done.returncode,
            "said": (done.stdout + done.stderr).strip().splitlines()[-SAID_LINES:]}


def walk_engines(limit: int, device: str) -> tuple[object, list[tuple[str, object]]]:
    """The builtin walk's first plan (the library plan, where its variants run here) and its next
    `limit` plans with that one kept, each one change from it: (library, [(why, plan)])."""
    from agent import search
    from agent.plan import engine_params, menu
    params = engine_params(search.FAST_ENGINE)
    start = search.default_plan(search.FAST_ENGINE, params)
    library = next(search.walk(lambda: start, device, menu(), params, start))[0]
    steps = search.walk(lambda: library, device, menu(), params, start)
    return library, [(why, plan) for plan, why in steps if plan != library][:limit]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--limit", type=int, default=6, help="how many of the walk's engines after the library plan")
    p.add_argument("--device", default="cuda", help="cpu: a check of the tool where there is no GPU")
    p.add_argument("--out", default=out_dir("menu-compile-out"))
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ensure_toy_weights()
    freeze_imports()   # as the judge's own processes do
    filled = Path(tempfile.mkdtemp(prefix="menu-compile-cache-"))
    library, walked = walk_engines(a.limit, a.device)
    first = screen(render_to_file(library, "library"), filled, a.device)
    print(f"library plan's screen: {first['status']} {first['stage_seconds']}", flush=True)
    rows = []
    for why, plan in walked:
        engine = render_to_file(plan, why)
        today, ahead = (Path(tempfile.mkdtemp(prefix="menu-compile-copy-")) / "cache" for _ in range(2))
        shutil.copytree(filled, today)
        shutil.copytree(filled, ahead)
        row = {"change": why, "today": screen(engine, today, a.device),
               "precompile": precompile(engine, ahead, a.device)}
        row["after"] = screen(engine, ahead, a.device)
        rows.append(row)
        public = [r["stage_seconds"].get("public") for r in (row["today"], row["after"])]
        print(f"{why}: public {public[0]} s ({row['today']['kernels_compiled']} kernels) -> {public[1]} s "
              f"({row['after']['kernels_compiled']}) after a precompile of {row['precompile']['seconds']} s "
              f"[{row['today']['status']}, {row['after']['status']}]", flush=True)
    (out / "menu_compile.json").write_text(json.dumps({"library": first, "engines": rows}, indent=2))


if __name__ == "__main__":
    main()
