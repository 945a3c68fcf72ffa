"""Kernel variants as code: one variant's text, and a slot module (the prelude of evaluator/slots.py
and the variant).

Two kinds of variant, two ways in:

* library variants, `templates/kernels/<slot>/<variant>.py.j2`, are Jinja templates of this
  repository and are rendered with the plan's `params` (tilings, `pdl`);
* model-written variants (an LLM's answer under our header, `ExtraVariants`) are inserted
  verbatim. They are never a template: a comment such as `{% endraw %}{{ ... }}` in model code
  would otherwise run at render time, inside the agent and the unit-check process (issue 20).

Jinja therefore only ever reads files of the template tree; model text reaches an engine as the
value of an expression (`{{ block }}` in templates/engine/paged.py.j2), which Jinja prints and
does not evaluate again.

The evaluator owns this module (evaluator/slot_check.py renders the module it checks with it);
agent/render.py builds engines on it. It imports nothing from the agent.
"""
from __future__ import annotations

import functools
from pathlib import Path

import jinja2

from evaluator.slots import PRELUDE

TEMPLATES = Path(__file__).resolve().parent.parent / "templates"
KERNELS = TEMPLATES / "kernels"

# (slot, variant) -> the source of a variant that is not a library file (a model's), verbatim.
ExtraVariants = dict[tuple[str, str], str]


@functools.lru_cache(maxsize=1)
def template_env() -> jinja2.Environment:
    """Jinja whose loader reads the repository's template tree only (engine skeletons and
    library kernels); nothing here renders text from memory."""
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True,
    )


def kernel_label(slot: str, variant: str) -> str:
    """The variant's path in the template tree, as engines name its section (model variants
    too, by the path they would have)."""
    return f"kernels/{slot}/{variant}.py.j2"


def kernel_path(slot: str, variant: str) -> Path:
    return TEMPLATES / kernel_label(slot, variant)


def library_variant(path: Path) -> tuple[str, str] | None:
    """(slot, variant) when `path` is a variant file of the library, else None."""
    path = Path(path).resolve()
    if path.parent.parent == KERNELS.resolve() and path.name.endswith(".py.j2"):
        return path.parent.name, path.name.removesuffix(".py.j2")
    return None


def variant_source(slot: str, variant: str, extra_variants: ExtraVariants | None = None) -> str:
    """The variant's text before rendering (to read its header lines): the model's, else the
    library file's."""
    text = (extra_variants or {}).get((slot, variant))
    return text if text is not None else kernel_path(slot, variant).read_text()


def render_kernel(slot: str, variant: str, params: dict | None = None,
                  extra_variants: ExtraVariants | None = None) -> str:
    """One variant's code: a model-written one as it is, a library one rendered with `params`."""
    text = (extra_variants or {}).get((slot, variant))
    if text is not None:
        return text
    return template_env().get_template(kernel_label(slot, variant)).render(params=params or {})


def render_slot_module(slot: str, variant: str, params: dict | None = None,
                       extra_variants: ExtraVariants | None = None) -> str:
    """One slot's variant as a standalone module (prelude + the variant), for unit checks."""
    return PRELUDE + "\n\n" + render_kernel(slot, variant, params, extra_variants)
