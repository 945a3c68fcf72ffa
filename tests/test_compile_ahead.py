"""Compiling ahead (evaluator/compile_ahead.py, issue 24's throughput): the plan names every model
and call the verdict makes, as the stress suite draws them; the worker starts the process beside
itself and kills it before anything is timed. On CUDA (skipped here) the kernels it compiles are
the ones the verdict's own calls then find in the worker's cache."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

from evaluator import compile_ahead, remote, stress
from evaluator.common import load_config
from evaluator.traces import QUICK, Contexts, benchmark_trace, public_sequence

REPO = Path(__file__).resolve().parent.parent
CASES = ["prefill", "mixed"]


def calls_of(trace) -> list[dict]:
    return [{"kind": op.kind, "ids": list(op.request_ids), "lengths": list(op.lengths)} for op in trace]


def test_the_plan_is_the_verdicts_models_and_calls_as_the_stress_suite_draws_them(tiny_model):
    config = load_config(tiny_model.config_path)
    seed = random.randrange(2**31)
    models = compile_ahead.plan(config, "/weights", True, CASES, "quick", seed, "cuda")
    randoms, target_seed = stress.draw(seed, True, "cuda", config)
    assert [m["name"] for m in models] == ["target", *(m.name for m in randoms)]
    assert [m["config"] for m in models[1:]] == [m.config for m in randoms]
    assert models[0]["weight_dir"] == "/weights" and all(m["weight_dir"] is None for m in models[1:])
    target_calls = public_sequence() + [op for case in CASES for op in benchmark_trace(case)]
    target_calls += stress.scenario_traces(target_seed, stress.target_scenarios(True), QUICK)[1][0]
    assert models[0]["calls"] == calls_of(target_calls)
    for planned, model in zip(models[1:], randoms):
        traces = stress.scenario_traces(model.trace_seed, model.scenarios, QUICK)[1]
        assert planned["calls"] == calls_of([op for trace in traces for op in trace])
    json.dumps(models)   # it travels to the worker as JSON


def test_the_stress_suite_runs_the_traces_the_plan_names(tiny_model, recompute_engine_path, monkeypatch):
    """The plan and the suite draw from one function: what the suite ran is what was planned."""
    seen = []
    original = stress.CheckedSession.run
    monkeypatch.setattr(stress.CheckedSession, "run", lambda self, trace: (seen.append(trace), original(self, trace))[1])
    seed = random.randrange(2**31)
    stress.run_stress(recompute_engine_path, "cpu", seed, quick=True, target=(tiny_model.config_path, tiny_model.weight_dir))
    planned = compile_ahead.plan(load_config(tiny_model.config_path), "/w", False, [], "quick", seed, "cpu")
    assert [op for trace in seen for op in calls_of(trace)] == [c for m in planned for c in m["calls"]]


def test_every_planned_model_ends_with_nothing_live(tiny_model):
    """One engine runs a model's traces back to back: what one left live would be in the next one's KV pool."""
    for model in compile_ahead.plan(load_config(tiny_model.config_path), "/w", True,
                                    ["prefill", "decode", "mixed", "decode128", "mixed128"], "full",
                                    random.randrange(2**31), "cuda"):
        live = Contexts()
        for call in model["calls"]:
            ids, lengths = call["ids"], call["lengths"]
            if call["kind"] == "prefill":
                live.lengths.update(zip(ids, lengths))
            elif call["kind"] == "remove":
                for i in ids:
                    live.lengths.pop(i, None)
        assert not live.lengths, model["name"]


def test_no_stress_plans_the_real_model_alone(tiny_model):
    models = compile_ahead.plan(load_config(tiny_model.config_path), "/w", True, ["prefill"], "off", 1, "cuda")
    assert [m["name"] for m in models] == ["target"]
    assert models[0]["calls"] == calls_of(public_sequence() + benchmark_trace("prefill"))


def test_held_compiles_run_on_the_pool_once_started_and_at_once_when_waited_for():
    from concurrent.futures import as_completed
    threads: dict[str, str] = {}

    def job(name):
        threads[name] = threading.current_thread().name
        return name.upper()

    executor = compile_ahead.Deferred(2)
    futures = [executor.submit(job, name) for name in ("a", "b", "c")]
    assert not threads   # held: nothing runs during the pass
    assert futures[1].result(timeout=5) == "B" and threads["b"] == threading.current_thread().name
    executor.start()
    assert sorted(f.result() for f in as_completed(futures, timeout=30)) == ["A", "B", "C"]
    assert threads["a"] != threading.current_thread().name and len(threads) == 3   # b ran once, inline
    failing = executor.submit(lambda: 1 / 0)
    executor.shutdown()
    with pytest.raises(ZeroDivisionError):
        failing.result()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # another uid's (the worker's own, when the judge runs as root)
        return True
    return Path(f"/proc/{pid}").is_dir() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_the_worker_starts_the_process_and_kills_it_when_asked(recompute_engine_path, tiny_model):
    with remote.Worker("cpu", memory_bytes=4 * 2**30) as worker:
        worker.request({"op": "load", "engine": worker.readable(recompute_engine_path)}, what="import")
        models = compile_ahead.plan(load_config(tiny_model.config_path), worker.readable(tiny_model.weight_dir),
                                    True, ["prefill"], "off", 1, "cpu")
        pid = int(worker.request({"op": "ahead"}, json.dumps(models).encode(), what="compile ahead")["pid"])
        assert _alive(pid)   # still importing torch
        worker.request({"op": "stop_ahead"}, what="compile ahead")
        assert not _alive(pid)


STAND_IN = """
import subprocess, sys, time
from pathlib import Path
print("stand-in: the plan is here", flush=True)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
Path(sys.argv[1] + ".pids").write_text(f"{child.pid}")
time.sleep(120)
"""


@pytest.fixture
def in_process_worker(tmp_path, monkeypatch):
    """evaluator.worker.Worker in this process (no jail), its compile-ahead process a stand-in that
    starts a child of its own (as Triton's threads start ptxas) and sleeps."""
    import socket
    from evaluator import worker as worker_mod
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    monkeypatch.setattr(worker_mod, "AHEAD_SCRIPT", str(script))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))   # where the worker writes the process's request
    ours, theirs = socket.socketpair()
    worker = worker_mod.Worker(ours)
    worker.engine_path = "engine.py"
    yield worker, theirs
    worker.stop_ahead()


