"""What the model is told and how its kernels are measured (issue 23), offline on the CPU: the
engine's call shapes, the unit worker's timing of a proposal against the current variant, the
refinement turn of a correct but slower answer, the profiled pass's per-slot attribution, and
the picture of the search. Scripted answers go through the real parsing, checking and timing."""
from __future__ import annotations

import contextlib
import json
import sys
import types
from dataclasses import replace

import pytest
import torch

from agent.plan import Plan, engine_params, reference_slots
from agent.records import Candidate
from agent.providers import ProviderOptions, prompts
from agent.render import render_engine
from evaluator.evaluate import profiled_pass
from evaluator.remote import RemoteModule, Worker
from evaluator.slot_shapes import Dims, call_shapes
from tests.conftest import TINY_CONFIG, load_source
from tests.test_providers import clean_env  # noqa: F401 - autouse: the LLM environment of those tests
from tests.test_providers import Empty, ScriptedServer, answer, paged_state, point_at

PROFILE = {"source": "torch.profiler, CUDA kernels", "total_ms": 100.0, "other_ms": 30.0, "cases": ["decode"],
           "slots": {"decode_attention": {"ms": 9.0, "calls": 12, "shapes": {"decode_attention q[8,4,192]": 9.0}},
                     "linear": {"ms": 5.0, "calls": 48, "shapes": {}},
                     "silu_mul": {"ms": 56.0, "calls": 12, "shapes": {"silu_mul gate_up[256,6144]": 56.0}}}}


def profiled_state():
    state = paged_state()
    state.best_result.slot_ms = PROFILE
    return state


def test_call_shapes_follow_the_engine_fused_rows_and_traces():
    dims = Dims.from_config(TINY_CONFIG)
    shapes = call_shapes(dims, ["prefill", "decode"], fused_rows=64)
    # decode steps (B=8 <= 64) run the fused linear functions and no norm/rope/silu kernels after the first norm
    assert {s.fn for s in shapes["linear"]} == {"linear_rope_cache", "linear_add_norm", "linear_silu"}
    assert all(s.spec["N"] == 8 for s in shapes["linear"])
    assert sorted(s.spec["N"] for s in shapes["silu_mul"]) == [256, 512]
    assert sum(s.calls for s in shapes["decode_attention"]) == 16 * dims.layers
    # with fused_rows 0, every pass runs the unfused path
    assert "linear" not in call_shapes(dims, ["decode"], fused_rows=0)


def test_prompt_carries_measured_shares_shapes_tolerance_and_judged_engines(tmp_path, monkeypatch):
    """The kernel prompt, as the model receives it: measured shares (not the estimate), this
    slot's call shapes and the measured per-shape time, the tolerance, the engines judged so far,
    the current code rendered (no template syntax)."""
    monkeypatch.setenv("LLM_REFINE_ROUNDS", "0")
    with ScriptedServer("openai", [{"text": answer("05_correct_faster", "llm_1")}]) as server:
        point_at(monkeypatch, "openai", server.url)
        from agent.providers.openai import create
        options = ProviderOptions("cpu", 0, tmp_path, Empty())
        options.log = lambda line: None
        proposer = create(options)
        proposer.episodes = 1   # a kernel episode, not the first (plan) one
        candidate = proposer.propose(profiled_state())
    assert candidate is not None and candidate.extra_variants
    prompt = server.requests[0]["body"]["messages"][1]["content"]
    for needle in ("measured: the evaluator's profiled pass", "- silu_mul: 56%", "- other: 30%", "- decode_attention: 9%",
                   "## Where the engine calls `silu_mul`", "| `silu_mul` | N=512, I=3072 | 12 |",
                   "`silu_mul gate_up[256,6144]`: 56.000 ms", "## Tolerance", "|out - ref| <=",
                   "## Engines judged so far", "paged", "[builtin]: score 1"):
        assert needle in prompt, needle
    assert "estimated" not in prompt and "{{" not in prompt and "{%" not in prompt


