"""agent/loop.py and the builtin search, with a fake judge: conservative first, keep the best,
never install a failure, never judge a plan twice, stop at the budget, survive the proposer."""
from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from agent import acceptance, loop
from agent.plan import Param, Plan, Variant
from agent.providers.builtin import BuiltinProposer
from agent.providers.proposals import UNIT_CHECKS
from agent.judge import CONSERVATIVE_CASE
from agent.records import DEADLINE, MARGIN_FLOOR, MIN_GAIN, MIN_SAFETY_MARGIN, Candidate, EvalResult, SearchState, improves
from agent.report import Reporter
from agent.workspace import Workspace

CONSERVATIVE = Plan("recompute").key()
CASES = ("prefill", "decode", "mixed")   # the CPU run's benchmark cases: each timing gives three paired ratios


def passed(score: float, seconds: float = 1.0) -> EvalResult:
    return EvalResult(status="passed", stage="done", device="cpu", score=score, seconds=seconds,
                      benchmark=[{"case_name": case, "tokens_per_second": 1000 * score} for case in CASES])


def failed(kind: str = "wrong_result") -> EvalResult:
    return EvalResult.failure("public", kind, "max abs err 0.5", "cpu", 1.0)


class ListProposer:
    """Proposes a fixed list of plans in order."""

    name = "list"

    def __init__(self, plans):
        self.plans = list(plans)
        self.feedback_seen = []

    def propose(self, state):
        return Candidate(self.plans.pop(0), "test", "listed") if self.plans else None

    def feedback(self, candidate, result):
        self.feedback_seen.append((candidate.plan.key(), result.status))


def fake_render(plan, extra_variants=None):
    return f"# engine for {plan.key()}\n"


def run_loop(tmp_path: Path, proposer, verdicts, budget: float = 600.0, device: str = "cpu", monkeypatch=None,
             verify=None, calls: list | None = None, stress=None, max_candidates: int | None = None, series=None,
             finals: dict | None = None, agains: dict | None = None):
    """Run the real loop with a judge that looks full verdicts up by plan key (default: fail);
    the conservative engine's VERIFY phase gives its full verdict's CONSERVATIVE_CASE alone (or `verify`).
    Like the evaluator, FINAL and STRESS carry no benchmark, STRESS gives `stress` if set, and FINAL
    `finals[key]` where given, and a screen's second run (acceptance.SCREEN_AGAIN) `agains[key]`.
    `calls` gets every (plan key, phase, out dir name) the judge was asked."""
    monkeypatch.setattr(loop, "render_engine", fake_render)
    judged = []

    def judge(engine: Path, out_dir: Path, timeout: float, phase: str) -> EvalResult:
        key = Plan.from_dict(json.loads((engine.parent / "plan.json").read_text())["plan"]).key()
        if engine.parent in (out_dir, out_dir.parent):   # not the best's repeated timings (agent/acceptance.py)
            judged.append((key, timeout, phase))
        assert engine.read_text() == fake_render(Plan.from_dict(json.loads(key)))
        full = verdicts.get(key, failed())
        if calls is not None:
            calls.append((key, phase, out_dir.name))
        if phase == loop.VERIFY:
            return verify or (replace(full, benchmark=[c for c in full.benchmark if c["case_name"] == CONSERVATIVE_CASE])
                              if full.passed else full)
        if phase == loop.STRESS and stress is not None:
            return stress
        if phase == loop.FINAL and finals and key in finals:
            return finals[key]
        if out_dir.name == acceptance.SCREEN_AGAIN and agains and key in agains:
            return agains[key]
        if phase in (loop.FINAL, loop.STRESS) and full.passed:
            return replace(full, benchmark=[], score=None)
        return full

    ws = Workspace(tmp_path / "ws")
    ws.reset()
    report = Reporter(ws.root, live=False)
    ws.open_history(warn=report.warn)
    state = SearchState(spec=None, device=device, hardware={})
    loop.run(state, proposer, judge, ws, report, budget, max_candidates=max_candidates, series=series)
    report.finish([])
    judged = [(k, t) for k, t, phase in judged if phase != loop.FINAL]   # a final may come later (settle_final)
    firsts = [(k, t) for i, (k, t) in enumerate(judged) if i == 0 or judged[i - 1][0] != k]
    return ws, state, firsts  # one (plan key, timeout) per candidate, in order


def installed_key(ws: Workspace) -> str | None:
    verdict = ws.installed_verdict()
    return Plan.from_dict(verdict["plan"]).key() if verdict else None


def test_improves_rule():
    assert improves(passed(1.0), None)
    assert not improves(failed(), None)
    assert improves(passed(1.0), failed())
    assert not improves(passed(1.0 + MIN_GAIN / 2), passed(1.0))
    assert improves(passed(1.1), passed(1.0))
    assert not improves(failed(), passed(1.0))


def with_margin(result: EvalResult, public: float, stress: float) -> EvalResult:
    result.public = {"status": "passed", "worst_margin": public}
    result.stress = {"passed": 4, "failed": 0, "worst_margin": min(stress, 0.1), "target_margin": stress}
    return result


