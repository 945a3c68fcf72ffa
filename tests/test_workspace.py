"""agent/workspace.py and agent/judge.py: atomic writes, the verdict record, and a judge that
survives a hanging, crashing or lying evaluator."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent import judge as judge_mod
from agent.judge import JudgeSettings, judge
from agent.workspace import PREVIOUS, RESULTS_LOG, TMP_PREFIX, Workspace, WorkspaceBusy, atomic_write
from evaluator.common import REPO_ROOT


def test_atomic_write_replaces_whole_files(tmp_path):
    path = tmp_path / "engine.py"
    atomic_write(path, "old\n")
    atomic_write(path, "new\n")
    assert path.read_text() == "new\n"
    assert [p.name for p in tmp_path.iterdir()] == ["engine.py"]


def test_failed_write_leaves_the_old_file_and_no_temp(tmp_path, monkeypatch):
    path = tmp_path / "engine.py"
    atomic_write(path, "passing engine\n")

    def boom(src, dst):
        raise OSError("disk full")
    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        atomic_write(path, "half")
    assert path.read_text() == "passing engine\n"
    assert [p.name for p in tmp_path.iterdir()] == ["engine.py"]


def test_reset_moves_the_last_run_aside_and_clears_kill_leftovers(tmp_path):
    """A new run starts from an empty workspace, the last run's engine, verdict, log and candidates
    kept as they were in previous/ (the run before that replaced): a second run had deleted the
    first's engine before it had a better one (a new-user walkthrough, thirty-third session)."""
    ws = Workspace(tmp_path)
    assert ws.reset() is None
    ws.install_engine("engine one\n", {"index": 1, "result": {"status": "passed"}})
    (ws.root / RESULTS_LOG).write_text("run one\n")
    (ws.root / f"{TMP_PREFIX}engine.py.abc").write_text("half")
    (ws.candidate_dir(1, "recompute") / "engine.py").write_text("x")
    assert "previous" in ws.reset()
    assert not ws.engine.exists() and ws.installed_verdict() is None
    assert list((ws.root / "candidates").iterdir()) == []
    assert not list(ws.root.glob(TMP_PREFIX + "*"))
    assert Workspace(ws.root / PREVIOUS).installed_verdict()["index"] == 1
    assert (ws.root / PREVIOUS / RESULTS_LOG).read_text() == "run one\n"
    assert (ws.root / PREVIOUS / "candidates" / "001-recompute" / "engine.py").exists()
    ws.install_engine("engine two\n", {"index": 2})
    ws.reset()
    assert Workspace(ws.root / PREVIOUS).installed_verdict()["index"] == 2   # the run before that: replaced
    assert sorted(p.name for p in ws.root.iterdir()) == ["candidates", PREVIOUS]
    (ws.root / RESULTS_LOG).write_text("a run stopped before its first engine\n")
    ws.reset()
    ws.reset()   # two runs stopped early in a row: the last engine stays in previous/
    assert Workspace(ws.root / PREVIOUS).installed_verdict()["index"] == 2
    assert not (ws.root / RESULTS_LOG).exists()


def test_a_reset_cut_by_a_kill_is_finished_by_the_next(tmp_path, monkeypatch):
    ws = Workspace(tmp_path)
    ws.reset()
    ws.install_engine("engine one\n", {"index": 1})
    (ws.root / RESULTS_LOG).write_text("run one\n")
    real, moves = os.replace, []

    def killed_on_the_third_move(src, dst):
        moves.append(src)
        if len(moves) == 3:
            raise KeyboardInterrupt
        real(src, dst)
    monkeypatch.setattr(os, "replace", killed_on_the_third_move)
    with pytest.raises(KeyboardInterrupt):
        ws.reset()
    monkeypatch.setattr(os, "replace", real)
    ws.reset()
    assert Workspace(ws.root / PREVIOUS).installed_verdict()["index"] == 1
    assert (ws.root / PREVIOUS / RESULTS_LOG).read_text() == "run one\n"


def test_a_second_run_on_a_held_workspace_is_refused(tmp_path):
    """Two runs on one workspace interleaved their engines and logs (a new-user walkthrough): the
    run holds a lock while it lasts, and a second one gets a line naming the holder."""
    ws = Workspace(tmp_path / "ws")
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom agent.workspace import Workspace\n"
                               "with Workspace(sys.argv[1]).locked():\n    print('held', flush=True)\n"
                               "    time.sleep(30)", str(ws.root)], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(WorkspaceBusy, match=rf"another run is using the workspace .*\(pid {holder.pid}\)"):
            with ws.locked():
                pass
    finally:
        holder.kill()
        holder.wait()
    with ws.locked():   # free again once its holder is gone
        with pytest.raises(WorkspaceBusy):
            with Workspace(ws.root).locked():
                pass


