"""What flows between the loop, the judge and the proposers (docs/design.md §2 and §6).

The bottom layer of the agent, with agent/plan.py and agent/spec.py: it imports nothing else of
the agent, so the loop, the judge, the report and every proposer can import it without
importing each other.

A proposer sees a `SearchState` and returns a `Candidate`; the judge turns a candidate into
an `EvalResult`; `improves` is the one rule that decides which result is better, shared by
the loop (what gets written to workspace/engine.py) and the builtin search (which plan to
vary next), so the two never disagree.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Protocol

from agent.plan import Plan

if TYPE_CHECKING:
    from agent.spec import ModelSpec

# A faster candidate must beat the best by this fraction: single timing runs on a busy
# machine move by a few percent, and replacing the engine on noise only churns the history.
MIN_GAIN = 0.02
# An engine must keep this much of the tolerance in hand on the real weights (the public
# sequence and the stress scenarios on the target model): an optimization that reorders
# floating-point work and lands near the tolerance there may cross it on the hidden traces.
# margin = 1 - max((|s - r| - rtol*|r|) / atol): 1 is exact, 0 is at the tolerance. The random
# stress models only have to pass: their weights are not the ones the engine will serve.
MIN_SAFETY_MARGIN = 0.5
# ...unless the judge itself is further than that from exact arithmetic on these weights
# (evaluator/noise.py: fp16/bf16 rounding alone can take half the tolerance); then the margin
# asked is the judge's own against fp32, an engine as close to the judge as the judge is to the
# exact answer, but never less than this: the checks then still leave 1.4x the worst error seen.
MARGIN_FLOOR = 0.3
# A benchmark case's timed runs' margin counts in an engine's margin where it is this much below
# the same case's checked pass (same traces, checked call by call): an engine exact where it is
# checked and looser where it is timed (EvalResult.margin). An honest engine's few timed rows
# are no worse than its many checked ones but by chance; fp16 rounding moves a margin ~0.1.
PATH_SLACK = 0.1
ACCEPTED = "faster"   # how an accepting decision begins (agent/acceptance.py)


# The error kind of a verdict the run's budget cut short (agent/loop.py cut_by_budget): the judge
# killed it because the run had no time left, not because the engine hung. Not a verdict on the
# engine: proposers are not told of it, and --resume judges the candidate again.
DEADLINE = "deadline"


@dataclass
class EvalResult:
    """The evaluator's JSON verdict (design.md §2), or one the judge made up for a
    timeout/crash/render failure (then `stage` may also be "render" or "unknown")."""

    status: str                      # "passed" | "failed"
    stage: str                       # "render" | "import" | "public" | "stress" | "benchmark" | "done" | "unknown"
    error_kind: str | None = None    # None | compile_error | runtime_error | wrong_result | timeout | crash | DEADLINE
    error: str | None = None
    device: str = ""
    public: dict | None = None
    stress: dict | None = None
    benchmark: list[dict] = field(default_factory=list)
    score: float | None = None
    reference_margin: float | None = None   # the judge's own margin against fp32 (evaluator/noise.py)
    isolation: str | None = None     # the worker's layers, as the evaluator logged them
    seconds: float = 0.0
    decision: str | None = None      # the loop's acceptance against the best (agent/acceptance.py)
    # A pass that is not yet a full verdict: the conservative engine's, before its stress suite
    # (agent/loop.py settle_conservative runs it once the engine stays the result).
    unstressed: bool = False
    # What the loop says of a passing verdict that differs from a challenger's, for results.log
    # and results.json: the one case the conservative engine was timed on, a stress failure that
    # left it installed ranked 0. None for every other verdict.
    note: str | None = None
    # The profiled pass (evaluator/slot_profile.py), when asked for: {"source", "case", "total_ms",
    # "other_ms", "slots": {slot: {"ms", "calls", "shapes": {label: ms}}}}. The worker's claim:
    # shown to the model, never scored.
    slot_ms: dict | None = None
    # Where the evaluation's time went, as the evaluator clocked it: {"judge start", "setup",
    # "worker", "public", "stress", "benchmark", "profile", "rest": seconds} (what ran).
    stage_seconds: dict | None = None
    # On CUDA with the run's shared Triton cache: the kernels this verdict's worker compiled itself.
    triton_compiled: int | None = None
    # The budget left no time to finish this verdict (a contest undecided for want of rounds, a won
    # contest whose final could not fit): like a DEADLINE, a resumed run judges it again.
    cut_short: bool = False

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def rank(self) -> float:
        """Higher is better: the evaluator's score (geometric mean of floor fractions), or,
        if it has none, the geometric mean of tokens/s over the benchmark cases."""
        if not self.passed:
            return 0.0
        if self.score is not None:
            return float(self.score)
        rates = [c.get("tokens_per_second") or 0.0 for c in self.benchmark]
        if not rates or min(rates) <= 0:
            return 0.0
        return math.exp(sum(math.log(r) for r in rates) / len(rates))

    def margin(self) -> float | None:
        """The worst margin on the real weights, or None if the verdict carries none: the checked
        calls' (public sequence, the stress suite's target), and a benchmark case's timed runs'
        (checked after the clock) where they show another path than its checked pass (PATH_SLACK):
        an engine can tell a timed trace from checked calls, and one exact where it was checked
        ran bf16 linears ~20% faster where it was timed (red-team helper, thirty-third session)."""
        margins = [part.get(key) for part, key in ((self.public, "worst_margin"), (self.stress, "target_margin"))
                   if part and part.get(key) is not None]
        for case in self.benchmark:
            timed, checked = case.get("timed_margin"), case.get("checked_margin")
            if timed is not None and (checked is None or timed < checked - PATH_SLACK):
                margins.append(timed)
        return min(margins, default=None)

    def required_margin(self) -> float:
        """MIN_SAFETY_MARGIN, or the judge's own margin against fp32 where that is smaller (see
        MARGIN_FLOOR)."""
        if self.reference_margin is None:
            return MIN_SAFETY_MARGIN
        return max(MARGIN_FLOOR, min(MIN_SAFETY_MARGIN, self.reference_margin))

    def safe(self) -> bool:
        margin = self.margin()
        return margin is None or margin >= self.required_margin()

    def tokens_per_second(self) -> dict[str, float]:
        return {c.get("case_name", "?"): float(c.get("tokens_per_second") or 0.0) for c in self.benchmark}

    @property
    def unfinished(self) -> bool:
        """The budget cut this verdict short (DEADLINE, or `cut_short`): not a verdict on the engine."""
        return self.error_kind == DEADLINE or self.cut_short

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> "EvalResult":
        known = {k: d[k] for k in EvalResult.__dataclass_fields__ if k in d}
        known.setdefault("status", "failed")
        known.setdefault("stage", "unknown")
        known["benchmark"] = list(known.get("benchmark") or [])
        return EvalResult(**known)

    @staticmethod
    def failure(stage: str, error_kind: str, error: str, device: str, seconds: float = 0.0) -> "EvalResult":
        return EvalResult(status="failed", stage=stage, error_kind=error_kind, error=error,
                          device=device, seconds=seconds)


def improves(new: EvalResult, old: EvalResult | None) -> bool:
    """The keep-the-best rule: only a passing result with a safe margin, and only if clearly
    faster than the best."""
    if not new.passed or not new.safe():
        return False
    if old is None or not old.passed:
        return True
    return new.rank() > old.rank() * (1.0 + MIN_GAIN)


@dataclass
class Candidate:
    """One engine to try: a plan plus, for LLM proposals, variant sources that are not files."""

    plan: Plan
    origin: str                      # "builtin", "openai:gpt-...", "replay", ...
    note: str                        # why it was proposed, one line
    extra_variants: dict[tuple[str, str], str] = field(default_factory=dict)
    parent: int | None = None        # the 1-based index of the judged engine it was built on (agent/archive.py)

    def key(self) -> str:
        """Identity for "never judge the same thing twice": the plan, plus the text of any
        in-memory variants (an LLM may resend a plan with different code under one name)."""
        if not self.extra_variants:
            return self.plan.key()
        digest = hashlib.sha256(json.dumps(sorted((f"{s}/{v}", t) for (s, v), t in self.extra_variants.items()))
                                .encode()).hexdigest()[:16]
        return f"{self.plan.key()}+{digest}"

    def to_dict(self) -> dict:
        return {"plan": self.plan.to_dict(), "origin": self.origin, "note": self.note,
                "extra_variants": sorted(f"{s}/{v}" for s, v in self.extra_variants), "parent": self.parent}

    def to_record(self) -> dict:
        """to_dict with the variants' texts: a candidate not judged yet has no folder that holds
        them (a judged one's are in candidates/*/variants), so a waiting one carries its own."""
        return {**self.to_dict(), "variant_texts": {f"{s}/{v}": t for (s, v), t in sorted(self.extra_variants.items())}}

    @staticmethod
    def from_record(d: dict) -> "Candidate":
        """The candidate `to_record` wrote. KeyError, TypeError or ValueError when `d` is not one."""
        texts = d["variant_texts"]
        if not isinstance(texts, dict) or not all(
                isinstance(t, str) and isinstance(k, str) and k.count("/") == 1
                and all(part.isidentifier() for part in k.split("/")) for k, t in texts.items()):
            raise ValueError("variant_texts is not a map of slot/name (identifiers) to text")
        parent = d.get("parent")
        return Candidate(Plan.from_dict(d["plan"]), str(d["origin"]), str(d.get("note", "")),
                         {tuple(k.split("/", 1)): t for k, t in texts.items()},
                         int(parent) if parent is not None else None)


@dataclass
class SearchState:
    """Everything a proposer may look at. The loop owns it and appends to `history`."""

    spec: "ModelSpec"
    device: str                      # "cpu" | "cuda"
    hardware: dict                   # facts: gpu name, cpu count, torch version...
    seconds_left: float = 0.0
    history: list[tuple[Candidate, EvalResult]] = field(default_factory=list)
    # Model candidates an interrupted run had checked (policy, unit check) but not judged yet,
    # restored by --resume (agent/resume.py): the head of the pipeline's queue, and the model's
    # plan menu lists their variants, as before the interruption.
    waiting: list[Candidate] = field(default_factory=list)
    # Plan keys of candidates handed to the judge whose verdicts are to come (more than the one
    # judged where screens run ahead on other GPUs, agent/screens.py): the proposers' view of it.
    pending: frozenset[str] = frozenset()
    best: Candidate | None = None
    best_result: EvalResult | None = None

    def tried(self, candidate: Candidate) -> bool:
        key = candidate.key()
        return any(c.key() == key for c, _ in self.history)


class Proposer(Protocol):
    name: str

    def propose(self, state: SearchState) -> Candidate | None:
        """The next candidate, or None when there is nothing left to try."""

    def feedback(self, candidate: Candidate, result: EvalResult) -> None:
        """The verdict on a candidate this proposer returned."""

