"""Randomized correctness traces against the reference: what the public sequence never tries.

    python3 evaluator/stress.py --engine PATH --device D [--seed N] [--quick | --full]
        [--model-config CFG --weight-dir DIR]   # also stress the real model
        [--fail-fast] [--atol 1e-2 --rtol 1e-2]

Quick mode (small traces, for CPU and CI) is the default on CPU, full mode on CUDA.

Random models (MHA, GQA with groups of 2, 3, 4 and 6, MQA; fp16 and bf16 configs; head_dim not hidden/heads; 1 to 4
layers; vocab up to 32k; norm weights not all ones; weights larger than the toy init, on CUDA
no larger than lets the judge stay near fp32: judge_safe_weights) each
run four scenarios (traces.py): a >= 1024-token prompt beside a 1-token one (in quick mode
on one model only), a wide ragged batch with shuffled decode subsets, lifecycle churn (id
reuse, replacing a live request, unknown ids, removing everything then continuing) and
random mixed rounds. Request ids are large and non-contiguous, and every call's ids are out
of ascending order.

Prints one line per case (max abs error, margin to the tolerance), then `N passed, M failed`;
exits 0 only when every case passed. Without --seed the draw is fresh (the seed is printed).
"""
from __future__ import annotations

import argparse
import math
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Callable

if __package__ in (None, ""):  # run as a script: make the `evaluator` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from evaluator.checkpoint import is_hf, save_hf_weights, with_conventions_of  # noqa: E402
from evaluator.common import (WEIGHT_FILE, EvalFailure, Tolerance, call_engine, check_harness_inputs,  # noqa: E402
                              compute_dtype, load_config, load_engine_module, load_weights,
                              make_generator, resolve_device)
from evaluator.guards import FunctionIdentities, ThreadWatch  # noqa: E402
from evaluator.noise import judge_margin  # noqa: E402
from evaluator.reference_model import ReferenceModel  # noqa: E402
from evaluator.remote import RemoteModule  # noqa: E402
from evaluator.session import CheckedSession  # noqa: E402
from evaluator.traces import FULL, LONG_PROMPT, QUICK, STRESS_SCENARIOS, Op, StressSize  # noqa: E402
from evaluator.weights import TOY_SCALE, random_weights, save_weights  # noqa: E402

# Weight scale per compute dtype: s = max(TOY_SCALE * f, sqrt(k / hidden)). k = hidden * s^2
# sets how far attention is from uniform (the toy init at hidden 64 has k = 0.03: attention
# nearly uniform, a wrong RoPE invisible) and how large the logits get. In fp32 (the CPU
# reference) k up to 1 costs nothing (logits O(1)-O(10)); in fp16/bf16 the compute dtype's own
# rounding grows with k, so k stays where a correct engine keeps a clear margin, and bf16
# stays near the toy init, as the official bf16 runs do.
SCALE_RANGES = {  # dtype: ((f_lo, f_hi), (k_lo, k_hi))
    torch.float32: ((1.0, 1.0), (0.5, 1.0)),
    torch.float16: ((1.0, 1.5), (0.15, 0.3)),
    torch.bfloat16: ((1.0, 1.2), (0.04, 0.1)),
}
NORM_SPREAD = 0.5   # norm weights uniform in [0.5, 1.5]
TARGET = "target"   # the name of the real model's cases (run_stress's `target`)
LARGE_VOCAB = 32000
# A random model on whose weights the judge is itself further than this from an fp32 run
# (evaluator/noise.py) cannot tell a right engine from a wrong one at the tolerance: a correct
# batched engine then fails by chance (an H100 run, eleventh session: a one-layer bf16 GQA model,
# 0.0156 against atol 0.01). Its weight scale shrinks by SCALE_STEP until the judge is within
# this, at most MAX_SHRINKS times; logits shrink with the scale, the tolerance does not. On the
# CPU the judge is fp32 and nothing changes.
JUDGE_MARGIN = 0.5
SCALE_STEP = 0.7
MAX_SHRINKS = 6


