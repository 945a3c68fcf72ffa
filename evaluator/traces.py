"""Request traces: what the benchmark times, the floor model prices and the stress suite checks.

A trace is a list of `Op`s. Tokens are never stored here: the runner draws them (fresh
random ids), so a trace is only the schedule of calls (docs/design.md §3).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Iterator

PREFILL, DECODE, REMOVE = "prefill", "decode", "remove"


@dataclass(frozen=True)
class Op:
    kind: str                       # PREFILL, DECODE or REMOVE
    request_ids: tuple[int, ...]
    lengths: tuple[int, ...] = ()   # prompt lengths, prefill only

    def __post_init__(self):
        if self.kind not in (PREFILL, DECODE, REMOVE):
            raise ValueError(f"unknown op kind {self.kind!r}")
        if (self.kind == PREFILL) != bool(self.lengths) or (self.lengths and len(self.lengths) != len(self.request_ids)):
            raise ValueError(f"{self.kind} op with request_ids {self.request_ids} and lengths {self.lengths}")

    def describe(self) -> str:
        ids = list(self.request_ids)
        if self.kind == PREFILL:
            return f"prefill({ids}, lens {list(self.lengths)})"
        return f"{self.kind}({ids})"


def prefill(ids, lengths) -> Op:
    return Op(PREFILL, tuple(ids), tuple(lengths))


def decode(ids) -> Op:
    return Op(DECODE, tuple(ids))


def remove(ids) -> Op:
    return Op(REMOVE, tuple(ids))


@dataclass
class Contexts:
    """Live requests and their current lengths, replayed op by op (remove ignores unknown ids)."""

    lengths: dict[int, int] = field(default_factory=dict)

    def apply(self, op: Op) -> None:
        if op.kind == PREFILL:
            self.lengths.update(zip(op.request_ids, op.lengths))
        elif op.kind == DECODE:
            for rid in op.request_ids:
                self.lengths[rid] += 1
        else:
            for rid in op.request_ids:
                self.lengths.pop(rid, None)


def replay(trace: list[Op]) -> Iterator[tuple[Op, dict[int, int]]]:
    """Each op with the live lengths right after it (a decode's context includes its token)."""
    ctx = Contexts()
    for op in trace:
        ctx.apply(op)
        yield op, ctx.lengths


def longest_context(trace: list[Op]) -> int:
    """The longest context any request of `trace` reaches."""
    return max((max(lengths.values(), default=0) for _, lengths in replay(trace)), default=0)


def token_counts(trace: list[Op]) -> tuple[int, int]:
    """(prefill tokens, decode tokens) of a trace, as the benchmark counts them."""
    pre = sum(sum(op.lengths) for op in trace if op.kind == PREFILL)
    dec = sum(len(op.request_ids) for op in trace if op.kind == DECODE)
    return pre, dec


# ---- benchmark cases (SPEC.md §5), request ids consecutive from 0 ----

def prefill_case(batch: int = 4, prompt: int = 128) -> list[Op]:
    ids = range(batch)
    return [prefill(ids, [prompt] * batch), remove(ids)]


def decode_case(batch: int = 8, prompt: int = 32, steps: int = 16) -> list[Op]:
    ids = range(batch)
    return [prefill(ids, [prompt] * batch), *[decode(ids) for _ in range(steps)], remove(ids)]


def mixed_case(first: int = 64, second: int = 128, third: int = 32) -> list[Op]:
    """prefill 4×first; decode 4; decode 4; prefill 2×second; decode 6; remove 2;
    prefill 4×third; decode 8; decode 8; remove 8. Decode and remove take the lowest live
    ids (`sorted(active)[:count]`), so decode batches are ragged."""
    trace: list[Op] = []
    active: set[int] = set()
    next_id = 0

    def add(count: int, length: int) -> None:
        nonlocal next_id
        ids = list(range(next_id, next_id + count))
        next_id += count
        active.update(ids)
        trace.append(prefill(ids, [length] * count))

    def lowest(count: int) -> list[int]:
        return sorted(active)[:count]

    def drop(count: int) -> None:
        ids = lowest(count)
        active.difference_update(ids)
        trace.append(remove(ids))

    add(4, first)
    trace += [decode(lowest(4)), decode(lowest(4))]
    add(2, second)
    trace.append(decode(lowest(6)))
    drop(2)
    add(4, third)
    trace += [decode(lowest(8)), decode(lowest(8))]
    drop(8)
    return trace


PUBLIC_CASES = ("prefill", "decode", "mixed")
BENCHMARK_CASES: dict[str, Callable[[], list[Op]]] = {
    "prefill": prefill_case,
    "decode": decode_case,
    "mixed": mixed_case,
    # the hidden run's style with longer prompts (SPEC.md §5)
    "decode128": lambda: decode_case(prompt=128),
    "mixed128": lambda: mixed_case(128, 128, 128),
    # a scale family: more work per call than the public cases
    "prefill-long": lambda: prefill_case(batch=8, prompt=2048),
    "decode-wide": lambda: decode_case(batch=64, prompt=512, steps=32),
}


def benchmark_trace(name: str) -> list[Op]:
    if name not in BENCHMARK_CASES:
        raise ValueError(f"unknown benchmark case {name!r}; known: {', '.join(BENCHMARK_CASES)}")
    return BENCHMARK_CASES[name]()


# ---- the public correctness sequence (SPEC.md §4) ----

def public_sequence() -> list[Op]:
    return [
        prefill([0], [11]), decode([0]), prefill([1, 2], [7, 13]), decode([0, 1, 2]),
        remove([1]), prefill([3], [5]), decode([0, 2, 3]), remove([0, 2, 3]),
    ]


# ---- stress scenarios: each ends with nothing live, so scenarios can share an engine ----

@dataclass(frozen=True)
class StressSize:
    """How big the stress scenarios are: quick (CPU, CI) or full (GPU)."""

    long_prompt: int      # the one long prompt (>= 1024 tokens)
    long_decode_steps: int
    wide_batch: int       # requests in the wide scenario
    wide_max_prompt: int
    wide_steps: int
    churn_max_prompt: int
    mixed_rounds: int
    mixed_max_prompt: int


QUICK = StressSize(long_prompt=1030, long_decode_steps=2, wide_batch=24, wide_max_prompt=40,
                   wide_steps=4, churn_max_prompt=24, mixed_rounds=3, mixed_max_prompt=48)
FULL = StressSize(long_prompt=2100, long_decode_steps=8, wide_batch=64, wide_max_prompt=600,
                  wide_steps=10, churn_max_prompt=300, mixed_rounds=8, mixed_max_prompt=512)


LONG_PROMPT_EXTRA = 8   # the long prompt is long_prompt plus fewer tokens than this, drawn


def longest_checked_context(cases: list[str] | tuple[str, ...]) -> int:
    """The longest context a judge asks of an engine: the benchmark `cases` it times and the full
    stress suite's long prompt (long_prompt_scenario: its prompt, then its decode steps)."""
    stress = FULL.long_prompt + LONG_PROMPT_EXTRA - 1 + FULL.long_decode_steps
    return max([stress, *(longest_context(benchmark_trace(c)) for c in cases)])


def _ids(rng: random.Random, count: int) -> list[int]:
    """Distinct, non-contiguous, large request ids in no particular order."""
    ids: set[int] = set()
    while len(ids) < count:
        ids.add(rng.choice((rng.randrange(1_000, 10**6), rng.randrange(2**31, 2**40))))
    return _unsorted(rng, list(ids))


def _unsorted(rng: random.Random, ids: list[int]) -> list[int]:
    """A shuffled copy that is never in ascending order (when it has two or more ids), so a
    call always tells caller order from sorted order."""
    ids = list(ids)
    rng.shuffle(ids)
    if len(ids) > 1 and ids == sorted(ids):
        ids.reverse()
    return ids


def _subset(rng: random.Random, live: list[int], at_least: int = 1) -> list[int]:
    count = rng.randint(min(at_least, len(live)), len(live))
    return _unsorted(rng, rng.sample(live, count))


def long_prompt_scenario(rng: random.Random, size: StressSize) -> list[Op]:
    """One prompt of >= 1024 tokens next to a one-token prompt in the same call, then decodes."""
    long_id, short_id = _ids(rng, 2)
    trace = [prefill([long_id, short_id], [size.long_prompt + rng.randrange(LONG_PROMPT_EXTRA), 1])]
    trace += [decode(_unsorted(rng, [long_id, short_id])) for _ in range(size.long_decode_steps)]
    return trace + [remove([short_id, long_id])]


def wide_batch_scenario(rng: random.Random, size: StressSize) -> list[Op]:
    """A wide prefill of ragged prompts, then decodes of shuffled subsets."""
    ids = _ids(rng, size.wide_batch)
    lengths = [rng.randint(1, size.wide_max_prompt) for _ in ids]
    trace = [prefill(ids, lengths)]
    trace.append(decode(_unsorted(rng, ids)))
    trace += [decode(_subset(rng, ids)) for _ in range(size.wide_steps - 1)]
    return trace + [remove(_unsorted(rng, ids))]


def churn_scenario(rng: random.Random, size: StressSize) -> list[Op]:
    """Lifecycle edge cases: id reuse after remove, prefill replacing a live request (alone
    and next to a new one), removing unknown ids, removing everything then continuing."""
    a, b, c, d, e, unknown = _ids(rng, 6)

    def p(ids: list[int]) -> Op:
        return prefill(_unsorted(rng, ids), [rng.randint(1, size.churn_max_prompt) for _ in ids])

    return [
        p([a, b, c]),
        decode(_unsorted(rng, [a, b, c])),
        remove([b]),
        p([b]),                                   # id reuse after remove
        decode(_unsorted(rng, [a, b, c])),
        p([a]),                                   # replace a live request
        decode(_unsorted(rng, [c, a])),
        p([d, c]),                                # a new one and a replacement in one call
        decode(_unsorted(rng, [a, b, c, d])),
        remove([unknown, c]),                     # unknown ids are ignored
        decode(_unsorted(rng, [d, a, b])),
        remove([a, b, d, unknown]),               # everything gone
        p([e, a]),                                # ...and the engine keeps working
        decode(_unsorted(rng, [a, e])),
        decode(_unsorted(rng, [e, a])),
        remove([a, e]),
    ]


def mixed_scenario(rng: random.Random, size: StressSize) -> list[Op]:
    """Rounds of prefill / decode / remove on a pool of requests, in random proportions."""
    pool = _ids(rng, 4 * size.mixed_rounds + 4)
    live: list[int] = []
    trace: list[Op] = []
    for _ in range(size.mixed_rounds):
        new = _unsorted(rng, [pool.pop() for _ in range(rng.randint(1, 4))])
        trace.append(prefill(new, [rng.randint(1, size.mixed_max_prompt) for _ in new]))
        live += new
        for _ in range(rng.randint(1, 3)):
            trace.append(decode(_subset(rng, live)))
        if len(live) > 2:
            gone = rng.sample(live, rng.randint(1, len(live) - 1))
            live = [r for r in live if r not in gone]
            trace.append(remove(gone))
    return trace + [remove(live)]


def rerun_scenario(rng: random.Random, size: StressSize) -> list[Op]:
    """The same calls twice (same ids, same prompt lengths, the same decode twice in a row),
    with fresh tokens every time: an engine that answers from a cache keyed by ids or shapes
    (the previous call's logits), or that keeps state from the first pass in blocks the second
    pass reuses, fails."""
    ids = _ids(rng, rng.randint(2, 4))
    order = _unsorted(rng, ids)
    once = [prefill(ids, [rng.randint(1, size.churn_max_prompt) for _ in ids]), decode(order), decode(order),
            remove(_unsorted(rng, ids))]
    return once + once


LONG_PROMPT = "long_prompt"
STRESS_SCENARIOS: dict[str, Callable[[random.Random, StressSize], list[Op]]] = {
    LONG_PROMPT: long_prompt_scenario,
    "wide_batch": wide_batch_scenario,
    "churn": churn_scenario,
    "mixed": mixed_scenario,
    "rerun": rerun_scenario,
}
