"""The throughput benchmark (SPEC.md §5), with the official command line and more cases.

    python3 evaluator/benchmark_throughput.py --engine workspace/engine.py \
        --model-config target/model_config.json --weight-dir target/weights --device auto \
        [--warmup 1 --repeat 3] [--cases prefill,decode,mixed] [--bandwidth-gbs --peak-tflops]

Seed 0 (each case its own stream: `case_seed`), tokens drawn on the device before the clock
starts. Per case: one warm-up engine runs the trace `warmup` times (run_benchmark's
shared_warm_up: one for all cases, a search's screens), then each of `repeat` measurements
builds a fresh engine and runs the trace once; the median by elapsed time is reported. Timed region:
synchronize → perf_counter → every prefill/decode/remove → synchronize → perf_counter,
under torch.no_grad(). Prints a JSON list, one object per case, with the official fields
plus the physical floor of the case and the fraction of it reached.

Beyond the official harness (both skipped by --no-verify): before any timing, every call of
one pass of each case is checked against the reference as it returns (one row of each output,
at random; the first warm-up pass, or an extra pass when there is no warm-up), so an engine
that recognises the benchmark's trace and skips work on calls whose outputs are not kept is
caught; and the last output of every timed run is checked after all timing is done (so an
engine cannot time one path and pass another). All warm-ups run before all timed runs, so
the reference is not in memory while the clock runs.
"""
from __future__ import annotations

import gc
import json
import math
import sys
import time
import random
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

if __package__ in (None, ""):  # run as a script: make the `evaluator` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from evaluator.common import (EngineRaised, ModelDims, Tolerance, WrongResult, call_engine, check_harness_inputs,  # noqa: E402
                              compute_dtype, harness_parser, load_config, load_engine_module,
                              make_generator, parse_cases, resolve_device, synchronize)
from evaluator.floor import Hardware, detect_hardware, floor_seconds  # noqa: E402
from evaluator.guards import FunctionIdentities, ThreadWatch, compare, take_output  # noqa: E402
from evaluator.reference_model import ReferenceModel  # noqa: E402
from evaluator.remote import RemoteEngine  # noqa: E402
from evaluator.session import (CheckedSession, Histories, draw_op_tokens,  # noqa: E402
                               mismatch_message, reference_rows)
from evaluator.traces import DECODE, PREFILL, PUBLIC_CASES, Op, benchmark_trace, token_counts  # noqa: E402

BENCHMARK_SEED = 0
MIB = 2**20
# Rows of each output the checked pass compares with the reference (chosen at random, every
# row validated): the pass is there to catch skipped calls, and on a CPU the reference costs
# more than a fast engine, so comparing every row would double a candidate's evaluation.
CHECKED_ROWS_PER_CALL = 1
# Rows of each timed run (an engine in the judge's worker) compared with the reference, drawn
# after the run from all its outputs by a generator the worker cannot see; every row of every
# output is checked finite. An engine right only where the checks look is caught this way.
TIMED_ROWS_CHECKED = 6


@dataclass
class LastOutput:
    """The last logits of a timed run and the histories they must match, checked later."""

    what: str
    request_ids: tuple[int, ...]
    histories: Histories
    got: torch.Tensor


@dataclass
class TimedRun:
    seconds: float
    peak_memory_mb: float
    checks: list[LastOutput] = field(default_factory=list)
    inner_seconds: float | None = None   # the worker's own clock around the same calls
    raw_seconds: float | None = None     # the judge's clock before the round trip is subtracted
    moments: list[float] | None = None   # evaluator.remote.TraceRun.moments
    cpu_ms: list[float] | None = None    # evaluator.remote.TraceRun.cpu_ms
    device_calls_ms: float | None = None


def _draw_trace(trace: list[Op], gen: torch.Generator, vocab: int, device: str) -> list[list[torch.Tensor]]:
    return [draw_op_tokens(op, gen, vocab, device) for op in trace]


def _calls(engine, trace: list[Op], tokens: list[list[torch.Tensor]]) -> list[tuple]:
    """(bound method, args, returns logits) per op, built before the clock starts."""
    out = []
    for op, drawn in zip(trace, tokens):
        ids = list(op.request_ids)
        if op.kind == PREFILL:
            out.append((engine.prefill, (ids, drawn), True))
        elif op.kind == DECODE:
            out.append((engine.decode, (ids, drawn[0]), True))
        else:
            out.append((engine.remove, (ids,), False))
    return out


