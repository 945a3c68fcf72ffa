"""Unit checks for one kernel variant of one slot (docs/design.md §5).

For each slot this module holds

* a reference op written from SPEC §3 numerics, independently of any template
  (``ref_rmsnorm``, ``ref_add_rmsnorm``, ``ref_rope_cache``, ``ref_prefill_attention``,
  ``ref_decode_attention``, ``ref_silu_mul``, ``ref_linear``, ``ref_linear_silu``,
  ``ref_linear_add_norm``, ``ref_linear_rope_cache``);
* a list of cases (sizes) covering the edges: N=1, odd N, head_dim 64/80/128/192 (on CUDA
  also the wide 256/384/512 that random stress models draw),
  MHA/GQA/MQA, contexts that cross block boundaries, block sizes 16/32/64, long
  contexts and prompts (CUDA), ragged batches;
* an input builder (seeded, fresh seed by default) that *poisons* what a correct
  kernel must not read: unused KV-cache slots and unused block-table columns hold NaN
  or point at NaN blocks, so a kernel that reads past ``context_lens`` returns NaN;
  on CUDA the allocator is primed with NaN blocks of the output sizes before each
  call, so an output element the kernel forgot to write shows up as NaN;
* tolerances per compute dtype, in ulps of that dtype.

``check_variant(slot, source, device, seed=None)`` loads a variant (a library file,
model-written text, or a module already rendered by ``slot_render.render_slot_module``),
calls its ``<fn>__<variant>`` functions on every case and returns a
``SlotCheckResult``. Failure messages name the case, the output, the index of the worst
element, got/want and the tolerance, so that they can go back to an LLM proposer as is.

CLI::

    python3 -m evaluator.slot_check --slot decode_attention --variant triton_split --device cuda
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import math
import os
import random
import re
import secrets
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, ClassVar

import torch
import torch.nn.functional as F

from evaluator.slot_render import PRELUDE, library_variant, render_slot_module

SLOT_FUNCTIONS: dict[str, tuple[str, ...]] = {
    "norm": ("rmsnorm", "add_rmsnorm"),
    "rope_cache": ("rope_cache",),
    "prefill_attention": ("prefill_attention",),
    "decode_attention": ("decode_attention",),
    "silu_mul": ("silu_mul",),
    "linear": ("linear", "linear_silu", "linear_add_norm", "linear_rope_cache"),
}
# Functions a variant may also define: checked when it does, and the engine then calls them
# (the paged engine's prefill passes above fused_rows run RoPE + the cache writes inside the
# attention kernel instead of a rope_cache kernel before it).
OPTIONAL_FUNCTIONS: dict[str, dict[str, str]] = {   # slot -> {function: its arguments}
    "prefill_attention": {"prefill_attention_rope_cache": "q, k, v, cos, sin, positions, slot_mapping, k_cache, "
                                                          "v_cache, cu_seqlens, seq_lens, max_seqlen, scale"},
}

# (atol, rtol) per compute dtype: about two units in the last place of the dtype, so a
# kernel that rounds once where the reference rounds twice passes, and one that drops a
# mask, a scale or a rounding step does not.
TOLERANCE: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}

DTYPE_NAMES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_NAME_OF_DTYPE = {v: k for k, v in DTYPE_NAMES.items()}
_HEADER = re.compile(r"#\s*slot:\s*(\w+)\s+variant:\s*(\w+)\s+devices:\s*([\w, ]+)")


# --------------------------------------------------------------------------- results


@dataclass
class CaseResult:
    name: str
    passed: bool
    max_abs_err: float
    ratio: float  # max over elements of |out - ref| / (atol + rtol * |ref|); <= 1 passes
    message: str = ""  # empty when passed


@dataclass
class SlotCheckResult:
    slot: str
    variant: str
    device: str
    seed: int
    passed: bool
    max_abs_err: float
    worst_case: str  # the first failure's message, else the case closest to its tolerance
    cases: list[CaseResult] = field(default_factory=list)
    error: str | None = None  # the variant could not be loaded or does not run on device

    def summary(self) -> str:
        n_ok = sum(c.passed for c in self.cases)
        head = (f"{self.slot}/{self.variant} on {self.device} (seed {self.seed}): "
                f"{'PASSED' if self.passed else 'FAILED'} {n_ok}/{len(self.cases)} cases, "
                f"max_abs_err={self.max_abs_err:.3g}")
        if self.error:
            return f"{head}\n  error: {self.error}"
        return f"{head}\n  worst: {self.worst_case}"

    def to_dict(self) -> dict:
        return asdict(self)


# --------------------------------------------------------------------------- references
# Written from SPEC §3, not copied from a template: the point is two independent readings.


def ref_rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return y.to(x.dtype) * w


def ref_add_rmsnorm(x, residual, w, eps):
    r = x + residual
    return ref_rmsnorm(r, w, eps), r


def ref_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE of x[N, H, D]; cos/sin[P, D/2] already in x's dtype."""
    c = cos[positions].unsqueeze(1)
    s = sin[positions].unsqueeze(1)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * c - odd * s, even * s + odd * c), dim=-1).flatten(-2)


def ref_rope_cache(q, k, v, cos, sin, positions, slot_mapping, k_cache, v_cache):
    """Returns (q_rot, k_rot, new_k_cache, new_v_cache) without touching the inputs."""
    q_rot = ref_rope(q, cos, sin, positions)
    k_rot = ref_rope(k, cos, sin, positions)
    kc, vc = k_cache.clone(), v_cache.clone()
    kc[slot_mapping] = k_rot
    vc[slot_mapping] = v
    return q_rot, k_rot, kc, vc


def _ref_attention(q, k, v, scale, causal):
    """q[L, Hq, D], k/v[T, Hkv, D] → o[L, Hq, D], the reference's order of operations."""
    group = q.shape[1] // k.shape[1]
    qh = q.transpose(0, 1).float()
    kh = k.transpose(0, 1).repeat_interleave(group, dim=0)
    vh = v.transpose(0, 1).repeat_interleave(group, dim=0)
    s = torch.matmul(qh, kh.float().transpose(-1, -2)) * scale
    if causal:
        L, T = q.shape[0], k.shape[0]
        mask = torch.ones(L, T, dtype=torch.bool, device=q.device).triu(T - L + 1)
        s = s.masked_fill(mask, float("-inf"))
    p = torch.softmax(s, dim=-1).to(q.dtype)
    return torch.matmul(p, vh).transpose(0, 1)


