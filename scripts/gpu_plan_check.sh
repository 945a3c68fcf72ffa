#!/usr/bin/env bash
# One device call that re-judges a single plan the way run.sh would, without the search: render
# it, run the public sequence, the full stress suite (optionally a given seed, to replay a failure
# the agent's run or a previous check printed) and the five benchmark cases. Outputs under $OUT.
#
#   run tool: command "PLAN='{...}' SEED=123 bash scripts/gpu_plan_check.sh", carry [".whl"]
#   env: PLAN (a plan dict as JSON, required: e.g. results.json's best plan), SEED,
#        STRESS_SECONDS (default 200)
set -uo pipefail
: "${PLAN:?PLAN: a plan dict as JSON}"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp/gpu_plan_check}"
CASES=prefill,decode,mixed,decode128,mixed128
source scripts/gpu_prelude.sh
[ -f target/weights/model.pt ] || python3 scripts/generate_toy_weights.py --config target/model_config.json \
  --output target/weights/model.pt > /dev/null
PLAN="$PLAN" python3 - "$OUT/engine.py" <<'PY'
import json, os, sys
from agent.plan import Plan
from agent.render import render_engine
plan = Plan.from_dict(json.loads(os.environ["PLAN"]))
open(sys.argv[1], "w").write(render_engine(plan))
print("plan:", plan.describe())
PY
ARGS=(--model-config target/model_config.json --weight-dir target/weights --device cuda)
python3 evaluator/test_correctness.py --engine "$OUT/engine.py" "${ARGS[@]}" > "$OUT/public.txt" 2>&1
echo "public sequence exit code $?"
timeout "${STRESS_SECONDS:-200}" python3 evaluator/stress.py --engine "$OUT/engine.py" --device cuda --full \
  ${SEED:+--seed "$SEED"} --model-config target/model_config.json --weight-dir target/weights > "$OUT/stress.txt" 2>&1
echo "stress exit code $? (124: cut at ${STRESS_SECONDS:-200}s)"
grep -c "^PASS" "$OUT/stress.txt" | sed 's/^/stress cases passed: /'; grep -A1 "^FAIL" "$OUT/stress.txt" | head -n 6
python3 evaluator/benchmark_throughput.py --engine "$OUT/engine.py" "${ARGS[@]}" --cases "$CASES" \
  > "$OUT/bench.json" 2> "$OUT/bench.err"
python3 - "$OUT/bench.json" <<'PY'
import json, math, sys
rows = json.load(open(sys.argv[1]))
for r in rows:
    print(f"{r['case_name']:10} {r['tokens_per_second']:12.0f} tok/s {100 * r['floor_fraction']:6.1f}% of floor "
          f"peak {r['peak_memory_mb']:.0f} MiB")
print(f"geometric mean {100 * math.exp(sum(math.log(r['floor_fraction']) for r in rows) / len(rows)):.1f}% of floor")
PY
