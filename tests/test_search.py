"""The search loop of issue 23, offline: parallel model requests (their timestamps overlap), a bad
model leaves a run no worse than the builtin alone, the archive lets the builtin walk build on a
model-written variant, --resume restores the archive, and the acceptance rule (back-to-back
timings, a sign test) accepts a clearly faster challenger and rejects one within noise. The judge
is faked throughout (deterministic timings); the model is the scripted HTTP server of
tests/test_providers.py behind the real SDK clients."""
from __future__ import annotations

import json
import math
import random
import re
import time
from pathlib import Path

import pytest

from agent import acceptance, loop, resume
from agent.archive import Archive
from agent.judge import FINAL
from agent.plan import Plan
from agent.providers import ProviderOptions, make_proposer
from agent.providers.builtin import BuiltinProposer
from agent.records import Candidate, EvalResult, SearchState
from agent.report import Reporter
from agent.spec import spec_from_config
from agent.workspace import RESULTS_JSON, RESULTS_LOG, Workspace
from tests.test_providers import CONFIG, KEYS, ScriptedServer, answer, fake_judge, point_at

CASES = ("prefill", "decode", "mixed")
FINAL_WAIT_S = 60.0   # a bound for the failing case only: a request arrives in well under a second


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for key in KEYS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("LLM_RETRY_DELAY_S", "0.01")
    monkeypatch.setenv("LLM_KERNELS_ON_CPU", "1")


class TimedServer(ScriptedServer):
    """Answers every kernel request with the fixture named `reply`, written for the variant the
    request asks for (requests in flight at once take episodes in any order), after `sleep` s."""

    def __init__(self, protocol: str, reply: str, sleep: float, n: int):
        super().__init__(protocol, [{"sleep": sleep, "text": ""}] * n)
        self.reply = reply

    def respond(self, step: dict, body: dict):
        text = json.dumps(body.get("messages"))
        variant = (re.findall(r"__(llm_\d+)", text) or ["llm_0"])[0]
        return super().respond({**step, "text": answer(self.reply, variant)}, body)


def run(workspace: Path, provider: str, parallel: int, judge=fake_judge, budget: float = 600.0):
    ws = Workspace(workspace)
    ws.reset()
    report = Reporter(ws.root, live=False)
    ws.open_history(warn=report.warn)
    spec = spec_from_config(json.loads(CONFIG.read_text()), CONFIG, workspace / "weights")
    state = SearchState(spec=spec, device="cpu", hardware={"device": "cpu"})
    proposer = make_proposer(provider, ProviderOptions("cpu", 0, ws.root, BuiltinProposer("cpu")), report.warn)
    loop.run(state, proposer, judge, ws, report, budget, parallel=parallel)
    report.finish([])
    return ws, state, (ws.root / RESULTS_LOG).read_text(), json.loads((ws.root / RESULTS_JSON).read_text())


def test_model_requests_overlap_in_time_and_the_log_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_MAX_CALLS", "6")
    with TimedServer("openai", "05_correct_faster", sleep=1.0, n=6) as server:
        point_at(monkeypatch, "openai", server.url)
        ws, state, log, _ = run(tmp_path / "ws", "openai", parallel=3)
    spans = sorted(server.spans)
    overlaps = sum(1 for (s1, e1), (s2, _) in zip(spans, spans[1:]) if s2 < e1)
    assert len(spans) >= 3 and overlaps >= 2 and server.max_in_flight >= 2, spans
    assert "model episodes in flight" in log and "candidates judged per minute" in log
    assert state.best_result.passed


@pytest.mark.parametrize("failure", ["slow", "wrong", "hostile", "truncated", "rate_limited"])
def test_a_bad_model_leaves_a_run_no_worse_than_the_builtin_alone(tmp_path, monkeypatch, failure):
    monkeypatch.setenv("LLM_MAX_CALLS", "8")
    monkeypatch.setenv("LLM_TIMEOUT_S", "0.5")
    monkeypatch.setenv("LLM_RETRIES", "1")
    _, alone, _, alone_results = run(tmp_path / "alone", "builtin", parallel=1)
    step = {"slow": {"sleep": 2.0, "text": "late"}, "wrong": {"text": answer("02_unit_check_fails", "llm_1")},
            "hostile": {"text": answer("03_policy_violation", "llm_1")},
            "truncated": {"text": answer("05_correct_faster", "llm_1")[:120]},
            "rate_limited": {"status": 429, "retry_after": "0"}}[failure]
    with ScriptedServer("openai", [step] * 8) as server:
        point_at(monkeypatch, "openai", server.url)
        ws, state, log, results = run(tmp_path / "ws", "openai", parallel=3)
    assert state.best_result.rank() >= alone.best_result.rank()
    builtin_plans = {json.dumps(c["plan"], sort_keys=True) for c in alone_results["candidates"]}
    judged = {json.dumps(c["plan"], sort_keys=True) for c in results["candidates"]}
    assert builtin_plans <= judged   # the builtin walk went on beside the model, all of it
    assert ws.installed_verdict() is not None