def ref_prefill_attention(q, k, v, cu_seqlens, seq_lens, max_seqlen, scale):
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    start = 0
    for n in seq_lens:
        out[start:start + n] = _ref_attention(q[start:start + n], k[start:start + n], v[start:start + n],
                                              scale, causal=True)
        start += n
    return out


def ref_decode_attention(q, k_cache, v_cache, block_table, context_lens, max_context, block_size, scale):
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    table = block_table.cpu()
    for b, n in enumerate(context_lens.cpu().tolist()):
        j = torch.arange(n)
        slots = (table[b, j // block_size].long() * block_size + j % block_size).to(q.device)
        out[b] = _ref_attention(q[b:b + 1], k_cache[slots], v_cache[slots], scale, causal=False)[0]
    return out


def ref_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    inter = gate_up.shape[-1] // 2
    return F.silu(gate_up[:, :inter]) * gate_up[:, inter:]


def ref_linear(x, weight):
    """A plain projection: x[N,K] @ weight[O,K]^T, accumulated in fp32 and rounded once to dt."""
    return F.linear(x, weight)


def ref_linear_silu(x, weight):
    """The MLP's gate/up projection and SwiGLU: weight[2I,K] holds gate (rows :I) over up (rows I:);
    silu(gate) * up as the silu_mul slot rounds it, [N, I]."""
    return ref_silu_mul(F.linear(x, weight))


def ref_linear_add_norm(x, weight, residual, norm_w, eps):
    """A sublayer's output projection, its residual add and the norm after it: (y, new_residual)."""
    r = residual + F.linear(x, weight)
    return ref_rmsnorm(r, norm_w, eps), r


def ref_linear_rope_cache(x, weight, cos, sin, positions, slot_mapping, k_cache, v_cache):
    """The QKV projection, RoPE on its q and k heads and the cache writes (Hkv, D from k_cache):
    (qkv with q and k rotated, new_k_cache, new_v_cache), the inputs untouched."""
    kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
    qkv = F.linear(x, weight).view(x.shape[0], -1, head_dim)
    q, k, v = qkv.split([qkv.shape[1] - 2 * kv_heads, kv_heads, kv_heads], dim=1)
    q_rot, k_rot, kc, vc = ref_rope_cache(q, k, v, cos, sin, positions, slot_mapping, k_cache, v_cache)
    return torch.cat([q_rot, k_rot, v], dim=1).flatten(1), kc, vc


def rope_cache_magnitudes(x, weight, slot_mapping, k_cache, v_cache):
    """What an error in each of linear_rope_cache's outputs (qkv, k_cache, v_cache) may scale with:
    for a rotated (q or k) element, the larger of its pair (e, o) before the rotation; else the
    element itself. A rotated value can be small while its inputs are large, and each input is
    free in its last bit (the GEMM's fp32 sums run in another order than the reference's)."""
    kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
    pre = F.linear(x, weight).float().abs().view(x.shape[0], -1, head_dim)
    mag = torch.maximum(pre[..., 0::2], pre[..., 1::2]).repeat_interleave(2, dim=-1)
    heads = pre.shape[1]
    mag[:, heads - kv_heads:] = pre[:, heads - kv_heads:]
    kc, vc = torch.zeros_like(k_cache, dtype=torch.float32), torch.zeros_like(v_cache, dtype=torch.float32)
    kc[slot_mapping] = mag[:, heads - 2 * kv_heads:heads - kv_heads]
    vc[slot_mapping] = mag[:, heads - kv_heads:]
    return [mag.flatten(1), kc, vc]


def linear_silu_magnitudes(x, weight):
    """What an error in linear_silu's output may scale with: gate and up are each free in their last
    bit (the GEMM's fp32 sums run in another order than cuBLAS's), and silu(g) * u moves by
    |u| * |silu(g)| for a relative step in u and |u| * |g silu'(g)| for one in g: five times |a| at
    g = -5. (An H100 fresh seed, N=64 K=2048 fp16: one element in 98304 three ulps off, against the
    plain atol + rtol * |a|.)"""
    gate_up = F.linear(x, weight).float()
    inter = gate_up.shape[-1] // 2
    g, u = gate_up[:, :inter], gate_up[:, inter:]
    sig = torch.sigmoid(g)
    return [u.abs() * ((g * sig).abs() + (g * sig * (1 + g * (1 - sig))).abs())]


# --------------------------------------------------------------------------- comparison


def _compare(label: str, out, ref: torch.Tensor, dtype: torch.dtype,
             magnitude: torch.Tensor | None = None) -> tuple[float, float, str]:
    """(max_abs_err, ratio, message); message is empty when `out` is within tolerance.

    The bound is atol + rtol * |ref|, or rtol * `magnitude` where a result inherits the rounding
    freedom of larger inputs (a rotated pair). NaN where the reference has NaN (poisoned cache
    slots nobody may write) counts as equal."""
    atol, rtol = TOLERANCE[dtype]
    if not isinstance(out, torch.Tensor):
        return math.inf, math.inf, f"{label}: returned {type(out).__name__}, want a tensor"
    if tuple(out.shape) != tuple(ref.shape):
        return math.inf, math.inf, f"{label}: shape {tuple(out.shape)}, want {tuple(ref.shape)}"
    if out.dtype != ref.dtype:
        return math.inf, math.inf, f"{label}: dtype {out.dtype}, want {ref.dtype}"
    if out.device != ref.device:
        return math.inf, math.inf, f"{label}: on {out.device}, want {ref.device}"
    if out.numel() == 0:
        return 0.0, 0.0, ""
    o, r = out.detach().float(), ref.detach().float()
    both_nan = torch.isnan(o) & torch.isnan(r)
    diff = torch.nan_to_num((o - r).abs(), nan=math.inf, posinf=math.inf)
    diff = torch.where(both_nan, torch.zeros_like(diff), diff)
    scale = r.abs() if magnitude is None else torch.maximum(r.abs(), magnitude.float())
    bound = atol + rtol * torch.nan_to_num(scale, nan=0.0, posinf=0.0)
    ratio_t = diff / bound
    worst = int(torch.argmax(ratio_t).item())
    ratio = float(ratio_t.flatten()[worst].item())
    max_abs = float(diff.max().item())
    if ratio <= 1.0:
        return max_abs, ratio, ""
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), tuple(out.shape)))
    got, want = float(o.flatten()[worst].item()), float(r.flatten()[worst].item())
    n_bad = int((ratio_t > 1).sum().item())
    kind = "non-finite value" if not math.isfinite(got) and math.isfinite(want) else "mismatch"
    return max_abs, ratio, (f"{label}: {kind} at index {idx}: got {got:.6g}, want {want:.6g} "
                            f"(|err|={abs(got - want):.3g}, {n_bad}/{out.numel()} elements out of "
                            f"atol={atol:g} rtol={rtol:g}; max_abs_err={max_abs:.3g})")


