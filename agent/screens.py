"""Screens ahead: on a host of several GPUs, the candidates after the one the loop is judging are
screened on the other GPUs meanwhile (issue 26, "parallel candidate evaluation").

A challenger's screen (the public sequence and one fresh engine a benchmark case, agent/judge.py
TIMING) is most of what the search pays for it: most candidates end there (a failure, or slower
than the best). So the loop (agent/loop.py) keeps its one judge on the first GPU for everything
that decides (the conservative engine, the contests' back-to-back timings against the best, the
finals whose timing is installed), and each other GPU has a judge of its own that screens the
candidates the loop will take next. When the loop reaches a candidate screened ahead it takes that
verdict as the candidate's screen (the screen's folder moves into the candidate's), and goes on
with its contest and final as for any other.

Each judge runs on one GPU alone and on its own share of the host's CPUs (agent/judge.py Place),
so no timing shares a GPU, and one judge's compiles do not take the cores another's timed host
thread runs on. A screen ahead is timed on another GPU than the best's score was, which is why it
only decides what goes on: a contest times both engines back to back on the first GPU, and a
clear win's final times it there in full before it is installed (agent/loop.py unconfirmed_win).

A candidate is drawn ahead only from what the proposers have ready now (agent/pipeline.py `next`
with `wait` off): the builtin walk's next step from the current best, or a checked model answer.
What is screened ahead and not reached when the run ends (the budget, --max-candidates) is
dropped; a model candidate among them stays in the pipeline's waiting list for --resume.
"""
from __future__ import annotations

import queue
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from agent.judge import TIMING
from agent.records import Candidate, EvalResult
from agent.workspace import AHEAD   # the workspace folder screens ahead are rendered and judged in

POLL_SECONDS = 0.2         # how long the loop waits for a screen ahead before looking again

# (engine.py, out dir, timeout s, phase) → a verdict, from one GPU's judge (agent/loop.py Judge)
Judge = Callable[[Path, Path, float, str], EvalResult]
# (candidate, its folder) → the engine's source where it rendered and passed the policy, else None
Prepare = Callable[[Candidate, Path], "str | None"]


@dataclass
class Ahead:
    """One candidate screened ahead: its folder (plan, engine, variants, the screen's own folder),
    the GPU it was screened on, the source it was screened as and, once done, the verdict."""

    candidate: Candidate
    folder: Path
    gpu: str
    source: str | None = None       # None: it did not render or broke the policy (not screened)
    result: EvalResult | None = None
    error: str | None = None        # the screen ahead itself failed (not the engine): the loop screens it
    done: threading.Event = field(default_factory=threading.Event)

    def move_into(self, folder: Path) -> None:
        """Move the screen's folder (verdict, logs) into the candidate's own `folder`; the rest of
        the folder ahead (the same engine, rendered again there) goes."""
        if (self.folder / TIMING).is_dir():
            shutil.rmtree(folder / TIMING, ignore_errors=True)
            shutil.move(str(self.folder / TIMING), str(folder / TIMING))
        shutil.rmtree(self.folder, ignore_errors=True)


class ScreensAhead:
    """The run's spare GPUs, each with its judge (`judges`: GPU name → Judge, asked for TIMING
    verdicts only), screening the candidates the loop hands over in `start`; `finished` gives
    them back, first started first.
    Each GPU's screens run in one thread for the whole run: a judge process dies with the thread
    that started it (PR_SET_PDEATHSIG is the thread's), so a thread a screen would restart the
    judge each time (its start, its setup and its worker's: ~10 s a screen on an H200)."""

    def __init__(self, judges: dict[str, Judge], root: Path, prepare: Prepare):
        self.judges, self.root, self.prepare = judges, root / AHEAD, prepare
        shutil.rmtree(self.root, ignore_errors=True)   # a killed run's: never a verdict of this one
        self.free = list(judges)
        self.running: list[Ahead] = []   # handed over, not taken back yet, in the order started
        self.cond = threading.Condition()
        self.started = 0
        self.jobs = {gpu: queue.SimpleQueue() for gpu in judges}
        for gpu in judges:
            threading.Thread(target=self._serve, args=(gpu,), name=f"screens-gpu{gpu}", daemon=True).start()

    def idle(self) -> bool:
        """A spare GPU has nothing to screen."""
        with self.cond:
            return bool(self.free)

    def pending(self) -> int:
        """Candidates handed over and not taken back."""
        with self.cond:
            return len(self.running)

    def start(self, candidate: Candidate, timeout: float) -> Ahead:
        """Render `candidate` in a folder of its own and screen it on a free GPU, in a thread."""
        with self.cond:
            gpu = self.free.pop(0)
            self.started += 1
            ahead = Ahead(candidate, self.root / f"{self.started:03d}", gpu)
            self.running.append(ahead)
        self.jobs[gpu].put((ahead, timeout))
        return ahead

    def finished(self) -> Ahead | None:
        """The first candidate handed over whose screen is done (or that had nothing to screen),
        taken back; None if none is."""
        with self.cond:
            for ahead in self.running:
                if ahead.done.is_set():
                    self.running.remove(ahead)
                    return ahead
        return None

    def quiet(self) -> None:
        """Until no candidate holding model-written code is being screened (agent/loop.py
        recorded_alone); those of the repository's own code may go on."""
        with self.cond:
            self.cond.wait_for(lambda: not any(a.candidate.extra_variants and not a.done.is_set()
                                               for a in self.running))

    def wait(self, seconds: float = POLL_SECONDS) -> None:
        """Until a screen ahead ends, or `seconds`."""
        with self.cond:
            if any(a.done.is_set() for a in self.running):
                return
            self.cond.wait(seconds)

    def close(self) -> None:
        """The GPUs' threads end after the screen they are on (whose judge the caller closes)."""
        for jobs in self.jobs.values():
            jobs.put(None)

    def __enter__(self) -> "ScreensAhead":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _serve(self, gpu: str) -> None:
        while (job := self.jobs[gpu].get()) is not None:
            self._screen(*job)

    def _screen(self, ahead: Ahead, timeout: float) -> None:
        try:
            ahead.source = self.prepare(ahead.candidate, ahead.folder)
            if ahead.source is not None:
                ahead.result = self.judges[ahead.gpu](ahead.folder / "engine.py", ahead.folder / TIMING, timeout,
                                                      TIMING)
        except Exception as e:  # noqa: BLE001 - the loop judges it itself: a screen ahead is only a head start
            ahead.source, ahead.result = None, None
            ahead.error = f"{type(e).__name__}: {e}"
        finally:
            with self.cond:
                self.free.append(ahead.gpu)
                ahead.done.set()
                self.cond.notify_all()
