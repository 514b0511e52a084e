"""The numba backend's kernels against the float64 reference, and its routing.

The backend-parametrized parity suite (test_attention.py and others) also runs on
numba; here: the in-register float16/bfloat16 conversions bit for bit over every
pattern, randomized ragged chunks in float32/float16/bfloat16 with every split forced
on small shapes (NaN past each row's length, empty rows, padded queries), float16
special values, the attention variants (window, softcap, sinks) against the float64
loop reference of test_numpy_attention, and which implementation serves a call and why.

Compile cost: every call here uses the same argument types, so the suite compiles
each kernel once per process (float32 buffers, uint16 buffers, the merge); with
``cache=True`` later processes load them from __pycache__.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import gqakv

numba = pytest.importorskip("numba")
ml_dtypes = pytest.importorskip("ml_dtypes")

from gqakv_backends import numba_kernels as nk  # noqa: E402
from gqakv_backends.numba_backend import NumbaBackend, attention_numba, default_workers  # noqa: E402

from gqakv.core.semantics import AttentionParams, key_range  # noqa: E402

from .support.reference import reference_attention, reference_on_buffers  # noqa: E402
from .support.variants import random_variant  # noqa: E402

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
SPLIT_EVERYTHING = dict(workers=3, query_block=2, min_key_split=2, key_block=3, parallel_min_work=0)


def _case(rng, lens, n_new, hkv, G, d, dtype):
    """Buffers [B, Hkv, max_len, d] (NaN past each row's length) and q [B, Hq, T, d] in dtype."""
    B, max_len = len(lens), max(lens) + 3
    k = np.full((B, hkv, max_len, d), np.nan)
    v = k.copy()
    for b, L in enumerate(lens):
        k[b, :, :L] = rng.standard_normal((hkv, L, d))
        v[b, :, :L] = rng.standard_normal((hkv, L, d))
    q = rng.standard_normal((B, hkv * G, max(max(n_new), 1), d))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


def _reference(q, k, v, lens, n_new):
    f64 = lambda x: np.asarray(x, dtype=np.float64)  # noqa: E731
    return reference_attention(f64(q), [f64(k[b, :, :L]) for b, L in enumerate(lens)],
                               [f64(v[b, :, :L]) for b, L in enumerate(lens)], n_new,
                               scale=1.0 / math.sqrt(q.shape[-1]))


def _run(q, k, v, lens, n_new, **kw):
    return attention_numba(q, k, v, np.arange(len(lens)), np.asarray(lens), np.asarray(n_new),
                           scale=1.0 / math.sqrt(q.shape[-1]), return_lse=True, **kw)


def _check(out, lse, want, want_lse, n_new, dtype):
    """FlashAttention's rule: the error is at most a few times that of storing the exact
    result in ``dtype`` (the kernels compute in float32 and round the output once)."""
    got = out.astype(np.float64)
    naive = np.abs(want.astype(dtype).astype(np.float64) - want).max(initial=0.0)
    assert np.abs(got - want).max(initial=0.0) <= 2 * naive + 1e-5
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    fin = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[fin], want_lse[fin], rtol=0, atol=1e-5)
    for b, n in enumerate(n_new):  # padded queries are exactly 0
        assert not out[b, :, n:].any()