_INT_VIEW = {2: torch.int16, 4: torch.int32, 8: torch.int64, 1: torch.int8}


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point():
        return t.detach().contiguous().view(_INT_VIEW[t.element_size()])
    return t.detach().contiguous()


def _unchanged(label: str, before: torch.Tensor, after: torch.Tensor) -> str:
    """Empty when `after` holds exactly the bits of `before`, NaN payloads included."""
    a, b = _bits(before), _bits(after)
    if torch.equal(a, b):
        return ""
    first = int(torch.nonzero((a != b).flatten())[0].item())
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(first), tuple(before.shape)))
    return f"{label}: input modified at index {idx} (was {before.flatten()[first].item():.6g}, " \
           f"now {after.flatten()[first].item():.6g}); this slot must not write it"


def _prime_allocator_with_nan(like: list[torch.Tensor]) -> None:
    """Free NaN-filled blocks of the outputs' sizes, so a fresh `torch.empty` in the variant
    most likely gets NaN memory back and an unwritten element cannot pass by luck."""
    if not like or like[0].device.type != "cuda":
        return
    blocks = [torch.full_like(t, float("nan"), memory_format=torch.contiguous_format) for t in like
              if t.is_floating_point()]
    del blocks


# --------------------------------------------------------------------------- slots
# Each slot: specs(rng, full) → concrete size dicts; build(spec, dtype, device, gen, cpu_gen) → inputs;
# run(fns, spec, inputs, dtype) → list of (max_abs, ratio, message) per compared output.


def _randn(shape, dtype, device, gen, scale=1.0):
    return (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * scale).to(dtype)


def _rope_cache_inputs(n, kv_heads, head_dim, positions, theta, dtype, device, gen) -> dict:
    """What RoPE and the cache writes take besides q/k/v: cos/sin tables of `positions` rows (the
    reference's fp32 angles cast to dt), random positions, distinct random slots, and NaN-poisoned
    caches with room for twice the tokens (slots nobody writes must stay NaN)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    ang = torch.arange(positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    num_slots = 2 * n + 7
    k_cache = torch.full((num_slots, kv_heads, head_dim), float("nan"), dtype=dtype, device=device)
    return {"cos": ang.cos().to(dtype).to(device), "sin": ang.sin().to(dtype).to(device),
            "positions": torch.randint(0, positions, (n,), generator=gen, device=device),
            "slot_mapping": torch.randperm(num_slots, generator=gen, device=device)[:n],
            "k_cache": k_cache, "v_cache": k_cache.clone()}


def _view_of_fused(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copy [N, H_i, D] tensors into one [N, sum(H_i)*D] buffer and return strided views of it,
    the way an engine slices q, k, v out of a fused QKV projection."""
    n, d = parts[0].shape[0], parts[0].shape[2]
    fused = torch.cat([p.reshape(n, -1) for p in parts], dim=1)
    out, col = [], 0
    for p in parts:
        width = p.shape[1] * d
        out.append(fused[:, col:col + width].view(n, p.shape[1], d))
        col += width
    return out


class _Slot:
    name: str

    def specs(self, rng: random.Random, full: bool) -> list[dict]:
        raise NotImplementedError

    def case_name(self, spec: dict) -> str:
        return " ".join(f"{k}={v}" for k, v in spec.items())

    def build(self, spec: dict, dtype, device, gen, cpu_gen) -> dict:
        raise NotImplementedError

    def run(self, fns: dict[str, Callable], spec: dict, inp: dict, dtype) -> list[tuple[float, float, str]]:
        raise NotImplementedError


def _pure_call(fn, args: dict, outputs_like: list[torch.Tensor], device, twice: bool):
    """Call fn(**args) with the allocator primed; on CUDA call it twice and demand the same bits."""
    _prime_allocator_with_nan(outputs_like)
    first = fn(**args)
    if not twice:
        return first, ""
    first_bits = [(_bits(t) if isinstance(t, torch.Tensor) else t)
                  for t in (first if isinstance(first, tuple) else (first,))]
    _prime_allocator_with_nan(outputs_like)
    second = fn(**args)
    for i, t in enumerate(second if isinstance(second, tuple) else (second,)):
        if isinstance(t, torch.Tensor) and isinstance(first_bits[i], torch.Tensor) \
                and t.shape == first_bits[i].shape and not torch.equal(_bits(t), first_bits[i]):
            return first, f"output {i}: two calls on the same inputs differ (a race, or unwritten memory)"
    return first, ""


class _Norm(_Slot):
    name = "norm"

    def specs(self, rng, full):
        sizes = [(1, 768), (7, 80), (33, 1000)]
        if full:
            sizes += [(64, 4096), (300, 2048), (5, 8192)]
        return [{"N": n, "H": h, "eps": rng.choice([1e-5, 1e-6]), "x_scale": rng.choice([0.5, 3.0]),
                 "row_strided": i % 2 == 1} for i, (n, h) in enumerate(sizes)]

    def build(self, spec, dtype, device, gen, cpu_gen):
        n, h = spec["N"], spec["H"]
        wide = _randn((n, h + (13 if spec["row_strided"] else 0)), dtype, device, gen, spec["x_scale"])
        return {"x": wide[:, :h], "residual": _randn((n, h), dtype, device, gen),
                "w": (1.0 + 0.3 * torch.randn(h, generator=gen, device=device)).to(dtype), "eps": spec["eps"]}

    def run(self, fns, spec, inp, dtype):
        twice = inp["x"].device.type == "cuda"
        res = []
        x, w, eps, residual = inp["x"], inp["w"], inp["eps"], inp["residual"]
        want = ref_rmsnorm(x, w, eps)
        before = [x.clone(), w.clone()]
        y, err = _pure_call(fns["rmsnorm"], {"x": x, "w": w, "eps": eps}, [want], x.device, twice)
        res.append(_compare("rmsnorm y", y, want, dtype))
        res += [(0, 0, e) for e in (err, _unchanged("rmsnorm x", before[0], x),
                                    _unchanged("rmsnorm w", before[1], w)) if e]
        want_y, want_r = ref_add_rmsnorm(x, residual, w, eps)
        args = {"x": x.clone(), "residual": residual.clone(), "w": w, "eps": eps}
        out = fns["add_rmsnorm"](**args)  # not called twice: a variant may update x/residual in place
        if not (isinstance(out, tuple) and len(out) == 2):
            return res + [(math.inf, math.inf, f"add_rmsnorm: returned {type(out).__name__}, want (y, new_residual)")]
        res.append(_compare("add_rmsnorm y", out[0], want_y, dtype))
        res.append(_compare("add_rmsnorm new_residual", out[1], want_r, dtype))
        return res


