"""Screens ahead on a host's other GPUs (agent/screens.py, issue 26): the real loop with fake
judges, one a GPU, whose verdicts take time; the `--gpus` flag; a judge's place (GPU, CPUs)."""
from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, ContextManager

import pytest

from agent import cli, loop
from agent.judge import Judge, JudgeSettings, Place
from agent.plan import Plan
from agent.records import Candidate, EvalResult, SearchState
from agent.report import Reporter
from agent.screens import AHEAD
from agent.workspace import Workspace
from tests.test_loop import CONSERVATIVE, ListProposer, failed, fake_render, installed_key, passed

REPO = Path(__file__).resolve().parent.parent
SCREEN_SECONDS = 0.15   # a fake verdict's length: long enough for screens to overlap measurably


class Judges:
    """Fake judges, one a GPU: a verdict sleeps SCREEN_SECONDS and is looked up by plan key; every
    call is recorded as (gpu, plan key, phase, out dir, start, end)."""

    def __init__(self, verdicts: dict[str, EvalResult], broken: set[str] = frozenset(),
                 seconds: dict[str, float] | None = None):
        self.verdicts, self.broken, self.seconds = verdicts, broken, seconds or {}
        self.calls: list[tuple[str, str, str, Path, float, float]] = []
        self.asked: list[tuple[str, str]] = []   # (plan key, phase) as each verdict starts
        self.busy: dict[str, bool] = {}
        self.lock = threading.Lock()

    def on(self, gpu: str):
        def judge(engine: Path, out_dir: Path, timeout: float, phase: str) -> EvalResult:
            key = Plan.from_dict(json.loads((engine.parent / "plan.json").read_text())["plan"]).key()
            assert engine.read_text() == fake_render(Plan.from_dict(json.loads(key)))
            with self.lock:
                assert not self.busy.get(gpu), f"two verdicts at once on GPU {gpu}"
                self.busy[gpu] = True
                self.asked.append((key, phase))
            start = time.monotonic()
            time.sleep(self.seconds.get(gpu, SCREEN_SECONDS))
            with self.lock:
                self.busy[gpu] = False
                self.calls.append((gpu, key, phase, out_dir, start, time.monotonic()))
            if gpu != "0" and key in self.broken:
                raise OSError("the spare judge's folder went away")
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "result.json").write_text(json.dumps({"gpu": gpu}))
            full = self.verdicts.get(key, failed())
            if phase in (loop.FINAL, loop.STRESS) and full.passed:
                return replace(full, benchmark=[], score=None)
            return replace(full)
        return judge


def run(tmp_path: Path, monkeypatch, plans: list[Plan], verdicts: dict[str, EvalResult], gpus=("0", "1"),
        max_candidates: int | None = None, broken: set[str] = frozenset()):
    monkeypatch.setattr(loop, "render_engine", fake_render)
    judges = Judges(verdicts, broken)
    ws = Workspace(tmp_path / "ws")
    ws.reset()
    report = Reporter(ws.root, live=False)
    ws.open_history(warn=report.warn)
    state = SearchState(spec=None, device="cuda", hardware={})
    started = time.monotonic()
    loop.run(state, ListProposer(plans), judges.on(gpus[0]), ws, report, 600.0, max_candidates=max_candidates,
             spares={gpu: judges.on(gpu) for gpu in gpus[1:]})
    report.finish([])
    return ws, state, judges, time.monotonic() - started, report


