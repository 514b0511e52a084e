"""Backend hot operations called on raw buffers, for tests that drive a backend directly
(the library itself calls them with the cache's KVStore and validated inputs)."""

from __future__ import annotations

import numpy as np

from gqakv.core.inputs import AppendInputs, AttentionInputs
from gqakv.core.semantics import AttentionParams
from gqakv.storage.store import KVStore


def _ints(a) -> np.ndarray:
    return np.asarray(a, dtype=np.int64)


def write_kv(backend, k_buf, v_buf, k_new, v_new, rows, starts, n_new) -> None:
    """``backend.write_kv`` into buffers ``[rows_total, Hkv, max_len, d]``."""
    backend.write_kv(KVStore.of(k_buf, v_buf), k_new, v_new,
                     AppendInputs(rows=_ints(rows), starts=_ints(starts), n_new=_ints(n_new)))


def attention(backend, q, k_buf, v_buf, rows, lens, n_new, *, scale: float, return_lse: bool):
    """``backend.attention`` of q ``[B, Hq, T, d]`` over buffers ``[rows_total, Hkv, max_len, d]``."""
    params = AttentionParams(scale=float(scale))
    inputs = AttentionInputs(rows=_ints(rows), lens=_ints(lens), n_new=_ints(n_new), params=params)
    return backend.attention(q, KVStore.of(k_buf, v_buf), inputs, params, return_lse=return_lse)
