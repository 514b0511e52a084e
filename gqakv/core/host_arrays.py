"""Host copies of small integer arrays from any array library (the bookkeeping inputs:
rows, n_new, page tables, draft trees)."""

from __future__ import annotations

import numpy as np


def to_numpy(x) -> np.ndarray:
    """Host copy of a small integer array from any library (list, NumPy, DLPack, CuPy)."""
    if isinstance(x, (np.ndarray, list, tuple, int, np.integer)):
        return np.asarray(x)
    if hasattr(x, "get") and type(x).__module__.startswith("cupy"):
        return x.get()
    try:
        return np.from_dlpack(x)
    except Exception:
        return np.asarray(x)
