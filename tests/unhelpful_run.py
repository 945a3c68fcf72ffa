"""A whole CPU run against a slow, unhelpful OpenAI-compatible server (issue 23):

    nice -n 10 python3 -m tests.unhelpful_run [--budget 240] [--parallel 4] [--keep DIR]

Starts a server on 127.0.0.1 that answers in seconds, and badly: wrong kernels, truncated
answers, HTTP 429 with retry-after headers, off-topic prose, code that does not parse, a body
that is not JSON, a policy violation, a correct but slower kernel, and now and then no answer
before the client's timeout. Then runs `bash run.sh --provider openai --device cpu` on a tiny
model with OPENAI_BASE_URL pointing at it, and checks what issue 23 asks of such a run: the
server was asked several times, with requests overlapping; no request started that could
outlive the run; the run ended with exit 0 and a workspace/engine.py whose verdict passed.
It prints the server's counts and results.log's pipeline lines (episodes in flight,
candidates judged per minute). Exit 0 when every check holds, 1 otherwise.

Minutes long, so no default test runs it; tests/test_search.py checks the same properties
offline in seconds with a faked judge.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from agent.workspace import RESULTS_LOG, Workspace
from tests.conftest import TINY_CONFIG, make_model_dir
from tests.test_providers import REPO, ScriptedServer, answer

REQUEST_TIMEOUT_S = 10.0      # LLM_TIMEOUT_S of the run
SLOW_S = (2.0, 6.0)           # every answer takes this long (uniform), except the hung ones
HANG_S = REQUEST_TIMEOUT_S + 5
MAX_STEPS = 400               # more than the run's call budget can use
PIPELINE_LINE = re.compile(r"in flight|candidates judged per minute")
OFF_TOPIC = ("Great question! Kernel performance depends on many factors. I would suggest profiling "
             "first and considering a larger batch size. Let me know if you need anything else.")

# What each request gets, in turn. "slower" is correct but slower: a model variant the whole
# engine judges on the CPU, the path a real model's kernels take.
BEHAVIOURS = ("wrong", "rate_limited", "truncated", "off_topic", "syntax", "not_json", "hostile",
              "slower", "hang")


@dataclass
class RunReport:
    exit_code: int
    requests: int
    max_in_flight: int
    late_requests: int        # arrived too late to be answered within the run's budget
    engine_passed: bool
    pipeline_lines: list[str]
    behaviours: dict[str, int]

    def failures(self) -> list[str]:
        checks = {"run.sh exited 0": self.exit_code == 0,
                  "the server was asked several times (>= 3)": self.requests >= 3,
                  "requests overlapped (max in flight >= 2)": self.max_in_flight >= 2,
                  "no request started that could outlive the run": self.late_requests == 0,
                  "workspace/engine.py exists and its verdict passed": self.engine_passed,
                  "results.log states episodes in flight and candidates per minute": bool(self.pipeline_lines)}
        return [name for name, ok in checks.items() if not ok]


class UnhelpfulServer(ScriptedServer):
    """ScriptedServer whose steps cycle through BEHAVIOURS, each after SLOW_S seconds."""

    def __init__(self, seed: int):
        rng = random.Random(seed)
        kinds = itertools.islice(itertools.cycle(BEHAVIOURS), MAX_STEPS)
        super().__init__("openai", [self._step(kind, rng) for kind in kinds])
        self.given: Counter[str] = Counter()   # behaviour -> requests that got it

    @staticmethod
    def _step(kind: str, rng: random.Random) -> dict:
        sleep = HANG_S if kind == "hang" else rng.uniform(*SLOW_S)
        if kind == "rate_limited":
            return {"kind": kind, "sleep": sleep, "status": 429, "retry_after": "1",
                    "headers": {"retry-after-ms": "1000", "x-ratelimit-remaining-requests": "0"}}
        if kind == "not_json":
            return {"kind": kind, "sleep": sleep, "raw": '{"id": "chatcmpl-1", "choices": [{"message": '}
        return {"kind": kind, "sleep": sleep, "text": "late" if kind == "hang" else ""}

    def respond(self, step: dict, body: dict):
        """The step's answer, written for the variant the request asks about."""
        with self.lock:
            self.given[step["kind"]] += 1
        variant = (re.findall(r"__(llm_\d+)", json.dumps(body.get("messages"))) or ["llm_1"])[0]
        text = {"wrong": lambda: answer("02_unit_check_fails", variant),
                "truncated": lambda: answer("05_correct_faster", variant)[:120],
                "off_topic": lambda: OFF_TOPIC,
                "syntax": lambda: answer("01_syntax_error", variant),
                "hostile": lambda: answer("03_policy_violation", variant),
                "slower": lambda: answer("04_correct_slower", variant)}.get(step["kind"])
        return super().respond({**step, "text": text()} if text else step, body)

