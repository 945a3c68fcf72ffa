"""The cases of the slot unit checks (docs/design.md §5): per slot, the sizes, an input builder
and how one case is run and compared.

* Sizes cover the edges: N=1, odd N, head_dim 64/80/128/192 (on CUDA also the wide 256/384/512
  that random stress models draw), MHA/GQA/MQA, contexts that cross block boundaries, block
  sizes 16/32/64, long contexts and prompts (CUDA), ragged batches.
* Inputs are seeded and *poisoned* where a correct kernel must not read: unused KV-cache slots
  and unused block-table columns hold NaN or point at NaN blocks, so a kernel that reads past
  `context_lens` returns NaN; on CUDA the allocator is primed with NaN blocks of the output
  sizes before each call, so an output element the kernel forgot to write shows up as NaN.

Each slot: specs(rng, full) → concrete size dicts; build(spec, dtype, device, gen, cpu_gen) →
inputs; run(fns, spec, inputs, dtype) → list of (max_abs, ratio, message) per compared output.
`make_inputs` serves the benchmarks and the GPU scripts too.
"""
from __future__ import annotations

import math
import random
from typing import Callable, ClassVar

import torch

from evaluator.slot_compare import compare, pure_call, unchanged
from evaluator.slot_refs import (linear_silu_magnitudes, ref_add_rmsnorm, ref_decode_attention, ref_linear,
                                 ref_linear_add_norm, ref_linear_rope_cache, ref_linear_silu, ref_prefill_attention,
                                 ref_rmsnorm, ref_rope_cache, ref_silu_mul, rope_cache_magnitudes)
from evaluator.slots import CONTRACTS

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


