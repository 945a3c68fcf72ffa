"""Flags and environment → RunConfig; inputs checked; the loop run; an exit code.

Exit codes: 0 workspace/engine.py holds an engine the evaluator passed in this run;
1 no candidate passed; 2 bad inputs or flags, or a workspace --resume cannot take over (one
line on stderr, workspace untouched); 3 the workspace cannot be written (read-only, disk full:
one line on stderr; whatever engine.py holds passed); 130 interrupted (likewise).
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from agent import acceptance, loop, resume
from agent.judge import REPO, Judge, JudgeSettings, Place
from agent.plan import Plan, engine_models, engines
from agent.pipeline import DEFAULT_PARALLEL, PARALLEL_ENV
from agent.providers import NAMES, ProviderOptions, make_proposer, resolve_name
from agent.providers.builtin import BuiltinProposer
from agent.records import EvalResult, SearchState
from agent.report import Entry, Reporter, describe
from agent.resume import Previous, ResumeError
from agent.spec import WEIGHTS_FILE, ModelSpec, SpecError, check_window_covers, load_spec
from agent.workspace import JUDGE_LOGS, Workspace, WorkspaceBusy

EXIT_OK, EXIT_NO_ENGINE, EXIT_BAD_INPUT, EXIT_WRITE_FAILED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
# Where the judged environment mounts its inputs; the repository's own target otherwise.
MOUNTED_CONFIG, MOUNTED_WEIGHTS = Path("/target/model_config.json"), Path("/target/weights")
REPO_CONFIG, REPO_WEIGHTS = REPO / "target" / "model_config.json", REPO / "target" / "weights"
HF_CONFIG = "config.json"   # a model folder's own config, used when --config is not given
TOY_WEIGHTS_SCRIPT = REPO / "scripts" / "generate_toy_weights.py"
# Default budgets: a CPU run is a smoke run (recompute, KV cache, a few parameters); on a GPU
# the walk over kernel variants and parameters needs roughly half an hour.
DEFAULT_BUDGET = {"cpu": 600.0, "cuda": 1800.0}
# Evaluator settings per device, the same for every candidate so their scores compare. On CPU
# the recompute engine is slow (a decode step re-runs the whole prompt), so one timed run of
# the public cases; on CUDA the official method (warm-up, median of 3) and every case for the
# engine installed, one fresh engine a case for a screen or a contest's round (agent/judge.py).
BENCH = {"cpu": {"warmup": 0, "repeat": 1, "screen_repeat": 1, "cases": "prefill,decode,mixed"},
         "cuda": {"warmup": 1, "repeat": 3, "screen_repeat": 1,
                  "cases": "prefill,decode,mixed,decode128,mixed128"}}
DEVICES = ("auto", "cuda", "cpu")
# What the builtin proposer walks: the library's kernel variants and the engine parameters
# (full), or the all-torch engine's parameters only (params: kernels come from a model alone).
BUILTIN_WALKS = ("full", "params")
BANDWIDTH, PEAK = "bandwidth GB/s", "peak TFLOP/s"   # keys of the hardware facts handed to the evaluator
KEPT_FLOOR = ", kept from the resumed run"   # how the facts of a resumed run say their floor is the run's own
SEED_RANGE = 1_000_000
ENV = {"config": "MODEL_CONFIG", "weights": "WEIGHT_DIR", "device": "DEVICE", "budget": "BUDGET",
       "provider": "PROVIDER", "model": "LLM_MODEL", "seed": "SEED", "workspace": "AGENT_WORKSPACE",  # not WORKSPACE: CI sets it
       "max_candidates": "MAX_CANDIDATES", "parallel": PARALLEL_ENV, "builtin_walk": "BUILTIN_WALK", "gpus": "GPUS"}


@dataclass(frozen=True)
class RunConfig:
    config: Path
    weights: Path
    device: str          # resolved: "cpu" | "cuda"
    budget: float        # seconds, wall clock, for the whole search
    provider: str
    model: str | None    # the LLM to ask; None: the provider's default
    seed: int
    workspace: Path
    max_candidates: int | None = None   # stop after this many judged; None: the budget decides
    parallel: int = 1                   # model episodes in flight while the judge works (agent/pipeline.py)
    builtin_walk: str = "full"          # one of BUILTIN_WALKS
    gpus: tuple[str, ...] = ()          # CUDA_VISIBLE_DEVICES names of the GPUs judged on; () one judge, as is


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    env = lambda name, default=None: os.environ.get(ENV[name]) or default  # noqa: E731
    p = argparse.ArgumentParser(prog="run.sh", description="Write, verify and tune workspace/engine.py "
                                "for a model. Every flag can also be set by the environment variable named.")
    p.add_argument("--config", "--model-config", default=env("config"),
                   help=f"model config JSON [{ENV['config']}; default the weights folder's {HF_CONFIG} if it has one, "
                        f"else {MOUNTED_CONFIG} if present, else target/]")
    p.add_argument("--weights", "--weight-dir", default=env("weights"),
                   help=f"folder with {WEIGHTS_FILE}, or a Hugging Face model folder (config.json, safetensors) "
                        f"[{ENV['weights']}; default {MOUNTED_WEIGHTS} if present, else target/weights]")
    p.add_argument("--device", choices=DEVICES, default=env("device", "auto"),
                   help=f"[{ENV['device']}] cuda without a GPU falls back to cpu, as the harness does")
    p.add_argument("--budget", type=float, default=env("budget"),
                   help=f"seconds for the whole search [{ENV['budget']}; default {DEFAULT_BUDGET['cpu']:.0f} on cpu, "
                        f"{DEFAULT_BUDGET['cuda']:.0f} on cuda]")
    p.add_argument("--provider", choices=NAMES, default=env("provider", "builtin"),
                   help=f"who proposes candidates [{ENV['provider']}; default builtin, offline]")
    p.add_argument("--model", default=env("model"),
                   help=f"the LLM an LLM provider asks [{ENV['model']}; default OPENAI_MODEL / ANTHROPIC_MODEL, "
                        "else the provider's default]")
    p.add_argument("--seed", type=int, default=env("seed"),
                   help=f"stress-suite seed, the same for every candidate of the run [{ENV['seed']}; default: "
                        "drawn fresh and logged, so inputs differ between runs]")
    p.add_argument("--workspace", default=env("workspace", str(REPO / "workspace")),
                   help=f"output folder [{ENV['workspace']}; default workspace/]")
    p.add_argument("--max-candidates", type=int, default=env("max_candidates"),
                   help=f"stop once this many candidates are judged, the conservative engine included "
                        f"[{ENV['max_candidates']}; default: no limit, the budget decides]")
    p.add_argument("--parallel", type=int, default=env("parallel"),
                   help=f"model requests in flight while the judge works, one evaluation at a time "
                        f"[{ENV['parallel']}; default {DEFAULT_PARALLEL} for an LLM provider, 1 for builtin]")
    p.add_argument("--builtin-walk", choices=BUILTIN_WALKS, default=env("builtin_walk", "full"),
                   help=f"what the builtin proposer tries [{ENV['builtin_walk']}; default full: the library's kernel "
                        "variants, then engine parameters; params: the all-torch engine and its parameters only, "
                        "so that kernels come from the model alone]")
    p.add_argument("--gpus", type=int, default=env("gpus"),
                   help=f"GPUs to judge on: the first judges every candidate in full, each other screens the next "
                        f"candidates meanwhile [{ENV['gpus']}; default every GPU of the first one's kind, 1 on cpu]")
    p.add_argument("--resume", action="store_true",
                   help="continue the interrupted run in the workspace (same config, weights and device): "
                        "candidates already judged are not judged again, the best so far is kept")
    given = sys.argv[1:] if argv is None else argv
    for name, kind in (("budget", float), ("seed", int), ("max_candidates", int), ("parallel", int), ("gpus", int)):
        flag, value = "--" + name.replace("_", "-"), env(name)
        if value is None or any(arg == flag or arg.startswith(flag + "=") for arg in given):
            continue
        try:   # argparse would name the flag, not the variable the value came from
            kind(value)
        except ValueError:
            p.error(f"{ENV[name]}={value!r}: not {'a number' if kind is float else 'a whole number'}")
    args = p.parse_args(argv)
    args.device = "cuda" if str(args.device).startswith("cuda:") else args.device   # DEVICE=cuda:0
    for name, choices in (("device", DEVICES), ("provider", NAMES), ("builtin_walk", BUILTIN_WALKS)):
        if getattr(args, name) not in choices:  # argparse checks flags, not environment defaults
            p.error(f"{ENV[name]}={getattr(args, name)!r}: choose from {', '.join(choices)}")
    def source(name: str) -> str:   # what the user set: the flag, or the variable it came from
        flag = "--" + name.replace("_", "-")
        from_flag = any(arg == flag or arg.startswith(flag + "=") for arg in given)
        return flag if from_flag or env(name) is None else ENV[name]
    # inf (or nan) seconds is no budget: the run would never end on its own
    if args.budget is not None and not 0 < float(args.budget) < float("inf"):
        p.error(f"{source('budget')} must be a positive, finite number of seconds, got {args.budget}")
    for name in ("parallel", "gpus", "max_candidates"):
        if getattr(args, name) is not None and not int(getattr(args, name)) >= 1:
            p.error(f"{source(name)} must be at least 1, got {getattr(args, name)}")
    return args


def resolve(args: argparse.Namespace) -> RunConfig:
    if args.config:
        config = Path(args.config)
    elif args.weights and (Path(args.weights) / HF_CONFIG).is_file():  # a Hugging Face model folder
        config = Path(args.weights) / HF_CONFIG
    else:
        config = MOUNTED_CONFIG if MOUNTED_CONFIG.is_file() else REPO_CONFIG
    weights = Path(args.weights) if args.weights else (MOUNTED_WEIGHTS if MOUNTED_WEIGHTS.is_dir() else REPO_WEIGHTS)
    from evaluator.common import resolve_device  # the harness's rule; imports torch

    device = resolve_device(args.device)
    budget = float(args.budget) if args.budget is not None else DEFAULT_BUDGET[device]
    seed = int(args.seed) if args.seed is not None else random.randrange(SEED_RANGE)
    return RunConfig(_absolute(config, "model config"), _absolute(weights, "weights directory"), device, budget,
                     args.provider, args.model, seed, _absolute(Path(args.workspace), "workspace"),
                     int(args.max_candidates) if args.max_candidates is not None else None,
                     int(args.parallel) if args.parallel is not None
                     else 1 if resolve_name(args.provider) == "builtin" else DEFAULT_PARALLEL,
                     args.builtin_walk, judged_gpus(device, int(args.gpus) if args.gpus is not None else None))


def judged_gpus(device: str, asked: int | None) -> tuple[str, ...]:
    """The GPUs the run judges on, as CUDA_VISIBLE_DEVICES will name them to each judge (by UUID
    where torch reports one, else the caller's own entry: a MIG instance stays as named): the first
    `asked` of the first one's kind, else every GPU of that kind (timings on a GPU of another kind
    would not compare). () for one: the judge runs as it always did."""
    if device != "cuda":
        if asked is not None and asked > 1:
            raise SpecError(f"--gpus {asked} needs CUDA GPUs; the device is {device}")
        return ()
    import torch

    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [v.strip() for v in visible.split(",")][:len(names)] if visible else [str(i) for i in range(len(names))]
    uuids = [getattr(torch.cuda.get_device_properties(i), "uuid", None) for i in range(len(names))]
    ids = [f"GPU-{uuid}" if uuid and not ids[i].upper().startswith("MIG") else ids[i] for i, uuid in enumerate(uuids)]
    alike = [ids[i] for i in range(len(names)) if names[i] == names[0]]
    if asked is not None and asked > len(alike):
        raise SpecError(f"--gpus {asked}: this machine has {len(alike)} GPU(s) of the first one's kind"
                        + (f" ({names[0]}; timings on another kind would not compare)" if names else ""))
    chosen = alike[:asked] if asked is not None else alike
    return tuple(chosen) if len(chosen) > 1 else ()


def core_of(cpu: int) -> str:
    """The physical core a CPU (a hardware thread) is on, as the hardware threads it shares (the
    kernel's thread_siblings_list); itself where the kernel does not say."""
    try:
        return Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip()
    except OSError:
        return str(cpu)


def places(gpus: tuple[str, ...]) -> list[Place]:
    """Each judged GPU with its share of this process's CPUs: whole cores (with SMT, a core's
    threads are numbered far apart: cut in CPU order, two judges shared every core), in CPU order,
    as even as they split, the cores left over to the first judges (the first decides)."""
    cores: dict[str, list[int]] = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        cores.setdefault(core_of(cpu), []).append(cpu)
    if len(cores) < len(gpus):   # too few to split: every judge may use them all
        return [Place(str(i), gpu, frozenset(os.sched_getaffinity(0))) for i, gpu in enumerate(gpus)]
    share, more = divmod(len(cores), len(gpus))
    bounds = [0]
    for i in range(len(gpus)):
        bounds.append(bounds[-1] + share + (i < more))
    ordered = list(cores.values())
    return [Place(str(i), gpu, frozenset(cpu for core in ordered[bounds[i]:bounds[i + 1]] for cpu in core))
            for i, gpu in enumerate(gpus)]


def _absolute(path: Path, what: str) -> Path:
    """path.resolve(); a path that cannot be resolved (a symlink loop) is a bad input like any other."""
    try:
        return path.resolve()
    except (OSError, RuntimeError) as e:
        raise SpecError(f"{what} {path} cannot be resolved: {e}") from None


def ensure_toy_weights(cfg: RunConfig) -> None:
    """Toy weights for the repository's own target only, written aside then renamed (never into /target)."""
    target = cfg.weights / WEIGHTS_FILE
    if cfg.config != REPO_CONFIG.resolve() or cfg.weights != REPO_WEIGHTS.resolve() or target.exists():
        return
    cfg.weights.mkdir(parents=True, exist_ok=True)
    tmp = cfg.weights / f".{WEIGHTS_FILE}.partial"
    print(f"making toy weights: {target}", flush=True)
    try:
        done = subprocess.run([sys.executable, str(TOY_WEIGHTS_SCRIPT), "--config", str(cfg.config),
                               "--output", str(tmp)], cwd=REPO, capture_output=True, text=True)
    except BaseException:   # Ctrl-C: no half-written file left behind
        tmp.unlink(missing_ok=True)
        raise
    if done.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise SpecError(f"could not make toy weights with {TOY_WEIGHTS_SCRIPT.name}: "
                        f"{(done.stderr.strip().splitlines() or ['no output'])[-1]}")
    os.replace(tmp, target)


def hardware(device: str, config: Path, recorded: dict | None = None) -> dict:
    """The machine's facts, with its memory bandwidth and GEMM peak measured once per run (a
    known GPU's from the evaluator's table): every evaluation gets them as flags, so each
    candidate's floor is the same and none spends time or memory measuring again. `recorded`:
    a resumed run's facts, whose floor is kept where the machine is the same one (device, GPU,
    CPUs, torch): measured again, a busy CPU's bandwidth had read 54.7 against 33.6 GB/s, and the
    summary's scores before and after the resume were on two floors (a new-user walkthrough,
    thirty-ninth session)."""
    import torch

    from evaluator.common import compute_dtype, load_config
    from evaluator.floor import detect_hardware

    facts = {"device": device, "cpus": os.cpu_count(), "torch": torch.__version__}
    if device == "cuda":
        facts["gpu"] = torch.cuda.get_device_name(0)
    recorded = recorded or {}
    if all(recorded.get(k) == v for k, v in facts.items()) and all(
            isinstance(recorded.get(k), (int, float)) and 0 < recorded[k] < math.inf for k in (BANDWIDTH, PEAK)):
        source = str(recorded.get("floor from", "measured")).removesuffix(KEPT_FLOOR)
        return {**facts, BANDWIDTH: recorded[BANDWIDTH], PEAK: recorded[PEAK], "floor from": source + KEPT_FLOOR}
    hw = detect_hardware(device, compute_dtype(load_config(config), device))
    facts.update({BANDWIDTH: round(hw.bandwidth_gbs, 1), PEAK: round(hw.peak_tflops, 2), "floor from": hw.source})
    return facts


def python_command() -> str:
    """The interpreter the printed commands name: `python3` where that is the one running (the
    same folder as on PATH: a venv's python3 beside its python), else this one's path. run.sh may
    have taken $PYTHON or .venv/bin/python, and the `python3` on PATH lack torch (the re-run
    commands had failed with "No module named 'torch'")."""
    found = shutil.which("python3")
    if found and Path(found).parent == Path(sys.executable).parent:
        return "python3"
    return shlex.quote(sys.executable)


def selftest_commands(cfg: RunConfig) -> list[str]:
    common = (f"--engine {shlex.quote(str(cfg.workspace / 'engine.py'))} --model-config {shlex.quote(str(cfg.config))} "
              f"--weight-dir {shlex.quote(str(cfg.weights))} --device {cfg.device}")
    scripts = REPO / "evaluator"   # absolute: the commands work from any folder
    return [f"{python_command()} {shlex.quote(str(scripts / name))} {common}"
            for name in ("test_correctness.py", "stress.py", "benchmark_throughput.py")]


def closing_lines(ws: Workspace, entries: list[Entry], cfg: RunConfig, interrupted: bool = False) -> list[str]:
    verdict = ws.installed_verdict()
    if verdict is None and interrupted:   # Ctrl-C before the first verdict had blamed the budget
        return [f"result: no candidate passed: interrupted before a verdict; {ws.engine} was not written"]
    if verdict is None:
        # a budget too short for even the conservative engine's verdict read as a broken engine
        # ("verify: FAILED at unknown (timeout)"; a new-user walkthrough, thirty-third session)
        ran_out = bool(entries) and all(e.result is None or e.result.unfinished or e.result.error_kind == "timeout"
                                        for e in entries)
        why = (f": the budget ({cfg.budget:.0f} s) ended before a verdict did; give the run more (--budget)"
               if ran_out else "")
        return [f"result: no candidate passed{why}; {ws.engine} was not written"]
    result = EvalResult.from_dict(verdict["result"])
    conservative = entries[0].result if entries and entries[0].result and entries[0].result.passed else None
    ratio = acceptance.speedup(result, conservative) if conservative and verdict["index"] != 1 else None
    speedup = f", {ratio:.1f}x the conservative engine over the cases both timed" if ratio else ""
    return [f"result: {ws.engine} = #{verdict['index']:03d} {describe(Plan.from_dict(verdict['plan']))} "
            f"(score {result.rank():.4g}{speedup})",
            "re-run the self-tests on it:", *[f"  {c}" for c in selftest_commands(cfg)]]


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()  # the budget covers the whole run, input checks included
    args = parse_args(argv)
    try:
        cfg = resolve(args)
        ensure_toy_weights(cfg)
        spec = load_spec(cfg.config, cfg.weights)
        check_window_covers(spec, BENCH[cfg.device]["cases"].split(","))
    except SpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:   # Ctrl-C while toy weights are made or a large checkpoint checked: had been a traceback
        print("interrupted before the run started; nothing written", file=sys.stderr)
        return EXIT_INTERRUPTED
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # unwind: kill the evaluator
    with contextlib.ExitStack() as held:   # the workspace's lock, until the run ends
        try:
            return run_in(Workspace(cfg.workspace), cfg, args, spec, started, held)
        except KeyboardInterrupt:   # outside the search's own handling (the hardware measured): had been a traceback
            print(f"interrupted; {cfg.workspace / 'engine.py'} holds the best engine that passed, if any",
                  file=sys.stderr)
            return EXIT_INTERRUPTED


def run_in(ws: Workspace, cfg: RunConfig, args: argparse.Namespace, spec: ModelSpec, started: float,
           held: contextlib.ExitStack) -> int:
    """The run, in the workspace it takes and holds (on `held`); the exit code."""
    try:
        held.enter_context(ws.locked())
        previous, notes = open_workspace(ws, cfg, args.resume)
        report = Reporter(cfg.workspace)
    except WorkspaceBusy as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except ResumeError as e:
        print(f"error: cannot resume: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as e:   # a file in its place had read "[Errno 17] File exists"
        why = "it is a file, not a folder" if cfg.workspace.is_file() else e
        print(f"error: cannot write the workspace {cfg.workspace}: {why}", file=sys.stderr)
        return EXIT_WRITE_FAILED
    if previous is not None and args.seed is None and previous.seed is not None:
        cfg = replace(cfg, seed=previous.seed)  # the interrupted run's stress draw, so verdicts compare
    bench = BENCH[cfg.device]
    facts = hardware(cfg.device, cfg.config, previous.hardware if previous is not None else None)
    settings = JudgeSettings(sys.executable, cfg.config, cfg.weights, cfg.device, cfg.seed, stress="quick",
                             cases=bench["cases"], warmup=bench["warmup"], repeat=bench["repeat"],
                             screen_repeat=bench["screen_repeat"],
                             bandwidth_gbs=facts[BANDWIDTH], peak_tflops=facts[PEAK],
                             profile=cfg.provider != "builtin")   # measured slot shares for the model's prompts
    if cfg.gpus:   # a worker at a time on each GPU: the host's memory shared between them
        settings = replace(settings, memory_bytes=settings.memory_bytes // len(cfg.gpus))
    state = SearchState(spec=spec, device=cfg.device, hardware=facts, seconds_left=cfg.budget)
    try:
        # The run's Triton cache: the judge's, shared by its candidates (evaluator/triton_cache.py).
        with tempfile.TemporaryDirectory(prefix="judge-triton-cache-") as cache:
            return run_search(cfg, spec, state, replace(settings, triton_cache=Path(cache)), ws, report,
                              previous, started, notes)
    except OSError as e:  # a full disk, a workspace made read-only: the run cannot record anything more
        print(f"error: writing the workspace failed: {e}; {ws.engine} holds the best engine that passed, if any",
              file=sys.stderr)
        return EXIT_WRITE_FAILED


def open_workspace(ws: Workspace, cfg: RunConfig, resuming: bool) -> tuple[Previous | None, list[str]]:
    """A fresh workspace (the last run moved aside), or (--resume) the interrupted run's, made
    consistent (agent/resume.py); and lines for the log saying which."""
    if not resuming:
        return None, [line for line in [ws.reset()] if line]
    previous = resume.load(ws, run_record(cfg))
    if previous is not None:
        ws.clear_leftovers()
        return previous, []
    moved = ws.reset()
    return None, [f"--resume: no run recorded in {ws.root} to resume; a new run", *([moved] if moved else [])]


def run_record(cfg: RunConfig) -> dict[str, str]:
    """The run's settings as results.json records them."""
    return {k: str(v) for k, v in cfg.__dict__.items()}


def run_search(cfg: RunConfig, spec: ModelSpec, state: SearchState, settings: JudgeSettings, ws: Workspace,
               report: Reporter, previous: Previous | None, started: float, notes: list[str]) -> int:
    """Report, proposer, loop; the exit code. `notes`: open_workspace's lines."""
    if previous is not None:
        report.entries = list(previous.entries)
        state.history = [(e.candidate, e.result) for e in previous.entries]
        if previous.search_best is not None:
            state.best, state.best_result = previous.search_best.candidate, previous.search_best.result
        state.waiting = list(previous.waiting)
    report.start({"run": run_record(cfg), "spec": spec.to_dict(),
                  "hardware": state.hardware}, header_lines(cfg, spec, state.hardware, settings))
    for note in notes:
        report.line(note)
    if previous is not None:
        best = previous.best
        if best is not None:
            report.best_line = f"#{best.index:03d} {describe(best.candidate.plan)} (score {best.result.rank():.4g})"
        report.line(f"resumed: {len(previous.entries)} candidates judged before (not judged again), best "
                    + (f"#{best.index:03d} {describe(best.candidate.plan)}" if best else "none"))
        if previous.waiting or previous.unreadable_waiting:
            report.line(f"resumed: {len(previous.waiting)} model candidate(s) checked but not judged, back in the "
                        "queue: " + ("; ".join(describe(c.plan) for c in previous.waiting) or "none")
                        + (f" ({previous.unreadable_waiting} unreadable, left out)" if previous.unreadable_waiting else ""))
    ws.open_history(warn=report.warn)
    builtin = BuiltinProposer(cfg.device, kernels=cfg.builtin_walk == "full")
    options = ProviderOptions(cfg.device, cfg.seed, cfg.workspace, builtin,
                              log=report.line, model=cfg.model)
    proposer = make_proposer(cfg.provider, options, report.warn)
    report.meta["proposer"] = proposer.name
    report.line(f"proposer {proposer.name}")
    interrupted = False
    try:
        with contextlib.ExitStack() as judges:   # one evaluator process for the run, and one a spare GPU
            where = places(cfg.gpus) if cfg.gpus else [None]
            judge, *spares = [judges.enter_context(Judge(settings, ws.root / JUDGE_LOGS / (f"gpu{p.label}" if i else ""),
                                                         p)) for i, p in enumerate(where)]
            verdicts = lambda one: lambda engine, out, timeout, phase: one.verdict(  # noqa: E731
                engine, out, timeout, settings.for_phase(phase))
            loop.run(state, proposer, verdicts(judge), ws, report, cfg.budget, started, cfg.max_candidates,
                     cfg.parallel, series=judge.series, spares={s.place.label: verdicts(s) for s in spares})
    except (KeyboardInterrupt, SystemExit):
        interrupted = True
        report.line(f"interrupted; {ws.engine} holds the best engine that passed, if any")
    report.finish(closing_lines(ws, report.entries, cfg, interrupted))
    if interrupted:
        return EXIT_INTERRUPTED
    return EXIT_OK if ws.installed_verdict() else EXIT_NO_ENGINE


def hf_lines(spec: ModelSpec) -> list[str]:
    """For a Hugging Face model: its conventions and the engines that render them (the others'
    candidates fail at render, naming this)."""
    if not spec.conventions.hf:
        return []
    able = [e for e in engines() if "hf" in engine_models(e)]
    return [f"Hugging Face model ({spec.conventions.describe()}): engines that run it: {', '.join(able)}; "
            f"the others are not proposed (their candidates would fail at render)"]


def bf16_lines(spec: ModelSpec, device: str) -> list[str]:
    """For a bf16 model in the course format on a GPU: why the recompute engine is likely to stay
    the result (measured: docs/benchmarks.md, twenty-second session, `python3 -m scripts.gpu bf16-probe`)."""
    if device != "cuda" or spec.dtype != "bfloat16" or spec.conventions.hf:
        return []
    return ["bf16 in the course format: the judge holds every engine to allclose(1e-2) against the bf16 reference, "
            "which that reference itself missed on 83 of 200 requests when only its GEMMs' sizes changed (the public "
            "config with toy weights on an H200: docs/benchmarks.md); an engine with a KV cache computes every position at other sizes and "
            "passes long or wide calls by chance, so the recompute engine (the reference's own shapes) is likely "
            "to stay the result"]


def header_lines(cfg: RunConfig, spec: ModelSpec, hw: dict, settings: JudgeSettings) -> list[str]:
    return [f"config {cfg.config}   weights {cfg.weights}",
            f"device {cfg.device}   budget {cfg.budget:.0f}s   provider {cfg.provider}   seed {cfg.seed}"
            + ("   builtin walk: the all-torch engine's parameters only" if cfg.builtin_walk == "params" else ""),
            *([f"judged on {len(cfg.gpus)} GPUs ({', '.join(f'{i}: {gpu}' for i, gpu in enumerate(cfg.gpus))}): "
               f"GPU 0 judges every candidate in full, {'the others screen' if len(cfg.gpus) > 2 else 'GPU 1 screens'} "
               f"the next ones meanwhile (each judge on {len(places(cfg.gpus)[0].cpus)} CPUs, "
               f"{settings.memory_bytes / 2**30:.0f} GiB a worker)"] if cfg.gpus else []),
            f"hardware {', '.join(f'{k} {v}' for k, v in hw.items())}",
            f"model {spec.summary()}",
            *[f"warning: {w}" for w in spec.warnings],
            *hf_lines(spec),
            *bf16_lines(spec, cfg.device),
            f"evaluator python3 {' '.join(settings.command()[1:])} (one process for the run; a request per verdict)"
            + (f"; screens and contest rounds time {settings.screen_repeat} fresh engine(s) a case, the engine "
               f"installed {settings.repeat}" if settings.screens_time_less() else "")]
