"""The LLM path, offline: the real OpenAI and Anthropic SDK clients talk to a scripted HTTP
server on 127.0.0.1 that speaks their protocols, through our retry, budget, transcript,
extraction, policy and unit-check code, inside the real agent loop (only the whole-engine
judge is faked, so "slower" and "faster" are deterministic on a CPU)."""
from __future__ import annotations

import datetime
import json
import re
import os
import random
import socket
import time
from dataclasses import replace
from pathlib import Path

import pytest

from agent import loop
from agent.plan import Plan, engine_params, reference_slots
from agent.providers import ProviderOptions, make_proposer
from agent.providers import prompts
from agent.providers.budget import Budget, MeteredClient
from agent.providers.builtin import BuiltinProposer
from agent.providers.chat import ChatError, RecordingClient, RetryingClient
from agent.providers.prices import Price, price_for
from agent.records import Candidate, EvalResult, SearchState
from agent.report import Reporter
from agent.spec import spec_from_config
from agent.workspace import RESULTS_JSON, RESULTS_LOG, Workspace
from scripts.llm_server import ScriptedServer

FIXTURES = Path(__file__).parent / "fixtures" / "llm"
REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "target" / "model_config.json"
KEYS = ("OPENAI_API_KEY", "OPENAI_BASE_URL", "OPENAI_MODEL", "ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL",
        "ANTHROPIC_MODEL", "LLM_PRICE_PER_MTOK", "LLM_REPLAY_FROM", "LLM_REPLAY_STRICT")
SCRIPT = ["01_syntax_error", "02_unit_check_fails", "03_policy_violation", "04_correct_slower", "05_correct_faster"]
# Which fixture answers which request: episode 1 writes llm_1 (four rounds), episode 2 llm_2.
VARIANT_OF_STEP = ["llm_1", "llm_1", "llm_1", "llm_1", "llm_2"]


def answer(name: str, variant: str) -> str:
    return (FIXTURES / f"{name}.md").read_text().replace("VARIANT", variant)


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for key in KEYS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("LLM_RETRY_DELAY_S", "0.01")
    monkeypatch.setenv("LLM_KERNELS_ON_CPU", "1")   # on CPU the engine runs torch variants; allow kernels anyway
    monkeypatch.setenv("LLM_MAX_CALLS", "5")


def point_at(monkeypatch, protocol: str, url: str) -> None:
    if protocol == "openai":
        monkeypatch.setenv("OPENAI_BASE_URL", url)
        monkeypatch.setenv("OPENAI_API_KEY", "test-key")
        monkeypatch.setenv("OPENAI_MODEL", "gpt-4.1-mini")
    else:
        monkeypatch.setenv("ANTHROPIC_BASE_URL", url)
        monkeypatch.setenv("ANTHROPIC_API_KEY", "test-key")
        monkeypatch.setenv("ANTHROPIC_MODEL", "claude-haiku-4-5")


def openai_proposer(tmp_path, monkeypatch, url: str, log: list | None = None, device: str = "cpu",
                    fallback=None):
    """The openai provider's proposer, pointed at `url`, with `fallback` (default: a builtin that
    has nothing) beside it; its log lines appended to `log` when given."""
    point_at(monkeypatch, "openai", url)
    from agent.providers.openai import create
    options = ProviderOptions(device, 0, tmp_path, fallback or Empty())
    options.log = log.append if log is not None else (lambda line: None)
    return create(options)


# --------------------------------------------------------------------------- the loop, judge faked
PROFILE = {"source": "torch.profiler, cpu", "case": "decode", "total_ms": 10.0, "other_ms": 1.0,
           "slots": {s: {"ms": ms, "calls": 12, "shapes": {}} for s, ms in
                     (("silu_mul", 5.0), ("norm", 2.0), ("decode_attention", 1.0), ("prefill_attention", 0.5),
                      ("rope_cache", 0.5))}}
SCORES = {"recompute": 0.01, "paged": 1.0, "llm_1": 0.9, "llm_2": 1.5}


def fake_judge(engine: Path, out_dir: Path, timeout: float, phase: str = "full") -> EvalResult:
    """Scores by what the rendered engine holds: the model's slower or faster variant, or none."""
    source = engine.read_text()
    plan = json.loads((engine.parent / "plan.json").read_text())["plan"]   # beside the engine, any phase
    key = next((v for v in ("llm_2", "llm_1") if f"def silu_mul__{v}(" in source), plan["engine"])
    result = EvalResult(status="passed", stage="done", device="cpu", score=SCORES[key], seconds=0.1,
                        benchmark=[{"case_name": "decode", "elapsed_ms": 10.0 / SCORES[key], "total_tokens": 384,
                                    "prefill_tokens": 256, "decode_tokens": 128, "floor_fraction": SCORES[key] / 100,
                                    "tokens_per_second": 1000 * SCORES[key]}])
    result.slot_ms = PROFILE   # a measured per-slot profile, as the evaluator's profiled pass reports it
    return result


