"""The agent loop: judge the conservative engine, then whatever the proposer suggests, and
keep the fastest candidate that passed. Anytime: workspace/engine.py only ever holds a
candidate the evaluator passed, and it is replaced only by one that passed and is faster.
"""
from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from agent import policy, search
from agent.providers.base import Candidate, EvalResult, Proposer, SearchState, improves
from agent.render import render_engine
from agent.report import Entry, Reporter, describe
from agent.workspace import Workspace, atomic_write

Judge = Callable[[Path, Path, float], EvalResult]    # (engine.py, candidate dir, timeout s) → verdict

RESERVE_SECONDS = 5.0        # kept back from the budget to write the summary and exit
MIN_EVAL_SECONDS = 10.0      # less than this left: no evaluation can finish, stop proposing
HANG_FACTOR, HANG_SLACK_SECONDS = 3.0, 120.0   # a candidate this much slower than any pass is hung
MAX_REPEATS = 20             # consecutive already-judged proposals before the search gives up


def conservative_candidate() -> Candidate:
    return Candidate(search.conservative_plan(), "builtin", "conservative: mirrors the reference, one request at a time")


def run(state: SearchState, proposer: Proposer, judge: Judge, ws: Workspace, report: Reporter,
        budget: float) -> None:
    """Judge candidates until the proposer runs dry or the budget cannot fit another one."""
    deadline = time.monotonic() + budget
    report.seconds_left = lambda: deadline - time.monotonic()
    candidate: Candidate | None = conservative_candidate()
    while candidate is not None:
        left = deadline - time.monotonic() - RESERVE_SECONDS
        if state.history and left < expected_seconds(state):
            report.line(f"budget: {left:.0f}s left, not enough for another evaluation; stopping")
            break
        entry = judge_one(len(state.history) + 1, candidate, state, judge, ws, report, timeout_for(state, left))
        state.history.append((candidate, entry.result))
        if entry.accepted:
            state.best, state.best_result = candidate, entry.result
        if len(state.history) > 1:
            proposer.feedback(candidate, entry.result)
        state.seconds_left = deadline - time.monotonic()
        candidate = next_candidate(proposer, state, report)


def judge_one(index: int, candidate: Candidate, state: SearchState, judge: Judge, ws: Workspace,
              report: Reporter, timeout: float) -> Entry:
    """Render, check, judge; install the engine if it passed and beats the best."""
    directory = ws.candidate_dir(index, describe(candidate.plan))
    entry = Entry(index, candidate, directory)
    report.started(entry)
    atomic_write(directory / "plan.json", json.dumps(candidate.to_dict(), indent=2) + "\n")
    source, result = None, None
    try:
        source = render_engine(candidate.plan, candidate.extra_variants)
    except Exception as e:  # noqa: BLE001 - a template that does not render is a failed candidate
        result = EvalResult.failure("render", "compile_error", f"{type(e).__name__}: {e}", state.device)
    if source is not None:
        atomic_write(directory / "engine.py", source)
        # Our own templates are trusted; code that came from a proposer is checked before it runs.
        violations = policy.check_engine(source) if candidate.extra_variants else []
        if violations:
            result = EvalResult.failure("policy", "policy", policy.describe(violations), state.device)
        else:
            result = judge(directory / "engine.py", directory, timeout)
    if result.stage in ("render", "policy"):
        atomic_write(directory / "result.json", json.dumps(result.to_dict(), indent=2) + "\n")
    entry.result = result
    entry.accepted = improves(result, state.best_result)
    if entry.accepted:
        ws.install_engine(source, {"index": index, **candidate.to_dict(), "result": result.to_dict()})
    report.finished(entry, installed=str(ws.engine) if entry.accepted else None)
    if entry.accepted:
        ws.commit(f"#{index:03d} {describe(candidate.plan)}: score {result.rank():.4g}\n\n"
                  f"{candidate.note}\n{json.dumps(candidate.to_dict(), indent=2)}")
    return entry


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
