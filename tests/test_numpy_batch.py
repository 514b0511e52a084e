"""The NumPy backend's small calls as one pass over the batch (``numpy_batch``).

Randomized ragged batches (rows of unequal length, padded and empty query slots, rows
not in order, NaN in every slot past a row's length, in the cache's buffers) through the
public API on the numpy backend, each call asserted to have taken the one-pass plan, against
the independent float64 reference (tests/support/reference.py), in every dtype and
variant the plan takes; the calls it must leave to the items; and the append's one
assignment against the per-row writes.
"""

from __future__ import annotations

import numpy as np
import pytest

import gqakv
from gqakv_backends import numpy_batch
from gqakv_backends.numpy_backend import WRITE

from gqakv.core.inputs import validate_append

from .support.reference import reference_attention

TOL = {"float64": 1e-10, "float32": 2e-5, "float16": 2e-3, "bfloat16": 2e-2}


def _filled(rng, B, hkv, d, dtype, max_len, page_size=None, kv_dtype=None):
    """An empty numpy KVCache of ``B`` rows (a PagedKVCache with ``page_size``; in
    ``kv_dtype`` codes if given) with NaN in every slot (every page of the pool; codes:
    random codes with NaN scales), and float64 K/V ``[B, hkv, max_len, d]`` holding
    values the cache's dtype stores exactly (codes: the values appended, not what the
    cache holds: read that back with ``live_kv``)."""
    coded = {} if kv_dtype is None else {"kv_dtype": kv_dtype}
    if page_size is None:
        cache = gqakv.KVCache(B, hkv, max_len, d, dtype=dtype, backend="numpy", **coded)
    else:
        cache = gqakv.PagedKVCache(B, hkv, max_len, d, page_size=page_size, dtype=dtype,
                                   backend="numpy", **coded)
    if kv_dtype is None:
        cache.k[...] = np.nan
        cache.v[...] = np.nan
    else:
        store = cache.store
        for buf in (store.k, store.v):
            buf[...] = rng.integers(0, 256, buf.shape).astype(buf.dtype)
        store.k_scale[...] = np.nan
        store.v_scale[...] = np.nan
    k = rng.standard_normal((B, hkv, max_len, d))
    v = rng.standard_normal((B, hkv, max_len, d))
    dt = np.float32 if kv_dtype is not None else cache.k.dtype
    k, v = (np.asarray(x.astype(dt), dtype=np.float64) for x in (k, v))  # stored values
    return cache, k, v


def _attend(cache, q, n_new, rows, **variant):
    """(out, lse) of one call, and whether its plan took the one pass."""
    plan = gqakv.plan_attention(cache, n_new, q_heads=q.shape[1], t_q=q.shape[2], rows=rows,
                                **variant)
    out, lse = plan.run(q, cache, return_lse=True)
    return out, lse, plan.work is not None and plan.work.batch is not None


def _variant(rng, Hq):
    kind = int(rng.integers(0, 4))
    if kind == 1:
        return {"window": int(rng.integers(1, 12))}
    if kind == 2:
        return {"softcap": float(rng.uniform(2, 20))}
    if kind == 3:
        sinks = rng.standard_normal(Hq).astype(np.float32).astype(np.float64)  # (held as float32)
        sinks[0] = -np.inf
        return {"sinks": sinks}
    return {}


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("seed", range(12))
def test_one_pass_matches_reference(seed, dtype, layout):
    rng = np.random.default_rng(seed)
    for _ in range(50):  # draws until one the one pass takes (most are)
        case = _ragged_case(rng, dtype, paged=layout == "paged")
        out, lse, one_pass = _attend(*case[:4], **case[-1])
        if one_pass:
            break
    assert one_pass, "no draw took the one pass over the batch"
    _check_against_reference(case, out, lse, TOL[dtype])


