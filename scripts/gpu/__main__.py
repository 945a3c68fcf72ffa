"""The GPU tool: `python3 -m scripts.gpu <subcommand> [args]`, run from the repository root.

Each subcommand is one device call's worth of work on a CUDA machine (torch and triton, no
network); `python3 -m scripts.gpu <subcommand> --help` says what it does and takes, without a
GPU. docs/evaluator.md lists them, each with its module docstring's first line.
"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# subcommand -> its module in scripts.gpu; what it does is the first line of the module's docstring
SUBCOMMANDS: dict[str, str] = {
    "session": "session", "targets": "targets", "plan-check": "plan_check", "plans": "plans", "scale": "scale",
    "profile": "profile_run", "timeline": "timeline", "engines": "engines", "kernels": "kernels",
    "linear-sweep": "linear_sweep", "slot-session": "slot_session", "judge-split": "judge_split",
    "hf": "hf_models", "scripted-search": "scripted_search", "engine-cost": "engine_cost",
    "persistent-probe": "persistent_probe", "bf16-probe": "bf16_probe",
    "first-run": "first_run", "megakernel-probe": "megakernel_probe", "compile-probe": "compile_probe",
    "verdict-split": "verdict_split", "menu-compile": "menu_compile", "timed-path": "timed_path", "worker-speed": "worker_speed", "tp-check": "tp_check",
    "parallel-search": "parallel_search",
}


def module(name: str):
    """The subcommand's module (imports torch and the repo's packages; no GPU needed)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return importlib.import_module(f"scripts.gpu.{SUBCOMMANDS[name]}")


def summary(name: str) -> str:
    """The one line that says what a subcommand does."""
    return module(name).__doc__.splitlines()[0]


def usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    lines = [f"  {name:{width}}  {summary(name)}" for name in SUBCOMMANDS]
    return ("usage: python3 -m scripts.gpu <subcommand> [--help | args]\n\nsubcommands:\n" + "\n".join(lines))


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, args = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"scripts.gpu: unknown subcommand {name!r} (one of: {', '.join(SUBCOMMANDS)})", file=sys.stderr)
        return 2
    sys.argv[0] = f"python3 -m scripts.gpu {name}"    # argparse's prog in usage lines
    return module(name).main(args) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
