"""The linear slot's tilings timed as the engine runs them: weights cold in L2.

    python3 -m scripts.gpu linear-sweep [--configs public,1B] [--quick] [--rows N] [--add-norm] [--out DIR]

--rows N times the projections at N rows instead of the config's decode batch; above the
kernel's WIDE_ROWS (a prefill) it sweeps the wide tilings of QKV + RoPE and gate/up + SwiGLU, the
two functions an engine runs at that size, against cuBLAS plus the rope_cache or silu_mul kernel.
--add-norm times only o_proj and down with their residual add and norm (linear_add_norm, a split-K
GEMM and its reduction) over a small split grid, at any --rows: can prefill-sized passes use it?

Why: the kernels subcommand replays one call on one weight matrix, which then sits in L2 (50 MiB on
an H100) from the second replay on. In a decode step every projection reads a weight nobody read
since the previous step, ~230 MB ago, so it comes from HBM: the engine's timeline
(the timeline subcommand) showed QKV at 4.3 us and gate/up at 6.6 us where the warm sweep
said 3.1 and 4.3. A weight read from HBM is bound by the bytes each SM keeps in flight (stages x
BLOCK_K x BLOCK_N), which a warm sweep does not see.

Here each problem gets enough copies of its weight to overflow L2 (>= 200 MB in all), a CUDA graph
runs the function once on every copy in turn (as the layers of a step do), and the time per call
is a replay's time over the copies (median of REPLAYS, CUDA events). Every tiling is checked
against the slot's reference op first. cuBLAS (plus the norm or SwiGLU kernel the engine would
run after it) is timed the same way, as the baseline. Prints a table per problem, best first, and
writes linear_sweep.json under --out ($OUT when set).
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
from pathlib import Path

import torch

from evaluator import slot_cases, slot_check, slot_refs
from scripts.gpu.common import out_dir
from scripts.gpu.kernels import unfused_linear

COLD_BYTES = 200 << 20      # weight copies per problem: at least this much, 4x an H100's L2
REPLAYS = 20
WIDE_ROWS = 64              # the linear slot's triton variant takes its wide tiling above this (WIDE_ROWS__triton)
MAX_ERR = 0.05              # a tiling further than this from the reference op is reported, not timed

# (hidden, q heads, kv heads, head dim, intermediate, decode rows)
CONFIGS = {"public": (768, 4, 4, 192, 3072, 8), "1B": (2048, 32, 8, 64, 8192, 64)}

GEMM_GRID = {"linear_gemm_block_n": (16, 32), "linear_block_k": (128, 256), "linear_stages": (3, 4, 5),
             "linear_gemm_warps": (4, 8)}
SPLIT_GRID = {"linear_block_n": (16, 32), "linear_splits": (2, 4, 8), "linear_block_k": (128, 256),
              "linear_stages": (3, 4), "linear_warps": (4, 8)}
# the narrow tiling's shape, for comparison at wide rows
NARROW_AT_WIDE = {"linear_gemm_block_m": 64, "linear_gemm_block_n": 32, "linear_block_k": 128, "linear_stages": 4,
                  "linear_gemm_warps": 4}
WIDE_GRID = {"linear_gemm_block_m": (64, 128), "linear_gemm_block_n": (64, 128), "linear_block_k": (32, 64),
             "linear_stages": (3, 4), "linear_gemm_warps": (4, 8)}
QUICK_WIDE = {"linear_gemm_block_m": (64, 128), "linear_gemm_block_n": (64, 128), "linear_block_k": (64,),
              "linear_stages": (3, 4), "linear_gemm_warps": (4, 8)}
QUICK_GEMM = {"linear_gemm_block_n": (16, 32), "linear_block_k": (128, 256), "linear_stages": (3, 5),
              "linear_gemm_warps": (4,)}
QUICK_SPLIT = {"linear_block_n": (16, 32), "linear_splits": (4, 8), "linear_block_k": (128,),
               "linear_stages": (3, 4), "linear_warps": (4,)}
ADD_NORM_SPLIT = {"linear_block_n": (32, 64), "linear_splits": (1, 2, 4, 8), "linear_block_k": (128,),
                  "linear_stages": (3,), "linear_warps": (4,)}


def grid(axes: dict) -> list[dict]:
    return [dict(zip(axes, values)) for values in itertools.product(*axes.values())]


def problems(name: str, rows: int | None, wide: bool, add_norm: bool = False):
    """(label, fn, kwargs) of the projections at `rows` (default: the config's decode rows): all
    four, with `wide` QKV + RoPE and gate/up + SwiGLU, with `add_norm` o_proj and down."""
    h, hq, hkv, d, inter, decode_rows = CONFIGS[name]
    rows = rows or decode_rows
    four = (("qkv", "linear", h, (hq + 2 * hkv) * d), ("gate_up+silu", "linear_silu", h, 2 * inter),
            ("o_proj+add+norm", "linear_add_norm", hq * d, h), ("down+add+norm", "linear_add_norm", inter, h))
    two = (("qkv+rope", "linear_rope_cache", h, (hq + 2 * hkv) * d), ("gate_up+silu", "linear_silu", h, 2 * inter))
    for label, fn, k, o in (four[2:] if add_norm else two if wide else four):
        spec = {"N": rows, "K": k, "O": o, "D": d, "Hkv": hkv, "theta": 10000.0, "row_strided": False, "eps": 1e-5,
                "x_scale": 1.0}
        inp = slot_cases.make_inputs("linear", spec, torch.float16, "cuda")
        _, args = slot_cases.SLOT_CASES["linear"].FUNCTIONS[fn]
        yield f"{name} {label} N={rows}", fn, {a: inp[a] for a in args}


def cold_time_us(call, kwargs: dict) -> float:
    """Median µs per call of call(**kwargs) with the weight swapped for one of many copies, in turn."""
    weight = kwargs["weight"]
    copies = max(4, math.ceil(COLD_BYTES / (weight.numel() * weight.element_size())))
    weights = [weight.clone() for _ in range(copies)]
    runs = [{**kwargs, "weight": w} for w in weights]
    for kw in runs[:2]:     # compile and warm outside the capture
        call(**kw)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for kw in runs:
            call(**kw)
    us = graph_replay_us(graph, copies)
    del graph, weights, runs
    torch.cuda.empty_cache()
    return us


def graph_replay_us(graph, calls: int, replays: int = REPLAYS) -> float:
    """Median µs per call of a captured graph that makes `calls` calls: one warm replay, then
    `replays` replays timed with CUDA events."""
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(1e3 * start.elapsed_time(end) / calls)
    return statistics.median(times)


def max_err(fn: str, got, kwargs: dict) -> float:
    want = getattr(slot_refs, f"ref_{fn}")(**kwargs)
    if isinstance(want, tuple) and not isinstance(got, tuple):   # linear_rope_cache: qkv, then the caches
        want = want[0]
    pairs = zip(got, want) if isinstance(got, tuple) else [(got, want)]
    return max((g.float() - w.float()).abs().max().item() for g, w in pairs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="public,1B")
    ap.add_argument("--quick", action="store_true", help="a smaller grid")
    ap.add_argument("--rows", type=int, default=0, help="rows a call (default: each config's decode batch)")
    ap.add_argument("--add-norm", action="store_true", help="only o_proj and down + residual add + norm")
    ap.add_argument("--out", default=out_dir("/tmp/gpu_linear_sweep"), help="where linear_sweep.json goes")
    args = ap.parse_args(argv)
    wide = args.rows > WIDE_ROWS and not args.add_norm
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    rows = []
    for name in args.configs.split(","):
        for label, fn, kwargs in problems(name, args.rows, wide, args.add_norm):
            split = fn == "linear_add_norm"
            axes = (ADD_NORM_SPLIT if args.add_norm else (QUICK_WIDE if args.quick else WIDE_GRID) if wide
                    else (QUICK_SPLIT if split else QUICK_GEMM) if args.quick else (SPLIT_GRID if split else GEMM_GRID))
            tilings = grid(axes) + ([NARROW_AT_WIDE] if wide else [])
            results = [{"params": "cuBLAS", "us": cold_time_us(unfused_linear(fn), kwargs), "err": 0.0}]
            for params in [{}] + tilings:
                f = slot_check.variant_function("linear", "triton", fn, params)
                try:
                    err = max_err(fn, f(**kwargs), kwargs)
                    us = cold_time_us(f, kwargs) if err < MAX_ERR else math.nan
                except Exception as e:  # noqa: BLE001 - a tiling that does not compile is data
                    print(f"  {label} {params}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                    err, us = math.nan, math.nan
                results.append({"params": params or "default", "us": us, "err": err})
            results.sort(key=lambda r: (math.isnan(r["us"]), r["us"]))
            print(f"\n== {label} (cold weights, µs per call)", flush=True)
            for r in results[:8] + [r for r in results[8:] if r["params"] in ("default", "cuBLAS")]:
                print(f"  {r['us']:7.2f}  err {r['err']:.2g}  {json.dumps(r['params'])}", flush=True)
            rows.append({"problem": label, "results": results})
    (out / "linear_sweep.json").write_text(json.dumps(rows, indent=1))
    return 0

