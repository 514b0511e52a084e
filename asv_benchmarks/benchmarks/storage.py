"""Storage kinds: paged and quantized caches, each timed beside its contiguous / bfloat16
peer in the same run (one attention layer of Llama-3.1-8B, as everywhere in this suite).

Targets: paged decode at most 1.15x the contiguous time at page_size 16 and 1.05x at
page_size 256 (issue 12; ``PagedDecode.track_ratio_to_contiguous``); forking a
4,096-token row into 8 rows at least 50x faster paged than contiguous (issue 12;
``PagedFork.track_ratio_to_contiguous`` <= 0.02); decode over an int8 cache at most 0.6x
the time over a bfloat16 cache (issue 14; ``QuantizedDecode.track_ratio_to_bfloat16``).
Every number is lower-is-better; ratios interleave the two sides' calls (``common.ratio``).
"""

from __future__ import annotations

import numpy as np

import gqakv

from .common import BACKENDS, D, FULL, HKV, attend, backend_or_skip, fill, queries, ratio, require, sync, timing


def _filled(backend, lens, *, max_len=None, dtype="float32", seed=0, **kwargs):
    """A cache whose row b holds lens[b] random tokens, appended 512 at a time (the same
    tokens for the same ``seed`` whatever the storage): ``kwargs`` with ``page_size``
    make it a PagedKVCache, with ``kv_dtype`` a quantized KVCache, else a KVCache."""
    B = len(lens)
    max_len = max_len or max(lens)
    if "page_size" in kwargs:
        require(gqakv, "PagedKVCache")
        cache = gqakv.PagedKVCache(B, HKV, max_len, D, dtype=dtype, backend=backend, **kwargs)
    else:
        try:
            cache = gqakv.KVCache(B, HKV, max_len, D, dtype=dtype, backend=backend, **kwargs)
        except TypeError as exc:  # commits before kv_dtype
            raise NotImplementedError(f"gqakv.KVCache does not take {sorted(kwargs)} in this commit: {exc}")
        except ValueError as exc:  # commits before this codec
            raise NotImplementedError(f"gqakv.KVCache refuses {kwargs} in this commit: {exc}")
    return fill(cache, backend, lens, dtype, seed)


@timing
class PagedDecode:
    """One decode step over a PagedKVCache, against the same step over a contiguous
    KVCache holding the same tokens, in float32 and bfloat16 (the serving default: pages
    of 16 bfloat16 tokens, where the numba kernels read a page's heads together and paged
    decode costs the most, 1.2-1.3x on the 2-core AMD EPYC, 2026-12-07)."""

    CASES = {"4x4096": (4, 4096)}  # label -> (batch, live length)
    if FULL:
        CASES["32x1024"] = (32, 1024)
    params = [BACKENDS, list(CASES), [16, 256], ["float32", "bfloat16"]]
    param_names = ["backend", "batch x length", "page_size", "dtype"]
    timeout = 300

    def setup(self, backend, case, page_size, dtype):
        self.backend = backend_or_skip(backend)
        B, L = self.CASES[case]
        self.paged = _filled(self.backend, [L] * B, max_len=L + 1, page_size=page_size,
                             dtype=dtype)
        self.contiguous = _filled(self.backend, [L] * B, max_len=L + 1, dtype=dtype)
        self.q = queries(self.backend, B, 1, dtype)
        self.n_new = np.ones(B, dtype=np.int64)

    def _paged(self):
        attend(self.backend, self.q, self.paged, self.n_new)

    def time_decode_paged(self, backend, case, page_size, dtype):
        self._paged()

    def track_ratio_to_contiguous(self, backend, case, page_size, dtype):
        return ratio(self._paged, lambda: attend(self.backend, self.q, self.contiguous, self.n_new),
                     self.backend, repeats=9)

    track_ratio_to_contiguous.unit = "x contiguous time"


