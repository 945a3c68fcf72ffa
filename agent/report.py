"""What the run tells the user: results.log (human), results.json (machine), the console.

results.log is appended line by line as things happen, so a killed run still explains
itself; results.json is rewritten atomically after every candidate. On a terminal the
console shows a live table of candidates and the best so far; otherwise plain lines,
the same as the log.
"""
from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from agent import plot
from agent.plan import Plan, engine_params
from agent.records import DEADLINE, Candidate, EvalResult
from agent.workspace import ENGINE, RESULTS_JSON, RESULTS_LOG, atomic_write

ERROR_CHARS = 400           # of an error, in the log line (the whole text is in results.json)
PLAN_CHARS = 60             # of a plan's description, in the summary table


@dataclass(frozen=True)
class FinalDue:
    """A challenger that won its contest and became the search's best before its final (agent/loop.py
    settle_final): what the final must still confirm. `p`: its contest's sign test (None: a clear
    win on the screen alone); `beat`: the index of the best it replaced."""

    p: float | None
    beat: int | None
    superseded_by: int | None = None   # a faster engine replaced it first: it will never need its final

    def to_dict(self) -> dict:
        return {"p": self.p, "beat": self.beat, "superseded_by": self.superseded_by}


@dataclass
class Entry:
    index: int
    candidate: Candidate
    directory: Path
    result: EvalResult | None = None     # None while it is being judged
    accepted: bool = False               # written to workspace/engine.py (judged in full)
    seconds: float = 0.0                 # since the run started, when its verdict was final
    spent: dict[str, list[float]] = field(default_factory=dict)   # judge seconds per kind of evaluation
    final_due: FinalDue | None = None    # won its contest, its final not run yet

    def to_dict(self, root: Path) -> dict:
        return {"index": self.index, "dir": str(self.directory.relative_to(root)), **self.candidate.to_dict(),
                "result": self.result.to_dict() if self.result else None, "accepted": self.accepted,
                "final_due": self.final_due.to_dict() if self.final_due else None,
                "seconds": round(self.seconds, 3),
                "judge_seconds": {kind: [round(x, 3) for x in xs] for kind, xs in self.spent.items()}}


def describe(plan: Plan) -> str:
    """A plan as a reader wants it: the engine, its non-torch slots, and only the parameters
    that differ from the engine's defaults ("paged block_size=32", not all of them)."""
    try:
        defaults = {name: p.default for name, p in engine_params(plan.engine).items()}
    except OSError:  # an engine that is not a template file: show everything
        defaults = {}
    changed = {k: v for k, v in plan.params.items() if defaults.get(k, object()) != v}
    return Plan(plan.engine, plan.slots, changed).describe()


def rate(x: float) -> str:
    """1234.5 → '1.2k' tokens/s."""
    for div, unit in ((1e6, "M"), (1e3, "k")):
        if x >= div:
            return f"{x / div:.1f}{unit}"
    return f"{x:.0f}"


def _num(x) -> str:
    return f"{x:.3g}" if isinstance(x, (int, float)) else "?"


def verdict_line(r: EvalResult) -> str:
    if r.error_kind == DEADLINE:
        return f"NOT JUDGED: {r.error}  [{r.seconds:.1f}s]"
    if not r.passed:
        error = " ".join((r.error or "").split())
        if len(error) > ERROR_CHARS:
            error = error[:ERROR_CHARS] + "…"
        return f"FAILED at {r.stage} ({r.error_kind}): {error}  [{r.seconds:.1f}s]"
    parts = [f"PASSED  score {r.rank():.4g}" + (f" ({r.note})" if r.note else "")
             + ("; its stress suite not run yet" if r.unstressed else "")]
    parts += [f"{name} {rate(tps)} tok/s" for name, tps in r.tokens_per_second().items()]
    if r.public:
        parts.append(f"public max err {_num(r.public.get('max_abs_err'))}")
    if r.stress:
        parts.append(f"stress {r.stress.get('passed', '?')} ok, margin {_num(r.stress.get('worst_margin'))}")
    return "  ".join(parts) + f"  [{r.seconds:.1f}s{_stages(r)}]"


