"""Why the judge's worker runs torch's small host steps slower: the same steps timed in this process's environment, in a plain process with the worker's environment, and inside a real worker.

    python3 -m scripts.gpu worker-speed [--repeat 30] [--out DIR]

Why: inside a confined worker (evaluator/worker.py) small torch steps took 1.5-4x what they took
in the judge's process (repeat_interleave 152 us against 41, a CUDA kernel launch and sync 62
against 33; docs/benchmarks.md, thirty-fourth session), and an engine's own calls in a timed
trace pay that too. The worker differs from the judge's process in its environment (only
evaluator/isolation.py ENV_KEEP, OMP_WAIT_POLICY=PASSIVE on a CPU and, before the thirty-fourth
session, on a GPU too; Python in isolated mode) and in its confinement (own uid, namespaces,
rlimits). Timing the same steps in the three places tells the environment from the confinement.
Some steps are timed again right after 2 ms of what a worker does while it awaits a timed trace
(a busy loop of poll(0) calls on its socket), of a pure Python busy loop, and of a sleep: a
worker's first steps of a trace ran 3-10x slower than here (judge-split, thirty-fifth session).
Also lists the environment variables the worker does not get.
Writes worker_speed.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from evaluator.isolation import ENV_KEEP, worker_env
from evaluator.remote import Worker
from scripts.gpu.common import ROOT, out_dir

# Runs as a script (a plain process) and as an engine module (inside a worker, whose create_engine
# raises the timings: the one channel back a worker has for an engine's own text).
PROBE = '''
import json, select, secrets, socket, statistics, time
import torch

SPIN_SECONDS = 0.002


def spin_on_a_socket():
    """What a worker does while it waits for a timed trace (evaluator/channel.py spin_until_readable)."""
    a, b = socket.socketpair()
    poller = select.poll()
    poller.register(a, select.POLLIN)
    end = time.perf_counter() + SPIN_SECONDS
    while not poller.poll(0) and time.perf_counter() < end:
        pass
    a.close(), b.close()


def spin_in_python():
    end = time.perf_counter() + SPIN_SECONDS
    while time.perf_counter() < end:
        pass


def few_bytecodes():
    x = {"engine": 1, "ops": [1, 2]}
    return [x.get("engine"), len(x["ops"]), x.get("absent")] * 3


def steps(repeat):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    counts = [128] * 4
    payload = torch.randint(0, 4096, (512,), dtype=torch.int64).numpy().tobytes()
    pinned = torch.empty(512, dtype=torch.int64, pin_memory=device == "cuda")
    out = {}

    def step(name, fn, before=None):
        sync()
        if before is not None:
            before()
        t = time.perf_counter()
        value = fn()
        sync()
        out.setdefault(name, []).append((time.perf_counter() - t) * 1e6)
        return value

    for _ in range(repeat):
        step("nothing", lambda: None)
        host = step("frombuffer", lambda: torch.frombuffer(bytearray(payload), dtype=torch.int64))
        keys = step("randbits", lambda: [secrets.randbits(62) for _ in counts])
        mask = step("repeat_interleave", lambda: torch.repeat_interleave(
            torch.tensor(keys, dtype=torch.int64), torch.tensor(counts, dtype=torch.int64)))
        masked = step("cpu xor", lambda: host ^ mask)
        dev = step("to device, pageable", lambda: masked.to(device))
        step("to device, pinned", lambda: dev.copy_(pinned, non_blocking=True))
        step("one kernel", lambda: dev[:128] ^ keys[0])
        step("ten kernels", lambda: [dev.add_(1) for _ in range(10)])
        step("to host, pageable", lambda: dev.cpu())
        step("python loop 1e4", lambda: sum(i * i for i in range(10000)))
        step("few bytecodes", few_bytecodes)
        for wait, before in (("a socket spin", spin_on_a_socket), ("a python spin", spin_in_python),
                             ("a sleep", lambda: time.sleep(SPIN_SECONDS))):
            step(f"few bytecodes after {wait}", few_bytecodes, before)
            step(f"cpu xor after {wait}", lambda: host ^ mask, before)
            step(f"to device, pinned, after {wait}", lambda: dev.copy_(pinned), before)
    return {name: round(statistics.median(v), 1) for name, v in out.items()}


def create_engine(config, weight_dir, device):
    raise RuntimeError("STEPS" + json.dumps(steps(int(config.get("repeat", 30)))))


if __name__ == "__main__":
    import sys
    print("STEPS" + json.dumps(steps(int(sys.argv[1]))))
'''


def _read(text: str) -> dict:
    """The probe's timings from what it printed or raised."""
    return json.loads(text[text.index("STEPS") + len("STEPS"):].splitlines()[0])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--out", default=out_dir("worker-speed-out"))
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    probe = Path(tempfile.mkdtemp()) / "probe_engine.py"
    probe.write_text(PROBE)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    places: dict[str, dict] = {}
    here = subprocess.run([sys.executable, str(probe), str(a.repeat)], capture_output=True, text=True, check=True,
                          cwd=ROOT)
    places["this process's environment"] = _read(here.stdout)
    with tempfile.TemporaryDirectory() as home:
        (Path(home) / "tmp").mkdir()
        clean = subprocess.run([sys.executable, "-I", str(probe), str(a.repeat)], capture_output=True, text=True,
                               check=True, cwd=home, env=worker_env(Path(home), device))
    places["worker's environment, no jail"] = _read(clean.stdout)
    with Worker(device, log=lambda line: None) as worker:
        worker.request({"op": "load", "engine": worker.readable(probe)}, what="import")
        try:
            worker.request({"op": "create", "config": {"repeat": a.repeat}, "weight_dir": "", "device": device},
                           what="create")
        except Exception as e:  # noqa: BLE001 - the probe answers by raising
            places["inside a worker"] = _read(str(e))
        layers = worker.layers
    names = list(places["this process's environment"])
    width = max(map(len, names))
    print(f"{'us (median)':<{width}}  " + "  ".join(f"{place:>30}" for place in places))
    for name in names:
        print(f"{name:<{width}}  " + "  ".join(f"{places[place].get(name, float('nan')):>30}" for place in places))
    dropped = sorted(k for k in os.environ if k not in ENV_KEEP)
    print("worker isolation:", layers)
    print("variables the worker does not get:", " ".join(dropped))
    (out / "worker_speed.json").write_text(json.dumps({"places": places, "dropped_env": dropped,
                                                       "layers": layers}, indent=1))


if __name__ == "__main__":
    main()