def test_the_next_candidates_are_screened_on_the_other_gpus_while_the_first_judges(tmp_path, monkeypatch):
    plans = [Plan("paged", params={"x": i}) for i in range(9)]
    fast = random.sample(range(9), 3)   # fresh winners every run, anywhere in the order
    verdicts = {CONSERVATIVE: passed(1.0), **{p.key(): passed(2.0 + 3 * i) if i in fast else failed()
                                              for i, p in enumerate(plans)}}
    ws, state, judges, _, report = run(tmp_path, monkeypatch, plans, verdicts, gpus=("0", "1", "2"))
    keys = [c.key() for c, _ in state.history]
    assert keys[0] == CONSERVATIVE and sorted(keys[1:]) == sorted(p.key() for p in plans)   # each once
    spare = [c for c in judges.calls if c[0] != "0"]
    assert spare and {c[2] for c in spare} == {loop.TIMING}   # a spare GPU screens, and only screens
    assert all(c[3].parent.parent.name == AHEAD for c in spare)
    main = [c for c in judges.calls if c[0] == "0"]
    assert {c[2] for c in main} >= {loop.VERIFY, loop.FINAL}   # what decides is the first GPU's
    assert all(c[3].parent.parent.name != AHEAD for c in main)
    overlapped = [s for s in spare if any(m[4] < s[5] and s[4] < m[5] for m in main)]
    assert overlapped, "no screen ahead ran while the first GPU judged"
    best = max(fast)
    assert installed_key(ws) == plans[best].key()
    screens = [e.directory / loop.TIMING / "result.json" for e in report.entries[1:]]
    assert any(json.loads(s.read_text())["gpu"] != "0" for s in screens if s.is_file()), \
        "no candidate's folder holds the screen its spare GPU made"
    log = (ws.root / "results.log").read_text()
    assert "screening ahead on GPU 1" in log and "screen (ahead, GPU" in log


def test_max_candidates_holds_with_screens_ahead_and_what_was_not_reached_is_dropped(tmp_path, monkeypatch):
    plans = [Plan("paged", params={"x": i}) for i in range(6)]
    ws, state, judges, _, _ = run(tmp_path, monkeypatch, plans, {CONSERVATIVE: passed(1.0)}, max_candidates=3)
    assert len(state.history) == 3
    screened = {key for key, phase in judges.asked if phase == loop.TIMING}
    assert screened <= {c.key() for c, _ in state.history}   # nothing screened beyond what the run may judge


def test_a_spare_judge_that_breaks_leaves_the_candidate_to_the_first_gpu(tmp_path, monkeypatch):
    plans = [Plan("paged", params={"x": i}) for i in range(4)]
    verdicts = {CONSERVATIVE: passed(1.0), **{p.key(): passed(5.0 + i) for i, p in enumerate(plans)}}
    ws, state, judges, _, _ = run(tmp_path, monkeypatch, plans, verdicts, broken={p.key() for p in plans})
    assert [c.key() for c, _ in state.history][1:] == [p.key() for p in plans]
    for plan in plans:   # each was screened on the first GPU once the spare's screen broke
        assert any(c[0] == "0" and c[1] == plan.key() and c[2] == loop.TIMING for c in judges.calls)
    broke = [line for line in (ws.root / "results.log").read_text().splitlines() if "broke" in line]
    assert broke and all("OSError: the spare judge's folder went away" in line for line in broke), broke   # said why
    assert installed_key(ws) == plans[-1].key()


def test_gpus_on_a_cpu_is_one_line_and_exit_2(tmp_path, capsys):
    """(In this process: what `python3 -m agent` runs, cli.main, with its exit code and stderr.)"""
    assert cli.main(["--device", "cpu", "--gpus", "2", "--workspace", str(tmp_path / "ws")]) == cli.EXIT_BAD_INPUT
    assert capsys.readouterr().err.strip() == "error: --gpus 2 needs CUDA GPUs; the device is cpu"
    assert not (tmp_path / "ws").exists()
    with pytest.raises(SystemExit) as bad:
        cli.main(["--gpus", "0"])
    assert bad.value.code == 2 and "--gpus must be at least 1" in capsys.readouterr().err


def test_each_judge_gets_its_share_of_the_cpus():
    cpus = sorted(os.sched_getaffinity(0))
    shares = cli.places(("3", "5"))
    assert [(p.label, p.gpu) for p in shares] == [("0", "3"), ("1", "5")]
    if len(cpus) >= 2:
        assert not shares[0].cpus & shares[1].cpus and shares[0].cpus | shares[1].cpus == set(cpus)
    else:
        assert shares[0].cpus == shares[1].cpus == set(cpus)


