"""The agent loop: judge the conservative engine, then the candidates the pipeline hands over
(agent/pipeline.py: the builtin walk and, in parallel, the model), and keep the fastest that
passed. Anytime: workspace/engine.py only ever holds a candidate the evaluator passed, and it is
replaced only by one that passed in full and beat the best with a stated confidence.

The conservative engine is judged so that a verified engine is on disk as early as possible, and
cheaply: VERIFY (the public sequence and the benchmark's one case agent/judge.py CONSERVATIVE_CASE
names, no stress) installs it with a score that compares case for case with a challenger's
(agent/acceptance.py pairs the cases both timed); its stress suite (STRESS) only once it is clear
that it stays the result (`settle_conservative`: a challenger's verdict came and did not replace
it, or the run ends), since on most targets the first challenger replaces it. Its verdict is
never timed on the other cases, not even when it stays the result: what it must be judged in
full on is its correctness, which the stress suite completes; the other cases would cost the
budget (44 s on the H100, docs/benchmarks.md) for a number no engine is compared with any more.
Its verdict says so (`note`). (A contest's rounds against it re-time it on every case, as any
incumbent: only for a challenger that its one case did not already decide.)
Every other candidate is a challenger (`challenge`): TIMING first (the public sequence and the
benchmark, no stress: the screen), then back-to-back timings against the best
(agent/acceptance.py), and only a finalist gets FINAL (the stress suite with its long cases),
deferred while it is the search's best (`settle_final`: a faster winner first makes it moot);
the verdict installed joins the final's stress to the screen's benchmark of the same engine, so
no engine is timed twice for one verdict, unless the screens time fewer fresh engines than the
full benchmark (on a GPU: agent/cli.py BENCH), where the final times it in full. Whatever is
installed at the end was judged in full.
"""
from __future__ import annotations

import contextlib
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from agent import acceptance, policy, search
from agent.archive import Archive
from agent.judge import FINAL, RESULT as RESULT_FILE, STRESS, TIMING, VERIFY
from agent.pipeline import Pipeline
from agent.providers.proposals import UNIT_CHECKS
from agent.records import DEADLINE, Candidate, EvalResult, Proposer, SearchState
from agent.render import render_engine
from agent.report import Entry, FinalDue, Reporter, describe
from agent.screens import Ahead, ScreensAhead
from agent.workspace import VARIANTS, Workspace, atomic_write
from evaluator.checkpoint import Conventions

Judge = Callable[[Path, Path, float, str], EvalResult]   # (engine.py, out dir, timeout s, phase) → verdict
OnScreen = Callable[[EvalResult], None]                  # told of a challenger's passed screen


class Timings(Protocol):
    """A contest's repeated timings (agent/judge.py Series): `result(label, timeout)` in order."""

    def result(self, label: str, timeout: float) -> EvalResult: ...

    def close(self) -> None: ...


# (every (label, engine.py) a contest may ask for, in order; the candidate's folder) → its Timings
SeriesFactory = Callable[[list[tuple[str, Path]], Path], Timings]


class OneByOne:
    """Timings as one TIMING evaluation each, through the loop's judge (where no series runs them)."""

    def __init__(self, judge: Judge, timings: list[tuple[str, Path]], folder: Path):
        self.judge, self.engines, self.folder = judge, dict(timings), folder

    def result(self, label: str, timeout: float) -> EvalResult:
        return self.judge(self.engines[label], self.folder / label, timeout, TIMING)

    def close(self) -> None:
        pass

RESERVE_SECONDS = 5.0        # kept back from the budget to write the summary and exit
MIN_EVAL_SECONDS = 10.0      # less than this left: no evaluation can finish, stop proposing
HANG_FACTOR, HANG_SLACK_SECONDS = 3.0, 120.0   # a candidate this much slower than any pass is hung
BUDGET_CUT_SLACK_SECONDS = 1.0   # a timeout within this of the budget left was the budget's (cut_by_budget)
# Before any final: a first final's length against the quickest pass, by device. On a GPU a final
# adds the stress suite to timing the engine at the full repeat (screens time one fresh engine a
# case): 33-46 s against screens of 13-25 s (H100 and H200, public config, twenty-second and
# twenty-third sessions). On a CPU a final times nothing (its screen's timing is joined in) and
# took less than a screen: expected_seconds stands.
FIRST_FINAL_FACTOR = {"cuda": 2.5}
# The time kept for a provisional best's final, over the slowest final judged so far: finals of
# one run differ by the engine (43-57 s on an H200, twenty-seventh and twenty-eighth sessions;
# 27.0 then over 33.8 s, 27.5 then 33.7 s in the thirty-second, where an engine with variants
# the first final's lacked compiled them for every random model: at 1.25 the second final was
# cut by the budget, and the run fell back to an engine 5% slower).
FINAL_RESERVE_FACTOR = 1.5
RANKED_0 = "ranked 0 (any engine that passes replaces it)"   # a conservative engine whose stress failed


