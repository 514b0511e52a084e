"""NumPy attention over a quantized (int8 / float8_e4m3fn) cache: the BLAS path of
``numpy_attention`` (same work items, threads, key splits and merge) with a per-item
kernel that dequantizes each K/V key block into a reused float32 buffer as it reads it.

Memory: each item holds one dequantized block of K and one of V,
``[heads, keys, d]`` float32 with ``heads x keys x d <= score_block_elements`` (1 MiB by
default), never a dequantized copy of a row. The values are exactly
``gqakv.quantize.dequantize``'s (code x scale in float32), so the result is the float32
attention over the dequantized cache.
"""

from __future__ import annotations

import functools

import numpy as np

from gqakv.storage import quantize as _quantize
from gqakv.ops.merge import SoftmaxState

from .numpy_attention import attention_numpy, fold_block, item_queries


@functools.cache
def _e4m3_values() -> np.ndarray:
    """float32 value of each e4m3fn bit pattern ([256])."""
    return _quantize.e4m3_table()


def _dequantize_into(codes, scales, kv_dtype: str, out):
    """out[...] = float32(codes) * scales[..., None]; codes [hh, n, d], scales [hh, n]."""
    if kv_dtype == "int8":
        np.copyto(out, codes, casting="unsafe")
    else:
        np.take(_e4m3_values(), codes, out=out, mode="clip")  # uint8: always in range
    np.multiply(out, scales[..., None], out=out)
    return out


def _attend_item_quantized(q, k_buf, v_buf, rows, lens, n_new, item, *, params, acc,
                           score_block_elements, k_scale, v_scale, kv_dtype):
    """``numpy_attention._attend_item`` over codes ``k_buf``/``v_buf`` [rows, Hkv, S, d]
    and scales ``k_scale``/``v_scale`` [rows, Hkv, S]; returns the item's SoftmaxState."""
    i, h0, h1, t0, t1, j0, j1, _ = item
    Hq, d = q.shape[1], q.shape[3]
    G = Hq // k_buf.shape[1]
    hh, nq = h1 - h0, t1 - t0
    r, L, n = int(rows[i]), int(lens[i]), int(n_new[i])
    qb = item_queries(q, item, G, params, acc)
    kc, vc = k_buf[r, h0:h1], v_buf[r, h0:h1]  # [hh, S, d] code views
    ks, vs = k_scale[r, h0:h1], v_scale[r, h0:h1]  # [hh, S]
    kb_len = max(16, score_block_elements // (hh * G * nq))
    kb_len = min(kb_len, max(16, score_block_elements // (hh * d)))
    k32 = np.empty((hh, min(kb_len, j1 - j0), d), dtype=np.float32)
    v32 = np.empty_like(k32)
    state = SoftmaxState(np)
    for js in range(j0, j1, kb_len):
        je = min(j1, js + kb_len)
        kb = _dequantize_into(kc[:, js:je], ks[:, js:je], kv_dtype, k32[:, :je - js])
        vb = _dequantize_into(vc[:, js:je], vs[:, js:je], kv_dtype, v32[:, :je - js])
        fold_block(state, qb, kb, vb, params=params, L=L, n=n, t0=t0, t1=t1, js=js, je=je)
    return state


def attention_numpy_quantized(q, store, inputs, params, *, return_lse: bool, **blocking):
    """Attention of ``q`` [B, Hq, T, d] over a quantized KVStore (no leading axes);
    see ``gqakv.gqa_attention``. ``blocking``: ``attention_numpy``'s keywords."""
    item = functools.partial(_attend_item_quantized, k_scale=store.k_scale,
                             v_scale=store.v_scale, kv_dtype=store.dtype)
    return attention_numpy(q, store.k, store.v, inputs.rows, inputs.lens, inputs.n_new,
                           scale=params.scale, return_lse=return_lse, params=params,
                           attend_item=item, **blocking)
