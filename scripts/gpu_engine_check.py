"""Check and time rendered paged engines on a GPU in one go (one device call).

    python3 scripts/gpu_engine_check.py [--plans auto|JSON] [--cases prefill,decode,...]
        [--warmup 1] [--repeat 3] [--out DIR]

For every plan: render templates/engine/paged.py.j2, check it against the SPEC §3 reference
(public sequence + the quick stress scenarios of evaluator/traces.py) on the public config
(fp16, toy weights) and on a bf16 GQA config (larger weights, non-unit norms), then time the
SPEC §5 cases on the public config with the SPEC method: a warm-up engine runs the trace, then
each repeat builds a fresh engine, synchronize, perf_counter, the whole trace, synchronize;
median by elapsed time; peak = torch.cuda.max_memory_allocated, reset before each timed run.
Prints a table; writes results.json under --out.

`--plans auto`: the all-torch plan; the torch plan with a graph-safe torch decode (gathers the
whole block table, so the CUDA-graph path runs before any Triton variant exists); every CUDA
variant on disk alone; all CUDA variants together with graphs on and off.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from agent.plan import SLOTS, Plan, menu  # noqa: E402
from agent.render import render_engine  # noqa: E402
from evaluator.common import Tolerance, load_config, make_generator  # noqa: E402
from evaluator.reference_model import ReferenceModel  # noqa: E402
from evaluator.session import CheckedSession, draw_op_tokens  # noqa: E402
from evaluator.traces import BENCHMARK_CASES, QUICK, STRESS_SCENARIOS, public_sequence, token_counts  # noqa: E402
from evaluator.weights import random_weights  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PUBLIC_CASES = "prefill,decode,mixed,decode128,mixed128"

# A graph-safe stand-in for decode_attention: the torch math over the block table's full width
# (ignores max_context), so the engine's CUDA-graph path can be exercised with torch slots only.
TORCH_FULL_DECODE = '''# slot: decode_attention    variant: torch_full    devices: cuda
def decode_attention__torch_full(q, k_cache, v_cache, block_table, context_lens, max_context, block_size, scale):
    return decode_attention__torch(q, k_cache, v_cache, block_table, context_lens,
                                   block_table.shape[1] * block_size, block_size, scale)
'''
EXTRA = {("decode_attention", "torch_full"): TORCH_FULL_DECODE}


def write_weights(weights, weight_dir: Path):
    weight_dir.mkdir(parents=True, exist_ok=True)
    torch.save(weights, weight_dir / "model.pt")


def auto_plans() -> dict[str, Plan]:
    torch_slots = {s: "torch" for s in SLOTS}
    plans = {"torch": Plan("paged", torch_slots),
             "torch+graphs": Plan("paged", {**torch_slots, "decode_attention": "torch_full"},
                                  {"max_graph_batch": 8})}
    combined = dict(torch_slots)
    for slot, variants in menu().items():
        for v in variants:
            if v.name != "torch" and "cuda" in v.devices:
                plans[f"{slot}={v.name}"] = Plan("paged", {**torch_slots, slot: v.name})
                combined[slot] = combined[slot] if combined[slot] != "torch" else v.name
    if combined != torch_slots:
        plans["all-cuda"] = Plan("paged", combined)
        plans["all-cuda eager"] = Plan("paged", combined, {"decode_graphs": False})
    return plans


def load(plan: Plan, tag: str):
    """Render to a file (Triton needs source files to compile) and import it."""
    import importlib.util
    path = Path(tempfile.mkdtemp()) / f"engine_{abs(hash(tag))}.py"
    path.write_text(render_engine(plan, EXTRA))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def check(module, cfg: dict, weights: dict, weight_dir: str, device: str) -> dict:
    engine = module.create_engine(cfg, weight_dir, device)
    reference = ReferenceModel(cfg, weights, device)
    session = CheckedSession(engine, reference, make_generator(7, device), Tolerance())
    session.run(public_sequence())
    rng = random.Random(0)
    for name, scenario in STRESS_SCENARIOS.items():
        session.label = f"{name}: "
        session.run(scenario(rng, QUICK))
    s = session.stats
    return {"calls": s.calls, "max_abs_err": s.max_abs_err, "worst_margin": s.worst_margin}


def run_trace(engine, trace, tokens):
    for op, drawn in zip(trace, tokens):
        ids = list(op.request_ids)
        if op.kind == "prefill":
            engine.prefill(ids, drawn)
        elif op.kind == "decode":
            engine.decode(ids, drawn[0])
        else:
            engine.remove(ids)


@torch.no_grad()
def bench(module, cfg: dict, weight_dir: str, case: str, warmup: int, repeat: int) -> dict:
    trace = BENCHMARK_CASES[case]()
    gen = make_generator(0, "cuda")
    tokens = [draw_op_tokens(op, gen, cfg["vocab_size"], "cuda") for op in trace]
    engine = module.create_engine(cfg, weight_dir, "cuda")
    for _ in range(warmup):
        run_trace(engine, trace, tokens)
    del engine
    runs = []
    for _ in range(repeat):
        engine = module.create_engine(cfg, weight_dir, "cuda")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run_trace(engine, trace, tokens)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        runs.append((elapsed, torch.cuda.max_memory_allocated() / 2**20))
        del engine
    elapsed, peak = sorted(runs)[len(runs) // 2]
    pre, dec = token_counts(trace)
    return {"case_name": case, "elapsed_ms": elapsed * 1e3, "prefill_tokens": pre, "decode_tokens": dec,
            "total_tokens": pre + dec, "tokens_per_second": (pre + dec) / elapsed,
            "decode_tokens_per_second": dec / elapsed, "peak_memory_mb": peak,
            "spread_ms": [round(r[0] * 1e3, 3) for r in runs]}


@torch.no_grad()
def prefill_launch_profile(module, cfg: dict, weight_dir: str) -> dict:
    """Is eager prefill launch-bound? Host time to enqueue one 4x128 prefill vs its total time."""
    engine = module.create_engine(cfg, weight_dir, "cuda")
    gen = make_generator(0, "cuda")
    prompts = [torch.randint(0, cfg["vocab_size"], (128,), generator=gen, device="cuda") for _ in range(4)]
    out = {}
    for i in range(4):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.prefill([0, 1, 2, 3], prompts)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        out = {"enqueue_ms": (t1 - t0) * 1e3, "total_ms": (t2 - t0) * 1e3}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plans", default="auto", help="'auto' or JSON {name: plan dict}")
    ap.add_argument("--only", default="", help="comma-separated plan names to keep (auto plans)")
    ap.add_argument("--cases", default=PUBLIC_CASES)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-bench", default="torch,torch+graphs", help="plans that are checked but not timed")
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the checks (no timing)")
    a = ap.parse_args(argv)

    plans = auto_plans() if a.plans == "auto" else {k: Plan.from_dict(v) for k, v in json.loads(a.plans).items()}
    if a.only:
        plans = {k: v for k, v in plans.items() if k in a.only.split(",")}
    public = load_config(ROOT / "target/model_config.json")
    gqa = {**public, "torch_dtype": "bfloat16", "num_attention_heads": 8, "num_key_value_heads": 2,
           "head_dim": 80, "num_hidden_layers": 4}
    tmp = Path(tempfile.mkdtemp())
    setups = {}
    for name, cfg, kw in (("public-fp16", public, {}), ("gqa-bf16", gqa, {"scale": 0.05, "norm_spread": 0.5})):
        weights = random_weights(cfg, seed=0, **kw)
        write_weights(weights, tmp / name)
        setups[name] = (cfg, weights, str(tmp / name))

    if a.device == "cuda":
        print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    results = {}
    for pname, plan in plans.items():
        res = results[pname] = {"plan": plan.to_dict()}
        try:
            module = load(plan, pname)
            for sname, (cfg, weights, wdir) in setups.items():
                res[sname] = check(module, cfg, weights, wdir, a.device)
                print(f"[{pname}] {sname}: {res[sname]}", flush=True)
            if a.device == "cuda" and pname not in a.no_bench.split(","):
                cfg, _, wdir = setups["public-fp16"]
                res["prefill_profile"] = prefill_launch_profile(module, cfg, wdir)
                res["bench"] = [bench(module, cfg, wdir, c, a.warmup, a.repeat) for c in a.cases.split(",")]
                for b in res["bench"]:
                    print(f"[{pname}] {b}", flush=True)
        except Exception as e:  # noqa: BLE001 - report and go on to the next plan
            res["error"] = f"{type(e).__name__}: {e}"
            print(f"[{pname}] ERROR {res['error']}", flush=True)

    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "results.json").write_text(json.dumps(results, indent=1))
    cases = a.cases.split(",")
    print("\nplan                          check(max err, margin)      " + "  ".join(f"{c:>12}" for c in cases))
    for pname, res in results.items():
        chk = " ".join(f"{res[s]['max_abs_err']:.1e}/{res[s]['worst_margin']:.2f}" for s in setups if s in res)
        row = "  ".join(f"{b['tokens_per_second'] / 1e3:9.1f}k/s" for b in res.get("bench", []))
        print(f"{pname:29} {chk:27} {row} {res.get('error', '')}")
    for pname, res in results.items():
        if "bench" in res:
            print(f"{pname:29} peak MiB " + " ".join(f"{b['peak_memory_mb']:.0f}" for b in res["bench"])
                  + f"   prefill 4x128 enqueue/total ms {res['prefill_profile']['enqueue_ms']:.2f}"
                  f"/{res['prefill_profile']['total_ms']:.2f}")
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
