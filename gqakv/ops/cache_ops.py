"""Generic (array-API) implementations of the cache's in-place writes."""

from __future__ import annotations


def write_kv_array_api(store, k_new, v_new, rows, starts, n_new) -> None:
    """In-place writes through the store, one row at a time.

    store: a KVStore without leading axes; k_new, v_new: [B, Hkv, T, d]. Entry i's first
    n_new[i] tokens land at tokens starts[i]..starts[i]+n_new[i]-1 of row rows[i].
    Padding slots (t >= n_new[i]) are never written. No concatenation, no reallocation.
    """
    for i in range(len(rows)):
        n = int(n_new[i])
        if n == 0:
            continue
        store.put(int(rows[i]), int(starts[i]), k_new[i, :, :n, :], v_new[i, :, :n, :])
