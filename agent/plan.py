"""Plans: one choice per kernel slot plus the engine's parameters.

The menu is read from the template tree, so adding a kernel variant is adding one file:
`templates/kernels/<slot>/<variant>.py.j2`, whose header line says where it runs:

    # slot: decode_attention    variant: triton_split    devices: cuda

A variant whose numerics are looser than the reference's (another rounding of the softmax
probabilities, say) may name, on a line of its own among the first lines, the variant that
stands in for it on bf16 models, whose 8-bit mantissa leaves such a variant no margin
(SPEC.md §3, docs/benchmarks-kernel-notes.md):

    # bf16: triton_exact

A variant that cannot be captured in a CUDA graph (its launches depend on more than tensor
shapes: a loop over a host-side list, say) says so the same way, and an engine with it runs
those passes eagerly (`graph_safe`; templates/engine/paged.py.j2):

    # graphs: no
"""
from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from evaluator.slot_render import variant_source
from evaluator.slots import SLOTS

TEMPLATES = Path(__file__).resolve().parent.parent / "templates"
KERNELS = TEMPLATES / "kernels"
ENGINES = TEMPLATES / "engine"

REFERENCE_VARIANT = "torch"
_HEADER = re.compile(r"#\s*slot:\s*(\w+)\s+variant:\s*(\w+)\s+devices:\s*([\w, ]+)")
_BF16 = re.compile(r"#\s*bf16:\s*(\w+)\s*$")
_GRAPHS = re.compile(r"#\s*graphs:\s*no\b")
_PARAM = re.compile(r"#\s*param:\s*(\w+)\s*=\s*(\S+)\s+choices:\s*(.+?)(?:\s+devices:\s*([\w, ]+?))?\s*$")
ALL_DEVICES = ("cpu", "cuda")
HEADER_LINES = 5   # the header lines (`# slot:`, `# bf16:`, `# graphs:`) sit among a variant's first comment lines


@dataclass(frozen=True)
class Variant:
    slot: str
    name: str
    devices: tuple[str, ...]
    path: Path | None  # None for a variant that lives only in memory (an LLM proposal)
    bf16: str | None = None  # the slot's variant an engine runs instead on bf16 models
    graph_safe: bool = True  # False: `# graphs: no`, the engine runs the passes that call it eagerly


@dataclass(frozen=True)
class Plan:
    """What to render: an engine skeleton, a variant per slot, and the skeleton's params."""

    engine: str
    slots: dict[str, str] = field(default_factory=dict)
    params: dict[str, object] = field(default_factory=dict)

    def key(self) -> str:
        """A stable identity, so the same plan is never judged twice."""
        return json.dumps({"engine": self.engine, "slots": self.slots, "params": self.params}, sort_keys=True)

    def describe(self) -> str:
        slots = " ".join(f"{s}={v}" for s, v in sorted(self.slots.items()) if v != REFERENCE_VARIANT)
        params = " ".join(f"{k}={v}" for k, v in sorted(self.params.items()))
        return " ".join(p for p in (self.engine, slots, params) if p)

    def to_dict(self) -> dict:
        return {"engine": self.engine, "slots": dict(self.slots), "params": dict(self.params)}

    @staticmethod
    def from_dict(d: dict) -> "Plan":
        return Plan(engine=d["engine"], slots=dict(d.get("slots", {})), params=dict(d.get("params", {})))


def parse_header(text: str, path: Path | None = None) -> Variant:
    """Read the `# slot: ... variant: ... devices: ...` line that starts every variant, and the
    optional `# bf16: V` and `# graphs: no` lines: within the comment lines it starts with (a
    model-written variant's two header lines end at a blank line, so its code cannot add one)."""
    head = list(itertools.takewhile(lambda line: line.startswith("#"), text.splitlines()[:HEADER_LINES]))
    bf16 = next((m.group(1) for m in map(_BF16.match, head) if m), None)
    graph_safe = not any(map(_GRAPHS.match, head))
    for line in head:
        m = _HEADER.search(line)
        if m:
            devices = tuple(d.strip() for d in m.group(3).split(",") if d.strip())
            return Variant(m.group(1), m.group(2), devices, path, bf16, graph_safe)
    where = path or "variant source"
    raise ValueError(f"{where}: no '# slot: S variant: V devices: D' header in its first lines")


