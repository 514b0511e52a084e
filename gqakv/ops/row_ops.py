"""Row operations of a serving loop: reorder (beam search), fork (parallel sampling),
accept (keep a verified draft-tree path),
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

from ..core.inputs import _to_numpy, check_rows, ints_1d as _ints_1d
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
    row's pages past ``ceil(new_lens[i] / page_size)``. A store whose sliding window
    released a row's first pages refuses (ValueError, nothing changed) a length whose next
    query would see released keys (``KVStore.check_keep``); 0 is always allowed.
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
        store.check_keep(r, n, "truncate")  # a sliding window's released keys: refused
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



# -- accepting a draft path (speculative decoding) --------------------------------------------


def _path_of(x, i: int, n: int) -> np.ndarray:
    """``paths[i]`` as host int64 ``[k]``: ints (not bools), in ``0..n-1``, no duplicates."""
    if isinstance(x, (list, tuple, range)):
        values = list(x)
    elif hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, (str, bytes)):
        a = _to_numpy(x)
        if a.ndim != 1:
            raise ValueError(f"paths[{i}] must be 1-D chunk indices, got shape {list(a.shape)}")
        if a.size and (a.dtype == np.bool_ or a.dtype.kind not in "iu"):
            raise TypeError(f"paths[{i}] must hold integers, got dtype {a.dtype}")
        values = [int(u) for u in a.tolist()]
    else:
        raise TypeError(f"paths[{i}] must be a sequence of chunk indices (ints), got {x!r}")
    out = np.empty(len(values), dtype=np.int64)
    for s, u in enumerate(values):
        if isinstance(u, (bool, np.bool_)) or not isinstance(u, (int, np.integer)):
            raise TypeError(f"paths[{i}][{s}]={u!r} is not an int chunk index")
        if not 0 <= int(u) < n:
            raise ValueError(f"paths[{i}][{s}]={int(u)} is outside entry {i}'s chunk 0..{n - 1} "
                             f"(its tree has n={n} tokens)")
        out[s] = int(u)
    if np.unique(out).size != out.size:
        vals, counts = np.unique(out, return_counts=True)
        raise ValueError(f"paths[{i}] names chunk token {int(vals[counts > 1][0])} twice: "
                         f"{out.tolist()}")
    return out


def plan_accept(lens: np.ndarray, paths, tree, rows=None) -> list[tuple[int, int, np.ndarray]]:
    """Validate an ``accept`` (see ``accept``) against host lengths ``lens`` ``[batch]``; returns
    ``(row, P, path)`` per entry (``P``: the row's length before the chunk). Nothing changes."""
    from ..core.tree import DraftTree

    if not isinstance(tree, DraftTree):
        raise TypeError(f"tree must be a gqakv.DraftTree, got {type(tree).__name__}; make one "
                        "with gqakv.DraftTree.of(parents_or_mask, n_new) (n_new: each entry's "
                        "chunk tokens)")
    batch, entries = len(lens), tree.batch
    if rows is None:
        if entries > batch:
            raise ValueError(f"the tree has {entries} entries, the cache {batch} rows (pass rows=)")
        r = np.arange(entries, dtype=np.int64)
    else:
        r = _row_list(rows, "rows", batch, distinct=True)
        if r.size != entries:
            raise ValueError(f"rows has {r.size} entries, the tree {entries}: one row per tree entry")
    if isinstance(paths, (str, bytes)) or not hasattr(paths, "__len__"):
        raise TypeError(f"paths must be a sequence of {entries} paths (one per entry), got {paths!r}")
    if len(paths) != entries:
        raise ValueError(f"paths has {len(paths)} entries, the tree {entries}: one path per entry")
    plan = []
    for i in range(entries):
        row, n = int(r[i]), int(tree.n[i])
        have = int(lens[row])
        if n > have:
            raise ValueError(f"entry {i}: row {row} holds {have} tokens, fewer than the tree's "
                             f"n={n} chunk tokens (accept runs after the chunk was appended)")
        path = _path_of(paths[i], i, n)
        why = tree.is_path(i, path)
        if why is not None:
            raise ValueError(f"paths[{i}]={path.tolist()} is not a root-down path of entry {i}'s "
                             f"tree: {why}")
        plan.append((row, have - n, path))
    return plan


def accept(backend, store, lengths, paths, tree, rows=None, *, trim_store=None) -> int:
    """Keep one root-down path of each entry's draft tree and drop the rest of its chunk.

    Entry i's chunk (``tree.n[i]`` tokens) is the last part of row ``rows[i]`` (default
    ``i``): slots ``P..L-1`` with ``L = lens[row]``, ``P = L - n``. ``paths[i]`` (``[k]``
    chunk indices, a path of ``tree`` from a root down; empty: reject the whole chunk)
    moves token ``P + path[s]`` to slot ``P + s`` for ``s = 0..k-1`` (stored codes and
    scales copied bit for bit, every layer, K and V), and the row then holds ``P + k``
    tokens. ``store`` has a leading layer axis (``_row_store``); ``trim_store`` (the cache's
    store) releases paged rows' pages past the new lengths. Everything is validated first,
    then (paged) every page the moves write that another row also names or the prefix
    cache holds is copied (``KVStore.reserve_moves``: OutOfPages there changes nothing);
    returns the tokens moved per layer."""
    plan = plan_accept(lengths.host, paths, tree, rows)
    if trim_store is not None:  # a sliding window's released keys: refused before any move
        trim_store.check_keep([row for row, _, _ in plan],
                              [P + path.size for _, P, path in plan], "accept draft paths of")
    moves = []
    for row, P, path in plan:
        ks = np.flatnonzero(path != np.arange(path.size))
        moves.append((row, P + ks, P + path[ks]))
    store.reserve_moves(backend, moves, lengths.host)  # copy on write: the last step that may refuse
    for row, dst, src in moves:
        store.move_tokens(row, dst, src)
    r = np.asarray([row for row, _, _ in plan], dtype=np.int64)
    new = np.asarray([P + path.size for _, P, path in plan], dtype=np.int64)
    if trim_store is not None:
        trim_store.trim_rows(r, new)
    lengths.set(r, new)
    return int(sum(d.size for _, d, _ in moves))
