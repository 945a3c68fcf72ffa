"""A model's answer → a checked proposal, or a verdict saying exactly why not.

A kernel answer goes through, in order: code extraction, syntax, the static policy
(agent/policy.py, kernel level), the slot's functions being defined, a no-op check, and the
slot's unit check against its reference op (evaluator/slot_check.py) in a confined worker
(evaluator/unit_worker.py) with a timeout, so that a hanging, crashing or hostile proposal
cannot take the agent down or touch its files. A plan answer
is checked against the library's menu. Each verdict's detail is written to be sent back to
the model as it is.
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from agent import policy
from agent.extract import ExtractError, extract_code, extract_json
from agent.plan import TEMPLATES, Plan, engine_params, engines, menu
from agent.records import SearchState
from evaluator.isolation import Jail
from evaluator.slot_shapes import CallShape, ShapeTiming, weighted_ratio
from evaluator.slots import SLOTS
from evaluator.unit_worker import RESULT_MARK

REPO = TEMPLATES.parent
UNIT_WORKER = REPO / "evaluator" / "unit_worker.py"
_HEADER_LINE = re.compile(r"^\s*#\s*slot:.*$", re.MULTILINE)
RESULT_TAIL_BYTES = 1 << 20   # of the unit check's output read back (it may print without end)
# A unit check's memory (every process of its uid, shared memory included: the judge's watch,
# evaluator/isolation.py Jail.resident_bytes), as a share of the machine's: one slot's calls at its
# shapes need little, and the judge's worker may hold most of the rest meanwhile.
UNIT_MEMORY_FRACTION = 0.25
UNIT_WATCH_SECONDS = 0.2      # how often a unit check's memory and disk use are looked at
ERROR_LINES = 12  # of a crashed unit check's stderr, sent back to the model
LOG_LINE = 300    # characters of a timing error kept

# Verdicts: PASSED means "passed every check we can make alone"; the rest are rejections.
PASSED, NO_CODE, SYNTAX, POLICY, MISSING, DUPLICATE, UNIT_CHECK = (
    "passed unit check", "no code", "syntax error", "policy violation", "missing functions",
    "duplicate", "unit check failed")
NO_PLAN, INVALID_PLAN = "no plan", "invalid plan"
# A passed variant this much slower than the current one at the real call shapes (call-weighted,
# evaluator/slot_timing.py) goes back to the model for refinement: interleaved medians on a
# busy machine move by tens of percent on microsecond kernels, never by a quarter consistently.
SLOWER_RATIO = 1.25


@dataclass(frozen=True)
class TimingRequest:
    """What the unit worker times a passed variant against (evaluator/slot_timing.py)."""

    current_name: str
    current: str                     # its source: a rendered library module or a model's variant text
    shapes: tuple[CallShape, ...]    # the engine's call shapes for this slot (evaluator/slot_shapes.py)
    dtype: str                       # "fp16" | "bf16" (CUDA); the CPU times in fp32


@dataclass(frozen=True)
class Verdict:
    verdict: str
    detail: str
    code: str | None = None          # the extracted code (kernel answers)
    template: str | None = None      # the variant template text, when PASSED
    plan: Plan | None = None         # the proposed plan (plan answers), when PASSED
    max_abs_err: float | None = None
    timings: tuple[ShapeTiming, ...] = ()   # against the current variant at the real shapes, when timed
    timing_error: str | None = None

    @property
    def passed(self) -> bool:
        return self.verdict == PASSED

    def ratio(self) -> float | None:
        """Its call-weighted time over the current variant's, when it was timed."""
        return weighted_ratio(list(self.timings)) if self.timings else None

    def slower(self) -> bool:
        ratio = self.ratio()
        return ratio is not None and ratio > SLOWER_RATIO


