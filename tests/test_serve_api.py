"""The server over the tiny model's rendered engines, in process (FastAPI's TestClient, httpx's
ASGI transport): greedy output equal to driving the engine directly at any concurrency, the
OpenAI shapes, streaming, stop strings, errors, the queue bound, disconnects, an engine that
runs out of KV memory."""
from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from agent.plan import Plan
from agent.render import render_engine
from serve.api import create_app
from serve.sampler import SamplingParams
from serve.scheduler import GenerationRequest
from serve.tokenizer import ByteTokenizer
from tests.serve_helpers import KVBudget, engine_idle, greedy_direct, make_service

GREEDY = SamplingParams(temperature=0.0)
SERVED_CONTEXT = 96   # --max-context of the shared server: keeps the recompute engine's requests short
ASCII = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJ.,!?0123456789"


@pytest.fixture(scope="module")
def paged_engine_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("serve_engines") / "paged.py"
    path.write_text(render_engine(Plan("paged")))
    return path


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread for the module (conftest's `single_thread`, module-wide): the
    scheduler thread's tiny steps are per-op overhead, and on a busy 2-core machine a second
    spinning OpenMP thread makes each of them up to 100x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def served(tiny_model_large, recompute_engine_path):
    service, spy = make_service(recompute_engine_path, tiny_model_large.weight_dir, SERVED_CONTEXT, max_batch=8)
    service.start()
    yield service, spy, TestClient(create_app(service))
    service.stop()


def random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(ASCII + "éü€😀") for _ in range(n))


