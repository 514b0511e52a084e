"""Block readers of the NumPy item kernel: where one item's K/V key blocks come from.

``numpy_attention``'s item kernel walks an item's keys ``j0..j1`` in blocks and asks a
*value reader* for each block's K and V as ``[hh, keys, d]`` arrays in the compute dtype.
Readers compose in two layers, so every (layout, codec) pair is one base reader and one
value reader, never a kernel of its own:

- a *base reader* knows the layout: which positions of which stored arrays hold tokens
  ``js..je-1`` of KV heads ``h0:h1`` of batch entry i. It reads any arrays of the store
  that share the token layout (K and V ``[..., d]``, and a codec's per-token scales
  ``[...]``, one value per token) from the same positions, so a value reader never knows
  the layout:
  ``Rows`` (contiguous rows ``[rows, Hkv, max_len, *tail]``: every block a view) and
  ``Pages`` (a pool ``[num_pages, Hkv, page_size, *tail]`` read through the row's page
  table: a block inside one page is a view, a block over several pages is gathered page
  by page into a reused buffer of at most ``GATHER_ELEMENTS``);
- a *value reader* knows the codec: ``Plain`` hands the stored K/V on (float16/bfloat16
  cast into reused float32 buffers, ``to_float32``); ``Coded`` (codes
  plus per-token scales) dequantizes the codes of each block with the scales of the same
  positions through the store's codec (``Codec.dequantize_into``, into reused float32
  buffers), whatever the base reader.

Memory: each item holds at most one converted block of K and one of V (and, paged, one
gathered block of each stored array), never a copy of a row.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from gqakv.storage.store import CONTIGUOUS, PAGED

#: Most K values (heads x keys x d) one gathered paged block holds (1 MiB of float32).
GATHER_ELEMENTS = 1 << 18
#: Fewest keys a block holds (so a tiny budget still makes progress in useful steps).
MIN_BLOCK_KEYS = 16


# -- base readers: the layout ---------------------------------------------------------------

class Rows:
    """Contiguous rows: ``arrays`` each ``[rows_total, Hkv, max_len, *tail]``; batch entry
    i reads row ``rows[i]``. Every block is a view."""

    def __init__(self, arrays, rows):
        self.arrays = tuple(arrays)
        self.rows = rows

    def block_keys(self, keys: int, hh: int, d: int) -> int:
        """The keys per block this layout reads for a request of ``keys``."""
        return keys

    def read(self, i: int, h0: int, h1: int, j0: int, j1: int, keys: int
             ) -> Iterator[tuple[int, int, tuple]]:
        """``(js, je, blocks)`` covering keys ``j0..j1-1`` in order, ``blocks`` one
        ``[h1 - h0, je - js, *tail]`` array per stored array (valid until the next step)."""
        r = int(self.rows[i])
        views = [a[r, h0:h1] for a in self.arrays]  # [hh, max_len, *tail]
        for js in range(j0, j1, keys):
            je = min(j1, js + keys)
            yield js, je, tuple(v[:, js:je] for v in views)


class Pages:
    """Paged storage: ``arrays`` each a pool ``[num_pages, Hkv, page_size, *tail]``,
    ``table`` ``[rows, pages_per_row]`` (batch entry i reads row ``rows[i]``'s pages).

    Blocks end at page boundaries and hold whole pages. Pages hold ``page_size`` tokens of
    every KV head, heads-major, so a page's copy into the gather buffer is ``hh`` runs of
    ``page_size x tail`` contiguous values. (``np.take`` on the pool's head-sliced view
    would first copy the whole pool into a contiguous array, and fancy indexing runs
    element loops: both were measured slower than one slice assignment per page.)
    """

    def __init__(self, arrays, rows, table, page_size: int, gather=None):
        self.arrays = tuple(arrays)
        self.rows = rows
        self.table = table
        self.page_size = int(page_size)
        #: ``gather(pool, pages, h0, h1, buf) -> bool``: a faster copy of the listed pages'
        #: heads h0:h1 into buf[:, :len(pages)] (True when done; False: the loop here does it)
        self.gather = gather

    def block_keys(self, keys: int, hh: int, d: int) -> int:
        P = self.page_size
        keys = min(keys, max(MIN_BLOCK_KEYS, GATHER_ELEMENTS // (hh * d)))
        return max(P, keys // P * P)  # whole pages

    def read(self, i: int, h0: int, h1: int, j0: int, j1: int, keys: int
             ) -> Iterator[tuple[int, int, tuple]]:
        P = self.page_size
        pages = self.table[int(self.rows[i])]
        hh = h1 - h0
        views = [np.swapaxes(a[:, h0:h1], 0, 1) for a in self.arrays]  # [hh, num_pages, P, *tail]
        # a block spanning two pages needs the buffers, even a short one: a window (or a
        # key piece) can start the item's keys inside a page
        bufs = None
        if keys > P and (j1 - 1) // P > j0 // P:
            # no more pages than the item's keys span: a short row's buffers stay small (a
            # 1 MiB one per call cost its allocation's page faults, 50 us a read)
            spanned = -(-(j1 - j0 // P * P) // P)
            bufs = [np.empty((hh, min(keys // P, spanned), *v.shape[2:]), dtype=v.dtype)
                    for v in views]
        js = j0
        while js < j1:
            p0 = js // P
            je = min(j1, p0 * P + keys)
            p1 = -(-je // P)
            a, b = js - p0 * P, je - p0 * P
            if p1 - p0 == 1:
                page = pages[p0]
                blocks = tuple(v[:, page, a:b] for v in views)
            else:  # whole pages into the buffers, one slice assignment per page
                assert bufs is not None
                for buf, v, pool in zip(bufs, views, self.arrays):
                    if self.gather is None or not self.gather(pool, pages[p0:p1], h0, h1, buf):
                        for j, page in enumerate(pages[p0:p1]):
                            buf[:, j] = v[:, page]
                blocks = tuple(buf.reshape(hh, -1, *buf.shape[3:])[:, a:b] for buf in bufs)
            yield js, je, blocks
            js = je


# -- value readers: the codec ---------------------------------------------------------------

def to_float32(x, out):
    """Cast a float16/bfloat16 block into the float32 array ``out`` (same shape); returns out.

    NumPy's own float16 -> float32 cast is scalar code (about 1 GB/s here, slower than
    the attention itself), so float16 goes through its bits: sign-extend to int32,
    shift the exponent and mantissa into float32 position, clear the three sign copies
    that land in the exponent, and rescale by 2**112 (the exponent bias difference;
    exact for normal and subnormal values alike). Half-precision inf/NaN would come out
    as finite values of magnitude >= 2**16, larger than any finite half (65504), so a
    block holding one is cast again the exact, slow way. bfloat16 (ml_dtypes) casts fast.
    """
    if x.dtype != np.float16:
        np.copyto(out, x, casting="unsafe")
        return out
    bits = out.view(np.int32)
    np.copyto(bits, x.view(np.int16), casting="unsafe")  # sign-extends
    np.left_shift(bits, 13, out=bits)
    np.bitwise_and(bits, np.int32(-0x70000001), out=bits)  # keep bit 31, clear bits 28..30
    np.multiply(out, np.float32(2.0**112), out=out)
    if out.size and not (out.max() < 65536.0 and out.min() > -65536.0):
        np.copyto(out, x, casting="unsafe")  # inf or NaN inside: exact cast
    return out


def _converted_keys(keys: int, block_elements: int, hh: int, d: int) -> int:
    """Keys per block when each block is converted into a buffer of its own: at most
    ``block_elements`` values of K (and as many of V)."""
    return min(keys, max(MIN_BLOCK_KEYS, block_elements // (hh * d)))


class Plain:
    """Values stored as themselves (``base``'s arrays: K and V); float16/bfloat16 blocks
    cast into reused compute-dtype buffers, by ``widen(block, out) -> out`` where given
    (a backend's faster cast, the same values; it may decline by returning None), else by
    ``to_float32``."""

    def __init__(self, base, widen=None):
        self.base = base
        self.widen = widen
        self.stored = base.arrays[0].dtype
        self.kv_heads = int(base.arrays[0].shape[1])

    def blocks(self, i: int, h0: int, h1: int, j0: int, j1: int, *, keys: int, acc,
               block_elements: int, d: int) -> Iterator[tuple[int, int, np.ndarray, np.ndarray]]:
        """``(js, je, kb, vb)`` covering keys ``j0..j1-1``: ``[h1 - h0, je - js, d]`` in
        ``acc`` (views of storage where nothing is converted)."""
        hh = h1 - h0
        cast = self.stored != acc
        if cast:
            keys = _converted_keys(keys, block_elements, hh, d)
        keys = self.base.block_keys(keys, hh, d)
        if not cast:
            for js, je, (kb, vb) in self.base.read(i, h0, h1, j0, j1, keys):
                yield js, je, kb, vb
            return
        k32 = np.empty((hh, min(keys, j1 - j0), d), dtype=acc)
        v32 = np.empty_like(k32)
        widen = self.widen

        def to_acc(x, out):
            done = None if widen is None else widen(x, out)
            return to_float32(x, out) if done is None else done

        for js, je, (kb, vb) in self.base.read(i, h0, h1, j0, j1, keys):
            yield js, je, to_acc(kb, k32[:, :je - js]), to_acc(vb, v32[:, :je - js])


class Coded:
    """Codes plus per-token scales (``base``'s arrays: K codes, V codes, K scales, V
    scales, one base reader for all four, so the scales come from the codes' positions),
    dequantized through ``codec`` into reused float32 buffers, or by ``dequantize(codec,
    codes, scales, out) -> out`` where given (a backend's faster pass, the same values; it
    may decline by returning None)."""

    def __init__(self, base, codec, dequantize=None):
        self.base = base
        self.codec = codec
        self.dequantize = dequantize
        self.kv_heads = int(base.arrays[0].shape[1])

    def blocks(self, i: int, h0: int, h1: int, j0: int, j1: int, *, keys: int, acc,
               block_elements: int, d: int) -> Iterator[tuple[int, int, np.ndarray, np.ndarray]]:
        """As ``Plain.blocks``; the blocks are float32 (the codec's dequantized values)."""
        hh = h1 - h0
        keys = self.base.block_keys(_converted_keys(keys, block_elements, hh, d), hh, d)
        k32 = np.empty((hh, min(keys, j1 - j0), d), dtype=np.float32)
        v32 = np.empty_like(k32)
        codec, fast = self.codec, self.dequantize

        def into(codes, scales, out):
            done = None if fast is None else fast(codec, codes, scales, out)
            return codec.dequantize_into(codes, scales, out) if done is None else done

        for js, je, (kc, vc, ks, vs) in self.base.read(i, h0, h1, j0, j1, keys):
            yield js, je, into(kc, ks, k32[:, :je - js]), into(vc, vs, v32[:, :je - js])


# -- a store's reader -------------------------------------------------------------------------

def _rows(store, arrays, rows, gather=None):
    return Rows(arrays, rows)


def _pages(store, arrays, rows, gather=None):
    return Pages(arrays, rows, store.page_table.entries, store.page_size, gather)


#: The base reader of each storage layout (``KVStore.kind``) the NumPy kernel reads.
BASE_READERS = {CONTIGUOUS: _rows, PAGED: _pages}


def reader_of(store, rows, gather=None, widen=None, dequantize=None):
    """The value reader of a KVStore without leading axes (of a layout in
    ``BASE_READERS``) for batch entries reading rows ``rows`` [B]: ``Coded`` over the
    layout's base reader of codes and scales when the codec stores scales, else
    ``Plain`` over K and V. ``gather``: a paged reader's faster page copy (``Pages``);
    ``widen``: a faster float16/bfloat16 -> float32 block cast (``Plain``);
    ``dequantize``: a faster dequantization of code blocks (``Coded``)."""
    base = BASE_READERS[store.kind]
    codec = store.spec.codec
    if codec.scaled:
        return Coded(base(store, (store.k, store.v, store.k_scale, store.v_scale), rows, gather), codec,
                     dequantize)
    return Plain(base(store, (store.k, store.v), rows, gather), widen)
