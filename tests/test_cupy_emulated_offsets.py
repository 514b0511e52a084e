"""64-bit offsets in the CUDA kernels: a cache row that starts past 2^31 elements.

The issue asks for 64-bit offsets wherever B x Hkv x max_len x d can exceed 2^31. Here
the emulated kernels get a cache whose row stride is 2^31 + 4096 elements, so row 1's
first element lies beyond what a signed 32-bit element offset (an ``int``) can reach, and,
in float32, beyond 2^32 bytes;
every launch addresses row 1 through ``rows = [1]``. The buffer is one sparse anonymous
mapping (only the pages the test writes or a kernel touches are ever committed), laid out
as [K row 0 | V row 0 | ... gap ... | K row 1 | V row 1] with K and V sharing strides.
A kernel that computed ``rows[b] * stride`` in 32 bits would land in row 0 (NaN: the
comparison with the float64 reference fails) or outside the mapping (the process faults,
which fails the run as loudly); narrowing that product to ``int`` in each of decode,
decode_mma, prefill, prefill_mma, write_kv and copy_tokens was tried once, and each was caught.
"""

from __future__ import annotations

import ctypes
import mmap
import sys

import numpy as np
import pytest

from gqakv_backends.cupy_backend import plan as planmod

from .cuda_emu import harness
from .cuda_emu.cases import STORAGE, _check_out
from .support.reference import reference_attention

if harness.compiler() is None:
    pytest.skip("no C++ compiler (g++) for the CUDA emulation harness", allow_module_level=True)
if sys.maxsize <= 2**32:
    pytest.skip("needs a 64-bit address space", allow_module_level=True)

HKV, G, D, SLOTS = 2, 4, 64, 48
ROW_STRIDE = 2**31 + 4096  # elements; a multiple of every vector width
HEAD_STRIDE, TOKEN_STRIDE = SLOTS * D, D
ROW_ELEMENTS = HKV * SLOTS * D


@pytest.fixture(scope="module")
def emulator():
    return harness.Emulator(harness.build(asan=False))


class SparseCache:
    """K and V [2 rows, HKV, SLOTS, D] in one sparse mapping, row 1 at ROW_STRIDE elements."""

    def __init__(self, dtype: str):
        self.st = STORAGE[dtype]
        item = self.st.itemsize
        self.map = mmap.mmap(-1, (ROW_STRIDE + 2 * ROW_ELEMENTS) * item)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        self.k_ptr, self.v_ptr = self.base, self.base + ROW_ELEMENTS * item
        for row in (0, 1):  # NaN everywhere a correct kernel never reads
            self.row(self.k_ptr, row)[...] = np.nan
            self.row(self.v_ptr, row)[...] = np.nan

    def row(self, ptr: int, row: int) -> np.ndarray:
        """[HKV, SLOTS, D] view of one row of K (ptr = k_ptr) or V."""
        off = ptr + row * ROW_STRIDE * self.st.itemsize
        buf = (ctypes.c_char * (ROW_ELEMENTS * self.st.itemsize)).from_address(off)
        return np.frombuffer(buf, dtype=self.st).reshape(HKV, SLOTS, D)

    def close(self):
        self.map.close()


def _launch_all(emu, plan, ptrs: dict, keep: list) -> None:
    ptrs = dict(ptrs)
    for name, shape in plan.workspace.items():
        ws = np.full(shape, np.nan, dtype=np.float32)
        keep.append(ws)
        ptrs[name] = ws.ctypes.data
    dummy = np.full(1, np.nan, dtype=np.float32)
    keep.append(dummy)
    ptrs.setdefault("dummy", dummy.ctypes.data)
    for launch in plan.launches:
        emu._launch(launch, ptrs)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("steps,splits", [((9, 5, 1), None), ((20, 1), 3), ((7, 3), None)],
                         ids=["prefill-then-decode", "decode-split", "prefill-small-T"])
