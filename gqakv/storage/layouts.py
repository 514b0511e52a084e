"""The storage layouts by name (``StorageSpec.kind``): each a ``KVStore`` class owning its
allocation, bytes, reading, writing and row operations (contiguous rows: ``KVStore``;
pages and a page table: ``gqakv.storage.paged.PagedStore``). A new layout is one store class
plus one entry here; callers ask the class, never the name."""

from __future__ import annotations

from .paged import PagedStore
from .store import CONTIGUOUS, PAGED, KVStore

#: Layout name -> its store class.
LAYOUTS: dict[str, type[KVStore]] = {CONTIGUOUS: KVStore, PAGED: PagedStore}


def store_class(kind: str) -> type[KVStore]:
    """The store class of layout ``kind``; ValueError naming the known layouts."""
    try:
        return LAYOUTS[kind]
    except KeyError:
        raise ValueError(f"storage kind={kind!r} (known: {', '.join(LAYOUTS)})") from None
