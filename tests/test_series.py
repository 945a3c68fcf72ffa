"""A contest's repeated timings in one evaluator process (evaluator/series.py, agent/judge.py
Series): each timing is a whole TIMING verdict in a worker of its own, handed over as soon as it
is in; the judge starts once; a contest that has decided stops the timings it did not need."""
from __future__ import annotations

import subprocess
import sys

import pytest

from agent import acceptance
from agent.judge import JudgeSettings, Series
from agent.records import EvalResult
from evaluator.common import REPO_ROOT
from tests.conftest import SINGLE_THREAD_ENV
from tests.fixtures.broken_engines import broken_source
from tests.test_search import timed


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
    broken = write_engine(broken_source("raises_in_decode", recompute_source), "broken")
    timings = [("incumbent-1", recompute_engine_path), ("challenger-2", broken), ("incumbent-3", recompute_engine_path)]
    with Series(timings, tmp_path / "c", settings(tiny_model)) as series:
        first = series.result("incumbent-1", 600)
        wrong = series.result("challenger-2", 600)
        third = series.result("incumbent-3", 600)
    assert first.passed and [c["case_name"] for c in first.benchmark] == ["prefill"] and first.stress is None
    assert first.public["status"] == "passed" and first.score > 0
    assert (wrong.status, wrong.stage, wrong.error_kind) == ("failed", "public", "runtime_error")
    assert third.passed   # a failed timing does not stop the series
    assert "judge start" in first.stage_seconds and "judge start" not in third.stage_seconds   # one judge start
    assert first.isolation != third.isolation   # each its own worker (its own uid)
    assert all((tmp_path / "c" / label / "result.json").exists() for label, _ in timings)
    assert series.running.proc.poll() is not None


def test_closing_a_series_stops_the_timings_nobody_asked_for(tiny_model, recompute_engine_path, tmp_path):
    timings = [(f"incumbent-{i}", recompute_engine_path) for i in range(1, 4)]
    series = Series(timings, tmp_path / "c", settings(tiny_model))
    with pytest.raises(ValueError, match="out of the series' order"):
        series.result("challenger-9", 600)
    assert series.running is None   # nothing was started for it
    killed = series.result("incumbent-2", 0.5)   # incumbent-1 skipped (run anyway); no time for a verdict
    assert (killed.status, killed.error_kind) == ("failed", "timeout")
    series.close()
    assert series.running.proc.poll() is not None
    pids = [p for p in subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split()]
    assert not pids   # neither the evaluator nor a worker is left


def test_consecutive_timings_of_one_engine_share_its_worker(tiny_model, recompute_engine_path, write_engine,
                                                            recompute_source, tmp_path):
    """In the contest's order (A, B B, A): the two B timings in one worker (the same jail, the
    same uid), each its own verdict on fresh engines; A's timings each in a worker of its own."""
    other = write_engine(recompute_source, "other")
    timings = [("incumbent-1", recompute_engine_path), ("incumbent-2", recompute_engine_path),
               ("challenger-2", other), ("challenger-3", other)]
    with Series(timings, tmp_path / "c", settings(tiny_model)) as series:
        results = [series.result(label, 600) for label, _ in timings]
    assert all(r.passed and r.benchmark for r in results)
    assert results[0].isolation == results[1].isolation and results[2].isolation == results[3].isolation
    assert results[1].isolation != results[2].isolation
    assert "(its worker again)" in (tmp_path / "c" / "series" / "stderr.txt").read_text()


def test_a_worker_whose_timing_failed_is_not_used_again(tiny_model, recompute_source, write_engine, tmp_path):
    broken = write_engine(broken_source("raises_in_decode", recompute_source), "broken")
    timings = [("challenger-2", broken), ("challenger-3", broken)]
    with Series(timings, tmp_path / "c", settings(tiny_model)) as series:
        first, second = (series.result(label, 600) for label, _ in timings)
    assert first.error_kind == second.error_kind == "runtime_error"
    assert first.isolation != second.isolation


@pytest.mark.parametrize("flag", ["--timing=a/b=engine.py", "--timing=noengine"])
def test_a_bad_timing_flag_is_one_line_and_exit_2(flag, tiny_model, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "evaluator.series", flag, "--out-dir", str(tmp_path),
                           "--model-config", str(tiny_model.config_path), "--weight-dir", str(tiny_model.weight_dir)],
                          capture_output=True, text=True, cwd=REPO_ROOT, env=SINGLE_THREAD_ENV)
    assert proc.returncode == 2 and "LABEL=ENGINE" in proc.stderr


def test_a_stopped_series_ends_at_once_and_writes_no_verdict_for_the_timing_it_cut(tiny_model, recompute_engine_path,
                                                                                 tmp_path):
    """SIGTERM (Series.close) in the middle of a timing: the timing is unwound (its jail torn
    down), no verdict is written for it (it would be the stop's, not the engine's), no timing
    follows, and the process exits by itself rather than waiting for SIGKILL."""
    import signal
    import time
    out = tmp_path / "c"
    proc = subprocess.Popen([sys.executable, "-m", "evaluator.series", "--timing", f"one={recompute_engine_path}",
                             "--timing", f"two={recompute_engine_path}", "--out-dir", str(out), "--cases", "prefill",
                             "--warmup", "0", "--repeat", "1", "--device", "cpu",
                             "--model-config", str(tiny_model.config_path), "--weight-dir", str(tiny_model.weight_dir)],
                            stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT, env=SINGLE_THREAD_ENV)
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if line.startswith("--- one:"):
            break
    time.sleep(0.5)   # into the timing (no verdict depends on how far it got)
    proc.send_signal(signal.SIGTERM)
    _, rest = proc.communicate(timeout=120)
    assert proc.returncode in (0, 128 + signal.SIGTERM), "".join(lines) + rest
    assert not (out / "two").exists() and "--- two" not in rest
    if not (out / "one" / "result.json").exists():
        assert "one: stopped by the caller" in rest or proc.returncode == 128 + signal.SIGTERM
