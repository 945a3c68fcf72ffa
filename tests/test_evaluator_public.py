"""The public correctness sequence (SPEC.md §4) and the guards every checked call goes through."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from evaluator.common import (COMPILE_ERROR, REPO_ROOT, RUNTIME_ERROR, WRONG_RESULT, EvalFailure,
                              Tolerance, WrongResult, load_engine_module)
from evaluator.guards import FunctionIdentities, InputSnapshot, compare, take_output
from evaluator.test_correctness import run_public_sequence
from evaluator.traces import public_sequence, token_counts

from tests.conftest import SINGLE_THREAD_ENV
from tests.fixtures.broken_engines import broken_source

pytestmark = pytest.mark.usefixtures("single_thread")


def test_public_sequence_is_the_spec_sequence():
    assert [op.describe() for op in public_sequence()] == [
        "prefill([0], lens [11])", "decode([0])", "prefill([1, 2], lens [7, 13])", "decode([0, 1, 2])",
        "remove([1])", "prefill([3], lens [5])", "decode([0, 2, 3])", "remove([0, 2, 3])",
    ]
    assert token_counts(public_sequence()) == (36, 7)


def test_recompute_engine_passes_exactly(recompute_engine_path, tiny_model_large):
    m = tiny_model_large
    result = run_public_sequence(recompute_engine_path, m.config, m.weight_dir, "cpu")
    assert result["status"] == "passed" and result["cases"] == 6
    assert result["max_abs_err"] == 0.0  # same ops as the reference, op for op, in fp32


def test_cli_prints_the_passed_json(recompute_engine_path, tiny_model):
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "evaluator/test_correctness.py"), "--engine", str(recompute_engine_path),
         "--model-config", str(tiny_model.config_path), "--weight-dir", str(tiny_model.weight_dir),
         "--device", "auto", "--atol", "1e-2", "--rtol", "1e-2"],
        capture_output=True, env=SINGLE_THREAD_ENV, text=True, check=True)
    assert json.loads(proc.stdout)["status"] == "passed"


# Faults the public sequence must catch, with the toy weights of the official run or larger ones.
# (sorted rows and a prefill that keeps state pass it: every call's ids are ascending and no live
# id is re-prefilled. That is what the stress suite is for.)
PUBLIC_REJECTS = [("stale_slot_reuse", "toy"), ("decode_ignores_cache", "toy"),
                  ("rotate_half_rope", "large"), ("bf16_on_cpu", "large")]


@pytest.mark.parametrize("name,weights", PUBLIC_REJECTS)
def test_public_sequence_rejects(name, weights, recompute_source, write_engine, tiny_model, tiny_model_large):
    m = tiny_model if weights == "toy" else tiny_model_large
    with pytest.raises(AssertionError, match=r"step \d+ \w+\(.*max abs err .* max rel err") as err:
        run_public_sequence(write_engine(broken_source(name, recompute_source)), m.config, m.weight_dir, "cpu")
    assert err.value.kind == WRONG_RESULT


@pytest.mark.parametrize("name,message,kind", [
    ("mutates_inputs", "modified its input tensor", WRONG_RESULT),
    ("lazy_subclass_output", "not a plain torch.Tensor", WRONG_RESULT),
    ("nan_output", "non-finite", WRONG_RESULT),
    ("wrong_shape", r"shape \(1, 255\), expected \(1, 256\)", WRONG_RESULT),
    ("raises_in_decode", "step 2 decode.*RuntimeError: decode exploded", RUNTIME_ERROR),
])
def test_guards_catch_cheats(name, message, kind, recompute_source, write_engine, tiny_model):
    with pytest.raises(EvalFailure, match=message) as err:
        run_public_sequence(write_engine(broken_source(name, recompute_source)), tiny_model.config,
                            tiny_model.weight_dir, "cpu")
    assert err.value.kind == kind


def test_import_failures_are_compile_errors(write_engine, tmp_path):
    with pytest.raises(EvalFailure, match="SyntaxError") as err:
        load_engine_module(write_engine("def create_engine(:\n"))
    assert err.value.kind == COMPILE_ERROR
    with pytest.raises(EvalFailure, match="no callable create_engine"):
        load_engine_module(write_engine("x = 1\n"))
    with pytest.raises(EvalFailure, match="not found"):
        load_engine_module(tmp_path / "missing.py")


def test_take_output_copies_before_the_next_call():
    out = torch.ones(2, 5)
    copy = take_output(out, 2, 5, "call")
    out.zero_()  # an engine reusing its output buffer on the next call
    assert torch.equal(copy, torch.ones(2, 5))
    with pytest.raises(WrongResult, match="shape"):
        take_output(torch.ones(5), 1, 5, "call")
    with pytest.raises(WrongResult, match="floating"):
        take_output(torch.ones(1, 5, dtype=torch.long), 1, 5, "call")


def test_any_float_dtype_is_accepted():
    copy = take_output(torch.ones(1, 4, dtype=torch.bfloat16), 1, 4, "call")
    assert copy.dtype == torch.float32


def test_input_snapshot_detects_changes():
    ids, tokens = [3, 1], [torch.arange(4)]
    snap = InputSnapshot.take(ids, tokens)
    snap.check_unchanged(ids, tokens, "call")
    tokens[0][2] = 0
    with pytest.raises(WrongResult, match="input tensor 0"):
        snap.check_unchanged(ids, tokens, "call")
    with pytest.raises(WrongResult, match="request_ids"):
        snap.check_unchanged([1, 3], [torch.arange(4)], "call")


def test_compare_is_allclose_and_margin_reads_against_the_tolerance():
    tol = Tolerance(atol=1e-2, rtol=1e-2)
    ref = torch.tensor([[0.0, 1.0, -2.0]])
    exact = compare(ref.clone(), ref, tol)
    assert exact.passed and exact.max_abs_err == 0 and exact.margin >= 1.0
    at_half = compare(ref + torch.tensor([[0.005, 0.0, 0.0]]), ref, tol)
    assert at_half.passed and at_half.margin == pytest.approx(0.5, abs=1e-4)
    outside = compare(ref + torch.tensor([[0.0, 0.0, 0.05]]), ref, tol)
    assert not outside.passed and outside.margin < 0 and outside.worst_row == 0
    assert outside.max_abs_err == pytest.approx(0.05, abs=1e-6)
    assert outside.max_rel_err == pytest.approx(0.025, abs=1e-6)


def test_function_identities_catch_patching(monkeypatch):
    ids = FunctionIdentities()
    ids.check("untouched")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    with pytest.raises(WrongResult, match="synchronize was replaced"):
        ids.check("after")
