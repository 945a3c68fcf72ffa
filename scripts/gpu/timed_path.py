"""Which of the worker's per-trace steps make a timed run longer than the official method's: the steps added one at a time, in one process.

    python3 -m scripts.gpu timed-path [--engine PATH | --plan NAME] [--rounds 7]
        [--cases prefill,decode,mixed] [--out DIR]

Why: the judge times an engine in its worker (evaluator/worker.py `trace`), and the worker's own
clock read 1.0 ms more than the official in-process method on the 0.75 ms prefill case and
0.4-0.7 ms more on the others (docs/benchmarks.md, thirteenth session); which step costs it was
never measured. The agent ranks candidates on that clock, so a fixed cost inside it hides most of
a prefill gain. Here the same engine is timed (a fresh engine a run, as the official method) with
the worker's steps added one by one to the official timed region:

  official  tokens drawn on the device before the clock, one tensor a prompt (the course's method)
  views     each call's tokens one device tensor made before the clock; prompts are its split views
  unmask    the trace's tokens masked on the device before the clock (evaluator/worker.py
            MaskedTokens), each call's unmasked inside it as the call is made
  upload    the same, the masking and the copy to the device inside the clock (as the worker does)
  staging   + each call's logits copied into fp32 staging rows as it returns
  worker    + one sync and the keyed digest of every row, read back (the worker's whole `trace`)
  warmed    the same, the trace's own buffers allocated and freed before the clock
            (evaluator/worker.py warm_trace_buffers, as the worker's `arm` does since this script)

Variants rotate within a round; medians over rounds. Writes timed_path.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from evaluator.benchmark_throughput import release_device_memory
from evaluator.common import load_config, load_engine_module, make_generator, synchronize
from evaluator.guards import digest_key, output_digest
from evaluator.session import draw_op_tokens
from evaluator.traces import DECODE, PREFILL, benchmark_trace
from evaluator.worker import MaskedTokens, warm_trace_buffers
from scripts.gpu.common import FINAL_PLAN, PUBLIC_CONFIG, PUBLIC_WEIGHTS, ensure_toy_weights, library_plans, out_dir, render_to_file

VARIANTS = ("official", "views", "unmask", "upload", "staging", "worker", "warmed")


def _official(engine, trace, drawn) -> None:
    for op, tokens in zip(trace, drawn):
        ids = list(op.request_ids)
        if op.kind == PREFILL:
            engine.prefill(ids, tokens)
        elif op.kind == DECODE:
            engine.decode(ids, tokens[0])
        else:
            engine.remove(ids)


def _worker_like(engine, trace, drawn, device: str, variant: str, key, staging) -> float:
    """Seconds of the worker's `trace` up to `variant`'s step (VARIANTS' order)."""
    level = VARIANTS.index(variant)
    flat = [t for tokens in drawn for t in tokens]
    counts = [sum(int(t.numel()) for t in tokens) for tokens in drawn]
    joined = [torch.cat(tokens) if tokens else None for tokens in drawn]   # made before the clock
    payload = torch.cat(flat).cpu().numpy().tobytes() if flat else b""
    synchronize(device)
    early = MaskedTokens(torch, payload, device, counts) if level == VARIANTS.index("unmask") else None
    if variant == "warmed":
        warm_trace_buffers(torch, output_digest, counts, device, staging[:sum(len(op.request_ids) for op in trace
                                                                                  if op.kind in (PREFILL, DECODE))], key)
    synchronize(device)
    start = time.perf_counter()
    masked = MaskedTokens(torch, payload, device, counts) if level >= VARIANTS.index("upload") else early
    row = 0
    for index, op in enumerate(trace):
        ids = list(op.request_ids)
        tokens = masked.of(index) if masked is not None else joined[index]
        if op.kind == PREFILL:
            out = engine.prefill(ids, list(tokens.split([int(t.numel()) for t in drawn[index]])))
        elif op.kind == DECODE:
            out = engine.decode(ids, tokens)
        else:
            engine.remove(ids)
            continue
        if level >= VARIANTS.index("staging"):
            staging[row:row + len(ids)].copy_(out.detach())
            row += len(ids)
    synchronize(device)
    if level >= VARIANTS.index("worker"):
        output_digest(staging[:row], key).cpu()
    return time.perf_counter() - start


def time_variant(module, config, weight_dir, device, case, variant, gen, key, staging) -> float:
    """Milliseconds of one timed run of `case` on a fresh engine, as `variant` times it."""
    vocab = int(config["vocab_size"])
    trace = benchmark_trace(case)
    engine = module.create_engine(config, weight_dir, device)
    drawn = [draw_op_tokens(op, gen, vocab, device) for op in trace]
    with torch.no_grad():
        if variant == "official":
            synchronize(device)
            start = time.perf_counter()
            _official(engine, trace, drawn)
            synchronize(device)
            seconds = time.perf_counter() - start
        else:
            seconds = _worker_like(engine, trace, drawn, device, variant, key, staging)
    del engine
    release_device_memory(device)
    return seconds * 1e3


def mask_steps(device: str, counts: list[int], repeat: int = 50) -> dict[str, float]:
    """Median us of each step of MaskedTokens on an idle device, each step synced on both sides
    (`steps` in timed_path.json): where the upload variant's extra time goes."""
    import itertools
    import secrets
    payload = torch.randint(0, 4096, (sum(counts),), dtype=torch.int64).numpy().tobytes()
    steps: dict[str, list[float]] = {}

    def step(name, fn):
        synchronize(device)
        t = time.perf_counter()
        value = fn()
        synchronize(device)
        steps.setdefault(name, []).append((time.perf_counter() - t) * 1e6)
        return value

    for _ in range(repeat):
        host = step("frombuffer", lambda: torch.frombuffer(bytearray(payload), dtype=torch.int64))
        keys = step("keys", lambda: [secrets.randbits(62) for _ in counts])
        step("starts", lambda: [0, *itertools.accumulate(counts)])
        mask = step("repeat_interleave", lambda: torch.repeat_interleave(torch.tensor(keys, dtype=torch.int64),
                                                                          torch.tensor(counts, dtype=torch.int64)))
        masked_host = step("xor on host", lambda: host ^ mask)
        masked = step("to device", lambda: masked_host.to(device))
        step("whole constructor", lambda: MaskedTokens(torch, payload, device, counts))
        step("of(0)", lambda: masked[:counts[0]] ^ keys[0])
    return {name: statistics.median(v) for name, v in steps.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", help="an engine file (default: render --plan)")
    p.add_argument("--plan", default=FINAL_PLAN, help="a name from scripts.gpu.common.library_plans")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--cases", default="prefill,decode,mixed")
    p.add_argument("--device", default="cuda", help="cpu only checks that it runs")
    p.add_argument("--out", default=out_dir("timed-path-out"))
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ensure_toy_weights()
    config = load_config(PUBLIC_CONFIG)
    vocab = int(config["vocab_size"])
    module = load_engine_module(a.engine or str(render_to_file(library_plans()[a.plan], a.plan)))
    gen = make_generator(0, a.device)
    key = digest_key(vocab, torch.Generator().manual_seed(1)).to(a.device)
    staging = torch.empty(4096, vocab, dtype=torch.float32, device=a.device)
    output_digest(staging[:1], key).cpu()   # the digest's kernels loaded before any clock, as the worker's arm does
    steps = mask_steps(a.device, [128, 128, 128, 128])
    print("MaskedTokens, us a step (idle device, synced): " + "  ".join(f"{k} {v:.1f}" for k, v in steps.items()), flush=True)
    results: dict[str, dict[str, list[float]]] = {}
    for case in [c for c in a.cases.split(",") if c]:
        runs = results[case] = {v: [] for v in VARIANTS}
        for variant in VARIANTS:   # warm: every kernel and code path of every variant once
            time_variant(module, config, PUBLIC_WEIGHTS, a.device, case, variant, gen, key, staging)
        for r in range(a.rounds):
            for i in range(len(VARIANTS)):
                variant = VARIANTS[(i + r) % len(VARIANTS)]
                runs[variant].append(time_variant(module, config, PUBLIC_WEIGHTS, a.device, case, variant, gen, key, staging))
        base = statistics.median(runs["official"])
        print(f"{case}: " + "  ".join(f"{v} {statistics.median(runs[v]):.3f} ms ({statistics.median(runs[v]) - base:+.3f})"
                                       for v in VARIANTS), flush=True)
    (out / "timed_path.json").write_text(json.dumps({"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "runs_ms": results, "steps_us": steps}, indent=1))


if __name__ == "__main__":
    main()
