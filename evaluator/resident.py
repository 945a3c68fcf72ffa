"""The judge of a whole agent run: one process that gives verdict after verdict.

    python3 -m evaluator.resident --model-config CFG --weight-dir DIR --device cpu|cuda|auto \
        [--cases ...] [--warmup 1] [--repeat 3] [--seed N] [--memory-gb G] \
        [--bandwidth-gbs B --peak-tflops P] [--triton-cache DIR] [--criterion auto|course|bf16]
        [--compile-ahead auto|off] [--spare-worker auto|on|off]

Requests come on stdin, one JSON object a line, and are done one at a time, in order:

    {"engine": PATH, "out_dir": DIR, "stress": "quick", "cases": "mixed", "benchmark": true,
     "profile": false, "update_cache": false, "cache_scope": [DIGEST, ...], "repeat": 1, "warm_up": "shared",
     "ticket": T}
                                                                   one verdict: DIR/result.json
    {"timings": [[LABEL, PATH, T, [DIGEST, ...]], ...], "out_dir": DIR, "cases": ..., "repeat": ...,
     "warm_up": ..., "done_ticket": D}                             a contest's series: DIR/LABEL/result.json,
                                                                   then DIR/series-done.json

Each verdict is exactly `python3 -m evaluator.evaluate` with the request's flags (a series'
timing: `--stress off`, no profile, the cache only read, and no public sequence: a series times
engines whose screen ran it in this run, and every timed run's outputs are still checked), in a fresh confined worker of its own
(evaluator/remote.py, evaluator/isolation.py); the candidate never runs in this process. What a
resident judge saves is what every verdict paid before it began: the process's start (imports,
~2 s of CPU, ~5 s on an H100), the floor's hardware and the judge's margin on the real weights
(~2.4 s on the H100; `JudgeSetup`, measured once with the same seed). A verdict's progress and
its one-line summary go to DIR/stderr.txt and DIR/stdout.txt (fd 1 and 2 are pointed there for
its duration, so that they lie beside its result.json as the standalone command's do); between
verdicts the judge's own output goes where it was started with. result.json is written last and
atomically: once it is there, holding the request's ticket, that verdict is done. The ticket (a
random string the caller sends on this process's stdin, which no worker can read: the judge is not
dumpable) is what makes it this judge's: a worker running under the judge's own uid (no root, no
uid of its own) could write a result.json into the verdict's folder, but not one with the ticket,
so a forged "passed" is never taken for the verdict. Each timing of a series has a ticket of its
own: a worker that reads one timing's result.json (it can find its contest's folder) learns nothing
it could write into the next.

A series' timings run back to back without waiting to be asked; consecutive timings of one engine
share its worker (the contest's order, agent/acceptance.py, A, B B, A A, B: each later pair has
one timing in a worker that timed before and one in a fresh worker; where the judge keeps a spare,
those fresh workers are all started with the series, before anything is timed, not between two
timings); a worker whose timing failed is not used again. A caller whose contest has decided
before its last timing sends SIGUSR1: the timing under way is cut (its worker killed with its
group: it would otherwise hold up the next request, its clock running), no later timing of the
series runs, and the judge reads its next request, its spare worker kept (before, the caller killed the judge, and the next verdict paid a
fresh judge's start, its setup and its own worker's start: 7-10 s on an H200, after most contests).
A series ends, stopped or not, with DIR/series-done.json holding the request's `done_ticket`, once
its workers are gone: the caller waits a few seconds for it after a SIGUSR1 and kills the judge
if it does not come (a worker still importing cannot be cut). SIGUSR1 outside a series does nothing. SIGTERM ends the process (the verdict under way unwound, its jail torn down, nothing
written); so does the end of stdin. The caller (agent/judge.py) watches each verdict's deadline and
kills the whole process group when it passes. Exit 2 for bad flags or a request it cannot read.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the `evaluator` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from evaluator.isolation import quiet_threads  # noqa: E402  (the standard library only)

STARTED = time.perf_counter()   # before torch is imported: the first verdict's share of the start
quiet_threads()

from evaluator.benchmark_throughput import release_device_memory  # noqa: E402
from evaluator.common import CRASH, ConfigError, freeze_imports, load_config, parse_cases, resolve_device  # noqa: E402
from evaluator.evaluate import (STRESS_MODES, WARM_UPS, JudgeSetup, add_timing_flags, default_memory_cap,  # noqa: E402
                                evaluate, failed_result, summary_line, write_json)
from evaluator.remote import Worker  # noqa: E402

RESULT, STDOUT, STDERR = "result.json", "stdout.txt", "stderr.txt"
SERIES_DONE = "series-done.json"   # in a series' DIR: written last, with the request's done_ticket
ERROR_CHARS = 1500     # of the traceback, in a verdict for a timing the judge itself failed on
OUTPUT_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_APPEND   # the caller made (and emptied) the files
HEX = frozenset("0123456789abcdef")   # a cache scope's digests (evaluator/triton_cache.py)


class BadRequest(ValueError):
    """A request line this judge cannot read: the caller's bug, so the process ends (exit 2)."""