def test_a_judge_runs_on_its_gpu_and_cpus(tmp_path, monkeypatch):
    """The evaluator process of a placed judge sees its GPU alone and runs on its CPUs (its workers
    inherit both): a stand-in for evaluator.resident writes what it was given."""
    seen = tmp_path / "seen.json"
    script = (f"import json, os; json.dump({{'gpu': os.environ.get('CUDA_VISIBLE_DEVICES'), "
              f"'cpus': sorted(os.sched_getaffinity(0))}}, open({str(seen)!r}, 'w'))")
    monkeypatch.setattr(JudgeSettings, "command", lambda self: [sys.executable, "-c", script])
    cpus = frozenset([min(os.sched_getaffinity(0))])
    settings = JudgeSettings(sys.executable, tmp_path / "c.json", tmp_path, "cuda", 0)
    with Judge(settings, tmp_path / "logs", Place("1", "7", cpus)) as judge:
        judge.send({}).wait(timeout=60)
    assert json.loads(seen.read_text()) == {"gpu": "7", "cpus": sorted(cpus)}


def test_the_builtin_walk_waits_for_the_library_plans_verdict_before_the_step_it_decides(tmp_path, monkeypatch):
    """The walk judges the faithful library plan only where the library plan was not kept: drawn
    ahead while the library plan's verdict was still to come, it was judged regardless (and its
    lineage built on; thirty-seventh session, 2 x H200)."""
    from agent import search
    from agent.plan import engine_params, menu
    from agent.providers.builtin import BuiltinProposer

    monkeypatch.setattr(loop, "render_engine", fake_render)
    start = search.default_plan("paged", engine_params("paged"))
    walk = search.walk(lambda: start, "cuda", menu(), engine_params("paged"), start)
    library, exact = next(walk)[0], next(walk)[0]
    assert library != exact   # the faithful plan follows where the library plan is not kept
    judges = Judges({CONSERVATIVE: passed(1.0), library.key(): passed(20.0)})
    ws = Workspace(tmp_path / "ws")
    ws.reset()
    report = Reporter(ws.root, live=False)
    ws.open_history(warn=report.warn)
    state = SearchState(spec=None, device="cuda", hardware={})
    loop.run(state, BuiltinProposer("cuda"), judges.on("0"), ws, report, 600.0, max_candidates=5,
             spares={"1": judges.on("1")})
    keys = [c.plan.key() for c, _ in state.history]
    assert library.key() in keys and exact.key() not in keys
    assert installed_key(ws) == library.key()


RESIDENT_STAND_IN = """
import json, os, sys
for line in sys.stdin:
    request = json.loads(line)
    out = os.path.join(request["out_dir"], "result.json")
    with open(out + ".tmp", "w") as f:
        json.dump({"ticket": request["ticket"], "status": "passed", "stage": "done", "note": str(os.getpid())}, f)
    os.replace(out + ".tmp", out)
"""


def test_a_spare_gpus_judge_lives_across_its_screens(tmp_path, monkeypatch):
    """One judge process a spare GPU for the run, as on the first GPU: a judge dies with the thread
    that started it (PR_SET_PDEATHSIG), and a thread a screen restarted it every time (~10 s)."""
    from agent.screens import ScreensAhead

    monkeypatch.setattr(JudgeSettings, "command", lambda self: [sys.executable, "-c", RESIDENT_STAND_IN])
    settings = JudgeSettings(sys.executable, tmp_path / "c.json", tmp_path, "cuda", 0)

    def prepare(candidate: Candidate, folder: Path) -> str:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "engine.py").write_text("# engine\n")
        return "# engine\n"
    with Judge(settings, tmp_path / "logs") as judge, \
            ScreensAhead({"1": lambda e, o, t, phase: judge.verdict(e, o, t, settings)}, tmp_path, prepare) as ahead:
        pids = []
        for i in range(3):
            ahead.start(Candidate(Plan("paged", params={"x": i}), "test", ""), 60)
            while (done := ahead.finished()) is None:
                ahead.wait()
            assert done.result.passed, done.result.error
            pids.append(done.result.note)
            time.sleep(0.3)   # the thread a screen had ended by now, and its judge with it
    assert len(set(pids)) == 1 and judge.starts == 1, pids