def run_agent(workspace: Path, provider: str) -> tuple[Workspace, SearchState, str, dict]:
    """The real loop, the real provider factory, the real builtin proposer; a fake judge."""
    ws = Workspace(workspace)
    ws.reset()
    report = Reporter(ws.root, live=False)
    ws.open_history(warn=report.warn)
    spec = spec_from_config(json.loads(CONFIG.read_text()), CONFIG, workspace / "weights")
    state = SearchState(spec=spec, device="cpu", hardware={"device": "cpu"})
    options = ProviderOptions("cpu", 0, ws.root, BuiltinProposer("cpu"))
    proposer = make_proposer(provider, options, report.warn)
    loop.run(state, proposer, fake_judge, ws, report, 600.0)
    report.finish([])
    return ws, state, (ws.root / RESULTS_LOG).read_text(), json.loads((ws.root / RESULTS_JSON).read_text())


def decisions(results: dict) -> list[tuple[str, bool]]:
    return [(json.dumps(c["plan"], sort_keys=True) + str(c["extra_variants"]), c["accepted"])
            for c in results["candidates"]]


def llm_entries(results: dict) -> list[dict]:
    """The model's candidates (the builtin walk also builds on an engine that holds model code)."""
    return [c for c in results["candidates"] if c["extra_variants"] and c["origin"] != "builtin"]


def in_order(log: str, needles: list[str]) -> bool:
    at = 0
    for needle in needles:
        at = log.find(needle, at)
        if at < 0:
            return False
        at += len(needle)
    return True


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
def test_five_proposals_only_the_correct_faster_one_is_accepted(tmp_path, monkeypatch, protocol):
    monkeypatch.setenv("LLM_REFINE_ROUNDS", "0")   # the whole engine's verdicts here; refinement has its test
    steps = [{"text": answer(name, v)} for name, v in zip(SCRIPT, VARIANT_OF_STEP)]
    with ScriptedServer(protocol, steps) as server:
        point_at(monkeypatch, protocol, server.url)
        ws, state, log, results = run_agent(tmp_path / "ws", protocol)

    # Every verdict is in the log, in order, and the feedback went back to the model.
    assert in_order(log, ["silu_mul/llm_1 round 1/4: syntax error", "silu_mul/llm_1 round 2/4: unit check failed",
                          "silu_mul/llm_1 round 3/4: policy violation", "silu_mul/llm_1 round 4/4: passed unit check",
                          "silu_mul/llm_1 judged in the whole engine: correct but not faster",
                          "silu_mul/llm_2 round 1/4: passed unit check",
                          "silu_mul/llm_2 judged in the whole engine: faster: accepted"])
    assert "call budget spent" in log and "the builtin proposer carries on alone" in log
    assert f"provider {protocol}" in log and "LLM totals: 5 calls" in log
    sent = [json.dumps(r["body"]["messages"]) for r in server.requests]
    assert len(sent) == 5
    assert "syntax error" in sent[1] and "never closed" in sent[1]
    assert "unit check failed" in sent[2] and "mismatch" in sent[2]
    assert "policy violation" in sent[3] and "inspect" in sent[3]
    assert "correct but not faster" in sent[4]   # episode 2's history

    # Only the correct and faster proposal was accepted; the engine on disk holds it.
    llm = llm_entries(results)
    assert [(c["extra_variants"], c["accepted"]) for c in llm] == [(["silu_mul/llm_1"], False),
                                                                  (["silu_mul/llm_2"], True)]
    assert "def silu_mul__llm_2(" in ws.engine.read_text()
    assert state.best.extra_variants and state.best_result.score == SCORES["llm_2"]

    # Every request and answer is in the transcript.
    (transcript,) = (ws.root / "transcripts").glob("*.jsonl")
    calls = [r for r in map(json.loads, transcript.read_text().splitlines()) if r["type"] == "call"]
    assert len(calls) == 5 and all(c["reply"]["text"] for c in calls)

    if protocol == "openai":
        # --provider replay: the same decisions, no network, no divergence.
        monkeypatch.setenv("LLM_REPLAY_STRICT", "1")
        for key in ("OPENAI_BASE_URL", "OPENAI_API_KEY"):
            monkeypatch.delenv(key)
        _, _, replay_log, replayed = run_agent(tmp_path / "ws", "replay")
        assert decisions(replayed) == decisions(results)
        assert "differs from the recording" not in replay_log
        assert "replay: 5 recorded requests of openai:gpt-4.1-mini" in replay_log
        assert [c["origin"] for c in llm_entries(replayed)] == ["replay:gpt-4.1-mini"] * 2


