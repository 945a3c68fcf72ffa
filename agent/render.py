"""Plan → engine source. The rendered engine imports only torch, triton and the stdlib.

Each kernel variant is rendered on its own first (evaluator/slot_render.py: library templates
by Jinja with the plan's params, model-written variants verbatim); the engine skeleton then
prints those blocks as values, so model text is never read as a template."""
from __future__ import annotations

from agent.plan import REFERENCE_VARIANT, Plan, engine_models, engines, graph_unsafe, menu, parse_header
from evaluator.checkpoint import Conventions
from evaluator.slot_render import ExtraVariants, kernel_label, render_kernel, template_env, variant_source
from evaluator.slots import OPTIONAL_FUNCTIONS, PRELUDE, SLOTS

PADDING_WHY = "so that the kernels below keep their lines and Triton's cache keys"


def _slot_region(slot: str, name: str, bf16_name: str, params: dict,
                 extra: ExtraVariants) -> list[tuple[str, str]]:
    """(label, code) of one slot's blocks: its torch variant (the CPU path), the chosen variant
    and its bf16 stand-in, each once."""
    return [(kernel_label(slot, v), render_kernel(slot, v, params, extra))
            for v in dict.fromkeys((REFERENCE_VARIANT, name, bf16_name))]


def _region_lines(blocks: list[tuple[str, str]]) -> int:
    """The lines a slot's blocks take in the engine: each block's label line and a blank
    before it (paged.py.j2's loop), then its code."""
    return sum(2 + code.count("\n") + (not code.endswith("\n")) for _, code in blocks)


def _kernel_blocks(slots: dict[str, str], bf16_slots: dict[str, str], params: dict,
                   extra: ExtraVariants, model: Conventions) -> list[tuple[str, str]]:
    """(label, code) of every slot's blocks in the order the engine defines them, each slot's
    padded with blank lines to the most any library variant of that slot takes with these params.
    Why: Triton keys a compiled kernel by its source AND its starting line, so without the padding
    a candidate that changes one slot's variant moves every kernel below that slot and the judge's
    shared cache (evaluator/triton_cache.py) misses them all: ~20 s of recompiling a screen on an
    H100. A model-written variant longer than the library's still moves what follows it."""
    library = menu()
    out = []
    for slot in SLOTS:
        blocks = _slot_region(slot, slots[slot], bf16_slots[slot], params, extra)
        most = max(_region_lines(_slot_region(slot, v.name, _bf16_name(slot, v.name, {}, model), params, {}))
                   for v in library[slot])
        padding = most - _region_lines(blocks)
        if padding > 0:
            label, code = blocks[-1]
            note = f"# ({padding} lines of padding: every {slot} variant takes the same lines, {PADDING_WHY})\n"
            blocks[-1] = (label, code.rstrip("\n") + "\n" + note + "\n" * (padding - 1))
        out += blocks
    return out


def _bf16_name(slot: str, name: str, extra: ExtraVariants, model: Conventions) -> str:
    """The variant slot `slot` runs on bf16 models when `name` is chosen: `name` itself unless
    its header names a stand-in (`# bf16: V`, agent/plan.py) and the model is in the course
    format. The stand-ins exist for the course's bf16 judge, an allclose against the bf16
    reference that the looser variants' roundings use up; a Hugging Face model is held to the
    bf16 criterion instead (evaluator/hf_judge.py: against fp32, a tolerance from the bf16
    reference's own distance), which a variant of the same precision passes whatever its
    rounding points."""
    if model.hf:
        return name
    return parse_header(variant_source(slot, name, extra)).bf16 or name


def _bf16_slots(slots: dict[str, str], extra: ExtraVariants, model: Conventions) -> dict[str, str]:
    """Every slot's variant on bf16 models (`_bf16_name`)."""
    return {slot: _bf16_name(slot, name, extra, model) for slot, name in slots.items()}


def _optional_functions(slots: dict[str, str], bf16_slots: dict[str, str], extra: ExtraVariants) -> set[str]:
    """`fn__variant` of every optional slot function (evaluator/slots.py) that a chosen variant
    or bf16 stand-in defines: the engine binds those, None for the others."""
    out = set()
    for slot, functions in OPTIONAL_FUNCTIONS.items():
        for name in {slots[slot], bf16_slots[slot]}:
            text = variant_source(slot, name, extra)
            out.update(f"{fn}__{name}" for fn in functions if f"def {fn}__{name}(" in text)
    return out


def render_engine(plan: Plan, extra_variants: ExtraVariants | None = None,
                  model: Conventions = Conventions()) -> str:
    """The engine of `plan`; `extra_variants` are model-written variants its slots may name;
    `model` the conventions it is written for (the course format's by default: a skeleton
    renders only the code a model's conventions need)."""
    if model.hf and "hf" not in engine_models(plan.engine):
        raise ValueError(f"the {plan.engine} engine does not run Hugging Face models yet "
                         f"(engines that do: {', '.join(e for e in engines() if 'hf' in engine_models(e))})")
    extra = extra_variants or {}
    slots = {s: plan.slots.get(s, REFERENCE_VARIANT) for s in SLOTS}
    bf16_slots = _bf16_slots(slots, extra, model)
    template = template_env().get_template(f"engine/{plan.engine}.py.j2")
    return template.render(plan=plan, model=model, slots=slots, bf16_slots=bf16_slots, params=plan.params,
                           graph_unsafe=graph_unsafe(slots, extra) | graph_unsafe(bf16_slots, extra),
                           kernel_blocks=_kernel_blocks(slots, bf16_slots, plan.params, extra, model), prelude=PRELUDE,
                           optional_functions=_optional_functions(slots, bf16_slots, extra))
