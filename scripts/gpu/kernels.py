"""Every CUDA variant of every slot: the GPU kernel tests, timings at two shapes, a tiling sweep.

One device call: the GPU tests, then each variant of each slot timed at the shapes of the public
config and of a 1B GQA config, then a sweep of the attention and linear kernels' tiling params.
Prints a short table last; full logs go to --out ($OUT when set).

    python3 -m scripts.gpu kernels [--no-tests] [--no-bench] [--no-sweep] [--test-timeout 360]
        [-k EXPR] [--slots linear,...] [--configs public,1B] [--variants triton_split,...] [--out DIR]

Times are medians over CUDA-graph replays (triton.testing.do_bench_cudagraph: what the kernel
costs inside the engine's captured decode step) and, for reference, eager medians
(triton.testing.do_bench: what a Python call costs, launch overhead included).
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import torch

from agent.plan import menu
from evaluator import slot_cases, slot_check, slot_refs
from scripts.gpu.common import ROOT, out_dir

# The shapes to time: the public config and a 1B-class GQA config (Llama-3.2-1B-like).
CONFIGS = {
    "public": {"H": 768, "Hq": 4, "Hkv": 4, "D": 192, "I": 3072,
               "decode": [(8, 48), (8, 144)], "prefill": [[128] * 4]},
    "1B": {"H": 2048, "Hq": 32, "Hkv": 8, "D": 64, "I": 8192,
           "decode": [(64, 544)], "prefill": [[2048] * 8, [512] * 64]},   # issue 21's two scale cases
}
BLOCK_SIZE = 16


def env_line() -> str:
    import triton
    p = torch.cuda.get_device_properties(0)
    return (f"{p.name}, {p.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}, "
            f"CUDA {torch.version.cuda}")


def run_tests(out: Path, timeout: int, select: str = "") -> str:
    """pytest on the kernel tests; returns the summary lines (full log in out/pytest.log)."""
    log = out / "pytest.log"
    cmd = [sys.executable, "-m", "pytest", "-q", "-rf", "--tb=line", "-p", "no:cacheprovider",
           "tests/test_kernels_gpu.py", "tests/test_slot_check.py"] + (["-k", select] if select else [])
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        text = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        text += f"\nTIMEOUT after {timeout}s"
    log.write_text(text)
    keep = [ln[:400] for ln in text.splitlines() if ln.startswith(("FAILED", "ERROR")) or " passed" in ln
            or " failed" in ln or "TIMEOUT" in ln or "no module named" in ln.lower()]
    return f"pytest ({time.time() - t0:.0f}s):\n" + "\n".join(keep[-40:])



def bench(call) -> tuple[float, float]:
    """(graph-replay median µs, eager median µs); NaN where a mode fails."""
    import triton.testing as tt
    graph_us = eager_us = math.nan
    try:
        call()
        torch.cuda.synchronize()
        eager_us = 1e3 * tt.do_bench(call, warmup=25, rep=100, return_mode="median")
    except Exception as e:  # noqa: BLE001
        print(f"    eager failed: {type(e).__name__}: {str(e)[:200]}")
    try:
        graph_us = 1e3 * tt.do_bench_cudagraph(call, rep=50, return_mode="median")
    except Exception as e:  # noqa: BLE001
        print(f"    graph failed: {type(e).__name__}: {str(e)[:200]}")
    return graph_us, eager_us


def problems(cfg_name: str, cfg: dict, dtype):
    """(label, slot, fn, kwargs) for every timed call of one config."""
    out = []
    n_dec = cfg["decode"][0][0]
    n_pre = sum(cfg["prefill"][0])
    for n, phase in ((n_dec, "decode"), (n_pre, "prefill")):
        spec = {"N": n, "H": cfg["H"], "eps": 1e-5, "x_scale": 1.0, "row_strided": False}
        inp = slot_cases.make_inputs("norm", spec, dtype, "cuda")
        out.append((f"rmsnorm N={n}", "norm", "rmsnorm", {k: inp[k] for k in ("x", "w", "eps")}))
        out.append((f"add_rmsnorm N={n}", "norm", "add_rmsnorm", inp))
        spec = {"N": n, "Hq": cfg["Hq"], "Hkv": cfg["Hkv"], "D": cfg["D"], "fused_qkv": True, "P": 4096,
                "theta": 10000.0}
        out.append((f"rope_cache N={n}", "rope_cache", "rope_cache",
                    slot_cases.make_inputs("rope_cache", spec, dtype, "cuda")))
        out.append((f"silu_mul N={n}", "silu_mul", "silu_mul",
                    slot_cases.make_inputs("silu_mul", {"N": n, "I": cfg["I"]}, dtype, "cuda")))
        for label, fn, k, o in (("qkv", "linear", cfg["H"], (cfg["Hq"] + 2 * cfg["Hkv"]) * cfg["D"]),
                                ("gate_up+silu", "linear_silu", cfg["H"], 2 * cfg["I"]),
                                ("o_proj+add+norm", "linear_add_norm", cfg["Hq"] * cfg["D"], cfg["H"]),
                                ("down+add+norm", "linear_add_norm", cfg["I"], cfg["H"])):
            spec = {"N": n, "K": k, "O": o, "D": cfg["D"], "Hkv": cfg["Hkv"], "theta": 10000.0,
                    "row_strided": False, "eps": 1e-5, "x_scale": 1.0}
            inp = slot_cases.make_inputs("linear", spec, dtype, "cuda")
            _, args = slot_cases.SLOT_CASES["linear"].FUNCTIONS[fn]
            out.append((f"{label} N={n}", "linear", fn, {a: inp[a] for a in args}))
    for b, ctx in cfg["decode"]:
        spec = {"ctx": [ctx] * b, "Hq": cfg["Hq"], "Hkv": cfg["Hkv"], "D": cfg["D"], "block_size": BLOCK_SIZE,
                "max_context": "exact", "q_scale": 1.0, "scale_mult": 1.0}
        out.append((f"decode B={b} ctx={ctx}", "decode_attention", "decode_attention",
                    slot_cases.make_inputs("decode_attention", spec, dtype, "cuda")))
    for lens in cfg["prefill"]:
        spec = {"seq_lens": lens, "Hq": cfg["Hq"], "Hkv": cfg["Hkv"], "D": cfg["D"], "fused_qkv": True,
                "q_scale": 1.0, "scale_mult": 1.0}
        out.append((f"prefill {len(lens)}x{lens[0]}", "prefill_attention", "prefill_attention",
                    slot_cases.make_inputs("prefill_attention", spec, dtype, "cuda")))
    return [(cfg_name, *p) for p in out]


def unfused_linear(fn: str):
    """The linear slot's function `fn` as the engine runs it without the slot: cuBLAS, then the
    silu_mul, rope_cache or norm slot's triton kernel. Takes the slot function's keyword arguments."""
    linear = torch.nn.functional.linear
    if fn == "linear":
        return lambda x, weight: linear(x, weight)
    if fn == "linear_silu":
        silu_mul = slot_check.variant_function("silu_mul", "triton", "silu_mul")
        return lambda x, weight: silu_mul(linear(x, weight))
    if fn == "linear_rope_cache":
        rope_cache = slot_check.variant_function("rope_cache", "triton", "rope_cache")

        def qkv_rope_cache(x, weight, cos, sin, positions, slot_mapping, k_cache, v_cache):
            qkv = linear(x, weight)
            kv_heads, head_dim = k_cache.shape[1:]
            q, k, v = qkv.split([qkv.shape[1] - 2 * kv_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], 1)
            rope_cache(q.unflatten(1, (-1, head_dim)), k.unflatten(1, (-1, head_dim)), v.unflatten(1, (-1, head_dim)),
                       cos, sin, positions, slot_mapping, k_cache, v_cache)
            return qkv
        return qkv_rope_cache
    add_rmsnorm = slot_check.variant_function("norm", "triton", "add_rmsnorm")
    return lambda x, weight, residual, norm_w, eps: add_rmsnorm(linear(x, weight), residual, norm_w, eps)


def run_bench(dtype, slots: set[str], configs: list[str], only: set[str]) -> list[dict]:
    rows = []
    variants = {s: [v.name for v in vs if "cuda" in v.devices and (not only or v.name in only)]
                for s, vs in menu().items()}
    for cfg_name in configs:
        cfg = CONFIGS[cfg_name]
        for cfg_name_, label, slot, fn, kwargs in problems(cfg_name, cfg, dtype):
            if slots and slot not in slots:
                continue
            calls = [(v, lambda f=slot_check.variant_function(slot, v, fn): f(**kwargs)) for v in variants[slot]]
            if slot == "linear":   # what the engine runs without the slot: cuBLAS, then the triton SwiGLU or norm
                calls.append(("unfused", lambda f=unfused_linear(fn): f(**kwargs)))
            for variant, call in calls:
                g, e = bench(call)
                rows.append({"config": cfg_name_, "problem": label, "slot": slot, "variant": variant,
                             "graph_us": g, "eager_us": e})
                print(f"  {cfg_name_:6s} {label:24s} {variant:12s} graph {g:9.1f} us  eager {e:9.1f} us", flush=True)
            torch.cuda.empty_cache()
    return rows


DECODE_SWEEP = ([{}] + [{"decode_splits": s, "decode_block_n": n} for s in (0, 1, 4, 16) for n in (16, 32, 64)]
                + [{"decode_splits": 1, "decode_block_n": n, "decode_stages": st, "decode_warps": w}
                   for n in (64, 128) for st in (2, 3, 4) for w in (4, 8)])
EXACT_DECODE_SWEEP = [{}] + [{"decode_splits": s, "decode_block_n": n, "decode_warps": w}
                             for s in (1, 2, 3) for n in (32, 64) for w in (4, 8)]
PREFILL_SWEEP = [{}] + [{"prefill_block_m": m, "prefill_block_n": n, "prefill_warps": w, "prefill_stages": st}
                 for m, n, w, st in ((16, 16, 2, 2), (16, 16, 4, 2), (32, 16, 4, 2), (32, 32, 2, 2),
                                     (32, 32, 4, 2), (32, 32, 4, 3), (64, 32, 4, 2), (64, 32, 4, 3),
                                     (64, 32, 8, 2), (64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 8, 3),
                                     (128, 32, 4, 2), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2))]

# triton_exact (what the search keeps for prefill): row tile, key tile (divides the row tile), warps, stages
EXACT_PREFILL_SWEEP = [{}] + [{"prefill_block_m": m, "prefill_block_n": n, "prefill_warps": w, "prefill_stages": st}
                              for m, n, w, st in ((16, 16, 2, 2), (16, 16, 4, 2), (32, 16, 4, 2), (32, 32, 4, 2),
                                                  (32, 32, 2, 2), (32, 32, 4, 3), (64, 16, 4, 2), (64, 32, 8, 2),
                                                  (64, 64, 4, 2), (16, 16, 4, 1), (32, 32, 8, 1))]

LINEAR_SWEEP = [{}] + [{"linear_block_n": n, "linear_block_k": k, "linear_splits": sp, "linear_warps": w,
                        "linear_stages": st}
                       for n, k, sp, w, st in ((16, 128, 0, 4, 3), (64, 128, 0, 4, 3), (32, 64, 0, 4, 3),
                                               (32, 256, 0, 4, 2), (32, 128, 1, 4, 3), (32, 128, 4, 4, 3),
                                               (32, 128, 16, 4, 3), (64, 64, 0, 4, 2), (32, 128, 0, 8, 3),
                                               (16, 64, 0, 2, 2))]
# linear and linear_silu (no K split): column tile, warps, K step, stages
GEMM_SWEEP = [{}] + [{"linear_gemm_block_n": n, "linear_gemm_warps": w, "linear_block_k": k, "linear_stages": st}
                     for n, w, k, st in ((16, 4, 128, 3), (16, 8, 128, 3), (16, 2, 128, 3), (32, 4, 128, 3),
                                         (32, 8, 128, 3), (64, 4, 128, 3), (16, 4, 64, 4), (16, 4, 256, 2),
                                         (32, 4, 256, 2), (16, 4, 128, 1), (32, 4, 64, 4), (64, 8, 64, 3))]


def run_sweep(dtype, slots: set[str], configs: list[str], only: set[str]) -> list[dict]:
    rows = []
    for cfg_name in configs:
        cfg = CONFIGS[cfg_name]
        for _, label, slot, fn, kwargs in problems(cfg_name, cfg, dtype):
            if slot == "decode_attention":
                sweeps = [("triton_split", DECODE_SWEEP), ("triton_exact", EXACT_DECODE_SWEEP)]
            elif slot == "prefill_attention":
                sweeps = [("triton", PREFILL_SWEEP), ("triton_exact", EXACT_PREFILL_SWEEP)]
            elif slot == "linear" and kwargs[next(iter(kwargs))].shape[0] <= 64:
                sweeps = [("triton", LINEAR_SWEEP if fn == "linear_add_norm" else GEMM_SWEEP)]
            else:
                continue
            if slots and slot not in slots:
                continue
            for variant, grid in sweeps:
                if only and variant not in only:
                    continue
                rows += sweep_one(cfg_name, label, slot, variant, fn, kwargs, grid)
    return rows


def sweep_one(cfg_name: str, label: str, slot: str, variant: str, fn: str, kwargs: dict, grid: list) -> list[dict]:
    """Every tiling of `grid` for one variant on one problem: max error against the slot's
    reference op, graph-replay µs."""
    rows = []
    want = getattr(slot_refs, f"ref_{fn}")(**kwargs)
    want = want[0] if isinstance(want, tuple) else want
    for params in grid:
        try:
            f = slot_check.variant_function(slot, variant, fn, params)
            got = f(**kwargs)
            err = ((got[0] if isinstance(got, tuple) else got).float() - want.float()).abs().max().item()
            g, _ = bench(lambda: f(**kwargs))
        except Exception as e:  # noqa: BLE001 - a config that does not compile is data
            print(f"    {params}: {type(e).__name__}: {str(e)[:160]}")
            g, err = math.nan, math.nan
        rows.append({"config": cfg_name, "problem": label, "variant": variant, "params": params, "graph_us": g,
                     "max_err": err})
        print(f"  {cfg_name:6s} {label:24s} {variant:12s} {json.dumps(params):80s} graph {g:8.1f} us err {err:.2g}",
              flush=True)
    return rows


def table(rows: list[dict]) -> str:
    """Markdown: one line per (config, problem), torch time and each other variant's speedup."""
    lines = ["| config | problem | variant | graph µs | eager µs | vs torch (graph) |", "|---|---|---|---:|---:|---:|"]
    base = {(r["config"], r["problem"]): r["graph_us"] for r in rows if r["variant"] == "torch"}
    for r in rows:
        t = base.get((r["config"], r["problem"]), math.nan)
        speed = t / r["graph_us"] if r["graph_us"] and not math.isnan(r["graph_us"]) else math.nan
        lines.append(f"| {r['config']} | {r['problem']} | {r['variant']} | {r['graph_us']:.1f} | {r['eager_us']:.1f} "
                     f"| {speed:.2f}x |")
    return "\n".join(lines)


