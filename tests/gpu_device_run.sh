#!/usr/bin/env bash
# tests/gpu_check.py on a lent CUDA machine (the `device` tool's `run`). That machine has
# Python 3.12 with CuPy (cuda13x), NumPy, ml-dtypes, pytest, hypothesis, setuptools and
# torch, but no network and no array-api-compat / array-api-strict: they travel as wheels.
#
# Here, once per session, in the repository root (the wheels are excluded, not committed):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 -d .whl array-api-compat array-api-strict
#   .venv/bin/pip wheel --no-deps -w .whl .      # gqakv itself, built here (pure Python)
# Then one call:  run(command="bash tests/gpu_device_run.sh", carry=[".whl"], timeout_s=540)
# (add --quick for a smaller benchmark grid). The log also lands in $OUT/gpu_check.log.
set -euo pipefail
# gqakv is installed from its wheel too: its backends are found through entry points.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
python3 -c "import cupy; print('cupy', cupy.__version__)"
set -o pipefail
python3 tests/gpu_check.py "$@" 2>&1 | tee "${OUT:-/tmp}/gpu_check.log"
