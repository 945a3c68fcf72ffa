"""Does programmatic dependent launch (PDL) pay inside a CUDA graph on this GPU, and how much?

A decode step is ~100 small kernels in a row, each a few microseconds, so the gap between one
kernel's end and the next one's first useful load is a large share of the step. With PDL
(sm_90+: the launch attribute `launch_pdl=True` plus `griddepcontrol.wait` in the kernel) the next
kernel's programs start while the previous kernel drains; anything that does not depend on it
(weights) can be loaded before the wait.

This probe times a chain of GEMVs shaped like a decode step's (8 rows, 1024 x 1024 and 1024 -> 4096
weights, one weight matrix per kernel so the chain streams from HBM as a real step does), captured
in one CUDA graph, four ways: plain launches; PDL with the wait first; PDL with the program's
weight tile loaded into registers before the wait; PDL with the tile only prefetched into L2
before the wait. It checks that all four give the same result.

    python3 scripts/gpu_pdl_probe.py [--kernels 96] [--rows 8]
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, M, N, stride, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 PDL: tl.constexpr, PREFETCH: tl.constexpr, L2: tl.constexpr):
    """y[M, N] = x[M, K] @ w[N, K]^T (x, y rows `stride` apart), one BLOCK_N column tile per program."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, K)
    if PREFETCH:
        w = tl.load(w_ptr + cols[:, None] * K + ks[None, :], mask=cols[:, None] < N, other=0.0)
    if L2:   # one prefetch.global.L2 per 128-byte line of the tile
        lines = tl.arange(0, K // 64) * 64
        addr = (w_ptr + cols[:, None] * K + lines[None, :]).to(tl.int64)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // dummy $0", "=r,l", [addr], dtype=tl.int32,
                                  is_pure=False, pack=1)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if not PREFETCH:
        w = tl.load(w_ptr + cols[:, None] * K + ks[None, :], mask=cols[:, None] < N, other=0.0)
    x = tl.load(x_ptr + rows[:, None] * stride + ks[None, :], mask=rows[:, None] < M, other=0.0)
    y = tl.dot(x, tl.trans(w))
    tl.store(y_ptr + rows[:, None] * stride + cols[None, :], y.to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def chain(xs, weights, mode):
    """Kernel i reads kernel i-1's output (the first reads xs[0]); returns the last output."""
    pdl, prefetch, l2 = mode != "plain", mode == "pdl+prefetch", mode == "pdl+l2"
    x = xs[0]
    for i, w in enumerate(weights):
        y = xs[1 + i % 2]
        n, k = w.shape
        _gemv_kernel[(triton.cdiv(n, 16),)](x, w, y, x.shape[0], n, y.stride(0), k, BLOCK_M=16, BLOCK_N=16,
                                           PDL=pdl, PREFETCH=prefetch, L2=l2, num_warps=4, launch_pdl=pdl)
        x = y
    return x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", type=int, default=96)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--replays", type=int, default=200)
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    shapes = [(1024, 1024), (4096, 1024)] * (args.kernels // 2)
    weights = [torch.randn(n, k, device=dev, dtype=torch.float16) * k ** -0.5 for n, k in shapes]
    xs = [torch.randn(args.rows, 4096, device=dev, dtype=torch.float16) for _ in range(3)]
    print(f"{torch.cuda.get_device_name()}  {args.kernels} GEMVs, {args.rows} rows, "
          f"{sum(w.numel() for w in weights) * 2 / 2**20:.0f} MiB of weights")
    results = {}
    for mode in ("plain", "pdl", "pdl+prefetch", "pdl+l2"):
        out = chain(xs, weights, mode).clone()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            last = chain(xs, weights, mode)
        graph.replay()
        torch.cuda.synchronize()
        same = torch.equal(last, out)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        us = start.elapsed_time(end) * 1000 / args.replays
        results[mode] = out
        print(f"{mode:>14}: {us:8.1f} us per graph, {us / args.kernels:5.2f} us per kernel, "
              f"graph == eager: {same}")
    print("all modes agree:", all(torch.equal(results["plain"], r) for r in results.values()))


if __name__ == "__main__":
    main()