def code_digest(code: str) -> str:
    """Identity of code up to blank lines and trailing spaces: a resent answer is a no-op."""
    lines = [line.rstrip() for line in code.splitlines() if line.strip()]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def variant_template(slot: str, name: str, device: str, code: str) -> str:
    """Model code as a variant's source: our header (agent/plan.py parse_header reads it), then
    the code verbatim. It is not a Jinja template, and nothing renders it as one: engines and
    unit checks insert it as text (evaluator/slot_render.py), so `{{` or `{% endraw %}` in it
    is just Python."""
    body = _HEADER_LINE.sub("", code).strip("\n")
    return (f"# slot: {slot}    variant: {name}    devices: {device}\n"
            f"# written by a model for this run; checked against the slot's reference op\n"
            f"\n{body}\n")


def _defined_functions(tree: ast.AST) -> set[str]:
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _syntax_detail(code: str, e: SyntaxError) -> str:
    lines = code.splitlines()
    where = lines[e.lineno - 1] if e.lineno and 0 < e.lineno <= len(lines) else ""
    return f"line {e.lineno}: {e.msg}" + (f"\n    {where.strip()}" if where.strip() else "")


def check_kernel_answer(text: str, slot: str, name: str, functions: tuple[str, ...], device: str,
                        seen: dict[str, str], timeout: float, seed: int,
                        timing: TimingRequest | None = None) -> Verdict:
    """`seen` maps code digests of earlier proposals (and the current best) to what they were.
    `seed` draws the unit check's inputs: fresh for every check, but derived from the run's
    seed, so a replayed run sends the model the same feedback. With `timing`, a variant that
    passes is also timed against the current one (Verdict.timings)."""
    wanted = tuple(f"{fn}__{name}" for fn in functions)
    try:
        code = extract_code(text, wanted)
    except ExtractError as e:
        return Verdict(NO_CODE, str(e))
    try:
        tree = policy.parse(code)
    except SyntaxError as e:
        return Verdict(SYNTAX, _syntax_detail(code, e), code)
    violations = policy.check_kernel(code)
    if violations:
        return Verdict(POLICY, policy.describe(violations), code)
    missing = [fn for fn in wanted if fn not in _defined_functions(tree)]
    if missing:
        return Verdict(MISSING, f"the module must define {', '.join(missing)}", code)
    digest = code_digest(code)
    if digest in seen:
        return Verdict(DUPLICATE, f"the code is identical to {seen[digest]}; change something that matters", code)
    template = variant_template(slot, name, device, code)
    result = unit_check(slot, template, device, timeout, seed, timing)
    if not result.passed:
        return Verdict(UNIT_CHECK, result.detail, code, max_abs_err=result.max_abs_err)
    return Verdict(PASSED, result.detail, code, template, max_abs_err=result.max_abs_err,
                   timings=result.timings, timing_error=result.timing_error)


@dataclass(frozen=True)
class UnitResult:
    """The unit worker's answer as the agent reads it (advice: see unit_check)."""

    passed: bool
    detail: str
    max_abs_err: float | None = None
    timings: tuple[ShapeTiming, ...] = ()
    timing_error: str | None = None


def _read_timings(result: dict) -> tuple[tuple[ShapeTiming, ...], str | None]:
    raw = result.get("timings")
    if raw is None:
        return (), (str(result["timing_error"])[:LOG_LINE] if result.get("timing_error") else None)
    try:
        return tuple(ShapeTiming(str(t["fn"]), str(t["label"]), int(t["calls"]), float(t["candidate_us"]),
                                 float(t["current_us"])) for t in raw), None
    except (TypeError, KeyError, ValueError):
        return (), "the timing result could not be read"


