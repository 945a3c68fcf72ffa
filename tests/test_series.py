"""A contest's repeated timings through the run's judge (evaluator/resident.py, agent/judge.py
Series): each timing is a whole TIMING verdict in a worker of its own, handed over as soon as it
is in; the judge starts once; a contest that has decided stops the timings it did not need."""
from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace

import pytest

from agent import acceptance
from agent import judge as judge_module
from agent.judge import Judge, JudgeSettings
from agent.records import EvalResult
from evaluator.common import REPO_ROOT
from evaluator.resident import BadRequest, parse_request
from evaluator.sweep import children, processes
from tests.conftest import SINGLE_THREAD_ENV
from tests.fixtures.broken_engines import broken_source
from tests.test_search import timed

HANG_TIMEOUT_SECONDS = 8.0   # a timing of the tiny model fits in it; the hang does not end


def test_a_contest_asks_for_its_timings_in_the_series_order():
    """acceptance.order() is what a series runs ahead: a contest that goes every round asks for
    exactly those timings, of those engines, in that order."""
    asked = []
    challenger_ratios = iter([[1.02, 1.02, 0.99], [1.01, 1.03, 1.02]])   # p stays open until the last round

    def mine(label: str) -> EvalResult:
        asked.append((label, True))
        return timed(1.0, next(challenger_ratios))

    def theirs(label: str) -> EvalResult:
        asked.append((label, False))
        return timed(1.0, [1, 1, 1])
    decision = acceptance.contest(timed(1.0, [1.02, 1.02, 1.02]), timed(1.0, [1, 1, 1]), mine, theirs)
    assert decision.p is not None and len(asked) == 2 * acceptance.MAX_ROUNDS - 1
    assert asked == acceptance.order()


def settings(model) -> JudgeSettings:
    return JudgeSettings(sys.executable, model.config_path, model.weight_dir, "cpu", 0, cases="prefill",
                         warmup=0, repeat=1, memory_bytes=4 * 2**30)


def test_each_timing_is_a_whole_verdict_in_a_worker_of_its_own(tiny_model, recompute_engine_path, recompute_source,
                                                               write_engine, tmp_path):
    broken = write_engine(broken_source("wrong_shape", recompute_source), "broken")   # wrong in the timed case
    timings = [("incumbent-1", recompute_engine_path), ("challenger-2", broken), ("incumbent-3", recompute_engine_path)]
    with Judge(settings(tiny_model), tmp_path / "judge") as judge, judge.series(timings, tmp_path / "c") as series:
        first = series.result("incumbent-1", 600)
        wrong = series.result("challenger-2", 600)
        third = series.result("incumbent-3", 600)
    assert first.passed and [c["case_name"] for c in first.benchmark] == ["prefill"] and first.stress is None
    assert first.score > 0
    # No public sequence in a repeated timing (its screen ran it); a wrong engine is still caught,
    # by the benchmark's checked runs.
    assert first.public is None and "public" not in first.stage_seconds and "benchmark" in first.stage_seconds
    assert (wrong.status, wrong.stage) == ("failed", "benchmark") and wrong.error_kind == "wrong_result"
    assert third.passed   # a failed timing does not stop the series
    assert "judge start" in first.stage_seconds and "judge start" not in third.stage_seconds   # one judge start
    assert first.isolation != third.isolation   # each its own worker (its own uid)
    assert all((tmp_path / "c" / label / "result.json").exists() for label, _ in timings)
    assert all((tmp_path / "c" / label / "stderr.txt").read_text() for label, _ in timings)   # logs beside each
    assert judge.starts == 1 and series.running.poll() is not None   # closed with the judge


