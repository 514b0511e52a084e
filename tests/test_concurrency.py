"""Several threads on one cache: nothing is lost or torn, and overlapping steps are refused.

Every write to one set of buffers (KVCache.append, a ModelKVCache step from open to commit
or abort, reorder / fork / truncate / reset) holds that cache's lock (``Lengths.lock``) from
validation to the length update; opening a second step while one is open raises
RuntimeError at once. The hammer tests below run appends, steps and row operations from
several threads with the interpreter switching threads every microsecond, then check the
result against what any serial order of the same calls must give: every chunk of tokens
is whole, every appended chunk is in the rows it was appended to exactly once, in each
thread's order, and row operations moved whole chunks.

Token values encode who wrote them: element 0 = thread, 1 = that thread's call number,
2 = the row it was appended to, 3 = its index in the chunk, 4 = layer (exact in float64).
"""

from __future__ import annotations

import sys
import threading
import time

import numpy as np
import pytest

import gqakv

from .support.routes import assert_product_routes

T = 8  # tokens per chunk (every call appends one chunk per row)
D = 8


@pytest.fixture
def fast_switching():
    """Switch threads every microsecond (default 5 ms) so races show up within a few calls."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


def chunk(thread: int, i: int, rows, layer: int = 0) -> np.ndarray:
    """k_new [B, 1, T, D] of call i of ``thread`` for cache ``rows``."""
    k = np.zeros((len(rows), 1, T, D))
    k[..., 0] = thread
    k[..., 1] = i
    k[..., 2] = np.asarray(rows)[:, None, None]
    k[..., 3] = np.arange(T)
    k[..., 4] = layer
    return k


def chunks_of(row_tokens: np.ndarray, what: str) -> list[tuple[int, int, int]]:
    """Split a row's live tokens [L, D] into (thread, i, row) chunks; each must be whole."""
    L = row_tokens.shape[0]
    assert L % T == 0, f"{what}: {L} tokens is not a whole number of chunks"
    out = []
    for c in range(L // T):
        tok = row_tokens[c * T:(c + 1) * T]
        tag = tuple(int(x) for x in tok[0, :3])
        assert (tok[:, :3] == tok[0, :3]).all() and (tok[:, 3] == np.arange(T)).all(), (
            f"{what}: chunk {c} is torn: {tok[:, :4].tolist()}")
        out.append(tag)
    return out


def check_rows(k, v, lens, layer: int, threads: int, calls: int, copied_rows=(), cut_rows=()):
    """Rows 0 and 1 (never changed by row operations) hold every call once, each thread's
    calls in order; rows in ``copied_rows`` hold row 0's call sequence (a prefix copied from
    row 0, then their own appends); rows in ``cut_rows`` a subsequence of it."""
    seqs = {}
    for r in range(len(lens)):
        n = int(lens[r])
        toks = k[r, 0, :n]
        assert (toks[:, 4] == layer).all(), f"layer {layer} row {r}: another layer's tokens"
        assert np.array_equal(v[r, 0, :n], -toks), f"layer {layer} row {r}: V does not match K"
        seqs[r] = chunks_of(toks, f"layer {layer} row {r}")
    for r in (0, 1):
        calls_seen = [(t, i) for t, i, row in seqs[r]]
        assert sorted(calls_seen) == [(t, i) for t in range(threads) for i in range(calls)], (
            f"row {r}: calls lost or doubled")
        for t in range(threads):
            assert [i for tt, i in calls_seen if tt == t] == list(range(calls)), (
                f"row {r}: thread {t}'s calls out of order")
        assert {row for *_, row in seqs[r]} == {r}
    order = [(t, i) for t, i, _ in seqs[0]]
    assert [(t, i) for t, i, _ in seqs[1]] == order, "rows 0 and 1 saw the calls in different orders"
    for r in copied_rows:
        assert [(t, i) for t, i, _ in seqs[r]] == order, f"row {r} is not a whole copy of row 0"
    for r in cut_rows:
        pos = 0
        for t, i, _ in seqs[r]:  # a subsequence of row 0's calls, in the same order
            while pos < len(order) and order[pos] != (t, i):
                pos += 1
            assert pos < len(order), f"row {r}: chunk {(t, i)} out of row 0's order"
            pos += 1


#: Storage and backends the hammer tests run on: the NumPy float64 contiguous cache, and
#: paged (page size 3: a chunk of 8 leaves a shared, partly filled last page after a fork,
#: so appends copy on write) and int8 caches in the kernels' dtypes, on the backends whose
#: fast paths serve them (every hot call's route is checked against what ran). Token values
#: are small integers: exact in bfloat16, and int8's per-token scale keeps each within
#: 0.5 of its value (rounded back when read).
CONCURRENT = {"numpy-contiguous-float64": ("numpy", {}, "float64"),
              "numba-paged-float32": ("numba", {"storage": "paged", "page_size": 3}, "float32"),
              "numpy-paged-bfloat16": ("numpy", {"storage": "paged", "page_size": 3}, "bfloat16"),
              "numba-int8-bfloat16": ("numba", {"kv_dtype": "int8"}, "bfloat16"),
              "numba-paged+int8-float32": ("numba", {"storage": "paged", "page_size": 3,
                                                     "kv_dtype": "int8"}, "float32")}


def concurrent_backend(name: str):
    backend = next(b for b in gqakv.list_backends() if b.name == name)
    if backend.unavailable_reason():
        pytest.skip(f"backend {name}: {backend.unavailable_reason()}")
    return backend


def host_rows(cache, layer: int | None = None):
    """(k, v) [R, 1, max_len, D] float64 of a cache's live rows (layer ``layer`` of a
    ModelKVCache), read through ``live_kv`` (any storage); quantized values rounded back
    to the integers appended. Dead slots are NaN."""
    R = cache.batch
    k = np.full((R, 1, cache.max_len, D), np.nan)
    v = k.copy()
    for b in range(R):
        kb, vb = cache.live_kv(b) if layer is None else cache.live_kv(layer, b)
        kb, vb = (np.asarray(cache.backend.to_numpy(x), np.float64) for x in (kb, vb))
        if cache.store.quantized:
            kb, vb = np.rint(kb), np.rint(vb)
        k[b, :, :kb.shape[1]], v[b, :, :vb.shape[1]] = kb, vb
    return k, v


def run_threads(targets, timeout=120):
    errors = []

    def wrap(fn):
        def run():
            try:
                fn()
            except BaseException as exc:  # reported after join
                errors.append(exc)
        return run

    threads = [threading.Thread(target=wrap(fn)) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a thread hung (deadlock?)"
    if errors:
        raise errors[0]


@pytest.mark.parametrize("where", list(CONCURRENT))
def test_appends_and_row_operations_from_many_threads(fast_switching, where, route_spy):
    """4 threads append chunks to all 4 rows of one KVCache (200 each on the NumPy float64
    cache, 30 on the others) while a fifth forks row 0 into row 2, reorders row 0 into row
    3 and truncates row 3 by whole chunks, and a sixth reads rows 0 and 1 (their live
    tokens: whole chunks only; a decode over them: finite)."""
    name, spec, dtype = CONCURRENT[where]
    backend = concurrent_backend(name)
    spy = route_spy(backend)
    threads, calls, R = 4, 200 if dtype == "float64" else 30, 4
    cache = gqakv.KVCache(R, 1, threads * calls * T, D, dtype=dtype, backend=backend, **spec)
    start = threading.Barrier(threads + 2)
    done = threading.Event()
    reads = [0]

    def writer(t):
        def run():
            start.wait()
            for i in range(calls):
                k = chunk(t, i, range(R))
                cache.append(backend.from_numpy(k, dtype), backend.from_numpy(-k, dtype), [T] * R)
        return run

    def row_ops():
        start.wait()
        while not done.is_set():
            cache.fork(0, [2])
            cache.reorder([0, 1, 2, 0])  # row 3 takes row 0
            n = int(cache.host_lens[3])
            if n >= 2 * T:
                cache.truncate([3], [n - T])  # may race an append: still <= lens[3]

    def reader():
        start.wait()
        q = backend.from_numpy(np.ones((2, 1, 1, D)), dtype)
        while not done.is_set():
            for r in (0, 1):
                k, _ = cache.live_kv(r)
                toks = np.asarray(backend.to_numpy(k), np.float64)[0]
                chunks_of(np.rint(toks) if cache.store.quantized else toks, f"read of row {r}")
            n = [1, 1] if min(cache.host_lens[:2]) else [0, 0]
            out = gqakv.gqa_attention(q, cache, n, rows=[0, 1])
            assert np.isfinite(np.asarray(backend.to_numpy(out), np.float64)).all()
            reads[0] += 1

    def writers_then_done():
        run_threads([writer(t) for t in range(threads)])
        done.set()

    run_threads([writers_then_done, row_ops, reader])
    lens = cache.host_lens.copy()
    assert lens[0] == lens[1] == threads * calls * T and reads[0] > 0
    k, v = host_rows(cache)
    check_rows(k, v, lens, 0, threads, calls, copied_rows=[2], cut_rows=[3])
    assert_product_routes(spy)


@pytest.mark.parametrize("where", list(CONCURRENT))
def test_steps_and_row_operations_from_many_threads(fast_switching, where, route_spy):
    """3 threads run steps (all layers, all rows; 20 each on the NumPy float64 cache, 8 on
    the others) on one ModelKVCache, retrying when another thread's step is open; a fourth
    forks and truncates between steps."""
    name, spec, dtype = CONCURRENT[where]
    backend = concurrent_backend(name)
    spy = route_spy(backend)
    threads, calls, R, layers = 3, 20 if dtype == "float64" else 8, 4, 3
    cache = gqakv.ModelKVCache(layers, R, 1, threads * calls * T, D, dtype=dtype,
                               backend=backend, **spec)
    start = threading.Barrier(threads + 1)
    done = threading.Event()
    refused = [0]
    q = backend.from_numpy(np.ones((R, 1, T, D)), dtype)

    def open_step():
        while True:
            try:
                return cache.step([T] * R)
            except RuntimeError as exc:
                assert "a step is open" in str(exc)
                refused[0] += 1
                time.sleep(0)

    def stepper(t):
        def run():
            start.wait()
            for i in range(calls):
                with open_step() as step:
                    for l in range(layers):
                        k = chunk(t, i, range(R), layer=l)
                        kd, vd = backend.from_numpy(k, dtype), backend.from_numpy(-k, dtype)
                        if l % 2:
                            step.write(l, kd, vd)
                        else:
                            step.attend(l, q, kd, vd)
        return run

    def row_ops():
        start.wait()
        while not done.is_set():
            try:
                cache.fork(0, [2])
                n = int(cache.host_lens[3])
                cache.truncate([3], [n - T] if n >= 2 * T else [n])
            except RuntimeError as exc:  # a step was open: row operations wait for none
                assert "a step is open" in str(exc)
            time.sleep(0)

    def steppers_then_done():
        run_threads([stepper(t) for t in range(threads)])
        done.set()

    run_threads([steppers_then_done, row_ops])
    lens = cache.host_lens.copy()
    assert lens[0] == lens[1] == threads * calls * T
    for l in range(layers):
        k, v = host_rows(cache, l)
        check_rows(k, v, lens, l, threads, calls, copied_rows=[2], cut_rows=[3])
    assert cache._open_step is None
    assert_product_routes(spy)


class _BlockingWrites:
    """Wraps a backend so that the first write_kv blocks until released (a slow write in
    progress); later writes go straight through."""

    def __init__(self, backend):
        self._backend = backend
        self.entered = threading.Event()
        self.release = threading.Event()

    def __getattr__(self, name):
        return getattr(self._backend, name)

    def write_kv(self, *args):  # (store, k_new, v_new, inputs)
        if not self.entered.is_set():
            self.entered.set()
            assert self.release.wait(30), "never released"
        return self._backend.write_kv(*args)


def test_an_append_waits_for_an_append_in_progress():
    """Thread A is inside its write (held there by the backend); thread B's append to the
    same rows waits for A to finish instead of writing at the same lengths: both chunks
    end up in the rows, one after the other (forced interleaving, no timing luck)."""
    cache = gqakv.KVCache(2, 1, 2 * T, D, dtype="float64", backend="numpy")
    blocking = _BlockingWrites(cache.backend)
    cache.backend = blocking
    ka, kb = chunk(0, 0, [0, 1]), chunk(1, 0, [0, 1])
    a = threading.Thread(target=lambda: cache.append(ka, -ka, [T, T]))
    a.start()
    try:
        assert blocking.entered.wait(30)
        b = threading.Thread(target=lambda: cache.append(kb, -kb, [T, T]))
        b.start()
        b.join(0.5)  # without the lock, B would be done by now, written over A's slots
    finally:
        blocking.release.set()
        a.join(30)
    b.join(30)
    assert cache.host_lens.tolist() == [2 * T, 2 * T]
    for r in range(2):
        assert chunks_of(cache.k[r, 0, :2 * T], f"row {r}") == [(0, 0, r), (1, 0, r)]


def test_two_threads_racing_to_open_a_step(fast_switching):
    """Two threads call step() at the same moment, 200 times: exactly one gets the step,
    the other RuntimeError, never both."""
    cache = gqakv.ModelKVCache(1, 2, 1, 400, D, dtype="float64", backend="numpy")
    k = np.ones((2, 1, 1, D))
    for trial in range(200):
        start = threading.Barrier(2)
        results = [None, None]

        def opener(j):
            def run():
                start.wait()
                try:
                    results[j] = cache.step([1, 1])
                except RuntimeError as exc:
                    results[j] = exc
            return run

        run_threads([opener(0), opener(1)])
        steps = [r for r in results if isinstance(r, gqakv.caches.model_cache.Step)]
        errors = [r for r in results if isinstance(r, RuntimeError)]
        assert len(steps) == 1 and len(errors) == 1, f"trial {trial}: {results}"
        assert "a step is open" in str(errors[0])
        steps[0].write(0, k, k)
        steps[0].commit()
    assert cache.host_lens.tolist() == [200, 200]


def test_a_refused_overlapping_step_changes_nothing():
    cache = gqakv.ModelKVCache(2, 2, 1, 8, D, dtype="float64", backend="numpy")
    step = cache.step([1, 1])
    k_before = cache.k.copy()
    for call in (lambda: cache.step([1, 1]), lambda: cache.fork(0, [1]),
                 lambda: cache.reorder([1, 0]), lambda: cache.truncate([0], [0]),
                 lambda: cache.reset()):
        with pytest.raises(RuntimeError, match="a step is open"):
            call()
    assert cache._open_step is step and cache.host_lens.tolist() == [0, 0]
    assert cache.k.tobytes() == k_before.tobytes()
    step.abort()
    cache.step([1, 1]).abort()  # the cache is free again


def test_other_caches_and_readers_do_not_wait_for_a_write():
    """While one thread is inside cache A's append (holding A's lock), another thread
    appends to cache B and reads A through attention, which sees A's old lengths: there
    is no global lock, and readers take none."""
    a = gqakv.KVCache(2, 1, 16, D, dtype="float64", backend="numpy")
    b = gqakv.KVCache(2, 1, 16, D, dtype="float64", backend="numpy")
    k = np.ones((2, 1, 2, D))
    a.append(k, k, [2, 2])
    blocking = _BlockingWrites(a.backend)
    a.backend = blocking
    writer = threading.Thread(target=lambda: a.append(2 * k, 2 * k, [2, 1]))
    writer.start()
    try:
        assert blocking.entered.wait(30)
        b.append(k, k, [1, 2])  # would deadlock behind a global lock
        assert b.host_lens.tolist() == [1, 2]
        out = gqakv.gqa_attention(np.ones((2, 1, 1, D)), a, [1, 1])  # A's readers go on
        assert a.host_lens.tolist() == [2, 2]
        np.testing.assert_array_equal(out, 1.0)  # only the old, live tokens (all ones)
    finally:
        blocking.release.set()
        writer.join(30)
    assert a.host_lens.tolist() == [4, 3]


def test_layer_views_share_the_model_lock_and_caches_do_not():
    m = gqakv.ModelKVCache(2, 1, 1, 4, D, backend="numpy")
    lock = m._lengths.lock
    assert all(m.layer(l)._lengths.lock is lock for l in range(2))
    assert gqakv.KVCache(1, 1, 4, D)._lengths.lock is not gqakv.KVCache(1, 1, 4, D)._lengths.lock


def test_device_lengths_are_never_stale_after_a_racing_update():
    """``cache.lens`` (the backend's copy of the lengths, cached) being made in one thread
    while another appends is not kept past that append: the interleaving is forced by a
    backend whose upload blocks after it has read the host lengths."""

    class SlowUpload:
        def __init__(self, backend):
            self._backend = backend
            self.entered = threading.Event()
            self.release = threading.Event()

        def __getattr__(self, name):
            return getattr(self._backend, name)

        def from_host_ints(self, values, device=None):
            if threading.current_thread() is not threading.main_thread():
                self.entered.set()
                assert self.release.wait(30), "never released"
            return self._backend.from_host_ints(values, device=device)

    cache = gqakv.KVCache(1, 1, 8, D, dtype="float64", backend="numpy")
    k = np.ones((1, 1, 1, D))
    cache.append(k, k, [1])
    cache.backend = slow = SlowUpload(cache.backend)
    reader = threading.Thread(target=lambda: cache.lens)
    reader.start()
    try:
        assert slow.entered.wait(30)  # the reader holds a copy of lens == [1]
        cache.append(k, k, [1])
    finally:
        slow.release.set()
        reader.join(30)
    assert np.asarray(cache.lens).tolist() == cache.host_lens.tolist() == [2]