class UnitChecks:
    """The unit checks of model code running on this host, kept apart from the timings whose score
    others are compared with (agent/loop.py recorded_alone). A check runs model code beside the
    judge, on its cores and its GPU, and that code can tell when a judge's worker runs (any process
    of a jail's uid in /proc): a variant that burned the CPUs while one lived, the policy passing
    it, halved the score of the timing beside it (red-team helper, thirty-eighth session), and a
    recorded score lowered so is what a later clear win of the same model is measured against.
    `running()` around a check waits while such a timing runs (and gives the seconds it waited,
    which the check's timeout must not add to the run); `held()` around the timing keeps new
    checks from starting and waits for those under way (at most their timeout)."""

    def __init__(self):
        self.cond = threading.Condition()
        self.checks = 0
        self.timings = 0

    @contextmanager
    def running(self) -> Iterator[float]:
        asked = time.monotonic()
        with self.cond:
            self.cond.wait_for(lambda: not self.timings)
            self.checks += 1
        try:
            yield time.monotonic() - asked
        finally:
            with self.cond:
                self.checks -= 1
                self.cond.notify_all()

    @contextmanager
    def held(self) -> Iterator[None]:
        with self.cond:
            self.timings += 1     # first: checks asked for from now on wait, so none can starve it
        try:
            with self.cond:
                self.cond.wait_for(lambda: not self.checks)
            yield
        finally:   # also where the wait itself is interrupted: no check waits on a timing that never ran
            with self.cond:
                self.timings -= 1
                self.cond.notify_all()


UNIT_CHECKS = UnitChecks()   # this process's: every proposer's checks, the loop's recorded timings


def unit_check(slot: str, template: str, device: str, timeout: float, seed: int,
               timing: TimingRequest | None = None) -> UnitResult:
    """evaluator.slot_check.check_variant on model code, in a confined worker of its own
    (evaluator/unit_worker.py in an evaluator.isolation.Jail: own uid, no network, limits, its
    output capped, killed whole at the end), then with `timing` its time against the current
    variant. The answer is parsed from the bounded tail of its output; it is advice (the engine
    holding the variant is judged again by the evaluator), so a variant that forges it (its
    correctness or its speed) gains nothing but a whole-engine benchmark. A wait for a recorded
    timing (UNIT_CHECKS) comes out of `timeout`, which the caller bounds by the run's budget."""
    with UNIT_CHECKS.running() as waited, Jail(device, unit_memory_cap()) as jail:
        timeout = max(timeout - waited, 0.0)
        src = jail.root / "variant.py"   # the agent's folder: readable by the worker, not replaceable
        src.write_text(template)
        argv = [str(UNIT_WORKER), slot, str(src), device, str(seed)]
        if timing is not None:
            request = jail.root / "timing.json"
            request.write_text(json.dumps({"current": timing.current, "dtype": timing.dtype,
                                           "shapes": [s.to_dict() for s in timing.shapes]}))
            os.chmod(request, 0o644)
            argv.append(str(request))
        os.chmod(src, 0o644)
        proc = jail.spawn(argv, pass_fds=())
        stopped = _watch_unit_check(proc, jail, timeout)
        if stopped is not None:
            return UnitResult(False, stopped)
        tail = jail.log_tail(RESULT_TAIL_BYTES)
    result = _unit_result(tail)
    if result is None:
        lines = "\n".join(line for line in tail.strip().splitlines() if not line.startswith(RESULT_MARK))
        lines = "\n".join(lines.splitlines()[-ERROR_LINES:])
        return UnitResult(False, f"crash: the unit check process died (exit {proc.returncode}):\n{lines}")
    err = result.get("max_abs_err")
    err = float(err) if isinstance(err, (int, float)) else None
    cases = result.get("cases") if isinstance(result.get("cases"), list) else []
    passed_cases = sum(1 for c in cases if isinstance(c, dict) and c.get("passed"))
    head = f"{passed_cases}/{len(cases)} cases passed on {device}, max abs error {err:.3g}" if err is not None else ""
    if result.get("passed") is True:
        timings, timing_error = _read_timings(result)
        return UnitResult(True, f"{head}; closest to tolerance: {result.get('worst_case')}", err, timings, timing_error)
    reason = result.get("error") or result.get("worst_case") or "failed"
    return UnitResult(False, f"{reason}" + (f"\n({head})" if head and not result.get("error") else ""), err)