def test_closing_a_series_stops_the_timings_nobody_asked_for(tiny_model, recompute_engine_path, tmp_path):
    timings = [(f"incumbent-{i}", recompute_engine_path) for i in range(1, 4)]
    before = children()
    judge = Judge(settings(tiny_model), tmp_path / "judge")
    series = judge.series(timings, tmp_path / "c")
    with pytest.raises(ValueError, match="out of the series' order"):
        series.result("challenger-9", 600)
    assert series.running is None and judge.starts == 0   # nothing was started for it
    killed = series.result("incumbent-2", 0.5)   # incumbent-1 skipped (run anyway); no time for a verdict
    assert (killed.status, killed.error_kind) == ("failed", "timeout")
    series.close()
    assert series.running.poll() is not None and judge.proc is None   # the judge was killed with its group
    assert not children() - before   # neither the judge nor a worker (re-parented here) is left
    judge.close()


def test_consecutive_timings_of_one_engine_share_its_worker(tiny_model, recompute_engine_path, write_engine,
                                                            recompute_source, tmp_path):
    """In the contest's order (A, B B, A): the two B timings in one worker (the same jail, the
    same uid), each its own verdict on fresh engines; A's timings each in a worker of its own."""
    other = write_engine(recompute_source, "other")
    timings = [("incumbent-1", recompute_engine_path), ("incumbent-2", recompute_engine_path),
               ("challenger-2", other), ("challenger-3", other)]
    with Judge(settings(tiny_model), tmp_path / "judge") as judge, judge.series(timings, tmp_path / "c") as series:
        results = [series.result(label, 600) for label, _ in timings]
    assert all(r.passed and r.benchmark for r in results)
    assert results[0].isolation == results[1].isolation and results[2].isolation == results[3].isolation
    assert results[1].isolation != results[2].isolation
    assert "(its worker again)" in (tmp_path / "c" / "incumbent-2" / "stderr.txt").read_text()


def test_a_series_starts_its_workers_before_its_first_timing(tiny_model, recompute_engine_path, write_engine,
                                                             recompute_source, tmp_path):
    """Where the judge keeps a spare, the fresh worker each engine's run of timings needs is
    started with the series (none starts between two timings), and it is still a worker of its
    own for each run."""
    other = write_engine(recompute_source, "other")
    timings = [("incumbent-1", recompute_engine_path), ("challenger-2", other), ("challenger-3", other),
               ("incumbent-3", recompute_engine_path)]
    with Judge(replace(settings(tiny_model), spare_worker="on"), tmp_path / "judge") as judge, \
            judge.series(timings, tmp_path / "c") as series:
        results = [series.result(label, 600) for label, _ in timings]
    assert all(r.passed and r.benchmark for r in results)
    assert len({results[0].isolation, results[1].isolation, results[3].isolation}) == 3
    assert results[1].isolation == results[2].isolation
    for label in ("challenger-2", "incumbent-3"):   # its hello came before the first timing, not here
        log = (tmp_path / "c" / label / "stderr.txt").read_text()
        assert "started with the series, made ready" in log and "worker isolation" not in log, log


def test_a_worker_whose_timing_failed_is_not_used_again(tiny_model, recompute_source, write_engine, tmp_path):
    broken = write_engine(broken_source("wrong_shape", recompute_source), "broken")
    timings = [("challenger-2", broken), ("challenger-3", broken)]
    with Judge(settings(tiny_model), tmp_path / "judge") as judge, judge.series(timings, tmp_path / "c") as series:
        first, second = (series.result(label, 600) for label, _ in timings)
    assert first.error_kind == second.error_kind == "wrong_result"
    assert first.isolation != second.isolation