def test_current_code_is_rendered_not_template_syntax():
    code = prompts.current_code("norm", "triton", {"pdl": False}, {})
    assert "def rmsnorm__triton" in code and "{{" not in code and "{%" not in code


def test_a_correct_but_slower_variant_is_refined_with_its_numbers(tmp_path, monkeypatch):
    """Round 1: correct, but about 40 copies slower than torch at the engine's shapes: the
    refinement turn carries its measured time against the current variant's per shape. Round 2:
    correct and about as fast as torch: it becomes the candidate. The slow variant is tens of
    times slower by construction, far past SLOWER_RATIO whatever the machine's load."""
    monkeypatch.setenv("LLM_REFINE_ROUNDS", "1")
    log: list[str] = []
    steps = [{"text": answer("06_correct_much_slower", "llm_1")}, {"text": answer("05_correct_faster", "llm_1")}]
    with ScriptedServer("openai", steps) as server:
        point_at(monkeypatch, "openai", server.url)
        from agent.providers.openai import create
        options = ProviderOptions("cpu", 0, tmp_path, Empty())
        options.log = log.append
        proposer = create(options)
        proposer.episodes = 1
        candidate = proposer.propose(profiled_state())
    assert len(server.requests) == 2
    refine = server.requests[1]["body"]["messages"][-1]["content"]
    assert "is correct" in refine and "the time of the current variant `torch`" in refine
    assert "`silu_mul` at N=256, I=3072 (36 calls in the benchmark): your kernel" in refine
    assert "us vs current `torch`" in refine and "refinement 1 of 1" in refine
    assert any("round 1/5: passed unit check" in line and "x the current variant's time" in line for line in log), log
    assert candidate is not None
    (text,) = candidate.extra_variants.values()
    assert "chunk(2, dim=-1)" in text and "range(40)" not in text
    # the transcript tapes both timings, for replay
    (transcript,) = (tmp_path / "transcripts").glob("*.jsonl")
    tapes = [r for r in map(json.loads, transcript.read_text().splitlines()) if r["type"] == "timing"]
    assert len(tapes) == 2 and tapes[0]["timings"][0]["candidate_us"] > tapes[0]["timings"][0]["current_us"]

    # replay (strict: any request that differs ends it) sends the same prompts, refinement
    # numbers included, and picks the same candidate: the taped timings stand in for today's
    monkeypatch.setenv("LLM_REPLAY_STRICT", "1")
    monkeypatch.setenv("LLM_REPLAY_FROM", str(transcript))
    from agent.providers.replay import create as replay
    options = ProviderOptions("cpu", 0, tmp_path / "replayed", Empty())
    replay_log: list[str] = []
    options.log = replay_log.append
    again = replay(options)
    again.episodes = 1
    replayed = again.propose(profiled_state())
    assert not any("differs from the recording" in line for line in replay_log)
    assert replayed is not None and replayed.extra_variants == candidate.extra_variants


class _Kernel:
    def __init__(self, name, us):
        self.name, self.duration = name, us   # as torch.profiler's kernel records: duration in us


class _Event:
    """torch.profiler's FunctionEvent as attribute reads it: a CPU event with the kernels torch
    tied to it, or (on_device_us) a kernel's own event."""

    def __init__(self, name, parent=None, kernels=(), on_device_us=None):
        self.name, self.cpu_parent, self.kernels = name, parent, list(kernels)
        self.device_type = types.SimpleNamespace(name="CPU" if on_device_us is None else "CUDA")
        self.time_range = types.SimpleNamespace(elapsed_us=lambda: on_device_us)


def _on_device(*kernels):
    """Each kernel's own event, as torch lists every kernel (tied to a CPU range or not)."""
    return [_Event(k.name, on_device_us=k.duration) for k in kernels]


