"""agent/spec.py: good inputs give a ModelSpec; each bad input stops with a message naming it."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agent.spec import SpecError, load_spec

REPO = Path(__file__).resolve().parent.parent
TINY_CONFIG = {
    "head_dim": 16, "hidden_size": 64, "intermediate_size": 128, "max_position_embeddings": 512,
    "model_type": "tiny_llama", "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "float16", "vocab_size": 256,
}


def tiny_weights(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """SPEC §1 layout, toy init, written here so the tests do not lean on the evaluator's helper."""
    g = torch.Generator().manual_seed(seed)
    h, i, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config.get("num_key_value_heads", config["num_attention_heads"]) * config["head_dim"]
    shapes = {"embed_tokens.weight": (v, h), "norm.weight": (h,), "lm_head.weight": (v, h)}
    for layer in range(config["num_hidden_layers"]):
        p = f"layers.{layer}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                       p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                       p + "mlp.down_proj.weight": (h, i)})
    return {k: torch.ones(s) if len(s) == 1 else torch.randn(s, generator=g) * 0.02 for k, s in shapes.items()}


def write_model(root: Path, config: dict | None = None, weights: dict | None = None) -> tuple[Path, Path]:
    """A config file and a weights folder under `root`; returns (config path, weight dir)."""
    config = dict(TINY_CONFIG if config is None else config)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    (root / "weights").mkdir(exist_ok=True)
    torch.save(tiny_weights(config) if weights is None else weights, root / "weights" / "model.pt")
    return root / "config.json", root / "weights"


def test_tiny_model_loads(tmp_path):
    spec = load_spec(*write_model(tmp_path))
    assert (spec.layers, spec.heads, spec.kv_heads, spec.head_dim, spec.dtype) == (2, 4, 2, 16, "float16")
    assert spec.parameters == sum(t.numel() for t in tiny_weights(TINY_CONFIG).values())
    assert "GQA" in spec.summary() and not spec.warnings


def test_public_config_parses_without_weights_loaded():
    from agent.spec import read_config, spec_from_config
    config = read_config(REPO / "target" / "model_config.json")
    spec = spec_from_config(config, Path("x"), Path("y"))
    assert (spec.hidden, spec.head_dim, spec.layers) == (768, 192, 12)


def test_defaults_and_bf16(tmp_path):
    config = {k: v for k, v in TINY_CONFIG.items() if k not in ("rms_norm_eps", "rope_theta", "num_key_value_heads")}
    config["torch_dtype"] = "bf16"
    spec = load_spec(*write_model(tmp_path, config))
    assert (spec.eps, spec.theta, spec.kv_heads, spec.dtype) == (1e-5, 10000.0, 4, "bfloat16")


def _config_case(tmp_path, change):
    config = dict(TINY_CONFIG)
    change(config)
    return write_model(tmp_path, config, tiny_weights(TINY_CONFIG))


def _weights_case(tmp_path, change):
    weights = tiny_weights(TINY_CONFIG)
    change(weights)
    return write_model(tmp_path, TINY_CONFIG, weights)


def _nan(weights):
    weights["layers.1.mlp.up_proj.weight"][3, 5] = float("nan")