def test_screens_and_rounds_time_screen_repeat_engines_and_the_final_the_full_repeat(
        tiny_model, recompute_engine_path, tmp_path):
    """One judge process at --repeat 2: a screen (TIMING) and a contest's timing run one fresh
    engine a case (screen_repeat 1), the finalist's verdict (FINAL) two (its stress suite left
    out here: the phases' stress settings are tests/test_feedback.py's)."""
    from agent.judge import FINAL, TIMING
    from dataclasses import replace
    run = replace(settings(tiny_model), repeat=2, screen_repeat=1, stress="off")
    with Judge(run, tmp_path / "judge") as judge:
        screen = judge.verdict(recompute_engine_path, tmp_path / "screen", 600, run.for_phase(TIMING))
        with judge.series([("incumbent-1", recompute_engine_path)], tmp_path / "c") as series:
            round_ = series.result("incumbent-1", 600)
        final = judge.verdict(recompute_engine_path, tmp_path / "final", 600, run.for_phase(FINAL))
    assert screen.passed and round_.passed and final.passed and judge.starts == 1
    assert [len(r.benchmark[0]["runs_ms"]) for r in (screen, round_, final)] == [1, 1, 2]
    assert [r.benchmark[0]["warm_up"] for r in (screen, round_, final)] == ["shared", "shared", "case"]


BAD_REQUESTS = ['{"timings": [["a/b", "engine.py"]], "out_dir": "x"}', '{"engine": "e.py"}',
                '{"engine": "e.py", "out_dir": "x", "stress": "no"}', '{"engine": "e.py", "out_dir": "x", "ticket": 7}',
                '[1, 2]', '{"timings": [["a", "e.py"], ["a", "e.py"]], "out_dir": "x"}',
                '{"engine": "e.py", "out_dir": "x", "repeat": 0}', '{"timings": [["a", "e.py"]], "out_dir": "x", "repeat": "2"}',
                '{"engine": "e.py", "out_dir": "x", "cache_scope": "ab"}',
                '{"engine": "e.py", "out_dir": "x", "cache_scope": ["../x"]}',
                '{"timings": [["a", "e.py", "t", ["AB"]]], "out_dir": "x"}',
                '{"engine": "e.py", "out_dir": "x", "warm_up": "none"}', '{"timings": [["a", "e.py"]], "out_dir": "x", "warm_up": 1}']


def test_a_request_names_the_cache_scope_of_its_engine():
    verdict = parse_request('{"engine": "e.py", "out_dir": "x", "cache_scope": ["ab12", "cd34"]}')
    assert verdict.cache_scope == ("ab12", "cd34") and parse_request('{"engine": "e.py", "out_dir": "x"}').cache_scope == ()
    series = parse_request('{"timings": [["a", "e.py", "t1", ["ab12"]], ["b", "f.py", "t2"]], "out_dir": "x"}')
    assert [(label, scope) for label, _, _, scope in series.timings] == [("a", ("ab12",)), ("b", ())]


@pytest.mark.parametrize("request_line", BAD_REQUESTS)
def test_a_request_the_judge_cannot_read_is_refused(request_line):
    with pytest.raises(BadRequest, match="bad request"):
        parse_request(request_line)