def conservative_candidate() -> Candidate:
    return Candidate(search.conservative_plan(), "builtin", "conservative: mirrors the reference, one request at a time")


def run(state: SearchState, proposer: Proposer, judge: Judge, ws: Workspace, report: Reporter,
        budget: float, started: float | None = None, max_candidates: int | None = None, parallel: int = 1,
        series: SeriesFactory | None = None, spares: dict[str, Judge] | None = None) -> None:
    """Judge candidates until the proposers run dry, `max_candidates` are judged, or the budget
    (seconds from `started`, a time.monotonic() reading; default now) cannot fit another evaluation.
    `parallel` model episodes are kept going while the judge works (agent/pipeline.py). A state
    that already has a history (a resumed run, agent/resume.py) goes on from it: the conservative
    engine, always its first entry, is not judged again. `series` runs a contest's repeated
    timings (default: one `judge` call each, OneByOne). `spares` (GPU name → its judge) screen the
    next candidates while `judge` works (agent/screens.py)."""
    deadline = (time.monotonic() if started is None else started) + budget
    left = lambda: deadline - time.monotonic() - RESERVE_SECONDS  # noqa: E731
    report.seconds_left = left
    state.seconds_left = left()
    keep = lambda waiting: ws.save_waiting([c.to_record() for c in waiting])  # noqa: E731 - for --resume
    due = lambda: settle_final(state, judge, ws, report, left, pipeline.final)  # noqa: E731 - the provisional best's final
    # What judging other candidates may spend: the budget less the provisional best's final, so
    # that a long screen or contest cannot leave a won contest without the time for its final.
    others = lambda: left() - final_reserve(state, report)  # noqa: E731
    judge = budget_aware(judge, others, state)   # a verdict cut by what it was given is the budget's
    model = state.spec.conventions if state.spec is not None else Conventions()  # no spec: unit tests
    ahead = None if not spares else ScreensAhead(
        {gpu: budget_aware(spare, others, state) for gpu, spare in spares.items()},
        ws.root, lambda candidate, folder: prepare(candidate, folder, state.device, model)[0])
    judge = recorded_alone(judge, ahead, left)
    with Pipeline(proposer, state, parallel, deadline - RESERVE_SECONDS - MIN_EVAL_SECONDS, report.line,
                  keep) as pipeline, ahead or contextlib.nullcontext():
        def fill() -> None:
            """Hand the spare GPUs the candidates ready now, as many as the run may still judge."""
            def room() -> bool:   # the one being judged, those screened ahead, and one more
                return max_candidates is None or len(state.history) + 1 + ahead.pending() < max_candidates
            while ahead.idle() and room() and others() >= expected_seconds(state):
                drawn = pipeline.next(wait=False)
                if drawn is None:
                    return
                report.line(f"     screening ahead on GPU {ahead.start(drawn, timeout_for(state, others())).gpu}: "
                            f"{describe(drawn.plan)}")

        if state.history:
            candidate, screened = pick(pipeline, ahead, due)
        else:
            candidate, screened = conservative_candidate(), None
        while candidate is not None:
            if max_candidates is not None and len(state.history) >= max_candidates:
                report.line(f"{len(state.history)} candidates judged, the most asked for (--max-candidates); stopping")
                break
            if provisional_best(state, report) is not None and others() < expected_seconds(state):
                due()   # after one more candidate its final would no longer fit
            if state.history and left() < expected_seconds(state) and (screened is None or screened.result is None):
                report.line(f"budget: {max(left(), 0):.0f}s left, not enough for another evaluation; stopping")
                break
            if ahead is not None:
                fill()
            index = len(state.history) + 1
            entry = judge_one(index, candidate, state, judge, ws, report, others,
                              lambda screen: pipeline.screened(index, candidate, screen), series, screened)
            state.history.append((candidate, entry.result))
            if entry.accepted or entry.final_due is not None:
                replaced = provisional_best(state, report)
                if replaced is not None:   # its final is no longer due
                    replaced.final_due = replace(replaced.final_due, superseded_by=index)
                state.best, state.best_result = candidate, entry.result
            if len(state.history) > 1:  # the conservative step is the loop's own, not the proposer's
                pipeline.feedback(candidate, entry.result)
                report.line(f"     {pipeline.status()}")
                settle_conservative(state, judge, ws, report, left)
            state.seconds_left = others()   # a model's request must leave its answer's verdict time, not the final's
            candidate, screened = pick(pipeline, ahead, due)
            if candidate is None:   # (the pipeline's deadline: MIN_EVAL_SECONDS before the budget's end)
                why = ("the budget's end is too near to start one" if left() <= MIN_EVAL_SECONDS
                       else "the proposers have nothing more to try")
                report.line(f"no candidate left to judge ({why}), {max(left(), 0):.0f}s of the budget left; stopping")
    if ahead is not None and ahead.pending():
        report.line(f"{ahead.pending()} candidate(s) screened ahead were not reached; dropped "
                    f"(their folders: {ahead.root})")
    while (pending := provisional_best(state, report)) is not None:   # a failed final may hand back to the one it replaced
        settle_final(state, judge, ws, report, left, pipeline.final)
        if provisional_best(state, report) is pending:
            break
    settle_conservative(state, judge, ws, report, left, final=True)
    report.line(Archive.of(state).summary())
    report.line(report.judge_time())