def sweep_table(rows: list[dict]) -> str:
    lines = ["| config | problem | variant | best params | graph µs | default-params µs |", "|---|---|---|---|---:|---:|"]
    by = {}
    for r in rows:
        by.setdefault((r["config"], r["problem"], r["variant"]), []).append(r)
    for (cfg, prob, variant), rs in by.items():
        ok = [r for r in rs if not math.isnan(r["graph_us"]) and r["max_err"] < 0.05]
        if not ok:
            lines.append(f"| {cfg} | {prob} | {variant} | none ran | | |")
            continue
        best = min(ok, key=lambda r: r["graph_us"])
        default = [r for r in rs if not r["params"]]
        d = f"{default[0]['graph_us']:.1f}" if default else ""
        lines.append(f"| {cfg} | {prob} | {variant} | {json.dumps(best['params'])} | {best['graph_us']:.1f} | {d} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-tests", action="store_true")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--test-timeout", type=int, default=360)
    ap.add_argument("-k", dest="select", default="", help="pytest -k expression for the tests")
    ap.add_argument("--dtype", default="fp16")
    ap.add_argument("--slots", default="", help="comma list: bench and sweep only these slots (default: all)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {', '.join(CONFIGS)}")
    ap.add_argument("--variants", default="", help="comma list: bench and sweep only these variants (default: all)")
    ap.add_argument("--out", default=out_dir("/tmp/gpu_kernels"), help="logs and tables ($OUT when set)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    print(env_line(), flush=True)
    summary = [env_line()]
    if not args.no_tests:
        summary.append(run_tests(out, args.test_timeout, args.select))
        print(summary[-1], flush=True)
    dtype = slot_check.DTYPE_NAMES[args.dtype]
    slots = {s for s in args.slots.split(",") if s}
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        ap.error(f"unknown config {unknown[0]!r}; configs: {', '.join(CONFIGS)}")
    only = {v for v in args.variants.split(",") if v}
    if not args.no_bench:
        rows = run_bench(dtype, slots, configs, only)
        (out / "timings.json").write_text(json.dumps(rows, indent=1))
        summary.append(table(rows))
    if not args.no_sweep:
        rows = run_sweep(dtype, slots, configs, only)
        (out / "sweep.json").write_text(json.dumps(rows, indent=1))
        summary.append(sweep_table(rows))
    text = "\n\n".join(summary)
    (out / "summary.md").write_text(text)
    print("\n=========== SUMMARY ===========\n" + text)
    return 0

