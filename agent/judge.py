"""Candidates through the evaluator, in a process group of its own, each under a wall-clock limit.

The evaluator owns the verdict and runs each candidate in a fresh confined worker of its own
(evaluator/isolation.py), capped at `memory_bytes`. A run keeps ONE evaluator process for all its
verdicts (`Judge`: `python3 -m evaluator.resident`, design.md §2), because every verdict used to
pay that process's start (importing torch: ~2 s of CPU, ~5 s on an H100) and its setup (the floor's
hardware, the judge's margin on the real weights: ~2.4 s on the H100) before its worker even
started; the resident judge pays them once. This module only makes sure the evaluator cannot hang
the agent or take it down: it runs in a new session without the agent's API keys, dies with the
agent, its whole group is killed when a verdict passes its deadline, prints without end, or the
agent is interrupted (the verdict is then the timeout or crash it is, and the next verdict starts a
fresh judge), and a crash or a missing verdict become an EvalResult like any other failure. The
agent is a child subreaper: a worker orphaned by a killed judge is re-parented to it and killed
here. Output goes to files, of which the agent reads only a bounded tail and keeps a bounded tail.

`Series` hands a contest's repeated timings to the same judge in one request, which runs them
back to back ahead of the asking; each verdict is handed over as soon as it is written, and
closing the series stops the timings nobody asked for.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from agent.records import EvalResult
from agent.workspace import VARIANTS, atomic_write
from evaluator.isolation import die_with_parent, protect_judge
from evaluator.sweep import children, forget_child, kill_new_children, start_child
from evaluator.traces import PUBLIC_CASES
from evaluator.triton_cache import read_regular

REPO = Path(__file__).resolve().parent.parent
TERM_GRACE_SECONDS = 3.0        # between SIGTERM and SIGKILL of the judge's group
ERROR_TAIL_CHARS = 2000         # how much of stderr goes into a crash's error text
POLL_SECONDS = 0.2              # how often the agent looks at the judge at work
MEMORY_FRACTION = 0.8           # of physical memory: the worker's cap (the agent needs the rest)
SECRET_SUFFIXES = ("_API_KEY", "_TOKEN", "_SECRET")
OUTPUT_CAP_BYTES = 256 * 2**20  # stdout + stderr of one verdict (a series: all of it); past this the judge is killed
KEPT_OUTPUT_BYTES = 2**20       # the tail of each output file kept on disk afterwards
STDOUT, STDERR, RESULT = "stdout.txt", "stderr.txt", "result.json"
SERIES_DONE = "series-done.json"   # evaluator/resident.py: a series' end, with its done_ticket
STOP_GRACE_SECONDS = 15.0          # for a series told to stop to say it is done, before its judge is killed
STOP_POLL_SECONDS = 0.02
MAX_VERDICT_BYTES = 16 * 2**20     # a verdict's JSON is a few KiB; a bigger file is not the judge's
# Phases (agent/loop.py): VERIFY the conservative engine's one verdict before its stress: the
# public sequence and the benchmark on one case only (`JudgeSettings.conservative_case`), at the
# run's full repeats (it is installed on this timing), so that its score compares case for case with every other engine's
# (agent/acceptance.py pairs the cases both timed); TIMING the public sequence and the benchmark at
# `screen_repeat` fresh engines a case, no stress (a challenger's screen and the back-to-back
# rounds); FINAL a finalist's stress suite (its long cases) with the public sequence and the
# profiled pass, and the benchmark at the run's full repeats where the screens time fewer (else no
# benchmark: its screen timed this very engine the same way, and the loop joins the two into the
# verdict it installs); STRESS the same without the profiled pass and the benchmark (the
# conservative engine's, when it stays the result). The full stress (45 cases) takes minutes on a
# GPU too (docs/benchmarks.md, twelfth session): the self-test commands results.log prints run it
# on the engine a run leaves.
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
    # Fresh engines a case in a screen and a contest's round (None: `repeat`). A screen decides only
    # which engine goes on, and its 20 create_engines at `repeat` 3 were ~18 s of a 33 s screen on
    # an H100 (docs/benchmarks.md, twenty-first session); the installed engine's score is timed in full.
    screen_repeat: int | None = None
    spare_worker: str = "auto"   # evaluator/resident.py --spare-worker: the next verdict's worker started ahead
    compile_ahead: str = "auto"  # evaluator/evaluate.py --compile-ahead: a verdict's kernels compiled beside its worker
    phase_repeat: int | None = None      # this phase's repeats (set by for_phase); None: `repeat`
    phase_warm_up: str = "case"          # this phase's warm-up engines (evaluator/evaluate.py WARM_UPS)

    def for_phase(self, phase: str) -> "JudgeSettings":
        """The settings of one phase (see VERIFY, TIMING, FINAL, STRESS); the screens and rounds
        have the same warm-up and repeats, and VERIFY's one case is one of TIMING's, so their
        scores compare case for case."""
        if phase == FINAL:   # the profiled pass: once per engine that becomes the best
            return replace(self, benchmark=self.screens_time_less())
        if phase == STRESS:  # the conservative engine: no slots to profile
            return replace(self, benchmark=False, profile=False)
        if phase == TIMING:   # one warm-up engine for all cases where a finalist is then timed officially
            return replace(self, stress="off", profile=False, phase_repeat=self.screen_repeat,
                           phase_warm_up="shared" if self.screens_time_less() else "case")
        if phase == VERIFY:
            return replace(self, stress="off", cases=self.conservative_case(), profile=False)
        raise ValueError(f"unknown judge phase {phase!r}")

    def screens_time_less(self) -> bool:
        """Whether a screen times fewer fresh engines a case than the run's full benchmark (then a
        finalist's verdict times its own, in full)."""
        return self.screen_repeat is not None and self.screen_repeat < self.repeat

    def conservative_case(self) -> str:
        """CONSERVATIVE_CASE where the run times it; else the first of the run's cases, the one
        case the conservative engine's timing then has in common with every other engine's."""
        cases = self.cases.split(",") if self.cases else list(PUBLIC_CASES)
        return CONSERVATIVE_CASE if CONSERVATIVE_CASE in cases else cases[0]

    def process_flags(self) -> list[str]:
        """The resident judge's command-line flags (evaluator/resident.py): what is the same for
        every verdict of a run (the model, the device, the seed, the warm-up and repeats, the
        worker's cap and cache); what a phase changes (stress, cases, benchmark, profile) goes in
        each request."""
        flags = ["--model-config", str(self.model_config), "--weight-dir", str(self.weight_dir),
                 "--device", self.device, "--seed", str(self.seed), "--warmup", str(self.warmup),
                 "--repeat", str(self.repeat), "--memory-gb", f"{self.memory_bytes / 2**30:.6f}"]
        if self.bandwidth_gbs and self.peak_tflops:
            flags += ["--bandwidth-gbs", str(self.bandwidth_gbs), "--peak-tflops", str(self.peak_tflops)]
        if self.triton_cache is not None:
            flags += ["--triton-cache", str(self.triton_cache)]
        return flags + ["--compile-ahead", self.compile_ahead]

    def command(self) -> list[str]:
        """The resident judge's command line."""
        return [self.python, "-m", "evaluator.resident", *self.process_flags(), "--spare-worker", self.spare_worker]

    def request(self, engine: Path, out_dir: Path) -> dict:
        """One verdict's request, in this phase's settings. Every worker reads a copy of the shared
        Triton cache and adds to it if it passes, in the layer of its model-written variants
        (`cache_scope`; evaluator/triton_cache.py): what a model's code compiled reaches only
        engines that hold that code."""
        return {"engine": str(engine), "out_dir": str(out_dir), "stress": self.stress, "cases": self.cases,
                "benchmark": self.benchmark, "profile": self.profile, "repeat": self.phase_repeat,
                "warm_up": self.phase_warm_up,
                "update_cache": self.triton_cache is not None, "cache_scope": cache_scope(engine)}


