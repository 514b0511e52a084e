"""Layouts as objects: the store class of each layout answers for its allocation arguments,
row operations and page table; the functional paged API reads the caller's table through a
read-only view that refuses to take, share or release pages."""

from __future__ import annotations

import numpy as np
import pytest

import gqakv
from gqakv.storage.layouts import LAYOUTS, store_class
from gqakv.storage.paged import PagedStore, PageTableView
from gqakv.storage.store import KVStore


def test_layout_names_give_their_store_classes_and_refuse_unknown_ones():
    assert store_class("contiguous") is KVStore and store_class("paged") is PagedStore
    assert set(LAYOUTS) == {"contiguous", "paged"}
    with pytest.raises(ValueError, match=r"storage kind='ring' \(known: contiguous, paged\)"):
        store_class("ring")
    with pytest.raises(ValueError, match="page_size=16 and num_pages=None apply to storage='paged' only"):
        gqakv.KVCache(1, 1, 8, 4, storage="contiguous", page_size=16)
    assert PagedStore.layout_args(2, 40) == {"page_size": 16, "num_pages": None, "prefix_cache": False,
                                             "window": None, "max_chunk": None}
    assert PagedStore.layout_args(2, 40, prefix_cache=True)["prefix_cache"] is True


def test_contiguous_storage_has_no_page_table():
    cache = gqakv.KVCache(1, 1, 8, 4, backend="numpy")
    with pytest.raises(TypeError, match="storage is 'contiguous'; pages exist only"):
        cache.page_size
    assert cache.store.reserve(cache.backend, [0], [0], [3]) is None


def test_the_callers_page_table_is_read_only():
    entries = np.array([[2, 0, -1]], dtype=np.int64)
    view = PageTableView(entries, page_size=4, num_pages=3)
    entries[0, 0] = 1  # the caller's array may change afterwards: the view holds its own copy
    assert view.entries.tolist() == [[2, 0, -1]] and view.pages_per_row == 3
    with pytest.raises(ValueError):
        view.entries[0, 0] = 1
    for op in (view.reserve, view.undo, view.reorder, view.fork, view.trim, view.point):
        with pytest.raises(TypeError, match="belongs to the caller"):
            op()
