"""The population: every passing engine of the run and every model-written variant, derived from
the history (results.json and candidates/*/variants on a resumed run), never stored apart.

A view, rebuilt from `state.history` whenever it is asked: the history is the one source of
truth, so a resumed run (agent/resume.py restores the history) has the same archive with no
second file to keep consistent. Parents are chosen by a deterministic UCB1 bandit over the
passing engines (docs/design.md §6): the score, as a fraction of the best, plus a bonus that
shrinks with the number of children a parent already has, so a good engine that has been built
on less gets its turn, and a replayed run chooses the same parents.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from agent.plan import Plan
from agent.records import Candidate, EvalResult, SearchState

EXPLORATION = 0.3      # UCB1's constant on scores normalised to the best (1.0): a parent at 80% of
                       # the best with no children outranks the best after about three of its children
PARENT_FLOOR = 0.5     # parents are engines within this fraction of the best (the rest are not worth a child)


@dataclass(frozen=True)
class Member:
    """One judged candidate of the archive: its 1-based index in the history and its verdict."""

    index: int
    candidate: Candidate
    result: EvalResult

    @property
    def score(self) -> float:
        return self.result.rank()


@dataclass(frozen=True)
class VariantRecord:
    """A model-written variant and the best score of an engine that held it."""

    slot: str
    name: str
    text: str
    best_score: float
    engines: int           # how many judged engines held it


class Archive:
    def __init__(self, history: list[tuple[Candidate, EvalResult]]):
        self.members = [Member(i + 1, c, r) for i, (c, r) in enumerate(history)]

    @staticmethod
    def of(state: SearchState) -> "Archive":
        return Archive(list(state.history))

    def passing(self) -> list[Member]:
        """Passing engines, best first (a tie goes to the earlier one)."""
        return sorted((m for m in self.members if m.result.passed and m.score > 0),
                      key=lambda m: (-m.score, m.index))

    def children(self, index: int) -> int:
        return sum(1 for m in self.members if m.candidate.parent == index)

    def choose_parent(self, eligible=lambda member: True) -> Member | None:
        """UCB1 over the passing engines within PARENT_FLOOR of the best that `eligible` allows."""
        pool = [m for m in self.passing() if eligible(m)]
        if not pool:
            return None
        best = pool[0].score
        pool = [m for m in pool if m.score >= PARENT_FLOOR * best]
        total = sum(self.children(m.index) for m in pool) + 1

        def value(m: Member) -> float:
            return m.score / best + EXPLORATION * math.sqrt(math.log(total) / (1 + self.children(m.index)))
        return max(pool, key=lambda m: (value(m), -m.index))

    def variants(self) -> dict[tuple[str, str], VariantRecord]:
        """Every model-written variant of the run with the best score of an engine that held it
        (0 when none passed): the texts a plan built on any of them needs to render."""
        out: dict[tuple[str, str], VariantRecord] = {}
        for m in self.members:
            for (slot, name), text in m.candidate.extra_variants.items():
                old = out.get((slot, name))
                score = m.score if m.result.passed else 0.0
                out[(slot, name)] = VariantRecord(slot, name, text, max(score, old.best_score if old else 0.0),
                                                  (old.engines if old else 0) + 1)
        return out

    def texts(self) -> dict[tuple[str, str], str]:
        return {key: record.text for key, record in self.variants().items()}

    def index_of(self, candidate: Candidate) -> int | None:
        key = candidate.key()
        return next((m.index for m in self.members if m.candidate.key() == key), None)

    def lineage(self, index: int) -> list[int]:
        """#`index` and the engines it was built on, parent by parent (nearest first)."""
        out = []
        while index is not None and 1 <= index <= len(self.members) and index not in out:
            out.append(index)
            index = self.members[index - 1].candidate.parent
        return out

    def merge(self, replaced: int, accepted: int) -> Candidate | None:
        """The two lineages as one engine: what #`replaced` (the best #`accepted` replaced)
        changed from their nearest common ancestor, in slots #`accepted` left as that ancestor had
        them, put onto #`accepted`'s plan. None where there is nothing to add: #`replaced` is one
        of #`accepted`'s ancestors (its changes are in already), they share no ancestor, or not
        the same engine. Parallel model episodes build on engines the bandit chooses, so two slots
        can win on separate branches (a scripted good model on an H200, twenty-third session: a
        prefill attention won, then a decode attention built on the engine before it replaced it,
        and the prefill win was dropped)."""
        if not self.members[replaced - 1].result.passed:   # a winner whose deferred final failed: not ground to keep
            return None
        mine = self.lineage(accepted)
        common = next((i for i in self.lineage(replaced) if i in mine), None)
        if common is None or common == replaced:
            return None
        new, old = self.members[accepted - 1].candidate, self.members[replaced - 1].candidate
        base = self.members[common - 1].candidate.plan
        if not base.engine == old.plan.engine == new.plan.engine:
            return None
        theirs = {s: v for s, v in old.plan.slots.items()
                  if v != base.slots.get(s) and new.plan.slots.get(s) == base.slots.get(s)}
        if not theirs:
            return None
        plan = Plan(new.plan.engine, {**new.plan.slots, **theirs}, new.plan.params)
        known = {**old.extra_variants, **new.extra_variants}
        changes = ", ".join(f"{s}={v}" for s, v in sorted(theirs.items()))
        return Candidate(plan, "builtin", f"merge: #{replaced:03d}'s {changes} onto #{accepted:03d}",
                         {(s, v): known[(s, v)] for s, v in plan.slots.items() if (s, v) in known}, accepted)

    def summary(self) -> str:
        """One line for the log: engines, variants, the highest score. That one need not be the
        result: a contest may have found it within noise of the best (the log's summary says which
        is installed)."""
        passing, variants = self.passing(), self.variants()
        best = (f"highest score #{passing[0].index:03d} ({passing[0].score:.4g}: one verdict's timing; paired "
                f"contests decide the engine kept)" if passing else "none passing")
        return (f"archive: {len(passing)} passing engines of {len(self.members)}, "
                f"{len(variants)} model-written variants; {best}")
