"""The stress suite accepts a correct engine and rejects each named fault (issue #2)."""
from __future__ import annotations

import random
import threading
import time
import subprocess
import sys

import pytest
import torch

from evaluator.common import REPO_ROOT, compute_dtype
from evaluator.reference_model import ReferenceModel
from evaluator.remote import RemoteModule
from evaluator.common import Tolerance
from evaluator.noise import judge_margin
from evaluator.stress import (JUDGE_MARGIN, MAX_SHRINKS, NORM_SPREAD, SCALE_STEP, judge_safe_weights,
                              run_stress, stress_models)
from evaluator.traces import (DECODE, FULL, PREFILL, QUICK, STRESS_SCENARIOS, Contexts, churn_scenario)
from evaluator.weights import TOY_SCALE, random_weights

from tests.conftest import SINGLE_THREAD_ENV
from tests.fixtures.broken_engines import BROKEN, broken_source

pytestmark = pytest.mark.usefixtures("single_thread")


def test_recompute_engine_passes_quick_stress(recompute_engine_path, test_seed):
    report = run_stress(recompute_engine_path, "cpu", seed=test_seed, quick=True)
    assert report.failed == 0, report.first_failure
    assert report.passed >= 12 and report.summary() == f"{report.passed} passed, 0 failed"
    assert report.to_dict()["max_abs_err"] == 0.0  # the recompute engine mirrors the reference op for op


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_stress_rejects_each_fault(name, recompute_source, write_engine, test_seed):
    report = run_stress(write_engine(broken_source(name, recompute_source)), "cpu", seed=test_seed,
                        quick=True, fail_fast=True)
    failure = report.first_failure
    assert failure is not None, f"{name} passed the stress suite (seed {test_seed})"
    assert failure.error_kind == "wrong_result" and "max abs err" in failure.error
    assert report.to_dict()["worst_margin"] < 0


def test_cli_prints_one_line_per_case_and_exits_by_verdict(recompute_source, write_engine, test_seed):
    def run(source: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(REPO_ROOT / "evaluator/stress.py"), "--engine",
                               str(write_engine(source)), "--device", "cpu", "--seed", str(test_seed),
                               "--quick", "--fail-fast"], capture_output=True, env=SINGLE_THREAD_ENV, text=True)
    bad = run(broken_source("sorted_rows", recompute_source))
    lines = bad.stdout.strip().splitlines()
    assert bad.returncode == 1 and lines[-1] == "0 passed, 1 failed", bad.stdout + bad.stderr
    assert lines[1].startswith("FAIL ") and "margin" in lines[1] and "request" in lines[2]


@pytest.mark.parametrize("quick", [True, False])
def test_models_cover_the_promised_variety(quick, test_seed):
    models = stress_models(random.Random(test_seed), quick, "cpu")
    configs = [m.config for m in models]
    kv = {(c["num_attention_heads"], c["num_key_value_heads"]) for c in configs}
    assert any(h == k for h, k in kv) and any(k == 1 for h, k in kv) and any(1 < k < h for h, k in kv)
    assert {c["torch_dtype"] for c in configs} >= {"float16", "bfloat16", "bf16"}
    assert any(c.get("head_dim", 0) * c["num_attention_heads"] != c["hidden_size"] for c in configs)
    assert any("rope_theta" not in c for c in configs)
    assert max(c["vocab_size"] for c in configs) == 32000
    assert all(1 <= c["num_hidden_layers"] <= 4 for c in configs)
    assert all(m.scale > TOY_SCALE for m in models)
    long_prompt = [m for m in models if "long_prompt" in m.scenarios]
    assert len(long_prompt) == (1 if quick else len(models))


def test_cpu_stress_weights_give_logits_of_order_one_to_ten(test_seed):
    """Large enough that a wrong RoPE or bf16 rounding is far outside the tolerance, small
    enough not to saturate."""
    gen = torch.Generator().manual_seed(test_seed)
    for m in stress_models(random.Random(test_seed), True, "cpu"):
        ref = ReferenceModel(m.config, random_weights(m.config, m.weight_seed, m.scale, NORM_SPREAD), "cpu")
        logits = ref.last_logits(torch.randint(0, m.config["vocab_size"], (40,), generator=gen))
        assert 1.0 < logits.abs().max().item() < 30.0, m.name


