"""Shared set-up for the benchmarks: backends as parameters, filled caches, timing helpers.

Shapes are one attention layer of Llama-3.1-8B: 32 query heads, 8 KV heads, head dim
128. Backends come from gqakv's registry; one that cannot run here makes ``setup``
raise NotImplementedError with the reason, which asv reports as skipped (``asv run -e``
prints it). The same goes for an API a benchmark needs that an older commit lacks: the
benchmarks always come from the working tree, gqakv from the commit being measured.

Every number reads lower-is-better (asv has no "greater is better"): times, time per
GB, ratios to a peer, bytes, MiB. ``track_`` values are the *minimum* over repeated
calls (the least disturbed by other load on the machine), and ratios interleave the
two sides' calls so that a burst of load hits both.

``GQAKV_ASV_FULL=1`` adds the slow sizes (long generation loops, the concatenation
baseline at full length) to the parameters; the default suite fits in minutes.
"""

from __future__ import annotations

import functools
import math
import os
import time
import tracemalloc

import numpy as np

import gqakv

try:
    from gqakv.tools import bench
except ImportError:
    try:  # commits before the layered package (gqakv/tools/)
        from gqakv import bench
    except ImportError:  # commits before `gqakv bench`
        bench = None

try:  # raised in a benchmark method, asv records "skipped" for that method only
    from asv_runner.benchmarks.mark import SkipNotImplemented
except ImportError:
    SkipNotImplemented = NotImplementedError

HQ, HKV, D = 32, 8, 128
FULL = os.environ.get("GQAKV_ASV_FULL", "") == "1"
# Conformance backends: correct, not meant to be fast, so not benchmarked.
NOT_BENCHMARKED = {"array_api_strict"}
# The generic array-API code on torch tensors: a parameter, but skipped unless GQAKV_ASV_FULL=1
# (on a CPU it is the slowest path and would double the suite's time; VsTorch covers torch SDPA).
FULL_ONLY = {"torch"}
BACKENDS = ([b.name for b in gqakv.list_backends() if b.name not in NOT_BENCHMARKED]
            if hasattr(gqakv, "list_backends") else ["numpy"])


def require(obj, *names: str, what: str | None = None) -> None:
    """NotImplementedError (asv: skipped) if ``obj`` lacks an attribute this benchmark uses."""
    missing = [n for n in names if not hasattr(obj, n)]
    if missing:
        owner = what or getattr(obj, "__name__", type(obj).__name__)
        raise NotImplementedError(f"{owner} has no {', '.join(missing)} in this commit (added later)")


def backend_or_skip(name: str):
    """The named backend, or NotImplementedError (asv: skipped) saying why it cannot run."""
    if name in FULL_ONLY and not FULL:
        raise NotImplementedError(f"{name}: benchmarked only with GQAKV_ASV_FULL=1 (the generic array-API path)")
    require(gqakv, "get_backend", "KVCache", "gqa_attention")
    if bench is None:
        raise NotImplementedError("gqakv.tools.bench does not exist in this commit (added later)")
    try:
        backend = gqakv.get_backend(name)
    except Exception as exc:
        raise NotImplementedError(f"{name}: {exc}") from None
    require(backend, "from_numpy", what=f"backend {name}")
    return backend


def torch_or_skip():
    """torch, or NotImplementedError saying how to get it into the benchmark environment."""
    try:
        import torch
    except ImportError:
        raise NotImplementedError("torch is not installed in this environment (asv.conf.json's matrix "
                                  "installs torch==2.13.0 CPU; with --python=same: pip install torch==2.13.0)") from None
    if bench is None or not hasattr(bench, "torch_sdpa"):
        raise NotImplementedError("gqakv.tools.bench.torch_sdpa does not exist in this commit (added later)")
    return torch


def sync(backend) -> None:
    """Wait for the device (``Backend.synchronize`` came later than the first benchmarks)."""
    s = getattr(backend, "synchronize", None)
    if s is not None:
        s()


