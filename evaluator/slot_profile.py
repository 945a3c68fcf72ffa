"""The profiled pass: where one benchmark trace's time goes, per kernel slot and call shape.

Runs in the worker (evaluator/worker.py, `profile` request), on an engine of its own: before
that engine is created, every slot function of the candidate's module (`<fn>__<variant>`, the
names templates/engine/paged/binding.py.j2 binds, evaluator/slots.py's contract) is replaced by
a wrapper that runs it inside `torch.profiler.record_function("slot:<slot>:<fn> <arg>[shape]")`;
the module's globals are restored right after, so the engines that are timed never see a
wrapper and the rendered engine is unchanged (no cost when the pass is not asked for).

The trace then runs once untimed (compilation, CUDA-graph capture), and once under
torch.profiler. Attribution:
* on CUDA, each kernel goes to the slot range it was launched from. Kernels launched from no
  slot range (a replayed CUDA graph's, which torch ties to no CPU range at all: they are
  events of their own only) go to the slot whose ranges launched a kernel of that name, in the
  pass or in the engine's creation, under the label REPLAYED (one name serves every shape a
  graph holds), else to `other`. An engine that captures every pass it runs launches nothing
  from a slot range in the pass itself (its slot functions ran while it captured its graphs),
  so on CUDA its creation and the untimed pass are watched too, for the kernel names alone (`watched`):
  torch.profiler for what torch launches (it ties no Triton kernel to a CPU range: Triton
  launches through the driver API), and Triton's launch hook for Triton's, each name with the
  slot open at its launch. A name launched from two slots, or also from outside any (a fill, a
  copy, a cuBLAS GEMM shared with lm_head), is learnt for none: its replayed kernels stay
  `other`;
* on the CPU, each outermost slot range's CPU time (its ops ran inside it).
`other_ms` is the pass's wall time less the slots' (GEMMs of unfused passes, embedding,
lm_head, host work, the profiler's own overhead). `fused_rows` is the engine's own limit on the
passes that run the linear slot (the paged engine's Kernels.fused_rows: 0 where its weights are
packed for oneDNN or its linear variant is torch on CUDA), where it has one. The numbers are the
worker's claim: shown to the model, never scored (docs/reliability.md).
"""
from __future__ import annotations

import re
import sys
import time
from collections import defaultdict
from typing import Callable

from evaluator.slots import CONTRACTS

RANGE = "slot:"
_RANGE = re.compile(r"^slot:(\w+):(\w+) (.*)$")
# every function a slot may define -> (slot, the name of its first argument)
_FUNCTIONS = {f.name: (slot, f.arg_names[0]) for slot, fns in CONTRACTS.items() for f in fns}
_SLOT_NAME = re.compile(r"^(\w+?)__(\w+)$")
UNTIED_EPS_MS = 1e-6   # below this, a name's device time and its tied time differ by rounding only
REPLAYED = "kernel {kernel} launched from no slot call (graph replays: every shape)"   # a slot_ms label
KERNEL_NAME_CHARS = 60   # of a kernel's name in that label
MAX_LABELS = 256         # shape labels a slot of a worker's claim may hold (a real pass: tens)
MAX_LABEL_CHARS = 200    # of a label, and of the claim's source


def _shape(value) -> str:
    shape = getattr(value, "shape", None)
    return "[" + ",".join(str(int(d)) for d in shape) + "]" if shape is not None else ""


_OPEN: list[tuple[str, str]] = []   # the slot ranges open now, outermost first (wrap_slots' wrappers)


def wrap_slots(namespace: dict, record_function: Callable) -> dict:
    """Replace every slot function in `namespace` (a module's globals) by a profiled wrapper;
    return the originals to put back."""
    saved = {}
    for name, value in list(namespace.items()):
        m = _SLOT_NAME.match(name)
        if not m or m.group(1) not in _FUNCTIONS or not callable(value):
            continue
        slot, first = _FUNCTIONS[m.group(1)]
        fn = m.group(1)

        def profiled(*args, __f=value, __slot=slot, __fn=fn, __first=first, **kwargs):
            arg = args[0] if args else kwargs.get(__first)
            label = f"{__fn} {__first}{_shape(arg)}"
            with record_function(f"{RANGE}{__slot}:{label}"):
                _OPEN.append((__slot, label))
                try:
                    return __f(*args, **kwargs)
                finally:
                    _OPEN.pop()
        saved[name] = value
        namespace[name] = profiled
    return saved


def _slot_of(event) -> tuple[str, str] | None:
    """(slot, "fn arg[shape]") of the outermost slot range `event` runs in, or None."""
    found = None
    while event is not None:
        m = _RANGE.match(event.name)
        if m:
            found = (m.group(1), f"{m.group(2)} {m.group(3)}")
        event = event.cpu_parent
    return found


Seen = dict[str, set]   # kernel name -> every (slot, label) it was launched from; None: from outside any slot


