"""Anti-cheat guards (LESSONS.md §B), kept in one place so they can be extended together.

- Outputs must be plain `torch.Tensor`s with storage, of shape [B, vocab], all finite, and
  are copied to the CPU right after their call, before the engine runs again (a lazy or
  recycled buffer cannot change what is compared).
- Inputs are snapshotted before each call and compared after it: an engine that mutates
  its inputs so that the reference agrees is caught, and the reference always reads the
  harness's own pristine copies.
- The functions the harness times and compares with, and every function and class of the
  evaluator's own modules, are snapshotted before the candidate is imported and checked after
  it has run: patching the timer, `synchronize` or the judge's comparison is caught.
- Python threads alive after a call that were not alive before the candidate was imported
  outlived the call: work hidden from the timer, or state changing behind the harness's back.
- On CUDA, the caching allocator's free memory is filled with NaN before every checked call,
  so an engine that reads memory it never wrote (a recycled block, a stale buffer) shows it.
"""
from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass

import torch

from evaluator.common import Tolerance, WrongResult

# Reference magnitudes below this count as this, so max_rel_err stays readable near zero.
REL_ERR_FLOOR = 1e-6

# (owner, attribute) pairs whose identity must not change while a candidate runs.
_WATCHED = (
    (time, "perf_counter"), (time, "time"), (torch, "allclose"), (torch, "isfinite"),
    (torch, "equal"), (torch, "no_grad"), (torch.cuda, "synchronize"),
    (torch.cuda, "max_memory_allocated"), (torch.cuda, "reset_peak_memory_stats"),
    (torch.Tensor, "float"), (torch.Tensor, "cpu"), (torch.Tensor, "clone"),
    (torch.Tensor, "__sub__"), (torch.Tensor, "abs"), (torch.Tensor, "max"),
)


EVALUATOR_PACKAGE = "evaluator"


def _evaluator_bindings() -> list[tuple[object, str]]:
    """(owner, name) of every function and class bound in a loaded evaluator module, and of
    every attribute of the classes those modules define: what the judge calls to decide."""
    out = []
    for module_name, module in list(sys.modules.items()):
        if module is None or (module_name != EVALUATOR_PACKAGE and not module_name.startswith(EVALUATOR_PACKAGE + ".")):
            continue
        for name, value in list(vars(module).items()):
            if callable(value):
                out.append((module, name))
            if isinstance(value, type) and value.__module__ == module_name:
                out += [(value, attr) for attr in vars(value) if not attr.startswith("__")]
    return out


class ThreadWatch:
    """The Python threads alive before the candidate was imported; any other thread alive after
    one of its calls outlived that call."""

    def __init__(self):
        self._before = set(threading.enumerate())

    def check(self, what: str) -> None:
        extra = [t for t in threading.enumerate() if t not in self._before and t.is_alive()]
        if extra:
            names = ", ".join(t.name for t in extra[:3])
            raise WrongResult(f"{what}: the engine left {len(extra)} thread(s) running ({names}); "
                              "all work must finish inside the call that started it")


class FunctionIdentities:
    """Identities of the harness's timing and comparison functions and of the evaluator's own
    functions and classes, taken before the candidate is imported; and the threads alive then."""

    def __init__(self):
        self._objs = {self._name(o, a): getattr(o, a) for o, a in _WATCHED}
        self._own = [(o, a, vars(o).get(a)) for o, a in _evaluator_bindings()]
        self.threads = ThreadWatch()

    @staticmethod
    def _name(owner, attr: str) -> str:
        return f"{getattr(owner, '__name__', type(owner).__name__)}.{attr}"

    def check(self, when: str) -> None:
        for (owner, attr) in _WATCHED:
            name = self._name(owner, attr)
            if getattr(owner, attr) is not self._objs[name]:
                raise WrongResult(f"{name} was replaced ({when}): the candidate patched the harness")
        for owner, attr, obj in self._own:
            if vars(owner).get(attr) is not obj:
                raise WrongResult(f"{self._name(owner, attr)} was replaced ({when}): the candidate patched the evaluator")
        self.threads.check(when)


