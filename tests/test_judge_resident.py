"""The run's one judge process (agent/judge.py Judge, evaluator/resident.py): its verdicts are the
standalone command's, several of them come from one process, and every guarantee of a verdict
in a process of its own still holds (a timeout kills the whole judge group and the next verdict
comes from a fresh judge; an interrupted agent leaves no judge or worker behind)."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

from agent import judge as judge_mod
from agent.judge import Judge, JudgeSettings
from agent.records import EvalResult
from evaluator.common import REPO_ROOT
from evaluator.evaluate import write_json
from evaluator.sweep import children, processes
from tests.conftest import SINGLE_THREAD_ENV
from tests.fixtures.broken_engines import broken_source

HANG_TIMEOUT_SECONDS = 8.0   # the judge's start and the public sequence fit in it; the hang does not end
# What no two verdicts of one engine share: the clock's readings, and the worker's uid.
TIMED_FIELDS = ("seconds", "stage_seconds", "benchmark", "score", "isolation")


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(judge_mod, "TERM_GRACE_SECONDS", 0.5)


def settings(model, seed: int, **changes) -> JudgeSettings:
    return JudgeSettings(sys.executable, model.config_path, model.weight_dir, "cpu", seed, cases="prefill",
                         warmup=0, repeat=1, memory_bytes=4 * 2**30, bandwidth_gbs=100.0, peak_tflops=1.0,
                         **changes)


def untimed(result: dict) -> dict:
    """A verdict less what the clock and the worker's uid decide; each benchmark case by its name."""
    kept = {k: v for k, v in result.items() if k not in TIMED_FIELDS}
    kept["benchmark"] = [case["case_name"] for case in result.get("benchmark") or []]
    return kept


def test_a_verdict_is_the_standalone_commands_in_content(tiny_model, recompute_engine_path, recompute_source,
                                                         write_engine, tmp_path):
    """The same engines, the same seed (the stress suite's cases, the judge's margin): the resident
    judge's verdicts equal `python3 -m evaluator.evaluate`'s field for field but for the clock, a
    passing and a failing one, the second after the first in the same process."""
    seed = random.randrange(2**31)
    broken = write_engine(broken_source("raises_in_decode", recompute_source), "broken")
    s = settings(tiny_model, seed, stress="quick")
    with Judge(s, tmp_path / "judge") as judge:
        mine = [judge.verdict(engine, tmp_path / f"resident-{i}", 600, s).to_dict()
                for i, engine in enumerate([recompute_engine_path, broken])]
    for i, engine in enumerate([recompute_engine_path, broken]):
        out = tmp_path / f"alone-{i}" / "result.json"
        subprocess.run([sys.executable, "-m", "evaluator.evaluate", "--engine", str(engine), "--out", str(out),
                        "--stress", "quick", "--cases", s.cases, *s.process_flags()], cwd=REPO_ROOT, env=SINGLE_THREAD_ENV,
                       capture_output=True, timeout=600)
        alone = EvalResult.from_dict(json.loads(out.read_text())).to_dict()
        assert untimed(mine[i]) == untimed(alone)
        assert (tmp_path / f"resident-{i}" / "stdout.txt").read_text().startswith(alone["status"])
    assert mine[0]["status"] == "passed" and mine[0]["stress"] and mine[1]["error_kind"] == "runtime_error"


def test_an_error_utf8_cannot_write_is_a_verdict_from_the_same_judge(tiny_model, recompute_source, write_engine,
                                                                       tmp_path):
    """An engine raising with a lone surrogate in its message (the worker's JSON carries it): the
    judge printed the verdict's line before writing it, the print raised, and the judge exited
    without a verdict (a start more for each such engine; a series ended there). Now a
    runtime_error, from the one judge."""
    from tests.test_judge_attacks import attacking_engine
    raises = "raise RuntimeError('lone \\ud800 surrogate')\n"
    engine = write_engine(attacking_engine(recompute_source, in_prefill=raises))
    s = settings(tiny_model, 1)
    with Judge(s, tmp_path / "judge") as judge:
        result = judge.verdict(engine, tmp_path / "verdict", 120, s)
        assert (result.status, result.error_kind, judge.starts) == ("failed", "runtime_error", 1), result.error
        assert "surrogate" in (tmp_path / "verdict" / "stdout.txt").read_text()


def test_several_verdicts_come_from_one_judge_process(tiny_model, recompute_engine_path, tmp_path):
    """Three verdicts, one process: started once, its start counted in the first verdict only,
    its margin measured once (the same on all), each verdict in a worker of its own."""
    s = settings(tiny_model, random.randrange(2**31), stress="off")
    with Judge(s, tmp_path / "judge") as judge:
        results = [judge.verdict(recompute_engine_path, tmp_path / f"v{i}", 600, s) for i in range(3)]
        pid = judge.proc.pid
        assert judge.starts == 1 and judge.proc.poll() is None
    assert all(r.passed for r in results)
    assert "judge start" in results[0].stage_seconds
    assert not any("judge start" in r.stage_seconds for r in results[1:])
    assert len({r.reference_margin for r in results}) == 1
    assert len({r.isolation for r in results}) == 3
    assert not _alive(pid)   # closing the judge ends it


