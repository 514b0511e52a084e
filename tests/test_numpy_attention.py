"""The NumPy backend's threaded attention: every split it can make, against the reference.

Tiny blocks, several workers and no size thresholds force the planner to cut rows
over KV heads, keys and queries on small shapes, so each merge path is checked
against tests/support/reference.py. Also: float16/bfloat16 computed in float32, bounded
temporaries (tracemalloc), work that follows live lengths, and BLAS threads restored.
The attention variants (window, softcap, sinks) are checked against the same reference
(``reference_on_buffers``: it on padded buffers), under the same forced splits.
"""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest

import gqakv
from gqakv_backends import numpy_attention as na

from .support.blas import openblas_pthreads_or_skip
from .support.reference import reference_attention, reference_on_buffers
from .support.variants import random_variant

SPLIT_EVERYTHING = dict(workers=3, score_block_elements=24, query_block=3, min_key_split=2,
                        parallel_min_work=0)


def _case(rng, lens, n_new, hkv, G, d, dtype=np.float64, nan_tail=True):
    """Buffers [B, Hkv, max_len, d] with NaN past each row's length, and queries."""
    B, max_len = len(lens), max(lens) + 3
    k = np.full((B, hkv, max_len, d), np.nan) if nan_tail else np.zeros((B, hkv, max_len, d))
    v = k.copy()
    for b, L in enumerate(lens):
        k[b, :, :L] = rng.standard_normal((hkv, L, d))
        v[b, :, :L] = rng.standard_normal((hkv, L, d))
    q = rng.standard_normal((B, hkv * G, max(n_new) if len(n_new) else 0, d))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


def _run(q, k, v, lens, n_new, **kw):
    B = len(lens)
    return na.attention_numpy(q, k, v, np.arange(B), np.asarray(lens), np.asarray(n_new),
                              scale=1.0 / math.sqrt(q.shape[-1]), return_lse=True, **kw)


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("knobs", [SPLIT_EVERYTHING,
                                   dict(workers=2, min_key_split=4, parallel_min_work=0),
                                   dict(workers=1, score_block_elements=5, query_block=2),
                                   dict(workers=2, query_block=5, max_tile_rows=6, parallel_min_work=0)],
                         ids=["split-everything", "two-workers", "serial-tiny-blocks", "few-tile-rows"])
def test_all_splits_match_reference(seed, knobs):
    rng = np.random.default_rng(seed)
    hkv, G, d = int(rng.choice([1, 2, 4])), int(rng.integers(1, 5)), int(rng.choice([1, 4, 8]))
    B = int(rng.integers(1, 4))
    lens = [int(x) for x in rng.integers(0, 40, B)]
    n_new = [int(rng.integers(0, L + 1)) if L else 0 for L in lens]
    q, k, v = _case(rng, lens, n_new, hkv, G, d)
    out, lse = _run(q, k, v, lens, n_new, **knobs)
    want, want_lse = reference_attention(q, [k[b, :, :L] for b, L in enumerate(lens)],
                                         [v[b, :, :L] for b, L in enumerate(lens)], n_new)
    np.testing.assert_allclose(out, want, atol=1e-10)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    fin = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[fin], want_lse[fin], atol=1e-10)
    for b, n in enumerate(n_new):
        assert not out[b, :, n:].any()  # padded queries are exactly 0


def test_long_row_split_over_keys_and_decode_batch():
    """One long MQA row (only keys can be split) and a ragged decode batch."""
    rng = np.random.default_rng(1)
    for lens, n_new, hkv in (([300], [1], 1), ([300], [40], 1), ([5, 200, 0, 77], [1, 1, 0, 1], 2)):
        q, k, v = _case(rng, lens, n_new, hkv, 3, 8)
        out, lse = _run(q, k, v, lens, n_new, workers=2, min_key_split=16, parallel_min_work=0,
                        score_block_elements=64)
        want, _ = reference_attention(q, [k[b, :, :L] for b, L in enumerate(lens)],
                                      [v[b, :, :L] for b, L in enumerate(lens)], n_new)
        np.testing.assert_allclose(out, want, atol=1e-10)


