"""Hugging Face model folders at the agent's door (agent/spec.py, agent/checkpoint.py): each
supported architecture becomes a ModelSpec naming its conventions; every broken or unsupported
folder is one line naming the key or file, exit 2."""
from __future__ import annotations

import json

import pytest
import torch

from agent.cli import EXIT_BAD_INPUT, main
from agent.spec import SpecError, load_spec
from tests.hf_models import ARCHITECTURES, LLAMA3_SCALING, build

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {"llama": build(root / "llama", llama3=True, tied=True),
            "sharded": build(root / "sharded", "Qwen2ForCausalLM", sharded=True),
            "bin": build(root / "bin", "Qwen3ForCausalLM", safetensors=False)}


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _edit_config(folder, **changes):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_each_architecture_is_read_with_its_conventions(tmp_path, arch):
    model = build(tmp_path / "m", arch, dtype=torch.bfloat16)
    spec = load_spec(model.folder / "config.json", model.folder)
    conv = spec.conventions
    assert conv.hf and conv.rope_style == "rotate_half"
    assert (conv.qkv_bias, conv.qk_norm) == (arch == "Qwen2ForCausalLM", arch == "Qwen3ForCausalLM")
    assert spec.dtype == "bfloat16" and spec.head_dim == 24 and spec.warnings == ()
    assert spec.parameters == sum(v.numel() for v in
                                  __import__("safetensors.torch").torch.load_file(model.folder / "model.safetensors").values())


def test_sharded_bin_tied_and_llama3(folders):
    spec = load_spec(folders["llama"].folder / "config.json", folders["llama"].folder)
    assert spec.conventions.tied and spec.conventions.rope_scaling.factor == 8.0
    assert "lm_head.weight" not in spec.expected_shapes()
    assert load_spec(folders["sharded"].folder / "config.json", folders["sharded"].folder).conventions.qkv_bias
    assert load_spec(folders["bin"].folder / "config.json", folders["bin"].folder).conventions.qk_norm


def _shard(folder):
    return sorted(folder.glob("model-*-of-*.safetensors"))[1]


