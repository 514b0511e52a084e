"""The CPU emulation harness checks itself: a uniform kernel runs, divergent barriers and
warp collectives are caught (every thread must reach the same __syncthreads, every lane of
a warp the same shuffle or mma; before, a barrier was a bare counter and a divergent kernel
could pass), a deadlock becomes a failure, and launch shapes a GPU would refuse are refused.
The self-test kernel is tests/cuda_emu/driver.cpp's emu_divergence_selftest."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from gqakv_backends.cupy_backend import plan as planmod

from .cuda_emu import harness

if harness.compiler() is None:
    pytest.skip("no C++ compiler (g++) for the CUDA emulation harness", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def emulator():
    return harness.Emulator(harness.build(asan=False))


_SELFTEST = textwrap.dedent("""
    import sys
    import numpy as np
    sys.path.insert(0, {root!r})
    from gqakv_backends.cupy_backend import plan as planmod
    from tests.cuda_emu import harness
    emu = harness.Emulator(harness.build(asan=False))
    out = np.zeros(2 * 128, dtype=np.float32)
    launch = planmod.Launch("selftest", "emu_divergence_selftest", (2, 1, 1), (128, 1, 1),
                            (np.int32({mode}), planmod.Buf("out")))
    emu.run(planmod.Plan(launches=[launch]), {{"out": out}})
    print("ran", float(out.sum()))
""")


def _run_selftest(mode: int, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the self-test kernel in a fresh interpreter (a divergence aborts the process).
    Callers take the ``emulator`` fixture so the library is built here, with no time limit,
    and the child only loads it (a build under a loaded machine can outlast the timeout)."""
    return subprocess.run([sys.executable, "-c", _SELFTEST.format(root=str(ROOT), mode=mode)],
                          capture_output=True, text=True, timeout=120,
                          env=None if env is None else {**os.environ, **env})


def test_emulator_runs_a_uniform_kernel(emulator):
    proc = _run_selftest(0)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # x = tid + partner(tid ^ 1), then + that of tid ^ 4: every element is 4 * tid + const.
    tid = np.arange(128, dtype=np.float64)
    x = tid + (tid.astype(int) ^ 1)
    x = x + x[np.arange(128) ^ 4]
    assert proc.stdout.split() == ["ran", str(float(2 * x.sum()))]


# Either side of a divergence may notice it first (threads race to report), so mode 1 and
# mode 4 accept the message of either side.
@pytest.mark.parametrize("mode,message", [
    (1, r"a lane left the kernel while others of its warp were at a warp collective"
        r"|__shfl_xor_sync: not every lane of the warp is at this shuffle"),
    (2, r"__syncthreads: not every thread of the block reached this barrier"),
    (3, r"__shfl_xor_sync: not every lane of the warp is at this shuffle"),
    (4, r"(mma_m16n8k16|__shfl_xor_sync): not every lane of the warp is at this (mma|shuffle)"),
])
def test_emulator_catches_divergent_collectives(emulator, mode, message):
    proc = _run_selftest(mode)
    assert proc.returncode != 0, f"mode {mode} ran to the end:\n{proc.stdout}"
    assert re.search(message, proc.stderr), proc.stderr[-2000:]


def test_emulator_turns_a_deadlock_into_a_failure(emulator):
    """Lane 0 at an extra shuffle while everyone else waits at __syncthreads: nobody can
    proceed. The watchdog (GQAKV_EMU_DEADLOCK_S, here 2 s) aborts with a message instead of
    hanging the test run."""
    proc = _run_selftest(5, env={"GQAKV_EMU_DEADLOCK_S": "2"})
    assert proc.returncode != 0, proc.stdout
    assert "deadlock: no barrier completed" in proc.stderr, proc.stderr[-2000:]


def test_emulator_refuses_grids_beyond_cudas_limits(emulator):
    """The emulator refuses what a GPU would: gridDim.x >= 2^31, y or z > 65535, or 0."""
    p = planmod.plan_write_kv("float32", 64, np.array([1]), 1, 1, (64, 64, 64), (64, 64, 64))
    arrays = {n: np.zeros(64, np.float32) for n in ("k_new", "v_new", "k_buf", "v_buf")}
    arrays.update({n: np.zeros(1, np.int64) for n in ("rows", "starts", "n_new")})
    good = p.launches[0]
    for grid in ((2**31, 1, 1), (1, 65536, 1), (1, 1, 65536), (0, 1, 1), (1, 0, 1)):
        bad = planmod.Launch(good.kernel, good.name, grid, good.block, good.args)
        with pytest.raises(ValueError, match="bad launch shape"):
            emulator.run(planmod.Plan(launches=[bad]), arrays)
