"""Kernel variants on CUDA: every variant passes evaluator.slot_check in fp16 and bf16 (the full
case list: long contexts, wide ragged batches), the wrong variants fail, tuning params keep
the kernels correct, the split decode kernels survive CUDA-graph capture and replay with
new contexts (fused_reduce's last-program reductions too, their counters back at zero), and
the faithful variants (norm/rope_cache/silu_mul `triton`, attention `triton_exact`) round like
the torch variants: bit-equal or within one ulp of the compute dtype on random inputs.
Skipped without CUDA."""
import math

import pytest
import torch

from agent.plan import menu
from evaluator import slot_cases, slot_check, slot_compare, slot_refs, slots
from evaluator.slot_check import check_variant
from tests.slot_variants import CORRECT, WRONG

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CUDA_VARIANTS = [(v.slot, v.name) for variants in menu().values() for v in variants if "cuda" in v.devices]
SEED = 20261122


@pytest.mark.parametrize("slot,variant", CUDA_VARIANTS)
def test_variant_passes_fp16_and_bf16(slot, variant):
    result = check_variant(slot, variant=variant, device="cuda", seed=SEED)
    assert result.passed, result.summary()


@pytest.mark.parametrize("slot,variant", [sv for sv in CUDA_VARIANTS if sv[1] != "torch"])
def test_variant_passes_a_fresh_seed(slot, variant):
    result = check_variant(slot, variant=variant, device="cuda")
    assert result.passed, result.summary()


@pytest.mark.parametrize("slot,name", sorted(WRONG))
def test_wrong_variant_fails_on_cuda(slot, name):
    result = check_variant(slot, WRONG[(slot, name)], "cuda", seed=SEED, dtypes=["fp16"])
    assert not result.passed, f"{slot}/{name} should fail: {result.summary()}"


@pytest.mark.parametrize("slot", sorted(CORRECT))
def test_hand_written_right_variant_passes_on_cuda(slot):
    result = check_variant(slot, CORRECT[slot], "cuda", seed=SEED, full=False)
    assert result.passed, result.summary()


TUNINGS = [
    ("decode_attention", "triton_split", {"decode_splits": 1}),
    ("decode_attention", "triton_split", {"decode_splits": 7, "decode_block_n": 16}),
    ("decode_attention", "triton_split", {"decode_splits": 32, "decode_block_n": 64, "decode_warps": 8}),
    ("prefill_attention", "triton", {"prefill_block_m": 64, "prefill_block_n": 64}),
    ("prefill_attention", "triton", {"prefill_block_m": 128, "prefill_block_n": 32, "prefill_warps": 8}),
    ("prefill_attention", "triton", {"prefill_block_m": 16, "prefill_block_n": 16, "prefill_stages": 1}),
    ("decode_attention", "triton_exact", {"decode_splits": 1}),
    ("decode_attention", "triton_exact", {"decode_splits": 7, "decode_block_n": 16}),
    ("decode_attention", "triton_exact", {"decode_splits": 32, "decode_block_n": 64, "decode_warps": 8}),
    ("prefill_attention", "triton_exact", {"prefill_block_m": 128, "prefill_block_n": 32, "prefill_warps": 8}),
    ("prefill_attention", "triton_exact", {"prefill_block_m": 16, "prefill_block_n": 16, "prefill_stages": 1}),
    ("linear", "triton", {"linear_splits": 1}),
    ("linear", "triton", {"linear_splits": 7, "linear_block_n": 16, "linear_block_k": 64}),
    ("linear", "triton", {"linear_splits": 64, "linear_block_n": 64, "linear_warps": 8, "linear_stages": 2}),
    ("linear", "triton", {"pdl": False}),     # pdl is on by default: the plain launches too
    ("linear", "triton", {"linear_gemm_block_n": 32, "linear_block_k": 32}),
    ("linear", "triton", {"linear_gemm_block_n": 64, "linear_gemm_warps": 2, "linear_stages": 1}),
    ("decode_attention", "triton_exact", {"pdl": True}),
    ("decode_attention", "triton_split", {"pdl": True, "decode_splits": 5}),
    ("decode_attention", "triton_split", {"pdl": False, "decode_splits": 5}),
    ("linear", "triton", {"pdl": True, "linear_splits": 7, "linear_block_k": 64}),
    ("norm", "triton", {"pdl": True}),
    ("linear", "triton", {"fused_reduce": True}),
    ("linear", "triton", {"fused_reduce": True, "pdl": True}),
    ("linear", "triton", {"fused_reduce": True, "linear_splits": 7, "linear_block_n": 16, "linear_block_k": 64}),
    ("decode_attention", "triton_split", {"fused_reduce": True}),
    ("decode_attention", "triton_split", {"fused_reduce": True, "decode_splits": 32, "decode_block_n": 16}),
]