@dataclass(frozen=True)
class StressModel:
    name: str
    config: dict
    scale: float
    weight_seed: int
    trace_seed: int
    scenarios: tuple[str, ...]


@dataclass
class CaseResult:
    name: str
    passed: bool
    calls: int = 0
    max_abs_err: float = 0.0
    worst_margin: float = math.inf
    seconds: float = 0.0
    error: str | None = None
    error_kind: str | None = None

    def line(self) -> str:
        head = f"{'PASS' if self.passed else 'FAIL'} {self.name:<44} calls {self.calls:3d}  " \
               f"max abs err {self.max_abs_err:9.3g}  margin {self.worst_margin:7.3f}  ({self.seconds:.1f} s)"
        return head if self.passed else f"{head}\n     {self.error_kind}: {self.error}"


@dataclass
class StressReport:
    seed: int
    mode: str
    cases: list[CaseResult] = field(default_factory=list)

    @property
    def passed(self) -> int:
        return sum(c.passed for c in self.cases)

    @property
    def failed(self) -> int:
        return len(self.cases) - self.passed

    @property
    def first_failure(self) -> CaseResult | None:
        return next((c for c in self.cases if not c.passed), None)

    def summary(self) -> str:
        return f"{self.passed} passed, {self.failed} failed"

    def to_dict(self) -> dict:
        """The `stress` object of docs/design.md §2 (plus the seed that reproduces it)."""
        checked = [c for c in self.cases if c.calls]
        on_target = [c for c in checked if c.name.startswith(f"{TARGET}/")]
        return {
            "passed": self.passed, "failed": self.failed,
            "max_abs_err": max((c.max_abs_err for c in checked), default=0.0),
            "worst_margin": min((c.worst_margin for c in checked), default=None),
            "target_margin": min((c.worst_margin for c in on_target), default=None),
            "seed": self.seed,
        }


# ---- random models ----

def _head_dim(rng: random.Random, hidden: int, heads: int, choices: list[int]) -> int:
    """An even head_dim with heads * head_dim != hidden."""
    return rng.choice([d for d in choices if d * heads != hidden])


# GQA query and KV head counts: groups of 2, 3, 4 and 6 (a kernel that packs a group's heads into
# a power-of-two tile must mask the rest; 12 and 6 heads are no power of two either).
GQA_HEADS = [4, 6, 8, 12]
GQA_KV_HEADS = (2, 3, 4)


def _model(rng: random.Random, kind: str, dtype_name: str, hidden_choices: list[int],
           head_dims: list[int], max_vocab: int, explicit: bool = True) -> dict:
    heads = rng.choice(GQA_HEADS if kind == "gqa" else [2, 4, 8])
    hidden = rng.choice([h for h in hidden_choices if h % heads == 0])
    if kind == "gqa":
        kv = rng.choice([g for g in GQA_KV_HEADS if g < heads and heads % g == 0])
    else:
        kv = heads if kind == "mha" else 1
    config = {
        "hidden_size": hidden,
        "intermediate_size": rng.choice([2, 3, 4]) * hidden + rng.choice([0, 8, 24]),
        "num_hidden_layers": rng.randint(1, 4),
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "vocab_size": max_vocab if max_vocab == LARGE_VOCAB else rng.randint(256, max_vocab),
        "max_position_embeddings": 4096,
        "model_type": "tiny_llama",
        "torch_dtype": dtype_name,
    }
    if explicit:  # otherwise head_dim, eps and theta take the SPEC defaults
        config.update(head_dim=_head_dim(rng, hidden, heads, head_dims),
                      rms_norm_eps=rng.choice([1e-5, 1e-6]), rope_theta=rng.choice([10000.0, 500000.0]))
    return config


# (kind, torch_dtype, vocab bound, explicit keys) per model; fp16 and bf16 both, MHA/GQA/MQA.
QUICK_MODELS = [("mha", "float16", 4096, True), ("gqa", "bfloat16", 4096, True),
                ("mqa", "float16", LARGE_VOCAB, True), ("gqa", "bf16", 2048, False)]
