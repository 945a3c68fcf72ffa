"""evaluator.slot_check on the CPU: right variants pass, the classic mistakes fail, every
variant template on disk renders and imports without triton."""
import math

import pytest
import torch

from agent.plan import KERNELS, menu
from evaluator import slot_cases, slot_check, slot_refs
from evaluator.slot_check import check_variant, import_module_text
from evaluator.slot_render import render_slot_module
from evaluator.slots import SLOT_FUNCTIONS
from tests.slot_variants import CORRECT, WRONG

ALL_VARIANTS = [(v.slot, v.name, v.devices) for variants in menu().values() for v in variants]
CPU_VARIANTS = [(s, n) for s, n, devices in ALL_VARIANTS if "cpu" in devices]


@pytest.mark.parametrize("slot,variant", CPU_VARIANTS)
def test_cpu_variants_on_disk_pass(slot, variant):
    result = check_variant(slot, variant=variant, device="cpu")  # a fresh seed, printed on failure
    assert result.passed, result.summary()
    assert result.cases and all(c.passed for c in result.cases)


@pytest.mark.parametrize("slot,variant,devices", ALL_VARIANTS)
def test_every_variant_renders_and_imports_without_triton(slot, variant, devices):
    module = import_module_text(render_slot_module(slot, variant), f"import_{slot}_{variant}")
    for fn in SLOT_FUNCTIONS[slot]:
        assert callable(getattr(module, f"{fn}__{variant}", None)), f"{slot}/{variant} lacks {fn}__{variant}"


@pytest.mark.parametrize("slot", sorted(CORRECT))
def test_hand_written_right_variant_passes(slot):
    result = check_variant(slot, CORRECT[slot], "cpu", seed=11)
    assert result.passed, result.summary()
    assert result.max_abs_err < 1e-4


@pytest.mark.parametrize("slot,name", sorted(WRONG))
def test_wrong_variant_fails_and_says_where(slot, name):
    result = check_variant(slot, WRONG[(slot, name)], "cpu", seed=11)
    assert not result.passed, f"{slot}/{name} should fail: {result.summary()}"
    bad = [c for c in result.cases if not c.passed]
    assert bad and bad[0].message.startswith(f"{slot} case"), bad[0].message
    assert "index (" in result.worst_case, result.worst_case  # names the worst element


def test_ignoring_context_lens_is_caught_by_nan_poison():
    result = check_variant("decode_attention", WRONG[("decode_attention", "wrong_ignores_context_lens")], "cpu", seed=3)
    assert "non-finite" in result.worst_case and math.isinf(result.max_abs_err)


def test_same_seed_same_cases_fresh_seed_reported():
    a = check_variant("silu_mul", CORRECT["silu_mul"], "cpu", seed=5)
    b = check_variant("silu_mul", CORRECT["silu_mul"], "cpu", seed=5)
    assert [c.name for c in a.cases] == [c.name for c in b.cases] and a.seed == b.seed == 5
    c = check_variant("silu_mul", CORRECT["silu_mul"], "cpu")
    assert isinstance(c.seed, int) and str(c.seed) in c.summary()


def test_sources_as_template_path_rendered_text_and_rendered_path(tmp_path):
    by_name = check_variant("norm", variant="torch", device="cpu", seed=1)
    by_path = check_variant("norm", str(KERNELS / "norm" / "torch.py.j2"), "cpu", seed=1)
    rendered = render_slot_module("norm", "torch")
    by_text = check_variant("norm", rendered, "cpu", seed=1)
    f = tmp_path / "norm_torch.py"
    f.write_text(rendered)
    by_file = check_variant("norm", f, "cpu", seed=1)
    for r in (by_name, by_path, by_text, by_file):
        assert r.passed and r.variant == "torch", r.summary()


def test_cuda_only_variant_is_refused_on_cpu_not_crashed():
    result = check_variant("decode_attention", variant="triton_split", device="cpu", seed=0)
    assert not result.passed and "cuda" in result.error


def test_load_and_runtime_errors_are_reported():
    missing = "# slot: silu_mul    variant: nofn    devices: cpu\nX = 1\n"
    r = check_variant("silu_mul", missing, "cpu", seed=0)
    assert not r.passed and "missing function silu_mul__nofn" in r.error
    broken = "# slot: silu_mul    variant: broken    devices: cpu\ndef silu_mul__broken(gate_up)\n"
    r = check_variant("silu_mul", broken, "cpu", seed=0)
    assert not r.passed and r.error.startswith("import_error")
    raises = "# slot: silu_mul    variant: raises    devices: cpu\ndef silu_mul__raises(gate_up):\n    raise RuntimeError('boom')\n"
    r = check_variant("silu_mul", raises, "cpu", seed=0)
    assert not r.passed and "runtime_error: RuntimeError: boom" in r.worst_case
    headerless = "def silu_mul__x(gate_up):\n    return gate_up\n"
    assert check_variant("silu_mul", headerless, "cpu", seed=0).error.startswith("render_error")


