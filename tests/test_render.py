"""Every plan the builtin search can propose renders to a module that compiles, imports only
torch/triton/stdlib, passes the engine policy, and carries its plan; in-memory variants
(LLM proposals) are rendered in."""
from __future__ import annotations

import ast
import sys

import pytest

from agent import policy
from agent.loop import conservative_candidate
from agent.plan import SLOTS, Plan
from agent.providers.base import EvalResult, SearchState
from agent.providers.builtin import BuiltinProposer
from agent.render import kernel_path, render_engine

ALLOWED_TOP_LEVEL = {"torch", "triton", "__future__"} | set(sys.stdlib_module_names)


def proposable_plans(device: str) -> list[Plan]:
    """The conservative plan plus everything the builtin walk yields on `device` (all failing,
    so the walk does not branch)."""
    state = SearchState(spec=None, device=device, hardware={})
    state.history.append((conservative_candidate(), EvalResult.failure("public", "wrong_result", "", device)))
    proposer = BuiltinProposer(device)
    while (candidate := proposer.propose(state)) is not None:
        state.history.append((candidate, EvalResult.failure("public", "wrong_result", "", device)))
    return [c.plan for c, _ in state.history]


def imported_modules(source: str) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module.split(".")[0])
    return out


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_every_proposable_plan_renders_clean(device):
    plans = proposable_plans(device)
    assert plans[0].engine == "recompute" and plans[1].engine == "paged"
    for plan in plans:
        source = render_engine(plan)
        compile(source, f"<{plan.describe()}>", "exec")
        assert "def create_engine" in source
        assert imported_modules(source) <= ALLOWED_TOP_LEVEL, plan.describe()
        assert not policy.check_engine(source), (plan.describe(), policy.describe(policy.check_engine(source)))


def test_cpu_walk_tries_the_kv_cache_engine_and_its_cpu_parameters():
    described = [p.describe() for p in proposable_plans("cpu")]
    assert described[0] == "recompute"
    assert all("decode_graphs=False" not in d for d in described)  # a CUDA-only knob


def test_extra_variant_is_rendered_in():
    slot = "silu_mul"
    text = kernel_path(slot, "torch").read_text().replace("variant: torch", "variant: llm_try") \
        .replace(f"{slot}__torch", f"{slot}__llm_try")
    plan = Plan("paged", {s: "torch" for s in SLOTS} | {slot: "llm_try"})
    source = render_engine(plan, {(slot, "llm_try"): text})
    assert f"def {slot}__llm_try" in source and f"def {slot}__torch" in source
    compile(source, "<llm>", "exec")