@pytest.mark.parametrize("slot,variant,params", TUNINGS)
def test_tuning_params_stay_correct(slot, variant, params):
    result = check_variant(slot, variant=variant, device="cuda", seed=SEED, params=params)
    assert result.passed, f"{params}: {result.summary()}"


def _projection_chain(fns, x, weights, residual, norm_w, steps):
    """A decode layer's projections, `steps` times over, each reading the one before: QKV-sized
    linear, linear_silu, then linear_add_norm twice (split-K partials + reduction)."""
    linear, linear_silu, add_norm = fns
    w_in, w_gu, w_o, w_down = weights
    for _ in range(steps):
        h = linear(x, w_in)[:, :w_o.shape[1]]
        x, residual = add_norm(h, w_o, residual, norm_w, 1e-5)
        x, residual = add_norm(linear_silu(x, w_gu), w_down, residual, norm_w, 1e-5)
    return x, residual


def _chain_inputs():
    """A projection chain's inputs at the public config's sizes, 8 rows, fp16, seeded: x, the four
    weights (QKV, gate/up, o_proj, down), the residual and the norm weight."""
    gen = torch.Generator(device="cuda").manual_seed(SEED)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).half()

    hidden, inter, rows = 768, 3072, 8
    weights = (randn(3 * hidden, hidden, scale=hidden ** -0.5), randn(2 * inter, hidden, scale=hidden ** -0.5),
               randn(hidden, hidden, scale=hidden ** -0.5), randn(hidden, inter, scale=inter ** -0.5))
    x, residual, norm_w = randn(rows, hidden), randn(rows, hidden), 1 + randn(hidden, scale=0.1)
    return x, weights, residual, norm_w


def test_pdl_launches_keep_stream_order_in_a_graph():
    """With programmatic dependent launch a kernel starts before the previous one ends; it must
    still read only finished results. A chain of dependent projections, captured and replayed,
    gives the same bits with PDL as with plain launches (the same kernels, the same sums)."""
    x, weights, residual, norm_w = _chain_inputs()
    fns = {pdl: [slot_check.variant_function("linear", "triton", fn, {"pdl": pdl})
                 for fn in ("linear", "linear_silu", "linear_add_norm")] for pdl in (False, True)}
    outs = {}
    for pdl in (False, True):
        _projection_chain(fns[pdl], x, weights, residual, norm_w, 1)     # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _projection_chain(fns[pdl], x, weights, residual, norm_w, 12)
        graph.replay()
        torch.cuda.synchronize()
        outs[pdl] = [t.clone() for t in out]
    eager = _projection_chain(fns[True], x, weights, residual, norm_w, 12)
    for got, plain, now in zip(outs[True], outs[False], eager):
        assert torch.isfinite(plain).all()
        assert torch.equal(got, plain) and torch.equal(now, plain)


@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
def test_fused_reduce_replays_in_a_graph_and_leaves_counters_zero(pdl):
    """fused_reduce: the last program of each tile reduces, on counters it resets. A chain of
    dependent projections, captured and replayed three times, gives the bits of the same chain
    run eagerly (the sums' order is fixed, not the programs' arrival order), stays within a few
    ulps of the two-kernel path (only the norm's sum of squares is summed in another order), and
    leaves every counter at zero."""
    x, weights, residual, norm_w = _chain_inputs()
    fns = {fused: [slot_check.variant_function("linear", "triton", fn, {"pdl": pdl, "fused_reduce": fused})
                   for fn in ("linear", "linear_silu", "linear_add_norm")] for fused in (False, True)}
    plain = _projection_chain(fns[False], x, weights, residual, norm_w, 4)
    _projection_chain(fns[True], x, weights, residual, norm_w, 1)     # compile, make the counters
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _projection_chain(fns[True], x, weights, residual, norm_w, 4)
    eager = _projection_chain(fns[True], x, weights, residual, norm_w, 4)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        for got, now, ref in zip(out, eager, plain):
            assert torch.equal(got, now)
            assert (got.float() - ref.float()).abs().max().item() < 0.05 * ref.float().abs().max().item()
    assert not fns[True][2].__globals__["_COUNTERS__triton"]["cuda:0"].any()


SPLIT_DECODES = [("triton_split", None), ("triton_exact", None), ("triton_exact", {"decode_splits": 1}),
                 ("triton_split", {"fused_reduce": True, "decode_splits": 4})]


