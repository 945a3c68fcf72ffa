"""`python -m serve` as a user starts it: a real socket, /health, completions through the
official `openai` client, the benchmark client against it, then terminated; bad inputs end with one line and exit code 2."""
from __future__ import annotations

import contextlib
import json
import random
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.conftest import SINGLE_THREAD_ENV

STARTUP_SECONDS = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def served(engine: Path, weights: Path, *flags: str, process: list | None = None):
    """`python -m serve` on a free loopback port until the block ends: its base URL (its process
    appended to `process` if given)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "serve", "--engine", str(engine), "--weights", str(weights),
                             "--port", str(port), "--device", "cpu", "--max-context", "64", "--log-level", "warning",
                             *flags], env=SINGLE_THREAD_ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if process is not None:
        process.append(proc)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_SECONDS
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                health = httpx.get(f"{base}/health", timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the server did not come up"
                time.sleep(0.2)
        assert health.status_code == 200 and health.json()["status"] == "ok"
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_serve_starts_answers_and_stops(tiny_model, recompute_engine_path, tmp_path):
    with served(recompute_engine_path, tiny_model.weight_dir) as base:
        openai = pytest.importorskip("openai")
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=4, temperature=0)
        assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 4
        stream = client.completions.create(model="tiny", prompt="abc", max_tokens=4, temperature=0, stream=True)
        assert [c.choices[0].finish_reason for c in stream][-1] == "length"
        out = tmp_path / "bench.json"
        bench = subprocess.run([sys.executable, "-m", "serve.bench", "--url", base, "--concurrency", "1,3",
                                "--requests", "3", "--warmup", "1", "--input-len", "16", "--output-len", "6",
                                "--classes", "short", "--out", str(out)], capture_output=True, text=True, timeout=120)
        assert bench.returncode == 0, bench.stderr
        report = json.loads(out.read_text())
        assert [r["output_tokens"] for r in report["levels"]] == [18, 18]   # ignore_eos: every token counted
        assert report["classes"]["short"]["clipped"] and report["classes"]["short"]["input_len"] == 32


CONCURRENT = 32


def test_32_concurrent_greedy_requests_answer_as_one_at_a_time(tiny_model, recompute_engine_path):
    """The official client, 32 requests at once on loopback (batched by the scheduler): each greedy
    answer and its usage equal the same request sent alone. (The recompute engine computes each
    request on its own, so batching may not change a bit; the paged engine's CPU GEMMs round by
    batch size, docs/serving.md.)"""
    openai = pytest.importorskip("openai")
    rng = random.Random()
    prompts = ["".join(rng.choice("abcdefghij ") for _ in range(rng.randint(3, 20))) for _ in range(CONCURRENT)]
    with served(recompute_engine_path, tiny_model.weight_dir) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)

        def ask(prompt: str):
            answer = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
            return answer.choices[0].text, answer.usage.prompt_tokens, answer.usage.completion_tokens

        alone = [ask(p) for p in prompts]
        with ThreadPoolExecutor(CONCURRENT) as pool:
            together = list(pool.map(ask, prompts))
    assert together == alone
    assert [u for _, u, _ in alone] == [len(p.encode()) for p in prompts]   # the byte tokenizer
    assert all(n == 8 for _, _, n in alone)


def test_serve_bad_inputs_exit_2(tmp_path, tiny_model):
    done = subprocess.run([sys.executable, "-m", "serve", "--engine", str(tmp_path / "none.py"),
                           "--weights", str(tiny_model.weight_dir)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("error: no engine at")
    port = subprocess.run([sys.executable, "-m", "serve", "--port", "99999"], capture_output=True, text=True, timeout=60)
    assert port.returncode == 2 and "99999 is not a TCP port" in port.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("argv,words", [(["--log-level", "loud"], "argument --log-level: invalid choice"),
                                         (["--device", "tpu"], "argument --device: invalid choice"),
                                         (["--shutdown-grace", "-1"], "-1 is not a non-negative number"),
                                         (["--shutdown-grace", "nan"], "nan is not a non-negative number")])
def test_bad_serve_flags_are_refused_by_the_parser(capsys, argv, words):
    """`--log-level loud` had loaded the engine, then ended in uvicorn's KeyError traceback;
    `--device tpu` served "on tpu"; `--shutdown-grace -1` cut every stop at once (a new-user walkthrough)."""
    from serve.__main__ import parse_args
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2 and words in capsys.readouterr().err
    assert parse_args(["--log-level", "DEBUG"]).log_level == "debug"


def test_a_host_that_does_not_resolve_is_not_called_a_busy_port(capsys, monkeypatch):
    """It had said "(another server there? pick one with --port)"."""
    from serve.__main__ import main
    monkeypatch.delenv("RUN_SH_CALLER_DIR", raising=False)
    assert main(["--host", "no.such.host.invalid", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: cannot listen on no.such.host.invalid:0") and "--port" not in err[0]


def test_a_relative_engine_path_through_run_sh_serve_is_the_callers(tmp_path, tiny_model):
    """`bash run.sh serve` runs Python from the repository; a relative --engine still names the
    caller's file (agent/caller.py)."""
    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run(["bash", str(repo / "run.sh"), "serve", "--engine", "none.py", "--weights",
                           str(tiny_model.weight_dir)], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**SINGLE_THREAD_ENV, "PYTHON": sys.executable})
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith(f"error: no engine at {tmp_path / 'none.py'}"), done.stderr
    # and with no --engine, run.sh's AGENT_WORKSPACE names the workspace, from the caller's folder too
    done = subprocess.run(["bash", str(repo / "run.sh"), "serve", "--weights", str(tiny_model.weight_dir)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**SINGLE_THREAD_ENV, "PYTHON": sys.executable, "AGENT_WORKSPACE": "ws"})
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith(f"error: no engine at {tmp_path / 'ws' / 'engine.py'}")


