"""``PagedKVCache``: a KVCache whose rows take pages from one pool as they grow.

A drop-in for ``KVCache`` (same methods and semantics; ``gqa_attention`` accepts it with
the same results) over paged storage (``gqakv.storage.paged``): memory follows the live tokens
rather than ``batch x max_len``, and ``fork`` / ``reorder`` share pages instead of
copying tokens.
"""

from __future__ import annotations

from .cache import KVCache
from ..storage.paged import DEFAULT_PAGE_SIZE
from ..storage.store import PAGED


class PagedKVCache(KVCache):
    """A KVCache with paged storage.

    Args:
        batch, kv_heads, max_len, head_dim, dtype, backend: as ``KVCache``.
        page_size: tokens per page (default 16).
        num_pages: pages in the pool, allocated once. None (default): every row at
            ``max_len`` fits (``batch * ceil(max_len / page_size)``, no overcommit); fewer
            overcommit, as servers do: an append the free pages cannot serve raises
            ``gqakv.OutOfPages`` (a MemoryError) and changes nothing.
        kv_dtype: None (K/V stored as ``dtype``), "int8" or "float8_e4m3fn": pages hold
            8-bit codes and each token's float32 scale is paged with it (the scheme of
            ``gqakv.storage.quantize``, as ``KVCache``'s ``kv_dtype``).
        prefix_cache: keep full pages findable by the tokens they hold: ``cache_prefix(row,
            token_ids)`` after a prompt's prefill, ``match_prefix(row, token_ids)`` to start a
            new request on the cached pages of its longest cached prefix (no copy, no
            prefill of them). Pages no row names stay cached, in an LRU, and are evicted
            only when an append needs them (``pages_free`` counts them, ``pages_reusable``
            says how many). Default False.
        window: None (default: every token kept), or the sliding window W >= 1 of the
            layer this cache serves (attention then passes ``window=W``, or a smaller one):
            window-sized storage. When an append starts at a row's length ``s``, the row's
            pages whose every key is before ``s - W + 1`` (the first key the append's first
            query, at position s, sees) go back to the pool first, so a row holds about
            ``W + chunk`` tokens of pages however long it grows (size ``num_pages`` by
            ``gqakv.storage.sizing.window_pages``). Attention that would read a released
            key (``window=None``, a larger window, queries further back) is refused with a
            ValueError naming the numbers; so is truncating (or accepting a draft) to a
            length whose next query would see one (0 always works), ``live_kv`` of a row
            that released pages, and ``cache_prefix`` after the window moved. Outputs are
            bit for bit those of the same cache without a window. Unlike other paged rows,
            a windowed row must not be attended by one thread while another appends to it
            (the append may reuse the pages behind its window for its new tokens).
        max_chunk: with a ``window`` only: None (default), or the most tokens one append
            adds to a row; a longer append is refused (ValueError naming the numbers,
            nothing changed), and ``num_pages`` defaults to ``batch x window_pages(W,
            max_len, page_size, max_chunk)``, a pool that never runs out
            (``gqakv.storage.ring``: what ``KVCache(..., window=W, max_chunk=C)`` makes).

    Attributes (besides KVCache's):
        k, v: the page pool, ``[num_pages, Hkv, page_size, d]`` each (heads-major inside a
            page). Row b's token j of head h is ``k[entries[b, j // P], h, j % P]``.
            Quantized: codes, with ``store.k_scale``/``store.v_scale`` ``[num_pages, Hkv,
            page_size]`` (token j's scale at ``[entries[b, j // P], h, j % P]``).
        store.page_table: the ``gqakv.storage.paged.PageTable``: ``entries`` ``[B,
            pages_per_row]`` int32 (each row's pages in token order, -1 past them),
            reference counts, free list.
        page_size, num_pages, pages_used, pages_free: ints.
        nbytes: bytes of the K and V pool (``store.page_table.nbytes`` more on the host).

    ``live_kv(row)`` returns copies gathered from the row's pages. ``fork`` and ``reorder``
    share pages (copying table entries, bumping reference counts); the one page ever
    copied is a shared, partly filled last page, when a row is about to write into it.
    ``truncate`` and ``reset`` release the pages no row names any more.
    """

    def __init__(self, batch: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype="float32", backend=None, *, page_size: int = DEFAULT_PAGE_SIZE,
                 num_pages: int | None = None, kv_dtype=None, prefix_cache: bool = False,
                 window: int | None = None, max_chunk: int | None = None):
        super().__init__(batch, kv_heads, max_len, head_dim, dtype, backend, storage=PAGED,
                         page_size=page_size, num_pages=num_pages, kv_dtype=kv_dtype,
                         prefix_cache=prefix_cache, window=window, max_chunk=max_chunk)

    @property
    def window(self) -> int | None:
        """The sliding window W whose history this cache lets go of (None: keeps all)."""
        return self.store.window

    @property
    def pages_released(self) -> int:
        """Pages the window has released so far (a running count over the cache's life)."""
        return self._page_table().window_released

    def __repr__(self) -> str:
        return (f"PagedKVCache(batch={self.batch}, kv_heads={self.kv_heads}, max_len={self.max_len}, "
                f"head_dim={self.head_dim}, dtype={self.dtype!r}, "
                + (f"kv_dtype={self.kv_dtype!r}, " if self.kv_dtype else "")
                + f"backend={self.backend.name!r}, "
                f"page_size={self.page_size}, num_pages={self.num_pages}, "
                + (f"window={self.window}, " if self.window is not None else "") +
                f"pages_used={self.pages_used})")
