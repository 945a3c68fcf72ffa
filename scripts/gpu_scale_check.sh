#!/usr/bin/env bash
# One device call for the scale family of issue #4 on a ~1B-parameter GQA config
# (scripts/configs/scale_1b_gqa.json): first, for each plan in CHECK_PLANS (comma-separated), the checked pass of
# decode-wide (64 requests, 512-token prompts, 32 steps) against the reference, which says whose
# numerics hold at this size; then each plan in TIME_PLANS timed (--no-verify) in prefill-long
# (8 x 2048) and decode-wide against the floor the benchmark reports. Before that, the CUDA engine
# tests (tests/test_engine_paged.py -k cuda), cut at TEST_TIMEOUT (0: skip them). Last, for each plan in
# PROFILE_PLANS (default none), scripts/gpu_profile.py over PROFILE_CASES (default decode-wide): the top kernels
# by GPU time and each call's host/GPU times, in $OUT/profile_<plan>/. TIME_ENGINES (space-separated engine
# files rendered beforehand, e.g. from another commit) are timed like TIME_PLANS, REPEAT times interleaved.
#
#   run tool: command "bash scripts/gpu_scale_check.sh", carry [".whl"]
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp/gpu_scale_check}"
CONFIG="${CONFIG:-scripts/configs/scale_1b_gqa.json}"
WEIGHTS="${WEIGHTS:-/tmp/scale_weights}"
mkdir -p "$WEIGHTS"
source scripts/gpu_prelude.sh

if [ "${TEST_TIMEOUT:-240}" != 0 ]; then
  echo "== CUDA engine tests"
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -rf tests/test_engine_paged.py -k cuda > "$OUT/tests.txt" 2>&1
  echo "pytest exit code $? (124: cut at ${TEST_TIMEOUT:-240}s)"; tail -n 5 "$OUT/tests.txt"
fi

# Plans by name: torch (every slot on its torch variant) and gpu_engine_check.library_plans (lib:
# agent.search.PREFERRED; lib split: with triton_split decode, what the search kept on the public config).
render() {
  python3 - "$1" "$2" <<'PY'
import sys
sys.path.insert(0, "scripts")
from agent.plan import Plan
from agent.render import render_engine
from gpu_engine_check import library_plans
plan = {"torch": Plan("paged"), **library_plans()}[sys.argv[1]]
print(f"{sys.argv[1]}: {plan.describe()}")
open(sys.argv[2], "w").write(render_engine(plan))
PY
}
ARGS=(--model-config "$CONFIG" --weight-dir "$WEIGHTS" --device cuda)
echo "== scale family on $CONFIG"
[ -f "$WEIGHTS/model.pt" ] || python3 scripts/generate_toy_weights.py --config "$CONFIG" --output "$WEIGHTS/model.pt"
IFS=, read -ra CHECK <<< "${CHECK_PLANS-torch,lib,lib split}"
IFS=, read -ra TIME <<< "${TIME_PLANS-lib,lib split}"
for name in "${CHECK[@]}"; do   # correctness: decode-wide's checked pass, one call at a time
  tag="${name// /-}"
  render "$name" "/tmp/scale_$tag.py"
  python3 evaluator/benchmark_throughput.py --engine "/tmp/scale_$tag.py" "${ARGS[@]}" --cases decode-wide \
    --warmup 0 --repeat 1 > "$OUT/check_$tag.json" 2> "$OUT/check_$tag.err"
  echo "$name: decode-wide checked pass exit code $?"; grep -h "Error\|differ" "$OUT/check_$tag.err" | tail -n 1
done
time_engine() {   # $1 tag, $2 engine file: timed (unverified: the checks above say which plans pass)
  python3 evaluator/benchmark_throughput.py --engine "$2" "${ARGS[@]}" \
    --cases "${CASES:-prefill-long,decode-wide}" --no-verify > "$OUT/bench_$1.json" 2> "$OUT/bench_$1.err"
  echo "$1: benchmark exit code $?"
  python3 - "$OUT/bench_$1.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    print(f"  {r['case_name']:13} {r['elapsed_ms']:9.2f} ms  {r['tokens_per_second']:11.0f} tok/s  "
          f"floor {r['floor_ms']:8.3f} ms  {100 * r['floor_fraction']:5.1f}% of floor  peak {r['peak_memory_mb']:.0f} MiB")
PY
}
for name in "${TIME[@]}"; do
  tag="${name// /-}"
  [ -f "/tmp/scale_$tag.py" ] || render "$name" "/tmp/scale_$tag.py"
  time_engine "$tag" "/tmp/scale_$tag.py"
done
for run in $(seq "${REPEAT:-1}"); do   # TIME_ENGINES: engine files rendered beforehand (an A/B against another commit)
  for file in ${TIME_ENGINES:-}; do
    time_engine "$(basename "$file" .py)-$run" "$file"
  done
done
IFS=, read -ra PROFILE <<< "${PROFILE_PLANS:-}"
for name in "${PROFILE[@]}"; do  # where the time goes
  tag="${name// /-}"
  [ -f "/tmp/scale_$tag.py" ] || render "$name" "/tmp/scale_$tag.py"
  echo "== profile $name"
  python3 scripts/gpu_profile.py --engine "/tmp/scale_$tag.py" --model-config "$CONFIG" --weight-dir "$WEIGHTS" \
    --cases "${PROFILE_CASES:-decode-wide}" --repeat 1 --out "$OUT/profile_$tag" > "$OUT/profile_$tag.txt" 2>&1
  echo "gpu_profile exit code $?"
  rm -f "$OUT/profile_$tag"/trace-*.json   # chrome traces: too large to bring back
done