CODES = ["int8", "float8_e4m3fn", "int8_g32", "int4_g64", "int4_g32_rotated"]


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("kv_dtype", CODES)
@pytest.mark.parametrize("seed", range(4))
def test_one_pass_over_codes_matches_reference(seed, kv_dtype, layout):
    """The one pass over codes and scales (read as views, or gathered from pages) decoded
    at once: the float64 reference over the values the cache holds (``live_kv``: decoded,
    and unrotated for a rotating codec), with random codes and NaN scales in every slot
    past a row's length."""
    rng = np.random.default_rng(100 + seed)
    for _ in range(50):
        dtype = str(rng.choice(["float32", "float16", "bfloat16"]))
        case = _ragged_case(rng, dtype, paged=layout == "paged", kv_dtype=kv_dtype)
        out, lse, one_pass = _attend(*case[:4], **case[-1])
        if one_pass:
            break
    assert one_pass, "no draw took the one pass over the batch"
    _check_against_reference(case, out, lse, TOL[dtype], held=True)


def _check_against_reference(case, out, lse, tol, held=False):
    """``out`` / ``lse`` of ``case`` against the float64 reference over the K/V appended
    (``held``: over what the cache holds, ``live_kv``), padding exactly 0."""
    cache, q, n_new, rows, k, v, lens, variant = case
    if held:
        kv = [cache.live_kv(int(r)) for r in rows]
        keys = [np.asarray(a, dtype=np.float64) for a, _ in kv]
        values = [np.asarray(b, dtype=np.float64) for _, b in kv]
    else:
        keys = [k[r, :, :L] for r, L in zip(rows, lens)]
        values = [v[r, :, :L] for r, L in zip(rows, lens)]
    want, want_lse = reference_attention(np.asarray(q, dtype=np.float64), keys, values, n_new,
                                         **variant)
    out64 = np.asarray(out, dtype=np.float64)
    assert np.isfinite(out64).all()
    np.testing.assert_allclose(out64, want, atol=tol, rtol=tol)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    fin = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[fin], want_lse[fin], atol=tol, rtol=tol)
    for b, n in enumerate(n_new):
        assert not out64[b, :, n:].any()  # padded queries are exactly 0


def _ragged_case(rng, dtype, paged=False, kv_dtype=None):
    """A cache of 1-5 rows, NaN past each row's length, a call over some of them in random
    order (ragged lengths and chunks, empty entries, padded slots) and a random variant:
    ``(cache, q, n_new, rows, k, v, lens, variant)``, k / v the float64 truth. ``paged``:
    pages of 1-8 tokens, the rows written a few tokens at a time in turn, so that each
    row's pages lie scattered through the pool among the other rows'."""
    hkv, G, d = int(rng.choice([1, 2, 3])), int(rng.integers(1, 5)), int(rng.choice([4, 8, 16]))
    if kv_dtype is not None:
        d = 64  # a multiple of every codec's group
    rows_total = int(rng.integers(1, 6))
    B = int(rng.integers(1, rows_total + 1))
    rows = rng.permutation(rows_total)[:B]
    past = rng.integers(0, 20, B)
    n_new = rng.integers(0, 5, B)
    n_new[int(rng.integers(0, B))] = max(1, int(n_new.max()))  # some query in the call
    T = int(n_new.max()) + int(rng.integers(0, 2))  # padded slots past the longest chunk too
    page_size = int(rng.choice([1, 2, 3, 4, 8])) if paged else None
    cache, k, v = _filled(rng, rows_total, hkv, d, dtype, max_len=40, page_size=page_size,
                          kv_dtype=kv_dtype)
    full = np.zeros(rows_total, dtype=np.int64)
    full[rows] = past + n_new
    dt = gqakv.get_backend("numpy").from_numpy(np.zeros(1), dtype).dtype  # q's, K/V's
    while (left := full - np.asarray(cache.lens)).any():  # each row's tokens, through the API
        r = int(rng.choice(np.flatnonzero(left)))
        s, n = int(cache.lens[r]), min(int(left[r]), int(rng.integers(1, 6)))
        cache.append(k[r:r + 1, :, s:s + n].astype(dt), v[r:r + 1, :, s:s + n].astype(dt), [n],
                     rows=[r])
    q = rng.standard_normal((B, hkv * G, T, d)).astype(dt)
    return cache, q, n_new, rows, k, v, full[rows], _variant(rng, hkv * G)