def test_a_pass_too_close_to_the_tolerance_is_not_kept(tmp_path, monkeypatch):
    thin = with_margin(passed(50.0), public=0.9, stress=MIN_SAFETY_MARGIN - 0.05)
    assert thin.margin() == MIN_SAFETY_MARGIN - 0.05 and not thin.safe()
    assert not improves(thin, passed(1.0))
    assert improves(with_margin(passed(2.0), public=0.9, stress=MIN_SAFETY_MARGIN), passed(1.0))
    a, b = Plan("paged", params={"x": 0}), Plan("paged", params={"x": 1})
    verdicts = {CONSERVATIVE: with_margin(passed(1.0), 1.0, 1.0), a.key(): thin,
                b.key(): with_margin(passed(5.0), 0.8, 0.7)}
    ws, _, _ = run_loop(tmp_path, ListProposer([a, b]), verdicts, monkeypatch=monkeypatch)
    assert installed_key(ws) == b.key()
    assert "too close to the tolerance" in (ws.root / "results.log").read_text()


def test_the_margin_asked_is_the_judges_own_where_the_judge_is_noisier_but_never_below_the_floor():
    def result(margin: float, reference: float | None) -> EvalResult:
        r = with_margin(passed(5.0), public=0.9, stress=margin)
        r.reference_margin = reference
        return r
    assert result(0.45, None).required_margin() == MIN_SAFETY_MARGIN   # no measurement: the fixed rule
    assert result(0.45, 0.9).required_margin() == MIN_SAFETY_MARGIN    # a quiet judge changes nothing
    assert not result(0.45, 0.9).safe()
    assert result(0.45, 0.35).safe() and not result(0.33, 0.35).safe()
    assert result(0.2, -3.0).required_margin() == MARGIN_FLOOR and not result(MARGIN_FLOOR - 0.01, -3.0).safe()
    assert EvalResult.from_dict({**result(0.45, 0.35).to_dict()}).safe()   # survives results.json

def test_conservative_first_then_keeps_the_fastest(tmp_path, monkeypatch):
    a, b, c, d = (Plan("paged", params={"x": i}) for i in range(4))
    verdicts = {CONSERVATIVE: passed(1.0), a.key(): passed(10.0), b.key(): failed(),
                c.key(): passed(10.0 * (1 - MIN_GAIN / 2)), d.key(): passed(30.0)}
    proposer = ListProposer([a, b, c, d])
    ws, state, judged = run_loop(tmp_path, proposer, verdicts, monkeypatch=monkeypatch)
    assert [k for k, _ in judged] == [CONSERVATIVE, a.key(), b.key(), c.key(), d.key()]
    assert installed_key(ws) == d.key()
    assert ws.engine.read_text() == fake_render(d)
    results = json.loads((ws.root / "results.json").read_text())
    assert [e["accepted"] for e in results["candidates"]] == [True, True, False, False, True]
    assert results["finished"] and results["best"] == 5
    assert proposer.feedback_seen[0] == (a.key(), "passed")  # the loop's own conservative step is not fed back
    for name in ("engine.py", "plan.json"):
        assert (ws.root / "candidates" / "003-paged-x-1" / name).exists()
    log = (ws.root / "results.log").read_text()
    assert "summary" in log and "FAILED at public (wrong_result)" in log and log.count("ACCEPTED") == 3
    assert log.count("PROVISIONAL") == 1   # a's final at once (the conservative engine on disk), d's deferred
    assert "no candidate left to judge (the proposers have nothing more to try)" in log   # why a run ends early


def test_the_conservative_engine_is_judged_once_timed_on_one_case_and_compared_case_for_case(tmp_path, monkeypatch):
    """One evaluation (VERIFY) installs it, timed on CONSERVATIVE_CASE only, and the results say
    so; a challenger is measured against it on that case, not by the two scores' geometric means
    (a score over one case is not one over three)."""
    a = Plan("paged")
    gain = random.uniform(1.5, 4.0)
    # the challenger's score is below the conservative's (its other cases drag its mean down),
    # yet on the case both timed it is `gain` times faster: it must win, and on that case alone
    conservative = with_margin(passed(1.0), 1.0, 1.0)
    challenger = with_margin(passed(0.5), 1.0, 1.0)
    for case in challenger.benchmark:
        case["tokens_per_second"] = 1000 * gain if case["case_name"] == CONSERVATIVE_CASE else 10.0
    calls = []
    ws, state, _ = run_loop(tmp_path, ListProposer([a]), {CONSERVATIVE: conservative, a.key(): challenger},
                            monkeypatch=monkeypatch, calls=calls)
    assert [phase for key, phase, _ in calls if key == CONSERVATIVE] == [loop.VERIFY]
    first = state.history[0][1]
    assert [c["case_name"] for c in first.benchmark] == [CONSERVATIVE_CASE] and first.unstressed
    record = json.loads((ws.root / "results.json").read_text())["candidates"]
    assert record[0]["result"]["note"] == f"the conservative engine, timed on {CONSERVATIVE_CASE} only"
    assert installed_key(ws) == a.key() and record[1]["accepted"]
    assert f"over {CONSERVATIVE_CASE}, the cases both timed" in state.history[1][1].decision
    log = (ws.root / "results.log").read_text()
    assert f"timed on {CONSERVATIVE_CASE} only" in log


def test_conservative_that_fails_verification_is_not_installed_nor_timed(tmp_path, monkeypatch):
    ws, state, judged = run_loop(tmp_path, ListProposer([]), {}, verify=failed(), monkeypatch=monkeypatch)
    assert not ws.engine.exists() and len(judged) == 1 and not state.history[0][1].passed


