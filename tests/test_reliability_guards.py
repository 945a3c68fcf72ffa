"""The evaluator's run-time guards, each against an engine that cheats in the way it catches
(issue #6; docs/reliability.md lists them), and the judge's worker containing the escapes the
in-process sandbox used to refuse (issue 20; tests/test_judge_attacks.py has the rest). The
engines are the recompute engine with one edit (tests/fixtures/broken_engines.py), so each is
right except for its trick."""
from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from evaluator import benchmark_throughput, isolation
from evaluator.common import COMPILE_ERROR, CRASH, REPO_ROOT, WRONG_RESULT, WrongResult, load_engine_module, \
    make_generator
from evaluator.evaluate import evaluate
from evaluator.floor import Hardware
from evaluator.guards import poison_free_device_memory
from evaluator.reference_model import ReferenceModel
from evaluator.session import CheckedSession
from evaluator.test_correctness import run_public_sequence
from evaluator.traces import QUICK, rerun_scenario

from tests.fixtures.broken_engines import broken_source

pytestmark = pytest.mark.usefixtures("single_thread")
HW = Hardware("test", 3000.0, 790.0, "flags")
# The quickest full evaluation: public sequence and one short timing.
QUICK_EVAL = {"stress": "off", "cases": ("prefill",), "warmup": 0, "repeat": 1, "device": "cpu",
              "bandwidth_gbs": 100.0, "peak_tflops": 1.0}   # the floor's hardware given: no measurement


def quick_evaluate(path, model) -> dict:
    return evaluate(path, model.config, model.weight_dir, **QUICK_EVAL)


def test_skipped_benchmark_calls_are_caught_by_the_checked_pass(recompute_source, write_engine, tiny_model,
                                                                monkeypatch):
    engine = write_engine(broken_source("skips_benchmark_calls", recompute_source))
    with pytest.raises(WrongResult, match=r"benchmark case decode \(checked pass\): step 3 decode"):
        benchmark_throughput.run_benchmark(engine, tiny_model.config, tiny_model.weight_dir, "cpu", ["decode"],
                                           warmup=0, repeat=1, hardware=HW)
    # Without the checked pass the cheat passes: its last output (step 16) is right.
    monkeypatch.setattr(benchmark_throughput, "_warm_up", lambda *args: {})   # no checked pass, no margins
    (result,) = benchmark_throughput.run_benchmark(engine, tiny_model.config, tiny_model.weight_dir, "cpu",
                                                   ["decode"], warmup=0, repeat=1, hardware=HW)
    assert result["decode_tokens"] == 128


RECORDS_PROMPTS = """

_SEEN = []   # (engine number, prompt tokens), across every engine this module makes
_real_create_engine = create_engine


def create_engine(*args, **kwargs):
    engine = _real_create_engine(*args, **kwargs)
    number = create_engine.made = getattr(create_engine, "made", -1) + 1
    prefill = engine.prefill

    def recorded(ids, inputs):
        _SEEN.extend((number, tuple(t.tolist())) for t in inputs)
        return prefill(ids, inputs)
    engine.prefill = recorded
    return engine
"""


@pytest.mark.parametrize("shared_warm_up", [False, True])
def test_no_warm_up_engine_is_handed_a_prompt_a_timed_run_then_gets(shared_warm_up, recompute_source, write_engine,
                                                                     tiny_model):
    """Every warm-up runs before any timed run: with one token stream for every case, a later case's
    warm-up had drawn the very prompts an earlier case's timed run then got, for an engine to cache
    by content at module level and replay inside the clock. Each case now has its own stream."""
    module = load_engine_module(write_engine(recompute_source + RECORDS_PROMPTS))
    cases = ["prefill", "decode128"]   # one stream for both: decode128's warm-up drew prefill's timed prompts
    benchmark_throughput.run_benchmark(module, tiny_model.config, tiny_model.weight_dir, "cpu", cases=cases,
                                       warmup=1, repeat=1, hardware=HW, seed=random.randrange(2**62),
                                       shared_warm_up=shared_warm_up)
    warm_ups = 1 if shared_warm_up else len(cases)
    warm = {prompt for number, prompt in module._SEEN if number < warm_ups}
    timed = [prompt for number, prompt in module._SEEN if number >= warm_ups and len(prompt) >= 4]
    assert timed and not [prompt for prompt in timed if prompt in warm]


