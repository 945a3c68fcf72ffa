"""A fresh engine's first call: where its extra host time comes from (one device call).

    python3 scripts/gpu_first_call.py [--plan NAME] [--params JSON] [--repeat 5] [--out DIR]

Why: the benchmark times each fresh engine's first call (a prefill), and on an H100 that call
took 407 us of host time against 132 once warm (docs/benchmarks.md, sixth session): a quarter
of the prefill case, whose GPU sits idle until the graph is launched. This builds fresh engines
as the benchmark does (the harness's _release between them, tokens drawn on the device before
the clock) and times the first prefill of the prefill case (4x128) and of the mixed case (4x64)
under each variant:
  plain     as the benchmark calls it;
  collect   gc.collect() between create_engine and the call;
  nogc      the Python GC disabled during the call;
  spin      20 ms of Python busy work right before the call (a CPU that idled while the GPU
            captured graphs);
  second    the same call once more on that engine, after removing the first (warm).
It also lists the Python GC collections that ran inside the call (gc.callbacks: generation, us).
Prints host us (until the call returns) and wall us (until its kernels end), median per variant.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from evaluator.benchmark_throughput import _release
from evaluator.common import load_config, load_engine_module
from scripts.gpu_step_timeline import engine_path

VARIANTS = ("plain", "collect", "nogc", "spin", "second")
SPIN_S = 0.02
SHAPES = {"4x128": (4, 128), "4x64": (4, 64)}


class GcWatch:
    """The collections that run between start() and stop(): (generation, duration us)."""

    def __init__(self):
        self.seen, self._began = [], 0.0

    def __call__(self, phase, info):
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.seen.append((info["generation"], round((time.perf_counter() - self._began) * 1e6, 1)))

    def start(self):
        self.seen = []
        gc.callbacks.append(self)

    def stop(self):
        gc.callbacks.remove(self)


def timed(engine, ids, prompts, watch) -> tuple[float, float, list]:
    torch.cuda.synchronize()
    watch.start()
    start = time.perf_counter()
    engine.prefill(ids, prompts)
    host = time.perf_counter() - start
    watch.stop()
    torch.cuda.synchronize()
    return host * 1e6, (time.perf_counter() - start) * 1e6, watch.seen


def one(module, config, weight_dir, shape, variant, watch) -> dict:
    batch, length = SHAPES[shape]
    engine = module.create_engine(config, weight_dir, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    prompts = [torch.randint(0, config["vocab_size"], (length,), generator=gen, device="cuda") for _ in range(batch)]
    ids = list(range(batch))
    counts = gc.get_count()
    if variant == "collect":
        gc.collect()
    elif variant == "spin":
        end = time.perf_counter() + SPIN_S
        while time.perf_counter() < end:
            pass
    elif variant == "second":
        timed(engine, ids, prompts, watch)
        engine.remove(ids)
    if variant == "nogc":
        gc.disable()
    try:
        host, wall, collections = timed(engine, ids, prompts, watch)
    finally:
        gc.enable()
    del engine, prompts
    _release("cuda")
    return {"host": host, "wall": wall, "gc": collections, "gc_count_before": counts}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine")
    p.add_argument("--plan", default="lib split linear")
    p.add_argument("--params", default="{}")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", default="first-call-out")
    a = p.parse_args()
    module = load_engine_module(engine_path(a.engine, a.plan, a.params))
    config = load_config("target/model_config.json")
    weight_dir = "target/weights"
    watch = GcWatch()
    one(module, config, weight_dir, "4x128", "plain", watch)   # the harness's warm-up engine
    runs = {(s, v): [] for s in SHAPES for v in VARIANTS}
    for _ in range(a.repeat):
        for shape in SHAPES:
            for variant in VARIANTS:
                runs[shape, variant].append(one(module, config, weight_dir, shape, variant, watch))
    print(f"{'shape':6} {'variant':8} {'host us':>9} {'wall us':>9}  GC collections inside the call")
    for (shape, variant), rs in runs.items():
        host = statistics.median(r["host"] for r in rs)
        wall = statistics.median(r["wall"] for r in rs)
        print(f"{shape:6} {variant:8} {host:9.1f} {wall:9.1f}  {[r['gc'] for r in rs]}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "first_call.json").write_text(json.dumps({f"{s} {v}": rs for (s, v), rs in runs.items()}, indent=1))


if __name__ == "__main__":
    main()
