"""The functional paged layer: attention, append and accept over caller-owned page pools.

For engines that run their own page allocator (vLLM-, FlashInfer-style): the caller owns
the pools, the page table and the lengths; gqakv owns none of them and keeps no state
between calls. Each call wraps the caller's arrays in a ``gqakv.storage.paged.PagedStore`` (no
copy of the pools; the page table is read on the host) and dispatches to the backend
exactly as ``gqa_attention`` / ``KVCache.append`` do, so every backend's paged path
serves it and the results equal a ``PagedKVCache`` holding the same tokens.

Layout (as ``gqakv.storage.paged``): K and V pools ``[num_pages, Hkv, page_size, d]`` each;
row b's token j of KV head h is at ``pool[page_table[b, j // P], h, j % P, :]``
(``P = page_size``). Entries of ``page_table[b]`` past the ``ceil(L / P)`` pages a row's
``L`` tokens need are never read (they may hold anything, e.g. -1); the entries a row
does use name distinct pages.

One convention for both calls: ``lens[b]`` is row b's length *after* this step's tokens
(its ``n_new[b]`` newest included), as in ``gqa_attention``. A step passes
``paged_append`` and ``paged_attention`` the same ``page_table``, ``lens`` and ``n_new``.
"""

from __future__ import annotations

import numpy as np

from ..core import dtypes as _dtypes
from ..ops.plan import AttentionPlan
from .cache import write
from ..core.inputs import (_to_numpy, batch_of_n_new, check_flag, check_outputs,
                           check_same_layout, host_ints, validate_append, validate_attention)
from ..storage.paged import PagedStore, PageTableView, pages_for
from ..dispatch.registry import get_backend, list_backends
from ..storage.store import PAGED, StorageSpec


class _PoolView:
    """What the input validators read from a cache (backend, dimensions, store, lengths),
    over a caller's pools: ``batch`` rows of ``max_len = pages_per_row * page_size`` slots."""

    def __init__(self, backend, store: PagedStore, lens: np.ndarray):
        self.backend, self.store = backend, store
        self.batch, self.kv_heads, self.head_dim = store.rows, store.kv_heads, store.head_dim
        self.max_len = store.max_len
        self.host_lens = lens


def _pick_backend(backend, k_pages, dtype: str, head_dim: int):
    """``backend`` resolved as ``get_backend`` does; None: the scoped/default choice when it
    holds ``k_pages``' library, else the first registered backend that holds it."""
    if backend is not None:
        return get_backend(backend, dtype=dtype, head_dim=head_dim)
    chosen = get_backend(None, dtype=dtype, head_dim=head_dim)
    if chosen.owns(k_pages):
        return chosen
    for candidate in list_backends():
        if (not candidate.not_supported_reasons(dtype=dtype, head_dim=head_dim)
                and candidate.owns(k_pages)):  # owns() of a backend that cannot run may fail
            return candidate
    raise TypeError(f"k_pages is a {type(k_pages).__module__}.{type(k_pages).__name__}; no "
                    f"registered backend holds such arrays with dtype {dtype}, d={head_dim}")