def timed_run(engine, trace: list[Op], tokens: list[list[torch.Tensor]], device: str, case: str,
              vocab: int, keep_last: bool, threads: ThreadWatch | None = None) -> TimedRun:
    """One pass over the trace under the official timing method. With keep_last, the last
    logits are copied (after the clock stops) for a later check against the reference. With
    `threads`, a thread still running when the clock stops (work hidden from it) fails. An
    engine in the judge's worker is timed by the judge around the whole trace (remote_timed_run)."""
    if isinstance(engine, RemoteEngine):
        return remote_timed_run(engine, trace, tokens, case, vocab, keep_last)
    calls = _calls(engine, trace, tokens)
    last, last_index, index = None, -1, -1
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    try:
        with torch.no_grad():
            synchronize(device)
            start = time.perf_counter()
            for index, (fn, args, returns) in enumerate(calls):
                result = fn(*args)
                if returns:
                    last, last_index = result, index
            synchronize(device)
            seconds = time.perf_counter() - start
    except Exception as e:  # noqa: BLE001 - the candidate may raise anything
        raise EngineRaised(f"case {case} {trace[index].describe()} raised {type(e).__name__}: {e}") from e
    if threads is not None:
        threads.check(f"benchmark case {case}, after the timed run")
    run = TimedRun(seconds, torch.cuda.max_memory_allocated() / MIB if device == "cuda" else 0.0)
    if keep_last and last_index >= 0:
        op = trace[last_index]
        what = f"benchmark case {case}, last output ({op.describe()})"
        histories = Histories()
        for prior, drawn in zip(trace[:last_index + 1], tokens):
            histories.apply(prior, drawn)
        run.checks = [LastOutput(what, op.request_ids, histories,
                                 take_output(last, len(op.request_ids), vocab, what))]
    return run


def remote_timed_run(engine: RemoteEngine, trace: list[Op], tokens: list[list[torch.Tensor]], case: str,
                     vocab: int, check: bool) -> TimedRun:
    """A timed run in the worker: every output must be there and finite; with `check`, up to
    TIMED_ROWS_CHECKED rows drawn at random from all of them are kept for the reference."""
    trace_run = engine.run_trace(trace, tokens, f"benchmark case {case}")
    run = TimedRun(trace_run.seconds, trace_run.peak_memory_mb, inner_seconds=trace_run.inner_seconds,
                   raw_seconds=trace_run.raw_seconds, moments=trace_run.moments, cpu_ms=trace_run.cpu_ms,
                   device_calls_ms=trace_run.device_calls_ms)
    rows = []
    for index, (op, out) in enumerate(zip(trace, trace_run.outputs)):
        if out is None:
            continue
        bad = ~torch.isfinite(out)
        if bad.any():
            raise WrongResult(f"benchmark case {case}, timed run, {op.describe()}: {int(bad.sum())} output values "
                              "non-finite or never written before the worker answered")
        rows += [(index, r) for r in range(len(op.request_ids))]
    if not check or not rows:
        return run
    picked = sorted(random.SystemRandom().sample(rows, min(TIMED_ROWS_CHECKED, len(rows))))
    histories = Histories()
    for index, (op, drawn) in enumerate(zip(trace, tokens)):
        histories.apply(op, drawn)
        mine = [r for i, r in picked if i == index]
        if mine:
            snapshot = Histories()
            snapshot.tokens = dict(histories.tokens)
            run.checks.append(LastOutput(f"benchmark case {case}, timed run, {op.describe()}",
                                         tuple(op.request_ids[r] for r in mine), snapshot,
                                         trace_run.outputs[index][mine]))
    return run


