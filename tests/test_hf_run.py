"""End to end: `bash run.sh --weights DIR` on a tiny Qwen2 checkpoint (q/k/v biases, sharded
safetensors) writes an engine that passed the judge. About a minute on a 2-core machine, so
it runs only with HF_E2E=1 (the other architectures were run by hand: see the README)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from agent.judge import REPO
from tests.hf_models import build

pytest.importorskip("transformers")


@pytest.mark.skipif(os.environ.get("HF_E2E") != "1", reason="slow (about a minute): set HF_E2E=1")
def test_run_sh_writes_a_passing_engine_for_a_model_folder(tmp_path):
    model = build(tmp_path / "qwen2", "Qwen2ForCausalLM", sharded=True)
    done = subprocess.run(["bash", str(REPO / "run.sh"), "--weights", str(model.folder), "--device", "cpu",
                           "--budget", "60", "--workspace", str(tmp_path / "ws")],
                          capture_output=True, text=True, env=dict(os.environ, PYTHON=sys.executable))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert (tmp_path / "ws" / "engine.py").is_file()
    assert "Qwen2ForCausalLM: rotate_half RoPE, q/k/v biases" in (tmp_path / "ws" / "results.log").read_text()
