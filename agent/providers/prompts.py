"""What the model is told: the prompts in templates/prompts/ and the facts they are filled with.

Everything a prompt contains is derived from the search state and the template tree, never
from the clock, so the same run state renders the same prompt (a replayed run sends the very
requests the recorded one did). The per-slot time split is an estimate unless the evaluator
supplies a measured profile, and the prompt says which.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import jinja2

from agent import policy
from agent.plan import KERNELS, REFERENCE_VARIANT, TEMPLATES, engine_params, engines, menu
from agent.records import Candidate, EvalResult, SearchState
from evaluator.slots import CONTRACTS, SLOT_FUNCTIONS

PROMPTS = TEMPLATES / "prompts"
# Launch-bound regime (SPEC §6): a layer's time follows its kernel count. Per layer: two
# norms, one RoPE+cache write, one attention, one SiLU·mul, four GEMMs (the linear slot).
LAUNCHES_PER_LAYER = {"norm": 2, "rope_cache": 1, "attention": 1, "silu_mul": 1, "linear": 4}
ATTENTION = ("prefill_attention", "decode_attention")
ESTIMATED = ("estimated from kernel counts per layer (at these sizes a step is launch-bound), "
             "attention split by prefill/decode tokens; not measured")
MEASURED = "measured by the evaluator's profiler"
# Peak DRAM bandwidth by GPU name, for when the driver does not say (GB/s, vendor figures).
BANDWIDTH_GBS = {"H200": 4800, "H100": 3350, "A100": 2039, "L40S": 864, "L4": 300, "A10": 600}


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
    contract = "\n".join(line.lstrip("#")[1:] if line.startswith("# ") else line.lstrip("#")
                         for line in lines[2:head])   # below the `# slot:` line and the block's title
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
    facts["streaming multiprocessors"] = props.multi_processor_count
    facts["memory"] = f"{props.total_memory / 2**30:.0f} GiB"
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


def profile(result: EvalResult | None) -> Profile:
    """Where the best engine's time goes: a profile the evaluator measured, else the estimate."""
    bench = list(result.benchmark) if result is not None else []
    cases = [{"name": c.get("case_name", "?"), "elapsed_ms": float(c.get("elapsed_ms") or 0.0),
              "tokens": int(c.get("total_tokens") or 0), "floor_fraction": float(c.get("floor_fraction") or 0.0)}
             for c in bench]
    measured = getattr(result, "profile", None)
    if measured:
        total = sum(measured.values()) or 1.0
        shares = sorted(((k, v / total) for k, v in measured.items()), key=lambda kv: -kv[1])
        return Profile(MEASURED, shares, cases)
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
