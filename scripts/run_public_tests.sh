#!/usr/bin/env bash
# The official public run on workspace/engine.py: correctness (SPEC.md §4), then the
# throughput benchmark (SPEC.md §5). Toy weights are generated first if absent.
#   PYTHON   interpreter (default python3)
#   ENGINE   engine file (default workspace/engine.py)
#   CONFIG   model config (default target/model_config.json)
#   WEIGHTS  weight directory (default target/weights)
#   DEVICE   auto | cuda | cpu (default auto)
# Extra arguments go to the benchmark (e.g. --cases prefill,decode,mixed,decode128,mixed128).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
ENGINE="${ENGINE:-workspace/engine.py}"
CONFIG="${CONFIG:-target/model_config.json}"
WEIGHTS="${WEIGHTS:-target/weights}"
DEVICE="${DEVICE:-auto}"

if [ ! -f "$WEIGHTS/model.pt" ]; then
    "$PYTHON" scripts/generate_toy_weights.py --config "$CONFIG" --output "$WEIGHTS/model.pt"
fi
"$PYTHON" evaluator/test_correctness.py --engine "$ENGINE" --model-config "$CONFIG" \
    --weight-dir "$WEIGHTS" --device "$DEVICE"
"$PYTHON" evaluator/benchmark_throughput.py --engine "$ENGINE" --model-config "$CONFIG" \
    --weight-dir "$WEIGHTS" --device "$DEVICE" "$@"
