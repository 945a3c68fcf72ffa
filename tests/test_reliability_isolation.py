"""Isolation (issue #6): a candidate that hangs, crashes, exits, floods its output, grabs memory,
forges its verdict or faults the GPU costs only itself. Each goes through the real judge and
the real evaluator on a tiny model (docs/reliability.md lists them)."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

from agent import judge as judge_mod
from agent.judge import JudgeSettings, judge

from tests.fixtures.broken_engines import broken_source

# The quickest verdict the evaluator gives: the public sequence and one short timing.
QUICK = {"stress": "off", "cases": "prefill", "warmup": 0, "repeat": 1}
HANG_TIMEOUT_SECONDS = 8.0      # start-up and the public sequence fit in it; the hang does not end
SMALL_CAP = 2 * 2**30           # below the 4 GiB hogs_memory asks for


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
    assert HANG_TIMEOUT_SECONDS <= elapsed < HANG_TIMEOUT_SECONDS + 3


@pytest.mark.parametrize("name,message", [
    ("segfaults", "evaluator exited -11 without a verdict"),
    ("exits_at_once", "evaluator exited 0 without a verdict"),
])
def test_a_dying_evaluator_is_a_crash(name, message, recompute_source, tmp_path, tiny_model):
    result = judge_fault(name, recompute_source, tmp_path, tiny_model)
    assert (result.status, result.error_kind) == ("failed", "crash")
    assert message in result.error
    assert json.loads((tmp_path / "out" / "result.json").read_text())["error_kind"] == "crash"


def test_a_forged_verdict_is_not_believed(recompute_source, tmp_path, tiny_model):
    result = judge_fault("forges_verdict", recompute_source, tmp_path, tiny_model)
    assert (result.status, result.error_kind) == ("failed", "crash")
    assert "without a verdict" in result.error  # the forgery was refused, then the candidate left


def test_no_candidate_code_runs_after_the_verdict(recompute_source, tmp_path, tiny_model):
    """An atexit handler would run after the sandbox is off; the evaluator leaves without them."""
    wrong = recompute_source.replace("for rid in request_ids])", "for rid in request_ids]) * 2")
    engine = tmp_path / "engine.py"
    engine.write_text(broken_source("forges_verdict_at_exit", wrong))
    result = judge(engine, tmp_path / "out", 60.0, settings(tiny_model))
    assert (result.status, result.error_kind) == ("failed", "wrong_result")
    assert json.loads((tmp_path / "out" / "result.json").read_text())["status"] == "failed"


def test_fifty_megabytes_of_output_cost_nothing(recompute_source, tmp_path, tiny_model):
    result = judge_fault("prints_50mb", recompute_source, tmp_path, tiny_model)
    assert result.passed, result.error
    kept = (tmp_path / "out" / "stdout.txt").read_text()
    assert kept.startswith("[judge: the first") and len(kept) < judge_mod.KEPT_OUTPUT_BYTES + 100


def test_endless_output_is_killed_at_the_cap(recompute_source, tmp_path, tiny_model, monkeypatch):
    monkeypatch.setattr(judge_mod, "OUTPUT_CAP_BYTES", 16 * 2**20)
    result = judge_fault("prints_forever", recompute_source, tmp_path, tiny_model)
    assert (result.status, result.error_kind) == ("failed", "crash")
    assert "printed more than 16 MiB" in result.error
    assert (tmp_path / "out" / "stdout.txt").stat().st_size < judge_mod.KEPT_OUTPUT_BYTES + 100


def test_memory_cap_on_cpu_turns_a_huge_allocation_into_a_runtime_error(recompute_source, tmp_path, tiny_model):
    capped = judge_fault("hogs_memory", recompute_source, tmp_path / "capped", tiny_model, memory_bytes=SMALL_CAP)
    assert (capped.status, capped.error_kind) == ("failed", "runtime_error")
    assert "can't allocate memory" in capped.error
    uncapped = judge_fault("hogs_memory", recompute_source, tmp_path / "uncapped", tiny_model,
                           memory_bytes=2**45)  # the same engine passes when the cap is out of reach
    assert uncapped.passed, uncapped.error


def test_resident_memory_watch_kills_an_evaluator_past_the_cap(tmp_path, tiny_model):
    """The CUDA path (no address-space limit there), driven by a stand-in evaluator on the CPU."""
    script = tmp_path / "fake_python"
    script.write_text(f"#!{sys.executable}\nimport time\nhog = bytearray(512 * 2**20)\ntime.sleep(30)\n")
    script.chmod(0o755)
    start = time.monotonic()
    result = judge(tmp_path / "engine.py", tmp_path / "out", 30.0,
                   JudgeSettings(str(script), tmp_path / "c.json", tmp_path, "cuda", 0, memory_bytes=256 * 2**20))
    assert (result.status, result.error_kind) == ("failed", "crash")
    assert "more than 0.2 GiB of memory" in result.error and time.monotonic() - start < 15


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
