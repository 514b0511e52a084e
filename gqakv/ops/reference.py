"""Reference attention for ``gqakv selftest``: float64, one query at a time, from the definition.

Written apart from the library's attention code (no blocking, no online softmax, no
backend): for every batch entry, query token and query head, take KV head ``h // G`` and the
keys ``gqakv.core.semantics.key_range`` gives (``0..p`` with ``p = L - n + t`` for plain causal
attention, ``max(0, p - W + 1)..p`` with a window; taken from that one definition so a
variant reaches the self-test too), soft-cap the scaled scores (``c * tanh(s / c)``), and
do the softmax in float64 with the head's sink logit as one more denominator term that
carries no value. Only the sum over keys is vectorized. The test suite's
``tests/support/reference.py`` shares nothing with the library, not even the key rule (it loops
over keys); the two are checked against each other in tests/test_selftest.py.

``naive_low_precision`` is the same computation done the plain way in a narrow dtype, every
intermediate rounded to it: its error against the reference is the yardstick of the
FlashAttention-style tolerance ``err <= k * err_naive + eps`` (``gqakv.tools.selftest``).
"""

from __future__ import annotations

import math

import numpy as np

from ..core.semantics import AttentionParams, key_positions, key_range, query_positions, tree_visible


def _trees(tree, n_new):
    """Each entry's ``EntryTree`` (None per entry without a ``tree``)."""
    if tree is None:
        return [None] * len(n_new)
    from ..core.tree import DraftTree

    t = DraftTree.of(tree, n_new)
    return [t.entry(b) for b in range(len(n_new))]


def _params(scale, window, softcap, sinks, alibi_slopes=None) -> AttentionParams:
    return AttentionParams(scale=float(scale), window=window, softcap=softcap,
                           sinks=None if sinks is None else tuple(float(x) for x in sinks),
                           alibi_slopes=None if alibi_slopes is None else
                           tuple(float(x) for x in alibi_slopes))