def _check_pools(k_pages, v_pages) -> tuple[str, tuple[int, int, int, int]]:
    """The pools' dtype name and shape ``(num_pages, Hkv, P, d)``; errors naming the argument."""
    for what, x in (("k_pages", k_pages), ("v_pages", v_pages)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{what} must be an array [num_pages, Hkv, page_size, d], got {x!r}")
        if len(x.shape) != 4:
            raise ValueError(f"{what} must be [num_pages, Hkv, page_size, d], got "
                             f"{len(x.shape)} dims {list(x.shape)}")
    num_pages, kv_heads, page_size, head_dim = (int(s) for s in k_pages.shape)
    shape = (num_pages, kv_heads, page_size, head_dim)
    if shape != tuple(int(s) for s in v_pages.shape) or type(k_pages) is not type(v_pages):
        raise ValueError(f"k_pages {list(k_pages.shape)} ({type(k_pages).__name__}) and v_pages "
                         f"{list(v_pages.shape)} ({type(v_pages).__name__}) must be arrays of "
                         "one library and one shape")
    try:
        dtype = _dtypes.canonical_name(k_pages.dtype)
    except TypeError:
        raise TypeError(f"k_pages has dtype {k_pages.dtype}; the pools hold float32, float16, "
                        "bfloat16 or float64 (quantized pools are PagedKVCache(kv_dtype=...)'s)"
                        ) from None
    if k_pages.dtype != v_pages.dtype:
        raise TypeError(f"k_pages has dtype {dtype}, v_pages {v_pages.dtype}: one dtype for both")
    for name, value in zip(("Hkv", "page_size", "d"), shape[1:]):
        if value < 1:
            raise ValueError(f"the pools are {list(shape)}: {name}={value} must be >= 1")
    return dtype, shape


def _check_table(page_table, batch: int, num_pages: int) -> np.ndarray:
    """``page_table`` as a host int32 ``[batch, pages_per_row]`` copy (entries unchecked)."""
    if page_table is None or isinstance(page_table, (bool, np.bool_)):
        raise TypeError(f"page_table must be integers [B, pages_per_row], got {page_table!r}")
    t = _to_numpy(page_table)
    if t.dtype.kind not in "iu" or t.dtype == np.bool_:
        raise TypeError(f"page_table must have an integer dtype (int32), got {t.dtype}")
    if t.ndim != 2 or t.shape[0] != batch:
        raise ValueError(f"page_table must be [B={batch}, pages_per_row] (one row per batch "
                         f"entry), got {list(t.shape)}")
    return np.asarray(t, dtype=np.int64)


def _check_pages(table: np.ndarray, ends: np.ndarray, page_size: int, num_pages: int,
                 what: str) -> None:
    """Row b's first ``ceil(ends[b] / P)`` entries name pages of the pool, and the table has
    that many entries; ValueError naming the row, entry and page otherwise."""
    per_row = table.shape[1]
    for b in range(table.shape[0]):
        need = pages_for(int(ends[b]), page_size)
        if need > per_row:
            raise ValueError(
                f"row {b} {what} {int(ends[b])} tokens, which need {need} pages of "
                f"{page_size}, but page_table has {per_row} entries per row")
        live = table[b, :need]
        bad = np.flatnonzero((live < 0) | (live >= num_pages))
        if bad.size:
            j = int(bad[0])
            raise ValueError(
                f"page_table[{b}, {j}]={int(live[j])} is not a page of the pool (0.."
                f"{num_pages - 1}); row {b} {what} {int(ends[b])} tokens, so its first "
                f"{need} entries must name pages")


def _check_distinct(table: np.ndarray, ends: np.ndarray, page_size: int) -> None:
    """Row b's first ``ceil(ends[b] / P)`` entries name distinct pages (two entries naming
    one page would put two of the row's tokens in one slot); ValueError naming the row,
    the page, its two entries and the tokens that would share its slots otherwise."""
    need = -(-ends.astype(np.int64) // page_size)  # [B] entries each row's tokens use
    width = int(need.max(initial=0))
    if width < 2:
        return
    col = np.arange(width)
    # entries past a row's need become distinct negatives, so only live entries can collide
    keyed = np.where(col[None, :] < need[:, None], table[:, :width], -1 - col[None, :])
    order = np.argsort(keyed, axis=1, kind="stable")
    ranked = np.take_along_axis(keyed, order, axis=1)
    dup = (ranked[:, 1:] == ranked[:, :-1]) & (ranked[:, 1:] >= 0)
    if not dup.any():
        return
    b, i = (int(x) for x in np.argwhere(dup)[0])
    j1, j2 = int(order[b, i]), int(order[b, i + 1])  # j1 < j2: a stable sort
    page, P, end = int(ranked[b, i]), page_size, int(ends[b])
    span = [f"{j * P}..{min((j + 1) * P, end) - 1}" for j in (j1, j2)]
    raise ValueError(
        f"row {b} names page {page} twice (page_table[{b}, {j1}] and page_table[{b}, {j2}]): "
        f"its tokens {span[0]} and {span[1]} (of {end}) would share that page's slots, so "
        f"writing one would overwrite the other; a row's pages must be distinct")


def _wrap(k_pages, v_pages, page_table, lens, batch: int, backend):
    """Validated (backend, store, host lens [B]) over the caller's arrays (no copy of the
    pools), entries of the table unchecked."""
    dtype, (num_pages, _, P, d) = _check_pools(k_pages, v_pages)
    backend = _pick_backend(backend, k_pages, dtype, d)
    for what, x in (("k_pages", k_pages), ("v_pages", v_pages)):
        if not backend.owns(x):
            raise TypeError(f"{what} is a {type(x).__module__}.{type(x).__name__}, but backend "
                            f"{backend.name!r} holds {backend.array_library} arrays")
    if backend.device_of(v_pages) != backend.device_of(k_pages):
        raise ValueError(f"k_pages is on {backend.device_of(k_pages)}, v_pages on "
                         f"{backend.device_of(v_pages)}: one device for both")
    table = _check_table(page_table, batch, num_pages)
    L = host_ints(lens, "lens", batch)
    if (L < 0).any():
        b = int(np.flatnonzero(L < 0)[0])
        raise ValueError(f"lens[{b}]={int(L[b])} is negative")
    # entries outside the pool are clipped to -1 only after _check_pages proved them unread
    pages = PageTableView(np.where((table >= 0) & (table < num_pages), table, -1), P, num_pages)
    store = PagedStore(StorageSpec.of(dtype, PAGED), k_pages, v_pages, pages, batch,
                       table.shape[1] * P)
    return backend, store, L, table


def _batch_of(x, n_new, what: str, shape_doc: str) -> int:
    """B: dim 0 of a padded ``x`` ``[B, H, T, d]``, n_new's length for a packed ``[N, H, d]``."""
    if not hasattr(x, "shape") or len(x.shape) not in (3, 4):
        raise ValueError(f"{what} must be {shape_doc}, got "
                         f"{list(getattr(x, 'shape', [])) if hasattr(x, 'shape') else repr(x)}")
    return int(x.shape[0]) if len(x.shape) == 4 else batch_of_n_new(n_new)


def paged_attention(q, k_pages, v_pages, page_table, lens, n_new, *, scale: float | None = None,
                    window: int | None = None, softcap: float | None = None, sinks=None,
                    return_lse: bool = False, backend=None, alibi_slopes=None, out=None,
                    lse_out=None, tree=None):
    """Causal grouped-query attention of the newest tokens over caller-owned page pools;
    ``gqa_attention``'s semantics, variants and results for a paged layout the caller manages.

    Args:
        q: ``[B, Hq, T, d]`` queries of each row's newest tokens, in the pools' dtype and
            array library, or packed ``[N, Hq, d]`` (``N = sum(n_new)``: row b's queries
            at ``offsets[b]..offsets[b] + n_new[b] - 1``, ``offsets`` the exclusive
            cumulative sum of n_new, i.e. ``cu_seqlens[:-1]``). ``Hq`` a multiple of
            ``Hkv``; query head ``h`` reads KV head ``h // (Hq // Hkv)``.
        k_pages, v_pages: the pools, ``[num_pages, Hkv, P, d]`` each (P = page_size; one
            float dtype: float32, float16, bfloat16 or float64; one device). Row b's token j
            of KV head h is ``k_pages[page_table[b, j // P], h, j % P, :]``. Read only.
        page_table: ``[B, pages_per_row]`` integers (int32), any library (read on the host):
            row b's pages in token order. Only its first ``ceil(lens[b] / P)`` entries are
            read; each must be in ``0..num_pages-1``, and distinct within the row; later
            entries may hold anything (-1). Rows may name the same pages (a shared prefix,
            beams).
        lens: ``[B]`` ints: tokens in row b *after* the append of these queries' tokens,
            i.e. including its ``n_new[b]`` newest (``gqa_attention``'s convention, and
            ``paged_append``'s: one step passes both calls the same ``lens`` and ``n_new``).
        n_new: ``[B]`` ints, ``0 <= n_new[b] <= min(T, lens[b])``: row b's queries are
            ``q[b, :, :n_new[b]]``, its tokens ``lens[b] - n_new[b] .. lens[b] - 1``; slots
            ``t >= n_new[b]`` are padding and return exactly 0.
        scale, window, softcap, sinks, alibi_slopes, return_lse, out, lse_out, tree: as
            ``gqa_attention``.
        backend: a backend name or Backend; None: the default backend when it holds the
            pools' library, else the first registered backend that does.

    Mask (bottom-right causal, ``gqakv.core.semantics``): with ``L = lens[b]`` and ``n =
    n_new[b]``, query t sits at position ``p = L - n + t`` and sees keys ``0..p`` (with a
    window W, only ``max(0, p - W + 1)..p``). For L = 6, n = 3 (x visible, . masked)::

                 keys 0 1 2 3 4 5
        query 0 (p=3)   x x x x . .
        query 1 (p=4)   x x x x x .
        query 2 (p=5)   x x x x x x

    Slots at or past ``L`` are never read, whatever the pool holds there.

    Everything is validated first (TypeError/ValueError naming the argument and value):
    the pools' shapes and dtypes, the table's shape and every entry it must name, lens
    and n_new, q and the variants.

    Returns:
        ``out`` ``[B, Hq, T, d]`` in q's dtype (packed: ``[N, Hq, d]``), or ``(out, lse)``
        with ``return_lse`` (``lse`` ``[B, Hq, T]`` / ``[N, Hq]``, float32, float64 for
        float64 pools).
    """
    return_lse = check_flag(return_lse, "return_lse")
    B = _batch_of(q, n_new, "q", "[B, Hq, T, d] or packed [N, Hq, d]")
    backend, store, L, table = _wrap(k_pages, v_pages, page_table, lens, B, backend)
    view = _PoolView(backend, store, L)
    inputs = validate_attention(view, q, n_new, None, scale, None, window=window,
                                softcap=softcap, sinks=sinks, alibi_slopes=alibi_slopes,
                                tree=tree)
    _check_pages(table, L, store.page_size, store.num_pages, "holds")
    _check_distinct(table, L, store.page_size)
    q_shape = tuple(int(s) for s in q.shape)
    check_outputs(view, q_shape, out, lse_out)
    return AttentionPlan(view, q_shape, inputs).launch(q, store, return_lse, out, lse_out)


def paged_append(k_pages, v_pages, page_table, lens, k_new, v_new, n_new, *, backend=None) -> None:
    """Write each row's new tokens into caller-owned page pools, in place (nothing is
    returned).

    ``lens`` and ``n_new`` are what ``paged_attention`` takes for the same step: advance
    the lengths and allocate the pages first, then ``paged_append(..., lens, ...)`` and
    ``paged_attention(..., lens, n_new)`` with the same arrays.

    Args:
        k_pages, v_pages: the pools, ``[num_pages, Hkv, P, d]`` each, as ``paged_attention``;
            written in place.
        page_table: ``[B, pages_per_row]`` integers (int32): row b's pages in token order;
            its first ``ceil(lens[b] / P)`` entries must name distinct pages of the pool
            (the caller allocates the pages before the call).
        lens: ``[B]`` ints: tokens in row b *after* this append, its new ones included
            (``paged_attention``'s convention): the new tokens land at
            ``lens[b] - n_new[b] .. lens[b] - 1``, so ``n_new[b] <= lens[b]``.
        k_new, v_new: ``[B, Hkv, T, d]`` in the pools' dtype and library, or packed
            ``[N, Hkv, d]`` (every row's ``n_new[b]`` tokens end to end, as ``paged_attention``'s q).
        n_new: ``[B]`` ints, ``0 <= n_new[b] <= min(T, lens[b])``: the first ``n_new[b]``
            slots of entry b are real tokens; the rest is padding and is not written.
        backend: as ``paged_attention``.

    Sharing: gqakv writes exactly the slots above. A page that other rows also name must
    be copied by the caller before a row writes into it (copy on write, as
    ``PagedKVCache`` does for a shared, partly filled last page); a page two rows of one
    call would write is refused (ValueError), and so is a row naming one page twice.

    Everything is validated before anything is written: on error (TypeError/ValueError
    naming the argument, row and numbers) the pools are unchanged.
    """
    backend, store, inputs = _validate_paged_append(k_pages, v_pages, page_table, lens, k_new,
                                                    v_new, n_new, backend)
    write(backend, store, k_new, v_new, inputs)


def _validate_paged_append(k_pages, v_pages, page_table, lens, k_new, v_new, n_new, backend):
    """``paged_append``'s checks: (backend, store over the pools, AppendInputs)."""
    B = _batch_of(k_new, n_new, "k_new", "[B, Hkv, T, d] or packed [N, Hkv, d]")
    backend, store, L, table = _wrap(k_pages, v_pages, page_table, lens, B, backend)
    n = host_ints(n_new, "n_new", B)
    for b in range(B):
        if n[b] > L[b]:
            raise ValueError(
                f"n_new[{b}]={int(n[b])} is more than lens[{b}]={int(L[b])}: lens counts row "
                f"{b}'s tokens after this append, its n_new[{b}] new ones included (as "
                "paged_attention takes it); the new tokens land at lens - n_new .. lens - 1")
    P = store.page_size
    _check_pages(table, L, P, store.num_pages, "holds after this append")
    _check_distinct(table, L, P)
    # validate_append reads the lengths before the append (negative n_new: it raises)
    view = _PoolView(backend, store, L - np.maximum(n, 0))
    inputs = validate_append(view, k_new, v_new, n_new)
    ends = inputs.starts + inputs.n_new
    writer: dict[int, int] = {}  # page -> the row writing it
    for b in range(B):  # the pages this call writes: each by one row only
        if inputs.n_new[b] == 0:
            continue
        for j in range(int(inputs.starts[b]) // P, pages_for(int(ends[b]), P)):
            page = int(table[b, j])
            if page in writer:  # another row's: a row's own pages are distinct (checked)
                raise ValueError(
                    f"page {page} would be written by rows {writer[page]} and {b} "
                    f"(page_table[{writer[page]}, ...] and page_table[{b}, {j}]); copy a "
                    "shared page before a row writes into it")
            writer[page] = b
    return backend, store, inputs


def paged_append_attention(q, k_new, v_new, k_pages, v_pages, page_table, lens, n_new, *,
                           scale: float | None = None, window: int | None = None,
                           softcap: float | None = None, sinks=None, return_lse: bool = False,
                           backend=None, alibi_slopes=None, out=None, lse_out=None, tree=None):
    """``paged_append`` of ``k_new`` / ``v_new`` then ``paged_attention`` of ``q`` over the
    same caller-owned pools, in one call (FlashAttention's ``flash_attn_with_kvcache``
    with a page table): everything both calls check is validated before anything is
    written, so a refused call leaves the pools unchanged.

    ``lens`` counts each row's tokens *after* this append (its ``n_new[b]`` new ones
    included); q, k_new and v_new are all padded (``[B, H, T, d]``) or all packed
    (``[N, H, d]``, ``N = sum(n_new)``). Arguments, mask and results: as
    ``paged_append`` and ``paged_attention``.
    """
    return_lse = check_flag(return_lse, "return_lse")
    check_same_layout(q, k_new)
    backend, store, append = _validate_paged_append(k_pages, v_pages, page_table, lens, k_new,
                                                    v_new, n_new, backend)
    view = _PoolView(backend, store, host_ints(lens, "lens", store.rows))
    inputs = validate_attention(view, q, n_new, None, scale, None, window=window,
                                softcap=softcap, sinks=sinks, alibi_slopes=alibi_slopes,
                                tree=tree)
    q_shape = tuple(int(s) for s in q.shape)
    check_outputs(view, q_shape, out, lse_out)
    plan = AttentionPlan(view, q_shape, inputs)
    write(backend, store, k_new, v_new, append)
    return plan.launch(q, store, return_lse, out, lse_out)


def paged_accept(k_pages, v_pages, page_table, lens, paths, tree, *, backend=None) -> np.ndarray:
    """Keep one verified path of each row's draft tree in caller-owned page pools
    (``RowsAndLengths.accept`` for the functional paged API); returns the new lengths.

    Args:
        k_pages, v_pages: the pools, ``[num_pages, Hkv, P, d]`` each, as ``paged_attention``;
            tokens move in place.
        page_table: ``[B, pages_per_row]`` integers: row b's pages; its first
            ``ceil(lens[b] / P)`` entries must name distinct pages of the pool.
        lens: ``[B]`` ints: row b's tokens, its draft chunk included (as after
            ``paged_append``).
        paths: ``[B]`` paths: ``paths[b]`` chunk indices of row b's tree from a root down
            (may be empty: reject the chunk).
        tree: a ``gqakv.DraftTree`` of B entries; ``tree.n[b]`` is row b's chunk tokens.
        backend: as ``paged_attention``.

    Row b's chunk is slots ``lens[b] - n .. lens[b] - 1``; token ``paths[b][s]`` moves to
    slot ``lens[b] - n + s``. Everything is validated before anything moves, and a page
    the moves would write that another row's live entries also name is refused
    (ValueError): copy it first. Returns ``[B]`` int64 host lengths, ``lens[b] - n +
    len(paths[b])``; the caller frees the pages past them.
    """
    from ..core.tree import DraftTree
    from ..ops import row_ops

    if not isinstance(tree, DraftTree):
        row_ops.plan_accept(np.zeros(0, dtype=np.int64), paths, tree)  # the TypeError
    B = tree.batch
    backend, store, L, table = _wrap(k_pages, v_pages, page_table, lens, B, backend)
    P = store.page_size
    _check_pages(table, L, P, store.num_pages, "holds")
    _check_distinct(table, L, P)
    plan = row_ops.plan_accept(L, paths, tree)
    need = [pages_for(int(L[b]), P) for b in range(B)]
    owners: dict[int, list[int]] = {}
    for b in range(B):
        for page in table[b, :need[b]].tolist():
            owners.setdefault(int(page), []).append(b)
    moves = []
    for row, start, path in plan:
        ks = np.flatnonzero(path != np.arange(path.size))
        dst, src = start + ks, start + path[ks]
        for j in sorted({int(d) // P for d in dst}):
            page = int(table[row, j])
            others = [o for o in owners[page] if o != row]
            if others:
                raise ValueError(
                    f"row {row}'s page {page} (page_table[{row}, {j}]) would be written by "
                    f"accept, but rows {others} also name it; copy a shared page before a row "
                    "writes into it. Nothing was changed")
        moves.append((row, dst, src))
    rows_store = store.with_layers(backend.namespace())
    for row, dst, src in moves:
        rows_store.move_tokens(row, dst, src)
    new = L.astype(np.int64).copy()
    for row, start, path in plan:
        new[row] = start + path.size
    return new


__all__ = ["paged_accept", "paged_append", "paged_append_attention", "paged_attention"]