def pick(pipeline: Pipeline, ahead: ScreensAhead | None,
         due: Callable[[], None]) -> tuple[Candidate | None, Ahead | None]:
    """The next candidate to judge, with its screen where it was screened ahead: first a screen
    ahead that is done, else what the proposers have ready, else (screens ahead still under way)
    the provisional best's final once, then waiting for whichever comes first. Without screens
    ahead: the pipeline's next, as a serial loop asks."""
    if ahead is None:
        return pipeline.next(idle=due), None
    idled = False
    while True:
        done = ahead.finished()
        if done is not None:
            return done.candidate, done
        if not ahead.pending():   # (not `busy`: a screen that ended since `finished` looked is still to take)
            return pipeline.next(idle=None if idled else due), None
        drawn = pipeline.next(wait=False)
        if drawn is not None:
            return drawn, None
        if not idled:
            due()   # the judge would wait for a screen ahead: the final due meanwhile
            idled = True
        else:
            ahead.wait()


def recorded_alone(judge: Judge, ahead: ScreensAhead | None, left: Callable[[], float]) -> Judge:
    """`judge`, whose verdicts that record a score others are compared with (VERIFY, FINAL) wait
    until no model-written candidate is being screened ahead and no model code's unit check runs
    (agent/providers/proposals.py UNIT_CHECKS; none starts meanwhile): such code on another GPU
    could slow this one through what the host shares (its memory bandwidth, its PCIe links), a
    unit check beside it on its very cores and GPU, and so lower the score a later clear win of its
    own is measured against (agent/acceptance.py). The loop starts no screen ahead meanwhile (it
    fills the spare GPUs between verdicts only). The repository's own candidates (the builtin walk)
    are not waited for. The wait is the budget's: the verdict's timeout, asked for before it, is cut
    to what `left` says is left after it (a unit check runs up to its timeout, minutes, and a final
    given its full timeout after one had run past the budget's end)."""
    def call(engine: Path, out_dir: Path, timeout: float, phase: str) -> EvalResult:
        if phase not in (VERIFY, FINAL):
            return judge(engine, out_dir, timeout, phase)
        if ahead is not None:
            ahead.quiet()
        with UNIT_CHECKS.held():
            return judge(engine, out_dir, min(timeout, max(left(), 0.0)), phase)
    return call