def test_a_broken_server_still_ends_with_a_passing_engine(tmp_path, monkeypatch):
    """Errors, timeouts and empty answers: retried, then the builtin proposer finishes the run."""
    monkeypatch.setenv("LLM_TIMEOUT_S", "0.5")
    monkeypatch.setenv("LLM_RETRIES", "1")
    steps = [{"status": 500}, {"status": 429, "retry_after": "0"}, {"sleep": 2.0, "text": "late"},
             {"text": ""}, {"text": ""}, {"text": ""}]
    with ScriptedServer("openai", steps) as server:
        point_at(monkeypatch, "openai", server.url)
        ws, state, log, results = run_agent(tmp_path / "ws", "openai")
    assert ws.installed_verdict() is not None and state.best_result.passed
    assert in_order(log, ["openai server (HTTP 500", "retry 1/1", "no answer from openai:gpt-4.1-mini: rate_limit",
                          "openai timeout", "retry 1/1", "no answer from openai:gpt-4.1-mini: empty"])
    assert "requests in a row failed after retries" in log and "builtin proposer carries on alone" in log
    assert not llm_entries(results)


def test_unreachable_provider_hands_over_to_the_builtin(tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_RETRIES", "0")
    point_at(monkeypatch, "openai", closed_port_url())
    ws, state, log, results = run_agent(tmp_path / "ws", "openai")
    assert "no answer from openai:gpt-4.1-mini: unreachable" in log
    assert "builtin proposer carries on alone" in log
    assert ws.installed_verdict() is not None and len(results["candidates"]) > 2


# --------------------------------------------------------------------------- the client layers alone
def stack(protocol: str, url: str, log: list, timeout: float = 5.0, retries: int = 3):
    if protocol == "openai":
        from agent.providers.openai import OpenAIChat
        client = OpenAIChat("gpt-4.1-mini", "k", url, timeout)
    else:
        from agent.providers.anthropic import AnthropicChat
        client = AnthropicChat("claude-haiku-4-5", "k", url, timeout)
    metered = MeteredClient(client, Budget(), price_for(client.model)[0])
    return RetryingClient(metered, log.append, retries=retries, base_delay=0.01), metered


MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]


@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
def test_rate_limit_and_server_errors_are_retried(protocol):
    log = []
    with ScriptedServer(protocol, [{"status": 429, "retry_after": "0"}, {"status": 503}, {"text": "hi"}]) as server:
        client, metered = stack(protocol, server.url, log)
        reply = client.complete(MESSAGES, 100)
    assert reply.text == "hi" and reply.output_tokens == 0 and reply.input_tokens > 0
    assert "rate_limit" in log[0] and "retry 1/3 in 0.0s" in log[0] and "server" in log[1]
    assert metered.usage.calls == 3
    body = server.requests[-1]["body"]
    if protocol == "anthropic":
        assert body["system"] == "be brief" and body["messages"] == [{"role": "user", "content": "hello"}]
    else:
        assert body["messages"] == MESSAGES and body["max_tokens"] == 100  # a compatible server: max_tokens


@pytest.mark.parametrize("headers, seconds", [
    ({"retry-after-ms": "1500", "retry-after": "9"}, 1.5),
    ({"retry-after": "7"}, 7.0),
    ({"retry-after": "Wed, 25 Nov 2026 12:00:30 GMT"}, 30.0),
    ({"x-ratelimit-reset-requests": "6m0s", "x-ratelimit-reset-tokens": "20ms"}, 360.0),
    ({"anthropic-ratelimit-tokens-reset": "2026-11-25T12:00:04Z"}, 4.0),
    ({"retry-after": "soon"}, None),
    ({}, None),
])
def test_how_long_a_server_asks_to_wait(headers, seconds):
    from agent.providers.chat import retry_after
    now = datetime.datetime(2026, 11, 25, 12, 0, 0, tzinfo=datetime.timezone.utc).timestamp()
    got = retry_after(headers, now)
    assert got == pytest.approx(seconds) if seconds is not None else got is None
    assert retry_after({"x-ratelimit-reset-tokens": "6m0s"}, now, rate_limited=False) is None   # a 5xx


@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
@pytest.mark.parametrize("header", [{"retry-after-ms": "400"}, {"x-ratelimit-reset-requests": "400ms"}])
def test_a_rate_limit_waits_as_long_as_the_server_asks(protocol, header):
    log = []
    with ScriptedServer(protocol, [{"status": 429, "headers": header}, {"text": "hi"}]) as server:
        client, _ = stack(protocol, server.url, log)
        assert client.complete(MESSAGES, 100).text == "hi"
    assert "retry 1/3 in 0.4s" in log[0], log   # not the client's own 0.01 s backoff