def _seen_in_events(events, seen: Seen) -> None:
    """What torch.profiler tied to CPU ranges: each kernel with its event's outermost slot range."""
    for e in events:
        for k in getattr(e, "kernels", []):
            seen.setdefault(k.name, set()).add(_slot_of(e))


def kernel_names(seen: Seen) -> dict[str, str]:
    """kernel name -> slot, for the names launched from one slot only, never from two slots nor
    from outside any."""
    names = {}
    for name, wheres in seen.items():
        slots = {where[0] if where else None for where in wheres}
        if len(slots) == 1 and None not in slots:
            names[name] = slots.pop()
    return names


class _TritonLaunches:
    """Triton's launch hook, while open: every Triton kernel launched, with the slot open then.
    Triton 3.4+ keeps its hooks in `triton.knobs.runtime` (a chain from 3.7, a single hook
    before), older ones on CompiledKernel; no Triton, or no hook there: nothing is seen."""

    def __init__(self, seen: Seen):
        self.seen, self.owner, self.before = seen, None, None

    def hook(self, metadata) -> None:
        try:
            name = metadata.get()["name"]
        except Exception:   # a metadata shape this Triton does not give: the name stays unknown
            return
        self.seen.setdefault(name, set()).add(_OPEN[0] if _OPEN else None)

    def __enter__(self) -> "_TritonLaunches":
        try:
            from triton import knobs
            self.owner = knobs.runtime
        except ImportError:
            try:
                from triton.compiler.compiler import CompiledKernel
                self.owner = CompiledKernel
            except ImportError:
                return self
        self.before = getattr(self.owner, "launch_enter_hook", None)
        if hasattr(self.before, "add"):
            self.before.add(self.hook)
        else:
            before = self.before
            setattr(self.owner, "launch_enter_hook",
                    self.hook if before is None else lambda m: (before(m), self.hook(m)))
        return self

    def __exit__(self, *_) -> None:
        if self.owner is None:
            return
        if hasattr(self.before, "remove"):
            self.before.remove(self.hook)
        else:
            setattr(self.owner, "launch_enter_hook", self.before)


def watched(torch, make: Callable[[], object], device: str, seen: Seen) -> object:
    """make()'s result; on CUDA, every kernel name its slot ranges (or none) launched goes into
    `seen` (torch.profiler for torch's launches, Triton's launch hook for Triton's)."""
    if device != "cuda":
        return make()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof, _TritonLaunches(seen):
        made = make()
        torch.cuda.synchronize()
    _seen_in_events(prof.events(), seen)
    return made


def _on_device(e) -> bool:
    """A kernel's own event (not a CPU op's, nor a user range torch mirrors on the device)."""
    return (getattr(getattr(e, "device_type", None), "name", None) == "CUDA"
            and not getattr(e, "is_user_annotation", False))


def replayed_label(kernel: str) -> str:
    """REPLAYED for `kernel`, its name cut before any template or argument list (a demangled C++
    name runs to hundreds of characters) and without backticks (it goes into a prompt)."""
    short = kernel.split("(")[0].split("<")[0].replace("`", "").strip()[:KERNEL_NAME_CHARS]
    return REPLAYED.format(kernel=short or "?")


def attribute(events, device: str, wall_ms: float, seen: Seen | None = None) -> dict:
    """EvalResult.slot_ms from a profiler's events (torch.profiler.profile().events()). On CUDA a
    kernel tied to a slot range is that range's; the rest of a name's device time (launched from
    no slot range: a replayed graph's) is the slot `kernel_names` gives the name over this pass's
    tied launches and `seen` (the launches watched while the engine was made and warmed up), under
    REPLAYED rather than a call shape: one name serves every shape a graph was captured at."""
    ms: dict[str, float] = defaultdict(float)
    shapes: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    calls: dict[str, int] = defaultdict(int)
    for e in events:
        m = _RANGE.match(e.name)
        if m and (e.cpu_parent is None or _slot_of(e.cpu_parent) is None):
            calls[m.group(1)] += 1
    if device == "cuda":
        tied: dict[str, float] = defaultdict(float)      # kernel name -> ms tied to a CPU range
        orphans: dict[str, float] = defaultdict(float)   # kernel name -> ms launched from no slot range
        launches: Seen = {name: set(wheres) for name, wheres in (seen or {}).items()}   # and this pass's
        for e in events:
            for k in getattr(e, "kernels", []):
                kernel_ms = k.duration / 1e3
                tied[k.name] += kernel_ms
                where = _slot_of(e)
                launches.setdefault(k.name, set()).add(where)
                if where is None:
                    orphans[k.name] += kernel_ms
                    continue
                ms[where[0]] += kernel_ms
                shapes[where[0]][where[1]] += kernel_ms
        # Every kernel is also an event of its own; torch ties to a CPU range only those whose
        # launch it correlates with an op or a record_function (not a replayed graph's, measured
        # on an H200): the rest of each name's time is launched from no slot range.
        on_device: dict[str, float] = defaultdict(float)
        for e in events:
            if _on_device(e):
                on_device[e.name] += e.time_range.elapsed_us() / 1e3
        for name, kernel_ms in on_device.items():
            if kernel_ms - tied[name] > UNTIED_EPS_MS:
                orphans[name] += kernel_ms - tied[name]
        names = kernel_names(launches)
        for name, kernel_ms in orphans.items():
            slot = names.get(name)
            if slot is not None:
                ms[slot] += kernel_ms
                shapes[slot][replayed_label(name)] += kernel_ms
    else:
        for e in events:
            m = _RANGE.match(e.name)
            if m and (e.cpu_parent is None or _slot_of(e.cpu_parent) is None):
                t = e.cpu_time_total / 1e3
                ms[m.group(1)] += t
                shapes[m.group(1)][f"{m.group(2)} {m.group(3)}"] += t
    slots = {s: {"ms": ms[s], "calls": calls[s], "shapes": dict(shapes[s])} for s in sorted(set(ms) | set(calls))}
    return {"slots": slots, "total_ms": wall_ms, "other_ms": max(wall_ms - sum(ms.values()), 0.0)}


