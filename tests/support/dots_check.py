"""``numba_kernels._dots_4x2`` against float64 dot products, for every stored element type
the kernels decode and head dims from one vector to several, and grouped codes decoded in
registers against the float32 rows ``dequantize_rows`` writes (``check_grouped``: the
dots and the P V sums bit for bit), bfloat16 queries over bfloat16 keys
(``check_bfloat16_queries``: pair products where the target has them), and a block's
passes with near and far prefetches against the same without (``check_prefetches``: bit
for bit); run in-process by
tests/test_numba_backend.py and, for the 8-lane (AVX2) form, in a process whose numba
target is Haswell (``python -m tests.support.dots_check``; prints "ok" and the lanes the dots used)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
from numba import njit

from gqakv_backends import numba_kernels as nk


@njit(fastmath=nk.FASTMATH, cache=False)
def _dots(qt, rr, krows, j0, j1):
    return nk._dots_4x2(qt, rr, krows, None, j0, j1)


@njit(fastmath=nk.FASTMATH, cache=False)
def _tile_dots(qt, r0, r1, krows, s):
    """s[r0:r1, :n] = the dots of tile rows r0..r1 with all n keys (``_block_dots``)."""
    nk._block_dots(qt, r0, r1, krows, None, krows.shape[0], s, 0, 0, 0)


@njit(fastmath=nk.FASTMATH, cache=False)
def _grouped_passes(qt, r1, codes, scales, s, acc, decoded):
    """Rows 0..r1 of a tile over the n keys of ``codes`` / ``scales`` (grouped), twice:
    decoded in registers (s[0], acc[0]) and from the rows ``dequantize_rows`` writes into
    ``decoded`` (s[1], acc[1]); each as ``_attend`` runs a block's dots, then its P V."""
    n = codes.shape[0]
    nk._block_dots(qt, 0, r1, codes, scales, n, s[0], 0, 0, 0)
    nk._accumulate(acc[0], 0, r1, s[0], 0, codes, scales, n, 0, 0)
    nk.dequantize_rows(codes, scales, n, decoded, 0)
    nk._block_dots(qt, 0, r1, decoded, None, n, s[1], 0, 0, 0)
    nk._accumulate(acc[1], 0, r1, s[1], 0, decoded, None, n, 0, 0)


@njit(fastmath=nk.FASTMATH, cache=False)
def _prefetching_passes(qt, r1, rows, n, s, acc, ahead, far):
    """A block's dots, then its P V, over the first n of ``rows`` with the given near and
    far prefetch distances (``prefetch_ahead``, ``far_ahead``)."""
    nk._block_dots(qt, 0, r1, rows, None, n, s, 0, ahead, far)
    nk._accumulate(acc, 0, r1, s, 0, rows, None, n, ahead, far)


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
    check_grouped(seed)
    check_prefetches(seed)
    check_bfloat16_queries(seed)


def check_bfloat16_queries(seed: int = 0) -> None:
    """Queries as bfloat16 bits (int16) over bfloat16 keys: the dots equal float64 ones to
    float32 rounding (every product is exact) for head dims of one 16-column vector to
    eight 32-column pairs, d = 48 and 80 (a last 16 columns widened) and d = 40 (the
    scalar loops), in passes of 4, 3, 2 or 1 rows; a row's dots are the same bits
    whichever rows share its pass (d a multiple of 16, as ``_dots_rows`` promises); and
    the pair products (``vdpbf16ps``) are compiled in exactly where the target has them
    (``_has_bf16_dots``)."""
    from numba.core.registry import cpu_target

    rng = np.random.default_rng(seed)
    n = 7  # odd: the last key has no partner
    for d in (16, 32, 40, 48, 80, 128, 256):
        sizes = np.array([[1.0], [1e4], [1e-3], [1.0]])  # rows of very different sizes
        qt, q = stored("bfloat16", rng.standard_normal((4, d)) * sizes)
        keys, k = stored("bfloat16", rng.standard_normal((n, d)))
        want = q @ k.T
        full = np.zeros((4, n), np.float32)
        _tile_dots(qt, 0, 4, keys, full)
        err = np.abs(full - want).max(axis=1) / np.abs(want).max(axis=1)
        assert err.max() < 1e-6, f"d={d}: relative errors by row {err}"
        for r0, r1 in ((0, 3), (1, 3), (3, 4), (0, 2), (2, 3)):
            part = np.zeros((4, n), np.float32)
            _tile_dots(qt, r0, r1, keys, part)
            err = np.abs(part[r0:r1] - want[r0:r1]).max(axis=1) / np.abs(want[r0:r1]).max(axis=1)
            assert err.max() < 1e-6, f"d={d}, rows {r0}..{r1}: relative errors by row {err}"
            if d % 16 == 0:
                assert np.array_equal(part[r0:r1].view(np.uint32), full[r0:r1].view(np.uint32)), \
                    f"d={d}: rows {r0}..{r1} in their own pass differ from the pass of four"
    _dots(qt, 0, keys, 0, 1)  # d = 256, every row of a pass of four
    asm = "".join(_dots.inspect_asm().values())
    has = nk._has_bf16_dots(cpu_target.target_context)
    assert ("vdpbf16ps" in asm) == has, f"vdpbf16ps compiled in: {'vdpbf16ps' in asm}, target has it: {has}"


