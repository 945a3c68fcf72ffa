"""Answers a hostile or broken model server sends (a red-team helper's, twenty-ninth session): each is
refused with a reason or counted safely, never the end of the model's part of the run, never a
budget switched off, never a request held past its deadline, never a key in the log."""
from __future__ import annotations

import json
import threading
import time

import pytest

from agent.extract import ExtractError, extract_json
from agent.providers import proposals
from agent.providers.budget import Budget, MeteredClient, counted
from agent.providers.chat import TIMEOUT, ChatError, DeadlineClient, RecordingClient, Reply, RetryingClient, shown_url
from agent.providers.prices import Price
from tests.test_providers import paged_state

CODE = "def silu_mul__llm_1(gate_up):\n    return gate_up\n"


class Slow:
    """A chat client whose answer comes only after `seconds` (a server dripping its bytes)."""
    provider, model = "test", "slow"

    def __init__(self, seconds: float):
        self.seconds, self.done = seconds, threading.Event()

    def complete(self, messages, max_tokens):
        self.done.wait(self.seconds)
        return Reply("late", 1, 1, "slow")


def test_a_request_is_bounded_in_all_not_per_read():
    slow = Slow(60.0)
    start = time.monotonic()
    with pytest.raises(ChatError) as e:
        DeadlineClient(slow, 0.3).complete([{"role": "user", "content": "hi"}], 10)
    slow.done.set()
    assert e.value.kind == TIMEOUT and time.monotonic() - start < 5.0
    assert DeadlineClient(Slow(0.0), 5.0).complete([], 10).text == "late"


@pytest.mark.parametrize("reported", [float("nan"), -10**12, None, "12", True, float("inf")])
def test_usage_numbers_that_cannot_be_counts_are_estimated(reported):
    assert counted(reported, 77) == 77
    assert counted(120, 77) == 120


def test_nan_usage_cannot_switch_the_token_limit_off():
    class Lying:
        provider, model = "test", "liar"

        def complete(self, messages, max_tokens):
            return Reply("x" * 30_000, float("nan"), -10**12, "liar")
    metered = MeteredClient(Lying(), Budget(max_calls=100, max_tokens=40_000, max_cost_usd=100.0), Price(0.0, 0.0))
    calls = 0
    with pytest.raises(ChatError):
        for calls in range(1, 100):
            metered.complete([{"role": "user", "content": "hi"}], 5_000)
    assert calls < 10 and metered.usage.tokens > 0


def test_credentials_in_a_base_url_are_not_shown():
    assert shown_url("http://user:sk-secret@host:8080/v1") == "http://***@host:8080/v1"
    assert shown_url("https://api.example.com/v1") == "https://api.example.com/v1"


@pytest.mark.parametrize("plan,words", [
    ({"slots": ["norm"]}, '"slots" must be an object'),
    ({"params": [["block_size", 32]]}, '"params" must be an object'),
    ({"params": {"block_size": 16.0}}, "is not a choice"),    # 16.0 would be a new key for the same plan
])
def test_plan_answers_of_the_wrong_types_are_refused_with_a_reason(plan, words):
    verdict = proposals.check_plan_answer(f"```json\n{json.dumps({'plan': plan})}\n```", paged_state(), {})
    assert verdict.verdict == proposals.INVALID_PLAN and words in verdict.detail


def test_json_nested_past_the_parser_is_no_plan():
    with pytest.raises(ExtractError, match="nested too deeply"):
        extract_json("```json\n" + "[" * 100_000 + "\n```")


@pytest.mark.parametrize("code,verdicts", [
    (CODE + "x = '\ud800'\n", {proposals.SYNTAX}),                           # a lone surrogate in the text
    (CODE + "x = " + "+".join(["1"] * 900) + "\n", {proposals.POLICY}),       # deeper than the checker walks
    (CODE + "x = " + "+".join(["1"] * 50000) + "\n", {proposals.SYNTAX}),     # deeper than the parser goes
], ids=["surrogate", "deep-for-the-checker", "deep-for-the-parser"])
def test_code_that_breaks_the_parser_or_the_checker_is_refused(code, verdicts):
    result = proposals.check_kernel_answer(f"```python\n{code}```", "silu_mul", "llm_1", ("silu_mul",), "cpu",
                                           {}, 30.0, 0)
    assert result.verdict in verdicts, result.detail


def test_prose_the_parser_gives_up_on_is_no_code_not_a_crash():
    """6000 bare words on one line: CPython's parser raises MemoryError on it, which had ended the
    model's part of the run (helper-35, thirty-sixth session)."""
    result = proposals.check_kernel_answer("ok " * 6000, "silu_mul", "llm_1", ("silu_mul",), "cpu", {}, 30.0, 0)
    assert result.verdict == proposals.NO_CODE, result.detail


def test_answers_are_valid_utf8_so_a_repair_round_can_send_them_back():
    from agent.providers.chat import clean_text
    text = clean_text("x = '\ud800'")
    assert text.encode("utf-8") and "\ud800" not in text