def test_a_workers_jail_covers_the_nodes_of_the_gpus_its_judge_was_not_given(tmp_path):
    """Which /dev/nvidiaN is whose comes from the driver's table, by UUID (a stand-in table here)."""
    from evaluator.isolation import gpus_not_given

    table, dev = tmp_path / "gpus", tmp_path / "dev"
    uuids = [f"GPU-{random.getrandbits(64):016x}-aaaa" for _ in range(3)]
    minors = random.sample(range(8), 3)   # device minors need not follow the UUIDs' order
    for uuid, minor in zip(uuids, minors):
        (table / f"0000:{minor:02x}:00.0").mkdir(parents=True)
        (table / f"0000:{minor:02x}:00.0" / "information").write_text(
            f"Model: \t\t NVIDIA H200\nIRQ:   \t\t 42\nGPU UUID: \t {uuid}\nDevice Minor: \t {minor}\n")
    dev.mkdir()
    for name in [f"nvidia{m}" for m in minors] + ["nvidiactl", "nvidia-uvm", "nvidia-caps"]:
        (dev / name).touch()
    nodes = lambda *ms: tuple(sorted(str(dev / f"nvidia{m}") for m in ms))  # noqa: E731
    assert gpus_not_given(uuids[1], table, dev) == nodes(minors[0], minors[2])
    assert gpus_not_given(f"{uuids[0].upper()},{uuids[2]}", table, dev) == nodes(minors[1])
    assert gpus_not_given("1", table, dev) == ()                      # by index: nothing to tell them by
    assert gpus_not_given("GPU-unknown", table, dev) == ()            # not in the table: hide nothing
    assert gpus_not_given("", table, dev) == ()


def builtin_run(tmp_path: Path, monkeypatch, proposer, verdicts: dict[str, EvalResult], seconds: dict[str, float],
                max_candidates: int = 5, budget: float = 600.0, parallel: int = 1, broken: set[str] = frozenset()):
    """The real loop with `proposer` on a fake first GPU and one fake spare (GPU 1)."""
    monkeypatch.setattr(loop, "render_engine", fake_render)
    judges = Judges(verdicts, broken, seconds)
    ws = Workspace(tmp_path / "ws")
    ws.reset()
    report = Reporter(ws.root, live=False)
    ws.open_history(warn=report.warn)
    state = SearchState(spec=None, device="cuda", hardware={})
    loop.run(state, proposer, judges.on("0"), ws, report, budget, max_candidates=max_candidates, parallel=parallel,
             spares={"1": judges.on("1")})
    report.finish([])
    return ws, state, judges


def library_plans():
    from agent import search
    from agent.plan import engine_params, menu

    start = search.default_plan("paged", engine_params("paged"))
    walk = search.walk(lambda: start, "cuda", menu(), engine_params("paged"), start)
    return next(walk)[0], next(walk)[0]


def test_a_screen_ahead_that_ends_just_after_the_loop_looked_is_still_taken(tmp_path, monkeypatch):
    """pick() asked `finished` (none yet), then `busy` (none any more: the screen had just ended):
    it then drew from the proposers as if nothing were screened ahead, and the builtin walk, whose
    next step waits for that screened candidate's verdict, had nothing: the run stopped there."""
    from agent.providers.builtin import BuiltinProposer
    from agent.screens import ScreensAhead

    library, _ = library_plans()
    finished = ScreensAhead.finished

    def late(self):   # the screen ahead ends between the loop's two looks
        done = finished(self)
        if done is None and not late.slept:
            late.slept = True
            time.sleep(1.0)
        return done
    late.slept = False
    monkeypatch.setattr(ScreensAhead, "finished", late)
    ws, state, judges = builtin_run(tmp_path, monkeypatch, BuiltinProposer("cuda"),
                                    {CONSERVATIVE: passed(1.0), library.key(): passed(20.0)}, {"0": 0.05, "1": 0.8})
    keys = [c.plan.key() for c, _ in state.history]
    assert library.key() in keys and len(keys) == 5, keys


