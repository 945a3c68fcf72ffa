"""One candidate engine → one JSON verdict (docs/design.md §2).

    python3 -m evaluator.evaluate --engine PATH --model-config CFG --weight-dir DIR \
        --device cpu|cuda|auto [--stress off|quick|full] [--cases prefill,decode,mixed,...] \
        [--no-benchmark] [--warmup 1] [--repeat 3] [--seed N] [--memory-gb G] [--triton-cache DIR [--triton-cache-update]]
        [--profile] [--criterion auto|course|bf16] [--compile-ahead auto|off] [--warm-up case|shared]
        --out RESULT.json

This process is the judge: it holds the inputs, the reference, the comparison, the clock and
the verdict, and never imports the candidate. The candidate runs in a worker process inside
the operating system's fence (evaluator/isolation.py: own uid, no network, limits, killed
whole at the end) and is driven over a narrow channel (evaluator/remote.py); see
docs/reliability.md for what each layer stops.

While the worker starts (it confines itself and imports torch before the candidate is loaded),
the judge measures the floor's hardware and its own rounding noise on the real weights
(evaluator/noise.py: `reference_margin`, what the loop's safety margin is read against). Stages in order: import →
[criterion →] public (SPEC.md §4) → stress → benchmark (tokens from a fresh, unpredictable seed;
outputs of the timed runs checked too); it stops at the first failing stage, writes RESULT.json
(even on failure) and exits 0 only when all passed. `--no-benchmark` leaves the benchmark out
(no score): for a caller that holds this engine's timing from an evaluation of its own (the
agent's finalist, timed by its screen, gets its stress suite here). `stage_seconds` says where
the evaluation's time went (judge start, setup: the floor's hardware and the judge's margin,
worker, public, stress, benchmark, profile). A Hugging Face model in bf16/fp16 is judged
by the bf16 criterion (evaluator/hf_judge.py: the criterion stage first, then the others against
fp32 at the tolerance it measured); the course format's judge is unchanged. Progress goes to
stderr, a one-line verdict to stdout. Timeouts are the caller's to record. With --profile, a
passing engine then gets a profiled pass of each benchmark case (evaluator/slot_profile.py):
`slot_ms` in the verdict, the worker's claim, reported and never scored.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from contextlib import ExitStack, closing
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the `evaluator` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from evaluator.isolation import quiet_threads  # noqa: E402  (the standard library only)

STARTED = time.perf_counter()   # before torch is imported: the judge's start counts in stage_seconds

quiet_threads()   # before torch is imported: see QUIET_THREADS

from evaluator.benchmark_throughput import run_benchmark  # noqa: E402
from evaluator.compile_ahead import limit as ahead_limit, plan as plan_ahead  # noqa: E402
from evaluator.common import (CRASH, ConfigError, EvalFailure, Tolerance, compute_dtype, freeze_imports,  # noqa: E402
                              harness_parser, load_config, parse_cases, resolve_device)
from evaluator.floor import Hardware, detect_hardware  # noqa: E402
from evaluator.hf_judge import CRITERIA, CRITERION_MARGIN, run_criterion, uses_bf16_criterion  # noqa: E402
from evaluator.noise import reference_margin  # noqa: E402
from evaluator.remote import RemoteModule, Worker  # noqa: E402
from evaluator.session import draw_op_tokens  # noqa: E402
from evaluator.slot_profile import merge as merge_profiles  # noqa: E402
from evaluator.stress import run_stress  # noqa: E402
from evaluator.test_correctness import run_public_sequence  # noqa: E402
from evaluator.triton_cache import compiled as compiled_kernels, merge as merge_cache  # noqa: E402
from evaluator.traces import BENCHMARK_CASES, PUBLIC_CASES, benchmark_trace  # noqa: E402

STRESS_MODES = ("off", "quick", "full")
MEMORY_FRACTION = 0.8   # of physical memory: the worker's default cap (the judge needs the rest)
# The profiled pass starts no case past this many seconds (it always profiles one): on a slow
# engine each case, run twice under the profiler's overhead, took ~12 s on an H200, and the
# all-torch engines of a model's lineage spent ~60 s of every final on it (twenty-sixth session).
PROFILE_BUDGET_S = 20.0
# Where the worker compiles a verdict's Triton kernels ahead, beside itself (evaluator/compile_ahead.py).
AHEAD_DEVICES = ("cuda",)
AHEAD_LOG_LINES = 12   # of what the compile-ahead process said, in the verdict's log
# The benchmark's warm-up engines: one a case (SPEC §5), or one shared by all cases (a search's
# screens and contest rounds: evaluator/benchmark_throughput.py run_benchmark's shared_warm_up).
WARM_UPS = ("case", "shared")


def default_memory_cap() -> int:
    return int(MEMORY_FRACTION * os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def device_memory(device: str) -> int:
    """The device's memory in bytes (the machine's on CPU)."""
    if device == "cuda":
        import torch
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass
class JudgeSetup:
    """What one judge process measures once and every verdict it gives shares: the floor's
    hardware and the judge's own margin against fp32 on the real weights (evaluator/noise.py),
    both the same for every candidate of one model, device and seed (evaluator/resident.py keeps
    one for a whole agent run). None: not measured yet; the first verdict that needs it fills it."""

    hardware: Hardware | None = None
    margin: float | None = None


def score(benchmark: list[dict]) -> float | None:
    """Geometric mean of floor_fraction over the cases (no case may be neglected)."""
    fractions = [r["floor_fraction"] for r in benchmark]
    if not fractions:
        return None
    return math.exp(sum(math.log(f) for f in fractions) / len(fractions))


def profiled_pass(module: RemoteModule, config: dict, weight_dir: str | Path, cases: list[str],
                  budget_s: float = PROFILE_BUDGET_S) -> dict:
    """slot_ms over the benchmark `cases` (fresh tokens), summed case by case, in their order until
    `budget_s` has passed, the mixed cases first (they call every slot, prefill and decode shapes
    alike: the share a pass cut short shows is nearer the score's five cases); `cases` in the
    result names those profiled."""
    import torch
    gen = torch.Generator().manual_seed(secrets.randbits(62))
    total: dict | None = None
    done: list[str] = []
    start = time.perf_counter()
    for case in sorted(cases, key=lambda c: not c.startswith("mixed")):
        if done and time.perf_counter() - start > budget_s:
            break
        trace = benchmark_trace(case)
        tokens = [draw_op_tokens(op, gen, int(config["vocab_size"]), "cpu") for op in trace]
        total = merge_profiles(total, module.profile(config, str(weight_dir), trace, tokens))
        done.append(case)
    return {**(total or {}), "cases": done}


def failed_result(device: str, stage: str, kind: str | None = None, error: str | None = None) -> dict:
    """A verdict's fields as a failure at `stage` (evaluate fills in the rest as it goes)."""
    return {"status": "failed", "stage": stage, "error_kind": kind, "error": error, "device": device,
            "criterion": None, "public": None, "stress": None, "benchmark": None, "score": None,
            "reference_margin": None, "isolation": None, "slot_ms": None, "seconds": 0.0, "stage_seconds": {},
            "triton_compiled": None}


def evaluate(engine: str | Path, model_config: dict | str | Path, weight_dir: str | Path,
             device: str = "auto", stress: str = "quick", cases=PUBLIC_CASES, warmup: int = 1,
             repeat: int = 3, seed: int | None = None, bandwidth_gbs: float | None = None,
             peak_tflops: float | None = None, tol: Tolerance = Tolerance(),
             log=lambda line: None, memory_bytes: int | None = None, triton_cache: Path | None = None,
             update_cache: bool = False, cache_scope: tuple[str, ...] = (), profile: bool = False,
             criterion: str = "auto",
             benchmark: bool = True, started: float | None = None, setup: JudgeSetup | None = None,
             reuse: Worker | None = None, public: bool = True, fresh: Worker | None = None,
             worker_ready: Callable[[], None] = lambda: None,
             before_timing: Callable[[], None] = lambda: None, compile_ahead: bool = True,
             shared_warm_up: bool = False) -> dict:
    """The EvalResult dict of docs/design.md §2. Never raises for a bad candidate: the
    candidate runs in a confined worker (evaluator/remote.py), capped at `memory_bytes`. With
    `triton_cache` the worker starts from a copy of that (judge-owned) cache, and with
    `update_cache` a passing worker's new entries are added to it, in the layer of `cache_scope`
    (the caller's digests of the model-written variants the engine holds; () when its code is all
    the repository's), and the worker reads only the layers of scopes within its own
    (evaluator/triton_cache.py). `profile`: a passing engine's
    profiled pass goes into `slot_ms` (a failure of the pass is logged; the verdict stands).
    criterion: evaluator/hf_judge.py (auto: the bf16 criterion for Hugging Face models in half precision).
    `benchmark` False: no benchmark, no score (see the module's docstring). `started`: a
    time.perf_counter() reading of the process's start, so that stage_seconds counts the judge's
    own start-up (imports) too. `setup`: this process's hardware and margin, measured by the first
    verdict that needs them and shared by the later ones (evaluator/resident.py: one judge for a
    run, so for the same model, device and seed); None: measured for this verdict alone. `reuse`:
    a worker that holds `engine` already and stays open (a series' consecutive timings of one
    engine); None: a fresh worker for this evaluation, killed at its end: `fresh` where one was
    started ahead and has run nothing yet (evaluator/resident.py's spare), else a new one.
    `worker_ready` is called once the worker has measured its channel's round trip (the resident
    judge starts the next verdict's worker then, beside the untimed stages), `before_timing`
    before the benchmark and the profiled pass (it waits there for that start). `compile_ahead`:
    on a GPU the worker compiles the verdict's kernels ahead, beside itself (evaluator/compile_ahead.py,
    stopped after the stress suite). `shared_warm_up`: the benchmark's warm-up passes on one
    engine for all cases (run_benchmark's; a search's screens and contest rounds). `public` False: no
    public sequence before the benchmark (the bf16 criterion still runs: its tolerance is the one
    the benchmark's outputs are checked at), only for a repeated timing of an
    engine whose screen passed them in this run (evaluator/resident.py series): what it is for is
    the clock, and every timed run's outputs are still checked (run_benchmark)."""
    if stress not in STRESS_MODES:
        raise ValueError(f"stress must be one of {STRESS_MODES}")
    start = time.perf_counter()
    device = resolve_device(device)
    result = failed_result(device, "import")
    clock = StageClock(result["stage_seconds"], start if started is None else started)
    setup = JudgeSetup() if setup is None else setup
    if started is not None:
        clock.lap("judge start")
    try:
        config = load_config(model_config)
        with ExitStack() as owned:
            # A fresh worker is started first: its confinement, torch import and device context
            # overlap the judge's setup below; it runs nothing of the candidate's before `load`.
            worker = reuse if reuse is not None else owned.enter_context(closing(
                fresh or Worker(device, memory_bytes or default_memory_cap(), log, triton_cache, cache_scope)))
            if fresh is not None:
                log("the worker: the judge's spare, started while the previous verdict ran")
            if setup.hardware is None:
                setup.hardware = detect_hardware(device, compute_dtype(config, device), bandwidth_gbs, peak_tflops)
            hardware = setup.hardware
            bf16_criterion = uses_bf16_criterion(config, device, criterion)
            if not bf16_criterion and setup.margin is None:   # the criterion path measures its own
                setup.margin = reference_margin(config, weight_dir, device, tol, seed)
            result["reference_margin"] = CRITERION_MARGIN if bf16_criterion else setup.margin
            log(f"the judge's own margin against fp32 on these weights: {result['reference_margin']:.3f}")
            clock.lap("setup")
            target_tol = tol
            worker.ready()
            worker_ready()
            result["isolation"] = worker.layers
            if reuse is None:
                worker.request({"op": "load", "engine": worker.readable(engine)}, what="import")
            stress_seed = secrets.randbits(31) if seed is None else seed
            ahead = compile_ahead and device in AHEAD_DEVICES and (public or stress != "off")   # they compile
            if ahead:
                models = plan_ahead(config, worker.readable(weight_dir), public, list(cases) if benchmark else [],
                                    stress, stress_seed, device,
                                    ahead_limit(memory_bytes or default_memory_cap(), device_memory(device)))
                started_ahead = worker.request({"op": "ahead"}, json.dumps(models).encode(), what="compile ahead")
                if started_ahead.get("error"):   # the worker's words: a line, and short
                    log(f"compile ahead: not started ({str(started_ahead['error']).splitlines()[0][:200]})")
            module = RemoteModule(worker)
            clock.lap("worker")
            if bf16_criterion:   # also where `public` is off: it sets the tolerance the benchmark checks at
                result["stage"] = "criterion"
                verdict, target_tol = run_criterion(module, config, weight_dir, device, seed)
                result["criterion"] = {"tolerance": verdict.tolerance, "reference_error": verdict.reference_error,
                                       "engine_error": verdict.engine_error, "agreement": verdict.agreement,
                                       "decided": verdict.decided}
                log(f"criterion: {verdict.line()}")
            if public:
                result["stage"] = "public"
                sequence = run_public_sequence(module, config, weight_dir, device, target_tol.atol, target_tol.rtol,
                                               reference_dtype=target_tol.reference_dtype)
                result["public"] = {"status": sequence["status"], "max_abs_err": sequence["max_abs_err"],
                                    "cases": sequence["cases"], "worst_margin": sequence["worst_margin"]}
                log(f"public: passed, max abs err {sequence['max_abs_err']:.3g}")
                clock.lap("public")
            else:
                log("public sequence: not run (a repeated timing: the screen ran it on this engine)")
            if stress != "off":
                result["stage"] = "stress"
                report = run_stress(module, device, stress_seed, quick=stress == "quick", target=(config, weight_dir),
                                    fail_fast=True, tol=tol, log=log, target_tol=target_tol)
                result["stress"] = report.to_dict()
                clock.lap("stress")
                failure = report.first_failure
                if failure is not None:
                    result["error_kind"] = failure.error_kind
                    result["error"] = f"stress case {failure.name} (seed {report.seed}): {failure.error}"
                    return result
            if ahead:   # before anything is timed, and before the worker's cache is counted and merged
                said = worker.request({"op": "stop_ahead"}, what="compile ahead").get("said")
                for line in (said if isinstance(said, str) else "").splitlines()[-AHEAD_LOG_LINES:]:
                    log(f"  | {line[:200]}")   # the worker's words (its compile-ahead process's progress)
            if benchmark:
                before_timing()
                result["stage"] = "benchmark"
                # A fresh seed the worker never sees: it gets each trace's tokens when the clock starts.
                result["benchmark"] = run_benchmark(module, config, weight_dir, device, list(cases), warmup, repeat,
                                                    seed=secrets.randbits(62), hardware=hardware, tol=target_tol,
                                                    shared_warm_up=shared_warm_up)
                result["score"] = score(result["benchmark"])
                clock.lap("benchmark")
            result["stage"], result["status"] = "done", "passed"
            if profile:
                before_timing()
                try:
                    result["slot_ms"] = profiled_pass(module, config, weight_dir, list(cases))
                except EvalFailure as e:
                    log(f"profiled pass failed ({e.kind}): {str(e).splitlines()[0] if str(e) else ''}")
                clock.lap("profile")
            if triton_cache is not None and device == "cuda":
                result["triton_compiled"] = compiled_kernels(worker.jail.compile_cache, triton_cache, cache_scope)
                log(f"Triton: {result['triton_compiled']} kernels compiled (not in the shared cache)")
            if triton_cache is not None and update_cache and device == "cuda":   # nothing compiles elsewhere
                added = merge_cache(worker.jail.compile_cache, triton_cache, cache_scope)
                log(f"shared Triton cache: {added} compiled kernels added")
    except EvalFailure as e:
        result["error_kind"], result["error"] = e.kind, str(e)
    except BaseException as e:  # noqa: BLE001 - the verdict must be written whatever happened
        result["error_kind"] = CRASH
        result["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}"
    finally:
        result["seconds"] = time.perf_counter() - start
        clock.lap("rest")   # a failing stage's time, the worker's teardown
    return result


class StageClock:
    """Seconds per stage of one evaluation, each lap the time since the previous one (rounded
    to ms; a stage lapped twice adds up)."""

    def __init__(self, into: dict[str, float], since: float):
        self.into, self.last = into, since

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.into[stage] = round(self.into.get(stage, 0.0) + now - self.last, 3)
        self.last = now


def write_json(result: dict, out: str | Path) -> None:
    """Atomically, so the judge never reads half a verdict. The file is made anew under a random
    name (O_EXCL: a link planted under a name the writer would pick is never followed, so what
    lands at `out` is the judge's own regular file), then renamed into place."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=out.name + ".", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)   # as a plain write would leave it (mkstemp's is 0600)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(result, indent=2))
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)  # a full disk leaves no half verdict behind
        raise


def summary_line(result: dict) -> str:
    """The verdict in one line, as stdout says it."""
    score_text = "untimed" if result["score"] is None else f"{result['score']:.4g}"
    verdict = f"score {score_text}" if result["status"] == "passed" else \
        f"{result['error_kind']} at {result['stage']}: {(result['error'] or '').splitlines()[0]}"
    line = f"{result['status']}: {verdict} ({result['seconds']:.1f} s)"
    # Escaped where UTF-8 cannot write it: an engine's exception may hold a lone surrogate (JSON
    # carries "\\ud800" from the worker), and printing it raised out of the resident judge before
    # it wrote the verdict (the judge exited; red-team helper, thirty-ninth session).
    return line.encode("utf-8", "backslashreplace").decode("utf-8")


def add_timing_flags(p: argparse.ArgumentParser) -> None:
    """The flags of a timed evaluation, the same for one verdict (here) and a contest's series
    (evaluator/resident.py, the agent's judge): cases, warm-up and repeats, the floor's hardware, the worker's cap and
    cache, the criterion."""
    p.add_argument("--cases", default=",".join(PUBLIC_CASES), help=f"comma-separated, of: {', '.join(BENCHMARK_CASES)}")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--bandwidth-gbs", type=float)
    p.add_argument("--peak-tflops", type=float)
    p.add_argument("--memory-gb", type=float,
                   help=f"each worker's memory cap (default {100 * MEMORY_FRACTION:.0f}%% of this machine's memory)")
    p.add_argument("--triton-cache", type=Path, help="the judge's shared Triton cache: each worker starts from a copy")
    p.add_argument("--compile-ahead", choices=("auto", "off"), default="auto",
                   help="auto: on a GPU the worker compiles the verdict's Triton kernels ahead on a thread pool "
                        "(evaluator/compile_ahead.py); off: each at its first launch (to measure the difference)")
    p.add_argument("--criterion", choices=CRITERIA, default="auto",
                   help="auto: the bf16 criterion for Hugging Face models in bf16/fp16, else the course judge "
                        "(evaluator/hf_judge.py); bf16 or course forces one (tests force bf16 on the CPU)")


def main(argv: list[str] | None = None) -> None:
    p = harness_parser(__doc__.splitlines()[0])
    add_timing_flags(p)
    p.add_argument("--stress", choices=STRESS_MODES, default="quick")
    p.add_argument("--warm-up", choices=WARM_UPS, default="case",
                   help="case: one warm-up engine a benchmark case (SPEC §5); shared: one for all cases "
                        "(a search's screens and contest rounds)")
    p.add_argument("--no-benchmark", action="store_true",
                   help="public sequence and stress only, no score: the caller holds this engine's timing")
    p.add_argument("--seed", type=int, help="stress seed (default: fresh)")
    p.add_argument("--triton-cache-update", action="store_true",
                   help="add a passing worker's new entries to --triton-cache (only for engines of the "
                        "repository's own code: the cache's shared layer)")
    p.add_argument("--profile", action="store_true",
                   help="a passing engine's profiled pass: per-slot time in slot_ms (reported, not scored)")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    # SIGTERM (the agent's timeout) unwinds like an interrupt, so the worker's jail is torn down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    cases = parse_cases(a.cases)
    freeze_imports()
    try:
        config = load_config(a.model_config)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    result = evaluate(a.engine, config, a.weight_dir, a.device, a.stress, cases, a.warmup, a.repeat,
                      a.seed, a.bandwidth_gbs, a.peak_tflops,
                      log=lambda line: print(line, file=sys.stderr, flush=True),
                      memory_bytes=int(a.memory_gb * 2**30) if a.memory_gb else None,
                      triton_cache=a.triton_cache, update_cache=a.triton_cache_update, profile=a.profile,
                      criterion=a.criterion, benchmark=not a.no_benchmark, started=STARTED,
                      compile_ahead=a.compile_ahead != "off", shared_warm_up=a.warm_up == "shared")
    write_json(result, a.out)
    print(summary_line(result))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if result["status"] == "passed" else 1)


if __name__ == "__main__":
    main()
