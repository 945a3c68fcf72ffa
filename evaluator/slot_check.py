"""Unit checks for one kernel variant of one slot (docs/design.md §5).

The pieces, one module each: the contract (the slots' functions and signatures,
evaluator/slots.py), the reference ops written from SPEC §3 numerics (evaluator/slot_refs.py),
the cases with their poisoned inputs (evaluator/slot_cases.py) and the tolerances and
comparisons (evaluator/slot_compare.py). This module loads a variant, runs the cases and
reports.

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

import torch

from evaluator.slot_cases import SLOT_CASES, make_inputs
from evaluator.slot_render import library_variant, render_slot_module
from evaluator.slots import OPTIONAL_FUNCTIONS, PRELUDE, SLOT_FUNCTIONS

DTYPE_NAMES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_NAME_OF_DTYPE = {v: k for k, v in DTYPE_NAMES.items()}
_HEADER = re.compile(r"#\s*slot:\s*(\w+)\s+variant:\s*(\w+)\s+devices:\s*([\w, ]+)")


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


# Swapped in for the renderer's prelude under --interpret: triton on the CPU (TRITON_INTERPRET=1).
_INTERPRET_PRELUDE_LINE = "    if not torch.cuda.is_available():\n        raise ImportError\n"
# ... and PDL off: the interpreter runs no gdc_wait (inline asm), and pdl is on by default, so on
# an sm_90 host, where the prelude finds PDL supported, every interpreted PDL kernel raised.
_INTERPRET_PDL = ("PDL_SUPPORTED = (", "PDL_SUPPORTED = False and (")


class _InterpretedLibdevice:
    """Stands in under --interpret for a variant's libdevice module, whose functions are extern
    stubs that the interpreter cannot run: each name is tl.math's function of that name (div_rn,
    exp, rsqrt, ...), looked up at call time, when the interpreter has patched tl.math."""

    def __getattr__(self, name: str):
        import triton.language as tl
        return getattr(tl.math, name)


def import_interpreted(text: str, tag: str = "variant"):
    """A rendered variant module imported to run its Triton kernels on the CPU: TRITON_INTERPRET=1
    (set for this process: triton.jit reads it as it decorates), the prelude's CUDA test dropped,
    PDL off, libdevice swapped for _InterpretedLibdevice. The interpreter runs a grid's programs
    one after another, in order."""
    os.environ["TRITON_INTERPRET"] = "1"
    module = import_module_text(text.replace(_INTERPRET_PRELUDE_LINE, "").replace(*_INTERPRET_PDL),
                                f"interpret_{tag}")
    for name, value in list(vars(module).items()):
        if getattr(value, "__name__", "").endswith(".libdevice") and type(value).__name__ == "module":
            setattr(module, name, _InterpretedLibdevice())
    return module


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
        out, linear = {}, SLOT_CASES["linear"]
        for fn, (_, arg_names) in linear.FUNCTIONS.items():
            args = {a: c[a].clone() if isinstance(c[a], torch.Tensor) else c[a] for a in arg_names}
            got, bad = linear.outputs(fn, fns[fn](**args))
            if bad:
                raise TypeError(bad)
            names = [fn] if len(got) == 1 else [f"{fn}.y", f"{fn}.r"]
            out.update(zip(names, got))
            out.update({f"{fn}.{a}": args[a][c["slot_mapping"]] for a in linear.IN_PLACE.get(fn, ())})
        return out
    return {"o": fns[slot](**c)}


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
    if not interpret and dev.type not in devices:
        return failed(f"variant {name!r} declares devices {', '.join(devices)}; cannot check it on {dev.type}")
    try:
        module = (import_interpreted if interpret else import_module_text)(text, f"{slot}_{name}")
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
    impl = SLOT_CASES[slot]
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