class _RopeCache(_Slot):
    name = "rope_cache"

    def specs(self, rng, full):
        shapes = [(1, 4, 4, 192, True), (7, 8, 2, 80, False), (5, 4, 1, 64, True)]
        if full:
            shapes += [(33, 32, 8, 64, True), (300, 16, 4, 128, False), (17, 12, 3, 192, True),
                       (9, 2, 2, 512, False)]
        return [{"N": n, "Hq": hq, "Hkv": hkv, "D": d, "fused_qkv": fused, "P": 4096,
                 "theta": rng.choice([10000.0, 500000.0])} for n, hq, hkv, d, fused in shapes]

    def build(self, spec, dtype, device, gen, cpu_gen):
        n, hq, hkv, d, p = spec["N"], spec["Hq"], spec["Hkv"], spec["D"], spec["P"]
        q, k, v = (_randn((n, h, d), dtype, device, gen, 2.0) for h in (hq, hkv, hkv))
        if spec["fused_qkv"]:
            q, k, v = _view_of_fused([q, k, v])
        return {"q": q, "k": k, "v": v, **_rope_cache_inputs(n, hkv, d, p, spec["theta"], dtype, device, gen)}

    def run(self, fns, spec, inp, dtype):
        want_q, want_k, want_kc, want_vc = ref_rope_cache(**inp)
        before = {name: inp[name].clone() for name in ("v", "cos", "sin", "positions", "slot_mapping")}
        out = fns["rope_cache"](**inp)
        res = [] if out is None else [(0, 0, f"rope_cache returned {type(out).__name__}; it works in place and returns None")]
        res.append(_compare("q (rotated in place)", inp["q"], want_q, dtype))
        res.append(_compare("k (rotated in place)", inp["k"], want_k, dtype))
        res.append(_compare("k_cache (slots by slot_mapping; the rest must stay NaN)", inp["k_cache"], want_kc, dtype))
        res.append(_compare("v_cache (slots by slot_mapping; the rest must stay NaN)", inp["v_cache"], want_vc, dtype))
        res += [(0, 0, e) for e in (_unchanged(name, t, inp[name]) for name, t in before.items()) if e]
        return res


class _PrefillAttention(_Slot):
    name = "prefill_attention"

    def specs(self, rng, full):
        shapes = [([1], 4, 4, 192, False), ([7, 13, 1], 8, 2, 80, True), ([5, 16, 33], 4, 1, 64, False),
                  ([rng.randint(1, 40) for _ in range(5)], 6, 6, 128, True)]
        if full:
            shapes += [([128] * 4, 4, 4, 192, True),
                       ([2048, 1, rng.randint(200, 400)], 8, 1, 192, False),
                       ([rng.randint(1000, 2048) for _ in range(3)], 16, 4, 128, True),
                       ([rng.randint(1, 64) for _ in range(64)], 8, 8, 64, False),
                       ([2048, 2048], 32, 8, 64, True),
                       ([rng.randint(1, 300) for _ in range(9)], 8, 2, 80, False),
                       # wide heads: tiles tuned at D <= 192 overflow shared memory here
                       ([rng.randint(100, 300), 17], 2, 2, 512, True), ([129, 64, 1], 4, 2, 384, False),
                       ([rng.randint(1, 200) for _ in range(3)], 4, 4, 256, True)]
        return [{"seq_lens": lens, "Hq": hq, "Hkv": hkv, "D": d, "fused_qkv": fused,
                 "q_scale": rng.choice([1.0, 3.0]), "scale_mult": 1.0 if i % 3 else 0.8}
                for i, (lens, hq, hkv, d, fused) in enumerate(shapes)]

    def case_name(self, spec):
        lens = spec["seq_lens"]
        shown = str(lens) if len(lens) <= 8 else f"[{len(lens)} seqs, max {max(lens)}]"
        rest = " ".join(f"{k}={v}" for k, v in spec.items() if k != "seq_lens")
        return f"seq_lens={shown} {rest}"

    def build(self, spec, dtype, device, gen, cpu_gen):
        lens, hq, hkv, d = spec["seq_lens"], spec["Hq"], spec["Hkv"], spec["D"]
        n = sum(lens)
        q = _randn((n, hq, d), dtype, device, gen, spec["q_scale"])
        k, v = (_randn((n, hkv, d), dtype, device, gen) for _ in range(2))
        if spec["fused_qkv"]:
            q, k, v = _view_of_fused([q, k, v])
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32, device=device)
        return {"q": q, "k": k, "v": v, "cu_seqlens": cu, "seq_lens": list(lens), "max_seqlen": max(lens),
                "scale": spec["scale_mult"] / math.sqrt(d)}

    def run(self, fns, spec, inp, dtype):
        want = ref_prefill_attention(**inp)
        before = {name: inp[name].clone() for name in ("q", "k", "v", "cu_seqlens")}
        out, err = _pure_call(fns["prefill_attention"], inp, [want], want.device, want.device.type == "cuda")
        res = [_compare("o", out, want, dtype)]
        res += [(0, 0, e) for e in [err] + [_unchanged(name, t, inp[name]) for name, t in before.items()] if e]
        if "prefill_attention_rope_cache" in fns:
            res += self.run_rope_cache(fns["prefill_attention_rope_cache"], spec, inp, dtype)
        return res

    @staticmethod
    def run_rope_cache(fn, spec, inp, dtype) -> list[tuple[float, float, str]]:
        """The optional fused function: rope_cache's rotation and cache writes (random positions,
        distinct random slots, NaN-poisoned caches), then attention on the rotated q and k. q and k
        themselves may come back rotated or not."""
        q, k, v = inp["q"], inp["k"], inp["v"]
        gen = torch.Generator(device=q.device).manual_seed(len(spec["seq_lens"]) * 7919 + q.shape[2])
        rope = _rope_cache_inputs(q.shape[0], k.shape[1], q.shape[2], 4096, 500000.0, dtype, q.device, gen)
        q_rot, k_rot, want_kc, want_vc = ref_rope_cache(q, k, v, **rope)
        want = ref_prefill_attention(q_rot, k_rot, v, inp["cu_seqlens"], inp["seq_lens"], inp["max_seqlen"],
                                     inp["scale"])
        before = {name: rope[name].clone() for name in ("cos", "sin", "positions", "slot_mapping")}
        before_v = v.clone()
        out = fn(q.clone(), k.clone(), v, **rope, cu_seqlens=inp["cu_seqlens"], seq_lens=inp["seq_lens"],
                 max_seqlen=inp["max_seqlen"], scale=inp["scale"])
        res = [_compare("prefill_attention_rope_cache o", out, want, dtype),
               _compare("prefill_attention_rope_cache k_cache (slots by slot_mapping; the rest must stay NaN)",
                        rope["k_cache"], want_kc, dtype),
               _compare("prefill_attention_rope_cache v_cache (slots by slot_mapping; the rest must stay NaN)",
                        rope["v_cache"], want_vc, dtype)]
        res += [(0, 0, e) for e in [_unchanged(f"prefill_attention_rope_cache {name}", t, rope[name])
                                    for name, t in before.items()] + [_unchanged("prefill_attention_rope_cache v",
                                                                                  before_v, v)] if e]
        return res


