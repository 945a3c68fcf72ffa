# Sourced by the scripts/gpu_*.sh device-call scripts after they set OUT: unbuffered Python,
# pytest from the carried wheels where the device image has none (.whl, see docs/benchmarks-kernel-notes.md),
# and the GPU, driver, torch and triton versions into $OUT/gpu.txt.
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
if ! python3 -c "import pytest" 2>/dev/null && ls .whl/pytest-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
