"""evaluator.evaluate: one candidate → one EvalResult JSON (docs/design.md §2)."""
from __future__ import annotations

import json
import math
import random
import subprocess
import sys
import time

import pytest

from evaluator.benchmark_throughput import run_benchmark
from evaluator.common import REPO_ROOT
from evaluator.evaluate import evaluate, score
from evaluator.remote import TRACE_MOMENTS, WORKER_STEPS, RemoteModule, Worker, _numbers

from tests.conftest import SINGLE_THREAD_ENV
from tests.fixtures.broken_engines import broken_source

pytestmark = pytest.mark.usefixtures("single_thread")

TOP_KEYS = {"status", "stage", "error_kind", "error", "device", "public", "stress", "benchmark", "score", "seconds"}


def run_cli(engine, model, out, *extra) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "evaluator.evaluate", "--engine", str(engine), "--model-config", str(model.config_path),
         "--weight-dir", str(model.weight_dir), "--device", "cpu", "--out", str(out), *extra],
        capture_output=True, env=SINGLE_THREAD_ENV, text=True, cwd=REPO_ROOT)


def test_cli_passes_a_correct_engine(recompute_engine_path, tiny_model, tmp_path, test_seed):
    out = tmp_path / "result.json"
    proc = run_cli(recompute_engine_path, tiny_model, out, "--stress", "quick", "--cases", "prefill,decode",
                   "--warmup", "0", "--repeat", "1", "--seed", str(test_seed))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads(out.read_text())
    assert r.keys() >= TOP_KEYS
    assert (r["status"], r["stage"], r["error_kind"], r["error"], r["device"]) == ("passed", "done", None, None, "cpu")
    assert r["public"]["status"] == "passed" and r["public"]["cases"] == 6
    assert r["stress"]["failed"] == 0 and r["stress"]["passed"] > 0 and r["stress"]["seed"] == test_seed
    assert [b["case_name"] for b in r["benchmark"]] == ["prefill", "decode"]
    assert r["score"] == pytest.approx(score(r["benchmark"]))
    assert proc.stdout.startswith("passed: score")
    assert "target/churn" in proc.stderr  # the real model is stressed too
    assert r["stage_seconds"].keys() >= {"judge start", "setup", "worker", "public", "stress", "benchmark"}
    assert sum(r["stage_seconds"].values()) >= r["seconds"] * 0.99   # the judge's start-up counts too


def test_no_benchmark_judges_without_timing(recompute_engine_path, tiny_model, tmp_path):
    """--no-benchmark (the agent's FINAL: its screen timed this engine): a verdict, no benchmark, no score."""
    out = tmp_path / "result.json"
    proc = run_cli(recompute_engine_path, tiny_model, out, "--stress", "off", "--no-benchmark")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads(out.read_text())
    assert (r["status"], r["stage"], r["benchmark"], r["score"]) == ("passed", "done", None, None)
    assert r["public"]["status"] == "passed" and "benchmark" not in r["stage_seconds"]
    assert proc.stdout.startswith("passed: score untimed")


def test_a_cpu_verdict_adds_nothing_to_the_shared_triton_cache(recompute_source, write_engine, tiny_model, tmp_path):
    """Nothing compiles on a CPU: what a worker left in its Triton cache there (here, an entry laid
    out as Triton lays one out) is never merged for later workers."""
    source = recompute_source.replace("    return Engine(model_config, weight_dir, device)\n", """\
    import json, os
    entry = os.path.join(os.environ["TRITON_CACHE_DIR"], "planted")
    os.makedirs(entry, exist_ok=True)
    with open(os.path.join(entry, "k.cubin"), "wb") as f:
        f.write(b"not compiled here")
    with open(os.path.join(entry, "__grp__k.json"), "w") as f:
        json.dump({"child_paths": {"k.cubin": os.path.join(entry, "k.cubin")}}, f)
    return Engine(model_config, weight_dir, device)
""", 1)
    shared = tmp_path / "shared"
    r = evaluate(write_engine(source), tiny_model.config, tiny_model.weight_dir, "cpu", stress="off", benchmark=False,
                 triton_cache=shared, update_cache=True)
    assert r["status"] == "passed", r["error"]
    assert not shared.exists() or not any(shared.iterdir())