def test_half_precision_scales_stay_nearer_the_toy_init(test_seed, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cpu = stress_models(random.Random(test_seed), True, "cpu")
    gpu = stress_models(random.Random(test_seed), True, "cuda")
    for a, b in zip(cpu, gpu):
        assert a.config == b.config and b.scale < a.scale
        if compute_dtype(b.config, "cuda") == torch.bfloat16:
            k = b.config["hidden_size"] * b.scale**2
            assert k <= 0.1 or b.scale <= 1.2 * TOY_SCALE


def test_a_random_model_shrinks_until_the_judge_is_within_its_margin_of_fp32(test_seed):
    """Where the judge in bf16 is far from fp32 (weights well above the toy init), the scale
    shrinks step by step until it is not; the real margin (judge_margin, bf16 on the CPU) of the
    weights handed back is then within JUDGE_MARGIN, and the same model gives the same weights."""
    model = stress_models(random.Random(test_seed), True, "cpu")[0]
    model = type(model)(model.name, model.config, 0.08, model.weight_seed, model.trace_seed, model.scenarios)
    bf16 = lambda *args: judge_margin(*args, dtype=torch.bfloat16)  # noqa: E731
    lines = []
    weights = judge_safe_weights(model, "cpu", Tolerance(), lines.append, margin_of=bf16)
    assert 1 <= len(lines) <= MAX_SHRINKS and all("scale x" in line for line in lines)
    assert bf16(model.config, weights, "cpu", Tolerance(), model.trace_seed) >= JUDGE_MARGIN
    shrunk = 0.08 * SCALE_STEP ** len(lines)
    assert torch.equal(weights["lm_head.weight"],
                       random_weights(model.config, model.weight_seed, shrunk, NORM_SPREAD)["lm_head.weight"])
    again = judge_safe_weights(model, "cpu", Tolerance(), margin_of=bf16)
    assert all(torch.equal(weights[k], again[k]) for k in weights)


def test_on_the_cpu_the_judge_is_fp32_and_the_drawn_scale_stays(test_seed):
    model = stress_models(random.Random(test_seed), True, "cpu")[1]
    lines = []
    weights = judge_safe_weights(model, "cpu", Tolerance(), lines.append)
    assert not lines
    assert torch.equal(weights["lm_head.weight"],
                       random_weights(model.config, model.weight_seed, model.scale, NORM_SPREAD)["lm_head.weight"])

@pytest.mark.parametrize("size", [QUICK, FULL], ids=["quick", "full"])
def test_scenarios_are_well_formed(size, test_seed):
    """Every call's ids out of ascending order, decode only of live ids, nothing live at the
    end, a >= 1024-token prompt, and the widest batch as promised."""
    rng = random.Random(test_seed)
    widest, longest = 0, 0
    for name, build in STRESS_SCENARIOS.items():
        ctx = Contexts()
        for op in build(rng, size):
            if len(op.request_ids) > 1 and op.kind != "remove":
                assert list(op.request_ids) != sorted(op.request_ids), (name, op)
            if op.kind == DECODE:
                assert set(op.request_ids) <= ctx.lengths.keys(), (name, op)
            if op.kind == PREFILL:
                widest, longest = max(widest, len(op.request_ids)), max(longest, *op.lengths)
            ctx.apply(op)
        assert ctx.lengths == {}, name
    assert longest >= 1024 and widest == size.wide_batch
    assert FULL.wide_batch == 64


def test_churn_covers_the_lifecycle_edges(test_seed):
    trace = churn_scenario(random.Random(test_seed), QUICK)
    ctx, seen = Contexts(), set()
    reused = replaced = removed_all = unknown_removed = False
    for op in trace:
        if op.kind == PREFILL:
            reused |= any(r in seen and r not in ctx.lengths for r in op.request_ids)
            replaced |= any(r in ctx.lengths for r in op.request_ids)
            seen.update(op.request_ids)
        if op.kind == "remove":
            unknown_removed |= any(r not in seen for r in op.request_ids)
        ctx.apply(op)
        removed_all |= op.kind == "remove" and not ctx.lengths and op is not trace[-1]
    assert reused and replaced and removed_all and unknown_removed


def test_random_models_weights_are_drawn_one_model_ahead_and_an_interrupted_suite_waits_for_one_draw(
        tiny_model, test_seed, monkeypatch):
    """The judge draws a random model's weights (and its margin, ~0.5 s on a GPU) on a thread while
    the model before it runs, one model ahead: an exit in the middle (SIGTERM's, inside an engine
    call) waits for the draw under way, not for every model's (the caller kills the judge 3 s
    after SIGTERM, before its worker's jail is torn down)."""
    import evaluator.stress as stress
    drawn = []

    def slow_draw(model, device, tol):
        time.sleep(0.5)
        drawn.append(model.name)
        return {}, []
    monkeypatch.setattr(stress, "_safe_weights", slow_draw)

    class Exits(RemoteModule):   # an engine in a worker, as the judge runs one
        def __init__(self):
            pass

        def create_engine(self, *_):
            raise SystemExit(143)
    started = time.perf_counter()
    with pytest.raises(SystemExit):
        run_stress(Exits(), "cpu", seed=test_seed, quick=False,
                   target=(tiny_model.config_path, tiny_model.weight_dir))
    assert time.perf_counter() - started < 1.5 and len(drawn) <= 1, drawn


def test_an_engine_in_the_judges_process_gets_no_draw_beside_its_calls(test_seed, monkeypatch):
    """An engine in the judge's own process (the course's stress.py run on a file) is never called
    while a random model is drawn: the draw's GPU work during the engine's graph capture broke both
    on an H200 (CUDA's global capture mode). Draws are made on the calling thread, between models."""
    import evaluator.stress as stress
    drawing = threading.Event()
    draw_threads, seen_drawing = [], []

    def slow_draw(model, device, tol):
        draw_threads.append(threading.current_thread())
        drawing.set()
        time.sleep(0.05)
        drawing.clear()
        return {}, []
    monkeypatch.setattr(stress, "_safe_weights", slow_draw)

    class Fails:   # a module in this process: each model's create_engine fails, the suite goes on
        @staticmethod
        def create_engine(*_):
            seen_drawing.append(drawing.is_set())
            time.sleep(0.1)
            seen_drawing.append(drawing.is_set())
            raise RuntimeError("no engine")
    report = run_stress(Fails, "cpu", seed=test_seed, quick=True)
    assert len(report.cases) > 1 and not any(c.passed for c in report.cases)
    assert seen_drawing and not any(seen_drawing), "a draw ran beside the engine's create_engine"
    assert draw_threads and all(t is threading.main_thread() for t in draw_threads)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_random_models_that_take_a_targets_architecture_keep_their_own_shapes(arch, test_seed):
    """A random model drawn without head_dim, num_key_value_heads or rms_norm_eps, then given a
    Hugging Face target's conventions, writes out what it meant by them: its architecture's
    defaults (a Qwen3 config without head_dim is head_dim 128) would otherwise change its shapes
    under the engine, which reads them (create_engine broke on every such model on a GPU,
    thirty-sixth session)."""
    from evaluator.checkpoint import with_config_defaults
    target = {"architectures": [arch], "hidden_size": 64, "num_attention_heads": 4}
    for model in stress_models(random.Random(test_seed), quick=False, device="cpu", target_config=target):
        assert with_config_defaults(model.config) == model.config, model.name


@pytest.mark.parametrize("rope", ["rope_parameters and rope_scaling", "a base inside rope_scaling"])
def test_random_models_take_a_targets_two_rope_forms_with_their_own_base(rope, test_seed):
    """A target holding both RoPE forms (or a base inside rope_scaling), which the agent takes where
    they agree: each random model's own base goes into every form, so its config is one the
    judge and the engines take (its rope_parameters base alone beside the target's rope_scaling
    is refused as two bases)."""
    from evaluator.checkpoint import conventions, rope_parameters, rope_theta
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    target = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4}
    if rope == "a base inside rope_scaling":
        target.update(rope_theta=500000.0, rope_scaling=dict(scaling, rope_theta=500000.0))
    else:
        target.update(rope_parameters=dict(scaling, rope_theta=10000.0), rope_scaling=scaling)
    conventions(target)
    for model in stress_models(random.Random(test_seed), quick=False, device="cpu", target_config=target):
        assert conventions(model.config).rope_scaling is not None, model.name
        assert rope_theta(model.config) == rope_parameters(model.config)["rope_theta"] == \
            model.config.get("rope_theta", 10000.0), model.name
