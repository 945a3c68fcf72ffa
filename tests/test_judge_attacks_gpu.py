"""Attacks on the split judge that only a GPU can mount (skipped without CUDA; docs/reliability.md
records their GPU runs). The engine is the recompute engine with its decode edited."""
from __future__ import annotations

import pytest
import torch

from evaluator.evaluate import evaluate

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DECODE = "        return self._logits_for(request_ids)\n\n    def remove"

# Each call first overwrites, from a side stream, the logits it returned on the previous call (as
# a CUDA graph replayed after its call returned would): the judge already holds its own copy.
WRITES_AFTER_RETURN = """        side = getattr(self, "side", None) or torch.cuda.Stream()
        self.side = side
        if getattr(self, "last", None) is not None:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.last.fill_(float("nan"))
            torch.cuda.current_stream().wait_stream(side)
        self.last = self._logits_for(request_ids)
        return self.last

    def remove"""

# Returns before its logits are in place: they land in the returned tensor from a side stream it
# never waits for, after a delay, so the copy the worker makes on the current stream reads zeros.
RETURNS_EARLY = """        real = self._logits_for(request_ids)
        side = getattr(self, "side", None) or torch.cuda.Stream()
        self.side = side
        out = torch.zeros_like(real)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(20_000_000)
            out.copy_(real)
        return out

    def remove"""


def judged(recompute_source: str, edit: str, tmp_path, tiny_model) -> dict:
    assert DECODE in recompute_source
    path = tmp_path / "engine.py"
    path.write_text(recompute_source.replace(DECODE, edit))
    return evaluate(path, tiny_model.config, tiny_model.weight_dir, "cuda", stress="off", cases=["decode"],
                    warmup=0, repeat=1)


def test_writes_after_the_call_returned_are_harmless(recompute_source, tmp_path, tiny_model):
    r = judged(recompute_source, WRITES_AFTER_RETURN, tmp_path, tiny_model)
    assert r["status"] == "passed", r["error"]


def test_logits_still_being_computed_when_the_call_returns_are_caught(recompute_source, tmp_path, tiny_model):
    r = judged(recompute_source, RETURNS_EARLY, tmp_path, tiny_model)
    assert (r["status"], r["error_kind"]) == ("failed", "wrong_result"), r["error"]


# At import: opens the device node of a GPU its judge was not given, then asks a child process
# without CUDA_VISIBLE_DEVICES how many GPUs it sees (a candidate screened ahead on one GPU of a
# host reaching for the GPU another judge is timing on: agent/screens.py).
REACHES_FOR_ANOTHER_GPU = '''import os as _os, subprocess as _sp, sys as _sys
try:
    _os.close(_os.open(OTHER_NODE, _os.O_RDWR))
    raise RuntimeError("opened " + OTHER_NODE)
except PermissionError:
    pass
_env = {k: v for k, v in _os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
_seen = _sp.run([_sys.executable, "-c", "import torch; print(torch.cuda.device_count())"], env=_env,
                capture_output=True, text=True).stdout.strip()
if _seen != "1":
    raise RuntimeError(f"a child without CUDA_VISIBLE_DEVICES sees {_seen!r} GPUs")
'''


def test_a_worker_given_one_gpu_of_a_host_cannot_reach_the_others(recompute_source, tmp_path, tiny_model,
                                                                   monkeypatch):
    import os

    from evaluator.isolation import gpus_not_given

    uuid = getattr(torch.cuda.get_device_properties(1), "uuid", None) if torch.cuda.device_count() > 1 else None
    if uuid is None or os.geteuid() != 0:
        pytest.skip("needs two GPUs that torch names by UUID, and root (the worker's own uid and mounts)")
    given = f"GPU-{uuid}"
    others = gpus_not_given(given)
    if not others:
        pytest.skip("no driver table here to tell the GPUs' device nodes apart")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", given)   # read by the jail and passed to the worker
    path = tmp_path / "engine.py"
    path.write_text(REACHES_FOR_ANOTHER_GPU.replace("OTHER_NODE", repr(others[0])) + recompute_source)
    r = evaluate(path, tiny_model.config, tiny_model.weight_dir, "cuda", stress="off", cases=["decode"],
                 warmup=0, repeat=1)
    assert r["status"] == "passed", r["error"]
    assert "only its judge's GPUs" in r["isolation"], r["isolation"]
