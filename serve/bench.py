"""`python3 -m serve.bench`: measure a running server the way served engines are scored.

1. Concurrency sweep (default 1, 2, 4, 8, 16, 32, 64): at each level, `--requests` streamed
   completions of random-token prompts (`--input-len` in, `--output-len` out, ignore_eos so
   every request makes exactly that many tokens), at most `level` in flight, after
   `--warmup` requests whose numbers are discarded. Per level: output tokens/s (completion
   tokens over the level's wall time), time to first token and time per output token
   (p50/p90/p99). The score is the mean of the levels' tokens/s weighted 1,1,2,2,4,4,8
   (toward 64).
2. Latency classes, one request at a time: short (64 in / 128 out), medium (2048 / 256),
   long (8192 / 256); a class that does not fit the server's max context is clipped to it
   (prompt shortened first) and the JSON says so.

Results go to `--out` (JSON); with matplotlib installed, a PNG of tokens/s and TTFT against
concurrency beside it.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

LEVELS = (1, 2, 4, 8, 16, 32, 64)
WEIGHTS = (1, 1, 2, 2, 4, 4, 8)     # of each level in the score, toward high concurrency
CLASSES = {"short": (64, 128), "medium": (2048, 256), "long": (8192, 256)}
CLASS_REQUESTS = 3                  # per latency class (the median is reported)
PROMPT_VOCAB = 256                  # random prompt ids below this: valid for every tokenizer here
TIMEOUT_S = 3600.0


@dataclass
class RequestResult:
    ttft_s: float
    latency_s: float
    output_tokens: int
    prompt_tokens: int

    @property
    def tpot_s(self) -> float:
        """Time per output token after the first."""
        return (self.latency_s - self.ttft_s) / max(self.output_tokens - 1, 1)


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    pick = lambda q: ordered[min(int(q * len(ordered)), len(ordered) - 1)]   # noqa: E731
    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99)}


async def one_request(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, usage = None, None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                raise RuntimeError(f"the server failed mid-stream: {event['error']['message']}")
            if event.get("choices") and ttft is None:
                ttft = time.perf_counter() - start
            usage = event.get("usage") or usage
    latency = time.perf_counter() - start
    if usage is None or ttft is None:
        raise RuntimeError("the stream ended without tokens or usage")
    return RequestResult(ttft, latency, usage["completion_tokens"], usage["prompt_tokens"])


async def run_level(client: httpx.AsyncClient, model: str, prompts: list[list[int]], max_tokens: int,
                    concurrency: int) -> tuple[list[RequestResult], float]:
    gate = asyncio.Semaphore(concurrency)

    async def gated(prompt: list[int]) -> RequestResult:
        async with gate:
            return await one_request(client, model, prompt, max_tokens)

    start = time.perf_counter()
    results = await asyncio.gather(*(gated(p) for p in prompts))
    return list(results), time.perf_counter() - start


def summarize(results: list[RequestResult], wall_s: float) -> dict:
    tokens = sum(r.output_tokens for r in results)
    return {"requests": len(results), "output_tokens": tokens, "wall_s": wall_s,
            "output_tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
            "ttft_s": percentiles([r.ttft_s for r in results]),
            "tpot_s": percentiles([r.tpot_s for r in results]),
            "latency_s": percentiles([r.latency_s for r in results])}


def clip(input_len: int, output_len: int, max_context: int) -> tuple[int, int]:
    """(in, out) within max_context: the prompt shortened first, at least half the context kept for it."""
    if input_len + output_len <= max_context:
        return input_len, output_len
    output_len = min(output_len, max_context // 2)
    return max_context - output_len, output_len


async def bench(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    async with httpx.AsyncClient(base_url=args.url, timeout=TIMEOUT_S,
                                 limits=httpx.Limits(max_connections=max(args.concurrency) + 4)) as client:
        info = (await client.get("/v1/models")).json()["data"][0]
        model, max_context = info["id"], int(info.get("max_model_len") or args.input_len + args.output_len)
        vocab = min(int(info.get("vocab_size") or PROMPT_VOCAB), PROMPT_VOCAB)
        prompt = lambda n: [rng.randrange(vocab) for _ in range(n)]   # noqa: E731
        input_len, output_len = clip(args.input_len, args.output_len, max_context)
        report = {"url": args.url, "model": model, "max_context": max_context, "input_len": input_len,
                  "output_len": output_len, "clipped": (input_len, output_len) != (args.input_len, args.output_len),
                  "levels": [], "classes": {}}
        print(f"{model}: {len(args.concurrency)} concurrency levels ({','.join(map(str, args.concurrency))}), each "
              f"{args.warmup} + {args.requests} requests of {input_len} tokens in and {output_len} out: "
              f"{len(args.concurrency) * (args.warmup + args.requests) * output_len} tokens to generate before the "
              f"latency classes (a CPU server takes hours; a quick look: --concurrency 1,4 --requests 4 "
              f"--input-len 64 --output-len 16 --classes short)", flush=True)
        for level in args.concurrency:
            await run_level(client, model, [prompt(input_len) for _ in range(args.warmup)], output_len, level)
            results, wall = await run_level(client, model, [prompt(input_len) for _ in range(args.requests)],
                                            output_len, level)
            row = {"concurrency": level, **summarize(results, wall)}
            report["levels"].append(row)
            print(f"concurrency {level:3d}: {row['output_tokens_per_s']:9.1f} output tok/s  "
                  f"TTFT p50 {row['ttft_s']['p50'] * 1e3:8.1f} ms  TPOT p50 {row['tpot_s']['p50'] * 1e3:7.2f} ms",
                  flush=True)
        weights = {lv: w for lv, w in zip(LEVELS, WEIGHTS)}
        rows = [r for r in report["levels"] if r["concurrency"] in weights]
        if rows:
            total = sum(weights[r["concurrency"]] for r in rows)
            report["weighted_output_tokens_per_s"] = sum(
                weights[r["concurrency"]] * r["output_tokens_per_s"] for r in rows) / total
        for name in args.classes:
            wanted = CLASSES[name]
            n_in, n_out = clip(*wanted, max_context)
            results, wall = await run_level(client, model, [prompt(n_in) for _ in range(CLASS_REQUESTS)], n_out, 1)
            report["classes"][name] = {"input_len": n_in, "output_len": n_out, "clipped": (n_in, n_out) != wanted,
                                       **summarize(results, wall)}
            c = report["classes"][name]
            print(f"{name:6s} {n_in}/{n_out}{' (clipped)' if c['clipped'] else ''}: latency p50 "
                  f"{c['latency_s']['p50']:.3f} s  TTFT p50 {c['ttft_s']['p50'] * 1e3:.1f} ms", flush=True)
    return report


def plot(report: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    levels = [r["concurrency"] for r in report["levels"]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(levels, [r["output_tokens_per_s"] for r in report["levels"]], marker="o")
    a.set(xscale="log", xlabel="concurrency", ylabel="output tokens/s", title=report["model"])
    b.plot(levels, [r["ttft_s"]["p50"] * 1e3 for r in report["levels"]], marker="o")
    b.set(xscale="log", xlabel="concurrency", ylabel="TTFT p50 (ms)")
    fig.tight_layout()
    fig.savefig(path)
    return True


def whole(smallest: int):
    """An argparse type: a whole number of at least `smallest` (--input-len 0 or --output-len -5
    had been sent to the server as they were)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < smallest:
            raise argparse.ArgumentTypeError(f"{text} is less than {smallest}")
        return value
    return parse


