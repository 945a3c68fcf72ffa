#!/usr/bin/env python3
"""Do the Triton kernels round like the reference? One device call: unit checks, ulp distances
to the torch variants, kernel timings, and whole engines against the reference in bf16 and fp16.

    python3 scripts/gpu_numerics_check.py [--sections unit,ulp,bench,engine,stress,pytest]
        [--unit REGEX] [--bench REGEX] [--plans torch,online,faithful,faithful-elem]
        [--stress torch:1,online:1,faithful:1,faithful:2] [--pytest-k EXPR]
        [--budget 480] [--baseline .numerics_old] [--out DIR]

Sections (each one's failures are reported, never fatal to the next):
  unit    evaluator.slot_check.check_variant of the faithful variants (norm, rope_cache, silu_mul
          `triton`; prefill/decode_attention `triton_exact`), fp16 and bf16, full case list, plus
          a few tuning params of the exact attention kernels.
  ulp     on random inputs, the distance in units in the last place of the compute dtype between
          each CUDA variant and the slot's torch variant (the reference's op order): fraction of
          elements bit-equal, fraction within 1 ulp, max ulp, max abs error; for attention also the
          error in ulps at max(|x|, rms/8) ("scaled": near-zero outputs of a sum are order noise).
          `old` = the elementwise kernels before the rounding change (from --baseline, see below).
  bench   triton.testing.do_bench (median, eager) and do_bench_cudagraph (median, replayed) of the
          attention variants at the public shapes (decode B=8, ctx 48/144; prefill 4x128; fp16,
          head_dim 192) and of the elementwise kernels before/after.
  engine  templates/engine/paged.py.j2 rendered with (a) torch slots, (b) the online Triton slots
          (before this change), (c) the faithful ones, (d) faithful elementwise + online attention;
          on a bf16 GQA config (public dims, 8 q x 2 kv heads, head_dim 80, 4 layers, toy scale,
          norm weights U[0.5, 1.5]) and the public fp16 config: run_public_sequence, then the quick
          stress scenarios of evaluator/traces.py on that config (every step checked, failures
          counted, not stopping), and bf16 noise on a 1034 + 11 token prefill (engine vs bf16
          reference vs fp32 reference).
  stress  evaluator.stress.run_stress(quick=True) for each plan:seed of --stress, while --budget lasts.
  pytest  the new tests of tests/test_kernels_gpu.py (-k "exact or faithful").

The `old` kernels: the `triton` variants of norm/rope_cache/silu_mul as they were before the
rounding change, read from --baseline (files <slot>.triton.py.j2), else from git (--baseline-rev).
They are rendered as variant `triton_old`.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from agent.plan import SLOTS, Plan  # noqa: E402
from agent.render import render_engine  # noqa: E402
from evaluator import slot_check  # noqa: E402
from evaluator.common import Tolerance, WrongResult, load_config, make_generator  # noqa: E402
from evaluator.reference_model import ReferenceModel  # noqa: E402
from evaluator.session import CheckedSession  # noqa: E402
from evaluator.slot_render import template_env  # noqa: E402
from evaluator.traces import QUICK, STRESS_SCENARIOS  # noqa: E402
from evaluator.weights import random_weights  # noqa: E402
from gpu_kernel_check import bench  # noqa: E402  (this script's folder is on sys.path)

OUT = Path(os.environ.get("OUT", "/tmp/gpu_numerics_check"))
ELEMENTWISE = ("norm", "rope_cache", "silu_mul")
T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


# --------------------------------------------------------------------------- old variants

def old_variants(baseline: str, rev: str) -> dict[tuple[str, str], str]:
    """{(slot, 'triton_old'): code} of the pre-change elementwise kernels: our own templates
    from git, rendered here with no params (engines insert extra variants verbatim)."""
    out = {}
    for slot in ELEMENTWISE:
        path = ROOT / baseline / f"{slot}.triton.py.j2"
        if path.is_file():
            text = path.read_text()
        else:
            try:
                text = subprocess.run(["git", "show", f"{rev}:templates/kernels/{slot}/triton.py.j2"], cwd=ROOT,
                                      capture_output=True, text=True, check=True).stdout
            except Exception:  # noqa: BLE001
                log(f"no baseline for {slot}: the 'old' rows are skipped")
                continue
        text = re.sub(r"__triton\b", "__triton_old", text)
        text = re.sub(r"(variant:\s*)triton(\s)", r"\1triton_old\2", text, count=1)
        out[(slot, "triton_old")] = template_env().from_string(text).render(params={})
    return out


def slot_fn(slot: str, variant: str, fn: str, extra: dict, params: dict | None = None):
    return slot_check.variant_function(slot, variant, fn, params, extra_variants=extra)


# --------------------------------------------------------------------------- ulps

ATTENTION_FLOOR = 1 / 8     # of the reference output's rms


def ulp_stats(got: torch.Tensor, want: torch.Tensor, floor: float = 0.0) -> dict:
    """exact/le1/max_ulp: bit distance (integers, monotone order); scaled: ulp_error at `floor`."""
    d = (slot_check.ulp_key(got) - slot_check.ulp_key(want)).abs()
    e = slot_check.ulp_error(got, want, floor)
    n = d.numel()
    return {"exact": (d == 0).sum().item() / n, "le1": (d <= 1).sum().item() / n, "max_ulp": int(d.max().item()),
            "le1_scaled": (e <= 1).sum().item() / n, "max_scaled": e.max().item(),
            "max_abs": (got.float() - want.float()).abs().max().item(), "n": n}


ULP_SPECS = {
    "norm": [{"N": 512, "H": 768, "eps": 1e-5, "x_scale": 3.0, "row_strided": False},
             {"N": 64, "H": 2048, "eps": 1e-6, "x_scale": 0.5, "row_strided": True}],
    "rope_cache": [{"N": 512, "Hq": 4, "Hkv": 4, "D": 192, "fused_qkv": True, "P": 4096, "theta": 10000.0},
                   {"N": 300, "Hq": 8, "Hkv": 2, "D": 80, "fused_qkv": True, "P": 4096, "theta": 500000.0}],
    "silu_mul": [{"N": 512, "I": 3072}, {"N": 64, "I": 8192}],
    "prefill_attention": [{"seq_lens": [128] * 4, "Hq": 4, "Hkv": 4, "D": 192, "fused_qkv": True,
                           "q_scale": 3.0, "scale_mult": 1.0},
                          {"seq_lens": [1034, 11, 300], "Hq": 8, "Hkv": 2, "D": 80, "fused_qkv": True,
                           "q_scale": 1.0, "scale_mult": 1.0}],
    "decode_attention": [{"ctx": [48, 144, 47, 145, 1, 16, 200, 96], "Hq": 4, "Hkv": 4, "D": 192,
                          "block_size": 16, "max_context": "bound", "q_scale": 3.0, "scale_mult": 1.0},
                         {"ctx": [1034, 11, 300, 700, 5], "Hq": 8, "Hkv": 2, "D": 80, "block_size": 16,
                          "max_context": "bound", "q_scale": 1.0, "scale_mult": 1.0}],
}
ULP_VARIANTS = {"norm": ["triton_old", "triton"], "rope_cache": ["triton_old", "triton"],
                "silu_mul": ["triton_old", "triton"],
                "prefill_attention": ["triton", "sdpa", "triton_exact"],
                "decode_attention": ["triton_split", "triton_exact"]}


def run_ulp(extra: dict, select: str = "") -> list[dict]:
    rows = []
    for slot, variants in ULP_VARIANTS.items():
        if select and not re.search(select, slot):
            continue
        ref_fns = {fn: slot_fn(slot, "torch", fn, extra) for fn in slot_check.SLOT_FUNCTIONS[slot]}
        for entry in variants:
            variant, params = entry if isinstance(entry, tuple) else (entry, None)
            if variant.endswith("_old") and (slot, variant) not in extra:
                continue
            try:
                fns = {fn: slot_fn(slot, variant, fn, extra, params) for fn in slot_check.SLOT_FUNCTIONS[slot]}
            except Exception as e:  # noqa: BLE001
                log(f"ulp {slot}/{variant}: load failed {type(e).__name__}: {e}")
                continue
            for dtype in (torch.bfloat16, torch.float16):
                agg: dict[str, dict] = {}
                try:
                    for i, spec in enumerate(ULP_SPECS[slot]):
                        for seed in (11, 12):
                            inp = slot_check.make_inputs(slot, spec, dtype, "cuda", seed=seed * 100 + i)
                            want = slot_check.slot_outputs(slot, ref_fns, inp)
                            got = slot_check.slot_outputs(slot, fns, inp)
                            for name in want:
                                floor = (ATTENTION_FLOOR * want[name].float().pow(2).mean().sqrt().item()
                                         if slot.endswith("attention") else 0.0)
                                s = ulp_stats(got[name], want[name], floor)
                                a = agg.setdefault(name, {"exact": 0.0, "le1": 0.0, "le1_scaled": 0.0, "max_ulp": 0,
                                                          "max_scaled": 0.0, "max_abs": 0.0, "n": 0})
                                for k in ("exact", "le1", "le1_scaled"):
                                    a[k] += s[k] * s["n"]
                                a["n"] += s["n"]
                                for k in ("max_ulp", "max_scaled", "max_abs"):
                                    a[k] = max(a[k], s[k])
                except Exception as e:  # noqa: BLE001
                    log(f"ulp {slot}/{variant}: {type(e).__name__}: {str(e)[:300]}")
                    continue
                for name, a in agg.items():
                    row = {"slot": slot, "variant": variant + (f" {json.dumps(params)}" if params else ""), "dtype": str(dtype).split(".")[-1], "output": name,
                           "exact": a["exact"] / a["n"], "le1": a["le1"] / a["n"], "max_ulp": a["max_ulp"],
                           "le1_scaled": a["le1_scaled"] / a["n"], "max_scaled": a["max_scaled"],
                           "max_abs": a["max_abs"]}
                    rows.append(row)
                    log(f"ulp {slot:18s} {row['variant']:13s} {row['dtype']:9s} {name:14s} exact {100 * row['exact']:7.3f}%  "
                        f"<=1ulp {100 * row['le1']:7.3f}%  max {row['max_ulp']:5d} ulp  scaled: <=1 "
                        f"{100 * row['le1_scaled']:7.3f}% max {row['max_scaled']:.2f}  max abs {row['max_abs']:.3g}")
    return rows


# --------------------------------------------------------------------------- unit checks

UNIT = [("norm", "triton", None), ("rope_cache", "triton", None), ("silu_mul", "triton", None),
        ("prefill_attention", "triton_exact", None), ("decode_attention", "triton_exact", None),
        ("decode_attention", "triton_exact", {"decode_splits": 1}),
        ("decode_attention", "triton_exact", {"decode_splits": 7, "decode_block_n": 16}),
        ("decode_attention", "triton_exact", {"decode_splits": 32, "decode_block_n": 64, "decode_warps": 8}),
        ("prefill_attention", "triton_exact", {"prefill_block_m": 128, "prefill_block_n": 32, "prefill_warps": 8}),
        ("prefill_attention", "triton_exact", {"prefill_block_m": 16, "prefill_block_n": 16, "prefill_stages": 1})]


def run_unit(select: str = "") -> list[dict]:
    rows = []
    for slot, variant, params in UNIT:
        if select and not re.search(select, f"{slot}/{variant} {json.dumps(params) if params else ''}"):
            continue
        t = time.time()
        r = slot_check.check_variant(slot, variant=variant, device="cuda", seed=20261122, params=params,
                                     full=params is None)
        worst = max((c.ratio for c in r.cases), default=math.inf)
        rows.append({"slot": slot, "variant": variant, "params": params, "passed": r.passed,
                     "cases": len(r.cases), "max_abs_err": r.max_abs_err, "worst_ratio": worst,
                     "summary": r.summary(), "seconds": time.time() - t})
        log(f"unit {slot}/{variant} {params or ''}: {'PASS' if r.passed else 'FAIL'} {len(r.cases)} cases, "
            f"max err {r.max_abs_err:.3g}, worst {worst:.2f} of tol ({time.time() - t:.0f}s)")
        if not r.passed:
            log("   " + r.summary().replace("\n", "\n   ")[:1500])
    return rows


# --------------------------------------------------------------------------- timings

def run_bench(extra: dict, select: str = "") -> list[dict]:
    rows = []
    dt = torch.float16
    problems = []
    for ctx in (48, 144):
        spec = {"ctx": [ctx] * 8, "Hq": 4, "Hkv": 4, "D": 192, "block_size": 16, "max_context": "exact",
                "q_scale": 1.0, "scale_mult": 1.0}
        inp = slot_check.make_inputs("decode_attention", spec, dt, "cuda", seed=1)
        for variant, params in (("triton_split", None), ("triton_exact", None), ("triton_split", {"decode_splits": 1}),
                                ("triton_exact", {"decode_splits": 1})):
            problems.append((f"decode B=8 ctx={ctx}", "decode_attention", variant, params, "decode_attention", inp))
    spec = {"seq_lens": [128] * 4, "Hq": 4, "Hkv": 4, "D": 192, "fused_qkv": True, "q_scale": 1.0, "scale_mult": 1.0}
    inp = slot_check.make_inputs("prefill_attention", spec, dt, "cuda", seed=1)
    for variant, params in (("triton", None), ("triton_exact", None)):
        problems.append(("prefill 4x128", "prefill_attention", variant, params, "prefill_attention", inp))
    for n in (8, 512):
        norm = slot_check.make_inputs("norm", {"N": n, "H": 768, "eps": 1e-5, "x_scale": 1.0, "row_strided": False},
                                      dt, "cuda", seed=1)
        rope = slot_check.make_inputs("rope_cache", {"N": n, "Hq": 4, "Hkv": 4, "D": 192, "fused_qkv": True,
                                                     "P": 4096, "theta": 10000.0}, dt, "cuda", seed=1)
        silu = slot_check.make_inputs("silu_mul", {"N": n, "I": 3072}, dt, "cuda", seed=1)
        for variant in ("triton_old", "triton"):
            if ("norm", "triton_old") in extra or variant == "triton":
                problems.append((f"add_rmsnorm N={n}", "norm", variant, None, "add_rmsnorm", norm))
                problems.append((f"rope_cache N={n}", "rope_cache", variant, None, "rope_cache", rope))
                problems.append((f"silu_mul N={n}", "silu_mul", variant, None, "silu_mul", silu))
    for label, slot, variant, params, fn, kwargs in problems:
        if select and not re.search(select, label):
            continue
        try:
            f = slot_fn(slot, variant, fn, extra, params)
        except Exception as e:  # noqa: BLE001
            log(f"bench {label} {variant}: load failed: {type(e).__name__}: {str(e)[:200]}")
            continue
        g_us, e_us = bench(lambda: f(**kwargs))
        name = variant + (f" {json.dumps(params)}" if params else "")
        rows.append({"problem": label, "variant": name, "eager_us": e_us, "graph_us": g_us})
        log(f"bench {label:20s} {name:40s} eager {e_us:7.1f} us  graph {g_us:7.1f} us")
    return rows


# --------------------------------------------------------------------------- engines

def plans() -> dict[str, Plan]:
    torch_slots = {s: "torch" for s in SLOTS}
    online = {"norm": "triton_old", "rope_cache": "triton_old", "silu_mul": "triton_old",
              "prefill_attention": "triton", "decode_attention": "triton_split"}
    faithful = {"norm": "triton", "rope_cache": "triton", "silu_mul": "triton",
                "prefill_attention": "triton_exact", "decode_attention": "triton_exact"}
    elem = {**faithful, "prefill_attention": "triton", "decode_attention": "triton_split"}
    return {"torch": Plan("paged", torch_slots), "online": Plan("paged", online),
            "faithful": Plan("paged", faithful), "faithful-elem": Plan("paged", elem)}


def render_to_file(plan: Plan, name: str, extra: dict) -> Path:
    path = Path(tempfile.mkdtemp(prefix="numerics-")) / f"engine_{re.sub(r'[^0-9A-Za-z]', '_', name)}.py"
    path.write_text(render_engine(plan, extra))
    return path


def configs(tmp: Path) -> dict[str, tuple[dict, dict, str]]:
    public = load_config(ROOT / "target/model_config.json")
    gqa = {**public, "torch_dtype": "bfloat16", "num_attention_heads": 8, "num_key_value_heads": 2,
           "head_dim": 80, "num_hidden_layers": 4}
    out = {}
    for name, cfg, kw in (("gqa-bf16", gqa, {"norm_spread": 0.5}), ("public-fp16", public, {})):
        weights = random_weights(cfg, seed=0, **kw)
        (tmp / name).mkdir(parents=True, exist_ok=True)
        torch.save(weights, tmp / name / "model.pt")
        out[name] = (cfg, weights, str(tmp / name))
    return out


def scenario_check(module_path: Path, cfg: dict, weights: dict, wdir: str) -> dict:
    """The quick stress scenarios on one config, every step compared; a mismatch is counted and
    the trace goes on (the engine's state is still right, only its numbers are off)."""
    from evaluator.common import load_engine_module
    module = load_engine_module(module_path)
    engine = module.create_engine(cfg, wdir, "cuda")
    reference = ReferenceModel(cfg, weights, "cuda")
    rng = random.Random(0)
    gen = make_generator(7, "cuda")
    stats = {"calls": 0, "failed_calls": 0, "max_abs_err": 0.0, "worst_margin": math.inf, "where": ""}
    for name, scenario in STRESS_SCENARIOS.items():
        session = CheckedSession(engine, reference, gen, Tolerance(), label=f"{name}: ")
        for op in scenario(rng, QUICK):
            try:
                session.step(op)
            except WrongResult as e:
                stats["failed_calls"] += 1
                if not stats["where"]:
                    stats["where"] = str(e)[:200]
        s = session.stats
        stats["calls"] += s.calls
        stats["max_abs_err"] = max(stats["max_abs_err"], s.max_abs_err)
        stats["worst_margin"] = min(stats["worst_margin"], s.worst_margin)
    return stats


@torch.no_grad()
def bf16_noise(module_path: Path, cfg: dict, weights: dict, wdir: str) -> dict:
    from evaluator.common import load_engine_module
    module = load_engine_module(module_path)
    engine = module.create_engine(cfg, wdir, "cuda")
    ref16 = ReferenceModel(cfg, weights, "cuda")
    ref32 = ReferenceModel(cfg, weights, "cpu")
    gen = make_generator(3, "cuda")
    prompts = [torch.randint(0, cfg["vocab_size"], (n,), generator=gen, device="cuda") for n in (1034, 11)]
    got = engine.prefill([0, 1], prompts).float().cpu()
    r16 = torch.stack([ref16.last_logits(p) for p in prompts]).float().cpu()
    r32 = torch.stack([ref32.last_logits(p.cpu()) for p in prompts]).float()
    return {"engine_vs_ref": (got - r16).abs().amax(-1).tolist(),
            "ref_vs_fp32": (r16 - r32).abs().amax(-1).tolist(),
            "engine_vs_fp32": (got - r32).abs().amax(-1).tolist()}


def run_engine(setups: dict, paths: dict) -> dict:
    from evaluator.test_correctness import run_public_sequence
    res = {}
    for pname, path in paths.items():
        res[pname] = r = {}
        for sname, (cfg, weights, wdir) in setups.items():
            if pname == "faithful-elem" and sname != "gqa-bf16":
                continue
            t = time.time()
            try:
                pub = run_public_sequence(str(path), cfg, wdir, "cuda")
                r[f"{sname} public"] = {"max_abs_err": pub["max_abs_err"], "worst_margin": pub["worst_margin"],
                                        "status": "passed"}
            except Exception as e:  # noqa: BLE001
                r[f"{sname} public"] = {"status": "failed", "error": f"{type(e).__name__}: {str(e)[:300]}"}
            try:
                r[f"{sname} scenarios"] = scenario_check(path, cfg, weights, wdir)
            except Exception as e:  # noqa: BLE001
                r[f"{sname} scenarios"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                log(traceback.format_exc()[-1500:])
            if sname == "gqa-bf16":
                try:
                    r["bf16 noise"] = bf16_noise(path, cfg, weights, wdir)
                except Exception as e:  # noqa: BLE001
                    r["bf16 noise"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            log(f"engine {pname} {sname} ({time.time() - t:.0f}s): public {r[f'{sname} public']} "
                f"scenarios {r[f'{sname} scenarios']}")
        if "bf16 noise" in r:
            log(f"engine {pname} bf16 noise {r['bf16 noise']}")
    return res


def run_stress_section(paths: dict, runs: list[tuple[str, int]], deadline: float) -> dict:
    from evaluator.stress import run_stress
    res = {}
    for pname, seed in runs:
        if True:
            if pname not in paths:
                continue
            if time.time() > deadline:
                log(f"stress: budget spent before seed {seed} {pname}")
                return res
            t = time.time()
            try:
                report = run_stress(str(paths[pname]), "cuda", seed=seed, quick=True)
                cases = [{"name": c.name, "passed": c.passed, "max_abs_err": c.max_abs_err,
                          "worst_margin": c.worst_margin} for c in report.cases]
            except Exception as e:  # noqa: BLE001
                cases = [{"name": "error", "passed": False, "max_abs_err": math.nan, "worst_margin": math.nan,
                          "error": f"{type(e).__name__}: {str(e)[:300]}"}]
            res.setdefault(pname, {})[seed] = cases
            log(f"stress {pname} seed {seed} ({time.time() - t:.0f}s): {stress_summary(cases)}")
    return res


def stress_summary(cases: list[dict]) -> str:
    """Passed count, then the worst margin of the bf16 cases (with their max error) and of the rest."""
    bf = [c for c in cases if "bf16" in c["name"] or "bfloat16" in c["name"]]
    hf = [c for c in cases if c not in bf]
    return (f"{sum(c['passed'] for c in cases)}/{len(cases)} passed, "
            f"bf16 margin {min((c['worst_margin'] for c in bf), default=math.nan):.3f} "
            f"(max err {max((c['max_abs_err'] for c in bf), default=math.nan):.3g}), "
            f"fp16 margin {min((c['worst_margin'] for c in hf), default=math.nan):.3f}")


# --------------------------------------------------------------------------- main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sections", default="unit,ulp,bench,engine,stress,pytest")
    ap.add_argument("--plans", default="torch,online,faithful,faithful-elem", help="engine section's plans")
    ap.add_argument("--stress", default="torch:1,online:1,faithful:1,faithful:2",
                    help="plan:seed runs of the stress section, in order")
    ap.add_argument("--unit", default="", help="regex on 'slot/variant params-json': the unit checks to run")
    ap.add_argument("--bench", default="", help="regex on the problem label: the timings to run")
    ap.add_argument("--ulp", default="", help="regex on the slot: the ulp comparisons to run")
    ap.add_argument("--pytest-k", default="exact or faithful")
    ap.add_argument("--budget", type=float, default=480.0, help="seconds; stress and pytest stop when it is spent")
    ap.add_argument("--baseline", default=".numerics_old")
    ap.add_argument("--baseline-rev", default="4d9d6d1")
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    sections = a.sections.split(",")
    deadline = T0 + a.budget
    import triton
    log(f"GPU {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    extra = old_variants(a.baseline, a.baseline_rev)
    results: dict = {}

    def save():
        (out / "numerics.json").write_text(json.dumps(results, indent=1, default=str))

    for section in ("unit", "ulp", "bench"):
        if section in sections:
            try:
                results[section] = {"unit": lambda: run_unit(a.unit), "ulp": lambda: run_ulp(extra, a.ulp),
                                    "bench": lambda: run_bench(extra, a.bench)}[section]()
            except Exception as e:  # noqa: BLE001
                results[section] = {"error": f"{type(e).__name__}: {e}"}
                log(traceback.format_exc()[-2000:])
            save()
            torch.cuda.empty_cache()

    paths = {}
    if "engine" in sections or "stress" in sections:
        wanted = set(a.plans.split(",")) | {r.split(":")[0] for r in a.stress.split(",") if r}
        paths = {name: render_to_file(plan, name, extra) for name, plan in plans().items()
                 if name in wanted and all(v in ("torch", "triton", "triton_split", "triton_exact", "sdpa") or (s, v) in extra
                        for s, v in plan.slots.items())}
    if "engine" in sections:
        setups = configs(Path(tempfile.mkdtemp(prefix="numerics-weights-")))
        results["engine"] = run_engine(setups, {k: v for k, v in paths.items() if k in a.plans.split(",")})
        save()
    if "stress" in sections:
        runs = [(r.split(":")[0], int(r.split(":")[1])) for r in a.stress.split(",") if r]
        results["stress"] = run_stress_section(paths, runs, deadline - 90 if "pytest" in sections else deadline)
        save()
    if "pytest" in sections:
        left = int(deadline - time.time())
        if left < 30:
            log("pytest: no budget left")
        else:
            cmd = [sys.executable, "-m", "pytest", "-q", "-rf", "--tb=short", "-p", "no:cacheprovider",
                   "tests/test_kernels_gpu.py", "-k", a.pytest_k]
            try:
                p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=left)
                text = p.stdout + p.stderr
            except subprocess.TimeoutExpired as e:
                text = (e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")) + "\nTIMEOUT"
            (out / "pytest.log").write_text(text)
            results["pytest"] = [ln for ln in text.splitlines() if ln.startswith(("FAILED", "ERROR"))
                                 or " passed" in ln or " failed" in ln or "TIMEOUT" in ln][-30:]
            save()

    # ---- summary tables ----
    print("\n==== summary ====")
    for r in results.get("unit", []) if isinstance(results.get("unit"), list) else []:
        print(f"unit  {r['slot']}/{r['variant']} {json.dumps(r['params']) if r['params'] else ''}: "
              f"{'PASS' if r['passed'] else 'FAIL'} {r['cases']} cases, max err {r['max_abs_err']:.3g}, "
              f"worst {r['worst_ratio']:.2f} of tol")
    if isinstance(results.get("ulp"), list):
        print("ulp vs torch variant: slot variant dtype output | exact% <=1ulp% max_ulp | scaled: <=1% max | max_abs")
        for r in results["ulp"]:
            print(f"  {r['slot']:18s} {r['variant']:13s} {r['dtype']:9s} {r['output']:14s} | {100 * r['exact']:7.3f} "
                  f"{100 * r['le1']:7.3f} {r['max_ulp']:5d} | {100 * r['le1_scaled']:7.3f} {r['max_scaled']:6.2f} | "
                  f"{r['max_abs']:.3g}")
    if isinstance(results.get("bench"), list):
        print("bench (fp16, public shapes): problem variant | eager us (do_bench median) | graph us")
        for r in results["bench"]:
            print(f"  {r['problem']:20s} {r['variant']:40s} | {r['eager_us']:7.1f} | {r['graph_us']:7.1f}")
    for pname, r in results.get("engine", {}).items():
        for k, v in r.items():
            if k == "bf16 noise":
                print(f"engine {pname:14s} {k:22s} " + " ".join(
                    f"{kk}={[round(x, 4) for x in vv]}" if isinstance(vv, list) else f"{kk}={vv}" for kk, vv in v.items()))
            else:
                print(f"engine {pname:14s} {k:22s} max err {v.get('max_abs_err', math.nan):.4g} margin "
                      f"{v.get('worst_margin', math.nan):.3f} failed calls {v.get('failed_calls', '-')}/"
                      f"{v.get('calls', '-')} {v.get('status', '')} {v.get('error', '')[:120]} {v.get('where', '')[:100]}")
    for pname, by_seed in results.get("stress", {}).items():
        for seed, cases in by_seed.items():
            print(f"stress {pname:9s} seed {seed}: {stress_summary(cases)}")
    for ln in results.get("pytest", []):
        print(f"pytest {ln}")
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