def test_failures_never_install(tmp_path, monkeypatch):
    ws, state, _ = run_loop(tmp_path, ListProposer([Plan("paged")]), {}, monkeypatch=monkeypatch)
    assert not ws.engine.exists() and ws.installed_verdict() is None
    assert len(state.history) == 2 and state.best is None


def test_git_history_has_each_accepted_engine(tmp_path, monkeypatch):
    pytest.importorskip("git")
    a = Plan("paged")
    ws, _, _ = run_loop(tmp_path, ListProposer([a]), {CONSERVATIVE: passed(1.0), a.key(): passed(5.0)},
                        monkeypatch=monkeypatch)
    messages = [c.message for c in ws.repo.iter_commits()]
    assert messages[0].startswith("#002 paged")


def test_repeated_plans_are_skipped(tmp_path, monkeypatch):
    a = Plan("paged")
    ws, state, judged = run_loop(tmp_path, ListProposer([a, a, Plan("recompute"), a]), {}, monkeypatch=monkeypatch)
    assert [k for k, _ in judged] == [CONSERVATIVE, a.key()]
    assert (ws.root / "results.log").read_text().count("repeated an already-judged candidate") == 3


def test_proposer_error_keeps_the_engine(tmp_path, monkeypatch):
    class Broken(ListProposer):
        def propose(self, state):
            raise RuntimeError("provider exploded")
    ws, _, _ = run_loop(tmp_path, Broken([]), {CONSERVATIVE: passed(1.0)}, monkeypatch=monkeypatch)
    assert installed_key(ws) == CONSERVATIVE
    assert "provider exploded" in (ws.root / "results.log").read_text()


def test_budget_stops_the_search(tmp_path, monkeypatch):
    plans = [Plan("paged", params={"x": i}) for i in range(5)]
    budget = loop.RESERVE_SECONDS + loop.MIN_EVAL_SECONDS / 2
    ws, state, judged = run_loop(tmp_path, ListProposer(plans), {CONSERVATIVE: passed(1.0)}, budget=budget,
                                 monkeypatch=monkeypatch)
    assert len(judged) == 1 and judged[0][1] <= budget
    assert "not enough for another evaluation" in (ws.root / "results.log").read_text()


def test_timeout_shrinks_to_what_is_left_and_caps_hangs():
    state = SearchState(spec=None, device="cpu", hardware={})
    assert loop.timeout_for(state, 500.0) == 500.0
    state.history.append((loop.conservative_candidate(), passed(1.0, seconds=10.0)))
    assert loop.timeout_for(state, 500.0) == loop.HANG_FACTOR * 10.0 + loop.HANG_SLACK_SECONDS
    assert loop.timeout_for(state, 20.0) == 20.0


FAKE_MENU = {
    "norm": [Variant("norm", "torch", ("cpu", "cuda"), None), Variant("norm", "triton_bad", ("cuda",), None)],
    "decode_attention": [Variant("decode_attention", "torch", ("cpu", "cuda"), None),
                         Variant("decode_attention", "triton_a", ("cuda",), None),
                         Variant("decode_attention", "triton_b", ("cuda",), None),
                         Variant("decode_attention", "cpu_only", ("cpu",), None)],
}
FAKE_PARAMS = {"block_size": Param("block_size", 16, (16, 32)), "graphs": Param("graphs", True, (True, False), ("cuda",))}


def _fake_menu(monkeypatch):
    import agent.providers.builtin as builtin
    monkeypatch.setattr(builtin, "menu", lambda: FAKE_MENU)
    monkeypatch.setattr(builtin, "engine_params", lambda engine: FAKE_PARAMS)
    monkeypatch.setattr(builtin, "engines", lambda: ["paged", "recompute"])


def test_builtin_walk_is_greedy_and_never_repeats(tmp_path, monkeypatch):
    _fake_menu(monkeypatch)
    slots = {"norm": "torch", "rope_cache": "torch", "prefill_attention": "torch",
             "decode_attention": "torch", "silu_mul": "torch", "linear": "torch"}
    base = {"block_size": 16, "graphs": True}
    key = lambda p=None, s=None: Plan("paged", {**slots, **(s or {})}, {**base, **(p or {})}).key()  # noqa: E731
    verdicts = {CONSERVATIVE: passed(1.0), key(): passed(10.0),
                key(s={"decode_attention": "triton_a"}): passed(15.0),
                key(s={"decode_attention": "triton_b"}): passed(12.0),
                key({"block_size": 32}, {"decode_attention": "triton_a"}): passed(20.0),
                key({"graphs": False}, {"decode_attention": "triton_a"}): passed(5.0)}
    ws, state, judged = run_loop(tmp_path, BuiltinProposer("cuda"), verdicts, device="cuda", monkeypatch=monkeypatch)
    keys = [k for k, _ in judged]
    assert len(keys) == len(set(keys))
    # decode attention first (search.WALK_ORDER), then the rest, each on the best plan so far
    assert keys[:7] == [CONSERVATIVE, key(), key(s={"decode_attention": "triton_a"}),
                    key(s={"decode_attention": "triton_b"}), key(s={"decode_attention": "triton_a", "norm": "triton_bad"}),
                    key({"block_size": 32}, {"decode_attention": "triton_a"}),
                    key({"graphs": False, "block_size": 32}, {"decode_attention": "triton_a"})]
    assert installed_key(ws) == key({"block_size": 32}, {"decode_attention": "triton_a"})
    # the best changed during the walk: it starts over from it, skipping what was judged
    again = [Plan.from_dict(json.loads(k)) for k in keys[7:]]
    assert again and all(p.params["block_size"] == 32 for p in again)