def test_planner_splits_keys_only_where_every_query_sees_the_piece_start():
    items, _ = na._plan(np.array([3000]), np.array([512]), 1, 4, workers=2, query_block=256,
                        min_key_split=64)
    for i, h0, h1, t0, t1, j0, j1, _ in items:
        assert j0 <= 3000 - 512 + t0  # the first query of the block sees key j0
    # pieces of each (row, heads, query block) tile its visible keys exactly once
    for t0 in (0, 256):
        pieces = sorted((it[5], it[6]) for it in items if it[3] == t0)
        assert pieces[0][0] == 0 and pieces[-1][1] == 3000 - 512 + t0 + 256
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))


@pytest.mark.parametrize("lens, n_new", [([4096], [4096]), ([3512, 3512, 3512, 3512], [512] * 4), ([100, 9000], [1, 300])])
def test_prefill_items_hold_few_query_rows_and_tile_the_call(lens, n_new):
    """A prefill chunk's items hold at most MAX_TILE_ROWS query rows (their heads split
    further), so key blocks stay long; the items still cover every (head, query, key)
    the call reads exactly once."""
    hkv, G = 8, 4
    work = na.plan_items(np.array(lens), np.array(n_new), (len(lens), hkv * G, max(n_new), 128), hkv,
                         gqakv.AttentionParams(scale=1.0), workers=2)
    covered = {}
    for i, h0, h1, t0, t1, j0, j1, _ in work.items:
        assert (h1 - h0) * G * (t1 - t0) <= na.MAX_TILE_ROWS
        for h in range(h0, h1):
            covered.setdefault((i, h, t0, t1), []).append((j0, j1))
    for i, (L, n) in enumerate(zip(lens, n_new)):
        blocks = [(t0, min(n, t0 + na.QUERY_BLOCK)) for t0 in range(0, n, na.QUERY_BLOCK)]
        for h in range(hkv):
            for t0, t1 in blocks:
                pieces = sorted(covered.pop((i, h, t0, t1)))
                assert pieces[0][0] == 0 and pieces[-1][1] == L - n + t1
                assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
    assert not covered


def test_work_follows_live_lengths():
    """A 100-token row beside a 16k-token row costs their sum, not 2 x 16k."""
    items, total = na._plan(np.array([100, 16000]), np.array([1, 1]), 8, 4, workers=2,
                            query_block=256, min_key_split=1024)
    assert total == 8 * 4 * (100 + 16000)
    assert sum(it[-1] for it in items) == total
    runs = na._share(items, 2)
    costs = [sum(it[-1] for it in r) for r in runs]
    assert len(runs) == 2 and max(costs) <= 0.6 * total


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_computed_in_float32(dtype):
    """Same result as the float32 computation of the rounded inputs, returned in dtype."""
    backend = gqakv.get_backend("numpy")
    np_dtype = backend.dtype(dtype)
    rng = np.random.default_rng(3)
    lens, n_new = [50, 9], [7, 1]
    q, k, v = _case(rng, lens, n_new, 2, 4, 16, dtype=np.float32)
    q, k, v = q.astype(np_dtype), k.astype(np_dtype), v.astype(np_dtype)
    out, lse = _run(q, k, v, lens, n_new, **SPLIT_EVERYTHING)
    assert out.dtype == np_dtype and lse.dtype == np.float32
    want, _ = reference_attention(q.astype(np.float64), [k[b, :, :L].astype(np.float64) for b, L in enumerate(lens)],
                                  [v[b, :, :L].astype(np.float64) for b, L in enumerate(lens)], n_new)
    # float32 accumulation, then one rounding to dtype: within one ulp of dtype at |out| <= ~4.
    ulp = {"float16": 2.0**-10, "bfloat16": 2.0**-7}[dtype]
    np.testing.assert_allclose(out.astype(np.float64), want, atol=4 * ulp, rtol=0)


