"""Shared pieces of the serve tests: a service over a rendered engine on a tiny model, an engine
spy that tracks which requests hold state, and the engine driven directly (the reference)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from evaluator.common import load_engine_module
from serve.model import load_model, resolve_source
from serve.service import Service
from serve.settings import ServeSettings


class SpyEngine:
    """Forwards the engine API and records which request ids hold state in the engine."""

    def __init__(self, engine):
        self.engine = engine
        self.live: set[int] = set()
        self.calls: list[tuple[str, list[int]]] = []

    def prefill(self, ids, prompts):
        self.calls.append(("prefill", list(ids)))
        self.live.update(ids)
        return self.engine.prefill(ids, prompts)

    def decode(self, ids, tokens):
        self.calls.append(("decode", list(ids)))
        assert set(ids) <= self.live, f"decode of ids without state: {set(ids) - self.live}"
        return self.engine.decode(ids, tokens)

    def remove(self, ids):
        self.calls.append(("remove", list(ids)))
        self.live.difference_update(ids)
        return self.engine.remove(ids)


def make_service(engine: Path, weights: Path, max_context: int | None = None, **settings) -> tuple[Service, SpyEngine]:
    """A service (not started: the caller starts it) whose engine is spied on."""
    model = load_model(resolve_source(engine, weights, None), "cpu", max_context)
    spy = model.engine = SpyEngine(model.engine)
    return Service(model, ServeSettings(**settings)), spy


def greedy_direct(engine: Path, config_path: Path, weights: Path, jobs: list[tuple[list[int], int]]) -> list[list[int]]:
    """Greedy tokens of each (prompt, steps), one request at a time through a fresh engine,
    as a user of the engine API would drive it: the reference the server must match."""
    eng = load_engine_module(engine).create_engine(json.loads(config_path.read_text()), str(weights), "cpu")
    outs = []
    with torch.inference_mode():
        for prompt, steps in jobs:
            logits = eng.prefill([0], [torch.tensor(prompt, dtype=torch.long)])
            out = [int(logits[0].argmax())]
            while len(out) < steps:
                out.append(int(eng.decode([0], torch.tensor(out[-1:], dtype=torch.long))[0].argmax()))
            eng.remove([0])
            outs.append(out)
    return outs


def engine_idle(spy: SpyEngine, timeout: float = 10.0) -> bool:
    """True once no request holds engine state. The scheduler removes a finished request right
    after emitting its last token, so a client may read the end just before the remove."""
    deadline = time.monotonic() + timeout
    while spy.live and time.monotonic() < deadline:
        time.sleep(0.002)
    return not spy.live


class KVBudget:
    """An engine with room for `capacity` tokens of KV cache in all, as an engine whose pool cannot
    grow: a call that would hold more raises torch.OutOfMemoryError, having done part of its work
    first, as a real engine may (the paged engine's decode moves its requests' lengths on before
    it grows the pool): a prefill gives its first request state, a decode feeds its first request
    its token. A scheduler that called again without prefilling them anew would drift off the
    engine's output. `ran_out` lists the calls that ran out ("prefill" | "decode")."""

    def __init__(self, engine, capacity: int):
        self.engine, self.capacity = engine, capacity
        self.lengths: dict[int, int] = {}
        self.ran_out: list[str] = []

    def _fits(self, kind: str, lengths: dict[int, int]) -> None:
        if sum(lengths.values()) > self.capacity:
            self.ran_out.append(kind)
            raise torch.OutOfMemoryError(f"CUDA out of memory: {sum(lengths.values())} tokens of KV cache, "
                                         f"room for {self.capacity}")

    def prefill(self, ids, prompts):
        lengths = {**self.lengths, **{i: len(p) for i, p in zip(ids, prompts)}}
        if sum(lengths.values()) > self.capacity:
            self.engine.prefill(ids[:1], prompts[:1])
            self.lengths[ids[0]] = len(prompts[0])
        self._fits("prefill", lengths)
        self.lengths = lengths
        return self.engine.prefill(ids, prompts)

    def decode(self, ids, tokens):
        lengths = {**self.lengths, **{i: self.lengths[i] + 1 for i in ids}}
        if sum(lengths.values()) > self.capacity:
            self.engine.decode(ids[:1], tokens[:1])
            self.lengths[ids[0]] += 1
        self._fits("decode", lengths)
        self.lengths = lengths
        return self.engine.decode(ids, tokens)

    def remove(self, ids):
        for i in ids:
            self.lengths.pop(i, None)
        return self.engine.remove(ids)