@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
@pytest.mark.parametrize("body", ["cut", "not utf-8"])
def test_a_body_that_does_not_parse_is_a_server_error_and_retried(protocol, body):
    """A JSON body cut short anywhere; one holding a byte that is not UTF-8 (its UnicodeDecodeError had
    ended the model's part of the run, helper-35)."""
    log = []
    whole = '{"id": "x", "choices": [{"message": {"content": "hi"}}]}'
    raw = whole[:random.randint(1, 40)] if body == "cut" else whole.encode().replace(b"hi", b"h\xff")
    with ScriptedServer(protocol, [{"raw": raw}, {"text": "ok"}]) as server:
        client, metered = stack(protocol, server.url, log)
        assert client.complete(MESSAGES, 100).text == "ok"
    assert "server" in log[0] and "did not parse" in log[0] and metered.usage.calls == 2


@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
def test_timeouts_and_empty_answers_are_retried(protocol):
    log = []
    with ScriptedServer(protocol, [{"sleep": 1.5, "text": "late"}, {"text": ""}, {"text": "ok"}]) as server:
        client, _ = stack(protocol, server.url, log, timeout=0.5)
        assert client.complete(MESSAGES, 100).text == "ok"
    assert "timeout" in log[0] and "empty answer" in log[1]


@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
def test_auth_errors_are_not_retried(protocol):
    log = []
    with ScriptedServer(protocol, [{"status": 401}]) as server:
        client, _ = stack(protocol, server.url, log)
        with pytest.raises(ChatError) as e:
            client.complete(MESSAGES, 100)
    assert e.value.kind == "auth" and log == [] and len(server.requests) == 1


def test_budget_refuses_a_call_that_could_cross_it():
    log = []
    with ScriptedServer("openai", [{"text": "a"}]) as server:
        client, metered = stack("openai", server.url, log)
        metered.budget = Budget(max_calls=10, max_tokens=10**9, max_cost_usd=0.01)
        metered.price = Price(1.0, 10.0)
        with pytest.raises(ChatError, match="cost budget"):
            client.complete(MESSAGES, 2000)   # worst case 2000 output tokens = $0.02
        assert server.requests == []
        assert client.complete(MESSAGES, 500).text == "a"
    assert metered.usage.cost_usd > 0


def test_transcript_records_errors_too(tmp_path):
    log = []
    with ScriptedServer("openai", [{"status": 500}, {"text": "fine"}]) as server:
        client, metered = stack("openai", server.url, log)
        recording = RecordingClient(metered.inner, tmp_path / "t.jsonl", {"base_url": server.url})
        metered.inner = recording
        client.complete(MESSAGES, 50)
    start, *calls = map(json.loads, (tmp_path / "t.jsonl").read_text().splitlines())
    assert start["type"] == "start" and start["base_url"] == server.url
    assert [c["error"]["kind"] if c["error"] else c["reply"]["text"] for c in calls] == ["server", "fine"]
    assert calls[0]["request_hash"] == calls[1]["request_hash"]


def test_prices_match_dated_snapshots_and_charge_unknown_models_high(monkeypatch):
    assert price_for("claude-sonnet-4-5-20250929")[1] == "table: claude-sonnet-4"
    assert price_for("gpt-4.1-mini-2025-04-14")[1] == "table: gpt-4.1-mini"
    assert price_for("my-local-llama")[0].output_per_mtok >= 75
    monkeypatch.setenv("LLM_PRICE_PER_MTOK", "0,0")
    assert price_for("my-local-llama")[0].cost(10**6, 10**6) == 0


# --------------------------------------------------------------------------- plans and prompts
def paged_state(device: str = "cpu") -> SearchState:
    spec = spec_from_config(json.loads(CONFIG.read_text()), CONFIG, Path("/nonexistent"))
    plan = Plan("paged", reference_slots(), {k: p.default for k, p in engine_params("paged").items()})
    best = Candidate(plan, "builtin", "paged")
    result = EvalResult(status="passed", stage="done", device=device, score=1.0,
                        benchmark=[{"case_name": "prefill", "elapsed_ms": 5.0, "total_tokens": 512,
                                    "prefill_tokens": 512, "decode_tokens": 0, "floor_fraction": 0.03}])
    return SearchState(spec=spec, device=device, hardware={"device": device}, seconds_left=600.0, best=best,
                       best_result=result, history=[(best, result)])


class Empty:
    name = "builtin"

    def propose(self, state):
        return None

    def feedback(self, candidate, result):
        pass


