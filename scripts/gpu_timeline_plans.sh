#!/usr/bin/env bash
# One device call: scripts/gpu_step_timeline.py for several plans (the final plan of run.sh with
# each set of extra params in PARAMS), then a short table of decode-step and prefill spans.
#
#   run tool: command "PARAMS='{}|{\"pdl\": true}' bash scripts/gpu_timeline_plans.sh", carry [".whl"]
#   env: PARAMS (|-separated JSON param dicts, default: none, then pdl), SLOTS (JSON slot
#        dict overriding the final plan's slots)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp/gpu_timeline_plans}"
source scripts/gpu_prelude.sh
[ -f target/weights/model.pt ] || python3 scripts/generate_toy_weights.py --config target/model_config.json \
  --output target/weights/model.pt > /dev/null
FINAL='{"decode_attention": "triton_split", "prefill_attention": "triton_exact", "norm": "triton", "rope_cache": "triton", "silu_mul": "triton", "linear": "triton"}'
IFS="|" read -ra SETS <<< "${PARAMS:-{\}|{\"pdl\": true\}}"
i=0
for params in "${SETS[@]}"; do
  i=$((i + 1))
  PLAN="{\"engine\": \"paged\", \"slots\": $(python3 -c "import json,sys; print(json.dumps({**json.loads(sys.argv[1]), **json.loads(sys.argv[2])}))" "$FINAL" "${SLOTS:-{\}}"), \"params\": $params}" \
    timeout 240 python3 scripts/gpu_step_timeline.py --out "$OUT/plan$i" > "$OUT/plan$i.txt" 2>&1
  echo "plan$i $params: exit $?"
  grep -E "^(plan:|== )" "$OUT/plan$i.txt"
  grep -A12 "^-- decode" "$OUT/plan$i.txt" | head -n 9
done