FULL_MODELS = QUICK_MODELS + [("mha", "bfloat16", LARGE_VOCAB, True), ("mqa", "bfloat16", 8192, True),
                              ("gqa", "float16", LARGE_VOCAB, True), ("mha", "float16", 8192, False)]
QUICK_SIZES = ([32, 48, 64, 96], [8, 12, 16, 20, 24, 32])
FULL_SIZES = ([256, 384, 512, 768, 1024], [32, 48, 64, 80, 96, 128, 192])


def weight_scale(rng: random.Random, dtype: torch.dtype, hidden: int) -> float:
    (f_lo, f_hi), (k_lo, k_hi) = SCALE_RANGES[dtype]
    return max(TOY_SCALE * rng.uniform(f_lo, f_hi), math.sqrt(rng.uniform(k_lo, k_hi) / hidden))


def stress_models(rng: random.Random, quick: bool, device: str,
                  target_config: dict | None = None) -> list[StressModel]:
    """The random models of a run. In quick mode one of them, drawn at random, carries the
    long-prompt scenario (recomputing 1k tokens per call is most of a CPU run's time). With a
    Hugging Face target they take its conventions (an engine is written for one model family)."""
    hidden_choices, head_dims = QUICK_SIZES if quick else FULL_SIZES
    kinds = QUICK_MODELS if quick else FULL_MODELS
    long_prompt_model = rng.randrange(len(kinds))
    out = []
    for i, (kind, dtype_name, vocab, explicit) in enumerate(kinds):
        config = _model(rng, kind, dtype_name, hidden_choices, head_dims, vocab, explicit)
        if target_config is not None and is_hf(target_config):
            config = with_conventions_of(config, target_config)
        scale = weight_scale(rng, compute_dtype(config, device), config["hidden_size"])
        heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
        name = (f"m{i}-{kind}{heads}x{kv}-{dtype_name}-h{config['hidden_size']}"
                f"-d{config.get('head_dim', 'auto')}-l{config['num_hidden_layers']}-v{config['vocab_size']}")
        scenarios = tuple(s for s in STRESS_SCENARIOS
                          if s != LONG_PROMPT or not quick or i == long_prompt_model)
        out.append(StressModel(name, config, scale, rng.randrange(2**31), rng.randrange(2**31), scenarios))
    return out


def draw(seed: int, quick: bool, device: str, target_config: dict | None = None) -> tuple[list[StressModel], int]:
    """What a run of `seed` checks: its random models and the real model's trace seed."""
    rng = random.Random(seed)
    models = stress_models(rng, quick, device, target_config)
    return models, rng.randrange(2**31)


def target_scenarios(quick: bool) -> list[str]:
    """The real model's scenarios: its churn in quick mode, every scenario in full mode."""
    return ["churn"] if quick else list(STRESS_SCENARIOS)


def scenario_traces(trace_seed: int, scenarios, size: StressSize) -> tuple[int, list[list[Op]]]:
    """A model's token seed and each scenario's trace, as its run draws them."""
    rng = random.Random(trace_seed)
    gen_seed = rng.randrange(2**31)
    return gen_seed, [STRESS_SCENARIOS[scenario](rng, size) for scenario in scenarios]


def write_weights(weights: dict[str, torch.Tensor], folder: str, config: dict) -> None:
    """`weights` into `folder` in the format of `config`: a Hugging Face folder or the course's file."""
    if is_hf(config):
        save_hf_weights(weights, folder, config)
    else:
        save_weights(weights, Path(folder) / WEIGHT_FILE)