def unit_memory_cap() -> int:
    return int(UNIT_MEMORY_FRACTION * os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def _watch_unit_check(proc: subprocess.Popen, jail: Jail, timeout: float) -> str | None:
    """Wait for the unit check to end; why it was stopped (its timeout, its memory past the jail's
    cap, the disk it filled), or None when it ended by itself. It had no cap at all: model code
    that passed the policy held 3 GiB in a plain tensor, and could take the host's memory (the
    OOM killer then picks among the judge, its worker and the agent) or its disk (red-team helper,
    thirty-ninth session). Its jail kills what is left."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            proc.wait(timeout=max(min(UNIT_WATCH_SECONDS, deadline - time.monotonic()), 0.0))
            return None
        except subprocess.TimeoutExpired:
            pass
        if time.monotonic() >= deadline:
            return f"timeout: the unit check did not finish in {timeout:.0f}s (a hang or far too slow)"
        over = jail.over_limits()
        if over is not None:
            return f"stopped: the unit check {over}"


def _unit_result(tail: str) -> dict | None:
    """The last RESULT_MARK line of the worker's output as a dict, or None."""
    for line in reversed(tail.splitlines()):
        if line.startswith(RESULT_MARK):
            try:
                value = json.loads(line[len(RESULT_MARK):])
            except (ValueError, RecursionError):
                return None
            return value if isinstance(value, dict) else None
    return None


def check_plan_answer(text: str, state: SearchState, llm_variants: dict[tuple[str, str], str]) -> Verdict:
    """A plan change from the menu; `llm_variants` are this run's unit-checked model variants."""
    try:
        answer = extract_json(text)
    except ExtractError as e:
        return Verdict(NO_PLAN, str(e))
    raw = answer.get("plan", answer)
    if not isinstance(raw, dict):
        return Verdict(INVALID_PLAN, '"plan" must be an object with "engine", "slots", "params"')
    best = state.best.plan if state.best is not None else None
    engine = raw.get("engine") or (best.engine if best else None)
    if engine not in engines():
        return Verdict(INVALID_PLAN, f"unknown engine {engine!r}; engines: {', '.join(engines())}")
    params = engine_params(engine)
    same = best is not None and best.engine == engine
    slots = dict(best.slots) if same else {s: "torch" for s in SLOTS}
    values = dict(best.params) if same else {n: p.default for n, p in params.items()}
    errors = []
    for key in ("slots", "params"):
        if not isinstance(raw.get(key) or {}, dict):
            return Verdict(INVALID_PLAN, f'"{key}" must be an object ({{"name": value, ...}}), got {type(raw[key]).__name__}')
    available = {s: [v.name for v in vs if state.device in v.devices] for s, vs in menu().items()}
    for slot, variant in (raw.get("slots") or {}).items():
        names = available.get(slot, []) + [v for s, v in llm_variants if s == slot]
        if slot not in SLOTS:
            errors.append(f"unknown slot {slot!r}; slots: {', '.join(SLOTS)}")
        elif variant not in names:
            errors.append(f"slot {slot}: unknown variant {variant!r} on {state.device}; choices: {', '.join(names)}")
        else:
            slots[slot] = variant
    for name, value in (raw.get("params") or {}).items():
        p = params.get(name)
        if p is None:
            errors.append(f"engine {engine} has no parameter {name!r}; parameters: {', '.join(params)}")
        elif not any(value == c and type(value) is type(c) for c in p.choices):   # 16.0 is not 16: a new key
            errors.append(f"{name}: {json.dumps(value)} is not a choice; choices: {', '.join(map(json.dumps, p.choices))}")
        elif state.device not in p.devices:
            errors.append(f"{name} has no effect on {state.device}")
        else:
            values[name] = value
    if errors:
        return Verdict(INVALID_PLAN, "\n".join(errors))
    plan = Plan(engine, slots, values)
    if best is not None and plan.key() == best.key():
        return Verdict(DUPLICATE, "that is the current best plan; propose a change")
    return Verdict(PASSED, f"plan {plan.describe()}: {answer.get('why', '')}".strip(), plan=plan)
