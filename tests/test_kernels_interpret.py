"""The `fused_reduce` split reductions on the CPU through Triton's interpreter: the checks of
tests/fixtures/interpret_fused.py, in a process of their own with TRITON_INTERPRET=1 (see its
docstring for why and what they check). Skipped where triton is not installed (CI's CPU image).
"""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 900     # the interpreter is slow; a loaded 2-core machine takes a few minutes

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton installed"),
              pytest.mark.slow]


def test_fused_reductions_under_the_interpreter():
    done = subprocess.run([sys.executable, "-m", "tests.fixtures.interpret_fused"], cwd=REPO,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