def filled_cache(backend, lens, max_len=None, dtype="float32", seed=0):
    """A KVCache whose row b holds lens[b] random tokens (written in a few appends)."""
    B = len(lens)
    max_len = max_len or max(lens)
    cache = gqakv.KVCache(B, HKV, max_len, D, dtype=dtype, backend=backend)
    return fill(cache, backend, lens, dtype, seed)


def fill(cache, backend, lens, dtype="float32", seed=0):
    """Append random tokens, 512 at a time, until row b holds lens[b] (the same tokens for
    the same ``seed`` whatever the cache's storage); returns the cache."""
    rng = np.random.default_rng(seed)
    block = min(512, max(1, max(lens)))
    data = backend.from_numpy(rng.standard_normal((len(lens), HKV, block, D), dtype=np.float32), dtype)
    lens = np.asarray(lens)
    while (left := lens - cache.host_lens).any():
        cache.append(data, data, np.minimum(left, block))
    sync(backend)
    return cache


def queries(backend, B, T, dtype="float32", seed=1):
    rng = np.random.default_rng(seed)
    return backend.from_numpy(rng.standard_normal((B, HQ, T, D), dtype=np.float32), dtype)


def attend(backend, q, cache, n_new):
    """gqa_attention, then wait for the device: every timed call goes through here."""
    out = gqakv.gqa_attention(q, cache, n_new)
    sync(backend)
    return out


def token_bytes(dtype) -> int:
    """Bytes of K plus V for one token of one layer."""
    return 2 * HKV * D * {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}[str(dtype)]


def live_kv_bytes(cache) -> int:
    return int(np.asarray(cache.host_lens).sum()) * token_bytes(cache.dtype)


_bandwidth = None


def read_bandwidth() -> float:
    """The machine's best measured streaming read bandwidth, bytes/s (once per process)."""
    global _bandwidth
    if _bandwidth is None:
        require(bench, "read_bandwidth", what="gqakv.tools.bench")
        _bandwidth = bench.read_bandwidth()["best"]
    return _bandwidth