def test_the_model_builds_on_a_screened_engine_while_its_final_verdict_is_awaited(tmp_path, monkeypatch):
    """On a CPU the KV-cache engine's first final (the stress suite) can take most of a short
    budget: the model is asked during it, building on the screened engine, not after it."""
    monkeypatch.setenv("LLM_MAX_CALLS", "2")
    finals = []

    def judge(engine, out, timeout, phase="full"):
        if phase == FINAL and not finals:   # the first final waits for a request, a minute at most
            waited = time.monotonic()
            while not server.requests and time.monotonic() - waited < FINAL_WAIT_S:
                time.sleep(0.05)
            finals.append(time.monotonic())
        return fake_judge(engine, out, timeout, phase)
    with ScriptedServer("openai", [{"text": "no code in this answer"}] * 2) as server:
        point_at(monkeypatch, "openai", server.url)
        _, state, log, _ = run(tmp_path / "ws", "openai", parallel=2, judge=judge)
    assert finals and server.requests and server.requests[0]["arrival"] < finals[0]
    assert state.best_result.passed


def member(plan: Plan, score: float, extra=None, parent=None, origin="builtin"):
    result = EvalResult(status="passed", stage="done", device="cpu", score=score,
                        benchmark=[{"case_name": c, "tokens_per_second": 100 * score} for c in CASES])
    return Candidate(plan, origin, "test", extra or {}, parent), result


def test_the_builtin_walk_tunes_an_engine_that_holds_a_model_variant(monkeypatch):
    from tests.test_loop import _fake_menu
    _fake_menu(monkeypatch)
    paged = Plan("paged", {s: "torch" for s in ("norm", "rope_cache", "prefill_attention", "decode_attention",
                                                  "silu_mul", "linear")}, {"block_size": 16, "graphs": True})
    text = f"def silu_mul__llm_1(x):\n    return x  # {random.random()}\n"
    model = Plan(paged.engine, {**paged.slots, "silu_mul": "llm_1"}, paged.params)
    state = SearchState(spec=None, device="cuda", hardware={})
    state.history = [member(Plan("recompute"), 0.01), member(paged, 1.0),
                     member(model, 2.0, {("silu_mul", "llm_1"): text}, parent=2, origin="openai:m")]
    state.best, state.best_result = state.history[2]
    proposer, seen = BuiltinProposer("cuda"), []
    while (candidate := proposer.propose(state)) is not None:
        seen.append(candidate)
        state.history.append((candidate, EvalResult.failure("public", "wrong_result", "x", "cuda")))
    tuned = [c for c in seen if c.plan.params != paged.params]
    assert tuned and all(c.plan.slots["silu_mul"] == "llm_1" for c in tuned)
    assert all(c.extra_variants == {("silu_mul", "llm_1"): text} and c.parent == 3 for c in tuned)


def test_parents_are_chosen_by_score_with_room_for_exploration():
    base = Plan("paged", {}, {"x": 0})
    history = [member(Plan("recompute"), 0.01), member(base, 1.0), member(Plan("paged", {}, {"x": 1}), 0.9)]
    archive = Archive(history)
    assert archive.choose_parent().index == 2                      # the best first
    history += [member(Plan("paged", {}, {"x": i}), 0.5, parent=2) for i in range(2, 6)]
    assert Archive(history).choose_parent().index == 3             # the best has had its children


