"""Shared set-up for the benchmarks: backends as parameters, filled caches, peers.

Shapes are one attention layer of Llama-3.1-8B: 32 query heads, 8 KV heads, head dim
128. Backends come from gqakv's registry; one that cannot run here makes ``setup``
raise NotImplementedError, which asv reports as skipped.
"""

from __future__ import annotations

import math
import time
import tracemalloc

import numpy as np

import gqakv
from gqakv import bench

HQ, HKV, D = 32, 8, 128
# Conformance backends: correct, not meant to be fast, so not benchmarked.
NOT_BENCHMARKED = {"array_api_strict"}
BACKENDS = [b.name for b in gqakv.list_backends() if b.name not in NOT_BENCHMARKED]


def backend_or_skip(name: str):
    """The named backend, or NotImplementedError (asv: skipped) saying why it cannot run."""
    try:
        backend = gqakv.get_backend(name)
    except Exception as exc:
        raise NotImplementedError(f"{name}: {exc}") from None
    return backend


def filled_cache(backend, lens, max_len=None, dtype="float32", seed=0):
    """A KVCache whose row b holds lens[b] random tokens (written in a few appends)."""
    B = len(lens)
    max_len = max_len or max(lens)
    cache = gqakv.KVCache(B, HKV, max_len, D, dtype=dtype, backend=backend)
    rng = np.random.default_rng(seed)
    block = min(512, max(1, max(lens)))
    data = backend.from_numpy(rng.standard_normal((B, HKV, block, D), dtype=np.float32), dtype)
    lens = np.asarray(lens)
    while (left := lens - cache.host_lens).any():
        cache.append(data, data, np.minimum(left, block))
    backend.synchronize()
    return cache


def queries(backend, B, T, dtype="float32", seed=1):
    rng = np.random.default_rng(seed)
    return backend.from_numpy(rng.standard_normal((B, HQ, T, D), dtype=np.float32), dtype)


def attend(backend, q, cache, n_new):
    """gqa_attention, then wait for the device: every timed call goes through here."""
    out = gqakv.gqa_attention(q, cache, n_new)
    backend.synchronize()
    return out


def live_kv_bytes(cache) -> int:
    return int(cache.host_lens.sum()) * bench.token_bytes(HKV, D, cache.dtype)


_bandwidth = None


def read_bandwidth() -> float:
    """The machine's best measured streaming read bandwidth, bytes/s (once per process)."""
    global _bandwidth
    if _bandwidth is None:
        _bandwidth = bench.read_bandwidth()["best"]
    return _bandwidth


def torch_ratio(gqakv_call, q, cache, n_new, backend) -> float:
    """gqakv time / torch SDPA time over the same live views; NaN without torch."""
    try:
        sdpa = bench.torch_sdpa(q, cache.k, cache.v, cache.host_lens, n_new)
    except ImportError:
        return math.nan
    except Exception:  # arrays torch cannot view (e.g. another device library)
        return math.nan
    t_g = bench.median_time(gqakv_call, backend)
    t_t = bench.median_time(sdpa, backend)
    return t_g / t_t


def temp_bytes(fn, backend) -> float:
    """Peak bytes NumPy allocated during one call (tracemalloc); NaN off NumPy."""
    if backend.array_library != "numpy":
        return math.nan
    tracemalloc.start()
    try:
        fn()
        return float(tracemalloc.get_traced_memory()[1])
    finally:
        tracemalloc.stop()


def seconds(fn, backend, repeats=5) -> float:
    return bench.median_time(fn, backend, repeats)


__all__ = ["BACKENDS", "attend", "HQ", "HKV", "D", "backend_or_skip", "filled_cache", "queries",
           "live_kv_bytes", "read_bandwidth", "torch_ratio", "temp_bytes", "seconds", "time"]