def test_graph_replayed_kernels_take_the_slot_their_names_were_launched_from_at_creation():
    """A fully captured engine's pass launches every kernel from cudaGraphLaunch, in no slot
    range; the names its slot ranges launched while the engine was created attribute them.
    Without those names the pass is all `other` (what an H200 showed: slots {} for the library
    plan, twenty-fourth session). A name also launched outside any slot is not learnt."""
    from evaluator import slot_profile
    warm = _Event("slot:decode_attention:decode_attention q[8,4,192]")
    norm = _Event("slot:norm:rmsnorm x[8,768]")
    creation = [warm, _Event("cudaLaunchKernel", warm, [_Kernel("_decode_split_kernel", 4.0)]),
                norm, _Event("aten::fill_", norm, [_Kernel("fill", 1.0)]),
                _Event("aten::zeros", None, [_Kernel("fill", 1.0)]),        # the same name outside a slot
                _Event("aten::mm", None, [_Kernel("nvjet_lm_head", 3.0)])]  # outside any slot
    seen = {}
    slot_profile._seen_in_events(creation, seen)
    known = slot_profile.kernel_names(seen)
    assert known == {"_decode_split_kernel": "decode_attention"}
    # a replayed graph's kernels are tied to no CPU event (not even its cudaGraphLaunch): events of their own only
    replay = [_Event("cudaGraphLaunch"), *_on_device(_Kernel("_decode_split_kernel", 5000.0),
                                                     _Kernel("nvjet_lm_head", 2000.0), _Kernel("fill", 1000.0))]
    blind = slot_profile.attribute(replay, "cuda", wall_ms=10.0)
    assert blind["slots"] == {} and blind["other_ms"] == 10.0
    named = slot_profile.attribute(replay, "cuda", wall_ms=10.0, seen=seen)
    assert named["slots"]["decode_attention"]["ms"] == pytest.approx(5.0)
    # under the kernel's name, not a call shape: a graph's kernel serves every shape it was captured at
    assert named["slots"]["decode_attention"]["shapes"] == {
        slot_profile.REPLAYED.format(kernel="_decode_split_kernel"): pytest.approx(5.0)}
    assert named["other_ms"] == pytest.approx(5.0)   # lm_head's and the fill's kernels stay the rest's
    # a kernel the pass itself launched from a slot range keeps that range (counted once: torch lists a
    # tied kernel as an event of its own too); its name, now seen under two slots, names no replay
    own, eager = _Event("slot:linear:linear x[8,768]"), _Kernel("_decode_split_kernel", 1000.0)
    mixed = slot_profile.attribute([own, _Event("cudaLaunchKernel", own, [eager]), *_on_device(eager), *replay],
                                   "cuda", wall_ms=10.0, seen=seen)
    assert mixed["slots"]["linear"]["ms"] == pytest.approx(1.0) and "decode_attention" not in mixed["slots"]
    assert mixed["other_ms"] == pytest.approx(9.0)   # the wall less the slots
    # a kernel the pass launched eagerly outside every slot is not a slot's, whatever else launched the name
    norm_range, inside, outside = _Event("slot:norm:rmsnorm x[8,768]"), _Kernel("fill", 1000.0), _Kernel("fill", 3000.0)
    fills = slot_profile.attribute([norm_range, _Event("aten::fill_", norm_range, [inside]),
                                    _Event("aten::zeros", None, [outside]), *_on_device(inside, outside)],
                                   "cuda", wall_ms=10.0)
    assert fills["slots"]["norm"]["ms"] == pytest.approx(1.0) and fills["other_ms"] == pytest.approx(9.0)


def test_a_replayed_kernels_label_is_short_and_safe_in_a_prompt():
    from evaluator import slot_profile
    cpp = "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<long>, `x`>(int, ...)"
    label = slot_profile.replayed_label(cpp)
    assert "`" not in label and "FillFunctor" not in label and "vectorized_elementwise_kernel" in label
    assert slot_profile.replayed_label("_gemm_kernel__triton") == slot_profile.REPLAYED.format(kernel="_gemm_kernel__triton")


class _Meta:
    def __init__(self, name):
        self.name = name

    def get(self):
        return {"name": self.name}


class _Chain:
    """Triton 3.7's HookChain: add, remove, call them all."""

    def __init__(self):
        self.calls = []

    def add(self, f):
        self.calls.append(f)

    def remove(self, f):
        self.calls.remove(f)

    def __call__(self, m):
        for f in self.calls:
            f(m)