def test_a_model_proposer_asked_in_turn_keeps_the_builtin_walk_while_it_waits_for_a_verdict(tmp_path, monkeypatch):
    """With --parallel 1 the LLM proposer takes turns with the builtin walk (LLMProposer.propose),
    and took a walk with nothing *now* (waiting for the library plan's verdict, screened ahead) for
    a walk with nothing *left*: the builtin side was done for the run after its first step."""
    from agent.providers import llm
    from agent.providers.budget import Usage
    from agent.providers.builtin import BuiltinProposer

    library, _ = library_plans()
    proposer = llm.LLMProposer(client=None, fallback=BuiltinProposer("cuda"), device="cuda", log=lambda line: None,
                               settings=llm.LLMSettings(model="m"), usage=Usage(), label="test")
    proposer.active = False   # the model side has stopped (a budget, a fatal error): the walk goes on alone
    ws, state, judges = builtin_run(tmp_path, monkeypatch, proposer,
                                    {CONSERVATIVE: passed(1.0), library.key(): passed(20.0)}, {})
    keys = [c.plan.key() for c, _ in state.history]
    assert library.key() in keys and len(keys) == 5, keys
    assert installed_key(ws) == library.key()


def test_a_broken_screen_ahead_is_not_started_again_on_the_first_gpu_past_the_budget(tmp_path, monkeypatch):
    """A candidate screened ahead skips the budget's 'not enough for another evaluation' stop (its
    screen is done); one whose screen ahead broke has no screen, and was screened on the first GPU
    however little of the budget was left."""
    plans = [Plan("paged", params={"x": i}) for i in range(3)]
    # 10.6 s of the budget left at the start (RESERVE_SECONDS kept): a screen ahead is started (an
    # evaluation is expected to take MIN_EVAL_SECONDS); the conservative's verdict takes 1 s of it
    ws, state, judges = builtin_run(tmp_path, monkeypatch, ListProposer(plans), {CONSERVATIVE: passed(1.0)},
                                    {"0": 1.0, "1": 0.05}, budget=loop.RESERVE_SECONDS + loop.MIN_EVAL_SECONDS + 0.6,
                                    broken={p.key() for p in plans})
    assert any(c[0] == "1" and c[1] == plans[0].key() for c in judges.calls)   # it was screened ahead, and broke
    assert [c.key() for c, _ in state.history] == [CONSERVATIVE]
    assert not any(c[0] == "0" and c[1] == plans[0].key() for c in judges.calls)
    assert "not enough for another evaluation; stopping" in (ws.root / "results.log").read_text()


@pytest.mark.parametrize("visible, uuids, expected", [(None, None, ("0", "2")),
                                                     ("2,0,1", ("a", "b", "c"), ("GPU-a", "GPU-c"))])
def test_gpus_asked_of_a_host_of_mixed_kinds_are_those_of_the_first_ones_kind(monkeypatch, visible, uuids, expected):
    """--gpus N takes N GPUs of the first one's kind, as the default takes them all: on a host whose
    GPU 1 is of another kind, `--gpus 2` refused although GPUs 0 and 2 were of one kind."""
    import torch

    names = ["NVIDIA H200", "NVIDIA L4", "NVIDIA H200"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(names))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: names[i])
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=uuids and uuids[i]))
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert cli.judged_gpus("cuda", None) == expected
    assert cli.judged_gpus("cuda", 2) == expected
    assert cli.judged_gpus("cuda", 1) == ()
    with pytest.raises(cli.SpecError, match="2 GPU"):   # of the first one's kind: H200
        cli.judged_gpus("cuda", 3)


