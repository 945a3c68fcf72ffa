"""The judge holds Hugging Face models in half precision to the bf16 criterion
(evaluator/hf_judge.py), the course format and fp32 runs to the fixed judge. On the CPU the
criterion path is forced (`criterion="bf16"`, the CLI's `--criterion bf16`): the engine computes
in fp32 there, and the criterion still measures the bf16 reference against fp32. GPU cases (the
paged engine in bf16 on tiny checkpoints, judged by the auto criterion) skip without CUDA."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from agent.plan import Plan, engine_params
from agent.render import render_engine
from agent.spec import load_spec
from evaluator.evaluate import evaluate
from evaluator.hf_judge import CRITERION_MARGIN, uses_bf16_criterion
from tests.hf_models import build

pytest.importorskip("transformers")

FAST = dict(stress="off", cases=("decode",), warmup=0, repeat=1)


def write_paged(spec, path, conventions=None, plan=None):
    """The paged engine for `spec` (or for other `conventions`: a known-wrong engine) at `path`."""
    plan = plan or Plan("paged", {}, {n: p.default for n, p in engine_params("paged").items()})
    path.write_text(render_engine(plan, None, conventions or spec.conventions))
    return path


def test_auto_picks_the_criterion_by_format_and_dtype(tmp_path):
    hf = {"architectures": ["LlamaForCausalLM"], "torch_dtype": "bfloat16"}
    course = {"torch_dtype": "bfloat16"}
    assert not uses_bf16_criterion(hf, "cpu")            # fp32 on the CPU: the fixed judge
    assert not uses_bf16_criterion(course, "cpu")
    assert uses_bf16_criterion(hf, "cpu", "bf16") and not uses_bf16_criterion(hf, "cpu", "course")
    assert uses_bf16_criterion(hf, "cuda") == torch.cuda.is_available()
    assert not uses_bf16_criterion(course, "cuda")       # the course judge never changes
    with pytest.raises(ValueError):
        uses_bf16_criterion(hf, "cpu", "loose")


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    model = build(tmp_path_factory.mktemp("judge") / "q2", "Qwen2ForCausalLM", seed=random.randrange(2**31),
                  dtype=torch.bfloat16)
    return load_spec(model.folder / "config.json", model.folder)


def test_forced_criterion_passes_the_paged_engine(qwen2, tmp_path):
    r = evaluate(write_paged(qwen2, tmp_path / "engine.py"), qwen2.config, qwen2.weight_dir, "cpu",
                 criterion="bf16", seed=random.randrange(2**31), **FAST)
    assert r["status"] == "passed", r["error"]
    c = r["criterion"]
    assert 0 < c["engine_error"] <= c["tolerance"] and c["reference_error"] > 0 and c["decided"] > 0
    assert r["reference_margin"] == CRITERION_MARGIN
    assert r["public"]["max_abs_err"] <= c["tolerance"]


def test_forced_criterion_fails_an_engine_without_the_biases(qwen2, tmp_path):
    wrong = write_paged(qwen2, tmp_path / "engine.py", replace(qwen2.conventions, qkv_bias=False))
    source = wrong.read_text()   # past its own check of the conventions (rendered_for), to the criterion
    wrong.write_text(source.replace("RENDERED_FOR = (False,", "RENDERED_FOR = (True,", 1))
    r = evaluate(wrong, qwen2.config, qwen2.weight_dir, "cpu", criterion="bf16", **FAST)
    assert (r["status"], r["stage"], r["error_kind"]) == ("failed", "criterion", "wrong_result"), r["error"]
    assert "bf16 criterion FAILED" in r["error"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
@pytest.mark.parametrize("library", [False, True])
def test_gpu_paged_engine_in_bf16_passes_the_criterion(tmp_path, arch, library):
    """The paged engine (all-torch, or the library's preferred variants) in bf16 on CUDA, judged
    with auto: the criterion stage, then public, the target's stress and the benchmark."""
    from agent.search import PREFERRED
    model = build(tmp_path / "m", arch, seed=random.randrange(2**31), dtype=torch.bfloat16,
                  tied=arch != "Qwen2ForCausalLM", llama3=arch == "LlamaForCausalLM")
    spec = load_spec(model.folder / "config.json", model.folder)
    plan = Plan("paged", PREFERRED if library else {}, {n: p.default for n, p in engine_params("paged").items()})
    r = evaluate(write_paged(spec, tmp_path / "engine.py", plan=plan), spec.config, spec.weight_dir, "cuda",
                 stress="quick", cases=("decode", "prefill"), warmup=0, repeat=1)
    assert r["status"] == "passed", r["error"]
    assert r["criterion"] is not None
