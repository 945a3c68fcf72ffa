"""The reference (evaluator/reference_model.py) equals `transformers`' own model on tiny
random-initialised checkpoints of each supported architecture (fp32, CPU), read from the
folder as the judge reads it (evaluator/common.load_weights)."""
from __future__ import annotations

import json
import random

import pytest
import torch

from evaluator.common import load_weights
from evaluator.reference_model import ReferenceModel
from tests.hf_models import ARCHITECTURES, build, transformers_model

pytest.importorskip("transformers")
ATOL = RTOL = 1e-4
CASES = [(arch, {}) for arch in ARCHITECTURES] + [
    ("LlamaForCausalLM", {"llama3": True, "tied": True}),
    ("Qwen2ForCausalLM", {"sharded": True, "tied": True}),
    ("LlamaForCausalLM", {"safetensors": False}),
]


@pytest.mark.parametrize("arch,options", CASES, ids=[f"{a}-{'-'.join(o) or 'plain'}" for a, o in CASES])
def test_reference_equals_transformers(tmp_path, arch, options):
    seed = random.randrange(2**31)
    model = build(tmp_path / "m", arch, seed=seed, **options)
    ref = ReferenceModel(model.config, load_weights(model.folder, model.config), "cpu")
    theirs = transformers_model(model.folder)
    tokens = torch.randint(0, model.config["vocab_size"], (1, 200), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        want = theirs(tokens).logits[0].float()
    got = ref.logits(tokens[0]).float()
    assert want.abs().max() > 1.0, "logits too small to tell conventions apart"
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL, msg=lambda m: f"seed {seed}: {m}")


def test_conventions_matter(tmp_path):
    """The comparison can fail: the same Qwen3 weights read as a course model (interleaved RoPE,
    no q/k norm) are far from transformers'."""
    model = build(tmp_path / "m", "Qwen3ForCausalLM", seed=random.randrange(2**31))
    weights = load_weights(model.folder, model.config)
    course = {k: v for k, v in model.config.items() if k != "architectures"}
    tokens = torch.randint(0, model.config["vocab_size"], (64,))
    right = ReferenceModel(model.config, weights, "cpu").logits(tokens)
    wrong = ReferenceModel(course, weights, "cpu").logits(tokens)
    assert (right - wrong).abs().max() > 0.1