def _started(worker, tmp_path) -> tuple[int, int]:
    """The stand-in's pid and its child's, once it has started one."""
    pid = int(worker.ahead({}, b"[]")["pid"])
    for _ in range(600):
        found = list(tmp_path.glob("compile-ahead-*.json.pids"))
        if found and found[0].read_text():
            return pid, int(found[0].read_text())
        time.sleep(0.05)
    raise AssertionError("the stand-in never started its child")


@pytest.mark.parametrize("stop", ["stop_ahead", "arm", "exit"])
def test_the_process_and_what_it_started_are_killed_before_a_timing(in_process_worker, tmp_path, stop):
    from evaluator import channel
    worker, judge_end = in_process_worker
    pid, grandchild = _started(worker, tmp_path)
    assert _alive(pid) and _alive(grandchild)
    if stop == "stop_ahead":
        assert "stand-in: the plan is here" in worker.stop_ahead()["said"]   # for the verdict's log
    elif stop == "arm":   # a timed trace's arm request (on CPU), as the judge sends it
        vocab = 8
        worker.arm({"device": "cpu", "vocab": vocab, "rows": 1,
                    "ops": [{"kind": "decode", "ids": [0], "lengths": []}]},
                   torch.zeros(2, vocab, dtype=torch.int64).numpy().tobytes())
    else:
        channel.send(judge_end, {"op": "exit"})
        worker.serve()
    for _ in range(100):   # the grandchild is reparented when its parent dies: give init a moment to reap it
        if not _alive(grandchild):
            break
        time.sleep(0.05)
    assert not _alive(pid) and not _alive(grandchild)


def test_a_process_that_cannot_start_costs_the_verdict_nothing(in_process_worker, monkeypatch):
    worker, _ = in_process_worker

    def refuse(*args, **kwargs):
        raise OSError(11, "Resource temporarily unavailable")
    monkeypatch.setattr(subprocess, "Popen", refuse)
    answer = worker.ahead({}, b"[]")
    assert answer["pid"] is None and "Resource temporarily unavailable" in answer["error"]
    assert worker.stop_ahead() == {}