def run(budget: float, parallel: int, root: Path, seed: int) -> RunReport:
    """One `bash run.sh` against the server; the workspace and model under `root`."""
    model = make_model_dir(root / "model", TINY_CONFIG)
    workspace = root / "workspace"
    env = {**{k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}, "OPENAI_MODEL": "unhelpful-1",
           "LLM_PRICE_PER_MTOK": "0,0", "LLM_TIMEOUT_S": str(REQUEST_TIMEOUT_S), "LLM_RETRY_DELAY_S": "1",
           "LLM_KERNELS_ON_CPU": "1", "LLM_PARALLEL": str(parallel)}
    with UnhelpfulServer(seed) as server:
        env["OPENAI_BASE_URL"] = server.url
        start = time.monotonic()
        proc = subprocess.run(["bash", str(REPO / "run.sh"), "--provider", "openai", "--device", "cpu",
                               "--budget", str(budget), "--config", str(model.config_path),
                               "--weights", str(model.weight_dir), "--workspace", str(workspace),
                               "--seed", str(seed)], env=env, cwd=REPO)
        with server.lock:
            arrivals = [r["arrival"] for r in server.requests]
            requests, max_in_flight = len(server.requests), server.max_in_flight
            behaviours = {kind: server.given[kind] for kind in BEHAVIOURS}
    # an arrival after this could not be answered (timeout) within the run's budget
    late = sum(1 for a in arrivals if a + REQUEST_TIMEOUT_S > start + budget)
    verdict = Workspace(workspace).installed_verdict()
    log = (workspace / RESULTS_LOG).read_text() if (workspace / RESULTS_LOG).exists() else ""
    return RunReport(proc.returncode, requests, max_in_flight, late,
                     verdict is not None and verdict["result"]["status"] == "passed",
                     [line.strip() for line in log.splitlines() if PIPELINE_LINE.search(line)], behaviours)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget", type=float, default=240.0, help="the run's --budget, seconds")
    p.add_argument("--parallel", type=int, default=4, help="LLM_PARALLEL: model episodes in flight")
    p.add_argument("--seed", type=int, default=random.randrange(2**31), help="the server's delays and the run's seed")
    p.add_argument("--keep", type=Path, help="leave the workspace and model here (default: a temporary folder)")
    a = p.parse_args(argv)
    if a.keep:
        a.keep.mkdir(parents=True, exist_ok=True)
        report = run(a.budget, a.parallel, a.keep, a.seed)
    else:
        with tempfile.TemporaryDirectory(prefix="unhelpful-run-") as tmp:
            report = run(a.budget, a.parallel, Path(tmp), a.seed)
    print(f"\nunhelpful server (seed {a.seed}): {report.requests} requests, at most {report.max_in_flight} in flight "
          f"at once; answers given: " + ", ".join(f"{k} {n}" for k, n in report.behaviours.items()))
    print(f"run.sh exit {report.exit_code}; engine.py passed: {report.engine_passed}; "
          f"requests that could outlive the run: {report.late_requests}")
    for line in report.pipeline_lines[-6:]:
        print(f"  results.log: {line}")
    failures = report.failures()
    for name in failures:
        print(f"FAILED: {name}", file=sys.stderr)
    print("all checks hold" if not failures else f"{len(failures)} check(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