def release_device_memory(device: str) -> None:
    """What the engines and reference models before left in torch's caching allocator, handed
    back, so that the next engine (or the next verdict's worker) finds the device's memory free."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


@dataclass
class _Case:
    """One benchmark case while it is measured: its trace and its token generator (seed 0; the
    warm-up passes draw first, the timed runs continue from there, as officially)."""

    name: str
    trace: list[Op]
    gen: torch.Generator


def case_seed(seed: int, case: str) -> int:
    """A case's own token stream: `seed` with the case's name mixed in. With one seed for every
    case and all warm-ups run before any timed run (so that the reference is freed before the
    clock), the stream positions and draw sizes lined up: decode128's warm-up engine was handed
    all 4 prompts the prefill case's timed run then got (a cold review, thirty-first session),
    which an engine caching its answers by token content at module level could replay inside the
    clock. Streams of distinct seeds share no such run of draws."""
    return seed ^ zlib.crc32(case.encode())


def _create(module: ModuleType, config: dict, weight_dir: str, device: str, case: str):
    return call_engine(f"create_engine (case {case})", module.create_engine, config, weight_dir, device)


def _warm_up(module: ModuleType, config: dict, weight_dir: str, device: str, cases: list[_Case], warmup: int,
             reference: ReferenceModel | None, tol: Tolerance, threads: ThreadWatch) -> dict[str, float]:
    """One warm-up engine runs each case's trace `warmup` times, case after case (each trace ends
    with nothing live); with a reference, each case's first pass (an extra one when warmup is 0)
    is checked call by call (one random row of each output). The checked passes' worst margins,
    by case."""
    passes = max(warmup, 1) if reference is not None else warmup
    margins: dict[str, float] = {}
    if passes == 0 or not cases:
        return margins
    vocab = int(config["vocab_size"])
    engine = _create(module, config, weight_dir, device, ",".join(case.name for case in cases))
    for case in cases:
        for i in range(passes):
            if i == 0 and reference is not None:
                session = CheckedSession(engine, reference, case.gen, tol, threads=threads,
                                         label=f"benchmark case {case.name} (checked pass): ",
                                         rows_per_call=CHECKED_ROWS_PER_CALL)
                session.run(case.trace)
                margins[case.name] = session.stats.worst_margin
            else:
                timed_run(engine, case.trace, _draw_trace(case.trace, case.gen, vocab, device), device, case.name,
                          vocab, False, threads)
    del engine
    release_device_memory(device)
    return margins


def _time_case(module: ModuleType, config: dict, weight_dir: str, device: str, case: _Case, repeat: int,
               keep_last: bool, threads: ThreadWatch) -> list[TimedRun]:
    """`repeat` timed runs, each on a fresh engine."""
    vocab = int(config["vocab_size"])
    runs = []
    for _ in range(repeat):
        engine = _create(module, config, weight_dir, device, case.name)
        tokens = _draw_trace(case.trace, case.gen, vocab, device)
        runs.append(timed_run(engine, case.trace, tokens, device, case.name, vocab, keep_last, threads))
        del engine, tokens
        release_device_memory(device)
    return runs


def verify(checks: list[LastOutput], config: dict, weight_dir: str, device: str, tol: Tolerance) -> list[float]:
    """Compare the kept outputs of timed runs with the reference, after all timing is done; each
    check's margin (evaluator.guards.Comparison). The margins are reported, not only the pass: an
    engine can tell a timed trace from a checked session (its calls come back to back, a checked
    one's wait for the judge's reference), and one that ran exactly where it was checked and a
    faster, looser path where it was timed passed with the checked margin alone (red-team
    helper, thirty-third session)."""
    if not checks:
        return []
    reference = ReferenceModel.load(config, weight_dir, device, tol.reference_dtype)
    margins = []
    for c in checks:
        expected = reference_rows(reference, c.histories, c.request_ids)
        cmp = compare(c.got, expected, tol)
        if not cmp.passed:
            raise WrongResult(mismatch_message(c.what, cmp, tol, c.request_ids))
        margins.append(cmp.margin)
    return margins


def run_benchmark(engine: ModuleType | str | Path, model_config: dict | str | Path,
                  weight_dir: str | Path, device: str = "auto", cases=PUBLIC_CASES,
                  warmup: int = 1, repeat: int = 3, seed: int = BENCHMARK_SEED,
                  hardware: Hardware | None = None, bandwidth_gbs: float | None = None,
                  peak_tflops: float | None = None, verify_outputs: bool = True,
                  tol: Tolerance = Tolerance(), shared_warm_up: bool = False) -> list[dict]:
    """Time each case; return one result dict per case (official fields + floor_ms,
    floor_fraction, runs_ms). Raises EvalFailure when the engine raises or (with
    verify_outputs) when a call of the checked pass or a timed run's last output disagrees
    with the reference. `shared_warm_up`: one warm-up engine runs every case's warm-up passes, in
    place of one a case (SPEC §5's method): four create_engines fewer, ~1.9 s of a screen's ~8 s
    benchmark on the public config (an H200, thirty-first session); the timed runs are as
    officially, each on a fresh engine. For a search's screens and contest rounds, which compare
    engines timed the same way; an installed engine's score is timed officially."""
    if repeat < 1:
        raise ValueError("repeat must be at least 1")
    identities = FunctionIdentities()
    config = load_config(model_config)
    device = resolve_device(device)
    module = load_engine_module(engine)
    dims = ModelDims.from_config(config)
    dtype = compute_dtype(config, device)
    hw = hardware or detect_hardware(device, dtype, bandwidth_gbs, peak_tflops)
    measured = [_Case(name, benchmark_trace(name), make_generator(case_seed(seed, name), device)) for name in cases]
    # All warm-ups first, with the reference (checked passes), which is then freed: it must not
    # count in the timed runs' peak memory.
    reference = (ReferenceModel.load(config, weight_dir, device, tol.reference_dtype)
                 if verify_outputs and measured else None)
    checked: dict[str, float] = {}   # each case's checked pass: its worst margin
    for group in ([measured] if shared_warm_up else [[case] for case in measured]):
        checked |= _warm_up(module, config, str(weight_dir), device, group, warmup, reference, tol, identities.threads)
        identities.check(f"after warming up benchmark case {','.join(case.name for case in group)}")
    del reference
    release_device_memory(device)
    results, checks, owners = [], [], []   # owners: each check's case (its index in results)
    for case in measured:
        runs = _time_case(module, config, str(weight_dir), device, case, repeat, verify_outputs, identities.threads)
        identities.check(f"after benchmark case {case.name}")
        case_checks = [c for r in runs for c in r.checks]
        checks += case_checks
        owners += [len(results)] * len(case_checks)
        median = sorted(runs, key=lambda r: r.seconds)[len(runs) // 2]
        trace = case.trace
        pre, dec = token_counts(trace)
        floor_s = floor_seconds(dims, dtype.itemsize, trace, hw)
        results.append({
            "case_name": case.name,
            "elapsed_ms": median.seconds * 1e3,
            "prefill_tokens": pre,
            "decode_tokens": dec,
            "total_tokens": pre + dec,
            "tokens_per_second": (pre + dec) / median.seconds,
            "decode_tokens_per_second": dec / median.seconds,
            "peak_memory_mb": median.peak_memory_mb,
            "floor_ms": floor_s * 1e3,
            "floor_fraction": floor_s / median.seconds,
            "runs_ms": [r.seconds * 1e3 for r in runs],
            "warm_up": "shared" if shared_warm_up else "case",   # its warm-up engine: one for all cases, or its own
            **({"checked_margin": checked[case.name]} if case.name in checked else {}),
            **({"worker_runs_ms": [r.inner_seconds * 1e3 for r in runs],
                "judge_clock_ms": [r.raw_seconds * 1e3 for r in runs],
                "split_ms": [[(b - a) * 1e3 for a, b in zip(r.moments, r.moments[1:])] for r in runs]}
               if median.inner_seconds is not None else {}),
            # a diagnosed worker's (evaluator.remote.Worker(diagnose=True)); None where it gave none
            **({"split_cpu_ms": [r.cpu_ms for r in runs],
                "device_calls_ms": [None if math.isnan(r.device_calls_ms) else r.device_calls_ms for r in runs]}
               if any(r.cpu_ms and not math.isnan(r.cpu_ms[0]) for r in runs) else {}),
        })
    for owner, margin in zip(owners, verify(checks, config, str(weight_dir), device, tol)):
        results[owner]["timed_margin"] = min(margin, results[owner].get("timed_margin", margin))
    return results


def main(argv: list[str] | None = None) -> None:
    p = harness_parser(__doc__.splitlines()[0])
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--cases", default=",".join(PUBLIC_CASES),
                   help="comma-separated; also decode128, mixed128, prefill-long, decode-wide")
    p.add_argument("--bandwidth-gbs", type=float, help="memory bandwidth for the floor (default: by device)")
    p.add_argument("--peak-tflops", type=float, help="GEMM peak for the floor (default: by device)")
    p.add_argument("--no-verify", action="store_true", help="skip the reference check of the timed outputs")
    a = p.parse_args(argv)
    check_harness_inputs(a.engine, a.model_config, a.weight_dir)
    device = resolve_device(a.device)
    config = load_config(a.model_config)
    hw = detect_hardware(device, compute_dtype(config, device), a.bandwidth_gbs, a.peak_tflops)
    print(f"floor hardware: {hw.name}, {hw.bandwidth_gbs:.0f} GB/s, {hw.peak_tflops:.1f} TFLOP/s ({hw.source})",
          file=sys.stderr)
    cases = parse_cases(a.cases)
    results = run_benchmark(a.engine, config, a.weight_dir, device, cases, a.warmup, a.repeat,
                            hardware=hw, verify_outputs=not a.no_verify)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
