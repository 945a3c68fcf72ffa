"""How far the judge's own answer is from exact arithmetic on the real weights.

    python3 -m evaluator.noise --model-config CFG --weight-dir DIR [--device auto]

The judge computes in fp16/bf16 (SPEC.md §3); on some weights that rounding alone takes its
logits half the tolerance or more away from the same model in fp32 (an fp16 GQA target with
hidden 1536, eleventh session: the fp16 judge sat at 0.55-0.72 of the tolerance from fp64).
Then no engine that rounds differently anywhere, however carefully, can be as close to the judge
as the loop's safety margin asks (MIN_SAFETY_MARGIN, agent/records.py), and that margin
is read against this one: an engine as close to the judge as the judge is to fp32 is as
trustworthy as the judge. The margin is the same statistic as the checks' (evaluator/guards.py
compare): 1 - the worst (|judge - fp32| - rtol*|fp32|) / atol over the last-position logits of
NOISE_PROMPTS fresh prompts, a row count near that of the checks on the real weights.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from evaluator.common import (Tolerance, compute_dtype, load_config, load_weights,  # noqa: E402
                              make_generator, resolve_device)
from evaluator.guards import compare  # noqa: E402
from evaluator.reference_model import ReferenceModel  # noqa: E402

NOISE_PROMPTS = 24
LONGEST_PROMPT = 512


def prompt_lengths(max_positions: int) -> list[int]:
    """Log-spaced from 1 token to LONGEST_PROMPT (or the model's limit): short prompts and long
    ones round differently (attention over more keys, more positions for RoPE)."""
    top = max(1, min(LONGEST_PROMPT, max_positions))
    return sorted({max(1, round(math.exp(math.log(top) * i / (NOISE_PROMPTS - 1)))) for i in range(NOISE_PROMPTS)})


def reference_margin(config: dict, weight_dir: str | Path, device: str = "auto",
                     tol: Tolerance = Tolerance(), seed: int | None = None,
                     dtype: torch.dtype | None = None) -> float:
    """The judge's margin against an fp32 run of the model in `weight_dir` (judge_margin)."""
    device = resolve_device(device)
    if (dtype or compute_dtype(config, device)) == torch.float32:
        return 1.0
    return judge_margin(config, load_weights(weight_dir, config), device, tol, seed, dtype)


@torch.no_grad()
def judge_margin(config: dict, weights: dict[str, torch.Tensor], device: str = "auto",
                 tol: Tolerance = Tolerance(), seed: int | None = None,
                 dtype: torch.dtype | None = None) -> float:
    """The judge's margin against an fp32 run of the same model; 1.0 where the judge is fp32.
    dtype: the judge's compute dtype, if not SPEC.md §3's for `device` (tests on the CPU)."""
    device = resolve_device(device)
    dtype = dtype or compute_dtype(config, device)
    if dtype == torch.float32:
        return 1.0
    judge = ReferenceModel(config, weights, device, dtype=dtype)
    exact = ReferenceModel(config, weights, device, dtype=torch.float32)
    gen = make_generator(random.SystemRandom().randrange(2**31) if seed is None else seed, device)
    worst = 1.0
    for length in prompt_lengths(int(config.get("max_position_embeddings", LONGEST_PROMPT))):
        tokens = torch.randint(0, judge.dims.vocab, (length,), generator=gen, device=device)
        got = judge.last_logits(tokens).float().cpu()[None]
        want = exact.last_logits(tokens).float().cpu()[None]
        worst = min(worst, compare(got, want, tol).margin)
    return worst


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-config", required=True)
    p.add_argument("--weight-dir", required=True)
    p.add_argument("--device", default="auto")
    p.add_argument("--atol", type=float, default=Tolerance.atol)
    p.add_argument("--rtol", type=float, default=Tolerance.rtol)
    p.add_argument("--seed", type=int, help="prompts' seed (default: a fresh draw)")
    a = p.parse_args(argv)
    config = load_config(a.model_config)
    margin = reference_margin(config, a.weight_dir, a.device, Tolerance(a.atol, a.rtol), a.seed)
    print(json.dumps({"reference_margin": margin, "device": resolve_device(a.device)}))


if __name__ == "__main__":
    main()