def levels(text: str) -> list[int]:
    """--concurrency: positive whole numbers, comma-separated, one at least ("a,b" had read
    "invalid <lambda> value", and "," run no level at all)."""
    values = [whole(1)(x.strip()) for x in text.split(",") if x.strip()]
    if not values:
        raise argparse.ArgumentTypeError("no concurrency level given")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python3 -m serve.bench", description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--concurrency", default=",".join(map(str, LEVELS)), type=levels)
    p.add_argument("--requests", type=whole(1), default=64, help="timed requests per concurrency level")
    p.add_argument("--warmup", type=whole(0), default=2, help="requests before each level, not counted")
    p.add_argument("--input-len", type=whole(1), default=1024)
    p.add_argument("--output-len", type=whole(1), default=1024)
    p.add_argument("--classes", default=",".join(CLASSES), type=lambda s: [x for x in s.split(",") if x])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench-serve.json"))
    args = p.parse_args(argv)
    bad = [c for c in args.classes if c not in CLASSES]
    if bad:
        p.error(f"unknown class {bad[0]}")
    folder = args.out.parent   # checked before the run: a missing one had lost the whole run to a traceback
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        p.error(f"--out {args.out}: the folder {folder} does not exist or cannot be written")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        report = asyncio.run(bench(args))
    except httpx.TransportError as e:   # had not said which server
        print(f"error: cannot reach {args.url}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except (httpx.HTTPError, RuntimeError, KeyError, ValueError) as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    png = args.out.with_suffix(".png")
    print(f"wrote {args.out}" + (f" and {png}" if plot(report, png) else " (no plot: matplotlib is not installed)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
