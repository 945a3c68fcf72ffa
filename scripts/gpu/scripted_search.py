"""One device call: a scripted good model writes every kernel; its run's score against the library plan's (issue 23).

    python3 -m scripts.gpu scripted-search [--budget 300] [--library-score S] [--library-plan NAME]
        [--parallel 4] [--seed N] [--device cuda|cpu] [--out DIR]

  1. The builtin library's score: the library plan (--library-plan, default the plan a builtin
     run ends at on the public config) rendered and judged once by `python3 -m evaluator.evaluate`
     with the settings a run uses on this device (the run's cases, warm-up, repeats, quick stress,
     floor facts and seed), as a finalist's verdict is; or --library-score from an earlier call.
     On a CPU the library plan is the all-torch engine, which the run judges itself: its score
     is read from the run's results.json instead of a second evaluation.
  2. The agent (`python3 -m agent --provider openai --builtin-walk params`) on the same config
     and seed, within --budget seconds: the builtin proposer judges the all-torch KV-cache engine
     and tunes its parameters only, so every kernel comes from the model, a good model played by
     scripts/llm_server.py's GoodModel on 127.0.0.1 (the real prompts, answered with the
     library's own kernels kept in tests/fixtures/llm/good/, a slow first answer for some slots
     so that refinement runs; the real client, extraction, policy, unit check, parallel episodes,
     archive and acceptance).
  3. Prints the run's final score against the library's and the ratio against the 80% target,
     candidates judged per minute, what the model answered, and results.log's tail; results.log,
     results.json, engine.py, the transcript and summary.txt land in --out ($OUT when set).

The budget is REDUCED: the issue's check is "within the default budget" (1800 s on CUDA), but a
device call lasts at most 10 minutes, so the default here is 300 s (with the library's
evaluation, about 7-8 minutes in all); a GPU evaluation takes 50-100 s, so such a run judges only
a handful of candidates, and its ratio is a lower bound on the default budget's. The default
budget is reached over several calls: each leaves `continue.tgz` in --out (the run's workspace,
the good model's memory, the budgets spent, the library's score), and `--continue-from` that
file resumes the run (`python3 -m agent --resume`) for this call's --budget more (the judge's
Triton cache is not kept: each call compiles anew). docs/llm.md has the commands. --device cpu is
the smoke run: a tiny model, a short budget, the library plan all-torch (the library's
kernels do not run on a CPU), the model's kernels through their torch fallbacks. Device tool:
carry [".whl"]; on the device: `python3 -m scripts.gpu scripted-search --out $OUT`.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from scripts.gpu.common import (FINAL_PLAN, PUBLIC_CONFIG, PUBLIC_WEIGHTS, ensure_toy_weights, library_plans,
                                out_dir, prelude, render_to_file, run)
from scripts.llm_server import GoodModel

TARGET = 0.8               # the bar: the model's run reaches 80% of the library's score
DEFAULT_BUDGET = 300       # seconds; see the docstring: the CUDA default (1800) does not fit a device call
SMOKE_BUDGET = 300         # --device cpu: recompute, all-torch, a model episode or two (less on a loaded machine)
RUN_GRACE_S = 120          # past the budget before the agent is cut (it ends within its budget)
JUDGE_TIMEOUT_S = 300      # the library's one evaluation
CPU_LIBRARY_PLAN = "torch" # the library's kernels are CUDA-only: on a CPU the builtin ends all-torch
MODEL_NAME = "scripted-good-model"
# The agent's LLM settings for a model on 127.0.0.1 that answers at once: a short request timeout
# (the run keeps timeout + 60 s free after a request, and the default 180 s would stop the model
# early in a 300 s run), no price, calls enough for the budget.
LLM_ENV = {"OPENAI_API_KEY": "scripted", "OPENAI_MODEL": MODEL_NAME, "LLM_PRICE_PER_MTOK": "0,0",
           "LLM_TIMEOUT_S": "20", "LLM_MAX_CALLS": "200", "LLM_RETRY_DELAY_S": "0.5"}
# --device cpu: a tiny model the CPU judges in seconds (the public config's recompute engine takes minutes).
SMOKE_CONFIG = {"head_dim": 24, "hidden_size": 64, "intermediate_size": 160, "max_position_embeddings": 4096,
                "model_type": "tiny_llama", "num_attention_heads": 4, "num_hidden_layers": 2,
                "num_key_value_heads": 2, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
                "torch_dtype": "float16", "vocab_size": 256}
KEPT = ("results.log", "results.json", "engine.py", "engine.json")
LOG_TAIL = 40
CONTINUATION = "continue.tgz"   # in --out: what --continue-from takes
WORKSPACE_IN_TAR, STATE_IN_TAR = "workspace", "state.json"
WORKSPACE = Path("/tmp/scripted_search_ws")
SMOKE_MODEL = Path("/tmp/scripted_search_smoke")   # --device cpu: the tiny model's config and weights


def write_continuation(path: Path, workspace: Path, state: dict) -> None:
    """The run's workspace and `state` (library_score, budgets, memory) as one file, written whole."""
    import io
    import tarfile
    partial = path.with_suffix(".part")
    with tarfile.open(partial, "w:gz") as tar:
        tar.add(workspace, arcname=WORKSPACE_IN_TAR)
        data = json.dumps(state, indent=1).encode()
        info = tarfile.TarInfo(STATE_IN_TAR)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    partial.replace(path)


