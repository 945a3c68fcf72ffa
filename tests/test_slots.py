"""The slot contract (evaluator/slots.py) agrees with what implements it: every library variant
defines the slot's functions with the contract's arguments in order, the reference ops take the
same arguments, and the template tree holds exactly the contract's slots."""
from __future__ import annotations

import inspect
import re

import pytest

from evaluator import slot_refs
from evaluator.slot_render import KERNELS
from evaluator.slots import CONTRACTS, SLOTS, function

VARIANTS = sorted(KERNELS.glob("*/*.py.j2"))


def positional_args(text: str, fn: str, variant: str) -> list[str] | None:
    """The argument names of `def fn__variant(...)` before any `*` or default, None if undefined."""
    m = re.search(rf"^def {fn}__{variant}\((.*?)\):", text, re.MULTILINE | re.DOTALL)
    if m is None:
        return None
    names = []
    for arg in (a.strip() for a in m.group(1).split(",")):
        if not arg or arg.startswith("*") or "=" in arg:
            break
        names.append(re.match(r"\w+", arg).group(0))
    return names


def test_the_template_tree_holds_the_contracts_slots():
    assert {p.parent.name for p in VARIANTS} == set(SLOTS)


@pytest.mark.parametrize("path", VARIANTS, ids=lambda p: f"{p.parent.name}/{p.name.removesuffix('.py.j2')}")
def test_every_library_variant_defines_the_contracts_functions(path):
    slot, variant, text = path.parent.name, path.name.removesuffix(".py.j2"), path.read_text()
    for f in CONTRACTS[slot]:
        args = positional_args(text, f.name, variant)
        if args is None:
            assert f.optional, f"{path.name} does not define {f.name}__{variant}"
            continue
        assert args == list(f.arg_names), f"{f.name}__{variant}{tuple(args)}, contract {f.signature(variant)}"


@pytest.mark.parametrize("slot", SLOTS)
def test_the_reference_ops_take_the_contracts_arguments(slot):
    for f in CONTRACTS[slot]:
        ref = getattr(slot_refs, f"ref_{f.name}", None)
        if ref is None:
            assert f.optional, f"no reference op for {f.name}"
            continue
        assert tuple(inspect.signature(ref).parameters) == f.arg_names


def test_a_signature_names_its_arguments_and_outputs():
    f = function("norm", "add_rmsnorm")
    assert f.signature("v1") == "add_rmsnorm__v1(x, residual, w, eps) -> (y[N,H], new_residual[N,H])"
    assert f.output_names == ("y", "new_residual") and not f.optional
    rope = function("rope_cache", "rope_cache")
    assert rope.result() == "None" and "Updates q, k, k_cache, v_cache in place." in rope.describe("v1")
