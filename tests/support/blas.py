"""NumPy's BLAS, for tests of the thread rules that depend on it."""

from __future__ import annotations

import pytest


def openblas_pthreads_or_skip():
    """threadpoolctl, where NumPy's BLAS is OpenBLAS's pthreads build (the one whose idle
    threads spin, ``cpu_plan.blas_spins``); skips the test elsewhere, naming what it found."""
    threadpoolctl = pytest.importorskip("threadpoolctl")
    blas = [i for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"]
    if not any(i["internal_api"] == "openblas" and i.get("threading_layer") == "pthreads"
               for i in blas):
        pytest.skip(f"NumPy's BLAS here is not OpenBLAS on pthreads: {blas}")
    return threadpoolctl
