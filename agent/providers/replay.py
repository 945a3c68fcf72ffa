"""Re-run a past run from its transcript, with no network (`--provider replay`).

The transcript (workspace/transcripts/*.jsonl, written by RecordingClient) holds every
attempt of the recorded run: the request, its hash, and the answer or the error. Replay
serves them in order through the same budget and retry layers, with the recorded run's
settings and budget, so a run whose evaluator verdicts are the same makes the same
decisions. Each request is compared with the recorded one; a difference (the prompt
changed because a timing did, or the code did) is reported with the first differing line,
and either tolerated (default: the recorded answers are re-judged by today's evaluator) or,
with LLM_REPLAY_STRICT=1, ends the LLM side of the run.
"""
from __future__ import annotations

import json
import os
import threading
from dataclasses import fields, replace
from pathlib import Path

from agent.providers.chat import REPLAY, ChatError, Log, Message, Reply, request_hash
from agent.providers.proposals import Verdict, code_digest
from evaluator.slot_shapes import ShapeTiming

TIMING = "timing"   # the transcript's record type of a unit timing

SOURCE_ENV, STRICT_ENV = "LLM_REPLAY_FROM", "LLM_REPLAY_STRICT"
SNIPPET_CHARS = 80


def first_difference(recorded: list[Message], now: list[Message]) -> str:
    """Where two requests part: message index, role, line, both versions of the line."""
    if len(recorded) != len(now):
        return f"{len(now)} messages, the recording has {len(recorded)}"
    for i, (a, b) in enumerate(zip(recorded, now)):
        if a.get("role") != b.get("role"):
            return f"message {i}: role {b.get('role')!r}, the recording has {a.get('role')!r}"
        if a.get("content") != b.get("content"):
            old, new = a.get("content", "").splitlines(), b.get("content", "").splitlines()
            for j in range(max(len(old), len(new))):
                x = old[j] if j < len(old) else "<end>"
                y = new[j] if j < len(new) else "<end>"
                if x != y:
                    return (f"message {i} ({b.get('role')}), line {j + 1}: now {y[:SNIPPET_CHARS]!r}, "
                            f"recorded {x[:SNIPPET_CHARS]!r}")
    return "max_tokens differs"


class TimingTape:
    """The unit worker's timings of passed answers, in the transcript: they are measurements
    (the clock), and the refinement turns and the next prompts depend on them, so a replay must
    see the recorded ones to make the same decisions. Recording appends one record per timed
    answer, keyed by its code's digest (parallel episodes may time in another order); replaying
    hands back the recorded timing of the same code instead of today's."""

    def __init__(self, path: Path | None = None, recorded: list[dict] | None = None):
        self.path = path
        self.recorded = None if recorded is None else {r.get("code"): r for r in recorded}
        self._lock = threading.Lock()

    def __call__(self, verdict: Verdict) -> Verdict:
        if not (verdict.timings or verdict.timing_error) or verdict.code is None:
            return verdict
        digest = code_digest(verdict.code)
        if self.recorded is not None:
            record = self.recorded.get(digest)
            if record is None:
                return verdict
            return replace(verdict, timings=tuple(ShapeTiming(**t) for t in record["timings"]),
                           timing_error=record.get("error"))
        if self.path is not None:
            line = json.dumps({"type": TIMING, "code": digest, "timings": [t.to_dict() for t in verdict.timings],
                               "error": verdict.timing_error})
            with self._lock, self.path.open("a") as f:
                f.write(line + "\n")
        return verdict


def load(path: Path) -> tuple[dict, list[dict]]:
    """(the start record, the call records in order)."""
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    start = next((r for r in records if r.get("type") == "start"), {})
    return start, [r for r in records if r.get("type") == "call"]


def latest(workspace: Path) -> Path:
    from agent.providers.llm import TRANSCRIPTS

    found = sorted((Path(workspace) / TRANSCRIPTS).glob("*.jsonl"), key=lambda p: (p.stat().st_mtime, p.name))
    if not found:
        raise RuntimeError(f"no transcript to replay in {Path(workspace) / TRANSCRIPTS} (set {SOURCE_ENV})")
    return found[-1]