def test_builtin_walk_on_cpu_skips_cuda_variants_and_params(tmp_path, monkeypatch):
    _fake_menu(monkeypatch)
    ws, state, judged = run_loop(tmp_path, BuiltinProposer("cpu"), {}, device="cpu", monkeypatch=monkeypatch)
    plans = [Plan.from_dict(json.loads(k)) for k, _ in judged]
    assert [(p.engine, p.slots.get("decode_attention"), p.params) for p in plans] == [
        ("recompute", None, {}), ("paged", "torch", {"block_size": 16, "graphs": True}),
        ("paged", "cpu_only", {"block_size": 16, "graphs": True}), ("paged", "torch", {"block_size": 32, "graphs": True})]


def test_builtin_proposer_on_the_real_menu_never_repeats():
    state = SearchState(spec=None, device="cpu", hardware={})
    proposer = BuiltinProposer("cpu")
    while (candidate := proposer.propose(state)) is not None:
        assert not state.tried(candidate)
        state.history.append((candidate, failed()))
    assert len(state.history) >= 1 and state.history[0][0].plan.engine == "paged"


def test_builtin_walk_starts_from_the_library_plan_where_it_runs(monkeypatch):
    """Where the preferred variants run, the first proposal is all of them at once and the
    all-torch engine comes only when no library plan was kept; on a device where none runs, the
    all-torch engine comes first and there is no jump."""
    import agent.providers.builtin as builtin
    from agent import search
    preferred = next(iter(search.PREFERRED.items()))
    slot, name = preferred
    fake = {slot: [Variant(slot, "torch", ("cpu", "cuda"), None), Variant(slot, name, ("cuda",), None)]}
    monkeypatch.setattr(builtin, "menu", lambda: fake)
    monkeypatch.setattr(builtin, "engine_params", lambda engine: {})
    monkeypatch.setattr(builtin, "engines", lambda: ["paged", "recompute"])
    for device, first_variant, second_variant in (("cuda", name, "torch"), ("cpu", "torch", None)):
        state = SearchState(spec=None, device=device, hardware={})
        proposer = BuiltinProposer(device)
        first = proposer.propose(state)
        state.history.append((first, failed()))
        second = proposer.propose(state)
        assert first.plan.slots[slot] == first_variant
        assert (second.plan.slots[slot] if second else None) == second_variant


def test_builtin_walk_falls_back_to_the_faithful_library_plan_only_when_the_library_plan_is_not_kept(monkeypatch):
    """A library plan that fails, or passes too close to the tolerance, is followed by the same
    plan with the attention variants that round like the reference; a kept one is not (the walk
    goes on slot by slot from it)."""
    import agent.providers.builtin as builtin
    from agent import search
    attention = ("decode_attention", "prefill_attention")
    fake = {slot: [Variant(slot, name, ("cpu", "cuda") if name == "torch" else ("cuda",), None)
                   for name in ("torch", search.PREFERRED[slot], search.FAITHFUL[slot])] for slot in attention}
    monkeypatch.setattr(builtin, "menu", lambda: fake)
    monkeypatch.setattr(builtin, "engine_params", lambda engine: {})
    monkeypatch.setattr(builtin, "engines", lambda: ["paged", "recompute"])
    faithful = {slot: search.FAITHFUL[slot] for slot in attention}
    thin = with_margin(passed(50.0), public=0.9, stress=MIN_SAFETY_MARGIN - 0.1)
    for library_verdict, expect_faithful in ((failed(), True), (thin, True), (passed(50.0), False)):
        state = SearchState(spec=None, device="cuda", hardware={})
        proposer = BuiltinProposer("cuda")
        candidate = proposer.propose(state)
        state.history.append((candidate, library_verdict))
        if improves(library_verdict, state.best_result):   # as the loop keeps its best
            state.best, state.best_result = candidate, library_verdict
        library, after = candidate.plan, proposer.propose(state).plan
        assert {slot: library.slots[slot] for slot in attention} == {s: search.PREFERRED[s] for s in attention}
        assert ({slot: after.slots[slot] for slot in attention} == faithful) == expect_faithful, after.slots


def test_the_final_adds_the_stress_to_the_screens_timing_and_times_nothing_twice(tmp_path, monkeypatch):
    """A finalist's verdict joins its FINAL (stress, no benchmark) to its screen (the benchmark):
    the engine installed carries the screen's score and the final's stress, and no phase but
    TIMING times an engine."""
    a = Plan("paged")
    calls = []
    challenger = with_margin(passed(5.0), 1.0, 0.9)
    ws, state, _ = run_loop(tmp_path, ListProposer([a]), {CONSERVATIVE: passed(1.0), a.key(): challenger},
                            monkeypatch=monkeypatch, calls=calls)
    assert [(phase, out) for key, phase, out in calls if key == a.key()] == [(loop.TIMING, "timing"), (loop.FINAL, "002-paged")]
    installed = ws.installed_verdict()["result"]
    assert installed["score"] == 5.0 and installed["stress"]["target_margin"] == 0.9
    assert [c["case_name"] for c in installed["benchmark"]] == list(CASES)
    log = (ws.root / "results.log").read_text()
    assert "judge time: screen 1s, final 1s" in log and "candidates judged per minute" in log