def test_packed_equal_chunks_take_the_one_pass():
    """Packed queries ``[B * n, Hq, d]`` with the same n per entry: the same bits as padded."""
    rng = np.random.default_rng(3)
    cache, k, v = _filled(rng, 3, 2, 8, "float32", max_len=30)
    cache.append(k[:, :, :9].astype(np.float32), v[:, :, :9].astype(np.float32), [7, 9, 4])
    n_new = [2, 2, 2]
    q = rng.standard_normal((3, 6, 2, 8)).astype(np.float32)
    padded, lse_p, one_pass = _attend(cache, q, n_new, None)
    plan = gqakv.plan_attention(cache, n_new, q_heads=6, packed=True)
    assert plan.work.batch is not None and plan.work.batch.packed
    packed, lse_k = plan.run(q.transpose(0, 2, 1, 3).reshape(6, 6, 8), cache, return_lse=True)
    assert one_pass
    np.testing.assert_array_equal(packed.reshape(3, 2, 6, 8).transpose(0, 2, 1, 3), padded)
    np.testing.assert_array_equal(lse_k.reshape(3, 2, 6).transpose(0, 2, 1), lse_p)


def test_what_the_items_keep():
    """ALiBi, draft trees, batch-invariant mode, packed
    chunks of unequal length, calls over ``BATCH_MAX_SCORES`` (codes:
    ``BATCH_MAX_CODED_SCORES``) and calls that would pad
    more than ``BATCH_MAX_WASTE`` times their own scores run the items."""
    rng = np.random.default_rng(5)

    def planned(cache, n_new, **kw):
        plan = gqakv.plan_attention(cache, n_new, q_heads=4, **kw)
        return plan.work.batch

    cache, k, v = _filled(rng, 2, 2, 8, "float32", max_len=4000)
    cache.append(k[:, :, :12].astype(np.float32), v[:, :, :12].astype(np.float32), [12, 12])
    assert planned(cache, [1, 1]) is not None
    assert planned(cache, [1, 1], alibi_slopes=[0.1, 0.2, 0.3, 0.4]) is None
    assert planned(cache, [1, 1], packed=True) is not None
    assert planned(cache, [1, 3], packed=True) is None
    with gqakv.batch_invariant():
        assert planned(cache, [1, 1]) is None
    # a row of 12 beside one of 2,000 tokens: padded to 2,000 keys, 1.99x its own scores
    long = np.zeros((1, 2, 2000, 8), dtype=np.float32)
    cache.append(long[:, :, :1988], long[:, :, :1988], [1988], rows=[1])
    assert planned(cache, [1, 1]) is not None  # (2 x 2,000 padded, 2,012 own: under 2x)
    short = gqakv.KVCache(3, 2, 4000, 8, dtype="float32", backend="numpy")
    short.append(np.zeros((3, 2, 1, 8), np.float32), np.zeros((3, 2, 1, 8), np.float32), [1, 1, 1])
    short.append(long[:, :, :1990], long[:, :, :1990], [1990], rows=[2])
    assert planned(short, [1, 1, 1]) is None  # 3 x 1,991 padded against 1,993 own
    big = gqakv.KVCache(1, 2, 4200, 8, dtype="float32", backend="numpy")
    big.append(np.zeros((1, 2, 4096, 8), np.float32), np.zeros((1, 2, 4096, 8), np.float32), [4096])
    assert planned(big, [8]) is not None  # 4 heads x 8 queries x 4,096 keys: BATCH_MAX_SCORES
    big.append(np.zeros((1, 2, 1, 8), np.float32), np.zeros((1, 2, 1, 8), np.float32), [1])
    assert planned(big, [8]) is None  # one key more
    paged = gqakv.PagedKVCache(2, 2, 64, 8, page_size=16, dtype="float32", backend="numpy")
    paged.append(np.zeros((2, 2, 5, 8), np.float32), np.zeros((2, 2, 5, 8), np.float32), [5, 5])
    assert planned(paged, [1, 1]).pages is not None  # pages: gathered (test_paged_* below)
    coded = gqakv.KVCache(2, 2, 64, 8, kv_dtype="int8", backend="numpy")
    coded.append(np.ones((2, 2, 5, 8), np.float32), np.ones((2, 2, 5, 8), np.float32), [5, 5])
    assert planned(coded, [1, 1]) is not None  # codes: decoded at once (test_one_pass_over_codes_*)
    wide = gqakv.KVCache(1, 2, 4200, 8, kv_dtype="int8", backend="numpy")
    wide.append(np.ones((1, 2, 1024, 8), np.float32), np.ones((1, 2, 1024, 8), np.float32), [1024])
    assert planned(wide, [8]) is not None  # 4 heads x 8 queries x 1,024 keys: 2^15
    wide.append(np.ones((1, 2, 1, 8), np.float32), np.ones((1, 2, 1, 8), np.float32), [1])
    assert planned(wide, [8]) is None  # one key more: BATCH_MAX_CODED_SCORES
    # numba: its kernels take small calls, and a chunk its BLAS path takes keeps the items
    pytest.importorskip("numba")
    chunk = gqakv.KVCache(1, 2, 300, 8, dtype="float32", backend="numba")
    chunk.append(np.zeros((1, 2, 200, 8), np.float32), np.zeros((1, 2, 200, 8), np.float32), [200])
    work = planned(chunk, [16])
    assert work is None and gqakv.get_backend("numba").route(
        "attention", dtype="float32", head_dim=8, layout="contiguous", codec=None, t_q=16,
        keys=200, group=2).impl == "numpy BLAS"


