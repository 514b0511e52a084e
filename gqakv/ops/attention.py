"""Grouped-query attention over the live part of a KVCache.

The generic implementation here is written once against the array API
(``xp = array_namespace(...)``) and serves NumPy, array-api-strict, CuPy's
non-fused fallback and any other array-API library.
"""

from __future__ import annotations

import math

from array_api_compat import array_namespace

from ..core.inputs import check_flag, check_outputs, validate_attention
from .cache_ops import entry_tokens
from .plan import AttentionPlan
from .merge import SoftmaxState, apply_sinks
from ..core.semantics import block_keys, key_positions, query_positions, transform, visible_mask

# Upper bound, in elements, of one block of attention scores [Hkv, G * q_block, k_block].
# It bounds the temporaries of a long prefill chunk (16 MiB of float32 by default)
# while letting a decode step cover a whole row in a single block.
SCORE_BLOCK_ELEMENTS = 1 << 22
QUERY_BLOCK = 256


def gqa_attention(q, cache, n_new, *, scale: float | None = None, window: int | None = None,
                  softcap: float | None = None, sinks=None, return_lse: bool = False,
                  rows=None, params=None, alibi_slopes=None, out=None, lse_out=None, tree=None):
    """Causal grouped-query attention of the newest tokens over a KVCache, optionally with
    a sliding window, a logit soft-cap, per-head sinks and ALiBi.

    Args:
        q: ``[B, Hq, T, d]`` queries of the tokens just appended, in the cache's dtype.
            ``Hq`` must be a multiple of ``Hkv``; with ``G = Hq // Hkv``, query head
            ``h`` reads KV head ``h // G`` (contiguous groups, as released GQA
            checkpoints lay them out). Repeated K/V is never materialized.
            Packed: ``[N, Hq, d]`` with ``N = sum(n_new)``, entry i's queries at rows
            ``offsets[i] .. offsets[i] + n_new[i] - 1`` (``offsets``: the exclusive
            cumulative sum of n_new, i.e. FlashAttention's ``cu_seqlens[:-1]``); no
            padding. out and lse are then ``[N, Hq, d]`` and ``[N, Hq]``.
        cache: the KVCache, *after* the append of these tokens (``lens`` post-append).
        n_new: ``[B]`` ints: entry i's real queries are ``q[i, :, :n_new[i]]``; slots
            ``t >= n_new[i]`` are padding and return exactly 0. Packed q: B is n_new's length.
        scale: softmax scale, default ``1 / sqrt(d)`` (a Python float).
        window: None, or W >= 1 (an int): query position p sees only keys
            ``max(0, p - W + 1) .. p``, the W most recent (transformers' ``sliding_window``);
            only those keys are read.
        softcap: None, or c > 0: each scaled score s becomes ``c * tanh(s / c)`` before the
            mask and the softmax (Gemma 2).
        sinks: None, or ``[Hq]`` real logits (array of any library or sequence; held as
            float32; -inf allowed): per query head an extra softmax term without a value,
            ``out = sum_j e^{s_j} v_j / (e^{sink_h} + sum_j e^{s_j})`` (gpt-oss).
        alibi_slopes: None, or ``[Hq]`` finite real slopes (array of any library or
            sequence; held as float32): ALiBi. Query head h at position p adds
            ``alibi_slopes[h] * (j - p)`` to its score of key j (after the soft-cap, before
            the mask; sinks get no bias). Positions are the cache's (0 = the row's first
            token), as BLOOM / MPT / Falcon-style checkpoints define them.
        tree: None, or a draft tree per entry (speculative decoding; ``gqakv.core.tree``):
            parents ``[B, T]`` ints (``-1 <= parents[i, t] < t``; -1: a child of the row's
            last cached token) or an ancestor mask ``[B, T, T]`` bools, of any library, or
            a ``gqakv.DraftTree``. Chunk query t then sees every key before the chunk and,
            of the chunk, only itself and its ancestors; windows and ALiBi measure logical
            positions (prefix + depth). Only ``t < n_new[i]`` is read.
        return_lse: (a bool) also return the natural-log log-sum-exp of the scores per
            query, ``[B, Hq, T]`` (float32, or float64 for float64 caches), ``-inf`` for
            padded queries, so partial results over disjoint key sets can be merged. With
            sinks it is the full denominator's ``log(e^{sink_h} + sum_j e^{s_j})``.
        rows: optional ``[B]`` cache rows read by each entry (default ``0..B-1``).
        params: optional ``gqakv.AttentionParams`` carrying scale, window, softcap,
            sinks and alibi_slopes instead of those keywords (not both; see ``gqakv.core.semantics``).
        out: optional ``[B, Hq, T, d]`` array of q's dtype (the cache's library and device)
            that receives the output and is returned; must not overlap q.
        lse_out: optional ``[B, Hq, T]`` float32 array (float64 for float64 caches) that
            receives the log-sum-exp (returned with ``return_lse``). Both are checked before
            anything is written.

    Mask (bottom-right causal, defined once in ``gqakv.core.semantics``): with ``L = lens[rows[i]]`` and ``n = n_new[i]``, query
    t sits at absolute position ``p = L - n + t`` and sees keys ``0..p``. For L = 6,
    n = 3 (x visible, . masked)::

                 keys 0 1 2 3 4 5
        query 0 (p=3)   x x x x . .
        query 1 (p=4)   x x x x x .
        query 2 (p=5)   x x x x x x

    Keys at or past ``L`` are never read, whatever the buffer holds there. With
    ``window=2`` the same call sees (query p: keys p-1 and p)::

                 keys 0 1 2 3 4 5
        query 0 (p=3)   . . x x . .
        query 1 (p=4)   . . . x x .
        query 2 (p=5)   . . . . x x

    A query that sees no key (a padded slot) returns exactly 0 (and lse -inf), with or
    without sinks.

    With ``tree=[[-1, 0, 0, 1]]`` (tokens 1 and 2 continue 0, token 3 continues 1) over
    L = 6, n = 4 (prefix keys 0 1)::

                 keys 0 1 | 2 3 4 5
        query 0 (depth 0)   x x | x . . .
        query 1 (depth 1)   x x | x x . .
        query 2 (depth 1)   x x | x . x .
        query 3 (depth 2)   x x | x x . x

    Returns:
        ``out`` ``[B, Hq, T, d]`` (packed: ``[N, Hq, d]``) in q's dtype, or ``(out, lse)``
        with ``return_lse``.
    """
    return_lse = check_flag(return_lse, "return_lse")
    inputs = validate_attention(cache, q, n_new, rows, scale, params,
                                window=window, softcap=softcap, sinks=sinks,
                                alibi_slopes=alibi_slopes, tree=tree)
    check_outputs(cache, inputs_shape(q), out, lse_out)
    # one plan, one run (gqakv.ops.plan): a step plans once and runs every layer
    return AttentionPlan(cache, inputs_shape(q), inputs).launch(q, cache.store, return_lse, out, lse_out)


