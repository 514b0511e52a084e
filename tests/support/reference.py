"""Direct reference attention, written independently of gqakv: loops and float64.

It follows the definition literally: for every row, query token and query head,
pick KV head h // G, take keys lo..pos where pos = L - n + t (lo = 0, or
max(0, pos - window + 1) with a sliding window), soft-cap each scaled score
(c * tanh(s / c)), add ALiBi's slope x (j - pos) for key j, and softmax in float64 with the head's sink logit as one more
term of the denominator that carries no value.

With ``parents`` (a draft tree per row: ``parents[b][t]`` is chunk token t's parent, -1
for a child of the last cached token), query t sees the keys before the chunk and the
chunk tokens met walking up from t through its parents; windows and ALiBi measure
logical positions (a prefix key j at j, chunk token u at P + its depth, P = L - n).
"""

from __future__ import annotations

import math

import numpy as np


def _tree_keys(L, n, t, parents_row):
    """[(key index, logical position)] query t of a tree chunk sees, and t's position."""
    P = L - n

    def depth(u):
        k = 0
        while int(parents_row[u]) >= 0:
            u, k = int(parents_row[u]), k + 1
        return k

    keys = [(j, j) for j in range(P)]
    u, path = t, []
    while u >= 0:
        path.append(u)
        u = int(parents_row[u])
    keys += [(P + u, P + depth(u)) for u in sorted(path)]
    return keys, P + depth(t)


def reference_attention(q, k_rows, v_rows, n_new, scale=None, *, window=None, softcap=None,
                        sinks=None, alibi_slopes=None, parents=None):
    """q: [B, Hq, T, d]; k_rows[b], v_rows[b]: [Hkv, L_b, d] live tokens of row b;
    window: None or W >= 1; softcap: None or c > 0; sinks: None or [Hq] logits (-inf: none);
    alibi_slopes: None or [Hq] slopes (head h's score of key j gets slope_h * (j - pos))

    Returns out [B, Hq, T, d] and lse [B, Hq, T], both float64 (lse: the log of the whole
    denominator, sink included); padded queries give out = 0 and lse = -inf.
    """
    q = np.asarray(q, dtype=np.float64)
    B, Hq, T, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = np.zeros((B, Hq, T, d))
    lse = np.full((B, Hq, T), -math.inf)
    for b in range(B):
        k = np.asarray(k_rows[b], dtype=np.float64)
        v = np.asarray(v_rows[b], dtype=np.float64)
        Hkv, L, _ = k.shape
        G = Hq // Hkv
        n = int(n_new[b])
        for t in range(n):
            if parents is None:
                pos = L - n + t
                seen = [(j, j) for j in range(pos + 1)]
            else:
                seen, pos = _tree_keys(L, n, t, parents[b])
            if window is not None:
                seen = [(j, p) for j, p in seen if p >= pos - window + 1]
            for h in range(Hq):
                kv = h // G
                scores = []
                for j, p in seen:
                    s = scale * float(np.dot(q[b, h, t], k[kv, j]))
                    if softcap is not None:
                        s = softcap * math.tanh(s / softcap)
                    if alibi_slopes is not None:
                        s += float(alibi_slopes[h]) * (p - pos)
                    scores.append(s)
                terms = list(scores)
                sink = None if sinks is None else float(sinks[h])
                if sink is not None and sink != -math.inf:
                    terms.append(sink)
                m = max(terms)
                total = sum(math.exp(s - m) for s in terms)
                for (j, _), s in zip(seen, scores):
                    out[b, h, t] += (math.exp(s - m) / total) * v[kv, j]
                lse[b, h, t] = m + math.log(total)
    return out, lse


def reference_on_buffers(q, k, v, lens, n_new, scale=None, *, window=None, softcap=None,
                         sinks=None, alibi_slopes=None, parents=None):
    """``reference_attention`` on padded buffers: k, v [B, Hkv, >= L_b, d] whose row b holds
    ``lens[b]`` live tokens (the slots past them are never read, NaN or not). Same returns."""
    k_rows = [np.asarray(k[b, :, :int(L)]) for b, L in enumerate(lens)]
    v_rows = [np.asarray(v[b, :, :int(L)]) for b, L in enumerate(lens)]
    return reference_attention(q, k_rows, v_rows, n_new, scale, window=window, softcap=softcap,
                               sinks=sinks, alibi_slopes=alibi_slopes, parents=parents)