@pytest.mark.parametrize("style", ["single", "chain"])
def test_triton_launches_are_named_by_the_slot_open_when_they_launch(monkeypatch, style):
    """torch.profiler ties no Triton kernel to a CPU range, so the creation's Triton launches are
    named through Triton's launch hook (a single hook in Triton 3.4-3.6, a chain from 3.7): each
    with the outermost slot open at its launch; one launched outside every slot is not learnt;
    the hook Triton had before is back afterwards. The launcher is played by calling the hook."""
    from evaluator import slot_profile
    runtime = types.SimpleNamespace(launch_enter_hook=None if style == "single" else _Chain())
    before = runtime.launch_enter_hook
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(knobs=types.SimpleNamespace(runtime=runtime)))

    def launch(name):
        if runtime.launch_enter_hook is not None:
            runtime.launch_enter_hook(_Meta(name))

    def rmsnorm__triton(x, weight, eps):
        launch("_rmsnorm_kernel")
        launch("_shared_kernel")

    def linear_silu__triton(x, weight):
        launch("_gemm_kernel")
        namespace["rmsnorm__triton"](x, None, 0.0)   # a slot called inside another: the outer one is open

    namespace = {"rmsnorm__triton": rmsnorm__triton, "linear_silu__triton": linear_silu__triton}
    saved = slot_profile.wrap_slots(namespace, lambda name: contextlib.nullcontext())
    x = torch.zeros(8, 64)

    def make():
        namespace["rmsnorm__triton"](x, None, 0.0)
        namespace["linear_silu__triton"](x, None)
        launch("_shared_kernel")   # outside any slot
        return "engine"

    seen = {}
    with slot_profile._TritonLaunches(seen):
        assert make() == "engine"
    namespace.update(saved)
    assert runtime.launch_enter_hook is before and (style == "single" or before.calls == [])
    assert seen["_rmsnorm_kernel"] == {("norm", "rmsnorm x[8,64]"), ("linear", "linear_silu x[8,64]")}
    assert None in seen["_shared_kernel"]
    # _rmsnorm_kernel ran under two slots (norm's own range, and linear's around it), _shared_kernel
    # also outside any: only _gemm_kernel is learnt
    assert slot_profile.kernel_names(seen) == {"_gemm_kernel": "linear"}