# -- conversions ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_conversion_is_bit_exact_for_every_pattern(name):
    """All 65,536 bit patterns (zeros, subnormals, normals, inf, NaN payloads) convert to
    exactly the float32 bits NumPy's / ml_dtypes' astype gives."""
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    got = np.empty(bits.size, dtype=np.float32)
    nk.convert_bits(bits.view(nk.BITS_VIEW[name]), got)  # the kernels' own decode
    want = bits.view(DTYPES[name]).astype(np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_exp_matches_float64_within_two_ulp():
    x = np.concatenate([-np.logspace(-9, 2, 20001), [0.0, -0.0, -86.9, -87.5, -1e30]]).astype(np.float32)
    got = np.array([nk.exp_nonpos(v) for v in x[::40]] + [nk.exp_nonpos(v) for v in x[-5:]],
                   dtype=np.float32)
    xs = np.concatenate([x[::40], x[-5:]])
    _assert_exp_close(got, np.exp(xs.astype(np.float64)))
    assert nk.exp_nonpos(np.float32(-np.inf)) == 0.0 and np.isnan(nk.exp_nonpos(np.float32(np.nan)))


# -- attention against the reference ----------------------------------------------------------

@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("seed", range(6))
def test_random_ragged_chunks_match_reference(dtype, seed):
    """Random ragged chunks (decode and short prefill chunks, empty rows, padding), G in
    1..8 and d in 16/64/80/128, once with the default plan and once split everywhere."""
    rng = np.random.default_rng(100 + seed)
    hkv, G = int(rng.choice([1, 2, 4])), int(rng.integers(1, 9))
    d = [16, 64, 80, 128][seed % 4]
    B = int(rng.integers(1, 5))
    lens = [int(x) for x in rng.integers(0, 60, B)]
    n_new = [int(rng.integers(0, min(L, 6) + 1)) if L else 0 for L in lens]
    q, k, v = _case(rng, lens, n_new, hkv, G, d, DTYPES[dtype])
    want, want_lse = _reference(q, k, v, lens, n_new)
    for knobs in ({}, SPLIT_EVERYTHING):
        out, lse = _run(q, k, v, lens, n_new, **knobs)
        assert out.dtype == q.dtype and lse.dtype == np.float32
        _check(out, lse, want, want_lse, n_new, DTYPES[dtype])


def test_long_row_split_over_keys_merges_by_lse():
    """One long MQA row: only its keys can be split among the threads."""
    rng = np.random.default_rng(7)
    lens, n_new = [700], [1]
    q, k, v = _case(rng, lens, n_new, 1, 4, 64, np.float32)
    want, want_lse = _reference(q, k, v, lens, n_new)
    out, lse = _run(q, k, v, lens, n_new, workers=4, min_key_split=16, parallel_min_work=0)
    _check(out, lse, want, want_lse, n_new, np.float32)


def test_float16_special_values_follow_the_reference():
    """Subnormal K/V values take part exactly; an inf in a live key gives what the float64
    reference gives (NaN or a finite result, per query); NaN in the tail is never read."""
    rng = np.random.default_rng(3)
    lens, n_new = [9, 6], [2, 1]
    q, k, v = _case(rng, lens, n_new, 1, 2, 16, np.float16)
    sub = np.float16(6e-8)  # the smallest float16 subnormal
    assert sub != 0 and abs(sub) < np.finfo(np.float16).tiny
    k[0, 0, 3] = sub
    v[0, 0, 2, :4] = [sub, -sub, np.float16(3e-5), np.float16(-6.1e-5)]
    want, want_lse = _reference(q, k, v, lens, n_new)
    out, lse = _run(q, k, v, lens, n_new)
    _check(out, lse, want, want_lse, n_new, np.float16)

    k[1, 0, 4, 5] = np.inf  # live: queries whose score becomes +inf give NaN, -inf drop the key
    want, want_lse = _reference(q, k, v, lens, n_new)
    out, lse = _run(q, k, v, lens, n_new, **SPLIT_EVERYTHING)
    got = out.astype(np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    fin = np.isfinite(want)
    naive = np.abs(want[fin].astype(np.float16).astype(np.float64) - want[fin]).max()
    assert np.abs(got[fin] - want[fin]).max() <= 2 * naive + 1e-5
    assert np.isnan(want).any()  # the case does exercise an infinite score


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_nan_scores_make_their_queries_nan_and_no_others(dtype):
    """A NaN query, and a NaN in a live key, give NaN out and lse for exactly the queries
    whose scores include NaN (the reference's rule), with every split forced (pieces
    merged by LSE) and without; the other queries match the reference; padded slots and
    empty rows stay 0 / -inf; the NaN tails past each length are never read."""
    rng = np.random.default_rng(23)
    lens, n_new = [40, 0, 33], [3, 0, 1]
    hkv, G, d = 2, 3, 16
    q, k, v = _case(rng, lens, n_new, hkv, G, d, DTYPES[dtype])
    q[0, 4, 1] = np.nan  # entry 0, query head 4 (KV head 1), second query of the chunk
    # a live key of entry 2, KV head 0 (its 3 query heads see it): a signaling NaN, which
    # the dots widen without restoring its bits (any NaN gives NaN)
    signaling = {"float32": (np.uint32, 0x7F800001), "float16": (np.uint16, 0x7C01),
                 "bfloat16": (np.uint16, 0x7F81)}[dtype]
    k[2, 0, 20, 5] = 0.0
    want, want_lse = _reference(q, k, v, lens, n_new)  # the NaN key as 0: the other queries' result
    k.view(signaling[0])[2, 0, 20, 5] = signaling[1]
    assert np.isnan(k[2, 0, 20, 5])
    bad = np.zeros(want_lse.shape, bool)
    bad[0, 4, 1] = True
    bad[2, :G, 0] = True
    for knobs in ({}, SPLIT_EVERYTHING):
        out, lse = _run(q, k, v, lens, n_new, **knobs)
        got = out.astype(np.float64)
        assert np.isnan(got[bad]).all() and np.isnan(lse[bad]).all()
        assert not np.isnan(got[~bad]).any() and not np.isnan(lse[~bad]).any()
        keep = ~bad[..., None].repeat(d, -1)
        naive = np.abs(want[keep].astype(DTYPES[dtype]).astype(np.float64) - want[keep]).max()
        assert np.abs(got[keep] - want[keep]).max() <= 2 * naive + 1e-5
        fin = ~bad & np.isfinite(want_lse)
        np.testing.assert_allclose(lse[fin], want_lse[fin], rtol=0, atol=1e-5)
        assert not out[1].any() and np.isneginf(lse[1]).all()  # the empty row
        assert not out[2, :, 1:].any() and np.isneginf(lse[2, :, 1:]).all()  # padded slots


def test_padded_queries_and_empty_rows_are_exact():
    rng = np.random.default_rng(5)
    lens, n_new = [0, 12, 4], [0, 1, 4]
    for dtype in DTYPES.values():
        q, k, v = _case(rng, lens, n_new, 2, 3, 16, dtype)
        out, lse = _run(q, k, v, lens, n_new, **SPLIT_EVERYTHING)
        assert not out[0].any() and np.isneginf(lse[0]).all()
        assert not out[1, :, 1:].any() and np.isneginf(lse[1, :, 1:]).all()
        assert np.isfinite(out.astype(np.float32)).all()  # NaN tails were not read


# -- routing, threads, availability -----------------------------------------------------------

def test_bfloat16_queries_reach_the_pair_product_dots_exactly_over_plain_bfloat16_keys():
    """``_kernel_queries``: q reaches the kernels as bfloat16 bits (int16: the dots' pair
    products, ``numba_kernels._dots_rows``) exactly where the keys are plain bfloat16
    (an int16 array or a ``Paged`` pool of them) and q holds bfloat16 values (bfloat16,
    or float32 whose low 16 bits are zero); everywhere else float32. Both carry q's
    values, and float32 queries holding bfloat16 values give the bfloat16 queries' lse
    bit for bit (the same route)."""
    from gqakv_backends.numba_backend import _kernel_queries

    rng = np.random.default_rng(31)
    qb = rng.standard_normal((2, 4, 3, 32)).astype(DTYPES["bfloat16"])
    held = qb.astype(np.float32)
    loose = held + np.float32(1e-3)  # not bfloat16 values any more
    assert (loose.view(np.uint32) & 0xFFFF).any()
    bf16_keys = np.zeros((2, 2, 8, 32), np.int16)
    paged = nk.paged(np.zeros((3, 2, 16, 32), np.int16), np.zeros((2, 1), np.int32), False)
    quantized = nk.Quantized(np.zeros((2, 2, 8, 32), np.int8), np.ones((2, 2, 8), np.float32))
    for q, keys, int16 in ((qb, bf16_keys, True), (held, bf16_keys, True), (qb, paged, True),
                           (loose, bf16_keys, False), (qb, np.zeros((2, 2, 8, 32), np.uint16), False),
                           (qb, np.zeros((2, 2, 8, 32), np.float32), False), (qb, quantized, False),
                           (held.astype(np.float16), bf16_keys, False)):
        got = _kernel_queries(q, keys, nk)
        assert got.dtype == (np.int16 if int16 else np.float32), (q.dtype, type(keys))
        assert got.flags.c_contiguous and got.shape == q.shape
        as32 = got.view(DTYPES["bfloat16"]).astype(np.float32) if int16 else got
        np.testing.assert_array_equal(as32, q.astype(np.float32))
    lens, n_new = [40, 9], [3, 1]
    _, k, v = _case(rng, lens, n_new, 2, 2, 32, DTYPES["bfloat16"])
    _, lse_b = _run(qb, k, v, lens, n_new)
    _, lse_f = _run(held, k, v, lens, n_new)
    np.testing.assert_array_equal(lse_b.view(np.uint32), lse_f.view(np.uint32))


def test_route_names_the_implementation_and_the_reason():
    b = NumbaBackend()
    f32 = np.zeros((1, 2, 8, 4), np.float32)
    assert b.attention_route(np.zeros((1, 2, 1, 4), np.float32), f32, f32) == ("numba kernel", "")
    route, why = b.attention_route(np.zeros((1, 2, 1, 4)), f32.astype(np.float64), f32.astype(np.float64))
    assert route == "numpy BLAS" and "dtype=float64" in why
    route, why = b.attention_route(np.zeros((1, 2, 64, 4), np.float32), f32, f32)
    assert route == "numpy BLAS" and "T=64" in why
    strided = np.zeros((1, 2, 8, 8), np.float32)[..., ::2]
    route, why = b.attention_route(np.zeros((1, 2, 1, 4), np.float32), strided, strided)
    assert route == "numpy BLAS" and "contiguous" in why


def test_backend_through_the_public_api_in_float16():
    """A float16 cache on the numba backend: append, then decode, against the reference."""
    rng = np.random.default_rng(11)
    cache = gqakv.KVCache(2, 2, 20, 16, dtype="float16", backend="numba")
    k = rng.standard_normal((2, 2, 5, 16)).astype(np.float16)
    v = rng.standard_normal((2, 2, 5, 16)).astype(np.float16)
    cache.append(k, v, [5, 3])
    q = rng.standard_normal((2, 4, 1, 16)).astype(np.float16)
    out, lse = gqakv.gqa_attention(q, cache, [1, 1], return_lse=True)
    want, want_lse = _reference(q, k, v, [5, 3], [1, 1])
    _check(out, lse, want, want_lse, [1, 1], np.float16)


def test_auto_picks_numba_on_a_cpu(monkeypatch):
    monkeypatch.delenv("GQAKV_BACKEND", raising=False)
    names = [b.name for b in gqakv.list_backends()]
    assert names.index("numba") < names.index("numpy")
    assert gqakv.get_backend(dtype="float16", head_dim=128).name in ("numba", "cupy")


def test_unavailable_when_numba_cannot_import(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "numba", None)  # import numba raises ImportError
    why = NumbaBackend().unavailable_reason()
    assert why and "numba is not importable" in why


def test_threads_follow_gqakv_num_threads(monkeypatch):
    monkeypatch.setenv("GQAKV_NUM_THREADS", "1")
    assert default_workers() == 1
    monkeypatch.delenv("GQAKV_NUM_THREADS")
    assert default_workers() == numba.config.NUMBA_NUM_THREADS


def test_float32_prefetch_plan_follows_the_cpu_numba_compiles_for():
    """AMD Zen prefetches float32 rows far ahead into L2 (small pages too); every other CPU
    keeps the near prefetch into L1 it was measured with; the kernels' constants are the
    plan of the CPU numba targets."""
    near = (nk.PREFETCH_BYTES, 3, False)
    for cpu in ("znver3", "znver4", "znver5"):
        ahead, locality, small_pages = nk.float32_prefetch(cpu)
        assert ahead > nk.PREFETCH_BYTES and locality == 1 and small_pages
    for cpu in ("sapphirerapids", "skylake-avx512", "haswell", "generic", ""):
        assert nk.float32_prefetch(cpu) == near
    assert (nk.FLOAT32_PREFETCH_BYTES, nk.FLOAT32_PREFETCH_LOCALITY,
            nk.FLOAT32_SMALL_PAGE_PREFETCH) == nk.float32_prefetch(nk._target_cpu())


def test_far_prefetch_plan_follows_the_cpu_and_reaches_only_contiguous_16_bit_rows():
    """AMD Zen also prefetches 16-bit rows far ahead into L2, every other CPU does not;
    the kernels' constant is the plan of the CPU numba targets, and only contiguous
    float16 / bfloat16 rows take it (``far_ahead``: paged, quantized and float32 0)."""
    for cpu in ("znver3", "znver4", "znver5"):
        assert nk.far_prefetch_16(cpu) > nk.PREFETCH_BYTES
    for cpu in ("sapphirerapids", "skylake-avx512", "haswell", "generic", ""):
        assert nk.far_prefetch_16(cpu) == 0
    assert nk.FAR_PREFETCH_16_BYTES == nk.far_prefetch_16(nk._target_cpu())

    @numba.njit
    def rows_ahead(buf):
        return nk.far_ahead(buf)

    d = 128
    far = nk.FAR_PREFETCH_16_BYTES
    want = (nk.PREFETCH_BYTES + far) // (2 * d) if far else 0
    for bits in (np.int16, np.uint16):
        assert rows_ahead(np.zeros((1, 2, 8, d), bits)) == want
    assert rows_ahead(np.zeros((1, 2, 8, d), np.float32)) == 0
    table = np.zeros((1, 1), np.int32)
    assert rows_ahead(nk.paged(np.zeros((1, 2, 16, d), np.int16), table, False)) == 0
    codes, scales = np.zeros((1, 2, 8, d), np.int8), np.ones((1, 2, 8), np.float32)
    assert rows_ahead(nk.Quantized(codes, scales)) == 0


def test_chunks_run_on_one_thread_below_their_multiply_add_floor():
    """A prefill chunk (a row of more than KERNEL_MAX_QUERIES queries) stays on one thread
    below CHUNK_PARALLEL_MIN_MACS multiply-adds, even past PARALLEL_MIN_WORK products;
    decode and chunks of at most KERNEL_MAX_QUERIES keep PARALLEL_MIN_WORK; an explicit
    parallel_min_work overrides both."""
    from gqakv_backends import numba_backend as nb

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("numba runs one thread here")
    Hq, Hkv, d = 8, 2, 64
    params = AttentionParams(scale=d ** -0.5)

    def workers(lens, n_new, **kw):
        B, T = len(lens), max(n_new)
        return nb.plan_numba(lens, n_new, (B, Hq, T, d), Hkv, params, workers=2, **kw).workers

    # 8 rows x 8 heads x 64 queries over 64 keys: 196,608 products, 2^23.6 multiply-adds
    chunk = ([64] * 8, [64] * 8)
    assert nb.default_parallel_min_work(chunk[1], d) == nb.CHUNK_PARALLEL_MIN_MACS // d
    assert nb.PARALLEL_MIN_WORK < 196_608 < nb.CHUNK_PARALLEL_MIN_MACS // d
    assert workers(*chunk) == 1
    assert workers(*chunk, parallel_min_work=0) == 2
    # 16 rows x 8 heads x 256 queries over 256 keys: 2^27.1 multiply-adds
    assert workers([256] * 16, [256] * 16) == 2
    # decode: 8 rows x 8 heads over 2,048 keys = 131,072 products, past PARALLEL_MIN_WORK
    assert nb.default_parallel_min_work([1] * 8, d) == nb.PARALLEL_MIN_WORK
    assert workers([2048] * 8, [1] * 8) == 2
    assert workers([512] * 8, [1] * 8) == 1  # 32,768 products
    # rows of KERNEL_MAX_QUERIES queries: no chunk floor
    short = [nb.KERNEL_MAX_QUERIES] * 2
    assert nb.default_parallel_min_work(short, d) == nb.PARALLEL_MIN_WORK
    assert nb.default_parallel_min_work([1, nb.KERNEL_MAX_QUERIES + 1], d) > nb.PARALLEL_MIN_WORK
    assert workers([1024] * 2, short) == 2  # 2 x 8 x 8 x 1,024 = 131,072 products, 2^23 x d


# -- attention variants: window, softcap, sinks -----------------------------------------------

def test_tanh_matches_float64_within_three_ulp():
    x = np.concatenate([np.logspace(-30, 1.5, 30001), [0.0, 0.6249, 0.625, 0.6251, 9.0, 1e30]])
    x = np.concatenate([x, -x]).astype(np.float32)
    got = np.array([nk.tanh_f32(v) for v in x], dtype=np.float32)
    want = np.tanh(x.astype(np.float64))
    ulp = np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)
    assert (np.abs(got - want) <= 3 * ulp).all()
    assert nk.tanh_f32(np.float32(np.inf)) == 1.0 and nk.tanh_f32(np.float32(-np.inf)) == -1.0
    assert np.isnan(nk.tanh_f32(np.float32(np.nan)))


def test_kernel_key_range_is_the_semantics_rule():
    """``visible_keys`` is ``semantics.key_range`` written for the kernel."""
    for window in (None, 1, 2, 5, 64):
        params = AttentionParams(scale=1.0, window=window)
        w = nk.NO_WINDOW if window is None else window
        for L in (1, 7, 70):
            for n in range(1, L + 1, 3):
                for t in range(n):
                    assert nk.visible_keys(L - n + t, w) == key_range(params, L, n, t)


def _variant_check(out, lse, want, want_lse, n_new, dtype):
    """_check's rule, with lse relative to its size (a sink of 1e4 is the whole lse)."""
    got = out.astype(np.float64)
    naive = np.abs(want.astype(dtype).astype(np.float64) - want).max(initial=0.0)
    assert np.abs(got - want).max(initial=0.0) <= 2 * naive + 1e-5
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    fin = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[fin], want_lse[fin], rtol=1e-6, atol=1e-5)
    assert np.isfinite(got).all()
    for b, n in enumerate(n_new):  # padded queries are exactly 0
        assert not out[b, :, n:].any()


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("seed", range(8))
def test_random_variants_match_reference(dtype, seed):
    """Random mixes of window (1, 2, past every row, random), softcap (tiny, small,
    large) and sinks (normal, 60, -inf) on ragged chunks, default plan and split everywhere."""
    rng = np.random.default_rng(300 + seed)
    hkv, G = int(rng.choice([1, 2])), int(rng.integers(1, 6))
    d = [16, 64, 80, 128][seed % 4]
    B = int(rng.integers(1, 4))
    lens = [int(x) for x in rng.integers(0, 60, B)]
    n_new = [int(rng.integers(0, min(L, 8) + 1)) if L else 0 for L in lens]
    q, k, v = _case(rng, lens, n_new, hkv, G, d, DTYPES[dtype])
    variant = random_variant(rng, hkv * G, max(lens))
    scale = 1.0 / math.sqrt(d)
    want, want_lse = reference_on_buffers(q, k, v, lens, n_new, scale, **variant)
    for knobs in ({}, SPLIT_EVERYTHING):
        out, lse = _run(q, k, v, lens, n_new, params=AttentionParams(scale=scale, **variant), **knobs)
        _variant_check(out, lse, want, want_lse, n_new, DTYPES[dtype])