@timing
class PagedFork:
    """``fork`` of one row of L = 4,096 tokens into 8 rows: paged, a bookkeeping
    operation (page-table entries and reference counts; no K/V bytes copied: a shared,
    partly filled last page is copied only when a row writes into it), against the
    contiguous cache's copy of the row's tokens into each row."""

    L, ROWS, PAGE_SIZE = 4096, 8, 16
    params = [BACKENDS]
    param_names = ["backend"]
    timeout = 300

    def setup(self, backend):
        self.backend = backend_or_skip(backend)
        B, L = self.ROWS + 1, self.L
        lens = [L] + [0] * self.ROWS
        pages = -(-L // self.PAGE_SIZE)  # the source's pages: forks share them
        self.paged = _filled(self.backend, lens, page_size=self.PAGE_SIZE, num_pages=pages)
        self.contiguous = _filled(self.backend, lens)
        self.dst = list(range(1, B))

    def _fork_paged(self):
        self.paged.fork(0, self.dst)
        sync(self.backend)

    def _fork_contiguous(self):
        self.contiguous.fork(0, self.dst)
        sync(self.backend)

    def time_fork_paged(self, backend):
        self._fork_paged()

    def time_fork_contiguous(self, backend):
        self._fork_contiguous()

    def track_ratio_to_contiguous(self, backend):
        return ratio(self._fork_paged, self._fork_contiguous, self.backend, repeats=9)

    track_ratio_to_contiguous.unit = "x contiguous fork time"


@timing
class QuantizedDecode:
    """One decode step over a quantized cache (queries and outputs bfloat16): int8 /
    float8_e4m3fn (a scale per token) and the grouped codecs (a scale per block of 32 values
    along d; issue 29's target: int4 at most 0.4x), against the same step over a bfloat16
    cache holding the same input tokens."""

    CASES = {"4x4096": (4, 4096), "1x32768": (1, 32768)}  # label -> (batch, live length)
    params = [BACKENDS, list(CASES), ["int8", "float8_e4m3fn", "int8_g32", "int4_g32",
                                      "int4_g32_rotated"]]
    param_names = ["backend", "batch x length", "kv_dtype"]
    timeout = 300
    DTYPE = "bfloat16"

    def setup(self, backend, case, kv_dtype):
        self.backend = backend_or_skip(backend)
        if self.DTYPE not in getattr(self.backend, "dtypes", ()):
            raise NotImplementedError(f"{backend} does not declare {self.DTYPE}")
        B, L = self.CASES[case]
        self.quantized = _filled(self.backend, [L] * B, dtype=self.DTYPE, kv_dtype=kv_dtype)
        self.plain = _filled(self.backend, [L] * B, dtype=self.DTYPE)
        self.q = queries(self.backend, B, 1, self.DTYPE)
        self.n_new = np.ones(B, dtype=np.int64)

    def _quantized(self):
        attend(self.backend, self.q, self.quantized, self.n_new)

    def time_decode_quantized(self, backend, case, kv_dtype):
        self._quantized()

    def track_ratio_to_bfloat16(self, backend, case, kv_dtype):
        return ratio(self._quantized, lambda: attend(self.backend, self.q, self.plain, self.n_new),
                     self.backend, repeats=9)

    track_ratio_to_bfloat16.unit = "x bfloat16 cache time"


class SharedPrefix:
    """Rows that share a prefix (forked), each with 64 tokens of its own: one decode
    step's attention with the prefix's pages read once (``gqakv.ops.shared_prefix``)
    against the same rows holding copies of it, alternating in one run
    (``gqakv.tools.shared_prefix_times``). Targets: 32 rows sharing 4,096 tokens at most
    0.15x the unshared time, 8 rows sharing 1,024 at most 0.3x (numba, 2 threads,
    float32 and bfloat16; ``track_shared_over_unshared``)."""

    params = [BACKENDS, ["32 rows x 4096", "8 rows x 1024"], ["float32", "bfloat16"]]
    param_names = ["backend", "rows x shared prefix", "dtype"]
    timeout = 600
    CASES = {"32 rows x 4096": (32, 4096), "8 rows x 1024": (8, 1024)}
    SUFFIX = 64
    ROUNDS = 5
    BLOCK_S = 0.2

    def setup(self, backend, case, dtype):
        b = backend_or_skip(backend)
        try:
            from gqakv.tools.shared_prefix_times import shared_prefix_times
        except ImportError:
            raise NotImplementedError("gqakv.tools.shared_prefix_times does not exist in this commit") from None
        if dtype not in b.dtypes:
            raise NotImplementedError(f"backend {backend} has no {dtype}")
        rows, prefix = self.CASES[case]
        self.result = shared_prefix_times(b, prefix=prefix, rows=rows, suffix=self.SUFFIX,
                                          kv_heads=HKV, group=4, head_dim=D, dtype=dtype,
                                          rounds=self.ROUNDS, block_s=self.BLOCK_S)

    def track_shared_over_unshared(self, backend, case, dtype):
        return self.result["shared_over_unshared"]

    track_shared_over_unshared.unit = "x unshared copies"

    def track_shared_ms(self, backend, case, dtype):
        return self.result["median_s"]["shared"] * 1e3

    track_shared_ms.unit = "ms"

    def track_unshared_ms(self, backend, case, dtype):
        return self.result["median_s"]["unshared"] * 1e3

    track_unshared_ms.unit = "ms"
