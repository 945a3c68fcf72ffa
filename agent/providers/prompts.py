"""What the model is told: the prompts in templates/prompts/ and the facts they are filled with.

Everything a prompt contains is derived from the search state, the template tree and the
judge's and unit worker's reports, never from the clock, so the same run state renders the same
prompt (a replayed run sends the very requests the recorded one did). The per-slot time split is
the evaluator's profiled pass (EvalResult.slot_ms, docs/evaluator.md) when the best engine has
one, else an estimate from kernel counts, and the prompt says which.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import jinja2

from agent import policy
from agent.plan import KERNELS, REFERENCE_VARIANT, TEMPLATES, engine_params, engines, graph_unsafe, menu
from agent.records import Candidate, EvalResult, SearchState
from evaluator.slot_render import render_kernel
from evaluator.slot_shapes import DEFAULT_FUSED_ROWS, CallShape, Dims, ShapeTiming, call_shapes
from evaluator.slots import CONTRACTS, SLOT_FUNCTIONS
from evaluator.traces import PUBLIC_CASES

PROMPTS = TEMPLATES / "prompts"
# Launch-bound regime (SPEC §6): a layer's time follows its kernel count. Per layer: two
# norms, one RoPE+cache write, one attention, one SiLU·mul, four GEMMs (the linear slot).
LAUNCHES_PER_LAYER = {"norm": 2, "rope_cache": 1, "attention": 1, "silu_mul": 1, "linear": 4}
ATTENTION = ("prefill_attention", "decode_attention")
ESTIMATED = ("estimated from kernel counts per layer (at these sizes a step is launch-bound), "
             "attention split by prefill/decode tokens; not measured")
MEASURED = "measured: the evaluator's profiled pass of the best engine"
OTHER = "other"   # EvalResult.slot_ms's time outside every slot (unfused GEMMs, embedding, lm_head, host)
# Peak DRAM bandwidth by GPU name, for when the driver does not say (GB/s, vendor figures).
BANDWIDTH_GBS = {"H200": 4800, "H100": 3350, "A100": 2039, "L40S": 864, "L4": 300, "A10": 600}
# Dense fp16/bf16 tensor-core peak by GPU name (TFLOP/s, vendor figures without sparsity).
PEAK_TFLOPS = {"H200": 989, "H100": 989, "A100": 312, "L40S": 362, "L4": 121, "A10": 125}
SHAPES_SHOWN = 6      # call shapes per slot in a prompt, most called first
JUDGED_SHOWN = 10     # judged plans in a prompt, best first
MAX_FUSED_ROWS = 1 << 16   # a profiled pass's fused_rows above this is not believed (the worker's claim)


@dataclass(frozen=True)
class SlotInfo:
    name: str
    functions: tuple[str, ...]   # the functions every variant defines (evaluator/slots.py)
    contract: str        # the reference variant's `# contract` comment block (the numerics)
    reference: str       # the reference variant's code
    signatures: tuple[str, ...]  # one line per function: `fn__<variant>(args) -> outputs` with shapes and contract
    optional: tuple[str, ...] = ()   # the same for the functions a variant may also define


def slot_info(slot: str, variant: str) -> SlotInfo:
    """The contract for writing `variant` of `slot`: signatures from evaluator/slots.py, the
    numerics and the reference code from the slot's torch variant."""
    lines = (KERNELS / slot / f"{REFERENCE_VARIANT}.py.j2").read_text().splitlines()
    head = 0
    while head < len(lines) and lines[head].startswith("#"):
        head += 1
    title = next((i for i in range(head) if lines[i].startswith("# contract")), 0)
    contract = "\n".join(line.lstrip("#")[1:] if line.startswith("# ") else line.lstrip("#")
                         for line in lines[title + 1:head])   # below the header lines and the block's title
    reference = "\n".join(lines[head:]).strip("\n")
    required = tuple(f.describe(variant) for f in CONTRACTS[slot] if not f.optional)
    optional = tuple(f.describe(variant) for f in CONTRACTS[slot] if f.optional)
    return SlotInfo(slot, SLOT_FUNCTIONS[slot], contract.strip("\n"), reference, required, optional)