@pytest.mark.parametrize("window", [1, 3, 200])
def test_window_smaller_than_the_chunk_with_softcap_and_sinks(window):
    """A 14-query chunk in blocks of 4 (windows inside one block, across blocks, past
    the row), keys split into pieces, in float32."""
    rng = np.random.default_rng(window)
    lens, n_new = [60, 20], [14, 9]
    q, k, v = _case(rng, lens, n_new, 2, 2, 16, np.float32)
    sinks = (0.5, -np.inf, 3.0, -1.0)
    for variant in (dict(window=window), dict(window=window, softcap=2.0, sinks=sinks)):
        want, want_lse = reference_on_buffers(q, k, v, lens, n_new, 0.3, **variant)
        out, lse = _run(q, k, v, lens, n_new, params=AttentionParams(scale=0.3, **variant),
                        workers=3, query_block=4, key_block=3, min_key_split=2, parallel_min_work=0)
        _variant_check(out, lse, want, want_lse, n_new, np.float32)


def test_sink_extremes():
    """-inf sinks give exactly the plain result; a sink of 3e38 (or 1e4 over key pieces)
    takes the whole softmax: out 0, lse the sink, no NaN; empty rows stay 0 / -inf."""
    rng = np.random.default_rng(31)
    lens, n_new = [300, 9, 0], [1, 2, 0]
    q, k, v = _case(rng, lens, n_new, 2, 2, 32, np.float32)
    knobs = dict(workers=3, min_key_split=16, parallel_min_work=0)  # the long row in pieces
    plain, plain_lse = _run(q, k, v, lens, n_new, **knobs)
    out, lse = _run(q, k, v, lens, n_new, params=AttentionParams(scale=1 / math.sqrt(32),
                                                                   sinks=(-np.inf,) * 4), **knobs)
    np.testing.assert_array_equal(out, plain)
    np.testing.assert_array_equal(lse, plain_lse)
    sinks = (1e4, 3e38, -np.inf, 0.5)
    out, lse = _run(q, k, v, lens, n_new, params=AttentionParams(scale=1 / math.sqrt(32), sinks=sinks),
                    **knobs)
    want, want_lse = reference_on_buffers(q, k, v, lens, n_new, 1 / math.sqrt(32), sinks=sinks)
    _variant_check(out, lse, want, want_lse, n_new, np.float32)
    assert not out[:, :2].any() and (lse[0, :2, 0] == np.float32(sinks[:2])).all()
    assert not out[2].any() and np.isneginf(lse[2]).all()