def test_a_pass_ended_by_any_exception_still_starts_the_compiles_it_asked_for():
    """Leaving AsyncCompileMode waits for every compile asked: one held, never started, would hang it."""
    executor = compile_ahead.Deferred(1)
    held = executor.submit(lambda: "compiled")

    class Engineless:
        @staticmethod
        def create_engine(*_):
            raise SystemExit("the engine's code exited")

    class Mode:
        raw_futures = [held]

    with pytest.raises(SystemExit):
        compile_ahead.go_through(torch, Engineless, [{"name": "m", "config": {}, "weight_dir": "/w", "calls": []}],
                                 Mode, executor, "/tmp", log=lambda line: None)
    assert held.result(timeout=30) == "compiled" and not executor.held
    executor.shutdown()


def test_a_real_model_too_large_for_a_second_copy_is_left_out(tiny_model):
    config = load_config(tiny_model.config_path)
    weights = compile_ahead.folder_bytes(str(tiny_model.weight_dir))
    kept = compile_ahead.plan(config, str(tiny_model.weight_dir), True, [], "quick", 1, "cuda", weight_limit=weights)
    dropped = compile_ahead.plan(config, str(tiny_model.weight_dir), True, [], "quick", 1, "cuda",
                                 weight_limit=weights - 1)
    assert kept[0]["name"] == "target" and [m["name"] for m in dropped] == [m["name"] for m in kept[1:]]
    assert compile_ahead.limit(8 * 2**30, 80 * 2**30) == 2 * 2**30
    assert compile_ahead.limit(100 * 2**30, 80 * 2**30) == int(80 * 2**30 * compile_ahead.MEMORY_FRACTION / 2)


def test_the_judge_stops_the_process_after_the_checks_and_before_any_timing(tiny_model, recompute_engine_path,
                                                                            monkeypatch):
    """The judge's requests in order, with compiling ahead on for the CPU: ahead once the engine is
    loaded, stop_ahead after the stress suite, before the first timed trace is armed; and also in a
    verdict with no benchmark, whose worker cache is then counted and merged."""
    from evaluator import evaluate
    monkeypatch.setattr(evaluate, "AHEAD_DEVICES", ("cuda", "cpu"))
    sent: list[str] = []
    original = remote.Worker.exchange
    monkeypatch.setattr(remote.Worker, "exchange",
                        lambda self, header, *a, **k: (sent.append(header["op"]), original(self, header, *a, **k))[1])
    for benchmark in (True, False):
        sent.clear()
        result = evaluate.evaluate(recompute_engine_path, tiny_model.config_path, tiny_model.weight_dir, "cpu",
                                   stress="quick", cases=["prefill"], warmup=0, repeat=1, benchmark=benchmark,
                                   bandwidth_gbs=100.0, peak_tflops=1.0)
        assert result["status"] == "passed", result["error"]
        assert sent.count("ahead") == 1 and sent.count("stop_ahead") == 1
        assert sent.index("load") < sent.index("ahead") < sent.index("call")
        if benchmark:   # (the worker's round trip, measured before the load, arms empty traces)
            assert sent.index("stop_ahead") < sent.index("arm", sent.index("load"))
        else:   # the stress suite's checked calls were the verdict's last
            assert sent.index("stop_ahead") > len(sent) - 1 - sent[::-1].index("call")
    sent.clear()   # --compile-ahead off: the A/B switch
    result = evaluate.evaluate(recompute_engine_path, tiny_model.config_path, tiny_model.weight_dir, "cpu",
                               stress="off", cases=["prefill"], warmup=0, repeat=1, benchmark=False,
                               compile_ahead=False)
    assert result["status"] == "passed" and "ahead" not in sent and "stop_ahead" not in sent


def test_the_worker_refuses_to_compile_ahead_before_a_load():
    with remote.Worker("cpu", memory_bytes=4 * 2**30) as worker:
        with pytest.raises(Exception, match="compile ahead before load"):
            worker.request({"op": "ahead"}, b"[]", what="compile ahead")


AS_IF_ON_CUDA = """
import contextlib, sys, types
sys.path.insert(0, {repo!r})
import torch
torch.cuda.is_available = lambda: True
torch.cuda.set_per_process_memory_fraction = lambda fraction: None
try:
    import triton.runtime.jit
except ImportError:   # a CPU build of torch: a Triton with nothing in it
    for name in ("triton", "triton.runtime", "triton.runtime.jit"):
        sys.modules[name] = types.ModuleType(name)
    sys.modules["triton.runtime.jit"].KernelInterface = type("KernelInterface", (), {{}})
from evaluator import compile_ahead
compile_ahead.dry = lambda torch: (contextlib.nullcontext(), compile_ahead.Deferred(1))
sys.exit(compile_ahead.main())
"""