@pytest.mark.parametrize("variant,params", SPLIT_DECODES)
def test_split_decode_replays_in_a_cuda_graph_with_new_contexts(variant, params):
    """Capture once at short contexts, then grow every context inside the same buffers and
    replay: the kernel must read its bounds from context_lens, not from capture-time values."""
    decode = slot_check.variant_function("decode_attention", variant, "decode_attention", params)
    spec = {"ctx": [5, 17, 33, 2], "Hq": 8, "Hkv": 2, "D": 80, "block_size": 16, "max_context": "bound",
            "q_scale": 2.0, "scale_mult": 1.0}
    inp = slot_cases.make_inputs("decode_attention", spec, torch.float16, "cuda", seed=1)
    grown = dict(spec, ctx=[40, 3, 47, 48])          # 48 = every block column of the table in use
    new = slot_cases.make_inputs("decode_attention", grown, torch.float16, "cuda", seed=2)
    # same buffers: copy the new problem into the captured tensors (tables padded to one shape)
    cols = max(inp["block_table"].shape[1], new["block_table"].shape[1])
    rows = max(inp["k_cache"].shape[0], new["k_cache"].shape[0])

    def padded(d):
        table = torch.zeros(d["block_table"].shape[0], cols, dtype=torch.int32, device="cuda")
        table[:, :d["block_table"].shape[1]] = d["block_table"]
        kc = torch.full((rows, 2, 80), float("nan"), dtype=torch.float16, device="cuda")
        vc = kc.clone()
        kc[:d["k_cache"].shape[0]] = d["k_cache"]
        vc[:d["v_cache"].shape[0]] = d["v_cache"]
        return dict(d, block_table=table, k_cache=kc, v_cache=vc, max_context=cols * 16)

    a, b = padded(inp), padded(new)
    static = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
    decode(**static)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode(**static)
    graph.replay()
    torch.cuda.synchronize()
    err = (out.float() - slot_refs.ref_decode_attention(**a).float()).abs().max().item()
    assert err < 5e-3, err
    for k in ("q", "k_cache", "v_cache", "block_table", "context_lens"):
        static[k].copy_(b[k])
    graph.replay()
    torch.cuda.synchronize()
    err = (out.float() - slot_refs.ref_decode_attention(**b).float()).abs().max().item()
    assert err < 5e-3 and not math.isnan(err), err
    counters = decode.__globals__.get("_COUNTERS__triton_split", {})
    assert not any(c.any() for c in counters.values()), "fused_reduce left a counter non-zero"


@pytest.mark.parametrize("variant,params", SPLIT_DECODES)
def test_split_decode_zero_context_rows_give_zeros_not_nan(variant, params):
    decode = slot_check.variant_function("decode_attention", variant, "decode_attention", params)
    spec = {"ctx": [9, 30], "Hq": 4, "Hkv": 4, "D": 64, "block_size": 16, "max_context": "exact",
            "q_scale": 1.0, "scale_mult": 1.0}
    inp = slot_cases.make_inputs("decode_attention", spec, torch.bfloat16, "cuda", seed=0)
    inp["context_lens"][1] = 0
    out = decode(**inp)
    assert torch.isfinite(out.float()).all() and out[1].abs().max().item() == 0.0


def test_add_rmsnorm_in_place_matches():
    add_rmsnorm = slot_check.variant_function("norm", "triton", "add_rmsnorm")
    x = torch.randn(37, 1000, device="cuda", dtype=torch.float16)
    r = torch.randn_like(x)
    w = torch.rand(1000, device="cuda", dtype=torch.float16) + 0.5
    want_y, want_r = slot_refs.ref_add_rmsnorm(x, r, w, 1e-5)
    y, new_r = add_rmsnorm(x, r, w, 1e-5, out=x, residual_out=r)
    assert y.data_ptr() == x.data_ptr() and new_r.data_ptr() == r.data_ptr()
    assert (y.float() - want_y.float()).abs().max().item() < 4e-3
    assert torch.equal(new_r, want_r)


def test_rope_cache_negative_slot_skips_the_cache_write():
    rope = slot_check.variant_function("rope_cache", "triton", "rope_cache")
    spec = {"N": 4, "Hq": 4, "Hkv": 2, "D": 64, "fused_qkv": True, "P": 128, "theta": 10000.0}
    inp = slot_cases.make_inputs("rope_cache", spec, torch.float16, "cuda", seed=0)
    inp["slot_mapping"][2] = -1
    rope(**inp)
    assert torch.isnan(inp["k_cache"]).sum().item() == (inp["k_cache"].shape[0] - 3) * 2 * 64


# ---- faithful rounding: the Triton variants against the torch variants, in ulps of dt ----


