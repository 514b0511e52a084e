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
# (add --quick for a smaller benchmark grid). It runs `gqakv selftest --backend cupy`
# first, then gpu_check.py; the log of both lands in $OUT/gpu_check.log.
set -euo pipefail
# gqakv is installed from its wheel too: its backends are found through entry points.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
python3 -c "import cupy; print('cupy', cupy.__version__)"
set -o pipefail
# First what a user runs first on new hardware: every kernel built and checked against the
# float64 reference. A failure does not stop the run (the parity suite's log is wanted
# too); the script's exit status reports it.
LOG="${OUT:-/tmp}/gpu_check.log"
selftest_status=0
python3 -m gqakv selftest --backend cupy 2>&1 | tee "$LOG" || selftest_status=$?
check_status=0
python3 tests/gpu_check.py "$@" 2>&1 | tee -a "$LOG" || check_status=$?
echo "selftest exit status: $selftest_status; gpu_check exit status: $check_status" | tee -a "$LOG"
if [ "$selftest_status" -ne 0 ]; then exit "$selftest_status"; fi
exit "$check_status"