def stalled(score: float, slow: dict[str, float]) -> EvalResult:
    """passed(score) with the named cases `slow` times slower, as a stall of the machine leaves a run."""
    result = passed(score)
    result.benchmark = [{**c, "tokens_per_second": c["tokens_per_second"] / slow.get(c["case_name"], 1.0)}
                        for c in result.benchmark]
    return result


@pytest.mark.parametrize("again, installed", [(1.2, True), (0.6, False)])
def test_a_screen_stalled_in_some_cases_is_timed_again_and_decided_on_each_cases_faster_run(tmp_path, monkeypatch,
                                                                                             again, installed):
    """A challenger 1.2x the best whose screen ran two cases 3x slow (below SCREEN_KEEP, but faster
    in one case) is timed once more; on each case's faster run it is a clear win and installed.
    One whose second run is slow across the board stays screened out, and says it was timed twice."""
    a, b = Plan("paged"), Plan("paged", {"norm": "triton"})
    calls = []
    screen = stalled(6.0, {"prefill": 3.0, "mixed": 3.0})
    ws, state, _ = run_loop(tmp_path, ListProposer([a, b]), {CONSERVATIVE: passed(1.0), a.key(): passed(5.0),
                                                             b.key(): screen},
                            monkeypatch=monkeypatch, calls=calls, agains={b.key(): passed(again * 5.0)})
    assert [(phase, out) for key, phase, out in calls if key == b.key()][:2] == \
        [(loop.TIMING, "timing"), (loop.TIMING, acceptance.SCREEN_AGAIN)]
    log = (ws.root / "results.log").read_text()
    assert "screen again: PASSED" in log
    if installed:
        assert installed_key(ws) == b.key() and "120% of best on the screen, every case at least" in log
        assert ws.installed_verdict()["result"]["benchmark"][1]["tokens_per_second"] == 6000.0   # each case's faster run
    else:
        assert installed_key(ws) == a.key() and "screened out: " in log and "the faster of two runs a case" in log


def test_a_screen_slower_in_every_case_is_not_timed_again(tmp_path, monkeypatch):
    a, b = Plan("paged"), Plan("paged", {"norm": "triton"})
    calls = []
    ws, _, _ = run_loop(tmp_path, ListProposer([a, b]), {CONSERVATIVE: passed(1.0), a.key(): passed(5.0),
                                                          b.key(): passed(3.0)},
                        monkeypatch=monkeypatch, calls=calls, agains={b.key(): passed(50.0)})
    assert [out for key, _, out in calls if key == b.key()] == ["timing"]
    assert "screened out: 60% of best" in (ws.root / "results.log").read_text()


@pytest.mark.parametrize("budget, cut", [(60.0, True), (600.0, False)])
def test_a_verdict_killed_when_the_budget_runs_out_is_not_the_engines_timeout(tmp_path, monkeypatch, budget, cut):
    """A screen killed at a timeout that was the rest of the run's budget says the budget ran out
    ("not judged"), and its proposer is not told of it; one killed at the hang limit, the budget
    to spare, stays the engine's timeout."""
    a, b = Plan("paged"), Plan("paged", {"norm": "triton"})
    killed = EvalResult.failure("unknown", "timeout", "no verdict in time; evaluator killed", "cpu", 50.0)
    proposer = ListProposer([a, b])
    slow = {CONSERVATIVE: passed(1.0, seconds=80.0), a.key(): passed(5.0)}   # a pass took longer than the 55 s left
    ws, state, _ = run_loop(tmp_path, proposer, {**slow, b.key(): killed}, budget=budget, monkeypatch=monkeypatch)
    result = state.history[-1][1]
    log = (ws.root / "results.log").read_text()
    assert (result.error_kind == DEADLINE) == cut and installed_key(ws) == a.key()
    assert ("NOT JUDGED: the run's budget ran out" in log) == cut and ("not judged" in log.split("summary")[1]) == cut
    assert [k for k, _ in proposer.feedback_seen] == ([a.key()] if cut else [a.key(), b.key()])


@pytest.mark.parametrize("device, installed", [("cuda", False), ("cpu", True)])
def test_a_first_final_on_a_gpu_is_expected_to_take_longer_than_a_screen(tmp_path, monkeypatch, device, installed):
    """No final judged yet: on a GPU a final (stress suite and the full timing) is expected to take
    FIRST_FINAL_FACTOR times the quickest screen, so a clear winner with less left is not started
    into a cut final; on a CPU (the final times nothing) the quickest pass stands."""
    from types import SimpleNamespace
    monkeypatch.setattr(loop, "time", SimpleNamespace(monotonic=lambda: 1000.0))
    a = Plan("paged")
    left = 60.0   # above a's 30 s screen, below 2.5 times it
    ws, _, _ = run_loop(tmp_path, ListProposer([a]), {CONSERVATIVE: passed(1.0), a.key(): passed(5.0, 30.0)},
                        budget=loop.RESERVE_SECONDS + left, device=device, monkeypatch=monkeypatch)
    log = (ws.root / "results.log").read_text()
    assert (installed_key(ws) == a.key()) == installed
    assert ("NOT INSTALLED: won its contest, but its final (the stress suite) cannot fit the 60s" in log) != installed
    if not installed:
        assert f"a final takes ~{30 * loop.FIRST_FINAL_FACTOR['cuda']:.0f}s" in log


