"""The page pool's accounting, checked after every paged operation; a cache's state to
compare before and after a refused call; poison for pages no row names; which backends
run the randomized paged-sequence tests."""

from __future__ import annotations

import math
import weakref

import numpy as np
import pytest


def float64_sequence_backend_or_skip(backend, emulator_test: str) -> None:
    """Skip a randomized float64 paged sequence on ``backend`` where it cannot run (no
    float64) or would take the CUDA emulator too long (``emulator_test`` names the shorter
    test that runs the CUDA kernels instead)."""
    if "float64" not in backend.dtypes:
        pytest.skip(f"{backend.name} has no float64")
    if backend.name == "cupy_emulated":
        pytest.skip(f"the emulator's time: {emulator_test} runs the CUDA kernels on a shorter sequence")


#: table -> (its entries' bytes, its version) at the last ``audit``
_AUDITED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def audit(cache) -> None:
    """``PageTable.audit`` finds nothing (each page's reference count equals the table
    entries naming it, the free list holds exactly the unnamed pages, no page twice, each
    row holds ceil(L / page_size) pages), the used / free counts add up, and the entries
    changed since the last audit of the table only with a new ``version`` (the CuPy
    backend keeps its device copy of the table by version, not by bytes)."""
    table = cache.store.page_table
    problems = table.audit(cache.host_lens)
    assert problems == []
    now = (table.entries.tobytes(), table.version)
    last = _AUDITED.get(table)
    if last is not None and last[0] != now[0]:
        assert now[1] != last[1], (f"the page table's entries changed at version {now[1]} "
                                   "(a write that does not count PageTable.version)")
    _AUDITED[table] = now
    reachable = {int(p) for b in range(cache.batch) for p in cache.store.page_table.row_pages(b)}
    assert cache.pages_used == len(reachable)
    assert cache.pages_used + cache.pages_free == cache.num_pages


def poison_unnamed(cache) -> None:
    """NaN into every K/V slot of every page no row names (free, released or cached
    unused), on every layer: a read of a released page then shows in the output."""
    stores = ([s for _, _, s in cache.store.groups] if hasattr(cache.store, "groups")
              else [cache.store])
    for store in stores:
        t = store.page_table
        named = {int(p) for b in range(t.entries.shape[0]) for p in t.row_pages(b)}
        lead = (slice(None),) * len(store.leading)
        for p in range(t.num_pages):
            if p not in named:
                for buf in (store.k, store.v):
                    buf[(*lead, p, ...)] = math.nan


def state(cache, arrays):
    """What a refused call must leave as it was: lengths, the page table and K."""
    t = cache.store.page_table
    return (cache.host_lens.copy(), t.entries.copy(), t.held.copy(), t.released.copy(),
            t.refs.copy(), list(t._free), arrays.to_numpy(cache.k).copy())


def assert_same_state(a, b):
    """Two ``state`` snapshots are equal, element for element."""
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def float_bits(x):
    """A float array's bytes (to compare bit for bit, NaNs included); other arrays as they are."""
    x = np.asarray(x)
    return x.view(np.uint8) if x.dtype.kind == "f" else x