def complete(client, **body) -> dict:
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def sse_events(text: str) -> list:
    lines = [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


@pytest.mark.parametrize("engine,concurrency", [("recompute", 1), ("recompute", 8), ("paged", 1)])
def test_greedy_equals_engine_driven_directly(engine, concurrency, tiny_model_large, recompute_engine_path,
                                              paged_engine_path, test_seed):
    """Requests of different lengths arriving at different times, batched by the scheduler,
    give exactly the tokens the engine gives each alone (the recompute engine's rows do not
    depend on the batch; the paged engine's CPU GEMMs round by batch shape, so it is checked
    one request at a time)."""
    path = recompute_engine_path if engine == "recompute" else paged_engine_path
    rng = random.Random(test_seed)
    prompts = [random_text(rng, rng.randrange(1, 40)) for _ in range(8)]
    steps = [rng.randrange(4, 16) for _ in prompts]
    service, spy = make_service(path, tiny_model_large.weight_dir, max_batch=concurrency)
    service.start()

    async def one(client, i):
        await asyncio.sleep(0.003 * i)
        r = await client.post("/v1/completions", json={"prompt": prompts[i], "max_tokens": steps[i],
                                                       "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()

    async def run():
        transport = httpx.ASGITransport(app=create_app(service))
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as client:
            return await asyncio.gather(*(one(client, i) for i in range(len(prompts))))

    try:
        answers = asyncio.run(run())
    finally:
        service.stop()
    widest = max(len(ids) for kind, ids in spy.calls if kind == "decode")
    assert widest == 1 if concurrency == 1 else widest > 1, "the requests were not batched"
    tok = ByteTokenizer()
    expected = greedy_direct(path, tiny_model_large.config_path, tiny_model_large.weight_dir,
                             [(tok.encode(p, True), n) for p, n in zip(prompts, steps)])
    for prompt, n, answer, ids in zip(prompts, steps, answers, expected):
        assert answer["choices"][0]["text"] == tok.decode(ids)
        assert answer["choices"][0]["finish_reason"] == "length"
        assert answer["usage"] == {"prompt_tokens": len(prompt.encode()), "completion_tokens": n,
                                   "total_tokens": len(prompt.encode()) + n}


def test_scheduler_tokens_equal_engine(tiny_model_large, recompute_engine_path, test_seed):
    """The scheduler alone, token ids compared: 8 requests, staggered, ids reused as they finish."""
    rng = random.Random(test_seed + 1)
    jobs = [([rng.randrange(256) for _ in range(rng.randrange(1, 30))], rng.randrange(1, 10)) for _ in range(8)]
    service, spy = make_service(recompute_engine_path, tiny_model_large.weight_dir, max_batch=3)
    service.start()

    async def one(i):
        await asyncio.sleep(0.005 * i)
        _, outputs = service.scheduler.submit(GenerationRequest(jobs[i][0], jobs[i][1], GREEDY))
        ids = []
        while True:
            out = await outputs.get()
            ids.append(out.token)
            if out.finish_reason:
                return ids

    async def run():
        return await asyncio.gather(*(one(i) for i in range(len(jobs))))

    try:
        got = asyncio.run(run())
    finally:
        service.stop()
    assert got == greedy_direct(recompute_engine_path, tiny_model_large.config_path, tiny_model_large.weight_dir, jobs)
    assert engine_idle(spy)
    assert max(max(ids) for kind, ids in spy.calls if kind == "prefill") < 3   # ids reused: max_batch of them


def test_endpoints_and_shapes(served):
    service, _, client = served
    assert client.get("/health").json()["status"] == "ok"
    assert client.get("/ping").status_code == 200
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == service.name
    assert client.get(f"/v1/models/{service.name}").json() == models["data"][0]   # the client's models.retrieve
    assert client.get("/v1/models/other").json()["error"]["code"] == "model_not_found"
    chat = client.post("/v1/chat/completions", json={"model": "x", "messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 5, "temperature": 0}).json()
    assert chat["object"] == "chat.completion" and chat["model"] == "x"
    assert chat["choices"][0]["message"]["role"] == "assistant"
    assert chat["usage"]["completion_tokens"] == 5
    assert chat["usage"]["prompt_tokens"] == len(ByteTokenizer().render_chat([{"role": "user", "content": "hi"}], {}))
    inv = client.post("/invocations", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                                            "temperature": 0}).json()
    assert inv["choices"][0]["message"]["content"] == chat["choices"][0]["message"]["content"]
    assert client.post("/invocations", json={"prompt": "hi", "max_tokens": 2}).json()["object"] == "text_completion"


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_streaming_equals_non_streaming(served, route, test_seed):
    """A seeded sampled request gives the same text streamed or not; the stream's deltas are
    valid text, the last chunk carries the finish reason, usage comes when asked."""
    _, spy, client = served
    body = {"max_tokens": 12, "temperature": 0.9, "top_p": 0.9, "top_k": 50, "seed": test_seed % 1000}
    body.update({"prompt": "Once upon"} if route == "/v1/completions" else
                {"messages": [{"role": "user", "content": "Once upon"}]})
    whole = client.post(route, json=body).json()
    r = client.post(route, json={**body, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1]["usage"] == whole["usage"]
    chunks = [e["choices"][0] for e in events[:-1]]
    if route == "/v1/completions":
        text, expected = "".join(c["text"] for c in chunks), whole["choices"][0]["text"]
    else:
        assert chunks[0]["delta"]["role"] == "assistant"
        text = "".join(c["delta"].get("content", "") for c in chunks)
        expected = whole["choices"][0]["message"]["content"]
    assert text == expected
    assert chunks[-1]["finish_reason"] == "length" and all(c["finish_reason"] is None for c in chunks[:-1])
    assert engine_idle(spy)


def test_seeded_sampling_ignores_the_batch(served, test_seed):
    """A seeded request's output depends on its seed alone, not on what else is running."""
    _, _, client = served
    body = {"prompt": "abc", "max_tokens": 10, "temperature": 1.0, "seed": test_seed % 997}
    alone = complete(client, **body)["choices"][0]["text"]

    async def crowd():
        transport = httpx.ASGITransport(app=client.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as c:
            others = [c.post("/v1/completions", json={"prompt": "x" * i, "max_tokens": 8, "temperature": 1.0})
                      for i in range(1, 5)]
            results = await asyncio.gather(c.post("/v1/completions", json=body), *others)
            return results[0].json()["choices"][0]["text"]

    assert asyncio.run(crowd()) == alone


def test_stop_string_cuts_output(served):
    _, spy, client = served
    full = complete(client, prompt="The", max_tokens=16, temperature=0)["choices"][0]["text"]
    clean = [i for i in range(2, len(full) - 2) if "\ufffd" not in full[i:i + 2]]
    if not clean:
        pytest.skip("the greedy text has no clean two-character piece to stop at")
    stop = full[clean[0]:clean[0] + 2]
    cut = complete(client, prompt="The", max_tokens=16, temperature=0, stop=[stop, "\u2603never"])
    assert cut["choices"][0]["text"] == full[:full.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"
    streamed = client.post("/v1/completions", json={"prompt": "The", "max_tokens": 16, "temperature": 0,
                                                    "stop": stop, "stream": True})
    chunks = [e["choices"][0] for e in sse_events(streamed.text)]
    assert "".join(c["text"] for c in chunks) == full[:full.index(stop)]
    assert chunks[-1]["finish_reason"] == "stop"
    assert engine_idle(spy)


BAD = [
    ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": 3}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": [1, 99999]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": SERVED_CONTEXT}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x" * SERVED_CONTEXT}, 400, "prompt"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, 400, "messages.0.role"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/invocations", [1, 2], 400, None),
    # helper-35, thirty-sixth session: these were 500s
    ("/v1/completions", {"prompt": "x", "seed": 2**64}, 400, "seed"),
    ("/v1/completions", {"prompt": "a\ud800"}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udc00"}]}, 400, "messages.0.content"),
    # asked for and silently ignored before: a client took the answer for what it asked
    ("/v1/completions", {"prompt": "x", "logprobs": 2}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": 0}, 400, "logprobs"),   # OpenAI's: the sampled token's
    ("/v1/completions", {"prompt": "x", "echo": True}, 400, "echo"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True}, 400, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, 400,
     "top_logprobs"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"256": 5}}, 400, "logit_bias"),   # the vocabulary is 256
    ("/v1/completions", {"prompt": "x", "logit_bias": {"65": 101}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"A": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),   # OpenAI's [-2, 2]
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}},
     400, "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "frequency_penalty": -3}, 400,
     "frequency_penalty"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, 400, "best_of"),   # had answered one plain sample
    ("/v1/completions", {"prompt": "x", "suffix": "end"}, 400, "suffix"),   # had been dropped
]


@pytest.mark.parametrize("route,body,status,param", BAD)
def test_bad_input_answered_in_openai_shape(served, route, body, status, param):
    _, spy, client = served
    # JSON as a client library writes it, escapes and all (a lone surrogate travels as \\ud800)
    r = client.post(route, content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    assert complete(client, prompt="still", max_tokens=2)["usage"]["completion_tokens"] == 2
    assert engine_idle(spy)


def test_logit_bias_forces_and_bans_tokens_and_unasked_fields_pass(served):
    """logit_bias is applied (greedy, sampled, streamed): +100 forces a token, -100 bans one (every
    byte but "B" banned here). logprobs, echo and top_logprobs that ask for nothing are fine."""
    _, spy, client = served
    forced = complete(client, prompt="The", max_tokens=4, temperature=0, logit_bias={"65": 100})
    assert forced["choices"][0]["text"] == "AAAA"
    sampled = complete(client, prompt="The", max_tokens=4, temperature=1.0, seed=1, logit_bias={"67": 100})
    assert sampled["choices"][0]["text"] == "CCCC"
    banned = {str(i): -100 for i in range(256) if i != ord("B")}
    streamed = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                         "max_tokens": 3, "temperature": 0, "logit_bias": banned,
                                                         "stream": True})
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in sse_events(streamed.text)) == "BBB"
    plain = complete(client, prompt="The", max_tokens=4, temperature=0, logprobs=None, echo=False, logit_bias={},
                     top_logprobs=0, response_format={"type": "text"}, tools=[], presence_penalty=0,
                     frequency_penalty=0, best_of=1, suffix=None)
    assert plain["choices"][0]["text"] == complete(client, prompt="The", max_tokens=4, temperature=0)["choices"][0]["text"]
    assert engine_idle(spy)


def test_a_frequency_penalty_takes_turns_between_two_tokens(served):
    """Every byte but "A" and "B" banned, "A" 3 above "B" by logit_bias: greedy says "A" each time
    (the toy model's own logits are far closer than 3); with the largest frequency penalty (2 a
    time it was generated) "B" comes by the third token."""
    _, spy, client = served
    only_ab = {**{str(i): -100 for i in range(256) if chr(i) not in "AB"}, str(ord("A")): 3}
    plain = complete(client, prompt="The", max_tokens=8, temperature=0, logit_bias=only_ab)["choices"][0]["text"]
    penalized = complete(client, prompt="The", max_tokens=8, temperature=0, logit_bias=only_ab,
                         frequency_penalty=2.0)["choices"][0]["text"]
    assert plain == "A" * 8
    assert "B" in penalized[:3], penalized
    assert engine_idle(spy)


def test_context_limit_message(served):
    _, _, client = served
    limit = served[0].model.max_context
    r = client.post("/v1/completions", json={"prompt": "y" * (limit - 3), "max_tokens": 10})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert f"maximum context length is {limit} tokens" in r.json()["error"]["message"]
    ok = complete(client, prompt="y" * (limit - 3), temperature=0)   # default max_tokens: what fits
    assert ok["usage"]["total_tokens"] == limit - 3 + min(16, 3)


def test_framework_errors_in_openai_shape(served):
    _, _, client = served
    for r, status in [(client.get("/nope"), 404), (client.get("/v1/completions"), 405),
                      (client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}), 400),
                      (client.post("/v1/completions", content=b"x" * (9 << 20)), 413),
                      # chunked, no Content-Length: FastAPI's own 400 for a body it failed to read, before
                      (client.post("/v1/completions", content=(b"x" * (1 << 20) for _ in range(9)),
                                   headers={"content-type": "application/json"}), 413)]:
        assert r.status_code == status
        assert r.json()["error"]["code"] == status


