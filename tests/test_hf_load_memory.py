"""The engines read a bf16 Hugging Face checkpoint once and never hold it twice (issue 21): on the
CPU, where they compute in fp32, the peak resident memory during create_engine is at most
(1 + LOAD_SLACK) x the model's fp32 size, plus the paged engine's KV pool (kept small here) and a
fixed allowance. A loader that keeps the stored checkpoint resident beside the cast weights (a
mapped file, a state dict read whole) peaks at 1.5x, and fails. Both formats a folder may hold:
safetensors, and the legacy pytorch_model.bin (a zip of a pickle and raw records).

Measured in a fresh process, from Linux's own counters: /proc/self/clear_refs resets the peak
(VmHWM) to the current RSS just before create_engine."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agent.plan import Plan, engine_params
from agent.render import render_engine
from agent.spec import load_spec
from evaluator.common import load_engine_module
from tests.hf_models import build

pytest.importorskip("transformers")

LOAD_SLACK = 0.2          # the bound: peak during load at most ~1.2x the model
# The allocator's and the interpreter's own noise, the tables; on a CPU the paged engine packs its
# fp32 projections for oneDNN's linear (each packed copy replaces its plain one), which leaves the
# freed plain copies to the allocator (a few MB here). oneDNN's one-time start (~6-8 MB) is made
# before the measurement (MEASURE): it is the library's, not the engine's weights held twice.
ALLOWANCE_MB = 16.0
CACHE_TOKENS = 1024       # the paged engine's first KV pool, its smallest choice
MB = 2**20
# ~26M parameters (104 MB in fp32): the weights dwarf the allowance, the largest tensor (the
# embedding, 4M) stays under LOAD_SLACK of the whole, and the build takes a second.
SHAPE = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=6, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, vocab_size=8192)

MEASURE = """
import json, sys
from evaluator.common import load_engine_module

def kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))

engine_path, config_path, folder = sys.argv[1:]
module = load_engine_module(engine_path)
config = json.loads(open(config_path).read())
if hasattr(module, "cpu_packing_works"):
    module.cpu_packing_works()   # oneDNN's one-time start (its code, its first kernel): not the weights
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")   # the peak RSS is now the current RSS
before = kib("VmRSS")
engine = module.create_engine(config, folder, "cpu")
print(json.dumps({"before": before, "after": kib("VmRSS"), "peak": kib("VmHWM")}))
"""


def fp32_bytes(config: dict) -> int:
    h, i, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    attn = h * d * (2 * config["num_attention_heads"] + 2 * config["num_key_value_heads"])
    layer = attn + 3 * h * i + 2 * h
    head = 1 if config["tie_word_embeddings"] else 2
    return 4 * (config["num_hidden_layers"] * layer + head * config["vocab_size"] * h + h)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs")
@pytest.mark.parametrize("safetensors", [True, False], ids=["safetensors", "pytorch_model.bin"])
@pytest.mark.parametrize("engine", ["paged", "recompute"])
def test_create_engine_holds_a_bf16_checkpoint_once(tmp_path, engine, safetensors):
    model = build(tmp_path / "m", "LlamaForCausalLM", seed=0, dtype=torch.bfloat16, sharded=False,
                  safetensors=safetensors, **SHAPE)
    spec = load_spec(model.folder / "config.json", model.folder)
    params = {name: p.default for name, p in engine_params(engine).items()}
    pool_mb = 0.0
    if engine == "paged":
        params["cache_tokens"] = CACHE_TOKENS
        c = model.config   # K and V of every layer, fp32, and one block of scratch
        pool_mb = (2 * 4 * c["num_hidden_layers"] * (CACHE_TOKENS + params["block_size"])
                   * c["num_key_value_heads"] * c["head_dim"]) / MB
    path = tmp_path / "engine.py"
    path.write_text(render_engine(Plan(engine, {}, params), None, spec.conventions))
    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", MEASURE, str(path), str(model.folder / "config.json"),
                           str(model.folder)], cwd=repo, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    kib = json.loads(done.stdout.splitlines()[-1])
    weights_mb = fp32_bytes(model.config) / MB
    held_mb, peak_mb = (kib["after"] - kib["before"]) / 1024, (kib["peak"] - kib["before"]) / 1024
    assert held_mb >= weights_mb, f"the engine holds {held_mb:.1f} MB, less than its {weights_mb:.1f} MB of weights"
    bound_mb = (1 + LOAD_SLACK) * weights_mb + pool_mb + ALLOWANCE_MB
    assert peak_mb <= bound_mb, (f"create_engine peaked {peak_mb:.1f} MB over its start: more than "
                                 f"{1 + LOAD_SLACK}x the {weights_mb:.1f} MB model + {pool_mb:.1f} MB KV pool "
                                 f"+ {ALLOWANCE_MB} MB")


def test_a_pytorch_model_bin_is_read_as_saved(tmp_path):
    """Each record is located in the zip and copied out: bf16 and fp32, a strided view into a
    larger storage, two names on one storage; each read is fresh memory of its own."""
    model = build(tmp_path / "m", "LlamaForCausalLM", seed=0, safetensors=False)
    spec = load_spec(model.folder / "config.json", model.folder)
    params = {name: p.default for name, p in engine_params("recompute").items()}
    path = tmp_path / "engine.py"
    path.write_text(render_engine(Plan("recompute", {}, params), None, spec.conventions))
    shared = torch.randn(7, 5, dtype=torch.bfloat16)
    saved = {"model.shared": shared, "lm_head.weight": shared, "model.vector": torch.randn(11),
             "model.strided": torch.randn(6, 9)[1:5, 2:7:2], "model.transposed": torch.randn(3, 8).t()}
    torch.save(saved, model.folder / "pytorch_model.bin")
    readers = load_engine_module(path).hf_tensors(str(model.folder))
    assert sorted(readers) == sorted(name.removeprefix("model.") for name in saved)
    reads = {name: readers[name.removeprefix("model.")]() for name in saved}
    for name, t in saved.items():
        assert reads[name].dtype == t.dtype and torch.equal(reads[name], t), name
    assert reads["model.shared"].data_ptr() != reads["lm_head.weight"].data_ptr()