def test_a_windowed_decode_reads_only_the_window(monkeypatch):
    """A decode on a row of 100,000 tokens with W = 4096: the kernel's items cover keys
    L - W .. L and nothing else (the same keys for every head, each once)."""
    L, W = 100_000, 4096
    rng = np.random.default_rng(32)
    k = np.zeros((1, 2, L, 8), np.float32)
    k[:, :, L - W:] = rng.standard_normal((1, 2, W, 8))
    v = k.copy()
    q = rng.standard_normal((1, 4, 1, 8)).astype(np.float32)
    seen = []
    real = nk.attention_items

    def spy(q, k_buf, v_buf, rows, lens, n_new, items, *rest):
        seen.append(items.copy())
        return real(q, k_buf, v_buf, rows, lens, n_new, items, *rest)

    monkeypatch.setattr(nk, "attention_items", spy)
    out, lse = _run(q, k, v, [L], [1], params=AttentionParams(scale=0.35, window=W),
                    workers=4, min_key_split=256, parallel_min_work=0)
    (items,) = seen
    for h in range(2):
        spans = sorted((int(j0), int(j1)) for _, h0, h1, _, _, j0, j1 in items if h0 <= h < h1)
        assert spans[0][0] == L - W and spans[-1][1] == L
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    want, want_lse = reference_on_buffers(q, k[:, :, L - W:], v[:, :, L - W:], [W], [1], 0.35)
    _variant_check(out, lse, want, want_lse, [1], np.float32)