def test_peak_temporaries_bounded_for_long_prefill_chunk():
    """A 512-token chunk over a 20k-token row never holds its [Hq, T, L] scores at once."""
    hkv, G, d, L, T = 2, 4, 32, 20000, 512
    rng = np.random.default_rng(4)
    k = rng.standard_normal((1, hkv, L, d), dtype=np.float32)
    v = rng.standard_normal((1, hkv, L, d), dtype=np.float32)
    q = rng.standard_normal((1, hkv * G, T, d), dtype=np.float32)
    full_scores = hkv * G * T * L * 4  # 328 MB if materialized
    tracemalloc.start()
    try:
        _run(q, k, v, [L], [T], workers=2, parallel_min_work=0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # the output (and the key pieces' partial outputs), plus per worker a few score blocks
    # (the block, the mask, the queries of an item): see the module docstring.
    bound = 2 * q.nbytes + 2 * 4 * na.SCORE_BLOCK_ELEMENTS * 4
    assert peak < bound < full_scores / 30


def test_blas_threads_restored():
    threadpoolctl = pytest.importorskip("threadpoolctl")
    before = [i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"]
    rng = np.random.default_rng(5)
    q, k, v = _case(rng, [64, 64], [1, 1], 2, 2, 8, dtype=np.float32)
    _run(q, k, v, [64, 64], [1, 1], workers=2, parallel_min_work=0)
    after = [i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"]
    assert after == before


def test_backend_uses_threaded_path_through_public_api(monkeypatch):
    """gqa_attention on the numpy backend goes through the item kernel (attention_store)
    with a reader over the cache's own buffers (a call too big for one pass over the
    batch: here every call is, ``numpy_batch.BATCH_MAX_SCORES`` 0)."""
    from gqakv_backends import numpy_batch

    monkeypatch.setattr(numpy_batch, "BATCH_MAX_SCORES", 0)
    seen = []
    real = na.readers.reader_of

    def spy(store, rows, *args):
        reader = real(store, rows, *args)
        seen.append(reader.base.arrays[0])
        return reader

    monkeypatch.setattr(na.readers, "reader_of", spy)
    cache = gqakv.KVCache(1, 2, 8, 4, dtype="float64", backend="numpy")
    x = np.ones((1, 2, 3, 4))
    cache.append(x, x, [3])
    out = gqakv.gqa_attention(np.ones((1, 4, 3, 4)), cache, [3])
    assert seen and seen[0] is cache.k
    np.testing.assert_allclose(out, 1.0)


def test_float16_bit_cast_is_exact_for_every_half():
    """All 65,536 float16 bit patterns (normals, subnormals, +-0, +-inf, NaNs) in blocks."""
    every = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).reshape(4, 128, 128)
    want = every.astype(np.float32)
    got = na.to_float32(every, np.empty(every.shape, np.float32))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    finite = every[np.isfinite(every)].reshape(-1, 1, 1)  # the fast path alone (no inf/NaN)
    got = na.to_float32(finite, np.empty(finite.shape, np.float32))
    np.testing.assert_array_equal(got.view(np.uint32), finite.astype(np.float32).view(np.uint32))
    strided = every[:, 3:40, :]  # a view like the cache's live slice
    got = na.to_float32(strided, np.empty(strided.shape, np.float32))
    np.testing.assert_array_equal(got.view(np.uint32), strided.astype(np.float32).view(np.uint32))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_float16_inf_in_live_keys_gives_nan_like_float32():
    """A live inf key must not be rounded to a finite value by the fast cast."""
    rng = np.random.default_rng(8)
    q, k, v = _case(rng, [20], [1], 1, 2, 8, dtype=np.float32, nan_tail=False)
    k[0, 0, 5, 0] = np.inf
    q[..., 0] = 1.0
    out32, _ = _run(q, k, v, [20], [1], workers=1)
    out16, _ = _run(q.astype(np.float16), k.astype(np.float16), v.astype(np.float16), [20], [1],
                    workers=1)
    np.testing.assert_array_equal(np.isnan(out16), np.isnan(out32))
    assert np.isnan(out32).any()


def test_thread_count_from_environment(monkeypatch):
    monkeypatch.setenv(na.ENV_THREADS, "3")
    assert na._threads.default_workers() == 3
    monkeypatch.setenv(na.ENV_THREADS, "zero")
    with pytest.raises(ValueError, match="GQAKV_NUM_THREADS='zero' is not an integer"):
        na._threads.default_workers()
    monkeypatch.setenv(na.ENV_THREADS, "0")
    with pytest.raises(ValueError, match="GQAKV_NUM_THREADS=0 must be >= 1"):
        na._threads.default_workers()


def test_calls_below_the_spin_cut_run_on_one_worker_with_blas_threads(monkeypatch):
    """Where OpenBLAS spins (2 threads, no timeout set) a default-planned call of fewer
    than SPINNING_BLAS_ONE_WORKER_MACS multiply-adds is planned for one worker, unsplit,
    and its items run outside the guard (BLAS keeps its 2 threads); one at or above the
    cut, GQAKV_NUM_THREADS set, OPENBLAS_THREAD_TIMEOUT set, an explicit worker count or
    batch-invariant mode keep two workers. The one-worker call matches the reference."""
    from gqakv.core.semantics import AttentionParams
    from gqakv_backends.cpu_plan import OPENBLAS_TIMEOUT_ENV

    threadpoolctl = openblas_pthreads_or_skip()
    monkeypatch.delenv(na.ENV_THREADS, raising=False)
    monkeypatch.delenv(OPENBLAS_TIMEOUT_ENV, raising=False)
    params = AttentionParams(scale=1.0)
    d, hkv, G = 64, 2, 4
    cut = na.SPINNING_BLAS_ONE_WORKER_MACS // d  # in query-key-head products

    def planned(T, **kw):
        lens = np.array([T]) if np.ndim(T) == 0 else np.asarray(T)
        return na.plan_items(lens, lens, (len(lens), hkv * G, int(lens.max()), d), hkv, params, **kw)

    def causal_products(T):
        """plan_items' total for one causal T-query prompt (whole query blocks)."""
        return sum(hkv * G * (min(T, t0 + na.QUERY_BLOCK) - t0) * min(T, t0 + na.QUERY_BLOCK)
                   for t0 in range(0, T, na.QUERY_BLOCK))

    below = max(T for T in range(128, 8192, 128) if causal_products(T) < cut)
    with threadpoolctl.threadpool_limits(2, user_api="blas"):
        small, large = planned(below), planned(below + 128)
        assert small.total < cut <= large.total
        assert small.workers == 1 and large.workers == 2
        # one worker's items: one per query block and head part (MAX_TILE_ROWS), no key pieces
        assert all(it[5] == 0 for it in small.items)
        assert planned(below, workers=2).workers == 2
        assert planned(below, invariant=True).workers == 2
        monkeypatch.setenv(na.ENV_THREADS, "2")
        assert planned(below).workers == 2
        monkeypatch.delenv(na.ENV_THREADS)
        monkeypatch.setenv(OPENBLAS_TIMEOUT_ENV, "4")
        assert planned(below).workers == 2
        monkeypatch.delenv(OPENBLAS_TIMEOUT_ENV)
    with threadpoolctl.threadpool_limits(1, user_api="blas"):
        assert planned(below).workers == 1  # one BLAS thread: one worker by default anyway

    # the route it means: items on the calling thread, BLAS not held to one thread
    rng = np.random.default_rng(3)
    lens, n_new = [300, 41], [300, 17]
    q, k, v = _case(rng, lens, n_new, hkv, G, d)
    q32, k32, v32 = (x.astype(np.float32) for x in (q, k, v))
    seen = []
    real_item = na._attend_item

    def recording_item(*args, **kw):
        seen.append(min(c.num_threads for c in threadpoolctl.ThreadpoolController()
                        .select(user_api="blas").lib_controllers))
        return real_item(*args, **kw)

    monkeypatch.setattr(na, "_attend_item", recording_item)
    reader = na.readers.Plain(na.readers.Rows((k32, v32), np.arange(2)))
    with threadpoolctl.threadpool_limits(2, user_api="blas"):
        out, lse = na.attend(q32, reader, np.array(lens), np.array(n_new),
                             params=AttentionParams(scale=1.0 / math.sqrt(d)), return_lse=True)
    assert seen and set(seen) == {2}
    want, want_lse = reference_on_buffers(q, k, v, lens, n_new)
    np.testing.assert_allclose(out, want, atol=1e-5)
    fin = np.isfinite(want_lse)
    np.testing.assert_array_equal(np.isneginf(lse), ~fin)
    np.testing.assert_allclose(lse[fin], want_lse[fin], atol=1e-5)


@pytest.mark.parametrize("k_major", [True, False])
def test_both_score_layouts_match_reference(monkeypatch, k_major):
    """Thin (decode) tiles use K @ q^T on AVX-512 OpenBLAS kernels: same answer either way."""
    monkeypatch.setattr(na._threads, "_k_major", k_major)
    rng = np.random.default_rng(9)
    lens, n_new = [30, 12, 7], [1, 3, 0]
    q, k, v = _case(rng, lens, n_new, 2, 4, 8)
    out, _ = _run(q, k, v, lens, n_new, **SPLIT_EVERYTHING)
    want, _ = reference_attention(q, [k[b, :, :L] for b, L in enumerate(lens)],
                                  [v[b, :, :L] for b, L in enumerate(lens)], n_new)
    np.testing.assert_allclose(out, want, atol=1e-10)


def _attend_in_child(conn):
    rng = np.random.default_rng(10)
    q, k, v = _case(rng, [64, 64], [2, 2], 2, 2, 8)
    out, _ = _run(q, k, v, [64, 64], [2, 2], workers=2, parallel_min_work=0)
    conn.send(float(np.abs(out).sum()))


def test_threaded_attention_works_in_a_forked_child():
    """The worker pool's threads do not survive fork; a child must not wait on them forever."""
    import multiprocessing

    rng = np.random.default_rng(10)
    q, k, v = _case(rng, [64, 64], [2, 2], 2, 2, 8)
    want, _ = _run(q, k, v, [64, 64], [2, 2], workers=2, parallel_min_work=0)  # pool now exists
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_attend_in_child, args=(child,))
    proc.start()
    try:
        assert parent.poll(60), "attention in a forked child hung"
        assert parent.recv() == pytest.approx(float(np.abs(want).sum()))
    finally:
        proc.join(5)
        if proc.is_alive():
            proc.kill()


# -- attention variants: window, softcap, sinks -----------------------------------------------

@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("knobs", [SPLIT_EVERYTHING,
                                   dict(workers=1, score_block_elements=5, query_block=2)],
                         ids=["split-everything", "serial-tiny-blocks"])
def test_variants_under_every_split_match_reference(seed, knobs):
    rng = np.random.default_rng(1000 + seed)
    hkv, G, d = int(rng.choice([1, 2])), int(rng.integers(1, 4)), int(rng.choice([1, 4, 8]))
    B = int(rng.integers(1, 4))
    lens = [int(x) for x in rng.integers(0, 40, B)]
    n_new = [int(rng.integers(0, L + 1)) if L else 0 for L in lens]
    q, k, v = _case(rng, lens, n_new, hkv, G, d)
    variant = random_variant(rng, hkv * G, max(lens))
    scale = 1.0 / math.sqrt(d)
    params = gqakv.AttentionParams(scale=scale, **variant)
    out, lse = _run(q, k, v, lens, n_new, params=params, **knobs)
    want, want_lse = reference_on_buffers(q, k, v, lens, n_new, scale, **variant)
    np.testing.assert_allclose(out, want, atol=1e-10, err_msg=str(variant))
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    fin = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[fin], want_lse[fin], atol=1e-10, err_msg=str(variant))
    assert np.isfinite(out).all()  # no NaN from a masked-out block or an extreme sink
    for b, n in enumerate(n_new):
        assert not out[b, :, n:].any()  # padded queries are exactly 0