def test_a_timeout_kills_the_judge_group_and_the_next_verdict_has_a_fresh_judge(tiny_model, recompute_source,
                                                                               recompute_engine_path,
                                                                               write_engine, tmp_path):
    hang = write_engine(broken_source("hangs", recompute_source), "hang")
    s = settings(tiny_model, random.randrange(2**31), stress="off")
    before = children()
    with Judge(s, tmp_path / "judge") as judge:
        assert judge.verdict(recompute_engine_path, tmp_path / "first", 600, s).passed
        first_pid = judge.proc.pid
        hung = judge.verdict(hang, tmp_path / "hung", HANG_TIMEOUT_SECONDS, s)
        assert (hung.status, hung.error_kind) == ("failed", "timeout")
        assert json.loads((tmp_path / "hung" / "result.json").read_text())["error_kind"] == "timeout"
        assert judge.proc is None and not _alive(first_pid)
        assert not children() - before   # its worker (re-parented to us, the subreaper) is gone too
        after = judge.verdict(recompute_engine_path, tmp_path / "after", 600, s)
        assert after.passed and judge.starts == 2 and judge.proc.pid != first_pid
        assert "judge start" in after.stage_seconds   # a fresh process paid its start


def test_an_interrupted_agent_leaves_no_judge_or_worker(tiny_model, recompute_source, write_engine, tmp_path):
    """KeyboardInterrupt (the agent's SIGINT/SIGTERM) while a verdict is under way, its worker
    hanging: the judge's group and the worker are killed before the interrupt goes on."""
    hang = write_engine(broken_source("hangs", recompute_source), "hang")
    s = settings(tiny_model, random.randrange(2**31), stress="off")
    before = children()
    seen: dict[str, set[int]] = {}

    def interrupt(*_):
        seen["tree"] = _tree(judge.proc.pid)
        raise KeyboardInterrupt
    previous = signal.signal(signal.SIGALRM, interrupt)
    judge = Judge(s, tmp_path / "judge")
    try:
        signal.setitimer(signal.ITIMER_REAL, HANG_TIMEOUT_SECONDS)
        with pytest.raises(KeyboardInterrupt):
            judge.verdict(hang, tmp_path / "v", 600, s)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        judge.close()
    assert len(seen["tree"]) >= 2, "the worker was not running yet: nothing interrupted"
    assert not [pid for pid in seen["tree"] if _alive(pid)]
    assert not children() - before


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except OSError:
        return False


def _tree(root: int) -> set[int]:
    """`root` and its descendants (the judge and its workers), now."""
    parents = {pid: int(f.get("PPid", "0").strip() or 0) for pid, f in processes()}
    tree = {root}
    grew = True
    while grew:
        grew = False
        for pid, parent in parents.items():
            if parent in tree and pid not in tree:
                tree.add(pid)
                grew = True
    return tree


def test_a_result_json_the_judge_did_not_write_is_not_the_verdict(tiny_model, recompute_source, write_engine,
                                                                   tmp_path):
    """A worker under the judge's own uid (no root) can write into the verdict's folder. A forged
    passing result.json there, while the real verdict (a hang) is under way, must not end the wait:
    only the result.json that carries the request's ticket is the verdict."""
    hang = write_engine(broken_source("hangs", recompute_source), "hang")
    s = settings(tiny_model, random.randrange(2**31), stress="off")
    out = tmp_path / "v"
    forged = {"status": "passed", "stage": "done", "score": 1e9, "device": "cpu",
              "ticket": "%032x" % random.getrandbits(128)}
    stop = threading.Event()

    def forge():
        while not stop.wait(0.2):
            if out.is_dir():
                (out / "forged.json").write_text(json.dumps(forged))
                (out / "forged.json").replace(out / "result.json")
    forger = threading.Thread(target=forge, daemon=True)
    forger.start()
    try:
        with Judge(s, tmp_path / "judge") as judge:
            started = time.monotonic()
            verdict = judge.verdict(hang, out, HANG_TIMEOUT_SECONDS, s)
    finally:
        stop.set()
        forger.join()
    assert (verdict.status, verdict.error_kind) == ("failed", "timeout")
    assert time.monotonic() - started >= HANG_TIMEOUT_SECONDS