def judge_one(index: int, candidate: Candidate, state: SearchState, judge: Judge, ws: Workspace,
              report: Reporter, left: Callable[[], float], on_screen: OnScreen = lambda screen: None,
              series: SeriesFactory | None = None, screened: Ahead | None = None) -> Entry:
    """Render, check, screen, contest the best, and install a finalist that passes in full.
    `on_screen` hears of a screen that passed, before the contest and the final. `screened`: its
    screen ahead on another GPU, taken as its screen where it screened this very engine."""
    entry = Entry(index, candidate, ws.candidate_dir(index, describe(candidate.plan)))
    report.started(entry)
    model = state.spec.conventions if state.spec is not None else Conventions()  # no spec: unit tests
    source, entry.result = prepare(candidate, entry.directory, state.device, model)
    if entry.result is None and not state.history:
        entry.result = judge_conservative(entry, source, judge, ws, report, left)
    elif entry.result is None:
        early = screened if screened is not None and screened.result is not None and screened.source == source \
            else None
        if early is not None:
            early.move_into(entry.directory)
        elif screened is not None and screened.error is not None:   # the spare's judge, not the engine
            report.line(f"     the screen ahead on GPU {screened.gpu} broke ({screened.error}): screened here")
        entry.result = challenge(entry, source, state, judge, ws, report, left, on_screen, series, early)
        # The candidate's folder holds its verdict whichever phase gave it (a rejected screen
        # lives in timing/ with its logs): one place to look, as the README's layout says.
        atomic_write(entry.directory / RESULT_FILE, json.dumps(entry.result.to_dict(), indent=2) + "\n")
    else:
        report.verdict(entry, entry.result)
    report.finished(entry)
    return entry


def challenge(entry: Entry, source: str, state: SearchState, judge: Judge, ws: Workspace, report: Reporter,
              left: Callable[[], float], on_screen: OnScreen = lambda screen: None,
              series: SeriesFactory | None = None, early: Ahead | None = None) -> EvalResult:
    """The screen (a timing, no stress; `early` where another GPU screened it ahead), the
    back-to-back rounds against the best, and for a finalist the full verdict (the stress suite's
    long cases included) that gets installed."""
    engine, folder = entry.directory / "engine.py", entry.directory
    spent = report.spending(entry)
    if early is not None:
        screen = spent("screen", early.result)
        report.verdict(entry, screen, label=f"screen (ahead, GPU {early.gpu})")
    else:
        screen = spent("screen", judge(engine, folder / TIMING, timeout_for(state, left()), TIMING))
        report.verdict(entry, screen, label="screen")
    if not screen.passed:
        return screen
    if not screen.safe():
        report.warn(f"#{entry.index:03d} passed with margin {screen.margin():.2f} < "
                    f"{screen.required_margin():.2f}: too close to the tolerance to keep")
        return decided(screen, "too close to the tolerance")
    on_screen(screen)
    again = None   # a second screen run where the first looks stalled (acceptance.worth_timing_again)
    if acceptance.worth_timing_again(screen, state.best_result) and left() >= expected_seconds(state):
        again = spent("screen", judge(engine, folder / acceptance.SCREEN_AGAIN, timeout_for(state, left()), TIMING))
        report.verdict(entry, again, label="screen again")
        if not again.passed:
            return again
        if not again.safe():
            return decided(again, "too close to the tolerance")
    incumbent = entry_of(report, state.best)

    timings: Timings | None = None   # started at the first timing the contest asks for

    def timing(label: str) -> EvalResult | None:
        nonlocal timings
        if left() < expected_seconds(state):
            return None
        if timings is None:
            engines = [(name, engine if mine else incumbent.directory / "engine.py") for name, mine in acceptance.order()]
            timings = (series or (lambda t, f: OneByOne(judge, t, f)))(engines, folder)
        budget = left()
        timeout = timeout_for(state, budget)
        return spent("repeated timing", cut_by_budget(timings.result(label, timeout), timeout, budget, state))
    try:
        with UNIT_CHECKS.held():   # no model code beside paired timings a model's own engine may be in
            decision = acceptance.contest(screen, state.best_result, timing, timing, again)
    finally:
        if timings is not None:
            timings.close()   # the timings the decision did not need are not run
    if decision.failure is not None:
        report.verdict(entry, decision.failure, label="repeated timing")
        return decided(decision.failure, decision.reason)
    report.line(f"     {'ACCEPT' if decision.accepted else 'REJECT'}: {decision.reason}")
    if not decision.accepted:
        screen.cut_short = decision.cut
        return decided(screen, decision.reason)
    final_seconds = expected_final_seconds(state, screen)
    if left() + final_reserve(state, report) < final_seconds:   # a final cut by the deadline would be lost
        # (the time kept for the provisional best's final is this winner's: it replaces that one)
        why = (f"won its contest, but its final (the stress suite) cannot fit the {max(left(), 0):.0f}s of the "
               f"budget left (a final takes ~{final_seconds:.0f}s): the best so far stays")
        report.line(f"     NOT INSTALLED: {why}")
        screen.cut_short = True
        return decided(screen, why)
    timed = decided(screen if again is None else acceptance.fastest(screen, again), decision.reason)
    installed = report.installed()
    if installed is None or installed.candidate.plan.engine == search.CONSERVATIVE_ENGINE:
        # Not deferred while the engine on disk is the conservative one: a run stopped at any
        # moment leaves a fast engine, and the run learns what a final costs here before it
        # keeps time for one (an H200 run that deferred its first final guessed 34 s from its
        # screens, gave it that much at the end, and it needed 46-57 s: twenty-eighth session).
        return run_final(entry, timed, decision.p, state.best_result, state, judge, ws, report, left)
    entry.final_due = FinalDue(decision.p, incumbent.index if incumbent is not None else None)
    report.line(f"     PROVISIONAL: the best the search builds on from now; its final (the stress suite, "
                f"~{final_seconds:.0f}s) runs when the judge would otherwise wait, or in time before the budget "
                f"ends, and not at all if a faster engine replaces it first")
    return timed