def judge_safe_weights(model: StressModel, device: str, tol: Tolerance,
                       log: Callable[[str], None] = lambda line: None,
                       margin_of: Callable[..., float] = judge_margin) -> dict[str, torch.Tensor]:
    """The model's weights, at its drawn scale or as much below it as the judge needs (JUDGE_MARGIN).
    The same model and device give the same weights: the margin's prompts are seeded by the model."""
    scale = model.scale
    for shrinks in range(MAX_SHRINKS + 1):
        weights = random_weights(model.config, model.weight_seed, scale, NORM_SPREAD)
        margin = margin_of(model.config, weights, device, tol, model.trace_seed)
        if margin >= JUDGE_MARGIN or shrinks == MAX_SHRINKS:
            break
        log(f"{model.name}: the judge is at margin {margin:.2f} from fp32 at weight scale {scale:.4g}; "
            f"scale x {SCALE_STEP}")
        scale *= SCALE_STEP
    return weights


def _safe_weights(model: StressModel, device: str, tol: Tolerance) -> tuple[dict[str, torch.Tensor], list[str]]:
    """judge_safe_weights and the lines it would have logged (run_stress logs them in order)."""
    said: list[str] = []
    return judge_safe_weights(model, device, tol, said.append), said


@dataclass
class _DrawnWhenAsked:
    """A random model's draw for an engine in the judge's process: _safe_weights, run on the
    calling thread when its result is asked for (run_stress says why)."""

    model: StressModel
    device: str
    tol: Tolerance

    def result(self) -> tuple[dict[str, torch.Tensor], list[str]]:
        return _safe_weights(self.model, self.device, self.tol)

    def cancel(self) -> None:
        """Nothing under way to cancel."""


# ---- running ----

@dataclass
class _Runner:
    """What every model's run shares: the candidate, the device, the sizes, the report."""

    module: ModuleType
    device: str
    size: StressSize
    tol: Tolerance
    report: StressReport
    log: Callable[[str], None]
    fail_fast: bool
    threads: ThreadWatch

    def model(self, name: str, config: dict, weight_dir: str, weights: dict[str, torch.Tensor],
              scenarios: list[str], trace_seed: int, tol: Tolerance | None = None) -> bool:
        """Every scenario on one model, one engine shared while it keeps passing (a failure
        leaves its state suspect, so the next scenario gets a fresh one). False: stop.
        tol: this model's, if not the run's (the target's under the bf16 criterion)."""
        tol = tol or self.tol
        gen_seed, traces = scenario_traces(trace_seed, scenarios, self.size)
        gen = make_generator(gen_seed, self.device)
        engine = reference = None
        for scenario, trace in zip(scenarios, traces):
            case = CaseResult(f"{name}/{scenario}", passed=False)
            t0 = time.perf_counter()
            session = None
            try:
                if engine is None:  # the engine first, then the reference (as the harness does)
                    engine = call_engine("create_engine", self.module.create_engine, config, weight_dir, self.device)
                if reference is None:
                    reference = ReferenceModel(config, weights, self.device, dtype=tol.reference_dtype)
                session = CheckedSession(engine, reference, gen, tol, label=f"{scenario}: ",
                                         threads=self.threads)
                session.run(trace)
                case.passed = True
            except EvalFailure as e:
                case.error, case.error_kind = str(e), e.kind
                engine = None
            if session is not None:
                s = session.stats
                case.calls, case.max_abs_err, case.worst_margin = s.calls, s.max_abs_err, s.worst_margin
            case.seconds = time.perf_counter() - t0
            self.report.cases.append(case)
            self.log(case.line())
            if self.fail_fast and not case.passed:
                return False
        return True


