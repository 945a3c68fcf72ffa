"""Tiny Hugging Face checkpoints built locally by `transformers` (random weights, nothing
downloaded), for every test that needs a real model folder.

`transformers` is a test dependency only: nothing under agent/, evaluator/ or the engines
imports it. Sizes are tiny so a forward takes milliseconds on the CPU; the weights are scaled
up from transformers' 0.02 init so attention is far from uniform and a wrong RoPE, a missing
bias or a missing q/k norm moves the logits well past the tolerance.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=24, vocab_size=257, max_position_embeddings=512,
            rms_norm_eps=1e-6, rope_theta=10000.0)
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}
INIT_STD = 0.08          # transformers' initializer_range; 0.02 leaves attention nearly uniform
SHARD_SIZE = "40KB"      # splits a tiny model over several files


@dataclass(frozen=True)
class HFModel:
    folder: Path
    config: dict        # config.json as written
    architecture: str


def build(folder: Path, architecture: str = "LlamaForCausalLM", *, seed: int = 0, tied: bool = False,
          llama3: bool = False, sharded: bool = False, dtype: torch.dtype = torch.float32,
          safetensors: bool = True, **overrides) -> HFModel:
    """A random-initialised model of `architecture` saved by save_pretrained into `folder`;
    q/k/v biases and norm weights are drawn too (transformers inits them to 0 and 1)."""
    import transformers

    kind = architecture.removesuffix("ForCausalLM")
    config_cls = getattr(transformers, f"{kind}Config")
    kwargs = dict(TINY, tie_word_embeddings=tied, initializer_range=INIT_STD, **overrides)
    if llama3:
        kwargs["rope_scaling"] = dict(LLAMA3_SCALING, rope_theta=kwargs["rope_theta"])
    if kind == "Mistral":
        kwargs.setdefault("sliding_window", kwargs["max_position_embeddings"])
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config_cls(**kwargs)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
    model = model.to(dtype)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, max_shard_size=SHARD_SIZE if sharded else "10GB")
    if not safetensors:  # transformers 5 writes safetensors only: the legacy file by hand
        (folder / "model.safetensors").unlink()
        torch.save(model.state_dict(), folder / "pytorch_model.bin")
    return HFModel(folder, json.loads((folder / "config.json").read_text()), architecture)


def transformers_model(folder: Path, dtype: torch.dtype = torch.float32):
    """transformers' own model of the folder, eager attention, for comparison."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype,
                                                             attn_implementation="eager").eval()