@pytest.mark.parametrize("window", [1, 3, 5, 200])
def test_window_smaller_than_the_chunk(window):
    """A 40-query chunk in blocks of 8 over a 60-token row: windows inside one block,
    across blocks and past the row; with softcap and sinks on too."""
    rng = np.random.default_rng(window)
    lens, n_new = [60, 45], [40, 33]
    q, k, v = _case(rng, lens, n_new, 2, 2, 8)
    sinks = (0.5, -np.inf, 3.0, -1.0)
    scale = 0.3
    for variant in (dict(window=window), dict(window=window, softcap=2.0, sinks=sinks)):
        params = gqakv.AttentionParams(scale=scale, **variant)
        out, lse = _run(q, k, v, lens, n_new, params=params, workers=3, query_block=8,
                        score_block_elements=40, min_key_split=2, parallel_min_work=0)
        want, want_lse = reference_on_buffers(q, k, v, lens, n_new, scale, **variant)
        np.testing.assert_allclose(out, want, atol=1e-10)
        np.testing.assert_allclose(lse, want_lse, atol=1e-10)


def test_window_of_one_returns_each_querys_own_value():
    rng = np.random.default_rng(21)
    lens, n_new = [9, 4], [3, 4]
    q, k, v = _case(rng, lens, n_new, 1, 3, 4)
    out, lse = _run(q, k, v, lens, n_new, params=gqakv.AttentionParams(scale=0.5, window=1),
                    **SPLIT_EVERYTHING)
    for b, (L, n) in enumerate(zip(lens, n_new)):
        for t in range(n):
            np.testing.assert_allclose(out[b, :, t], np.broadcast_to(v[b, 0, L - n + t], (3, 4)),
                                       atol=1e-12)
            np.testing.assert_allclose(lse[b, :, t], 0.5 * q[b, :, t] @ k[b, 0, L - n + t], atol=1e-12)


