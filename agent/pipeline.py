"""Candidates for the judge, with the model asked in parallel (docs/design.md §1, docs/llm.md).

The judge (the loop's thread) takes one candidate at a time, so evaluations never overlap and
their timings do not disturb each other; on a host of several GPUs, each other GPU's judge
screens candidates drawn ahead (`next` with `wait` off, agent/screens.py), and the proposers see
what is handed out and not judged yet as `SearchState.pending`. Where the proposer is the LLM proposer and `parallel`
is above 1, `parallel` worker threads keep that many model episodes going (request, extraction,
policy, unit check) while the judge works; each episode builds on a parent the archive chooses
(agent/archive.py). The builtin walk is drawn only when the judge is free, so each of its steps
builds on the latest best; the judge alternates between a ready model candidate and the builtin
walk, so the builtin lineage keeps going beside the model and a run is never starved of either.
With `parallel` 1, or a proposer that has no model side, candidates come from `propose` in turn,
exactly as a serial loop would ask.

A challenger that passed its screen may be built on before its final verdict, while the archive
offers the model nothing to build on (`screened`): on a CPU the first final of the KV-cache
engine (its stress suite) can take most of a short budget, and the model would otherwise wait
it out and never be asked. Its candidates are judged in full like any other.

The candidates waiting for the judge that carry model-written code (ready, the one it is judging,
and those whose verdict the budget cut short: EvalResult.unfinished) are handed to `keep` whenever
that list changes (the loop writes them to the workspace), and a resumed run's (`state.waiting`)
start the queue: a run cut before their verdicts does not lose what the model wrote and the
checks passed.

No worker starts a request the run's deadline cannot hold (the LLM proposer checks its own
request timeout against it); workers are daemon threads, so a run that ends does not wait for
an answer nobody will judge.
"""
from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import replace

from agent.archive import Archive, Member
from agent.records import Candidate, EvalResult, Proposer, SearchState

MAX_REPEATS = 20      # consecutive already-judged proposals from one side before it is given up
PARALLEL_ENV = "LLM_PARALLEL"
DEFAULT_PARALLEL = 4  # model requests in flight, for LLM providers
IDLE_POLL_SECONDS = 1.0


