"""End to end through `bash run.sh` on a tiny model, CPU, real evaluator and templates:
interrupted mid-run it leaves a passing engine; re-run, it finishes with the conservative
engine and a KV-cache engine, both with numbers, in the log, and the engine passes the
public check."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_spec import REPO, TINY_CONFIG, write_model

# Big enough that a KV cache matters on a CPU (recompute re-runs ~40 tokens per request per
# decode step), small enough that every evaluation takes seconds.
SMALL_CONFIG = {**TINY_CONFIG, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
                "head_dim": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024}
# Generous on purpose: no verdict here may depend on how fast (or how loaded) the machine is. The
# interrupted run is stopped once its first engine is in; the re-run stops after its second
# candidate (--max-candidates), so neither waits for the budget. (That the budget holds is
# test_reliability_runs.py's business.)
BUDGET_SECONDS = 900
WAIT_SECONDS = 600          # for the first engine of the interrupted run; reached only on failure
RERUN_CANDIDATES = 2        # the conservative engine and the KV-cache engine


def run_sh(tmp_path: Path, *args: str, **popen) -> subprocess.Popen:
    config, weights = write_model(tmp_path / "model", SMALL_CONFIG) if not (tmp_path / "model").exists() else \
        (tmp_path / "model" / "config.json", tmp_path / "model" / "weights")
    cmd = ["bash", str(REPO / "run.sh"), "--config", str(config), "--weights", str(weights), "--device", "cpu",
           "--workspace", str(tmp_path / "ws"), "--seed", "1", *args]
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **popen)


def public_check(tmp_path: Path) -> dict:
    done = subprocess.run([sys.executable, str(REPO / "evaluator" / "test_correctness.py"),
                           "--engine", str(tmp_path / "ws" / "engine.py"),
                           "--model-config", str(tmp_path / "model" / "config.json"),
                           "--weight-dir", str(tmp_path / "model" / "weights"), "--device", "cpu"],
                          capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout[done.stdout.index("{"):])


def evaluators_running(workspace: Path) -> list[int]:
    """Processes of this run: its workspace on their command line (the agent), or their output
    going into it (the run's judge, whose stdout/stderr are the workspace's judge logs)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit():
                continue
            outputs = [os.readlink(proc / "fd" / fd) for fd in ("1", "2") if (proc / "fd" / fd).exists()]
            if any(str(workspace) in text for text in [(proc / "cmdline").read_bytes().decode(errors="replace"),
                                                       *outputs]):
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def test_bad_input_through_run_sh(tmp_path):
    write_model(tmp_path / "model")
    (tmp_path / "model" / "weights" / "model.pt").unlink()
    proc = run_sh(tmp_path)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert err.strip().splitlines()[-1].startswith("error: missing weights file")
    assert not (tmp_path / "ws" / "engine.py").exists()


def test_relative_paths_on_run_shs_command_line_are_the_callers(tmp_path):
    """run.sh runs Python from the repository, yet a relative --config, --weights or --workspace
    means what it means in the caller's shell (a new-user sweep, thirty-fifth session: they were
    read from the repository, and a relative workspace was written inside it)."""
    write_model(tmp_path / "model")
    (tmp_path / "model" / "weights" / "model.pt").unlink()
    proc = subprocess.run(["bash", str(REPO / "run.sh"), "--config", "model/config.json", "--weights", "model/weights",
                           "--device", "cpu", "--workspace", "ws-relative"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: missing weights file") and str(tmp_path / "model" / "weights") in last, last


@pytest.mark.slow
def test_interrupt_then_rerun(tmp_path):
    # 1. Interrupted once the conservative engine is on disk, while later evaluations run.
    proc = run_sh(tmp_path, "--budget", str(BUDGET_SECONDS))
    log = tmp_path / "ws" / "results.log"
    deadline = time.monotonic() + WAIT_SECONDS
    while time.monotonic() < deadline and proc.poll() is None:
        if log.exists() and "ACCEPTED" in log.read_text():
            break
        time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail(f"no engine accepted within {WAIT_SECONDS}s:\n{log.read_text() if log.exists() else ''}")
    time.sleep(2)
    os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    verdict = json.loads((tmp_path / "ws" / "engine.json").read_text())
    assert verdict["plan"]["engine"] == "recompute" and verdict["result"]["status"] == "passed"
    assert public_check(tmp_path)["status"] == "passed"
    time.sleep(1)
    assert not evaluators_running(tmp_path / "ws"), "the evaluator outlived the interrupted agent"

    # 2. Re-run (from scratch: no --resume) until its second candidate is judged.
    proc = run_sh(tmp_path, "--budget", str(BUDGET_SECONDS), "--max-candidates", str(RERUN_CANDIDATES))
    out, err = proc.communicate(timeout=BUDGET_SECONDS * 2)
    text = log.read_text()
    assert proc.returncode == 0, text + err[-2000:]
    assert f"{RERUN_CANDIDATES} candidates judged, the most asked for" in text, text
    assert public_check(tmp_path)["status"] == "passed"
    results = json.loads((tmp_path / "ws" / "results.json").read_text())
    first, *rest = results["candidates"]
    assert first["plan"]["engine"] == "recompute" and first["result"]["status"] == "passed"
    paged = [c for c in rest if c["plan"]["engine"] == "paged" and c["result"]["status"] == "passed"]
    assert paged, text
    assert paged[0]["result"]["benchmark"] and paged[0]["result"]["score"] > 0
    assert "#001 recompute" in text and "#002 paged" in text and "tok/s" in text and "summary" in text
    # Keep-the-best, as recorded: the installed engine is the first of the highest-ranked passes.
    # (Which engine that is depends on the machine's timing noise, so it is not asserted.)
    best = json.loads((tmp_path / "ws" / "engine.json").read_text())
    assert best["index"] == results["best"] and results["candidates"][best["index"] - 1]["accepted"]
    folder = tmp_path / "ws" / results["candidates"][1]["dir"]
    for name in ("engine.py", "plan.json", "result.json"):
        assert (folder / name).exists(), name
    for name in ("stdout.txt", "stderr.txt"):   # beside the verdict of each phase it went through
        assert list(folder.rglob(name)), name
