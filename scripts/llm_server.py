"""Servers on 127.0.0.1 that play a model, over the OpenAI chat-completions or Anthropic messages
protocol, for the real SDK clients and everything behind them (retries, budget, transcript,
extraction, policy, unit check, the loop).

* ScriptedServer answers from a script of steps (answers, errors, delays): the tests' model.
* GoodModel answers the agent's real prompts as a capable kernel writer would, from the answers
  kept in tests/fixtures/llm/good/ (the library's own kernels for the slot asked, written as a
  model's answer): issue 23's scripted-model check (`python3 -m scripts.gpu scripted-search`)
  and its CPU test (tests/test_scripted_search.py).

Standard library only; nothing of agent/ or evaluator/ imports it.
"""
from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

GOOD_ANSWERS = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "llm" / "good"
VARIANT_MARK = "VARIANT"    # the fixtures' placeholder for the variant name the prompt asks for
# The first line of templates/prompts/kernel.j2: the variant and the slot asked for.
KERNEL_ASK = re.compile(r"Write a faster variant `(\w+)` of the slot `(\w+)`")
# A line of the plan menu (agent/providers/prompts.py plan_menu) naming a slot's variants.
MENU_LINE = re.compile(r"^  - `(\w+)`: (.+)$", re.MULTILINE)
MODEL_VARIANT = re.compile(r"llm_\d+")
NOTHING_BETTER = ("I have no faster version of this slot than the one I already gave; the current "
                  "variant is as far as I can take it at these shapes.")


class ScriptedServer:
    """OpenAI chat-completions or Anthropic messages on 127.0.0.1, answering from a script.

    A step is {"text": str} (an answer), {"status": int, "retry_after": str} (an error),
    {"raw": str | bytes} (a body sent as it is, which need not parse, nor be UTF-8), or any of them with "sleep":
    seconds first (a slow server, for client timeouts) and "headers": {name: value}. When the
    script runs out every request gets HTTP 500. `max_in_flight`: the most requests it held
    at once; `spans`: (arrival, end) of each request, time.monotonic()."""

    def __init__(self, protocol: str, steps: list[dict]):
        self.protocol = protocol
        self.steps = list(steps)
        self.requests: list[dict] = []
        self.spans: list[tuple[float, float]] = []
        self.in_flight = self.max_in_flight = 0
        self.lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                arrival = time.monotonic()
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with owner.lock:
                    owner.requests.append({"path": self.path, "body": body, "arrival": arrival})
                    step = owner.steps.pop(0) if owner.steps else {"status": 500}
                    owner.in_flight += 1
                    owner.max_in_flight = max(owner.max_in_flight, owner.in_flight)
                try:
                    time.sleep(step.get("sleep", 0))
                    self._send(step, body)
                finally:
                    with owner.lock:
                        owner.in_flight -= 1
                        owner.spans.append((arrival, time.monotonic()))

            def _send(self, step: dict, body: dict) -> None:
                status, payload = owner.respond(step, body)
                raw = step.get("raw")
                data = json.dumps(payload).encode() if raw is None else raw if isinstance(raw, bytes) else raw.encode()
                headers = {**({"Retry-After": step["retry_after"]} if "retry_after" in step else {}),
                           **step.get("headers", {})}
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    for name, value in headers.items():
                        self.send_header(name, value)
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (a timeout test)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address
        return f"http://{host}:{port}" + ("/v1" if self.protocol == "openai" else "")

    def respond(self, step: dict, body: dict) -> tuple[int, dict]:
        status = step.get("status", 200)
        if status != 200:
            if self.protocol == "openai":
                return status, {"error": {"message": f"scripted {status}", "type": "server_error", "code": None}}
            return status, {"type": "error", "error": {"type": "api_error", "message": f"scripted {status}"}}
        text = step.get("text", "")
        n_in = sum(len(str(m.get("content", ""))) for m in body.get("messages", [])) // 4 + 1
        n_out = len(text) // 4
        if self.protocol == "openai":
            return 200, {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": body["model"],
                         "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                      "finish_reason": "stop"}],
                         "usage": {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}}
        return 200, {"id": "msg_1", "type": "message", "role": "assistant", "model": body["model"],
                     "content": [{"type": "text", "text": text}] if text else [],
                     "stop_reason": "end_turn", "stop_sequence": None,
                     "usage": {"input_tokens": n_in, "output_tokens": n_out}}

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


