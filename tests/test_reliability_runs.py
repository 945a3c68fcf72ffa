"""Whole runs under faults (issue #6): resumed after a kill -9 at random moments, with a
workspace that cannot be written or a disk that fills up, with a candidate that hangs against
the budget. docs/reliability.md lists each fault, its injection and what the agent does."""
from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from agent import cli, loop, resume
from agent.judge import JudgeSettings
from agent.plan import Plan
from agent.records import DEADLINE, Candidate, EvalResult, SearchState
from agent.report import Reporter
from agent.workspace import TMP_PREFIX, Workspace, atomic_write
from evaluator import floor

from tests.conftest import SINGLE_THREAD_ENV
from tests.fixtures.broken_engines import broken_source

REPO = Path(__file__).resolve().parent.parent
PLANS = [Plan("paged", params={"x": i}) for i in range(4)]


class ListProposer:
    name = "list"

    def __init__(self, plans):
        self.plans = list(plans)

    def propose(self, state):
        while self.plans:
            candidate = Candidate(self.plans.pop(0), "test", "listed")
            if not state.tried(candidate):
                return candidate
        return None

    def feedback(self, candidate, result):
        pass


def passed(score: float) -> EvalResult:
    return EvalResult(status="passed", stage="done", device="cpu", score=score, seconds=1.0)


class FakeJudge:
    """Passes every candidate with a score twice the last one's (so each is installed at its
    screen, agent/acceptance.py CLEAR_WIN), the same again for an engine judged before (the best's
    repeated timings), writing result.json as the real judge does; remembers what it judged."""

    def __init__(self):
        self.judged: list[str] = []

    def __call__(self, engine: Path, out_dir: Path, timeout: float, phase) -> EvalResult:
        if engine.read_text() not in self.judged:
            self.judged.append(engine.read_text())
        result = passed(2.0 ** self.judged.index(engine.read_text()))
        atomic_write(out_dir / "result.json", json.dumps(result.to_dict()))
        return result


def fake_render(plan, extra_variants=None) -> str:
    return f"# engine {plan.key()}\n"


def recorded_run(root: Path, plans, monkeypatch, state: SearchState | None = None) -> tuple[Workspace, FakeJudge]:
    """A loop run with the fake judge, leaving a real record in root/ws."""
    monkeypatch.setattr(loop, "render_engine", fake_render)
    ws = Workspace(root / "ws")
    if state is None:
        ws.reset()
    report = Reporter(ws.root, live=False)
    fake = FakeJudge()
    state = state or SearchState(spec=None, device="cpu", hardware={})
    report.start({"run": RUN}, [])
    loop.run(state, ListProposer(plans), fake, ws, report, 600.0)
    report.finish([])
    return ws, fake


RUN = {"config": "/c.json", "weights": "/w", "device": "cpu", "seed": "5"}


def resumed_state(ws: Workspace, run=RUN) -> tuple[SearchState, resume.Previous]:
    previous = resume.load(ws, run)
    state = SearchState(spec=None, device="cpu", hardware={},
                        history=[(e.candidate, e.result) for e in previous.entries])
    return state, previous


# --- resume: the record made consistent, nothing judged twice ---------------------------

def test_resume_skips_what_was_judged_and_keeps_the_best(tmp_path, monkeypatch):
    ws, _ = recorded_run(tmp_path, PLANS[:2], monkeypatch)
    state, previous = resumed_state(ws)
    assert [e.index for e in previous.entries] == [1, 2, 3] and previous.best.index == 3 and previous.seed == 5
    ws2, fake = recorded_run(tmp_path, PLANS, monkeypatch, state)
    assert fake.judged == [fake_render(PLANS[2]), fake_render(PLANS[3])]  # not the conservative, not 0 or 1
    assert ws2.installed_verdict()["index"] == 5