def test_cli_writes_the_verdict_of_a_wrong_engine(recompute_source, write_engine, tiny_model, tmp_path):
    out = tmp_path / "result.json"
    proc = run_cli(write_engine(broken_source("sorted_rows", recompute_source)), tiny_model, out)
    assert proc.returncode == 1
    r = json.loads(out.read_text())
    assert (r["status"], r["stage"], r["error_kind"]) == ("failed", "stress", "wrong_result")
    assert r["public"]["status"] == "passed" and r["benchmark"] is None and r["score"] is None
    assert "stress case" in r["error"] and "max abs err" in r["error"] and r["stress"]["failed"] == 1


def test_import_failure_is_a_compile_error(write_engine, tiny_model):
    r = evaluate(write_engine("import torch\ndef create_engine(:\n"), tiny_model.config, tiny_model.weight_dir, "cpu")
    assert (r["status"], r["stage"], r["error_kind"]) == ("failed", "import", "compile_error")
    assert "SyntaxError" in r["error"] and r["public"] is None


def test_a_raising_engine_is_a_runtime_error(recompute_source, write_engine, tiny_model):
    r = evaluate(write_engine(broken_source("raises_in_decode", recompute_source)), tiny_model.config,
                 tiny_model.weight_dir, "cpu")
    assert (r["stage"], r["error_kind"]) == ("public", "runtime_error")
    assert "decode exploded" in r["error"]


def test_patching_the_timer_in_the_worker_is_harmless(recompute_source, write_engine, tiny_model):
    """time.perf_counter = lambda: 0.0 in the candidate patches the worker's clock only: the worker
    reports 0 ms for its own run, the judge's clock (elapsed_ms) is real."""
    before = time.perf_counter
    r = evaluate(write_engine(broken_source("patches_timer", recompute_source)), tiny_model.config,
                 tiny_model.weight_dir, "cpu", stress="off", cases=["prefill"], warmup=0, repeat=1,
                 bandwidth_gbs=100.0, peak_tflops=1.0)
    assert time.perf_counter is before   # the judge's own is untouched
    assert (r["status"], r["stage"]) == ("passed", "done"), r["error"]
    (bench,) = r["benchmark"]
    assert bench["worker_runs_ms"] == [0.0]          # the patch took effect where the engine runs
    assert bench["elapsed_ms"] > 0.1 and bench["judge_clock_ms"][0] > 0.1


def test_a_timed_runs_split_covers_the_judges_clock_step_by_step(recompute_source, write_engine, tiny_model):
    """split_ms: one entry a step between TRACE_MOMENTS (the worker's token upload, calls, sync and
    digest among them), each a real duration, together the judge's whole clock."""
    r = evaluate(write_engine(recompute_source), tiny_model.config, tiny_model.weight_dir, "cpu", stress="off",
                 cases=["prefill"], warmup=0, repeat=1, bandwidth_gbs=100.0, peak_tflops=1.0)
    (bench,) = r["benchmark"]
    (split,) = bench["split_ms"]
    assert len(split) == len(TRACE_MOMENTS) - 1 and all(math.isfinite(s) and s >= 0 for s in split)
    assert sum(split) == pytest.approx(bench["judge_clock_ms"][0], rel=1e-6)
    calls = TRACE_MOMENTS.index("calls returned") - 1   # the step that ends when the calls returned
    assert split[calls] == max(split)   # on a CPU the recompute engine's calls are the time
    assert "split_cpu_ms" not in bench and "device_calls_ms" not in bench   # only a diagnosed worker's


def test_a_diagnosed_worker_reports_its_threads_cpu_time_a_step(recompute_engine_path, tiny_model):
    """Worker(diagnose=True), as scripts.gpu judge-split makes it: split_cpu_ms, the worker thread's
    CPU time in each of its own steps (WORKER_STEPS), at most the wall time of the same step; no
    device time on a CPU."""
    with Worker("cpu", diagnose=True) as worker:
        worker.request({"op": "load", "engine": worker.readable(recompute_engine_path)}, what="import")
        (bench,) = run_benchmark(RemoteModule(worker), tiny_model.config, tiny_model.weight_dir, "cpu", ["prefill"],
                                 warmup=0, repeat=1)
    (split,), (cpu,) = bench["split_ms"], bench["split_cpu_ms"]
    first = TRACE_MOMENTS.index(WORKER_STEPS[0]) - 1
    assert len(cpu) == len(WORKER_STEPS)
    assert all(0 <= c <= w * 1.001 + 0.05 for c, w in zip(cpu, split[first:])), (cpu, split)
    assert bench["device_calls_ms"] == [None]