def final_reserve(state: SearchState, report: Reporter) -> float:
    """The time kept from other candidates for the provisional best's final: FINAL_RESERVE_FACTOR
    times the slowest final of the run (finals of one run differ by the engine)."""
    if provisional_best(state, report) is None:
        return 0.0
    finals = finals_judged(state)
    return FINAL_RESERVE_FACTOR * (max(finals) if finals else expected_final_seconds(state, state.best_result))


def provisional_best(state: SearchState, report: Reporter) -> Entry | None:
    """The search's best, where it won its contest but its final has not run (FinalDue)."""
    entry = entry_of(report, state.best)
    due = entry.final_due if entry is not None else None
    return entry if due is not None and due.superseded_by is None else None


def entry_of(report: Reporter, candidate: Candidate | None) -> Entry | None:
    """The report's entry of `candidate` (the search's best: installed, or provisional)."""
    if candidate is None:
        return None
    key = candidate.key()
    return next((e for e in reversed(report.entries) if e.candidate.key() == key and e.result is not None), None)


def settle_final(state: SearchState, judge: Judge, ws: Workspace, report: Reporter, left: Callable[[], float],
                 tell: Callable[[Candidate, EvalResult], None] = lambda candidate, result: None) -> None:
    """The provisional best's final (FINAL: the stress suite with its long cases, and on a GPU a
    full timing), deferred since its contest: a best that a faster engine replaces before then
    never needs one (a final is 43-57 s on an H200, a screen 10-34 s: twenty-eighth session).
    Passed in full, it is installed. Otherwise the search goes back: to the winner it replaced
    where that one's final is still due (it becomes the provisional best again), else to the best
    installed (workspace/engine.py, judged in full). A final this run cannot fit, cut by the
    budget, or interrupted stays due: `--resume` runs it. `tell` hands the verdict to the
    candidate's proposer (a model told "faster: accepted" at the contest hears if it did not hold)."""
    entry = provisional_best(state, report)
    if entry is None:
        return
    due, timed = entry.final_due, entry.result
    report.line(f"#{entry.index:03d} {describe(entry.candidate.plan)}: the final it won in its contest")
    final_seconds = expected_final_seconds(state, timed)
    if left() < final_seconds:
        report.line(f"     NOT INSTALLED: won its contest, but its final (the stress suite) cannot fit the "
                    f"{max(left(), 0):.0f}s of the budget left (a final takes ~{final_seconds:.0f}s); "
                    "--resume runs it")
        go_back(entry, state, report)
        return
    installed = report.installed()
    entry.final_due = None   # its final runs now: no time is kept for it meanwhile
    try:
        result = run_final(entry, timed, due.p, installed.result if installed else None, state, judge, ws,
                           report, left)
    except BaseException:
        entry.final_due = due   # interrupted: still due, for --resume
        raise
    if result.unfinished:   # the budget cut it: not a verdict on the engine
        entry.final_due = due
        go_back(entry, state, report)
        return
    entry.result = result
    at = max(i for i, (c, _) in enumerate(state.history) if c.key() == entry.candidate.key())
    state.history[at] = (entry.candidate, result)
    atomic_write(entry.directory / RESULT_FILE, json.dumps(result.to_dict(), indent=2) + "\n")
    if entry.accepted:
        state.best_result = result
    else:
        go_back(entry, state, report, due)
    tell(entry.candidate, result)
    report.finished(entry)