def test_verdict_must_match_the_engine_on_disk(tmp_path):
    ws = Workspace(tmp_path)
    ws.reset()
    ws.install_engine("engine one\n", {"index": 1})
    assert ws.installed_verdict()["index"] == 1
    ws.engine.write_text("edited by hand\n")
    assert ws.installed_verdict() is None


def test_candidate_dirs_are_numbered_and_safe(tmp_path):
    ws = Workspace(tmp_path)
    ws.reset()
    d = ws.candidate_dir(7, "paged norm=triton block_size=32 / ../x")
    assert d.parent == ws.root / "candidates" and d.name.startswith("007-paged-norm-triton-block")


# --- the judge, against stand-in evaluators --------------------------------------------

FAKE_EVALUATORS = {
    "passes": "put({'status': 'passed', 'stage': 'done', 'score': 0.5, 'benchmark': []})",
    "hangs": "import subprocess; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)",
    "sleeps": "time.sleep(60)",
    "crashes": "sys.stderr.write('Traceback: engine segfaulted\\n'); sys.exit(-11 % 256)",
    "fails": "put({'status': 'failed', 'stage': 'public', 'error_kind': 'wrong_result', 'error': 'max abs err 0.3'})",
}


def fake_evaluator(tmp_path: Path, behaviour: str) -> JudgeSettings:
    """Settings whose `python` is a script acting as the run's judge (`python -m evaluator.resident`):
    a request a line on stdin, its verdict (with the request's ticket) written atomically to
    OUT_DIR/result.json."""
    script = tmp_path / "fake_python"
    script.write_text(f"#!{sys.executable}\nimport json, os, sys, time\n"
                      "def put(verdict):\n    verdict['ticket'] = request['ticket']\n"
                      "    json.dump(verdict, open(out + '.tmp', 'w')); os.replace(out + '.tmp', out)\n"
                      "for line in sys.stdin:\n    request = json.loads(line)\n"
                      "    out = os.path.join(request['out_dir'], 'result.json')\n"
                      f"    {FAKE_EVALUATORS[behaviour]}\n")
    script.chmod(0o755)
    return JudgeSettings(str(script), tmp_path / "c.json", tmp_path / "w", "cpu", 0)


@pytest.mark.parametrize("behaviour,status,kind", [("passes", "passed", None), ("crashes", "failed", "crash"),
                                                   ("fails", "failed", "wrong_result")])
def test_judge_maps_outcomes(tmp_path, behaviour, status, kind):
    result = judge(tmp_path / "engine.py", tmp_path, 30.0, fake_evaluator(tmp_path, behaviour))
    assert (result.status, result.error_kind) == (status, kind)
    if behaviour == "crashes":
        assert "segfaulted" in result.error
    assert json.loads((tmp_path / "result.json").read_text())["status"] == status


def test_judge_kills_a_hanging_evaluator_and_its_children(tmp_path, monkeypatch):
    monkeypatch.setattr(judge_mod, "TERM_GRACE_SECONDS", 0.5)
    start = time.monotonic()
    result = judge(tmp_path / "engine.py", tmp_path, 2.0, fake_evaluator(tmp_path, "hangs"))
    assert time.monotonic() - start < 30   # killed after its 2 s, not after the 60 s it sleeps
    assert (result.status, result.error_kind) == ("failed", "timeout")
    assert json.loads((tmp_path / "result.json").read_text())["error_kind"] == "timeout"
    time.sleep(0.2)
    leftovers = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _is_sleeper(p)]
    assert not leftovers


def test_evaluator_dies_with_a_killed_agent(tmp_path):
    settings = fake_evaluator(tmp_path, "sleeps")
    agent = subprocess.Popen([sys.executable, "-c", (
        "import sys; from pathlib import Path; from agent.judge import JudgeSettings, judge; "
        f"judge(Path('e.py'), Path({str(tmp_path)!r}), 60.0, JudgeSettings({settings.python!r}, Path('c'), "
        "Path('w'), 'cpu', 0))")], cwd=judge_mod.REPO)
    deadline = time.monotonic() + 30
    while not _evaluators(settings.python) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _evaluators(settings.python), "the fake evaluator never started"
    agent.kill()
    agent.wait()
    deadline = time.monotonic() + 5
    while _evaluators(settings.python) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _evaluators(settings.python)


def _evaluators(script: str) -> list[Path]:
    out = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
            if proc.name.isdigit() and (proc / "stat").read_text().split()[2] != "Z" and argv[1:2] == [script]:
                out.append(proc)
        except (OSError, IndexError):
            continue
    return out


def _is_sleeper(proc: Path) -> bool:
    try:
        return "time.sleep(60)" in (proc / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


def test_a_workspace_whose_filesystem_has_no_locks_is_used_with_a_warning(tmp_path, monkeypatch):
    import errno
    import fcntl

    def no_locks(*_):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(fcntl, "flock", no_locks)
    ws, warned = Workspace(tmp_path), []
    ws.warn = warned.append
    with ws.locked():
        pass
    assert len(warned) == 1 and "cannot be locked" in warned[0]