def hardware_facts(state: SearchState) -> dict[str, object]:
    """The run's hardware facts, plus SM count, memory and bandwidth when a GPU can say."""
    facts = dict(state.hardware)
    if state.device != "cuda":
        return facts
    try:
        import torch
        props = torch.cuda.get_device_properties(0)
    except Exception:  # noqa: BLE001 - facts are a courtesy; the prompt goes without them
        return facts
    facts.setdefault("gpu", props.name)
    facts["compute capability"] = f"sm_{props.major}{props.minor}"
    facts["streaming multiprocessors"] = props.multi_processor_count
    facts["memory"] = f"{props.total_memory / 2**30:.0f} GiB"
    l2 = getattr(props, "L2_cache_size", 0)
    if l2:
        facts["L2 cache"] = f"{l2 / 2**20:.0f} MiB"
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in props.name), None)
    if peak:
        facts["peak fp16/bf16 tensor throughput"] = f"{peak} TFLOP/s dense (vendor figure)"
    facts["torch"] = torch.__version__
    try:
        import triton
        facts["triton"] = triton.__version__
    except ImportError:
        facts["triton"] = "not installed"
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    if clock_khz and bus_bits:
        facts["peak memory bandwidth"] = f"{2 * clock_khz * 1e3 * bus_bits / 8 / 1e9:.0f} GB/s"
    else:
        known = next((v for k, v in BANDWIDTH_GBS.items() if k in props.name), None)
        if known:
            facts["peak memory bandwidth"] = f"{known} GB/s (vendor figure)"
    return facts


@dataclass
class Profile:
    source: str
    shares: list[tuple[str, float]]                       # largest first
    cases: list[dict] = field(default_factory=list)        # name, elapsed_ms, tokens, floor_fraction

    def share(self, slot: str) -> float:
        return dict(self.shares).get(slot, 0.0)


def measured_shares(slot_ms: dict | None) -> list[tuple[str, float]]:
    """Shares of the profiled pass's time per slot and OTHER (EvalResult.slot_ms), largest first;
    [] when there is no usable profile."""
    if not isinstance(slot_ms, dict) or not isinstance(slot_ms.get("slots"), dict):
        return []
    ms = {slot: float(v.get("ms") or 0.0) for slot, v in slot_ms["slots"].items() if isinstance(v, dict)}
    ms[OTHER] = float(slot_ms.get("other_ms") or 0.0)
    total = sum(ms.values())
    if total <= 0:
        return []
    return sorted(((k, v / total) for k, v in ms.items()), key=lambda kv: -kv[1])


def profile(result: EvalResult | None) -> Profile:
    """Where the best engine's time goes: the evaluator's profiled pass, else the estimate."""
    bench = list(result.benchmark) if result is not None else []
    cases = [{"name": c.get("case_name", "?"), "elapsed_ms": float(c.get("elapsed_ms") or 0.0),
              "tokens": int(c.get("total_tokens") or 0), "floor_fraction": float(c.get("floor_fraction") or 0.0)}
             for c in bench]
    measured = measured_shares(result.slot_ms if result is not None else None)
    if measured:
        profiled = result.slot_ms.get("cases")
        parts = [str(result.slot_ms.get("source") or ""),
                 "cases " + ", ".join(map(str, profiled)) if isinstance(profiled, list) and profiled else ""]
        where = "; ".join(part for part in parts if part)
        return Profile(f"{MEASURED} ({where})" if where else MEASURED, measured, cases)
    prefill = sum(int(c.get("prefill_tokens") or 0) for c in bench)
    decode = sum(int(c.get("decode_tokens") or 0) for c in bench)
    prefill_part = prefill / (prefill + decode) if prefill + decode else 0.5
    total = sum(LAUNCHES_PER_LAYER.values())
    shares = {}
    for name, launches in LAUNCHES_PER_LAYER.items():
        if name == "attention":
            shares["prefill_attention"] = launches / total * prefill_part
            shares["decode_attention"] = launches / total * (1 - prefill_part)
        else:
            shares[name] = launches / total
    return Profile(ESTIMATED, sorted(shares.items(), key=lambda kv: -kv[1]), cases)


