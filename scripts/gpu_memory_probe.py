"""GPU memory across a stress run: reserved/allocated bytes and live engines after every case.

    python3 scripts/gpu_memory_probe.py [--plans "lib split,lib"] [--seed N] [--full]
        [--engines "name=path,..."] [--model-config C --weight-dir W]

Why: a run.sh on a GQA fp16 target (eleventh session) rejected the library plan at its quick stress
with `create_engine` out of memory, 78 GiB reserved by PyTorch and unallocated, while the
all-torch plan passed the same cases. This prints, per case, what the caching allocator holds and
how many Engine objects are still alive, so that a leak shows up as a column that only grows.
"""
from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from evaluator.stress import run_stress  # noqa: E402
from scripts.gpu_engine_check import library_plans, load, render_to_file  # noqa: E402

GIB = 2**30
OOM_SEED = 938563   # the stress seed of the run.sh (gqa_fp16 target) whose quick stress ran out of memory


def live_engines() -> int:
    return sum(1 for o in gc.get_objects() if type(o).__name__ == "Engine")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plans", default="lib split", help="comma-separated names from library_plans()")
    p.add_argument("--engines", default="", help="comma-separated name=path of engines rendered beforehand")
    p.add_argument("--seed", type=int, default=OOM_SEED, help=f"stress seed [{OOM_SEED}: the run that ran out of memory]")
    p.add_argument("--full", action="store_true")
    p.add_argument("--snapshot", action="store_true",
                   help="record allocation history; print the largest segments and where they were made")
    p.add_argument("--model-config")
    p.add_argument("--weight-dir")
    a = p.parse_args()
    target = (a.model_config, a.weight_dir) if a.model_config else None
    engines = {name: render_to_file(library_plans()[name], name) for name in filter(None, a.plans.split(","))}
    engines.update(dict(item.split("=", 1) for item in filter(None, a.engines.split(","))))
    for name, path in engines.items():
        module = load(Path(path))

        def log(line: str) -> None:
            print(f"{line[:110]:110s} reserved {torch.cuda.memory_reserved() / GIB:6.2f} GiB  allocated "
                  f"{torch.cuda.memory_allocated() / GIB:6.2f} GiB  engines alive {live_engines()}", flush=True)

        print(f"== {name}")
        if a.snapshot:
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        report = run_stress(module, "cuda", a.seed, quick=not a.full, target=target, log=log)
        print(f"{name}: {report.passed} passed, {report.failed} failed; max reserved "
              f"{torch.cuda.max_memory_reserved() / GIB:.2f} GiB")
        if a.snapshot:
            print_segments(torch.cuda.memory._snapshot())
            torch.cuda.memory._record_memory_history(enabled=None)
        torch.cuda.reset_peak_memory_stats()


def print_segments(snapshot: dict, top: int = 12) -> None:
    """Reserved memory grouped by (pool, stream, the Python frames of the call that made the
    segment): a leak is a group that holds much and allocates little."""
    groups: dict[tuple, list[int]] = {}
    for seg in snapshot["segments"]:
        frames = [f for f in (seg.get("frames") or []) if f["filename"].endswith(".py")][:4]
        where = " < ".join(f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in frames)
        key = (str(seg.get("segment_pool_id")), seg["stream"], where)
        g = groups.setdefault(key, [0, 0, 0])
        g[0] += seg["total_size"]; g[1] += seg["allocated_size"]; g[2] += 1
    for (pool, stream, where), (total, used, n) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"{total / GIB:7.2f} GiB reserved {used / GIB:6.2f} in use  {n:4d} segments  pool {pool} "
              f"stream {stream}  made at {where or '?'}")


if __name__ == "__main__":
    main()
