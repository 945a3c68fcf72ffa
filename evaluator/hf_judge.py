"""Which criterion the judge holds a candidate to, and the bf16 criterion's stage.

The course format (and any model computed in fp32, as on the CPU) keeps the fixed judge of
SPEC.md §3: allclose at 1e-2 against the reference in the compute dtype. A Hugging Face model
computed in bf16 or fp16 (on CUDA) is judged by evaluator/bf16_criterion.py instead, because
no engine that batches differently from the bf16 reference can stay within 1e-2 of it:

1. stage "criterion": the candidate runs the criterion's trace on the real weights (prefill,
   long teacher-forced decode, id reuse) against an fp32 run; its tolerance is measured there
   (SLACK x the bf16 reference's own distance from fp32). Failing it fails the candidate.
2. The public sequence, the target's stress scenarios and the benchmark's checked outputs then
   compare with the fp32 reference at that measured tolerance (atol, rtol 0). The stress
   suite's random models keep the course judge: their weights are scaled until it is safe.
3. The judge's own margin under this criterion is the bf16 reference's: 1 - 1/SLACK.

`--criterion bf16` on `python3 -m evaluator.evaluate` forces this path on any model and
device (the CPU tests use it: the engine computes in fp32 there, the criterion still measures
the bf16 reference against fp32); `--criterion course` forces the fixed judge.
"""
from __future__ import annotations

from pathlib import Path
from types import ModuleType

import torch

from evaluator.bf16_criterion import SLACK, Verdict, check
from evaluator.checkpoint import is_hf
from evaluator.common import Tolerance, WrongResult, call_engine, compute_dtype, load_weights

CRITERIA = ("auto", "course", "bf16")
CRITERION_MARGIN = 1.0 - 1.0 / SLACK   # where the bf16 reference itself sits under the criterion


def uses_bf16_criterion(config: dict, device: str, criterion: str = "auto") -> bool:
    """auto: a Hugging Face model whose compute dtype on `device` is half precision."""
    if criterion not in CRITERIA:
        raise ValueError(f"criterion must be one of {CRITERIA}, got {criterion!r}")
    if criterion == "auto":
        return is_hf(config) and compute_dtype(config, device) != torch.float32
    return criterion == "bf16"


def run_criterion(module: ModuleType, config: dict, weight_dir: str | Path, device: str,
                  seed: int | None = None) -> tuple[Verdict, Tolerance]:
    """The criterion on a fresh engine of `module`; raises WrongResult naming the verdict when
    it fails, else returns it and the tolerance the later stages compare at."""
    engine = call_engine("create_engine", module.create_engine, config, str(weight_dir), device)
    verdict = check(engine, config, load_weights(weight_dir, config), device, seed)
    if not verdict.passed:
        raise WrongResult(f"bf16 criterion {verdict.line()}")
    return verdict, Tolerance(atol=verdict.tolerance, rtol=0.0, reference_dtype=torch.float32)
