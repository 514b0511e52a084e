"""bfloat16 prefill items on bfloat16 products: the BLAS path's item kernel without float32 copies.

The numba backend's BLAS path (``numpy_attention``) computes a bfloat16 cache in float32:
each K/V block is cast to float32 and multiplied by OpenBLAS's sgemm. Where the CPU has
bfloat16 products with float32 sums (``amx.why_not``: AMX tiles, or where there are none
AVX-512 BF16 dot products, the same product with the same operand layouts,
``avx512_bf16``), an item whose queries and K/V are bfloat16 runs here instead:

    S = Q K^T               bfloat16 x bfloat16 -> float32 (products exact)
    P = softmax step of S   float32 (``numba_kernels.softmax_block``: scale, mask, max, exp)
    O = alpha O + P V       P split into bfloat16 high and low parts, P_hi V + P_lo V

so every product is exact and every sum float32, as on the float32 path, and P = P_hi
+ P_lo (P's top 16 bits and the remainder's) is within 2^-14 of P, below it: the
output's error from it is at most 2^-14 of max |v|, far below the bfloat16 output's
2^-9. Torch's CPU flash attention, by contrast, rounds P to bfloat16 once (2^-9).

Each key block (at most ``score_block_elements`` scores, the BLAS path's blocks) is one
GIL-free numba call (``fold_block``): K laid out in pairs of d (``keys_as_pairs``: the
B operand of S holds, for each key, two consecutive d values side by side), V in pairs
of keys (``values_as_pairs``), both tile products through the kernel's process symbol
(``_kernel``), the soft-cap, the softmax step writing P's two parts, the output
rescaled. Rows (G x queries) and keys are padded with zeros to multiples of 32, the
tiles' blocks; the padding is never seen (its scores are masked by ``keys``, its rows
dropped); buffer rows are padded off multiples of 512 bytes (``_pitch``).

The item's (m, l, o) state is the float32 ``SoftmaxState`` the BLAS path merges and
finishes, so key pieces, sinks and the output cast are unchanged.

int8 and float8_e4m3fn codes with per-token scales run here too (``fold_codes``): every
code's value is a bfloat16, so the codes are laid out as bfloat16 bits through a table
(``codes_as_pairs``), S = Q C^T on the tiles, each key's score column times its K scale,
and each p times its value's V scale before P's split: the products of the dequantized
K and V, each scale applied once per score instead of once per value.

Declined (the float32 path runs): neither engine available, storage other than bfloat16 or those
8-bit codes (grouped codes, float16, float32), queries that are not
bfloat16 values (bfloat16, or float32 holding them: ``holds_bfloat16``), d not
a multiple of 32, draft trees and ALiBi (a position-dependent score hook) for a whole
call (``declines``), and items below ``MIN_ITEM_WORK`` one by one.
"""

from __future__ import annotations

import functools
import threading

import ml_dtypes
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from gqakv.ops.merge import SoftmaxState

from . import amx
from .amx import holds_bfloat16
from .numba_kernels import bfloat16_parts, score, softmax_block
from .numpy_readers import MIN_BLOCK_KEYS, Coded, Pages, Plain, _converted_keys
from .scratch import thread_buffer


def _scratch(name: str, shape: tuple, dtype) -> np.ndarray:
    """This thread's reused memory for the items' buffer ``name`` (``scratch.thread_buffer``):
    a prefill walks hundreds of items per thread, and fresh buffers of a few MiB each
    would be faulted in and zeroed by the kernel every time."""
    return thread_buffer(f"amx {name}", shape, dtype)