def test_a_body_that_is_not_json_or_is_empty_is_named_so():
    """Not JSON had read "0: JSON decode error" with param "0", an empty body "body: Field
    required" (a new-user walkthrough). The errors as FastAPI reports them."""
    from serve.api import _validation_message
    assert _validation_message([{"type": "json_invalid", "loc": ("body", 0), "msg": "JSON decode error",
                                 "ctx": {"error": "Expecting value"}}]) == (
        "the body is not valid JSON: Expecting value", None)
    assert _validation_message([{"type": "missing", "loc": ("body",), "msg": "Field required"}]) == (
        "the body is empty: a JSON object is expected", None)
    assert _validation_message([{"type": "missing", "loc": ("body", "prompt"), "msg": "Field required"}]) == (
        "prompt: Field required", "prompt")


def test_queue_full_is_503_with_retry_after(tiny_model, recompute_engine_path):
    """The scheduler is not started, so the one queued request stays queued."""
    service, _ = make_service(recompute_engine_path, tiny_model.weight_dir, max_queue=1)

    async def run():
        service.scheduler.submit(GenerationRequest([1, 2, 3], 1))
        transport = httpx.ASGITransport(app=create_app(service))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})

    r = asyncio.run(run())
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "server_overloaded"


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_cancels_and_frees(tiny_model, recompute_engine_path, stream):
    """A client that leaves mid-request (raw ASGI: http.disconnect after the body, or after the
    first streamed chunk) has its request cancelled and its engine state removed."""
    service, spy = make_service(recompute_engine_path, tiny_model.weight_dir)
    service.start()
    app = create_app(service)
    body = json.dumps({"prompt": "hello", "max_tokens": 3000, "stream": stream}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
             "root_path": "", "scheme": "http", "server": ("t", 80), "client": ("c", 1),
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}

    async def run():
        gone = asyncio.Event()
        sent = []

        async def receive():
            if not sent:
                sent.append("body")
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        task = asyncio.ensure_future(app(scope, receive, send))
        for _ in range(2000):        # until the engine holds the request
            await asyncio.sleep(0.005)
            if spy.live:
                break
        assert spy.live, "the request never reached the engine"
        gone.set()
        await asyncio.wait_for(task, 30)

    try:
        asyncio.run(run())
        assert engine_idle(spy)
        stats = service.scheduler.stats()
        assert stats.live == 0 and stats.waiting == 0
    finally:
        service.stop()