def test_a_new_best_from_another_branch_is_merged_with_the_best_it_replaced():
    """#3 won a prefill attention on #2; #4, built on #2 too, won a decode attention and replaced
    #3: the merge (#4 with #3's prefill, its text carried) is the next candidate judged, and only
    where the branches changed different slots."""
    from agent.pipeline import Pipeline
    torch_slots = {"prefill_attention": "torch", "decode_attention": "torch", "norm": "torch"}
    prefill, decode = "def prefill_attention__llm_1(): pass\n", "def decode_attention__llm_2(): pass\n"
    history = [member(Plan("recompute"), 0.01), member(Plan("paged", torch_slots), 1.0),
               member(Plan("paged", {**torch_slots, "prefill_attention": "llm_1"}), 2.0,
                      {("prefill_attention", "llm_1"): prefill}, parent=2, origin="openai:m"),
               member(Plan("paged", {**torch_slots, "decode_attention": "llm_2"}, {"block_size": 32}), 3.0,
                      {("decode_attention", "llm_2"): decode}, parent=2, origin="openai:m")]
    merged = Archive(history).merge(3, 4)
    assert merged.plan == Plan("paged", {**torch_slots, "prefill_attention": "llm_1", "decode_attention": "llm_2"},
                               {"block_size": 32})
    assert merged.extra_variants == {("prefill_attention", "llm_1"): prefill, ("decode_attention", "llm_2"): decode}
    assert merged.parent == 4 and "merge: #003's prefill_attention=llm_1 onto #004" in merged.note
    assert Archive(history).merge(2, 3) is None                     # built on the best it replaced
    same_slot = history[:3] + [member(Plan("paged", {**torch_slots, "prefill_attention": "llm_2"}), 3.0, parent=2)]
    assert Archive(same_slot).merge(3, 4) is None                   # both changed the same slot: nothing to add
    # #5 built on #3 (a descendant of the best it replaces, #2 here): its parent's changes are in already
    descendant = history[:4] + [member(Plan("paged", {**torch_slots, "prefill_attention": "llm_1", "norm": "triton"}),
                                       4.0, parent=3)]
    assert Archive(descendant).merge(2, 5) is None
    # #5 built on #4 replaces #3: only #3's change since their common ancestor #2 comes over, not #4's undone
    cousin = history[:4] + [member(Plan("paged", {**torch_slots, "decode_attention": "llm_2", "norm": "triton"}),
                                   4.0, {("decode_attention", "llm_2"): decode}, parent=4)]
    assert Archive(cousin).merge(3, 5).plan.slots == {"prefill_attention": "llm_1", "decode_attention": "llm_2",
                                                      "norm": "triton"}
    # #3 won its contest but failed its deferred final (agent/loop.py settle_final): its change is no ground to keep
    failed_final = [*history[:2], (history[2][0], EvalResult.failure("stress", "mismatch", "long prompt", "cpu")),
                    history[3]]
    assert Archive(failed_final).merge(3, 4) is None

    state = SearchState(spec=None, device="cpu", hardware={}, history=history[:3], best=history[2][0],
                        best_result=history[2][1])
    lines: list[str] = []
    from tests.test_loop import ListProposer
    pipeline = Pipeline(ListProposer([]), state, 1, time.monotonic() + 60, lines.append)
    state.history.append(history[3])
    state.best, state.best_result = history[3]
    pipeline.feedback(*history[3])
    assert pipeline.next() == merged and any("next: merge: #003's" in line for line in lines)


def test_resume_restores_the_archive(tmp_path, monkeypatch):
    monkeypatch.setattr(loop, "render_engine", lambda plan, extra=None, **kw: f"# {plan.key()} {sorted(extra or {})}\n")
    text = f"def silu_mul__llm_1(x):\n    return x  # {random.random()}\n"
    plans = [Plan("paged", {"silu_mul": "torch"}), Plan("paged", {"silu_mul": "llm_1"})]
    scores = {plans[0].key(): 1.0, plans[1].key(): 2.0, Plan("recompute").key(): 0.01}

    class Listed:
        name = "list"

        def __init__(self):
            self.todo = [Candidate(plans[0], "builtin", "a", parent=1),
                         Candidate(plans[1], "openai:m", "b", {("silu_mul", "llm_1"): text}, parent=2)]

        def propose(self, state):
            return self.todo.pop(0) if self.todo else None

        def feedback(self, candidate, result):
            pass

    def judge(engine, out, timeout, phase):
        plan = Plan.from_dict(json.loads((engine.parent / "plan.json").read_text())["plan"])
        return member(plan, scores[plan.key()])[1]
    ws = Workspace(tmp_path / "ws")
    ws.reset()
    report = Reporter(ws.root, live=False)
    state = SearchState(spec=None, device="cpu", hardware={})
    loop.run(state, Listed(), judge, ws, report, 600.0)
    report.finish([])
    previous = resume.load(ws, {"config": "c", "weights": "w", "device": "cpu"})
    restored = Archive([(e.candidate, e.result) for e in previous.entries])
    original = Archive(state.history)
    assert restored.variants() == original.variants() and restored.variants()[("silu_mul", "llm_1")].text == text
    assert [(m.index, m.candidate.parent, m.score) for m in restored.passing()] == \
           [(m.index, m.candidate.parent, m.score) for m in original.passing()]
    assert restored.choose_parent().index == original.choose_parent().index == 3


