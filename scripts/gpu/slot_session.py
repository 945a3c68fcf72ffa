"""One device call for one kernel slot: its tests, its kernels timed and swept, engines with and without it.

    python3 -m scripts.gpu slot-session [--slot linear] [--plans library] [--bench "lib,lib linear,lib linear pdl"]
        [--test-timeout 200] [--out DIR]

The slot's GPU unit tests, its kernels timed against the other variants (and cuBLAS alone for the
linear slot) with a tiling sweep (the kernels subcommand), then whole engines with and without
it (the engines subcommand on --bench, from --plans: public sequence, quick stress, the five
benchmark cases, a step profile). Outputs under --out ($OUT when set); tables last.
Device tool: carry [".whl"].
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from scripts.gpu.common import out_dir, prelude, run

SUMMARY_MARK = "=========== SUMMARY"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slot", default="linear")
    p.add_argument("--plans", default="library", help="the engines subcommand's --plans")
    p.add_argument("--bench", default="lib,lib linear,lib linear pdl",
                   help="plans checked and timed (the others of --plans are left out)")
    p.add_argument("--test-timeout", type=int, default=200)
    p.add_argument("--out", default=out_dir("/tmp/gpu_slot_session"))
    a = p.parse_args(argv)
    out = Path(a.out)
    prelude(out)
    gpu = [sys.executable, "-m", "scripts.gpu"]
    print(f"== kernel tests, bench and sweep of slot {a.slot}", flush=True)
    run([*gpu, "kernels", "--slots", a.slot, "-k", a.slot, "--test-timeout", str(a.test_timeout),
         "--out", str(out / "kernels")], out / "kernels.txt")
    text = (out / "kernels.txt").read_text()
    print(text[text.find(SUMMARY_MARK):] if SUMMARY_MARK in text else "\n".join(text.splitlines()[-20:]), flush=True)
    print("== engines", flush=True)
    run([*gpu, "engines", "--plans", a.plans, "--only", a.bench, "--bench", a.bench, "--noise", "",
         "--out", str(out / "engines")], out / "engines.txt", tail=12)
    return 0