@pytest.mark.parametrize("bad", ["narrow", "nan", "broken_step"])
def test_logits_the_engine_gets_wrong_fail_the_request_and_serving_goes_on(tiny_model, recompute_engine_path, bad):
    """Logits of the wrong width or holding NaN (NaN had been sampled as token 0), and a step that
    fails outside the engine's calls (the scheduler thread had died: every later request hung
    while /health said ok; helper-35, thirty-sixth session): the request fails, the next is served."""
    service, spy = make_service(recompute_engine_path, tiny_model.weight_dir)
    scheduler, broken = service.scheduler, [True]
    real_decode, real_step = spy.decode, scheduler._step

    def decode(ids, tokens):
        out = real_decode(ids, tokens)
        return out if not broken[0] else out[:, :5] if bad == "narrow" else out.fill_(float("nan"))

    def step(admitted, decoding):
        if broken[0]:
            raise RuntimeError("a bug of the server's own")
        real_step(admitted, decoding)
    if bad == "broken_step":
        scheduler._step = step
    else:
        spy.decode = decode
    service.start()
    client = TestClient(create_app(service))
    try:
        r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4})
        assert r.status_code == 500, r.text
        broken[0] = False
        assert client.get("/health").json()["status"] == "ok"
        assert complete(client, prompt="again", max_tokens=3)["usage"]["completion_tokens"] == 3
    finally:
        service.stop()