@dataclass(frozen=True)
class InputSnapshot:
    """Pristine copies of one call's arguments."""

    request_ids: tuple[int, ...]
    tensors: tuple[torch.Tensor, ...]

    @staticmethod
    def take(request_ids: list[int], tensors: list[torch.Tensor]) -> "InputSnapshot":
        return InputSnapshot(tuple(request_ids), tuple(t.detach().clone() for t in tensors))

    def check_unchanged(self, request_ids: list[int], tensors: list[torch.Tensor], what: str) -> None:
        if tuple(request_ids) != self.request_ids:
            raise WrongResult(f"{what}: the engine modified the request_ids list it was given")
        for i, (now, before) in enumerate(zip(tensors, self.tensors)):
            if now.shape != before.shape or now.dtype != before.dtype or not torch.equal(now, before):
                raise WrongResult(f"{what}: the engine modified its input tensor {i} in place")


def take_output(out: object, rows: int, vocab: int, what: str) -> torch.Tensor:
    """Validate an engine output and return a private fp32 CPU copy of it.

    Any floating dtype is accepted (the harness compares `out.float().cpu()`), but it must
    be a plain tensor with storage (no lazy subclass computing on comparison), of shape
    [rows, vocab], with finite values.
    """
    if type(out) is not torch.Tensor:
        raise WrongResult(f"{what}: returned {type(out).__name__}, not a plain torch.Tensor")
    if out.layout != torch.strided or out.device.type == "meta":
        raise WrongResult(f"{what}: returned a {out.layout} tensor on {out.device}, not a dense tensor with storage")
    if tuple(out.shape) != (rows, vocab):
        raise WrongResult(f"{what}: returned shape {tuple(out.shape)}, expected {(rows, vocab)}")
    if not out.is_floating_point():
        raise WrongResult(f"{what}: returned dtype {out.dtype}, expected a floating dtype")
    copy = out.detach().float().cpu().clone()
    if not torch.isfinite(copy).all():
        raise WrongResult(f"{what}: output has {int((~torch.isfinite(copy)).sum())} non-finite values")
    return copy


@dataclass(frozen=True)
class Comparison:
    """How far an output is from the reference, and how much slack the tolerance leaves.

    margin = 1 - max((|s - r| - rtol*|r|) / atol): 1 means exact, 0 means at the
    tolerance, below 0 means outside it; `passed` is exactly torch.allclose's verdict.
    """

    max_abs_err: float
    max_rel_err: float
    margin: float
    worst_row: int
    passed: bool


def compare(student: torch.Tensor, reference: torch.Tensor, tol: Tolerance) -> Comparison:
    """student and reference: fp32 CPU tensors of the same shape [rows, vocab]."""
    diff = (student - reference).abs()
    excess = (diff - tol.rtol * reference.abs()) / tol.atol
    worst = excess.amax(dim=-1)
    rel = diff / reference.abs().clamp_min(REL_ERR_FLOOR)
    return Comparison(
        max_abs_err=float(diff.max()),
        max_rel_err=float(rel.max()),
        margin=float(1 - worst.max()),
        worst_row=int(worst.argmax()),
        passed=bool(torch.allclose(student, reference, atol=tol.atol, rtol=tol.rtol)),
    )


# Every byte of a poisoned block: NaN read as fp32, fp16 or bf16 (and -1 as an integer index).
POISON_BYTE = 0xFF
SMALL_REQUEST = 1 << 20   # the caching allocator serves requests up to 1 MiB from its small segments