class OneModelCandidate:
    """A model side (agent/pipeline.py's interface) whose one episode yields `candidate`."""

    name = "model"
    active = True

    def __init__(self, candidate: Candidate):
        self.candidate, self.asked = candidate, 0
        from tests.test_loop import ListProposer
        self.fallback = ListProposer([])

    def ready(self, state):
        return True

    def ask(self, state):
        self.asked += 1
        return self.candidate if self.asked == 1 else None

    def paused(self, state):
        return False

    def feedback(self, candidate, result):
        pass


class PausedModel(OneModelCandidate):
    """A model side that paused itself (agent/providers/llm.py: episodes with nothing usable)."""

    def ready(self, state):
        return False

    def paused(self, state):
        return True


def test_the_run_ends_when_the_model_is_paused_and_nothing_else_can_wake_it(tmp_path):
    """The builtin walk has nothing left and the paused model has nothing in flight: only a faster
    engine would end the pause, and nothing is left to judge, so the pipeline ends at once instead
    of idling to the deadline."""
    from agent.pipeline import Pipeline
    base = member(Plan("paged", {"norm": "torch"}), 1.0)
    state = SearchState(spec=None, device="cpu", hardware={}, history=[base], best=base[0], best_result=base[1])
    model = PausedModel(Candidate(Plan("paged", {"norm": "llm_1"}), "openai:m", "model-written"))
    with Pipeline(model, state, 2, time.monotonic() + 60, lambda line: None) as pipeline:
        started = time.monotonic()
        assert pipeline.next() is None and time.monotonic() - started < 5
        assert model.asked == 0