def run_stress(engine: ModuleType | str | Path, device: str = "auto", seed: int | None = None,
               quick: bool = True, target: tuple[dict | str | Path, str | Path] | None = None,
               fail_fast: bool = False, tol: Tolerance = Tolerance(),
               log: Callable[[str], None] = lambda line: None,
               target_tol: Tolerance | None = None) -> StressReport:
    """Run the stress suite on `engine`: a module or a path, run in this process, or the judge's
    RemoteModule for one in a worker (only that one gets its random models drawn ahead).
    `target` = (model config, weight dir) adds the real model: its churn scenario in quick mode,
    every scenario in full mode, judged at `target_tol` if given (the bf16 criterion's), the
    random models at `tol`.
    Never raises for a wrong engine: failures are in the report (EvalFailure only if the
    module cannot be imported). The same seed draws the same models and traces."""
    seed = random.SystemRandom().randrange(2**31) if seed is None else seed
    device = resolve_device(device)
    target_config = load_config(target[0]) if target is not None else None
    models, target_trace_seed = draw(seed, quick, device, target_config)
    # For an engine in a worker (the judge's RemoteModule), each random model's weights are drawn
    # (and their judge margin measured, ~0.5 s a model on a GPU) on a thread of the judge's while
    # the model before it runs: mostly while the judge waits for the worker. One model ahead at
    # most (a model's fp32 weights are held until its turn; an interrupted suite waits for one
    # draw, not all). The thread starts here, before the candidate's threads are counted. The same
    # model gives the same weights wherever they are drawn. For an engine in this process they are
    # drawn on this thread when its turn comes: the draw's GPU work during the engine's graph
    # capture (CUDA's global capture mode, the default) broke both (the public config's full
    # stress on an H200, thirty-third session).
    in_worker = isinstance(engine, RemoteModule)
    with ThreadPoolExecutor(1, thread_name_prefix="stress-weights") if in_worker else nullcontext() as ahead:
        def draw_ahead(i: int):
            if i >= len(models):
                return None
            if not in_worker:
                return _DrawnWhenAsked(models[i], device, tol)
            return ahead.submit(_safe_weights, models[i], device, tol)

        pending = draw_ahead(0)
        try:
            identities = FunctionIdentities()
            report = StressReport(seed, "quick" if quick else "full")
            module = load_engine_module(engine)
            run = _Runner(module, device, QUICK if quick else FULL, tol, report, log, fail_fast, identities.threads)
            log(f"stress ({report.mode}) on {device}, seed {seed}")
            go_on = True
            if target is not None:
                weight_dir = str(target[1])
                scenarios = target_scenarios(quick)
                go_on = run.model(TARGET, target_config, weight_dir, load_weights(weight_dir, target_config),
                                  scenarios, target_trace_seed, target_tol)
            for i, model in enumerate(models if go_on else []):
                weights, said = pending.result()
                pending = draw_ahead(i + 1)
                for line in said:
                    log(line)
                with tempfile.TemporaryDirectory(prefix="stress-weights-") as tmp:
                    write_weights(weights, tmp, model.config)
                    if not run.model(model.name, model.config, tmp, weights, list(model.scenarios), model.trace_seed):
                        break
        finally:
            if pending is not None:
                pending.cancel()
    identities.check("after the stress suite")
    log(report.summary())
    return report


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", required=True)
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, help="reproduce a run (default: a fresh draw, printed)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="small traces (the default on CPU)")
    mode.add_argument("--full", action="store_true", help="large traces (the default on CUDA)")
    p.add_argument("--model-config", help="also stress the real model (with --weight-dir)")
    p.add_argument("--weight-dir")
    p.add_argument("--fail-fast", action="store_true", help="stop at the first failing case")
    p.add_argument("--atol", type=float, default=1e-2)
    p.add_argument("--rtol", type=float, default=1e-2)
    a = p.parse_args(argv)
    if bool(a.model_config) != bool(a.weight_dir):
        p.error("--model-config and --weight-dir go together")
    check_harness_inputs(a.engine, a.model_config, a.weight_dir)
    target = (a.model_config, a.weight_dir) if a.model_config else None
    quick = a.quick or (not a.full and resolve_device(a.device) != "cuda")
    report = run_stress(a.engine, a.device, a.seed, quick, target, a.fail_fast,
                        Tolerance(a.atol, a.rtol), log=lambda line: print(line, flush=True))
    sys.exit(0 if report.failed == 0 else 1)


if __name__ == "__main__":
    main()