def _qkv(spec: dict, n: int, q_scale: float, kv_scale: float, dtype, device, gen) -> list[torch.Tensor]:
    """Random q [n, Hq, D], k and v [n, Hkv, D] (drawn in that order); with `spec["fused_qkv"]`,
    strided views of one [n, (Hq + 2 Hkv) * D] buffer, the way an engine slices them out of a
    fused QKV projection."""
    parts = [_randn((n, h, spec["D"]), dtype, device, gen, scale)
             for h, scale in ((spec["Hq"], q_scale), (spec["Hkv"], kv_scale), (spec["Hkv"], kv_scale))]
    if not spec["fused_qkv"]:
        return parts
    fused = torch.cat([p.reshape(n, -1) for p in parts], dim=1)
    out, col = [], 0
    for p in parts:
        width = p.shape[1] * p.shape[2]
        out.append(fused[:, col:col + width].view(p.shape))
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
        y, err = pure_call(fns["rmsnorm"], {"x": x, "w": w, "eps": eps}, [want], x.device, twice)
        res.append(compare("rmsnorm y", y, want, dtype))
        res += [(0, 0, e) for e in (err, unchanged("rmsnorm x", before[0], x),
                                    unchanged("rmsnorm w", before[1], w)) if e]
        want_y, want_r = ref_add_rmsnorm(x, residual, w, eps)
        args = {"x": x.clone(), "residual": residual.clone(), "w": w, "eps": eps}
        out = fns["add_rmsnorm"](**args)  # not called twice: a variant may update x/residual in place
        if not (isinstance(out, tuple) and len(out) == 2):
            return res + [(math.inf, math.inf, f"add_rmsnorm: returned {type(out).__name__}, want (y, new_residual)")]
        res.append(compare("add_rmsnorm y", out[0], want_y, dtype))
        res.append(compare("add_rmsnorm new_residual", out[1], want_r, dtype))
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
        n = spec["N"]
        q, k, v = _qkv(spec, n, 2.0, 2.0, dtype, device, gen)
        return {"q": q, "k": k, "v": v,
                **_rope_cache_inputs(n, spec["Hkv"], spec["D"], spec["P"], spec["theta"], dtype, device, gen)}

    def run(self, fns, spec, inp, dtype):
        want_q, want_k, want_kc, want_vc = ref_rope_cache(**inp)
        before = {name: inp[name].clone() for name in ("v", "cos", "sin", "positions", "slot_mapping")}
        out = fns["rope_cache"](**inp)
        res = [] if out is None else [(0, 0, f"rope_cache returned {type(out).__name__}; it works in place and returns None")]
        res.append(compare("q (rotated in place)", inp["q"], want_q, dtype))
        res.append(compare("k (rotated in place)", inp["k"], want_k, dtype))
        res.append(compare("k_cache (slots by slot_mapping; the rest must stay NaN)", inp["k_cache"], want_kc, dtype))
        res.append(compare("v_cache (slots by slot_mapping; the rest must stay NaN)", inp["v_cache"], want_vc, dtype))
        res += [(0, 0, e) for e in (unchanged(name, t, inp[name]) for name, t in before.items()) if e]
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
                       # more prompts than a kernel may hold its boundaries for in registers
                       ([rng.randint(1, 4) for _ in range(1100)], 2, 1, 64, True),
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
        lens = spec["seq_lens"]
        q, k, v = _qkv(spec, sum(lens), spec["q_scale"], 1.0, dtype, device, gen)
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32, device=device)
        return {"q": q, "k": k, "v": v, "cu_seqlens": cu, "seq_lens": list(lens), "max_seqlen": max(lens),
                "scale": spec["scale_mult"] / math.sqrt(spec["D"])}

    def run(self, fns, spec, inp, dtype):
        want = ref_prefill_attention(**inp)
        before = {name: inp[name].clone() for name in ("q", "k", "v", "cu_seqlens")}
        out, err = pure_call(fns["prefill_attention"], inp, [want], want.device, want.device.type == "cuda")
        res = [compare("o", out, want, dtype)]
        res += [(0, 0, e) for e in [err] + [unchanged(name, t, inp[name]) for name, t in before.items()] if e]
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
        res = [compare("prefill_attention_rope_cache o", out, want, dtype),
               compare("prefill_attention_rope_cache k_cache (slots by slot_mapping; the rest must stay NaN)",
                       rope["k_cache"], want_kc, dtype),
               compare("prefill_attention_rope_cache v_cache (slots by slot_mapping; the rest must stay NaN)",
                       rope["v_cache"], want_vc, dtype)]
        res += [(0, 0, e) for e in [unchanged(f"prefill_attention_rope_cache {name}", t, rope[name])
                                    for name, t in before.items()] + [unchanged("prefill_attention_rope_cache v",
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
        out, err = pure_call(fns["decode_attention"], inp, [want], want.device, want.device.type == "cuda")
        res = [compare("o", out, want, dtype)]
        res += [(0, 0, e) for e in [err] + [unchanged(name, t, inp[name]) for name, t in before.items()] if e]
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
        out, err = pure_call(fns["silu_mul"], inp, [want], want.device, want.device.type == "cuda")
        res = [compare("out", out, want, dtype)]
        res += [(0, 0, e) for e in (err, unchanged("gate_up", before, inp["gate_up"])) if e]
        return res


_LINEAR_REFS = {"linear": ref_linear, "linear_silu": ref_linear_silu, "linear_add_norm": ref_linear_add_norm,
                "linear_rope_cache": ref_linear_rope_cache}


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
    # From the contract (evaluator/slots.py): function -> (reference, keyword arguments); OUTPUTS:
    # what each returns, one tensor or a tuple; IN_PLACE: arguments a function updates (compared
    # as outputs too, each call on fresh copies)
    FUNCTIONS: ClassVar[dict] = {f.name: (_LINEAR_REFS[f.name], f.arg_names) for f in CONTRACTS["linear"]}
    OUTPUTS: ClassVar[dict] = {f.name: f.output_names for f in CONTRACTS["linear"]}
    IN_PLACE: ClassVar[dict] = {f.name: f.writes for f in CONTRACTS["linear"] if f.writes}
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
            out, err = pure_call(fns[fn], args, want, device, device.type == "cuda")
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
            res += [compare(f"{fn} {name}", g, w, dtype, m) for name, g, w, m in zip(names, got, want, mags)]
            res += [(0, 0, err)] if err else []
        res += [(0, 0, e) for e in (unchanged(name, t, inp[name]) for name, t in before.items()) if e]
        return res


SLOT_CASES: dict[str, _Slot] = {s.name: s for s in (_Norm(), _RopeCache(), _PrefillAttention(), _DecodeAttention(),
                                                _SiluMul(), _Linear())}


def case_specs(slot: str, seed: int, full: bool) -> list[dict]:
    """The concrete sizes check_variant uses for (slot, seed); `full` adds the CUDA-sized ones."""
    return SLOT_CASES[slot].specs(random.Random(seed), full)


def make_inputs(slot: str, spec: dict, dtype: torch.dtype, device: str, seed: int = 0) -> dict:
    """Poisoned random inputs for one case, as keyword arguments of the slot's function(s).
    (For norm the dict also holds `residual`, used by add_rmsnorm.) Used by benchmarks too."""
    gen = torch.Generator(device=device).manual_seed(seed)
    cpu_gen = torch.Generator().manual_seed(seed)
    return SLOT_CASES[slot].build(spec, dtype, device, gen, cpu_gen)