@pytest.mark.usefixtures("single_thread")
def test_profiled_pass_attributes_time_to_slots_on_cpu(tiny_model, tmp_path):
    """The worker's profiled pass of a paged engine: every slot the traces call shows up, with as
    many calls as the engine's call shapes predict, and the slots' time within the pass's."""
    plan = Plan("paged", reference_slots(), {k: p.default for k, p in engine_params("paged").items()})
    engine = tmp_path / "engine.py"
    engine.write_text(render_engine(plan))
    with Worker("cpu") as worker:
        worker.request({"op": "load", "engine": worker.readable(engine)}, what="import")
        slot_ms = profiled_pass(RemoteModule(worker), tiny_model.config, tiny_model.weight_dir, ["prefill", "decode"])
        # past its time budget the pass starts no further case, and says which it profiled: a mixed
        # case first (it calls every slot)
        first_only = profiled_pass(RemoteModule(worker), tiny_model.config, tiny_model.weight_dir,
                                   ["decode", "mixed"], budget_s=0.0)
    assert slot_ms["cases"] == ["prefill", "decode"] and first_only["cases"] == ["mixed"]
    assert {s: v["calls"] for s, v in first_only["slots"].items()} == {
        s: sum(c.calls for c in v) for s, v in call_shapes(Dims.from_config(tiny_model.config), ["mixed"],
                                                           first_only["fused_rows"]).items()}
    # fp32 weights packed for oneDNN run every pass unfused (the engine's fused_rows is 0 then)
    fused_rows = 0 if load_source(render_engine(plan), "feedback_engine").cpu_packing_works() else 64
    expected = {s: sum(c.calls for c in v) for s, v in call_shapes(Dims.from_config(tiny_model.config),
                                                                   ["prefill", "decode"], fused_rows).items()}
    assert {s: v["calls"] for s, v in slot_ms["slots"].items()} == expected
    assert slot_ms["fused_rows"] == fused_rows   # the engine's own limit, reported with the pass
    in_slots = sum(v["ms"] for v in slot_ms["slots"].values())
    assert 0 < in_slots <= slot_ms["total_ms"] * 1.01
    assert slot_ms["other_ms"] == pytest.approx(max(slot_ms["total_ms"] - in_slots, 0.0), abs=1e-6)
    for v in slot_ms["slots"].values():
        assert v["ms"] > 0 and sum(v["shapes"].values()) == pytest.approx(v["ms"])
    assert "norm" in slot_ms["slots"] and any("x[512," in k for k in slot_ms["slots"]["norm"]["shapes"])
    # the engine file is untouched and the prompt reads the pass as measured shares
    assert engine.read_text() == render_engine(plan)
    state = paged_state()
    state.best_result.slot_ms = slot_ms
    assert prompts.fused_rows(state) == fused_rows   # what the prompt's call shapes are cut at
    profile = prompts.profile(state.best_result)
    assert profile.source.startswith(prompts.MEASURED) and sum(s for _, s in profile.shares) == pytest.approx(1.0)
    assert "cases prefill, decode" in profile.source


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("slots", ["torch", "library"])
def test_profiled_pass_attributes_kernel_time_to_slots_on_cuda(tiny_model, tmp_path, slots):
    """The profiled pass through a confined CUDA worker, of the all-torch engine (eager: the torch
    attention variants are not graph-safe) and of the library plan (captured graphs, whose kernels
    are attributed by name): a profile comes back, the slots the pass calls get kernel time, and
    what is not a slot's stays under the pass's wall time."""
    from agent.search import PREFERRED
    chosen = reference_slots() if slots == "torch" else {**reference_slots(), **PREFERRED, "linear": "triton"}
    plan = Plan("paged", chosen, {k: p.default for k, p in engine_params("paged").items()})
    engine = tmp_path / "engine.py"
    engine.write_text(render_engine(plan))
    with Worker("cuda") as worker:
        worker.request({"op": "load", "engine": worker.readable(engine)}, what="import")
        # mixed: one case that calls every slot (the pass starts no second case past PROFILE_BUDGET_S,
        # and this worker compiles every kernel afresh: a second case never ran on an H200)
        slot_ms = profiled_pass(RemoteModule(worker), tiny_model.config, tiny_model.weight_dir, ["mixed"])
    timed = {s for s, v in slot_ms["slots"].items() if v["ms"] > 0}
    assert {"prefill_attention", "decode_attention"} <= timed, slot_ms
    assert 0 < sum(v["ms"] for v in slot_ms["slots"].values()) <= slot_ms["total_ms"], slot_ms
    assert prompts.profile(replace(paged_state().best_result, slot_ms=slot_ms)).source.startswith(prompts.MEASURED)


def test_search_picture_is_drawn_or_skipped_with_a_log_line(tmp_path):
    from agent import plot
    points = [plot.Point(1, 1.0, 1.0, "builtin", True), plot.Point(2, 2.0, None, "openai:gpt", False, "wrong_result", 1),
              plot.Point(3, 3.0, 2.5, "openai:gpt", True, parent=1), plot.Point(4, 4.0, 2.0, "builtin", False)]
    lines: list[str] = []
    drawn = plot.draw(tmp_path / plot.SEARCH_PNG, points, lines.append)
    try:
        import matplotlib  # noqa: F401 - only whether it is there
    except ImportError:
        assert not drawn and "matplotlib is not installed" in lines[0]
        return
    png = (tmp_path / plot.SEARCH_PNG).read_bytes()
    assert drawn and not lines and png.startswith(b"\x89PNG") and len(png) > 5000