def test_variants_run_the_kernel_through_the_public_api(monkeypatch):
    """gqa_attention(params=...) with every variant on a float16 numba cache runs the
    kernels (not the NumPy or generic path) and matches the reference."""
    import gqakv_backends.numba_backend as nb

    calls, runs = [], []
    plan, run = nb.plan_numba, nb.run_numba
    monkeypatch.setattr(nb, "plan_numba", lambda *a, **kw: calls.append(a[4]) or plan(*a, **kw))
    monkeypatch.setattr(nb, "run_numba", lambda *a, **kw: runs.append(a[0]) or run(*a, **kw))
    rng = np.random.default_rng(33)
    cache = gqakv.KVCache(2, 2, 20, 16, dtype="float16", backend="numba")
    k = rng.standard_normal((2, 2, 9, 16)).astype(np.float16)
    v = rng.standard_normal((2, 2, 9, 16)).astype(np.float16)
    cache.append(k, v, [9, 6])
    q = rng.standard_normal((2, 4, 2, 16)).astype(np.float16)
    params = AttentionParams(scale=0.25, window=3, softcap=1.5, sinks=(0.5, -np.inf, 2.0, 8.0))
    out, lse = gqakv.gqa_attention(q, cache, [2, 1], params=params, return_lse=True)
    assert calls == [params] and len(runs) == 1  # planned with the variant, then run
    want, want_lse = reference_on_buffers(q, k, v, [9, 6], [2, 1], 0.25, window=3, softcap=1.5,
                                          sinks=params.sinks)
    _variant_check(out, lse, want, want_lse, [2, 1], np.float16)


def test_alibi_is_a_compile_time_piece_of_the_score_loop(monkeypatch):
    """A call without ALiBi hands the kernel ``alibi=None`` (its specialization compiles no
    bias: ``numba_kernels.bias``), one with ALiBi its float32 slopes [Hq]; both match the
    float64 reference, over a long row split into key pieces (positions stay absolute
    across pieces) and a short chunk, with every other variant on."""
    seen = []
    real = nk.attention_items

    def spy(*args):
        seen.append(args[13])  # attention_items' ``alibi``
        return real(*args)

    monkeypatch.setattr(nk, "attention_items", spy)
    rng = np.random.default_rng(34)
    L, d = 700, 16
    k = rng.standard_normal((2, 2, L, d)).astype(np.float32)
    v = rng.standard_normal((2, 2, L, d)).astype(np.float32)
    q = rng.standard_normal((2, 6, 3, d)).astype(np.float32)
    slopes = (0.5, 0.25, 0.0, -0.125, 0.03125, 2.0 ** -8)
    for params in (AttentionParams(scale=0.25),
                   AttentionParams(scale=0.25, alibi_slopes=slopes),
                   AttentionParams(scale=0.25, window=300, softcap=2.0,
                                   sinks=(0.5, -np.inf, 2.0, 8.0, 0.0, 1.0), alibi_slopes=slopes)):
        seen.clear()
        out, lse = _run(q, k, v, [L, 400], [3, 2], params=params, workers=3, min_key_split=64,
                        parallel_min_work=0)
        (alibi,) = seen
        if params.alibi_slopes is None:
            assert alibi is None
        else:
            assert alibi.dtype == np.float32 and alibi.tolist() == list(slopes)
        want, want_lse = reference_on_buffers(q, k, v, [L, 400], [3, 2], 0.25, window=params.window,
                                              softcap=params.softcap, sinks=params.sinks,
                                              alibi_slopes=params.alibi_slopes)
        _check(out, lse, want, want_lse, [3, 2], np.float32)


# -- the BLAS path's fused softmax step (chunks longer than the kernels take) -----------------

def _softmax_step_reference(s, m_old, l_old, nq, pos0, window):
    """The step ``softmax_block`` makes, from its definition, row by row: NumPy's max (a
    NaN reaches it), the difference ``s - shift`` rounded to float32 as the kernel forms
    it, then exp and the sums in float64. Returns p [R, K], m, l, alpha [R] (float64)."""
    R, K = s.shape
    p, m, l, alpha = np.zeros((R, K)), np.empty(R), np.empty(R), np.empty(R)
    lowest = np.finfo(np.float32).min
    for r in range(R):
        end = pos0 + r % nq + 1
        hi = min(K, max(0, end))
        lo = 0 if window <= 0 else min(hi, max(0, end - window))
        row_max = s[r, lo:hi].max() if hi > lo else np.float32(-np.inf)
        m[r] = np.maximum(m_old[r], row_max)
        shift = np.float32(lowest if m[r] == -np.inf else m[r])
        p[r, lo:hi] = np.exp((s[r, lo:hi] - shift).astype(np.float64))
        alpha[r] = np.exp(np.float64(np.float32(m_old[r] - shift)))
        l[r] = l_old[r] * alpha[r] + p[r].sum()
    return p, m, l, alpha


def _assert_exp_close(got, want):
    """``exp_nonpos``'s rule against float64 ``want``: 2 ulp where the value is a normal
    float32, at most the smallest normal below that; NaN where NaN."""
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    got, want = got[ok].astype(np.float64), want[ok]
    normal = want > np.finfo(np.float32).tiny
    np.testing.assert_allclose(got[normal], want[normal], rtol=2.4e-7, atol=0)
    assert (got[~normal] <= np.finfo(np.float32).tiny * 1.01).all()


@pytest.mark.parametrize("window", [0, 1, 4, 100])
@pytest.mark.parametrize("pos0", [-3, 10, 40])
def test_fused_softmax_step_matches_its_definition(pos0, window):
    """``numba_kernels.softmax_block`` over rows that see nothing, part or all of a
    37-key block (vector tails), with running maxima -inf, below and above the block's
    scores and NaN, a NaN score seen by its row, one hidden from its row (no effect) and
    a -inf score: masked keys exactly 0, m bit for bit, p and alpha within exp's 2 ulp,
    l within the float32 summation bound (K ulp) on top."""
    rng = np.random.default_rng(1000 + 7 * pos0 + window)
    nq, G, K = 5, 3, 37
    R = nq * G
    s = (rng.standard_normal((R, K)) * 4).astype(np.float32)
    s[1, 0] = np.nan  # seen by row 1 unless its window starts past key 0
    s[2, K - 1] = np.nan  # past row 2's last key unless it sees the whole block
    s[4, 3] = -np.inf
    m_old = rng.choice([-np.inf, -20.0, 0.5, 30.0], R).astype(np.float32)
    m_old[7] = np.nan
    l_old = np.where(m_old == -np.inf, 0.0, rng.uniform(1, 5, R)).astype(np.float32)
    want_p, want_m, want_l, want_alpha = _softmax_step_reference(s, m_old, l_old, nq, pos0, window)
    p, m, l, alpha = s.copy(), m_old.copy(), l_old.copy(), np.empty(R, np.float32)
    nk.softmax_block(p, m, l, alpha, nq, pos0, window, 1.0, p.shape[1], *(np.empty((0, 0), np.uint16),) * 2)
    np.testing.assert_array_equal(m, want_m.astype(np.float32))
    assert not p[want_p == 0].any()  # masked keys and exp(-inf)
    _assert_exp_close(p, want_p)
    _assert_exp_close(alpha, want_alpha)
    np.testing.assert_array_equal(np.isnan(l), np.isnan(want_l))
    ok = ~np.isnan(want_l)
    np.testing.assert_allclose(l[ok], want_l[ok], rtol=K * 2.0 ** -24 + 2.4e-7, atol=0)
    if pos0 == 40:  # every query is past the block: its window (from position 40 + t) decides
        # row 2 (t = 2, position 42) sees key K - 1 = 36 for W >= 7; row 1 (41) key 0 for W >= 42
        assert np.isnan(m[2]) == (window == 0 or window >= 7)
        assert np.isnan(m[1]) == (window == 0 or window >= 42)