BF16 = np.dtype(ml_dtypes.bfloat16)
#: Rows and keys are padded to multiples of this (a block of 2 x 2 tiles).
TILE_BLOCK = amx.TILE_BLOCK
#: Items of less work than this (padded rows x keys x d multiply-adds per product) take
#: the float32 path: each AMX item pays its layout steps and a few host calls per block.
#: Measured 2026-12-05 (2 threads, whole calls, AMX / float32 path time): 1.45 at 0.8M
#: (16 queries of one head over 200 keys), 1.12 at 0.8M (B=8, 64-token rows, d=64), 1.02
#: at 8.4M (B=8, 128-token prompts, d=128), 0.94 at 6.3M (a 512-token SmolLM2 prompt),
#: 0.47-0.66 from 16 queries over 3,000 keys up.
MIN_ITEM_WORK = 1 << 22


def _round_up(x: int) -> int:
    return -(-x // TILE_BLOCK) * TILE_BLOCK


def _pitch(n: int, itemsize: int) -> int:
    """Elements per buffer row for rows of ``n``: ``n``, plus 64 bytes where a row would
    be a multiple of 512 bytes."""
    return n + (64 // itemsize if (n * itemsize) % 512 == 0 else 0)


@njit(cache=True, nogil=True)
def keys_as_pairs(k, out):
    """``out[h, r, n] = k[h, n, r]``: K ``[hh, K, d / 2]`` (as uint32 pairs of bfloat16)
    into the S product's B operand ``[hh, d / 2, Kp]`` (uint32), keys K..Kp-1 zero. Walks
    16 x 16 blocks so reads and writes both stay in L1; a block of 16 whole keys has
    constant trip counts, which LLVM unrolls (2.3x faster than one loop for every block,
    0.12 -> 0.05 ms for 2,048 keys at d 128)."""
    hh, K, half = k.shape
    Kp = out.shape[2]
    for h in range(hh):
        for n0 in range(0, Kp, 16):
            if n0 + 16 <= K:
                for r0 in range(0, half, 16):
                    for r in range(r0, min(half, r0 + 16)):
                        for n in range(16):
                            out[h, r, n0 + n] = k[h, n0 + n, r]
            else:  # the last keys and the zero padding after them
                for r in range(half):
                    for n in range(n0, n0 + 16):
                        out[h, r, n] = k[h, n, r] if n < K else np.uint32(0)


@njit(cache=True, nogil=True)
def values_as_pairs(v, out):
    """``out[h, r, n, e] = v[h, 2r + e, n]``: V ``[hh, K, d]`` (bfloat16 bits) into the
    P V product's B operand ``[hh, Kp / 2, d, 2]``, keys K..Kp-1 zero. Whole pairs are
    joined as one 32-bit word first, so the loop over d vectorizes (0.066 -> 0.040 ms for
    2,048 keys at d 128)."""
    hh, K, d = v.shape
    half = out.shape[1]
    for h in range(hh):
        for r in range(half):
            a, b = 2 * r, 2 * r + 1
            if b < K:
                for n in range(d):
                    w = np.uint32(v[h, a, n]) | (np.uint32(v[h, b, n]) << np.uint32(16))
                    out[h, r, n, 0] = np.uint16(w & np.uint32(0xFFFF))
                    out[h, r, n, 1] = np.uint16(w >> np.uint32(16))
            else:
                for n in range(d):
                    out[h, r, n, 0] = v[h, a, n] if a < K else np.uint16(0)
                    out[h, r, n, 1] = 0


@njit(cache=True, nogil=True)
def codes_as_pairs(kc, vc, lut, kt, vv):
    """``keys_as_pairs`` and ``values_as_pairs`` of 8-bit codes (K and V ``[hh, K, d]``,
    as uint8) through ``lut`` [256] uint16: each code's value as bfloat16 bits (int8 and
    float8_e4m3fn values are all bfloat16, so exactly); zero past K."""
    hh, K, d = kc.shape
    half, Kp = kt.shape[1], kt.shape[2]
    for h in range(hh):
        for n0 in range(0, Kp, 16):
            for r0 in range(0, half, 16):
                for r in range(r0, min(half, r0 + 16)):
                    for n in range(n0, n0 + 16):
                        if n < K:
                            kt[h, r, n] = (np.uint32(lut[kc[h, n, 2 * r]])
                                           | (np.uint32(lut[kc[h, n, 2 * r + 1]]) << np.uint32(16)))
                        else:
                            kt[h, r, n] = 0
        for r in range(vv.shape[1]):
            a, b = 2 * r, 2 * r + 1
            for c in range(d):
                vv[h, r, c, 0] = lut[vc[h, a, c]] if a < K else np.uint16(0)
                vv[h, r, c, 1] = lut[vc[h, b, c]] if b < K else np.uint16(0)


@njit(cache=True, nogil=True)
def pages_as_pairs(pool_k, pool_v, pages, h0, at, K, kt, vv):
    """``keys_as_pairs`` and ``values_as_pairs`` of keys ``at .. at + K - 1`` of the pages
    ``pages`` (token t at row t % P of page pages[t // P]), KV heads h0 .. h0 + hh - 1,
    read from the pools (pool_k [num_pages, Hkv, P, d / 2] uint32, pool_v [num_pages, Hkv,
    P, d] uint16) without a gathered copy; zero past K, as those."""
    hh, half, Kp = kt.shape
    _, Hkv, P, d = pool_v.shape
    flat_k, flat_v = pool_k.reshape(-1), pool_v.reshape(-1)  # C-contiguous: views
    row = np.empty(16, np.int64)  # each of 16 keys' row: its first element in the pool
    for h in range(hh):
        hd = h0 + h
        for n0 in range(0, Kp, 16):
            for n in range(16):
                t = at + n0 + n
                page = pages[t // P] if n0 + n < K else 0
                row[n] = (page * Hkv + hd) * P + t % P
            if n0 + 16 <= K:
                for r0 in range(0, half, 16):
                    for r in range(r0, min(half, r0 + 16)):
                        for n in range(16):
                            kt[h, r, n0 + n] = flat_k[row[n] * half + r]
            else:  # the last keys and the zero padding after them
                for r in range(half):
                    for n in range(16):
                        kt[h, r, n0 + n] = (flat_k[row[n] * half + r] if n0 + n < K
                                            else np.uint32(0))
            for e in range(0, 16, 2):  # the values of these 16 keys, a pair at a time
                i = (n0 + e) // 2
                if i >= vv.shape[1]:
                    break
                a, b = n0 + e, n0 + e + 1
                if b < K:
                    va, vb = row[e] * d, row[e + 1] * d
                    for c in range(d):
                        w = np.uint32(flat_v[va + c]) | (np.uint32(flat_v[vb + c]) << np.uint32(16))
                        vv[h, i, c, 0] = np.uint16(w & np.uint32(0xFFFF))
                        vv[h, i, c, 1] = np.uint16(w >> np.uint32(16))
                else:
                    va = row[e] * d
                    for c in range(d):
                        vv[h, i, c, 0] = flat_v[va + c] if a < K else np.uint16(0)
                        vv[h, i, c, 1] = 0


@njit(cache=True, nogil=True)
def rescale_rows(o, alpha, d):
    """``o[h, r, :d] *= alpha[h, r]`` (o C-contiguous, its rows padded past d)."""
    for h in range(o.shape[0]):
        for r in range(o.shape[1]):
            row, a = o[h, r, :d], alpha[h, r]
            for j in range(d):
                row[j] *= a


@intrinsic
def _kernel(typingctx, a1, a2, lda, b, ldb, bstep, bcol, c, ldc, m32, n32, nk, heads, sa, sb, sc,
            accumulate):
    """A call of the product (``amx.SYMBOL``, registered by ``amx._compile``: AMX or AVX-512
    BF16) from
    numba code: its pointers as integers, the rest as in ``amx.matmul``."""
    args = (a1, a2, lda, b, ldb, bstep, bcol, c, ldc, m32, n32, nk, heads, sa, sb, sc, accumulate)
    if not all(isinstance(x, types.Integer) for x in args):
        return None
    pointers = (0, 1, 3, 7)

    def codegen(context, builder, signature, values):
        i64, ptr = ir.IntType(64), ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(ir.VoidType(), [ptr if k in pointers else i64 for k in range(len(values))])
        fn = cgutils.get_or_insert_function(builder.module, fnty, amx.SYMBOL)
        cast = [builder.sext(v, i64) if v.type.width < 64 else v for v in values]
        builder.call(fn, [builder.inttoptr(v, ptr) if k in pointers else v for k, v in enumerate(cast)])
        return context.get_dummy_value()

    return types.void(*args), codegen


@njit(cache=True, inline="always")
def _tile_product(a1, a2, two, b, c, accumulate):
    """``amx.matmul(a1, b, c, a2=a2 if two, accumulate)`` from numba, B's pairs in rows
    (``[heads, K / 2, N, 2]``, or as uint32 ``[heads, K / 2, N]``); shapes as the caller's
    (multiples of 32, rows contiguous), unchecked."""
    heads, M, K = a1.shape
    N = c.shape[2]
    _kernel(a1.ctypes.data, a2.ctypes.data if two else 0, a1.strides[1], b.ctypes.data,
            b.strides[1], 16 * b.strides[1], 64, c.ctypes.data, c.strides[1], M // 32, N // 32,
            K // 32, heads, a1.strides[0], b.strides[0], c.strides[0], 1 if accumulate else 0)


@njit(cache=True, nogil=True)
def fold_block(qp, k, v, kt, vv, s_full, hi_full, lo_full, o_rows, m, l, alpha, nq, pos0, window,
               scale, softcap, keys):
    """One key block of an item, without the GIL: K and V into the tiles' layouts,
    S = Q K^T on the product, the soft-cap (``softcap`` > 0), the softmax step writing P's
    bfloat16 parts (``softmax_block``), the output rescaled, O += P V on the product.

    qp: [hh, Rp, d] bfloat16 bits (rows padded to 32); k: [hh, keys, d / 2] uint32 (pairs
    of bfloat16), v: [hh, keys, d] bfloat16 bits; kt: [hh, d / 2, Kp] uint32 and vv:
    [hh, Kp / 2, d, 2] their layout buffers; s_full, hi_full, lo_full: [hh, Rp, >= Kp]
    C-contiguous; o_rows: [hh, Rp, >= d] C-contiguous, the running output; m, l, alpha:
    [hh, Rp]; the rest as ``softmax_block``'s."""
    keys_as_pairs(k, kt)
    values_as_pairs(v, vv)
    _fold_laid_out(qp, kt, vv, s_full, hi_full, lo_full, o_rows, m, l, alpha, nq, pos0, window,
                   scale, softcap, keys)


@njit(cache=True, nogil=True)
def fold_pages(qp, pool_k, pool_v, pages, h0, at, kt, vv, s_full, hi_full, lo_full, o_rows, m,
               l, alpha, nq, pos0, window, scale, softcap, keys):
    """``fold_block`` for a block of paged keys, laid out from the pool's pages in place of
    a gathered copy (``pages_as_pairs``): the block's ``keys`` keys start at row ``at`` of
    page ``pages[0]`` and run on through ``pages``; pool_k: [num_pages, Hkv, P, d / 2]
    uint32, pool_v: [num_pages, Hkv, P, d] uint16; KV heads h0 .. h0 + hh - 1."""
    pages_as_pairs(pool_k, pool_v, pages, h0, at, keys, kt, vv)
    _fold_laid_out(qp, kt, vv, s_full, hi_full, lo_full, o_rows, m, l, alpha, nq, pos0, window,
                   scale, softcap, keys)


@njit(cache=True, nogil=True)
def fold_codes(qp, kc, vc, ks, vs, lut, kt, vv, s_full, hi_full, lo_full, o_rows, m, l, alpha,
               nq, pos0, window, scale, softcap, keys):
    """``fold_block`` for 8-bit codes with per-token scales: the codes laid out as
    bfloat16 (``codes_as_pairs``: exact), then ``_fold_laid_out`` with the K scales (ks
    [hh, keys]) on the score columns and the V scales (vs [hh, keys]) on p: the
    dequantized K and V's products, each scale applied once per score instead of once
    per value."""
    codes_as_pairs(kc, vc, lut, kt, vv)
    _fold_laid_out(qp, kt, vv, s_full, hi_full, lo_full, o_rows, m, l, alpha, nq, pos0, window,
                   scale, softcap, keys, ks, vs)


@njit(cache=True, nogil=True)
def _fold_laid_out(qp, kt, vv, s_full, hi_full, lo_full, o_rows, m, l, alpha, nq, pos0, window,
                   scale, softcap, keys, ks=None, vs=None):
    """``fold_block`` once K and V are in the tiles' layouts (``kt``, ``vv``). ``ks``,
    ``vs``: None, or per-token scales [hh, keys] of codes: K's multiply the score columns
    before the soft-cap, V's each p before P's split (None compiles both out)."""
    hh, Rp, d = qp.shape
    Kp = kt.shape[2]
    s = s_full[:, :, :Kp]
    _tile_product(qp, qp, False, kt, s, False)
    if ks is not None:
        for h in range(hh):
            f = ks[h, :keys]
            for r in range(Rp):
                row = s_full[h, r, :keys]
                for j in range(keys):
                    row[j] *= f[j]
    if softcap > 0:  # scaled and soft-capped as the kernels' scores, before the mask
        c, x = np.float32(softcap), np.float32(scale)
        for h in range(hh):
            for r in range(Rp):
                row = s_full[h, r, :keys]
                for j in range(keys):
                    row[j] = score(row[j], x, c)
        scale = 1.0
    for h in range(hh):  # P into its two bfloat16 parts; columns from ``keys`` on: 0
        if vs is None:
            softmax_block(s_full[h], m[h], l[h], alpha[h], nq, pos0, window, scale, keys,
                          hi_full[h], lo_full[h])
        else:  # p into s, then times its value's scale, split as softmax_block splits
            empty = np.empty((0, 0), np.uint16)
            softmax_block(s_full[h], m[h], l[h], alpha[h], nq, pos0, window, scale, keys,
                          empty, empty)
            f = vs[h]
            for r in range(Rp):
                row, hi_row, lo_row = s_full[h, r], hi_full[h, r], lo_full[h, r]
                for j in range(keys):
                    hi_row[j], lo_row[j] = bfloat16_parts(row[j] * f[j])
                for j in range(keys, Kp):
                    hi_row[j] = 0
                    lo_row[j] = 0
    rescale_rows(o_rows, alpha, d)
    _tile_product(hi_full[:, :, :Kp], lo_full[:, :, :Kp], True, vv, o_rows[:, :, :d], True)


def _pools_in_place(reader, i: int, j0: int, j1: int):
    """(K pool as uint32 pairs, V pool as uint16) where ``reader`` reads a paged bfloat16
    store whose pools the layout step can read in place (C-contiguous) for keys j0..j1-1
    of entry i, else None (the reader's gathered blocks; also where a page id of those
    keys lies outside the pool: the layout step does not check, the reader raises)."""
    base = getattr(reader, "base", None)
    if not isinstance(base, Pages) or len(base.arrays) != 2:
        return None
    k, v = base.arrays
    if not (k.flags.c_contiguous and v.flags.c_contiguous and k.shape[-1] % 2 == 0):
        return None
    P = base.page_size
    pages = base.table[int(base.rows[i]), j0 // P:-(-j1 // P)]
    if pages.size and not (0 <= int(pages.min()) and int(pages.max()) < k.shape[0]):
        return None
    return k.view(np.uint16).view(np.uint32), v.view(np.uint16)


def _page_blocks(pages, P: int, j0: int, j1: int, keys: int):
    """``(js, je, the block's pages, its first key's row in the first page)`` over keys
    j0..j1-1 in the blocks ``numpy_readers.Pages.read`` makes (ending ``keys`` after the
    start of the page they start in), so the blocks and results are those of the
    gathered reads."""
    js = j0
    while js < j1:
        p0 = js // P
        je = min(j1, p0 * P + keys)
        yield js, je, pages[p0:-(-je // P)], js - p0 * P
        js = je


@functools.lru_cache(maxsize=None)
def _code_table(tag: str) -> np.ndarray:
    """[256] uint16: the bfloat16 bits of each 8-bit code's value (a code's uint8 bits as
    the index) for the codec tags ``int8`` and ``e4m3fn``."""
    bits = np.arange(256, dtype=np.uint8)
    values = (bits.view(np.int8).astype(np.float32) if tag == "int8"
              else bits.view(ml_dtypes.float8_e4m3fn).astype(np.float32))
    return (values.view(np.uint32) >> 16).astype(np.uint16)


def _code_values(reader):
    """The code table (``_code_table``) where ``reader`` reads int8 or float8_e4m3fn codes
    with per-token scales, else None."""
    if not isinstance(reader, Coded) or reader.codec.kernel_tag not in ("int8", "e4m3fn"):
        return None
    codes, _, scales, _ = reader.base.arrays
    if scales.ndim != codes.ndim - 1 or codes.dtype.itemsize != 1:
        return None
    return _code_table(reader.codec.kernel_tag)


def declines(q, reader, params, tree) -> str | None:
    """Why an item of this call does not run here (None: it does). The call's facts first:
    the first ``amx.why_not`` compiles the kernel."""
    if not (isinstance(reader, Plain) and reader.stored == BF16) and _code_values(reader) is None:
        return "bf16-product items need a plain bfloat16 cache, or int8 / e4m3 codes with per-token scales"
    if q.dtype != BF16 and not holds_bfloat16(q):
        return "bf16-product items need bfloat16 queries (or float32 queries holding bfloat16 values)"
    if q.shape[-1] % TILE_BLOCK:
        return f"bf16-product items need d a multiple of {TILE_BLOCK} (d = {q.shape[-1]})"
    if tree is not None or params.alibi_slopes is not None:
        return "draft trees and ALiBi take the float32 path"
    return amx.why_not()


_served = 0
_served_lock = threading.Lock()


def items_served() -> int:
    """Items ``attend_item`` has run on the bfloat16 products in this process (declined ones not
    counted): what ``gqakv selftest`` reports, through the backend's ``served_counts``."""
    return _served


def item_kernel(q, reader, params, trees):
    """``numpy_attention.attend``'s ``item_kernel``: ``attend_item`` where this call's
    items can run here (``declines``), else None."""
    return attend_item if declines(q, reader, params, trees) is None else None


def attend_item(q, reader, lens, n_new, item, *, params, score_block_elements: int, tiles,
                block_keys_fixed=None):
    """The online softmax of one item (``numpy_attention._attend_item``'s contract) on AMX
    tiles; returns its float32 ``SoftmaxState`` (o [hh, G * nq, d], m, l [hh, G * nq, 1]),
    an empty state when no key block was read, or None (declined: ``MIN_ITEM_WORK``).
    ``tiles``: the item's queries ``[hh, G * nq, d]`` (``numpy_attention.item_tiles``,
    unscaled): bfloat16, or float32 holding bfloat16 values. Call where ``declines`` says
    None."""
    i, h0, h1, t0, t1, j0, j1, _ = item
    hh, R, d = tiles.shape
    if hh * _round_up(R) * (j1 - j0) * d < MIN_ITEM_WORK:
        return None  # too small to pay for its layout steps and calls
    nq = t1 - t0
    L, n = int(lens[i]), int(n_new[i])
    Rp = _round_up(R)
    # rows of every buffer padded off multiples of 512 bytes (_pitch): tile loads and
    # stores of 16 rows a power of two apart would fall into a few L1 sets
    qp = _scratch("q", (hh, Rp, _pitch(d, 2)), np.uint16)[..., :d]
    # bfloat16 bits; float32 queries here hold bfloat16 values (``declines``): their top half
    qp[:, :R] = tiles.view(np.uint16) if tiles.dtype == BF16 else tiles.view(np.uint32) >> 16
    qp[:, R:] = 0
    keys = (max(MIN_BLOCK_KEYS, score_block_elements // (hh * R)) if block_keys_fixed is None
            else block_keys_fixed)
    m = np.full((hh, Rp), -np.inf, dtype=np.float32)
    l = np.zeros((hh, Rp), dtype=np.float32)
    alpha = np.empty((hh, Rp), dtype=np.float32)
    o_rows = _scratch("o", (hh, Rp, _pitch(d, 4)), np.float32)  # o: o_rows[..., :d]
    o_rows[...] = 0
    window = params.window or 0
    width = 0  # keys the block buffers hold
    seen = False
    lut = _code_values(reader)
    pools = None if lut is not None else _pools_in_place(reader, i, j0, j1)
    if lut is not None:  # codes and scales as stored (the tiles take the codes' values)
        base = reader.base
        keys = base.block_keys(_converted_keys(keys, score_block_elements, hh, d), hh, d)
        blocks = ((js, je, arrays[:2], arrays[2:])  # (K codes, V codes), (K scales, V scales)
                  for js, je, arrays in base.read(i, h0, h1, j0, j1, keys))
    elif pools is None:
        blocks = reader.blocks(i, h0, h1, j0, j1, keys=keys, acc=BF16,
                               block_elements=score_block_elements, d=d)
    else:  # paged: the pages' keys laid out straight from the pool (no gathered copy)
        base = reader.base
        keys = base.block_keys(keys, hh, d)
        blocks = _page_blocks(base.table[int(base.rows[i])], base.page_size, j0, j1, keys)
    for js, je, kb, vb in blocks:
        K = je - js
        Kp = _round_up(K)
        if Kp > width:  # the first block (or, rarely, a longer one): buffers for it
            width = max(Kp, _round_up(min(keys, j1 - j0)))
            w = _pitch(width, 4)
            s_full = _scratch("s", (hh, Rp, w), np.float32)
            hi_full = _scratch("hi", (hh, Rp, w), np.uint16)
            lo_full = _scratch("lo", (hh, Rp, w), np.uint16)
            kt_full = _scratch("k", (hh, d // 2, w, 2), np.uint16)
            vv_full = _scratch("v", (hh, width // 2, _pitch(d, 4), 2), np.uint16)
        kt = kt_full[:, :, :Kp].view(np.uint32)[..., 0]
        vv = vv_full[:, :Kp // 2, :d]
        if lut is not None:  # kb: the block's K and V codes, vb: their scales
            fold_codes(qp, kb[0].view(np.uint8), kb[1].view(np.uint8), vb[0], vb[1], lut, kt,
                       vv, s_full, hi_full, lo_full, o_rows, m, l, alpha, nq, L - n + t0 - js,
                       window, params.scale, params.softcap or 0.0, K)
        elif pools is None:
            fold_block(qp, kb.view(np.uint16).view(np.uint32), vb.view(np.uint16), kt, vv,
                       s_full, hi_full, lo_full, o_rows, m, l, alpha, nq, L - n + t0 - js, window,
                       params.scale, params.softcap or 0.0, K)
        else:  # kb: the block's pages, vb: where in the first page it starts
            fold_pages(qp, pools[0], pools[1], kb, h0, vb, kt, vv, s_full, hi_full, lo_full,
                       o_rows, m, l, alpha, nq, L - n + t0 - js, window, params.scale,
                       params.softcap or 0.0, K)
        seen = True
    global _served
    with _served_lock:
        _served += 1
    if not seen:
        return SoftmaxState(np)
    return SoftmaxState(np, m[:, :R, None].copy(), l[:, :R, None].copy(),
                        np.ascontiguousarray(o_rows[:, :R, :d]))

