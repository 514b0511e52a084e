"""Row operations of a serving loop: reorder (beam search), fork (parallel sampling),
truncate (speculative-decoding rollback) and reset (row reuse).

They act on a ``KVStore`` with a leading layer axis (a standalone KVCache passes its
store with a leading axis of 1) and on the shared ``Lengths``. On paged storage
(``gqakv.storage.paged``) they move no data: reorder and fork share pages through the page
table, truncate and reset release the pages no row names any more. Every
operation validates all of its arguments before it touches anything, so a rejected
call changes nothing. Only live tokens move: row ``b``'s copy costs ``lens[b]``
tokens per layer, never ``max_len``; truncate and reset move no data at all.

Here each operation is validated; the store's layout then does it
(``KVStore.reorder_rows`` / ``fork_rows`` / ``trim_rows``): a contiguous layout copies
through ``Backend.copy_tokens`` in waves planned by ``gqakv.storage.row_copies``, a paged one
shares and releases pages.
"""

from __future__ import annotations

import numpy as np

from ..core.inputs import check_rows, ints_1d as _ints_1d
from ..storage.row_copies import TEMP, Wave, copy_tokens_array_api, plan_reorder, run_waves  # noqa: F401  (re-exported)


# -- validation ------------------------------------------------------------------------------


def _row_list(rows, what: str, batch: int, *, distinct: bool) -> np.ndarray:
    """``rows`` (an int, a sequence or a 1-D int array) as host int64 [n], every entry in
    0..batch-1 (and distinct if asked)."""
    return check_rows(_ints_1d(rows, what), what, batch, distinct=distinct)


def _row(x, what: str, batch: int) -> int:
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
        raise TypeError(f"{what} must be an int row index, got {x!r}")
    if not 0 <= x < batch:
        raise ValueError(f"{what}={int(x)} is out of range for a cache of {batch} rows")
    return int(x)


# -- the operations --------------------------------------------------------------------------


def reorder(backend, store, lengths, src_rows) -> int:
    """Row b takes the contents and length of row ``src_rows[b]`` (duplicates allowed).

    In place in the preallocated buffers; copies ``lens[src_rows[b]]`` tokens for each
    row with ``src_rows[b] != b`` (plus the shortest row of each permutation cycle once
    more, through a one-row temporary, allocated before the first copy: a MemoryError
    there changes nothing). Returns tokens copied per layer.
    """
    batch = len(lengths.host)
    src = _row_list(src_rows, "src_rows", batch, distinct=False)
    if src.size != batch:
        raise ValueError(f"src_rows must have one entry per cache row ({batch}), got {src.size}")
    old = lengths.host.copy()
    copied = store.reorder_rows(backend, src, old)  # the layout's way: copies or shared pages
    lengths.set(np.arange(batch), old[src])
    return copied


def fork(backend, store, lengths, src: int, dst_rows) -> int:
    """Copy row ``src``'s live tokens into each row of ``dst_rows`` (distinct; ``src``
    itself is skipped if listed), which then hold ``lens[src]`` tokens. Returns tokens
    copied per layer."""
    batch = len(lengths.host)
    s = _row(src, "src", batch)
    dst = _row_list(dst_rows, "dst_rows", batch, distinct=True)
    dst = dst[dst != s]
    n = int(lengths.host[s])
    copied = store.fork_rows(backend, s, dst, n)  # the layout's way: copies or shared pages
    lengths.set(dst, np.full(dst.size, n))
    return copied


def truncate(lengths, rows, new_lens, *, store=None) -> None:
    """Shorten row ``rows[i]`` to ``new_lens[i]`` tokens: O(1), no data moves.

    ``0 <= new_lens[i] <= lens[rows[i]]``; the dropped tokens stay in the buffer but are
    no longer live, and the next append overwrites them. A paged ``store`` releases the
    row's pages past ``ceil(new_lens[i] / page_size)``.
    """
    batch = len(lengths.host)
    r = _row_list(rows, "rows", batch, distinct=True)
    n = _ints_1d(new_lens, "new_lens")
    if n.size != r.size:
        raise ValueError(f"new_lens must have shape [{r.size}] (one per row), got [{n.size}]")
    for i in range(r.size):
        have = int(lengths.host[r[i]])
        if not 0 <= n[i] <= have:
            raise ValueError(
                f"new_lens[{i}]={int(n[i])} is outside 0..{have} for row {int(r[i])}, which "
                f"holds {have} tokens (truncate only shortens rows)"
            )
    if store is not None:
        store.trim_rows(r, n)  # paged: pages past the new lengths go back to the pool
    lengths.set(r, n)


def reset(lengths, rows=None, *, store=None) -> None:
    """Empty ``rows`` (distinct; default every row) so new requests can reuse them (a
    paged ``store`` releases their pages)."""
    batch = len(lengths.host)
    r = np.arange(batch) if rows is None else _row_list(rows, "rows", batch, distinct=True)
    if store is not None:
        store.trim_rows(r, np.zeros(r.size, dtype=np.int64))
    lengths.set(r, np.zeros(r.size, dtype=np.int64))
