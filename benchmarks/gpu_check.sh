#!/usr/bin/env bash
# GPU check: the mlp and cnn workloads on 1 NVIDIA GPU, as users run fit (metrics=["accuracy"],
# shuffle=True, partial last batch): distribute fit against hand-written JAX
# doing the same work and Keras DataParallel.  One script, under 8 minutes on one GPU
# (install about 1-3 minutes, depending on the network; benchmark about 4 minutes).
#
#   bash benchmarks/gpu_check.sh                       # installs, runs, results in benchmarks/results/gpu/
#   PYTHON=/path/to/python bash benchmarks/gpu_check.sh   # use an interpreter that already has CUDA jax
#   WHEELS=/dir bash benchmarks/gpu_check.sh           # install offline from wheels in /dir (pip --no-index)
#
# What it installs (unless PYTHON is given): a virtual environment at $VENV (default
# /tmp/distribute-gpu-venv) with, from the package registry (or $WHEELS):
#   jax[cuda12]==0.10.2   -> jax 0.10.2, jaxlib 0.10.2, jax-cuda12-plugin[with-cuda] 0.10.2 and
#                            jax-cuda12-pjrt 0.10.2, which bring NVIDIA's CUDA 12 runtime wheels
#                            (nvidia-cublas-cu12, nvidia-cudnn-cu12, nvidia-cuda-runtime-cu12, nccl, ...)
#   keras==3.15.1 optax>=0.2.3,<0.3 grain>=0.2.18,<0.3 numpy<3
# (the project's own pins in pyproject.toml: jax 0.10.x, keras 3.15.x).  The project itself runs
# from src/ (PYTHONPATH), it is not installed.  Needs an NVIDIA driver for CUDA 12.
#
# Environment: PYTHON (skip the install), VENV, WHEELS, REPEATS (default 2), OUT (results dir),
# BUDGET_SECONDS (default 330: the benchmark part is stopped after this long).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
repeats="${REPEATS:-2}"
out="${OUT:-$here/results/gpu}"
budget="${BUDGET_SECONDS:-330}"
start=$SECONDS

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_check: no NVIDIA GPU here (nvidia-smi missing or lists none); this check needs one GPU." >&2
    exit 2
fi
nvidia-smi -L

if [ -z "${PYTHON:-}" ]; then
    venv="${VENV:-/tmp/distribute-gpu-venv}"
    base="$(command -v python3.11 || command -v python3.12 || command -v python3)"
    echo "gpu_check: installing CUDA jax 0.10.2 + keras 3.15.1 into $venv (from ${WHEELS:-the package registry})"
    "$base" -m venv "$venv"
    pip_args=(-q --disable-pip-version-check)
    if [ -n "${WHEELS:-}" ]; then pip_args+=(--no-index --find-links "$WHEELS"); fi
    "$venv/bin/python" -m pip install "${pip_args[@]}" \
        "jax[cuda12]==0.10.2" "keras==3.15.1" "optax>=0.2.3,<0.3" "grain>=0.2.18,<0.3" "numpy<3"
    python="$venv/bin/python"
    echo "gpu_check: install took $((SECONDS - start)) s"
else
    python="$PYTHON"
fi

# JAX must see the GPU (a CPU-only jaxlib would silently run on CPU).
if ! "$python" - <<'EOF'
import os, sys
os.environ["JAX_PLATFORMS"] = "cuda"
try:
    import jax
    devices = jax.devices()
except Exception as err:  # no CUDA plugin, driver mismatch, ...
    sys.exit(f"gpu_check: JAX cannot use the GPU with {sys.executable}: {err}")
print("jax", jax.__version__, "devices:", devices)
EOF
then
    exit 3
fi

export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}"
# Every run is a fresh process (60 s cap each); the whole benchmark stops after $budget seconds.
# 3 systems x 2 workloads x $repeats runs of about 10-20 s each.
timeout "$budget" "$python" "$here/compare.py" \
    --platform gpu --replicas 1 --workloads mlp,cnn --config user \
    --systems dist_fit,jax,keras_dp \
    --repeats "$repeats" --timeout 60 --retries 0 --python "$python" \
    --out "$out"
echo "gpu_check: done in $((SECONDS - start)) s; results in $out/results.md"