class PhaseJudge(FakeJudge):
    """FakeJudge that remembers each call's phase, and fails the FINAL of engines in `fail_final`."""

    def __init__(self, fail_final=()):
        super().__init__()
        self.calls: list[tuple[str, str]] = []
        self.fail_final = set(fail_final)

    def __call__(self, engine: Path, out_dir: Path, timeout: float, phase) -> EvalResult:
        self.calls.append((engine.read_text(), phase))
        if phase == loop.FINAL and engine.read_text() in self.fail_final:
            result = EvalResult.failure("stress", "mismatch", "wrong on a long prompt", "cpu", 1.0)
            atomic_write(out_dir / "result.json", json.dumps(result.to_dict()))
            return result
        return super().__call__(engine, out_dir, timeout, phase)


class Heard(ListProposer):
    """ListProposer that remembers every verdict it was handed."""

    def __init__(self, plans):
        super().__init__(plans)
        self.heard: list[tuple[dict, str]] = []

    def feedback(self, candidate, result):
        self.heard.append((candidate.plan.params, result.stage))


def deferred_run(tmp_path, monkeypatch, judge, plans=PLANS, proposer=None,
                 capture: bool = True) -> tuple[Workspace, SearchState, list[str]]:
    """A fresh loop run in tmp_path/ws with `judge`; its log lines in the list returned (`capture`),
    or written to results.log as a real run writes them. The report is finished on the way out of
    an interrupt too, as cli.run_search finishes it."""
    monkeypatch.setattr(loop, "render_engine", fake_render)
    ws = Workspace(tmp_path / "ws")
    ws.reset()
    report, state, lines = Reporter(ws.root, live=False), SearchState(spec=None, device="cpu", hardware={}), []
    if capture:
        monkeypatch.setattr(report, "line", lambda text="": lines.append(text))
    report.start({"run": RUN}, [])
    try:
        loop.run(state, proposer or ListProposer(plans), judge, ws, report, 600.0)
    finally:
        report.finish([])
    return ws, state, lines


def resumed_run(ws: Workspace, state: SearchState, previous: resume.Previous, judge) -> None:
    """The resumed run cli.run_search makes of `previous` with `judge`: it builds on search_best
    (a winner whose deferred final was due, where there is one) and proposes nothing new."""
    state.best, state.best_result = previous.search_best.candidate, previous.search_best.result
    report = Reporter(ws.root, live=False)
    report.entries = list(previous.entries)
    report.start({"run": RUN}, [])
    loop.run(state, ListProposer([]), judge, ws, report, 600.0)
    report.finish([])


def test_a_winner_replaced_before_its_final_never_needs_one(tmp_path, monkeypatch):
    """Each winner becomes the search's best at once; its final is deferred, and a faster winner
    makes it unnecessary: of four winners in a row, the first (which replaces the conservative
    engine on disk) and the last have finals, and only they are installed (workspace/engine.py
    holds only engines judged in full meanwhile)."""
    judge = PhaseJudge()
    ws, state, lines = deferred_run(tmp_path, monkeypatch, judge)
    finals = [engine for engine, phase in judge.calls if phase == loop.FINAL]
    assert finals == [fake_render(PLANS[0]), fake_render(PLANS[3])]
    assert ws.engine.read_text() == fake_render(PLANS[3]) and ws.installed_verdict()["index"] == 5
    assert sum("PROVISIONAL" in line for line in lines) == 3
    record = json.loads((ws.root / "results.json").read_text())["candidates"]
    assert [c["accepted"] for c in record] == [True, True, False, False, True]
    assert [(c["final_due"] or {}).get("superseded_by") for c in record] == [None, None, 4, 5, None]


