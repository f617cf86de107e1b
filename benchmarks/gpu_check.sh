#!/usr/bin/env bash
# GPU check: MLP and CNN workloads on 1 GPU replica, distribute (custom loop and
# fit) against hand-written JAX.  Installs nothing; needs a Python whose jax has
# CUDA support (set PYTHON=..., default: python3).  Fits in about 5 minutes.
#
#   bash benchmarks/gpu_check.sh            # results in benchmarks/results/gpu/
#   PYTHON=/path/to/venv/bin/python REPEATS=3 bash benchmarks/gpu_check.sh
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-python3}"
repeats="${REPEATS:-3}"
out="${OUT:-$here/results/gpu}"

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_check: no NVIDIA GPU here (nvidia-smi missing or lists none); this check needs one GPU." >&2
    exit 2
fi
nvidia-smi -L

# JAX must see the GPU too (a CPU-only jaxlib would silently run on CPU).
if ! "$python" - <<'EOF'
import os, sys
os.environ["JAX_PLATFORMS"] = "cuda"
try:
    import jax
    devices = jax.devices()
except Exception as err:  # no CUDA jaxlib / plugin, driver mismatch, ...
    sys.exit(f"gpu_check: JAX cannot use the GPU with {sys.executable}: {err}")
print("jax", jax.__version__, "devices:", devices)
EOF
then
    exit 3
fi

# Every run is a fresh process; timeout keeps one stuck run from eating the budget.
exec timeout 290 "$python" "$here/compare.py" \
    --platform gpu --replicas 1 --workloads mlp,cnn \
    --systems dist_loop,dist_fit,jax \
    --repeats "$repeats" --timeout 60 --retries 0 \
    --out "$out"
