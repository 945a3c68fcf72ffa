"""CPU decode of a Hugging Face checkpoint: the engine run.sh writes beside transformers, against this machine's floor.

    python3 scripts/cpu_hf_bench.py [--model qwen2.5-0.5b] [--rounds 5] [--engine PATH ...] [--profile]
        [--threads N] [--weights DIR] [--out DIR]

Issue 21's CPU target: a Qwen2.5-0.5B-shaped model (built here by transformers, random weights,
saved in fp32; nothing is downloaded), 8 prompts of 128 tokens, then 16 cached decode steps at
batch 8, on the engine and on transformers' own model (sdpa, last-token logits), the same work.
The engine is the one run.sh writes on a CPU for the folder: the paged skeleton, rendered for the
model's conventions, whose slots run their torch variants on CPU. --engine times engine files
given instead (several: each is a contestant, e.g. before and after a change).

The machine is shared, so contestants alternate inside each round, forwards then backwards
(A B B A), and a contestant's figure is the median over rounds of its mean decode step; the
load average is printed before and after. --threads sets torch's intra-op threads for every
contestant alike (on this shared 2-core machine one thread is the faster setting: see
docs/benchmarks.md, fifteenth session). The floor of a step is max(bytes / bandwidth,
FLOPs / GEMM peak) (evaluator/floor.py), both measured here at the start. The engine's first
round is checked against transformers' logits (fp32, the CPU criterion's 1e-2). --profile
prints where one engine decode step spends its CPU time (torch.profiler, by op).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from agent.plan import Plan, engine_params  # noqa: E402
from agent.render import render_engine  # noqa: E402
from agent.spec import load_spec  # noqa: E402
from evaluator.common import ModelDims, load_config, load_engine_module  # noqa: E402
from evaluator.floor import Hardware, call_costs, measure_hardware  # noqa: E402
from evaluator.traces import Op  # noqa: E402
from scripts.gpu.hf_models import SHAPES  # noqa: E402

BATCH, PROMPT, STEPS = 8, 128, 16      # issue 21's CPU work
SEED = 0
TOLERANCE = 1e-2                       # the CPU criterion (fp32 against transformers' fp32)
PROFILE_STEPS = 4


@dataclass(frozen=True)
class Work:
    prompts: torch.Tensor   # [BATCH, PROMPT]
    steps: torch.Tensor     # [STEPS, BATCH]


@dataclass(frozen=True)
class Run:
    prefill_ms: float
    step_ms: float               # mean decode step
    logits: torch.Tensor         # the last step's [BATCH, vocab]


def build(folder: Path, name: str) -> None:
    """The model `name` with random weights (transformers' init), saved in fp32."""
    import transformers
    architecture, keys = SHAPES[name]
    config = getattr(transformers, architecture.removesuffix("ForCausalLM") + "Config")(**keys)
    torch.manual_seed(SEED)
    getattr(transformers, architecture)(config).to(torch.float32).save_pretrained(folder)


def render(folder: Path, out: Path) -> Path:
    """The engine run.sh writes on CPU for `folder`: the paged skeleton at its defaults (every slot
    runs its torch variant on CPU, whatever the plan names)."""
    spec = load_spec(folder / "config.json", folder)
    defaults = {name: p.default for name, p in engine_params("paged").items()}
    path = out / "engine.py"
    path.write_text(render_engine(Plan("paged", {}, defaults), None, spec.conventions))
    return path


class EngineContestant:
    def __init__(self, path: Path, folder: Path, config: dict):
        self.name = f"engine {path}"
        self.engine = load_engine_module(path).create_engine(config, str(folder), "cpu")

    def run(self, work: Work, profile: bool = False) -> Run:
        rids = list(range(BATCH))
        t0 = time.perf_counter()
        self.engine.prefill(rids, list(work.prompts))
        prefill_ms = 1e3 * (time.perf_counter() - t0)
        if profile:
            return profile_steps(lambda step: self.engine.decode(rids, step), work)
        t0 = time.perf_counter()
        for step in work.steps:
            logits = self.engine.decode(rids, step)
        step_ms = 1e3 * (time.perf_counter() - t0) / STEPS
        self.engine.remove(rids)
        return Run(prefill_ms, step_ms, logits)


class TransformersContestant:
    name = "transformers (sdpa)"

    def __init__(self, folder: Path):
        import transformers
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, attn_implementation="sdpa").eval()

    @torch.no_grad()
    def run(self, work: Work) -> Run:
        t0 = time.perf_counter()
        out = self.model(work.prompts, use_cache=True, logits_to_keep=1)
        prefill_ms = 1e3 * (time.perf_counter() - t0)
        t0 = time.perf_counter()
        for step in work.steps:
            out = self.model(step[:, None], past_key_values=out.past_key_values, use_cache=True, logits_to_keep=1)
        step_ms = 1e3 * (time.perf_counter() - t0) / STEPS
        return Run(prefill_ms, step_ms, out.logits[:, -1])


