#!/usr/bin/env bash
# One device call: the kernel library at wide heads (head_dim 256-512, which random stress models
# draw: 2 heads of hidden 768 give 384). Runs, side by side on the one GPU (correctness only, no
# timing): the GPU kernel tests, whose slot checks now include D = 256/384/512 cases, and the full
# stress suite at SEED on the library plan with linear=triton (the engine run.sh keeps on the
# public config), where seed 169816081 drew m7-mha2x2-float16-h768 and create_engine failed with
# "out of resource: shared memory, Required: 245760, Hardware limit: 232448" (twelfth session).
#
#   run tool: command "bash scripts/gpu_wide_heads.sh", carry [".whl"]
#   env: SEED (default 169816081), STRESS_SECONDS (default 400)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp/gpu_wide_heads}"
source scripts/gpu_prelude.sh
python3 -m pytest -q tests/test_kernels_gpu.py > "$OUT/tests.txt" 2>&1 &
tests=$!
python3 -c "
import sys; sys.path.insert(0, 'scripts')
from gpu_engine_check import library_plans
from agent.render import render_engine
open('/tmp/lib_split_linear.py', 'w').write(render_engine(library_plans()['lib split linear']))"
[ -f target/weights/model.pt ] || python3 scripts/generate_toy_weights.py --config target/model_config.json --output target/weights/model.pt
timeout "${STRESS_SECONDS:-400}" python3 evaluator/stress.py --engine /tmp/lib_split_linear.py --device cuda --full \
  --seed "${SEED:-169816081}" --model-config target/model_config.json --weight-dir target/weights > "$OUT/stress.txt" 2>&1
echo "stress exit $? (124: cut)"; grep -A1 '^FAIL' "$OUT/stress.txt" | head -12; tail -n 1 "$OUT/stress.txt"
wait $tests
echo "GPU kernel tests exit $?"; tail -n 15 "$OUT/tests.txt"
