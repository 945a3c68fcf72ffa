"""The agent loop: judge the conservative engine, then whatever the proposer suggests, and
keep the fastest candidate that passed. Anytime: workspace/engine.py only ever holds a
candidate the evaluator passed, and it is replaced only by one that passed and is faster.

The conservative engine is judged in two phases so that a verified engine is on disk as
early as possible: VERIFY (the public sequence and one short timing) installs it; FULL (the
stress suite and the benchmark every later candidate gets) then gives it comparable numbers,
within a share of the budget. Every other candidate gets FULL alone.
"""
from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from agent import policy, search
from agent.judge import FULL, VERIFY
from agent.records import Candidate, EvalResult, Proposer, SearchState, improves
from agent.render import render_engine
from agent.report import Entry, Reporter, describe
from agent.workspace import VARIANTS, Workspace, atomic_write
from evaluator.checkpoint import Conventions

Judge = Callable[[Path, Path, float, str], EvalResult]   # (engine.py, out dir, timeout s, phase) → verdict

RESERVE_SECONDS = 5.0        # kept back from the budget to write the summary and exit
MIN_EVAL_SECONDS = 10.0      # less than this left: no evaluation can finish, stop proposing
HANG_FACTOR, HANG_SLACK_SECONDS = 3.0, 120.0   # a candidate this much slower than any pass is hung
CONSERVATIVE_FULL_SHARE = 0.35   # of the budget left, at most, for timing the (slow) conservative engine
UNTIMED = "verified on the public sequence, not timed in full"
MAX_REPEATS = 20             # consecutive already-judged proposals before the search gives up


def conservative_candidate() -> Candidate:
    return Candidate(search.conservative_plan(), "builtin", "conservative: mirrors the reference, one request at a time")


def run(state: SearchState, proposer: Proposer, judge: Judge, ws: Workspace, report: Reporter,
        budget: float, started: float | None = None, max_candidates: int | None = None) -> None:
    """Judge candidates until the proposer runs dry, `max_candidates` are judged, or the budget
    (seconds from `started`, a time.monotonic() reading; default now) cannot fit another evaluation. A state that already
    has a history (a resumed run, agent/resume.py) goes on from it: the conservative engine,
    always its first entry, is not judged again."""
    deadline = (time.monotonic() if started is None else started) + budget
    left = lambda: deadline - time.monotonic() - RESERVE_SECONDS  # noqa: E731
    report.seconds_left = left
    state.seconds_left = left()
    candidate = next_candidate(proposer, state, report) if state.history else conservative_candidate()
    while candidate is not None:
        if max_candidates is not None and len(state.history) >= max_candidates:
            report.line(f"{len(state.history)} candidates judged, the most asked for (--max-candidates); stopping")
            break
        if state.history and left() < expected_seconds(state):
            report.line(f"budget: {left():.0f}s left, not enough for another evaluation; stopping")
            break
        entry = judge_one(len(state.history) + 1, candidate, state, judge, ws, report, left)
        state.history.append((candidate, entry.result))
        if entry.accepted:
            state.best, state.best_result = candidate, entry.result
        if len(state.history) > 1:  # the conservative step is the loop's own, not the proposer's
            proposer.feedback(candidate, entry.result)
        state.seconds_left = left()
        candidate = next_candidate(proposer, state, report)


def judge_one(index: int, candidate: Candidate, state: SearchState, judge: Judge, ws: Workspace,
              report: Reporter, left: Callable[[], float]) -> Entry:
    """Render, check, judge; install the engine if it passed and beats the best."""
    entry = Entry(index, candidate, ws.candidate_dir(index, describe(candidate.plan)))
    report.started(entry)
    model = state.spec.conventions if state.spec is not None else Conventions()  # no spec: unit tests
    source, entry.result = prepare(candidate, entry.directory, state.device, model)
    if entry.result is None and not state.history:
        entry.result = judge_conservative(entry, source, judge, ws, report, left)
    else:
        if entry.result is None:
            entry.result = judge(entry.directory / "engine.py", entry.directory, timeout_for(state, left()), FULL)
        report.verdict(entry, entry.result)
        if entry.result.passed and not entry.result.safe():
            report.warn(f"#{index:03d} passed with margin {entry.result.margin():.2f} < "
                        f"{entry.result.required_margin():.2f}: too close to the tolerance to keep")
        if improves(entry.result, state.best_result):
            install(entry, entry.result, source, ws, report)
    report.finished(entry)
    return entry


def judge_conservative(entry: Entry, source: str, judge: Judge, ws: Workspace, report: Reporter,
                       left: Callable[[], float]) -> EvalResult:
    """VERIFY, install at once (anytime), then FULL within a share of the budget. If FULL does
    not pass, the engine stays, ranked 0 (untimed), so any candidate that passes replaces it."""
    engine = entry.directory / "engine.py"
    verified = judge(engine, entry.directory / VERIFY, left(), VERIFY)
    if verified.passed:  # its one short timing does not compare with full scores: rank it 0 for now
        verified = replace(verified, score=0.0, error=UNTIMED)
    report.verdict(entry, verified, label="verify")
    if not verified.passed:
        return verified
    install(entry, verified, source, ws, report)
    full = judge(engine, entry.directory, CONSERVATIVE_FULL_SHARE * left(), FULL)
    report.verdict(entry, full, label="timing")
    if full.passed:
        install(entry, full, source, ws, report)
        return full
    report.warn(f"the conservative engine stays installed, ranked 0: its full evaluation did not pass "
                f"({full.error_kind} at {full.stage})")
    return replace(verified, error=f"{UNTIMED}: full evaluation {full.error_kind} at {full.stage}")


def prepare(candidate: Candidate, directory: Path, device: str,
            model: Conventions = Conventions()) -> tuple[str | None, EvalResult | None]:
    """Render the candidate into its folder; a failure to render or a policy breach is its verdict."""
    atomic_write(directory / "plan.json", json.dumps(candidate.to_dict(), indent=2) + "\n")
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


def next_candidate(proposer: Proposer, state: SearchState, report: Reporter) -> Candidate | None:
    """Ask the proposer, skipping (loudly) anything already judged; a proposer error ends the search."""
    for _ in range(MAX_REPEATS):
        try:
            candidate = proposer.propose(state)
        except Exception:  # noqa: BLE001 - logged in full; the best engine so far stays
            report.warn(f"proposer '{proposer.name}' failed; search stopped:\n{traceback.format_exc()}")
            return None
        if candidate is None or not state.tried(candidate):
            return candidate
        report.warn(f"proposer '{proposer.name}' repeated an already-judged plan: {describe(candidate.plan)}")
    report.warn(f"proposer '{proposer.name}' repeated itself {MAX_REPEATS} times; search stopped")
    return None


def expected_seconds(state: SearchState) -> float:
    """An optimistic guess of the next evaluation's length: the quickest pass of a
    non-conservative engine (a candidate that overruns is killed at the deadline anyway)."""
    fast = [r.seconds for c, r in state.history if r.passed and c.plan.engine != search.CONSERVATIVE_ENGINE]
    return max(min(fast, default=MIN_EVAL_SECONDS), MIN_EVAL_SECONDS)


def timeout_for(state: SearchState, left: float) -> float:
    """The rest of the budget, but no more than a few times the slowest pass: past that it hangs."""
    passes = [r.seconds for _, r in state.history if r.passed]
    if not passes:
        return left
    return min(left, HANG_FACTOR * max(passes) + HANG_SLACK_SECONDS)