def _cached_free_blocks() -> list[int]:
    """Request sizes, largest first, that the CUDA caching allocator can serve from blocks it holds
    free for the current stream in its default pool: each large free block whole, free memory in
    small segments in requests of at most 1 MiB (a larger request would open a large segment)."""
    stream = torch.cuda.current_stream().cuda_stream
    sizes = []
    for seg in torch.cuda.memory_snapshot():
        if seg["stream"] != stream or tuple(seg["segment_pool_id"]) != (0, 0):
            continue
        small = seg["segment_type"] == "small"
        for block in seg["blocks"]:
            if block["state"] != "inactive":
                continue
            if not small:
                if block["size"] > SMALL_REQUEST:
                    sizes.append(block["size"])
                continue
            whole, rest = divmod(block["size"], SMALL_REQUEST)
            sizes += [SMALL_REQUEST] * whole + ([rest] if rest else [])
    return sorted(sizes, reverse=True)


def _reserved_bytes() -> int:
    """torch.cuda.memory_reserved() without flattening every allocator statistic into a dict
    first (that took ~0.5 ms a call, ~40 calls a poisoning on a judge's GPU: thirty-second
    session)."""
    return int(torch.cuda.memory_stats_as_nested_dict().get("reserved_bytes", {}).get("all", {}).get("current", 0))


def poison_free_device_memory(device: str) -> None:
    """Fill the memory the CUDA caching allocator holds but has not handed out with NaN.

    Each free block is taken (allocated at its exact size, largest first, so each request lands
    on its own block), filled, and all are freed again: the next torch.empty in the engine gets
    NaN, not a plausible stale tensor (the reference's last logits, a request that was just
    removed). The blocks come from the allocator's own list, never a guess: an earlier form
    allocated power-of-two sizes while the free total allowed, and each time the free memory was
    fragmented it opened a fresh 1 GiB segment, kept in the cache; a stress run reserved 78 GiB
    that way and the next engine ran out of memory. Should a request still open a segment, it is
    handed back at once. Nothing to do on the CPU, whose allocator returns large blocks to the
    system."""
    if device != "cuda":
        return
    reserved = _reserved_bytes()
    taken = []
    for size in _cached_free_blocks():
        block = torch.empty(size, dtype=torch.uint8, device="cuda")
        if _reserved_bytes() != reserved:   # not a cached block after all
            del block
            torch.cuda.empty_cache()
            break
        block.fill_(POISON_BYTE)
        taken.append(block)
    del taken


# Digest keys are below 2**KEY_BITS and digits are signed 16-bit halves (|h| <= 2**15), two a
# value, so a row's sum stays below 2**53 up to a vocabulary of 2**(53 - 15 - KEY_BITS - 1) =
# 262144 (no integer overflow, and exact in any order, on any device).
DIGEST_KEY_BITS = 19


def digest_key(vocab: int, gen: torch.Generator) -> torch.Tensor:
    """A fresh [2 * vocab] int64 key for output_digest: one a 16-bit half of a row's values, never
    0 (a half keyed 0 would not be in the digest: ~0.6 halves a trace at a 152k vocabulary)."""
    return torch.randint(1, 2**DIGEST_KEY_BITS, (2 * vocab,), generator=gen, dtype=torch.int64)


def output_digest(rows: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """A keyed digest of each row's exact fp32 bit patterns: the sum over the row's 16-bit halves
    (each value's two, read as signed) of half * its key. The worker sends these with a timed
    trace's answer, before the outputs themselves travel (after the clock): it cannot produce
    them for outputs it has not computed, and the bits are not linear in anything cheaper
    (unlike a plain sum of logits, which a cheat could get from the final hidden state and a
    column sum of lm_head). Three kernels on a GPU (the widening, the products, the sums): it
    runs inside the judge's clock; an earlier form of masks and shifts took nine. It is linear in the
    halves, though, and the worker holds the key: outputs computed after the answer can have their
    low halves fitted to digests sent first, so the handover is timed too (evaluator/remote.py
    HANDOVER_FACTOR)."""
    halves = rows.contiguous().view(torch.int16).to(torch.int64)
    # Products and sums, not a matmul: CUDA has no integer matmul.
    return (halves * key).sum(dim=1)
