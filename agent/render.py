"""Plan → engine source. The rendered engine imports only torch, triton and the stdlib.

Each kernel variant is rendered on its own first (evaluator/slot_render.py: library templates
by Jinja with the plan's params, model-written variants verbatim); the engine skeleton then
prints those blocks as values, so model text is never read as a template."""
from __future__ import annotations

from agent.plan import REFERENCE_VARIANT, Plan, engine_models, engines, parse_header
from evaluator.checkpoint import Conventions
from evaluator.slot_render import ExtraVariants, kernel_label, render_kernel, template_env, variant_source
from evaluator.slots import OPTIONAL_FUNCTIONS, PRELUDE, SLOTS


def _kernel_blocks(slots: dict[str, str], bf16_slots: dict[str, str], params: dict,
                   extra: ExtraVariants) -> list[tuple[str, str]]:
    """(label, code) of every slot's torch variant (the CPU path), chosen variant and bf16
    stand-in, in the order the engine defines them."""
    out = []
    for slot in SLOTS:
        for name in dict.fromkeys((REFERENCE_VARIANT, slots[slot], bf16_slots[slot])):
            out.append((kernel_label(slot, name), render_kernel(slot, name, params, extra)))
    return out


def _bf16_slots(slots: dict[str, str], extra: ExtraVariants, model: Conventions) -> dict[str, str]:
    """The variant each slot runs on bf16 models: the chosen one unless its header names a
    stand-in (`# bf16: V`, agent/plan.py) and the model is in the course format. The stand-ins
    exist for the course's bf16 judge, an allclose against the bf16 reference that the looser
    variants' roundings use up; a Hugging Face model is held to the bf16 criterion instead
    (evaluator/hf_judge.py: against fp32, a tolerance from the bf16 reference's own distance),
    which a variant of the same precision passes whatever its rounding points."""
    if model.hf:
        return dict(slots)
    return {slot: parse_header(variant_source(slot, name, extra)).bf16 or name for slot, name in slots.items()}


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
                           kernel_blocks=_kernel_blocks(slots, bf16_slots, plan.params, extra), prelude=PRELUDE,
                           optional_functions=_optional_functions(slots, bf16_slots, extra))
