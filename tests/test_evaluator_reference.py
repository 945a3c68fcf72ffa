"""The reference model (SPEC.md §3) checked against independent formulations, and the toy
weight generator (SPEC.md §1)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from evaluator.common import REPO_ROOT, ModelDims, compute_dtype, resolve_device
from evaluator.reference_model import ReferenceModel, apply_rope, rope_tables
from evaluator.weights import random_weights, weight_shapes

from tests.conftest import SINGLE_THREAD_ENV, TINY_CONFIG

pytestmark = pytest.mark.usefixtures("single_thread")

FP32_TOL = dict(atol=1e-5, rtol=1e-5)


def test_rope_is_the_interleaved_complex_rotation(test_seed):
    """Pairs (x[2j], x[2j+1]) as complex numbers, multiplied by exp(i * pos * inv_freq_j)."""
    gen = torch.Generator().manual_seed(test_seed)
    seq, heads, head_dim, theta = 9, 3, 20, 10000.0
    x = torch.randn(seq, heads, head_dim, generator=gen)
    pos = torch.arange(seq)
    cos, sin = rope_tables(pos, head_dim, theta, torch.float32)
    inv_freq = torch.tensor([theta ** (-(2 * j) / head_dim) for j in range(head_dim // 2)])
    rot = torch.polar(torch.ones(seq, head_dim // 2), pos[:, None].float() * inv_freq[None, :])
    expected = torch.view_as_real(torch.view_as_complex(x.reshape(seq, heads, -1, 2)) * rot[:, None, :])
    torch.testing.assert_close(apply_rope(x, cos, sin), expected.reshape(seq, heads, head_dim), **FP32_TOL)


def test_rope_tables_round_to_the_compute_dtype():
    cos, sin = rope_tables(torch.arange(50), 16, 10000.0, torch.float16)
    assert cos.dtype == sin.dtype == torch.float16
    cos32, _ = rope_tables(torch.arange(50), 16, 10000.0, torch.float32)
    assert torch.equal(cos, cos32.half())


def test_logits_are_causal(test_seed):
    """Position t of a long sequence equals the last position of its prefix of length t + 1."""
    ref = ReferenceModel(TINY_CONFIG, random_weights(TINY_CONFIG, test_seed, 0.12, 0.5), "cpu")
    tokens = torch.randint(0, TINY_CONFIG["vocab_size"], (12,), generator=torch.Generator().manual_seed(test_seed))
    full = ref.logits(tokens)
    for t in (0, 5, 11):
        torch.testing.assert_close(full[t], ref.last_logits(tokens[:t + 1]), **FP32_TOL)
    assert not torch.allclose(full[4], full[5], atol=1e-2), "different positions should differ"


def test_gqa_equals_mha_with_repeated_kv_heads(test_seed):
    """Query head h reads kv head h // (heads // kv_heads)."""
    gqa = dict(TINY_CONFIG, num_attention_heads=4, num_key_value_heads=2)
    mha = dict(gqa, num_key_value_heads=4)
    w = random_weights(gqa, test_seed, 0.12, 0.5)
    d = ModelDims.from_config(gqa)
    w_mha = dict(w)
    for i in range(d.layers):
        for proj in ("k_proj", "v_proj"):
            key = f"layers.{i}.self_attn.{proj}.weight"
            w_mha[key] = w[key].view(d.kv_heads, d.head_dim, d.hidden).repeat_interleave(2, dim=0).reshape(-1, d.hidden)
    tokens = torch.randint(0, gqa["vocab_size"], (10,), generator=torch.Generator().manual_seed(test_seed))
    a = ReferenceModel(gqa, w, "cpu").logits(tokens)
    b = ReferenceModel(mha, w_mha, "cpu").logits(tokens)
    torch.testing.assert_close(a, b, **FP32_TOL)
    swapped = dict(w_mha)  # the other grouping (h % kv_heads) must give something else
    for i in range(d.layers):
        for proj in ("k_proj", "v_proj"):
            key = f"layers.{i}.self_attn.{proj}.weight"
            swapped[key] = w[key].view(d.kv_heads, d.head_dim, d.hidden).repeat(2, 1, 1).reshape(-1, d.hidden)
    assert not torch.allclose(a, ReferenceModel(mha, swapped, "cpu").logits(tokens), atol=1e-3)


def test_cpu_computes_in_fp32_and_cuda_dtype_follows_the_config(monkeypatch):
    for name in ("float16", "bfloat16", "bf16"):
        ref = ReferenceModel(dict(TINY_CONFIG, torch_dtype=name), random_weights(TINY_CONFIG), "cpu")
        assert ref.dtype == torch.float32 and ref.w["lm_head.weight"].dtype == torch.float32
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == "cuda"
    assert compute_dtype({"torch_dtype": "bf16"}, "cuda") == torch.bfloat16
    assert compute_dtype({"torch_dtype": "BFloat16"}, "cuda") == torch.bfloat16
    assert compute_dtype({"torch_dtype": "float32"}, "cuda") == torch.float16
    assert compute_dtype({}, "cuda") == torch.float16


def test_cuda_without_a_gpu_resolves_to_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == resolve_device("cuda") == "cpu"


