"""Engines that travel (issue 24): a kernel variant that does not compile on the machine falls back
per slot to its torch variant inside create_engine, and every Triton variant sizes its tiles from
the GPU's shared memory.

The fallback is device-independent code (probe_kernels in templates/engine/paged/probe.py.j2), so
it is tested on CPU: the engine is made to bind the plan's variants there as it does on CUDA, and
a model-written variant whose functions raise at their first call (as a Triton kernel that does
not compile raises at its first launch) stands in for the kernel that does not compile."""
from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from agent.plan import SLOTS, Plan, menu
from agent.render import render_engine
from evaluator.slot_render import render_slot_module
from evaluator.slots import PRELUDE
from evaluator.test_correctness import run_public_sequence
from evaluator.weights import random_weights
from tests.conftest import load_source
from tests.test_engine_paged import config, write_weights

# Shared memory a program may take (the bound Triton compiles to): an RTX 3090 (sm_86), an
# A100 (sm_80) and an H100 (sm_90).
SM86_SHARED = 101376
SM80_SHARED = 166912
SM90_SHARED = 232448
CPU = torch.device("cpu")   # a variant's config on the CPU: an H100's SM count stands in
COMPILE_ERROR = "out of resource: shared memory, Required: 131072, Hardware limit: 101376"

BROKEN_NORM = f'''# slot: norm    variant: llm_broken    devices: cuda
def rmsnorm__llm_broken(x, w, eps):
    raise RuntimeError("{COMPILE_ERROR}")


def add_rmsnorm__llm_broken(x, residual, w, eps):
    raise RuntimeError("{COMPILE_ERROR}")
'''
# A variant that runs (the torch math): its slot must stay bound to it.
WORKING_SILU = '''# slot: silu_mul    variant: llm_ok    devices: cuda
def silu_mul__llm_ok(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
'''


def test_compile_fallback_rebinds_the_failing_slot_and_passes_the_public_sequence(tmp_path, monkeypatch):
    """norm's variant raises at its first call: create_engine warns once, naming slot, variant and
    error, binds norm's torch variant, keeps silu_mul's working variant, and the engine passes the
    public correctness sequence."""
    plan = Plan("paged", slots={**{s: "torch" for s in SLOTS}, "norm": "llm_broken", "silu_mul": "llm_ok"})
    extra = {("norm", "llm_broken"): BROKEN_NORM, ("silu_mul", "llm_ok"): WORKING_SILU}
    module = load_source(render_engine(plan, extra), "travel_engine_fallback")
    monkeypatch.setattr(module, "bind_kernels", lambda device, dtype: module.plan_kernels(dtype))   # CUDA's binding
    cfg = config(num_key_value_heads=2)
    write_weights(random_weights(cfg, seed=3, scale=0.2, norm_spread=0.5), tmp_path)

    with pytest.warns(RuntimeWarning) as caught:
        engine = module.create_engine(cfg, str(tmp_path), "cpu")
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1, messages
    assert re.search(r"slot norm: variant llm_broken .*RuntimeError: out of resource: shared memory", messages[0])
    assert engine.kernels.variants == {**plan.slots, "norm": "torch"}
    assert engine.kernels.rmsnorm is module.rmsnorm__torch and engine.kernels.add_rmsnorm is module.add_rmsnorm__torch
    assert engine.kernels.silu_mul is module.silu_mul__llm_ok

    with pytest.warns(RuntimeWarning, match="slot norm: variant llm_broken"):
        result = run_public_sequence(module, cfg, tmp_path, device="cpu", atol=1e-4, rtol=0.0)
    assert result["status"] == "passed" and result["cases"] > 0


def test_compile_fallback_probes_nothing_when_every_variant_runs(tmp_path, monkeypatch, recwarn):
    """The plan's kernels come back unchanged (the same functions, no warning) when every probe
    passes; a plan of torch variants is not probed at all."""
    plan = Plan("paged", slots={**{s: "torch" for s in SLOTS}, "silu_mul": "llm_ok"})
    module = load_source(render_engine(plan, {("silu_mul", "llm_ok"): WORKING_SILU}), "travel_engine_working")
    probed = []
    monkeypatch.setattr(module, "bind_kernels", lambda device, dtype: module.plan_kernels(dtype))
    real_probe = module.probe_slot
    monkeypatch.setattr(module, "probe_slot", lambda slot, *rest: probed.append(slot) or real_probe(slot, *rest))
    cfg = config()
    write_weights(random_weights(cfg, seed=4, scale=0.2), tmp_path)
    engine = module.create_engine(cfg, str(tmp_path), "cpu")
    assert probed == ["silu_mul"] and not recwarn.list
    assert engine.kernels == module.plan_kernels(torch.float32)