def test_the_conservative_stress_is_skipped_when_a_challenger_replaces_it(tmp_path, monkeypatch):
    a = Plan("paged")
    calls = []
    ws, state, _ = run_loop(tmp_path, ListProposer([a]), {CONSERVATIVE: passed(1.0), a.key(): passed(5.0)},
                            monkeypatch=monkeypatch, calls=calls)
    assert [phase for key, phase, _ in calls if key == CONSERVATIVE] == [loop.VERIFY]
    assert installed_key(ws) == a.key()
    first = state.history[0][1]
    assert first.unstressed and first.error is None   # the table says it was not judged in full
    assert "unstressed" in (ws.root / "results.log").read_text().split("summary")[1]


@pytest.mark.parametrize("challenger", ["fails", "none"])
def test_the_conservative_that_stays_the_result_is_judged_in_full(tmp_path, monkeypatch, challenger):
    """Its stress suite comes after the first challenger that did not replace it, or at the run's
    end, and the verdict installed joins it to the conservative engine's timing."""
    plans = [Plan("paged")] if challenger == "fails" else []
    calls = []
    conservative = with_margin(passed(1.0), 1.0, 1.0)
    ws, state, _ = run_loop(tmp_path, ListProposer(plans), {CONSERVATIVE: conservative},
                            monkeypatch=monkeypatch, calls=calls)
    assert [phase for key, phase, _ in calls if key == CONSERVATIVE] == [loop.VERIFY, loop.STRESS]
    assert [key for key, _, _ in calls][-1] == CONSERVATIVE   # after the challenger's verdict
    installed = ws.installed_verdict()["result"]
    assert installed["status"] == "passed" and installed["score"] == 1.0 and installed["stress"] is not None
    assert installed["error"] is None and not installed["unstressed"] and state.best_result.stress is not None
    assert [c["case_name"] for c in installed["benchmark"]] == [CONSERVATIVE_CASE]   # not timed again
    assert installed["note"] == f"the conservative engine, timed on {CONSERVATIVE_CASE} only"
    assert json.loads((ws.root / "results.json").read_text())["candidates"][0]["result"]["stress"] is not None


@pytest.mark.parametrize("kind, said", [("wrong_result", "its stress suite did not pass"),
                                        ("timeout", "its stress suite did not finish in the")])
def test_a_conservative_that_fails_its_stress_stays_installed_ranked_0_and_says_so(tmp_path, monkeypatch, kind, said):
    ws, state, _ = run_loop(tmp_path, ListProposer([]), {CONSERVATIVE: passed(1.0)}, monkeypatch=monkeypatch,
                            stress=failed(kind))
    first = state.history[0][1]
    assert first.rank() == 0.0 and f"stress {kind}" in first.note and not first.unstressed
    assert installed_key(ws) == CONSERVATIVE and f"stress {kind}" in ws.installed_verdict()["result"]["note"]
    assert said in (ws.root / "results.log").read_text()


def test_a_hang_given_longer_than_any_pass_stays_a_timeout_and_a_cut_conservative_stress_stays_unstressed(
        tmp_path, monkeypatch):
    """Killed at the budget's end after longer than the slowest pass took, a verdict is the
    engine's timeout (a hang: --resume must not give it the budget again). The conservative
    engine's stress cut by the budget before it could have finished leaves it unstressed, to be
    run by --resume, not ranked 0."""
    a = Plan("paged")
    killed = EvalResult.failure("unknown", "timeout", "no verdict in time; evaluator killed", "cpu", 50.0)
    ws, state, _ = run_loop(tmp_path, ListProposer([a]), {CONSERVATIVE: passed(1.0, seconds=5.0), a.key(): killed},
                            budget=60.0, monkeypatch=monkeypatch)
    assert state.history[1][1].error_kind == "timeout"
    cut = EvalResult.failure("stress", "timeout", "no verdict in time; evaluator killed", "cpu", 50.0)
    ws, state, _ = run_loop(tmp_path / "second", ListProposer([]), {CONSERVATIVE: passed(1.0, seconds=700.0)},
                            monkeypatch=monkeypatch, stress=cut)
    first = state.history[0][1]
    assert first.unstressed and first.rank() == 1.0 and installed_key(ws) == CONSERVATIVE
    assert "stays the result without its stress suite: the budget ran out" in (ws.root / "results.log").read_text()


def test_no_conservative_stress_is_started_that_the_budget_cannot_fit(tmp_path, monkeypatch):
    """Seen on the H100: with 1 s left the stress was started, timed out, and the log called the
    conservative engine's stress failed. Now it is not started, and the verdict stays unstressed."""
    calls = []
    budget = loop.RESERVE_SECONDS + loop.MIN_EVAL_SECONDS - 1   # the verify fits (the first is always judged)
    ws, state, _ = run_loop(tmp_path, ListProposer([]), {CONSERVATIVE: passed(1.0)}, budget=budget,
                            monkeypatch=monkeypatch, calls=calls)
    assert [phase for _, phase, _ in calls] == [loop.VERIFY]
    first = state.history[0][1]
    assert first.passed and first.unstressed and first.rank() == 1.0 and installed_key(ws) == CONSERVATIVE
    assert (ws.root / "results.log").read_text().count("stays the result without its stress suite") == 1