def test_nan_past_a_short_row_stays_out():
    """Rows of 3 and 30 tokens: the short row's one pass reads 27 slots past its length,
    all NaN in both buffers; its output is the reference's, finite."""
    rng = np.random.default_rng(9)
    cache, k, v = _filled(rng, 2, 1, 4, "float64", max_len=40)
    cache.append(k[:, :, :30], v[:, :, :30], [3, 30])
    q = rng.standard_normal((2, 2, 1, 4))
    out, lse, one_pass = _attend(cache, q, [1, 1], None)
    assert one_pass and np.isfinite(out).all()
    want, _ = reference_attention(q, [k[0, :, :3], k[1, :, :30]], [v[0, :, :3], v[1, :, :30]], [1, 1])
    np.testing.assert_allclose(out, want, atol=1e-12)


def test_gather_copies_the_indexed_pool_rows_and_values_outside_are_zeroed():
    """``gather_pages`` copies the indexed rows of each pool (values, codes or scales of
    any trailing shape); ``_zero_outside`` then zeroes an entry's values outside its own
    keys whatever they held (NaN here), so that p = 0 there adds nothing."""
    pool_k = np.full((3, 2, 4, 8), np.nan, dtype=np.float32)  # [num_pages, Hkv, P, d]
    pool_s = np.arange(3 * 2 * 4, dtype=np.float32).reshape(3, 2, 4)  # per-token scales
    pool_k[1] = 1.0
    pool_k[1, 1, 2] = 5.0
    rows = (1 * 2 + np.arange(2)[None, :, None]) * 4 + np.arange(4)[None, None, :]  # page 1
    index = np.concatenate([rows, np.zeros_like(rows)])  # entry 1 reads NaN rows
    k_out = np.empty((2, 2, 4, 8), np.float32)
    s_out = np.empty((2, 2, 4), np.float32)
    numpy_batch.gather_pages((pool_k, pool_s), index, (k_out, s_out))
    np.testing.assert_array_equal(k_out[0], pool_k[1])
    np.testing.assert_array_equal(s_out[0], pool_s[1])
    np.testing.assert_array_equal(s_out[1], np.zeros((2, 4)))  # pool row 0's scale: 0
    assert np.isnan(k_out[1]).all()
    numpy_batch._zero_outside(k_out, [(10, 14), (11, 13)], 10)
    np.testing.assert_array_equal(k_out[0], pool_k[1])  # its own keys: all of them
    assert not k_out[1, :, 0].any() and not k_out[1, :, 3].any()  # outside keys 11..12
    assert np.isnan(k_out[1, :, 1:3]).all()  # its own keys, as they are