def test_stray_biases_of_a_llama_folder_are_ignored_as_transformers_does(tmp_path):
    """A Llama folder that stores q/k/v biases its architecture has none of: transformers' Llama
    never loads them, and neither does the reference (it used to add whatever biases it found,
    so the judge held every engine to another model than the checkpoint's: a sweep of unseen
    checkpoints, twenty-ninth session)."""
    from safetensors.torch import load_file, save_file
    seed = random.randrange(2**31)
    model = build(tmp_path / "m", "LlamaForCausalLM", seed=seed)
    path = model.folder / "model.safetensors"
    tensors = load_file(path)
    for name in [k for k in tensors if k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight"))]:
        tensors[name.replace(".weight", ".bias")] = torch.randn(tensors[name].shape[0])
    save_file(tensors, path, metadata={"format": "pt"})
    ref = ReferenceModel(model.config, load_weights(model.folder, model.config), "cpu")
    tokens = torch.randint(0, model.config["vocab_size"], (1, 64), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        want = transformers_model(model.folder)(tokens).logits[0].float()
    torch.testing.assert_close(ref.logits(tokens[0]).float(), want, atol=ATOL, rtol=RTOL)


def test_a_tensor_of_another_dtype_beside_the_weights_is_ignored_by_the_engines(tmp_path):
    """An unused int64 buffer in model.safetensors (transformers ignores it; the agent warns and takes
    the folder): the engines' reader had raised KeyError 'I64' in create_engine, so no engine passed."""
    from safetensors.torch import load_file, save_file

    from agent.plan import Plan
    from agent.render import render_engine
    from agent.spec import load_spec
    from evaluator.common import load_engine_module

    model = build(tmp_path / "m", "LlamaForCausalLM")
    path = model.folder / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.0.self_attn.rotary_emb.position_ids"] = torch.arange(8)
    save_file(tensors, path, metadata={"format": "pt"})
    spec = load_spec(model.folder / "config.json", model.folder)
    assert "unexpected tensor" in spec.warnings[0]
    engine_file = tmp_path / "engine.py"
    engine_file.write_text(render_engine(Plan("recompute"), None, spec.conventions))
    engine = load_engine_module(engine_file).create_engine(model.config, str(model.folder), "cpu")
    tokens = torch.randint(0, model.config["vocab_size"], (1, 16))
    with torch.no_grad():
        want = transformers_model(model.folder)(tokens).logits[0, -1].float()
    torch.testing.assert_close(engine.prefill([0], [tokens[0]])[0].float(), want, atol=ATOL, rtol=RTOL)


# Config keys a config.json may leave out, whose transformers default is its architecture's own
# (evaluator/checkpoint.py CONFIG_DEFAULTS), with a model built at those values (unseen-checkpoints
# sweep, thirty-sixth session: the engines had computed a Llama without rms_norm_eps at 1e-5).
LEFT_OUT = {
    "LlamaForCausalLM": dict(rms_norm_eps=1e-6, num_key_value_heads=4, head_dim=16),   # 4 heads of hidden 64
    "MistralForCausalLM": dict(rms_norm_eps=1e-6, num_attention_heads=8, num_key_value_heads=8, head_dim=8),
    "Qwen2ForCausalLM": dict(rms_norm_eps=1e-6, num_attention_heads=32, num_key_value_heads=32, head_dim=2),
    "Qwen3ForCausalLM": dict(rms_norm_eps=1e-6, num_attention_heads=32, num_key_value_heads=32, head_dim=128),
}
LEFT_OUT_KEYS = ("rms_norm_eps", "num_key_value_heads", "head_dim")


@pytest.mark.parametrize("arch", list(LEFT_OUT))
def test_keys_a_config_leaves_out_take_the_architectures_defaults(tmp_path, arch):
    """The spec, the reference (the config as the judge reads it) and an engine (the config.json as
    written, as a user passes it) all match transformers on a folder whose config lacks the keys."""
    from agent.plan import Plan
    from agent.render import render_engine
    from agent.spec import load_spec
    from evaluator.common import load_config, load_engine_module

    seed = random.randrange(2**31)
    model = build(tmp_path / "m", arch, seed=seed, **LEFT_OUT[arch])
    path = model.folder / "config.json"
    written = {k: v for k, v in json.loads(path.read_text()).items() if k not in LEFT_OUT_KEYS}
    path.write_text(json.dumps(written))
    spec = load_spec(path, model.folder)
    assert (spec.eps, spec.kv_heads, spec.head_dim) == tuple(
        LEFT_OUT[arch].get(k, model.config.get(k)) for k in LEFT_OUT_KEYS)
    tokens = torch.randint(0, model.config["vocab_size"], (1, 48), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        want = transformers_model(model.folder)(tokens).logits[0].float()
    config = load_config(path)
    torch.testing.assert_close(ReferenceModel(config, load_weights(model.folder, config), "cpu").logits(tokens[0]).float(),
                               want, atol=ATOL, rtol=RTOL, msg=lambda m: f"reference, seed {seed}: {m}")
    engine_file = tmp_path / "engine.py"
    engine_file.write_text(render_engine(Plan("recompute"), None, spec.conventions))
    engine = load_engine_module(engine_file).create_engine(written, str(model.folder), "cpu")
    last = engine.prefill([0], [tokens[0]])[0].float()
    torch.testing.assert_close(last, want[-1], atol=ATOL, rtol=RTOL, msg=lambda m: f"engine, seed {seed}: {m}")
    course = dict(config, rms_norm_eps=1e-5)   # the course's default, as before: the comparison can fail
    assert (ReferenceModel(course, load_weights(model.folder, course), "cpu").logits(tokens[0]).float()
            - want).abs().max() > ATOL


def test_a_null_kv_head_count_is_one_kv_head_a_query_head_as_transformers_reads_it(tmp_path):
    """"num_key_value_heads": null is num_attention_heads to transformers (every architecture
    here), not the Qwen2 default of 32 that leaving the key out gives, nor a missing key."""
    from transformers import AutoConfig

    from agent.plan import Plan
    from agent.render import render_engine
    from agent.spec import load_spec
    from evaluator.common import load_engine_module

    seed = random.randrange(2**31)
    model = build(tmp_path / "m", "Qwen2ForCausalLM", seed=seed, num_attention_heads=4, num_key_value_heads=4)
    path = model.folder / "config.json"
    written = dict(json.loads(path.read_text()), num_key_value_heads=None)
    path.write_text(json.dumps(written))
    assert AutoConfig.from_pretrained(model.folder).num_key_value_heads == 4
    assert load_spec(path, model.folder).kv_heads == 4
    tokens = torch.randint(0, model.config["vocab_size"], (1, 24), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        want = transformers_model(model.folder)(tokens).logits[0, -1].float()
    engine_file = tmp_path / "engine.py"
    engine_file.write_text(render_engine(Plan("paged"), None, load_spec(path, model.folder).conventions))
    engine = load_engine_module(engine_file).create_engine(written, str(model.folder), "cpu")
    torch.testing.assert_close(engine.prefill([0], [tokens[0]])[0].float(), want, atol=ATOL, rtol=RTOL,
                               msg=lambda m: f"engine, seed {seed}: {m}")


def test_a_folder_with_both_a_single_file_and_shards_is_read_as_transformers_reads_it(tmp_path):
    """model.safetensors wins over an index and its shards (transformers 4.x and 5.x): the shards
    of another model beside it had been what the reference and the engines read."""
    from agent.plan import Plan
    from agent.render import render_engine
    from agent.spec import load_spec
    from evaluator.common import load_engine_module

    seed = random.randrange(2**31)
    model = build(tmp_path / "m", seed=seed)
    other = build(tmp_path / "other", seed=seed + 1, sharded=True)
    for f in other.folder.glob("model-*"):
        (model.folder / f.name).write_bytes(f.read_bytes())
    (model.folder / "model.safetensors.index.json").write_bytes((other.folder / "model.safetensors.index.json").read_bytes())
    spec = load_spec(model.folder / "config.json", model.folder)
    tokens = torch.randint(0, model.config["vocab_size"], (1, 32), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        want = transformers_model(model.folder)(tokens).logits[0].float()
    torch.testing.assert_close(ReferenceModel(model.config, load_weights(model.folder, model.config), "cpu")
                               .logits(tokens[0]).float(), want, atol=ATOL, rtol=RTOL)
    engine_file = tmp_path / "engine.py"
    engine_file.write_text(render_engine(Plan("recompute"), None, spec.conventions))
    engine = load_engine_module(engine_file).create_engine(model.config, str(model.folder), "cpu")
    torch.testing.assert_close(engine.prefill([0], [tokens[0]])[0].float(), want[-1], atol=ATOL, rtol=RTOL)
