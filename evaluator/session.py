"""Drive one engine and the reference through a trace, checking every call as it returns.

Shared by the public sequence, the stress suite and the benchmark's checked pass, so all
apply the same guards: fresh tokens drawn by the harness, free device memory poisoned before
each call, outputs copied right after their call, inputs checked unchanged, no thread left
running, the reference fed the harness's pristine copies of every token.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from evaluator.common import Tolerance, WrongResult, call_engine, draw_tokens
from evaluator.guards import (Comparison, InputSnapshot, ThreadWatch, compare, poison_free_device_memory,
                              take_output)
from evaluator.reference_model import ReferenceModel
from evaluator.remote import RemoteEngine
from evaluator.traces import DECODE, PREFILL, Op


@dataclass
class SessionStats:
    calls: int = 0                     # outputs checked
    max_abs_err: float = 0.0
    max_rel_err: float = 0.0
    worst_margin: float = math.inf

    def add(self, c: Comparison) -> None:
        self.calls += 1
        self.max_abs_err = max(self.max_abs_err, c.max_abs_err)
        self.max_rel_err = max(self.max_rel_err, c.max_rel_err)
        self.worst_margin = min(self.worst_margin, c.margin)


class Histories:
    """Each live request's full token history, as the harness drew it (on the device)."""

    def __init__(self):
        self.tokens: dict[int, torch.Tensor] = {}

    def apply(self, op: Op, drawn: list[torch.Tensor]) -> None:
        if op.kind == PREFILL:
            self.tokens.update(zip(op.request_ids, drawn))
        elif op.kind == DECODE:
            (step,) = drawn
            for i, rid in enumerate(op.request_ids):
                self.tokens[rid] = torch.cat([self.tokens[rid], step[i:i + 1]])
        else:
            for rid in op.request_ids:
                self.tokens.pop(rid, None)


def draw_op_tokens(op: Op, gen: torch.Generator, vocab: int, device: str) -> list[torch.Tensor]:
    """The token tensors of one call: one prompt per request for prefill, one [B] tensor for
    decode, none for remove."""
    if op.kind == PREFILL:
        return [draw_tokens(gen, n, vocab, device) for n in op.lengths]
    if op.kind == DECODE:
        return [draw_tokens(gen, len(op.request_ids), vocab, device)]
    return []


def invoke(engine, op: Op, ids: list[int], drawn: list[torch.Tensor], what: str):
    """One engine call for `op`, its exceptions attributed to the candidate."""
    if op.kind == PREFILL:
        return call_engine(what, engine.prefill, ids, drawn)
    if op.kind == DECODE:
        return call_engine(what, engine.decode, ids, drawn[0])
    return call_engine(what, engine.remove, ids)


def reference_rows(reference: ReferenceModel, histories: Histories, request_ids) -> torch.Tensor:
    """What the judge expects: each request recomputed alone from its full history."""
    rows = [reference.last_logits(histories.tokens[rid]) for rid in request_ids]
    return torch.stack(rows).float().cpu()


def mismatch_message(what: str, c: Comparison, tol: Tolerance, request_ids) -> str:
    return (f"{what}: outputs differ from the reference: max abs err {c.max_abs_err:.4g} "
            f"(atol {tol.atol:g}), max rel err {c.max_rel_err:.4g} (rtol {tol.rtol:g}), "
            f"margin {c.margin:.3g}, worst row {c.worst_row} (request {request_ids[c.worst_row]})")


class CheckedSession:
    """Runs ops on an engine, checks each output against the reference right after its call."""

    def __init__(self, engine, reference: ReferenceModel, gen: torch.Generator,
                 tol: Tolerance = Tolerance(), label: str = "", threads: ThreadWatch | None = None,
                 rows_per_call: int | None = None):
        """`threads`: the threads alive before the candidate was imported (by default those
        alive now), checked after every call. `rows_per_call`: compare only this many rows of
        each output with the reference, drawn by an unseeded generator the engine cannot
        predict (every row is still validated); None compares every row."""
        self.engine, self.reference, self.gen, self.tol = engine, reference, gen, tol
        self.label = label
        self.threads = threads or ThreadWatch()
        self.rows_per_call = rows_per_call
        self._row_rng = random.SystemRandom()
        self.vocab = reference.dims.vocab
        self.device = reference.device
        # A worker's engine has its memory in the worker, which poisons it before each call
        # (evaluator/worker.py); poisoning the judge's own cached blocks as well cost a screen
        # ~1.5 s and a final ~5 s of walking the allocator's stats (thirty-second session).
        self.poisons_here = not isinstance(engine, RemoteEngine)
        self.histories = Histories()
        self.stats = SessionStats()
        self.step_index = 0

    def run(self, trace: list[Op]) -> SessionStats:
        for op in trace:
            self.step(op)
        return self.stats

    def step(self, op: Op) -> Comparison | None:
        self.step_index += 1
        what = f"{self.label}step {self.step_index} {op.describe()}"
        ids = list(op.request_ids)
        drawn = draw_op_tokens(op, self.gen, self.vocab, self.device)
        pristine = InputSnapshot.take(ids, drawn)
        if self.poisons_here:
            poison_free_device_memory(self.device)
        with torch.no_grad():
            out = invoke(self.engine, op, ids, drawn, what)
        self.threads.check(what)
        if op.kind not in (PREFILL, DECODE):
            pristine.check_unchanged(ids, drawn, what)
            self.histories.apply(op, [])
            return None
        got = take_output(out, len(ids), self.vocab, what)
        pristine.check_unchanged(ids, drawn, what)
        self.histories.apply(op, list(pristine.tensors))
        rows = list(range(len(ids)))
        if self.rows_per_call is not None and self.rows_per_call < len(rows):
            rows = sorted(self._row_rng.sample(rows, self.rows_per_call))
        checked_ids = [pristine.request_ids[r] for r in rows]
        c = compare(got[rows], reference_rows(self.reference, self.histories, checked_ids), self.tol)
        self.stats.add(c)
        if not c.passed:
            raise WrongResult(mismatch_message(what, c, self.tol, checked_ids))
        return c