def test_a_prompt_slow_to_tokenize_does_not_stall_other_requests(tiny_model, recompute_engine_path):
    """Prompts are tokenized off the event loop: an 8 MB prompt had held an HF tokenizer (and the
    loop) for seconds, every other request's stream frozen meanwhile."""
    service, _ = make_service(recompute_engine_path, tiny_model.weight_dir)
    tokenizer, entered, left = service.model.tokenizer, threading.Event(), []
    real = tokenizer.encode

    def slow(text, add_special_tokens):
        entered.set()
        time.sleep(0.5)
        left.append(time.monotonic())
        return real(text, add_special_tokens)
    tokenizer.encode = slow
    service.start()

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(service)), base_url="http://t") as c:
            long = asyncio.ensure_future(c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}))
            while not entered.is_set():
                await asyncio.sleep(0.001)
            assert (await c.get("/ping")).status_code == 200
            answered = time.monotonic()
            assert (await long).status_code == 200
            return answered
    try:
        assert asyncio.run(run()) < left[0]
    finally:
        service.stop()


def test_an_engine_without_the_api_is_refused_at_load(tmp_path, tiny_model):
    engine = tmp_path / "no_api.py"
    engine.write_text("def create_engine(model_config, weight_dir, device='cuda'):\n    return object()\n")
    with pytest.raises(Exception, match="without prefill, decode, remove"):
        make_service(engine, tiny_model.weight_dir)


def test_a_dead_scheduler_thread_is_a_503_and_health_says_so(tiny_model, recompute_engine_path):
    """What the step's guard cannot catch (an engine calling sys.exit) ends the thread: requests
    get a 503 at once and /health an error, instead of a wait with no end; the request in flight
    when it died too (it had hung, its client waiting for ever)."""
    service, _ = make_service(recompute_engine_path, tiny_model.weight_dir)

    def step(admitted, decoding):
        raise SystemExit(3)
    service.scheduler._step = step
    service.start()
    app = create_app(service)
    client = TestClient(app)

    async def first():   # the request in flight when the thread died
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await asyncio.wait_for(c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}), 10)
    try:
        r = asyncio.run(first())
        assert r.status_code == 503 and "engine thread has stopped" in r.json()["error"]["message"]
        service.scheduler._thread.join(10)
        assert client.get("/health").status_code == 503
        r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 503 and "engine thread has stopped" in r.json()["error"]["message"]
    finally:
        service.stop()


def start_when_queued(service, n: int) -> None:
    """Start the scheduler once `n` requests wait: its first step admits them all at once."""
    import time
    deadline = time.monotonic() + 30
    while service.scheduler.stats().waiting < n:
        assert time.monotonic() < deadline, "the requests never reached the queue"
        time.sleep(0.002)
    service.start()


@pytest.mark.parametrize("runs_out", ["prefill", "decode"])
def test_a_burst_beyond_kv_memory_waits_instead_of_failing(runs_out, tiny_model, recompute_engine_path, test_seed):
    """More requests at once than the engine's KV memory holds (an engine whose pool cannot grow
    raises torch.OutOfMemoryError; they had been 500s): every one is answered, with the engine's
    own greedy tokens, whether the prompts together overflow it at prefill or the generations at
    decode (then the requests of the failed call, whose state it may have half-written, are
    prefilled again from their prompt and the tokens so far). Room for 60 tokens; 6 requests of
    up to 24 (prefill: prompts of 12-17, 6 tokens out) or of 24 (decode: prompts of 4, 20 out)."""
    rng = random.Random(test_seed)
    if runs_out == "prefill":
        jobs = [(random_text(rng, rng.randrange(12, 18)), 6) for _ in range(6)]
    else:
        jobs = [(random_text(rng, 4), 20) for _ in range(6)]
    service, spy = make_service(recompute_engine_path, tiny_model.weight_dir, max_batch=8)
    budget = spy.engine = KVBudget(spy.engine, capacity=60)

    async def run():
        transport = httpx.ASGITransport(app=create_app(service))
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as client:
            asks = [asyncio.ensure_future(client.post("/v1/completions", json={"prompt": p, "max_tokens": n,
                                                                                "temperature": 0}))
                    for p, n in jobs]
            await asyncio.to_thread(start_when_queued, service, len(jobs))
            return await asyncio.gather(*asks)

    try:
        answers = asyncio.run(run())
        stats = service.scheduler.stats()
    finally:
        service.stop()
    assert [r.status_code for r in answers] == [200] * len(jobs), [r.text for r in answers if r.status_code != 200]
    assert runs_out in budget.ran_out and stats.requeued > 0
    tok = ByteTokenizer()
    expected = greedy_direct(recompute_engine_path, tiny_model.config_path, tiny_model.weight_dir,
                             [(tok.encode(p, True), n) for p, n in jobs])
    assert [r.json()["choices"][0]["text"] for r in answers] == [tok.decode(ids) for ids in expected]
    assert engine_idle(spy) and stats.room is None   # the cap lifted once the engine emptied
    assert TestClient(create_app(service)).get("/health").json()["running_limit"] == 8


