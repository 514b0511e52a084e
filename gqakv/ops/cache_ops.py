"""Generic (array-API) implementations of the cache's in-place writes."""

from __future__ import annotations


def write_kv_array_api(store, k_new, v_new, rows, starts, n_new, offsets=None) -> None:
    """In-place writes through the store, one row at a time.

    store: a KVStore without leading axes; k_new, v_new: padded [B, Hkv, T, d] or, with
    ``offsets`` ([B] host ints), packed [N, Hkv, d] (entry i's tokens are
    ``offsets[i]:offsets[i] + n_new[i]``). Entry i's first n_new[i] tokens land at tokens
    starts[i]..starts[i]+n_new[i]-1 of row rows[i]. Padding slots (t >= n_new[i]) are
    never written. No concatenation, no reallocation.
    """
    for i in range(len(rows)):
        n = int(n_new[i])
        if n == 0:
            continue
        store.put(int(rows[i]), int(starts[i]), entry_tokens(k_new, offsets, i, n),
                  entry_tokens(v_new, offsets, i, n))


def entry_tokens(x, offsets, i: int, n: int):
    """Entry i's first ``n`` tokens of ``x`` as ``[H, n, d]``: ``x[i, :, :n]`` of a padded
    ``[B, H, T, d]`` (``offsets`` None), else rows ``offsets[i]..+n`` of a packed
    ``[N, H, d]``, heads first (a view where the library makes one)."""
    if offsets is None:
        return x[i, :, :n, :]
    from array_api_compat import array_namespace

    s = int(offsets[i])
    return array_namespace(x).permute_dims(x[s:s + n, :, :], (1, 0, 2))
