"""The KV cache: K and V allocated once, written in place at each row's length.

Layout (gpt-fast style): ``k`` and ``v`` are each ``[B, Hkv, max_len, d]``; row b's
live tokens are ``k[b, :, :lens[b], :]``. Appends write at ``lens[b]`` and then
advance it; nothing is ever concatenated, stacked, repeated or reallocated.

Storage is a ``gqakv.storage.store.KVStore`` (``cache.store``): it owns the layout, the
dtypes, the byte count and allocation, and it is what the backends' hot operations
take. Public contract of the buffers: ``cache.k`` / ``cache.v`` (and ``live_kv``) are
the store's arrays, and for contiguous storage they are *views*
of the live memory, never copies: reading them is supported, writing them bypasses
validation and the lengths (tests poison dead slots through ``cache.store.fill``).
A storage kind that is not contiguous (paged, quantized) will not promise views: there
``live_kv`` returns the store's reader output (``KVStore.blocks``: copies gathered from
a paged row's pages, dequantized copies) and ``k`` / ``v`` are not dense per-row buffers
(paged: the page pool ``[num_pages, Hkv, page_size, d]``).

A KVCache is either *standalone* (it allocated its own buffers) or a *layer view* of
a ``gqakv.ModelKVCache``: then ``k`` and ``v`` are views ``k[layer]`` of the model's
``[layers, B, Hkv, max_len, d]`` buffers and the lengths are shared with every other
layer. A layer view reads (attention, ``live_kv``) like any cache, but it cannot
append or move rows on its own: lengths advance once per model step, for all layers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from ..core import dtypes as _dtypes
from ..core.dims import check_dims
from ..core.inputs import immutable_ints, validate_append
from ..core.units import human_bytes
from ..dispatch.registry import get_backend
from ..ops import row_ops
from ..storage.layouts import store_class
from ..storage.ring import storage_for
from ..storage.prefix_index import token_ids_of
from ..storage.store import MAX_BUFFER_BYTES, KVStore, StorageSpec  # noqa: F401  (MAX_BUFFER_BYTES: re-exported)


class Lengths:
    """Live tokens per row, shared by every view of the same buffers.

    The host int64 copy is the source of truth: validation reads it without a device
    round trip. Callers are handed copies (``read_only``, ``device``), never it or an
    array another caller also holds, so nothing a caller does to what it got (a write,
    NumPy's ``setflags(write=True)``) reaches the lengths or the next caller.

    ``lock`` serializes the writers of one set of buffers (an append, a step's open,
    writes and commit, a row operation: validate, write, advance the lengths), shared by
    a KVCache or ModelKVCache and every layer view of it. Readers do not take it: they
    snapshot the lengths they validate against, and writers change only slots past them.
    """

    def __init__(self, batch: int):
        self.host = np.zeros(batch, dtype=np.int64)
        self.lock = threading.RLock()

    @classmethod
    def of(cls, values: np.ndarray) -> "Lengths":
        lengths = cls(len(values))
        lengths.host[:] = values
        return lengths

    def set(self, rows: np.ndarray, values: np.ndarray) -> None:
        self.host[rows] = values

    def read_only(self) -> np.ndarray:
        """A snapshot ``[B]`` int64 that cannot be made writable (``immutable_ints``)."""
        return immutable_ints(self.host)

    def device(self, backend, like):
        """A new backend array of a snapshot, on ``like``'s device, for each caller: never
        cached, since torch, CuPy and array-API arrays are writable (a shared one let one
        caller's write change what the next read) and it must not change under its
        holder after the next append."""
        return backend.from_host_ints(self.host.copy(), device=backend.device_of(like))


def write(backend, store: KVStore, k_new, v_new, inputs) -> None:
    """The one dispatch of a validated write (``KVCache.append`` and ``Step.write``):
    ``inputs`` is the ``AppendInputs`` of ``k_new``/``v_new``, ``store`` has no leading axis."""
    backend.write_kv(store, k_new, v_new, inputs)


class RowsAndLengths:
    """Live lengths and row operations, shared by KVCache and ModelKVCache.

    A subclass has ``backend``, ``store`` (a KVStore) and ``_lengths`` (a Lengths; a new
    cache sets them up through ``_allocate``), and provides
    ``_row_store()`` (the store with a leading layer axis, ``[layers, B, Hkv, max_len, d]``) and
    ``_check_can_change(what)`` (raises when the cache may not change now).
    """

    # What a subclass provides (above), declared for the type checker. store: a KVStore, or
    # its paged subclass (gqakv.storage.paged.PagedStore) whose page table the paged paths read
    # after checking the store's kind.
    store: Any
    _row_store: Callable[[], KVStore]
    _check_can_change: Callable[[str], None]

    def _allocate(self, leading: tuple[int, ...], batch, kv_heads, max_len, head_dim, dtype,
                  backend, what: str, storage: str = "contiguous", page_size=None,
                  num_pages=None, kv_dtype=None, prefix_cache=False, window=None,
                  max_chunk=None) -> None:
        """Check the dimensions, pick the backend, allocate K and V
        ``[*leading, B, Hkv, max_len, d]`` once (paged storage: a pool of ``num_pages``
        pages of ``page_size`` tokens, ``gqakv.storage.paged``; contiguous with a
        ``window``: a ring of pages per row, ``gqakv.storage.ring``) and start every row
        empty."""
        self.batch, self.kv_heads, self.max_len, self.head_dim = check_dims(
            batch, kv_heads, max_len, head_dim)
        self.dtype = _dtypes.canonical_name(dtype)
        storage = storage_for(storage, [window], max_chunk=max_chunk, num_pages=num_pages,
                              prefix_cache=prefix_cache)
        spec = StorageSpec.of(self.dtype, storage, kv_dtype)
        self.kv_dtype: str | None = spec.dtype if spec.quantized else None
        layout = store_class(spec.kind)
        args = layout.layout_args(self.batch, self.max_len, page_size=page_size, num_pages=num_pages,
                                  prefix_cache=prefix_cache, window=window, max_chunk=max_chunk)
        self.backend = get_backend(backend, dtype=self.dtype, head_dim=self.head_dim)
        shape = (*leading, self.batch, self.kv_heads, self.max_len, self.head_dim)
        self.store = layout.allocate(self.backend, spec, shape, what, **args)
        self._lengths = Lengths(self.batch)

    @property
    def k(self):
        """K: for contiguous storage, the buffer ``[*leading, B, Hkv, max_len, d]`` itself
        (see the module docstring for what may be done with it)."""
        return self.store.k

    @property
    def v(self):
        """V, as ``k``."""
        return self.store.v

    # -- pages (paged storage) ---------------------------------------------------------------

    def _page_table(self):
        return self.store.page_table  # TypeError, naming the storage, when not paged

    @property
    def page_size(self) -> int:
        """Tokens per page (paged storage only)."""
        return self._page_table().page_size

    @property
    def num_pages(self) -> int:
        """Pages in the pool (paged storage only)."""
        return self._page_table().num_pages

    @property
    def pages_used(self) -> int:
        """Pages some row's table names (paged storage only)."""
        return self._page_table().pages_used

    @property
    def pages_free(self) -> int:
        """Pages an append can take (paged storage only): the free list, plus the prefix
        cache's cached pages no row names (evicted only when the free list runs out)."""
        return self._page_table().pages_free

    @property
    def pages_reusable(self) -> int:
        """Cached pages no row names (paged storage; 0 without a prefix cache)."""
        return self._page_table().pages_reusable

    @property
    def prefix_index(self):
        """The prefix cache's ``gqakv.storage.prefix_index.PrefixIndex`` (None without one;
        paged storage only; None for a model cache of several layer kinds, which has none)."""
        if getattr(self.store, "page_tables", None) is not None:
            return None
        return self._page_table().index

    # -- the prefix cache (paged storage made with prefix_cache=True) ---------------------------

    def _index_and_row(self, row, what: str):
        table = self._page_table()
        if table.index is None:
            raise ValueError(f"cannot {what}: this cache has no prefix cache (make it with "
                             "storage='paged', prefix_cache=True)")
        return table, row_ops._row(row, "row", self.batch)

    def match_prefix(self, row: int, token_ids, *, salt=None) -> int:
        """Start empty row ``row`` with the cached pages of the longest prefix of
        ``token_ids`` made of full pages (keys: ``gqakv.storage.prefix_index``), named by
        reference (no copy), every layer at once; returns the tokens it now holds (a
        multiple of ``page_size``). At most ``len(token_ids) - 1`` tokens are matched, so
        the caller always runs the last prompt token (its logits are the first output).
        The caller then appends ``token_ids[matched:]`` at the positions that follow.

        ``salt`` (None, a str, bytes or an int) separates prompts whose equal token ids
        mean different things (an adapter, images): only pages cached with the same salt
        match. Validated before anything changes; the row must be empty (``reset`` it)."""
        with self._lengths.lock:
            self._check_can_change("match a prefix")
            table, row = self._index_and_row(row, "match a prefix")
            ids = token_ids_of(token_ids)
            if int(self._lengths.host[row]) or int(table.held[row]):
                raise ValueError(f"row {row} holds {int(self._lengths.host[row])} tokens; "
                                 "match_prefix starts an empty row (reset it first)")
            limit = min(ids.size - 1, self.max_len)
            pages = table.index.match(ids, salt, max_tokens=max(limit, 0))
            table.attach(row, pages)
            matched = int(pages.size) * table.page_size
            self._lengths.set(np.array([row]), np.array([matched]))
            return matched

    def cache_prefix(self, row: int, token_ids, *, salt=None) -> int:
        """Put row ``row``'s full pages into the prefix cache as holding ``token_ids`` (the
        row's first ``len(token_ids)`` tokens, at most ``lens[row]``: the caller's word for
        what it appended), so later ``match_prefix`` calls find them. Pages already cached
        stay as they are. Returns how many pages became cached. Call it after a prompt's
        prefill (and again later with the generated tokens, to cache those too)."""
        with self._lengths.lock:
            self._check_can_change("cache a prefix")
            table, row = self._index_and_row(row, "cache a prefix")
            ids = token_ids_of(token_ids)
            have = int(self._lengths.host[row])
            gone = int(self.store.first_held([row])[0])
            if gone:
                raise ValueError(
                    f"cannot cache a prefix of row {row}: its sliding window (window="
                    f"{self.store.window}) released its tokens 0..{gone - 1}, and a cached prefix "
                    "starts at token 0 (call cache_prefix right after the prompt's prefill, before "
                    "the next append lets the window move)")
            if ids.size > have:
                raise ValueError(f"token_ids has {ids.size} ids, but row {row} holds {have} "
                                 "tokens: cache_prefix names tokens the row already holds")
            full = ids.size // table.page_size
            return table.index.insert(ids, table.row_pages(row)[:full], salt)

    @property
    def host_lens(self) -> np.ndarray:
        """Live tokens per row as a NumPy int64 ``[B]`` array (no device round trip): a
        snapshot of its own for each call, which cannot be made writable."""
        return self._lengths.read_only()

    @property
    def lens(self):
        """Live tokens per row, ``[B]`` int64, as an array of the cache's backend: a new
        snapshot for each call (NumPy: one that cannot be made writable), so writing it
        changes nothing else."""
        return self._lengths.device(self.backend, self.store.any_buffer)

    def reorder(self, src_rows) -> None:
        """Row b takes the contents and length of row ``src_rows[b]`` (``[B]`` ints; duplicates
        allowed: beam search). In place, every layer at once; copies only live tokens,
        ordered so no row is overwritten before it is read (a one-row temporary breaks
        permutation cycles). See ``row_ops.reorder``."""
        with self._lengths.lock:
            self._check_can_change("reorder rows")
            row_ops.reorder(self.backend, self._row_store(), self._lengths, src_rows)

    def fork(self, src: int, dst_rows) -> None:
        """Copy row ``src``'s live tokens and length into each of ``dst_rows`` (distinct)."""
        with self._lengths.lock:
            self._check_can_change("fork rows")
            row_ops.fork(self.backend, self._row_store(), self._lengths, src, dst_rows)

    def truncate(self, rows, new_lens) -> None:
        """Shorten ``rows[i]`` to ``new_lens[i] <= lens[rows[i]]`` tokens: O(1), no data moves."""
        with self._lengths.lock:
            self._check_can_change("truncate rows")
            row_ops.truncate(self._lengths, rows, new_lens, store=self.store)

    def accept(self, paths, tree, *, rows=None) -> None:
        """Keep one verified path of each entry's draft tree (speculative decoding), every
        layer at once, after the tree's chunk was appended and attended (``tree=``).

        Args:
            paths: ``[B']`` paths, one per tree entry: ``paths[i]`` a sequence of ``k_i``
                chunk indices of entry i's tree from a root down (each the parent of the
                next; ``tree.is_path``), or empty to reject the whole chunk.
            tree: the ``gqakv.DraftTree`` (``gqakv.DraftTree.of(parents, n_new)``) whose
                ``n[i]`` tokens are the last ``n[i]`` of row ``rows[i]``.
            rows: ``[B']`` distinct rows (default ``0..B'-1``).

        With ``L = lens[rows[i]]`` and ``P = L - n[i]``, chunk token ``path[s]`` (slot
        ``P + path[s]``) moves to slot ``P + s``, K and V, stored codes and scales bit for
        bit, and the row holds ``P + k_i`` tokens (paged: pages past that are released).
        Nothing else moves. Everything is validated first (TypeError / ValueError naming
        the entry and the numbers), so a refused call changes nothing. Paged: a page the
        moves would write that other rows also name (or the prefix cache holds) is copied
        first and the row names its copy (copy on write, as for an append); when the pool
        cannot supply the copies, ``gqakv.OutOfPages`` and nothing changed. See
        ``row_ops.accept``."""
        with self._lengths.lock:
            self._check_can_change("accept draft paths")
            row_ops.accept(self.backend, self._row_store(), self._lengths, paths, tree, rows,
                           trim_store=self.store)

    def reset(self, rows=None) -> None:
        """Empty ``rows`` (distinct; default every row) for reuse by new requests."""
        with self._lengths.lock:
            self._check_can_change("reset rows")
            row_ops.reset(self._lengths, rows, store=self.store)


class KVCache(RowsAndLengths):
    """A preallocated per-layer KV cache with ragged per-row lengths.

    Args:
        batch: B, number of rows (sequences).
        kv_heads: Hkv, number of key/value heads.
        max_len: capacity in tokens of every row.
        head_dim: d, the head dimension.
        dtype: "float32" (default), "float16", "bfloat16", "float64" or a dtype object.
        backend: a backend name, a Backend, "auto" or None (see ``gqakv.get_backend``).
        storage: the storage kind (``gqakv.storage.store.KINDS``): "contiguous" (default) or
            "paged" (see ``gqakv.PagedKVCache``).
        page_size: paged storage (or a contiguous ring, ``window``): tokens per page
            (default 16).
        num_pages: paged storage only: pages in the pool (default: every row at ``max_len``).
        prefix_cache: paged storage only: keep full pages findable by the tokens they hold
            (``match_prefix`` / ``cache_prefix``; pages no row names stay cached until the
            pool needs them). Default False.
        window: None (default: every token kept), or the sliding window W (>= 1) of the
            layer this cache serves: as each row grows, the pages wholly behind the window
            of every query it can still make go back to the pool (``gqakv.PagedKVCache``).
            Attention must then read no earlier key (it is refused, naming the numbers,
            e.g. ``window=None`` after pages went), truncating into released history is
            refused, and ``live_kv`` of such a row is refused. With contiguous storage
            (the default) it needs ``max_chunk`` and makes each row a ring of
            ``window_pages(W, max_len, page_size, max_chunk)`` pages (``gqakv.storage.ring``):
            the store is then paged, and ``k``/``v`` are its page pool ``[num_pages, Hkv,
            page_size, d]``, not ``[B, Hkv, max_len, d]`` rows.
        max_chunk: with a ``window`` only: None, or the most tokens one append adds to a
            row (1: decode; a prefill chunk's length). An append of more is refused
            (ValueError naming the numbers, nothing changed); paged storage without
            ``num_pages`` sizes its pool from it, as the contiguous ring does.
        kv_dtype: how K and V are stored: None (as ``dtype``), "int8" or "float8_e4m3fn"
            (8-bit codes plus a float32 scale per row, KV head and token, ``gqakv.storage.quantize``;
            contiguous or paged storage, dtype float32/float16/bfloat16). ``dtype`` stays the dtype
            of q, k_new/v_new and the output; appends quantize, attention dequantizes
            block by block as it reads, row operations carry the scales.

    Attributes:
        store: the KVStore (layout, dtypes, bytes); what the backend's operations take.
        k, v: the buffers, ``[B, Hkv, max_len, d]`` each, allocated once (contiguous
            storage: views of the store's memory; see the module docstring).
        lens: ``[B]`` int64, live tokens per row (read-only; changed by ``append``).
        backend: the Backend holding the buffers.
    """

    def __init__(self, batch: int, kv_heads: int, max_len: int, head_dim: int,
                 dtype="float32", backend=None, *, storage: str = "contiguous",
                 page_size: int | None = None, num_pages: int | None = None, kv_dtype=None,
                 prefix_cache: bool = False, window: int | None = None,
                 max_chunk: int | None = None):
        self._allocate((), batch, kv_heads, max_len, head_dim, dtype, backend, "KV cache",
                       storage, page_size, num_pages, kv_dtype, prefix_cache, window, max_chunk)
        self._frozen: str | None = None  # why this cache cannot change its own lengths (layer views)

    @classmethod
    def _view_of(cls, store: KVStore, lengths: Lengths, *, backend, frozen: str) -> "KVCache":
        """A cache over an existing ``store`` without leading axes (``[B, Hkv, max_len, d]``
        views) with shared ``lengths``; it reads like any cache, and ``append`` and the row
        operations raise RuntimeError(``frozen``). Used for ModelKVCache's layer views."""
        self = cls.__new__(cls)
        self.batch, self.kv_heads, self.max_len, self.head_dim = (
            store.rows, store.kv_heads, store.max_len, store.head_dim)
        self.dtype = store.spec.q_dtype
        self.kv_dtype = store.dtype if store.quantized else None
        self.backend = backend
        self.store = store
        self._lengths = lengths
        self._frozen = frozen
        return self

    # -- sizing ----------------------------------------------------------------------------

    @staticmethod
    def nbytes_for(batch: int, kv_heads: int, max_len: int, head_dim: int, dtype="float32",
                   kv_dtype=None) -> int:
        """Bytes the K and V buffers of such a cache take together (with ``kv_dtype``: codes
        plus scales), computed before allocating (each dimension checked as the constructor
        checks it; exact Python ints, no wrap-around)."""
        batch, kv_heads, max_len, head_dim = check_dims(batch, kv_heads, max_len, head_dim)
        return StorageSpec.of(dtype, kv_dtype=kv_dtype).nbytes(batch * max_len, kv_heads, head_dim)

    @property
    def nbytes(self) -> int:
        return self.store.nbytes

    @property
    def window(self) -> int | None:
        """The sliding window W whose history this cache lets go of (None: keeps all)."""
        return self.store.window

    def _check_can_change(self, what: str) -> None:
        if self._frozen is not None:
            raise RuntimeError(f"cannot {what} through this cache: {self._frozen}")

    # -- writing ---------------------------------------------------------------------------

    def append(self, k_new, v_new, n_new, *, rows=None) -> None:
        """Write new tokens in place at each row's current length, then advance the lengths.

        Args:
            k_new, v_new: ``[B, Hkv, T, d]`` in the cache's dtype and array library, or
                packed ``[N, Hkv, d]``: entry i's n_new[i] tokens end to end, ``N =
                sum(n_new)`` (no padding; see ``gqa_attention``).
            n_new: ``[B]`` ints, ``0 <= n_new[i] <= T``: the first n_new[i] of entry i's
                T slots are real tokens, the rest is padding and is not written.
            rows: optional ``[B]`` distinct cache rows (default ``0..B-1``): entry i writes
                to cache row ``rows[i]`` (continuous batching over a larger cache).

        Everything is validated before anything is written: on error (TypeError or
        ValueError naming the row and the numbers; ``gqakv.OutOfPages`` when a paged
        cache's pool cannot supply the pages) no row's data or length changes.
        """
        with self._lengths.lock:  # validate, write and advance as one step (see Lengths)
            self._check_can_change("append")
            inputs = validate_append(self, k_new, v_new, n_new, rows)
            # the layout takes what the write needs (paged: pages; OutOfPages changes nothing)
            reservation = self.store.reserve(self.backend, inputs.rows, inputs.starts, inputs.n_new)
            try:
                write(self.backend, self.store, k_new, v_new, inputs)
            except BaseException:
                # the write landed only past live tokens: giving the pages back restores the
                # table, and no length has moved
                self.store.give_back(reservation)
                raise
            self._lengths.set(inputs.rows, inputs.starts + inputs.n_new)

    # -- row operations (RowsAndLengths) ---------------------------------------------------------

    def _row_store(self) -> KVStore:
        """The store as ``[1, B, Hkv, max_len, d]`` views, the row operations' layout."""
        return self.store.with_layers(self.backend.namespace())

    # -- reading ---------------------------------------------------------------------------

    def live_kv(self, row: int):
        """Row ``row``'s live keys and values, ``[Hkv, L, d]`` each, in the storage dtype:
        for contiguous storage the views ``k[row, :, :L]`` and ``v[row, :, :L]`` (they
        change when the row is written; copy them to keep them). Paged storage returns
        copies gathered from the row's pages (the pages are shared and move between rows);
        other kinds return what ``KVStore.blocks`` reads. See the module docstring."""
        if isinstance(row, bool) or not isinstance(row, (int, np.integer)) or not 0 <= row < self.batch:
            raise ValueError(f"row={row!r} is not a row of this cache (0..{self.batch - 1})")
        n = int(self._lengths.host[row])
        k, v = self.store.row_kv(self.backend, int(row), n)  # views, or the layout's copies
        codec = self.store.spec.codec
        if codec.rotates_keys:  # stored rotated: handed back in the caller's basis
            k = codec.unrotate_keys(self.backend.namespace(), k)
        return k, v

    def __repr__(self) -> str:
        return (f"KVCache(batch={self.batch}, kv_heads={self.kv_heads}, max_len={self.max_len}, "
                f"head_dim={self.head_dim}, dtype={self.dtype!r}, "
                + (f"kv_dtype={self.kv_dtype!r}, " if self.kv_dtype else "")
                + (f"window={self.window} (a ring of {self.store.num_pages} pages), "
                   if self.window is not None else "")
                + f"backend={self.backend.name!r}, {human_bytes(self.nbytes)})")
