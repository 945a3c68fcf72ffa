"""Issue 23's scripted-model check, offline: `--builtin-walk params` keeps the builtin proposer to
the all-torch engine and its parameters, and the good model of scripts/llm_server.py (the
library's kernels as a model's answers, tests/fixtures/llm/good/) answers the real prompts
through the real SDK client, extraction, policy and unit check inside the real loop, and its
variant ends up in workspace/engine.py. The whole-engine judge is faked (scores by how many slots
hold a model's variant), so what is accepted does not depend on this machine's speed; the GPU
run of the same loop is `python3 -m scripts.gpu scripted-search`."""
from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from agent import cli, loop
from agent.plan import Plan
from agent.providers import ProviderOptions, make_proposer
from agent.providers.builtin import BuiltinProposer
from agent.records import EvalResult, SearchState
from agent.report import Reporter
from agent.search import PREFERRED
from agent.spec import spec_from_config
from agent.workspace import RESULTS_JSON, Workspace
from evaluator.slots import SLOTS
from scripts.llm_server import GOOD_ANSWERS, VARIANT_MARK, GoodModel
from tests.test_providers import CONFIG, KEYS, point_at

# The fake judge's profile: the model is asked for the slots with the largest shares first.
SHARES = {"silu_mul": 6.0, "norm": 3.0, "decode_attention": 1.0}


@pytest.fixture(autouse=True)
def llm_env(monkeypatch):
    for key in KEYS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("LLM_RETRY_DELAY_S", "0.01")
    monkeypatch.setenv("LLM_KERNELS_ON_CPU", "1")   # the fixtures' torch fallbacks run on the CPU


def test_params_walk_keeps_every_slot_on_torch():
    def walked(kernels: bool) -> list[Plan]:
        proposer, plans = BuiltinProposer("cuda", kernels=kernels), []
        state = SearchState(spec=None, device="cuda", hardware={})
        while (candidate := proposer.propose(state)) is not None:
            plans.append(candidate.plan)
            state.history.append((candidate, EvalResult.failure("public", "wrong_result", "x", "cuda")))
        return plans
    params_only = walked(kernels=False)
    assert params_only[0].slots == {s: "torch" for s in SLOTS}
    assert len(params_only) > 1 and all(set(p.slots.values()) == {"torch"} for p in params_only)
    assert len({p.key() for p in params_only}) == len(params_only)
    full = walked(kernels=True)   # the default walk starts from the library plan
    assert full[0].slots == {**{s: "torch" for s in SLOTS}, **PREFERRED}


def test_builtin_walk_flag_and_environment(monkeypatch):
    monkeypatch.delenv("BUILTIN_WALK", raising=False)
    assert cli.parse_args([]).builtin_walk == "full"
    assert cli.parse_args(["--builtin-walk", "params"]).builtin_walk == "params"
    monkeypatch.setenv("BUILTIN_WALK", "kernels")
    with pytest.raises(SystemExit) as e:
        cli.parse_args([])
    assert e.value.code == 2


def test_good_model_reads_the_real_prompts():
    """The kernel prompt's slot and variant are what it answers for; a slot with a slow answer
    gets it first and the fast one on the next turn; then a plan that stacks the menu's model
    variants; never a library variant."""
    model = GoodModel()
    name = f"llm_{random.randint(1, 99)}"
    ask = [{"role": "user", "content": f"Write a faster variant `{name}` of the slot `norm`.\n..."}]
    slow = model.reply(ask)
    assert f"def rmsnorm__{name}(" in slow and "for i in range" in slow
    fast = model.reply(ask + [{"role": "assistant", "content": slow}, {"role": "user", "content": "slower"}])
    assert fast == (GOOD_ANSWERS / "norm.md").read_text().replace(VARIANT_MARK, name)
    # refined once more (its fast answer judged slower somewhere): nothing better to write, no code
    third = model.reply(ask + [{"role": "assistant", "content": slow}, {"role": "user", "content": "slower"},
                               {"role": "assistant", "content": fast}, {"role": "user", "content": "slower"}])
    assert "def rmsnorm__" not in third
    menu = ("- slot variants on this device:\n  - `norm`: torch, triton, llm_2, llm_11\n"
            "  - `silu_mul`: torch, triton\n")
    again = model.reply([{"role": "user", "content": f"Write a faster variant `llm_12` of the slot `norm`.\n{menu}"}])
    plan = json.loads(re.search(r"```json\n(.*?)\n```", again, re.S).group(1))
    assert plan["plan"] == {"slots": {"norm": "llm_11"}}
    assert "```" not in model.reply([{"role": "user", "content": "Propose ONE change\n- slot variants on this "
                                                                   "device:\n  - `norm`: torch, triton\n"}])
    assert [kind for _, kind in model.answers] == ["slow", "fast", "no plan", "plan change", "no plan"]


