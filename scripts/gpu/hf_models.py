"""One device call: Hugging Face checkpoints of real shapes through run.sh, timed beside transformers.

    python3 -m scripts.gpu hf [--models llama-3.2-1b,qwen2.5-0.5b] [--budget 200] [--max-candidates N]
        [--cases prefill-long,decode-wide] [--repeat 3] [--tiny] [--device cuda|cpu] [--out DIR]
        [--plans "lib,lib exact" [--rounds 2] [--judge]]

Issue 21's GPU targets. Each model is built here by transformers from its config, with random
weights (nothing is downloaded; the shapes are Llama-3.2-1B's, llama3 rope scaling and tied
embeddings included, and Qwen2.5-0.5B's, q/k/v biases), saved in bf16 as a safetensors folder.
Then `bash run.sh --weights <folder>` writes and judges its engine (on CUDA the judge holds it
to the bf16 criterion, evaluator/hf_judge.py); the engine it wrote is timed on --cases
(evaluator/benchmark_throughput.py, --no-verify: the judge checked it) and transformers' own
forward (sdpa, cached decode, last-token logits) is timed on the same work on the same device,
side by side. --plans renders the named library plans (scripts/gpu/common.py) for each model
instead of running run.sh, times them in interleaved rounds (A B, B A, ...) beside transformers,
and with --judge holds each to the judge (public sequence and quick stress, no benchmark). It also records the memory create_engine peaks at on the device against the
model's size in its compute dtype (issue 21: at most ~1.2x). --tiny builds tiny models of the same architectures on the CPU (fp32 compute) and
times the small public cases, to prove the plumbing. Outputs under --out/<model>/ ($OUT when set); a summary table last. A
device call lasts at most 10 minutes: the default budget fits both models in one; for a longer
search run one model a call (`--models llama-3.2-1b --budget 420`).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

from evaluator.common import load_engine_module
from scripts.gpu.common import bench_rows, out_dir, prelude, run

# name -> (architecture, config keys). Sizes as the published configs give them.
SHAPES = {
    "llama-3.2-1b": ("LlamaForCausalLM", dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192})),
    "qwen2.5-0.5b": ("Qwen2ForCausalLM", dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_theta=1000000.0, tie_word_embeddings=True, use_sliding_window=False)),
    "llama-3.1-8b": ("LlamaForCausalLM", dict(   # issue 26's 8B shape (python3 -m scripts.gpu tp-check)
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192})),
}
# --tiny: the same architectures and conventions at a size a loaded CPU runs in seconds.
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=257, max_position_embeddings=4096)
# Benchmark cases as (batch, prompt tokens, decode steps), the work of evaluator/traces.py's
# BENCHMARK_CASES of the same name (tests/test_scripts.py holds the two together).
CASE_SHAPES = {"prefill-long": (8, 2048, 0), "decode-wide": (64, 512, 32), "prefill": (4, 128, 0),
               "decode": (8, 32, 16)}
SCALE_CASES = "prefill-long,decode-wide"   # issue 21's targets
TINY_CASES = "prefill,decode"              # --tiny: the plumbing, fast even for the recompute engine
SEED = 0


def build(folder: Path, name: str, tiny: bool) -> dict:
    """The model `name` with random weights (transformers' init), saved in bf16; its config."""
    import transformers
    architecture, keys = SHAPES[name]
    if tiny:
        keys = {**keys, **TINY}
        if "rope_scaling" in keys:
            keys["rope_scaling"] = {**keys["rope_scaling"], "original_max_position_embeddings": 256}
    config = getattr(transformers, architecture.removesuffix("ForCausalLM") + "Config")(**keys)
    torch.manual_seed(SEED)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):   # the init of a 1B model takes minutes on a CPU, seconds on a GPU
        model = getattr(transformers, architecture)(config)
    model.to(torch.bfloat16).save_pretrained(folder)
    del model
    return json.loads((folder / "config.json").read_text())


@torch.no_grad()
def time_transformers(folder: Path, case: str, device: str, repeat: int) -> float:
    """Median ms of transformers' forward (sdpa) on `case`'s work: one batched prefill of equal
    prompts, then cached decode steps of one token each, last-token logits only."""
    import transformers
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa")
    model = model.to(device).eval()
    batch, prompt, steps = CASE_SHAPES[case]
    gen = torch.Generator(device).manual_seed(SEED)
    vocab = model.config.vocab_size
    runs = []
    for _ in range(repeat + 1):   # the first run warms up
        ids = torch.randint(0, vocab, (batch, prompt), device=device, generator=gen)
        tokens = torch.randint(0, vocab, (steps, batch, 1), device=device, generator=gen)
        sync(device)
        start = time.perf_counter()
        out = model(ids, use_cache=steps > 0, logits_to_keep=1)
        for step in range(steps):
            out = model(tokens[step], past_key_values=out.past_key_values, use_cache=True, logits_to_keep=1)
        sync(device)
        runs.append(1e3 * (time.perf_counter() - start))
    del model
    return statistics.median(runs[1:])