def test_the_process_reads_its_request_and_loads_the_engine_it_names(recompute_engine_path, tiny_model, tmp_path):
    """The real process as if on CUDA (a Triton stand-in where there is none): it reads the request,
    says when it was ready, and loads the engine (the recompute engine has no Triton kernel: nothing
    to compile)."""
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"engine": str(recompute_engine_path), "models": compile_ahead.plan(
        load_config(tiny_model.config_path), str(tiny_model.weight_dir), True, [], "off", 1, "cpu")}))
    script = tmp_path / "as_if_on_cuda.py"
    script.write_text(AS_IF_ON_CUDA.format(repo=str(REPO)))
    done = subprocess.run([sys.executable, "-I", str(script), str(request)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.index("ready") < done.stdout.index("defines no Triton kernel"), done.stdout


def test_without_cuda_the_process_says_so_and_exits_cleanly(recompute_engine_path, tiny_model, tmp_path):
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"engine": str(recompute_engine_path), "models": compile_ahead.plan(
        load_config(tiny_model.config_path), str(tiny_model.weight_dir), True, [], "off", 1, "cpu")}))
    done = _run_ahead(request, {**os.environ, "CUDA_VISIBLE_DEVICES": ""}, 120)
    assert done.returncode == 0 and "nothing to do here" in done.stdout


def _run_ahead(request: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """The process as the worker starts it, on its request."""
    return subprocess.run([sys.executable, "-I", str(REPO / "evaluator" / "compile_ahead.py"), str(request)],
                          capture_output=True, text=True, timeout=timeout, env=env)


# ---- on CUDA ----

PROBE = """
import os, sys, torch
sys.path.insert(0, {repo!r})
from evaluator.common import load_config, load_engine_module
from evaluator.test_correctness import run_public_sequence
module = load_engine_module({engine!r})
config = load_config({config!r})
run_public_sequence(module, config, {weights!r}, "cuda")
"""


def _entries(cache: Path) -> set[str]:
    return {p.name for p in cache.iterdir()} if cache.is_dir() else set()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernels_compiled_ahead_are_the_ones_the_public_sequence_then_finds(tmp_path):
    """The library's engine on the public config: the process compiles its kernels into a cache,
    then the real public sequence (a fresh process on that cache, results checked against the
    reference) compiles almost nothing of its own."""
    from agent.plan import Plan
    from agent.render import render_engine
    from agent.search import PREFERRED
    from evaluator.slots import SLOTS
    engine = tmp_path / "engine.py"
    engine.write_text(render_engine(Plan("paged", {**{s: "torch" for s in SLOTS}, **PREFERRED, "linear": "triton"}), {}))
    from evaluator.weights import random_weights, save_weights
    config_path, weights = REPO / "target" / "model_config.json", tmp_path / "weights"
    weights.mkdir()
    save_weights(random_weights(load_config(config_path)), weights / "model.pt")
    cache = tmp_path / "cache"
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache)}
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"engine": str(engine), "models": compile_ahead.plan(
        load_config(config_path), str(weights), True, [], "off", 1, "cuda")}))
    start = time.perf_counter()
    ahead = _run_ahead(request, env, 300)
    assert ahead.returncode == 0 and "done in" in ahead.stdout, ahead.stdout + ahead.stderr
    compiled_ahead = _entries(cache)
    print(f"compiled ahead: {len(compiled_ahead)} entries in {time.perf_counter() - start:.1f} s")
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE.format(repo=str(REPO), engine=str(engine), config=str(config_path), weights=str(weights)))
    real = subprocess.run([sys.executable, str(probe)], capture_output=True, text=True, timeout=300, env=env)
    assert real.returncode == 0, real.stdout + real.stderr
    new = _entries(cache) - compiled_ahead
    names = sorted(f.name for entry in new for f in (cache / entry).iterdir() if not f.name.startswith("__grp__"))
    assert len(compiled_ahead) >= 20 and len(new) <= len(compiled_ahead) // 10, \
        f"{len(compiled_ahead)} ahead, {len(new)} after: {names}\n{ahead.stdout}"