def test_config_defaults():
    bare = {k: v for k, v in TINY_CONFIG.items() if k not in ("rms_norm_eps", "rope_theta", "head_dim")}
    d = ModelDims.from_config(bare)
    assert (d.eps, d.theta, d.head_dim) == (1e-5, 10000.0, bare["hidden_size"] // bare["num_attention_heads"])


def test_toy_weights_layout_and_init():
    w = random_weights(TINY_CONFIG, seed=3)
    d = ModelDims.from_config(TINY_CONFIG)
    assert {k: tuple(v.shape) for k, v in w.items()} == weight_shapes(d)
    assert w["layers.1.self_attn.q_proj.weight"].shape == (d.heads * d.head_dim, d.hidden)
    assert w["layers.1.self_attn.k_proj.weight"].shape == (d.kv_heads * d.head_dim, d.hidden)
    assert all(v.dtype == torch.float32 for v in w.values())
    assert all(torch.equal(v, torch.ones_like(v)) for k, v in w.items() if k.endswith("norm.weight"))
    matrices = torch.cat([v.flatten() for v in w.values() if v.dim() == 2])
    assert matrices.std().item() == pytest.approx(0.02, rel=0.05)
    assert all(torch.equal(w[k], v) for k, v in random_weights(TINY_CONFIG, seed=3).items())
    assert not torch.equal(w["lm_head.weight"], random_weights(TINY_CONFIG, seed=4)["lm_head.weight"])


def test_norm_spread_gives_non_unit_norms():
    w = random_weights(TINY_CONFIG, seed=0, scale=0.1, norm_spread=0.5)
    norm = w["norm.weight"]
    assert norm.min() >= 0.5 and norm.max() <= 1.5 and norm.std() > 0.1


def test_generate_toy_weights_script_writes_the_seeded_toy_weights(tmp_path):
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(TINY_CONFIG))
    out = tmp_path / "weights" / "model.pt"
    subprocess.run([sys.executable, str(REPO_ROOT / "scripts/generate_toy_weights.py"), "--config", str(cfg),
                    "--output", str(out), "--seed", "5"], check=True, capture_output=True, env=SINGLE_THREAD_ENV)
    written = torch.load(out, weights_only=True)
    expected = random_weights(TINY_CONFIG, seed=5)
    assert written.keys() == expected.keys()
    assert all(torch.equal(written[k], v) for k, v in expected.items())


@pytest.mark.parametrize("change, said", [({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads"),
                                         ({"intermediate_size": -640}, "'intermediate_size' must be a positive integer"),
                                         ({"vocab_size": None}, "missing required key 'vocab_size'"),
                                         ({}, "is a folder; name the file to write")])
def test_generate_toy_weights_refuses_a_config_the_agent_would_with_one_line(tmp_path, change, said):
    """It wrote weights for a config run.sh then refused, and met a negative size or a missing key
    with a raw traceback (a new-user sweep, thirty-fifth session); an --output that is a folder too
    (thirty-sixth)."""
    config = {k: v for k, v in {**TINY_CONFIG, **change}.items() if v is not None}
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(config))
    out = tmp_path / "weights" / "model.pt"
    if not change:
        out.mkdir(parents=True)
    done = subprocess.run([sys.executable, str(REPO_ROOT / "scripts/generate_toy_weights.py"), "--config", str(cfg),
                           "--output", str(out)], capture_output=True, text=True, env=SINGLE_THREAD_ENV)
    assert done.returncode != 0 and (out.is_dir() if not change else not out.exists())
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and said in last and "Traceback" not in done.stderr, done.stderr


def test_reference_margin_is_the_judges_own_distance_from_fp32(tiny_model, tiny_model_large):
    """evaluator/noise.py: 1.0 where the judge computes in fp32 (the CPU); in bf16 the worst
    margin of the judge against the same model in fp32 over its prompts, computed by hand here,
    and lower on larger weights, where rounding grows."""
    from evaluator.guards import compare
    from evaluator.noise import prompt_lengths, reference_margin
    from evaluator.common import Tolerance, load_weights, make_generator
    assert reference_margin(TINY_CONFIG, tiny_model.weight_dir, "cpu") == 1.0
    weights = load_weights(tiny_model.weight_dir)
    judge = ReferenceModel(TINY_CONFIG, weights, "cpu", dtype=torch.bfloat16)
    exact = ReferenceModel(TINY_CONFIG, weights, "cpu", dtype=torch.float32)
    gen, worst = make_generator(5, "cpu"), 1.0
    for length in prompt_lengths(TINY_CONFIG["max_position_embeddings"]):
        tokens = torch.randint(0, judge.dims.vocab, (length,), generator=gen)
        worst = min(worst, compare(judge.last_logits(tokens).float()[None], exact.last_logits(tokens)[None],
                                   Tolerance()).margin)
    toy = reference_margin(TINY_CONFIG, tiny_model.weight_dir, "cpu", seed=5, dtype=torch.bfloat16)
    large = reference_margin(TINY_CONFIG, tiny_model_large.weight_dir, "cpu", seed=5, dtype=torch.bfloat16)
    assert toy == pytest.approx(worst) and toy < 1.0
    assert large < toy


def test_the_judge_maps_weights_only_where_no_worker_can_write_them(tmp_path):
    """load_weights maps model.pt (each tensor read when cast) only where the file is root's and
    writable by root alone, the judge running as root: a mapping sees later writes to the file,
    and confined workers run as uids of their own. A legacy, non-zip file is read whole."""
    import os
    from evaluator.common import _mappable, load_weights
    weights = {"a": torch.arange(6.0).reshape(2, 3)}
    for legacy in (False, True):
        torch.save(weights, tmp_path / "model.pt", _use_new_zipfile_serialization=not legacy)
        torch.testing.assert_close(load_weights(tmp_path)["a"], weights["a"], rtol=0, atol=0)
    path = tmp_path / "model.pt"
    os.chmod(path, 0o644)
    assert _mappable(path) == (os.geteuid() == 0 and path.stat().st_uid == 0)
    os.chmod(path, 0o664)   # a group could write it
    assert not _mappable(path)
    assert not _mappable(tmp_path / "absent.pt")