BROKEN = {
    "missing shard": ("sharded", lambda d: _shard(d).unlink(), "names a missing file"),
    "index naming a missing file": ("sharded", lambda d: (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "model-99-of-99.safetensors"}})), "model-99-of-99"),
    "truncated safetensors": ("llama", lambda d: (d / "model.safetensors").write_bytes(
        (d / "model.safetensors").read_bytes()[:-100]), "cannot read"),
    "wrong shape": ("llama", lambda d: _edit_config(d, intermediate_size=100), "has shape"),
    "unsupported architecture": ("llama", lambda d: _edit_config(d, architectures=["GPT2LMHeadModel"]),
                                 "'architectures'"),
    "mixture of experts": ("llama", lambda d: _edit_config(d, num_local_experts=8), "'num_local_experts'"),
    "other rope type": ("llama", lambda d: _edit_config(d, rope_parameters={"rope_type": "yarn", "factor": 4.0}),
                        "'rope_parameters'"),
    "sliding window below the context": ("llama", lambda d: _edit_config(
        d, architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=128), "'sliding_window'"),
    "Mistral's default window below the context": ("llama", lambda d: _edit_config(
        d, architectures=["MistralForCausalLM"], model_type="mistral", max_position_embeddings=8192),
        "sliding window 4096 shorter than max_position_embeddings 8192"),
    "a Qwen window used from a layer on": ("sharded", lambda d: _edit_config(
        d, sliding_window=64, use_sliding_window=True, max_window_layers=1, layer_types=None), "sliding window 64"),
    "a Qwen window with no sliding_window key": ("sharded", lambda d: (_edit_config(
        d, use_sliding_window=True, max_window_layers=1, layer_types=None, max_position_embeddings=8192),
        _drop_key(d, "sliding_window")), "sliding window 4096 shorter than max_position_embeddings 8192"),
    "a layer kind the engines do not run": ("sharded", lambda d: _edit_config(
        d, layer_types=["linear_attention", "full_attention"]), "'layer_types'"),
    "model_type not the architecture's": ("llama", lambda d: _edit_config(d, model_type="gemma"), "'model_type'"),
    "two RoPE bases": ("llama", lambda d: _edit_config(d, rope_theta=500000.0, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0}), "'rope_theta' (500000.0) and 'rope_parameters.rope_theta'"),
    "rope_scaling beside rope_parameters": ("llama", lambda d: _edit_config(d, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0}, rope_scaling={"rope_type": "linear", "factor": 4.0}),
        "'rope_scaling' (linear) and 'rope_parameters' (default) disagree"),
    # transformers 5 reads a legacy rope_scaling over rope_parameters, and a base inside it over rope_theta;
    # 4.x reads rope_theta or 10000: each had been run with one base by the judge or the engines, 0.8 apart
    "a rope_parameters base beside a rope_scaling": ("llama", lambda d: _edit_config(d, rope_parameters=dict(
        LLAMA3_SCALING, rope_theta=500000.0), rope_scaling=LLAMA3_SCALING),
        "'rope_theta' (absent: 10000.0) and 'rope_parameters.rope_theta' (500000.0) disagree"),
    "a base inside rope_scaling": ("llama", lambda d: (_edit_config(d, rope_scaling=dict(
        LLAMA3_SCALING, rope_theta=500000.0)), _drop_key(d, "rope_parameters")),
        "'rope_scaling.rope_theta' (500000.0) and 'rope_theta' (absent: 10000.0) disagree"),
    "a base inside rope_scaling past float's range": ("llama", lambda d: (_edit_config(d, rope_scaling=dict(
        LLAMA3_SCALING, rope_theta=10**400)), _drop_key(d, "rope_parameters")),   # float() had raised OverflowError
        "'rope_scaling.rope_theta' (1000"),
    "original_max_position_embeddings outside the llama3 dict": (   # transformers 5 reads it, 4.x the dict's
        "llama", lambda d: _edit_config(d, original_max_position_embeddings=128),
        "'original_max_position_embeddings' (128) and 'rope_parameters.original_max_position_embeddings' (64)"),
    "a window and no max_position_embeddings": ("llama", lambda d: _edit_config(
        d, architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=16, max_position_embeddings=None),
        "no max_position_embeddings bounds"),
    "tied with another head stored": ("sharded", lambda d: _edit_config(d, tie_word_embeddings=True),
                                      "transformers versions disagree"),
    "no weights at all": ("llama", lambda d: (d / "model.safetensors").unlink(), "holds no model.safetensors"),
    "shard without index": ("sharded", lambda d: (d / "model.safetensors.index.json").unlink(),
                            "no model.safetensors.index.json"),
    "no 'architectures' key": ("llama", lambda d: _drop_key(d, "architectures"),
                               "holds model.safetensors: a Hugging Face folder's config.json names its class"),
    "a Qwen2 config without num_key_value_heads (32 in transformers)": (
        "sharded", lambda d: _drop_key(d, "num_key_value_heads"),
        "num_key_value_heads 32 (model config key 'num_key_value_heads') (absent from the config, so read as its "
        "default: num_key_value_heads 32)"),
    # partial rotary embeddings: a null had ended the agent with a traceback; inside rope_parameters (where
    # transformers 5 moves it) its llama3 path reads it and its forward fails, and it had been run full
    "a null partial_rotary_factor": ("llama", lambda d: _edit_config(d, partial_rotary_factor=None),
                                     "partial rotary embeddings (model config key 'partial_rotary_factor' = None)"),
    "partial_rotary_factor inside rope_parameters": ("llama", lambda d: _edit_config(d, rope_parameters=dict(
        LLAMA3_SCALING, rope_theta=10000.0, partial_rotary_factor=0.5)),
        "model config key 'rope_parameters.partial_rotary_factor' = 0.5"),
    # a null base beside rope_parameters: transformers 5 reads the inner one, 4.x fails, and the judge and
    # the engines had raised TypeError on float(None) after the spec had read 10000 (thirty-ninth session)
    "a null rope_theta": ("llama", lambda d: _edit_config(d, rope_theta=None),
                          "'rope_theta' must be a positive number, got None"),
    "a null max_window_layers": ("sharded", lambda d: _edit_config(   # every engine had raised in create_engine
        d, max_window_layers=None, use_sliding_window=True, sliding_window=4096, layer_types=None),
        "model config key 'max_window_layers' is null"),
    "a null tie_word_embeddings": ("llama", lambda d: _edit_config(d, tie_word_embeddings=None),
                                   "model config key 'tie_word_embeddings' is null"),
    "a null head_dim of a Qwen": ("bin", lambda d: _edit_config(d, head_dim=None),   # Qwen3: transformers refuses
                                  "model config key 'head_dim' is null"),
    "rope_scaling not an object": ("llama", lambda d: (_edit_config(d, rope_scaling="llama3"),   # had been a traceback
                                                       _drop_key(d, "rope_parameters")),
                                   "model config key 'rope_scaling' must be an object, got 'llama3'"),
    "rope_parameters per layer type": ("sharded", lambda d: _edit_config(d, rope_parameters={   # transformers fails
        "full_attention": {"rope_type": "default", "rope_theta": 1000.0}}), "RoPE settings per layer type"),
    "layer_types not a list": ("sharded", lambda d: _edit_config(d, layer_types=5),   # had been a traceback
                               "model config key 'layer_types' must be a list of layer kinds, got 5"),
    "missing tensor": ("bin", lambda d: torch.save({k: v for k, v in torch.load(d / "pytorch_model.bin").items()
                                                    if "q_norm" not in k}, d / "pytorch_model.bin"),
                       "missing tensor 'model.layers.0.self_attn.q_norm.weight'"),
}