def reader(nbytes: int):
    """A call that streams ``nbytes`` from memory as fast as this machine reads and leaves no
    threads spinning after it: numba's parallel sum over a float32 array where numba imports
    (on the threads numba's kernels use), else BLAS's threaded matrix-vector product over a
    ``[n, 128]`` float32 matrix (gqakv.tools.bench's best reader).

    Not BLAS where it can be helped: OpenBLAS's workers spin for about 0.1 s after each
    call (the performance guide, "Threads shared with the model's BLAS"), so a step timed
    right after it shared its cores with them. On the 2-core AMD EPYC a float32 decode (B=4
    L=4,096) took 13.8 ms interleaved with the product and 6.2-7.0 ms interleaved with the
    numba sum, which also read faster (36 GB/s against 25-30; 2026-12-07)."""
    total = _parallel_sum()
    if total is None:
        matrix = np.ones((max(1, nbytes // 512), 128), dtype=np.float32)
        x = np.ones(128, dtype=np.float32)
        return lambda: matrix @ x
    parts = 64  # a few per thread, so that threads that start late still finish level
    a = np.ones((parts, max(16, nbytes // 4 // parts)), dtype=np.float32)
    total(a)  # compile here, not in the first timed call
    return lambda: total(a)


@functools.cache
def _parallel_sum():
    """numba's parallel sum of a [parts, n] float32 array (one prange index per part,
    vectorized within it), compiled once per process; None where numba does not import."""
    try:
        from numba import njit, prange
    except ImportError:
        return None

    @njit(parallel=True, fastmath=True)
    def total(a):
        sums = np.zeros(a.shape[0], np.float32)
        for p in prange(a.shape[0]):
            acc = np.float32(0.0)
            for i in range(a.shape[1]):
                acc += a[p, i]
            sums[p] = acc
        return sums.sum()
    return total


def matmul(flops: float, n: int = 1024):
    """``(call, done)``: a call doing ``done`` (about ``flops``) float32 FLOP as fast as this
    machine multiplies, BLAS's threaded ``[n, n] @ [n, n]`` repeated (gqakv bench's matmul
    yardstick); scale a time ratio against it by ``done / flops``."""
    a = np.ones((n, n), dtype=np.float32)
    reps = max(1, round(flops / (2 * n ** 3)))

    def call():
        for _ in range(reps):
            a @ a
    return call, reps * 2 * n ** 3


def prefill_flops(lens, n_new, heads=None) -> float:
    """FLOP of the attention of rows of ``lens`` tokens whose last ``n_new`` are the
    queries (bottom-right causal): 4 x d per visible (query head, key) pair, QK^T and PV."""
    heads = HQ if heads is None else heads
    pairs = sum(n * (L - n) + n * (n + 1) // 2 for L, n in zip(lens, n_new))
    return 4.0 * D * heads * pairs


def best_seconds(fn, backend, repeats=7) -> float:
    """Minimum wall time of ``fn()`` over ``repeats`` calls after one warm-up call."""
    fn()
    sync(backend)
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync(backend)
        best = min(best, time.perf_counter() - t)
    return best


def ratio(fn_a, fn_b, backend, repeats=7, min_seconds=0.5, max_pairs=60) -> float:
    """min time of ``fn_a`` / min time of ``fn_b``, their calls interleaved (a, b, a, b, ...):
    at least ``repeats`` pairs, more (up to ``max_pairs``) until each side has run
    ``min_seconds``. A track_ value has no samples for asv's statistics, so its minimum
    must be stable by itself: fast calls get many pairs, so that each side's minimum
    comes from a moment when the machine's other load let it run undisturbed."""
    fn_a(), fn_b()
    sync(backend)
    best = [math.inf, math.inf]
    spent = [0.0, 0.0]
    pairs = 0
    while pairs < repeats or (pairs < max_pairs and min(spent) < min_seconds):
        for which, fn in enumerate((fn_a, fn_b)):
            t = time.perf_counter()
            fn()
            sync(backend)
            dt = time.perf_counter() - t
            best[which] = min(best[which], dt)
            spent[which] += dt
        pairs += 1
    return best[0] / best[1]


def temp_mib(fn) -> float:
    """Peak MiB traced during one call of ``fn`` (after a warm-up call), counting only what the
    call allocates: tracemalloc starts after set-up, so the cache is not included. NumPy
    reports its array buffers to tracemalloc; other array libraries do not."""
    fn()
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()


# asv timing attributes shared by the time_ benchmarks: two rounds (two processes), each with
# samples of at least 20 ms, 3 to 8 of them within 1 s (more only for fast calls). Two rounds
# because `asv continuous` interleaves rounds across the two commits (base round 1, head round
# 1, base round 2, head round 2): a change in the machine's load between the first and second
# half of a run then falls on both commits instead of one. (It does not remove the swings
# of minutes on this shared 2-core VM: docs/guides/performance.md, "Benchmarks (asv)".)
# track_ methods keep one round (their values are ratios whose two sides are already
# interleaved in one call, or counts): the suite's time stays about what one round of 5 to
# 15 samples within 2 s took (asv continuous, two commits: 764-812 s with the builds).
TIMING = dict(sample_time=0.02, repeat=(3, 8, 1.0), rounds=2, warmup_time=0.1, min_run_count=5)


def timing(cls):
    """Class decorator: the shared timing attributes, unless the class sets its own; each
    track_ method runs in one round (a method attribute, which asv reads before the class's)."""
    for k, v in TIMING.items():
        if k not in cls.__dict__:
            setattr(cls, k, v)
    for name, fn in list(cls.__dict__.items()):
        if name.startswith("track_") and callable(fn) and not hasattr(fn, "rounds"):
            fn.rounds = 1
    return cls


__all__ = ["BACKENDS", "FULL", "attend", "HQ", "HKV", "D", "backend_or_skip", "filled_cache", "queries",
           "live_kv_bytes", "read_bandwidth", "reader", "best_seconds", "ratio", "temp_mib", "require", "sync",
           "timing", "torch_or_skip", "token_bytes", "SkipNotImplemented"]
