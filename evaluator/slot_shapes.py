"""The shapes at which the paged engine really calls each slot's functions, for one model and
the benchmark traces (docs/design.md §5).

Why: a kernel's speed at the unit check's edge sizes says little about the engine; what counts
is its time at the calls the benchmark makes. This walks the benchmark traces
(evaluator/traces.py) the way the paged engine's forward pass does
(templates/engine/paged/forward.py.j2): a pass of N tokens at most `fused_rows` runs the linear
slot's fused projections (linear_rope_cache, linear_add_norm, linear_silu) and no norm,
rope_cache or silu_mul kernel after the first norm; a longer pass runs rmsnorm once, then per
layer rope_cache, two add_rmsnorm and silu_mul (its GEMMs are cuBLAS, outside the slots).
Prefill passes call prefill_attention, decode passes decode_attention, once per layer.

Each `CallShape` carries a `spec` that evaluator.slot_cases.make_inputs builds inputs from, so
the unit worker can time a variant at exactly these sizes (evaluator/slot_timing.py), and a
label for the model's prompt ("N=512, H=768"). Standard library only.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

from evaluator.checkpoint import COURSE_EPS
from evaluator.traces import DECODE, PREFILL, benchmark_trace, replay

DEFAULT_FUSED_ROWS = 64    # the paged engine's fused_rows default (templates/engine/paged.py.j2)
DEFAULT_BLOCK_SIZE = 16
TIMED_PER_FUNCTION = 2     # shapes timed per slot function: the most called ones


@dataclass(frozen=True)
class Dims:
    """The model sizes the shapes depend on."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    eps: float = 1e-5
    theta: float = 10000.0
    max_positions: int = 4096

    @staticmethod
    def from_config(config: dict) -> "Dims":
        """From a course or HF config dict (the keys evaluator/common.py's configs use)."""
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return Dims(hidden, int(config["intermediate_size"]), heads,
                    int(config.get("num_key_value_heads") or heads), int(config.get("head_dim") or hidden // heads),
                    int(config["num_hidden_layers"]), float(config.get("rms_norm_eps", COURSE_EPS)),
                    float(config.get("rope_theta", 10000.0)), int(config.get("max_position_embeddings", 4096)))


@dataclass
class CallShape:
    """One function of a slot called at one size, `calls` times over the benchmark traces."""

    slot: str
    fn: str
    label: str          # for a reader: "N=512, H=768"
    spec: dict          # for evaluator.slot_cases.make_inputs(slot, spec, ...)
    calls: int = 0
    cases: list[str] = field(default_factory=list)

    def key(self) -> tuple[str, str, str]:
        return self.slot, self.fn, self.label

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> "CallShape":
        return CallShape(str(d["slot"]), str(d["fn"]), str(d["label"]), dict(d["spec"]), int(d.get("calls", 0)),
                         [str(c) for c in d.get("cases", [])])


@dataclass
class ShapeTiming:
    """One function at one shape: both medians in microseconds."""

    fn: str
    label: str
    calls: int           # how often the benchmark traces make this call
    candidate_us: float
    current_us: float

    @property
    def ratio(self) -> float:
        return self.candidate_us / self.current_us if self.current_us > 0 else float("inf")

    def to_dict(self) -> dict:
        return asdict(self)


def weighted_ratio(timings: list[ShapeTiming]) -> float | None:
    """The candidate's time over the current one's, each shape weighted by its calls in the
    benchmark: the share of the slot's time it would save or cost."""
    cand = sum(t.candidate_us * max(t.calls, 1) for t in timings)
    cur = sum(t.current_us * max(t.calls, 1) for t in timings)
    return cand / cur if cur > 0 else None


def _norm(n: int, m: Dims) -> dict:
    return {"N": n, "H": m.hidden, "eps": m.eps, "x_scale": 1.0, "row_strided": False}


def _linear(n: int, k: int, o: int, m: Dims) -> dict:
    return {"N": n, "K": k, "O": o, "D": m.head_dim, "Hkv": m.kv_heads, "row_strided": False, "eps": m.eps,
            "x_scale": 1.0, "theta": m.theta}


def _pass_shapes(kind: str, lengths: list[int], contexts: list[int], m: Dims, fused_rows: int,
                 block_size: int) -> list[tuple[CallShape, int]]:
    """(shape, calls) for one engine call of `kind` over `lengths` new tokens per request."""
    n = sum(lengths)
    qkv = (m.heads + 2 * m.kv_heads) * m.head_dim
    heads = f"Hq={m.heads}, Hkv={m.kv_heads}, D={m.head_dim}"
    out: list[tuple[CallShape, int]] = [(CallShape("norm", "rmsnorm", f"N={n}, H={m.hidden}", _norm(n, m)), 1)]
    if n <= fused_rows:
        out += [(CallShape("linear", "linear_rope_cache", f"N={n}, K={m.hidden}, O={qkv}",
                           _linear(n, m.hidden, qkv, m)), m.layers),
                (CallShape("linear", "linear_add_norm", f"N={n}, K={m.heads * m.head_dim}, O={m.hidden}",
                           _linear(n, m.heads * m.head_dim, m.hidden, m)), m.layers),
                (CallShape("linear", "linear_silu", f"N={n}, K={m.hidden}, O={2 * m.intermediate}",
                           _linear(n, m.hidden, 2 * m.intermediate, m)), m.layers),
                (CallShape("linear", "linear_add_norm", f"N={n}, K={m.intermediate}, O={m.hidden}",
                           _linear(n, m.intermediate, m.hidden, m)), m.layers)]
    else:
        out += [(CallShape("rope_cache", "rope_cache", f"N={n}, {heads}",
                           {"N": n, "Hq": m.heads, "Hkv": m.kv_heads, "D": m.head_dim, "fused_qkv": True,
                            "P": m.max_positions, "theta": m.theta}), m.layers),
                (CallShape("norm", "add_rmsnorm", f"N={n}, H={m.hidden}", _norm(n, m)), 2 * m.layers),
                (CallShape("silu_mul", "silu_mul", f"N={n}, I={m.intermediate}",
                           {"N": n, "I": m.intermediate}), m.layers)]
    if kind == PREFILL:
        out.append((CallShape("prefill_attention", "prefill_attention", f"seq_lens={lengths}, {heads}",
                              {"seq_lens": list(lengths), "Hq": m.heads, "Hkv": m.kv_heads, "D": m.head_dim,
                               "fused_qkv": True, "q_scale": 1.0, "scale_mult": 1.0}), m.layers))
    else:
        bucket = 1 << (max(max(contexts), 2) - 1).bit_length()   # steps of one decode run share a label
        out.append((CallShape("decode_attention", "decode_attention",
                              f"B={len(contexts)}, contexts <= {bucket}, {heads}, block {block_size}",
                              {"ctx": list(contexts), "Hq": m.heads, "Hkv": m.kv_heads, "D": m.head_dim,
                               "block_size": block_size, "max_context": "exact", "q_scale": 1.0,
                               "scale_mult": 1.0}), m.layers))
    return out


def call_shapes(dims: Dims, cases: list[str] | tuple[str, ...], fused_rows: int = DEFAULT_FUSED_ROWS,
                block_size: int = DEFAULT_BLOCK_SIZE) -> dict[str, list[CallShape]]:
    """slot -> its call shapes over the benchmark `cases`, most calls first. Shapes are merged by
    label: the steps of a decode run share one (contexts bucketed by powers of two; the first
    step's contexts are the ones timed)."""
    merged: dict[tuple[str, str, str], CallShape] = {}
    for case in cases:
        for op, live in replay(benchmark_trace(case)):
            if op.kind not in (PREFILL, DECODE):
                continue
            lengths = list(op.lengths) if op.kind == PREFILL else [1] * len(op.request_ids)
            contexts = [live[r] for r in op.request_ids]
            for shape, calls in _pass_shapes(op.kind, lengths, contexts, dims, fused_rows, block_size):
                known = merged.setdefault(shape.key(), shape)
                known.calls += calls
                if case not in known.cases:
                    known.cases.append(case)
    out: dict[str, list[CallShape]] = {}
    for shape in sorted(merged.values(), key=lambda s: -s.calls):
        out.setdefault(shape.slot, []).append(shape)
    return out


def timed_shapes(shapes: list[CallShape], per_function: int = TIMED_PER_FUNCTION) -> list[CallShape]:
    """The shapes worth timing for one slot: per function, the `per_function` most called."""
    taken: Counter = Counter()
    out = []
    for s in shapes:
        if taken[s.fn] < per_function:
            taken[s.fn] += 1
            out.append(s)
    return out
