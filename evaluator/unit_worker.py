"""One kernel variant's unit check inside the jail (evaluator/isolation.py).

    python3 -I evaluator/unit_worker.py SLOT VARIANT_FILE DEVICE SEED [TIMING_FILE] <jail spec JSON>

Started by the agent for a model-written variant (agent/providers/proposals.py): the variant is
imported only here, after the process confined itself, never in the agent. The result of
evaluator.slot_check.check_variant is printed as the last line, after RESULT_MARK. The agent
reads it as advice, not as a verdict: a variant that passes is then judged again inside a whole
engine by the judge (evaluator/evaluate.py), which the variant cannot touch.

With TIMING_FILE (JSON: the current best variant's source, the call shapes of
evaluator/slot_shapes.py, the compute dtype), a variant that passed is then timed against the
current one at those shapes (evaluator/slot_timing.py); the result gains `timings`, or
`timing_error` when timing failed (the check's verdict stands either way).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # isolated mode (-I) adds no path

from evaluator.isolation import JailSpec, enter  # noqa: E402  (the standard library only)

RESULT_MARK = "unit-check-result: "


def _timings(slot: str, source: str, timing_file: str, device: str, seed: int) -> dict:
    """{"timings": [...]} or {"timing_error": "..."}: the passed variant against the current one."""
    try:
        import torch
        from evaluator.slot_check import DTYPE_NAMES
        from evaluator.slot_shapes import CallShape
        from evaluator.slot_timing import load_functions, time_against
        request = json.loads(Path(timing_file).read_text())
        shapes = [CallShape.from_dict(d) for d in request["shapes"]]
        dtype = DTYPE_NAMES[request["dtype"]] if device == "cuda" else torch.float32
        timings = time_against(slot, load_functions(slot, source), load_functions(slot, request["current"]),
                               shapes, device, dtype, seed)
        return {"timings": [t.to_dict() for t in timings]}
    except Exception as e:  # noqa: BLE001 - advice only: the check's verdict stands without it
        return {"timing_error": f"{type(e).__name__}: {e}"}


def main() -> None:
    args, spec = sys.argv[1:-1], sys.argv[-1]
    slot, path, device, seed = args[:4]
    enter(JailSpec.from_json(spec))
    from evaluator.slot_check import check_variant
    source = Path(path).read_text()
    result = check_variant(slot, source, device, int(seed)).to_dict()
    if len(args) > 4 and result["passed"]:
        result.update(_timings(slot, source, args[4], device, int(seed)))
    sys.stdout.write("\n" + RESULT_MARK + json.dumps(result, default=str) + "\n")
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
