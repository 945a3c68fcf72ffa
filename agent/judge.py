"""A candidate through the evaluator, in its own process group, under a wall-clock limit.

The evaluator (`python3 -m evaluator.evaluate`, design.md §2) owns the verdict and runs the
candidate in a confined worker of its own (evaluator/isolation.py), capped at `memory_bytes`.
This module only makes sure the evaluation cannot hang the agent or take it down: the
evaluator runs in a new session without the agent's API keys, the whole group is killed on
timeout, when it prints without end, or when the agent itself is interrupted, and a timeout, a
crash or a missing verdict become an EvalResult like any other failure. The agent is a child
subreaper: a worker orphaned by a killed evaluator is re-parented to it and killed here.
Output goes to files, of which the agent reads only a bounded tail and keeps a bounded tail.

`Series` runs a contest's repeated timings the same way, in one evaluator process for all of
them (`python3 -m evaluator.series`, each timing in a fresh worker of its own), and hands each
verdict over as soon as it is written; closing it stops the timings nobody asked for.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from agent.records import EvalResult
from agent.workspace import VARIANTS, atomic_write
from evaluator.isolation import protect_judge
from evaluator.sweep import children, forget_child, kill_new_children, start_child
from evaluator.traces import PUBLIC_CASES

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
SERIES_LOGS = "series"          # a Series' stdout/stderr, under its folder (its verdicts: LABEL/result.json)
# Phases (agent/loop.py): VERIFY the conservative engine's one verdict before its stress: the
# public sequence and the benchmark on one case only (`JudgeSettings.conservative_case`), at the
# run's warm-up and repeats, so that its score compares case for case with every other engine's
# (agent/acceptance.py pairs the cases both timed); TIMING the public sequence and the run's
# benchmark, no stress (a challenger's screen and the back-to-back rounds); FINAL a finalist's
# stress suite (its long cases) with the public sequence and the profiled pass, no benchmark: its
# screen timed this very engine, and the loop joins the two into the verdict it installs; STRESS
# the same without the profiled pass (the conservative engine's, when it stays the result). The
# full stress (45 cases) takes minutes on a GPU too (docs/benchmarks.md, twelfth session): the
# self-test commands results.log prints run it on the engine a run leaves.
VERIFY, TIMING, FINAL, STRESS = "verify", "timing", "final", "stress"
# The conservative engine's one timed case. It recomputes every request from its first token, one
# request at a time, so a case costs it one whole forward pass per request and step: prefill 4,
# mixed 40, decode and decode128 136 each (its full timing was 44 s of benchmark on the H100 for a
# score of 0.001). Mixed is the cheapest case that still compares: it has decode steps, where a
# KV cache is the whole gain; on prefill alone the recompute engine does a batched engine's work
# (on a CPU a batched engine's prefill can be the slower, docs/benchmarks.md), so a challenger
# many times faster could be screened out there. Every default case list holds it.
CONSERVATIVE_CASE = "mixed"


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
        """The settings of one phase (see VERIFY, TIMING, FINAL, STRESS); every timed phase has
        the same warm-up and repeats, and VERIFY's one case is one of TIMING's, so their scores
        compare case for case."""
        if phase == FINAL:   # the profiled pass: once per engine that becomes the best
            return replace(self, benchmark=False)
        if phase == STRESS:  # the conservative engine: no slots to profile
            return replace(self, benchmark=False, profile=False)
        if phase == TIMING:
            return replace(self, stress="off", profile=False)
        if phase == VERIFY:
            return replace(self, stress="off", cases=self.conservative_case(), profile=False)
        raise ValueError(f"unknown judge phase {phase!r}")

    def conservative_case(self) -> str:
        """CONSERVATIVE_CASE where the run times it; else the first of the run's cases, the one
        case the conservative engine's timing then has in common with every other engine's."""
        cases = self.cases.split(",") if self.cases else list(PUBLIC_CASES)
        return CONSERVATIVE_CASE if CONSERVATIVE_CASE in cases else cases[0]

    def _model_and_timing_flags(self) -> list[str]:
        """What evaluator.evaluate and evaluator.series both take (evaluator/evaluate.py
        add_timing_flags): the model, the device, the seed, the timing, the worker's cap and cache."""
        flags = ["--model-config", str(self.model_config), "--weight-dir", str(self.weight_dir),
                 "--device", self.device, "--seed", str(self.seed), "--warmup", str(self.warmup),
                 "--repeat", str(self.repeat), "--memory-gb", f"{self.memory_bytes / 2**30:.6f}"]
        if self.cases:
            flags += ["--cases", self.cases]
        if self.bandwidth_gbs and self.peak_tflops:
            flags += ["--bandwidth-gbs", str(self.bandwidth_gbs), "--peak-tflops", str(self.peak_tflops)]
        if self.triton_cache is not None:
            flags += ["--triton-cache", str(self.triton_cache)]
        return flags

    def series_command(self, timings: list[tuple[str, Path]], out_dir: Path) -> list[str]:
        """evaluator.series' command line: the TIMING phase's settings, for each (label, engine)."""
        t = self.for_phase(TIMING)
        cmd = [t.python, "-m", "evaluator.series", "--out-dir", str(out_dir), *t._model_and_timing_flags()]
        for label, engine in timings:
            cmd += ["--timing", f"{label}={engine}"]
        return cmd

    def command(self, engine: Path, out: Path) -> list[str]:
        """The evaluator's command line. Every worker reads a copy of the shared Triton cache; only
        an engine with no model-written variant (its candidate folder has no VARIANTS) adds to it."""
        cmd = [self.python, "-m", "evaluator.evaluate", "--engine", str(engine), "--out", str(out),
               "--stress", self.stress, *self._model_and_timing_flags()]
        if self.profile:
            cmd.append("--profile")
        if not self.benchmark:
            cmd.append("--no-benchmark")
        if self.triton_cache is not None and not (engine.parent / VARIANTS).exists():
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