def test_sinks_extremes_and_lse_holds_the_whole_denominator():
    """-inf sinks change nothing; a dominating sink sends out to 0 and lse to the sink;
    lse = log(e^sink + sum_j e^{s_j}) and out is scaled by the keys' share of it."""
    rng = np.random.default_rng(22)
    lens, n_new = [30, 7, 0], [2, 1, 0]
    q, k, v = _case(rng, lens, n_new, 2, 2, 8)
    scale = 1 / math.sqrt(8)
    plain, plain_lse = _run(q, k, v, lens, n_new, **SPLIT_EVERYTHING)
    params = gqakv.AttentionParams(scale=scale, sinks=(-np.inf,) * 4)
    out, lse = _run(q, k, v, lens, n_new, params=params, **SPLIT_EVERYTHING)
    np.testing.assert_allclose(out, plain, atol=1e-14)
    np.testing.assert_array_equal(lse, plain_lse)
    sinks = (1e4, 0.25, -3.0, 3.0e38)  # 3e38: near float32's max
    out, lse = _run(q, k, v, lens, n_new, params=gqakv.AttentionParams(scale=scale, sinks=sinks),
                    **SPLIT_EVERYTHING)
    real = np.array([[t < n for t in range(q.shape[2])] for n in n_new])  # [B, T]
    for h, sink in enumerate(sinks):
        got_lse, keys_lse = lse[:, h][real], plain_lse[:, h][real]
        np.testing.assert_allclose(got_lse, np.logaddexp(keys_lse, sink), rtol=1e-15)
        share = np.exp(keys_lse - got_lse)[:, None]  # the keys' part of the denominator
        np.testing.assert_allclose(out[:, h][real], plain[:, h][real] * share, atol=1e-14)
    assert not out[:, 0].any() and not out[:, 3].any()  # the sink takes everything
    assert not out[2].any() and np.isneginf(lse[2]).all()  # an empty row stays 0 / -inf
    assert np.isfinite(out).all()


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_variants_in_narrow_dtypes_match_reference(dtype):
    """Computed in float32 (lse float32), the output rounded once to the cache's dtype."""
    np_dtype = gqakv.get_backend("numpy").dtype(dtype)
    rng = np.random.default_rng(23)
    lens, n_new = [50, 20, 9], [7, 1, 1]
    q, k, v = (x.astype(np_dtype) for x in _case(rng, lens, n_new, 2, 4, 16, dtype=np.float32))
    variant = dict(window=6, softcap=0.8, sinks=tuple(float(np.float32(x)) for x in rng.standard_normal(8)))
    out, lse = _run(q, k, v, lens, n_new, params=gqakv.AttentionParams(scale=0.25, **variant),
                    **SPLIT_EVERYTHING)
    assert out.dtype == np_dtype and lse.dtype == np.float32
    want, want_lse = reference_on_buffers(q, k, v, lens, n_new, 0.25, **variant)
    rounding = np.abs(want.astype(np_dtype).astype(np.float64) - want).max()
    assert np.abs(out.astype(np.float64) - want).max() <= 2 * rounding + 1e-6
    fin = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[fin], want_lse[fin], atol=1e-5, rtol=0)