def test_a_winner_whose_final_fails_is_not_installed_and_the_search_goes_back(tmp_path, monkeypatch):
    """The deferred final of the search's best fails (its stress suite): it is not installed, and
    the search goes back to the winner it replaced, whose final is due again and runs (it passes
    here and is installed), not past it to the older engine on disk."""
    judge, proposer = PhaseJudge(fail_final=[fake_render(PLANS[3])]), Heard(PLANS)
    ws, state, lines = deferred_run(tmp_path, monkeypatch, judge, proposer=proposer)
    assert ({"x": 3}, "stress") in proposer.heard   # its proposer hears the final's failure too
    finals = [engine for engine, phase in judge.calls if phase == loop.FINAL]
    assert finals == [fake_render(PLANS[0]), fake_render(PLANS[3]), fake_render(PLANS[2])]
    assert ws.installed_verdict()["index"] == 4 and state.best.plan == PLANS[2]
    assert any("the search goes back to #004, the winner it replaced" in line for line in lines)
    record = json.loads((ws.root / "results.json").read_text())["candidates"]
    assert record[4]["result"]["stage"] == "stress" and not record[4]["accepted"] and not record[4]["final_due"]
    assert record[3]["accepted"] and [c["accepted"] for c in record] == [True, True, False, True, False]


def test_a_final_interrupted_or_cut_by_the_budget_stays_due(tmp_path, monkeypatch):
    """A deferred final stopped by an interrupt (or one the budget cut short) is not a verdict:
    the winner stays due in the record, so --resume makes it the search's best and runs it."""
    class Interrupted(PhaseJudge):
        def __call__(self, engine, out_dir, timeout, phase):
            if phase == loop.FINAL and engine.read_text() == fake_render(PLANS[3]):
                raise KeyboardInterrupt
            return super().__call__(engine, out_dir, timeout, phase)
    with pytest.raises(KeyboardInterrupt):
        deferred_run(tmp_path, monkeypatch, Interrupted())
    ws = Workspace(tmp_path / "ws")
    record = json.loads((ws.root / "results.json").read_text())["candidates"]
    assert record[-1]["index"] == 5 and record[-1]["final_due"] and not record[-1]["accepted"]
    _, previous = resumed_state(ws)
    assert previous.search_best.index == 5 and previous.best.index == 2


def test_a_winner_the_run_stopped_before_its_final_gets_it_on_resume(tmp_path, monkeypatch):
    """A run cut after a contest was won, before its final: the resumed run builds on that winner
    and runs its final, instead of losing the win (its plan is judged, so never proposed again)."""
    ws, _ = recorded_run(tmp_path, PLANS[:2], monkeypatch)
    record = json.loads((ws.root / "results.json").read_text())
    last = record["candidates"][-1]
    last.update(accepted=False, final_due={"p": None, "beat": 2})   # killed before its final
    (ws.root / "results.json").write_text(json.dumps(record))
    (ws.root / "engine.json").unlink()
    state, previous = resumed_state(ws)
    assert previous.best.index == 2 and previous.search_best.index == 3
    judge = PhaseJudge()
    resumed_run(ws, state, previous, judge)
    assert judge.calls == [(fake_render(PLANS[1]), loop.FINAL)]
    assert ws.installed_verdict()["index"] == 3


def test_cli_resume_runs_the_final_an_interrupted_run_left_due(cli_env, tmp_path, monkeypatch, capsys):
    """The whole path through `python3 -m agent --resume` (cli.run_search: Previous.search_best):
    a run stopped in its last winner's deferred final leaves that winner due; the resumed run
    builds on it, runs that final and nothing else, and installs it."""
    class Interrupted(PhaseJudge):
        def __call__(self, engine, out_dir, timeout, phase):
            if phase == loop.FINAL and engine.read_text() == fake_render(PLANS[1]):
                raise KeyboardInterrupt
            return super().__call__(engine, out_dir, timeout, phase)
    monkeypatch.setattr(loop, "render_engine", fake_render)
    monkeypatch.setattr(cli, "make_proposer", lambda *args: ListProposer(PLANS[:2]))
    run_judge_is(Interrupted(), monkeypatch)
    ws = tmp_path / "ws"
    assert cli.main(cli_args(cli_env, ws)) == cli.EXIT_INTERRUPTED
    assert json.loads((ws / "engine.json").read_text())["index"] == 2
    assert json.loads((ws / "results.json").read_text())["candidates"][-1]["final_due"]

    judge = PhaseJudge()
    run_judge_is(judge, monkeypatch)
    monkeypatch.setattr(cli, "make_proposer", lambda *args: ListProposer([]))
    first_floor = json.loads((ws / "results.json").read_text())["hardware"]

    def measured_again(*args, **kwargs):
        raise AssertionError("the resumed run measured the machine again: its scores would be on another floor")
    monkeypatch.setattr(floor, "detect_hardware", measured_again)
    assert cli.main(cli_args(cli_env, ws, "--resume")) == cli.EXIT_OK, capsys.readouterr().err
    assert judge.calls == [(fake_render(PLANS[1]), loop.FINAL)]
    kept = json.loads((ws / "results.json").read_text())["hardware"]
    assert (kept[cli.BANDWIDTH], kept[cli.PEAK]) == (first_floor[cli.BANDWIDTH], first_floor[cli.PEAK])
    installed = json.loads((ws / "engine.json").read_text())
    assert installed["index"] == 3 and (ws / "engine.py").read_text() == fake_render(PLANS[1])
    record = json.loads((ws / "results.json").read_text())
    assert record["best"] == 3 and record["candidates"][-1]["accepted"] and not record["candidates"][-1].get("final_due")


