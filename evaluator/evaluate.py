"""One candidate engine → one JSON verdict (docs/design.md §2).

    python3 -m evaluator.evaluate --engine PATH --model-config CFG --weight-dir DIR \
        --device cpu|cuda|auto [--stress off|quick|full] [--cases prefill,decode,mixed,...] \
        [--warmup 1] [--repeat 3] [--seed N] [--protect PATH ...] --out RESULT.json

Before the candidate is imported, the judge's own rounding noise on the real weights
(evaluator/noise.py: `reference_margin`, what the loop's safety margin is read against).
Stages in order: import → public (SPEC.md §4) → stress → benchmark; it stops at the first
failing stage, writes RESULT.json (even on failure) and exits 0 only when all passed.
Progress goes to stderr, a one-line verdict to stdout. Timeouts are the caller's to record.
From the import on, the candidate runs inside the sandbox (evaluator/sandbox.py): no network,
no processes (on CPU), no writes to the repository, RESULT.json's folder, the weights, the
config or any --protect path.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the `evaluator` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from evaluator.benchmark_throughput import run_benchmark  # noqa: E402
from evaluator.common import (CRASH, REPO_ROOT, EvalFailure, Tolerance, compute_dtype,  # noqa: E402
                              harness_parser, load_config, load_engine_module, parse_cases,
                              resolve_device)
from evaluator.floor import detect_hardware  # noqa: E402
from evaluator.guards import FunctionIdentities  # noqa: E402
from evaluator.noise import reference_margin  # noqa: E402
from evaluator.sandbox import Sandbox  # noqa: E402
from evaluator.stress import run_stress  # noqa: E402
from evaluator.test_correctness import run_public_sequence  # noqa: E402
from evaluator.traces import BENCHMARK_CASES, PUBLIC_CASES  # noqa: E402

STRESS_MODES = ("off", "quick", "full")


def score(benchmark: list[dict]) -> float | None:
    """Geometric mean of floor_fraction over the cases (no case may be neglected)."""
    fractions = [r["floor_fraction"] for r in benchmark]
    if not fractions:
        return None
    return math.exp(sum(math.log(f) for f in fractions) / len(fractions))


def evaluate(engine: str | Path, model_config: dict | str | Path, weight_dir: str | Path,
             device: str = "auto", stress: str = "quick", cases=PUBLIC_CASES, warmup: int = 1,
             repeat: int = 3, seed: int | None = None, bandwidth_gbs: float | None = None,
             peak_tflops: float | None = None, tol: Tolerance = Tolerance(),
             log=lambda line: None, protect: tuple[str | Path, ...] = ()) -> dict:
    """The EvalResult dict of docs/design.md §2. Never raises for a bad candidate. The
    candidate runs in the sandbox, which also protects the repository, the weights, the config
    (when a path) and `protect`."""
    if stress not in STRESS_MODES:
        raise ValueError(f"stress must be one of {STRESS_MODES}")
    start = time.perf_counter()
    identities = FunctionIdentities()
    device = resolve_device(device)
    result = {"status": "failed", "stage": "import", "error_kind": None, "error": None, "device": device,
              "public": None, "stress": None, "benchmark": None, "score": None, "reference_margin": None,
              "seconds": 0.0}
    fenced = [REPO_ROOT, weight_dir, *protect] + ([] if isinstance(model_config, dict) else [model_config])
    sandbox = Sandbox(fenced, device)

    def check(when: str) -> None:
        identities.check(when)
        sandbox.check(when)

    try:
        config = load_config(model_config)
        # Before the sandbox: this is the evaluator's own work (it may run `uname`, and measures).
        hardware = detect_hardware(device, compute_dtype(config, device), bandwidth_gbs, peak_tflops)
        # Before the candidate exists: nothing it patches can touch the yardstick of its margin.
        result["reference_margin"] = reference_margin(config, weight_dir, device, tol, seed)
        log(f"the judge's own margin against fp32 on these weights: {result['reference_margin']:.3f}")
        with sandbox:
            try:
                module = load_engine_module(engine)
            finally:
                check("at import")  # a refused operation explains a failed import better than its traceback
            result["stage"] = "public"
            public = run_public_sequence(module, config, weight_dir, device, tol.atol, tol.rtol)
            check("after the public sequence")
            result["public"] = {"status": public["status"], "max_abs_err": public["max_abs_err"],
                                "cases": public["cases"], "worst_margin": public["worst_margin"]}
            log(f"public: passed, max abs err {public['max_abs_err']:.3g}")
            if stress != "off":
                result["stage"] = "stress"
                report = run_stress(module, device, seed, quick=stress == "quick", target=(config, weight_dir),
                                    fail_fast=True, tol=tol, log=log)
                result["stress"] = report.to_dict()
                check("after the stress suite")
                failure = report.first_failure
                if failure is not None:
                    result["error_kind"] = failure.error_kind
                    result["error"] = f"stress case {failure.name} (seed {report.seed}): {failure.error}"
                    return result
            result["stage"] = "benchmark"
            result["benchmark"] = run_benchmark(module, config, weight_dir, device, list(cases), warmup, repeat,
                                                hardware=hardware, tol=tol)
            result["score"] = score(result["benchmark"])
            check("after the evaluation")
            result["stage"], result["status"] = "done", "passed"
    except EvalFailure as e:
        result["error_kind"], result["error"] = e.kind, str(e)
    except BaseException as e:  # noqa: BLE001 - the verdict must be written whatever happened
        result["error_kind"] = CRASH
        result["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}"
    finally:
        result["seconds"] = time.perf_counter() - start
    return result


def write_json(result: dict, out: str | Path) -> None:
    """Atomically, so the judge never reads half a verdict."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps(result, indent=2))
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk leaves no half verdict behind
        raise


def main(argv: list[str] | None = None) -> None:
    p = harness_parser(__doc__.splitlines()[0])
    p.add_argument("--stress", choices=STRESS_MODES, default="quick")
    p.add_argument("--cases", default=",".join(PUBLIC_CASES), help=f"comma-separated, of: {', '.join(BENCHMARK_CASES)}")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--seed", type=int, help="stress seed (default: fresh)")
    p.add_argument("--bandwidth-gbs", type=float)
    p.add_argument("--peak-tflops", type=float)
    p.add_argument("--protect", action="append", default=[],
                   help="a path the candidate may not write to (besides the repository, the weights, "
                        "the config and the folder of --out); repeatable")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    cases = parse_cases(a.cases)
    result = evaluate(a.engine, a.model_config, a.weight_dir, a.device, a.stress, cases, a.warmup, a.repeat,
                      a.seed, a.bandwidth_gbs, a.peak_tflops,
                      log=lambda line: print(line, file=sys.stderr, flush=True),
                      protect=(Path(a.out).resolve().parent, *a.protect))
    write_json(result, a.out)
    score_text = "untimed" if result["score"] is None else f"{result['score']:.4g}"
    verdict = f"score {score_text}" if result["status"] == "passed" else \
        f"{result['error_kind']} at {result['stage']}: {(result['error'] or '').splitlines()[0]}"
    print(f"{result['status']}: {verdict} ({result['seconds']:.1f} s)")
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without the interpreter's teardown: the sandbox is off now, and a candidate's atexit
    # handler, finalizer or leftover thread must not get to run and rewrite the verdict.
    os._exit(0 if result["status"] == "passed" else 1)


if __name__ == "__main__":
    main()
