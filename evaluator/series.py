"""Timings one after another in one judge process: the agent's back-to-back rounds
(agent/acceptance.py) without an evaluator start per timing.

    python3 -m evaluator.series --timing LABEL=ENGINE [--timing LABEL=ENGINE ...] --out-dir DIR \
        --model-config CFG --weight-dir DIR --device cpu|cuda|auto [--cases ...] [--warmup 1] \
        [--repeat 3] [--seed N] [--memory-gb G] [--bandwidth-gbs B --peak-tflops P] [--triton-cache DIR]

Each timing, in the order given, is exactly an `evaluate --stress off` of its engine (public
sequence, then the benchmark with its timed outputs checked, every timed run on a fresh
create_engine). Consecutive timings of one engine share its worker; the worker is killed whole
before another engine's timing starts, so no candidate runs beside another's clock, and the
candidate is never imported here (evaluator/evaluate.py). In the contest's order (A, B B, A A,
B: agent/acceptance.py order) each later pair has one timing in a worker that timed before and
one in a fresh worker, the side alternating from round to round as the order does. A worker
whose timing failed is not used again.
Its verdict goes to DIR/LABEL/result.json as soon as it is in, so a caller can decide on the
first timings and stop the rest. What a series saves is the judge's own start per timing
(imports, the device's context), the floor's hardware and the judge's margin on the real
weights, measured once: all the same for every timing. The shared Triton cache is only read here (the engines timed were
judged before; a series adds nothing to it). Progress goes to stderr; exit 0 once every verdict
is written (each says whether its timing passed), 2 for bad flags.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the `evaluator` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from evaluator.isolation import quiet_threads  # noqa: E402  (the standard library only)

STARTED = time.perf_counter()   # before torch is imported: the first timing's share of the start
quiet_threads()

from evaluator.common import (ConfigError, EvalFailure, Tolerance, compute_dtype, load_config,  # noqa: E402
                              parse_cases, resolve_device)
from evaluator.floor import detect_hardware  # noqa: E402
from evaluator.evaluate import add_timing_flags, default_memory_cap, evaluate, write_json  # noqa: E402
from evaluator.remote import Worker  # noqa: E402
from evaluator.hf_judge import uses_bf16_criterion  # noqa: E402
from evaluator.noise import reference_margin  # noqa: E402

RESULT = "result.json"


def parse_timing(text: str) -> tuple[str, Path]:
    """`LABEL=ENGINE`; the label names a folder under --out-dir, so it is one plain name."""
    label, sep, engine = text.partition("=")
    if not sep or not label or not engine or label in (".", "..") or not label.replace("-", "").replace("_", "").isalnum():
        raise argparse.ArgumentTypeError(f"--timing {text!r}: expected LABEL=ENGINE, LABEL letters, digits, - and _")
    return label, Path(engine)


def run_series(timings: list[tuple[str, Path]], out_dir: Path, config: dict, weight_dir: str | Path, device: str,
               cases: list[str], warmup: int, repeat: int, seed: int | None = None,
               bandwidth_gbs: float | None = None, peak_tflops: float | None = None,
               memory_bytes: int | None = None, triton_cache: Path | None = None, criterion: str = "auto",
               log=lambda line: None, started: float | None = None,
               stopped: Callable[[], bool] = lambda: False) -> list[dict]:
    """Time each engine in turn (stress off), writing out_dir/LABEL/result.json after each.
    `stopped()` true after a timing: the caller stopped the series (SIGTERM), and what that
    timing became is the stop's doing, not the engine's: not written, and no timing follows."""
    device = resolve_device(device)
    tol = Tolerance()
    hardware = detect_hardware(device, compute_dtype(config, device), bandwidth_gbs, peak_tflops)   # once
    margin = None
    if not uses_bf16_criterion(config, device, criterion):   # the criterion path measures its own
        margin = reference_margin(config, weight_dir, device, tol, seed)
        log(f"the judge's own margin against fp32 on these weights: {margin:.3f} (once for the series)")
    results = []
    held: Held | None = None   # the last engine's worker, for that engine's next timing
    try:
        for label, engine in timings:
            if held is not None and held.engine != engine:
                held.close()
                held = None
            if held is None:
                held = Held.start(engine, device, memory_bytes, triton_cache, log)
            log(f"--- {label}: {engine}" + (" (its worker again)" if held and held.timed else ""))
            result = evaluate(engine, config, weight_dir, device, "off", cases, warmup, repeat, seed,
                              hardware.bandwidth_gbs, hardware.peak_tflops, tol, log, memory_bytes, triton_cache,
                              update_cache=False, criterion=criterion, started=started, margin=margin,
                              reuse=held.worker if held else None)
            started = None   # the judge's start-up counts in the first timing only
            if stopped():
                log(f"{label}: stopped by the caller")
                break
            if held is not None:
                held.timed = True
                if result["status"] != "passed":
                    held.close()
                    held = None
            write_json(result, out_dir / label / RESULT)
            verdict = "passed" if result["status"] == "passed" else f"{result['error_kind']} at {result['stage']}"
            log(f"{label}: {verdict} ({result['seconds']:.1f} s)")
            results.append(result)
    finally:
        if held is not None:
            held.close()
    return results


@dataclass
class Held:
    """A worker holding one engine, kept open between that engine's consecutive timings."""

    engine: Path
    worker: Worker
    timed: bool = False

    @staticmethod
    def start(engine: Path, device: str, memory_bytes: int | None, triton_cache: Path | None, log) -> "Held | None":
        """A fresh worker that imported `engine`; None where it failed to start or to import it:
        then evaluate() starts its own, and its verdict says what failed."""
        worker = None
        try:
            worker = Worker(device, memory_bytes or default_memory_cap(), log, triton_cache)
            worker.ready()
            worker.request({"op": "load", "engine": worker.readable(engine)}, what="import")
        except EvalFailure:
            if worker is not None:
                worker.close()
            return None
        return Held(engine, worker)

    def close(self) -> None:
        self.worker.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--timing", action="append", type=parse_timing, required=True, metavar="LABEL=ENGINE")
    p.add_argument("--out-dir", required=True, type=Path)
    p.add_argument("--model-config", required=True)
    p.add_argument("--weight-dir", required=True)
    p.add_argument("--device", default="auto")
    add_timing_flags(p)
    p.add_argument("--seed", type=int, help="the judge margin's seed (default: fresh)")
    a = p.parse_args(argv)
    labels = [label for label, _ in a.timing]
    if len(set(labels)) != len(labels):
        p.error(f"--timing labels must differ, got {', '.join(labels)}")
    stops: list[int] = []

    def stop(*_) -> None:   # unwinds the timing under way (its jail torn down), then the series ends
        stops.append(signal.SIGTERM)
        sys.exit(128 + signal.SIGTERM)
    signal.signal(signal.SIGTERM, stop)
    try:
        config = load_config(a.model_config)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    run_series(a.timing, a.out_dir, config, a.weight_dir, a.device, parse_cases(a.cases), a.warmup, a.repeat,
               a.seed, a.bandwidth_gbs, a.peak_tflops, int(a.memory_gb * 2**30) if a.memory_gb else None,
               a.triton_cache, a.criterion, log=lambda line: print(line, file=sys.stderr, flush=True),
               started=STARTED, stopped=lambda: bool(stops))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
