"""The static policy as the loop applies it (issue #6): every candidate, ours included, is
checked before it runs; an engine that reaches for frames, other modules' globals, the
evaluator's files, the network, processes, threads or the timer is refused and never judged."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent import loop, policy, search
from agent.plan import Plan, engine_params, engines, menu
from agent.records import Candidate, EvalResult, SearchState
from agent.render import render_engine
from agent.report import Reporter
from agent.workspace import Workspace

from tests.fixtures.broken_engines import ESCAPES, FAULTS, broken_source

# What each escape is refused for: a piece of the violation text.
REFUSED_FOR = {
    "spawns_thread": "import of 'threading'",
    "patches_evaluator": "import of 'sys'",
    "reads_frames": "attribute 'f_back'",
    "forges_verdict": "'os._exit' is not allowed",
    "forges_verdict_at_exit": "import of 'atexit'",
    "edits_evaluator": "'open' is not allowed",
    "opens_socket": "import of 'socket'",
    "runs_subprocess": "import of 'subprocess'",
    "patches_timer": "import of 'time'",
    "exits_interpreter": "'exit' is not allowed",
    "segfaults": "import of 'ctypes'",
    "exits_at_once": "'os._exit' is not allowed",
}
# Reaching the same things without an import: through torch's own attributes.
WITHOUT_IMPORTS = {
    "torch.cuda.synchronize = lambda: None\n": "patches a module",
    "torch.Tensor.allclose = lambda *a, **k: True\n": "patches a module",
    "torch.multiprocessing.Process(target=print).start()\n": "'torch.multiprocessing.Process' is not allowed",
    "torch.os.system('true')\n": "reached through another module",
    "torch.hub.load('x', 'y')\n": "network access",
    "getattr(torch, 'o' + 's')\n": "getattr is allowed only with a literal",
    "import os\nos.environ['X'] = '1'\n": "environment access",
}


def all_template_plans() -> list[Plan]:
    """Every engine's default plan, each slot variant on it, and each parameter value on it."""
    plans = []
    for engine in engines():
        params = engine_params(engine)
        base = search.default_plan(engine, params)
        plans.append(base)
        plans += [Plan(engine, {**base.slots, slot: v.name}, base.params) for slot, vs in menu().items() for v in vs]
        plans += [Plan(engine, base.slots, {**base.params, name: c}) for name, p in params.items() for c in p.choices]
        plans += [Plan(engine, base.slots, {**base.params, **extra}) for extra in UNWALKED.get(engine, [])]
    return plans


# Params a skeleton reads that the search does not walk (no `# param:` line): set by hand, rendered all the same.
UNWALKED = {"paged": [{"megakernel": True}]}


def distinct_renders(*model) -> dict[str, Plan]:
    """Each distinct engine source the template plans render (a param that changes no text
    renders the same source: checked once), with a plan that renders it. A combination the
    engine refuses is not an engine to check."""
    sources: dict[str, Plan] = {}
    for plan in all_template_plans():
        try:
            sources.setdefault(render_engine(plan, None, *model), plan)
        except Exception:  # noqa: BLE001
            continue
    return sources


def test_every_template_passes_the_engine_policy():
    sources = distinct_renders()
    for source, plan in sources.items():
        assert policy.check_engine(source) == [], plan.describe()
    assert len(sources) > len(engines())


@pytest.mark.parametrize("conventions", [dict(), dict(qkv_bias=True, tied=True, llama3=True), dict(qk_norm=True)],
                         ids=["llama", "qwen2-tied-llama3", "qwen3"])
def test_every_hugging_face_render_passes_the_engine_policy(conventions):
    """A model folder's engines read its files through torch alone: the run judges no engine that
    breaks the policy (a loader that opened files itself made every HF candidate fail at policy
    on the H100, fifteenth session)."""
    from evaluator.checkpoint import Conventions, Llama3Scaling
    scaling = Llama3Scaling(8.0, 1.0, 4.0, 8192) if conventions.get("llama3") else None
    sources = distinct_renders(Conventions(hf=True, rope_scaling=scaling,
                                           **{k: v for k, v in conventions.items() if k != "llama3"}))
    for source, plan in sources.items():
        assert policy.check_engine(source) == [], plan.describe()
    assert len(sources) >= 2   # the recompute and paged skeletons at least


@pytest.mark.parametrize("name", sorted(REFUSED_FOR))
def test_escapes_are_refused_before_they_run(name, recompute_source):
    assert name in ESCAPES or name in FAULTS
    text = policy.describe(policy.check_engine(broken_source(name, recompute_source)))
    assert REFUSED_FOR[name] in text, text


@pytest.mark.parametrize("line", sorted(WITHOUT_IMPORTS))
def test_escapes_without_imports_are_refused(line):
    text = policy.describe(policy.check_engine("import torch\n" + line))
    assert WITHOUT_IMPORTS[line] in text, text


def test_the_loop_refuses_a_policy_breach_without_judging_it(tmp_path, monkeypatch, recompute_source):
    """A plain plan (no proposer code) whose rendering breaks the policy: the loop's own check."""
    escape = Plan("paged", params={"escape": True})
    monkeypatch.setattr(loop, "render_engine", lambda plan, extra=None: (
        broken_source("opens_socket", recompute_source) if plan == escape else recompute_source))
    judged = []

    def judge(engine: Path, out_dir: Path, timeout: float, phase: str) -> EvalResult:
        judged.append((json.loads((engine.parent / "plan.json").read_text())["plan"]["engine"], phase))
        return EvalResult(status="passed", stage="done", device="cpu", score=1.0, seconds=1.0)

    class OneEscape:
        name = "escape"
        sent = False

        def propose(self, state):
            if self.sent:
                return None
            self.sent = True
            return Candidate(escape, "test", "reaches the network")

        def feedback(self, candidate, result):
            pass

    ws = Workspace(tmp_path / "ws")
    ws.reset()
    report = Reporter(ws.root, live=False)
    state = SearchState(spec=None, device="cpu", hardware={})
    loop.run(state, OneEscape(), judge, ws, report, 600.0)
    report.finish([])
    verdict = state.history[1][1]
    assert (verdict.stage, verdict.error_kind) == ("policy", "policy") and "socket" in verdict.error
    # The conservative engine, verified and timed, then stressed (the escape did not replace it); never the escape.
    assert [engine for engine, _ in judged] == ["recompute"] * 2 and judged[-1][1] == "stress"
    assert json.loads(ws.engine.with_name("engine.json").read_text())["plan"]["engine"] == "recompute"
