"""The offline proposer: walks the template menu (agent/search.py), never repeating a plan."""
from __future__ import annotations

from collections.abc import Iterator

from agent import search
from agent.plan import Plan, engine_models, engine_params, engines, menu
from agent.records import Candidate, EvalResult, SearchState


class BuiltinProposer:
    name = "builtin"

    def __init__(self, device: str, engine: str = search.FAST_ENGINE):
        self.device = device
        self.engine = engine
        self._state: SearchState | None = None
        self._walk: Iterator[tuple[Plan, str]] | None = None

    def _start(self) -> Iterator[tuple[Plan, str]]:
        if self.engine not in engines() or not self._runs_model():
            return iter(())
        params = engine_params(self.engine)
        start = search.default_plan(self.engine, params)
        base = lambda: search.best_plan_of(self.engine, self._state, start)  # noqa: E731
        return search.walk(base, self.device, menu(), params, start)

    def _runs_model(self) -> bool:
        """Whether the walked engine renders this model's conventions (a Hugging Face model
        on an engine that does not: nothing to walk; the conservative engine stands)."""
        spec = self._state.spec if self._state is not None else None
        return spec is None or not spec.conventions.hf or "hf" in engine_models(self.engine)

    def propose(self, state: SearchState) -> Candidate | None:
        self._state = state
        if self._walk is None:
            self._walk = self._start()
        for plan, note in self._walk:
            candidate = Candidate(plan, origin=self.name, note=note)
            if not state.tried(candidate):
                return candidate
        return None

    def feedback(self, candidate: Candidate, result: EvalResult) -> None:
        """Nothing to learn: the walk re-reads the best plan from the state at every step."""