def check_prefetches(seed: int = 0) -> None:
    """Prefetching changes no bit: a block's dots and P V over 16-bit and float32 rows
    with near and far prefetches (distances inside the rows, at their end and past it:
    the far one is skipped there) equal the same passes without any."""
    rng = np.random.default_rng(seed)
    for name in ("float32", "float16", "bfloat16"):
        for d, r1 in ((128, 4), (64, 3), (32, 1)):
            n = 40
            bits, _ = stored(name, rng.standard_normal((n + 8, d)))
            qt = rng.standard_normal((4, d)).astype(np.float32)
            start = rng.standard_normal((4, d)).astype(np.float32)
            results = []
            for ahead, far in ((0, 0), (2, 5), (2, n - 1), (3, n + 20)):
                s = np.zeros((4, n), np.float32)
                acc = start.copy()
                _prefetching_passes(qt, r1, bits, n, s, acc, ahead, far)
                results.append((s, acc))
            for (s, acc), ahead_far in zip(results[1:], ((2, 5), (2, n - 1), (3, n + 20))):
                what = f"{name} d={d} rows {r1}, prefetch {ahead_far}"
                assert np.array_equal(s.view(np.uint32), results[0][0].view(np.uint32)), what
                assert np.array_equal(acc.view(np.uint32), results[0][1].view(np.uint32)), what


def check_grouped(seed: int = 0) -> None:
    """Grouped codes (8-bit, 4-bit nibble pairs; blocks of 32 and 64 values) read in
    registers give the bits of the float32 rows they decode to: the dots of 1 to 4 tile
    rows and their P V sums, over head dims of one block to several (96: a last pass of
    fewer vectors than the others), every code and a zero scale included; and those rows
    are NumPy's float32 code x scale, bit for bit (the one decoder checked on its own, in
    this process's lanes)."""
    rng = np.random.default_rng(seed)
    for bits in (8, 4):
        for group, d in ((32, 32), (32, 96), (32, 128), (64, 64), (64, 192)):
            n = 9  # odd: the last key of a block has no partner
            if bits == 8:
                codes = rng.integers(-128, 128, (n, d)).astype(np.int8)
                codes[0] = np.resize(np.arange(-128, 128), d)
            else:
                codes = rng.integers(0, 256, (n, d // 2)).astype(np.uint8)
                codes[0] = np.resize(np.arange(256), d // 2)
            scales = rng.standard_normal((n, d // group)).astype(np.float32)
            scales[1, 0] = 0.0
            if bits == 8:
                values = codes.astype(np.float32)
            else:
                values = np.empty((n, d), np.float32)
                values[:, 0::2] = (codes & 15).astype(np.float32) - 8
                values[:, 1::2] = (codes >> 4).astype(np.float32) - 8
            want = values * np.repeat(scales, group, axis=1)
            qt = rng.standard_normal((4, d)).astype(np.float32)
            for r1 in (1, 2, 3, 4):
                s = np.zeros((2, 4, n), np.float32)
                acc = np.tile(rng.standard_normal((1, 4, d)).astype(np.float32), (2, 1, 1))
                decoded = np.empty((n, d), np.float32)
                _grouped_passes(qt, r1, codes, scales, s, acc, decoded)
                what = f"{bits}-bit blocks of {group}, d={d}, {r1} rows"
                assert np.array_equal(decoded.view(np.uint32), want.view(np.uint32)), f"rows: {what}"
                assert np.array_equal(s[0].view(np.uint32), s[1].view(np.uint32)), f"dots: {what}"
                assert np.array_equal(acc[0].view(np.uint32), acc[1].view(np.uint32)), f"P V: {what}"


if __name__ == "__main__":
    from numba.core.registry import cpu_target

    check()
    print("ok", nk._vector_lanes(cpu_target.target_context))  # the lanes the dots used
