"""What every GPU subcommand shares: the repo root, the named library plans, rendering a plan to
a file, toy weights where absent, the device-call prelude, and the benchmark-table printers.

Subcommands run from the repository root (the device tool's working directory) and write their
outputs under --out, whose default is $OUT (the folder the device tool brings back) when set.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from agent.plan import Plan  # noqa: E402
from agent.render import render_engine  # noqa: E402
from evaluator.slots import SLOTS  # noqa: E402

PUBLIC_CONFIG = "target/model_config.json"
PUBLIC_WEIGHTS = "target/weights"
PUBLIC_CASES = "prefill,decode,mixed,decode128,mixed128"
FINAL_PLAN = "lib split linear"     # run.sh's usual final plan on the public config
WHEELS = ".whl"                     # wheels carried to the device: what its image lacks (pytest, openai, fastapi, ...)
WHEEL_SITE = "/tmp/site"


def out_dir(default: str) -> str:
    """--out's default: the device tool's $OUT when set (what it brings back), else `default`."""
    return os.environ.get("OUT", default)


def library_plans() -> dict[str, Plan]:
    """Plans by name: `torch` (every slot on its torch variant), `lib` (the plan the builtin
    search jumps to, agent.search.PREFERRED), `lib split` (with triton_split decode: the same plan
    since PREFERRED chose it, sixth session; the name stays for the recorded commands), both with
    the linear slot's Triton variant, that variant with programmatic dependent launch on (`lib linear pdl`: the
    same plan as `lib linear` since pdl became the default, thirty-ninth session; the name stays for the recorded
    commands), and `lib exact`
    (the attention variants that round like the reference: what `lib` bound on bf16 models before the
    eighteenth session, and still does in the course format)."""
    from agent.search import PREFERRED
    torch_slots = {s: "torch" for s in SLOTS}
    lib = {**torch_slots, **PREFERRED}
    split = {**lib, "decode_attention": "triton_split"}
    linear = {**lib, "linear": "triton"}
    return {"torch": Plan("paged", torch_slots), "lib": Plan("paged", lib), "lib split": Plan("paged", split),
            "lib split linear": Plan("paged", {**split, "linear": "triton"}),
            "lib linear": Plan("paged", linear), "lib linear pdl": Plan("paged", linear, {"pdl": True}),
            "lib exact": Plan("paged", {**lib, "decode_attention": "triton_exact", "prefill_attention": "triton_exact"})}


def render_to_file(plan: Plan, tag: str, extra: dict | None = None) -> Path:
    """The engine of `plan` in a fresh temporary file: Triton compiles only functions defined in
    a file. `extra`: variants inserted beside the library's ({(slot, variant): code})."""
    path = Path(tempfile.mkdtemp()) / f"engine_{abs(hash(tag))}.py"
    path.write_text(render_engine(plan, extra or {}))
    return path


def add_engine_arguments(p) -> None:
    """--engine FILE, or --plan NAME rendered (engine_file): the engine a subcommand measures."""
    p.add_argument("--engine", help="an engine file (default: render --plan)")
    p.add_argument("--plan", default=FINAL_PLAN, help="a name from scripts.gpu.common.library_plans")


def engine_file(a) -> str:
    """The path of the engine add_engine_arguments' flags name: --engine, else --plan rendered."""
    return a.engine or str(render_to_file(library_plans()[a.plan], a.plan))


def ensure_toy_weights(config: str = PUBLIC_CONFIG, weight_dir: str = PUBLIC_WEIGHTS,
                       norm_spread: float = 0.0) -> Path:
    """`<weight_dir>/model.pt` for `config`, written by the toy init (evaluator.weights, the one
    generate_toy_weights.py runs) if absent."""
    from evaluator.common import load_config
    from evaluator.weights import random_weights, save_weights
    path = Path(weight_dir) / "model.pt"
    if not path.is_file():
        save_weights(random_weights(load_config(config), norm_spread=norm_spread), path)
    return path


def prelude(out: Path) -> None:
    """The start of every device call: unbuffered output from the children, the carried wheels
    (what the image lacks: pytest, openai, fastapi, ...; PYTHONPATH for the children), and the GPU, driver,
    torch and triton versions into out/gpu.txt."""
    out.mkdir(parents=True, exist_ok=True)
    os.environ["PYTHONUNBUFFERED"] = "1"
    wheels = sorted(Path(WHEELS).glob("*.whl"))
    if wheels:   # whatever was carried (pytest, openai, fastapi, ...): the children find it first
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--upgrade", "--target", WHEEL_SITE, *map(str, wheels)], check=True)
        os.environ["PYTHONPATH"] = WHEEL_SITE
    try:   # no nvidia-smi (a CPU machine: `hf --tiny` runs there) had been a FileNotFoundError traceback
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout.strip()
    except OSError:
        smi = "no GPU (nvidia-smi not found)"
    versions = subprocess.run([sys.executable, "-c", "import torch, triton; "
                               "print('torch', torch.__version__, 'triton', triton.__version__)"],
                              capture_output=True, text=True).stdout.strip()
    (out / "gpu.txt").write_text(f"{smi}\n{versions}\n")
    print(smi, versions, sep="\n", flush=True)


def run(cmd: list[str], log: Path | None = None, timeout: float | None = None, tail: int = 0,
        err: Path | None = None) -> int:
    """Run `cmd` with its output into `log` (or onto ours), stderr with it unless `err` names a
    file of its own (a JSON on stdout stays parseable); print the log's last `tail` lines; return
    the exit code, 124 when cut at `timeout` seconds (as timeout(1) does)."""
    stderr = subprocess.STDOUT if err is None else subprocess.PIPE
    try:
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, timeout=timeout)
        text, errors, code = done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired as e:
        text, errors, code = _text(e.stdout), _text(e.stderr), 124
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(text)
    else:
        print(text, end="", flush=True)
    if err is not None:
        err.write_text(errors or "")
    if tail and log is not None:
        print("\n".join(text.splitlines()[-tail:]), flush=True)
    return code


def _text(output: bytes | str | None) -> str:
    """What a timed-out child had written (bytes even in text mode)."""
    return output.decode(errors="replace") if isinstance(output, bytes) else (output or "")


def harness(config: str = PUBLIC_CONFIG, weight_dir: str = PUBLIC_WEIGHTS) -> list[str]:
    """The judge scripts' model arguments on the GPU."""
    return ["--model-config", config, "--weight-dir", weight_dir, "--device", "cuda"]


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def bench_rows(path: Path) -> list[dict]:
    """The rows evaluator/benchmark_throughput.py printed as JSON; none if it wrote nothing."""
    text = path.read_text() if path.is_file() else ""
    return json.loads(text) if text.strip() else []


def print_floor_table(rows: list[dict]) -> None:
    """One line a case (tok/s, % of floor, peak memory), then the geometric mean of % of floor."""
    for r in rows:
        print(f"{r['case_name']:10} {r['tokens_per_second']:12.0f} tok/s {100 * r['floor_fraction']:6.1f}% of floor "
              f"peak {r['peak_memory_mb']:.0f} MiB")
    if rows:
        print(f"geometric mean {100 * geomean([r['floor_fraction'] for r in rows]):.1f}% of floor")


def print_table(header: list[str], rows: list[list[str]]) -> None:
    """A text table whose columns are as wide as their widest cell: the first (what the row is)
    aligned left, the others (numbers) right."""
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    for line in (header, *rows):
        print(" ".join([line[0].ljust(widths[0]), *(cell.rjust(w) for cell, w in zip(line[1:], widths[1:]))]))