def test_a_model_candidate_checked_but_not_judged_survives_a_resume(tmp_path, monkeypatch):
    """A run cut between a model candidate's checks and its verdict (the budget, a kill) loses
    nothing the model wrote: the pipeline keeps the waiting ones (in the queue, or the one being
    judged, also when the budget cut its verdict short) in waiting.json; a resumed run puts them
    back in the queue, judges them, and leaves out one judged already and one unreadable."""
    from agent.pipeline import Pipeline
    from agent.records import DEADLINE
    text = f"def norm__llm_3(x, w, eps):\n    return x  # {random.random()}\n"
    base = member(Plan("paged", {"norm": "torch"}), 1.0)
    waiting = Candidate(Plan("paged", {"norm": "llm_3"}), "openai:m", "model-written", {("norm", "llm_3"): text})
    ws = Workspace(tmp_path / "ws")
    ws.reset()
    state = SearchState(spec=None, device="cpu", hardware={}, history=[base], best=base[0], best_result=base[1])
    kept: list[list[Candidate]] = []
    pipeline = Pipeline(OneModelCandidate(waiting), state, 2, time.monotonic() + 60, lambda line: None, kept.append)
    deadline = time.monotonic() + FINAL_WAIT_S
    while not kept and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [c.key() for c in kept[-1]] == [waiting.key()]            # checked, in the queue
    taken = pipeline.next()
    assert taken.key() == waiting.key() and [c.key() for c in kept[-1]] == [waiting.key()]   # being judged
    cut = EvalResult.failure("benchmark", DEADLINE, "the run's budget ran out", "cpu")
    state.history.append((taken, cut))   # as the loop does, before the feedback and the next ask
    pipeline.feedback(taken, cut)
    assert [c.key() for c in kept[-1]] == [waiting.key()]            # its verdict was cut short: still waiting
    pipeline.close()
    while pipeline.workers:
        time.sleep(0.01)
    assert pipeline.next() is None and [c.key() for c in kept[-1]] == [waiting.key()]
    state.history.pop()

    # the interrupted run's record: the conservative engine and the base engine, judged
    monkeypatch.setattr(loop, "render_engine", lambda plan, extra=None, **kw: f"# {plan.key()} {sorted(extra or {})}\n")
    judged: list[str] = []

    def judge(engine, out, timeout, phase):
        plan = Plan.from_dict(json.loads((engine.parent / "plan.json").read_text())["plan"])
        judged.append(plan.key())
        return member(plan, {"recompute": 0.01}.get(plan.engine, 2.0 if plan.slots.get("norm") == "llm_3" else 1.0))[1]
    from tests.test_loop import ListProposer
    report = Reporter(ws.root, live=False)
    loop.run(SearchState(spec=None, device="cpu", hardware={}), ListProposer([base[0].plan]), judge, ws, report, 600.0)
    report.finish([])
    assert not (ws.root / "waiting.json").exists()   # the builtin walk alone: nothing waits, nothing written
    judged_before = Candidate(base[0].plan, "test", "listed")
    orphan = Candidate(Plan("paged", {"silu_mul": "llm_4"}), "openai:m", "built on a challenger the cut dropped",
                       {("silu_mul", "llm_4"): "def silu_mul__llm_4(x):\n    return x\n"}, parent=7)
    escaping = {**orphan.to_record(), "variant_texts": {"../../x/y": "text"}}
    ws.save_waiting([c.to_record() for c in kept[-1]] + [judged_before.to_record(), orphan.to_record(),
                                                          {"plan": "not a plan"}, escaping])

    previous = resume.load(ws, {"config": "c", "weights": "w", "device": "cpu"})
    assert [c.key() for c in previous.waiting] == [waiting.key(), orphan.key()] and previous.unreadable_waiting == 2
    assert previous.waiting[0].parent == 1 and previous.waiting[1].parent is None   # #7 is not in the record
    previous.waiting.pop()
    assert previous.waiting[0].extra_variants == {("norm", "llm_3"): text}
    state = SearchState(spec=None, device="cpu", hardware={}, history=[(e.candidate, e.result) for e in previous.entries],
                        best=previous.best.candidate, best_result=previous.best.result, waiting=previous.waiting)
    judged.clear()
    report = Reporter(ws.root, live=False)
    loop.run(state, ListProposer([]), judge, ws, report, 600.0)
    assert Plan("paged", {"norm": "llm_3"}).key() in judged
    assert state.best.key() == waiting.key()
    assert json.loads((ws.root / "waiting.json").read_text())["candidates"] == []   # judged: none waits
    variants = list((ws.root / "candidates").glob("*/variants/norm.llm_3.py.j2"))
    assert [v.read_text() for v in variants] == [text]


def timed(score: float, noise: list[float]) -> EvalResult:
    """A passing timing whose cases move by the given factors (the noise of one evaluation)."""
    return EvalResult(status="passed", stage="done", device="cpu", score=score, benchmark=[
        {"case_name": c, "tokens_per_second": 100 * score * f} for c, f in zip(CASES, noise)])


def noisy(score: float, spread: float, rng: random.Random):
    return lambda label: timed(score, [1 + rng.uniform(-spread, spread) for _ in CASES])


def test_a_faster_challenger_is_accepted_with_its_confidence():
    rng = random.Random()
    decision = acceptance.contest(timed(1.07, [1, 1, 1]), timed(1.0, [1, 1, 1]),
                                  noisy(1.07, 0.01, rng), noisy(1.0, 0.01, rng))
    assert decision.accepted and decision.p <= acceptance.ALPHA and "p=" in decision.reason
    assert decision.ratio == pytest.approx(1.07, rel=0.03)


def test_a_clear_win_in_every_case_needs_no_rounds_and_no_time_falls_back_to_the_record():
    never = lambda label: pytest.fail("timed again")  # noqa: E731
    clear = acceptance.contest(timed(1.3, [1, 1, 1]), timed(1.0, [1, 1, 1]), never, never)
    assert clear.accepted and clear.p is None and "every case" in clear.reason
    # one case short of the bound: rounds, and with no time for them the recorded timing is the pair
    mixed = acceptance.contest(timed(1.3, [1, 1, 0.8]), timed(1.0, [1, 1, 1]), never, lambda label: None)
    assert "recorded timing" in mixed.reason and mixed.p is not None
    # undecided for want of time: not a verdict on the challenger (a resumed run times it again)
    assert not mixed.accepted and mixed.cut and not clear.cut