def _spy_fused(monkeypatch):
    """Count the blocks ``FusedSoftmaxState.add_causal`` folded (it returned True)."""
    from gqakv_backends.numba_backend import FusedSoftmaxState

    folded = []
    real = FusedSoftmaxState.add_causal

    def spy(self, *args):
        took = real(self, *args)
        folded.append(took)
        return took

    monkeypatch.setattr(FusedSoftmaxState, "add_causal", spy)
    return folded


@pytest.mark.parametrize("storage", ["contiguous", "paged"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("seed", range(3))
def test_long_chunks_fold_through_the_fused_softmax(monkeypatch, storage, dtype, seed):
    """Chunks longer than the kernels take run the NumPy BLAS path, whose float32 score
    blocks the numba backend folds with ``softmax_block`` and whose paged blocks it
    gathers with ``gather_pages``: ragged rows (one empty, one decoding) with random
    variants (window, softcap, sinks, ALiBi) through the public API match the float64
    reference, every block was folded there, and (paged) pages were gathered there."""
    import gqakv_backends.numba_backend as nb

    folded = _spy_fused(monkeypatch)
    gathered, widened, narrowed = [], [], []
    real_gather, real_widen, real_narrow = nb.gather_pages, nb.widen_block, nb.narrow_block
    monkeypatch.setattr(nb, "gather_pages", lambda *a: gathered.append(real_gather(*a)) or gathered[-1])
    monkeypatch.setattr(nb, "widen_block", lambda *a: widened.append(real_widen(*a)) or widened[-1])
    monkeypatch.setattr(nb, "narrow_block", lambda *a: narrowed.append(real_narrow(*a)) or narrowed[-1])
    rng = np.random.default_rng(2000 + seed)
    hkv, G, d = int(rng.choice([1, 2])), int(rng.integers(1, 5)), [16, 64, 80][seed]
    # the longest row past KERNEL_SHORT_ROW_KEYS: over shorter rows the kernels take chunks
    lens = [int(rng.integers(140, 260)), 0, int(rng.integers(9, 40)), 30]
    n_new = [int(rng.integers(9, 40)), 0, lens[2], 1]
    q, k, v = _case(rng, lens, n_new, hkv, G, d, DTYPES[dtype])
    variant = random_variant(rng, hkv * G, max(lens))
    if seed:
        variant["alibi_slopes"] = tuple(float(x) for x in 2.0 ** -rng.integers(1, 9, hkv * G))
    kw = dict(page_size=16) if storage == "paged" else {}
    cls = gqakv.PagedKVCache if storage == "paged" else gqakv.KVCache
    cache = cls(len(lens), hkv, max(lens) + 3, d, dtype=dtype, backend="numba", **kw)
    cache.append(np.ascontiguousarray(k[:, :, :max(lens)]), np.ascontiguousarray(v[:, :, :max(lens)]), lens)
    params = AttentionParams(scale=1.0 / math.sqrt(d), **variant)
    out, lse = gqakv.gqa_attention(q, cache, n_new, params=params, return_lse=True)
    want, want_lse = reference_on_buffers(q, k, v, lens, n_new, params.scale, **variant)
    _variant_check(out, lse, want, want_lse, n_new, DTYPES[dtype])
    assert folded and all(folded)
    assert all(gathered) and bool(gathered) == (storage == "paged")
    # half-precision blocks and queries were widened by the compiled cast (none declined
    # to NumPy's), float16 results narrowed by it
    assert all(w is not None for w in widened) and bool(widened) == (dtype != "float32")
    assert any(w is not None for w in narrowed) == (dtype == "float16")


@pytest.mark.parametrize("storage", ["contiguous", "paged", "int8"])
@pytest.mark.parametrize("seed", range(3))
def test_chunks_over_short_rows_take_the_kernels(route_spy, storage, seed):
    """Over rows of at most ``KERNEL_SHORT_ROW_KEYS`` keys the kernels take chunks of any
    length and tiles of any size (there the BLAS path's per-item host work costs more than
    the arithmetic it saves): ragged rows (one empty, one decoding, the longest exactly at
    the limit) with random variants, padded, match the float64 reference, and the spy saw
    the kernels run as ``route`` names them; one key more and the same call is the BLAS
    path's."""
    from gqakv_backends.numba_backend import KERNEL_SHORT_ROW_KEYS

    from .support.quantization import held
    from .support.routes import assert_routes_ran

    backend = next(b for b in gqakv.list_backends() if b.name == "numba")
    rng = np.random.default_rng(3000 + seed)
    hkv, G, d = int(rng.choice([1, 2])), int(rng.integers(3, 9)), [16, 64, 80][seed]
    for longest, impl in ((KERNEL_SHORT_ROW_KEYS, "numba kernel"),
                          (KERNEL_SHORT_ROW_KEYS + 1, "numpy BLAS")):
        T = int(rng.integers(9, 100))
        lens = [longest, 0, int(rng.integers(T, longest)), 30]
        n_new = [T, 0, T, 1]
        q, k, v = _case(rng, lens, n_new, hkv, G, d, np.float32)
        variant = random_variant(rng, hkv * G, max(lens))
        kw = {"paged": dict(storage="paged", page_size=16), "int8": dict(kv_dtype="int8"),
              "contiguous": {}}[storage]
        cache = gqakv.KVCache(len(lens), hkv, max(lens) + 3, d, dtype="float32", backend="numba", **kw)
        cache.append(np.ascontiguousarray(k[:, :, :max(lens)]), np.ascontiguousarray(v[:, :, :max(lens)]),
                     lens)
        kh, vh = k.copy(), v.copy()  # the values as the cache holds them (int8: decoded codes)
        for b, L in enumerate(lens if storage == "int8" else []):
            for x, h in ((k, kh), (v, vh)):
                h[b, :, :L] = held(x[b, :, :L], {"kv_dtype": "int8"})
        params = AttentionParams(scale=1.0 / math.sqrt(d), **variant)
        spy = route_spy(backend)
        out, lse = gqakv.gqa_attention(q, cache, n_new, params=params, return_lse=True)
        want, want_lse = reference_on_buffers(q, kh, vh, lens, n_new, params.scale, **variant)
        _variant_check(out, lse, want, want_lse, n_new, np.float32)
        attends = [c for c in spy.calls if c.op == "attention"]
        assert [c.ran[0] for c in attends] == [impl], (longest, [c.ran for c in attends])
        assert backend.route("attention", **attends[0].facts).impl == impl
        assert_routes_ran(spy)


def test_windowed_chunk_past_a_key_block_sees_only_its_window(monkeypatch):
    """A long chunk with a sliding window over several of the BLAS path's key blocks: a
    query past a block's last key sees only that block's keys inside its window. (Until
    2026-12-05 the fused step took the window's left edge from the block's end for such
    queries, and read up to W keys it must not see; float32 and bfloat16 alike.)"""
    seen = []
    real = nk.softmax_block

    def spy(s, m, l, alpha, nq, pos0, window, *rest):
        seen.append(pos0 + nq > s.shape[1] and window > 0)  # some query past the block
        return real(s, m, l, alpha, nq, pos0, window, *rest)

    monkeypatch.setattr(nk, "softmax_block", spy)
    rng = np.random.default_rng(3001)
    hkv, G, d, window = 1, 7, 32, 169
    lens, n_new = [432, 0, 84, 41], [128, 0, 84, 1]
    q, k, v = _case(rng, lens, n_new, hkv, G, d, np.float32)
    cache = gqakv.KVCache(len(lens), hkv, max(lens) + 3, d, dtype="float32", backend="numba")
    cache.append(np.ascontiguousarray(k[:, :, :max(lens)]), np.ascontiguousarray(v[:, :, :max(lens)]), lens)
    params = AttentionParams(scale=1.0 / math.sqrt(d), window=window)
    out, lse = gqakv.gqa_attention(q, cache, n_new, params=params, return_lse=True)
    want, want_lse = reference_on_buffers(q, k, v, lens, n_new, params.scale, window=window)
    _variant_check(out, lse, want, want_lse, n_new, np.float32)
    assert any(seen)


def test_fused_softmax_over_many_blocks_and_key_pieces(monkeypatch):
    """The BLAS path with tiny score blocks, query blocks and key pieces on 3 threads:
    each item folds many blocks (the running output rescaled by alpha each time) and,
    without the window, the 300-key row's 4 queries are split into key pieces merged
    through their LSE; matches the float64 reference, with windows that leave whole
    blocks unseen by some of a block's queries."""
    from gqakv.core.semantics import block_keys
    from gqakv_backends.numba_backend import FusedSoftmaxState
    from gqakv_backends.numpy_attention import attention_numpy, plan_items

    folded = _spy_fused(monkeypatch)
    rng = np.random.default_rng(77)
    lens, n_new = [300, 90, 17], [4, 90, 12]
    q, k, v = _case(rng, lens, n_new, 2, 3, 16, np.float32)
    for variant in ({}, dict(window=7, softcap=3.0, sinks=(0.5, -np.inf, 2.0, 8.0, 0.0, 1.0))):
        folded.clear()
        params = AttentionParams(scale=0.3, **variant)
        out, lse = attention_numpy(q, k, v, np.arange(3), np.asarray(lens), np.asarray(n_new),
                                   scale=0.3, return_lse=True, params=params, workers=3,
                                   query_block=8, min_key_split=64, parallel_min_work=0,
                                   score_block_elements=256, state_class=FusedSoftmaxState)
        want, want_lse = reference_on_buffers(q, k, v, lens, n_new, 0.3, **variant)
        _variant_check(out, lse, want, want_lse, n_new, np.float32)
        items = plan_items(np.asarray(lens), np.asarray(n_new), q.shape, 2, params, workers=3,
                           query_block=8, min_key_split=64).items
        # blocks of 16 keys (MIN_BLOCK_KEYS): several per item without the window, one with it
        assert len(folded) >= (1 if variant else 2) * len(items) and all(folded)
        pieces = [it for it in items if (it[5], it[6]) != block_keys(params, lens[it[0]], n_new[it[0]],
                                                                     it[3], it[4])]
        assert bool(pieces) == (not variant)  # a window of 7 leaves no row long enough to split


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8", "uint8"])
@pytest.mark.parametrize("tail", [(8,), ()])
def test_gather_pages_copies_the_listed_pages_heads(dtype, tail):
    """``numba_backend.gather_pages`` (the BLAS path's paged gather) writes
    pool[pages[j], h0:h1] into out[:, j] bit for bit, for every element size the
    stores hold (values, codes, nibble pairs; [.., P, d] blocks and [.., P] scales),
    leaves the rest of out alone, and declines (False, nothing written) a
    non-contiguous pool, page ids outside the pool and a head range that does not fit."""
    from gqakv_backends.numba_backend import gather_pages

    rng = np.random.default_rng(5)
    np_dtype = DTYPES.get(dtype, np.dtype(dtype))
    bits = rng.integers(0, 256, (7, 4, 3, *tail, np.dtype(np_dtype).itemsize), dtype=np.uint8)
    pool = bits.view(np_dtype).reshape(7, 4, 3, *tail)  # every bit pattern, NaNs included
    pages = np.array([5, 0, 5, 2], dtype=np.int32)
    out = np.zeros((2, 6, 3, *tail), dtype=np_dtype)
    assert gather_pages(pool, pages, 1, 3, out)
    want = np.zeros_like(out)
    for j, page in enumerate(pages):
        want[:, j] = pool[page, 1:3]
    np.testing.assert_array_equal(out.view(np.uint8), want.view(np.uint8))
    before = out.copy()
    assert not gather_pages(pool[:, :, ::-1], pages, 1, 3, out)
    for bad in ([5, 7], [-1, 0]):  # outside the pool: left to NumPy's indexing
        assert not gather_pages(pool, np.array(bad), 1, 3, out)
    assert not gather_pages(pool, pages, 1, 4, out)  # 3 heads into a buffer of 2
    np.testing.assert_array_equal(out.view(np.uint8), before.view(np.uint8))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_widen_block_casts_every_pattern_exactly_and_declines_the_rest(dtype):
    """``numba_backend.widen_block`` (the BLAS path's float16/bfloat16 block cast) gives
    the float32 bits of NumPy's / ml_dtypes' cast for every bit pattern (subnormals,
    infinities, NaN payloads), read through a block view of a cache ([heads, keys, d] of
    [Hkv, max_len, d]: strided across heads) into part of a buffer; it declines (None,
    nothing written) float32, a block not contiguous within a head, a shape mismatch and
    a float64 out, and then the reader's NumPy cast serves."""
    from gqakv_backends.numba_backend import widen_block

    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    cache = bits.view(DTYPES[dtype]).reshape(4, 512, 32)  # [Hkv, max_len, d]
    block = cache[1:3, 100:400]
    buf = np.full((2, 320, 32), 7.0, dtype=np.float32)
    out = buf[:, :300]
    assert widen_block(block, out) is out
    np.testing.assert_array_equal(out.view(np.uint32), block.astype(np.float32).view(np.uint32))
    assert (buf[:, 300:] == 7.0).all()
    before = buf.copy()
    for x, o in ((block.astype(np.float32), out), (block[:, :, ::2], out[:, :, :16]),
                 (block, buf[:, :299]), (block, out.astype(np.float64))):
        assert widen_block(x, o) is None
    np.testing.assert_array_equal(buf, before)


def test_narrow_block_rounds_as_numpy_and_declines_the_rest():
    """``numba_backend.narrow_block`` (the BLAS path's float16 result store) gives NumPy's
    float16 bits (round to nearest even, overflow to infinity, subnormals) for a million
    float32 patterns spread over all 2^32, NaN for NaN, into a head-wise contiguous part
    of a buffer; it declines (None, nothing written) a bfloat16 or float32 out, a float64
    x, an out not contiguous within a head and a shape mismatch."""
    from gqakv_backends.numba_backend import narrow_block

    bits = np.arange(0, 1 << 32, 4099, dtype=np.uint64).astype(np.uint32)[: 2 * 1022 * 512]
    x = bits.view(np.float32).reshape(2, 1022, 512)
    buf = np.full((2, 1024, 512), 7.0, dtype=np.float16)
    out = buf[:, :1022]
    assert narrow_block(x, out) is out
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
    nan = np.isnan(x)
    np.testing.assert_array_equal(out.view(np.uint16)[~nan], want.view(np.uint16)[~nan])
    assert np.isnan(out[nan]).all() and nan.any()
    assert (buf[:, 1022:] == 7.0).all()
    before = buf.copy()
    for xx, o in ((x, np.empty(out.shape, DTYPES["bfloat16"])), (x, np.empty(out.shape, np.float32)),
                  (np.zeros(x.shape), out), (x[:, :, ::2], out[:, :, :256]), (x, buf[:, :1021])):
        assert narrow_block(xx, o) is None
    np.testing.assert_array_equal(buf.view(np.uint16), before.view(np.uint16))


@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3fn"])
def test_dequantize_block_matches_the_codec_bit_for_bit_and_declines_the_rest(kv_dtype):
    """``numba_backend.dequantize_block`` (the BLAS path's 8-bit blocks with per-token
    scales) writes exactly the codec's own NumPy values (``dequantize_into``; NaN where
    they are NaN) for all 256 codes at scales from subnormal to huge, read through a block view of a cache into part
    of a buffer; it declines (None, nothing written) block scales, another codec, a float64
    out, codes not contiguous within a head and a shape mismatch."""
    from gqakv.storage import codecs
    from gqakv_backends.numba_backend import dequantize_block

    codec = codecs.of(kv_dtype)
    rng = np.random.default_rng(11)
    code_dtype = np.int8 if kv_dtype == "int8" else np.uint8
    codes = np.arange(256, dtype=np.uint8).view(code_dtype)[rng.permutation(256 * 12) % 256]
    cache_codes = codes.reshape(3, 64, 16)  # [Hkv, max_len, d]
    scales = (10.0 ** rng.uniform(-40, 30, (3, 64))).astype(np.float32)
    scales[0, :3] = (0.0, 1.0, np.finfo(np.float32).max)
    block, block_scales = cache_codes[1:3, 5:60], scales[1:3, 5:60]
    buf = np.full((2, 60, 16), 7.0, dtype=np.float32)
    out = buf[:, :55]
    with np.errstate(over="ignore", invalid="ignore"):
        want = codec.dequantize_into(block, block_scales, np.empty(out.shape, np.float32))
        assert dequantize_block(codec, block, block_scales, out) is out
    nan = np.isnan(want)  # e4m3fn's two NaN patterns: NaN either way (its sign may differ)
    np.testing.assert_array_equal(out.view(np.uint32)[~nan], want.view(np.uint32)[~nan])
    assert np.isnan(out[nan]).all() and nan.any() == (kv_dtype != "int8")
    assert (buf[:, 55:] == 7.0).all()
    before = buf.copy()
    for c, k, sc, o in ((codecs.of("int8_g32"), block, block_scales, out),
                        (codec, block, block_scales[..., None].repeat(16, -1), out),
                        (codec, block, block_scales, np.zeros(out.shape)),
                        (codec, block[:, :, ::2], block_scales, out[:, :, :8]),
                        (codec, block, block_scales[:, :54], out)):
        assert dequantize_block(c, k, sc, o) is None
    np.testing.assert_array_equal(buf, before)


@pytest.mark.parametrize("storage", ["contiguous", "paged"])
@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3fn"])
def test_long_chunks_over_codes_dequantize_in_compiled_passes(monkeypatch, storage, kv_dtype):
    """float32 queries over an 8-bit cache take the BLAS path's float32 items (the bf16
    products take bfloat16 queries only): ragged rows (one empty, one decoding) through
    the public API match the float64 reference over the values the cache holds, and every
    code block was dequantized by ``dequantize_block`` (none declined)."""
    import gqakv_backends.numba_backend as nb

    from .support.quantization import held

    done = []
    real = nb.dequantize_block
    monkeypatch.setattr(nb, "dequantize_block", lambda *a: done.append(real(*a)) or done[-1])
    rng = np.random.default_rng(4000 + len(storage) + len(kv_dtype))
    hkv, G, d = 2, 3, 64
    lens = [int(rng.integers(140, 260)), 0, int(rng.integers(9, 40)), 30]
    n_new = [int(rng.integers(9, 40)), 0, lens[2], 1]
    q, k, v = _case(rng, lens, n_new, hkv, G, d, np.float32)
    kw = dict(page_size=16) if storage == "paged" else {}
    cls = gqakv.PagedKVCache if storage == "paged" else gqakv.KVCache
    cache = cls(len(lens), hkv, max(lens) + 3, d, dtype="float32", kv_dtype=kv_dtype, backend="numba", **kw)
    cache.append(np.ascontiguousarray(k[:, :, :max(lens)]), np.ascontiguousarray(v[:, :, :max(lens)]), lens)
    out, lse = gqakv.gqa_attention(q, cache, n_new, return_lse=True)
    spec = {"kv_dtype": kv_dtype}
    want, want_lse = reference_on_buffers(q, held(k, spec), held(v, spec), lens, n_new, 1.0 / math.sqrt(d))
    _check(out, lse, want, want_lse, n_new, np.float32)
    assert done and all(x is not None for x in done)


def test_dots_of_four_rows_and_two_keys_match_float64():
    """``_dots_4x2`` (the kernels' vector dots, one reduction tree for eight sums) equals
    float64 dot products to float32 rounding, for every stored element type, head dims
    of one to sixteen vectors, any two keys (the same key twice at a block's end)."""
    from .support.dots_check import check

    check()


def test_dots_in_eight_lanes_match_float64_where_numba_targets_avx2():
    """The same in a process whose numba target is Haswell (AVX2: ``_vector_lanes`` gives
    8 lanes, and the tree folds eight 8-lane vectors)."""
    import os
    import subprocess
    import sys

    from gqakv.tools.work_count import NUMBA_TARGET

    env = {**os.environ, **NUMBA_TARGET}
    out = subprocess.run([sys.executable, "-m", "tests.support.dots_check"], env=env,
                         capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0 and out.stdout.strip() == "ok 8", out.stdout + out.stderr