def test_a_reply_without_usage_is_counted_by_its_text_and_a_timed_out_attempt_by_its_worst_case():
    class NoUsage:
        provider, model = "test", "quiet"

        def complete(self, messages, max_tokens):
            return Reply("y" * 40_000, None, None, "quiet")
    metered = MeteredClient(NoUsage(), Budget(max_calls=100, max_tokens=50_000, max_cost_usd=100.0), Price(0.0, 0.0))
    metered.complete([{"role": "user", "content": "hi"}], 20_000)
    assert metered.usage.output_tokens > 10_000

    class Cut:
        provider, model = "test", "cut"

        def complete(self, messages, max_tokens):
            raise ChatError(TIMEOUT, "no whole answer")
    cut = MeteredClient(Cut(), Budget(max_calls=100, max_tokens=50_000, max_cost_usd=100.0), Price(0.0, 0.0))
    with pytest.raises(ChatError):
        cut.complete([{"role": "user", "content": "hi"}], 2_000)
    assert cut.usage.output_tokens == 2_000


@pytest.mark.parametrize("url,shown", [
    ("user:sk-secret@host:8080/v1", "***@host:8080/v1"),
    ("sk-secret@host/v1", "***@host/v1"),
    ("http://u:p@[::1]:8080/v1", "http://***@[::1]:8080/v1"),
    ("http://u:p@host:abc/v1", "http://***@host:abc/v1"),
    ("http://host/v1?x=a@b", "http://host/v1?x=a@b"),
])
def test_odd_base_urls_are_shown_without_credentials(url, shown):
    assert shown_url(url) == shown


def test_a_unit_check_never_runs_past_the_run(monkeypatch):
    """An answer that loops at import held a run of --budget 120 for the whole 300 s unit-check
    timeout (helper-35, thirty-sixth session): the check's timeout is what the run has left."""
    from agent.providers import llm
    from agent.providers.budget import Usage
    from agent.providers.builtin import BuiltinProposer
    seen = []
    monkeypatch.setattr(llm, "check_kernel_answer", lambda *args: seen.append(args[6]) or proposals.Verdict(
        proposals.NO_CODE, "x"))
    proposer = llm.LLMProposer(client=None, fallback=BuiltinProposer("cpu"), device="cpu", log=lambda line: None,
                               settings=llm.LLMSettings(model="m"), usage=Usage(), label="test")
    proposer._deadline = time.monotonic() + 40.0
    proposer._check(llm._Episode(kind=llm.KERNEL, what="x", slot="silu_mul", variant="llm_1"), CODE, paged_state())
    assert 30.0 < seen[0] <= 40.0, seen


