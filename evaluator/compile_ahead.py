"""Compile a candidate's Triton kernels ahead of the calls that need them, on a pool of threads.

    python3 -I evaluator/compile_ahead.py REQUEST.json    (started by evaluator/worker.py, in its jail)

Why: a worker compiles each kernel at its first launch, one after another, and compiling was
most of what a verdict waited for: a screen's public phase 2-17 s of it, a final's stress suite
27-40 s (63-97 kernels, every random model's shapes anew; docs/benchmarks.md, twenty-eighth
and twenty-ninth sessions). On an H200, 182 of an engine's kernels took 66.5 s one after
another and 15.5 s on 8 threads under Triton's AsyncCompileMode (thirtieth session,
`python3 -m scripts.gpu compile-probe`): Triton's passes and ptxas release the GIL.

How: the judge sends, as the verdict starts, every model it will run and the calls it will make
on each (`plan`: the public sequence and the benchmark's traces on the real model, each stress
scenario on its model); the worker starts this process beside itself. (Started with a spare
worker instead, its torch, Triton and CUDA context made before the plan came, it made a
screen's public phase no shorter and the spare's start ~5 s long, which a warm screen then
waited for before its benchmark; thirty-first session.) Here the engine makes
those calls with no Triton kernel run: every launch becomes Triton's `warmup` (compile, do not
run) under AsyncCompileMode; a model's compiles are held until its pass is through (`Deferred`)
and then run on a pool of threads while the next model's pass goes on, into the worker's Triton
cache, where the worker's own launches then find them. torch.empty
gives zeros here, so what a skipped kernel would have written (token ids, slots) reads as 0, a
valid index, and no torch op asserts on it. Nothing computed here is right or read: the process
is thrown away, its group killed by the worker after the stress suite, before anything is timed
and before the worker's cache is merged into the run's (evaluator/worker.py). It is best
effort: a model whose pass fails here costs nothing but the kernels it did not reach, which the
worker compiles itself as it always did. It runs the candidate's code in the worker's jail (its
uid, limits and memory cap), so it can do nothing the worker could not.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from pathlib import Path

if __package__ in (None, ""):  # run as a script (isolated mode adds no path)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROGRESS_EVERY = 10   # compiles between two progress lines
MAX_THREADS = 8   # 8 compiled 4.3x faster than one, 16 no faster (an H200 host's 16 cores, thirtieth session)
# The most of the GPU's memory this process may take: the worker creates its engines beside it, and
# an engine that sizes its KV pool from the free memory must still find most of it free.
MEMORY_FRACTION = 0.25


def plan(config: dict, weight_dir: str, public: bool, cases: list[str], stress: str, seed: int,
         device: str, weight_limit: int | None = None) -> list[dict]:
    """Every model a verdict runs and the calls it makes on each, in the order the verdict needs
    them: the real model first (`weight_dir`, the worker-readable form), then each random model
    of the stress suite (no weights: this process draws its own, their values do not matter).
    Calls are the worker's op dicts (kind, ids, lengths). The real model is left out where its
    weight files pass `weight_limit` bytes: this process would hold a second copy of them, on the
    host beside the worker's under one memory cap and on the GPU beside the judge's and the
    worker's (`limit`)."""
    from evaluator.stress import draw, scenario_traces, target_scenarios
    from evaluator.traces import FULL, QUICK, benchmark_trace, public_sequence
    calls = public_sequence() if public else []
    for case in cases:
        calls += benchmark_trace(case)   # each ends with nothing live: one engine runs them all
    models = [{"name": "target", "config": config, "weight_dir": weight_dir}]
    if stress != "off":
        quick, size = stress == "quick", QUICK if stress == "quick" else FULL
        randoms, target_seed = draw(seed, quick, device, config)
        for trace in scenario_traces(target_seed, target_scenarios(quick), size)[1]:
            calls += trace
        for model in randoms:
            models.append({"name": model.name, "config": model.config, "weight_dir": None,
                           "calls": [op for trace in scenario_traces(model.trace_seed, model.scenarios, size)[1]
                                     for op in trace]})
    models[0]["calls"] = calls
    if weight_limit is not None and folder_bytes(weight_dir) > weight_limit:
        models = models[1:]
    for model in models:
        model["calls"] = [{"kind": op.kind, "ids": list(op.request_ids), "lengths": list(op.lengths)}
                          for op in model["calls"]]
    return models