def _stages(r: EvalResult) -> str:
    """'; judge start 2.5, worker 2.6, benchmark 3.8; 12 kernels compiled': where the evaluator's
    time went (the stages that took a tenth of a second or more), and on CUDA how many Triton
    kernels its worker compiled rather than found in the run's shared cache."""
    stages = [f"{name} {sec:.1f}" for name, sec in (r.stage_seconds or {}).items()
              if isinstance(sec, (int, float)) and sec >= 0.05]
    compiled = f"; {r.triton_compiled} kernels compiled" if isinstance(r.triton_compiled, int) else ""
    return ("; " + ", ".join(stages) if stages else "") + compiled


def _spent(books: dict[str, list[float]]) -> str:
    """'screen 20s, repeated timing 3x 61s, final 30s'."""
    return ", ".join(f"{kind} {f'{len(xs)}x ' if len(xs) > 1 else ''}{sum(xs):.0f}s" for kind, xs in books.items())


def summary_rows(entries: list[Entry]) -> tuple[list[str], list[list[str]]]:
    """The final table, shared by the log and the console: one row per candidate."""
    cases = list(dict.fromkeys(c for e in entries if e.result for c in e.result.tokens_per_second()))
    header = ["", "#", "plan", "origin", "verdict", "score", *[f"{c} tok/s" for c in cases], "secs"]
    rows = []
    for e in entries:
        r = e.result
        verdict = ("unfinished" if r is None else "not judged" if r.error_kind == DEADLINE
                   else f"{r.stage}:{r.error_kind}" if not r.passed
                   else "won, no final" if e.final_due and r.passed else "unstressed" if r.unstressed
                   else "verified" if r.rank() <= 0 else "passed")
        tps = r.tokens_per_second() if r else {}
        rows.append(["*" if e.accepted else "", str(e.index), describe(e.candidate.plan)[:PLAN_CHARS],
                     e.candidate.origin, verdict, f"{r.rank():.4g}" if r and r.passed else "-",
                     *[rate(tps[c]) if c in tps else "-" for c in cases], f"{r.seconds:.1f}" if r else "-"])
    return header, rows


def text_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(line, widths)).rstrip() for line in [header, *rows])


