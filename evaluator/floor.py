"""The physical floor of a trace: the time no engine can beat on this device.

Per call, max(FLOPs / peak, bytes / bandwidth), summed over the trace (SPEC.md §6):
- bytes: every weight matrix read once per prefill or decode call (layers + lm_head, in the
  compute dtype), the embedding rows gathered, and for decode the KV cache read.
- FLOPs: 2 · layer params · tokens, attention (QK^T and PV over the causal pairs of a
  prompt, over the whole context for a decode token), lm_head on last tokens only.
Every speed number is read against this, so that "2× faster" is never mistaken for "fast".
"""
from __future__ import annotations

import platform
import time
from dataclasses import dataclass

import torch

from evaluator.common import ModelDims, synchronize
from evaluator.traces import DECODE, PREFILL, Op, replay

GIGA, TERA = 1e9, 1e12


@dataclass(frozen=True)
class Hardware:
    name: str
    bandwidth_gbs: float   # memory bandwidth, GB/s
    peak_tflops: float     # dense GEMM peak in the compute dtype, TFLOP/s
    source: str            # "table", "measured", "flags" or a mix, for the report


# Measured on these machines (LESSONS.md §A): copy bandwidth and bf16/fp16 GEMM peak.
KNOWN_GPUS = {"H200": (4300.0, 790.0), "H100": (3000.0, 790.0)}

# The quick measurement: a copy large enough to leave the caches, a GEMM large enough to
# approach the peak, best of a few runs.
_COPY_BYTES = 256 * 2**20
_GEMM_SIZE = {"cuda": 8192, "cpu": 1024}
_MEASURE_RUNS = 3


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return platform.processor() or platform.machine() or "cpu"


def _best_seconds(fn, device: str) -> float:
    best = float("inf")
    for _ in range(_MEASURE_RUNS + 1):  # the first run warms up
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best


def measure_hardware(device: str, dtype: torch.dtype) -> tuple[float, float]:
    """(bandwidth GB/s, peak TFLOP/s) measured now: one copy and one square GEMM."""
    src = torch.empty(_COPY_BYTES // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    copy_s = _best_seconds(lambda: dst.copy_(src), device)
    n = _GEMM_SIZE.get(device, _GEMM_SIZE["cuda"])
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    gemm_s = _best_seconds(lambda: a @ b, device)
    return 2 * _COPY_BYTES / copy_s / GIGA, 2 * n**3 / gemm_s / TERA


def detect_hardware(device: str, dtype: torch.dtype, bandwidth_gbs: float | None = None,
                    peak_tflops: float | None = None) -> Hardware:
    """Flags first, then the table of known GPUs by name, then a quick measurement."""
    name = _device_name(device)
    known = next((v for k, v in KNOWN_GPUS.items() if device == "cuda" and k in name), None)
    bw, peak = bandwidth_gbs, peak_tflops
    sources = ["flags"] if (bw or peak) else []
    if known and (bw is None or peak is None):
        bw, peak = bw or known[0], peak or known[1]
        sources.append("table")
    if bw is None or peak is None:
        m_bw, m_peak = measure_hardware(device, dtype)
        bw, peak = bw or m_bw, peak or m_peak
        sources.append("measured")
    return Hardware(name, float(bw), float(peak), "+".join(sources))


@dataclass(frozen=True)
class CallCost:
    flops: float
    bytes: float

    def seconds(self, hw: Hardware) -> float:
        return max(self.flops / (hw.peak_tflops * TERA), self.bytes / (hw.bandwidth_gbs * GIGA))


def call_costs(dims: ModelDims, dtype_bytes: int, trace: list[Op]) -> list[CallCost]:
    """The work of every call of the trace; a remove costs nothing."""
    weight_params = dims.layers * dims.layer_params + dims.vocab * dims.hidden  # + lm_head
    attn_per_pair = 4 * dims.heads * dims.head_dim * dims.layers  # QK^T and PV, multiply-add
    out = []
    for op, lengths in replay(trace):
        if op.kind == PREFILL:
            tokens = sum(op.lengths)
            pairs = sum(n * (n + 1) // 2 for n in op.lengths)
            kv_read = 0
        elif op.kind == DECODE:
            tokens = len(op.request_ids)
            pairs = kv_read = sum(lengths[rid] for rid in op.request_ids)
        else:
            out.append(CallCost(0.0, 0.0))
            continue
        rows = len(op.request_ids)  # lm_head on the last token of each request
        flops = 2 * dims.layers * dims.layer_params * tokens + attn_per_pair * pairs + 2 * dims.vocab * dims.hidden * rows
        bytes_ = dtype_bytes * (weight_params + tokens * dims.hidden + kv_read * dims.kv_values_per_token)
        out.append(CallCost(float(flops), float(bytes_)))
    return out


def floor_seconds(dims: ModelDims, dtype_bytes: int, trace: list[Op], hw: Hardware) -> float:
    return sum(c.seconds(hw) for c in call_costs(dims, dtype_bytes, trace))