def plan_menu(device: str, llm_variants: dict[str, list[str]]) -> str:
    """The library as the model may choose from it, for this device."""
    out = []
    for engine in engines():
        params = engine_params(engine)
        if not params:
            out.append(f"- engine `{engine}` (ignores slots; the conservative reference engine)")
            continue
        out.append(f"- engine `{engine}`, parameters:")
        for p in params.values():
            if device in p.devices:
                choices = ", ".join(json.dumps(c) for c in p.choices)
                out.append(f"  - `{p.name}` (default {json.dumps(p.default)}): {choices}")
    out.append("- slot variants on this device:")
    for slot, variants in menu().items():
        names = [v.name for v in variants if device in v.devices] + llm_variants.get(slot, [])
        out.append(f"  - `{slot}`: {', '.join(names)}")
    return "\n".join(out)


def _env() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(PROMPTS)), undefined=jinja2.StrictUndefined,
                              keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True)


def render(name: str, **context) -> str:
    return _env().get_template(f"{name}.j2").render(**context).strip() + "\n"


def allowed_imports() -> str:
    return ", ".join(sorted(m for m in policy.KERNEL_IMPORTS if m != "__future__"))


def best_plan_json(best: Candidate | None) -> str:
    return json.dumps(best.plan.to_dict() if best else {}, indent=1, sort_keys=True)


def model_dims(state: SearchState) -> Dims:
    s = state.spec
    return Dims(s.hidden, s.intermediate, s.heads, s.kv_heads, s.head_dim, s.layers, s.eps, s.theta, s.max_positions)


def fused_rows(state: SearchState, slot: str = "") -> int:
    """The limit on the passes that run the linear slot's fused functions, for a variant of `slot`
    in the best engine: what its profiled pass reported (the engine's own Kernels.fused_rows), else
    the binding's rule (templates/engine/paged/binding.py.j2): 0 for the torch linear variant on
    CUDA, the plan's `fused_rows` otherwise. A linear variant written for CUDA replaces the torch
    one, so it runs at the plan's limit. (The plan param alone was wrong on CUDA with the torch
    variant and on a CPU whose engine packs its weights for oneDNN: then every pass runs unfused.)"""
    plan = state.best.plan if state.best is not None else None
    param = int(plan.params.get("fused_rows", DEFAULT_FUSED_ROWS)) if plan is not None else DEFAULT_FUSED_ROWS
    if slot == "linear" and state.device == "cuda":
        return param
    slot_ms = state.best_result.slot_ms if state.best_result is not None else None
    reported = slot_ms.get("fused_rows") if isinstance(slot_ms, dict) else None
    if isinstance(reported, int) and not isinstance(reported, bool) and 0 <= reported <= MAX_FUSED_ROWS:
        return reported
    if plan is not None and state.device == "cuda" and plan.slots.get("linear", REFERENCE_VARIANT) == REFERENCE_VARIANT:
        return 0
    return param


# The slots whose variant decides whether the paged engine captures a pass as a CUDA graph
# (templates/engine/paged.py.j2 graph_safe_*), and the plan param that turns those graphs on;
# decode first: decode steps dominate four of the five benchmark cases.
GRAPHED_SLOTS = {"decode_attention": "decode_graphs", "prefill_attention": "prefill_graphs"}


