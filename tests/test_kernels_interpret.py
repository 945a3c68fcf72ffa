"""Triton kernels on the CPU through Triton's interpreter: the `fused_reduce` split reductions
(tests/fixtures/interpret_fused.py), the prefill attention's sequence lookup
(tests/fixtures/interpret_prefill.py) and the decode megakernel inside the engine
(tests/fixtures/interpret_megakernel.py), each in a process of its own with TRITON_INTERPRET=1 (see
their docstrings for why and what they check). Skipped where triton is not installed (CI's CPU image)
or numpy is too new for its interpreter.
"""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 900     # the interpreter is slow; a loaded 2-core machine takes a few minutes


def _numpy_too_new() -> bool:
    """Triton 3.6's interpreter calls int() on one-element arrays (loop bounds), which numpy 2.4
    refuses: every kernel with a loop fails there, ours or not."""
    import numpy
    return tuple(int(p) for p in numpy.__version__.split(".")[:2]) >= (2, 4)


pytestmark = [pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton installed"),
              pytest.mark.skipif(_numpy_too_new(), reason="Triton's interpreter needs numpy < 2.4"),
              pytest.mark.slow]


def run_fixture(name: str) -> None:
    """python3 -m tests.fixtures.<name> with TRITON_INTERPRET=1, which must exit 0."""
    done = subprocess.run([sys.executable, "-m", f"tests.fixtures.{name}"], cwd=REPO,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]


def test_fused_reductions_under_the_interpreter():
    run_fixture("interpret_fused")


def test_prefill_sequence_lookup_under_the_interpreter():
    run_fixture("interpret_prefill")


def test_decode_megakernel_inside_the_engine_under_the_interpreter():
    run_fixture("interpret_megakernel")
