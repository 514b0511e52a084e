"""Appending K/V in place: a decode step for 32 rows, a 512-token chunk, a ragged chunk.

(What an append allocates: attention.TempMemory.)
"""

from __future__ import annotations

import numpy as np

import gqakv

from .common import BACKENDS, D, HKV, backend_or_skip, require, sync, timing

# name -> (rows, tokens per call, n_new per row)
CASES = {
    "decode 32 rows x 1": (32, 1, [1] * 32),
    "chunk 1 row x 512": (1, 512, [512]),
    "ragged chunk 4 rows x <=512": (4, 512, [512, 7, 300, 0]),
}


@timing
class Append:
    params = [BACKENDS, list(CASES)]
    param_names = ["backend", "case"]

    def setup(self, backend, case):
        self.backend = backend_or_skip(backend)
        B, T, n_new = CASES[case]
        self.n_new = np.array(n_new, dtype=np.int64)
        self.cache = gqakv.KVCache(B, HKV, 4096, D, backend=self.backend)
        require(self.cache, "truncate", what="KVCache")
        rng = np.random.default_rng(0)
        self.kv = self.backend.from_numpy(rng.standard_normal((B, HKV, T, D), dtype=np.float32),
                                          "float32")
        self.base = np.full(B, 1000, dtype=np.int64)  # rows already hold 1,000 tokens
        self.cache.append(*[self.backend.from_numpy(np.zeros((B, HKV, 1000, D), np.float32),
                                                    "float32")] * 2, self.base)
        self.rows = np.arange(B)

    def _call(self):
        self.cache.truncate(self.rows, self.base)  # O(1): back to 1,000 tokens
        self.cache.append(self.kv, self.kv, self.n_new)
        sync(self.backend)

    def time_append(self, backend, case):
        self._call()