def test_a_final_installed_before_the_record_was_written_is_not_run_again(tmp_path, monkeypatch):
    """Killed after a deferred final installed its winner, before results.json said so: --resume
    takes the installed verdict (engine.json) for that winner instead of running its final again."""
    ws, _ = recorded_run(tmp_path, PLANS[:2], monkeypatch)
    assert ws.installed_verdict()["index"] == 3
    record = json.loads((ws.root / "results.json").read_text())
    record["candidates"][-1].update(accepted=False, final_due={"p": None, "beat": 2})   # as before its final
    record["best"] = 2
    (ws.root / "results.json").write_text(json.dumps(record))
    state, previous = resumed_state(ws)
    assert previous.best.index == 3 and previous.search_best.index == 3 and previous.best.final_due is None
    assert previous.best.result.to_dict() == ws.installed_verdict()["result"]
    judge = PhaseJudge()
    resumed_run(ws, state, previous, judge)
    assert judge.calls == []
    assert json.loads((ws.root / "results.json").read_text())["best"] == 3


def test_a_verdict_holding_text_utf8_cannot_write_goes_into_the_log_escaped(tmp_path, monkeypatch):
    """A candidate's error message with a lone surrogate (an engine raised it; the verdict carried
    it back): the log line escapes it instead of the run ending in a UnicodeEncodeError, which a
    --resume then met again on the same candidate (red-team helper, twenty-ninth session)."""
    class Surrogate(PhaseJudge):
        def __call__(self, engine, out_dir, timeout, phase):
            if engine.read_text() == fake_render(PLANS[0]):
                result = EvalResult.failure("public", "runtime_error", "raised ValueError: bad \udc80 byte", "cpu", 1.0)
                atomic_write(out_dir / "result.json", json.dumps(result.to_dict()))
                return result
            return super().__call__(engine, out_dir, timeout, phase)
    ws, _, _ = deferred_run(tmp_path, monkeypatch, Surrogate(), PLANS[:2], capture=False)
    assert "bad \\udc80 byte" in (ws.root / "results.log").read_text()
    assert json.loads((ws.root / "results.json").read_text())["finished"]


def test_the_final_of_the_best_runs_while_the_judge_would_wait_for_the_model(monkeypatch):
    """Pipeline.next's `idle`: with model workers busy and nothing ready, the judge's pending final
    runs (once) instead of the judge waiting."""
    from agent.pipeline import Pipeline
    ran, answered = [], threading.Event()

    class Slow:
        name = "slow"
        active = True
        fallback = ListProposer([])   # the builtin walk, spent

        def propose(self, state):
            return None

        def feedback(self, candidate, result):
            pass

        def ready(self, state):
            return True

        def ask(self, state):   # a model episode that lasts until the judge has done its own work
            answered.wait(60)
            raise RuntimeError("this worker is done")   # it stops (a bug on the model's side would)

        def paused(self, state):
            return False
    best = Candidate(PLANS[0], "builtin", "")
    state = SearchState(spec=None, device="cpu", hardware={}, history=[(best, passed(1.0))], best=best,
                        best_result=passed(1.0))

    def idle():
        ran.append(time.monotonic())
        answered.set()
    with Pipeline(Slow(), state, 2, time.monotonic() + 60.0, lambda text: None, lambda waiting: None) as pipeline:
        assert pipeline.next(idle=idle) is None
    assert len(ran) == 1