def test_fresh_tokens_every_run_defeat_a_cache_keyed_by_shape(recompute_source, write_engine, tiny_model):
    """The checked pass fills the cheat's cache; the timed run (a new engine, new tokens, the same
    shapes) gets the cached logits back, and its last output is checked after timing."""
    engine = write_engine(broken_source("replays_by_shape", recompute_source))
    with pytest.raises(WrongResult, match="benchmark case prefill, last output"):
        benchmark_throughput.run_benchmark(engine, tiny_model.config, tiny_model.weight_dir, "cpu", ["prefill"],
                                           warmup=0, repeat=1, hardware=HW)


@pytest.mark.parametrize("name", ["replays_by_shape", "skips_benchmark_calls"])
def test_rerun_scenario_catches_answers_replayed_by_ids_or_shape(name, recompute_source, write_engine,
                                                                   tiny_model_large, test_seed):
    m = tiny_model_large
    module = load_engine_module(write_engine(broken_source(name, recompute_source)))
    engine = module.create_engine(m.config, str(m.weight_dir), "cpu")
    reference = ReferenceModel.load(m.config, m.weight_dir, "cpu")
    trace = rerun_scenario(random.Random(test_seed), QUICK)
    with pytest.raises(WrongResult, match="outputs differ from the reference"):
        CheckedSession(engine, reference, make_generator(test_seed, "cpu")).run(trace)


@pytest.mark.parametrize("name,message", [
    ("fills_output_late", "step 1 prefill.*outputs differ"),   # compared at return, before the next call
    ("only_first_row", "step 3 prefill.*outputs differ"),       # every row of every call compared
    ("spawns_thread", "step 1 prefill.*left 1 thread"),         # no thread outlives its call
])
def test_public_sequence_guards(name, message, recompute_source, write_engine, tiny_model):
    with pytest.raises(WrongResult, match=message):
        run_public_sequence(write_engine(broken_source(name, recompute_source)), tiny_model.config,
                            tiny_model.weight_dir, "cpu")


def test_patching_the_evaluator_in_the_worker_does_not_save_a_wrong_engine(recompute_source, write_engine,
                                                                           tiny_model):
    """`patches_evaluator` makes evaluator.session.compare always agree, in the worker: the judge
    compares in its own process, and a wrong engine (logits doubled) still fails."""
    wrong = recompute_source.replace("for rid in request_ids])", "for rid in request_ids]) * 2")
    result = quick_evaluate(write_engine(broken_source("patches_evaluator", wrong)), tiny_model)
    assert (result["status"], result["stage"], result["error_kind"]) == ("failed", "public", WRONG_RESULT)
    assert "outputs differ from the reference" in result["error"]


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the worker's own uid (the layer under test) needs root")


@needs_root
def test_the_worker_cannot_write_the_evaluators_files(recompute_source, write_engine, tiny_model):
    """`edits_evaluator` opens evaluator/guards.py for appending at import: refused by the operating
    system (the worker's own uid), so the import fails."""
    guards = REPO_ROOT / "evaluator" / "guards.py"
    before = guards.read_bytes()
    result = quick_evaluate(write_engine(broken_source("edits_evaluator", recompute_source)), tiny_model)
    assert (result["status"], result["stage"], result["error_kind"]) == ("failed", "import", COMPILE_ERROR)
    assert "PermissionError" in result["error"] and guards.read_bytes() == before