def go_back(entry: Entry, state: SearchState, report: Reporter, due: FinalDue | None = None) -> None:
    """`entry` is not installed: the search's best becomes the winner it replaced, where that
    one's final is still due (superseded by `entry` alone, `due` given: its own final failed),
    else the best installed."""
    beaten = next((e for e in report.entries if due is not None and e.index == due.beat), None)
    if beaten is not None and beaten.final_due is not None and beaten.final_due.superseded_by == entry.index:
        beaten.final_due = replace(beaten.final_due, superseded_by=None)
        state.best, state.best_result = beaten.candidate, beaten.result
        report.line(f"     the search goes back to #{beaten.index:03d}, the winner it replaced (its final is due)")
        return
    installed = report.installed()
    state.best, state.best_result = (installed.candidate, installed.result) if installed else (None, None)
    report.line("     the search goes back to " + (f"#{installed.index:03d}, the best installed" if installed
                                                     else "no engine: none is installed"))


def run_final(entry: Entry, timed: EvalResult, p: float | None, beaten: EvalResult | None, state: SearchState,
              judge: Judge, ws: Workspace, report: Reporter, left: Callable[[], float]) -> EvalResult:
    """FINAL on a finalist whose screen (`timed`) won its contest (sign test `p`); installed where
    it passes in full and, for a clear win, its full timing beats `beaten`'s (the best installed:
    a full timing too, where the winner it replaced may have had only its screen)."""
    engine = entry.directory / "engine.py"
    final = decided(joined(report.spending(entry)("final", judge(engine, entry.directory, timeout_for(state, left()),
                                                                FINAL)), timed), timed.decision)
    report.verdict(entry, final, label="final")
    below = unconfirmed_win(final, timed, p, beaten)
    if below is not None:
        report.line(f"     NOT INSTALLED: {below}")
        return decided(final, below)
    if final.passed and final.safe():
        install(entry, final, engine.read_text(), ws, report)
    elif final.passed:
        report.warn(f"#{entry.index:03d} passed with margin {final.margin():.2f} < "
                    f"{final.required_margin():.2f}: too close to the tolerance to keep")
    return final


def unconfirmed_win(final: EvalResult, screen: EvalResult, p: float | None,
                    incumbent: EvalResult | None) -> str | None:
    """Why a finalist accepted on its screen alone (a clear win: no paired timings) is not
    installed, or None. Where the final timed the engine itself in full (the screens time one fresh
    engine a case), that timing must still beat the best's recorded one: a single screen run is
    noisier than the median it was compared with."""
    if not final.passed or final.benchmark is screen.benchmark or p is not None \
            or incumbent is None or not incumbent.passed or incumbent.rank() <= 0:
        return None
    ratio = acceptance.speedup(final, incumbent)
    if ratio is None or ratio > 1:
        return None
    return (f"its screen was a clear win, but its full timing is {acceptance.percent(ratio)} "
            f"over the cases both timed: the best so far stays")


def joined(stressed: EvalResult, timed: EvalResult) -> EvalResult:
    """A verdict without a benchmark (FINAL, STRESS) completed by the benchmark of the same
    engine in an earlier verdict (its screen, its timing); a failure, or a final that timed the
    engine itself (the screens time fewer repeats: JudgeSettings.screen_repeat), stays what it is."""
    if not stressed.passed or stressed.benchmark:
        return stressed
    return replace(stressed, benchmark=timed.benchmark, score=timed.score, note=timed.note)   # its own time: stage_seconds


