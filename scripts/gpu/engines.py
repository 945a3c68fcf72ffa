"""Check and time rendered paged engines on a GPU in one go (one device call).

    python3 -m scripts.gpu engines [--plans auto|library|JSON] [--only NAMES] [--cases prefill,decode,...]
        [--warmup 1] [--repeat 3] [--out DIR]

For every plan: render templates/engine/paged.py.j2, check it against the SPEC §3 reference
(public sequence + the quick stress scenarios of evaluator/traces.py) on the public config
(fp16, toy weights) and on a bf16 GQA config (toy scale, non-unit norms), then run
evaluator.evaluate on it (public sequence, stress suite, SPEC §5 benchmark with floor fractions;
timed even when stress fails, marked unverified), profile a prefill and decode steps (host
enqueue vs total, top kernels), and measure bf16 noise (engine and bf16 reference vs fp32). Prints a table; writes results.json under --out.

`--plans library`: the named plans of scripts.gpu.common.library_plans. `--plans auto`: the all-torch plan; the torch plan with a graph-safe torch decode (gathers the
whole block table, so the CUDA-graph path runs before any Triton variant exists); every CUDA
variant on disk alone; one CUDA variant of every slot together (Triton ones first) with graphs
on and off.
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from agent.plan import Plan, menu
from evaluator.benchmark_throughput import run_benchmark
from evaluator.common import Tolerance, load_config, load_engine_module, make_generator
from evaluator.evaluate import evaluate
from evaluator.reference_model import ReferenceModel
from evaluator.session import CheckedSession
from evaluator.slots import SLOTS
from evaluator.traces import QUICK, STRESS_SCENARIOS, public_sequence
from evaluator.weights import random_weights, save_weights
from scripts.gpu.common import PUBLIC_CASES, PUBLIC_CONFIG, ROOT, library_plans, out_dir, render_to_file

# A graph-safe stand-in for decode_attention: the torch math over the block table's full width
# (ignores max_context), so the engine's CUDA-graph path can be exercised with torch slots only.
TORCH_FULL_DECODE = '''# slot: decode_attention    variant: torch_full    devices: cuda
def decode_attention__torch_full(q, k_cache, v_cache, block_table, context_lens, max_context, block_size, scale):
    return decode_attention__torch(q, k_cache, v_cache, block_table, context_lens,
                                   block_table.shape[1] * block_size, block_size, scale)
'''
EXTRA = {("decode_attention", "torch_full"): TORCH_FULL_DECODE}


def auto_plans() -> dict[str, Plan]:
    torch_slots = {s: "torch" for s in SLOTS}
    plans = {"torch": Plan("paged", torch_slots),
             "torch+graphs": Plan("paged", {**torch_slots, "decode_attention": "torch_full"},
                                  {"max_graph_batch": 8})}
    combined = dict(torch_slots)
    for slot, variants in menu().items():
        cuda = [v.name for v in variants if v.name != "torch" and "cuda" in v.devices]
        for name in cuda:
            plans[f"{slot}={name}"] = Plan("paged", {**torch_slots, slot: name})
        triton_first = sorted(cuda, key=lambda n: (not n.startswith("triton"), n))
        if triton_first:
            combined[slot] = triton_first[0]
    if combined != torch_slots:
        plans["all-cuda"] = Plan("paged", combined)
        plans["all-cuda eager"] = Plan("paged", combined, {"decode_graphs": False})
        plans["all-cuda bs32"] = Plan("paged", combined, {"block_size": 32})
    return plans


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


def _kernel_table(prof, rows=14) -> str:
    for key in ("self_device_time_total", "self_cuda_time_total"):
        try:
            return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60)
        except Exception:  # noqa: BLE001 - the sort key's name changed across torch versions
            continue
    return ""


@torch.no_grad()
def step_profile(module, cfg: dict, weight_dir: str, device: str = "cuda") -> dict:
    """Where a step's time goes: host enqueue vs total for a 4x128 prefill and for decode steps
    of 8 requests (context ~40), the raw replay time of the batch-8 decode graph, and the top
    kernels of each (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile
    engine = module.create_engine(cfg, weight_dir, device)
    gen = make_generator(0, device)
    draw = lambda n: torch.randint(0, cfg["vocab_size"], (n,), generator=gen, device=device)  # noqa: E731
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    out = {}

    def timed(fn, reps):
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        return {"enqueue_ms": (t1 - t0) * 1e3 / reps, "total_ms": (t2 - t0) * 1e3 / reps}

    prompts = [draw(128) for _ in range(4)]
    timed(lambda: engine.prefill([100, 101, 102, 103], prompts), 2)
    out["prefill_4x128"] = timed(lambda: engine.prefill([100, 101, 102, 103], prompts), 3)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.prefill([100, 101, 102, 103], prompts)
        sync()
    out["prefill_kernels"] = _kernel_table(prof)
    engine.remove([100, 101, 102, 103])

    ids = list(range(8))
    engine.prefill(ids, [draw(32) for _ in ids])
    steps = [draw(8) for _ in range(8)]
    it = iter(steps)
    out["decode_b8"] = timed(lambda: engine.decode(ids, next(it)), 8)
    graph = engine.decode_graphs.get(engine._decode_graph_key(8, 40)) if hasattr(engine, "decode_graphs") else None
    if graph is not None:
        out["decode_b8_replay"] = timed(graph.graph.replay, 20)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(4):
            engine.decode(ids, draw(8))
        sync()
    out["decode_kernels"] = _kernel_table(prof)
    return out


@torch.no_grad()
def bf16_noise(module, cfg: dict, weights: dict, weight_dir: str, device: str = "cuda") -> dict:
    """Is a bf16 mismatch the engine's or bf16's own? For a 1034-token and an 11-token prompt:
    max |engine - bf16 reference|, |bf16 reference - fp32 reference| and |engine - fp32 reference|."""
    engine = module.create_engine(cfg, weight_dir, device)
    ref16 = ReferenceModel(cfg, weights, device)
    ref32 = ReferenceModel(cfg, weights, "cpu")
    gen = make_generator(3, device)
    prompts = [torch.randint(0, cfg["vocab_size"], (n,), generator=gen, device=device) for n in (1034, 11)]
    got = engine.prefill([0, 1], prompts).float().cpu()
    r16 = torch.stack([ref16.last_logits(p) for p in prompts]).float().cpu()
    r32 = torch.stack([ref32.last_logits(p.cpu()) for p in prompts]).float()
    return {"engine_vs_bf16_ref": (got - r16).abs().amax(-1).tolist(),
            "bf16_ref_vs_fp32_ref": (r16 - r32).abs().amax(-1).tolist(),
            "engine_vs_fp32_ref": (got - r32).abs().amax(-1).tolist(),
            "logit_absmax": r32.abs().amax(-1).tolist()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plans", default="auto", help="'auto', 'library' or JSON {name: plan dict}")
    ap.add_argument("--only", default="", help="comma-separated plan names to keep (auto plans)")
    ap.add_argument("--cases", default=PUBLIC_CASES)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--stress", default="quick", choices=("off", "quick", "full"))
    ap.add_argument("--noise", default="torch,all-cuda", help="plans whose bf16 noise is measured")
    ap.add_argument("--check-on", default="public-fp16,gqa-bf16", help="configs the non-timed plans are checked on")
    ap.add_argument("--bench", default="all-cuda,all-cuda bs32", help="plans that are also evaluated and timed")
    ap.add_argument("--out", default=out_dir(""), help="where results.json goes ($OUT when set)")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the checks (no timing)")
    a = ap.parse_args(argv)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)

    named = {"auto": auto_plans, "library": library_plans}
    plans = named[a.plans]() if a.plans in named else {k: Plan.from_dict(v) for k, v in json.loads(a.plans).items()}
    if a.only:
        plans = {k: v for k, v in plans.items() if k in a.only.split(",")}
    public = load_config(ROOT / PUBLIC_CONFIG)
    gqa = {**public, "torch_dtype": "bfloat16", "num_attention_heads": 8, "num_key_value_heads": 2,
           "head_dim": 80, "num_hidden_layers": 4}
    tmp = Path(tempfile.mkdtemp())
    setups = {}
    for name, cfg, kw in (("public-fp16", public, {}), ("gqa-bf16", gqa, {"norm_spread": 0.5})):
        weights = random_weights(cfg, seed=0, **kw)
        save_weights(weights, tmp / name / "model.pt")
        setups[name] = (cfg, weights, str(tmp / name))

    if a.device == "cuda":
        print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    public_dir = setups["public-fp16"][2]
    bench = a.bench.split(",")
    results = {}
    for pname, plan in plans.items():
        res = results[pname] = {"plan": plan.to_dict()}
        try:
            path = render_to_file(plan, pname, EXTRA)
            module = load_engine_module(path)
            for sname, (cfg, weights, wdir) in setups.items():
                if sname not in a.check_on.split(",") and pname not in bench:
                    continue
                try:
                    res[sname] = check(module, cfg, weights, wdir, a.device)
                except Exception as e:  # noqa: BLE001 - a wrong result on one config; time it anyway
                    res[sname] = {"max_abs_err": float("nan"), "worst_margin": float("nan"),
                                  "error": f"{type(e).__name__}: {e}"}
                print(f"[{pname}] {sname}: {res[sname]}", flush=True)
            if a.device == "cuda" and pname in bench:
                verdict = evaluate(path, setups["public-fp16"][0], public_dir, "cuda", stress=a.stress,
                                   cases=a.cases.split(","), warmup=a.warmup, repeat=a.repeat)
                res["evaluate"] = {k: verdict[k] for k in ("status", "stage", "error", "stress", "score")}
                print(f"[{pname}] evaluate: {res['evaluate']}", flush=True)
                if verdict["benchmark"] is None:    # failed before timing: time it anyway, unverified
                    verdict["benchmark"] = run_benchmark(path, setups["public-fp16"][0], public_dir, "cuda",
                                                         a.cases.split(","), a.warmup, a.repeat,
                                                         verify_outputs=False)
                res["bench"] = verdict["benchmark"]
                for b in res["bench"]:
                    print(f"[{pname}] {b}", flush=True)
                res["profile"] = step_profile(module, setups["public-fp16"][0], public_dir)
                if a.out:
                    (Path(a.out) / f"kernels_{pname.replace(' ', '_').replace('=', '-')}.txt").write_text(
                        res["profile"].pop("prefill_kernels") + "\n\n" + res["profile"].pop("decode_kernels"))
            if a.device == "cuda" and pname in a.noise.split(","):
                cfg, weights, wdir = setups["gqa-bf16"]
                res["bf16_noise"] = bf16_noise(module, cfg, weights, wdir)
                print(f"[{pname}] bf16 noise: {res['bf16_noise']}", flush=True)
        except Exception as e:  # noqa: BLE001 - report and go on to the next plan
            res["error"] = f"{type(e).__name__}: {e}"
            print(f"[{pname}] ERROR {res['error']}", flush=True)
        if a.out:   # after every plan, so a run cut short still leaves what it measured
            (Path(a.out) / "results.json").write_text(json.dumps(results, indent=1))

    cases = a.cases.split(",")
    print("\nplan                          check(max err, margin)      " + "  ".join(f"{c:>12}" for c in cases))
    for pname, res in results.items():
        chk = " ".join(f"{res[s]['max_abs_err']:.1e}/{res[s]['worst_margin']:.2f}" for s in setups if s in res)
        row = "  ".join(f"{b['tokens_per_second'] / 1e3:7.1f}k/s {100 * b['floor_fraction']:4.1f}%"
                        for b in res.get("bench", []))
        verdict = res.get("evaluate", {})
        print(f"{pname:29} {chk:27} {row} {verdict.get('status', '')} {verdict.get('score') or ''} "
              f"{verdict.get('error') or ''} {res.get('error', '')}")
    for pname, res in results.items():
        if "bench" in res:
            prof = res.get("profile", {})
            print(f"{pname:29} peak MiB " + " ".join(f"{b['peak_memory_mb']:.0f}" for b in res["bench"])
                  + "   " + "  ".join(f"{k} {v['enqueue_ms']:.3f}/{v['total_ms']:.3f} ms"
                                      for k, v in prof.items() if isinstance(v, dict)))
        if "bf16_noise" in res:
            print(f"{pname:29} bf16 noise " + " ".join(f"{k}={[round(x, 4) for x in v]}"
                                                     for k, v in res["bf16_noise"].items()))
    return 0 if all("error" not in r for r in results.values()) else 1


