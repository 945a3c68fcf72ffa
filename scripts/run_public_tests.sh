#!/usr/bin/env bash
# The official public run on workspace/engine.py: correctness (SPEC.md §4), then the
# throughput benchmark (SPEC.md §5). Toy weights are generated first if the repository's own
# target has none.
#   PYTHON   interpreter (default python3)
#   ENGINE   engine file (default $AGENT_WORKSPACE/engine.py, else workspace/engine.py)
#   CONFIG   model config (default $MODEL_CONFIG, else the weights folder's config.json, else
#            /target/model_config.json when mounted, else target/model_config.json)
#   WEIGHTS  weight directory (default $WEIGHT_DIR, else /target/weights when mounted, else target/weights)
#   DEVICE   auto | cuda | cpu (default $DEVICE, else auto)
# (run.sh's own variables are the fallbacks, so a run set up with them is tested on what it wrote.)
# Relative paths are the caller's. Extra arguments go to the benchmark (e.g. --cases
# prefill,decode,mixed,decode128,mixed128).
set -euo pipefail
callers() { case "$1" in /*) printf '%s' "$1" ;; *) printf '%s' "$PWD/$1" ;; esac; }
ENGINE="${ENGINE:-${AGENT_WORKSPACE:+$AGENT_WORKSPACE/engine.py}}"
CONFIG="${CONFIG:-${MODEL_CONFIG:-}}"
WEIGHTS="${WEIGHTS:-${WEIGHT_DIR:-}}"
ENGINE="${ENGINE:+$(callers "$ENGINE")}"
CONFIG="${CONFIG:+$(callers "$CONFIG")}"
WEIGHTS="${WEIGHTS:+$(callers "$WEIGHTS")}"
cd "$(dirname "$0")/.."
REPO="$PWD"
PYTHON="${PYTHON:-python3}"
ENGINE="${ENGINE:-workspace/engine.py}"
# The agent's defaults (agent/cli.py): /target when mounted, else the repository's target; the
# config in the weights folder (a Hugging Face folder's own) before either.
if [ -z "$WEIGHTS" ]; then
    if [ -d /target/weights ]; then WEIGHTS=/target/weights; else WEIGHTS=target/weights; fi
fi
if [ -z "$CONFIG" ]; then
    if [ -f "$WEIGHTS/config.json" ]; then CONFIG="$WEIGHTS/config.json"
    elif [ -f /target/model_config.json ]; then CONFIG=/target/model_config.json
    else CONFIG=target/model_config.json; fi
fi
DEVICE="${DEVICE:-auto}"
absolute() { printf '%s/%s' "$(cd "$(dirname "$1")" 2>/dev/null && pwd)" "$(basename "$1")"; }

# Toy weights for the repository's own target only, as the agent makes them: never for another model.
if [ "$(absolute "$CONFIG")" = "$REPO/target/model_config.json" ] && [ "$(absolute "$WEIGHTS")" = "$REPO/target/weights" ] \
    && [ ! -f "$WEIGHTS/model.pt" ]; then
    "$PYTHON" scripts/generate_toy_weights.py --config "$CONFIG" --output "$WEIGHTS/model.pt"
fi
"$PYTHON" evaluator/test_correctness.py --engine "$ENGINE" --model-config "$CONFIG" \
    --weight-dir "$WEIGHTS" --device "$DEVICE"
"$PYTHON" evaluator/benchmark_throughput.py --engine "$ENGINE" --model-config "$CONFIG" \
    --weight-dir "$WEIGHTS" --device "$DEVICE" "$@"