def test_each_judge_gets_whole_cores_where_a_core_runs_two_threads(monkeypatch):
    """On a host with SMT, Linux numbers a core's second hardware thread half the CPUs further on
    (cpu i and i + n/2): shares cut in CPU order gave the second judge the second thread of every
    core the first judge's timed host thread runs on."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(cli, "core_of", lambda cpu: cpu % 4)   # cores 0-3, each cpu i and i + 4
    first, second = cli.places(("0", "1"))
    assert first.cpus == {0, 1, 4, 5} and second.cpus == {2, 3, 6, 7}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    monkeypatch.setattr(cli, "core_of", lambda cpu: cpu)
    first, second = cli.places(("0", "1"))   # cores that do not split evenly: the one more to the judge that decides
    assert first.cpus == {0, 1} and second.cpus == {2}


class ModelProposer(ListProposer):
    """Proposes its plans in order, each with a model-written variant's text."""

    def propose(self, state):
        return Candidate(self.plans.pop(0), "model", "written", extra_variants={("linear", "m"): "# m\n"}) \
            if self.plans else None


def test_no_score_others_are_compared_with_is_timed_while_a_unit_check_runs_model_code(tmp_path, monkeypatch):
    """A model episode's unit check runs model code on the judge's own host and GPU while the judge
    works, and that code can see a judge's worker in /proc: a variant that burned the CPUs while
    one lived halved the score timed beside it (red-team helper). VERIFY and FINAL wait for the
    checks under way, and no check starts until they end; a screen runs beside them."""
    from agent.providers import proposals
    spans: dict[str, tuple[float, float]] = {}

    def span(name: str, seconds: float) -> None:
        start = time.monotonic()
        time.sleep(seconds)
        spans[name] = (start, time.monotonic())

    def judge(engine, out_dir, timeout, phase):
        span(phase, 0.3)
        return passed(1.0)

    def check(name: str, after: float = 0.0) -> threading.Thread:
        def run() -> None:
            time.sleep(after)
            with proposals.UNIT_CHECKS.running():
                span(name, 0.3)
        thread = threading.Thread(target=run)
        thread.start()
        return thread

    recorded = loop.recorded_alone(judge, None, lambda: 60.0)
    first = check("check under way")
    time.sleep(0.05)
    second = check("check asked for meanwhile", after=0.1)
    recorded(Path("engine.py"), tmp_path, 10.0, loop.FINAL)
    third = check("check beside a screen")
    time.sleep(0.05)
    recorded(Path("engine.py"), tmp_path, 10.0, loop.TIMING)
    for thread in (first, second, third):
        thread.join()
    assert spans["check under way"][1] <= spans[loop.FINAL][0]
    assert spans[loop.FINAL][1] <= spans["check asked for meanwhile"][0]
    assert spans["check beside a screen"][0] < spans[loop.TIMING][0] < spans["check beside a screen"][1]

    class Held(Exception):
        pass

    def jail(device, memory_bytes=None):   # the unit check itself holds its place while its jail exists
        raise Held(proposals.UNIT_CHECKS.checks)
    monkeypatch.setattr(proposals, "Jail", jail)
    with pytest.raises(Held) as held:
        proposals.unit_check("norm", "", "cpu", 1.0, 0)
    assert held.value.args == (1,) and proposals.UNIT_CHECKS.checks == 0


def holding(gate: Callable[[], ContextManager], seconds: float) -> threading.Thread:
    """A thread inside `gate()` (UNIT_CHECKS.running or .held) for `seconds`, started and already in."""
    inside = threading.Event()

    def hold() -> None:
        with gate():
            inside.set()
            time.sleep(seconds)
    thread = threading.Thread(target=hold)
    thread.start()
    inside.wait()
    return thread