class _Evaluator:
    """An evaluator process as the agent runs one: its own session, without the agent's secrets,
    killed with the agent, registered (evaluator/sweep.py) so that no jail's sweep takes it, its
    output in files (capped), and everything it left behind killed when it is done."""

    def __init__(self, command: list[str], out_dir: Path):
        self.outputs = [out_dir / STDOUT, out_dir / STDERR]
        protect_judge()
        self.before = children()
        with open(self.outputs[0], "wb") as so, open(self.outputs[1], "wb") as se:
            self.proc = start_child(lambda: subprocess.Popen(
                command, cwd=REPO, stdin=subprocess.DEVNULL, stdout=so, stderr=se,
                start_new_session=True, preexec_fn=_die_with_parent, env=_evaluator_env()))
        self.done = False

    def watch(self, deadline: float, ready: Callable[[], bool] = lambda: False) -> str | None:
        """Wait until it exits or `ready()`: None; else why it must be killed (it is not yet).
        The agent being interrupted meanwhile takes it down."""
        try:
            while True:
                try:
                    self.proc.wait(timeout=max(min(POLL_SECONDS, deadline - time.monotonic()), 0.01))
                    return None
                except subprocess.TimeoutExpired:
                    pass
                if ready():
                    return None
                if time.monotonic() >= deadline:
                    return "timeout"
                written = sum(p.stat().st_size for p in self.outputs if p.exists())
                if written > OUTPUT_CAP_BYTES:
                    return f"it printed more than {OUTPUT_CAP_BYTES // 2**20} MiB"
        except BaseException:
            self.finish(kill=True)
            raise

    def finish(self, kill: bool) -> None:
        """Kill its group first if `kill` (or if it still runs), then what it left behind."""
        if self.done:
            return
        self.done = True
        if kill or self.proc.poll() is None:
            _kill_group(self.proc)
        forget_child(self.proc.pid)
        kill_new_children(self.before)   # a worker whose evaluator was killed
        for path in self.outputs:
            _keep_tail(path)


