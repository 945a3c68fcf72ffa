"""One kernel variant's unit check inside the jail (evaluator/isolation.py).

    python3 -I evaluator/unit_worker.py SLOT VARIANT_FILE DEVICE SEED <jail spec JSON>

Started by the agent for a model-written variant (agent/providers/proposals.py): the variant is
imported only here, after the process confined itself, never in the agent. The result of
evaluator.slot_check.check_variant is printed as the last line, after RESULT_MARK. The agent
reads it as advice, not as a verdict: a variant that passes is then judged again inside a whole
engine by the judge (evaluator/evaluate.py), which the variant cannot touch.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # isolated mode (-I) adds no path

from evaluator.isolation import JailSpec, enter  # noqa: E402  (the standard library only)

RESULT_MARK = "unit-check-result: "


def main() -> None:
    slot, path, device, seed, spec = sys.argv[1:6]
    enter(JailSpec.from_json(spec))
    from evaluator.slot_check import check_variant
    result = check_variant(slot, Path(path).read_text(), device, int(seed))
    sys.stdout.write("\n" + RESULT_MARK + json.dumps(result.to_dict(), default=str) + "\n")
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