def test_the_worker_has_no_network(recompute_source, write_engine, tiny_model):
    """`opens_socket` connects, at import, to a server listening on this machine's 127.0.0.1: in the
    worker's own network namespace 127.0.0.1 is its own loopback (up, for a tensor-parallel
    engine's ranks), where nothing listens, so the connection is refused and the server sees
    nobody. It raises if it reaches the server, or sees an interface beside the loopback."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        port = server.getsockname()[1]
        source = broken_source("opens_socket", recompute_source).replace("HOST_PORT = 9", f"HOST_PORT = {port}")
        result = quick_evaluate(write_engine(source), tiny_model)
        if "no network" not in (result["isolation"] or ""):
            pytest.skip("this machine gives the worker no network namespace")
        with pytest.raises(BlockingIOError):
            server.accept()   # nobody came
    assert "its own loopback up" in result["isolation"]
    assert result["status"] == "passed", result["error"]


@needs_root
def test_a_subprocess_of_the_worker_is_confined_with_it(recompute_source, write_engine, tiny_model):
    """`runs_subprocess` starts `true` at import: harmless, it runs under the worker's uid and limits
    (tests/test_judge_attacks.py shows what such processes cannot do, and that none outlives it)."""
    result = quick_evaluate(write_engine(broken_source("runs_subprocess", recompute_source)), tiny_model)
    assert result["status"] == "passed", result["error"]


def test_a_correct_engine_passes_in_the_worker_and_the_verdict_names_its_layers(recompute_engine_path, tiny_model):
    result = quick_evaluate(recompute_engine_path, tiny_model)
    assert result["status"] == "passed", result["error"]
    layers = result["isolation"]
    assert layers.startswith("worker isolation: ") and "no new privileges" in layers and "file size" in layers
    assert ("own uid" in layers) == (os.geteuid() == 0)


def test_leaving_the_interpreter_is_a_crash_verdict(recompute_source, write_engine, tiny_model):
    """exit(0) in prefill ends the worker (SystemExit): the judge records a crash."""
    result = quick_evaluate(write_engine(broken_source("exits_interpreter", recompute_source)), tiny_model)
    assert (result["status"], result["stage"], result["error_kind"]) == ("failed", "public", CRASH)
    assert "the worker" in result["error"]


def test_an_engine_in_the_judges_process_has_its_free_memory_poisoned_before_every_call(
        recompute_source, write_engine, tiny_model, test_seed, monkeypatch):
    """The course's own test runs the engine in-process: the judge poisons its free memory before
    each call. (A worker's engine is poisoned by the worker instead, evaluator/worker.py.)"""
    import evaluator.session as session
    poisoned = []
    monkeypatch.setattr(session, "poison_free_device_memory", poisoned.append)
    m = tiny_model
    engine = load_engine_module(write_engine(recompute_source)).create_engine(m.config, str(m.weight_dir), "cpu")
    trace = rerun_scenario(random.Random(test_seed), QUICK)
    CheckedSession(engine, ReferenceModel.load(m.config, m.weight_dir, "cpu"), make_generator(test_seed, "cpu")).run(trace)
    assert poisoned == ["cpu"] * len(trace)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
def test_poison_fills_freed_device_memory_with_nan():
    block = torch.ones(1 << 20, device="cuda")
    del block
    poison_free_device_memory("cuda")
    again = torch.empty(1 << 20, device="cuda")
    assert torch.isnan(again).all()


@cuda
def test_poison_is_nan_in_every_float_dtype():
    block = torch.ones(4 << 20, dtype=torch.uint8, device="cuda")
    del block
    poison_free_device_memory("cuda")
    again = torch.empty(4 << 20, dtype=torch.uint8, device="cuda")
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        assert torch.isnan(again.view(dtype)).all(), dtype


@cuda
def test_poison_takes_cached_blocks_only_even_when_free_memory_is_fragmented():
    """600 + 700 MiB free, no block of 1 GiB: the guard must not open segments of its own, call
    after call (an earlier form opened a 1 GiB segment per call and a stress run reserved 78 GiB)."""
    a, live, b = (torch.empty(n << 20, dtype=torch.uint8, device="cuda") for n in (600, 8, 700))
    del a, b
    reserved = torch.cuda.memory_reserved()
    for _ in range(5):
        poison_free_device_memory("cuda")
    assert torch.cuda.memory_reserved() == reserved
    again = torch.empty(700 << 20, dtype=torch.uint8, device="cuda")
    assert bool((again == 0xFF).all()) and live.numel() == 8 << 20


def reads_memory_it_never_wrote(recompute_source: str) -> str:
    """The recompute engine whose decode leaves its last row as torch.empty gave it."""
    source = recompute_source.replace("""\
            self.histories[rid] = torch.cat([self.histories[rid], tokens[i:i + 1]])
        return self._logits_for(request_ids)
""", """\
            self.histories[rid] = torch.cat([self.histories[rid], tokens[i:i + 1]])
        logits = self._logits_for(request_ids)
        out = torch.empty_like(logits)
        out[:-1] = logits[:-1]
        return out
""")
    assert source != recompute_source
    return source


@cuda
def test_an_engine_reading_memory_it_never_wrote_gets_nan(recompute_source, write_engine, tiny_model):
    with pytest.raises(WrongResult, match="non-finite values"):
        run_public_sequence(write_engine(reads_memory_it_never_wrote(recompute_source)), tiny_model.config,
                            tiny_model.weight_dir, "cuda")


@cuda
def test_an_engine_in_a_worker_reading_memory_it_never_wrote_gets_nan(recompute_source, write_engine, tiny_model):
    """In the judge's worker, the worker's own poisoning is what hands the engine NaN (the judge
    poisons only an engine in its own process)."""
    result = evaluate(write_engine(reads_memory_it_never_wrote(recompute_source)), tiny_model.config,
                      tiny_model.weight_dir, "cuda", stress="off", benchmark=False)
    assert result["status"] == "failed" and "non-finite values" in result["error"], result["error"]


SIDE_STREAM_SLEEP = """\
            self.histories[rid] = torch.cat([self.histories[rid], tokens[i:i + 1]])
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(SLEEP_CYCLES)
        return self._logits_for(request_ids)
"""
SLEEP_CYCLES = 200_000_000   # about 0.1 s at GPU clocks


@cuda
def test_work_left_on_a_side_stream_is_timed(recompute_source, write_engine, tiny_model):
    """The clock stops after a device-wide synchronize, so a decode that leaves work running on
    a side stream pays for it."""
    source = recompute_source.replace("""\
            self.histories[rid] = torch.cat([self.histories[rid], tokens[i:i + 1]])
        return self._logits_for(request_ids)
""", SIDE_STREAM_SLEEP).replace("import torch\n", f"import torch\n\nSLEEP_CYCLES = {SLEEP_CYCLES}\n", 1)
    assert "_sleep" in source
    (result,) = benchmark_throughput.run_benchmark(write_engine(source), tiny_model.config, tiny_model.weight_dir,
                                                   "cuda", ["decode"], warmup=0, repeat=1, hardware=HW)
    torch.cuda.synchronize()
    start = time.perf_counter()
    torch.cuda._sleep(SLEEP_CYCLES)
    torch.cuda.synchronize()
    one_sleep_ms = (time.perf_counter() - start) * 1e3
    assert result["elapsed_ms"] >= 0.9 * one_sleep_ms  # at least the last decode's sleep was waited for


@needs_root
def test_a_worker_sees_no_process_but_its_own(recompute_source, write_engine, tiny_model):
    """Under its own uid (a root judge) the worker's /proc shows only its uid's processes: not its
    judge, not this test. A unit check's model code had watched /proc for a judge's worker and
    slowed the host only while one ran (evaluator/isolation.py _hide_others)."""
    if os.geteuid() != 0:
        pytest.skip("the worker has its own uid only under a root judge")
    probe = ("import os as _os\n"
             f"if _os.path.exists('/proc/{os.getpid()}') or _os.path.exists('/proc/%d' % _os.getppid()):\n"
             "    raise RuntimeError('sees processes of other uids')\n")
    private_proc = ("import ctypes, os; c = ctypes.CDLL(None, use_errno=True)\n"
                    "os._exit(c.unshare(0x00020000) or c.mount(None, b'/', None, 16384 | (1 << 18), None)"
                    " or c.mount(b'proc', b'/proc', b'proc', 14, b'hidepid=invisible'))")
    if subprocess.run([sys.executable, "-c", private_proc]).returncode != 0:
        pytest.skip("no /proc of its own here (no mount namespace, a container's masked /proc, or Linux < 5.8)")
    result = quick_evaluate(write_engine(probe + recompute_source), tiny_model)
    assert result["status"] == "passed", result["error"]
    assert "others' processes out of sight" in result["isolation"]
    assert os.path.exists(f"/proc/{os.getpid()}")   # the host's /proc is untouched


def test_a_device_node_of_a_gpu_the_judge_was_not_given_cannot_be_opened(recompute_source, write_engine, tiny_model,
                                                                         monkeypatch):
    """The covering of other GPUs' nodes (evaluator/isolation.py gpus_not_given), on a stand-in
    node any uid may open (in a folder any uid may enter: pytest's own are root's alone): in the
    worker it cannot be opened, outside it still can. (On a host of several GPUs:
    tests/test_judge_attacks_gpu.py.)"""
    folder = Path(tempfile.mkdtemp(prefix="stand-in-dev-"))
    os.chmod(folder, 0o755)
    node = folder / "nvidia7"
    node.write_bytes(b"")
    os.chmod(node, 0o666)
    monkeypatch.setattr(isolation, "gpus_not_given", lambda: (str(node),))
    probe = (f"import os as _os\ntry:\n    _os.close(_os.open({str(node)!r}, _os.O_RDWR))\n"
             f"    raise RuntimeError('opened the node')\nexcept PermissionError:\n    pass\n")
    unshare = "import ctypes, os; os._exit(ctypes.CDLL(None, use_errno=True).unshare(0x00020000))"   # CLONE_NEWNS
    if subprocess.run([sys.executable, "-c", unshare]).returncode != 0:
        pytest.skip("no mount namespace here")
    result = quick_evaluate(write_engine(probe + recompute_source), tiny_model)
    assert result["status"] == "passed", result["error"]
    assert f"only its judge's GPUs ({node} out of reach)" in result["isolation"]
    os.close(os.open(node, os.O_RDWR))   # the judge's own view is untouched
    shutil.rmtree(folder)