def judge(engine: Path, out_dir: Path, timeout: float, settings: JudgeSettings) -> EvalResult:
    """Run the evaluator on `engine`, leaving stdout/stderr/result.json in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / RESULT
    out.unlink(missing_ok=True)
    start = time.monotonic()
    running = _Evaluator(settings.command(engine, out), out_dir)
    killed_because = running.watch(start + max(timeout, 1.0))
    running.finish(kill=killed_because is not None)
    seconds = time.monotonic() - start
    if killed_because is not None:
        return _killed(out, killed_because, timeout, settings.device, seconds)
    rc = running.proc.returncode
    result = _read(out)
    if result is None:
        return _record(out, EvalResult.failure("unknown", "crash", f"evaluator exited {rc} without a verdict: "
                                               f"{_tail(out_dir / STDERR) or '(no stderr)'}", settings.device, seconds))
    if result.passed and rc != 0:
        return _record(out, EvalResult.failure(result.stage, "crash", f"evaluator exited {rc} after a passing "
                                               f"verdict: {_tail(out_dir / STDERR)}", settings.device, seconds))
    result.seconds = seconds  # wall time, start-up included: what the budget actually pays
    return result


class Series:
    """A contest's repeated timings in one evaluator (evaluator.series), started at the first
    `result` asked for. `timings`: every (label, engine) the contest may ask for, in the order
    it asks; `result(label)` waits for that one (the next in order), so a contest that decides
    early stops it by `close`. Use as a context manager."""

    def __init__(self, timings: list[tuple[str, Path]], out_dir: Path, settings: JudgeSettings):
        self.timings, self.out_dir, self.settings = timings, out_dir, settings
        self.running: _Evaluator | None = None
        self.next = 0
        self.since = 0.0

    def __enter__(self) -> "Series":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.running is not None:
            self.running.finish(kill=True)

    def result(self, label: str, timeout: float) -> EvalResult:
        """The verdict of timing `label`, within `timeout` seconds from now (else the series is
        killed and it is a timeout, as for one evaluation)."""
        labels = [name for name, _ in self.timings]
        if label not in labels[self.next:]:   # a label skipped is run anyway, before the next one
            raise ValueError(f"timing {label!r} asked out of the series' order {labels} (at {self.next})")
        self.next = labels.index(label, self.next) + 1
        out = self.out_dir / label / RESULT
        if self.running is None:
            logs = self.out_dir / SERIES_LOGS
            logs.mkdir(parents=True, exist_ok=True)
            for name in labels:
                (self.out_dir / name / RESULT).unlink(missing_ok=True)
            self.since = time.monotonic()
            self.running = _Evaluator(self.settings.series_command(self.timings, self.out_dir), logs)
        device = self.settings.device
        killed_because = None if self.running.done else \
            self.running.watch(time.monotonic() + max(timeout, 1.0), ready=out.exists)
        seconds, self.since = time.monotonic() - self.since, time.monotonic()
        if killed_because is not None:
            self.running.finish(kill=True)
            out.parent.mkdir(parents=True, exist_ok=True)
            return _killed(out, killed_because, timeout, device, seconds)
        result = _read(out)
        if result is None:
            self.running.finish(kill=True)
            out.parent.mkdir(parents=True, exist_ok=True)
            return _record(out, EvalResult.failure("unknown", "crash", f"the series ended without this timing's "
                                                   f"verdict: {_tail(self.out_dir / SERIES_LOGS / STDERR) or '(no stderr)'}",
                                                   device, seconds))
        result.seconds = seconds   # wall time since the previous verdict (the first: since the start)
        return result


def _killed(out: Path, why: str, timeout: float, device: str, seconds: float) -> EvalResult:
    partial = _read(out)
    kind, text = ("timeout", f"no verdict within {timeout:.0f}s") if why == "timeout" else ("crash", why)
    return _record(out, EvalResult.failure(partial.stage if partial else "unknown", kind,
                                           f"{text}; evaluator killed", device, seconds))


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
