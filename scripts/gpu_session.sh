#!/usr/bin/env bash
# One device call that answers "does the agent work on a GPU, and how fast is what it writes":
#   1. the GPU unit tests (kernel variants, paged engine),
#   2. `bash run.sh` on the public config within BUDGET seconds (offline, builtin proposer),
#   3. the public tests, the full stress suite and all five benchmark cases on the engine it wrote,
#   4. the same benchmark on the recompute engine (the baseline every ratio is read against).
# Everything lands in $OUT (results.log, results.json, bench_*.json, log); a short table is printed last.
#
#   run tool: command "bash scripts/gpu_session.sh", carry [".whl"]   (.whl: pytest wheels, see
#   docs/benchmarks-kernel-notes.md; the device image has no pytest)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp/gpu_session}"
BUDGET="${BUDGET:-420}"
SKIP_TESTS="${SKIP_TESTS:-0}"
CASES=prefill,decode,mixed,decode128,mixed128
source scripts/gpu_prelude.sh

if [ "$SKIP_TESTS" != 1 ]; then
  echo "== GPU tests"
  python3 -m pytest -q -x tests/test_kernels_gpu.py tests/test_engine_paged.py 2>&1 | tail -n 15 | tee "$OUT/tests.txt"
fi

echo "== run.sh (budget ${BUDGET}s)"
rm -rf workspace
bash run.sh --device cuda --budget "$BUDGET" > "$OUT/runsh.txt" 2>&1
echo "run.sh exit code $?" | tee -a "$OUT/runsh.txt"
cp workspace/results.log workspace/results.json "$OUT/" 2>/dev/null
tail -n 30 workspace/results.log

ARGS=(--model-config target/model_config.json --weight-dir target/weights --device cuda)
echo "== public tests + full stress on workspace/engine.py"
python3 evaluator/test_correctness.py --engine workspace/engine.py "${ARGS[@]}" 2>&1 | tail -n 3
timeout "${STRESS_SECONDS:-150}" python3 evaluator/stress.py --engine workspace/engine.py --device cuda --full \
  --model-config target/model_config.json --weight-dir target/weights > "$OUT/stress_full.txt" 2>&1
echo "stress exit code $? (124: cut at ${STRESS_SECONDS:-150}s)"; tail -n 3 "$OUT/stress_full.txt"

echo "== benchmarks"
python3 evaluator/benchmark_throughput.py --engine workspace/engine.py "${ARGS[@]}" --cases "$CASES" \
  > "$OUT/bench_final.json" 2> "$OUT/bench_final.err"
if [ -f "${RECOMPUTE_JSON:-}" ]; then   # an earlier run's recompute numbers (the baseline does not change)
  cp "$RECOMPUTE_JSON" "$OUT/bench_recompute.json"
else
  python3 -c "
from agent.render import render_engine; from agent.plan import Plan
open('/tmp/recompute.py', 'w').write(render_engine(Plan('recompute')))"
  python3 evaluator/benchmark_throughput.py --engine /tmp/recompute.py "${ARGS[@]}" --cases "$CASES" --warmup 0 --repeat 1 \
    > "$OUT/bench_recompute.json" 2> "$OUT/bench_recompute.err"
fi
python3 - "$OUT" <<'EOF'
import json, sys
out = sys.argv[1]
final = {r["case_name"]: r for r in json.load(open(f"{out}/bench_final.json"))}
base = {r["case_name"]: r for r in json.load(open(f"{out}/bench_recompute.json"))}
print(f"{'case':10} {'recompute tok/s':>16} {'final tok/s':>12} {'% floor':>8} {'speedup':>8} {'peak MiB':>9}")
for name, r in final.items():
    b = base.get(name, {})
    print(f"{name:10} {b.get('tokens_per_second', 0):16.0f} {r['tokens_per_second']:12.0f} "
          f"{100 * r['floor_fraction']:7.1f}% {r['tokens_per_second'] / max(b.get('tokens_per_second', 1), 1):7.0f}x "
          f"{r['peak_memory_mb']:9.0f}")
EOF
