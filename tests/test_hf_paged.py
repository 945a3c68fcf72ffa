"""The paged KV-cache engine rendered for Hugging Face checkpoints (rotate-half RoPE through
permuted q/k rows, llama3 scaling, q/k/v biases, q/k norm, tied embeddings, explicit head_dim)
matches transformers' fp32 model on the CPU at the CPU criterion (atol = rtol = 1e-2), over
a trace with ragged prefills (above and below the fused-projection size), ragged decode steps,
a prompt added while others decode, and ids reused after remove and by a second prefill."""
from __future__ import annotations

import random

import pytest
import torch

from agent.plan import Plan, engine_params
from agent.render import render_engine
from agent.spec import load_spec
from evaluator.common import load_engine_module
from tests.hf_models import ARCHITECTURES, build, transformers_model

pytest.importorskip("transformers")

TOLERANCE = dict(atol=1e-2, rtol=1e-2)
# How each architecture's checkpoint is built: every convention the paged engine renders is on
# in at least one (TINY's head_dim 24 differs from hidden / heads = 16 in all of them).
OPTIONS = {
    "LlamaForCausalLM": dict(tied=True, llama3=True, dtype=torch.bfloat16),
    "MistralForCausalLM": dict(sharded=True),
    "Qwen2ForCausalLM": dict(sharded=True, dtype=torch.bfloat16),
    "Qwen3ForCausalLM": dict(dtype=torch.bfloat16, tied=True, safetensors=False),   # a pytorch_model.bin
}


def paged_engine(spec, folder, block_size=16, device="cpu"):
    """The paged engine of `spec`'s conventions, all-torch slots, written to `folder` and created."""
    defaults = {name: p.default for name, p in engine_params("paged").items()}
    path = folder / "engine.py"
    path.write_text(render_engine(Plan("paged", {}, dict(defaults, block_size=block_size)), None, spec.conventions))
    return load_engine_module(path).create_engine(spec.config, spec.weight_dir, device)


class Histories:
    """Each live request's tokens, and transformers' last-position logits on them."""

    def __init__(self, model):
        self.model, self.tokens = model, {}

    def expect(self, rids):
        with torch.no_grad():
            return torch.stack([self.model(self.tokens[r][None]).logits[0, -1] for r in rids])


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_paged_engine_matches_transformers_on_cpu(tmp_path, arch):
    model = build(tmp_path / "m", arch, seed=random.randrange(2**31), **OPTIONS[arch])
    spec = load_spec(model.folder / "config.json", model.folder)
    engine = paged_engine(spec, tmp_path, block_size=random.choice((16, 32)))
    h = Histories(transformers_model(model.folder, torch.float32))
    vocab = model.config["vocab_size"]

    def prefill(rids, lengths):
        prompts = [torch.randint(0, vocab, (n,)) for n in lengths]
        h.tokens.update(zip(rids, prompts))
        torch.testing.assert_close(engine.prefill(rids, prompts), h.expect(rids), **TOLERANCE)

    def decode(rids):
        step = torch.randint(0, vocab, (len(rids),))
        for r, t in zip(rids, step):
            h.tokens[r] = torch.cat([h.tokens[r], t.reshape(1)])
        torch.testing.assert_close(engine.decode(rids, step), h.expect(rids), **TOLERANCE)

    prefill([11, 4], [37, 50])      # 87 tokens: above FUSED_ROWS, cuBLAS and the rope_cache slot
    for _ in range(3):
        decode([4, 11])             # the linear slot's fused projections
    prefill([7], [5])               # a small prefill while the others decode (fused)
    decode([7, 11, 4])
    engine.remove([4])
    h.tokens.pop(4)
    prefill([11, 4], [9, 3])        # id 11 replaced while live, id 4 reused after remove
    for _ in range(2):
        decode([4, 7, 11])          # ragged contexts (4, 7, 10 tokens ... 6 to 12)


@pytest.mark.parametrize("engine_name", ["paged", "recompute"])
def test_a_context_past_the_sliding_window_is_refused(tmp_path, engine_name):
    """A Mistral model whose window covers max_position_embeddings is taken (the agent refuses
    any other), but both engines attend to every position: past the window they would answer for
    another model (by 0.3 at the logits one token past it, a sweep of unseen checkpoints,
    twenty-ninth session). Up to the window they run; one token past it, by prefill or by
    decode, is a ValueError naming the window."""
    model = build(tmp_path / "m", "MistralForCausalLM", max_position_embeddings=40, sliding_window=40)
    spec = load_spec(model.folder / "config.json", model.folder)
    if engine_name == "paged":
        engine = paged_engine(spec, tmp_path)
    else:
        path = tmp_path / "engine.py"
        path.write_text(render_engine(Plan("recompute"), None, spec.conventions))
        engine = load_engine_module(path).create_engine(spec.config, spec.weight_dir, "cpu")
    vocab = model.config["vocab_size"]
    engine.prefill([0, 1], [torch.randint(0, vocab, (40,)), torch.randint(0, vocab, (38,))])
    engine.decode([1], torch.randint(0, vocab, (1,)))                 # request 1 at 39
    with pytest.raises(ValueError, match="sliding window of 40"):
        engine.decode([1, 0], torch.randint(0, vocab, (2,)))          # 41 for request 0
    engine.decode([1], torch.randint(0, vocab, (1,)))                 # request 1 untouched by that call: 40
    with pytest.raises(ValueError, match="sliding window of 40"):
        engine.decode([1], torch.randint(0, vocab, (1,)))             # and now 41
    with pytest.raises(ValueError, match="sliding window of 40"):
        engine.prefill([2], [torch.randint(0, vocab, (41,))])


@pytest.mark.parametrize("engine_name", ["paged", "recompute"])
def test_an_engine_refuses_a_config_of_other_conventions(tmp_path, engine_name):
    """An engine is written for its target's conventions: given a folder of the same family whose
    head is untied, it had used the embedding as the head (4 off at the logits); now create_engine
    is a ValueError naming what differs. The architectures table it carries is the agent's."""
    from evaluator.checkpoint import ARCHITECTURES
    tied = build(tmp_path / "tied", "Qwen3ForCausalLM", tied=True)
    untied = build(tmp_path / "untied", "Qwen3ForCausalLM")
    spec = load_spec(tied.folder / "config.json", tied.folder)
    if engine_name == "paged":
        paged_engine(spec, tmp_path)
    else:
        (tmp_path / "engine.py").write_text(render_engine(Plan("recompute"), None, spec.conventions))
    module = load_engine_module(tmp_path / "engine.py")
    assert module.ARCHITECTURES == ARCHITECTURES
    module.create_engine(tied.config, str(tied.folder), "cpu")
    with pytest.raises(ValueError, match="tied embeddings True; this config's model has tied embeddings False"):
        module.create_engine(untied.config, str(untied.folder), "cpu")
    # the course's config (no architectures) had read "q/k/v biases None, q/k norm None"
    with pytest.raises(ValueError, match=r"written for a Hugging Face model folder .*'architectures': None"):
        module.create_engine({k: v for k, v in tied.config.items() if k != "architectures"}, str(tied.folder), "cpu")