def load_memory(engine: Path, weights: Path) -> str:
    """create_engine's peak device memory (torch.cuda.max_memory_allocated) over the model's
    size in its compute dtype (its parameters, as the agent's ModelSpec counts them, at the
    compute dtype's width)."""
    from agent.spec import load_spec
    config = json.loads((weights / "config.json").read_text())
    width = 2 if torch.cuda.is_available() else 4   # bf16 / fp16 on CUDA, fp32 on CPU
    model_bytes = width * load_spec(weights / "config.json", weights).parameters
    if not torch.cuda.is_available():
        return f"create_engine: model {model_bytes / 2**20:.0f} MiB (peak on CUDA only)"
    torch.cuda.empty_cache()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    eng = load_engine_module(engine).create_engine(config, str(weights), "cuda")
    peak, held = torch.cuda.max_memory_allocated() - start, torch.cuda.memory_allocated() - start
    del eng
    torch.cuda.empty_cache()
    return (f"create_engine: peak {peak / 2**20:.0f} MiB, holds {held / 2**20:.0f} MiB after (weights, KV pool, "
            f"graphs); model {model_bytes / 2**20:.0f} MiB: peak {peak / model_bytes:.2f}x the model")


def compare_plans(name: str, weights: Path, folder: Path, plans: list[str], cases: list[str], device: str,
                  repeat: int, rounds: int, judge: bool) -> list[str]:
    """The named library plans rendered for the model's conventions, timed in alternating rounds
    (and judged with --judge); one summary line per plan and case, then transformers'."""
    from agent.render import render_engine
    from agent.spec import load_spec
    from scripts.gpu.common import library_plans
    spec, library = load_spec(weights / "config.json", weights), library_plans()
    engines = {}
    for plan in plans:
        if plan.endswith(".py"):   # an engine rendered beforehand (e.g. from another tree: before and after)
            engines[plan] = Path(plan)
            continue
        engines[plan] = folder / f"engine-{plan.replace(' ', '-')}.py"
        engines[plan].write_text(render_engine(library[plan], model=spec.conventions))
    times: dict[tuple[str, str], list[float]] = {}
    floors: dict[str, float] = {}
    for r in range(rounds):
        for plan in plans if r % 2 == 0 else plans[::-1]:
            bench = folder / f"bench-{Path(plan).stem.replace(' ', '-')}-{r}.json"
            run([sys.executable, "evaluator/benchmark_throughput.py", "--engine", str(engines[plan]),
                 "--model-config", str(weights / "config.json"), "--weight-dir", str(weights), "--device", device,
                 "--cases", ",".join(cases), "--repeat", str(repeat), "--no-verify"], bench,
                err=folder / f"{bench.stem}.err")
            for row in bench_rows(bench):
                times.setdefault((plan, row["case_name"]), []).append(row["elapsed_ms"])
                floors[row["case_name"]] = row["floor_ms"]
    lines = [f"{name}: plans {', '.join(plans)}, {rounds} interleaved rounds of {repeat}"]
    for case in cases:
        for plan in plans:
            ms = times.get((plan, case), [])
            shown = " / ".join(f"{t:.1f} ({100 * floors[case] / t:.1f}%)" for t in ms) or "no timing"
            lines.append(f"  {case:13} {plan:18} ms (% of floor): {shown}")
        lines.append(f"  {case:13} {'transformers':18} {time_transformers(weights, case, device, repeat):.1f} ms")
    if judge:
        for plan in plans:
            verdict = folder / f"judge-{Path(plan).stem.replace(' ', '-')}.json"
            code = run([sys.executable, "-m", "evaluator.evaluate", "--engine", str(engines[plan]), "--model-config",
                        str(weights / "config.json"), "--weight-dir", str(weights), "--device", device,
                        "--stress", "quick", "--no-benchmark", "--out", str(verdict)],
                       folder / f"judge-{Path(plan).stem.replace(' ', '-')}.txt", tail=4)
            result = json.loads(verdict.read_text()) if verdict.is_file() else {}
            criterion, stress = result.get("criterion") or {}, result.get("stress") or {}
            lines.append(f"  judge {plan}: exit {code}, {result.get('status')} at {result.get('stage')}; "
                         f"criterion {json.dumps(criterion)[:300]}; stress {json.dumps(stress)[:160]}; "
                         f"{str(result.get('error') or '')[:200]}")
    return lines


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(SHAPES), help=f"comma-separated, of: {', '.join(SHAPES)}")
    p.add_argument("--budget", type=int, default=200, help="run.sh's budget per model, seconds")
    p.add_argument("--max-candidates", type=int, help="run.sh's --max-candidates")
    p.add_argument("--cases", help=f"comma-separated, of: {', '.join(CASE_SHAPES)} "
                                   f"(default {SCALE_CASES}; {TINY_CASES} with --tiny)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="tiny models on the CPU: the plumbing, not the targets")
    p.add_argument("--device", choices=("cuda", "cpu"), help="default: cpu with --tiny, else cuda")
    p.add_argument("--plans", help="comma-separated library plans (or engine files, .py) to time instead of run.sh")
    p.add_argument("--rounds", type=int, default=2, help="with --plans: interleaved rounds")
    p.add_argument("--judge", action="store_true", help="with --plans: judge each engine (public + quick stress)")
    p.add_argument("--out", default=out_dir("/tmp/gpu_hf"))
    a = p.parse_args(argv)
    cases = [c for c in (a.cases or (TINY_CASES if a.tiny else SCALE_CASES)).split(",") if c]
    models = [m for m in a.models.split(",") if m]
    unknown = [m for m in models if m not in SHAPES] + [c for c in cases if c not in CASE_SHAPES]
    if unknown:
        p.error(f"unknown model or case {unknown[0]!r}")
    device = a.device or ("cpu" if a.tiny else "cuda")
    out = Path(a.out)
    if device == "cuda":
        prelude(out)
    out.mkdir(parents=True, exist_ok=True)
    summary = []
    for name in models:
        folder, workspace = out / name, Path(f"/tmp/hf_ws_{name}_{os.getpid()}")   # a call's own, beside others
        weights = Path(f"/tmp/hf_weights_{name}{'_tiny' if a.tiny else ''}")
        folder.mkdir(parents=True, exist_ok=True)
        if not (weights / "config.json").is_file():
            # built aside, then renamed: a second call on another GPU of the machine finds it whole
            building = weights.with_name(f"{weights.name}.{os.getpid()}")
            build(building, name, a.tiny)
            try:
                building.rename(weights)
            except OSError:   # the other call's build got there first, or a stale folder is in the way
                shutil.rmtree(building, ignore_errors=True)
                if not (weights / "config.json").is_file():
                    p.error(f"{weights} is in the way (a folder without config.json): remove it")
        print(f"== {name}: {weights}", flush=True)
        if a.plans:
            summary += compare_plans(name, weights, folder, [x for x in a.plans.split(",") if x], cases, device,
                                     a.repeat, a.rounds, a.judge)
            (folder / "summary.txt").write_text("\n".join(summary) + "\n")
            continue
        shutil.rmtree(workspace, ignore_errors=True)   # an earlier call's, had it the same pid
        limit = ["--max-candidates", str(a.max_candidates)] if a.max_candidates else []
        code = run(["bash", "run.sh", "--weights", str(weights), "--device", device, "--budget", str(a.budget),
                    "--workspace", str(workspace), *limit], folder / "runsh.txt", tail=3)
        for log in ("results.log", "results.json", "engine.py"):
            if (workspace / log).is_file():
                shutil.copy(workspace / log, folder / log)
        summary.append(f"{name}: run.sh exit {code}; " + next(
            (line for line in (folder / "runsh.txt").read_text().splitlines() if line.startswith("result:")), ""))
        if not (workspace / "engine.py").is_file():
            continue
        summary.append("  " + load_memory(workspace / "engine.py", weights))
        bench = folder / "bench.json"
        run([sys.executable, "evaluator/benchmark_throughput.py", "--engine", str(workspace / "engine.py"),
             "--model-config", str(weights / "config.json"), "--weight-dir", str(weights), "--device", device,
             "--cases", ",".join(cases), "--repeat", str(a.repeat), "--no-verify"], bench, err=folder / "bench.err")
        ours = {r["case_name"]: r for r in bench_rows(bench)}
        for case in cases:
            theirs = time_transformers(weights, case, device, a.repeat)
            row = ours.get(case)
            if row is None:
                summary.append(f"  {case:13} engine: no timing (see {folder / 'bench.err'}); "
                               f"transformers {theirs:9.2f} ms")
                continue
            summary.append(f"  {case:13} engine {row['elapsed_ms']:9.2f} ms ({100 * row['floor_fraction']:5.1f}% of "
                           f"floor {row['floor_ms']:.2f} ms)  transformers {theirs:9.2f} ms "
                           f"({100 * row['floor_ms'] / theirs:5.1f}% of floor)  speed-up {theirs / row['elapsed_ms']:.2f}x")
        (folder / "summary.txt").write_text("\n".join(summary) + "\n")
    print("\n".join(summary))
    return 0
