"""The kernel slots' contract, in one place (docs/design.md §5): the ordered slot names, each
slot's functions with their signatures, which of them are optional, and the prelude every
rendered kernel module starts with.

The evaluator owns the truth, so it lives here; everything else reads it: the slot unit checks
(evaluator/slot_check.py, slot_cases.py), the renderer (evaluator/slot_render.py,
agent/render.py), the plan menu (agent/plan.py) and the LLM prompts (agent/providers/prompts.py,
proposals.py). The numerics each function must match are written in the slot's reference
variant (templates/kernels/<slot>/torch.py.j2, its `# contract:` block) and, independently,
as the reference ops of evaluator/slot_refs.py.

A variant `V` of slot `S` defines each function of `S` suffixed `__V` (`rmsnorm__triton`),
taking the arguments below in this order. Shapes: `N` packed tokens, `B` requests, `Hq`/`Hkv`
heads, `D` head_dim, `H` hidden, `I` intermediate, `K`/`O` a projection's input/output width,
`P` RoPE table rows, `S` cache slots, `M` block-table columns; tensors are in the compute dtype
unless an integer type is named. Standard library only: the agent imports it without torch.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

_NAME = re.compile(r"\w+")


@dataclass(frozen=True)
class SlotFunction:
    """One function of a slot's contract."""

    name: str
    args: tuple[str, ...]        # in call order: `name`, `name[shape] type` or `name: type`
    returns: tuple[str, ...]     # the outputs, in order; () when it works in place and returns None
    contract: str                # what it does, one line (the numerics: the reference variant)
    writes: tuple[str, ...] = ()  # arguments it must update in place
    optional: bool = False       # a variant may leave it out; checked and bound when present

    @property
    def arg_names(self) -> tuple[str, ...]:
        return tuple(_NAME.match(a).group(0) for a in self.args)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(_NAME.match(r).group(0) for r in self.returns)

    def signature(self, variant: str) -> str:
        """`name__variant(args) -> outputs`, the arguments by name only (as Python spells them)."""
        return f"{self.name}__{variant}({', '.join(self.arg_names)}) -> {self.result()}"

    def result(self) -> str:
        if not self.returns:
            return "None"
        return self.returns[0] if len(self.returns) == 1 else f"({', '.join(self.returns)})"

    def describe(self, variant: str) -> str:
        """One line for a reader (a prompt, a doc): the signature, the shapes and the contract."""
        writes = f" Updates {', '.join(self.writes)} in place." if self.writes else ""
        return f"`{self.signature(variant)}`; arguments {', '.join(self.args)}; {self.contract}.{writes}"


_ROPE_ARGS = ("cos[P,D/2]", "sin[P,D/2]", "positions[N] i64", "slot_mapping[N] i64",
              "k_cache[S,Hkv,D]", "v_cache[S,Hkv,D]")
_PREFILL_ARGS = ("cu_seqlens[B+1] i32 (on the device)", "seq_lens: list[int]", "max_seqlen: int", "scale: float")

# slot -> its functions, in the order the engine defines the slots.
CONTRACTS: dict[str, tuple[SlotFunction, ...]] = {
    "norm": (
        SlotFunction("rmsnorm", ("x[N,H]", "w[H]", "eps: float"), ("y[N,H]",),
                     "RMSNorm of each row of x, times w; x is not modified"),
        SlotFunction("add_rmsnorm", ("x[N,H]", "residual[N,H]", "w[H]", "eps: float"),
                     ("y[N,H]", "new_residual[N,H]"),
                     "new_residual = x + residual (rounded to dt), y = rmsnorm(new_residual, w, eps)"),
    ),
    "rope_cache": (
        SlotFunction("rope_cache", ("q[N,Hq,D]", "k[N,Hkv,D]", "v[N,Hkv,D]") + _ROPE_ARGS, (),
                     "rotates q and k (interleaved RoPE at positions), then k_cache[slot_mapping] = k and "
                     "v_cache[slot_mapping] = v; q, k, v may be strided views of one fused QKV output",
                     writes=("q", "k", "k_cache", "v_cache")),
    ),
    "prefill_attention": (
        SlotFunction("prefill_attention", ("q[N,Hq,D]", "k[N,Hkv,D]", "v[N,Hkv,D]") + _PREFILL_ARGS,
                     ("o[N,Hq,D]",),
                     "causal attention within each packed sequence (GQA: query head h reads kv head "
                     "h // (Hq // Hkv)); q, k, v may be strided views"),
        SlotFunction("prefill_attention_rope_cache",
                     ("q[N,Hq,D]", "k[N,Hkv,D]", "v[N,Hkv,D]") + _ROPE_ARGS + _PREFILL_ARGS, ("o[N,Hq,D]",),
                     "what rope_cache does to q, k and the caches, then prefill_attention on the rotated "
                     "q and k (q and k may come back rotated or not); the paged engine then runs no "
                     "rope_cache kernel in its prefill passes above fused_rows",
                     writes=("k_cache", "v_cache"), optional=True),
    ),
    "decode_attention": (
        SlotFunction("decode_attention",
                     ("q[B,Hq,D]", "k_cache[S,Hkv,D]", "v_cache[S,Hkv,D]", "block_table[B,M] i32",
                      "context_lens[B] i32", "max_context: int", "block_size: int", "scale: float"),
                     ("o[B,Hq,D]",),
                     "request b attends to the cache slots block_table[b, j // block_size] * block_size "
                     "+ j % block_size for j < context_lens[b]; max_context bounds context_lens and may "
                     "size the work, never the result"),
    ),
    "silu_mul": (
        SlotFunction("silu_mul", ("gate_up[N,2I]",), ("out[N,I]",),
                     "F.silu(gate) * up, gate the first I columns and up the last I"),
    ),
    "linear": (
        SlotFunction("linear", ("x[N,K]", "weight[O,K]"), ("y[N,O]",),
                     "the bare GEMM x @ weight.T, fp32 accumulation rounded once to dt"),
        SlotFunction("linear_silu", ("x[N,K]", "weight[2I,K]"), ("a[N,I]",),
                     "the gate/up GEMM, then F.silu(gate) * up (gate the first I output columns)"),
        SlotFunction("linear_add_norm", ("x[N,K]", "weight[O,K]", "residual[N,O]", "norm_w[O]", "eps: float"),
                     ("y[N,O]", "new_residual[N,O]"),
                     "new_residual = residual + linear(x, weight), y = rmsnorm(new_residual, norm_w, eps)"),
        SlotFunction("linear_rope_cache", ("x[N,K]", "weight[O,K]") + _ROPE_ARGS, ("qkv[N,O]",),
                     "the QKV GEMM (O = (Hq + 2 Hkv) * D, Hkv and D from k_cache), then what rope_cache "
                     "does to its q, k and v heads; returns qkv with q and k rotated",
                     writes=("k_cache", "v_cache")),
    ),
}