def test_the_profiled_pass_is_asked_for_once_per_new_best(tmp_path):
    """Only the FINAL phase (an engine about to become the best) asks for the profiled pass: the
    screens and repeated timings that decide acceptance are never profiled."""
    from agent.judge import FINAL, STRESS, TIMING, VERIFY, JudgeSettings
    settings = JudgeSettings("python3", tmp_path / "c.json", tmp_path / "w", "cpu", 0, profile=True)
    flags = {phase: settings.for_phase(phase).request(tmp_path / "engine.py", tmp_path / "out")["profile"]
             for phase in (VERIFY, STRESS, TIMING, FINAL)}
    assert flags == {VERIFY: False, STRESS: False, TIMING: False, FINAL: True}


def test_only_timing_phases_run_the_benchmark(tmp_path):
    """FINAL and STRESS judge an engine whose timing the loop holds already (its screen, its
    TIMING): the evaluator is told to leave the benchmark out."""
    from agent.judge import FINAL, STRESS, TIMING, VERIFY, JudgeSettings
    settings = JudgeSettings("python3", tmp_path / "c.json", tmp_path / "w", "cpu", 0)
    asked = {phase: settings.for_phase(phase).request(tmp_path / "engine.py", tmp_path / "out")
             for phase in (VERIFY, STRESS, TIMING, FINAL)}
    assert {phase: r["benchmark"] for phase, r in asked.items()} == \
        {VERIFY: True, STRESS: False, TIMING: True, FINAL: False}
    assert {phase: r["stress"] for phase, r in asked.items()} == \
        {VERIFY: "off", STRESS: "quick", TIMING: "off", FINAL: "quick"}
    assert {r["repeat"] for r in asked.values()} == {None}   # the judge process's --repeat
    assert {r["warm_up"] for r in asked.values()} == {"case"}   # a screen's timing is installed: SPEC §5's


def test_where_screens_time_fewer_engines_the_final_times_its_own_in_full(tmp_path):
    """With screen_repeat under repeat (a GPU run: agent/cli.py BENCH) the screens and the contest's
    rounds ask for screen_repeat fresh engines a case; a finalist's verdict runs the benchmark itself,
    and the conservative engine its one case, at the judge's full --repeat (each is installed on
    that timing); STRESS still none."""
    from agent.judge import FINAL, STRESS, TIMING, VERIFY, JudgeSettings
    settings = JudgeSettings("python3", tmp_path / "c.json", tmp_path / "w", "cuda", 0, repeat=3, screen_repeat=1)
    asked = {phase: settings.for_phase(phase).request(tmp_path / "engine.py", tmp_path / "out")
             for phase in (VERIFY, STRESS, TIMING, FINAL)}
    assert {phase: (r["benchmark"], r["repeat"]) for phase, r in asked.items()} == \
        {VERIFY: (True, None), STRESS: (False, None), TIMING: (True, 1), FINAL: (True, None)}
    # ... with one warm-up engine for all cases; the finalist's timing, installed, has SPEC §5's one a case
    assert {phase: r["warm_up"] for phase, r in asked.items()} == \
        {VERIFY: "case", STRESS: "case", TIMING: "shared", FINAL: "case"}
    cmd = settings.for_phase(TIMING).command()
    assert cmd[cmd.index("--repeat") + 1] == "3"   # one judge process for every phase


def test_the_conservative_engine_is_timed_on_one_case_of_the_runs_at_its_warmup_and_repeats(tmp_path):
    """VERIFY times CONSERVATIVE_CASE alone (the first of the run's cases where the run lacks it),
    with the warm-up and repeats of every other timing, so that its one score compares case for case."""
    import random
    from agent.judge import CONSERVATIVE_CASE, TIMING, VERIFY, JudgeSettings
    warmup, repeat = random.randint(0, 3), random.randint(1, 5)
    settings = JudgeSettings("python3", tmp_path / "c.json", tmp_path / "w", "cpu", 0, warmup=warmup, repeat=repeat)

    def flags(s: JudgeSettings, phase: str) -> tuple[str, str, str]:
        """The request's cases; the warm-up and repeats of the run's one judge process."""
        phased = s.for_phase(phase)
        cmd = phased.command()
        return (phased.request(tmp_path / "engine.py", tmp_path / "out")["cases"],
                *(cmd[cmd.index(flag) + 1] for flag in ("--warmup", "--repeat")))
    assert flags(settings, VERIFY) == (CONSERVATIVE_CASE, str(warmup), str(repeat))
    assert flags(settings, TIMING) == (None, str(warmup), str(repeat))   # the evaluator's default cases
    assert flags(replace(settings, cases=f"decode,{CONSERVATIVE_CASE}"), VERIFY)[0] == CONSERVATIVE_CASE
    assert flags(replace(settings, cases="decode128,prefill"), VERIFY)[0] == "decode128"


