#!/usr/bin/env bash
# One device call: scripts/gpu_step_timeline.py for one library plan (PLAN, default run.sh's usual
# final plan) with each set of extra params in PARAMS, then each one's decode-step and prefill
# spans and its heaviest decode kernels.
#
#   run tool: command "PARAMS='{}|{\"pdl\": true}' bash scripts/gpu_timeline_plans.sh", carry [".whl"]
#   env: PARAMS (|-separated JSON param dicts, default: none, then pdl), PLAN (a name from
#        scripts/gpu_engine_check.library_plans, default "lib split linear")
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp/gpu_timeline_plans}"
source scripts/gpu_prelude.sh
[ -f target/weights/model.pt ] || python3 scripts/generate_toy_weights.py --config target/model_config.json \
  --output target/weights/model.pt > /dev/null
IFS="|" read -ra SETS <<< "${PARAMS:-{\}|{\"pdl\": true\}}"
i=0
for params in "${SETS[@]}"; do
  i=$((i + 1))
  timeout 240 python3 scripts/gpu_step_timeline.py --plan "${PLAN:-lib split linear}" --params "$params" \
    --out "$OUT/plan$i" > "$OUT/plan$i.txt" 2>&1
  echo "plan$i $params: exit $?"
  grep -E "^(plan:|== )" "$OUT/plan$i.txt"
  grep -A3 "^== whole calls" "$OUT/plan$i.txt" | tail -n 3
  grep -A12 "^== a fresh engine" "$OUT/plan$i.txt"
  grep -A12 "^-- decode" "$OUT/plan$i.txt" | head -n 9
  grep -A12 "^-- prefill" "$OUT/plan$i.txt" | head -n 9
done