def test_a_link_or_fifo_planted_where_the_verdict_goes_is_not_read_and_does_not_hang(tmp_path):
    """A same-uid worker could plant a symlink (to a file it rewrites after the judge's write) or a
    FIFO (whose read would block the agent for good) at result.json: the agent reads only a regular
    file, without following or blocking; and the judge's write puts its own regular file there."""
    ticket = "%032x" % random.getrandbits(128)
    theirs = tmp_path / "theirs.json"
    theirs.write_text(json.dumps({"status": "passed", "stage": "done", "score": 1e9, "ticket": ticket}))
    link, fifo = tmp_path / "link" / "result.json", tmp_path / "fifo" / "result.json"
    link.parent.mkdir(), fifo.parent.mkdir()
    link.symlink_to(theirs)
    os.mkfifo(fifo)
    started = time.monotonic()
    assert judge_mod._read(link, ticket) is None and judge_mod._read(fifo, ticket) is None
    assert time.monotonic() - started < 5
    write_json({"status": "passed", "ticket": ticket}, link)
    assert not link.is_symlink() and judge_mod._read(link, ticket) is not None
    assert json.loads(theirs.read_text())["score"] == 1e9   # the judge's write did not go through the link


SERIES_FAILING = r'''
import argparse, json, sys
from pathlib import Path
from evaluator import resident

def broken_worker(*args, **kwargs):
    raise OSError("fork: resource temporarily unavailable")

calls = []
def evaluate(self, engine, *args, **kwargs):
    calls.append(engine)
    if len(calls) == 1:
        raise RuntimeError("the judge's own bug")
    return resident.failed_result("cpu", "benchmark", "wrong_result", "a verdict of its own")

resident.Worker = broken_worker      # Held.start cannot start one: evaluate() is left to try
resident.Resident.evaluate = evaluate
judge = resident.Resident(argparse.Namespace(device="cpu", memory_gb=None, triton_cache=None, spare_worker="off"), {})
out = Path(sys.argv[1])
judge.series(resident.SeriesRequest([("a-1", Path("a.py"), "t1", ()), ("b-1", Path("b.py"), "t2", ())], out))
print(json.dumps([json.loads((out / label / "result.json").read_text()) for label in ("a-1", "b-1")]))
'''


def test_a_timing_the_judge_itself_fails_on_is_a_crash_verdict_and_the_series_goes_on(tmp_path):
    """On the H100 a resident judge ended inside a contest and every timing after it was lost ("the
    judge ended without this timing's verdict"). An exception of the judge's own, or a worker that
    cannot be started, is now that timing's crash verdict, its traceback in the timing's stderr,
    and the next timing runs."""
    done = subprocess.run([sys.executable, "-c", SERIES_FAILING, str(tmp_path)], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    first, second = json.loads(done.stdout.strip().splitlines()[-1])
    assert first["status"] == "failed" and first["error_kind"] == "crash"
    assert "the judge's own bug" in first["error"] and first["ticket"] == "t1"
    assert "RuntimeError" in (tmp_path / "a-1" / "stderr.txt").read_text()
    assert second["stage"] == "benchmark" and second["error"] == "a verdict of its own" and second["ticket"] == "t2"


def test_a_worker_that_cannot_be_started_leaves_no_jail_behind(monkeypatch):
    """The resident judge now goes on after a worker fails to start; the jail made for it (its
    folder, its channel) must not pile up meanwhile."""
    from evaluator import isolation, remote

    roots = []

    def refuse(self, argv, pass_fds):
        roots.append(self.root)
        raise OSError("fork: resource temporarily unavailable")
    monkeypatch.setattr(isolation.Jail, "spawn", refuse)
    with pytest.raises(OSError, match="fork"):
        remote.Worker("cpu")
    assert roots and not roots[0].exists()


def test_a_spare_worker_started_after_each_verdict_runs_the_next(tiny_model, recompute_engine_path, recompute_source,
                                                                write_engine, tmp_path):
    """--spare-worker on: every verdict after the first runs in a worker the judge started when the
    previous verdict was written, one of its own (a failed engine's worker is not the next's), and
    none is left when the judge ends."""
    broken = write_engine(broken_source("raises_in_decode", recompute_source), "broken")
    s = settings(tiny_model, random.randrange(2**31), stress="off", spare_worker="on")
    before = children()
    with Judge(s, tmp_path / "judge") as judge:
        results = [judge.verdict(engine, tmp_path / f"v{i}", 600, s)
                   for i, engine in enumerate([recompute_engine_path, broken, recompute_engine_path])]
    assert [r.passed for r in results] == [True, False, True] and results[1].error_kind == "runtime_error"
    spare_used = ["the judge's spare" in (tmp_path / f"v{i}" / "stderr.txt").read_text() for i in range(3)]
    assert spare_used == [False, True, True]
    assert len({r.isolation for r in results}) == 3
    assert children() <= before


def test_a_spare_that_did_not_start_is_closed_and_the_verdict_starts_its_own():
    """A spare worker that died before its verdict (killed, out of memory) must not become that
    verdict's failure: `take_spare` hands out only a worker that said hello."""
    import argparse
    from evaluator import resident
    from evaluator.remote import WorkerDied

    class Dead:
        closed = False

        def ready(self):
            raise WorkerDied("the worker exited with code -9")

        def close(self):
            self.closed = True
    judge = resident.Resident(argparse.Namespace(device="cpu", memory_gb=None, triton_cache=None,
                                                 spare_worker="on"), {})
    judge.spare = dead = Dead()
    assert judge.take_spare() is None and dead.closed and judge.spare is None