def test_a_workers_claimed_numbers_are_read_or_dropped_never_raised_on():
    """A worker's claims (moments, CPU times, peak memory) come as JSON, which carries integers too
    large for a float: each is a finite number or NaN, and the judge does not raise on any."""
    assert _numbers([1, 2.5], 2) == [1.0, 2.5]
    for claimed in ([10**400, 1], [float("inf"), 1], [float("nan"), 1], [True, 1], ["1", 1], [1], None, {"a": 1}):
        assert all(math.isnan(x) for x in _numbers(claimed, 2)), claimed


def test_a_profiled_pass_claim_of_any_shape_is_its_layout_or_no_profile_never_raised_on():
    """slot_profile.claimed reads the worker's slot_ms: a slot given as a number, a list, a string
    or null (not the dict the pass writes) is no profile. It had raised AttributeError, and the
    verdict, passed already, was written with a crash."""
    from evaluator.slot_profile import claimed
    good = {"ms": 1.0, "calls": 2, "shapes": {"rms_norm x[1,8]": 1.0}}
    assert claimed({"slots": {"norm": good}, "total_ms": 2.0, "other_ms": 1.0})["slots"]["norm"] == good
    for entry in (5, [good], "fast", None, {**good, "calls": -1}, {**good, "shapes": [1]}):
        assert claimed({"slots": {"norm": entry}, "total_ms": 2.0, "other_ms": 1.0}) == {}, entry


def test_score_is_the_geometric_mean_of_floor_fractions():
    assert score([{"floor_fraction": 0.01}, {"floor_fraction": 1.0}]) == pytest.approx(0.1)
    assert score([{"floor_fraction": 0.5}]) == pytest.approx(0.5)
    assert score([]) is None
    assert math.isclose(score([{"floor_fraction": f} for f in (0.2, 0.2, 0.2)]), 0.2)


@pytest.mark.parametrize("module", ["evaluator.evaluate", "evaluator.resident"])
def test_help_names_the_default_memory_cap(module):
    """--help renders (a bare % in a help text made argparse raise instead)."""
    done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--memory-gb" in done.stdout and "80% of" in " ".join(done.stdout.split())


def test_the_worker_starts_before_the_judges_setup_and_goes_with_a_failing_one(recompute_engine_path, tiny_model,
                                                                              monkeypatch):
    """The worker's start (its confinement, torch) overlaps the judge's margin: by the time the
    margin is measured a worker process runs, not yet ready (the candidate not loaded). A setup
    that fails takes that worker and its jail down with the evaluation."""
    from evaluator import evaluate as evaluate_module, remote
    started: list[remote.Worker] = []
    init = remote.Worker.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        started.append(self)
    monkeypatch.setattr(remote.Worker, "__init__", spy)
    seen = []
    margin = 0.5 + random.random() / 2

    def measured(*args, **kwargs):
        seen.append([(w.proc.poll() is None, w.layers) for w in started])
        return margin
    monkeypatch.setattr(evaluate_module, "reference_margin", measured)
    r = evaluate(recompute_engine_path, tiny_model.config_path, tiny_model.weight_dir, "cpu", stress="off",
                 cases=["prefill"], warmup=0, repeat=1)
    assert r["status"] == "passed" and r["reference_margin"] == margin and r["isolation"]
    assert seen == [[(True, None)]]                         # running, its hello not yet awaited
    assert started[0].proc.poll() is not None and not started[0].jail.root.exists()

    def broken(*args, **kwargs):
        raise RuntimeError("the margin's reference ran out of memory")
    monkeypatch.setattr(evaluate_module, "reference_margin", broken)
    r = evaluate(recompute_engine_path, tiny_model.config_path, tiny_model.weight_dir, "cpu", stress="off",
                 cases=["prefill"], warmup=0, repeat=1)
    assert r["error_kind"] == "crash" and "ran out of memory" in r["error"]
    assert len(started) == 2 and started[1].proc.poll() is not None and not started[1].jail.root.exists()