def decided(result: EvalResult, why: str) -> EvalResult:
    """The verdict with the acceptance's reason on it (the same object: a judge may attach more)."""
    result.decision = why
    return result


def judge_conservative(entry: Entry, source: str, judge: Judge, ws: Workspace, report: Reporter,
                       left: Callable[[], float]) -> EvalResult:
    """VERIFY (the public sequence and one benchmark case), and a pass installed at once
    (anytime), unstressed: its stress comes later (settle_conservative)."""
    engine = entry.directory / "engine.py"
    verified = report.spending(entry)("conservative", judge(engine, entry.directory / VERIFY, left(), VERIFY))
    if verified.passed:
        cases = ", ".join(verified.tokens_per_second())
        verified = replace(verified, unstressed=True,
                           note=f"the conservative engine, timed on {cases} only" if cases else None)
    report.verdict(entry, verified, label="verify")
    if verified.passed:
        install(entry, verified, source, ws, report)
    return verified


def settle_conservative(state: SearchState, judge: Judge, ws: Workspace, report: Reporter,
                        left: Callable[[], float], final: bool = False) -> None:
    """The conservative engine's stress suite, once it is the best with a challenger judged
    beside it, or at the run's end: then it is the result and must be judged in full. A pass
    joins its timing (the verdict installed again, now complete); a failure leaves it installed,
    verified on the public sequence, ranked 0 (any passing engine replaces it). With less than
    MIN_EVAL_SECONDS of the budget left it is not started: the verdict stays unstressed, and the
    log says why instead of reporting the sure timeout as the engine's failure."""
    first = report.entries[0] if report.entries else None
    if first is None or not first.accepted or state.best is not first.candidate or first.result is None \
            or not first.result.unstressed:
        return
    engine, budget = first.directory / "engine.py", left()
    if budget < MIN_EVAL_SECONDS:   # no stress could finish: say so (once, at the end), rather than time out
        if final:
            report.warn(f"the conservative engine stays the result without its stress suite: {max(budget, 0):.0f}s "
                        f"of the budget left (its self-tests, below, run it)")
        return
    stressed = report.spending(first)("conservative", judge(engine, first.directory, budget, STRESS))
    report.verdict(first, stressed, label="stress")
    if stressed.error_kind == DEADLINE:   # the budget ran out under it: unstressed still (--resume runs it)
        report.warn("the conservative engine stays the result without its stress suite: the budget ran out "
                    "before it finished (its self-tests, below, run it)")
        report.finished(first)
        return
    if stressed.passed:
        result = joined(stressed, first.result)
        install(first, result, engine.read_text(), ws, report)
    else:
        why = (f"did not finish in the {budget:.0f}s of the budget left" if stressed.error_kind == "timeout"
               else "did not pass")
        report.warn(f"the conservative engine stays installed, {RANKED_0}: its stress suite {why} "
                    f"({stressed.error_kind} at {stressed.stage})")
        result = replace(first.result, score=0.0, unstressed=False,
                         note=f"stress {stressed.error_kind} at {stressed.stage}: {RANKED_0}")
        ws.install_engine(engine.read_text(), {"index": first.index, **first.candidate.to_dict(),
                                               "result": result.to_dict()})   # engine.json says so
    first.result = state.best_result = result
    state.history[0] = (first.candidate, result)
    report.finished(first)


def prepare(candidate: Candidate, directory: Path, device: str,
            model: Conventions = Conventions()) -> tuple[str | None, EvalResult | None]:
    """Render the candidate into its folder; a failure to render or a policy breach is its verdict."""
    atomic_write(directory / "plan.json", json.dumps(candidate.to_dict(), indent=2) + "\n")
    shutil.rmtree(directory / VARIANTS, ignore_errors=True)   # exactly this candidate's: its cache scope (agent/judge.py)
    for (slot, name), text in candidate.extra_variants.items():  # kept so that --resume can restore them
        atomic_write(directory / VARIANTS / f"{slot}.{name}.py.j2", text)
    try:
        conventions = {"model": model} if model.hf else {}  # the course format: render_engine's default
        source = render_engine(candidate.plan, candidate.extra_variants, **conventions)
    except Exception as e:  # noqa: BLE001 - a template that does not render is a failed candidate
        failure = EvalResult.failure("render", "compile_error", f"{type(e).__name__}: {e}", device)
    else:
        atomic_write(directory / "engine.py", source)
        # Every engine is checked before it runs, ours too: a template edit that reaches outside
        # the engine is refused like a proposer's code (tests hold every template to the policy).
        violations = policy.check_engine(source)
        if not violations:
            return source, None
        failure = EvalResult.failure("policy", "policy", policy.describe(violations), device)
    atomic_write(directory / "result.json", json.dumps(failure.to_dict(), indent=2) + "\n")
    return None, failure