def test_the_wait_for_a_unit_check_is_spent_from_the_recorded_timings_budget(tmp_path):
    """A FINAL asked for with the budget's last seconds as its timeout, then kept waiting by a unit
    check under way (up to the check's timeout, minutes), is given only what is left after the
    wait: with its timeout as asked it had run past the budget's end."""
    from agent.providers import proposals
    given: list[float] = []

    def judge(engine, out_dir, timeout, phase):
        given.append(timeout)
        return passed(1.0)

    ends = time.monotonic() + 1.0
    thread = holding(proposals.UNIT_CHECKS.running, 0.5)   # a check under way
    loop.recorded_alone(judge, None, lambda: ends - time.monotonic())(Path("engine.py"), tmp_path,
                                                                     ends - time.monotonic(), loop.FINAL)
    thread.join()
    assert given and given[0] <= 0.55, given


def test_a_unit_checks_wait_for_a_recorded_timing_comes_out_of_its_timeout(tmp_path, monkeypatch):
    """A unit check asked for with the run's last seconds as its timeout, kept waiting by a FINAL,
    runs only what is left after the wait: given its whole timeout after it, it had run into the
    time kept for the final, which then waited for it in turn."""
    import subprocess

    from agent.providers import proposals
    given: list[float] = []

    class Worker:
        returncode = 0

        def wait(self, timeout):
            given.append(timeout)
            time.sleep(timeout)   # a unit check that does not end
            raise subprocess.TimeoutExpired("unit worker", timeout)

    class FakeJail:
        memory_bytes = None

        def __init__(self, device, memory_bytes=None):
            self.root = tmp_path

        def over_limits(self):
            return None

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

        def spawn(self, argv, pass_fds=()):
            return Worker()
    monkeypatch.setattr(proposals, "Jail", FakeJail)
    thread = holding(proposals.UNIT_CHECKS.held, 0.5)   # a recorded timing under way
    proposals.unit_check("norm", "", "cpu", 1.0, 0)
    thread.join()
    assert given and sum(given) <= 0.55, given   # the unit check's waits, watched in steps


def test_no_score_others_are_compared_with_is_timed_while_model_code_runs_on_another_gpu(tmp_path, monkeypatch):
    """A model's candidate screened ahead could slow the first GPU through what the host shares,
    and so lower the recorded score its own clear win would be measured against: VERIFY and
    FINAL wait until no model code is screened ahead."""
    monkeypatch.setattr(loop, "render_engine", fake_render)
    plans = [Plan("paged", params={"x": i}) for i in range(4)]
    verdicts = {CONSERVATIVE: passed(1.0), **{p.key(): passed(5.0 + 5 * i) for i, p in enumerate(plans)}}
    judges = Judges(verdicts, seconds={"1": 0.6})   # the spare's screens outlast the first GPU's verdicts
    ws = Workspace(tmp_path / "ws")
    ws.reset()
    report = Reporter(ws.root, live=False)
    ws.open_history(warn=report.warn)
    state = SearchState(spec=None, device="cuda", hardware={})
    loop.run(state, ModelProposer(plans), judges.on("0"), ws, report, 600.0, spares={"1": judges.on("1")})
    recorded = [c for c in judges.calls if c[0] == "0" and c[2] in (loop.VERIFY, loop.FINAL)]
    model = [c for c in judges.calls if c[0] == "1"]
    assert recorded and model
    assert not [(r[1:3], m[1]) for r in recorded for m in model if r[4] < m[5] and m[4] < r[5]]
    assert len(state.history) == 5 and installed_key(ws) == plans[-1].key()


def test_a_recorded_timing_interrupted_while_it_waits_for_a_check_holds_no_later_check_back(monkeypatch):
    """Ctrl-C while a VERIFY or FINAL waits for a unit check under way: the timing never runs, and
    no later check waits for it (it had left its count raised, and every later check blocked)."""
    from agent.providers import proposals
    checks = proposals.UnitChecks()

    def interrupted(predicate, timeout=None):
        raise KeyboardInterrupt
    with checks.running():
        monkeypatch.setattr(checks.cond, "wait_for", interrupted)
        with pytest.raises(KeyboardInterrupt), checks.held():
            pass
        monkeypatch.undo()
    assert checks.timings == 0
    with checks.running() as waited:
        assert waited < 1.0
