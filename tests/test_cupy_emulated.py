"""The cupy backend's CUDA kernels, run on the CPU through the emulation harness.

tests/cuda_emu compiles the backend's unchanged .cu files with g++ and a CUDA shim (each
CUDA thread an OS thread, __syncthreads a block barrier, full-mask shuffles through a
per-warp exchange) and runs the launch plans the backend itself builds
(``gqakv_backends.cupy_backend.plan``). Every scenario is compared with the float64 loop
reference: append (bit-exact), decode, small-T decode, split-KV + merge, chunked prefill,
ragged rows, padded queries (exactly 0, lse -inf), NaN-filled tails and padding, rows
indirection, G in 1, 3, 4, 8, 12, dtypes float32 / float16 / bfloat16, d in 20, 64, 128.

Tolerance (FlashAttention's rule): max |out - ref| <= 2 * (max rounding error of the
reference rounded to the cache dtype) + 2e-6 (fp32 accumulation); lse within 1e-5.

The same scenarios then run under AddressSanitizer in a subprocess, with every byte a
kernel must not touch poisoned (dead cache tails, untouched rows, padding slots).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .cuda_emu import cases, harness

if harness.compiler() is None:
    pytest.skip("no C++ compiler (g++) for the CUDA emulation harness", allow_module_level=True)

HERE = Path(__file__).resolve().parent
CASES = cases.all_cases()
_SEEN_KERNELS: set[str] = set()


@pytest.fixture(scope="module")
def emulator():
    return harness.Emulator(harness.build(asan=False))


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_emulated_kernels_match_reference(emulator, case):
    stats = cases.run_case(emulator, case)
    assert stats["steps"] == len(case.steps)
    _SEEN_KERNELS.update(stats["kernels"])


def test_every_kernel_and_dtype_was_exercised(emulator):
    if len(_SEEN_KERNELS) == 0:
        pytest.skip("run together with the scenario tests")
    for kernel in ("gqakv_write_kv", "gqakv_decode", "gqakv_merge", "gqakv_prefill"):
        for ctype in ("float", "gqakv_half", "gqakv_bf16"):
            hits = [k for k in _SEEN_KERNELS if k.startswith(f"{kernel}<{ctype},")]
            assert hits, f"no scenario launched {kernel} for {ctype}"


def test_emulator_rejects_wrong_argument_types(emulator):
    """A launch whose scalar types differ from the kernel's signature fails loudly."""
    import numpy as np

    from gqakv_backends.cupy_backend import plan as planmod

    p = planmod.plan_write_kv("float32", 64, np.array([1]), 1, 1, (64, 64, 64), (64, 64, 64))
    bad = planmod.Launch(p.launches[0].kernel, p.launches[0].name, p.launches[0].grid,
                         p.launches[0].block,
                         tuple(np.int32(a) if isinstance(a, np.int64) else a
                               for a in p.launches[0].args))
    arrays = {n: np.zeros(64, np.float32) for n in ("k_new", "v_new", "k_buf", "v_buf")}
    arrays.update({n: np.zeros(1, np.int64) for n in ("rows", "starts", "n_new")})
    with pytest.raises(TypeError, match="sizes do not match"):
        emulator.run(planmod.Plan(launches=[bad]), arrays)


def test_emulated_kernels_under_address_sanitizer():
    runtime = harness.asan_runtime()
    if runtime is None:
        pytest.skip("AddressSanitizer runtime (libasan) not found for g++")
    harness.build(asan=True)
    env = dict(os.environ, LD_PRELOAD=runtime, ASAN_OPTIONS="detect_leaks=0:abort_on_error=0")
    proc = subprocess.run([sys.executable, str(HERE / "cuda_emu" / "run_cases.py"), "--asan"],
                          env=env, capture_output=True, text=True, timeout=900)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"AddressSanitizer run failed:\n{tail}"
    assert f"{len(CASES)} passed, 0 failed" in proc.stdout, tail
    print(proc.stdout.splitlines()[-2])