def graph_blocking(state: SearchState, variants: dict | None = None) -> list[str]:
    """The slots whose variant in the best engine keeps it from capturing CUDA graphs on a GPU
    (`# graphs: no`, agent/plan.py graph_unsafe) where the plan has those graphs on: the passes
    that call them run eagerly, every kernel launched from the host. `variants`: model-written
    ones beside the best's own. In GRAPHED_SLOTS' order."""
    best = state.best
    if state.device != "cuda" or best is None:
        return []
    params = engine_params(best.plan.engine)   # an engine without the graph params captures none (recompute)
    slots = {s: best.plan.slots.get(s, REFERENCE_VARIANT) for s, param in GRAPHED_SLOTS.items()
             if param in params and best.plan.params.get(param, params[param].default) is not False}
    try:
        unsafe = graph_unsafe(slots, {**best.extra_variants, **(variants or {})})
        return [s for s in GRAPHED_SLOTS if s in unsafe]
    except ValueError:   # a variant without a header (not one this run wrote): nothing to say
        return []


def slot_shapes(state: SearchState, slot: str) -> list[CallShape]:
    """Where the best engine calls `slot` on the benchmark's public cases, most calls first."""
    params = state.best.plan.params if state.best is not None else {}
    shapes = call_shapes(model_dims(state), PUBLIC_CASES, fused_rows(state, slot), int(params.get("block_size", 16)))
    return shapes.get(slot, [])


def measured_shapes(result: EvalResult | None, slot: str) -> dict[str, float]:
    """The profiled pass's milliseconds per call shape of `slot` ({} without a profile)."""
    slot_ms = result.slot_ms if result is not None else None
    if not isinstance(slot_ms, dict):
        return {}
    entry = (slot_ms.get("slots") or {}).get(slot)
    shapes = entry.get("shapes") if isinstance(entry, dict) else None
    return {str(k): float(v) for k, v in shapes.items()} if isinstance(shapes, dict) else {}


def timing_lines(timings: list[ShapeTiming] | tuple[ShapeTiming, ...], current: str) -> list[str]:
    """"your kernel: 41 us vs current 23 us at N=512, H=768" lines, one per timed shape."""
    return [f"`{t.fn}` at {t.label} ({t.calls} calls in the benchmark): your kernel {t.candidate_us:.1f} us "
            f"vs current `{current}` {t.current_us:.1f} us ({t.ratio:.2f}x)" for t in timings]


def tolerance(dtype: str) -> str:
    """The unit check's tolerance at the compute dtype (evaluator/slot_compare.py)."""
    import torch
    from evaluator.slot_compare import TOLERANCE
    dt = {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(dtype, torch.float32)
    atol, rtol = TOLERANCE[dt]
    return f"|out - ref| <= {atol:g} + {rtol:g} * |ref| elementwise ({dtype})"


def _by(candidate: Candidate) -> str:
    """Who proposed it, as the model sees it (not the provider's name: a replay sends the same)."""
    return "builtin" if candidate.origin == "builtin" else "model"


def judged_lines(state: SearchState, limit: int = JUDGED_SHOWN) -> list[str]:
    """The engines judged so far, passing ones best first, then the failures' kinds."""
    passed = sorted(((c, r) for c, r in state.history if r.passed), key=lambda cr: -cr[1].rank())
    lines = [f"{c.plan.describe()} [{_by(c)}]: score {r.rank():.4g}" for c, r in passed[:limit]]
    failed = [(c, r) for c, r in state.history if not r.passed]
    lines += [f"{c.plan.describe()} [{_by(c)}]: failed at {r.stage} ({r.error_kind})"
              for c, r in failed[-max(limit - len(lines), 2):]]
    return lines


def current_code(slot: str, variant: str, params: dict, model_variants: dict[tuple[str, str], str]) -> str:
    """The current variant's code as the engine holds it: a library template rendered with the
    plan's params (never raw template syntax), a model's variant as it was written."""
    return render_kernel(slot, variant, params, model_variants).strip("\n")