def test_a_request_that_cannot_fit_alone_is_a_400_and_serving_goes_on(tiny_model, recompute_engine_path):
    """A request the engine runs out of memory for with nothing else running can never be served:
    it fails alone, with a 400 that says so (code out_of_memory), whether its prompt does not fit
    or its generation outgrows the memory (streamed: an error event), and the next is served."""
    service, spy = make_service(recompute_engine_path, tiny_model.weight_dir)
    spy.engine = KVBudget(spy.engine, capacity=40)
    service.start()
    client = TestClient(create_app(service))
    try:
        for body in [{"prompt": "p" * 50, "max_tokens": 2}, {"prompt": "p" * 30, "max_tokens": 20}]:
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["code"] == "out_of_memory" and error["type"] == "invalid_request_error"
            assert "ran out of memory holding this request alone" in error["message"]
        streamed = client.post("/v1/completions", json={"prompt": "p" * 30, "max_tokens": 20, "stream": True})
        events = sse_events(streamed.text)
        assert events[-1]["error"]["code"] == "out_of_memory"
        assert "choices" in events[0]   # what fitted went out, then the error
        assert complete(client, prompt="p" * 30, max_tokens=8)["usage"]["completion_tokens"] == 8
        assert engine_idle(spy)
    finally:
        service.stop()


def test_the_paged_engine_out_of_pool_memory_serves_the_burst_then_the_next(tiny_model, tmp_path):
    """The paged engine itself, its pool (32 tokens at first) bounded at 160 tokens as a full device
    would bound it (its growth raises torch.OutOfMemoryError): a burst of 6 requests of up to 3
    blocks against room for 9 is served whole; a lone request past the pool is a 400, and the
    engine, whose failed growth had dropped its pools and not made them again (the next request
    was a 500), serves the next one."""
    engine = tmp_path / "paged_small.py"
    engine.write_text(render_engine(Plan("paged", params={"cache_tokens": 32, "block_size": 16})))
    service, spy = make_service(engine, tiny_model.weight_dir, max_batch=8)
    pool = spy.engine._pool

    def bounded(shape):
        if shape[0] > 160:
            raise torch.OutOfMemoryError(f"CUDA out of memory: a pool of {shape[0]} tokens (a test's bound)")
        return pool(shape)
    spy.engine._pool = bounded
    rng = random.Random(3)
    prompts = [random_text(rng, rng.randrange(20, 30)) for _ in range(6)]

    async def run():
        transport = httpx.ASGITransport(app=create_app(service))
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as client:
            asks = [asyncio.ensure_future(client.post("/v1/completions", json={"prompt": p, "max_tokens": 8}))
                    for p in prompts]
            await asyncio.to_thread(start_when_queued, service, len(prompts))
            return await asyncio.gather(*asks)

    try:
        answers = asyncio.run(run())
        assert [r.status_code for r in answers] == [200] * len(prompts), [r.text for r in answers]
        assert all(r.json()["usage"]["completion_tokens"] == 8 for r in answers)
        assert service.scheduler.stats().requeued > 0
        client = TestClient(create_app(service))
        r = client.post("/v1/completions", json={"prompt": "p" * 200, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["code"] == "out_of_memory", r.text
        assert complete(client, prompt="still here", max_tokens=4)["usage"]["completion_tokens"] == 4
        assert engine_idle(spy)
    finally:
        service.stop()
