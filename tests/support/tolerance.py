"""Tolerances for outputs computed in a narrow dtype, derived from the float64 reference
and the values the cache holds, never from the output under test (FlashAttention's rule:
an error at most k times the error the same dtype has anyway, plus a small eps)."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` rounded to ``dtype`` (through float32, as the kernels' stores), back in float64."""
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    return x.astype(np.float32).astype(np_dtype).astype(np.float64)


def max_error(out, want) -> float:
    """The largest absolute difference, in float64."""
    return float(np.abs(np.asarray(out, np.float64) - want).max())


def plain_float32_attention(q, k_rows, v_rows, n_new, scale, *, window=None, softcap=None,
                            sinks=None, alibi_slopes=None) -> np.ndarray:
    """The attention of ``reference_attention`` (same arguments, same masks) computed the
    plain way in float32: one matmul for the scores, a soft-cap, a max-subtracted exp, one
    matmul for P @ V and a division, each in float32. Only its error against the float64
    reference is used (the error float32 arithmetic has anyway on these values), never its
    output as the truth. Returns out [B, Hq, T, d] float32 (padded queries 0)."""
    q = np.asarray(q, np.float32)
    B, Hq, T, d = q.shape
    out = np.zeros((B, Hq, T, d), np.float32)
    scale = np.float32(scale)
    for b in range(B):
        k = np.asarray(k_rows[b], np.float32)  # [Hkv, L, d]
        v = np.asarray(v_rows[b], np.float32)
        Hkv, L, _ = k.shape
        G, n = Hq // Hkv, int(n_new[b])
        if n == 0:
            continue
        pos = np.arange(L - n, L)[:, None]  # [n, 1]: each query's position
        keys = np.arange(L)[None, :]  # [1, L]
        visible = (keys <= pos) & (True if window is None else keys > pos - window)  # [n, L]
        for h in range(Hq):
            s = (q[b, h, :n] @ k[h // G].T) * scale  # [n, L]
            if softcap is not None:
                c = np.float32(softcap)
                s = c * np.tanh(s / c)
            if alibi_slopes is not None:
                s = s + np.float32(alibi_slopes[h]) * (keys - pos).astype(np.float32)
            s = np.where(visible, s, np.float32(-np.inf))
            sink = -math.inf if sinks is None else float(sinks[h])
            m = np.maximum(s.max(axis=1), np.float32(sink))[:, None]  # [n, 1]
            p = np.exp(s - m)
            total = p.sum(axis=1, keepdims=True) + np.exp(np.float32(sink) - m)
            out[b, h, :n] = (p @ v[h // G]) / total
    return out