def test_a_busy_port_is_one_line_before_the_engine_loads(tmp_path, tiny_model, recompute_engine_path):
    """A second server on a port in use had loaded its engine, then failed among uvicorn's lines
    (a new-user walkthrough): it says so first, in one line, exit 2."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "serve", "--engine", str(recompute_engine_path), "--weights",
                               str(tiny_model.weight_dir), "--port", str(port)], capture_output=True, text=True,
                              timeout=60)
    assert done.returncode == 2 and "loading" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        f"error: cannot listen on 127.0.0.1:{port}: Address already in use (another server there? pick one with --port)"]


def test_a_stop_cuts_requests_in_flight_after_the_grace(tiny_model, recompute_engine_path):
    """SIGTERM with a long generation in flight: the server exits once --shutdown-grace has passed,
    not when the generation would have ended (it had waited for every one, however long)."""
    import threading
    process: list = []
    with served(recompute_engine_path, tiny_model.weight_dir, "--max-context", "4096", "--shutdown-grace", "1",
                process=process) as base:
        def long_request():
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(f"{base}/v1/completions", json={"prompt": "a", "max_tokens": 4000, "stream": True,
                                                           "ignore_eos": True}, timeout=120)
        threading.Thread(target=long_request, daemon=True).start()
        time.sleep(1.5)
        start = time.monotonic()
        process[0].terminate()
        process[0].wait(timeout=60)
        assert time.monotonic() - start < 20


def test_a_second_ctrl_c_exits_at_once_quietly_with_130(tiny_model, recompute_engine_path):
    """Ctrl-C twice with a long generation in flight: the first starts the graceful stop (up to
    --shutdown-grace, 30 s here), the second ends the process at once, with 130 and one line. It
    had printed a traceback for each cancelled request (and the lifespan's), then exited 0."""
    import signal
    import threading
    process: list = []
    with served(recompute_engine_path, tiny_model.weight_dir, "--max-context", "4096", process=process) as base:
        def long_request():
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(f"{base}/v1/completions", json={"prompt": "a", "max_tokens": 4000, "stream": True,
                                                           "ignore_eos": True}, timeout=120)
        threading.Thread(target=long_request, daemon=True).start()
        deadline = time.monotonic() + 30
        while httpx.get(f"{base}/health", timeout=5).json()["running"] == 0:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.05)
        proc = process[0]
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)             # the first handled (two signals at once may be seen as one)
        assert proc.poll() is None, "the first Ctrl-C did not wait for the request in flight"
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 130
        assert time.monotonic() - start < 5
        output = proc.stdout.read()
    assert "Traceback" not in output and "Error" not in output, output
    assert output.strip().splitlines()[-1] == "serve: interrupted again: exiting now, requests in flight cut"