def test_max_candidates_1_still_judges_the_conservative_in_full(tmp_path, monkeypatch):
    calls = []
    run_loop(tmp_path, ListProposer([Plan("paged")]), {CONSERVATIVE: passed(1.0)}, monkeypatch=monkeypatch,
             calls=calls, max_candidates=1)
    assert [phase for _, phase, _ in calls] == [loop.VERIFY, loop.STRESS]


def test_a_contest_times_through_the_series_in_its_order_and_closes_it(tmp_path, monkeypatch):
    """The repeated timings go to the series (agent/judge.py Series: one evaluator for all of
    them), asked in acceptance.order(), while no unit check of model code runs (agent/providers/
    proposals.py UNIT_CHECKS: its code could slow one side); once the contest decides, the series
    is closed."""
    a = Plan("paged")
    made = []

    class FakeSeries:
        def __init__(self, timings, folder):
            self.timings, self.folder, self.asked, self.closed = timings, folder, [], False
            made.append(self)

        def result(self, label, timeout):
            assert not self.closed and UNIT_CHECKS.timings == 1   # no unit check of model code beside it
            self.asked.append(label)
            return passed(1.05 if dict(self.timings)[label].parent.name.startswith("002") else 1.0)

        def close(self):
            self.closed = True
    calls = []
    ws, _, _ = run_loop(tmp_path, ListProposer([a]), {CONSERVATIVE: passed(1.0), a.key(): passed(1.05)},
                        monkeypatch=monkeypatch, series=FakeSeries, calls=calls)
    (series,) = made
    assert [label for label, _ in series.timings] == [label for label, _ in acceptance.order()]
    assert [path.parent.name for _, path in series.timings] == \
        ["002-paged" if mine else "001-recompute" for _, mine in acceptance.order()]
    assert series.asked == ["incumbent-1", "incumbent-2", "challenger-2"] and series.closed   # 6/6 faster: decided
    assert series.folder.name == "002-paged" and installed_key(ws) == a.key()
    assert not [c for c in calls if c[2].startswith(("incumbent", "challenger"))]   # none through the judge
    assert "repeated timing 3x" in (ws.root / "results.log").read_text()


def test_a_verdict_line_says_where_the_evaluators_time_went():
    from agent.report import verdict_line
    r = passed(1.0, seconds=9.6)
    r.stage_seconds = {"judge start": 2.54, "setup": 0.002, "worker": 2.6, "benchmark": 3.8}
    assert verdict_line(r).endswith("[9.6s; judge start 2.5, worker 2.6, benchmark 3.8]")
    assert verdict_line(passed(1.0, seconds=9.6)).endswith("[9.6s]")
    r.triton_compiled = 12                          # on CUDA: the kernels its worker compiled
    assert verdict_line(r).endswith("[9.6s; judge start 2.5, worker 2.6, benchmark 3.8; 12 kernels compiled]")


class SlowSeries:
    """The repeated timings of the candidate in folder `SLOW` take 60 s of `CLOCK` each (others'
    none); the challenger is 5% faster."""
    CLOCK = [1000.0]
    SLOW = "002"

    def __init__(self, timings, folder):
        self.timings, self.challenger, self.slow = dict(timings), folder, folder.name.startswith(self.SLOW)

    def result(self, label, timeout):
        self.CLOCK[0] += 60.0 if self.slow else 0.0
        return passed(1.05 if self.timings[label].parent == self.challenger else 1.0)

    def close(self):
        pass