_CHAT = {"id": "x", "object": "chat.completion", "created": 0, "model": "m",
         "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]}


@pytest.mark.parametrize("protocol,raw", [
    ("openai", json.dumps({**_CHAT, "choices": [{"index": 0, "message": None}]})),
    ("openai", json.dumps({**_CHAT, "choices": [{"index": 0, "message": {"content": [{"type": "text"}]}}]})),
    ("openai", json.dumps({**_CHAT, "choices": "abc"})),
    ("openai", "<html>a proxy's page</html>"),
    ("openai", json.dumps(_CHAT)[:-1] + ', "usage": {"prompt_tokens": ' + "9" * 5000 + "}}"),
    ("anthropic", json.dumps({"type": "message", "model": "m", "content": [{"type": "text", "text": 5}]})),
    ("anthropic", "[1]"),
], ids=["null-message", "content-list", "choices-str", "html", "5000-digits", "text-int", "list"])
def test_an_answer_that_parses_but_is_no_chat_answer_is_a_server_error_and_retried(protocol, raw):
    """A 200 body of the wrong shape had raised AttributeError, TypeError or ValueError out of the
    client: the model's part of the run stopped as an internal error (thirty-eighth session)."""
    from scripts.llm_server import ScriptedServer
    from tests.test_providers import MESSAGES, stack
    log = []
    html = {"Content-Type": "text/html"} if raw.startswith("<") else {}   # the SDK hands back the text
    with ScriptedServer(protocol, [{"raw": raw, "headers": html}, {"text": "ok"}]) as server:
        client, metered = stack(protocol, server.url, log)
        assert client.complete(MESSAGES, 100).text == "ok"
    assert "server" in log[0] and metered.usage.calls == 2


def test_usage_past_what_a_call_can_be_billed_is_not_believed():
    """A server claiming 1e300 tokens for a call: counted at most at the call's max_tokens out and
    the prompt's bytes in, so the budget is not spent in one call (it had stopped the model)."""
    class Inflating:
        provider, model = "test", "inflating"

        def complete(self, messages, max_tokens):
            return Reply("ok", 10 ** 300, 10 ** 300, "inflating")
    metered = MeteredClient(Inflating(), Budget(max_calls=100, max_tokens=50_000, max_cost_usd=100.0),
                            Price(1.0, 1.0))
    for _ in range(5):
        metered.complete([{"role": "user", "content": "hi"}], 1_000)
    assert metered.usage.output_tokens == 5 * 1_000 and metered.usage.input_tokens < 5 * 100


def test_a_usage_count_past_floats_range_is_estimated():
    assert counted(10 ** 400, 77) == 77


def test_an_answer_longer_than_its_token_limit_is_cut_before_it_is_recorded_or_sent_back(tmp_path, monkeypatch):
    """3.5 MB of prose for a 16000-token answer, its usage saying 1 token: the transcript held it,
    the repair round sent it back, and the token budget refused that request as a worst case past
    its limit, which stopped the model for the rest of the run (thirty-eighth session)."""
    from scripts.llm_server import ScriptedServer
    from tests.test_providers import answer, openai_proposer
    monkeypatch.setenv("LLM_KERNELS_ON_CPU", "0")   # a plan episode: no unit check
    flood = json.dumps({**_CHAT, "choices": [{"index": 0, "message": {"role": "assistant", "content": "word " * 700_000}}],
                        "usage": {"prompt_tokens": 1, "completion_tokens": 1}})
    with ScriptedServer("openai", [{"raw": flood}, {"text": answer("plan_change", "")}]) as server:
        proposer = openai_proposer(tmp_path, monkeypatch, server.url)
        candidate = proposer.ask(paged_state())
    assert proposer.active and candidate is not None and len(server.requests) == 2
    assert len(json.dumps(server.requests[1]["body"])) < 400_000
    assert sum(f.stat().st_size for f in (tmp_path / "transcripts").iterdir()) < 1_000_000


def test_a_verdicts_detail_sent_back_to_the_model_is_bounded(tmp_path, monkeypatch):
    """A plan naming 8000 unknown slots (or a unit check's output: 12 lines of any length) made a
    repair round of hundreds of thousands of tokens, which the token budget's refusal of the next
    round turned into the model's stop for the run (thirty-eighth session)."""
    from scripts.llm_server import ScriptedServer
    from tests.test_providers import answer, openai_proposer
    monkeypatch.setenv("LLM_KERNELS_ON_CPU", "0")
    bogus = json.dumps({"plan": {"slots": {f"s{i}": "x" for i in range(8_000)}}})
    with ScriptedServer("openai", [{"text": f"```json\n{bogus}\n```"}, {"text": answer("plan_change", "")}]) as server:
        proposer = openai_proposer(tmp_path, monkeypatch, server.url)
        assert proposer.ask(paged_state()) is not None
    repair = server.requests[1]["body"]["messages"][-1]["content"]
    assert "unknown slot 's0'" in repair and "more characters cut" in repair and len(repair) < 5_000


@pytest.mark.parametrize("protocol", ["openai", "anthropic"])
def test_an_api_key_the_server_writes_back_is_not_logged_or_recorded(protocol, tmp_path):
    """"Incorrect API key provided: sk-..." in an error, or the key in an answer, had gone into
    results.log and the transcript as the server sent them (thirty-eighth session)."""
    from scripts.llm_server import ScriptedServer
    from agent.providers.anthropic import AnthropicChat
    from agent.providers.openai import OpenAIChat
    key = "sk-secret-0123456789"
    error = json.dumps({"error": {"message": f"Incorrect API key provided: {key}", "type": "x"}})
    steps = [{"status": 429, "raw": error, "retry_after": "0"}, {"text": f"the key is {key}"}, {"status": 401, "raw": error}]
    log = []
    with ScriptedServer(protocol, steps) as server:
        chat = (OpenAIChat if protocol == "openai" else AnthropicChat)("m", key, server.url, 5.0)
        recorded = RecordingClient(chat, tmp_path / "t.jsonl")
        client = RetryingClient(recorded, log.append, base_delay=0.0)
        assert client.complete([{"role": "user", "content": "hi"}], 100).text == "the key is ***"
        with pytest.raises(ChatError) as e:
            client.complete([{"role": "user", "content": "hi"}], 100)
    assert "Incorrect API key provided: ***" in e.value.message and "Incorrect API key provided: ***" in log[0]
    assert key not in (tmp_path / "t.jsonl").read_text() + "\n".join(log) + str(e.value)


def test_a_servers_long_error_message_is_cut_before_the_log_and_the_transcript(tmp_path):
    """A 429 whose message held 5 MB wrote 5 MB to results.log and to the transcript on every attempt:
    a run's 40 calls of such errors, gigabytes (thirty-eighth session)."""
    from scripts.llm_server import ScriptedServer
    from agent.providers.openai import OpenAIChat
    error = json.dumps({"error": {"message": "slow down " * 200_000, "type": "x"}})
    log = []
    with ScriptedServer("openai", [{"status": 429, "raw": error, "retry_after": "0"}, {"text": "ok"}]) as server:
        recorded = RecordingClient(OpenAIChat("m", "k", server.url, 5.0), tmp_path / "t.jsonl")
        assert RetryingClient(recorded, log.append, base_delay=0.0).complete([{"role": "user", "content": "hi"}], 100).text == "ok"
    assert "slow down" in log[0] and "more characters cut" in log[0] and len(log[0]) < 3_000
    assert (tmp_path / "t.jsonl").stat().st_size < 10_000