def install(entry: Entry, result: EvalResult, source: str, ws: Workspace, report: Reporter) -> None:
    """Atomically make this candidate workspace/engine.py, say so, and commit it to the history."""
    ws.install_engine(source, {"index": entry.index, **entry.candidate.to_dict(), "result": result.to_dict()})
    report.accepted(entry, result)
    entry.accepted = True
    ws.commit(f"#{entry.index:03d} {describe(entry.candidate.plan)}: {result.status}, score {result.rank():.4g}\n\n"
              f"{entry.candidate.note}\n{json.dumps(entry.candidate.to_dict(), indent=2)}")


def expected_seconds(state: SearchState, also: tuple[float, ...] = ()) -> float:
    """An optimistic guess of the next evaluation's length: the quickest pass of a
    non-conservative engine, `also` (passes not in the history yet) among them (a candidate that
    overruns is killed at the deadline anyway)."""
    fast = [r.seconds for c, r in state.history if r.passed and c.plan.engine != search.CONSERVATIVE_ENGINE]
    return max(min(fast + list(also), default=MIN_EVAL_SECONDS), MIN_EVAL_SECONDS)


def finals_judged(state: SearchState) -> list[float]:
    """How long the run's finals of non-conservative engines took (verdicts with their stress suite)."""
    return [r.seconds for c, r in state.history
            if r.passed and r.stress is not None and c.plan.engine != search.CONSERVATIVE_ENGINE]


def expected_final_seconds(state: SearchState, screen: EvalResult) -> float:
    """An optimistic guess of a final's length: the quickest earlier final of a non-conservative
    engine (a verdict with its stress suite), else on a device with a FIRST_FINAL_FACTOR the
    quickest pass (this candidate's `screen` among them) times it, else the quickest pass
    (expected_seconds)."""
    finals = finals_judged(state)
    if finals:
        return max(min(finals), MIN_EVAL_SECONDS)
    factor = FIRST_FINAL_FACTOR.get(state.device)
    if factor is None:   # a final no longer than a pass
        return expected_seconds(state)
    return expected_seconds(state, (screen.seconds,)) * factor


def cut_by_budget(result: EvalResult, timeout: float, budget: float, state: SearchState) -> EvalResult:
    """`result`, or where it is a timeout whose limit was the run's remaining budget (`budget`
    when the verdict was asked for) rather than the hang limit, and shorter than the slowest
    verdict that passed (an honest engine could have needed more), the same marked DEADLINE: the
    run ran out of time, the engine was not shown to hang (records.DEADLINE). A hang given at
    least that long stays a timeout, so a resumed run does not give it the budget again."""
    slowest = max((r.seconds for _, r in state.history if r.passed), default=0.0)
    if result.passed or result.error_kind != "timeout" or timeout < budget - BUDGET_CUT_SLACK_SECONDS \
            or timeout >= slowest:
        return result
    return replace(result, error_kind=DEADLINE,
                   error=f"the run's budget ran out ({timeout:.0f}s were left when it started): not judged")


def budget_aware(judge: Judge, left: Callable[[], float], state: SearchState) -> Judge:
    """`judge` with cut_by_budget applied to its verdicts."""
    def call(engine: Path, out_dir: Path, timeout: float, phase: str) -> EvalResult:
        budget = left()
        return cut_by_budget(judge(engine, out_dir, timeout, phase), timeout, budget, state)
    return call


def timeout_for(state: SearchState, left: float) -> float:
    """The rest of the budget, but no more than a few times the slowest pass: past that it hangs."""
    passes = [r.seconds for _, r in state.history if r.passed]
    if not passes:
        return left
    return min(left, HANG_FACTOR * max(passes) + HANG_SLACK_SECONDS)
