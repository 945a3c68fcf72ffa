#!/usr/bin/env bash
# One device call: `bash run.sh` on targets other than the public config (issue #4: the engines the
# agent writes must pass on GQA, MQA and bf16 configs too), each followed by the public tests and
# the full stress suite (cut at STRESS_SECONDS) on the engine it wrote. Weights: the toy init,
# with norm weights uniform in 1 ± SPREAD (`config.json:SPREAD`, default 0.5; 0 is the plain toy
# init, all-one norms). Outputs under $OUT/<config>[-spreadS]/; a line per config last.
#
#   run tool: command "bash scripts/gpu_targets.sh", carry [".whl"]
#   env: CONFIGS (default: scripts/configs/gqa_bf16.json scripts/configs/mqa_fp16.json; each
#        optionally `:SPREAD`), BUDGET (run.sh budget per config, default 200), STRESS_SECONDS (default 45)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp/gpu_targets}"
CONFIGS="${CONFIGS:-scripts/configs/gqa_bf16.json scripts/configs/mqa_fp16.json}"
source scripts/gpu_prelude.sh
summary=()
for entry in $CONFIGS; do
  cfg="${entry%%:*}"; spread=0.5; [[ "$entry" == *:* ]] && spread="${entry##*:}"
  name=$(basename "$cfg" .json); [[ "$spread" != 0.5 ]] && name="$name-spread$spread"
  dir="$OUT/$name"; ws="/tmp/targets_ws_$name"; weights="/tmp/targets_weights_$name"
  mkdir -p "$dir" "$weights"; rm -rf "$ws"
  python3 scripts/generate_toy_weights.py --config "$cfg" --output "$weights/model.pt" --norm-spread "$spread"
  bash run.sh --device cuda --budget "${BUDGET:-200}" --config "$cfg" --weights "$weights" --workspace "$ws" \
    > "$dir/runsh.txt" 2>&1
  rc=$?
  cp "$ws/results.log" "$ws/results.json" "$dir/" 2>/dev/null
  final=$(grep '^result:' "$dir/runsh.txt" | head -1)
  python3 evaluator/test_correctness.py --engine "$ws/engine.py" --model-config "$cfg" --weight-dir "$weights" \
    --device cuda > "$dir/public.txt" 2>&1
  public=$?
  timeout "${STRESS_SECONDS:-45}" python3 evaluator/stress.py --engine "$ws/engine.py" --model-config "$cfg" \
    --weight-dir "$weights" --device cuda --full > "$dir/stress_full.txt" 2>&1
  stress=$?
  fails=$(grep -c '^FAIL' "$dir/stress_full.txt")
  passes=$(grep -c '^PASS' "$dir/stress_full.txt")
  summary+=("$name: run.sh exit $rc; public tests exit $public; full stress exit $stress (124: cut) with $passes passed, $fails failed; $final")
  grep '^FAIL' "$dir/stress_full.txt" | head -3
done
printf '%s\n' "${summary[@]}"