def test_row_past_2_31_elements(emulator, dtype, steps, splits):
    cache = SparseCache(dtype)
    st = cache.st
    rng = np.random.default_rng(len(steps) * 10 + (splits or 0))
    keep: list = []
    rows = np.array([1], dtype=np.int64)
    live = 0
    kernels = set()
    k_rows, v_rows = np.zeros((HKV, 0, D)), np.zeros((HKV, 0, D))
    try:
        for n in steps:
            k_new = rng.standard_normal((1, HKV, n, D)).astype(st)
            v_new = rng.standard_normal((1, HKV, n, D)).astype(st)
            q = rng.standard_normal((1, HKV * G, n, D)).astype(st)
            starts, n_new = np.array([live], np.int64), np.array([n], np.int64)
            live += n
            lens = np.array([live], np.int64)
            ints = [rows, starts, n_new, lens]
            keep += [k_new, v_new, q, *ints]
            buf_strides = (ROW_STRIDE, HEAD_STRIDE, TOKEN_STRIDE)
            write = planmod.plan_write_kv(dtype, D, n_new, HKV, n, (HKV * n * D, n * D, D), buf_strides)
            _launch_all(emulator, write, {"k_new": k_new.ctypes.data, "v_new": v_new.ctypes.data,
                                          "k_buf": cache.k_ptr, "v_buf": cache.v_ptr,
                                          "rows": rows.ctypes.data, "starts": starts.ctypes.data,
                                          "n_new": n_new.ctypes.data}, keep)
            out = np.zeros((1, HKV * G, n, D), dtype=st)
            lse = np.full((1, HKV * G, n), -np.inf, dtype=np.float32)
            keep += [out, lse]
            attn = planmod.plan_attention(
                dtype, D, batch=1, kv_heads=HKV, group=G, t_q=n, lens=lens, n_new=n_new,
                scale=D ** -0.5, q_strides=(HKV * G * n * D, n * D, D), buf_strides=buf_strides,
                out_strides=(HKV * G * n * D, n * D, D), sm_count=132, force_splits=splits)
            kernels |= {launch.kernel for launch in attn.launches}
            _launch_all(emulator, attn, {"q": q.ctypes.data, "k_buf": cache.k_ptr,
                                         "v_buf": cache.v_ptr, "rows": rows.ctypes.data,
                                         "lens": lens.ctypes.data, "n_new": n_new.ctypes.data,
                                         "out": out.ctypes.data, "lse": lse.ctypes.data}, keep)
            # the append landed in row 1, past 2^31 elements, and nowhere in row 0
            k_rows = np.concatenate([k_rows, k_new[0].astype(np.float64)], axis=1)
            v_rows = np.concatenate([v_rows, v_new[0].astype(np.float64)], axis=1)
            np.testing.assert_array_equal(cache.row(cache.k_ptr, 1)[:, :live].astype(np.float64), k_rows)
            np.testing.assert_array_equal(cache.row(cache.v_ptr, 1)[:, :live].astype(np.float64), v_rows)
            assert np.isnan(cache.row(cache.k_ptr, 0).astype(np.float32)).all()
            assert np.isnan(cache.row(cache.v_ptr, 0).astype(np.float32)).all()
            ref, ref_lse = reference_attention(q.astype(np.float64), [k_rows], [v_rows], n_new)
            stats = {"max_out_err": 0.0, "max_out_tol": 0.0, "max_lse_err": 0.0}
            case = type("C", (), {"dtype": dtype, "name": f"offset-{dtype}"})
            _check_out(case, n, out, lse, ref, ref_lse, n_new, stats)
        # row copies (reorder / fork): row 1's live tokens into row 0 and back into row 1
        strides = (2 * ROW_STRIDE, ROW_STRIDE, HEAD_STRIDE, TOKEN_STRIDE)  # [layers=1, rows, ...]
        for dst, src in ((0, 1), (1, 0)):
            pairs = np.array([[dst], [src], [live]], dtype=np.int64)
            keep.append(pairs)
            copy = planmod.plan_copy_tokens(dtype, D, pairs[2], 1, HKV, strides, strides)
            _launch_all(emulator, copy, {"dst_k": cache.k_ptr, "dst_v": cache.v_ptr,
                                         "src_k": cache.k_ptr, "src_v": cache.v_ptr,
                                         "pairs": pairs.ctypes.data}, keep)
            for ptr, want in ((cache.k_ptr, k_rows), (cache.v_ptr, v_rows)):
                np.testing.assert_array_equal(cache.row(ptr, dst)[:, :live].astype(np.float64), want)
    finally:
        del keep
        cache.close()
    if dtype == "bfloat16":
        assert kernels & {"gqakv_decode_mma", "gqakv_prefill_mma"}
    if splits:
        assert "gqakv_merge" in kernels

