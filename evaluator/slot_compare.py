"""How a slot's outputs are judged against the reference (docs/design.md §5): tolerances in
units of the compute dtype's last place, the comparison whose failure message goes back to an
LLM as is, bit-exact checks that inputs were left alone, a second call that must give the same
bits, and errors counted in ulps.
"""
from __future__ import annotations

import math

import torch

# (atol, rtol) per compute dtype: about two units in the last place of the dtype, so a
# kernel that rounds once where the reference rounds twice passes, and one that drops a
# mask, a scale or a rounding step does not.
TOLERANCE: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def compare(label: str, out, ref: torch.Tensor, dtype: torch.dtype,
            magnitude: torch.Tensor | None = None) -> tuple[float, float, str]:
    """(max_abs_err, ratio, message); message is empty when `out` is within tolerance.

    The bound is atol + rtol * |ref|, or rtol * `magnitude` where a result inherits the rounding
    freedom of larger inputs (a rotated pair). NaN where the reference has NaN (poisoned cache
    slots nobody may write) counts as equal."""
    atol, rtol = TOLERANCE[dtype]
    if not isinstance(out, torch.Tensor):
        return math.inf, math.inf, f"{label}: returned {type(out).__name__}, want a tensor"
    if tuple(out.shape) != tuple(ref.shape):
        return math.inf, math.inf, f"{label}: shape {tuple(out.shape)}, want {tuple(ref.shape)}"
    if out.dtype != ref.dtype:
        return math.inf, math.inf, f"{label}: dtype {out.dtype}, want {ref.dtype}"
    if out.device != ref.device:
        return math.inf, math.inf, f"{label}: on {out.device}, want {ref.device}"
    if out.numel() == 0:
        return 0.0, 0.0, ""
    o, r = out.detach().float(), ref.detach().float()
    both_nan = torch.isnan(o) & torch.isnan(r)
    diff = torch.nan_to_num((o - r).abs(), nan=math.inf, posinf=math.inf)
    diff = torch.where(both_nan, torch.zeros_like(diff), diff)
    scale = r.abs() if magnitude is None else torch.maximum(r.abs(), magnitude.float())
    bound = atol + rtol * torch.nan_to_num(scale, nan=0.0, posinf=0.0)
    ratio_t = diff / bound
    worst = int(torch.argmax(ratio_t).item())
    ratio = float(ratio_t.flatten()[worst].item())
    max_abs = float(diff.max().item())
    if ratio <= 1.0:
        return max_abs, ratio, ""
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), tuple(out.shape)))
    got, want = float(o.flatten()[worst].item()), float(r.flatten()[worst].item())
    n_bad = int((ratio_t > 1).sum().item())
    kind = "non-finite value" if not math.isfinite(got) and math.isfinite(want) else "mismatch"
    return max_abs, ratio, (f"{label}: {kind} at index {idx}: got {got:.6g}, want {want:.6g} "
                            f"(|err|={abs(got - want):.3g}, {n_bad}/{out.numel()} elements out of "
                            f"atol={atol:g} rtol={rtol:g}; max_abs_err={max_abs:.3g})")


_INT_VIEW = {2: torch.int16, 4: torch.int32, 8: torch.int64, 1: torch.int8}


def bits(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point():
        return t.detach().contiguous().view(_INT_VIEW[t.element_size()])
    return t.detach().contiguous()


def unchanged(label: str, before: torch.Tensor, after: torch.Tensor) -> str:
    """Empty when `after` holds exactly the bits of `before`, NaN payloads included."""
    a, b = bits(before), bits(after)
    if torch.equal(a, b):
        return ""
    first = int(torch.nonzero((a != b).flatten())[0].item())
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(first), tuple(before.shape)))
    return f"{label}: input modified at index {idx} (was {before.flatten()[first].item():.6g}, " \
           f"now {after.flatten()[first].item():.6g}); this slot must not write it"


def prime_allocator_with_nan(like: list[torch.Tensor]) -> None:
    """Free NaN-filled blocks of the outputs' sizes, so a fresh `torch.empty` in the variant
    most likely gets NaN memory back and an unwritten element cannot pass by luck."""
    if not like or like[0].device.type != "cuda":
        return
    blocks = [torch.full_like(t, float("nan"), memory_format=torch.contiguous_format) for t in like
              if t.is_floating_point()]
    del blocks


def pure_call(fn, args: dict, outputs_like: list[torch.Tensor], device, twice: bool):
    """Call fn(**args) with the allocator primed; on CUDA call it twice and demand the same bits."""
    prime_allocator_with_nan(outputs_like)
    first = fn(**args)
    if not twice:
        return first, ""
    first_bits = [(bits(t) if isinstance(t, torch.Tensor) else t)
                  for t in (first if isinstance(first, tuple) else (first,))]
    prime_allocator_with_nan(outputs_like)
    second = fn(**args)
    for i, t in enumerate(second if isinstance(second, tuple) else (second,)):
        if isinstance(t, torch.Tensor) and isinstance(first_bits[i], torch.Tensor) \
                and t.shape == first_bits[i].shape and not torch.equal(bits(t), first_bits[i]):
            return first, f"output {i}: two calls on the same inputs differ (a race, or unwritten memory)"
    return first, ""


def ulp_key(t: torch.Tensor) -> torch.Tensor:
    """A 16-bit float's bits as an integer that is monotone in its value (+0 and -0 both 0):
    the difference of two keys is the number of representable values between them."""
    i = t.detach().contiguous().view(torch.int16).to(torch.int32)
    return torch.where(i < 0, -(i & 0x7FFF), i)


def ulp_error(got: torch.Tensor, want: torch.Tensor, floor: float = 0.0) -> torch.Tensor:
    """|got - want| in units in the last place of the 16-bit dtype at max(|got|, |want|, floor).
    With floor > 0, elements smaller than the floor are judged at the floor's ulp: an attention
    output is a sum with cancellation, and near zero its last bits are summation-order noise."""
    g, w = got.float(), want.float()
    mag = torch.clamp(torch.maximum(g.abs(), w.abs()), min=floor)
    _, exp = torch.frexp(mag)                      # mag = m * 2**exp, m in [0.5, 1)
    mant_bits = 7 if got.dtype == torch.bfloat16 else 10
    ulp = torch.ldexp(torch.ones_like(mag), exp - 1 - mant_bits)
    return (g - w).abs() / ulp