# (slot, variant, spec, max ulps, min fraction bit-equal, min fraction within 1 ulp). Elementwise
# slots: the bit distance. Attention: ulps at max(|x|, rms/8) (an output is a sum with cancellation;
# near zero its last bits are summation-order noise); a probability whose fp32 value sits at a
# rounding boundary (exp2.approx and the MMA's summation order vs torch's) can round the other way
# and move an output by a few ulps (H100: prefill up to 9, 99.0-99.96% bit-equal; decode up to 1,
# 99.7-100%). The online variants (`triton`, `triton_split`) measured 55-65% bit-equal, 90-95%
# within 1 ulp, up to 35 ulps.
FAITHFUL = [
    ("rope_cache", "triton", {"N": 300, "Hq": 8, "Hkv": 2, "D": 80, "fused_qkv": True, "P": 4096,
                              "theta": 10000.0}, 0, 1.0, 1.0),
    ("rope_cache", "triton", {"N": 64, "Hq": 4, "Hkv": 4, "D": 192, "fused_qkv": False, "P": 4096,
                              "theta": 500000.0}, 0, 1.0, 1.0),
    ("norm", "triton", {"N": 300, "H": 768, "eps": 1e-5, "x_scale": 3.0, "row_strided": True}, 2, 0.999, 0.9999),
    ("norm", "triton", {"N": 33, "H": 2000, "eps": 1e-6, "x_scale": 0.5, "row_strided": False}, 2, 0.999, 0.9999),
    ("silu_mul", "triton", {"N": 300, "I": 3072}, 0, 1.0, 1.0),
    ("prefill_attention", "triton_exact", {"seq_lens": [128, 128, 37, 300], "Hq": 4, "Hkv": 4, "D": 192,
                                           "fused_qkv": True, "q_scale": 3.0, "scale_mult": 1.0}, 16, 0.98, 0.995),
    ("prefill_attention", "triton_exact", {"seq_lens": [1034, 11], "Hq": 8, "Hkv": 2, "D": 80,
                                           "fused_qkv": False, "q_scale": 1.0, "scale_mult": 1.0}, 16, 0.98, 0.995),
    ("decode_attention", "triton_exact", {"ctx": [48, 144, 1, 17, 700, 1034], "Hq": 8, "Hkv": 2, "D": 80,
                                          "block_size": 16, "max_context": "bound", "q_scale": 3.0,
                                          "scale_mult": 1.0}, 4, 0.98, 0.995),
    ("decode_attention", "triton_exact", {"ctx": [48] * 4 + [144] * 4, "Hq": 4, "Hkv": 4, "D": 192,
                                          "block_size": 16, "max_context": "exact", "q_scale": 1.0,
                                          "scale_mult": 1.0}, 4, 0.98, 0.995),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("slot,variant,spec,max_ulp,min_exact,min_le1", FAITHFUL,
                         ids=[f"{f[0]}-{f[1]}-{i}" for i, f in enumerate(FAITHFUL)])
def test_faithful_variant_rounds_like_the_torch_variant(slot, variant, spec, max_ulp, min_exact, min_le1, dtype):
    """Same inputs through the torch variant (the reference's op order) and the faithful one: every
    output element within `max_ulp` units in the last place of dt, most of them bit-equal and
    nearly all within one ulp."""
    fns = {fn: slot_check.variant_function(slot, variant, fn) for fn in slots.SLOT_FUNCTIONS[slot]}
    ref = {fn: slot_check.variant_function(slot, "torch", fn) for fn in slots.SLOT_FUNCTIONS[slot]}
    for seed in (1, 2):
        inp = slot_cases.make_inputs(slot, spec, dtype, "cuda", seed=seed)
        got, want = slot_check.slot_outputs(slot, fns, inp), slot_check.slot_outputs(slot, ref, inp)
        for name in want:
            exact = (slot_compare.ulp_key(got[name]) == slot_compare.ulp_key(want[name])).float().mean().item()
            if slot.endswith("attention"):
                floor = want[name].float().pow(2).mean().sqrt().item() / 8
                err = slot_compare.ulp_error(got[name], want[name], floor)
            else:
                err = (slot_compare.ulp_key(got[name]) - slot_compare.ulp_key(want[name])).abs().float()
            worst, le1 = err.max().item(), (err <= 1).float().mean().item()
            assert worst <= max_ulp and exact >= min_exact and le1 >= min_le1, (
                f"{name} (seed {seed}): max {worst:.3g} ulp (allowed {max_ulp}), "
                f"{100 * exact:.3f}% bit-equal (want >= {100 * min_exact:.1f}%), "
                f"{100 * le1:.3f}% within 1 ulp (want >= {100 * min_le1:.2f}%)")