@dataclass(frozen=True)
class Verdict:
    """One verdict asked for: evaluate()'s per-candidate flags."""

    engine: Path
    out_dir: Path
    stress: str = "quick"
    cases: list[str] | None = None      # None: the process's --cases
    benchmark: bool = True
    profile: bool = False
    update_cache: bool = False
    repeat: int | None = None           # fresh engines a benchmark case; None: the process's --repeat
    ticket: str | None = None           # copied into result.json: how the caller knows it is this verdict
    cache_scope: tuple[str, ...] = ()   # the engine's model-written variants: its Triton cache layers
    warm_up: str = "case"               # WARM_UPS: one warm-up engine a case (SPEC §5), or one shared


@dataclass(frozen=True)
class SeriesRequest:
    """A contest's repeated timings, in the order it asks for them."""

    timings: list[tuple[str, Path, str | None, tuple[str, ...]]]   # (label, engine, its ticket, its cache scope)
    out_dir: Path
    cases: list[str] | None = None      # None: the process's --cases
    repeat: int | None = None           # None: the process's --repeat
    done_ticket: str | None = None      # copied into DIR/series-done.json once the series is over
    warm_up: str = "case"


def parse_request(line: str) -> Verdict | SeriesRequest:
    try:
        data = json.loads(line)
        if not isinstance(data, dict) or not isinstance(data.get("out_dir"), str):
            raise BadRequest("a request is a JSON object with an out_dir")
        out_dir = Path(data["out_dir"])
        cases = parse_cases(data["cases"]) if data.get("cases") else None
        repeat = data.get("repeat")
        if repeat is not None and (type(repeat) is not int or repeat < 1):
            raise BadRequest("repeat must be a positive integer")
        warm_up = data.get("warm_up", "case")
        if warm_up not in WARM_UPS:
            raise BadRequest(f"warm_up must be one of {WARM_UPS}")
        if "timings" in data:
            timings = [(str(label), Path(engine), _ticket(rest[0] if rest else None),
                        _scope(rest[1] if len(rest) > 1 else []))
                       for label, engine, *rest in data["timings"]]
            if not timings or any(not _plain_name(label) for label, *_ in timings) \
                    or len({label for label, *_ in timings}) != len(timings):
                raise BadRequest("timings: distinct LABELs of letters, digits, - and _")
            return SeriesRequest(timings, out_dir, cases, repeat, _ticket(data.get("done_ticket")), warm_up)
        if data.get("stress", "quick") not in STRESS_MODES:
            raise BadRequest(f"stress must be one of {STRESS_MODES}")
        return Verdict(Path(data["engine"]), out_dir, data.get("stress", "quick"), cases,
                       bool(data.get("benchmark", True)), bool(data.get("profile", False)),
                       bool(data.get("update_cache", False)), repeat, _ticket(data.get("ticket")),
                       cache_scope=_scope(data.get("cache_scope", [])), warm_up=warm_up)
    except (ValueError, KeyError, TypeError) as e:
        raise BadRequest(f"bad request {line.strip()[:200]!r}: {e}") from None


