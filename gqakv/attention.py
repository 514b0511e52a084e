"""Grouped-query attention over the live part of a KVCache.

The generic implementation here is written once against the array API
(``xp = array_namespace(...)``) and serves NumPy, array-api-strict, CuPy's
non-fused fallback and any other array-API library.
"""

from __future__ import annotations

import math

from array_api_compat import array_namespace

from .inputs import check_flag, validate_attention

# Upper bound, in elements, of one block of attention scores [Hkv, G * q_block, k_block].
# It bounds the temporaries of a long prefill chunk (16 MiB of float32 by default)
# while letting a decode step cover a whole row in a single block.
SCORE_BLOCK_ELEMENTS = 1 << 22
QUERY_BLOCK = 256


def gqa_attention(q, cache, n_new, *, scale: float | None = None, return_lse: bool = False,
                  rows=None):
    """Causal grouped-query attention of the newest tokens over a KVCache.

    Args:
        q: ``[B, Hq, T, d]`` queries of the tokens just appended, in the cache's dtype.
            ``Hq`` must be a multiple of ``Hkv``; with ``G = Hq // Hkv``, query head
            ``h`` reads KV head ``h // G`` (contiguous groups, as released GQA
            checkpoints lay them out). Repeated K/V is never materialized.
        cache: the KVCache, *after* the append of these tokens (``lens`` post-append).
        n_new: ``[B]`` ints: entry i's real queries are ``q[i, :, :n_new[i]]``; slots
            ``t >= n_new[i]`` are padding and return exactly 0.
        scale: softmax scale, default ``1 / sqrt(d)`` (a Python float).
        return_lse: (a bool) also return the natural-log log-sum-exp of the scaled scores per
            query, ``[B, Hq, T]`` (float32, or float64 for float64 caches), ``-inf`` for
            padded queries, so partial results over disjoint key sets can be merged.
        rows: optional ``[B]`` cache rows read by each entry (default ``0..B-1``).

    Mask (bottom-right causal): with ``L = lens[rows[i]]`` and ``n = n_new[i]``, query
    t sits at absolute position ``p = L - n + t`` and sees keys ``0..p``. For L = 6,
    n = 3 (x visible, . masked)::

                 keys 0 1 2 3 4 5
        query 0 (p=3)   x x x x . .
        query 1 (p=4)   x x x x x .
        query 2 (p=5)   x x x x x x

    Keys at or past ``L`` are never read, whatever the buffer holds there.

    Returns:
        ``out`` ``[B, Hq, T, d]`` in q's dtype, or ``(out, lse)`` with ``return_lse``.
    """
    return_lse = check_flag(return_lse, "return_lse")
    inputs = validate_attention(cache, q, n_new, rows, scale)
    return cache.backend.attention(q, cache.k, cache.v, inputs.rows, inputs.lens, inputs.n_new,
                                   scale=inputs.scale, return_lse=return_lse)


def _compute_dtype(xp, dtype):
    """float64 stays float64; everything narrower accumulates in float32."""
    return xp.float64 if dtype == xp.float64 else xp.float32