def inputs_shape(q) -> tuple[int, ...]:
    """q's shape as Python ints: ``(B, Hq, T, d)``, packed ``(N, Hq, d)``."""
    return tuple(int(s) for s in q.shape)


def _compute_dtype(xp, dtype):
    """float64 stays float64; everything narrower accumulates in float32."""
    return xp.float64 if dtype == xp.float64 else xp.float32


def attention_array_api(q, store, inputs, params, *, return_lse: bool,
                        score_block_elements: int = SCORE_BLOCK_ELEMENTS,
                        query_block: int = QUERY_BLOCK):
    """Array-API attention over validated inputs; see ``gqa_attention`` for the semantics.

    q: [B, Hq, T, d], or packed [N, Hq, d] when ``inputs.offsets`` is set (then out is
    [N, Hq, d] and lse [N, Hq]); store: a KVStore without leading axes, read only through
    ``store.blocks`` (so any storage kind works here); inputs: ``AttentionInputs``
    (rows, lens, n_new: host int arrays [B]); params: ``AttentionParams``. Works one row
    at a time over the keys its queries see (``gqakv.core.semantics``), so work follows the
    sum of live lengths, and blocks over queries and keys with an online softmax
    (``gqakv.ops.merge.SoftmaxState``) so temporaries stay within ``score_block_elements``.
    Variants: scores are soft-capped and ALiBi-biased before the mask
    (``semantics.transform``), a window narrows the keys read (``semantics.block_keys``),
    and sinks join each row's result once, after all
    its keys (``gqakv.ops.merge.apply_sinks``).
    """
    rows, lens, n_new = inputs.rows, inputs.lens, inputs.n_new
    offsets = getattr(inputs, "offsets", None)  # packed q [N, Hq, d] when set
    if getattr(inputs, "invariant", False):
        # batch-invariant mode: each query its own tile, so its key range and key blocks
        # (score_block_elements // (Hkv * G) keys, from its first visible key, page-aligned
        # when paged) depend on its position alone, not on its chunk or batch
        query_block = 1
    xp = array_namespace(q)
    Hq, d = int(q.shape[1]), int(q.shape[-1])  # Hq is dim 1 in both layouts
    Hkv = store.kv_heads
    G = Hq // Hkv
    acc = _compute_dtype(xp, q.dtype)
    dev = getattr(q, "device", None)
    out = xp.zeros(tuple(q.shape), dtype=q.dtype, device=dev)
    lse = xp.full(tuple(q.shape[:-1]), -math.inf, dtype=acc, device=dev) if return_lse else None
    sinks = None if params.sinks is None else xp.asarray(params.sinks, dtype=acc, device=dev)
    for i in range(len(rows)):
        n, L = int(n_new[i]), int(lens[i])
        if n == 0:
            continue  # only padding: zeros (and -inf lse)
        # [Hq, n, d] -> [Hkv, G, n, d]: query head h = kv * G + g reads KV head kv = h // G.
        q_row = xp.reshape(xp.astype(entry_tokens(q, offsets, i, n), acc), (Hkv, G, n, d))
        o_row, lse_row = _attend_row(xp, q_row, store, int(rows[i]), L, params, acc=acc,
                                     score_block_elements=score_block_elements,
                                     query_block=query_block, tree=inputs.entry_tree(i)
                                     if hasattr(inputs, "entry_tree") else None)
        o_row, lse_row = xp.reshape(o_row, (Hq, n, d)), xp.reshape(lse_row, (Hq, n))
        if sinks is not None:  # once per query, after every key (never per key block)
            o_row, lse_row = apply_sinks(o_row, lse_row, sinks)
        if offsets is None:
            out[i, :, :n, :] = xp.astype(o_row, q.dtype)
            if lse is not None:  # return_lse
                lse[i, :, :n] = lse_row
        else:  # packed: entry i's rows of out [N, Hq, d] and lse [N, Hq]
            s = int(offsets[i])
            out[s:s + n, :, :] = xp.permute_dims(xp.astype(o_row, q.dtype), (1, 0, 2))
            if lse is not None:
                lse[s:s + n, :] = xp.matrix_transpose(lse_row)
    return (out, lse) if return_lse else out