def test_a_resumed_runs_rate_counts_only_what_it_judged(tmp_path, monkeypatch):
    """Candidates judged per minute over a resumed process's own minutes: the earlier process's
    candidates are not its work (a resumed GPU run once claimed 3.25 a minute for 5 in 369 s)."""
    ws, _ = recorded_run(tmp_path, PLANS[:2], monkeypatch)
    state, previous = resumed_state(ws)
    report = Reporter(ws.root, live=False)
    report.entries = list(previous.entries)          # as agent/cli.py restores them
    report.start({"run": RUN}, [])
    loop.run(state, ListProposer(PLANS), FakeJudge(), ws, report, 600.0)
    assert len(report.entries) == 5 and report.started_here == 2
    begun = report._started
    monkeypatch.setattr(time, "monotonic", lambda: begun + 60.0)
    assert report.judge_time().endswith("; 2.00 candidates judged per minute over 60s")
    report.finish([])


def test_resume_after_a_kill_between_install_and_record(tmp_path, monkeypatch):
    ws, _ = recorded_run(tmp_path, PLANS[:2], monkeypatch)
    record = json.loads((ws.root / "results.json").read_text())
    record["candidates"] = record["candidates"][:2]  # #003 installed, its entry never written
    (ws.root / "results.json").write_text(json.dumps(record))
    _, previous = resumed_state(ws)
    assert [e.index for e in previous.entries] == [1, 2, 3] and previous.best.index == 3
    assert previous.best.candidate.plan == PLANS[1]


def test_resume_after_a_kill_between_engine_and_its_verdict(tmp_path, monkeypatch):
    ws, _ = recorded_run(tmp_path, PLANS[:2], monkeypatch)
    record = json.loads((ws.root / "results.json").read_text())
    record["candidates"] = record["candidates"][:2]
    record["candidates"][1].update(accepted=True, final_due=None)   # #002 passed its final and was installed
    (ws.root / "results.json").write_text(json.dumps(record))
    (ws.root / "engine.json").write_text(json.dumps({"index": 2, "sha256": "of the engine before"}))
    unfinished = ws.candidate_dir(4, "never finished")
    (unfinished / f"{TMP_PREFIX}engine.py.x").write_text("half")
    ws.clear_leftovers()
    _, previous = resumed_state(ws)
    assert [e.index for e in previous.entries] == [1, 2] and not unfinished.exists()
    assert ws.engine.read_text() == fake_render(PLANS[0])  # #002 installed again from its folder
    assert ws.installed_verdict()["index"] == 2
    assert not list(ws.root.rglob(TMP_PREFIX + "*"))


@pytest.mark.parametrize("how", ["deadline", "contest"])
def test_a_candidate_the_budget_cut_short_is_judged_again_on_resume(tmp_path, monkeypatch, how):
    """The last candidate's verdict was cut by the run's budget (records.DEADLINE, or a contest or
    final the budget left no time for: cut_short): not a verdict on it, so the resumed run drops
    it with its folder and judges its plan again."""
    ws, _ = recorded_run(tmp_path, PLANS[:2], monkeypatch)
    record = json.loads((ws.root / "results.json").read_text())
    record["candidates"][-1]["accepted"] = False
    record["candidates"][-1]["result"] = (
        EvalResult.failure("unknown", DEADLINE, "the run's budget ran out", "cpu", 9.0) if how == "deadline" else
        EvalResult(status="passed", stage="done", device="cpu", score=3.0, cut_short=True,
                   decision="within noise (p=0.125): 130% of best; no time left for another pair")).to_dict()
    (ws.root / "results.json").write_text(json.dumps(record))
    (ws.root / "engine.json").unlink()
    cut = next((ws.root / "candidates").glob("003-*"))
    state, previous = resumed_state(ws)
    assert [e.index for e in previous.entries] == [1, 2] and not cut.exists()
    _, fake = recorded_run(tmp_path, PLANS[:2], monkeypatch, state)
    assert fake.judged[0] == fake_render(PLANS[1])   # #003's plan, judged again


