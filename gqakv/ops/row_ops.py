"""Row operations of a serving loop: reorder (beam search), fork (parallel sampling),
truncate (speculative-decoding rollback) and reset (row reuse).

They act on a ``KVStore`` with a leading layer axis (a standalone KVCache passes its
store with a leading axis of 1) and on the shared ``Lengths``. On paged storage
(``gqakv.storage.paged``) they move no data: reorder and fork share pages through the page
table, truncate and reset release the pages no row names any more. Every
operation validates all of its arguments before it touches anything, so a rejected
call changes nothing. Only live tokens move: row ``b``'s copy costs ``lens[b]``
tokens per layer, never ``max_len``; truncate and reset move no data at all.

Copies go through ``Backend.copy_tokens`` in *waves*: the copies of one wave are
independent (no destination of a wave is read by the same wave), so a backend can run
a wave as a single kernel launch. ``plan_reorder`` orders them so no row is
overwritten before every row that reads it has been written.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core.inputs import check_rows, host_ints
from ..storage.store import PAGED

#: Row index meaning "the one-row temporary" in a reorder plan.
TEMP = -1


# -- validation ------------------------------------------------------------------------------


def _row_list(rows, what: str, batch: int, *, distinct: bool) -> np.ndarray:
    """``rows`` (an int, a sequence or a 1-D int array) as host int64 [n], every entry in
    0..batch-1 (and distinct if asked)."""
    return check_rows(_ints_1d(rows, what), what, batch, distinct=distinct)


def _ints_1d(x, what: str) -> np.ndarray:
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        x = [x]
    if isinstance(x, (list, tuple, range)):
        x = list(x)
        return host_ints(x, what, len(x))  # checks the elements before NumPy sees them
    shape = tuple(getattr(x, "shape", ()))
    if len(shape) != 1:
        raise ValueError(f"{what} must be a 1-D list of integers, got {x!r}")
    return host_ints(x, what, int(shape[0]))


def _row(x, what: str, batch: int) -> int:
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
        raise TypeError(f"{what} must be an int row index, got {x!r}")
    if not 0 <= x < batch:
        raise ValueError(f"{what}={int(x)} is out of range for a cache of {batch} rows")
    return int(x)


# -- planning (host only) -------------------------------------------------------------------


@dataclass(frozen=True)
class Wave:
    """Independent copies: ``dst_rows[i]`` takes the first ``n_tokens[i]`` tokens of
    ``src_rows[i]``. ``TEMP`` in either list means the one-row temporary buffer (a wave
    touching it holds only that copy)."""

    dst_rows: np.ndarray
    src_rows: np.ndarray
    n_tokens: np.ndarray


def plan_reorder(src_rows: np.ndarray, lens: np.ndarray) -> list[Wave]:
    """Copies that make row b hold what row ``src_rows[b]`` holds, in a safe order.

    Row b must be written only after every row that reads b has been written. Rows no
    one still reads are written first, in waves; what remains are cycles
    (b1 <- b2 <- ... <- bk <- b1), each broken by saving its shortest row to the
    temporary. Token counts are the live lengths of the source rows before the call;
    rows with ``src_rows[b] == b`` cost nothing.
    """
    src = [int(s) for s in src_rows]
    pending = {b for b, s in enumerate(src) if s != b}  # rows still to be written
    readers: dict[int, int] = {}  # row -> number of pending rows that still read it
    for b in pending:
        readers[src[b]] = readers.get(src[b], 0) + 1
    waves: list[Wave] = []

    def wave(dst, srcs, n):
        waves.append(Wave(np.asarray(dst, dtype=np.int64), np.asarray(srcs, dtype=np.int64),
                          np.asarray(n, dtype=np.int64)))

    ready = sorted(b for b in pending if readers.get(b, 0) == 0)
    while pending:
        while ready:
            wave(ready, [src[b] for b in ready], [lens[src[b]] for b in ready])
            nxt = []
            for b in ready:
                pending.discard(b)
                s = src[b]
                readers[s] -= 1
                if readers[s] == 0 and s in pending:
                    nxt.append(s)
            ready = sorted(nxt)
        if not pending:
            break
        # Only cycles remain: every pending row is read by exactly one pending row.
        start = min(pending, key=lambda b: (lens[b], b))
        cycle = [start]
        while src[cycle[-1]] != start:
            cycle.append(src[cycle[-1]])
        wave([TEMP], [start], [lens[start]])
        for b in cycle[:-1]:  # b takes its source, which is read by no one else now
            wave([b], [src[b]], [lens[src[b]]])
        wave([cycle[-1]], [TEMP], [lens[start]])
        pending.difference_update(cycle)
        for b in cycle:
            readers[src[b]] -= 1
    return waves


# -- generic copy (Backend.copy_tokens default) ------------------------------------------------


def copy_tokens_array_api(dst, dst_rows, src, src_rows, n_tokens) -> None:
    """Row ``dst_rows[i]`` of store ``dst`` takes tokens ``:n_tokens[i]`` of row ``src_rows[i]``
    of ``src``, every layer (``KVStore.copy_row``: one slice assignment per row for
    contiguous storage). The copies are independent (a wave), so their order does not matter.
    """
    for i in range(len(dst_rows)):
        n = int(n_tokens[i])
        if n == 0:
            continue
        dst.copy_row(int(dst_rows[i]), src, int(src_rows[i]), n)


def run_waves(backend, store, waves: list[Wave]) -> int:
    """Run a plan on ``store`` (leading layer axis); returns tokens copied per layer. The
    temporary is one row (``KVStore.temporary``) of the longest row any cycle saves,
    allocated only when a cycle needs it and before the first copy, so a MemoryError there
    leaves the store untouched."""
    saved = [int(w.n_tokens[0]) for w in waves if w.dst_rows[0] == TEMP]
    temp = store.temporary(backend, max(saved)) if saved else None
    copied = 0
    for w in waves:
        copied += int(w.n_tokens.sum())
        if w.dst_rows[0] == TEMP:
            backend.copy_tokens(temp, [0], store, w.src_rows, w.n_tokens)
        elif w.src_rows[0] == TEMP:
            backend.copy_tokens(store, w.dst_rows, temp, [0], w.n_tokens)
        else:
            backend.copy_tokens(store, w.dst_rows, store, w.src_rows, w.n_tokens)
    return copied


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
    if store.kind == PAGED:
        store.table.reorder(src)
        copied = 0
    else:
        copied = run_waves(backend, store, plan_reorder(src, old))
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
    if store.kind == PAGED:  # shared pages; the last is copied when a row writes into it
        store.table.fork(s, dst)
        lengths.set(dst, np.full(dst.size, n))
        return 0
    backend.copy_tokens(store, dst, store, np.full(dst.size, s), np.full(dst.size, n))
    lengths.set(dst, np.full(dst.size, n))
    return n * int(dst.size)


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
    if store is not None and store.kind == PAGED:
        store.table.trim(r, n)
    lengths.set(r, n)


def reset(lengths, rows=None, *, store=None) -> None:
    """Empty ``rows`` (distinct; default every row) so new requests can reuse them (a
    paged ``store`` releases their pages)."""
    batch = len(lengths.host)
    r = np.arange(batch) if rows is None else _row_list(rows, "rows", batch, distinct=True)
    if store is not None and store.kind == PAGED:
        store.table.trim(r, np.zeros(r.size, dtype=np.int64))
    lengths.set(r, np.zeros(r.size, dtype=np.int64))