class ReplayClient:
    """`ChatClient` that answers from a transcript."""

    provider = "replay"

    def __init__(self, path: Path, log: Log, strict: bool = False):
        self.path = Path(path)
        self.start, self.calls = load(self.path)
        self.model = self.start.get("model") or (self.calls[0]["model"] if self.calls else "unknown")
        self.log = log
        self.strict = strict
        self.position = 0              # how many recorded calls have been served
        self.served: set[int] = set()
        self._lock = threading.Lock()
        self.divergences = 0

    def _next_record(self, wanted: str) -> dict | None:
        """The first unserved recorded call with this request's hash, else the first unserved one:
        requests made in parallel (agent/pipeline.py) may come in another order than recorded."""
        with self._lock:
            unserved = [i for i in range(len(self.calls)) if i not in self.served]
            if not unserved:
                return None
            i = next((i for i in unserved if self.calls[i]["request_hash"] == wanted), unserved[0])
            self.served.add(i)
            self.position = len(self.served)
            return self.calls[i]

    def complete(self, messages: list[Message], max_tokens: int) -> Reply:
        record = self._next_record(request_hash(messages, max_tokens))
        if record is None:
            raise ChatError(REPLAY, f"the recording ends after {len(self.calls)} requests")
        if request_hash(messages, max_tokens) != record["request_hash"]:
            self.divergences += 1
            where = first_difference(record["messages"], messages) if record.get("max_tokens") == max_tokens \
                else f"max_tokens {max_tokens}, recorded {record.get('max_tokens')}"
            message = f"request {record['seq'] + 1} differs from the recording: {where}"
            if self.strict:
                raise ChatError(REPLAY, message)
            self.log(f"replay: warning: {message}; serving the recorded answer anyway")
        error = record.get("error")
        if error:
            raise ChatError(error["kind"], error["message"], error.get("retry_after"))
        return Reply(**record["reply"])


# Settings that change what the proposer does, and their value in runs recorded before they
# existed: a replay of such a run must behave as it did then (before pauses, a model with nothing
# usable was stopped at once: max_pauses 0).
BEFORE_RECORDED = {"max_pauses": 0}


def _restore(cls, recorded: dict | None, base):
    """A settings dataclass as recorded, on top of today's defaults; a field the recording lacks
    keeps today's default, or the behaviour of its time where BEFORE_RECORDED says."""
    for f in fields(cls):
        if recorded and f.name in recorded:
            setattr(base, f.name, recorded[f.name])
        elif recorded and f.name in BEFORE_RECORDED:
            setattr(base, f.name, BEFORE_RECORDED[f.name])
    return base


def create(options):
    """The LLM proposer answering from a transcript (agent/providers/__init__.py, `--provider replay`)."""
    from agent.providers.budget import Budget
    from agent.providers.llm import LLMSettings, build_proposer, workspace_log

    path = Path(getattr(options, "replay_from", None) or os.environ.get(SOURCE_ENV) or latest(options.workspace))
    log = getattr(options, "log", None) or workspace_log(options.workspace)
    client = ReplayClient(path, log, strict=os.environ.get(STRICT_ENV, "") not in ("", "0"))
    settings = _restore(LLMSettings, client.start.get("settings"), LLMSettings(model=client.model))
    budget = _restore(Budget, client.start.get("budget"), Budget())
    budget.max_seconds = None  # wall time is not reproducible; the recorded run's calls are the limit
    log(f"replay: {len(client.calls)} recorded requests of {client.start.get('provider', '?')}:{client.model} "
        f"from {path}")
    timings = [r for r in map(json.loads, path.read_text().splitlines()) if r.get("type") == TIMING]
    return build_proposer(options, client, settings, record=False, sleep=lambda seconds: None, budget=budget,
                          tape=TimingTape(recorded=timings))