class GoodModel(ScriptedServer):
    """A good model: for a kernel prompt, the slot's fixture answer under the variant name asked
    for. A slot with a `<slot>.slow.md` fixture first gets that (correct, clearly slower: the
    refinement turn that follows gets the fast one, and a turn after the fast one a plan change:
    it has nothing better). A new episode on a slot whose variant of its own the prompt's menu
    lists gets a plan change instead, the best plan with the newest model variant of every slot
    the menu lists (a good model stacks its own kernels), or, with none to stack, a plain
    sentence (no code), as does one whose fast answer this process sent that is still on its way
    to the menu (another episode's unit check). One on a slot whose fast answer an earlier
    process sent (`remembered`) but whose variant the menu does not list (it never reached the
    run: cut in flight) gets the fast answer again, once, as a model reading the prompt would
    write it again. A plan prompt gets the same plan change. It never names a library variant:
    kernels come from it alone. `answers`: (slot or "plan", what it sent) in order, for the
    report. `memory()` is what it must keep for a run continued in another process (`--resume`):
    the slots whose fast answer it sent; `remembered` takes it back."""

    def __init__(self, protocol: str = "openai", fixtures: Path = GOOD_ANSWERS, remembered: dict | None = None):
        super().__init__(protocol, [])
        self.fixtures = fixtures
        self.answers: list[tuple[str, str]] = []
        self._fast_sent: set[str] = set((remembered or {}).get("fast_sent", []))
        # sent by an earlier process and not on this run's menu when first asked here: written once more
        self._lost: set[str] = set(self._fast_sent)

    def memory(self) -> dict:
        with self.lock:
            return {"fast_sent": sorted(self._fast_sent)}

    def respond(self, step: dict, body: dict) -> tuple[int, dict]:
        return super().respond({"text": self.reply(body.get("messages", []))}, body)

    def reply(self, messages: list[dict]) -> str:
        prompts = [_text(m) for m in messages if m.get("role") == "user"]
        asked = KERNEL_ASK.search(prompts[0]) if prompts else None
        if asked is None:
            return self._record("plan", _stack(prompts[0] if prompts else ""))
        variant, slot = asked.groups()
        answered = [_text(m) for m in messages if m.get("role") == "assistant"]
        listed = slot in _own_variants(prompts[0])
        with self.lock:
            slow, fast = self.fixtures / f"{slot}.slow.md", self.fixtures / f"{slot}.md"
            fast_text = fast.read_text().replace(VARIANT_MARK, variant) if fast.is_file() else None
            # Nothing better to write: the fast answer sent in this episode, its variant on the menu,
            # or sent by this process and still on its way there (another episode's unit check).
            in_flight = slot in self._fast_sent and slot not in self._lost
            if fast_text is None or fast_text in answered or in_flight or (listed and not answered):
                return self._record(slot, _stack(prompts[0]))
            if not answered and slot not in self._fast_sent and slow.is_file():
                return self._record(slot, slow.read_text().replace(VARIANT_MARK, variant), "slow")
            again = not answered and slot in self._lost
            self._lost.discard(slot)
            self._fast_sent.add(slot)
            return self._record(slot, fast_text, "fast again" if again else "fast")

    def _record(self, what: str, text: str, kind: str = "") -> str:
        self.answers.append((what, kind or ("plan change" if "```json" in text else "no plan")))
        return text


def _text(message: dict) -> str:
    """A message's text (Anthropic's may be a list of blocks)."""
    content = message.get("content", "")
    if isinstance(content, list):
        return "".join(b.get("text", "") for b in content if isinstance(b, dict))
    return str(content)


def _own_variants(prompt: str) -> dict[str, str]:
    """slot -> the newest model-written variant the prompt's menu lists for it."""
    start = prompt.find("- slot variants on this device:")
    slots = {}
    for slot, names in MENU_LINE.findall(prompt[start:] if start >= 0 else ""):
        ours = MODEL_VARIANT.findall(names)
        if ours:
            slots[slot] = max(ours, key=lambda n: int(n.split("_")[1]))
    return slots


def _stack(prompt: str) -> str:
    """The plan change that puts the newest model-written variant of each slot the prompt's menu
    lists into the best plan; a sentence without a plan when the menu lists none."""
    slots = _own_variants(prompt)
    if not slots:
        return NOTHING_BETTER
    plan = {"plan": {"slots": slots}, "why": "combine the variants I wrote, each checked on its own"}
    return f"Together they should add up:\n\n```json\n{json.dumps(plan)}\n```\n"
