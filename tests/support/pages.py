"""The page pool's accounting, checked after every paged operation; which backends run the
randomized paged-sequence tests."""

from __future__ import annotations

import pytest


def float64_sequence_backend_or_skip(backend, emulator_test: str) -> None:
    """Skip a randomized float64 paged sequence on ``backend`` where it cannot run (no
    float64) or would take the CUDA emulator too long (``emulator_test`` names the shorter
    test that runs the CUDA kernels instead)."""
    if "float64" not in backend.dtypes:
        pytest.skip(f"{backend.name} has no float64")
    if backend.name == "cupy_emulated":
        pytest.skip(f"the emulator's time: {emulator_test} runs the CUDA kernels on a shorter sequence")


def audit(cache) -> None:
    """``PageTable.audit`` finds nothing (each page's reference count equals the table
    entries naming it, the free list holds exactly the unnamed pages, no page twice, each
    row holds ceil(L / page_size) pages), and the used / free counts add up."""
    problems = cache.store.page_table.audit(cache.host_lens)
    assert problems == []
    reachable = {int(p) for b in range(cache.batch) for p in cache.store.page_table.row_pages(b)}
    assert cache.pages_used == len(reachable)
    assert cache.pages_used + cache.pages_free == cache.num_pages