def test_input_mutation_is_caught():
    mutates = CORRECT["silu_mul"].replace("test_ok", "mutates").replace(
        "    g, u = gate_up.chunk(2, dim=-1)\n", "    g, u = gate_up.chunk(2, dim=-1)\n    out = F.silu(g) * u\n"
        "    gate_up.zero_()\n    return out\n")
    r = check_variant("silu_mul", mutates, "cpu", seed=0)
    assert not r.passed and "input modified" in r.worst_case


def test_wrong_dtype_and_shape_are_reported():
    upcast = "# slot: silu_mul    variant: upcast    devices: cpu\ndef silu_mul__upcast(gate_up):\n" \
             "    g, u = gate_up.double().chunk(2, dim=-1)\n    return F.silu(g) * u\n"
    r = check_variant("silu_mul", upcast, "cpu", seed=0)
    assert not r.passed and "dtype torch.float64" in r.worst_case


def test_linear_return_forms_are_checked():
    """linear and linear_silu return one tensor, linear_add_norm the (y, new_residual) tuple."""
    ok = CORRECT["linear"].replace("test_ok", "forms")
    tupled = ok.replace("    return _mm_forms(x, weight)\n", "    return _mm_forms(x, weight), None\n")
    assert tupled != ok
    r = check_variant("linear", tupled, "cpu", seed=0)
    assert not r.passed and "linear: returned tuple, want one tensor" in r.worst_case, r.summary()
    single = ok.replace("* norm_w, r\n", "* norm_w\n")
    assert single != ok
    r = check_variant("linear", single, "cpu", seed=0)
    assert not r.passed and "linear_add_norm: returned Tensor, want (y, new_residual)" in r.worst_case, r.summary()


def test_linear_cases_split_weight_into_gate_and_up():
    """Every case's O is even (linear_silu's weight is [2I, K]) and some I is no multiple of 16."""
    for full in (False, True):
        specs = slot_cases.case_specs("linear", 0, full)
        assert all(s["O"] % 2 == 0 for s in specs) and any((s["O"] // 2) % 16 for s in specs)
    inp = slot_cases.make_inputs("linear", specs[2], torch.float32, "cpu")
    assert slot_refs.ref_linear_silu(inp["x"], inp["weight"]).shape == (specs[2]["N"], specs[2]["O"] // 2)


def test_linear_silu_leaves_gate_and_up_their_last_bit():
    """A tiled GEMM sums in another fp32 order than cuBLAS, so its gate and up may round one ulp
    off; silu(g) * u carries that at up to five times its own size (g < 0). Every gate and up
    element one ulp off passes in fp16; silu on the wrong half still fails."""
    nudged = """# slot: linear    variant: nudged    devices: cpu
def linear__nudged(x, weight):
    return F.linear(x, weight)


def linear_silu__nudged(x, weight):
    gate, up = F.linear(x, weight).chunk(2, dim=-1)
    gate, up = ((t.view(torch.int16) + 1).view(t.dtype) for t in (gate, up))   # one ulp off zero
    return F.silu(gate) * up
"""
    base = WRONG[("linear", "wrong_silu_on_up")]    # its other functions are right
    others = base[base.index("def linear_add_norm__"):].replace("wrong_silu_on_up", "nudged")
    r = check_variant("linear", nudged + "\n\n" + others, "cpu", seed=0, dtypes=["fp16"], full=True)
    assert r.passed, r.summary()
    r = check_variant("linear", base, "cpu", seed=0, dtypes=["fp16"], full=True)
    assert not r.passed and "linear_silu" in r.worst_case, r.summary()


def test_make_inputs_poisons_unused_cache_slots():
    spec = slot_cases.case_specs("decode_attention", 0, full=False)[1]
    inp = slot_cases.make_inputs("decode_attention", spec, torch.float32, "cpu", seed=0)
    assert torch.isnan(inp["k_cache"]).any() and torch.isnan(inp["v_cache"]).any()
    assert not torch.isnan(slot_refs.ref_decode_attention(**inp)).any()


def test_cli_exit_codes(capsys):
    assert slot_check.main(["--slot", "silu_mul", "--variant", "torch", "--device", "cpu", "--seed", "1"]) == 0
    assert "PASSED" in capsys.readouterr().out
    assert slot_check.main(["--slot", "silu_mul", "--variant", "triton", "--device", "cpu", "--seed", "1"]) == 1