def profile_steps(decode, work: Work) -> Run:
    """PROFILE_STEPS decode steps under torch.profiler; its table by op, self CPU time."""
    from torch.profiler import ProfilerActivity, profile
    decode(work.steps[0])   # outside the profile: the first step after a prefill
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for step in work.steps[1:1 + PROFILE_STEPS]:
            decode(step)
    print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=25))
    return Run(0.0, 0.0, torch.empty(0))


def machine_floor() -> Hardware:
    """The best copy bandwidth and fp32 GEMM rate measured at each thread count up to torch's:
    on a loaded machine two threads can measure below one (each waits for the other's core)."""
    threads = torch.get_num_threads()
    runs = []
    for n in range(1, threads + 1):
        torch.set_num_threads(n)
        runs.append(measure_hardware("cpu", torch.float32))
    torch.set_num_threads(threads)
    return Hardware("cpu", max(bw for bw, _ in runs), max(peak for _, peak in runs), "measured")


def step_floor_ms(config: dict, hw: Hardware) -> float:
    """The mean floor of the work's decode steps (contexts PROMPT+1 .. PROMPT+STEPS)."""
    rids = tuple(range(BATCH))
    trace = [Op("prefill", rids, (PROMPT,) * BATCH)] + [Op("decode", rids)] * STEPS
    costs = call_costs(ModelDims.from_config(config), 4, trace)[1:]
    return 1e3 * statistics.mean(c.seconds(hw) for c in costs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--engine", action="append", type=Path, help="an engine file to time (default: render one)")
    p.add_argument("--weights", type=Path, help="the model folder (default: /tmp/cpu_hf_<model>, built once)")
    p.add_argument("--profile", action="store_true", help="profile the (first) engine's decode steps, then stop")
    p.add_argument("--threads", type=int, help="torch.set_num_threads for every contestant (default: torch's)")
    p.add_argument("--out", type=Path, default=Path("/tmp/cpu_hf_bench"))
    a = p.parse_args(argv)
    if a.rounds < 1:
        p.error("--rounds must be at least 1")
    if a.threads is not None and a.threads < 1:
        p.error("--threads must be at least 1")
    missing = [e for e in a.engine or [] if not e.is_file()]
    if missing:
        p.error(f"no engine file {missing[0]}")
    folder = a.weights or Path(f"/tmp/cpu_hf_{a.model}")
    if not (folder / "config.json").is_file():
        print(f"building {a.model} in {folder} (fp32, random weights) ...", flush=True)
        build(folder, a.model)
    a.out.mkdir(parents=True, exist_ok=True)
    config = load_config(folder / "config.json")
    print(f"model {a.model} ({folder}); torch {torch.__version__}; load average {os.getloadavg()[0]:.2f}", flush=True)
    gen = torch.Generator().manual_seed(SEED)
    vocab = int(config["vocab_size"])
    work = Work(torch.randint(0, vocab, (BATCH, PROMPT), generator=gen),
                torch.randint(0, vocab, (STEPS, BATCH), generator=gen))
    engines = [EngineContestant(path, folder, config) for path in (a.engine or [render(folder, a.out)])]
    if a.profile:
        torch.set_num_threads(a.threads or torch.get_num_threads())
        engines[0].run(work, profile=True)
        return 0
    hw = machine_floor()
    floor = step_floor_ms(config, hw)
    print(f"floor: {hw.bandwidth_gbs:.1f} GB/s copy, {1e3 * hw.peak_tflops:.1f} GFLOP/s fp32 GEMM (best over "
          f"1..{torch.get_num_threads()} threads); a decode step >= {floor:.1f} ms", flush=True)
    if a.threads is not None:
        torch.set_num_threads(a.threads)
        print(f"contestants run with {a.threads} thread(s)", flush=True)
    contestants = [TransformersContestant(folder), *engines]
    times: dict[str, list[Run]] = {c.name: [] for c in contestants}
    for r in range(a.rounds):
        for c in contestants + contestants[::-1]:   # A B B A: drifting load falls on both alike
            times[c.name].append(c.run(work))
        if r == 0:
            expected = times[contestants[0].name][0].logits
            for e in engines:
                diff = (times[e.name][0].logits - expected).abs().max().item()
                verdict = "ok" if torch.allclose(times[e.name][0].logits, expected, atol=TOLERANCE, rtol=TOLERANCE) else "FAILS"
                print(f"  {e.name}: last step's logits vs transformers: max |diff| {diff:.2e} ({verdict} at {TOLERANCE})")
        print(f"  round {r + 1}/{a.rounds}: " + ", ".join(
            f"{name.split()[0]} {statistics.mean(x.step_ms for x in runs[-2:]):.1f}" for name, runs in times.items()),
            flush=True)
    base = statistics.median(x.step_ms for x in times[contestants[0].name])
    print(f"\ndecode step at batch {BATCH} (median of {a.rounds} rounds x 2 runs of {STEPS} steps; "
          f"load average {os.getloadavg()[0]:.2f}):")
    for name, runs in times.items():
        step = statistics.median(x.step_ms for x in runs)
        pre = statistics.median(x.prefill_ms for x in runs)
        print(f"  {name:40} {step:7.1f} ms/step ({100 * floor / step:5.1f}% of floor {floor:.1f} ms), "
              f"{base / step:4.2f}x transformers; prefill {pre:7.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
