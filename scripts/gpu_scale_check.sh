#!/usr/bin/env bash
# One device call for the scale family of issue #4: the engine the builtin search writes on the
# public config (the library plan with split decode, or ENGINE=path), timed on a ~1B-parameter GQA
# config (scripts/configs/scale_1b_gqa.json) in the two scale cases: prefill-long (8 x 2048) and
# decode-wide (64 requests, 512-token prompts, 32 steps), against the floor the benchmark reports.
# Before that, the CUDA engine tests (tests/test_engine_paged.py -k cuda), cut at TEST_TIMEOUT.
#
#   run tool: command "bash scripts/gpu_scale_check.sh", carry [".whl"]
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp/gpu_scale_check}"
CONFIG="${CONFIG:-scripts/configs/scale_1b_gqa.json}"
WEIGHTS="${WEIGHTS:-/tmp/scale_weights}"
mkdir -p "$OUT" "$WEIGHTS"
export PYTHONUNBUFFERED=1
if ! python3 -c "import pytest" 2>/dev/null && ls .whl/pytest-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

if [ "${TEST_TIMEOUT:-240}" != 0 ]; then
  echo "== CUDA engine tests"
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -rf tests/test_engine_paged.py -k cuda > "$OUT/tests.txt" 2>&1
  echo "pytest exit code $? (124: cut at ${TEST_TIMEOUT:-240}s)"; tail -n 5 "$OUT/tests.txt"
fi

ENGINE="${ENGINE:-}"
if [ -z "$ENGINE" ]; then
  ENGINE=/tmp/scale_engine.py
  python3 -c "
from agent.plan import Plan, reference_slots
from agent.render import render_engine
from agent.search import PREFERRED
plan = Plan('paged', {**reference_slots(), **PREFERRED, 'decode_attention': 'triton_split'})
print('engine:', plan.describe())
open('$ENGINE', 'w').write(render_engine(plan))"
fi
echo "== scale family on $CONFIG"
[ -f "$WEIGHTS/model.pt" ] || python3 scripts/generate_toy_weights.py --config "$CONFIG" --output "$WEIGHTS/model.pt"
python3 evaluator/benchmark_throughput.py --engine "$ENGINE" --model-config "$CONFIG" --weight-dir "$WEIGHTS" \
  --device cuda --cases "${CASES:-prefill-long,decode-wide}" > "$OUT/bench_scale.json" 2> "$OUT/bench_scale.err"
echo "benchmark exit code $?"; tail -n 3 "$OUT/bench_scale.err"
python3 - "$OUT/bench_scale.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    print(f"{r['case_name']:13} {r['elapsed_ms']:9.2f} ms  {r['tokens_per_second']:11.0f} tok/s  "
          f"floor {r['floor_ms']:8.3f} ms  {100 * r['floor_fraction']:5.1f}% of floor  peak {r['peak_memory_mb']:.0f} MiB")
PY
