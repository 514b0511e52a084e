"""Contiguous sliding layers as rings: ``storage="contiguous"`` with a sliding window.

A sliding-window layer (window W: the query at position p sees keys ``p - W + 1..p``)
asked for in contiguous storage (``KVCache(..., window=W, max_chunk=C)``,
``ModelKVCache(..., windows=[...], storage="contiguous", max_chunk=C)``) keeps, per row,
a ring of ``window_pages(W, max_len, P, C)`` pages of ``P`` token slots
(``ceil((W - 1 + C) / P) + 1`` pages, at most ``ceil(max_len / P)``) instead of
``max_len`` slots: the ``W - 1`` keys before an append plus the at most ``C`` tokens it
adds, rounded up to whole pages. An append longer than ``C`` tokens is refused before
anything changes (ValueError naming the numbers, ``PageTable.check_chunk``).

What the ring is. It is the window-sized paged storage of ``gqakv.storage.paged``
(``PageTable.window``) with its pool sized ``rows x window_pages(W, max_len, P, C)`` and
appends capped at ``C`` tokens, nothing more. That is a ring because it can never run out:

- when an append of ``n <= C`` tokens starts at a row's length ``s``, the row first
  gives back its pages wholly before ``s - W + 1`` (``window_releasable``), then names
  pages up to token ``s + n - 1``: at most ``ceil((W - 1 + n) / P) + 1`` pages, which is
  ``window_pages``; a row that does not append, or is truncated, names no more than it did;
- fork and reorder make rows name pages other rows name (reference counts), and a copy
  on write replaces the row's own entry, while the page it copies stays named by another
  row: so the distinct pages in use are never more than the sum of each row's named
  pages, at most ``rows x window_pages`` = the pool.

So the free list plays the part of a ring's cycling index (a row's page ``p`` of its
history lands in whichever page the last release freed), and every reader and writer
of paged storage (NumPy, numba and CUDA kernels, the generic path) serves the ring with
no change. A ring of private, cyclically indexed pages (row b's page p at
``b x n + p mod n``) would be the same memory and the same kernels, but fork and reorder
would then have to copy every live token of the window instead of sharing pages: more
code, and slower row operations, for nothing gained.

What changes for the caller. The store is a ``PagedStore`` (``store.kind == "paged"``),
so ``cache.k`` / ``cache.v`` are the page pool ``[(layers,) num_pages, Hkv, P, d]``,
not ``[B, Hkv, max_len, d]`` views of the rows: row b's token j of head h is at
``k[entries[b, j // P], h, j % P]`` (``store.page_table.entries``) while j is inside the
window. ``live_kv`` of a row whose window released pages is refused (it has no whole
history), as are attention that reads further back than the window, and a ``truncate``
(or accept) to a length whose next query would see released keys (the error names the
window; 0 always works). Outputs are bit for bit those of the full-history cache.
A model cache of full and sliding layers keeps its full layers in contiguous rows
(``[layers, B, Hkv, max_len, d]``, read by the backends' contiguous paths) beside the
sliding layers' rings (``gqakv.storage.layer_groups``).
"""

from __future__ import annotations

from .store import CONTIGUOUS, PAGED


def storage_for(storage: str, windows, *, max_chunk, num_pages, prefix_cache) -> str:
    """The storage kind to allocate for ``storage`` and the layers' ``windows`` (None
    entries: full layers): ``"paged"`` for a contiguous cache with a sliding layer (its
    ring, module docstring), else ``storage`` unchanged (a model cache asks per layer
    kind, so its full layers stay contiguous). Refuses (ValueError naming the
    argument) what a ring cannot take: no ``max_chunk``, a ``num_pages`` (the ring sizes
    its pool) or a prefix cache."""
    windowed = [w for w in windows if w is not None]
    if storage != CONTIGUOUS or not windowed:
        return storage
    shown = windowed[0] if len(set(windowed)) == 1 else sorted(set(windowed))
    if max_chunk is None:
        raise ValueError(
            f"window={shown} with storage={CONTIGUOUS!r} keeps each row's sliding layer in a ring "
            "of W - 1 + max_chunk token slots (rounded up to pages): give max_chunk=C, the most "
            "tokens one append adds to a row (1 for decode; a prefill chunk's length), and "
            "append longer prompts in chunks of at most C")
    if num_pages is not None:
        raise ValueError(f"num_pages={num_pages!r} does not apply to storage={CONTIGUOUS!r} with "
                         f"window={shown}: the ring sizes its own pool (window_pages per row); "
                         "use storage='paged' to choose the pool's size")
    if prefix_cache is not False:
        raise ValueError(f"prefix_cache={prefix_cache!r} applies to storage='paged' only, not "
                         f"storage={CONTIGUOUS!r} (with window={shown}: a ring of pages)")
    return PAGED