@pytest.mark.parametrize("record", ["field", "old error text"])
def test_a_resumed_unstressed_conservative_engine_still_gets_its_stress_suite(tmp_path, monkeypatch, record):
    """Killed before the conservative engine's stress suite: the resumed run runs it once it
    stays the result, whether results.json says so in `unstressed` or (an older record) in `error`."""
    ws, _ = recorded_run(tmp_path, [], monkeypatch)
    data = json.loads((ws.root / "results.json").read_text())
    first = data["candidates"][0]["result"]
    first.update(stress=None, unstressed=True)
    if record == "old error text":
        del first["unstressed"]
        first["error"] = resume.OLD_UNSTRESSED
    (ws.root / "results.json").write_text(json.dumps(data))
    (ws.root / "engine.json").unlink()   # the record is the truth: installed again from its folder
    state, previous = resumed_state(ws)
    assert previous.entries[0].result.unstressed and previous.entries[0].result.error is None
    phases = []
    fake = FakeJudge()

    def judge(engine, out_dir, timeout, phase):
        phases.append(phase)
        return fake(engine, out_dir, timeout, phase)
    report = Reporter(ws.root, live=False)
    report.entries = list(previous.entries)
    state.best, state.best_result = previous.best.candidate, previous.best.result
    loop.run(state, ListProposer([]), judge, ws, report, 600.0)
    report.finish([])
    assert phases == [loop.STRESS] and not state.history[0][1].unstressed
    assert not ws.installed_verdict()["result"]["unstressed"]


def test_resume_with_nothing_passed_removes_an_unrecorded_engine(tmp_path):
    ws = Workspace(tmp_path / "ws")
    ws.reset()
    (ws.root / "results.json").write_text(json.dumps({"run": RUN, "candidates": []}))
    ws.engine.write_text("installed, never recorded\n")
    _, previous = resumed_state(ws)
    assert previous.entries == [] and not ws.engine.exists()


def test_resume_refuses_another_runs_workspace(tmp_path, monkeypatch):
    ws, _ = recorded_run(tmp_path, PLANS[:1], monkeypatch)
    with pytest.raises(resume.ResumeError, match="used weights /w, not /other"):
        resume.load(ws, {**RUN, "weights": "/other"})
    assert resume.load(Workspace(tmp_path / "empty"), RUN) is None


# --- the CLI: a workspace that cannot be written, a disk that fills up --------------------

@pytest.fixture
def cli_env(monkeypatch, tiny_model):
    """cli.main in-process, its SIGTERM handler restored afterwards."""
    before = signal.getsignal(signal.SIGTERM)
    yield tiny_model
    signal.signal(signal.SIGTERM, before)


def cli_args(model, ws: Path, *more: str) -> list[str]:
    return ["--config", str(model.config_path), "--weights", str(model.weight_dir), "--device", "cpu",
            "--workspace", str(ws), "--seed", "1", *more]


def run_judge_is(fake: FakeJudge, monkeypatch) -> None:
    """cli's run judge (agent/judge.py Judge) made a stand-in whose every verdict is `fake`'s. The
    real one gets a phase's settings (JudgeSettings.for_phase); here they carry the phase's name."""
    monkeypatch.setattr(JudgeSettings, "for_phase", lambda self, phase: phase)

    class Resident:
        def __init__(self, settings, log_dir, place=None):
            self.place = place

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def verdict(self, engine, out, timeout, phase):
            return fake(engine, out, timeout, phase)

        def series(self, timings, folder):
            return loop.OneByOne(fake, timings, folder)
    monkeypatch.setattr(cli, "Judge", Resident)