def test_paged_window_reads_no_released_page():
    """A windowed PagedKVCache releases the pages behind each row's window: rows of
    unequal length then read a key range whose start lies on released pages (-1) of the
    longer rows. The one pass takes the call, reads none of them, and matches the
    reference."""
    rng = np.random.default_rng(21)
    W, d = 6, 8
    cache = gqakv.PagedKVCache(3, 2, 64, d, page_size=2, window=W, dtype="float64",
                               backend="numpy")
    cache.k[...] = np.nan
    cache.v[...] = np.nan
    k, v = rng.standard_normal((3, 2, 64, d)), rng.standard_normal((3, 2, 64, d))
    lens = [14, 10, 9]  # window keys 8..13, 4..9 and 3..8: the one pass reads keys 3..13
    for r, L in enumerate(lens):
        for s in range(0, L, 3):
            n = min(3, L - s)
            cache.append(k[r:r + 1, :, s:s + n], v[r:r + 1, :, s:s + n], [n], rows=[r])
    assert (np.asarray(cache.store.page_table.entries)[0, 1:3] < 0).all()  # keys 2..5 released
    q = rng.standard_normal((3, 4, 1, d))
    out, lse, one_pass = _attend(cache, q, [1, 1, 1], None, window=W)
    assert one_pass
    want, want_lse = reference_attention(q, [k[r, :, :L] for r, L in enumerate(lens)],
                                         [v[r, :, :L] for r, L in enumerate(lens)], [1, 1, 1],
                                         window=W)
    np.testing.assert_allclose(out, want, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, atol=1e-12)


def test_paged_plan_follows_the_table_it_runs_over():
    """A plan made over one paged cache runs over another of the same lengths (another
    layer's) whose pages lie elsewhere, and back: each run reads its own cache's pages
    (the index is rebuilt when the table or its version differs from the one planned)."""
    rng = np.random.default_rng(23)
    caches = []
    for order in ([0, 1, 2], [2, 0, 1]):  # the rows' pages taken in another order
        cache, k, v = _filled(rng, 3, 2, 8, "float32", max_len=32, page_size=4)
        for r in order:
            cache.append(k[r:r + 1, :, :10].astype(np.float32),
                         v[r:r + 1, :, :10].astype(np.float32), [10], rows=[r])
        caches.append((cache, k, v))
    plan = gqakv.plan_attention(caches[0][0], [1, 1, 1], q_heads=4)
    assert plan.work.batch is not None and plan.work.batch.pages is not None
    q = rng.standard_normal((3, 4, 1, 8)).astype(np.float32)
    for cache, k, v in (caches[1], caches[0], caches[1]):
        out = plan.run(q, cache)
        want, _ = reference_attention(np.asarray(q, np.float64), list(k[:, :, :10]),
                                      list(v[:, :, :10]), [1, 1, 1])
        np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)
    cache, k, v = caches[0]
    cache.reorder([1, 2, 0])  # entries change, version counts: rows now hold 1, 2, 0
    out = plan.run(q, cache)
    want, _ = reference_attention(np.asarray(q, np.float64), list(k[[1, 2, 0], :, :10]),
                                  list(v[[1, 2, 0], :, :10]), [1, 1, 1])
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("longest", [numpy_batch.WRITE_MAX_ROW_TOKENS, numpy_batch.WRITE_MAX_ROW_TOKENS + 1])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_append_in_one_assignment_matches_per_row_writes(packed, dtype, longest, monkeypatch):
    """``numpy write_tokens`` (the route of a plain append) writes what the generic per-row
    writes do, ragged and with rows out of order: by one assignment when no entry has
    more than ``WRITE_MAX_ROW_TOKENS`` new tokens, else row by row (``write_rows``)."""
    rng = np.random.default_rng(11)
    backend = gqakv.get_backend("numpy")
    one = gqakv.KVCache(4, 2, 16, 8, dtype=dtype, backend="numpy")
    other = gqakv.KVCache(4, 2, 16, 8, dtype=dtype, backend="numpy")
    n_new, rows = [3, 0, longest], [2, 0, 1]
    for cache in (one, other):
        cache.append(np.ones((4, 2, 2, 8), one.k.dtype), np.ones((4, 2, 2, 8), one.k.dtype), [2, 1, 0, 2])
    shape = (sum(n_new), 2, 8) if packed else (3, 2, longest, 8)
    k = rng.standard_normal(shape).astype(one.k.dtype)
    v = rng.standard_normal(shape).astype(one.k.dtype)
    tokens = "packed" if packed else "padded"
    assert backend.route("write_kv", dtype=dtype, head_dim=8, layout="contiguous", codec=None,
                         tokens=tokens).impl == WRITE
    ran = []
    for name in ("write_tokens", "write_rows"):
        real = getattr(numpy_batch, name)
        monkeypatch.setattr(numpy_batch, name, lambda *a, real=real, name=name: ran.append(name) or real(*a))
    one.append(k, v, n_new, rows=rows)
    assert ran == ["write_tokens" if longest <= numpy_batch.WRITE_MAX_ROW_TOKENS else "write_rows"]
    gqakv.Backend.write_kv(backend, other.store, k, v, validate_append(other, k, v, n_new, rows))
    for r, L in enumerate(np.asarray(one.lens)):  # the written slots, bit for bit
        for a, b in ((one.k, other.k), (one.v, other.v)):
            np.testing.assert_array_equal(a[r, :, :L].view(np.uint8), b[r, :, :L].view(np.uint8))
    assert np.asarray(one.lens).tolist() == [2 + 0, 1 + longest, 0 + 3, 2]  # rows 2, 0, 1 got 3, 0, longest
    assert backend.route("write_kv", dtype=dtype, head_dim=8, layout="paged", codec=None).impl == WRITE
    assert backend.route("write_kv", dtype=dtype, head_dim=8, layout="contiguous",
                         codec="int8").impl == WRITE  # codes: test_coded_append_* below


