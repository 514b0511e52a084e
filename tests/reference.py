"""Direct reference attention, written independently of gqakv: loops and float64.

It follows the definition literally: for every row, query token and query head,
pick KV head h // G, take keys 0..pos where pos = L - n + t, softmax in float64.
"""

from __future__ import annotations

import math

import numpy as np


def reference_attention(q, k_rows, v_rows, n_new, scale=None):
    """q: [B, Hq, T, d]; k_rows[b], v_rows[b]: [Hkv, L_b, d] live tokens of row b.

    Returns out [B, Hq, T, d] and lse [B, Hq, T], both float64; padded queries give
    out = 0 and lse = -inf.
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
            pos = L - n + t
            for h in range(Hq):
                kv = h // G
                scores = [scale * float(np.dot(q[b, h, t], k[kv, j])) for j in range(pos + 1)]
                m = max(scores)
                weights = [math.exp(s - m) for s in scores]
                total = sum(weights)
                for j, w in enumerate(weights):
                    out[b, h, t] += (w / total) * v[kv, j]
                lse[b, h, t] = m + math.log(total)
    return out, lse