def limit(memory_cap: int, device_bytes: int) -> int:
    """The largest real model compiled ahead: a quarter of the worker's memory cap, and no more
    than the share of the GPU this process may take (MEMORY_FRACTION), half of it for the
    engine's own buffers."""
    return min(memory_cap // 4, int(device_bytes * MEMORY_FRACTION / 2))


def folder_bytes(folder: str) -> int:
    return sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())


# ---- this process ----

class Deferred(Executor):
    """AsyncCompileMode's executor: a pass's compiles are held until the pass has asked for them
    all (`start`), then run on a pool. Compiling beside the pass starved it: Triton's code
    generation holds the GIL, and the pass's own Python (an engine polling a mailbox no skipped
    kernel will ever acknowledge) waited for it, ~40 s of a create_engine that takes ~1 s alone
    (thirtieth session, an H200). A compile whose result is asked for early runs right there."""

    def __init__(self, threads: int, log=lambda line: print(line, flush=True)):
        self.pool = ThreadPoolExecutor(threads)
        self.held: list[_Compile] = []
        self.asked = self.done = 0
        self.counted = threading.Lock()
        self.log, self.since = log, time.perf_counter()

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future = _Compile(lambda: _loaded(fn(*args, **kwargs)))
        future.add_done_callback(self._count)
        self.held.append(future)
        self.asked += 1
        return future

    def _count(self, _) -> None:
        """A line every PROGRESS_EVERY compiles and whenever none is left: when the worker's
        kernels were there (the verdict's log shows these lines)."""
        with self.counted:
            self.done += 1
            if self.done % PROGRESS_EVERY == 0 or self.done == self.asked:
                self.log(f"compile ahead: {self.done} of {self.asked} compiled "
                         f"({time.perf_counter() - self.since:.1f} s)")

    def start(self) -> None:
        for future in self.held:
            self.pool.submit(future.run)
        self.held = []

    def shutdown(self, wait: bool = True, **_) -> None:
        self.start()
        self.pool.shutdown(wait)


def _loaded(kernel):
    """`kernel`, loaded: Triton builds a kernel's launcher (a C module a signature, by the host's C
    compiler, cached beside the kernels) only when it is first loaded for a launch, and a worker
    whose kernels were compiled ahead still built 17 of them on the public config, one by one."""
    try:
        kernel._init_handles()
    except Exception:  # noqa: BLE001 - best effort: a kernel that does not load is the worker's to report
        pass
    return kernel


class _Compile(Future):
    """A held compile: run once, by a pool thread or by whoever asks for its result first."""

    def __init__(self, job):
        super().__init__()
        self.job = job
        self.claimed = threading.Lock()

    def run(self) -> None:
        if not self.claimed.acquire(blocking=False):
            return
        self.set_running_or_notify_cancel()
        try:
            self.set_result(self.job())
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on it
            self.set_exception(e)

    def result(self, timeout=None):
        self.run()
        return super().result(timeout)