SLOTS: tuple[str, ...] = tuple(CONTRACTS)
# slot -> the names of the functions every variant defines / may define.
SLOT_FUNCTIONS: dict[str, tuple[str, ...]] = {
    s: tuple(f.name for f in fns if not f.optional) for s, fns in CONTRACTS.items()}
OPTIONAL_FUNCTIONS: dict[str, tuple[str, ...]] = {
    s: tuple(f.name for f in fns if f.optional) for s, fns in CONTRACTS.items()}


def function(slot: str, name: str) -> SlotFunction:
    """The contract of one function of `slot`."""
    return next(f for f in CONTRACTS[slot] if f.name == name)


# The imports every rendered module starts with: triton only where CUDA is present.
PRELUDE = '''import math
import torch
import torch.nn.functional as F
try:
    if not torch.cuda.is_available():
        raise ImportError
    import triton
    import triton.language as tl
except ImportError:
    triton = None
    tl = None


def _triton_has_pdl():
    """Whether this Triton has programmatic dependent launch (gdc_wait and the launch_pdl launch
    option arrived together, after Triton 3.0: an older one refuses launch_pdl even when False)."""
    try:
        from triton.language.extra.cuda import gdc_wait  # noqa: F401
    except ImportError:
        return False
    return True


# Programmatic dependent launch (a kernel starts before the previous one ends) needs sm_90+ and a
# Triton that has it. A variant passes the launch_pdl option only when it launches with PDL.
PDL_SUPPORTED = (triton is not None and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
                 and _triton_has_pdl())
# Shared memory one Triton program may take on this GPU, the bound Triton checks each compiled
# kernel against (no bound in the CPU interpreter).
MAX_SHARED_MEMORY = (triton.runtime.driver.active.utils.get_device_properties(torch.cuda.current_device())[
    "max_shared_mem"] if triton is not None and torch.cuda.is_available() else math.inf)
DEFAULT_SM_COUNT = 132   # an H100's, where the device has none to tell (the CPU, Triton's interpreter)
_SM_COUNTS = {}


def sm_count(device):
    """The device's SMs (streaming multiprocessors), asked once a device: what a kernel sizes its
    grid or its pipeline by, to fill the GPU in one wave."""
    key = str(device)
    if key not in _SM_COUNTS:
        _SM_COUNTS[key] = (torch.cuda.get_device_properties(device).multi_processor_count
                           if device.type == "cuda" else DEFAULT_SM_COUNT)
    return _SM_COUNTS[key]


def fit_shared_memory(block_n, stages, rows, width, elem_bytes, min_block_n=16):
    """(block_n, stages) for an attention kernel that keeps a [rows, width] query tile and, per
    pipeline stage, a [block_n, width] key tile and value tile in shared memory: stages given up
    first, then halves of the key tile, until they fit MAX_SHARED_MEMORY. Tiles tuned for
    head_dim <= 192 ask more than a GPU has at wide heads (an H100, head_dim 384: 240 KiB of 227,
    the figure of Triton's error)."""
    while elem_bytes * width * (rows + 2 * stages * block_n) > MAX_SHARED_MEMORY:
        if stages > 1:
            stages -= 1
        elif block_n > min_block_n:
            block_n //= 2
        else:
            break
    return block_n, stages


def fit_gemm_shared_memory(block_k, stages, rows, cols, elem_bytes, min_block_k=32):
    """(block_k, stages) for a GEMM that stages, per pipeline stage, a [rows, block_k] activation
    tile and a [cols, block_k] weight tile in shared memory: stages given up first, then halves of
    block_k, until they fit MAX_SHARED_MEMORY. Tiles tuned on an H100 (227 KiB a program) ask more
    than an sm_86 GPU has (99 KiB): a 64-row SwiGLU tile over 4 stages is 128 KiB."""
    while elem_bytes * block_k * stages * (rows + cols) > MAX_SHARED_MEMORY:
        if stages > 1:
            stages -= 1
        elif block_k > min_block_k:
            block_k //= 2
        else:
            break
    return block_k, stages
'''
