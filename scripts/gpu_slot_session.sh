#!/usr/bin/env bash
# One device call for a kernel slot under development: its GPU unit tests, its kernels timed
# against the other variants (and cuBLAS alone for the linear slot) with a tiling sweep, then
# whole engines with and without it (public sequence, quick stress, the five benchmark cases,
# a step profile). Outputs under $OUT; tables last.
#
#   run tool: command "bash scripts/gpu_slot_session.sh", carry [".whl"]
#   env: SLOT (default linear), PLANS (gpu_engine_check --plans: default library),
#        BENCH (plans to check and time, default "lib,lib linear,lib linear pdl"; the others of PLANS
#        are left out), TEST_TIMEOUT (200)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-/tmp/gpu_slot_session}"
SLOT="${SLOT:-linear}"
source scripts/gpu_prelude.sh

echo "== kernel tests, bench and sweep of slot $SLOT"
OUT="$OUT/kernels" python3 scripts/gpu_kernel_check.py --slots "$SLOT" -k "$SLOT" \
  --test-timeout "${TEST_TIMEOUT:-200}" > "$OUT/kernels.txt" 2>&1
sed -n '/=========== SUMMARY/,$p' "$OUT/kernels.txt"

echo "== engines"
BENCH="${BENCH:-lib,lib linear,lib linear pdl}"
python3 scripts/gpu_engine_check.py --plans "${PLANS:-library}" --only "$BENCH" --bench "$BENCH" \
  --noise "" --out "$OUT/engines" > "$OUT/engines.txt" 2>&1
tail -n 12 "$OUT/engines.txt"