def profile_trace(torch, run: Callable[[], None], device: str, seen: Seen | None = None) -> dict:
    """Run `run` (the whole trace, one pass) under torch.profiler and attribute its time."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        run()
        if device == "cuda":
            torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) * 1e3
    result = attribute(prof.events(), device, wall_ms, seen)
    result["source"] = f"torch.profiler, {'CUDA kernels' if device == 'cuda' else 'CPU ops'}"
    return result


def _ms(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= sys.float_info.max


def _label(value) -> bool:
    return isinstance(value, str) and len(value) <= MAX_LABEL_CHARS


def _slot_entry(entry) -> bool:
    """One slot's part of a claim in profile_trace's layout: its ms, its count of calls, each
    label's ms (a slot given as a number or a list had raised here, and the passed verdict had
    carried a crash)."""
    if not isinstance(entry, dict):
        return False
    calls, shapes = entry.get("calls"), entry.get("shapes")
    return _ms(entry.get("ms")) and isinstance(calls, int) and not isinstance(calls, bool) and calls >= 0 \
        and isinstance(shapes, dict) and len(shapes) <= MAX_LABELS and all(_label(k) and _ms(v) for k, v in shapes.items())


def claimed(slot_ms) -> dict:
    """A worker's slot_ms as the judge passes it on: `profile_trace`'s layout (known slots, finite
    milliseconds and counts, short labels), rebuilt from those fields; {} (no profile) for anything
    else. The claim goes into the agent's arithmetic and the model's prompts: a worker's "ms" that
    was a string had stopped the LLM proposer for the rest of the run (red-team helper, thirty-eighth
    session)."""
    if not isinstance(slot_ms, dict) or not isinstance(slot_ms.get("slots"), dict) \
            or len(slot_ms["slots"]) > len(CONTRACTS):
        return {}
    if not (_ms(slot_ms.get("total_ms")) and _ms(slot_ms.get("other_ms")) and _label(slot_ms.get("source", ""))):
        return {}
    slots = {}
    for slot, entry in slot_ms["slots"].items():
        if slot not in CONTRACTS or not _slot_entry(entry):
            return {}
        slots[slot] = {"ms": float(entry["ms"]), "calls": entry["calls"],
                       "shapes": {k: float(v) for k, v in entry["shapes"].items()}}
    out = {"slots": slots, "total_ms": float(slot_ms["total_ms"]), "other_ms": float(slot_ms["other_ms"]),
           "source": slot_ms.get("source", "")}
    rows = slot_ms.get("fused_rows")
    if isinstance(rows, int) and not isinstance(rows, bool):
        out["fused_rows"] = rows
    return out


def merge(total: dict | None, part: dict) -> dict:
    """Two passes' slot_ms as one (the benchmark cases profiled one after another); an empty one
    (a claim `claimed` refused) adds nothing."""
    if not total or not part:
        return total or part
    out = {"source": part.get("source", total.get("source", "")),
           "total_ms": total["total_ms"] + part["total_ms"], "other_ms": total["other_ms"] + part["other_ms"],
           "slots": {}}
    if "fused_rows" in part or "fused_rows" in total:
        out["fused_rows"] = part.get("fused_rows", total.get("fused_rows"))
    for slot in sorted(set(total["slots"]) | set(part["slots"])):
        a, b = total["slots"].get(slot, {}), part["slots"].get(slot, {})
        shapes = dict(a.get("shapes", {}))
        for k, v in b.get("shapes", {}).items():
            shapes[k] = shapes.get(k, 0.0) + v
        out["slots"][slot] = {"ms": a.get("ms", 0.0) + b.get("ms", 0.0),
                              "calls": a.get("calls", 0) + b.get("calls", 0), "shapes": shapes}
    return out
