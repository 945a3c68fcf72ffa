"""What a persistent decode kernel that walks the layers could save: the projections of a decode step as one kernel with grid barriers, against the same work as one kernel a projection.

    python3 -m scripts.gpu persistent-probe [--batch 8] [--layers 12] [--iters 200] [--out DIR]

Why (issue 24): on the public config a decode step of batch 8 is ~90 kernels and ~334 us of kernel
time (docs/benchmarks.md, sixteenth session) against ~77 us of weight reads at 3 TB/s; every
small kernel costs a few microseconds of ramp and tail whatever its bytes. The lever the issue
names is fewer kernels: one persistent kernel (a program per SM) that walks every layer and
waits at a grid barrier between the steps that depend on each other. Before building that into the
engine, this measures its two unknowns at the public config's shapes, with no attention and no
norms: the cost of one grid barrier, and the time of a step's four projections a layer
(QKV 768 -> 2304, o_proj 768 -> 768, gate/up 768 -> 6144, down 3072 -> 768) as

  separate   one GEMV kernel a projection (48 a step), replayed from a CUDA graph;
  persistent one kernel for the whole step: a program per SM takes the output tiles of a
             projection in turn, then all programs meet at a barrier (an atomic counter in global
             memory; activations are read past L1), 48 barriers a step;
  barriers   the persistent kernel with no work: 48 barriers alone.

Each projection reads the previous one's output as its input (o_proj takes QKV's first 768
columns, down gate/up's first 3072), so the barriers are needed for the numbers to be right; the
persistent result is checked against the separate one. The floor line is the weights' bytes at
the copy bandwidth the judge's floor measures (evaluator/floor.py). Writes persistent_probe.json.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from evaluator.floor import measure_hardware
from scripts.gpu.common import out_dir
from scripts.gpu.linear_sweep import graph_replay_us

HIDDEN, INTER = 768, 3072
# (in, out) of a layer's projections, in order; each reads the previous one's output (see above)
PROJECTIONS = [(HIDDEN, 3 * HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, 2 * INTER), (INTER, HIDDEN)]
BLOCK_N, BLOCK_K, ROWS = 64, 128, 16   # ROWS: the batch padded to tl.dot's smallest M


class Step:
    """The weights and buffers of one decode step's projections."""

    def __init__(self, batch: int, layers: int):
        g = torch.Generator(device="cuda").manual_seed(0)
        self.batch, self.layers = batch, layers
        self.weights = [torch.randn(layers, n_out, n_in, device="cuda", dtype=torch.float16, generator=g) * 0.03
                        for n_in, n_out in PROJECTIONS]
        self.x0 = torch.randn(ROWS, HIDDEN, device="cuda", dtype=torch.float16, generator=g)
        self.x = self.x0.clone()
        # each projection's output; down's is x itself, the next layer's input
        self.ys = [torch.zeros(ROWS, n_out, device="cuda", dtype=torch.float16) for _, n_out in PROJECTIONS[:-1]]
        self.ys.append(self.x)
        self.counter = torch.zeros(1, device="cuda", dtype=torch.int32)
        self.programs = torch.cuda.get_device_properties(0).multi_processor_count

    def bytes(self) -> int:
        return sum(w.numel() * w.element_size() for w in self.weights)

    def separate(self) -> None:
        import triton
        from scripts.gpu.persistent_kernels import _gemv_kernel
        for layer in range(self.layers):
            x = self.x
            for (n_in, n_out), w, y in zip(PROJECTIONS, self.weights, self.ys):
                tiles = triton.cdiv(n_out, BLOCK_N)
                _gemv_kernel[(tiles,)](x, w[layer], y, n_in, n_out, x.stride(0), y.stride(0), self.batch,
                                       BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, ROWS=ROWS, num_warps=4)
                x = y

    def persistent(self, work: bool = True) -> None:
        from scripts.gpu.persistent_kernels import _step_kernel
        self.counter.zero_()
        _step_kernel[(self.programs,)](self.x, *self.weights, *self.ys[:-1], self.counter, self.batch, self.layers,
                                       H=HIDDEN, I=INTER, WORK=work, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, ROWS=ROWS,
                                       num_warps=4)


def graph_us(fn, iters: int) -> float:
    """Microseconds a replay of `fn` captured as a CUDA graph takes (median of `iters` timed replays)."""
    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            fn()
    return graph_replay_us(graph, 1, iters)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--out", default=out_dir("/tmp/persistent_probe"))
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    step = Step(a.batch, a.layers)

    step.x.copy_(step.x0)
    step.separate()
    expected = step.x[:a.batch, :HIDDEN].float().clone()
    step.x.copy_(step.x0)
    step.persistent()
    torch.cuda.synchronize()
    got = step.x[:a.batch, :HIDDEN].float()
    err = (got - expected).abs().max().item() / max(expected.abs().max().item(), 1e-6)

    bandwidth = measure_hardware("cuda", torch.float16)[0] * 1e9   # bytes a second, the judge's own copy
    floor_us = step.bytes() / bandwidth * 1e6
    rows = {"separate": graph_us(step.separate, a.iters),
            "persistent": graph_us(step.persistent, a.iters),
            "barriers": graph_us(lambda: step.persistent(work=False), a.iters)}
    barriers = 4 * a.layers
    result = {"device": torch.cuda.get_device_name(0), "programs": step.programs, "batch": a.batch,
              "layers": a.layers, "weight_mib": step.bytes() / 2**20, "copy_bandwidth_gbs": bandwidth / 1e9,
              "floor_us": floor_us, "persistent_rel_err": err, "us": rows,
              "barrier_us": rows["barriers"] / barriers, "kernels_separate": 4 * a.layers}
    (out / "persistent_probe.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"{result['device']}, {step.programs} programs, batch {a.batch}, {a.layers} layers, "
          f"{result['weight_mib']:.0f} MiB of weights, copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    print(f"persistent vs separate: max rel err {err:.2e}")
    for name, us in rows.items():
        print(f"  {name:10} {us:8.1f} us  ({floor_us / us:6.1%} of the weights' floor {floor_us:.1f} us)")
    print(f"  one grid barrier: {result['barrier_us']:.2f} us ({barriers} a step)")