def test_the_prompts_fused_rows_follow_the_engine_not_the_plan_param():
    """The prompt's call shapes (and its "passes of at most N tokens" line) assumed the plan's
    fused_rows, 64, also where the engine runs every pass unfused: the torch linear variant on
    CUDA, weights packed for oneDNN on a CPU. A profiled pass's report wins; without one, the
    binding's rule; a report that is not a plausible row count is not believed."""
    cpu, cuda = paged_state("cpu"), paged_state("cuda")
    assert prompts.fused_rows(cpu) == 64 and prompts.fused_rows(cuda) == 0
    # the small passes call the norm slot when nothing is fused; a linear variant of the model's
    # own would replace the torch one and run at the plan's limit, so its shapes are the fused ones
    assert any(s.fn == "add_rmsnorm" and "N=8," in s.label for s in prompts.slot_shapes(cuda, "norm"))
    assert not any(s.fn == "add_rmsnorm" and "N=8," in s.label for s in prompts.slot_shapes(cpu, "norm"))
    assert prompts.fused_rows(cuda, "linear") == 64 and prompts.slot_shapes(cuda, "linear")
    triton = paged_state("cuda")
    triton.best = Candidate(Plan("paged", {**triton.best.plan.slots, "linear": "triton"}, triton.best.plan.params),
                            "builtin", "paged")
    assert prompts.fused_rows(triton) == 64 and prompts.slot_shapes(triton, "linear")
    for claim, believed in ((0, 0), (128, 128), (True, 64), (-1, 64), (10 ** 9, 64), ("64", 64)):
        cpu.best_result.slot_ms = {"slots": {}, "total_ms": 1.0, "other_ms": 1.0, "fused_rows": claim}
        assert prompts.fused_rows(cpu) == believed, claim


def test_a_triton_before_knobs_is_hooked_on_compiled_kernel_beside_a_hook_already_there(monkeypatch):
    """Triton before 3.4 keeps its launch hook on CompiledKernel; a hook someone set there keeps
    being called while the pass watches, and is the one left afterwards."""
    from evaluator import slot_profile
    calls = []

    class CompiledKernel:
        launch_enter_hook = staticmethod(lambda m: calls.append(("theirs", m.get()["name"])))

    before = CompiledKernel.launch_enter_hook
    triton = types.ModuleType("triton")   # no `knobs`: `from triton import knobs` fails
    compiler = types.ModuleType("triton.compiler")
    compiled = types.ModuleType("triton.compiler.compiler")
    compiled.CompiledKernel = CompiledKernel
    for name, module in (("triton", triton), ("triton.compiler", compiler), ("triton.compiler.compiler", compiled)):
        monkeypatch.setitem(sys.modules, name, module)
    # where the real Triton was imported (a GPU machine), `from triton import knobs` would find its
    # submodule in sys.modules even from the stand-in package
    monkeypatch.delitem(sys.modules, "triton.knobs", raising=False)
    namespace = {"silu_mul__triton": lambda gate_up: CompiledKernel.launch_enter_hook(_Meta("_silu_kernel"))}
    saved = slot_profile.wrap_slots(namespace, lambda name: contextlib.nullcontext())
    seen = {}
    with slot_profile._TritonLaunches(seen):
        namespace["silu_mul__triton"](torch.zeros(2, 8))
    namespace.update(saved)
    assert calls == [("theirs", "_silu_kernel")]
    assert slot_profile.kernel_names(seen) == {"_silu_kernel": "silu_mul"}
    assert CompiledKernel.launch_enter_hook is before
