"""Model text is never a Jinja template (issue 20, class 1).

A model-written kernel variant used to be wrapped in `{% raw %}` and rendered: a comment that
closed the wrapper (`{%endraw%}`, spelled without spaces, slipped past the check) ran a Jinja
expression inside the agent and inside the unit-check process. Now a model's variant is stored
and inserted verbatim: the answer below, whose comments and strings are full of Jinja, must come
out byte for byte in the proposal, the engine, the slot module and a resumed run, with none of
its expressions evaluated (the live ones would create a file and set an environment variable).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import jinja2
import pytest

from agent import loop, resume
from agent.plan import Plan
from agent.providers.proposals import MISSING, PASSED, check_kernel_answer, variant_template
from agent.records import Candidate
from agent.render import render_engine
from agent.workspace import VARIANTS
from evaluator import slot_check
from evaluator.slot_render import render_slot_module
from evaluator.slots import SLOTS

SLOT, NAME = "silu_mul", "llm_1"
ENV = "TEMPLATE_INJECTION_RAN"
JINJA_OS = "cycler.__init__.__globals__.os"   # reaches `os` from any Jinja environment's globals
PADDING = re.compile(r"^# \(\d+ lines of padding: .*\n\n*", re.MULTILINE)


def unpadded(engine: str) -> str:
    return PADDING.sub("", engine)
# The first line alone is the attack that got through: `{%endraw%}` without spaces passed the
# old check. The others are every other form of Jinja syntax, in comments and a string.
PAYLOAD = [
    '# {%endraw%}{{ JINJA_OS.open("MARKER", 65) }}{{ JINJA_OS.environ.__setitem__("ENV", "1") }}{%raw%}',
    '# {% endraw %}{{ 7777*7777 }}{% raw %}',
    '# {% for i in range(3) %}LOOP{% endfor %} {# a Jinja comment #} {% include "engine/paged.py.j2" %}',
    'TEMPLATE_TEXT = "{{ 7777*7777 }} {% endraw %} {%endraw%} {% raw %} {%- if true -%} {{ params }}"',
]
FUNCTION = '''

def silu_mul__llm_1(gate_up):
    """{{ 6666*6667 }} in a docstring: SiLU(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
'''


@pytest.fixture(params=[1, len(PAYLOAD)], ids=["spaceless-endraw", "every-form"])
def code(request, tmp_path: Path, monkeypatch) -> str:
    """The hostile variant, its file payload aimed at tmp_path/MARKER; ENV is set to "0" so that
    the test sees whether anything changed it (and monkeypatch restores it)."""
    monkeypatch.setenv(ENV, "0")
    text = "\n".join(PAYLOAD[:request.param]) + "\n" + FUNCTION
    return text.replace("JINJA_OS", JINJA_OS).replace("MARKER", str(tmp_path / "MARKER")).replace('"ENV"', f'"{ENV}"')


def assert_nothing_ran(tmp_path: Path) -> None:
    assert not (tmp_path / "MARKER").exists(), "a Jinja expression in the model's code was evaluated"
    assert os.environ[ENV] == "0", "a Jinja expression in the model's code was evaluated"


def plan() -> Plan:
    return Plan("paged", {s: "torch" for s in SLOTS} | {SLOT: NAME})


def test_the_payload_is_live_under_the_old_raw_wrapper(code, tmp_path):
    """Otherwise the other tests would prove nothing: its first lines, rendered the old way, run
    (the whole code no longer parses as a template once the wrapper is closed)."""
    payload = "\n".join(code.splitlines()[:2])
    jinja2.Environment().from_string("{% raw %}\n" + payload + "\n{% endraw %}\n").render()
    assert (tmp_path / "MARKER").exists() and os.environ[ENV] == "1"


def test_an_answer_full_of_jinja_passes_the_normal_checks_and_is_kept_verbatim(code, tmp_path):
    answer = f"Here is the variant:\n\n```python\n{code}```\n"
    verdict = check_kernel_answer(answer, SLOT, NAME, ("silu_mul",), "cpu", {}, 120.0, seed=1)
    assert verdict.verdict == PASSED, verdict.detail        # the unit check ran it, in its process
    assert verdict.code.strip("\n") == code.strip("\n")
    assert code.strip("\n") in verdict.template
    assert_nothing_ran(tmp_path)


def test_the_raw_marker_is_no_reason_to_refuse_an_answer(code):
    """`{% endraw` used to be refused as a policy breach; now the answer goes on to the checks
    every answer gets (here: its function is missing)."""
    answer = "```python\n" + code.replace("def silu_mul__llm_1", "def other") + "```\n"
    verdict = check_kernel_answer(answer, SLOT, NAME, ("silu_mul",), "cpu", {}, 120.0, seed=1)
    assert verdict.verdict == MISSING, verdict.detail


def test_engine_and_slot_module_hold_the_code_byte_for_byte(code, tmp_path):
    source = variant_template(SLOT, NAME, "cpu", code)
    assert code.strip("\n") in source
    engine = render_engine(plan(), {(SLOT, NAME): source})
    placeholder = variant_template(SLOT, NAME, "cpu", "@@CODE@@")
    stand_in = render_engine(plan(), {(SLOT, NAME): placeholder})
    # inserted as it is, nothing else moved (but the slot's padding, agent/render.py, which counts its lines)
    assert unpadded(engine) == unpadded(stand_in.replace(placeholder, source))
    compile(engine, "<engine>", "exec")
    module = render_slot_module(SLOT, NAME, None, {(SLOT, NAME): source})
    # 8-digit products: a temporary path (pytest-342) cannot contain them by chance
    assert module.endswith(source) and str(7777 * 7777) not in module and str(6666 * 6667) not in module
    checked, name, _ = slot_check.render_source(SLOT, source)
    assert checked == module and name == NAME
    result = slot_check.check_variant(SLOT, source, "cpu", seed=1)   # the evaluator's own rendering
    assert result.passed, result.summary()
    assert_nothing_ran(tmp_path)


def test_a_resumed_run_restores_the_variant_and_renders_the_same_engine(code, tmp_path):
    source = variant_template(SLOT, NAME, "cpu", code)
    candidate = Candidate(plan(), "openai:test", "hostile comments", {(SLOT, NAME): source})
    folder = tmp_path / "candidates" / "002-llm"
    rendered, failure = loop.prepare(candidate, folder, "cpu")
    assert failure is None and rendered == (folder / "engine.py").read_text()
    assert (folder / VARIANTS / f"{SLOT}.{NAME}.py.j2").read_text() == source
    restored = resume._variants(folder, [f"{SLOT}/{NAME}"])
    assert restored == {(SLOT, NAME): source}
    assert render_engine(plan(), restored) == rendered
    assert_nothing_ran(tmp_path)