def read_continuation(path: Path, workspace: Path) -> dict:
    """`state` of a continuation file, its workspace extracted to `workspace` (replacing it only
    once the file has proved to be one). ValueError names what is wrong with it."""
    import tarfile
    try:
        with tarfile.open(path, "r:gz") as tar:
            members = tar.getmembers()
            names = {m.name for m in members}
            if STATE_IN_TAR not in names or WORKSPACE_IN_TAR not in names:
                raise ValueError(f"not a {CONTINUATION} of scripted-search (no {STATE_IN_TAR} or {WORKSPACE_IN_TAR}/)")
            state = json.loads(tar.extractfile(STATE_IN_TAR).read())
            if not isinstance(state, dict) or not isinstance(state.get("budgets", []), list):
                raise ValueError(f"{STATE_IN_TAR} is not a continuation's state")
            ours = [m for m in members if m.name == WORKSPACE_IN_TAR or m.name.startswith(WORKSPACE_IN_TAR + "/")]
            bad = [m.name for m in ours if not (m.isfile() or m.isdir()) or ".." in Path(m.name).parts]
            if bad:   # write_continuation makes files and folders only, under workspace/
                raise ValueError(f"unexpected members {bad[:3]}")
            tmp = workspace.parent / (workspace.name + ".extract")
            shutil.rmtree(tmp, ignore_errors=True)
            extra = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extractall(tmp, members=ours, **extra)
    except (OSError, tarfile.TarError, UnicodeDecodeError) as e:
        raise ValueError(f"unreadable: {e}") from e
    shutil.rmtree(workspace, ignore_errors=True)
    (tmp / WORKSPACE_IN_TAR).replace(workspace)
    shutil.rmtree(tmp, ignore_errors=True)
    return state


def library_score(plan_name: str, config: str, weights: str, device: str, seed: int, out: Path) -> float | None:
    """The library plan's score, judged as a run judges a finalist on this device (agent.cli's
    settings); None when it did not pass."""
    from agent.cli import BANDWIDTH, BENCH, PEAK, hardware
    from agent.judge import FINAL, JudgeSettings, judge
    bench, facts = BENCH[device], hardware(device, Path(config))
    settings = JudgeSettings(sys.executable, Path(config).resolve(), Path(weights).resolve(), device, seed,
                             stress="quick", cases=bench["cases"], warmup=bench["warmup"], repeat=bench["repeat"],
                             screen_repeat=bench["screen_repeat"], bandwidth_gbs=facts[BANDWIDTH], peak_tflops=facts[PEAK])
    engine = render_to_file(library_plans()[plan_name], plan_name)
    result = judge(engine, out / "library", JUDGE_TIMEOUT_S, settings.for_phase(FINAL))
    shutil.copy(engine, out / "library" / "engine.py")
    if not result.passed:
        print(f"library plan {plan_name!r} did not pass: {result.stage}/{result.error_kind}: {result.error}")
        return None
    return result.rank()


def final_score(workspace: Path) -> tuple[float | None, dict]:
    """The score of the engine the run left, and its record (engine.json)."""
    try:
        verdict = json.loads((workspace / "engine.json").read_text())
    except (OSError, ValueError):
        return None, {}
    return verdict.get("result", {}).get("score"), verdict


def run_score(workspace: Path, plan) -> float | None:
    """The score the run's own judging gave `plan`'s engine (the slots and engine; any params)."""
    try:
        candidates = json.loads((workspace / "results.json").read_text())["candidates"]
    except (OSError, ValueError, KeyError):
        return None
    scores = [(c.get("result") or {}).get("score") for c in candidates
              if c.get("plan", {}).get("engine") == plan.engine and c.get("plan", {}).get("slots") == plan.slots]
    scores = [s for s in scores if s]
    return max(scores, default=None)


