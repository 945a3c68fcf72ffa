"""The bf16 criterion for real checkpoints (evaluator/bf16_criterion.py): a sound bf16 engine
passes it, each known-wrong engine fails it; and on the CPU the rendered engine of each
architecture matches transformers' fp32 model at atol = rtol = 1e-2."""
from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from agent import search
from agent.render import render_engine
from agent.spec import load_spec
from evaluator.bf16_criterion import check as full_check
from evaluator.common import load_weights
from evaluator.reference_model import ReferenceModel
from tests.hf_models import ARCHITECTURES, build, transformers_model

pytest.importorskip("transformers")


STEPS = 10   # decode steps per trace: enough for the id reuse halfway, fast on a loaded CPU
DECIDING_TRACES = 3   # traces the sound engine may take until greedy agreement decides a step


def check(engine, config, weights):
    return full_check(engine, config, weights, steps=STEPS)


class RefEngine:
    """An engine that recomputes each request's history with the reference in `dtype`;
    `stale`: prefill of a known id appends to the old history (a cache that outlives remove)."""

    def __init__(self, config, weights, dtype, stale=False):
        self.model, self.stale, self.h = ReferenceModel(config, weights, "cpu", dtype=dtype), stale, {}

    def _rows(self, rids):
        return torch.stack([self.model.last_logits(self.h[r]) for r in rids])

    def prefill(self, rids, prompts):
        for r, p in zip(rids, prompts):
            self.h[r] = torch.cat([self.h[r], p]) if self.stale and r in self.h else p.clone()
        return self._rows(rids)

    def decode(self, rids, tokens):
        for r, t in zip(rids, tokens):
            self.h[r] = torch.cat([self.h[r], t.reshape(1)])
        return self._rows(rids)

    def remove(self, rids):
        if not self.stale:
            for r in rids:
                self.h.pop(r, None)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    root = tmp_path_factory.mktemp("crit")
    q2 = build(root / "q2", "Qwen2ForCausalLM", seed=random.randrange(2**31))
    q3 = build(root / "q3", "Qwen3ForCausalLM", seed=random.randrange(2**31))
    return {m.architecture: (m.config, load_weights(m.folder, m.config)) for m in (q2, q3)}


def test_sound_bf16_engine_passes(qwen):
    """Every trace passes, and greedy agreement decides steps in one of them. A short trace on a
    tiny random model can have every fp32 top-two gap under 2·tol (no step decided: seen about once
    in twenty runs), so up to DECIDING_TRACES traces with fresh prompts are run until one decides."""
    config, weights = qwen["Qwen3ForCausalLM"]
    for _ in range(DECIDING_TRACES):
        verdict = check(RefEngine(config, weights, torch.bfloat16), config, weights)
        assert verdict.passed, verdict.line()
        if verdict.decided:
            break
    assert verdict.reference_error > 0 and verdict.decided > 0


WRONG = {
    "wrong RoPE style": ("Qwen3ForCausalLM", lambda c, w: ({k: v for k, v in c.items() if k != "architectures"}, w)),
    "missing q/k norm": ("Qwen3ForCausalLM", lambda c, w: (dict(c, architectures=["LlamaForCausalLM"], model_type="llama"), w)),
    "missing bias": ("Qwen2ForCausalLM", lambda c, w: (c, {k: v for k, v in w.items() if not k.endswith(".bias")})),
}


@pytest.mark.parametrize("mistake", list(WRONG))
def test_wrong_engines_fail(qwen, mistake):
    arch, spoil = WRONG[mistake]
    config, weights = qwen[arch]
    verdict = check(RefEngine(*spoil(config, weights), torch.bfloat16), config, weights)
    assert not verdict.passed, verdict.line()


def test_stale_cache_after_id_reuse_fails(qwen):
    config, weights = qwen["Qwen2ForCausalLM"]
    verdict = check(RefEngine(config, weights, torch.bfloat16, stale=True), config, weights)
    assert not verdict.passed, verdict.line()


def _engine(spec):
    source = render_engine(search.conservative_plan(), None, spec.conventions)
    module_spec = importlib.util.spec_from_loader(f"hf_engine_{random.randrange(10**9)}", loader=None)
    module = importlib.util.module_from_spec(module_spec)
    exec(compile(source, "engine.py", "exec"), module.__dict__)  # noqa: S102 - our own rendered engine
    return module.create_engine(spec.config, spec.weight_dir, "cpu")


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_rendered_engine_matches_transformers_on_cpu(tmp_path, arch):
    """Stored bf16, computed in fp32 on the CPU as the course's CPU path does; a batch of two
    ragged requests, then a decode step, against transformers' fp32 model on each history."""
    model = build(tmp_path / "m", arch, seed=random.randrange(2**31), dtype=torch.bfloat16,
                  tied=arch == "LlamaForCausalLM", llama3=arch == "LlamaForCausalLM")
    engine = _engine(load_spec(model.folder / "config.json", model.folder))
    theirs = transformers_model(model.folder, torch.float32)
    prompts = [torch.randint(0, model.config["vocab_size"], (n,)) for n in (37, 5)]
    got = engine.prefill([11, 4], prompts)
    step = torch.randint(0, model.config["vocab_size"], (2,))
    got_next = engine.decode([4, 11], step.flip(0))
    with torch.no_grad():
        for row, p in enumerate(prompts):
            torch.testing.assert_close(got[row], theirs(p[None]).logits[0, -1], atol=1e-2, rtol=1e-2)
        longer = torch.cat([prompts[0], step[:1]])
        torch.testing.assert_close(got_next[1], theirs(longer[None]).logits[0, -1], atol=1e-2, rtol=1e-2)
