"""NumPy attention over a paged cache: the BLAS path of ``numpy_attention`` (same work
items, threads, key splits and merge) with a per-item kernel that reads K/V through the
row's page table.

Each item walks its keys in blocks that end at page boundaries. A block inside one page
is a view of the pool (``k_pool[page, h0:h1, a:b]``); a block over several pages is
gathered page by page into a reused buffer ``[hh, keys, d]`` whose size is bounded
(``GATHER_ELEMENTS``, about 1 MiB of float32 for K and as much for V: it stays in a
core's cache while the matmuls read it), never a row. Pages hold ``page_size`` tokens of
every KV head, heads-major, so each page's copy is ``hh`` runs of ``page_size x d``
contiguous values. (``np.take`` on the pool's head-sliced view would first copy the
whole pool into a contiguous array, and fancy indexing runs element loops: both were
measured slower than one slice assignment per page.)
"""

from __future__ import annotations

import functools

import numpy as np

from gqakv.ops.merge import SoftmaxState

from .numpy_attention import attention_numpy, fold_block, item_queries, to_float32

#: Most K values (heads x keys x d) one gathered block holds.
GATHER_ELEMENTS = 1 << 18


def _attend_item_paged(q, k_pool, v_pool, rows, lens, n_new, item, *, params, acc,
                       score_block_elements, table, page_size):
    """``numpy_attention._attend_item`` over the pool ``k_pool``/``v_pool``
    ``[num_pages, Hkv, P, d]`` and the page table ``table`` ``[B, pages_per_row]``;
    returns the item's SoftmaxState."""
    i, h0, h1, t0, t1, j0, j1, _ = item
    Hq, d = q.shape[1], q.shape[3]
    G = Hq // k_pool.shape[1]
    hh, nq = h1 - h0, t1 - t0
    r, L, n = int(rows[i]), int(lens[i]), int(n_new[i])
    P = page_size
    pages = table[r]
    qb = item_queries(q, item, G, params, acc)
    kp = k_pool[:, h0:h1].transpose(1, 0, 2, 3)  # [hh, num_pages, P, d] views
    vp = v_pool[:, h0:h1].transpose(1, 0, 2, 3)
    kb_len = max(16, score_block_elements // (hh * G * nq))
    kb_len = min(kb_len, max(16, GATHER_ELEMENTS // (hh * d)))
    kb_len = max(P, kb_len // P * P)  # whole pages
    # a block spanning two pages needs the buffer, even a short one: a window (or a key
    # piece) can start the item's keys inside a page
    gather = kb_len > P and (j1 - 1) // P > j0 // P
    if gather:
        per = kb_len // P
        kbuf = np.empty((hh, per, P, d), dtype=k_pool.dtype)
        vbuf = np.empty_like(kbuf)
    cast = k_pool.dtype != acc
    if cast:
        k32 = np.empty((hh, min(kb_len, j1 - j0), d), dtype=acc)
        v32 = np.empty_like(k32)
    state = SoftmaxState(np)
    js = j0
    while js < j1:
        p0 = js // P
        je = min(j1, p0 * P + kb_len)
        p1 = -(-je // P)
        a, b = js - p0 * P, je - p0 * P
        if p1 - p0 == 1:
            kb, vb = kp[:, pages[p0], a:b], vp[:, pages[p0], a:b]
        else:  # whole pages into the buffer, one slice assignment per page
            for j, page in enumerate(pages[p0:p1]):
                kbuf[:, j] = kp[:, page]
                vbuf[:, j] = vp[:, page]
            kb = kbuf.reshape(hh, -1, d)[:, a:b]
            vb = vbuf.reshape(hh, -1, d)[:, a:b]
        if cast:
            kb = to_float32(kb, k32[:, :je - js])
            vb = to_float32(vb, v32[:, :je - js])
        fold_block(state, qb, kb, vb, params=params, L=L, n=n, t0=t0, t1=t1, js=js, je=je)
        js = je
    return state


def attention_numpy_paged(q, store, inputs, params, *, return_lse: bool, **blocking):
    """Attention of ``q`` [B, Hq, T, d] over a paged store (no leading axes); see
    ``gqakv.gqa_attention``. ``blocking``: ``attention_numpy``'s keywords."""
    item = functools.partial(_attend_item_paged, table=store.table.table,
                             page_size=store.page_size)
    return attention_numpy(q, store.k, store.v, inputs.rows, inputs.lens, inputs.n_new,
                           scale=params.scale, return_lse=return_lse, params=params,
                           attend_item=item, **blocking)