def judged_per_minute(log: str) -> str:
    lines = [line.strip() for line in log.splitlines() if "candidates judged per minute" in line]
    return lines[-1] if lines else "no pipeline line in results.log"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget", type=int, help=f"the agent's budget, seconds (default {DEFAULT_BUDGET} on cuda, "
                                              f"{SMOKE_BUDGET} on cpu; the run's own default, 1800, does not fit)")
    p.add_argument("--library-score", type=float, help="the library plan's score from an earlier call (skips step 1)")
    p.add_argument("--library-plan", choices=sorted(library_plans()),
                   help=f"default {FINAL_PLAN!r} on cuda, {CPU_LIBRARY_PLAN!r} on cpu")
    p.add_argument("--parallel", type=int, default=4, help="model episodes in flight (the agent's --parallel)")
    p.add_argument("--seed", type=int, default=0, help="stress seed, the same for the library and the run")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the smoke run on a tiny model")
    p.add_argument("--out", default=out_dir("/tmp/gpu_scripted_search"))
    p.add_argument("--continue-from", type=Path, metavar="FILE",
                   help=f"an earlier call's {CONTINUATION}: resume its run for --budget more seconds")
    a = p.parse_args(argv)
    if a.budget is not None and a.budget <= 0:
        p.error(f"--budget must be positive, got {a.budget}")
    if a.library_score is not None and not a.library_score > 0:
        p.error(f"--library-score must be positive, got {a.library_score}")
    previous = None
    if a.continue_from is not None:
        try:
            previous = read_continuation(a.continue_from, WORKSPACE)
        except ValueError as e:
            print(f"scripted-search: cannot continue from {a.continue_from}: {e}", file=sys.stderr)
            return 2
    smoke = a.device == "cpu"
    budget = a.budget or (SMOKE_BUDGET if smoke else DEFAULT_BUDGET)
    plan_name = a.library_plan or (CPU_LIBRARY_PLAN if smoke else FINAL_PLAN)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if smoke:   # a fixed place: a continued run must name the same config and weights (agent/resume.py)
        SMOKE_MODEL.mkdir(parents=True, exist_ok=True)
        config, weights = str(SMOKE_MODEL / "model_config.json"), str(SMOKE_MODEL / "weights")
        Path(config).write_text(json.dumps(SMOKE_CONFIG, indent=1))
    else:
        prelude(out)
        config, weights = PUBLIC_CONFIG, PUBLIC_WEIGHTS
    if subprocess.run([sys.executable, "-c", "import openai"], capture_output=True).returncode != 0:
        # the agent would warn and carry on with the builtin proposer: a run that checks nothing
        print("scripted-search: the agent cannot import openai here (carry its wheels in .whl)", file=sys.stderr)
        return 2
    ensure_toy_weights(config, weights)
    print(f"scripted-search: budget {budget}s, REDUCED from the run's default "
          f"({'600' if smoke else '1800'} s) to fit one device call; the issue's bar is at the default budget",
          flush=True)

    started = time.monotonic()
    library = a.library_score or (previous or {}).get("library_score")
    if library is None and not smoke:
        print(f"== the library plan {plan_name!r} through the judge", flush=True)
        library = library_score(plan_name, config, weights, a.device, a.seed, out)
        print(f"library score {library} ({time.monotonic() - started:.0f}s)", flush=True)

    budgets = (previous or {}).get("budgets", []) + [budget]
    print(f"== the agent {'resumed' if previous else 'from an all-torch start'}, kernels from the scripted good "
          f"model only (budget {budget}s, {sum(budgets)}s over {len(budgets)} call(s); parallel {a.parallel})",
          flush=True)
    workspace = WORKSPACE
    if previous is None:
        shutil.rmtree(workspace, ignore_errors=True)
    env = {**LLM_ENV, **({"LLM_KERNELS_ON_CPU": "1"} if smoke else {})}
    with GoodModel("openai", remembered=(previous or {}).get("memory")) as server:
        os.environ.update({**env, "OPENAI_BASE_URL": server.url})
        try:
            code = run([sys.executable, "-m", "agent", "--provider", "openai", "--builtin-walk", "params",
                        "--device", a.device, "--budget", str(budget), "--parallel", str(a.parallel),
                        "--seed", str(a.seed), "--config", config, "--weights", weights, "--workspace", str(workspace)]
                       + (["--resume"] if previous else []),
                       out / "agent.txt", timeout=budget + RUN_GRACE_S)
        finally:   # the next call's start, even where this one's agent was cut
            if workspace.is_dir():
                write_continuation(out / CONTINUATION, workspace, {"library_score": library, "budgets": budgets,
                                                                   "memory": server.memory()})
    for name in KEPT:
        if (workspace / name).is_file():
            shutil.copy(workspace / name, out / name)
    if (workspace / "transcripts").is_dir():
        shutil.copytree(workspace / "transcripts", out / "transcripts", dirs_exist_ok=True)

    if library is None and smoke:
        library = run_score(workspace, library_plans()[plan_name])
    score, verdict = final_score(workspace)
    log = (workspace / "results.log").read_text() if (workspace / "results.log").is_file() else ""
    ratio = score / library if score and library else None
    summary = [f"agent exit {code}; budget {budget}s this call, {sum(budgets)}s over {len(budgets)} call(s) "
               f"(the run's default: {'600' if smoke else '1800'}s; see --help)",
               f"library plan {plan_name!r}: score {library}",
               f"final engine: #{verdict.get('index', 0):03d} {verdict.get('plan')}: score {score}",
               "ratio: " + ("n/a" if ratio is None else f"{100 * ratio:.1f}% of the library's score; " + (
                   "the smoke run (the library plan is all-torch on a CPU): no reading of the bar" if smoke else
                   f"target {100 * TARGET:.0f}%: {'MET' if ratio >= TARGET else 'NOT MET'}")),
               judged_per_minute(log),
               f"model answers ({len(server.answers)} requests): "
               + ", ".join(f"{what}:{kind}" for what, kind in server.answers)]
    (out / "summary.txt").write_text("\n".join(summary) + "\n")
    print("== results.log tail", *log.splitlines()[-LOG_TAIL:], "== summary", *summary, sep="\n")
    return 0
