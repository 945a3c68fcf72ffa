"""The agent's search on one GPU and on several, the same budget and seed: what screens ahead buy.

    python3 -m scripts.gpu parallel-search [--gpus 1,2] [--budget 200] [--seed 1] [--out DIR]

Issue 26's "the agent's parallel evaluation is timed against serial evaluation on the same
budget". For each count in --gpus, in turn, `python3 -m agent` (what run.sh runs) on the public
config with that `--gpus`, the same --budget and --seed, in a workspace of its own; then from each
run's results.json: candidates judged, how many of them were screened ahead on another GPU,
verdicts, the engine installed and its score (timed on the first GPU in every run). Writes
parallel_search.json and each run's results log (results-gpusN.log); a table last. On a machine
with fewer GPUs than a count asks for, that run fails with the agent's own one-line error.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from agent.plan import Plan
from agent.report import describe
from scripts.gpu.common import out_dir

ROOT = Path(__file__).resolve().parents[2]


def search(gpus: int, budget: float, seed: int, workspace: Path) -> dict:
    """One run of the agent; what its record says."""
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "agent", "--gpus", str(gpus), "--budget", str(budget),
                           "--seed", str(seed), "--workspace", str(workspace)], cwd=ROOT, capture_output=True,
                          text=True)
    seconds = time.monotonic() - started
    record_file = workspace / "results.json"
    if not record_file.is_file():
        return {"gpus": gpus, "exit": done.returncode, "seconds": round(seconds, 1),
                "error": (done.stderr.strip().splitlines() or ["no output"])[-1]}
    record = json.loads(record_file.read_text())
    candidates = record["candidates"]
    log = (workspace / "results.log").read_text()
    best = next((c for c in candidates if c["index"] == record.get("best")), None)
    return {"gpus": gpus, "exit": done.returncode, "seconds": round(seconds, 1),
            "judged": len(candidates), "screened_ahead": log.count("screen (ahead, GPU"),
            "dropped_ahead": sum(int(m) for m in re.findall(r"^(\d+) candidate\(s\) screened ahead were not reached",
                                                             log, re.M)),
            "passed": sum(c["result"]["status"] == "passed" for c in candidates),
            "per_minute": round(len(candidates) / (budget / 60), 2),
            "installed": f"#{best['index']:03d} {describe(Plan.from_dict(best['plan']))}" if best else None,
            "score": best["result"]["score"] if best else None}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", default="1,2", help="comma-separated GPU counts, one run each, in this order")
    p.add_argument("--budget", type=float, default=200.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default=out_dir("/tmp/parallel_search"))
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for gpus in (int(g) for g in args.gpus.split(",")):
        workspace = Path(f"/tmp/parallel-search-ws-{gpus}")
        shutil.rmtree(workspace, ignore_errors=True)
        row = search(gpus, args.budget, args.seed, workspace)
        rows.append(row)
        if (workspace / "results.log").is_file():
            shutil.copy(workspace / "results.log", out / f"results-gpus{gpus}.log")
        print(json.dumps(row), flush=True)
    (out / "parallel_search.json").write_text(json.dumps({"budget": args.budget, "seed": args.seed, "runs": rows},
                                                         indent=2))
    print(f"\n{'gpus':>4} {'judged':>6} {'ahead':>5} {'passed':>6} {'per min':>7} {'score':>8}  installed")
    for r in rows:
        print(f"{r['gpus']:>4} {r.get('judged', '-'):>6} {r.get('screened_ahead', '-'):>5} {r.get('passed', '-'):>6} "
              f"{r.get('per_minute', '-'):>7} {r.get('score') or 0:>8.4g}  {r.get('installed') or r.get('error')}")


if __name__ == "__main__":
    main()