def slow_series(monkeypatch, slow: str) -> type:
    clock = [1000.0]
    monkeypatch.setattr(loop, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    return type("Slow", (SlowSeries,), {"CLOCK": clock, "SLOW": slow})


def test_a_winner_whose_final_cannot_fit_the_budget_is_not_started_and_says_why(tmp_path, monkeypatch):
    """Seen on the H100: a challenger won its contest with 14 s of the budget left, its final
    (the stress suite, ~80 s) was started and killed at the deadline, and the log called it a
    timeout at stage unknown. Now the final is not started, and the log says why the best stays."""
    a = Plan("paged", params={"x": 0})
    calls = []
    verdicts = {CONSERVATIVE: passed(1.0), a.key(): passed(1.05, 50.0)}
    # on a GPU a first final is expected to take FIRST_FINAL_FACTOR (2.5) screens: 125 s
    ws, state, _ = run_loop(tmp_path, ListProposer([a]), verdicts, budget=loop.RESERVE_SECONDS + 260, device="cuda",
                            monkeypatch=monkeypatch, series=slow_series(monkeypatch, "002"), calls=calls)
    phases = [(key, phase) for key, phase, _ in calls]
    assert (a.key(), loop.TIMING) in phases and (a.key(), loop.FINAL) not in phases
    assert installed_key(ws) == CONSERVATIVE
    log = (ws.root / "results.log").read_text()
    assert "NOT INSTALLED: won its contest, but its final (the stress suite) cannot fit the 80s" in log
    assert "a final takes ~125s" in log and "timeout" not in log
    # not a verdict on a: a resumed run judges it again (agent/resume.py), as one the deadline killed
    assert state.history[-1][0].plan == a and state.history[-1][1].unfinished


def three_winners(tmp_path, monkeypatch, c_score: float, budget: float, slow: str):
    """a beats the conservative engine (its final at once), b beats a, then c (`c_score`); the
    repeated timings of the candidate in folder `slow` take 60 s each; `budget` past the reserve.
    The three plans, the workspace, the state, and every (plan key, phase) the judge was asked."""
    a, b, c = (Plan("paged", params={"x": i}) for i in range(3))
    calls = []
    verdicts = {CONSERVATIVE: passed(0.5), a.key(): passed(1.0, 50.0), b.key(): passed(1.05, 50.0),
                c.key(): passed(c_score, 50.0)}
    ws, state, _ = run_loop(tmp_path, ListProposer([a, b, c]), verdicts, budget=loop.RESERVE_SECONDS + budget,
                            monkeypatch=monkeypatch, series=slow_series(monkeypatch, slow), calls=calls)
    return a, b, c, ws, state, [(key, phase) for key, phase, _ in calls]


def test_a_long_contest_cannot_take_the_time_the_best_needs_for_its_final(tmp_path, monkeypatch):
    """The search's best (b) won its contest and waits for its final; the next challenger's
    contest is slow (60 s a timing): its timings stop where going on would leave the best's final
    no time, and the best's final runs and installs it. (a, the first to beat the conservative
    engine, has its final at once.)"""
    a, b, c, ws, state, phases = three_winners(tmp_path, monkeypatch, c_score=1.1, budget=200, slow="004")
    assert [key for key, phase in phases if phase == loop.FINAL] == [a.key(), b.key()] and installed_key(ws) == b.key()
    assert (c.key(), loop.TIMING) in phases and state.history[3][1].unfinished


def test_the_best_s_final_runs_before_a_candidate_that_would_leave_it_no_time(tmp_path, monkeypatch):
    """b won a slow contest (60 s a timing) and waits for its final; with what is left, one more
    candidate and b's final would not both fit: b's final runs first, then c is judged."""
    a, b, c, ws, state, phases = three_winners(tmp_path, monkeypatch, c_score=1.0, budget=260, slow="003")
    assert phases.index((b.key(), loop.FINAL)) < phases.index((c.key(), loop.TIMING))
    assert installed_key(ws) == b.key()
    log = (ws.root / "results.log").read_text()
    assert log.index("the final it won in its contest") < log.index("#004")


def test_a_run_whose_budget_ended_before_any_verdict_says_so(tmp_path):
    """`--budget 20` ended with "verify: FAILED at unknown (timeout)" and "no candidate passed",
    which read as a broken engine (a new-user walkthrough): the closing line names the budget."""
    from types import SimpleNamespace

    from agent import cli
    from agent.workspace import Workspace
    ws = Workspace(tmp_path)
    ws.reset()
    cfg = SimpleNamespace(budget=20.0)
    timed_out = SimpleNamespace(result=EvalResult(status="failed", stage="unknown", error_kind="timeout"))
    wrong = SimpleNamespace(result=EvalResult(status="failed", stage="public", error_kind="wrong_result"))
    assert "the budget (20 s) ended before a verdict did" in cli.closing_lines(ws, [timed_out], cfg)[0]
    assert "the budget" not in cli.closing_lines(ws, [timed_out, wrong], cfg)[0]
    # Ctrl-C before the first verdict had also blamed the budget (a new-user walkthrough)
    stopped = SimpleNamespace(result=None)
    line = cli.closing_lines(ws, [stopped], cfg, interrupted=True)[0]
    assert "interrupted" in line and "the budget" not in line
    assert line.endswith(f"{ws.engine} was not written")   # the run's workspace, not always workspace/


def test_the_self_test_commands_the_run_prints_work_from_any_folder(tmp_path):
    """results.log's re-run commands named `evaluator/...` relative to the repository, and failed
    from any other folder (a new-user sweep): each now names its script by absolute path."""
    import shlex
    from types import SimpleNamespace

    from agent import cli
    cfg = SimpleNamespace(workspace=tmp_path / "ws", config=tmp_path / "m" / "config.json",
                          weights=tmp_path / "m" / "weights", device="cpu")
    for command in cli.selftest_commands(cfg):
        script = Path(shlex.split(command)[1])
        assert script.is_absolute() and script.is_file(), command


def test_the_self_test_commands_name_the_interpreter_that_ran(tmp_path, monkeypatch):
    """`python3` only where PATH's python3 is the running one (a venv's bin): with PYTHON=... or
    .venv/bin/python the python3 on PATH may lack torch, so the commands name this interpreter."""
    import shlex
    from types import SimpleNamespace

    from agent import cli
    cfg = SimpleNamespace(workspace=tmp_path / "ws", config=tmp_path / "c.json", weights=tmp_path / "w", device="cpu")
    monkeypatch.setattr(cli.sys, "executable", "/opt/venv/bin/python")
    monkeypatch.setattr(cli.shutil, "which", lambda name: "/usr/bin/python3")
    assert {shlex.split(c)[0] for c in cli.selftest_commands(cfg)} == {"/opt/venv/bin/python"}
    monkeypatch.setattr(cli.shutil, "which", lambda name: "/opt/venv/bin/python3")
    assert {shlex.split(c)[0] for c in cli.selftest_commands(cfg)} == {"python3"}