def _attend_row(xp, q_row, store, row, L, params, *, acc, score_block_elements, query_block,
                tree=None):
    """One row: q_row [Hkv, G, n, d] (compute dtype), the row's last n queries of L tokens
    (``tree``: the entry's draft tree, ``gqakv.core.tree.EntryTree``).

    Query blocks read only the keys some query of theirs sees (``semantics.block_keys``),
    in key blocks from ``store.blocks``, masked by ``semantics.visible_mask``.
    Returns out [Hkv, G, n, d] and lse [Hkv, G, n], both in the compute dtype.
    """
    Hkv, G, n, d = (int(s) for s in q_row.shape)
    dev = getattr(q_row, "device", None)
    out = xp.empty((Hkv, G, n, d), dtype=acc, device=dev)
    lse = xp.empty((Hkv, G, n), dtype=acc, device=dev)
    q_block = max(1, min(n, query_block))
    neg_inf = xp.asarray(-math.inf, dtype=acc, device=dev)
    # The score hook's query heads [Hkv, G, 1, 1] (head h = kv * G + g), when it needs them.
    heads = (None if params.alibi_slopes is None else
             xp.reshape(xp.arange(Hkv * G, device=dev), (Hkv, G, 1, 1)))
    for t0 in range(0, n, q_block):
        t1 = min(n, t0 + q_block)
        nq = t1 - t0
        # Fold the group into the query tile: one matmul per KV head serves all G heads.
        qb = xp.reshape(q_row[:, :, t0:t1, :], (Hkv, G * nq, d)) * params.scale
        lo, hi = block_keys(params, L, n, t0, t1, tree)
        k_block = max(1, score_block_elements // max(1, Hkv * G * nq))
        state = SoftmaxState(xp)
        for j0, j1 in store.key_blocks(row, lo, hi, k_block):  # page-aligned when paged
            kb, vb = store.blocks(row, j0, j1)
            if kb.dtype != acc:
                kb, vb = xp.astype(kb, acc), xp.astype(vb, acc)
            s = qb @ xp.matrix_transpose(kb)  # [Hkv, G*nq, j1-j0]
            if heads is None:  # the soft-cap (if any), before the mask
                s = transform(params, s, 0, 0, 0, xp)
            else:  # positions matter: [Hkv, G, nq, keys]
                q_pos = xp.reshape(_positions(xp, query_positions(L, n, t0, t1, tree), dev),
                                   (1, 1, nq, 1))
                k_pos = xp.reshape(_positions(xp, key_positions(L, n, j0, j1, tree), dev),
                                   (1, 1, 1, j1 - j0))
                s4 = transform(params, xp.reshape(s, (Hkv, G, nq, j1 - j0)), q_pos, k_pos, heads, xp)
                s = xp.reshape(s4, (Hkv, G * nq, j1 - j0))
            visible = visible_mask(params, L, n, t0, t1, j0, j1, xp=xp, device=dev, tree=tree)
            if visible is not None:  # [nq, j1-j0]
                s = xp.reshape(xp.where(visible, xp.reshape(s, (Hkv, G, nq, j1 - j0)), neg_inf),
                               (Hkv, G * nq, j1 - j0))
            state.add(s, vb)
        if state.m is None:  # no query of the block sees any key
            empty_o = xp.zeros((Hkv, G * nq, d), dtype=acc, device=dev)
            o_b, lse_b = empty_o, xp.full((Hkv, G * nq, 1), -math.inf, dtype=acc, device=dev)
        else:
            o_b, lse_b = state.result()
        out[:, :, t0:t1, :] = xp.reshape(o_b, (Hkv, G, nq, d))
        lse[:, :, t0:t1] = xp.reshape(lse_b, (Hkv, G, nq))
    return out, lse


def _positions(xp, host, dev):
    """Host int64 positions (``semantics.query_positions`` / ``key_positions``) as an
    ``xp`` int64 array on ``dev``."""
    return xp.asarray(host.tolist(), dtype=xp.int64, device=dev)