def _ticket(ticket: object) -> str | None:
    if ticket is not None and not isinstance(ticket, str):
        raise BadRequest("ticket must be a string")
    return ticket


def _scope(scope: object) -> tuple[str, ...]:
    """A cache scope: hex digests (evaluator/triton_cache.py)."""
    if not isinstance(scope, list) or not all(isinstance(d, str) and d and all(c in HEX for c in d) for d in scope):
        raise BadRequest("cache_scope must be a list of hex digests")
    return tuple(scope)


def _plain_name(label: str) -> bool:
    return bool(label) and label not in (".", "..") and label.replace("-", "").replace("_", "").isalnum()


class Resident:
    """The process's state: its flags, its JudgeSetup, whether a series was asked to stop."""

    in_series = False                  # a series' timings are under way
    series_stopped = False             # ... and its caller asked for no more (SIGUSR1)
    timing_worker: Worker | None = None   # the worker timing now, where the series holds it

    def __init__(self, a: argparse.Namespace, config: dict):
        self.a, self.config = a, config
        self.device = resolve_device(a.device)   # where torch's cached memory is handed back after a verdict
        self.setup = JudgeSetup()
        self.started: float | None = STARTED   # the process's start counts in its first verdict only
        self.terminated = False   # SIGTERM came: what the verdict under way became is the stop's
        self.memory_bytes = int(a.memory_gb * 2**30) if a.memory_gb else None
        self.home = (os.dup(1), os.dup(2))     # where the judge's own output goes between verdicts
        # The next verdict's worker, started when a verdict begins: its start (confinement, torch's import,
        # the device's context and Triton: 4-7 s on an H100) runs beside this verdict's untimed stages
        # (its own worker's load, the public sequence, the stress suite) and is waited for before
        # anything is timed. Only where --spare-worker says so (auto: on a GPU; on a CPU its start
        # would take cores from the agent's and this verdict's work).
        self.keep_spare = a.spare_worker == "on" or (a.spare_worker == "auto" and self.device == "cuda")
        self.spare: Worker | None = None

    def log(self, line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    @contextmanager
    def output_to(self, folder: Path):
        """fd 1 and 2 (this process's prints, a worker's start-up messages) into `folder` for the
        duration of one verdict, then back home."""
        folder.mkdir(parents=True, exist_ok=True)
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, name in ((1, STDOUT), (2, STDERR)):
            target = os.open(folder / name, OUTPUT_FLAGS, 0o644)
            os.dup2(target, fd)
            os.close(target)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(self.home[0], 1)
            os.dup2(self.home[1], 2)

    def evaluate(self, engine: Path, stress: str, cases: list[str] | None, benchmark: bool = True,
                 profile: bool = False, update_cache: bool = False, reuse: Worker | None = None,
                 public: bool = True, repeat: int | None = None, fresh: Worker | None = None,
                 cache_scope: tuple[str, ...] = (), warm_up: str = "case") -> dict:
        a = self.a
        result = evaluate(engine, self.config, a.weight_dir, a.device, stress, cases or parse_cases(a.cases),
                          a.warmup, repeat or a.repeat, a.seed, a.bandwidth_gbs, a.peak_tflops, log=self.log,
                          memory_bytes=self.memory_bytes, triton_cache=a.triton_cache, update_cache=update_cache,
                          cache_scope=cache_scope,
                          profile=profile, criterion=a.criterion, benchmark=benchmark, started=self.started,
                          compile_ahead=a.compile_ahead != "off", shared_warm_up=warm_up == "shared",
                          setup=self.setup, reuse=reuse, fresh=fresh, public=public, worker_ready=self.start_spare,
                          before_timing=self.settle_spare)
        self.started = None
        if self.terminated:   # evaluate() turned the unwinding into a verdict: not the engine's
            raise SystemExit(128 + signal.SIGTERM)
        return result

    def start_spare(self) -> None:
        """The next verdict's worker, started now: after this verdict's own worker measured its
        round trip (evaluate's `worker_ready`), so that the spare's start does not inflate it;
        `take_spare` gives it the shared Triton cache's entries added meanwhile. Only a spare with
        a uid of its own is kept: one under the candidate's uid (no root) could be stopped or
        written to by the candidate running beside it."""
        if self.keep_spare and self.spare is None:
            try:
                spare = Worker(self.device, self.memory_bytes or default_memory_cap(), self.log, self.a.triton_cache)
            except Exception as e:  # noqa: BLE001 - no spare: the next verdict starts its own, as before
                self.log(f"no spare worker: {type(e).__name__}: {e}")
                return
            if spare.jail.spec.uid is None:
                self.log("no spare worker: workers have no uid of their own here (not root)")
                spare.close()
                self.keep_spare = False
                return
            self.spare = spare

    def take_spare(self, scope: tuple[str, ...] = ()) -> Worker | None:
        """The spare worker once it has said hello, its Triton cache brought up to date with the
        layers of its engine's `scope` (it started with the shared layer only); None where
        there is none or it failed to start (it is closed, and the verdict starts its own: the
        judge's failure is never the engine's)."""
        spare, self.spare = self.spare, None
        if spare is None:
            return None
        try:
            spare.ready()   # its round trip measured now: the last verdict's worker is gone, no spare starts
            spare.jail.refresh_cache(scope)
        except Exception as e:  # noqa: BLE001 - WorkerDied, a broken channel, a failed copy: not the candidate's
            self.log(f"the spare worker is not used: {type(e).__name__}: {e}")
            spare.close()
            return None
        except BaseException:   # SIGTERM's exit while it was waited for: its jail torn down too
            spare.close()
            raise
        return spare

    def settle_spare(self) -> None:
        """Wait until the spare has started (its hello): nothing may be timed while it starts,
        which would slow whichever engine is timed then."""
        if self.spare is not None:
            try:
                self.spare.started()
            except Exception as e:  # noqa: BLE001 - it failed to start: the next verdict starts its own
                self.log(f"the spare worker did not start: {type(e).__name__}: {e}")
                self.close_spare()

    def close_spare(self) -> None:
        spare, self.spare = self.spare, None
        if spare is not None:
            spare.close()

    def verdict(self, v: Verdict) -> None:
        with self.output_to(v.out_dir):
            fresh = self.take_spare(v.cache_scope)
            result = self.evaluate(v.engine, v.stress, v.cases, v.benchmark, v.profile, v.update_cache,
                                   repeat=v.repeat, fresh=fresh, cache_scope=v.cache_scope, warm_up=v.warm_up)
            print(summary_line(result), flush=True)
        write_json({**result, "ticket": v.ticket}, v.out_dir / RESULT)
        release_device_memory(self.device)

    def series_workers(self, engines: list[Path]) -> list[Worker]:
        """A worker for each run of one engine's timings in a series (the contest's order: A, B B,
        A A, B), all started at once and waited for before anything is timed. A worker's start
        (confinement, torch's import, the device's context: ~4.5 s on an H200) then no longer
        falls between two timings of a contest: where one engine's timings gave way to the
        other's, a fresh worker took 4.4-5.6 s there (thirty-second session). A worker holds no
        candidate's code until its engine is imported, right before its first timing, so one
        waiting beside a timing is the judge's own, like the spare; those a series stopped early
        never used are closed with it. Only where the judge keeps a spare (a GPU, or
        --spare-worker on: on a CPU the starts would take cores from the timings), and workers
        have a uid of their own (one under the candidate's could be reached from its worker).
        Errors of a worker's start are the judge's: that timing starts one of its own."""
        if not self.keep_spare:
            return []
        runs = sum(1 for i, engine in enumerate(engines) if i == 0 or engine != engines[i - 1])
        started: list[Worker] = []
        try:
            for _ in range(runs):
                started.append(Worker(self.device, self.memory_bytes or default_memory_cap(), self.log,
                                      self.a.triton_cache))
                if started[-1].jail.spec.uid is None:   # as for the spare: a candidate could reach it
                    raise _NoUidOfItsOwn
            for worker in list(started):
                if self.series_stopped:
                    break
                try:
                    worker.started()
                except Exception as e:  # noqa: BLE001 - that timing starts a worker of its own, as before
                    self.log(f"a series' worker did not start: {type(e).__name__}: {e}")
                    started.remove(worker)
                    worker.close()
        except Exception as e:  # noqa: BLE001 - the judge's (a fork, a channel): each timing starts its own
            for worker in started:
                worker.close()
            if isinstance(e, _NoUidOfItsOwn):
                self.keep_spare = False   # as the spare's start decides: none here again
            else:
                self.log(f"no workers started with the series: {type(e).__name__}: {e}")
            return []
        except BaseException:   # SIGTERM's exit: their jails torn down too
            for worker in started:
                worker.close()
            raise
        return started

    def stop_series(self) -> None:
        """SIGUSR1's handler: the caller's contest has decided. Only a flag and a kill (safe between
        any two of the main thread's bytecodes): the timing under way ends as its worker dies, and
        `series` runs no more. Outside a series, nothing."""
        if not self.in_series:
            return
        self.series_stopped = True
        _cut(self.timing_worker)

    def timing_with(self, worker: Worker) -> None:
        """`worker` times now: known to stop_series from the moment it exists, so a stop while it
        still starts or imports its engine cuts it too (a stop that came first cuts it here)."""
        self.timing_worker = worker
        if self.series_stopped:
            _cut(worker)

    def series(self, s: SeriesRequest) -> None:
        """Each timing in turn (stress off, no public sequence), DIR/LABEL/result.json after each,
        until the last or the caller's SIGUSR1 (`stop_series`)."""
        held: Held | None = None   # the last engine's worker, for that engine's next timing
        self.settle_spare()
        self.series_stopped, self.in_series = False, True
        waiting: list[Worker] = []   # started with the series, for its later engines' timings
        try:
            waiting = self.series_workers([engine for _, engine, _, _ in s.timings])
            for label, engine, ticket, scope in s.timings:
                if self.series_stopped:
                    break
                folder = s.out_dir / label
                with self.output_to(folder):
                    try:
                        t0 = time.perf_counter()
                        if held is not None and held.engine != engine:
                            held.close()
                            held = None
                        t1, ahead = time.perf_counter(), bool(waiting)
                        if held is None:
                            held = Held.start(engine, self.a.device, self.memory_bytes, self.a.triton_cache,
                                              self.log, scope, on_start=self.timing_with,
                                              started=waiting.pop(0) if waiting else None)
                        if held is None:
                            said = " (its worker did not start or import the engine: the timing starts its own)"
                        elif held.timed:
                            said = " (its worker again)"
                        else:
                            said = (f" (the last worker closed in {t1 - t0:.1f} s; this one, "
                                    f"{'started with the series' if ahead else 'started now'}, made ready and "
                                    f"imported the engine in {time.perf_counter() - t1:.1f} s)")
                        self.log(f"--- {label}: {engine}{said}")
                        self.timing_worker = held.worker if held else None
                        if self.series_stopped:   # asked while its worker started (and was cut)
                            self.log(f"--- {label}: the series was stopped by its caller (the contest decided)")
                            break
                        result = self.evaluate(engine, "off", s.cases, reuse=held.worker if held else None,
                                               public=False, repeat=s.repeat, cache_scope=scope, warm_up=s.warm_up)
                    except Exception:  # noqa: BLE001 - the judge's own failure: this timing's verdict, not its end
                        traceback.print_exc()
                        result = failed_result(self.device, "unknown", CRASH, "the judge failed on this timing: "
                                               + traceback.format_exc()[-ERROR_CHARS:])
                    self.timing_worker = None
                    if self.series_stopped:   # cut by the caller: a verdict of nothing, not written
                        self.log(f"--- {label}: the series was stopped by its caller (the contest decided)")
                        break
                    if held is not None:
                        held.timed = True
                        if result["status"] != "passed":
                            held.close()
                            held = None
                    print(summary_line(result), flush=True)
                write_json({**result, "ticket": ticket}, folder / RESULT)
                release_device_memory(self.device)
        finally:
            self.in_series = False
            self.timing_worker = None
            try:
                if held is not None:
                    held.close()
            finally:
                for worker in waiting:
                    worker.close()
            release_device_memory(self.device)
        if s.done_ticket is not None:   # not after a failure of the judge's own: the caller kills it then
            write_json({"ticket": s.done_ticket, "stopped": self.series_stopped}, s.out_dir / SERIES_DONE)


class _NoUidOfItsOwn(Exception):
    """A worker started ahead would share the judge's uid with the candidate's."""


def _cut(worker: Worker | None) -> None:
    """Kill `worker`'s process group (signal-handler safe: one system call)."""
    if worker is not None and worker.proc is not None:
        try:
            os.killpg(worker.proc.pid, signal.SIGKILL)
        except OSError:   # gone already
            pass


@dataclass
class Held:
    """A worker holding one engine, kept open between that engine's consecutive timings."""

    engine: Path
    worker: Worker
    timed: bool = False

    @staticmethod
    def start(engine: Path, device: str, memory_bytes: int | None, triton_cache: Path | None, log,
              scope: tuple[str, ...] = (), on_start=lambda worker: None,
              started: Worker | None = None) -> "Held | None":
        """A fresh worker (`started`, one started ahead with no engine yet, its cache brought up
        to date with `scope`'s layers, or a new one) that imported `engine`; None where it failed
        to start or to import it (or was cut: `on_start` hears of it as soon as it runs): then
        evaluate() starts its own, and its verdict says what failed."""
        worker = started
        try:
            if worker is None:
                worker = Worker(device, memory_bytes or default_memory_cap(), log, triton_cache, scope)
            on_start(worker)
            worker.ready()
            if started is not None:
                worker.jail.refresh_cache(scope)
            worker.request({"op": "load", "engine": worker.readable(engine)}, what="import")
        except Exception:  # noqa: BLE001 - EvalFailure, or the worker's start (fork, channel) failing
            if worker is not None:
                worker.close()
            return None
        except BaseException:   # SIGTERM's exit: its jail torn down too (a worker handed in is ours now)
            if worker is not None:
                worker.close()
            raise
        return Held(engine, worker)

    def close(self) -> None:
        self.worker.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-config", required=True)
    p.add_argument("--weight-dir", required=True)
    p.add_argument("--device", default="auto")
    add_timing_flags(p)
    p.add_argument("--seed", type=int, help="the stress suite's and the margin's seed (default: fresh)")
    p.add_argument("--spare-worker", choices=("auto", "on", "off"), default="auto",
                   help="start each verdict's worker once the previous verdict is written (auto: on a GPU)")
    a = p.parse_args(argv)
    try:
        config = load_config(a.model_config)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    judge = Resident(a, config)
    freeze_imports()

    def terminate(*_) -> None:
        """SIGTERM (the caller's timeout or stop) unwinds like an interrupt, so a worker's jail
        is torn down; evaluate() turns the unwinding into a verdict, which `Resident.evaluate`
        then refuses (it is the stop's, not the engine's): nothing is written."""
        judge.terminated = True
        sys.exit(128 + signal.SIGTERM)

    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGUSR1, lambda *_: judge.stop_series())
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            try:
                request = parse_request(line)
            except BadRequest as e:
                print(f"error: {e}", file=sys.stderr, flush=True)
                sys.exit(2)
            (judge.series if isinstance(request, SeriesRequest) else judge.verdict)(request)
            judge.start_spare()
    finally:
        judge.close_spare()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
