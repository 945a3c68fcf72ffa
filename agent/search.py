"""The builtin search: which Plan to try next, with no model to ask.

A greedy walk over the menu that the templates declare (agent/plan.py):
  1. the KV-cache engine with the library's preferred variants (PREFERRED) where they run (the
     loop has already judged the conservative recompute engine before any proposer is asked),
     should that plan not be kept the same with the attention variants that round like the
     reference (FAITHFUL), and should neither be kept the engine with every slot on its torch
     variant; where no library variant runs (a CPU), that all-torch engine alone;
  2. each slot in turn (WALK_ORDER), each of its variants that runs on this device, applied to the
     best KV-cache plan so far (a variant stays only if it made that plan faster);
  3. each engine parameter in turn, each other value, on the best plan so far.
With `kernels` off (`--builtin-walk params`) the walk skips 1's library plans and 2: it judges
the all-torch engine and tunes parameters only, so kernel variants can come from a model alone
(issue 23's scripted-model check: how far a model gets from an all-torch start).
Every step starts from the *current* best, so an improvement found in step 2 is kept
while step 3 tunes around it. Plans already judged are skipped by the proposer.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

from agent.plan import REFERENCE_VARIANT, Param, Plan, Variant, reference_slots

CONSERVATIVE_ENGINE = "recompute"
FAST_ENGINE = "paged"
# Slots in the order the walk tries them: the linear slot first, because decode steps dominate
# four of the five benchmark cases and it takes kernels out of every step, and it is the one slot
# the library plan below leaves on torch; then the attention slots (the library's loose variants
# against their exact ones), then the elementwise slots. (With no library plan, as on a device
# where its variants do not run, a graph-safe decode variant is what lets the engine capture CUDA
# graphs; the walk still reaches it second.)
WALK_ORDER = ("linear", "decode_attention", "prefill_attention", "norm", "rope_cache", "silu_mul")
# The library's best guess, tried right after the all-torch engine where its variants run: one
# evaluation that lands near the end of the walk (a GPU evaluation takes about a minute, and a
# slot-by-slot walk from all-torch needs half a dozen before the engine can use CUDA graphs).
# The attention variants are the faster, looser ones: fp16 keeps their margin, and on bf16
# models the engine binds the stand-ins their headers name (triton_exact, which rounds like the
# reference). The elementwise variants round like the reference. On an H100 (docs/benchmarks.md,
# sixth session) split decode and the loose prefill beat the exact ones by 1.5 and 2.5 us a layer.
PREFERRED = {"decode_attention": "triton_split", "prefill_attention": "triton", "norm": "triton",
             "rope_cache": "triton", "silu_mul": "triton"}
# The library plan once more, with the attention variants that round like the reference: the
# looser ones can cost the safety margin where the model's own rounding already takes much of it
# (an fp16 GQA target at head_dim 128, eleventh session: the library plan passed at margin 0.38
# against the all-torch engine's 0.59, was not kept, and the slot-by-slot walk from all-torch ran
# out of budget at 4% of the library plan's speed).
FAITHFUL = {**PREFERRED, "decode_attention": "triton_exact", "prefill_attention": "triton_exact"}


def conservative_plan() -> Plan:
    """The engine that mirrors the reference, one request at a time: verified first, always."""
    return Plan(CONSERVATIVE_ENGINE)


def default_plan(engine: str, params: dict[str, Param]) -> Plan:
    return Plan(engine, reference_slots(), {name: p.default for name, p in params.items()})


def walk(base: Callable[[], Plan], device: str, menu: dict[str, list[Variant]],
         params: dict[str, Param], start: Plan, kernels: bool = True,
         pending: Callable[[Plan], bool] = lambda plan: False) -> Iterator[tuple[Plan | None, str]]:
    """Yield (plan, why) in search order; `base()` is re-read at every step so the walk
    builds on whatever has been kept so far. The library plan goes first where it runs: on a GPU
    the all-torch engine is many times slower and costs a whole evaluation (86 s of a 230 s
    budget on a Llama-3.2-1B shape, fourteenth session) that the library plan makes moot.
    Which step follows the library plans depends on their verdicts: while one is `pending` (handed
    to the judge, its verdict to come: a screen ahead, agent/screens.py) the walk yields
    (None, why) and stays there. A later step only builds on the best so far, whatever is pending."""
    if not kernels:
        menu = {}
    runnable = {slot: {v.name for v in variants if device in v.devices} for slot, variants in menu.items()}
    preferred = {slot: name for slot, name in PREFERRED.items() if name in runnable.get(slot, ())}
    faithful = {slot: name for slot, name in FAITHFUL.items() if name in runnable.get(slot, ())}
    if preferred:
        library = Plan(start.engine, {**start.slots, **preferred}, start.params)
        yield library, "KV cache with the kernel library's preferred variant in every slot that has one here"
        while pending(library):
            yield None, "waiting for the library plan's verdict"
        if faithful and faithful != preferred and base() != library:
            exact = Plan(start.engine, {**start.slots, **faithful}, start.params)
            yield exact, "the library plan not kept: the same with attention that rounds like the reference"
            while pending(exact):
                yield None, "waiting for the faithful library plan's verdict"
    if not preferred or base() == start:   # no library plan was kept
        yield start, "KV cache, batched prefill/decode, all-torch slots"
    for slot in WALK_ORDER:
        for variant in menu.get(slot, []):
            if variant.name == REFERENCE_VARIANT or device not in variant.devices:
                continue
            plan = base()
            yield (Plan(plan.engine, {**plan.slots, slot: variant.name}, plan.params),
                   f"{slot}: try {variant.name} instead of {plan.slots.get(slot, REFERENCE_VARIANT)}")
    for name, param in params.items():
        if device not in param.devices:
            continue
        for choice in param.choices:
            plan = base()
            if plan.params.get(name) == choice:
                continue
            yield (Plan(plan.engine, plan.slots, {**plan.params, name: choice}),
                   f"{name}: try {choice} instead of {plan.params.get(name)}")

