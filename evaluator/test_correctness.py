"""The public correctness sequence (SPEC.md §4), with the official command line.

    python3 evaluator/test_correctness.py --engine workspace/engine.py \
        --model-config target/model_config.json --weight-dir target/weights --device auto

Seed 7, tokens drawn on the device, engine created first, then the reference. Prints one
JSON object with "status": "passed"; on a mismatch it raises (an AssertionError naming the
step, the max abs and rel error).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from types import ModuleType

import torch

if __package__ in (None, ""):  # run as a script: make the `evaluator` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from evaluator.common import (Tolerance, call_engine, check_harness_inputs, harness_parser, load_config,  # noqa: E402
                              load_engine_module, make_generator, resolve_device)
from evaluator.guards import FunctionIdentities  # noqa: E402
from evaluator.reference_model import ReferenceModel  # noqa: E402
from evaluator.session import CheckedSession  # noqa: E402
from evaluator.traces import public_sequence  # noqa: E402

PUBLIC_SEED = 7


def run_public_sequence(engine: ModuleType | str | Path, model_config: dict | str | Path,
                        weight_dir: str | Path, device: str = "auto", atol: float = 1e-2,
                        rtol: float = 1e-2, seed: int = PUBLIC_SEED,
                        reference_dtype: torch.dtype | None = None) -> dict:
    """Run SPEC.md §4 on `engine` (a module or a path); return the passed JSON object or raise
    EvalFailure (WrongResult is an AssertionError) naming the step that failed. reference_dtype:
    the reference's, if not the compute dtype (the bf16 criterion's fp32, evaluator/hf_judge.py)."""
    identities = FunctionIdentities()
    config = load_config(model_config)
    device = resolve_device(device)
    module = load_engine_module(engine)
    candidate = call_engine("create_engine", module.create_engine, config, str(weight_dir), device)
    tol = Tolerance(atol, rtol, reference_dtype)
    reference = ReferenceModel.load(config, weight_dir, device, tol.reference_dtype)
    stats = CheckedSession(candidate, reference, make_generator(seed, device), tol,
                           threads=identities.threads).run(public_sequence())
    identities.check("after the public sequence")
    return {
        "status": "passed", "device": device, "cases": stats.calls,
        "max_abs_err": stats.max_abs_err, "max_rel_err": stats.max_rel_err,
        "worst_margin": stats.worst_margin, "atol": atol, "rtol": rtol,
    }


def main(argv: list[str] | None = None) -> None:
    p = harness_parser(__doc__.splitlines()[0])
    p.add_argument("--atol", type=float, default=1e-2)
    p.add_argument("--rtol", type=float, default=1e-2)
    a = p.parse_args(argv)
    check_harness_inputs(a.engine, a.model_config, a.weight_dir)
    result = run_public_sequence(a.engine, a.model_config, a.weight_dir, a.device, a.atol, a.rtol)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