class Reporter:
    def __init__(self, root: Path, live: bool | None = None):
        self.root = Path(root)
        self.entries: list[Entry] = []   # a resumed run's earlier candidates first (agent/cli.py)
        self.started_here = 0            # candidates this process started: the rate's numerator
        self.meta: dict = {}
        self.best_line = "none yet"
        self.isolation: str | None = None   # the last worker-isolation line shown
        self.seconds_left: Callable[[], float] = lambda: 0.0
        self.spent: dict[str, list[float]] = {}   # the run's judge seconds per kind of evaluation
        self._log = open(self.root / RESULTS_LOG, "a", buffering=1)
        self._started = time.monotonic()
        self._plot = True       # False once drawing was found impossible (said once in the log)
        self._live = None
        if live if live is not None else sys.stdout.isatty():
            self._start_live()

    # --- output channels -------------------------------------------------------------
    def _start_live(self) -> None:
        try:
            from rich.console import Console, Group
            from rich.live import Live
            from rich.table import Table
        except ImportError:
            return
        def render():
            header, rows = summary_rows(self.entries)
            table = Table(*header, title="candidates", title_justify="left")
            for row in rows:
                table.add_row(*row)
            return Group(table, f"best: {self.best_line}    budget left: {max(self.seconds_left(), 0):.0f}s")
        self._live = Live(console=Console(), get_renderable=render, refresh_per_second=2, transient=False)
        self._live.start()

    def line(self, text: str = "") -> None:
        """One line to the log and the console. Text that cannot be written as UTF-8 (a lone
        surrogate in a candidate's error message, carried back from its worker) is escaped
        rather than ending the run with a UnicodeEncodeError (red-team helper, twenty-ninth session)."""
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
        self._log.write(text + "\n")
        if self._live is not None:
            self._live.console.print(text, markup=False, highlight=False)
        else:
            print(text, flush=True)

    def warn(self, text: str) -> None:
        self.line(f"warning: {text}")

    # --- events ----------------------------------------------------------------------
    def start(self, meta: dict, header_lines: list[str]) -> None:
        self.meta = meta
        self.line(f"# inference agent run, {time.strftime('%Y-%m-%d %H:%M:%S')}")
        for text in header_lines:
            self.line(text)
        self.line(f"picture of the search: {self.root / plot.SEARCH_PNG} (rewritten after each candidate)")
        self._write_json(finished=False)

    def started(self, entry: Entry) -> None:
        self.entries.append(entry)
        self.started_here += 1
        c = entry.candidate
        self.line(f"#{entry.index:03d} {describe(c.plan)}  [{c.origin}] {c.note}")

    def verdict(self, entry: Entry, result: EvalResult, label: str = "") -> None:
        if result.isolation and result.isolation != self.isolation:   # once, and again if it changes
            self.isolation = result.isolation
            self.line(f"     {result.isolation}")
        self.line(f"     {label + ': ' if label else ''}{verdict_line(result)}")

    def accepted(self, entry: Entry, result: EvalResult) -> None:
        again = " (same engine, verdict updated)" if entry.accepted else ""
        self.best_line = f"#{entry.index:03d} {describe(entry.candidate.plan)} (score {result.rank():.4g})"
        self.line(f"     ACCEPTED -> {self.root / ENGINE}{again}")

    def spending(self, entry: Entry) -> Callable[[str, EvalResult], EvalResult]:
        """A recorder of where the judge's time goes: `spent(kind, verdict)` books the verdict's
        wall time under `kind` (screen, repeated timing, final, conservative) for the entry and
        the run, and returns the verdict."""
        def spent(kind: str, result: EvalResult) -> EvalResult:
            for book in (entry.spent, self.spent):
                book.setdefault(kind, []).append(result.seconds)
            return result
        return spent

    def judge_time(self) -> str:
        """This process's judge time by kind of evaluation, and candidates judged per minute: a
        resumed run's earlier candidates took time this process did not see, so they are not counted."""
        minutes = max(time.monotonic() - self._started, 1e-9) / 60
        return (f"judge time: {_spent(self.spent) or 'none'}; {self.started_here / minutes:.2f} candidates "
                f"judged per minute over {60 * minutes:.0f}s")

    def finished(self, entry: Entry) -> None:
        if entry.spent:
            self.line(f"     judge time: {_spent(entry.spent)}")
        entry.seconds = time.monotonic() - self._started
        self._write_json(finished=False)
        self._draw()

    def _draw(self) -> None:
        """workspace/search.png (agent/plot.py); parent lines where the archive chose a parent."""
        if not self._plot:
            return
        points = [plot.Point(e.index, e.seconds, 100 * (e.result.score or 0.0) if e.result.passed else None,
                             e.candidate.origin, e.accepted, None if e.result.passed else e.result.error_kind,
                             e.candidate.parent)
                  for e in self.entries if e.result is not None]
        self._plot = plot.draw(self.root / plot.SEARCH_PNG, points, self.line)

    def finish(self, closing_lines: list[str]) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
        self.line()
        self.line(f"summary (* = written to {ENGINE} when judged; the last * is the result)")
        self.line(text_table(*summary_rows(self.entries)))
        self.line()
        for text in closing_lines:
            self.line(text)
        self._write_json(finished=True)
        self._log.close()

    def installed(self) -> Entry | None:
        """The entry of workspace/engine.py: the last candidate installed (judged in full)."""
        return next((e for e in reversed(self.entries) if e.accepted), None)

    def _write_json(self, finished: bool) -> None:
        installed = self.installed()
        data = {**self.meta, "finished": finished, "best": installed.index if installed else None,
                "candidates": [e.to_dict(self.root) for e in self.entries]}
        atomic_write(self.root / RESULTS_JSON, json.dumps(data, indent=2, default=str) + "\n")