def graph_unsafe(slots: dict[str, str], extra: dict[tuple[str, str], str] | None = None) -> set[str]:
    """The slots whose variant in `slots` cannot be captured in a CUDA graph (`# graphs: no` in
    its header; `extra`: model-written variants' texts): an engine with one runs the passes that
    call it eagerly."""
    return {slot for slot, name in slots.items() if not parse_header(variant_source(slot, name, extra)).graph_safe}


def menu() -> dict[str, list[Variant]]:
    """Every kernel variant on disk, by slot, the reference (torch) variant first."""
    out: dict[str, list[Variant]] = {s: [] for s in SLOTS}
    for path in sorted(KERNELS.glob("*/*.py.j2")):
        v = parse_header(path.read_text(), path)
        if v.slot != path.parent.name or v.name != path.name.removesuffix(".py.j2"):
            raise ValueError(f"{path}: header says slot={v.slot} variant={v.name}, file name disagrees")
        out.setdefault(v.slot, []).append(v)
    for variants in out.values():
        variants.sort(key=lambda v: (v.name != REFERENCE_VARIANT, v.name))
        names = {v.name for v in variants}
        for v in variants:
            if v.bf16 is not None and v.bf16 not in names:
                raise ValueError(f"{v.path}: 'bf16: {v.bf16}' names no variant of slot {v.slot}")
    return out


def _literal(text: str) -> object:
    text = text.strip()
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return int(text)
    except ValueError:
        return text


@dataclass(frozen=True)
class Param:
    name: str
    default: object
    choices: tuple
    devices: tuple[str, ...] = ALL_DEVICES  # where changing it can matter (e.g. CUDA graphs: cuda)


def engine_params(engine: str) -> dict[str, Param]:
    """The tunables an engine skeleton declares in its header, one per line, optionally
    saying on which devices trying other values is worth a candidate:

        # param: block_size = 16  choices: 16, 32, 64
        # param: decode_graphs = true  choices: true, false  devices: cuda
    """
    out = {}
    for line in (ENGINES / f"{engine}.py.j2").read_text().splitlines()[:60]:
        m = _PARAM.search(line)
        if m:
            choices = tuple(_literal(c) for c in m.group(3).split(","))
            devices = tuple(d.strip() for d in (m.group(4) or "").split(",") if d.strip()) or ALL_DEVICES
            out[m.group(1)] = Param(m.group(1), _literal(m.group(2)), choices, devices)
    return out


_MODELS = re.compile(r"\{#\s*models:\s*([\w, ]+?)\s*(?:\(|#\})")


def engine_models(engine: str) -> tuple[str, ...]:
    """The model formats a skeleton renders, from its `{# models: course, hf ... #}` line (a
    Jinja comment, so rendered engines do not carry it); the course format alone without one."""
    for line in (ENGINES / f"{engine}.py.j2").read_text().splitlines()[:5]:
        m = _MODELS.search(line)
        if m:
            return tuple(f.strip() for f in m.group(1).split(",") if f.strip())
    return ("course",)


_NOT_SEARCHED = re.compile(r"\{#\s*search:\s*no\b")


def skeletons() -> list[str]:
    """Every engine skeleton on disk, those the search leaves alone included (render_engine renders any)."""
    return sorted(p.name.removesuffix(".py.j2") for p in ENGINES.glob("*.py.j2"))


def searched(engine: str) -> bool:
    """Whether the search may propose the skeleton: False where one of its first lines says
    `{# search: no (why) #}` (the tp skeleton: its ranks are processes the judge's jail and the
    static policy refuse, docs/design.md)."""
    return not any(map(_NOT_SEARCHED.search, (ENGINES / f"{engine}.py.j2").read_text().splitlines()[:5]))


def engines() -> list[str]:
    """The skeletons the search proposes: the builtin walk, the model's menu and its answers' check."""
    return [e for e in skeletons() if searched(e)]


def reference_slots() -> dict[str, str]:
    return {s: REFERENCE_VARIANT for s in SLOTS}