def cache_scope(engine: Path) -> list[str]:
    """The digests of the model-written variants `engine` holds (the sources the loop saved in its
    candidate folder's VARIANTS, each with its file name, which names its slot and variant)."""
    folder = engine.parent / VARIANTS
    files = sorted(f for f in folder.glob("*.py.j2") if f.is_file() and not f.is_symlink()) if folder.is_dir() else []
    return [hashlib.sha256(f.name.encode() + b"\n" + f.read_bytes()).hexdigest() for f in files]


def default_memory_cap() -> int:
    """MEMORY_FRACTION of this machine's physical memory, in bytes."""
    return int(MEMORY_FRACTION * os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


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


@dataclass(frozen=True)
class Place:
    """Where a judge runs on a host of several GPUs (agent/screens.py): the GPU it sees alone
    (`gpu`, its CUDA_VISIBLE_DEVICES: by UUID where torch gives one, so that the judge's workers
    are kept from the host's other GPUs, evaluator/isolation.py gpus_not_given), and the CPUs its
    processes may use (its share of the host's, so that one judge's compiles do not take the cores
    another's timed host thread needs). `label`: its name in the log (its place in the run's list).
    The default, none given: the caller's own GPUs and CPUs."""

    label: str
    gpu: str
    cpus: frozenset[int]

    def env(self) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": self.gpu}

    def enter(self) -> None:
        """In the judge's process, before it runs: its CPUs (inherited by its workers)."""
        os.sched_setaffinity(0, self.cpus)


class Judge:
    """The run's judge: one resident evaluator process (evaluator/resident.py) for all its
    verdicts, started at the first one asked for and again after one was killed. It runs in its own
    session without the agent's secrets, dies with the agent, is registered (evaluator/sweep.py) so
    that no jail's sweep takes it, and its own output (outside verdicts) goes to `log_dir`. Each
    verdict has a deadline: past it, when the verdict prints without end, or when the agent is
    interrupted, the whole process group is killed, then whatever it left behind (the agent is a
    child subreaper), and the next verdict starts a fresh judge. One caller at a time. Use as a
    context manager; `starts` counts the processes started."""

    def __init__(self, settings: JudgeSettings, log_dir: Path, place: Place | None = None):
        self.settings, self.log_dir, self.place = settings, log_dir, place
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def __enter__(self) -> "Judge":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """End the judge (its stdin closed, then its group killed: nothing of it outlives this)."""
        if self.proc is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            self._stop(children())

    def verdict(self, engine: Path, out_dir: Path, timeout: float, settings: JudgeSettings) -> EvalResult:
        """The verdict on `engine` in `settings` (a phase of this judge's: JudgeSettings.for_phase),
        within `timeout` seconds; stdout/stderr/result.json in `out_dir`."""
        if settings.process_flags() != self.settings.process_flags():
            raise ValueError("a verdict's settings must differ from the judge's only in the phase")
        out, ticket = out_dir / RESULT, secrets.token_hex(16)
        outputs = _fresh_outputs(out_dir)
        out.unlink(missing_ok=True)
        start, before = time.monotonic(), children()
        self.send({**settings.request(engine, out_dir), "ticket": ticket})
        killed_because = self.watch(start + max(timeout, 1.0), outputs, lambda: _read(out, ticket) is not None, before)
        seconds = time.monotonic() - start
        for path in outputs:
            _keep_tail(path)
        if killed_because is not None:
            return _killed(out, killed_because, timeout, settings.device, seconds, ticket)
        result = _read(out, ticket)
        if result is None:
            rc = self.proc.returncode if self.proc is not None else None
            self._stop(before)
            return _record(out, EvalResult.failure("unknown", "crash", f"the judge exited ({rc}) without a verdict: "
                                                   f"{self.stderr_tail(out_dir)}", settings.device, seconds))
        result.seconds = seconds  # wall time, the judge's start included where it started: what the budget pays
        return result

    def series(self, timings: list[tuple[str, Path]], folder: Path) -> "Series":
        return Series(self, timings, folder)

    def send(self, request: dict) -> subprocess.Popen:
        """Hand a request to the judge, starting one where none runs (or the last one died)."""
        if self.proc is not None and self.proc.poll() is not None:
            self._stop(children())
        if self.proc is None:
            self._start()
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        except OSError:   # it died just now: watch() sees it gone, and the verdict says so
            pass
        return self.proc

    def watch(self, deadline: float, outputs: list[Path], ready: Callable[[], bool], before: set[int]) -> str | None:
        """Wait until `ready()` or the judge exits: None; else why it was killed (its group is, and
        what it left behind). The agent being interrupted meanwhile takes it down too."""
        try:
            while not ready():
                try:
                    self.proc.wait(timeout=max(min(POLL_SECONDS, deadline - time.monotonic()), 0.01))
                    return None
                except subprocess.TimeoutExpired:
                    pass
                why = "timeout" if time.monotonic() >= deadline else \
                    f"it printed more than {OUTPUT_CAP_BYTES // 2**20} MiB" \
                    if sum(p.stat().st_size for p in outputs if p.exists()) > OUTPUT_CAP_BYTES else None
                if why is not None:
                    self._stop(before)
                    return why
            return None
        except BaseException:
            self._stop(before)
            raise

    def stderr_tail(self, out_dir: Path) -> str:
        return _tail(out_dir / STDERR) or _tail(self.log_dir / STDERR) or "(no stderr)"

    def _start(self) -> None:
        protect_judge()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        place = self.place

        def prepare() -> None:   # in the child, before exec
            die_with_parent()
            if place is not None:
                place.enter()
        env = {**_evaluator_env(), **(place.env() if place is not None else {})}
        with open(self.log_dir / STDOUT, "ab") as so, open(self.log_dir / STDERR, "ab") as se:
            self.proc = start_child(lambda: subprocess.Popen(
                self.settings.command(), cwd=REPO, stdin=subprocess.PIPE, stdout=so, stderr=se, text=True,
                start_new_session=True, preexec_fn=prepare, env=env))
        self.starts += 1

    def _stop(self, before: set[int]) -> None:
        """Kill the judge's group (if it still runs), then the agent's children that appeared
        since `before` (a worker orphaned by the judge); the next request starts a fresh judge."""
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        if proc.poll() is None:
            _kill_group(proc)
        else:
            try:
                os.killpg(proc.pid, signal.SIGKILL)   # what it left in its group
            except (ProcessLookupError, PermissionError):
                pass
        forget_child(proc.pid)
        kill_new_children(before)
        try:
            proc.stdin.close()
        except OSError:
            pass


def _fresh_outputs(out_dir: Path) -> list[Path]:
    """A verdict's stdout/stderr, made empty (the judge appends to them)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    outputs = [out_dir / STDOUT, out_dir / STDERR]
    for path in outputs:
        path.write_bytes(b"")
    return outputs


def judge(engine: Path, out_dir: Path, timeout: float, settings: JudgeSettings) -> EvalResult:
    """One verdict from a judge of its own (tests, scripts; a run keeps one `Judge` for all)."""
    with Judge(settings, out_dir) as one:
        return one.verdict(engine, out_dir, timeout, settings)


class Series:
    """A contest's repeated timings through the run's judge, asked of it at the first `result`:
    it runs them back to back, ahead of the asking. `timings`: every (label, engine) the contest
    may ask for, in the order it asks; `result(label)` waits for that one (the next in order). A
    contest that decides early says so by `close`: the judge, by then on a timing nobody will ask
    for, is told so (SIGUSR1: it cuts the timing under way, whose clock would hold up the next
    verdict, runs no more of the series and says it is done; evaluator/resident.py), and the next
    verdict has the same judge and its spare worker. A judge that has not said so within
    STOP_GRACE_SECONDS (a worker still importing its engine cannot be cut) is killed with its
    group, as before, and the next verdict starts a fresh one. Each timing has a ticket of its own
    (see _read), and so does the end of the series. Use as a context manager."""

    def __init__(self, judge: Judge, timings: list[tuple[str, Path]], out_dir: Path):
        self.judge, self.timings, self.out_dir = judge, timings, out_dir
        self.running: subprocess.Popen | None = None   # the judge process the series was asked of
        self.next = 0
        self.since = 0.0
        self.before: set[int] = set()
        self.tickets = {label: secrets.token_hex(16) for label, _ in timings}   # one per timing's result.json
        self.done_ticket = secrets.token_hex(16)                                 # ... and the series' end

    def __enter__(self) -> "Series":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.running is not None and self.running is self.judge.proc and self.next < len(self.timings):
            self.running.send_signal(signal.SIGUSR1)
            deadline = time.monotonic() + STOP_GRACE_SECONDS
            while not self._stopped() and self.running.poll() is None and time.monotonic() < deadline:
                time.sleep(STOP_POLL_SECONDS)
            if not self._stopped():
                self.judge._stop(self.before)
        self.next = len(self.timings)

    def _stopped(self) -> bool:
        """Whether the judge said this series is over (its series-done.json, under our ticket)."""
        return _ticketed(self.out_dir / SERIES_DONE, self.done_ticket) is not None

    def result(self, label: str, timeout: float) -> EvalResult:
        """The verdict of timing `label`, within `timeout` seconds from now (else the judge is
        killed and it is a timeout, as for one verdict)."""
        labels = [name for name, _ in self.timings]
        if label not in labels[self.next:]:   # a label skipped is run anyway, before the next one
            raise ValueError(f"timing {label!r} asked out of the series' order {labels} (at {self.next})")
        self.next = labels.index(label, self.next) + 1
        out = self.out_dir / label / RESULT
        device = self.judge.settings.device
        if self.running is None:
            for name in labels:
                _fresh_outputs(self.out_dir / name)
                (self.out_dir / name / RESULT).unlink(missing_ok=True)
            (self.out_dir / SERIES_DONE).unlink(missing_ok=True)
            self.since, self.before = time.monotonic(), children()
            timing = self.judge.settings.for_phase(TIMING)
            self.running = self.judge.send({"timings": [[name, str(engine), self.tickets[name], cache_scope(engine)]
                                                        for name, engine in self.timings],
                                            "out_dir": str(self.out_dir), "cases": timing.cases,
                                            "repeat": timing.phase_repeat, "warm_up": timing.phase_warm_up,
                                            "done_ticket": self.done_ticket})
        outputs = [self.out_dir / name / f for name in labels for f in (STDOUT, STDERR)]
        killed_because = None if self.running is not self.judge.proc else \
            self.judge.watch(time.monotonic() + max(timeout, 1.0), outputs,
                             lambda: _read(out, self.tickets[label]) is not None or self._stopped(), self.before)
        seconds, self.since = time.monotonic() - self.since, time.monotonic()
        if killed_because is not None:
            return _killed(out, killed_because, timeout, device, seconds, self.tickets[label])
        result = _read(out, self.tickets[label])
        if result is None and self._stopped():   # a SIGUSR1 the agent did not send: the judge lives on
            self.next = len(self.timings)
            return _record(out, EvalResult.failure("unknown", "crash", "the judge's series ended before this "
                                                   "timing (stopped by a signal it was not sent by the agent)",
                                                   device, seconds))
        if result is None:
            if self.running is self.judge.proc:
                self.judge._stop(self.before)
            return _record(out, EvalResult.failure("unknown", "crash", f"the judge ended without this timing's "
                                                   f"verdict: {self.judge.stderr_tail(out.parent)}", device, seconds))
        result.seconds = seconds   # wall time since the previous verdict (the first: since the request)
        return result


def _killed(out: Path, why: str, timeout: float, device: str, seconds: float, ticket: str) -> EvalResult:
    partial = _read(out, ticket)
    kind, text = ("timeout", f"no verdict within {timeout:.0f}s") if why == "timeout" else ("crash", why)
    return _record(out, EvalResult.failure(partial.stage if partial else "unknown", kind,
                                           f"{text}; evaluator killed", device, seconds))


def _record(path: Path, result: EvalResult) -> EvalResult:
    """A verdict the judge made (timeout, crash) replaces whatever the evaluator left."""
    atomic_write(path, json.dumps(result.to_dict(), indent=2) + "\n")
    return result


def _ticketed(path: Path, ticket: str) -> dict | None:
    """The JSON object at `path` if the judge wrote it for the request that carried `ticket`
    (evaluator/resident.py: a file without it, a worker's forgery included, is not the judge's)."""
    try:
        data = json.loads(read_regular(path, MAX_VERDICT_BYTES) or b"")
    except ValueError:
        return None
    if not isinstance(data, dict) or not secrets.compare_digest(str(data.get("ticket")), ticket):
        return None
    return data


def _read(path: Path, ticket: str) -> EvalResult | None:
    """The verdict at `path` if the judge wrote it for the request that carried `ticket`."""
    data = _ticketed(path, ticket)
    return None if data is None else EvalResult.from_dict(data)
