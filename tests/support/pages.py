"""The page pool's accounting, checked after every paged operation."""

from __future__ import annotations


def audit(cache) -> None:
    """``PageTable.audit`` finds nothing (each page's reference count equals the table
    entries naming it, the free list holds exactly the unnamed pages, no page twice, each
    row holds ceil(L / page_size) pages), and the used / free counts add up."""
    problems = cache.store.page_table.audit(cache.host_lens)
    assert problems == []
    reachable = {int(p) for b in range(cache.batch) for p in cache.store.page_table.row_pages(b)}
    assert cache.pages_used == len(reachable)
    assert cache.pages_used + cache.pages_free == cache.num_pages
