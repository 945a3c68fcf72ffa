#!/usr/bin/env python3
"""The engine's projections timed in every way torch can call cuBLAS for them, weights cold in L2.

    python3 scripts/gpu_gemm_forms.py [--configs public,1B] [--out DIR]

Why: at prefill sizes the paged engine runs its projections through cuBLAS (F.linear, weight
[O, K]), and on an H100 they take 2-5x their FLOP floor (the public 4x128 prefill: down 8.2 us,
QKV 6.2, o_proj 4.5, gate/up 10.4; docs/benchmarks.md eighth session). cuBLAS picks its kernel
by heuristics on the call's layout, so the same product called another way may get another,
faster kernel. Forms, each x [M, K] @ w^T:
  linear   F.linear(x, w), what the engine does
  mm_t     torch.mm(x, wt) with wt = w.t().contiguous() kept instead of w (another layout)
  addmm0   torch.addmm(zeros(O), x, w.t()): torch's cublasLt path with a (zero) bias epilogue
  lt       F.linear with torch.backends.cuda.preferred_blas_library("cublaslt") (a process-wide
           setting: reported to know, not for the engine, whose settings must not change the
           reference's GEMMs in the same process)
Each form's time is a CUDA-graph replay of LAYERS calls, each with its own copy of the weight (the
engine's layers: weights come from HBM, not L2), divided by LAYERS; median of 20 replays.
Beside each time: the fraction of outputs bit-equal to `linear`'s (1.0: the same rounding) and
the max abs difference. fp16, reduced-precision reductions off, as the engine sets them.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F

from scripts.gpu_linear_sweep import graph_replay_us

LAYERS = 12
CONFIGS = {   # hidden, q heads, kv heads, head_dim, intermediate, vocab; row counts to time
    "public": (768, 4, 4, 192, 3072, 4096, (8, 64, 128, 192, 256, 384, 512)),
    "1B": (2048, 32, 8, 64, 8192, 32000, (64, 512, 2048, 16384)),
}


def projections(hidden, hq, hkv, d, inter, vocab) -> dict[str, tuple[int, int]]:
    """name -> (O, K) of the weight."""
    return {"qkv": ((hq + 2 * hkv) * d, hidden), "o_proj": (hidden, hq * d), "gate_up": (2 * inter, hidden),
            "down": (hidden, inter), "lm_head": (vocab, hidden)}


def time_graph(calls) -> float:
    """µs per call of a graph running `calls` once each (graph_replay_us: median of its replays)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    return graph_replay_us(graph, len(calls))


def run(config: str) -> list[dict]:
    hidden, hq, hkv, d, inter, vocab, row_counts = CONFIGS[config]
    rows = []
    for name, (o, k) in projections(hidden, hq, hkv, d, inter, vocab).items():
        layers = LAYERS if o * k * 2 < 64 << 20 else 4        # large weights are cold anyway
        weights = [torch.randn(o, k, device="cuda", dtype=torch.float16) / k ** 0.5 for _ in range(layers)]
        transposed = [w.t().contiguous() for w in weights]
        zero = torch.zeros(o, device="cuda", dtype=torch.float16)
        for m in row_counts:
            if name == "lm_head" and m > 512:
                continue
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            forms = {
                "linear": [lambda w=w: F.linear(x, w) for w in weights],
                "mm_t": [lambda wt=wt: torch.mm(x, wt) for wt in transposed],
                "addmm0": [lambda w=w: torch.addmm(zero, x, w.t()) for w in weights],
            }
            base = F.linear(x, weights[0])
            row = {"config": config, "proj": name, "rows": m, "O": o, "K": k}
            for form, calls in forms.items():
                row[form] = time_graph(calls)
                got = calls[0]()
                row[form + "_equal"] = (got == base).float().mean().item()
                row[form + "_diff"] = (got.float() - base.float()).abs().max().item()
            torch.backends.cuda.preferred_blas_library("cublaslt")
            try:
                row["lt"] = time_graph(forms["linear"])
                got = F.linear(x, weights[0])
                row["lt_equal"] = (got == base).float().mean().item()
                row["lt_diff"] = (got.float() - base.float()).abs().max().item()
            finally:
                torch.backends.cuda.preferred_blas_library("cublas")
            rows.append(row)
            print(f"{config:6s} {name:8s} M={m:6d} " + "  ".join(
                f"{f} {row[f]:7.1f} us ({row[f + '_equal']:.3f} eq)" for f in ("linear", "mm_t", "addmm0", "lt")),
                flush=True)
        del weights, transposed
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="public,1B")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    print(torch.cuda.get_device_name(0), torch.__version__, flush=True)
    rows = [r for c in args.configs.split(",") for r in run(c)]
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gemm_forms.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
