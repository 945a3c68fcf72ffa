"""One device call on several GPUs: the tensor-parallel engine on Hugging Face checkpoints of real shapes, checked, then its decode timed against one GPU and the floor.

    python3 -m scripts.gpu tp-check [--models llama-3.2-1b,llama-3.1-8b] [--degree 2] [--batch 64]
        [--prompt 128] [--steps 32] [--repeat 3] [--tiny] [--out DIR]

Issue 26's measurement, for `nvidia-h200-x2` (or larger). Each model is built by transformers from
its config with random weights (scripts/gpu/hf_models.py build: nothing is downloaded) and saved
in bf16. Then, in this process (the judge's worker cannot run the engine's ranks yet: its network
namespace has no loopback and the static policy refuses processes; docs/design.md "The tp
skeleton"):
  1. the tp engine (templates/engine/tp.py.j2, `tp_degree` --degree) held to the judge's bf16
     criterion and then the public sequence at the tolerance it measured (evaluator/hf_judge.py);
  2. decode at --batch requests (prompts of --prompt tokens, then --steps decode steps of all of
     them: evaluator/traces.py decode_case), timed as the benchmark times a case (a fresh engine
     a run, synchronize and perf_counter around the whole trace, the median of --repeat), for the
     tp engine and for the single-GPU paged engine of the library plan (FINAL_PLAN), each against
     the floor of its GPUs (evaluator/floor.py; N GPUs: N times the bandwidth and the FLOP/s).
--tiny builds tiny models of the same architectures on the CPU (gloo, fp32, the course's
criterion), to prove the plumbing (~20 s). On the GPU the 8B model alone (16 GB of bf16 weights
to build and write, its fp32 reference for the criterion) may take most of a 10-minute device
call: run one model a call where both do not fit. Writes tp_check.json; a table last.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch

from agent.plan import Plan
from agent.render import render_engine
from agent.spec import load_spec
from evaluator.benchmark_throughput import release_device_memory, timed_run
from evaluator.common import ModelDims, compute_dtype, load_engine_module, make_generator
from evaluator.floor import detect_hardware, floor_seconds
from evaluator.hf_judge import run_criterion, uses_bf16_criterion
from evaluator.session import draw_op_tokens
from evaluator.test_correctness import run_public_sequence
from evaluator.traces import decode_case
from scripts.gpu.common import FINAL_PLAN, library_plans, out_dir, prelude
from scripts.gpu.hf_models import build

TINY_STEPS = 4   # --tiny: decode steps (the CPU's fp32 engines are slow; the plumbing is the point)


def render(plan: Plan, weights: Path, out: Path, name: str) -> Path:
    """The plan's engine for the checkpoint's conventions, in a file of its own."""
    path = out / f"{name}.py"
    path.write_text(render_engine(plan, None, load_spec(weights / "config.json", weights).conventions))
    return path


def check(engine: Path, config: dict, weights: Path, device: str) -> str:
    """The judge's criterion on a fresh engine, then the public sequence at its tolerance: one line."""
    module = load_engine_module(engine)
    if uses_bf16_criterion(config, device):
        verdict, tol = run_criterion(module, config, weights, device)
        run_public_sequence(module, config, weights, device, atol=tol.atol, rtol=tol.rtol,
                            reference_dtype=tol.reference_dtype)
        return f"bf16 criterion {verdict.line()}; public sequence passed at atol {tol.atol:.3g}"
    run_public_sequence(module, config, weights, device)
    return "public sequence passed (course criterion)"


def time_decode(engine: Path, config: dict, weights: Path, device: str, batch: int, prompt: int, steps: int,
                repeat: int) -> tuple[float, list[float]]:
    """(median ms, every run's ms) of the decode trace, a fresh engine a run after one warm-up run."""
    module = load_engine_module(engine)
    trace = decode_case(batch, prompt, steps)
    gen = make_generator(0, device)
    vocab = int(config["vocab_size"])
    runs = []
    for index in range(repeat + 1):
        eng = module.create_engine(config, str(weights), device)
        tokens = [draw_op_tokens(op, gen, vocab, device) for op in trace]
        run = timed_run(eng, trace, tokens, device, "tp-decode", vocab, keep_last=False)
        if index:
            runs.append(run.seconds * 1e3)
        close = getattr(eng, "close", None)
        if close is not None:
            close()
        del eng, tokens
        release_device_memory(device)
    return statistics.median(runs), runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="llama-3.2-1b,llama-3.1-8b")
    p.add_argument("--degree", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="tiny models on the CPU (gloo): the plumbing")
    p.add_argument("--out", default=out_dir("tp-check-out"))
    a = p.parse_args(argv)
    out = Path(a.out)
    device = "cpu" if a.tiny else "cuda"
    if device == "cuda":
        prelude(out)
    out.mkdir(parents=True, exist_ok=True)
    if device == "cuda" and torch.cuda.device_count() < a.degree:
        print(f"tp-check: --degree {a.degree} needs {a.degree} GPUs, this machine has {torch.cuda.device_count()}",
              file=sys.stderr)
        return 2
    steps = TINY_STEPS if a.tiny else a.steps
    rows, report = [], {}
    for name in [m for m in a.models.split(",") if m]:
        folder = out / name / "weights"
        config = build(folder, name, a.tiny)
        tp = render(Plan("tp", {}, {"tp_degree": a.degree}), folder, out / name, "tp")
        ranks = load_engine_module(tp).usable_degree(config, a.degree)   # fewer where the model does not split
        engines = {f"tp{ranks}": (tp, ranks),
                   "paged (1 GPU)": (render(library_plans()[FINAL_PLAN], folder, out / name, "paged"), 1)}
        dims = ModelDims.from_config(config)
        hw = detect_hardware(device, compute_dtype(config, device))
        width = torch.finfo(compute_dtype(config, device)).bits // 8
        floor_1 = floor_seconds(dims, width, decode_case(a.batch, a.prompt, steps), hw) * 1e3
        report[name] = {"config": config, "hardware": dataclasses.asdict(hw), "floor_ms_1_gpu": floor_1}
        for label, (engine, gpus) in engines.items():
            line = check(engine, config, folder, device)
            print(f"{name} {label}: {line}", flush=True)
            ms, runs = time_decode(engine, config, folder, device, a.batch, a.prompt, steps, a.repeat)
            floor = floor_1 / gpus
            tokens = a.batch * (a.prompt + steps)
            report[name][label] = {"check": line, "ms": ms, "runs_ms": runs, "floor_ms": floor}
            rows.append([name, label, f"{ms:.2f}", f"{tokens / ms * 1e3:.0f}", f"{100 * floor / ms:.1f}%", line[:60]])
            (out / "tp_check.json").write_text(json.dumps(report, indent=1, default=str))
    print(f"\ndecode: {a.batch} requests x {a.prompt} prompt tokens + {steps} steps; floor: the engine's GPUs")
    widths = [max(len(r[i]) for r in rows + [["model", "engine", "ms", "tokens/s", "% floor", "check"]])
              for i in range(6)]
    for r in [["model", "engine", "ms", "tokens/s", "% floor", "check"], *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
