"""Isolation (issues #6, 20): a candidate that hangs, crashes, exits, floods its output, grabs
memory, forges its verdict or faults the GPU costs only itself. Each goes through the real judge
(agent/judge.py) and the real evaluator, whose confined worker runs the candidate, on a tiny
model (docs/reliability.md lists them; tests/test_judge_attacks.py attacks the worker's walls)."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

from agent import judge as judge_mod
from agent.judge import JudgeSettings, judge
from evaluator import isolation, remote, sweep
from evaluator.common import EvalFailure

from tests.fixtures.broken_engines import broken_source

# The quickest verdict the evaluator gives: the public sequence and one short timing.
QUICK = {"stress": "off", "cases": "prefill", "warmup": 0, "repeat": 1,
         "bandwidth_gbs": 100.0, "peak_tflops": 1.0}   # the floor is not under test here: no measuring
HANG_TIMEOUT_SECONDS = 8.0      # start-up and the public sequence fit in it; the hang does not end
KILL_SLACK_SECONDS = 15.0       # killing and sweeping the worker, on a loaded machine
SMALL_CAP = 2**30               # below the 1.5 GiB hogs_memory holds
FILE_SIZE_LIMIT_MIB = isolation.FILE_SIZE_LIMIT // 2**20


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # tiny models: a second thread only adds overhead
    monkeypatch.setattr(judge_mod, "TERM_GRACE_SECONDS", 0.5)


def settings(model, device: str = "cpu", **changes) -> JudgeSettings:
    return JudgeSettings(sys.executable, model.config_path, model.weight_dir, device, 0, **{**QUICK, **changes})


def judge_fault(name: str, recompute_source: str, tmp_path: Path, model, timeout: float = 60.0, **changes):
    tmp_path.mkdir(parents=True, exist_ok=True)
    engine = tmp_path / "engine.py"
    engine.write_text(broken_source(name, recompute_source) if name != "recompute" else recompute_source)
    return judge(engine, tmp_path / "out", timeout, settings(model, **changes))


def test_a_hang_is_killed_at_its_timeout(recompute_source, tmp_path, tiny_model):
    start = time.monotonic()
    result = judge_fault("hangs", recompute_source, tmp_path, tiny_model, timeout=HANG_TIMEOUT_SECONDS)
    elapsed = time.monotonic() - start
    assert (result.status, result.error_kind) == ("failed", "timeout")
    assert HANG_TIMEOUT_SECONDS <= elapsed < HANG_TIMEOUT_SECONDS + KILL_SLACK_SECONDS


@pytest.mark.parametrize("name", ["segfaults", "exits_at_once"])
def test_a_dying_worker_is_a_crash_verdict(name, recompute_source, tmp_path, tiny_model):
    """The candidate's process dies (SIGSEGV, os._exit): the evaluator, a process of its own, writes
    the crash verdict (with the exit code when the worker was reaped before its channel's end was
    seen)."""
    result = judge_fault(name, recompute_source, tmp_path, tiny_model)
    assert (result.status, result.stage, result.error_kind) == ("failed", "public", "crash")
    assert "the worker" in result.error
    assert json.loads((tmp_path / "out" / "result.json").read_text())["error_kind"] == "crash"


def _writes_the_verdict(source: str, out: Path) -> str:
    """An escape from tests/fixtures/broken_engines.py aimed at `out` (the worker's command line has
    no --out to read it from)."""
    return source.replace('"--out" in sys.argv', "True").replace('sys.argv[sys.argv.index("--out") + 1]',
                                                               repr(str(out)))


def test_a_forged_verdict_is_not_believed(recompute_source, tmp_path, tiny_model):
    """`forges_verdict` writes a passing result.json, then os._exit(0): the write is refused (the
    worker's own uid) or overwritten, and the judge's verdict is the crash."""
    out = tmp_path / "out" / "result.json"
    engine = tmp_path / "engine.py"
    engine.write_text(_writes_the_verdict(broken_source("forges_verdict", recompute_source), out))
    result = judge(engine, out.parent, 60.0, settings(tiny_model))
    assert (result.status, result.stage, result.error_kind) == ("failed", "import", "crash")
    assert "the worker" in result.error
    assert json.loads(out.read_text())["status"] == "failed"


def test_no_candidate_code_runs_after_the_verdict(recompute_source, tmp_path, tiny_model):
    """An atexit handler writing a passing verdict never runs: the worker leaves with os._exit, or is
    killed."""
    out = tmp_path / "out" / "result.json"
    wrong = recompute_source.replace("for rid in request_ids])", "for rid in request_ids]) * 2")
    engine = tmp_path / "engine.py"
    engine.write_text(_writes_the_verdict(broken_source("forges_verdict_at_exit", wrong), out))
    result = judge(engine, out.parent, 60.0, settings(tiny_model))
    assert (result.status, result.error_kind) == ("failed", "wrong_result")
    assert json.loads(out.read_text())["status"] == "failed"


def test_fifty_megabytes_of_output_cost_nothing(recompute_source, tmp_path, tiny_model):
    """The worker's output goes to its own log, of which the judge reads a tail only on a crash."""
    result = judge_fault("prints_50mb", recompute_source, tmp_path, tiny_model)
    assert result.passed, result.error
    for name in ("stdout.txt", "stderr.txt"):
        assert (tmp_path / "out" / name).stat().st_size < 100_000


def test_endless_output_is_stopped_at_the_file_size_limit(recompute_source, tmp_path, tiny_model):
    """1 MB prints without end: the worker's log reaches its file-size limit and the next print
    fails inside the engine (runtime_error); the log goes with the worker's folder."""
    result = judge_fault("prints_forever", recompute_source, tmp_path, tiny_model)
    assert (result.status, result.stage, result.error_kind) == ("failed", "public", "runtime_error")
    assert "File too large" in result.error
    assert f"file size {FILE_SIZE_LIMIT_MIB} MiB" in result.isolation
    for name in ("stdout.txt", "stderr.txt"):
        assert (tmp_path / "out" / name).stat().st_size < 100_000
    assert not sweep.stale_jails()   # its judge is gone: so must its jail be (others' live jails may exist)


def test_memory_cap_fails_a_huge_allocation_naming_the_cap(recompute_source, tmp_path, tiny_model):
    """hogs_memory holds 1.5 GiB under a 1 GiB cap: with a CPU build of torch the address-space limit
    refuses the allocation (runtime_error, the limit named in the verdict's layers); with a CUDA
    build the judge watches resident memory and kills the worker (crash, the cap named). The same
    engine passes with the cap out of reach."""
    capped = judge_fault("hogs_memory", recompute_source, tmp_path / "capped", tiny_model, memory_bytes=SMALL_CAP)
    assert capped.status == "failed" and capped.error_kind in ("runtime_error", "crash"), capped.error
    if capped.error_kind == "runtime_error":
        assert "can't allocate memory" in capped.error and "address space 1.0 GiB" in capped.isolation
    else:
        assert "more than 1.0 GiB of memory (the cap)" in capped.error
    uncapped = judge_fault("hogs_memory", recompute_source, tmp_path / "uncapped", tiny_model,
                           memory_bytes=2**45)
    assert uncapped.passed, uncapped.error


HOLDS_RESIDENT_MEMORY = "import time\nhog = b'x' * (3 << 29)\ntime.sleep(600)\ndef create_engine(*args):\n    pass\n"


def test_resident_memory_watch_kills_a_worker_past_the_cap(tmp_path, monkeypatch):
    """The CUDA build's path (no address-space limit there; forced here on a CPU build): a worker whose
    resident memory passes the cap is killed while the judge waits for its answer."""
    monkeypatch.setattr(isolation, "_torch_is_cpu_build", lambda: False)
    engine = tmp_path / "engine.py"
    engine.write_text(HOLDS_RESIDENT_MEMORY)
    start = time.monotonic()
    with remote.Worker("cpu", memory_bytes=2**30) as worker:
        assert worker.jail.spec.address_space is None
        with pytest.raises(EvalFailure, match=r"more than 1\.0 GiB of memory \(the cap\)") as failure:
            worker.request({"op": "load", "engine": worker.readable(engine)}, what="import")
    assert failure.value.kind == "crash" and time.monotonic() - start < 300   # killed, not waited out


ILLEGAL_ADDRESS_KERNEL = '''
import triton
import triton.language as tl


@triton.jit
def _store_far_away(ptr):
    tl.store(ptr + (1 << 40), 1.0)


def _fault(device):
    x = torch.zeros(16, device=device)
    _store_far_away[(1,)](x)
'''


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_illegal_address_costs_only_the_candidate(recompute_source, tmp_path, tiny_model):
    faulty = recompute_source.replace("\nclass Engine:\n", ILLEGAL_ADDRESS_KERNEL + "\n\nclass Engine:\n").replace(
        "        for rid, ids in zip(request_ids, input_ids):\n",
        "        _fault(self.device)\n        for rid, ids in zip(request_ids, input_ids):\n")
    engine = tmp_path / "faulty.py"
    engine.write_text(faulty)
    result = judge(engine, tmp_path / "faulty", 120.0, settings(tiny_model, "cuda"))
    assert result.status == "failed" and result.error_kind in ("runtime_error", "crash")
    after = judge_fault("recompute", recompute_source, tmp_path, tiny_model, device="cuda")
    assert after.passed, after.error


def test_a_jail_closing_in_another_thread_leaves_the_evaluator_beside_it_alone():
    """The agent judges a candidate while a model episode's unit check closes its jail, which
    sweeps the orphans it left: the evaluator, a child started on purpose, is not one of them
    (it was killed and reaped, and its Popen read "exited 0 without a verdict", on the H100);
    a stray child, what an orphan re-parented to the agent looks like, still is."""
    import subprocess
    import threading
    evaluator = sweep.start_child(lambda: subprocess.Popen(["sleep", "60"]))
    try:
        def unit_check():
            with isolation.Jail("cpu"):
                stray.append(subprocess.Popen(["sleep", "60"]))
        stray: list[subprocess.Popen] = []
        thread = threading.Thread(target=unit_check)
        thread.start()
        thread.join(timeout=60)
        assert evaluator.poll() is None, "the jail's sweep killed a child started on purpose"
        with pytest.raises(ProcessLookupError):
            sweep.os.kill(stray[0].pid, 0)   # killed and reaped by the sweep
    finally:
        evaluator.kill()
        evaluator.wait()
        sweep.forget_child(evaluator.pid)


def test_a_gpu_worker_gets_libgomps_own_wait_policy_and_a_cpu_worker_sleeping_threads(tmp_path, monkeypatch):
    """The judge's own OMP_WAIT_POLICY=PASSIVE default (QUIET_THREADS) reaches a CPU worker, where
    spinning waiters beside a busy judge took its cores, and not a GPU worker, where each small
    parallel region of an engine's host work paid ~50 us to wake them inside the clock; a
    caller's own choice reaches both."""
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setattr(isolation, "_DEFAULTED", set())
    isolation.quiet_threads()   # as the judge does at its start
    assert isolation.worker_env(tmp_path, "cpu")["OMP_WAIT_POLICY"] == "PASSIVE"
    assert "OMP_WAIT_POLICY" not in isolation.worker_env(tmp_path, "cuda")
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")   # the caller's
    monkeypatch.setattr(isolation, "_DEFAULTED", set())
    isolation.quiet_threads()
    assert isolation.worker_env(tmp_path, "cpu")["OMP_WAIT_POLICY"] == "ACTIVE"
    assert isolation.worker_env(tmp_path, "cuda")["OMP_WAIT_POLICY"] == "ACTIVE"


def test_a_gpu_worker_leaves_the_judge_a_core_unless_the_caller_chose(tmp_path, monkeypatch):
    """A GPU worker's torch threads leave JUDGE_CORES to the judge, whose thread spins through a
    timed trace; a caller's OMP_NUM_THREADS reaches both kinds of worker as it is."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.setattr(isolation.os, "sched_getaffinity", lambda pid: set(range(32)))   # 2 threads a core
    monkeypatch.setattr(torch, "get_num_threads", lambda: 16)                           # torch's: a core each
    assert isolation.worker_env(tmp_path, "cuda")["OMP_NUM_THREADS"] == str(16 - isolation.JUDGE_CORES)
    assert "OMP_NUM_THREADS" not in isolation.worker_env(tmp_path, "cpu")
    monkeypatch.setattr(isolation.os, "sched_getaffinity", lambda pid: {0})
    assert isolation.worker_env(tmp_path, "cuda")["OMP_NUM_THREADS"] == "1"
    monkeypatch.setenv("MKL_NUM_THREADS", "5")   # torch reads it before OMP_NUM_THREADS
    assert "OMP_NUM_THREADS" not in isolation.worker_env(tmp_path, "cuda")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert isolation.worker_env(tmp_path, "cuda")["OMP_NUM_THREADS"] == "3"
    assert isolation.worker_env(tmp_path, "cpu")["OMP_NUM_THREADS"] == "3"
