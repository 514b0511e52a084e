"""Row copies of a contiguous layout, planned on the host: independent copies in *waves*.

The copies of one wave are independent (no destination of a wave is read by the same
wave), so a backend can run a wave as a single ``Backend.copy_tokens`` launch.
``plan_reorder`` orders them so no row is overwritten before every row that reads it has
been written; ``run_waves`` runs a plan; ``copy_tokens_array_api`` is the generic copy.
Used by ``KVStore.reorder_rows`` / ``fork_rows`` (a paged layout moves no data).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: Row index meaning "the one-row temporary" in a reorder plan.
TEMP = -1


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


# -- running them ---------------------------------------------------------------------------


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