def test_an_unwritable_workspace_is_one_line_and_exit_3(cli_env, tmp_path, capsys):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the workspace's parent should be")
    assert cli.main(cli_args(cli_env, blocker / "ws")) == cli.EXIT_WRITE_FAILED
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: cannot write the workspace") and "Not a directory" in err
    assert cli.main(cli_args(cli_env, blocker)) == cli.EXIT_WRITE_FAILED   # the workspace itself a file
    assert capsys.readouterr().err.strip().endswith(f"{blocker}: it is a file, not a folder")
    if os.geteuid() != 0:  # root writes through permissions; the file above stands in for it there
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o555)
        assert cli.main(cli_args(cli_env, locked / "ws")) == cli.EXIT_WRITE_FAILED
        assert "Permission denied" in capsys.readouterr().err


@pytest.mark.parametrize("writes_before_full", [0, 2, 5, 9])
def test_a_full_disk_ends_the_run_cleanly(cli_env, tmp_path, monkeypatch, capsys, writes_before_full):
    """The disk fills after `writes_before_full` fsyncs (where a full disk surfaces for a file
    written through the page cache): every later atomic write fails with ENOSPC."""
    real_fsync, calls = os.fsync, []

    def fsync(fd):
        calls.append(fd)
        if len(calls) > writes_before_full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_fsync(fd)

    judge = FakeJudge()
    run_judge_is(judge, monkeypatch)
    monkeypatch.setattr(cli, "make_proposer", lambda *args: ListProposer(PLANS))
    monkeypatch.setattr(os, "fsync", fsync)
    ws = tmp_path / "ws"
    code = cli.main(cli_args(cli_env, ws))
    monkeypatch.setattr(os, "fsync", real_fsync)
    err = capsys.readouterr().err.strip()
    assert code == cli.EXIT_WRITE_FAILED, err
    assert err.count("\n") == 0 and "No space left on device" in err
    assert not [p for p in ws.rglob("*") if p.name.startswith(TMP_PREFIX) and ".git" not in p.parts]
    if (ws / "engine.py").exists():  # only ever a whole engine that was judged
        assert (ws / "engine.py").read_text() in judge.judged


# --- whole runs: the budget with a hanging candidate, kill -9 then --resume ---------------

BUDGET_SECONDS = 30.0       # the conservative engine (2-3 s on 2 cores with the suite's other worker busy,
                            # thirty-eighth session; ~10 s where it compiles) and the hang, which takes the rest
BUDGET_OVERRUN_SECONDS = 15.0   # killing and sweeping the hung evaluator, on a loaded machine


@pytest.mark.slow
def test_the_budget_holds_when_a_candidate_hangs(cli_env, tmp_path, monkeypatch, recompute_source):
    hang = Plan("paged", params={"hangs": True})
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(loop, "render_engine", lambda plan, extra=None: (
        broken_source("blocks", recompute_source) if plan == hang else recompute_source))
    monkeypatch.setattr(cli, "make_proposer", lambda *args: ListProposer([hang, PLANS[0]]))
    ws = tmp_path / "ws"
    start = time.monotonic()
    code = cli.main(cli_args(cli_env, ws, "--budget", str(BUDGET_SECONDS)))
    elapsed = time.monotonic() - start
    assert code == cli.EXIT_OK
    assert elapsed <= BUDGET_SECONDS + BUDGET_OVERRUN_SECONDS, elapsed
    results = json.loads((ws / "results.json").read_text())
    verdicts = [(c["plan"]["params"], c["result"]["error_kind"]) for c in results["candidates"]]
    # the hang took the rest of the budget, longer than the conservative engine's pass: a timeout, not a cut
    assert verdicts == [({}, None), ({"hangs": True}, "timeout")]
    assert public_check(ws / "engine.py", cli_env)


def public_check(engine: Path, model) -> bool:
    done = subprocess.run([sys.executable, str(REPO / "evaluator" / "test_correctness.py"), "--engine", str(engine),
                           "--model-config", str(model.config_path), "--weight-dir", str(model.weight_dir),
                           "--device", "cpu"], capture_output=True, text=True, cwd=REPO, env=SINGLE_THREAD_ENV)
    return done.returncode == 0 and '"status": "passed"' in done.stdout