def test_a_bad_request_is_one_line_and_exit_2(tiny_model):
    """The process end of it (one of BAD_REQUESTS: each starts a process, which imports torch)."""
    proc = subprocess.run([sys.executable, "-m", "evaluator.resident", "--model-config", str(tiny_model.config_path),
                           "--weight-dir", str(tiny_model.weight_dir), "--device", "cpu"],
                          input=random.choice(BAD_REQUESTS) + "\n", capture_output=True, text=True, cwd=REPO_ROOT,
                          env=SINGLE_THREAD_ENV, timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "bad request" in proc.stderr


def children_of(pid: int) -> set[int]:
    return {p for p, f in processes() if f.get("PPid", "").strip() == str(pid)}


def wait_for(path, text, seconds=120.0) -> bool:
    """Until the judge's log for a timing says `text` (the timing is under way)."""
    deadline = time.monotonic() + seconds
    while (not path.exists() or text not in path.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return path.exists() and text in path.read_text()


def test_a_series_closed_before_its_last_timing_is_cut_and_the_judge_goes_on(tiny_model, recompute_source,
                                                                          write_engine, tmp_path):
    """Series.close once the contest has what it needs: the judge, running ahead on a timing nobody
    will ask for (here one that would never end), cuts it (its worker killed), runs no later
    timing, says the series is done, and gives the next verdict itself, from its spare worker: no
    second judge start, nothing of the cut timing's worker left. (A series after a stopped one:
    the next test.)"""
    engines = [write_engine(recompute_source, "e0"), write_engine(broken_source("hangs", recompute_source), "e1"),
               write_engine(recompute_source, "e2")]
    timings = [(f"t{i}", engine) for i, engine in enumerate(engines)]
    with Judge(replace(settings(tiny_model), spare_worker="on"), tmp_path / "judge") as judge:
        with judge.series(timings, tmp_path / "c") as series:
            assert series.result("t0", 600).passed
            first = judge.proc
            hung = tmp_path / "c" / "t1" / "stderr.txt"
            assert wait_for(hung, "--- t1")
            time.sleep(1.0)   # its worker in the hanging prefill
        assert judge.proc is first and first.poll() is None
        assert json.loads((tmp_path / "c" / "series-done.json").read_text())["stopped"] is True
        assert len(children_of(first.pid)) <= 1   # its spare at most: the cut timing's worker is gone
        started = time.monotonic()
        after = judge.verdict(engines[0], tmp_path / "after", 600, judge.settings)
        assert after.passed and judge.starts == 1 and "judge start" not in after.stage_seconds
        assert "the judge's spare" in (tmp_path / "after" / "stderr.txt").read_text()
        assert time.monotonic() - started < 120
        assert "stopped by its caller" in hung.read_text()
    assert not (tmp_path / "c" / "t1" / "result.json").exists() and not (tmp_path / "c" / "t2" / "result.json").exists()


def test_a_stop_cuts_a_worker_still_importing_its_engine_and_a_stop_not_asked_for_ends_one_timing(
        tiny_model, recompute_source, write_engine, tmp_path):
    """The stop reaches a timing's worker from the moment it exists: one importing an engine that
    takes a minute to import is cut at once, not waited for (or its judge killed at the grace's
    end). And a SIGUSR1 the agent did not send (a same-uid worker can signal the judge) ends only
    the timing asked for, as a crash said at once, not a wait to the timeout; the judge lives on."""
    slow_import = write_engine("import time\ntime.sleep(60)\n" + recompute_source, "slow")
    hang = write_engine(broken_source("hangs", recompute_source), "hang")
    quick = write_engine(recompute_source, "quick")
    with Judge(settings(tiny_model), tmp_path / "judge") as judge:
        with judge.series([("t0", quick), ("t1", slow_import)], tmp_path / "c") as series:
            assert series.result("t0", 600).passed
            first = judge.proc
            assert wait_for(tmp_path / "c" / "t1" / "stderr.txt", "worker")   # its worker started, importing
            time.sleep(1.0)
            started = time.monotonic()
        assert time.monotonic() - started < judge_module.STOP_GRACE_SECONDS / 2
        assert judge.proc is first and first.poll() is None and judge.starts == 1
        with judge.series([("t0", quick), ("t1", hang)], tmp_path / "d") as series:
            assert series.result("t0", 600).passed
            assert wait_for(tmp_path / "d" / "t1" / "stderr.txt", "--- t1")
            time.sleep(1.0)
            first.send_signal(signal.SIGUSR1)
            started = time.monotonic()
            cut = series.result("t1", 300)
        assert time.monotonic() - started < 30
        assert cut.error_kind == "crash" and "not sent by the agent" in cut.error
        assert judge.proc is first and first.poll() is None and judge.starts == 1


def test_a_judge_that_does_not_say_its_series_is_done_is_killed(tiny_model, recompute_engine_path, tmp_path,
                                                                 monkeypatch):
    """No word from the judge within the grace (a worker still importing cannot be cut; here no
    grace at all): it is killed with its group, as before the judge could stop a series, and the
    next verdict has a fresh one."""
    monkeypatch.setattr(judge_module, "STOP_GRACE_SECONDS", 0.0)
    timings = [(f"t{i}", recompute_engine_path) for i in range(6)]
    before = children()
    with Judge(settings(tiny_model), tmp_path / "judge") as judge:
        with judge.series(timings, tmp_path / "c") as series:
            assert series.result("t0", 600).passed
            first = judge.proc
        assert judge.proc is None and first.poll() is not None and not children() - before
        after = judge.verdict(recompute_engine_path, tmp_path / "after", 600, settings(tiny_model))
        assert after.passed and judge.starts == 2


def test_one_timings_result_cannot_be_passed_off_as_anothers(tiny_model, recompute_engine_path, recompute_source,
                                                             write_engine, tmp_path):
    """Each timing of a series has its own ticket. A worker under the judge's uid can read the
    first timing's result.json (its contest's folder) and copy it, ticket and all, into the next
    timing's place while that one is under way: not taken for it."""
    hang = write_engine(broken_source("hangs", recompute_source), "hang")
    timings = [("incumbent-1", recompute_engine_path), ("challenger-2", hang)]
    folder, stop = tmp_path / "c", threading.Event()

    def copy_first_into_second():
        while not stop.wait(0.2):
            first = folder / "incumbent-1" / "result.json"
            if first.exists() and (folder / "challenger-2").is_dir():
                (folder / "challenger-2" / "copy.json").write_text(first.read_text())
                (folder / "challenger-2" / "copy.json").replace(folder / "challenger-2" / "result.json")
    copier = threading.Thread(target=copy_first_into_second, daemon=True)
    with Judge(settings(tiny_model), tmp_path / "judge") as judge, judge.series(timings, folder) as series:
        assert series.result("incumbent-1", 600).passed
        copier.start()
        try:
            second = series.result("challenger-2", HANG_TIMEOUT_SECONDS)
        finally:
            stop.set()
            copier.join()
    assert (second.status, second.error_kind) == ("failed", "timeout")


def test_sigterm_unwinds_the_verdict_under_way_and_writes_nothing(tiny_model, recompute_source, write_engine,
                                                                 tmp_path):
    """SIGTERM (the agent's kill) in the middle of a verdict: unwound (its jail torn down), no
    verdict written for it (it would be the stop's, not the engine's), and the process exits by
    itself rather than waiting for SIGKILL."""
    import signal
    import time
    hang = write_engine(broken_source("hangs", recompute_source), "hang")
    out = tmp_path / "v"
    proc = subprocess.Popen([sys.executable, "-m", "evaluator.resident", "--model-config", str(tiny_model.config_path),
                             "--weight-dir", str(tiny_model.weight_dir), "--device", "cpu", "--cases", "prefill"],
                            stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT,
                            env=SINGLE_THREAD_ENV)
    proc.stdin.write(json.dumps({"engine": str(hang), "out_dir": str(out), "stress": "off"}) + "\n")
    proc.stdin.flush()
    deadline = time.monotonic() + 300
    while "margin" not in _read(out / "stderr.txt") and time.monotonic() < deadline:   # the verdict under way
        time.sleep(0.2)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM
    assert not (out / "result.json").exists()


def _read(path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def test_a_worker_started_with_the_series_is_closed_when_sigterm_comes_while_it_takes_its_engine(
        monkeypatch, tmp_path):
    """A worker handed to Held.start (started with the series) is no longer in the series' list:
    SIGTERM's exit while it is made ready closes it there (its process and its jail)."""
    from evaluator.remote import Worker
    from evaluator.resident import Held
    worker = Worker("cpu", 2**31)
    try:
        worker.started()
        monkeypatch.setattr(Worker, "ready", lambda self: (_ for _ in ()).throw(SystemExit(143)))
        with pytest.raises(SystemExit):
            Held.start(tmp_path / "engine.py", "cpu", 2**31, None, print, (), started=worker)
        left = worker.proc.poll() is None or worker.jail.root.exists()
    finally:
        monkeypatch.undo()
        worker.close()
    assert not left