# ---- tile sizing: every variant's tiles fit a capped shared-memory budget ----

def _next_power_of_2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


# The two helpers the tile functions take from Triton (where it is not installed: plain arithmetic).
TRITON_ARITHMETIC = SimpleNamespace(next_power_of_2=_next_power_of_2, cdiv=lambda a, b: -(-a // b))


def slot_namespace(slot: str, variant: str, shared: int, params: dict | None = None) -> dict:
    """The variant's module as Python sees it (rendered with `params`), with the GPU's shared memory
    capped at `shared`."""
    # From a file: @triton.jit reads its function's source, which a string exec does not have.
    tag = "_".join(f"{k}{v}" for k, v in sorted((params or {}).items()))
    namespace = vars(load_source(render_slot_module(slot, variant, params), f"travel_{slot}_{variant}_{shared}{tag}"))
    if namespace["triton"] is None:
        namespace["triton"] = TRITON_ARITHMETIC
    namespace["MAX_SHARED_MEMORY"] = shared
    return namespace


def attention_bytes(rows, block_n, stages, width, elem=2):
    """A [rows, width] query tile once, a [block_n, width] key and value tile per stage."""
    return elem * width * (rows + 2 * stages * block_n)


def gemm_bytes(rows, cols, block_k, stages, elem=2):
    """Per stage, a [rows, block_k] activation tile and a [cols, block_k] weight tile."""
    return elem * block_k * stages * (rows + cols)


HEAD_DIMS = (64, 80, 96, 128, 192, 256, 384, 512)


@pytest.mark.parametrize("shared", [SM86_SHARED, SM80_SHARED])
@pytest.mark.parametrize("variant", ["triton_split", "triton_exact"])
def test_decode_tiles_fit_a_capped_budget(variant, shared):
    ns = slot_namespace("decode_attention", variant, shared)
    for head_dim in HEAD_DIMS:
        for group in (1, 4, 8, 16):
            block_g, block_d, block_n, stages = ns[f"_decode_tiles__{variant}"](head_dim, group, 2)
            assert attention_bytes(block_g, block_n, stages, block_d) <= shared, (head_dim, group)


@pytest.mark.parametrize("shared", [SM86_SHARED, SM80_SHARED])
@pytest.mark.parametrize("variant", ["triton", "triton_exact"])
def test_prefill_tiles_fit_a_capped_budget(variant, shared):
    ns = slot_namespace("prefill_attention", variant, shared)
    for head_dim in HEAD_DIMS:
        if variant == "triton":   # its tiles are sized by the width the head dim runs at (parts' sum)
            block_da, block_db, tail = ns["_head_dim_parts__triton"](head_dim)
            width = block_da + block_db * tail
            block_m, block_n, _, stages = ns["_prefill_tiles__triton"](width, 2)
        else:
            width = max(16, _next_power_of_2(head_dim))
            block_m, block_n, _, stages = ns["_prefill_tiles__triton_exact"](head_dim, 2)
        assert attention_bytes(block_m, block_n, stages, width) <= shared, head_dim
        assert block_m % block_n == 0


@pytest.mark.parametrize("shared", [SM86_SHARED, SM80_SHARED])
def test_linear_tiles_fit_a_capped_budget(shared):
    ns = slot_namespace("linear", "triton", shared)
    for m in (1, 8, 16, 33, 64, 65, 512):
        for weight_rows in (1, 2):   # linear / linear_rope_cache, linear_silu (gate and up tiles)
            block_m, block_n, block_k, _, stages = ns["_gemm_config__triton"](m, 8192, weight_rows, 2, CPU)
            assert gemm_bytes(block_m, weight_rows * block_n, block_k, stages) <= shared, (m, weight_rows)
        block_m, block_n, block_k, splits, k_chunk, _, stages = ns["_split_config__triton"](m, 768, 3072, 2)
        assert gemm_bytes(block_m, block_n, block_k, stages) <= shared, m
        assert k_chunk % block_k == 0 and splits * k_chunk >= 3072


def test_linear_tiles_are_unchanged_on_an_h100():
    """Trimming only touches what a GPU could not compile: the H100's tuned tiles stay as measured."""
    ns = slot_namespace("linear", "triton", SM90_SHARED)
    assert ns["_gemm_config__triton"](64, 3072, 2, 2, CPU) == (64, 32, 128, 4, 4)
    assert ns["_gemm_config__triton"](512, 3072, 2, 2, CPU) == (128, 64, 64, 8, 3)
    assert ns["_split_config__triton"](8, 768, 3072, 2)[2::4] == (128, 4)   # BLOCK_K, stages
    capped = slot_namespace("linear", "triton", SM86_SHARED)
    assert capped["_gemm_config__triton"](64, 3072, 2, 2, CPU) == (64, 32, 128, 4, 3)   # 128 KiB at 4 stages


def test_a_decode_gemm_gives_up_a_stage_to_run_in_one_wave():
    """A 1B model's gate/up at 64 rows is 256 programs: at 4 stages (128 KiB) an H100's 132 SMs hold
    one each (two waves), at 3 two each (one wave), which the sweep measured faster. Grids that fit
    in one wave as they are (QKV: 96 programs), or in none at any stage count, keep their stages."""
    ns = slot_namespace("linear", "triton", SM90_SHARED)   # the CPU stands for an H100's 132 SMs
    assert ns["_gemm_config__triton"](64, 8192, 2, 2, CPU)[4] == 3
    assert ns["_gemm_config__triton"](64, 3072, 1, 2, CPU)[4] == 4
    assert ns["_gemm_config__triton"](64, 32768, 2, 2, CPU)[4] == 4
    assert ns["_gemm_config__triton"](8, 8192, 2, 2, CPU)[4] == 4    # 20 KiB a stage: two an SM at 4
    pinned = slot_namespace("linear", "triton", SM90_SHARED, {"linear_stages": 4})
    assert pinned["_gemm_config__triton"](64, 8192, 2, 2, CPU)[4] == 4   # a plan's stages are kept


def test_every_variant_with_staged_tiles_sizes_them_from_the_device():
    """A variant that stages tiles through shared memory (tl.dot operands) trims them with the
    prelude's fitters, which read the GPU's bound (MAX_SHARED_MEMORY); and none passes the
    launch_pdl option unconditionally (Triton 3.0 refuses it, even when False)."""
    assert "get_device_properties" in PRELUDE and "max_shared_mem" in PRELUDE
    for slot, variants in menu().items():
        for v in variants:
            text = v.path.read_text()
            if "tl.dot" in text:
                assert re.search(r"fit_(gemm_)?shared_memory\(", text), f"{slot}/{v.name} sizes no tile"
            assert "launch_pdl=" not in text, f"{slot}/{v.name}: launch_pdl without a feature check"



def test_pdl_is_off_under_triton_s_interpreter():
    """import_interpreted turns the prelude's PDL_SUPPORTED off: the interpreter runs no gdc_wait,
    and pdl is on by default, so on an sm_90 host (where the prelude finds PDL supported) every
    interpreted linear or triton_split kernel raised."""
    from evaluator import slot_check
    old, new = slot_check._INTERPRET_PDL
    assert PRELUDE.count(old) == 1
    source = render_slot_module("linear", "triton", {}).replace(*slot_check._INTERPRET_PDL)
    namespace = {}
    exec(source[source.index(new):source.index("# Shared memory one Triton program")],
         {"triton": object(), "torch": torch, "_triton_has_pdl": lambda: True}, namespace)
    assert namespace["PDL_SUPPORTED"] is False


def test_a_weight_copied_at_the_call_is_read_after_the_wait():
    """A PDL GEMM reads its first weight block before gdc_wait: right only for a weight no earlier
    kernel writes. A weight with strided columns is copied by the call itself (the kernel just
    before), so that launch goes without PDL."""
    ns = slot_namespace("linear", "triton", SM90_SHARED)
    ns["LINEAR_PDL__triton"] = True
    w = torch.zeros(8, 4)
    strided = torch.zeros(4, 8).t()
    assert ns["_pdl_for__triton"](ns["_rows_contiguous__triton"](w), w)
    assert not ns["_pdl_for__triton"](ns["_rows_contiguous__triton"](strided), strided)
    ns["LINEAR_PDL__triton"] = False
    assert not ns["_pdl_for__triton"](w, w)