KILLS = 2
KILL_WINDOW_SECONDS = (0.5, 12.0)   # from start-up to a few candidates into the run
FINAL_BUDGET_SECONDS = 300.0   # generous: the final run stops two candidates past the record instead
MORE_CANDIDATES = 1


def agent_process(model, ws: Path, *more: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "agent", *cli_args(model, ws, *more)], cwd=REPO,
                            env=SINGLE_THREAD_ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)


def judged_results(ws: Path) -> dict[str, int]:
    """result.json of every candidate the record says was judged -> its mtime (a winner whose
    final had not run yet is not judged in full: the resumed run runs it, agent/loop.py settle_final)."""
    try:
        record = json.loads((ws / "results.json").read_text())
    except (OSError, ValueError):
        return {}
    out = {}
    for c in record["candidates"]:
        path = ws / c["dir"] / "result.json"
        if c["result"] and not c.get("final_due") and path.exists():
            out[str(path)] = path.stat().st_mtime_ns
    return out


@pytest.mark.slow
def test_kill_9_at_random_moments_then_resume(tiny_model, tmp_path, test_seed):
    rng = random.Random(test_seed)
    ws = tmp_path / "ws"
    judged_before: dict[str, int] = {}
    for k in range(KILLS):
        proc = agent_process(tiny_model, ws, "--budget", "120", *(["--resume"] if k else []))
        time.sleep(rng.uniform(*KILL_WINDOW_SECONDS))
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        engine = ws / "engine.py"
        assert not engine.exists() or public_check(engine, tiny_model), f"kill {k}: engine.py does not pass"
        judged_before.update(judged_results(ws))
    recorded = len(json.loads((ws / "results.json").read_text())["candidates"]) if (ws / "results.json").exists() else 0
    proc = agent_process(tiny_model, ws, "--budget", str(FINAL_BUDGET_SECONDS), "--resume",
                         "--max-candidates", str(recorded + MORE_CANDIDATES))
    _, err = proc.communicate(timeout=FINAL_BUDGET_SECONDS * 2)
    assert proc.returncode == cli.EXIT_OK, err.decode()[-2000:]
    assert public_check(ws / "engine.py", tiny_model)
    record = json.loads((ws / "results.json").read_text())
    keys = [Plan.from_dict(c["plan"]).key() for c in record["candidates"]]
    assert len(keys) == len(set(keys)), "a plan was judged twice"
    assert [c["index"] for c in record["candidates"]] == list(range(1, len(keys) + 1))
    for path, mtime in judged_before.items():  # judged before a kill: never judged again
        assert Path(path).stat().st_mtime_ns == mtime, path


def test_resume_restores_model_written_variants(tmp_path, monkeypatch):
    """A candidate carrying an LLM-written variant keeps its code across a resume: the same
    candidate is recognised as judged, and the best plan can still be rendered."""
    text = "# slot: silu_mul    variant: llm_1    devices: cpu\ndef silu_mul__llm_1(x):\n    return x\n"
    plan = Plan("paged", slots={"silu_mul": "llm_1"})
    llm = Candidate(plan, "test", "model-written", {("silu_mul", "llm_1"): text})

    class OneCandidate(ListProposer):
        def propose(self, state):
            return None if state.tried(llm) else llm

    monkeypatch.setattr(loop, "render_engine", fake_render)
    ws = Workspace(tmp_path / "ws")
    ws.reset()
    report = Reporter(ws.root, live=False)
    report.start({"run": RUN}, [])
    loop.run(SearchState(spec=None, device="cpu", hardware={}), OneCandidate([]), FakeJudge(), ws, report, 600.0)
    report.finish([])
    state, previous = resumed_state(ws)
    restored = previous.entries[-1].candidate
    assert restored.extra_variants == {("silu_mul", "llm_1"): text}
    assert restored.key() == llm.key() and state.tried(llm)
