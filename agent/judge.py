"""A candidate through the evaluator, in its own process group, under a wall-clock limit.

The evaluator (`python3 -m evaluator.evaluate`, design.md §2) owns the verdict; the judge
only makes sure it cannot hang the agent or take it down: the child runs in a new session,
the whole group is killed on timeout or when the agent itself is interrupted, and a
timeout, a crash or a missing verdict become an EvalResult like any other failure.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, replace
from pathlib import Path

from agent.providers.base import EvalResult
from agent.workspace import atomic_write

REPO = Path(__file__).resolve().parent.parent
PR_SET_PDEATHSIG = 1            # prctl option (linux/prctl.h)
TERM_GRACE_SECONDS = 3.0        # between SIGTERM and SIGKILL of the evaluator's group
ERROR_TAIL_CHARS = 2000         # how much of stderr goes into a crash's error text
STDOUT, STDERR, RESULT = "stdout.txt", "stderr.txt", "result.json"
VERIFY, FULL = "verify", "full"   # phases: see agent/loop.py
VERIFY_CASES = "prefill"        # the cheapest benchmark case (the evaluator always runs one)


@dataclass(frozen=True)
class JudgeSettings:
    """Evaluator flags, the same for every candidate of a run so that scores compare."""

    python: str
    model_config: Path
    weight_dir: Path
    device: str
    seed: int
    stress: str = "quick"
    cases: str | None = None     # None: the evaluator's default cases
    warmup: int = 1
    repeat: int = 3

    def for_phase(self, phase: str) -> "JudgeSettings":
        """FULL: these settings. VERIFY: the public sequence and one short timing, the quickest
        verdict the evaluator gives (a verified conservative engine on disk before anything slow)."""
        if phase == FULL:
            return self
        return replace(self, stress="off", cases=VERIFY_CASES, warmup=0, repeat=1)

    def command(self, engine: Path, out: Path) -> list[str]:
        cmd = [self.python, "-m", "evaluator.evaluate", "--engine", str(engine),
               "--model-config", str(self.model_config), "--weight-dir", str(self.weight_dir),
               "--device", self.device, "--stress", self.stress, "--seed", str(self.seed),
               "--warmup", str(self.warmup), "--repeat", str(self.repeat), "--out", str(out)]
        if self.cases:
            cmd += ["--cases", self.cases]
        return cmd


def _die_with_parent() -> None:
    """In the evaluator, before exec (Linux): be SIGKILLed when the agent dies, even by SIGKILL,
    so a killed run leaves no evaluator behind writing into the next run's workspace."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the group kill on timeout/interrupt still applies
        pass


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the evaluator's whole process group, then SIGKILL whatever is left."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=TERM_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            pass
        os.killpg(proc.pid, signal.SIGKILL)  # also children that outlived the leader
    except ProcessLookupError:
        pass
    proc.wait()


def _tail(path: Path) -> str:
    try:
        text = path.read_text(errors="replace").strip()
    except OSError:
        return ""
    return text[-ERROR_TAIL_CHARS:]


def judge(engine: Path, out_dir: Path, timeout: float, settings: JudgeSettings) -> EvalResult:
    """Run the evaluator on `engine`, leaving stdout/stderr/result.json in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / RESULT
    out.unlink(missing_ok=True)
    start = time.monotonic()
    with open(out_dir / STDOUT, "wb") as so, open(out_dir / STDERR, "wb") as se:
        proc = subprocess.Popen(settings.command(engine, out), cwd=REPO, stdin=subprocess.DEVNULL,
                                stdout=so, stderr=se, start_new_session=True, preexec_fn=_die_with_parent)
        try:
            rc = proc.wait(timeout=max(timeout, 1.0))
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            seconds = time.monotonic() - start
            partial = _read(out)
            return _record(out, EvalResult.failure(
                partial.stage if partial else "unknown", "timeout",
                f"no verdict within {timeout:.0f}s; evaluator killed", settings.device, seconds))
        except BaseException:
            _kill_group(proc)  # the agent is being interrupted: take the evaluator down with it
            raise
    seconds = time.monotonic() - start
    result = _read(out)
    if result is None:
        return _record(out, EvalResult.failure("unknown", "crash", f"evaluator exited {rc} without a verdict: "
                                               f"{_tail(out_dir / STDERR) or '(no stderr)'}", settings.device, seconds))
    if result.passed and rc != 0:
        return _record(out, EvalResult.failure(result.stage, "crash", f"evaluator exited {rc} after a passing "
                                               f"verdict: {_tail(out_dir / STDERR)}", settings.device, seconds))
    result.seconds = seconds  # wall time, start-up included: what the budget actually pays
    return result


def _record(path: Path, result: EvalResult) -> EvalResult:
    """A verdict the judge made (timeout, crash) replaces whatever the evaluator left."""
    atomic_write(path, json.dumps(result.to_dict(), indent=2) + "\n")
    return result


def _read(path: Path) -> EvalResult | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return EvalResult.from_dict(data) if isinstance(data, dict) else None
