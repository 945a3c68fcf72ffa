"""A candidate through the evaluator, in its own process group, under a wall-clock limit.

The evaluator (`python3 -m evaluator.evaluate`, design.md §2) owns the verdict and runs the
candidate in a confined worker of its own (evaluator/isolation.py), capped at `memory_bytes`.
This module only makes sure the evaluation cannot hang the agent or take it down: the
evaluator runs in a new session without the agent's API keys, the whole group is killed on
timeout, when it prints without end, or when the agent itself is interrupted, and a timeout, a
crash or a missing verdict become an EvalResult like any other failure. The agent is a child
subreaper: a worker orphaned by a killed evaluator is re-parented to it and killed here.
Output goes to files, of which the agent reads only a bounded tail and keeps a bounded tail.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from agent.records import EvalResult
from agent.workspace import VARIANTS, atomic_write
from evaluator.isolation import protect_judge
from evaluator.sweep import children, forget_child, kill_new_children, start_child

REPO = Path(__file__).resolve().parent.parent
PR_SET_PDEATHSIG = 1            # prctl option (linux/prctl.h)
TERM_GRACE_SECONDS = 3.0        # between SIGTERM and SIGKILL of the evaluator's group
ERROR_TAIL_CHARS = 2000         # how much of stderr goes into a crash's error text
POLL_SECONDS = 0.2              # how often the judge looks at the running evaluator
MEMORY_FRACTION = 0.8           # of physical memory: the worker's cap (the agent needs the rest)
SECRET_SUFFIXES = ("_API_KEY", "_TOKEN", "_SECRET")
OUTPUT_CAP_BYTES = 256 * 2**20  # stdout + stderr of one evaluation; past this it is killed
KEPT_OUTPUT_BYTES = 2**20       # the tail of each output file kept on disk afterwards
STDOUT, STDERR, RESULT = "stdout.txt", "stderr.txt", "result.json"
# Phases (agent/loop.py): VERIFY the conservative engine's quickest verdict; TIMING the public
# sequence and the run's benchmark, no stress (the conservative engine's timing, a challenger's
# screen and the back-to-back rounds, agent/acceptance.py); FINAL a finalist's stress suite (its
# long cases) with the public sequence and the profiled pass, no benchmark: its screen timed this
# very engine, and the loop joins the two into the verdict it installs; STRESS the same without
# the profiled pass (the conservative engine's, when it stays the result). The full stress (45
# cases) takes minutes on a GPU too (docs/benchmarks.md, twelfth session): the self-test
# commands results.log prints run it on the engine a run leaves.
VERIFY, TIMING, FINAL, STRESS = "verify", "timing", "final", "stress"
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
    memory_bytes: int = field(default_factory=lambda: default_memory_cap())   # the worker's cap
    bandwidth_gbs: float | None = None   # the floor's hardware, measured once per run;
    peak_tflops: float | None = None     # None: each evaluation measures its own
    triton_cache: Path | None = None   # the run's shared Triton cache (evaluator/triton_cache.py), judge-owned
    profile: bool = False        # a passing engine's profiled pass (slot_ms, for the model's prompts)
    benchmark: bool = True       # False: public sequence and stress only (no score)

    def for_phase(self, phase: str) -> "JudgeSettings":
        """The settings of one phase (see VERIFY, TIMING, FINAL, STRESS); every timed phase but
        VERIFY has the same cases, warm-up and repeats, so their scores compare."""
        if phase == FINAL:   # the profiled pass: once per engine that becomes the best
            return replace(self, benchmark=False)
        if phase == STRESS:  # the conservative engine: no slots to profile
            return replace(self, benchmark=False, profile=False)
        if phase == TIMING:
            return replace(self, stress="off", profile=False)
        if phase == VERIFY:
            return replace(self, stress="off", cases=VERIFY_CASES, warmup=0, repeat=1, profile=False)
        raise ValueError(f"unknown judge phase {phase!r}")

    def command(self, engine: Path, out: Path) -> list[str]:
        """The evaluator's command line. Every worker reads a copy of the shared Triton cache; only
        an engine with no model-written variant (its candidate folder has no VARIANTS) adds to it."""
        cmd = [self.python, "-m", "evaluator.evaluate", "--engine", str(engine),
               "--model-config", str(self.model_config), "--weight-dir", str(self.weight_dir),
               "--device", self.device, "--stress", self.stress, "--seed", str(self.seed),
               "--warmup", str(self.warmup), "--repeat", str(self.repeat), "--out", str(out),
               "--memory-gb", f"{self.memory_bytes / 2**30:.6f}"]
        if self.cases:
            cmd += ["--cases", self.cases]
        if self.profile:
            cmd.append("--profile")
        if not self.benchmark:
            cmd.append("--no-benchmark")
        if self.bandwidth_gbs and self.peak_tflops:
            cmd += ["--bandwidth-gbs", str(self.bandwidth_gbs), "--peak-tflops", str(self.peak_tflops)]
        if self.triton_cache is not None:
            cmd += ["--triton-cache", str(self.triton_cache)]
            if not (engine.parent / VARIANTS).exists():
                cmd.append("--triton-cache-update")
        return cmd


def default_memory_cap() -> int:
    """MEMORY_FRACTION of this machine's physical memory, in bytes."""
    return int(MEMORY_FRACTION * os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def _die_with_parent() -> None:
    """In the evaluator, before exec (Linux): be SIGKILLed when the agent dies, even by SIGKILL,
    so a killed run leaves no evaluator behind writing into the next run's workspace."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the group kill on timeout/interrupt still applies
        pass


def _evaluator_env() -> dict[str, str]:
    """The agent's environment without its secrets (the evaluator needs no API key)."""
    return {k: v for k, v in os.environ.items() if not k.upper().endswith(SECRET_SUFFIXES)}


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


def _tail(path: Path, limit: int = ERROR_TAIL_CHARS) -> str:
    """The last `limit` bytes of a file, read from the end (the file may be huge)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(f.seek(0, os.SEEK_END) - limit, 0))
            return f.read().decode(errors="replace").strip()
    except OSError:
        return ""


def _keep_tail(path: Path) -> None:
    """Cut an output file down to its last KEPT_OUTPUT_BYTES, saying so on its first line."""
    try:
        size = path.stat().st_size
        if size <= KEPT_OUTPUT_BYTES:
            return
        with open(path, "rb") as f:
            f.seek(size - KEPT_OUTPUT_BYTES)
            tail = f.read()
        atomic_write(path, f"[judge: the first {size - KEPT_OUTPUT_BYTES} of {size} bytes were cut]\n"
                     + tail.decode(errors="replace"))
    except OSError:
        pass


def _watch(proc: subprocess.Popen, deadline: float, settings: JudgeSettings, outputs: list[Path]) -> str | None:
    """Wait for the evaluator; None once it exited, else why it must be killed."""
    while True:
        try:
            proc.wait(timeout=max(min(POLL_SECONDS, deadline - time.monotonic()), 0.01))
            return None
        except subprocess.TimeoutExpired:
            pass
        if time.monotonic() >= deadline:
            return "timeout"
        written = sum(p.stat().st_size for p in outputs if p.exists())
        if written > OUTPUT_CAP_BYTES:
            return f"it printed more than {OUTPUT_CAP_BYTES // 2**20} MiB"


def judge(engine: Path, out_dir: Path, timeout: float, settings: JudgeSettings) -> EvalResult:
    """Run the evaluator on `engine`, leaving stdout/stderr/result.json in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / RESULT
    out.unlink(missing_ok=True)
    start = time.monotonic()
    outputs = [out_dir / STDOUT, out_dir / STDERR]
    protect_judge()
    before = children()
    with open(outputs[0], "wb") as so, open(outputs[1], "wb") as se:
        proc = start_child(lambda: subprocess.Popen(
            settings.command(engine, out), cwd=REPO, stdin=subprocess.DEVNULL, stdout=so, stderr=se,
            start_new_session=True, preexec_fn=_die_with_parent, env=_evaluator_env()))
        try:
            killed_because = _watch(proc, start + max(timeout, 1.0), settings, outputs)
        except BaseException:
            _kill_group(proc)  # the agent is being interrupted: take the evaluator down with it
            forget_child(proc.pid)
            kill_new_children(before)
            raise
        if killed_because is not None:
            _kill_group(proc)
    forget_child(proc.pid)
    kill_new_children(before)   # a worker whose evaluator was killed
    for path in outputs:
        _keep_tail(path)
    seconds = time.monotonic() - start
    if killed_because is not None:
        partial = _read(out)
        kind, why = ("timeout", f"no verdict within {timeout:.0f}s") if killed_because == "timeout" else \
            ("crash", killed_because)
        return _record(out, EvalResult.failure(partial.stage if partial else "unknown", kind,
                                               f"{why}; evaluator killed", settings.device, seconds))
    rc = proc.returncode
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
