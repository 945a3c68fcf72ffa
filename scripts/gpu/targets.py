"""One device call: run.sh on other targets, then public tests and full stress on each engine it wrote.

    python3 -m scripts.gpu targets [--configs scripts/configs/gqa_bf16.json scripts/configs/mqa_fp16.json[:SPREAD] ...]
        [--budget 200] [--stress-seconds 45] [--out DIR]

Issue #4: the engines the agent writes must pass on GQA, MQA and bf16 configs too. Each config
gets toy weights with norm weights uniform in 1 ± SPREAD (`config.json:SPREAD`, default 0.5; 0 is
the plain toy init, all-one norms), `bash run.sh` within --budget seconds, then the public tests
and the full stress suite (cut at --stress-seconds) on the engine it wrote. Outputs under
--out/<config>[-spreadS]/ ($OUT when set); a line per config last. Device tool: carry [".whl"].
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from scripts.gpu.common import ensure_toy_weights, out_dir, prelude, run

DEFAULT_CONFIGS = ["scripts/configs/gqa_bf16.json", "scripts/configs/mqa_fp16.json"]
DEFAULT_SPREAD = 0.5


def parse_entry(entry: str) -> tuple[str, float, str]:
    """`config.json[:SPREAD]` -> (config, spread, output name)."""
    config, _, spread_text = entry.partition(":")
    spread = float(spread_text) if spread_text else DEFAULT_SPREAD
    name = Path(config).stem + ("" if spread == DEFAULT_SPREAD else f"-spread{spread_text}")
    return config, spread, name


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, help="config.json[:SPREAD] ...")
    p.add_argument("--budget", type=int, default=200, help="run.sh's budget per config, seconds")
    p.add_argument("--stress-seconds", type=int, default=45)
    p.add_argument("--out", default=out_dir("/tmp/gpu_targets"))
    a = p.parse_args(argv)
    for entry in a.configs:
        if not Path(parse_entry(entry)[0]).is_file():
            p.error(f"no config file {parse_entry(entry)[0]}")
    out = Path(a.out)
    prelude(out)
    py = sys.executable
    summary = []
    for entry in a.configs:
        config, spread, name = parse_entry(entry)
        folder, workspace, weights = out / name, Path(f"/tmp/targets_ws_{name}"), f"/tmp/targets_weights_{name}"
        folder.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(workspace, ignore_errors=True)
        ensure_toy_weights(config, weights, spread)
        runsh = run(["bash", "run.sh", "--device", "cuda", "--budget", str(a.budget), "--config", config,
                     "--weights", weights, "--workspace", str(workspace)], folder / "runsh.txt")
        for log in ("results.log", "results.json"):
            if (workspace / log).is_file():
                shutil.copy(workspace / log, folder / log)
        result = next((line for line in (folder / "runsh.txt").read_text().splitlines()
                       if line.startswith("result:")), "")
        model = ["--model-config", config, "--weight-dir", weights, "--device", "cuda"]
        engine = str(workspace / "engine.py")
        public = run([py, "evaluator/test_correctness.py", "--engine", engine, *model], folder / "public.txt")
        stress = run([py, "evaluator/stress.py", "--engine", engine, *model, "--full"], folder / "stress_full.txt",
                     timeout=a.stress_seconds)
        lines = (folder / "stress_full.txt").read_text().splitlines()
        fails = [line for line in lines if line.startswith("FAIL")]
        passes = sum(line.startswith("PASS") for line in lines)
        summary.append(f"{name}: run.sh exit {runsh}; public tests exit {public}; full stress exit {stress} "
                       f"(124: cut) with {passes} passed, {len(fails)} failed; {result}")
        print("\n".join(fails[:3]), flush=True)
    print("\n".join(summary))
    return 0
