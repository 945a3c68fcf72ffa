"""`--resume`: take over an interrupted run's workspace instead of starting over.

The record is the loop's own: `results.json` (every finished candidate, its verdict, whether it
was accepted) and `engine.json` (the verdict of the engine on disk, with its sha256). A resumed
run re-reads them, keeps every judged candidate in the history (the proposer skips their plans,
so none is judged twice), keeps the best, and numbers new candidates after the old ones.

A kill can land anywhere, so the record is made consistent first:
- a candidate installed whose results.json entry was not written yet (the kill came between
  the two) is taken from engine.json, which holds its plan and verdict;
- folders of candidates that never finished are removed (they are judged again, renumbered),
  as are the last ones whose verdict the budget cut short (records.DEADLINE, or a contest or a
  final the budget left no time for: EvalResult.cut_short);
- if engine.py is not the engine the record says is best (the kill came between writing
  engine.py and engine.json), the best recorded candidate's engine is installed again from its
  folder; with no passing candidate recorded, engine.py and engine.json are removed.
So the workspace holds a passing engine or none, and the history says which.

Model candidates that had passed their checks but were not judged yet (waiting.json, kept by the
pipeline) come back too, at the head of the queue: without them a run cut between a model's answer and
its verdict loses what it paid for (a scripted good model on an H200, twenty-sixth session: a
norm and a RoPE kernel answered before a cut never reached the engine). One that is unreadable,
or was judged after all, is left out.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path

from agent.plan import Plan
from agent.records import Candidate, EvalResult
from agent.report import Entry, FinalDue
from agent.workspace import CANDIDATES, ENGINE, RESULTS_JSON, VARIANTS, VERDICT, WAITING, Workspace

# Run settings that must match for old verdicts to mean the same thing in the new run.
SAME_INPUTS = ("config", "weights", "device")
# How results.json said "passed, its stress suite not run yet" before EvalResult.unstressed: in
# `error`. Such a conservative engine gets its stress suite in the resumed run like any other.
OLD_UNSTRESSED = "verified and timed; its stress suite runs only if it stays the result"


class ResumeError(Exception):
    """The workspace cannot be resumed (another model's run, an unreadable record)."""


@dataclass
class Previous:
    """What a resumed run takes over."""

    entries: list[Entry] = field(default_factory=list)   # judged candidates, indices 1..n
    seed: int | None = None                               # the interrupted run's stress seed
    waiting: list[Candidate] = field(default_factory=list)   # checked model candidates, not judged yet
    unreadable_waiting: int = 0                           # waiting.json entries that could not be read
    hardware: dict = field(default_factory=dict)          # the interrupted run's facts (its floor: cli.hardware)

    @property
    def best(self) -> Entry | None:
        """The loop's best installed: the last candidate it accepted (workspace/engine.py)."""
        return next((e for e in reversed(self.entries) if e.accepted), None)

    @property
    def search_best(self) -> Entry | None:
        """What the search builds on: the best installed, or a later winner whose final had not run
        when the run stopped (agent/loop.py settle_final runs it in the resumed run)."""
        return next((e for e in reversed(self.entries)
                     if e.accepted or (e.final_due is not None and e.final_due.superseded_by is None)), None)


def _entry(ws: Workspace, d: dict) -> Entry:
    directory = ws.root / d["dir"] if "dir" in d else _find_dir(ws, int(d["index"]))
    candidate = Candidate(Plan.from_dict(d["plan"]), d.get("origin", "?"), d.get("note", ""),
                          _variants(directory, d.get("extra_variants", [])), d.get("parent"))
    result = EvalResult.from_dict(d["result"])
    if result.passed and result.error == OLD_UNSTRESSED:
        result = replace(result, unstressed=True, error=None)
    due = d.get("final_due")
    final_due = FinalDue(due.get("p"), due.get("beat"), due.get("superseded_by")) \
        if isinstance(due, dict) and result.passed else None
    return Entry(int(d["index"]), candidate, directory, result, bool(d.get("accepted")), final_due=final_due)


def _variants(directory: Path, names: list[str]) -> dict[tuple[str, str], str]:
    """The model-written variants a candidate used, from the sources the loop saved beside it,
    so that its identity (Candidate.key) and a plan built on it survive the resume."""
    out = {}
    for name in names:
        slot, variant = name.split("/", 1)
        path = directory / VARIANTS / f"{slot}.{variant}.py.j2"
        try:
            out[(slot, variant)] = path.read_text()
        except OSError as e:
            raise ResumeError(f"{path} is gone ({e}); run without --resume to start over") from e
    return out


def _find_dir(ws: Workspace, index: int) -> Path:
    found = sorted((ws.root / CANDIDATES).glob(f"{index:03d}-*"))
    if not found:
        raise ResumeError(f"candidate #{index:03d} is recorded as installed but its folder is gone")
    return found[0]


def load(ws: Workspace, run: dict[str, str]) -> Previous | None:
    """The interrupted run in `ws`, made consistent; None when there is nothing to resume.
    `run` is the new run's settings (RunConfig as strings): the inputs must be the same."""
    try:
        record = json.loads((ws.root / RESULTS_JSON).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ResumeError(f"{RESULTS_JSON} cannot be read ({e}); run without --resume to start over") from e
    old = record.get("run", {})
    for key in SAME_INPUTS:
        if key in old and old[key] != run[key]:
            raise ResumeError(f"the run in {ws.root} used {key} {old[key]}, not {run[key]}; "
                              "run without --resume to start over")
    try:
        entries = [_entry(ws, d) for d in record.get("candidates", []) if d.get("result")]
        entries = _installed_taken_back(ws, entries, ws.installed_verdict())
    except (KeyError, TypeError, ValueError) as e:
        raise ResumeError(f"{RESULTS_JSON} is not a record this agent wrote ({e})") from e
    if [e.index for e in entries] != list(range(1, len(entries) + 1)):
        raise ResumeError(f"{RESULTS_JSON} has gaps in its candidate numbers; run without --resume")
    while entries and entries[-1].result.unfinished and not entries[-1].accepted:
        entries.pop()   # the budget ran out before its verdict: judged again, like an unfinished one
    previous = Previous(entries, int(old["seed"]) if str(old.get("seed", "")).isdigit() else None,
                        hardware=record["hardware"] if isinstance(record.get("hardware"), dict) else {})
    judged = {e.candidate.key() for e in entries}
    waiting, previous.unreadable_waiting = _waiting(ws)
    # A parent past the record (a challenger built on before its verdict, the run cut meanwhile)
    # would name whichever candidate takes its number next: none, then.
    previous.waiting = [c if c.parent is None or c.parent <= len(entries) else replace(c, parent=None)
                        for c in waiting if c.key() not in judged]
    best_source = _best_source(previous)  # may refuse: nothing is changed before this
    _drop_unfinished(ws, len(entries))
    _reinstall_best(ws, previous, best_source)
    return previous


def _installed_taken_back(ws: Workspace, entries: list[Entry], installed: dict | None) -> list[Entry]:
    """The record with what engine.json says was installed after the record's last write (a kill
    in between): the next candidate, installed at its verdict; or a winner whose deferred final
    passed and was installed (agent/loop.py settle_final), which must not run that final again."""
    if installed is None:
        return entries
    index = installed.get("index")
    if index == len(entries) + 1:
        return entries + [_entry(ws, {**installed, "accepted": True})]
    return [_entry(ws, {**installed, "accepted": True}) if e.index == index and e.final_due is not None else e
            for e in entries]


def _waiting(ws: Workspace) -> tuple[list[Candidate], int]:
    """The candidates waiting.json holds, and how many of its entries could not be read."""
    try:
        records = json.loads((ws.root / WAITING).read_text())["candidates"]
    except FileNotFoundError:
        return [], 0
    except (OSError, ValueError, KeyError, TypeError):
        return [], 1
    out, bad = [], 0
    for record in records if isinstance(records, list) else []:
        try:
            out.append(Candidate.from_record(record))
        except (KeyError, TypeError, ValueError, AttributeError):
            bad += 1
    return out, bad


def _best_source(previous: Previous) -> str | None:
    best = previous.best
    if best is None:
        return None
    try:
        return (best.directory / ENGINE).read_text()
    except OSError as e:
        raise ResumeError(f"the best recorded engine, #{best.index:03d}, is gone from its folder ({e})") from e


def _drop_unfinished(ws: Workspace, judged: int) -> None:
    for folder in (ws.root / CANDIDATES).glob("*-*"):
        number = folder.name.split("-", 1)[0]
        if number.isdigit() and int(number) > judged:
            shutil.rmtree(folder, ignore_errors=True)


def _reinstall_best(ws: Workspace, previous: Previous, source: str | None) -> None:
    """engine.py must be the best recorded candidate's engine (`source`), or absent."""
    best, installed = previous.best, ws.installed_verdict()
    if best is None or source is None:
        for name in (ENGINE, VERDICT):
            (ws.root / name).unlink(missing_ok=True)
        return
    if installed is not None and installed.get("index") == best.index:
        return
    ws.install_engine(source, {"index": best.index, **best.candidate.to_dict(), "result": best.result.to_dict()})
