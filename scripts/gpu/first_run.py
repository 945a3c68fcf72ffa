"""Why a benchmark's first timed engine can be slow: its runs case by case, and a profile of the first one.

    python3 -m scripts.gpu first-run [--plan NAME | --engine PATH] [--judge] [--out DIR]

Why: at one fresh engine a case (the screens' setting), the prefill case of every engine measured
46-69 ms where the same engines' later fresh engines take 1.6 ms (twenty-second session): the
median of three hides it, one run does not. In-process (no judge, no worker), this runs the
benchmark as the judge does (every warm-up first, with the reference; then each case's fresh
engines) and prints each case's runs; then the prefill case alone (its warm-up right before its
runs, as SPEC.md §5 orders them); then the order of the judge again with torch.profiler around
the first timed run, printing what took its time. Writes first_run.json and first_run_profile.txt.

--judge instead asks the run's judge (agent/judge.py, as run.sh does) for screens of the engine
(TIMING, one fresh engine a case), --screens with --spare-worker off and as many with it on, and
prints each screen's runs and each run's delivery: the judge sending the timed request to the
worker having it, which a stalled run showed at 1.2-4.0 ms against ~0.03 (twenty-third session,
two jobs on one host; `first-run --judge --screens 10` on one GPU with nothing beside it says
whether the second job was the cause).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from evaluator.benchmark_throughput import (_Case, _create, _draw_trace, _warm_up, make_generator,
                                            release_device_memory, run_benchmark, timed_run)
from evaluator.common import Tolerance, load_config, load_engine_module
from evaluator.guards import ThreadWatch
from evaluator.reference_model import ReferenceModel
from evaluator.traces import benchmark_trace
from scripts.gpu.common import FINAL_PLAN, PUBLIC_CONFIG, PUBLIC_WEIGHTS, ensure_toy_weights, library_plans, \
    out_dir, render_to_file

CASES = ["prefill", "decode", "mixed"]


def runs(bench: list[dict]) -> dict[str, list[float]]:
    return {c["case_name"]: [round(ms, 2) for ms in c["runs_ms"]] for c in bench}


def deliveries(bench: list[dict]) -> dict[str, list[float]]:
    """Per case, each timed run's delivery in ms (the first of its split_ms: judge sent, worker received)."""
    return {c["case_name"]: [round(split[0], 3) for split in c.get("split_ms") or []] for c in bench}


def profiled_first_run(module, config: dict, weights: str, out: Path) -> float:
    """Warm-ups of CASES with the reference (as run_benchmark), then the first prefill run profiled."""
    cases = [_Case(name, benchmark_trace(name), make_generator(0, "cuda")) for name in CASES]
    reference = ReferenceModel.load(config, weights, "cuda")
    threads = ThreadWatch()
    for case in cases:
        _warm_up(module, config, weights, "cuda", [case], 1, reference, Tolerance(), threads)
    del reference
    release_device_memory("cuda")
    case = cases[0]
    engine = _create(module, config, weights, "cuda", case.name)
    tokens = _draw_trace(case.trace, case.gen, int(config["vocab_size"]), "cuda")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        run = timed_run(engine, case.trace, tokens, "cuda", case.name, int(config["vocab_size"]), False)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70)
    table += "\n" + prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=70)
    (out / "first_run_profile.txt").write_text(table)
    print(table[:6000])
    return run.seconds * 1e3


def judge_screens(engine: Path, out: Path, screens: int) -> dict[str, list[dict]]:
    """`screens` screens of `engine` from one judge process per --spare-worker setting."""
    import sys
    from agent.judge import TIMING, Judge, JudgeSettings
    found = {}
    for spare in ("off", "on"):
        settings = JudgeSettings(sys.executable, Path(PUBLIC_CONFIG), Path(PUBLIC_WEIGHTS), "cuda", 0,
                                 cases=",".join(CASES), warmup=1, repeat=3, screen_repeat=1, spare_worker=spare,
                                 triton_cache=out / "triton-cache")
        (out / "triton-cache").mkdir(exist_ok=True)
        with Judge(settings, out / f"judge-{spare}") as judge:
            for i in range(screens):
                r = judge.verdict(engine, out / f"spare-{spare}-{i}", 600, settings.for_phase(TIMING))
                row = {"status": r.status, "error": r.error, "stages": r.stage_seconds,
                       "runs": runs(r.benchmark or []), "delivery_ms": deliveries(r.benchmark or [])}
                print(f"spare {spare}, screen {i}: {row}", flush=True)
                found.setdefault(f"spare {spare}", []).append(row)
    return found


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plan", default=FINAL_PLAN)
    p.add_argument("--engine")
    p.add_argument("--judge", action="store_true", help="screens through the run's judge, its spare worker off and on")
    p.add_argument("--screens", type=int, default=3, help="with --judge: screens per spare-worker setting")
    p.add_argument("--out", default=out_dir("/tmp/first_run"))
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ensure_toy_weights()
    engine = Path(a.engine) if a.engine else render_to_file(library_plans()[a.plan], "first_run")
    if a.judge:
        (out / "first_run.json").write_text(json.dumps(judge_screens(engine, out, a.screens), indent=2) + "\n")
        return
    module = load_engine_module(engine)
    config = load_config(PUBLIC_CONFIG)
    found = {"judge order, repeat 3": runs(run_benchmark(module, config, PUBLIC_WEIGHTS, "cuda", CASES, 1, 3)),
             "prefill alone, repeat 3": runs(run_benchmark(module, config, PUBLIC_WEIGHTS, "cuda", ["prefill"], 1, 3)),
             "judge order again, repeat 1": runs(run_benchmark(module, config, PUBLIC_WEIGHTS, "cuda", CASES, 1, 1))}
    for what, by_case in found.items():
        print(f"{what}: {by_case}", flush=True)
    found["profiled first prefill run (ms, under the profiler)"] = profiled_first_run(module, config, PUBLIC_WEIGHTS,
                                                                                       out)
    (out / "first_run.json").write_text(json.dumps(found, indent=2) + "\n")