CODECS = ["int8", "float8_e4m3fn", "int8_g32", "int4_g32", "int4_g64", "int4_g32_rotated"]


@pytest.mark.parametrize("backend", ["numpy", "numba"])
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("kv_dtype", CODECS)
def test_coded_append_matches_per_row_writes(kv_dtype, packed, layout, backend, monkeypatch):
    """Codes and scales of every built-in codec, every new token encoded by one call and
    written by one assignment per part (``numpy_batch.write_coded``, route ``numpy
    write_tokens`` on numpy and numba): bit for bit what the generic per-row writes store
    (the same appends into a second cache with ``numpy_batch.append`` swapped for them),
    ragged, rows out of order, with tokens of every magnitude (zeros, 1e-30, 1e20), in two
    appends (the second across page ends), then one written row by row."""
    if backend == "numba":
        pytest.importorskip("numba")
    rng = np.random.default_rng(17)
    d = 64
    make = gqakv.PagedKVCache if layout == "paged" else gqakv.KVCache
    paged = {"page_size": 4} if layout == "paged" else {}
    one, other = (make(4, 2, 24, d, dtype="float32", kv_dtype=kv_dtype, backend=backend, **paged)
                  for _ in range(2))
    be = one.backend
    assert be.route("write_kv", dtype="float32", head_dim=d, layout=layout, codec=kv_dtype,
                    tokens="packed" if packed else "padded").impl == WRITE
    appends = []
    # two appends by one assignment, one row by row (an entry of 6 tokens)
    for n_new, rows in (([3, 0, 4], [2, 0, 1]), ([4, 2, 1, 2], [1, 3, 0, 2]), ([1, 6], [0, 3])):
        B, total = len(n_new), sum(n_new)
        shape = (total, 2, d) if packed else (B, 2, max(n_new), d)
        size = rng.choice([1e-30, 1.0, 1e20], shape[:-1])[..., None]
        k = (rng.standard_normal(shape) * size).astype(np.float32)
        v = rng.standard_normal(shape).astype(np.float32)
        k[0] = 0.0  # tokens of zeros (scale 0)
        appends.append((k, v, n_new, rows))
    calls = []
    real_coded = numpy_batch.write_coded
    monkeypatch.setattr(numpy_batch, "write_coded", lambda *a: calls.append(1) or real_coded(*a))
    for k, v, n_new, rows in appends:
        one.append(k, v, n_new, rows=rows)
    assert len(calls) == 2  # one encode-and-write per short append (the long one: by rows)
    monkeypatch.setattr(numpy_batch, "append", lambda store, k, v, inputs:
                        gqakv.Backend.write_kv(be, store, k, v, inputs))
    for k, v, n_new, rows in appends:
        other.append(k, v, n_new, rows=rows)
    assert len(calls) == 2
    assert np.array_equal(np.asarray(one.lens), np.asarray(other.lens))
    if paged:
        entries = np.asarray(one.store.page_table.entries)
        np.testing.assert_array_equal(entries, np.asarray(other.store.page_table.entries))
    for r, L in enumerate(np.asarray(one.lens)):  # the written slots (the rest is never set)
        j = np.arange(L)
        at = (entries[r, j // 4], slice(None), j % 4) if paged else (r, slice(None), j)
        for a, b in zip(one.store.buffers, other.store.buffers):
            np.testing.assert_array_equal(np.asarray(a)[at].view(np.uint8),
                                          np.asarray(b)[at].view(np.uint8))


@pytest.mark.parametrize("backend", ["numpy", "numba"])
@pytest.mark.parametrize("packed", [False, True])
def test_paged_append_in_one_assignment(packed, backend):
    """Appends into 4-token pages (ragged, rows out of order, across page ends) land where
    the page table says: every row reads back what a contiguous cache got from the same
    appends; a slot on no page raises before anything is written. numba's paged appends
    take the same route."""
    if backend == "numba":
        pytest.importorskip("numba")
        route = gqakv.get_backend("numba").route("write_kv", dtype="float32", head_dim=8,
                                                 layout="paged", codec=None)
        assert route.impl == WRITE
    rng = np.random.default_rng(13)
    paged = gqakv.PagedKVCache(3, 2, 24, 8, page_size=4, dtype="float32", backend=backend)
    flat = gqakv.KVCache(3, 2, 24, 8, dtype="float32", backend="numpy")
    for n_new, rows in (([3, 6, 1], [1, 0, 2]), ([5, 0, 2], [2, 1, 0]), ([1, 1, 1], None)):
        total, B = sum(n_new), len(n_new)
        shape = (total, 2, 8) if packed else (B, 2, max(n_new), 8)
        k, v = rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)
        for cache in (paged, flat):
            cache.append(k, v, n_new, rows=rows)
    entries = np.asarray(paged.store.page_table.entries)
    for r, L in enumerate(np.asarray(flat.lens)):
        j = np.arange(L)
        for pool, want in ((paged.k, flat.k), (paged.v, flat.v)):
            got = pool[entries[r, j // 4], :, j % 4]  # [L, Hkv, d]
            np.testing.assert_array_equal(got, want[r, :, :L].swapaxes(0, 1))
    from gqakv.core.inputs import AppendInputs

    before = paged.k.copy()
    far = AppendInputs(rows=np.array([0, 1]), starts=np.array([int(paged.lens[0]), 20]),
                       n_new=np.array([1, 1]))
    x = np.ones((2, 2, 1, 8), np.float32)
    with pytest.raises(RuntimeError, match="row 1's slot 20 is on no page"):
        numpy_batch.append(paged.store, x, x, far)
    np.testing.assert_array_equal(paged.k, before)
    long = AppendInputs(rows=np.array([0, 1]), starts=np.array([int(paged.lens[0]), 18]),
                        n_new=np.array([1, 5]))  # row 1's slots 18..22: on no page
    x = np.ones((2, 2, 5, 8), np.float32)
    with pytest.raises(RuntimeError, match="row 1's slot 18 is on no page"):
        numpy_batch.append(paged.store, x, x, long)  # (row by row: more than 4 tokens)
    np.testing.assert_array_equal(paged.k, before)


def test_one_pass_and_write_are_the_host_time_kernels():
    """The numpy backend declares the one pass, its paged gather and the append's moves as its kernels, so
    the host-time benchmark gives its host work; no-op'd, a decode step computes nothing."""
    from gqakv.tools.host_time import step_host_time

    backend = gqakv.get_backend("numpy")
    assert set(backend.kernel_entries()) == {("gqakv_backends.numpy_batch", "attend_batch"),
                                             ("gqakv_backends.numpy_batch", "gather_pages"),
                                             ("gqakv_backends.numpy_batch", "decode_values"),
                                             ("gqakv_backends.numpy_batch", "write_tokens"),
                                             ("gqakv_backends.numpy_batch", "write_coded"),
                                             ("gqakv_backends.numpy_batch", "write_rows")}
    host = step_host_time(backend, layers=2, batch=2, kv_heads=2, group=2, head_dim=8, rounds=1,
                          steps_per_round=1)
    assert host["host_s"] is not None and 0 < host["host_s"]
    assert numpy_batch.attend_batch.__module__ == "gqakv_backends.numpy_batch"  # put back
