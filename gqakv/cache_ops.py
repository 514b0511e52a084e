"""Generic (array-API) implementations of the cache's in-place writes."""

from __future__ import annotations


def write_kv_array_api(k_buf, v_buf, k_new, v_new, rows, starts, n_new) -> None:
    """In-place slice assignment, one row at a time.

    k_buf, v_buf: [rows_total, Hkv, max_len, d]; k_new, v_new: [B, Hkv, T, d].
    Entry i's first n_new[i] tokens land at k_buf[rows[i], :, starts[i]:starts[i]+n_new[i]].
    Padding slots (t >= n_new[i]) are never written. No concatenation, no reallocation.
    """
    for i in range(len(rows)):
        n = int(n_new[i])
        if n == 0:
            continue
        r, s = int(rows[i]), int(starts[i])
        k_buf[r, :, s : s + n, :] = k_new[i, :, :n, :]
        v_buf[r, :, s : s + n, :] = v_new[i, :, :n, :]
