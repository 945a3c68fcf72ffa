"""The offline proposer: walks the template menu (agent/search.py), never repeating a plan."""
from __future__ import annotations

from collections.abc import Iterator

from agent import search
from agent.archive import Archive
from agent.plan import Plan, engine_models, engine_params, engines, menu
from agent.records import Candidate, EvalResult, SearchState


class BuiltinProposer:
    """The walk builds on the loop's best of its engine, model-written variants included (their
    texts come from the archive), and starts over from the best once it has run out, if the best
    changed since it started: the library's variants and the engine parameters are then tried on
    whatever the model (or the walk itself) made best. `kernels` False: the all-torch engine and
its parameters only (agent/search.py, `--builtin-walk params`)."""

    name = "builtin"

    def __init__(self, device: str, engine: str = search.FAST_ENGINE, kernels: bool = True):
        self.device = device
        self.engine = engine
        self.kernels = kernels
        self._state: SearchState | None = None
        self._walk: Iterator[tuple[Plan, str]] | None = None
        self._walked_from: str | None = None      # the best's key when the current walk started
        self.waiting = False   # the last propose had nothing now, not nothing left: its walk waits for a verdict

    def _start(self) -> Iterator[tuple[Plan, str]]:
        if self.engine not in engines() or not self._runs_model():
            return iter(())
        params = engine_params(self.engine)
        start = search.default_plan(self.engine, params)
        base = lambda: self._base().plan if self._base() is not None else start  # noqa: E731
        pending = lambda plan: self._state is not None and plan.key() in self._state.pending  # noqa: E731
        return search.walk(base, self.device, menu(), params, start, self.kernels, pending)

    def _base(self) -> Candidate | None:
        """The loop's best, when it is an engine of the walk (its plan is what the walk varies)."""
        best = self._state.best if self._state is not None else None
        return best if best is not None and best.plan.engine == self.engine else None

    def _runs_model(self) -> bool:
        """Whether the walked engine renders this model's conventions (a Hugging Face model
        on an engine that does not: nothing to walk; the conservative engine stands)."""
        spec = self._state.spec if self._state is not None else None
        return spec is None or not spec.conventions.hf or "hf" in engine_models(self.engine)

    def propose(self, state: SearchState) -> Candidate | None:
        self._state = state
        self.waiting = False
        for _ in range(2):   # the walk, then once more if the best changed since it began
            if self._walk is None:
                self._walk, self._walked_from = self._start(), self._best_key()
            for plan, note in self._walk:
                if plan is None:   # the walk's next step waits for a verdict to come: nothing now
                    self.waiting = True
                    return None
                candidate = self._candidate(plan, note, state)
                if not state.tried(candidate):
                    return candidate
            if self._best_key() == self._walked_from:
                return None
            self._walk = None
        return None

    def _best_key(self) -> str | None:
        base = self._base()
        return base.key() if base is not None else None

    def _candidate(self, plan: Plan, note: str, state: SearchState) -> Candidate:
        """The plan with the texts of the model-written variants it names (from the archive), and
        the best as its parent when it was built on it."""
        archive = Archive.of(state)
        known = archive.texts()
        extra = {(s, v): known[(s, v)] for s, v in plan.slots.items() if (s, v) in known}
        base = self._base()
        parent = archive.index_of(base) if base is not None and plan.engine == base.plan.engine else None
        return Candidate(plan, origin=self.name, note=note, extra_variants=extra, parent=parent)

    def feedback(self, candidate: Candidate, result: EvalResult) -> None:
        """Nothing to learn: the walk re-reads the best plan from the state at every step."""
