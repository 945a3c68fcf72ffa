"""The reference (evaluator/reference_model.py) equals `transformers`' own model on tiny
random-initialised checkpoints of each supported architecture (fp32, CPU), read from the
folder as the judge reads it (evaluator/common.load_weights)."""
from __future__ import annotations

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
