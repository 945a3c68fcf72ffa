"""A proposed variant's time against the current one, at the engine's real call shapes.

Run by the unit worker (evaluator/unit_worker.py) inside its jail, after the variant passed its
unit check: both variants are loaded in the same process, given the same inputs
(evaluator.slot_cases.make_inputs at the shapes of evaluator/slot_shapes.py), and timed
interleaved (candidate, current, candidate, ...) so that a busy machine slows both alike; the
median of each is reported. On CUDA each call is timed with CUDA events, on the CPU with the
process clock around the call: the torch variants there, so CI runs this very code.

Advice, never a verdict: the numbers travel back as the worker's claim and go into the model's
prompt; only the whole-engine benchmark decides what is kept.
"""
from __future__ import annotations

import statistics
import time

import torch

from evaluator.slot_cases import make_inputs
from evaluator.slot_check import import_module_text, render_source
from evaluator.slot_shapes import CallShape, ShapeTiming
from evaluator.slots import SLOT_FUNCTIONS, function

REPEATS = {"cuda": 25, "cpu": 3}   # timed calls per variant and shape
WARMUP = 1                        # untimed calls first (compilation, allocator, caches)


def _timer(device: str):
    """A callable that runs fn once and returns its time in microseconds."""
    if device == "cuda":
        def run(fn) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) * 1e3
        return run

    def run_cpu(fn) -> float:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    return run_cpu


def load_functions(slot: str, source: str) -> dict:
    """A variant's functions by name, from its source (slot_check.render_source's forms)."""
    text, name, _ = render_source(slot, source)
    module = import_module_text(text, f"{slot}_{name}")
    return {fn: getattr(module, f"{fn}__{name}") for fn in SLOT_FUNCTIONS[slot]
            if callable(getattr(module, f"{fn}__{name}", None))}


def time_against(slot: str, candidate: dict, current: dict, shapes: list[CallShape], device: str,
                 dtype: torch.dtype, seed: int = 0, repeats: int | None = None) -> list[ShapeTiming]:
    """`candidate` and `current` map a slot's function names to callables (both variants'). Each
    shape gets fresh inputs from `seed`; both variants see the same ones."""
    repeats = repeats or REPEATS.get(device, REPEATS["cpu"])
    timer = _timer(device)
    out = []
    for i, shape in enumerate(shapes):
        inputs = make_inputs(slot, shape.spec, dtype, device, seed * 1000 + i)
        names = function(slot, shape.fn).arg_names
        args = {a: inputs[a] for a in names}
        calls = {which: (lambda f=fns[shape.fn]: f(**args)) for which, fns in (("candidate", candidate),
                                                                               ("current", current))}
        with torch.no_grad():
            for _ in range(WARMUP):
                for call in calls.values():
                    call()
            times: dict[str, list[float]] = {"candidate": [], "current": []}
            for _ in range(repeats):
                for which, call in calls.items():
                    times[which].append(timer(call))
        out.append(ShapeTiming(shape.fn, shape.label, shape.calls, statistics.median(times["candidate"]),
                               statistics.median(times["current"])))
    return out