def reference_attention(q, k_rows, v_rows, n_new, scale=None, *, window=None, softcap=None,
                        sinks=None, alibi_slopes=None, tree=None):
    """q: [B, Hq, T, d]; k_rows[b], v_rows[b]: [Hkv, L_b, d] live tokens of row b;
    window, softcap, sinks ([Hq] logits), alibi_slopes ([Hq] slopes): the variant, as
    ``gqakv.AttentionParams`` holds it; tree: None or the entries' draft trees
    (``gqakv.core.tree``: query t sees the keys ``semantics.tree_visible`` gives, ALiBi over
    logical positions).

    Returns out [B, Hq, T, d] and lse [B, Hq, T], float64 (lse of the whole denominator,
    sink included); padded queries (t >= n_new[b]) give out = 0 and lse = -inf.
    """
    q = np.asarray(q, dtype=np.float64)
    B, Hq, T, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    params = _params(scale, window, softcap, sinks, alibi_slopes)
    out = np.zeros((B, Hq, T, d))
    lse = np.full((B, Hq, T), -math.inf)
    trees = _trees(tree, n_new)
    for b in range(B):
        k = np.asarray(k_rows[b], dtype=np.float64)
        v = np.asarray(v_rows[b], dtype=np.float64)
        Hkv, L, _ = k.shape
        G = Hq // Hkv
        n = int(n_new[b])
        for t in range(n):
            if trees[b] is None:
                lo, hi = key_range(params, L, n, t)  # the keys query t sees (gqakv.core.semantics)
                seen = np.arange(lo, hi)
            else:
                seen = np.flatnonzero(tree_visible(params, L, n, t, t + 1, 0, L, trees[b])[0])
            k_pos = key_positions(L, n, 0, L, trees[b])[seen]
            q_pos = int(query_positions(L, n, t, t + 1, trees[b])[0])
            for h in range(Hq):
                keys, values = k[h // G, seen], v[h // G, seen]  # [keys seen, d]
                scores = scale * (keys @ q[b, h, t])  # [keys seen]
                if softcap is not None:
                    scores = softcap * np.tanh(scores / softcap)
                if alibi_slopes is not None:  # after the soft-cap: slope x (key position - p)
                    scores = scores + float(alibi_slopes[h]) * (k_pos - q_pos)
                sink = -math.inf if sinks is None else float(sinks[h])
                m = max(scores.max(), sink)
                w = np.exp(scores - m)
                total = w.sum() + math.exp(sink - m)  # the sink: a term without a value
                out[b, h, t] = (w @ values) / total
                lse[b, h, t] = m + math.log(total)
    return out, lse


def naive_low_precision(q, k_rows, v_rows, n_new, round_to, scale=None, *, window=None,
                        softcap=None, sinks=None, alibi_slopes=None, tree=None):
    """The same attention computed plainly with every intermediate rounded by ``round_to``
    (a function float32 array -> float32 array holding the nearest narrow-dtype values):
    scores, their soft-cap, their max, exp, the sum (sink term included), P @ V and the
    division are each rounded once, the dot products accumulate in float32 (as hardware
    matmuls do). Same shapes as ``reference_attention``; padded queries give 0 and -inf."""
    q = np.asarray(q, dtype=np.float32)
    B, Hq, T, d = q.shape
    scale = np.float32(1.0 / math.sqrt(d) if scale is None else scale)
    params = _params(scale, window, softcap, sinks, alibi_slopes)
    out = np.zeros((B, Hq, T, d), dtype=np.float32)
    lse = np.full((B, Hq, T), -np.inf, dtype=np.float32)
    trees = _trees(tree, n_new)
    for b in range(B):
        k = np.asarray(k_rows[b], dtype=np.float32)
        v = np.asarray(v_rows[b], dtype=np.float32)
        Hkv, L, _ = k.shape
        G = Hq // Hkv
        n = int(n_new[b])
        if n == 0:
            continue
        qb = q[b, :, :n].reshape(Hkv, G * n, d)  # query head h reads KV head h // G
        s = round_to(round_to(qb @ k.swapaxes(1, 2)) * scale)  # [Hkv, G * n, L]
        if softcap is not None:
            c = np.float32(softcap)
            s = round_to(np.tanh(round_to(s / c)) * c)
        if alibi_slopes is not None:  # [Hkv, G * n, L]: head kv * G + g, query t at L - n + t
            slopes = np.repeat(np.asarray(alibi_slopes, np.float32).reshape(Hkv, G), n, axis=1)[..., None]
            dist = (key_positions(L, n, 0, L, trees[b])[None, :]
                    - query_positions(L, n, 0, n, trees[b])[:, None]).astype(np.float32)
            s = round_to(s + round_to(slopes * np.tile(dist, (G, 1))[None]))
        if trees[b] is None:
            lo, hi = key_range(params, L, n, np.arange(n))  # [n]
            keys = np.arange(L)[:, None]
            seen = (keys >= lo) & (keys < hi[None, :])  # [L, n]
        else:
            seen = tree_visible(params, L, n, 0, n, 0, L, trees[b]).T
        visible = np.tile(seen, (1, G)).T  # [G * n, L]
        s = np.where(visible, s, -np.inf)
        # [Hkv, G * n, 1]: query head h = kv * G + g, each of its n queries
        sink = np.full((Hkv, G * n, 1), -np.inf, dtype=np.float32) if sinks is None else \
            np.repeat(np.asarray(sinks, np.float32).reshape(Hkv, G), n, axis=1)[..., None]
        m = np.maximum(s.max(axis=-1, keepdims=True), sink)
        p = round_to(np.exp(round_to(s - m)))
        total = round_to(p.sum(axis=-1, keepdims=True) + round_to(np.exp(sink - m)))
        o = round_to(round_to(p @ v) / total)
        out[b, :, :n] = o.reshape(Hq, n, d)
        lse[b, :, :n] = (m + np.log(total)).reshape(Hq, n)
    return out, lse