def test_a_repeated_timing_that_took_another_path_loses_its_contest():
    """A challenger whose repeated timing's timed runs are much looser than its checked pass
    (EvalResult.margin) loses the contest, however fast."""
    def looser(label):
        result = timed(1.5, [1, 1, 1])
        result.benchmark[0].update(timed_margin=0.2, checked_margin=0.9)
        return result
    decision = acceptance.contest(timed(1.02, [1.02, 1.02, 0.99]), timed(1.0, [1, 1, 1]), looser,
                                  lambda label: timed(1.0, [1, 1, 1]))
    assert not decision.accepted and "margin 0.20 is below" in decision.reason


def test_a_challenger_within_noise_is_rejected_as_such_and_a_slow_one_screened_out():
    # each pair: two cases a little faster, one a little slower: a mean gain the sign test cannot trust
    pattern = iter([[1.0, 1.0, 1.0]] + [[1.0, 1.0, 1.0], [1.02, 1.02, 0.99]] * acceptance.MAX_ROUNDS)
    challenger = lambda label: timed(1.0, next(pattern))  # noqa: E731
    decision = acceptance.contest(timed(1.0, [1.02, 1.02, 0.99]), timed(1.0, [1, 1, 1]), challenger,
                                  lambda label: timed(1.0, [1, 1, 1]))
    assert not decision.accepted and decision.reason.startswith("within noise: ") and not decision.cut
    slow = acceptance.contest(timed(0.7, [1, 1, 1]), timed(1.0, [1, 1, 1]), None, None)
    assert not slow.accepted and slow.reason == "screened out: 70% of best"


def test_a_second_screen_run_decides_the_screen_with_the_first_and_alone_pairs_in_the_rounds():
    """Whether the screen is screened out is decided on each case's faster run; a clear win and
    the rounds take single runs, so the challenger's half of the first round is the second run,
    not the faster-of-two (here the first run's decode case is the faster, 1.26 against 1.05)."""
    stalled = timed(1.05, [1 / 3, 1.2, 1 / 3])
    assert acceptance.worth_timing_again(stalled, timed(1.0, [1, 1, 1]))
    assert not acceptance.worth_timing_again(timed(0.7, [1, 1, 1]), timed(1.0, [1, 1, 1]))   # slower in every case
    assert not acceptance.worth_timing_again(timed(1.0, [1, 1, 1]), timed(1.0, [1, 1, 1]))   # not below SCREEN_KEEP
    faster = acceptance.fastest(stalled, timed(1.0, [1, 0.9, 1]))   # 35, 126, 35 and 100, 90, 100 tok/s
    assert faster.tokens_per_second() == pytest.approx(dict(zip(CASES, [100.0, 126.0, 100.0])))
    again = timed(1.05, [1, 1, 1])
    decision = acceptance.contest(stalled, timed(1.0, [1, 1, 1]), lambda label: timed(1.05, [1, 1, 1]),
                                  lambda label: timed(1.0, [1, 1, 1]), again)
    assert decision.accepted and decision.p is not None and decision.ratio == pytest.approx(1.05)
    alone = acceptance.contest(stalled, timed(1.0, [1, 1, 1]), None, None)
    assert not alone.accepted and alone.reason.startswith("screened out: ") and "two runs" not in alone.reason


def test_the_faster_of_two_runs_is_scored_on_its_own_rows():
    """fastest's score is the evaluator's (the geometric mean of the floor fractions) over the rows it keeps."""
    def run(fractions):
        return EvalResult(status="passed", stage="done", device="cpu", score=math.exp(sum(map(math.log, fractions)) / 3),
                          benchmark=[{"case_name": c, "tokens_per_second": 1000 * f, "floor_fraction": f}
                                     for c, f in zip(CASES, fractions)])
    merged = acceptance.fastest(run([0.1, 0.4, 0.2]), run([0.3, 0.2, 0.2]))
    assert merged.score == pytest.approx((0.3 * 0.4 * 0.2) ** (1 / 3))


def test_sign_test_matches_its_definition():
    n = random.randint(3, 12)
    for wins in range(n + 1):
        brute = sum(1 for bits in range(2 ** n) if bin(bits).count("1") >= wins) / 2 ** n
        assert math.isclose(acceptance.sign_p(wins, n), brute)