def test_plan_change_is_checked_against_the_menu_and_repaired(tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_KERNELS_ON_CPU", "0")   # on CPU: plan episodes only
    steps = [{"text": answer("plan_invalid", "")}, {"text": answer("plan_change", "")}]
    log = []
    with ScriptedServer("openai", steps) as server:
        proposer = openai_proposer(tmp_path, monkeypatch, server.url, log)
        candidate = proposer.propose(paged_state())
    assert candidate.plan.params["block_size"] == 32 and candidate.origin == "openai:gpt-4.1-mini"
    assert not candidate.extra_variants and "model-proposed plan change" in candidate.note
    assert any("plan change #1 round 1/4: invalid plan: block_size: 48 is not a choice" in line for line in log)
    assert "48 is not a choice" in json.dumps(server.requests[1]["body"]["messages"])


def test_prompt_carries_contract_hardware_model_profile_and_code():
    state = paged_state()
    info = prompts.slot_info("norm", "llm_1")
    assert "rsqrt(mean(r.float()**2, -1) + eps)" in info.contract
    assert [s.split("`")[1] for s in info.signatures] == [
        "rmsnorm__llm_1(x, w, eps) -> y[N,H]", "add_rmsnorm__llm_1(x, residual, w, eps) -> (y[N,H], new_residual[N,H])"]
    assert "residual[N,H]" in info.signatures[1] and not info.optional
    profile = prompts.profile(state.best_result)
    assert "estimated" in profile.source and profile.shares[0][0] == "linear"
    assert profile.share("prefill_attention") > 0 and profile.share("decode_attention") == 0
    text = prompts.render("kernel", slot=info, variant="llm_1", dtype="float32", best_plan="paged",
                          current_variant="torch", current_code="", hardware={"gpu": "H100", "SMs": 132},
                          model=state.spec.summary(), profile=profile, history=[], plan_menu="",
                          shapes=prompts.slot_shapes(state, "norm"), measured={}, fused_rows=64, blocking=False,
                          tolerance=prompts.tolerance("float32"), judged=prompts.judged_lines(state))
    for needle in ("## Contract", "`rmsnorm__llm_1(x, w, eps) -> y[N,H]`; arguments x[N,H], w[H]", "gpu: H100", "12 layers, hidden 768",
                   "| prefill | 5.000 | 512 | 0.0300 |", "estimated", "def rmsnorm__torch",
                   "| `add_rmsnorm` | N=256, H=768 | 72 |", "paged"):
        assert needle in text


def test_on_a_gpu_the_slots_that_keep_the_engine_eager_are_asked_for_first(tmp_path, monkeypatch):
    """From an all-torch best engine on a GPU (its decode and prefill attention loop on the host:
    no CUDA graphs), the first kernel episodes go to those two slots, decode first, each prompt
    saying why; then the shares decide. On a CPU, or once the attention is graph-safe, nothing blocks."""
    from agent.providers.llm import BLOCKING_TRIES, KERNEL
    state = paged_state("cuda")
    assert prompts.graph_blocking(state) == ["decode_attention", "prefill_attention"]
    assert prompts.graph_blocking(paged_state("cpu")) == []
    safe = Plan("paged", {**state.best.plan.slots, "decode_attention": "triton_split", "prefill_attention": "triton"},
                state.best.plan.params)
    assert prompts.graph_blocking(replace(state, best=Candidate(safe, "builtin", "paged"))) == []
    no_decode_graphs = Plan("paged", state.best.plan.slots, {**state.best.plan.params, "decode_graphs": False})
    assert prompts.graph_blocking(replace(state, best=Candidate(no_decode_graphs, "builtin", "paged"))) == \
        ["prefill_attention"]   # graphs off by the plan: a graph-safe decode variant would change nothing
    with ScriptedServer("openai", []) as server:
        proposer = openai_proposer(tmp_path, monkeypatch, server.url, device="cuda")
        episodes = [proposer._start(state, prompts.profile(state.best_result), KERNEL) for _ in range(2 * BLOCKING_TRIES + 1)]
    assert [e.slot for e in episodes] == ["decode_attention", "prefill_attention"] * BLOCKING_TRIES + ["linear"]
    first, last = episodes[0].messages[1]["content"], episodes[-1].messages[1]["content"]
    assert "## Why this slot first" in first and "capture its decode steps in CUDA graphs" in first
    assert "`decode_attention` variant `torch` loops on the host" in first
    assert "Why this slot first" not in last
    for slot in ("decode_attention", "prefill_attention"):   # a `# graphs:` header line is not contract text
        contract = prompts.slot_info(slot, "llm_1").contract
        assert contract.lstrip().startswith("numerics") and "graphs:" not in contract and "contract (" not in contract


def test_no_request_without_run_time_to_judge_its_answer(tmp_path, monkeypatch):
    with ScriptedServer("openai", [{"text": answer("plan_change", "")}]) as server:
        log = []
        state = paged_state()
        state.seconds_left = 100.0   # less than a request's timeout plus an evaluation
        proposer = openai_proposer(tmp_path, monkeypatch, server.url, log)
        assert proposer.propose(state) is None
        assert [proposer.ask(state) for _ in range(3)] == [None] * 3   # the parallel workers' asks
    assert server.requests == [] and sum("not enough for a request" in line for line in log) == 1


def test_an_episode_in_flight_sends_no_further_round_once_the_llm_side_stopped(tmp_path, monkeypatch):
    """Parallel episodes: one stops the LLM side (a fatal error, an internal one) while another
    waits for its answer; that one's repair rounds are not sent."""
    with ScriptedServer("openai", [{"text": "no code in this answer"}] * 4) as server:
        log = []
        proposer = openai_proposer(tmp_path, monkeypatch, server.url, log)
        answer_of = proposer.client.complete

        def complete(messages, max_tokens):
            reply = answer_of(messages, max_tokens)
            proposer._stop("stopped by another episode")   # as that episode would, under the lock
            return reply
        monkeypatch.setattr(proposer.client, "complete", complete)
        assert proposer.ask(paged_state()) is None
        proposer._stop("a second episode fails")   # the stop is said once
    assert len(server.requests) == 1 and sum("carries on alone" in line for line in log) == 1


def installed(state, block_size: int, score: float, history_only: bool = False) -> None:
    """A judged engine of `score`; unless `history_only`, the loop installs it as its best."""
    candidate = Candidate(replace(state.best.plan, params={**state.best.plan.params, "block_size": block_size}),
                          "builtin", "")
    result = replace(state.best_result, score=score)
    state.history.append((candidate, result))
    if not history_only:
        state.best, state.best_result = candidate, result


def test_a_model_with_nothing_usable_is_paused_until_a_new_best_engine_then_stopped(tmp_path, monkeypatch):
    """Episodes in a row with nothing usable pause the model (no request goes out, the builtin goes
    on); a new best engine wakes it with a fresh count, and nothing else does (a screen that scored
    high but was not installed, as one that lost its contest or failed its final); after
    `max_pauses` pauses the next such run of episodes stops it for good."""
    monkeypatch.setenv("LLM_REPAIR_ROUNDS", "0")
    monkeypatch.setenv("LLM_MAX_CALLS", "20")
    with ScriptedServer("openai", [{"text": "no code in this answer"}] * 10) as server:
        log = []
        proposer = openai_proposer(tmp_path, monkeypatch, server.url, log)
        proposer.settings.max_failed_episodes, proposer.settings.max_pauses = 2, 1
        state = paged_state()
        assert [proposer.ask(state) for _ in range(2)] == [None, None] and len(server.requests) == 2
        assert sum("asked again once a new best engine is installed (the best scores 1 now; pause 1 of 1)" in line
                   for line in log) == 1
        assert not proposer.ready(state) and proposer.paused(state) and proposer.active
        assert proposer.ask(state) is None and len(server.requests) == 2          # paused: nothing sent
        installed(state, 32, 3.0, history_only=True)                             # high, but not the best
        assert proposer.paused(state) and proposer.ask(state) is None and len(server.requests) == 2
        installed(state, 64, 2.5)
        assert proposer.ready(state) and not proposer.paused(state)
        assert proposer.ask(state) is None and len(server.requests) == 3          # awake: asked again
        assert any("a new best engine (score 2.5): asking the model again" in line for line in log)
        assert proposer.ask(state) is None and len(server.requests) == 4
        assert not proposer.active and sum("carries on alone" in line for line in log) == 1   # pauses spent
        assert proposer.ask(state) is None and len(server.requests) == 4


def test_an_episode_in_flight_sends_no_further_round_once_the_model_is_paused(tmp_path, monkeypatch):
    """Parallel episodes: one pauses the model while another waits for its answer; that one's
    repair rounds are not sent (a paused model is asked nothing), and a new best wakes it."""
    monkeypatch.setenv("LLM_REPAIR_ROUNDS", "3")
    with ScriptedServer("openai", [{"text": "no code in this answer"}] * 6) as server:
        log = []
        proposer = openai_proposer(tmp_path, monkeypatch, server.url, log)
        state = paged_state()
        answer_of = proposer.client.complete

        def complete(messages, max_tokens):
            reply = answer_of(messages, max_tokens)
            proposer._pause(state, "another episode had nothing usable")   # as that episode would
            return reply
        monkeypatch.setattr(proposer.client, "complete", complete)
        assert proposer.ask(state) is None
        assert len(server.requests) == 1 and any("the model is paused; no round 2" in line for line in log)
        assert proposer.active and proposer.paused(state)
        monkeypatch.setattr(proposer.client, "complete", answer_of)
        installed(state, 32, 2.0)
        assert proposer.ask(state) is None and len(server.requests) == 5   # awake: the whole episode again


def test_the_serial_loop_ends_the_model_side_when_it_is_paused_and_the_builtin_is_spent(tmp_path, monkeypatch):
    """Serial path (propose): with the builtin walk spent and the model paused nothing can wake it,
    and the log says so instead of "the LLM goes on alone"."""
    with ScriptedServer("openai", []) as server:
        log = []
        proposer, state = openai_proposer(tmp_path, monkeypatch, server.url, log, fallback=Empty()), paged_state()
        proposer._pause(state, "4 episodes in a row produced nothing usable")
        assert proposer.propose(state) is None and not proposer.active and server.requests == []
    assert not any("goes on alone" in line for line in log)
    assert any("the model is paused and nothing else is left to judge" in line for line in log)


def test_a_replay_of_a_run_recorded_before_pauses_stops_the_model_as_that_run_did():
    """A transcript's settings lack the fields added since: they keep today's defaults, except
    those that change what the proposer does (BEFORE_RECORDED), which take the behaviour of the
    recording's time (no pauses)."""
    from agent.providers.llm import LLMSettings
    from agent.providers.replay import _restore
    old = _restore(LLMSettings, {"model": "m", "repair_rounds": 1}, LLMSettings(model="m"))
    assert (old.max_pauses, old.repair_rounds, old.retries) == (0, 1, LLMSettings(model="m").retries)
    new = _restore(LLMSettings, {"model": "m", "max_pauses": 2}, LLMSettings(model="m"))
    assert new.max_pauses == 2


def test_a_bug_on_the_llm_side_stops_the_llm_not_the_run(tmp_path, monkeypatch):
    class Two(Empty):
        sizes = [32, 64]

        def propose(self, state):
            return Candidate(Plan("paged", reference_slots(), {"block_size": self.sizes.pop(0)}), "builtin", "")

    def broken(*args, **kwargs):
        raise KeyError("boom")

    monkeypatch.setattr(prompts, "profile", broken)
    with ScriptedServer("openai", []) as server:
        log = []
        proposer, state = openai_proposer(tmp_path, monkeypatch, server.url, log, fallback=Two()), paged_state()
        first = proposer.propose(state)            # the builtin's turn
        second = proposer.propose(state)           # the LLM's turn: it breaks, the builtin goes on
    assert (first.plan.params, second.plan.params) == ({"block_size": 32}, {"block_size": 64})
    assert second.origin == "builtin" and server.requests == []
    assert any("KeyError: 'boom'" in line for line in log)
    assert any("internal error in the LLM proposer" in line for line in log)


def test_unit_check_survives_a_crashing_or_hanging_proposal():
    from agent.providers.proposals import unit_check, variant_template
    crash = variant_template("silu_mul", "llm_9", "cpu", "def silu_mul__llm_9(gate_up):\n    raise SystemExit(3)\n")
    hang = variant_template("silu_mul", "llm_9", "cpu", "def silu_mul__llm_9(gate_up):\n    while True:\n        pass\n")
    result = unit_check("silu_mul", hang, "cpu", 3.0, seed=1)
    assert not result.passed and result.detail.startswith("timeout")
    result = unit_check("silu_mul", crash, "cpu", 120.0, seed=1)
    assert not result.passed and ("crash" in result.detail or "SystemExit" in result.detail)


@pytest.mark.skipif(os.geteuid() != 0, reason="the unit check's own uid needs a root agent")
def test_unit_check_runs_model_code_where_it_cannot_touch_the_agent(tmp_path):
    """Class 8 of issue 20: the model's variant runs in a jail (own uid, scratch cwd, output
    read back from a bounded tail): writing into the repository fails, 50 MB of output cost the
    agent nothing, a daemon it leaves is gone, and the verdict still comes back."""
    from agent.providers.proposals import REPO, unit_check, variant_template
    marker = REPO / f"PWNED-{os.getpid()}"
    late = tmp_path / "late"
    os.chmod(tmp_path, 0o777)   # the daemon could write here: only being killed stops it
    code = f'''
import os, sys, time
def silu_mul__llm_7(gate_up):
    try:
        open({str(marker)!r}, "w").write("x")
    except OSError:
        pass
    if os.fork() == 0:
        os.setsid()
        time.sleep(3)
        open({str(late)!r}, "w").write("still here")
        os._exit(0)
    sys.stderr.write("x" * (50 * 2**20))
    d = gate_up.shape[-1] // 2
    import torch
    return torch.nn.functional.silu(gate_up[..., :d]) * gate_up[..., d:]
'''
    try:
        result = unit_check("silu_mul", variant_template("silu_mul", "llm_7", "cpu", code), "cpu", 300.0, seed=3)
        assert result.passed, result.detail
        assert not marker.exists()
        time.sleep(4)
        assert not late.exists()
    finally:
        marker.unlink(missing_ok=True)


def test_a_unit_check_has_a_memory_cap(monkeypatch):
    """A variant holding 3 GiB in a plain tensor (nothing the policy refuses) passed its unit check:
    the check's jail had no memory cap and nothing watched it, so model code could take the host's
    memory while the judge ran beside it. Now it has one (made 2 GiB here): refused."""
    from agent.providers import proposals
    from agent.providers.proposals import unit_check, variant_template
    machine = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    monkeypatch.setattr(proposals, "UNIT_MEMORY_FRACTION", 2**31 / machine, raising=False)
    code = '''
import torch
_HELD = []
def silu_mul__llm_7(gate_up):
    if not _HELD:
        _HELD.append(torch.ones(3 * 2**30, dtype=torch.uint8))
    d = gate_up.shape[-1] // 2
    return torch.nn.functional.silu(gate_up[..., :d]) * gate_up[..., d:]
'''
    result = unit_check("silu_mul", variant_template("silu_mul", "llm_7", "cpu", code), "cpu", 300.0, seed=3)
    assert not result.passed
    assert "memory" in result.detail.lower() or "allocate" in result.detail, result.detail


@pytest.mark.parametrize("where", ["judged", "waiting"])
def test_a_resumed_run_keeps_the_models_earlier_variants_and_their_names(where, tmp_path, monkeypatch):
    """A run continued with --resume has its earlier model variants in the history, or in the
    candidates that were still waiting for the judge (state.waiting), only: the plan menu lists
    them (so a plan can stack them), and the next variant the model is asked for takes the next
    free number, not one a judged or waiting plan already names."""
    monkeypatch.setenv("LLM_KERNELS_ON_CPU", "1")
    state = paged_state()
    earlier = Candidate(Plan("paged", {**state.best.plan.slots, "decode_attention": "llm_5"}, state.best.plan.params),
                        "openai:gpt-4.1-mini", "earlier", {("decode_attention", "llm_5"): "def decode_attention__llm_5(): pass\n"})
    if where == "judged":
        state.history.append((earlier, replace(state.best_result, score=0.5)))
    else:
        state.waiting.append(earlier)
    with ScriptedServer("openai", [{"text": "no code here"}]) as server:
        openai_proposer(tmp_path, monkeypatch, server.url).ask(state)
    prompt = json.dumps(server.requests[0]["body"]["messages"])
    assert "Write a faster variant `llm_6` of the slot" in prompt
    menu_line = re.search(r"  - `decode_attention`: ([^\\]*)\\n", prompt).group(1)
    assert "llm_5" in menu_line.split(", ")


def test_a_model_told_its_engine_won_hears_when_its_deferred_final_fails(tmp_path, monkeypatch):
    """A contest's win is "faster: accepted" in the model's history while its final is deferred
    (agent/loop.py settle_final); if that final then fails, the model hears the engine was not
    kept. A final that holds adds nothing."""
    from agent.providers.llm import _Pending
    with ScriptedServer("openai", []) as server:
        log = []
        proposer, state = openai_proposer(tmp_path, monkeypatch, server.url, log), paged_state()
        won, held = (Candidate(replace(state.best.plan, params={**state.best.plan.params, "block_size": b}), "m", "")
                     for b in (32, 64))
        for candidate, what in ((won, "linear/llm_1"), (held, "norm/llm_2")):
            proposer._pending[candidate.key()] = _Pending(what, state.best_result)
            proposer.feedback(candidate, replace(state.best_result, score=2.0, decision="faster: 5/5 paired timings"))
        proposer.feedback(won, EvalResult.failure("stress", "mismatch", "wrong on a long prompt", "cpu"))
        proposer.feedback(held, replace(state.best_result, score=2.0, decision="faster: 5/5 paired timings",
                                        stress={"passed": 18}))
    verdicts = [(a.what, a.verdict) for a in proposer.history]
    assert verdicts == [("linear/llm_1", "faster: accepted"), ("norm/llm_2", "faster: accepted"),
                        ("linear/llm_1", "won its contest, then failed its final: not kept")]
    assert any("linear/llm_1 won its contest, then its final" in line and "wrong on a long prompt" in line
               for line in log)
