"""Plan → engine source. The rendered engine imports only torch, triton and the stdlib."""
from __future__ import annotations

import jinja2

from agent.plan import KERNELS, REFERENCE_VARIANT, SLOTS, TEMPLATES, Plan, parse_header

ExtraVariants = dict[tuple[str, str], str]


class _Loader(jinja2.FileSystemLoader):
    """Templates from disk, plus in-memory kernel variants (LLM proposals) by their would-be path."""

    def __init__(self, extra: ExtraVariants):
        super().__init__(str(TEMPLATES))
        self.extra = {f"kernels/{slot}/{name}.py.j2": text for (slot, name), text in extra.items()}

    def get_source(self, environment, template):
        if template in self.extra:
            return self.extra[template], None, lambda: True
        return super().get_source(environment, template)


def _env(extra: ExtraVariants) -> jinja2.Environment:
    return jinja2.Environment(
        loader=_Loader(extra), undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
        trim_blocks=True, lstrip_blocks=True,
    )


# The imports every rendered module starts with: triton only where CUDA is present.
PRELUDE = '''import math
import torch
import torch.nn.functional as F
try:
    if not torch.cuda.is_available():
        raise ImportError
    import triton
    import triton.language as tl
except ImportError:
    triton = None
    tl = None
# Programmatic dependent launch (a kernel starts before the previous one ends) needs sm_90+.
PDL_SUPPORTED = triton is not None and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
# Shared memory one Triton program may take on this GPU, the bound Triton checks each compiled
# kernel against (no bound in the CPU interpreter).
MAX_SHARED_MEMORY = (triton.runtime.driver.active.utils.get_device_properties(torch.cuda.current_device())[
    "max_shared_mem"] if triton is not None and torch.cuda.is_available() else math.inf)


def fit_shared_memory(block_n, stages, rows, width, elem_bytes, min_block_n=16):
    """(block_n, stages) for an attention kernel that keeps a [rows, width] query tile and, per
    pipeline stage, a [block_n, width] key tile and value tile in shared memory: stages given up
    first, then halves of the key tile, until they fit MAX_SHARED_MEMORY. Tiles tuned for
    head_dim <= 192 ask more than a GPU has at wide heads (an H100, head_dim 384: 240 KiB of 227,
    the figure of Triton's error)."""
    while elem_bytes * width * (rows + 2 * stages * block_n) > MAX_SHARED_MEMORY:
        if stages > 1:
            stages -= 1
        elif block_n > min_block_n:
            block_n //= 2
        else:
            break
    return block_n, stages
'''


def _variant_includes(slots: dict[str, str], bf16_slots: dict[str, str]) -> list[str]:
    """Template paths of every slot's torch variant (the CPU path), chosen variant and bf16
    stand-in."""
    out = []
    for slot in SLOTS:
        for name in dict.fromkeys((REFERENCE_VARIANT, slots[slot], bf16_slots[slot])):
            out.append(f"kernels/{slot}/{name}.py.j2")
    return out


def _bf16_slots(slots: dict[str, str], extra: ExtraVariants) -> dict[str, str]:
    """The variant each slot runs on bf16 models: the chosen one unless its header names a
    stand-in (`# bf16: V`, agent/plan.py)."""
    out = {}
    for slot, name in slots.items():
        text = extra.get((slot, name))
        if text is None:
            text = kernel_path(slot, name).read_text()
        out[slot] = parse_header(text).bf16 or name
    return out


def _optional_functions(slots: dict[str, str], bf16_slots: dict[str, str], extra: ExtraVariants) -> set[str]:
    """`fn__variant` of every optional slot function (slot_check.OPTIONAL_FUNCTIONS) that a
    chosen variant or bf16 stand-in defines: the engine binds those, None for the others."""
    from evaluator.slot_check import OPTIONAL_FUNCTIONS
    out = set()
    for slot, functions in OPTIONAL_FUNCTIONS.items():
        for name in {slots[slot], bf16_slots[slot]}:
            text = extra.get((slot, name))
            if text is None:
                text = kernel_path(slot, name).read_text()
            out.update(f"{fn}__{name}" for fn in functions if f"def {fn}__{name}(" in text)
    return out


def render_engine(plan: Plan, extra_variants: ExtraVariants | None = None) -> str:
    extra = extra_variants or {}
    slots = {s: plan.slots.get(s, REFERENCE_VARIANT) for s in SLOTS}
    bf16_slots = _bf16_slots(slots, extra)
    template = _env(extra).get_template(f"engine/{plan.engine}.py.j2")
    return template.render(plan=plan, slots=slots, bf16_slots=bf16_slots, params=plan.params,
                           kernel_includes=_variant_includes(slots, bf16_slots), prelude=PRELUDE,
                           optional_functions=_optional_functions(slots, bf16_slots, extra))



def render_slot_module(slot: str, variant: str, params: dict | None = None,
                       extra_variants: ExtraVariants | None = None) -> str:
    """One slot's variant as a standalone module (prelude + the variant), for unit checks."""
    env = _env(extra_variants or {})
    body = env.get_template(f"kernels/{slot}/{variant}.py.j2").render(params=params or {})
    return PRELUDE + "\n\n" + body


def kernel_path(slot: str, variant: str):
    return KERNELS / slot / f"{variant}.py.j2"