# Windows transformers does not apply: taken as full attention (their sliding_window key is inert).
def _drop_key(folder, key):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.pop(key, None)
    path.write_text(json.dumps(config))


INERT_WINDOWS = {
    "Llama (no window in LlamaConfig)": ("llama", dict(sliding_window=16)),
    "Qwen2 without use_sliding_window": ("sharded", dict(sliding_window=16)),
    "Qwen2 with every layer below max_window_layers": ("sharded", dict(sliding_window=16, use_sliding_window=True,
                                                                       max_window_layers=28, layer_types=None)),
    "Qwen2 whose layer_types are all full": ("sharded", dict(sliding_window=16, use_sliding_window=True,
                                                             max_window_layers=1)),
    # transformers sets a Qwen sliding_window to None without use_sliding_window, whatever layer_types say
    "Qwen2 whose layer_types slide without use_sliding_window": ("sharded", dict(
        sliding_window=16, use_sliding_window=False, layer_types=["sliding_attention", "full_attention"])),
}


@pytest.mark.parametrize("case", list(INERT_WINDOWS))
def test_windows_transformers_does_not_apply_are_no_windows(folders, tmp_path, case):
    source, changes = INERT_WINDOWS[case]
    folder = _copy(folders[source].folder, tmp_path / "m")
    _edit_config(folder, **changes)
    assert load_spec(folder / "config.json", folder).conventions.hf


@pytest.mark.parametrize("problem", list(BROKEN))
def test_broken_folders_are_one_line(folders, tmp_path, problem):
    source, breaks, words = BROKEN[problem]
    folder = _copy(folders[source].folder, tmp_path / "m")
    breaks(folder)
    with pytest.raises(SpecError) as e:
        load_spec(folder / "config.json", folder)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_run_sh_takes_the_folders_config_and_exits_2(folders, tmp_path, capsys):
    """--weights DIR alone: DIR/config.json is the config; a broken folder ends with one line, exit 2."""
    folder = _copy(folders["sharded"].folder, tmp_path / "m")
    _shard(folder).unlink()
    assert main(["--weights", str(folder), "--workspace", str(tmp_path / "ws"), "--device", "cpu"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "names a missing file" in err[0]


def test_a_window_shorter_than_what_the_judge_checks_is_one_line_and_exit_2(tmp_path, capsys):
    """A Mistral whose window covers its max_position_embeddings (512) is a model the engines run,
    but the judge checks contexts past 2000 tokens (the stress suite's long prompt), which every
    engine must refuse: one line naming the window, exit 2, before any candidate is judged."""
    model = build(tmp_path / "m", "MistralForCausalLM")
    capsys.readouterr()   # transformers' progress bar while saving
    assert main(["--weights", str(model.folder), "--workspace", str(tmp_path / "ws"), "--device", "cpu"]) \
        == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "sliding window 512 is shorter than the" in err[0]
    assert not (tmp_path / "ws").exists()


def test_a_null_head_dim_reads_as_absent_as_in_transformers(tmp_path):
    """transformers' configs take head_dim null as hidden / heads; so does the agent (it refused it)."""
    model = build(tmp_path / "m", head_dim=16)        # TINY: hidden 64, 4 heads
    _edit_config(model.folder, head_dim=None)
    assert load_spec(model.folder / "config.json", model.folder).head_dim == 16
    _edit_config(model.folder, head_dim=0)
    with pytest.raises(SpecError, match="'head_dim' must be a positive integer"):
        load_spec(model.folder / "config.json", model.folder)


def test_a_folder_without_config_json_is_said_to_lack_it(folders, tmp_path):
    """--weights DIR with no DIR/config.json reads the course's config: the line had said that config
    lacked 'architectures', as if the folder's own config.json did (unseen-configs sweep, thirty-ninth session)."""
    from agent.judge import REPO

    folder = _copy(folders["llama"].folder, tmp_path / "m")
    (folder / "config.json").unlink()
    with pytest.raises(SpecError) as e:
        load_spec(REPO / "target" / "model_config.json", folder)
    assert "holds model.safetensors but no config.json" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("key", ["hidden_act", "model_type", "max_position_embeddings"])
def test_a_huge_value_is_quoted_briefly(folders, tmp_path, key):
    """A 400-digit value of a key the conventions refuse is one short line (it had been quoted whole).
    max_position_embeddings: past the Mistral window it is refused before the spec's size bound."""
    folder = _copy(folders["llama"].folder, tmp_path / "m")
    _edit_config(folder, **{key: 10**400}, **({"architectures": ["MistralForCausalLM"], "model_type": "mistral"}
                                              if key == "max_position_embeddings" else {}))
    with pytest.raises(SpecError) as e:
        load_spec(folder / "config.json", folder)
    assert "an integer of about 401 digits" in str(e.value) and len(str(e.value)) < 300, str(e.value)[:300]