class Pipeline:
    def __init__(self, proposer: Proposer, state: SearchState, parallel: int, deadline: float,
                 log: Callable[[str], None], keep: Callable[[list[Candidate]], None] = lambda waiting: None):
        """`deadline`: time.monotonic() when proposals stop being useful (the run's end). `keep`
        hears the model candidates waiting for a verdict each time they change."""
        self.proposer, self.state, self.deadline, self.log, self.keep = proposer, state, deadline, log, keep
        model_side = hasattr(proposer, "ask") and hasattr(proposer, "fallback")
        self.parallel = parallel if model_side and parallel > 1 else 1
        self.builtin: Proposer = proposer.fallback if self.parallel > 1 else proposer
        self.ready: list[Candidate] = [c for c in state.waiting if not state.tried(c)]
        self.taken: dict[str, Candidate] = {}   # every candidate handed out whose verdict has not come, by key
        self.cut: list[Candidate] = []          # ... whose verdict the budget cut short: for a resumed run only
        self._kept_keys = [c.key() for c in self.ready]   # what `keep` last took (a resumed run's: its file's)
        self._keep_failed = False
        self.in_flight = 0
        self.workers = 0
        self.judged = 0
        self.started = time.monotonic()
        self.last_model = False       # the last candidate handed to the judge came from the model
        self.screen: Member | None = None   # a challenger past its screen, its final verdict to come
        self.stopped = False
        self.cond = threading.Condition()
        self._builtin_keys: set[str] = set()
        self.merges: list[Candidate] = []   # Archive.merge's candidates, judged before anything else
        self._best = Archive.of(state).index_of(state.best) if state.best is not None else None
        for i in range(self.parallel if self.parallel > 1 else 0):
            self.workers += 1
            threading.Thread(target=self._work, name=f"proposer-{i + 1}", daemon=True).start()

    # --- the judge's side -----------------------------------------------------------------
    def next(self, idle: Callable[[], None] | None = None, wait: bool = True) -> Candidate | None:
        """The next candidate to judge, or None when no side has anything left before the deadline.
        `idle` (the judge's own pending work: a provisional best's final) runs, once, where the
        judge would otherwise wait for the model. `wait` False: None also where nothing is ready
        now (a screen ahead on another GPU takes what is, agent/screens.py)."""
        while True:
            with self.cond:
                while self.merges:
                    candidate = self.merges.pop(0)
                    if not self._known(candidate):
                        self._builtin_keys.add(candidate.key())
                        return self._judging(candidate)
                if self.ready and not self.last_model:
                    candidate = self._take()
                    if candidate is not None:
                        return candidate
                    continue
            candidate = self._draw(self.builtin)
            if candidate is not None:
                self._builtin_keys.add(candidate.key())
                self.last_model = False
                with self.cond:
                    return self._judging(candidate)
            with self.cond:
                if self.ready:
                    candidate = self._take()
                    if candidate is not None:
                        return candidate
                    continue
                if not wait or self.workers == 0 or time.monotonic() >= self.deadline:
                    return None
                if self.in_flight == 0 and self.proposer.paused(self.state):   # only a new best engine wakes it
                    if idle is None:
                        return None
                if idle is None:
                    self.cond.wait(min(IDLE_POLL_SECONDS, max(self.deadline - time.monotonic(), 0.01)))
                    continue
            idle()   # outside the lock: the model's workers go on meanwhile
            idle = None

    def feedback(self, candidate: Candidate, result: EvalResult) -> None:
        self.judged += 1
        key = candidate.key()
        side = self.builtin if key in self._builtin_keys else self.proposer
        self._builtin_keys.discard(key)
        if not result.unfinished:   # the budget cut it short: nothing to learn of the candidate
            side.feedback(candidate, result)
        archive = Archive.of(self.state)
        best = archive.index_of(self.state.best) if self.state.best is not None else None
        if best is not None and self._best is not None and best != self._best:   # a new best: join the lineages
            merged = archive.merge(self._best, best)
            if merged is not None:
                self.log(f"     next: {merged.note}")
                self.merges.append(merged)
        self._best = best
        with self.cond:
            self.screen = None   # its verdict is in: the archive holds it, or it failed
            judged = self.taken.pop(key, None)
            if judged is not None and judged.extra_variants:
                if result.unfinished:   # judged again on --resume (agent/resume.py): still waiting
                    self.cut.append(judged)
                self._kept()
            self.cond.notify_all()   # a worker waiting for room (or for a basis) may go on

    def final(self, candidate: Candidate, result: EvalResult) -> None:
        """The deferred final's verdict on a candidate judged before (agent/loop.py settle_final):
        its proposer, told "faster: accepted" at the contest, hears whether the engine held."""
        self.proposer.feedback(candidate, result)

    def screened(self, index: int, candidate: Candidate, screen: EvalResult) -> None:
        """Candidate #`index` passed its screen; the model may build on it until its verdict."""
        with self.cond:
            self.screen = Member(index, candidate, screen)
            self.cond.notify_all()

    def status(self) -> str:
        minutes = max(time.monotonic() - self.started, 1e-9) / 60
        rate = f"{self.judged / minutes:.2f} candidates judged per minute"
        if self.parallel == 1:
            return f"pipeline: serial; {rate}"
        return f"pipeline: {self.in_flight} model episodes in flight, {len(self.ready)} ready, {rate}"

    def close(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _take(self) -> Candidate | None:
        """The first ready candidate, now the one being judged; None when it was judged already."""
        self.last_model = True
        candidate = self.ready.pop(0)
        self.cond.notify_all()
        return None if self._known(candidate) else self._judging(candidate)

    def _judging(self, candidate: Candidate) -> Candidate:
        """`candidate`, handed to the judge: kept until its verdict if it carries model-written code
        (from the model, or built on it by the builtin walk or a merge, or any side of a serial run)."""
        self.taken[candidate.key()] = candidate
        self._kept()
        return candidate

    def _known(self, candidate: Candidate) -> bool:
        """Judged, or handed out and its verdict to come (a screen ahead may hold several)."""
        return self.state.tried(candidate) or candidate.key() in self.taken

    def _kept(self) -> None:
        """Hand the waiting model candidates to `keep` (under the lock) where they changed: a run
        of the builtin walk alone writes nothing. A failure is logged once: the run goes on, only
        a resume would lose them."""
        judging = [c for c in self.taken.values() if c.extra_variants]   # handed out, in that order
        waiting = self.cut + judging + self.ready
        keys = [c.key() for c in waiting]
        if keys == self._kept_keys:
            return
        try:
            self.keep(waiting)
            self._kept_keys = keys
        except OSError as e:
            if not self._keep_failed:
                self.log(f"warning: the model candidates waiting for the judge could not be kept ({e}); "
                         "a resumed run would not judge them")
            self._keep_failed = True

    def _draw(self, side: Proposer) -> Candidate | None:
        """Ask one side, skipping (loudly) what was judged already; an error ends that side."""
        for _ in range(MAX_REPEATS):
            try:
                candidate = side.propose(self._view(self.state.best, self.state.best_result))
            except Exception:  # noqa: BLE001 - logged in full; the best engine so far stays
                self.log(f"warning: proposer '{side.name}' failed; it is asked no more:\n{traceback.format_exc()}")
                self.builtin = _Dry(side.name)
                return None
            if candidate is None or not self._known(candidate):
                return candidate
            what = "a candidate being judged" if candidate.key() in self.taken else "an already-judged candidate"
            self.log(f"warning: proposer '{side.name}' repeated {what}: {candidate.plan.describe()}")
        self.log(f"warning: proposer '{side.name}' repeated itself {MAX_REPEATS} times; it is asked no more")
        self.builtin = _Dry(side.name)
        return None

    def _view(self, best, best_result) -> SearchState:
        """The state as a proposer sees it now, with `best` the engine to build on."""
        with self.cond:   # (an RLock: also from under it)
            pending = frozenset(c.plan.key() for c in self.taken.values())
        return replace(self.state, best=best, best_result=best_result, seconds_left=self.deadline - time.monotonic(),
                       pending=pending)

    # --- the workers' side ----------------------------------------------------------------
    def _work(self) -> None:
        model = self.proposer
        try:
            while True:
                with self.cond:
                    parent = self._parent()
                    while not self.stopped and (parent is None or self.in_flight + len(self.ready) >= self.parallel):
                        if not model.active or time.monotonic() >= self.deadline:
                            return
                        self.cond.wait(IDLE_POLL_SECONDS)
                        parent = self._parent()
                    if self.stopped:
                        return
                    self.in_flight += 1
                view = self._view(parent.candidate, parent.result)
                candidate = None
                try:
                    candidate = model.ask(view)
                finally:
                    with self.cond:   # one step: no moment with nothing in flight and the candidate not ready
                        self.in_flight -= 1
                        if candidate is not None and not self._known(candidate):
                            self.ready.append(replace(candidate, parent=parent.index))
                            self._kept()
                        self.cond.notify_all()
        except Exception:  # noqa: BLE001 - a bug here stops this worker, never the run
            self.log(f"warning: proposer worker failed:\n{traceback.format_exc()}")
        finally:
            with self.cond:
                self.workers -= 1
                self.cond.notify_all()

    def _parent(self):
        """The archive's choice among the engines the model can build on, else the challenger
        past its screen if the model can build on it; None: none yet."""
        if not self.proposer.active:
            return None
        eligible = lambda m: self.proposer.ready(self._view(m.candidate, m.result))  # noqa: E731
        chosen = Archive.of(self.state).choose_parent(eligible)
        if chosen is None and self.screen is not None and eligible(self.screen):
            return self.screen
        return chosen


class _Dry:
    """A side that has nothing more to give (it failed, or it kept repeating itself)."""

    def __init__(self, name: str):
        self.name = name

    def propose(self, state: SearchState) -> None:
        return None

    def feedback(self, candidate: Candidate, result: EvalResult) -> None:
        pass