def attention_array_api(q, k_buf, v_buf, rows, lens, n_new, *, scale: float, return_lse: bool,
                        score_block_elements: int = SCORE_BLOCK_ELEMENTS,
                        query_block: int = QUERY_BLOCK):
    """Array-API attention over validated inputs; see ``gqa_attention`` for the semantics.

    q: [B, Hq, T, d]; k_buf, v_buf: [rows_total, Hkv, max_len, d]; rows, lens, n_new:
    host int arrays [B]. Works one row at a time on views sliced to the live length, so
    work follows the sum of live lengths, and blocks over queries and keys with an
    online softmax so temporaries stay within ``score_block_elements``.
    """
    xp = array_namespace(q, k_buf)
    B, Hq, T, d = (int(s) for s in q.shape)
    Hkv = int(k_buf.shape[1])
    G = Hq // Hkv
    acc = _compute_dtype(xp, q.dtype)
    dev = getattr(q, "device", None)
    out = xp.zeros((B, Hq, T, d), dtype=q.dtype, device=dev)
    lse = xp.full((B, Hq, T), -math.inf, dtype=acc, device=dev) if return_lse else None
    for i in range(B):
        n, L = int(n_new[i]), int(lens[i])
        if n == 0:
            continue  # only padding: zeros (and -inf lse)
        r = int(rows[i])
        # [Hq, n, d] -> [Hkv, G, n, d]: query head h = kv * G + g reads KV head kv = h // G.
        q_row = xp.reshape(xp.astype(q[i, :, :n, :], acc), (Hkv, G, n, d))
        o_row, lse_row = _attend_row(xp, q_row, k_buf[r, :, :L, :], v_buf[r, :, :L, :],
                                     start=L - n, scale=scale, acc=acc,
                                     score_block_elements=score_block_elements,
                                     query_block=query_block)
        out[i, :, :n, :] = xp.astype(xp.reshape(o_row, (Hq, n, d)), q.dtype)
        if return_lse:
            lse[i, :, :n] = xp.reshape(lse_row, (Hq, n))
    return (out, lse) if return_lse else out


def _attend_row(xp, q_row, k_row, v_row, *, start, scale, acc, score_block_elements, query_block):
    """One row: q_row [Hkv, G, n, d] (compute dtype), k_row, v_row [Hkv, L, d] views.

    Query t is at absolute position start + t and sees keys 0..start + t.
    Returns out [Hkv, G, n, d] and lse [Hkv, G, n], both in the compute dtype.
    """
    Hkv, G, n, d = (int(s) for s in q_row.shape)
    dev = getattr(q_row, "device", None)
    out = xp.empty((Hkv, G, n, d), dtype=acc, device=dev)
    lse = xp.empty((Hkv, G, n), dtype=acc, device=dev)
    q_block = max(1, min(n, query_block))
    neg_inf = xp.asarray(-math.inf, dtype=acc, device=dev)
    for t0 in range(0, n, q_block):
        t1 = min(n, t0 + q_block)
        nq = t1 - t0
        # Fold the group into the query tile: one matmul per KV head serves all G heads.
        qb = xp.reshape(q_row[:, :, t0:t1, :], (Hkv, G * nq, d)) * scale
        visible_end = start + t1  # keys past the block's last query are never looked at
        k_block = max(1, score_block_elements // max(1, Hkv * G * nq))
        m = l = o = None  # online-softmax state: running max, sum of exp, weighted values
        for j0 in range(0, visible_end, k_block):
            j1 = min(visible_end, j0 + k_block)
            kb = k_row[:, j0:j1, :]
            vb = v_row[:, j0:j1, :]
            if kb.dtype != acc:
                kb, vb = xp.astype(kb, acc), xp.astype(vb, acc)
            s = qb @ xp.matrix_transpose(kb)  # [Hkv, G*nq, j1-j0]
            if j1 - 1 > start + t0:  # the block reaches past the first query's position
                key_pos = xp.arange(j0, j1, device=dev)
                query_pos = xp.arange(start + t0, start + t1, device=dev)
                visible = key_pos[None, :] <= query_pos[:, None]  # [nq, j1-j0]
                s = xp.reshape(xp.where(visible, xp.reshape(s, (Hkv, G, nq, j1 - j0)), neg_inf),
                               (Hkv, G * nq, j1 - j0))
            # Every query sees key 0, so the row max is finite after the first block.
            s_max = xp.max(s, axis=-1, keepdims=True)
            if m is None:
                m = s_max
                p = xp.exp(s - m)
                l = xp.sum(p, axis=-1, keepdims=True)
                o = p @ vb
            else:
                m_new = xp.maximum(m, s_max)
                alpha = xp.exp(m - m_new)
                p = xp.exp(s - m_new)
                l = alpha * l + xp.sum(p, axis=-1, keepdims=True)
                o = alpha * o + p @ vb
                m = m_new
        out[:, :, t0:t1, :] = xp.reshape(o / l, (Hkv, G, nq, d))
        lse[:, :, t0:t1] = xp.reshape(m + xp.log(l), (Hkv, G, nq))
    return out, lse
