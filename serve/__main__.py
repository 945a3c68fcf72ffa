"""`python -m serve` (`bash run.sh serve`): an OpenAI-compatible server for an engine the agent wrote.

Exit codes: 2 for bad flags or inputs that cannot be served (one line on stderr); otherwise
the server runs until stopped: a first Ctrl-C (or SIGTERM) lets requests in flight finish for
--shutdown-grace seconds, then exits 0; a second Ctrl-C exits at once, quietly, with 130.
"""
from __future__ import annotations

import argparse
import errno
import json
import os
import signal
import socket
import sys
from pathlib import Path

from agent.caller import enter_callers_folder
from serve.model import DEFAULT_ENGINE, load_model, resolve_source
from serve.settings import ServeSettings

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130   # 128 + SIGINT: what a shell reports for a process Ctrl-C ended
EXIT_STARTUP_FAILURE = 3   # uvicorn's own, where it failed to start (uvicorn.run's)

def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


# A stop had waited for every generation in flight, however long (two 3000-token requests: 430 s; helper-35).
SHUTDOWN_GRACE_S = 30.0


def tcp_port(text: str) -> int:
    """A port number (0: any free one); 99999 had loaded the engine, then failed in uvicorn with a traceback."""
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text} is not a TCP port (0-65535)")
    return value


def seconds(text: str) -> float:
    """A non-negative, finite number of seconds (-1 and nan had been taken and cut every stop at once)."""
    value = float(text)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a non-negative number of seconds")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = ServeSettings()
    p = argparse.ArgumentParser(prog="bash run.sh serve", description=__doc__.splitlines()[0])
    p.add_argument("--engine", type=Path, default=None,
                   help=f"engine file [default: $AGENT_WORKSPACE/engine.py, else {DEFAULT_ENGINE}]")
    p.add_argument("--weights", type=Path, default=None,
                   help="weights folder [default: the one the run that wrote the engine used, from results.json]")
    p.add_argument("--config", type=Path, default=None,
                   help="model config [default: config.json or model_config.json in or beside --weights]")
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"), help="[auto]")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=tcp_port, default=8000)
    p.add_argument("--max-batch", type=positive, default=defaults.max_batch, help="requests decoded per step")
    p.add_argument("--max-queue", type=positive, default=defaults.max_queue,
                   help="requests waiting for a batch slot before new ones get 503")
    p.add_argument("--max-prefill-tokens", type=positive, default=defaults.max_prefill_tokens,
                   help="prompt tokens admitted per step (a longer prompt still goes alone)")
    p.add_argument("--max-context", type=positive, default=None,
                   help="prompt + completion tokens per request [default and at most: max_position_embeddings]")
    p.add_argument("--max-body-bytes", type=positive, default=defaults.max_body_bytes)
    p.add_argument("--no-thinking", action="store_true",
                   help="render chat templates with enable_thinking=false (requests may override)")
    p.add_argument("--shutdown-grace", type=seconds, default=SHUTDOWN_GRACE_S,
                   help="seconds a stop (SIGTERM, Ctrl-C) lets requests in flight finish before cutting them "
                        "[%(default)s]")
    p.add_argument("--log-level", default="info", type=str.lower,   # uvicorn's; another had been a KeyError traceback
                   choices=("critical", "error", "warning", "info", "debug", "trace"))
    return p.parse_args(argv)


def can_listen(host: str, port: int) -> str | None:
    """None if (host, port) can be listened on now, else why not. Checked before the engine loads:
    a busy port had surfaced as uvicorn's error after the whole load (a new-user walkthrough)."""
    try:   # every address, as asyncio's create_server (uvicorn's) binds them
        for family, kind, proto, _, address in socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                                  flags=socket.AI_PASSIVE):
            with socket.socket(family, kind, proto) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                s.bind(address)
    except OSError as e:
        hint = " (another server there? pick one with --port)" if e.errno == errno.EADDRINUSE else ""
        return f"cannot listen on {host}:{port}: {e.strerror or e}{hint}"
    return None


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:   # Ctrl-C while the engine loads, or while the stop waits for its thread
        print("serve: interrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED


def _main(argv: list[str] | None) -> int:
    enter_callers_folder()   # relative paths on run.sh's command line are the caller's
    args = parse_args(argv)
    busy = can_listen(args.host, args.port)
    if busy:
        print(f"error: {busy}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        source = resolve_source(args.engine, args.weights, args.config)
        print(f"serve: loading {source.engine} for {source.config} / {source.weights}", file=sys.stderr, flush=True)
        model = load_model(source, args.device, args.max_context)
    except Exception as e:   # noqa: BLE001 - ModelError, or whatever an engine raises at load
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    import uvicorn

    from serve.api import create_app
    from serve.service import Service
    Server = _server_class()

    settings = ServeSettings(args.max_batch, args.max_queue, args.max_prefill_tokens, args.max_body_bytes,
                             chat_template_kwargs={"enable_thinking": False} if args.no_thinking else {})
    service = Service(model, settings)
    service.start()
    print(f"serve: {source.name} on {model.device}, max context {model.max_context}, "
          f"tokenizer {type(model.tokenizer).__name__}; settings {json.dumps(settings.__dict__)}",
          file=sys.stderr, flush=True)
    server = Server(uvicorn.Config(create_app(service), host=args.host, port=args.port, log_level=args.log_level,
                                   timeout_graceful_shutdown=args.shutdown_grace))
    try:
        server.run()
    except KeyboardInterrupt:   # the first Ctrl-C, raised again by uvicorn once it has shut down
        pass
    finally:
        service.stop()
    return 0 if server.started else EXIT_STARTUP_FAILURE


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, but a second Ctrl-C during the graceful stop exits at once, with 130
        and one line. uvicorn's own force-quit cancels the requests in flight, each of which logs
        a traceback (the stream's task group, the lifespan), and then exits 0."""

        def handle_exit(self, sig: int, frame) -> None:
            if sig == signal.SIGINT and self.should_exit:
                print("serve: interrupted again: exiting now, requests in flight cut", file=sys.stderr, flush=True)
                sys.stdout.flush()
                os._exit(EXIT_INTERRUPTED)   # nothing to clean: the engine's state dies with the process
            super().handle_exit(sig, frame)

    return Server


if __name__ == "__main__":
    sys.exit(main())