def fake_judge(engine: Path, out_dir: Path, timeout: float, phase: str = "full") -> EvalResult:
    """Passes every engine; the paged engine scores 1, and 1.5x more for each slot that holds a
    model-written variant, in every case (a clear win, accepted without timing rounds)."""
    plan = json.loads((engine.parent / "plan.json").read_text())["plan"]
    model_slots = sum(1 for v in (plan.get("slots") or {}).values() if v.startswith("llm_"))
    score = 0.01 if plan["engine"] == "recompute" else 1.5 ** model_slots
    result = EvalResult(status="passed", stage="done", device="cpu", score=score, seconds=0.1,
                        benchmark=[{"case_name": c, "elapsed_ms": 10.0 / score, "total_tokens": 384,
                                    "prefill_tokens": 256, "decode_tokens": 128, "floor_fraction": score / 100,
                                    "tokens_per_second": 1000 * score} for c in ("prefill", "decode")])
    result.slot_ms = {"source": "torch.profiler, cpu", "total_ms": 11.0, "other_ms": 1.0, "cases": ["decode"],
                      "slots": {s: {"ms": ms, "calls": 12, "shapes": {}} for s, ms in SHARES.items()}}
    return result


@pytest.mark.slow
def test_a_good_models_variant_is_accepted_into_the_engine(tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_MAX_CALLS", "3")
    ws = Workspace(tmp_path / "ws")
    ws.reset()
    report = Reporter(ws.root, live=False)
    ws.open_history(warn=report.warn)
    spec = spec_from_config(json.loads(CONFIG.read_text()), CONFIG, tmp_path / "weights")
    state = SearchState(spec=spec, device="cpu", hardware={"device": "cpu"})
    with GoodModel("openai") as server:
        point_at(monkeypatch, "openai", server.url)
        options = ProviderOptions("cpu", 0, ws.root, BuiltinProposer("cpu", kernels=False))
        proposer = make_proposer("openai", options, report.warn)
        loop.run(state, proposer, fake_judge, ws, report, 600.0, parallel=2)
    report.finish([])
    results = json.loads((ws.root / RESULTS_JSON).read_text())
    model = [c for c in results["candidates"] if c["origin"] != "builtin"]
    # Two episodes run at once (silu_mul's and norm's, the largest shares), so which variant reaches
    # the judge first, and is accepted, depends on the machine's load: either is a good model's.
    assert ("silu_mul", "fast") in server.answers and model and any(c["accepted"] for c in model)
    assert all(set(c["plan"]["slots"].values()) <= {"torch"} | {v for v in c["plan"]["slots"].values()
                                                                if v.startswith("llm_")}
               for c in results["candidates"] if c["plan"]["engine"] == "paged")   # no library kernel
    assert re.search(r"def \w+__llm_\d+\(", ws.engine.read_text())
    assert state.best.origin != "builtin" and state.best_result.passed


def test_a_continued_run_keeps_its_workspace_budgets_and_the_models_memory(tmp_path):
    """The default budget (1800 s) does not fit one device call: scripted-search leaves
    continue.tgz, and the next call resumes from it. The good model keeps the slots whose fast
    answer it sent (asked again, it stacks a plan instead of sending the kernel again), the
    workspace comes back file for file, and a file that is not a continuation is refused."""
    from scripts.gpu import scripted_search as ss
    model = GoodModel()
    ask = [{"role": "user", "content": "Write a faster variant `llm_3` of the slot `norm`.\n..."}]
    assert "def rmsnorm__llm_3(" in model.reply(ask + [{"role": "assistant", "content": "x"}])   # the fast answer
    again = GoodModel(remembered=json.loads(json.dumps(model.memory())))
    assert again.memory() == {"fast_sent": ["norm"]}
    # asked again with its variant in the menu, it stacks a plan; with none there (the answer never
    # reached the run: a call cut before its unit check), it writes the fast kernel again, not the slow one
    menu = "\n- slot variants on this device:\n  - `norm`: torch, triton, llm_3\n"
    stacked = again.reply([{"role": "user", "content": ask[0]["content"].replace("llm_3", "llm_4") + menu}])
    assert "def rmsnorm__llm_4(" not in stacked and '"norm": "llm_3"' in stacked
    rewritten = again.reply([{"role": "user", "content": ask[0]["content"].replace("llm_3", "llm_5")}])
    assert rewritten == (GOOD_ANSWERS / "norm.md").read_text().replace(VARIANT_MARK, "llm_5")
    # once: sent by this process now, it is on its way to the menu (a unit check), not lost
    later = again.reply([{"role": "user", "content": ask[0]["content"].replace("llm_3", "llm_6")}])
    assert "def rmsnorm__" not in later
    assert [kind for _, kind in again.answers] == ["plan change", "fast again", "no plan"]
    # in one process, a second episode while the first's fast answer is still in its unit check: no copy
    assert "def rmsnorm__" not in model.reply([{"role": "user", "content": ask[0]["content"].replace("llm_3", "llm_7")}])

    ws = tmp_path / "ws"
    (ws / "candidates" / "001_x").mkdir(parents=True)
    (ws / "candidates" / "001_x" / "engine.py").write_text("print(1)\n")
    (ws / "results.json").write_text('{"candidates": []}\n')
    state = {"library_score": 0.127, "budgets": [450], "memory": model.memory()}
    ss.write_continuation(tmp_path / ss.CONTINUATION, ws, state)
    assert not (tmp_path / "continue.part").exists()
    (ws / "stale.txt").write_text("from another run\n")   # the target is replaced, not merged into
    back = ss.read_continuation(tmp_path / ss.CONTINUATION, ws)
    assert back == state
    assert sorted(str(p.relative_to(ws)) for p in ws.rglob("*")) == ["candidates", "candidates/001_x",
                                                                      "candidates/001_x/engine.py", "results.json"]
    assert (ws / "candidates" / "001_x" / "engine.py").read_text() == "print(1)\n"
    import tarfile
    with tarfile.open(tmp_path / "other.tgz", "w:gz") as tar:
        tar.add(ws / "results.json", arcname="results.json")
    with pytest.raises(ValueError, match="not a continue.tgz"):
        ss.read_continuation(tmp_path / "other.tgz", tmp_path / "ws2")
    garbage = tmp_path / "garbage.tgz"
    garbage.write_bytes(b"not a gzip file")
    for bad in (tmp_path / "other.tgz", garbage):
        with pytest.raises(ValueError):
            ss.read_continuation(bad, ws)
        assert (ws / "results.json").is_file()   # a file that is not a continuation replaces nothing


def test_a_bad_continuation_file_is_refused_before_anything_runs(tmp_path, monkeypatch, capsys):
    from scripts.gpu import scripted_search as ss
    monkeypatch.setattr(ss, "WORKSPACE", tmp_path / "ws")
    monkeypatch.setattr(ss, "SMOKE_MODEL", tmp_path / "model")
    bad = tmp_path / "bad.tgz"
    bad.write_bytes(b"\x1f\x8b not really")
    assert ss.main(["--device", "cpu", "--continue-from", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert f"cannot continue from {bad}: unreadable" in capsys.readouterr().err
    assert not (tmp_path / "model").exists() and not (tmp_path / "o").exists()
