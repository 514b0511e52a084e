"""``numba_kernels._dots_4x2`` against float64 dot products, for every stored element type
the kernels decode and head dims from one vector to several; run in-process by
tests/test_numba_backend.py and, for the 8-lane (AVX2) form, in a process whose numba
target is Haswell (``python -m tests.support.dots_check``; prints "ok" and the lanes the dots used)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
from numba import njit

from gqakv_backends import numba_kernels as nk


@njit(fastmath=nk.FASTMATH, cache=False)
def _dots(qt, rr, krows, j0, j1):
    return nk._dots_4x2(qt, rr, krows, j0, j1)


def stored(name: str, x: np.ndarray):
    """(the bits the kernels read, their float64 values) of float64 ``x`` stored as ``name``."""
    if name == "float32":
        bits = x.astype(np.float32)
        return bits, bits.astype(np.float64)
    if name == "int8":
        bits = np.clip(np.round(x * 40), -127, 127).astype(np.int8)
        return bits, bits.astype(np.float64)
    dtype = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16,
             "e4m3": ml_dtypes.float8_e4m3fn}[name]
    view = {"float16": np.uint16, "bfloat16": np.int16, "e4m3": np.uint8}[name]
    held = x.astype(dtype)
    return held.view(view), held.astype(np.float64)


def check(seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for d in (16, 32, 80, 128, 256):
        qt = rng.standard_normal((6, d)).astype(np.float32)
        for name in ("float32", "float16", "bfloat16", "int8", "e4m3"):
            bits, values = stored(name, rng.standard_normal((5, d)))
            for rr, (j0, j1) in ((0, (0, 1)), (2, (3, 3)), (1, (4, 2))):
                got = np.array(_dots(qt, rr, bits, j0, j1), dtype=np.float64)
                q = qt[rr:rr + 4].astype(np.float64)
                want = np.concatenate([q @ values[j0], q @ values[j1]])
                err = np.abs(got - want).max() / np.abs(want).max()
                # float32 products summed in float32 over d <= 256 terms
                assert err < 1e-6, f"d={d} {name} rows {rr}.. keys {j0},{j1}: error {err:.3g}"


if __name__ == "__main__":
    from numba.core.registry import cpu_target

    check()
    print("ok", nk._vector_lanes(cpu_target.target_context))  # the lanes the dots used