def dry(torch):
    """Triton launches compile only, held by a Deferred executor; torch's empty tensors are zeros.
    (AsyncCompileMode, Deferred), or None where this Triton has no AsyncCompileMode (before 3.4)."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode
        from triton.runtime.jit import JITFunction
    except ImportError:
        return None
    launch = JITFunction.run

    def compile_only(self, *args, grid=None, warmup=False, **kwargs):
        return launch(self, *args, grid=grid, warmup=True, **kwargs)

    JITFunction.run = compile_only
    for owner, name in ((torch, "empty"), (torch, "empty_like"), (torch, "empty_strided"),
                        (torch.Tensor, "new_empty")):
        original = getattr(owner, name)
        setattr(owner, name, lambda *a, _original=original, **k: _original(*a, **k).zero_())
    executor = Deferred(max(1, min(MAX_THREADS, (os.cpu_count() or 2) // 2)))
    try:   # a kernel that fails to compile stops nothing else (the worker's own launch reports it)
        return AsyncCompileMode(executor, ignore_errors=True), executor
    except TypeError:   # Triton before ignore_errors
        return AsyncCompileMode(executor), executor


def weights_for(model: dict, folder: str) -> str:
    """The model's weight folder: the real model's, or random weights of its config saved here."""
    if model["weight_dir"] is not None:
        return model["weight_dir"]
    from evaluator.stress import write_weights
    from evaluator.weights import random_weights
    path = Path(folder) / model["name"]
    path.mkdir()
    write_weights(random_weights(model["config"]), str(path), model["config"])
    return str(path)


def run_calls(torch, engine, calls: list[dict]) -> None:
    for call in calls:
        ids = list(call["ids"])
        if call["kind"] == "prefill":
            engine.prefill(ids, [torch.zeros(n, dtype=torch.long, device="cuda") for n in call["lengths"]])
        elif call["kind"] == "decode":
            engine.decode(ids, torch.zeros(len(ids), dtype=torch.long, device="cuda"))
        else:
            engine.remove(ids)


def go_through(torch, module, models: list[dict], mode, executor: Deferred, folder: str,
               log=lambda line: print(line, flush=True)) -> None:
    """Each model's engine created and its calls made, its compiles then started on the pool while
    the next model's pass goes on. (Starting create_engine's compiles once it returned made a
    screen's public phase no shorter on the public config: 7.2-10.3 s with 15-29 kernels compiled,
    against 6.4-7.4 s held until the pass was through; thirty-first session.) A model whose pass
    fails costs only the kernels it did not reach; its compiles asked so far start whatever ended
    the pass (else leaving `mode` waits for compiles that were never started)."""
    start = time.perf_counter()
    for model in models:
        engine = None
        try:
            engine = module.create_engine(model["config"], weights_for(model, folder), "cuda")
            log(f"compile ahead: {model['name']}: create_engine through, {len(mode.raw_futures)} compiles asked "
                f"({time.perf_counter() - start:.1f} s)")
            run_calls(torch, engine, model["calls"])
            log(f"compile ahead: {model['name']}: {len(model['calls'])} calls gone through, "
                f"{len(mode.raw_futures)} compiles asked ({time.perf_counter() - start:.1f} s)")
        except Exception as e:  # noqa: BLE001 - best effort: the worker compiles what was missed
            log(f"compile ahead: {model['name']}: stopped at {type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}")
        finally:
            executor.start()
            engine = None
            torch.cuda.empty_cache()


def main() -> int:
    born = time.perf_counter()
    from evaluator.isolation import die_with_parent
    die_with_parent()   # as the worker dies with the judge
    request = json.loads(Path(sys.argv[1]).read_text())
    import torch
    from evaluator.common import load_engine_module
    dried = dry(torch) if torch.cuda.is_available() else None
    if dried is None:
        print("compile ahead: nothing to do here (no CUDA, or a Triton without AsyncCompileMode)", flush=True)
        return 0
    mode, executor = dried
    torch.cuda.set_per_process_memory_fraction(MEMORY_FRACTION)
    start = executor.since = time.perf_counter()
    print(f"compile ahead: ready {start - born:.1f} s after the process started (torch, Triton, CUDA)", flush=True)
    module = load_engine_module(request["engine"])
    from triton.runtime.jit import KernelInterface
    if not any(isinstance(value, KernelInterface) for value in vars(module).values()):
        print("compile ahead: nothing to do here (the engine defines no Triton kernel)", flush=True)
        return 0
    if isinstance(getattr(module, "MAILBOX_SPINS", None), int):
        module.MAILBOX_SPINS = 0   # the paged engine's mailbox: no skipped kernel will acknowledge a post
    with tempfile.TemporaryDirectory(prefix="compile-ahead-") as folder, torch.no_grad():
        try:
            with mode:   # leaving it waits for every compile
                go_through(torch, module, request["models"], mode, executor, folder)
        except Exception as e:  # noqa: BLE001 - a kernel that does not compile: the worker's launch says so
            print(f"compile ahead: a compile failed: {type(e).__name__}", flush=True)
    print(f"compile ahead: done in {time.perf_counter() - start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