BAD_INPUTS = {
    "missing config key": (lambda p: _config_case(p, lambda c: c.pop("vocab_size")), "'vocab_size'"),
    "non-integer size": (lambda p: _config_case(p, lambda c: c.update(hidden_size="64")), "'hidden_size'"),
    "rope scaling": (lambda p: _config_case(p, lambda c: c.update(rope_scaling={"type": "linear", "factor": 2.0})),
                     "unsupported feature: RoPE scaling"),
    "heads not a multiple of kv heads": (lambda p: _config_case(p, lambda c: c.update(num_key_value_heads=3)),
                                         "'num_key_value_heads'"),
    "missing tensor": (lambda p: _weights_case(p, lambda w: w.pop("layers.1.self_attn.k_proj.weight")),
                       "missing tensor 'layers.1.self_attn.k_proj.weight'"),
    "wrong shape": (lambda p: _weights_case(p, lambda w: w.update({"layers.0.mlp.down_proj.weight": torch.zeros(64, 64)})),
                    "'layers.0.mlp.down_proj.weight' has shape [64, 64], expected [64, 128]"),
    "non-finite": (lambda p: _weights_case(p, _nan), "'layers.1.mlp.up_proj.weight'"),
    "bias": (lambda p: _weights_case(p, lambda w: w.update({"layers.0.self_attn.q_proj.bias": torch.zeros(64)})),
             "unsupported feature: biases ('layers.0.self_attn.q_proj.bias'"),
    "integer tensor": (lambda p: _weights_case(p, lambda w: w.update({"norm.weight": torch.ones(64, dtype=torch.long)})),
                       "'norm.weight'"),
    "tied embeddings": (lambda p: _config_case(p, lambda c: c.update(tie_word_embeddings=True)) and
                        _weights_case(p, lambda w: w.pop("lm_head.weight")), "lm_head.weight"),
    "model. prefix": (lambda p: _weights_case(p, lambda w: [w.__setitem__("model." + k, w.pop(k)) for k in list(w)]),
                      "'model.' prefix"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_names_the_problem(tmp_path, case):
    make, expected = BAD_INPUTS[case]
    config, weights = make(tmp_path)
    with pytest.raises(SpecError) as err:
        load_spec(config, weights)
    message = str(err.value)
    assert expected in message and "\n" not in message


def test_tied_embeddings_config_with_lm_head_is_fine(tmp_path):
    config = dict(TINY_CONFIG, tie_word_embeddings=True)
    assert load_spec(*write_model(tmp_path, config)).vocab == 256


def test_file_problems(tmp_path):
    config, weights = write_model(tmp_path)
    with pytest.raises(SpecError, match="model config not found"):
        load_spec(tmp_path / "nope.json", weights)
    (tmp_path / "bad.json").write_text("{ not json")
    with pytest.raises(SpecError, match="not valid JSON"):
        load_spec(tmp_path / "bad.json", weights)
    with pytest.raises(SpecError, match="weights directory not found"):
        load_spec(config, tmp_path / "none")
    with pytest.raises(SpecError, match="weights must be a folder, and .*model.pt is a file"):
        load_spec(config, weights / "model.pt")
    (weights / "model.pt").unlink()
    with pytest.raises(SpecError, match="missing weights file: .*model.pt"):
        load_spec(config, weights)
    (weights / "model.pt").write_bytes(b"garbage")
    with pytest.raises(SpecError, match="cannot load"):
        load_spec(config, weights)
    torch.save([torch.zeros(2)], weights / "model.pt")
    with pytest.raises(SpecError, match="is not a state dict"):
        load_spec(config, weights)


def test_extra_tensors_are_a_warning(tmp_path):
    weights = tiny_weights(TINY_CONFIG)
    weights["layers.2.mlp.up_proj.weight"] = torch.zeros(1)
    spec = load_spec(*write_model(tmp_path, TINY_CONFIG, weights))
    assert spec.warnings and "layers beyond num_hidden_layers" in spec.warnings[0]


def test_rope_parameters_in_the_course_format_is_a_warning(tmp_path):
    """Not a course key: the course's reference reads rope_theta alone, and so does every engine;
    said, not silently dropped (a sweep of unseen configs, twenty-ninth session)."""
    cfg, weights = write_model(tmp_path)
    data = json.loads(cfg.read_text())
    data["rope_parameters"] = {"rope_type": "linear", "factor": 4.0}
    cfg.write_text(json.dumps(data))
    spec = load_spec(cfg, weights)
    assert any("'rope_parameters' is not part of the course format" in w for w in spec.warnings)


@pytest.mark.parametrize("dtype, warned", [("float16", False), ("bfloat16", False), ("bf16", False),
                                           ("int8", True), ("bfloat61", True)])
def test_a_torch_dtype_that_is_neither_fp16_nor_bf16_is_said(tmp_path, dtype, warned):
    """SPEC.md: anything but bf16 computes in fp16, so a typo (`bfloat61`) or `int8` ran as fp16
    unseen (a new-user sweep, thirty-fifth session); it still runs, and the run says so."""
    cfg, weights = write_model(tmp_path)
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "torch_dtype": dtype}))
    spec = load_spec(cfg, weights)
    assert spec.dtype == ("bfloat16" if dtype.startswith("bf") and dtype != "bfloat61" else "float16")
    assert any(f"torch_dtype '{dtype}' is neither float16 nor bfloat16" in w for w in spec.warnings) == warned