class _DecodeAttention(_Slot):
    name = "decode_attention"

    def specs(self, rng, full):
        shapes = [([1], 4, 4, 192, 16), ([15, 16, 17], 8, 2, 80, 16),
                  ([rng.randint(1, 100) for _ in range(5)], 4, 1, 64, 32),
                  ([rng.randint(1, 200) for _ in range(4)], 6, 6, 128, 64)]
        if full:
            shapes += [([rng.choice([48, 144]) + rng.randint(-3, 3) for _ in range(8)], 4, 4, 192, 16),
                       ([544 + rng.randint(-40, 40) for _ in range(64)], 32, 8, 64, 16),
                       ([4096] + [rng.randint(1, 4096) for _ in range(3)], 16, 4, 128, 32),
                       ([rng.randint(1, 1000) for _ in range(7)], 8, 8, 80, 64),
                       ([rng.randint(1, 600) for _ in range(13)], 32, 4, 192, 16),
                       ([1, 2, 3, 31, 32, 33, 63, 64, 65], 16, 2, 64, 32),
                       # wide heads: tiles tuned at D <= 192 overflow shared memory here
                       ([rng.randint(1, 700) for _ in range(6)], 2, 2, 512, 16), ([100, 257, 1], 4, 1, 384, 32),
                       ([rng.randint(1, 300) for _ in range(5)], 8, 2, 256, 64)]
        return [{"ctx": ctx, "Hq": hq, "Hkv": hkv, "D": d, "block_size": bs,
                 "max_context": "bound" if i % 2 else "exact", "q_scale": rng.choice([1.0, 4.0]),
                 "scale_mult": 1.0 if i % 3 else 0.8}
                for i, (ctx, hq, hkv, d, bs) in enumerate(shapes)]

    def case_name(self, spec):
        ctx = spec["ctx"]
        shown = str(ctx) if len(ctx) <= 9 else f"[{len(ctx)} reqs, {min(ctx)}..{max(ctx)}]"
        rest = " ".join(f"{k}={v}" for k, v in spec.items() if k != "ctx")
        return f"ctx={shown} {rest}"

    def build(self, spec, dtype, device, gen, cpu_gen):
        ctx, hq, hkv, d, bs = spec["ctx"], spec["Hq"], spec["Hkv"], spec["D"], spec["block_size"]
        b = len(ctx)
        blocks_per_req = [-(-n // bs) for n in ctx]
        spare = 3  # physical blocks nobody owns: all NaN
        num_blocks = sum(blocks_per_req) + spare
        m = max(blocks_per_req) + 1  # one more column than any request needs
        perm = torch.randperm(num_blocks, generator=cpu_gen).tolist()
        # unused columns point at random blocks: NaN ones or other requests' ones
        table = torch.randint(0, num_blocks, (b, m), generator=cpu_gen, dtype=torch.int32)
        slots, used = [], 0
        for i, n in enumerate(ctx):
            table[i, :blocks_per_req[i]] = torch.tensor(perm[used:used + blocks_per_req[i]], dtype=torch.int32)
            used += blocks_per_req[i]
            j = torch.arange(n)
            slots.append(table[i, j // bs].long() * bs + j % bs)
        slots = torch.cat(slots).to(device)
        k_cache = torch.full((num_blocks * bs, hkv, d), float("nan"), dtype=dtype, device=device)
        v_cache = k_cache.clone()
        k_cache[slots] = _randn((slots.numel(), hkv, d), dtype, device, gen)
        v_cache[slots] = _randn((slots.numel(), hkv, d), dtype, device, gen)
        return {"q": _randn((b, hq, d), dtype, device, gen, spec["q_scale"]), "k_cache": k_cache, "v_cache": v_cache,
                "block_table": table.to(device), "context_lens": torch.tensor(ctx, dtype=torch.int32, device=device),
                "max_context": m * bs if spec["max_context"] == "bound" else max(ctx), "block_size": bs,
                "scale": spec["scale_mult"] / math.sqrt(d)}

    def run(self, fns, spec, inp, dtype):
        want = ref_decode_attention(**inp)
        before = {name: inp[name].clone() for name in ("q", "k_cache", "v_cache", "block_table", "context_lens")}
        out, err = _pure_call(fns["decode_attention"], inp, [want], want.device, want.device.type == "cuda")
        res = [_compare("o", out, want, dtype)]
        res += [(0, 0, e) for e in [err] + [_unchanged(name, t, inp[name]) for name, t in before.items()] if e]
        return res


class _SiluMul(_Slot):
    name = "silu_mul"

    def specs(self, rng, full):
        sizes = [(1, 3072), (5, 80), (17, 1000)]
        if full:
            sizes += [(64, 8192), (512, 3072), (3, 1)]
        return [{"N": n, "I": i} for n, i in sizes]

    def build(self, spec, dtype, device, gen, cpu_gen):
        return {"gate_up": _randn((spec["N"], 2 * spec["I"]), dtype, device, gen, 3.0)}

    def run(self, fns, spec, inp, dtype):
        want = ref_silu_mul(inp["gate_up"])
        before = inp["gate_up"].clone()
        out, err = _pure_call(fns["silu_mul"], inp, [want], want.device, want.device.type == "cuda")
        res = [_compare("out", out, want, dtype)]
        res += [(0, 0, e) for e in (err, _unchanged("gate_up", before, inp["gate_up"])) if e]
        return res


class _Linear(_Slot):
    """The slot's projections, each with what the layer does right after it: `linear` (plain),
    `linear_silu` (gate/up with SwiGLU), `linear_add_norm` (o_proj or down with the residual add
    and the next norm) and `linear_rope_cache` (QKV with RoPE and the cache writes). One `weight`
    [O, K] serves all four: linear_silu reads it as [2I, K], gate rows over up rows (I = O // 2;
    every case has an even O, and some an I that is not a multiple of 16), linear_rope_cache as
    (Hq + 2 Hkv) heads of D (every case's O is a multiple of its D). Weights are scaled by
    1/sqrt(K) so outputs are O(1) and a dropped rounding or a swapped operand shows at the dtype's
    last bits."""

    name = "linear"
    # function -> (reference, keyword arguments); OUTPUTS: what each returns, one tensor or a tuple;
    # IN_PLACE: arguments a function updates (compared as outputs too, each call on fresh copies)
    FUNCTIONS: ClassVar[dict] = {"linear": (ref_linear, ("x", "weight")),
                                 "linear_silu": (ref_linear_silu, ("x", "weight")),
                                 "linear_add_norm": (ref_linear_add_norm,
                                                     ("x", "weight", "residual", "norm_w", "eps")),
                                 "linear_rope_cache": (ref_linear_rope_cache,
                                                       ("x", "weight", "cos", "sin", "positions", "slot_mapping",
                                                        "k_cache", "v_cache"))}
    OUTPUTS: ClassVar[dict] = {"linear": ("y",), "linear_silu": ("a",), "linear_add_norm": ("y", "new_residual"),
                               "linear_rope_cache": ("qkv",)}
    IN_PLACE: ClassVar[dict] = {"linear_rope_cache": ("k_cache", "v_cache")}
    POSITIONS = 4096     # rows of the RoPE tables

    def specs(self, rng, full):
        # (N, K, O, D, Hkv): O = (Hq + 2 Hkv) * D, with MQA, GQA and D = 20, 40 (not powers of 2)
        sizes = [(1, 768, 768, 192, 1), (7, 80, 48, 16, 1), (33, 1000, 300, 20, 5)]
        if full:
            sizes += [(8, 3072, 768, 64, 4), (64, 2048, 3072, 128, 4), (200, 768, 1000, 40, 1),
                      (16, 4096, 4096, 128, 8), (5, 768, 2048, 512, 1)]
        return [{"N": n, "K": k, "O": o, "D": d, "Hkv": hkv, "row_strided": i % 3 == 1,
                 "eps": rng.choice([1e-5, 1e-6]), "x_scale": rng.choice([0.5, 3.0]),
                 "theta": rng.choice([10000.0, 500000.0])}
                for i, (n, k, o, d, hkv) in enumerate(sizes)]

    def build(self, spec, dtype, device, gen, cpu_gen):
        n, k, o, d, hkv = spec["N"], spec["K"], spec["O"], spec["D"], spec["Hkv"]
        pad = 13 if spec["row_strided"] else 0
        return {"x": _randn((n, k + pad), dtype, device, gen, spec["x_scale"])[:, :k],
                "residual": _randn((n, o + pad), dtype, device, gen)[:, :o],
                "norm_w": (1.0 + 0.3 * torch.randn(o, generator=gen, device=device)).to(dtype), "eps": spec["eps"],
                "weight": _randn((o, k), dtype, device, gen, k ** -0.5),
                **_rope_cache_inputs(n, hkv, d, self.POSITIONS, spec["theta"], dtype, device, gen)}

    @classmethod
    def outputs(cls, fn: str, out) -> tuple[list, str]:
        """(out as a list of tensors, "") when `fn` returned what its contract says, else ([], message)."""
        names = cls.OUTPUTS[fn]
        if len(names) == 1:
            if isinstance(out, torch.Tensor):
                return [out], ""
            return [], f"{fn}: returned {type(out).__name__}, want one tensor ({names[0]})"
        if isinstance(out, tuple) and len(out) == len(names):
            return list(out), ""
        got = f"a {len(out)}-tuple" if isinstance(out, tuple) else type(out).__name__
        return [], f"{fn}: returned {got}, want ({', '.join(names)})"

    def run(self, fns, spec, inp, dtype):
        device = inp["x"].device
        before = {name: t.clone() for name, t in inp.items() if isinstance(t, torch.Tensor)}
        res = []
        for fn, (ref, arg_names) in self.FUNCTIONS.items():
            in_place = self.IN_PLACE.get(fn, ())
            args = {a: (inp[a].clone() if a in in_place else inp[a]) for a in arg_names}
            want = ref(**args)
            want = list(want) if isinstance(want, tuple) else [want]
            out, err = _pure_call(fns[fn], args, want, device, device.type == "cuda")
            got, bad = self.outputs(fn, out)
            if bad:
                res.append((math.inf, math.inf, bad))
                continue
            names = self.OUTPUTS[fn] + tuple(f"{a} (slots by slot_mapping; the rest must stay NaN)" for a in in_place)
            got += [args[a] for a in in_place]
            if fn == "linear_rope_cache":
                mags = rope_cache_magnitudes(inp["x"], inp["weight"], inp["slot_mapping"], inp["k_cache"], inp["v_cache"])
            elif fn == "linear_silu":
                mags = linear_silu_magnitudes(args["x"], args["weight"])
            else:
                mags = [None] * len(want)
            res += [_compare(f"{fn} {name}", g, w, dtype, m) for name, g, w, m in zip(names, got, want, mags)]
            res += [(0, 0, err)] if err else []
        res += [(0, 0, e) for e in (_unchanged(name, t, inp[name]) for name, t in before.items()) if e]
        return res


SLOTS: dict[str, _Slot] = {s.name: s for s in (_Norm(), _RopeCache(), _PrefillAttention(), _DecodeAttention(),
                                                _SiluMul(), _Linear())}


def case_specs(slot: str, seed: int, full: bool) -> list[dict]:
    """The concrete sizes check_variant uses for (slot, seed); `full` adds the CUDA-sized ones."""
    return SLOTS[slot].specs(random.Random(seed), full)


def make_inputs(slot: str, spec: dict, dtype: torch.dtype, device: str, seed: int = 0) -> dict:
    """Poisoned random inputs for one case, as keyword arguments of the slot's function(s).
    (For norm the dict also holds `residual`, used by add_rmsnorm.) Used by benchmarks too."""
    gen = torch.Generator(device=device).manual_seed(seed)
    cpu_gen = torch.Generator().manual_seed(seed)
    return SLOTS[slot].build(spec, dtype, device, gen, cpu_gen)


# --------------------------------------------------------------------------- loading

# Swapped in for the renderer's prelude under --interpret: triton on the CPU (TRITON_INTERPRET=1).
_INTERPRET_PRELUDE_LINE = "    if not torch.cuda.is_available():\n        raise ImportError\n"


def _module_dir() -> Path:
    d = Path(tempfile.gettempdir()) / f"slot_check_modules_{os.getuid() if hasattr(os, 'getuid') else 0}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def import_module_text(text: str, tag: str = "variant"):
    """Import module source from a real file (Triton's JIT reads kernels' source with inspect)."""
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    name = f"_slot_check_{re.sub(r'[^0-9A-Za-z_]', '_', tag)}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    path = _module_dir() / f"{name}.py"
    if not path.exists() or path.read_text() != text:
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def render_source(slot: str, source=None, variant: str | None = None, params: dict | None = None
                  ) -> tuple[str, str, tuple[str, ...]]:
    """→ (module text, variant name, devices). `source` is None (the library's `variant`), a
    path (a library variant file under templates/kernels/; any other file is read as text), or
    text: a module already rendered by render_slot_module (it starts with the prelude) or a
    variant's source with its header line (a model's). Only library files are rendered as
    templates, with `params`; text goes in verbatim (evaluator/slot_render.py says why)."""
    if source is None:
        if variant is None:
            raise ValueError("give a variant name or its source")
        text = render_slot_module(slot, variant, params)
    else:
        text = str(source)
        if isinstance(source, Path) or ("\n" not in text and len(text) < 4096 and Path(text).is_file()):
            library = library_variant(Path(text))
            text = render_slot_module(*library, params) if library else Path(text).read_text()
        if not text.startswith(PRELUDE):
            m = _HEADER.search("\n".join(text.splitlines()[:5]))
            if not m:
                raise ValueError("variant source has no '# slot: S    variant: V    devices: D' header line")
            name = m.group(2)
            text = render_slot_module(slot, name, params, extra_variants={(slot, name): text})
    m = _HEADER.search(text)
    if not m:
        raise ValueError("rendered variant has no '# slot: S    variant: V    devices: D' header line")
    if m.group(1) != slot:
        raise ValueError(f"variant header says slot {m.group(1)!r}, checking slot {slot!r}")
    if variant is not None and m.group(2) != variant:
        raise ValueError(f"variant header says {m.group(2)!r}, asked for {variant!r}")
    devices = tuple(d.strip() for d in m.group(3).split(",") if d.strip())
    return text, m.group(2), devices


def variant_function(slot: str, variant: str, fn: str, params: dict | None = None,
                     extra_variants: dict | None = None):
    """One function (`<fn>__<variant>`) of a slot's variant, rendered and imported."""
    module = import_module_text(render_slot_module(slot, variant, params, extra_variants=extra_variants),
                                f"{slot}_{variant}")
    return getattr(module, f"{fn}__{variant}")


def slot_outputs(slot: str, fns: dict, inp: dict) -> dict[str, torch.Tensor]:
    """Every output of one call of the slot's functions `fns` (by name) on a copy of `inp`
    (make_inputs), so that two variants can be compared output by output."""
    c = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in inp.items()}
    if slot == "norm":
        y = fns["rmsnorm"](c["x"], c["w"], c["eps"])
        y2, r = fns["add_rmsnorm"](c["x"].clone(), c["residual"].clone(), c["w"], c["eps"])
        return {"rmsnorm": y, "add_rmsnorm.y": y2, "add_rmsnorm.r": r}
    if slot == "rope_cache":
        fns["rope_cache"](**c)
        sm = c["slot_mapping"]
        return {"q": c["q"], "k": c["k"], "k_cache": c["k_cache"][sm], "v_cache": c["v_cache"][sm]}
    if slot == "silu_mul":
        return {"out": fns["silu_mul"](**c)}
    if slot == "linear":  # linear, linear_silu, linear_add_norm.y/.r, linear_rope_cache (+ .k_cache/.v_cache)
        out = {}
        for fn, (_, arg_names) in _Linear.FUNCTIONS.items():
            args = {a: c[a].clone() if isinstance(c[a], torch.Tensor) else c[a] for a in arg_names}
            got, bad = _Linear.outputs(fn, fns[fn](**args))
            if bad:
                raise TypeError(bad)
            names = [fn] if len(got) == 1 else [f"{fn}.y", f"{fn}.r"]
            out.update(zip(names, got))
            out.update({f"{fn}.{a}": args[a][c["slot_mapping"]] for a in _Linear.IN_PLACE.get(fn, ())})
        return out
    return {"o": fns[slot](**c)}


# --------------------------------------------------------------------------- rounding, in ulps

def ulp_key(t: torch.Tensor) -> torch.Tensor:
    """A 16-bit float's bits as an integer that is monotone in its value (+0 and -0 both 0):
    the difference of two keys is the number of representable values between them."""
    i = t.detach().contiguous().view(torch.int16).to(torch.int32)
    return torch.where(i < 0, -(i & 0x7FFF), i)


def ulp_error(got: torch.Tensor, want: torch.Tensor, floor: float = 0.0) -> torch.Tensor:
    """|got - want| in units in the last place of the 16-bit dtype at max(|got|, |want|, floor).
    With floor > 0, elements smaller than the floor are judged at the floor's ulp: an attention
    output is a sum with cancellation, and near zero its last bits are summation-order noise."""
    g, w = got.float(), want.float()
    mag = torch.clamp(torch.maximum(g.abs(), w.abs()), min=floor)
    _, exp = torch.frexp(mag)                      # mag = m * 2**exp, m in [0.5, 1)
    mant_bits = 7 if got.dtype == torch.bfloat16 else 10
    ulp = torch.ldexp(torch.ones_like(mag), exp - 1 - mant_bits)
    return (g - w).abs() / ulp


# --------------------------------------------------------------------------- the check


@contextmanager
def full_precision_gemms():
    """cuBLAS may reduce fp16/bf16 GEMMs in half precision (split-K partials rounded to 16 bits:
    tens of ulps in bf16) unless told not to. Engines tell it not to in create_engine, and the
    reference then runs in the same process; the slot checks compare against GEMMs made the same way."""
    m = torch.backends.cuda.matmul
    saved = (m.allow_fp16_reduced_precision_reduction, m.allow_bf16_reduced_precision_reduction)
    m.allow_fp16_reduced_precision_reduction = m.allow_bf16_reduced_precision_reduction = False
    try:
        yield
    finally:
        m.allow_fp16_reduced_precision_reduction, m.allow_bf16_reduced_precision_reduction = saved


def check_variant(slot: str, source=None, device: str = "cpu", seed: int | None = None, *,
                  variant: str | None = None, params: dict | None = None, dtypes=None,
                  full: bool | None = None, interpret: bool = False) -> SlotCheckResult:
    """Check one variant of `slot` on `device` against the reference on every case.

    source: template path/text or rendered module text (see render_source); None with
    `variant` reads templates/kernels/<slot>/<variant>.py.j2. seed: None draws a fresh one
    (reported in the result). dtypes: default fp16 and bf16 on CUDA, fp32 on CPU.
    full: the long/wide cases too (default: on CUDA). interpret: run Triton kernels on the
    CPU through TRITON_INTERPRET=1 (slow; needs triton installed; for kernel development)."""
    if slot not in SLOT_FUNCTIONS:
        raise ValueError(f"unknown slot {slot!r}; slots: {', '.join(SLOT_FUNCTIONS)}")
    seed = secrets.randbits(31) if seed is None else int(seed)
    dev = torch.device(device)
    name = variant or "?"

    def failed(msg: str) -> SlotCheckResult:
        return SlotCheckResult(slot, name, device, seed, False, math.inf, msg, [], error=msg)

    try:
        text, name, devices = render_source(slot, source, variant, params)
    except Exception as e:  # noqa: BLE001 - reported, not raised: the caller is a search loop
        return failed(f"render_error: {type(e).__name__}: {e}")
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"
        text = text.replace(_INTERPRET_PRELUDE_LINE, "")
    elif dev.type not in devices:
        return failed(f"variant {name!r} declares devices {', '.join(devices)}; cannot check it on {dev.type}")
    try:
        module = import_module_text(text, f"{slot}_{name}")
    except Exception as e:  # noqa: BLE001
        return failed(f"import_error: {type(e).__name__}: {e}")
    fns = {}
    for fn in SLOT_FUNCTIONS[slot]:
        f = getattr(module, f"{fn}__{name}", None)
        if not callable(f):
            return failed(f"missing function {fn}__{name} (slot {slot} needs {', '.join(SLOT_FUNCTIONS[slot])})")
        fns[fn] = f
    for fn in OPTIONAL_FUNCTIONS.get(slot, ()):
        f = getattr(module, f"{fn}__{name}", None)
        if callable(f):
            fns[fn] = f

    if dtypes is None:
        dtypes = [torch.float16, torch.bfloat16] if dev.type == "cuda" else [torch.float32]
    dtypes = [DTYPE_NAMES[d] if isinstance(d, str) else d for d in dtypes]
    full = (dev.type == "cuda") if full is None else full
    impl = SLOTS[slot]
    results: list[CaseResult] = []
    for i, spec in enumerate(impl.specs(random.Random(seed), full)):
        for dtype in dtypes:
            case = f"{slot} case {i} [{impl.case_name(spec)} dtype={_NAME_OF_DTYPE[dtype]}]"
            try:
                inp = make_inputs(slot, spec, dtype, device, seed * 1000 + i)
                with full_precision_gemms():
                    checks = impl.run(fns, spec, inp, dtype)
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
            except Exception as e:  # noqa: BLE001
                results.append(CaseResult(case, False, math.inf, math.inf, f"{case}: runtime_error: "
                                          f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"))
                continue
            msgs = [m for _, _, m in checks if m]
            max_abs = max((a for a, _, _ in checks), default=0.0)
            ratio = max((r for _, r, _ in checks), default=0.0)
            results.append(CaseResult(case, not msgs, max_abs, ratio,
                                      "" if not msgs else f"{case}: " + "; ".join(msgs)))
    passed = all(c.passed for c in results) and bool(results)
    failures = [c for c in results if not c.passed]
    if failures:
        worst = failures[0].message
    else:
        top = max(results, key=lambda c: c.ratio)
        worst = f"{top.name}: max_abs_err={top.max_abs_err:.3g}, {top.ratio:.2f} of the tolerance"
    max_abs = max((c.max_abs_err for c in results), default=math.inf)
    return SlotCheckResult(slot, name, device, seed, passed, max_abs, worst, results)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slot", required=True, choices=sorted(SLOT_FUNCTIONS))
    ap.add_argument("--variant", help="a file stem in templates/kernels/<slot>/")
    ap.add_argument("--source", help="a library variant file, a variant's source or a rendered module (.py) instead")
    ap.add_argument("--device", default="auto", help="cpu, cuda or auto")
    ap.add_argument("--seed", type=int, default=None, help="default: a fresh one, printed")
    ap.add_argument("--dtype", default=None, help="comma list of fp32,fp16,bf16 (default by device)")
    ap.add_argument("--params", default="{}", help="JSON dict rendered into the template as params")
    ap.add_argument("--full", action="store_true", default=None, help="the long/wide cases also on CPU")
    ap.add_argument("--interpret", action="store_true", help="run Triton kernels through TRITON_INTERPRET=1")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args(argv)
    if not args.variant and not args.source:
        ap.error("give --variant or --source")
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    result = check_variant(args.slot, args.source, device, args.seed, variant=args.variant,
                           params=json.loads(args.params),
                           dtypes=args.dtype.split(",") if args.dtype else None,
                           full=args.full, interpret=args.interpret)
    if args.json:
        print(json.dumps(result.to_dict(), indent=1, default=str))
    else:
        for c in result.cases:
            print(f"{'ok  ' if c.passed else 'FAIL'} err={c.max_abs_err:<9.3g} tol-ratio={c.ratio:<6.2f} {c.name}")
            if c.message:
                print(f"     {c.message}")
        print(result.summary())
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