def test_tiny_softcap_saturates_without_nan():
    """softcap 1e-6: every score is +-1e-6 after tanh; the softmax is nearly uniform."""
    rng = np.random.default_rng(24)
    lens, n_new = [25], [3]
    q, k, v = _case(rng, lens, n_new, 1, 2, 8)
    q *= 1e3  # scores far into tanh's saturation
    params = gqakv.AttentionParams(scale=1.0, softcap=1e-6, window=10)
    out, lse = _run(q, k, v, lens, n_new, params=params, **SPLIT_EVERYTHING)
    want, want_lse = reference_on_buffers(q, k, v, lens, n_new, 1.0, softcap=1e-6, window=10)
    np.testing.assert_allclose(out, want, atol=1e-10)
    np.testing.assert_allclose(lse, want_lse, atol=1e-10)
    np.testing.assert_allclose(lse, math.log(10), atol=1e-5)  # ten keys of score ~0


def test_window_bounds_the_work_of_a_long_decode():
    """A decode on a row of 100,000 tokens with W = 4096: the items read exactly the last
    4096 keys (their key ranges tile L - W .. L once per KV head), whatever the split."""
    L, W, hkv, G = 100_000, 4096, 8, 4
    params = gqakv.AttentionParams(scale=1.0, window=W)
    for workers, min_key_split in ((1, 1024), (2, 1024), (16, 256)):
        items, total = na._plan(np.array([L]), np.array([1]), hkv, G, workers, na.QUERY_BLOCK,
                                min_key_split, params=params)
        assert total == hkv * G * W
        assert sum(it[-1] for it in items) == total
        for h in range(hkv):
            spans = sorted((it[5], it[6]) for it in items if it[1] <= h < it[2])
            assert spans[0][0] == L - W and spans[-1][1] == L
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