def test_a_shape_mismatch_names_the_config_key_left_out(tmp_path):
    """A config without num_key_value_heads reads it as num_attention_heads; GQA weights then failed
    on k_proj's shape with no word of the key (a new-user sweep, thirty-fifth session)."""
    cfg, weights = write_model(tmp_path, {**TINY_CONFIG, "num_key_value_heads": 2})
    data = json.loads(cfg.read_text())
    del data["num_key_value_heads"]
    cfg.write_text(json.dumps(data))
    with pytest.raises(SpecError, match=r"k_proj.*read as its default: num_key_value_heads"):
        load_spec(cfg, weights)


def test_cli_bad_input_is_one_line_and_writes_nothing(tmp_path):
    config, weights = _weights_case(tmp_path, _nan)
    ws = tmp_path / "ws"
    done = subprocess.run([sys.executable, "-m", "agent", "--config", str(config), "--weights", str(weights),
                           "--device", "cpu", "--workspace", str(ws)], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "non-finite" in done.stderr
    assert not (ws / "engine.py").exists()


def test_toy_weights_only_for_the_repository_target(tmp_path, monkeypatch):
    from agent import cli
    config, _ = write_model(tmp_path / "src")
    weights = tmp_path / "target" / "weights"
    monkeypatch.setattr(cli, "REPO_CONFIG", config)
    monkeypatch.setattr(cli, "REPO_WEIGHTS", weights)
    run = cli.RunConfig(config.resolve(), weights.resolve(), "cpu", 60.0, "builtin", None, 0, tmp_path / "ws")
    cli.ensure_toy_weights(run)
    assert sorted(p.name for p in weights.iterdir()) == ["model.pt"]  # written aside, then renamed
    assert load_spec(config, weights).parameters > 0
    before = (weights / "model.pt").stat().st_mtime_ns
    cli.ensure_toy_weights(run)
    assert (weights / "model.pt").stat().st_mtime_ns == before  # present: left alone
    other = cli.RunConfig(config.resolve(), (tmp_path / "elsewhere").resolve(), "cpu", 60.0, "builtin", None, 0, tmp_path)
    cli.ensure_toy_weights(other)
    assert not (tmp_path / "elsewhere").exists()  # not the repository's target: never written


def test_a_bf16_course_target_on_a_gpu_says_why_the_recompute_engine_is_likely_to_stay():
    """results.log's header explains the measured reason (the bf16 reference misses its own
    allclose when only GEMM sizes change) for bf16 course-format targets on a GPU only."""
    from dataclasses import replace
    from agent.cli import bf16_lines
    from agent.spec import read_config, spec_from_config
    from evaluator.checkpoint import Conventions
    spec = spec_from_config(read_config(REPO / "target" / "model_config.json"), Path("x"), Path("y"))
    bf16 = replace(spec, dtype="bfloat16")
    assert "recompute engine" in " ".join(bf16_lines(bf16, "cuda"))
    assert bf16_lines(spec, "cuda") == bf16_lines(bf16, "cpu") == []
    assert bf16_lines(replace(bf16, conventions=Conventions(hf=True)), "cuda") == []