def one_case(case: str, tokens_per_second: float, score: float) -> EvalResult:
    """A passing timing of one benchmark case (the conservative engine's: agent/judge.py CONSERVATIVE_CASE)."""
    return EvalResult(status="passed", stage="done", device="cpu", score=score,
                      benchmark=[{"case_name": case, "tokens_per_second": tokens_per_second}])


def test_a_screen_meets_an_incumbent_timed_on_fewer_cases_case_for_case():
    """The screen against an incumbent timed on one case decides on that case: neither its score
    (one case's floor fraction) against the screen's (a mean over three) nor the screen's other cases."""
    never = lambda label: pytest.fail("timed again")  # noqa: E731
    gain = random.uniform(1.5, 5.0)
    screen = timed(0.2, [1, 1, 1])                      # a low score over three cases...
    tps = screen.tokens_per_second()[CASES[2]]
    win = acceptance.contest(screen, one_case(CASES[2], tps / gain, score=1.0), never, never)
    assert win.accepted and win.ratio == pytest.approx(gain) and f"over {CASES[2]}, the cases both timed" in win.reason
    loss = acceptance.contest(timed(5.0, [1, 1, 1 / (5 * gain)]), one_case(CASES[2], 100.0, score=0.01), never, never)
    assert not loss.accepted and loss.reason.startswith("screened out: ")   # a high score, slower on the case


def test_verdicts_with_no_case_in_common_are_not_compared_by_their_scores():
    screen, incumbent = one_case("prefill", 1000.0, score=10.0), one_case("mixed", 10.0, score=1.0)
    assert acceptance.paired_log_ratios(screen, incumbent) == [] and acceptance.speedup(screen, incumbent) is None
    decision = acceptance.contest(screen, incumbent, None, lambda label: None)
    assert not decision.accepted and "no benchmark case in common" in decision.reason
    # scores meet only where a verdict carries no cases at all
    bare = EvalResult(status="passed", stage="done", device="cpu", score=2.0)
    assert acceptance.speedup(bare, incumbent) == pytest.approx(2.0)


def test_a_final_keeps_its_own_full_timing_and_a_stress_only_one_takes_the_screens():
    """loop.joined: a FINAL without a benchmark (screens timed as the final would) is completed by
    the screen's; a FINAL that timed the engine itself in full (the screens time fewer fresh
    engines: JudgeSettings.screen_repeat) keeps its own numbers; a failure stays a failure."""
    from dataclasses import replace
    from agent.loop import joined
    screen = timed(1.0, [1, 1, 1])
    stress_only = EvalResult(status="passed", stage="done", device="cpu", stress={"cases": 3})
    assert joined(stress_only, screen).benchmark == screen.benchmark and joined(stress_only, screen).score == 1.0
    full = replace(timed(1.2, [1, 1, 1]), stress={"cases": 3})
    assert joined(full, screen) is full and joined(full, screen).score == 1.2
    failed = EvalResult.failure("stress", "wrong_result", "", "cpu")
    assert joined(failed, screen) is failed


def test_a_clear_win_on_one_screen_run_is_installed_only_if_its_full_timing_still_wins():
    """loop.unconfirmed_win: a challenger accepted on its screen alone (no paired timings) whose
    final timed it in full below the best's recorded timing is not installed; one that timed
    above is, and a contest's win (a sign test was run) or a final joined to its screen's timing
    is not second-guessed."""
    from dataclasses import replace
    from agent.loop import unconfirmed_win
    incumbent, screen = timed(1.0, [1, 1, 1]), timed(1.2, [1, 1, 1])
    clear = acceptance.Decision(True, "faster", 1.2)
    slower_in_full = replace(timed(0.97, [1, 1, 1]), stress={"cases": 3})
    faster_in_full = replace(timed(1.15, [1, 1, 1]), stress={"cases": 3})
    assert "stays" in unconfirmed_win(slower_in_full, screen, clear.p, incumbent)
    assert unconfirmed_win(faster_in_full, screen, clear.p, incumbent) is None
    assert unconfirmed_win(slower_in_full, screen, 0.01, incumbent) is None
    assert unconfirmed_win(replace(slower_in_full, benchmark=screen.benchmark), screen, clear.p, incumbent) is None
    assert unconfirmed_win(slower_in_full, screen, clear.p, None) is None
