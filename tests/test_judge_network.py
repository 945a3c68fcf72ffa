"""The worker has no network: a candidate connecting to a server the judge's side can reach
(loopback, here) gets nowhere, and the server never sees it."""
from __future__ import annotations

import os
import socket
import threading

import pytest

from evaluator.evaluate import evaluate

CONNECTS = '''
import socket as _socket
try:
    _socket.create_connection(("127.0.0.1", @PORT@), timeout=2).sendall(b"leak")
    _reached = "reached the server"
except OSError as _e:
    _reached = f"no network: {_e}"
raise RuntimeError(_reached)
'''


@pytest.mark.skipif(os.geteuid() != 0, reason="the worker's network namespace needs a root judge here")
def test_the_worker_cannot_reach_a_server_on_this_machine(recompute_source, tmp_path, tiny_model):
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(15)
    seen = []

    def listen() -> None:
        try:
            seen.append(server.accept())
        except OSError:   # the timeout, or the socket closed under it: nobody came, as it should be
            pass
    thread = threading.Thread(target=listen, daemon=True)
    thread.start()
    engine = tmp_path / "engine.py"
    engine.write_text(CONNECTS.replace("@PORT@", str(server.getsockname()[1])) + recompute_source)
    result = evaluate(engine, tiny_model.config, tiny_model.weight_dir, "cpu", stress="off", cases=["prefill"],
                      warmup=0, repeat=1)
    server.close()
    assert result["error_kind"] == "compile_error" and "no network" in result["error"], result["error"]
    assert not seen