def test_variants_take_the_threaded_path_through_the_public_api(monkeypatch):
    """gqa_attention(params=...) with every variant on the numpy backend runs
    the item kernel (attention_store, not the generic path) and matches the reference."""
    seen = []
    real = na.attention_store

    def spy(*args, **kw):
        seen.append(args[3])
        return real(*args, **kw)

    monkeypatch.setattr(na, "attention_store", spy)
    rng = np.random.default_rng(25)
    lens, n_new = [12, 5], [3, 1]
    q, k, v = _case(rng, lens, n_new, 2, 2, 4, nan_tail=False)
    cache = gqakv.KVCache(2, 2, 16, 4, dtype="float64", backend="numpy")
    cache.append(k[:, :, :12], v[:, :, :12], lens)
    params = gqakv.AttentionParams(scale=0.5, window=4, softcap=3.0, sinks=(0.125, -np.inf, 2.0, 40.0))
    out, lse = gqakv.gqa_attention(q, cache, n_new, params=params, return_lse=True)
    assert seen == [params]
    want, want_lse = reference_on_buffers(q, k, v, lens, n_new, 0.5, window=4, softcap=3.0,
                                          sinks=params.sinks)
    np.testing.assert_allclose(out, want, atol=1e-10)
    np.testing.assert_allclose(lse, want_lse, atol=1e-10)


@pytest.mark.parametrize("window", [None, 1, 3, 7, 40])
def test_masking_only_the_edge_columns_sets_what_the_whole_mask_sets(window):
    """``_mask`` looks only at the key columns outside the range every query of the block
    sees; the scores it leaves are the ones the whole block's mask leaves, bit for bit, for
    random blocks of random rows (causal, windows), diagonal blocks and prefix blocks."""
    from gqakv.core.semantics import AttentionParams, visible_mask

    rng = np.random.default_rng(0 if window is None else window)
    params = AttentionParams(scale=1.0, window=window)
    for _ in range(300):
        L = int(rng.integers(1, 60))
        n = int(rng.integers(1, L + 1))
        t0 = int(rng.integers(0, n))
        t1 = int(rng.integers(t0 + 1, n + 1))
        js = int(rng.integers(0, L))
        je = int(rng.integers(js + 1, L + 1))
        s = rng.standard_normal((2, 3, t1 - t0, je - js))
        want = s.copy()
        visible = visible_mask(params, L, n, t0, t1, js, je)
        if visible is not None:
            np.copyto(want, -np.inf, where=~visible)
        na._mask(s, params, L, n, t0, t1, js, je, None)
        assert s.tobytes() == want.tobytes(), (L, n, t0, t1, js, je)
