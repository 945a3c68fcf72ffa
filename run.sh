#!/usr/bin/env bash
# Write, verify and tune workspace/engine.py for a model:   bash run.sh [flags]   (bash run.sh --help)
# Serve the engine it wrote (OpenAI-compatible API):        bash run.sh serve [flags]
#
# This script only gets Python ready: it finds an interpreter with torch ($PYTHON overrides),
# installs whatever requirements.txt lists that is missing (and nothing else), then hands over
# to the agent (`python -m agent`), which resolves the inputs (/target/... when mounted, else
# target/), makes toy weights for the repository's own target if absent, and runs the search.
# Exit code 0 only when workspace/engine.py holds an engine that passed verification.
set -uo pipefail
# Python runs from the repository; the agent and the server then resolve relative paths in their
# flags (and MODEL_CONFIG, WEIGHT_DIR, AGENT_WORKSPACE) against the caller's folder, as a shell would.
export RUN_SH_CALLER_DIR="$PWD"
cd "$(dirname "${BASH_SOURCE[0]}")" || exit 2

has_torch() { "$1" -c "import torch" >/dev/null 2>&1; }

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for candidate in python3 python .venv/bin/python; do
    if command -v "$candidate" >/dev/null 2>&1 && has_torch "$candidate"; then PY="$candidate"; break; fi
  done
fi
PY="${PY:-python3}"
if ! command -v "$PY" >/dev/null 2>&1; then
  echo "error: no Python interpreter found (tried \$PYTHON, python3, python); set PYTHON=/path/to/python" >&2
  exit 2
fi
if ! has_torch "$PY"; then
  if command -v nvidia-smi >/dev/null 2>&1 || [ -e /dev/nvidia0 ]; then
    echo "run.sh: $PY has no torch; installing it with CUDA (pip install torch: several GB)" >&2
    "$PY" -m pip install --quiet torch >&2 || { echo "error: could not install torch for $PY" >&2; exit 2; }
  else
    # No NVIDIA GPU here: the CPU build (about 200 MB) instead of the default CUDA one (several GB).
    # One retry and a short timeout: where PyTorch's index cannot be reached, pip's default five
    # retries a package cost a minute or more before the pinned CPU build from the registry.
    echo "run.sh: $PY has no torch and this machine no NVIDIA GPU; installing torch's CPU build" >&2
    "$PY" -m pip install --quiet --retries 1 --timeout 20 torch --index-url https://download.pytorch.org/whl/cpu >&2 \
      || "$PY" -m pip install --quiet "torch==2.13.0" >&2 \
      || { echo "error: could not install torch for $PY" >&2; exit 2; }
  fi
fi

# Requirements whose module cannot be imported: install only those. A failed install (no network)
# is not fatal here: the agent says clearly if something it cannot run without is missing.
missing=$("$PY" - <<'EOF'
import importlib.util, re
MODULE = {"gitpython": "git", "pytest-xdist": "xdist"}   # distribution name → import name, where they differ
for line in open("requirements.txt"):
    req = line.split("#")[0].strip()
    if not req:
        continue
    name = re.split(r"[<>=!~\[; ]", req)[0]
    module = MODULE.get(name.lower(), name.lower().replace("-", "_"))
    if importlib.util.find_spec(module) is None:
        print(req)
EOF
)
if [ -n "$missing" ]; then
  echo "run.sh: installing what requirements.txt lists and $PY lacks (for the agent, the server and the tests): $(echo $missing)" >&2
  # shellcheck disable=SC2086
  "$PY" -m pip install --quiet --retries 1 --timeout 15 $missing >&2 \
    || "$PY" -m pip install --quiet --retries 1 --timeout 15 --user $missing >&2 \
    || echo "run.sh: warning: could not install: $(echo $missing)" >&2
fi

# `bash run.sh serve [flags]`: the OpenAI-compatible server for the engine a run wrote (docs/serving.md).
if [ "${1:-}" = "serve" ]; then
  shift
  exec "$PY" -m serve "$@"
fi
exec "$PY" -m agent "$@"
