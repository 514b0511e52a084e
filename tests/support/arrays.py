"""Moving NumPy test data into a backend's array library and back."""

from __future__ import annotations

import numpy as np


class BackendArrays:
    """Moves NumPy test data into a backend's library and back."""

    def __init__(self, backend):
        self.backend = backend
        self.xp = backend.namespace()

    def asarray(self, a, dtype=None):
        a = np.asarray(a)
        return self.backend.from_numpy(a, dtype or a.dtype.name)

    def to_numpy(self, x, dtype=np.float64):
        return np.asarray(self.backend.to_numpy(x)).astype(dtype)
