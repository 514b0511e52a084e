"""The numba kernels over paged and quantized storage, against the float64 reference.

The kernels read a ``Paged`` pool through its page table one page run at a time and
decode ``Quantized`` codes in registers with each token's scale folded into its score
(K) and its p (V) (``numba_kernels.key_run``). Checked here: ragged rows, padded
queries, empty rows, chunked prefill then decode, pages of 1, 3, 16 and 256 tokens,
pages shared after a fork, every split forced on small shapes, sliding windows whose
first key falls inside a page, soft-caps and sinks, unused pool pages and dead slots
poisoned with NaN; int8 and float8_e4m3fn codes against the reference on the
dequantized values (``tests/support/quantization.held``), paged and quantized at once
(codes and scales paged through one table), e4m3 decoding over all 256 patterns, and which
implementation serves each storage kind and why.

Compile cost: one compilation of the kernels per layout type (float32 and bfloat16
pools, int8 and uint8 codes), cached in __pycache__ for later processes.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import gqakv

numba = pytest.importorskip("numba")
ml_dtypes = pytest.importorskip("ml_dtypes")

from gqakv_backends import numba_kernels as nk  # noqa: E402
from gqakv_backends.numba_backend import (KERNEL_MAX_QUERIES, NumbaBackend, attention_numba,  # noqa: E402
                                         kernel_layout, reads_heads_together)

from gqakv.core.inputs import validate_attention  # noqa: E402
from gqakv.core.semantics import AttentionParams  # noqa: E402

from .support.quantization import hard_tokens, held  # noqa: E402
from .support.reference import reference_on_buffers  # noqa: E402
from .support.spies import kernel_layouts  # noqa: E402
from .support.tolerance import max_error, plain_float32_attention, round_to  # noqa: E402

SPLIT_EVERYTHING = dict(workers=3, query_block=2, min_key_split=2, key_block=5, parallel_min_work=0)
NP = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
VARIANTS = {"causal": {}, "window 5": dict(window=5),
            "window 19 + softcap + sinks": dict(window=19, softcap=2.0,
                                                sinks=(0.5, -np.inf, 3.0, -1.0, 60.0, 0.0))}


def _grow(rng, cache, model, chunks, dtype, hard=False):
    """Append each n_new list to ``cache`` and to ``model`` (per row, the [Hkv, L, d]
    float64 values the cache holds: ``held`` of what was appended)."""
    B, hkv, d = cache.batch, cache.kv_heads, cache.head_dim
    storage = {"kv_dtype": cache.store.dtype} if cache.store.quantized else {}
    for n_new in chunks:
        T = max(max(n_new), 1)
        kv = [(hard_tokens(rng, (B, hkv, T, d), dtype) if hard else
               rng.standard_normal((B, hkv, T, d))).astype(NP[dtype]) for _ in range(2)]
        cache.append(kv[0], kv[1], n_new)
        for x, rows in zip(kv, model):
            h = held(x.astype(np.float32), storage)
            for b, n in enumerate(n_new):
                rows[b] = np.concatenate([rows[b], h[b, :, :n].astype(np.float64)], axis=1)


def _dense(model, S):
    """model rows as [B, Hkv, S, d] float64, zeros past each row."""
    B, (hkv, _, d) = len(model), model[0].shape
    out = np.zeros((B, hkv, S, d))
    for b, x in enumerate(model):
        out[b, :, :x.shape[1]] = x
    return out


#: How many times the plain float32 computation's own error a kernel may show: FlashAttention's
#: 2, times 2 because the kernels' exp and tanh are polynomials of about 1 and 2 ulp
#: (numba_kernels.exp_nonpos / tanh_f32) where NumPy's are nearly correctly rounded. Measured
#: on these tests: at most 3.6x (a 1e30 token's output under a soft-cap).
PLAIN_FLOAT32_FACTOR = 4


def _check(out, lse, want, want_lse, n_new, dtype, err_plain=0.0):
    """The kernels compute in float32 and round once: the error is at most twice that of
    rounding the exact result to ``dtype``, or PLAIN_FLOAT32_FACTOR times ``err_plain``
    (the error of the plain float32 computation on the same held values,
    ``plain_float32_attention``: derived from the reference and the storage, never from a
    kernel), plus 1e-5; lse as test_numba_backend's."""
    err_round = max_error(round_to(want, dtype), want)
    bound = max(2 * err_round, PLAIN_FLOAT32_FACTOR * err_plain) + 1e-5
    assert max_error(out, want) <= bound, (max_error(out, want), err_round, err_plain)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    fin = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[fin], want_lse[fin], rtol=1e-6, atol=1e-5)
    assert not np.isnan(np.asarray(out, np.float32)).any()  # no poisoned slot was read
    for b, n in enumerate(n_new):  # padded queries are exactly 0
        assert not np.asarray(out[b, :, n:], np.float32).any()


def _attend_both_ways(rng, cache, model, n_new, T, G, variant, dtype):
    """Through gqa_attention (the backend's route: the kernel, checked by a spy) and
    through attention_numba on kernel_layout with every split forced; both against the
    float64 reference."""
    B, hkv, d = cache.batch, cache.kv_heads, cache.head_dim
    q = rng.standard_normal((B, hkv * G, T, d)).astype(NP[dtype])
    lens = [x.shape[1] for x in model[0]]
    scale = 1.0 / math.sqrt(d)
    params = AttentionParams(scale=scale, **variant)
    want, want_lse = reference_on_buffers(q, _dense(model[0], max(lens) + 1),
                                          _dense(model[1], max(lens) + 1), lens, n_new, scale,
                                          **variant)
    err_plain = 0.0
    if cache.store.quantized:  # hard tokens: the float32 arithmetic's own error on them
        err_plain = max_error(plain_float32_attention(q, model[0], model[1], n_new, scale,
                                                      **variant), want)
    out, lse = gqakv.gqa_attention(q, cache, n_new, params=params, return_lse=True)
    assert out.dtype == q.dtype
    _check(out, lse, want, want_lse, n_new, dtype, err_plain)
    inputs = validate_attention(cache, q, n_new, params=params)
    k_buf, v_buf = kernel_layout(cache.store)
    out, lse = attention_numba(q, k_buf, v_buf, inputs.rows, inputs.lens, inputs.n_new,
                               scale=scale, return_lse=True, params=params, **SPLIT_EVERYTHING)
    _check(out, lse, want, want_lse, n_new, dtype, err_plain)


@pytest.fixture
def kernel_calls(monkeypatch):
    """The layouts the kernel was called with, by type name (Paged / Quantized / ndarray)."""
    return kernel_layouts(monkeypatch)


# -- paged ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("page_size", [1, 3, 16, 256, 512])
def test_paged_matches_reference(page_size, variant, kernel_calls):
    """Ragged rows (one empty), chunked prefill then decode, a fork sharing the prompt's
    pages (then both rows growing apart through copy on write), unused pages NaN. Pages up
    to 256 tokens are within ``together_page_limit`` at d = 16 (their KV heads read
    together); 512-token pages are larger (the kernels compiled for one head a pass)."""
    rng = np.random.default_rng(page_size)
    dtype = "float32" if page_size != 16 else "bfloat16"
    B, hkv, G, d, S = 4, 2, 3, 16, 600
    cache = gqakv.PagedKVCache(B, hkv, S, d, dtype, backend="numba", page_size=page_size)
    cache.store.fill(np.nan)
    model = ([np.zeros((hkv, 0, d))] * B, [np.zeros((hkv, 0, d))] * B)
    model = (list(model[0]), list(model[1]))
    _grow(rng, cache, model, [[300, 0, 37, 5], [13, 0, 16, 250]], dtype)
    cache.fork(0, [1])
    for m in model:
        m[1] = m[0].copy()
    calls = 0
    Tk = KERNEL_MAX_QUERIES  # the longest chunk gqa_attention hands the kernel
    for n_new, T in (([Tk - 1, 4, 0, Tk], Tk), ([1, 1, 1, 1], 1), ([1, 1, 0, 1], 1)):
        _grow(rng, cache, model, [n_new], dtype)
        _attend_both_ways(rng, cache, model, n_new, T, G, VARIANTS[variant], dtype)
        calls += 1
    assert cache.store.page_table.audit(cache.host_lens) == []
    assert kernel_calls == ["Paged"] * (2 * calls)


def test_paged_window_starts_inside_a_page_and_crosses_pages():
    """Decodes whose window starts at every offset of a page of 16 and spans 1 to 3 page
    boundaries, G = 4 (full tiles) and d = 64, keys split into pieces."""
    rng = np.random.default_rng(7)
    B, hkv, G, d, P = 2, 1, 4, 64, 16
    cache = gqakv.PagedKVCache(B, hkv, 200, d, "float32", backend="numba", page_size=P)
    cache.store.fill(np.nan)
    model = ([np.zeros((hkv, 0, d))] * B, [np.zeros((hkv, 0, d))] * B)
    model = (list(model[0]), list(model[1]))
    _grow(rng, cache, model, [[100, 77]], "float32")
    for step in range(P + 1):
        _grow(rng, cache, model, [[1, 1]], "float32")
        for window in (P - 1 + step, 2 * P + 3, 3 * P + step % 5):
            _attend_both_ways(rng, cache, model, [1, 1], 1, G, dict(window=window), "float32")


def test_kernel_views_are_the_rows_in_place():
    """The views the kernels read runs through are the very memory of the buffers (a
    write through one lands in it), for 16-bit and float32 rows and float32 scales, at
    every page or row, head and offset of a small buffer: ``page_rows`` (``_rows_from``:
    address arithmetic, no reference count) of pages read heads together (the page's rows
    [Hkv * P, d] from head h's row ``at`` on) and of pages read one head at a time (head
    h's rows from ``at``), and ``key_run`` of contiguous rows (numba's own view of row r,
    head h from key j)."""
    from numba import njit

    @njit
    def page_view_and_mark(buf, page, h, at):
        rows = nk.page_rows(buf, page, h, at)
        seen = rows.copy()
        rows[0, ...] = -1
        return seen

    @njit
    def run_view_and_mark(buf, r, h, j):
        rows, _, m = nk.key_run(buf, r, h, j, 2)
        seen = rows.copy()
        rows[0, ...] = -1
        return seen, m

    for dtype, row_shape in ((np.int16, (8,)), (np.float32, (8,)), (np.float32, ())):
        pool = np.arange(5 * 3 * 4 * 8).astype(dtype)[:5 * 3 * 4 * int(np.prod(row_shape))]
        pool = pool.reshape(5, 3, 4, *row_shape)
        for together in (True, False):
            layout = nk.paged(pool, np.zeros((1, 1), dtype=np.int32), together)
            for page in range(5):
                for h in range(3):
                    for at in range(4):
                        want = (pool[page].reshape(12, *row_shape)[h * 4 + at:] if together
                                else pool[page, h, at:]).copy()
                        got = page_view_and_mark(layout, page, h, at)
                        np.testing.assert_array_equal(got, want)
                        assert np.all(pool[page, h, at] == -1)
                        pool[page, h, at] = want[0]
        for r in range(5):  # the same array as contiguous rows [B, Hkv, max_len, ...]
            for h in range(3):
                for j in range(4):
                    want = pool[r, h, j:].copy()
                    got, m = run_view_and_mark(pool, r, h, j)
                    np.testing.assert_array_equal(got, want)
                    assert m == 2 and np.all(pool[r, h, j] == -1)
                    pool[r, h, j] = want[0]


def test_paged_pool_of_huge_pages_and_kernel_layout():
    """kernel_layout: views of the pool (no copy) and the shared table; the shift is
    log2(page_size) for powers of two, else -1 (division); ``together`` is True for pages
    of at most ``together_page_limit`` tokens (16 KiB of float32 rows, within the 256-key
    default block: 256 at d = 8, 64 at d = 64), None for larger ones, on plain, per-token
    and grouped codes alike."""
    for P, shift in ((1, 0), (3, -1), (16, 4), (256, 8), (48, -1), (512, 9), (513, -1)):
        cache = gqakv.PagedKVCache(2, 2, 1100, 8, "bfloat16", backend="numba", page_size=P)
        k, v = kernel_layout(cache.store)
        assert isinstance(k, nk.Paged) and k.shift == shift
        assert k.pool.dtype == np.int16 and np.shares_memory(k.pool, cache.store.k)
        assert np.shares_memory(k.table, cache.store.page_table.entries) and v.table is k.table
        together = True if P <= 256 else None
        assert k.together is together and v.together is together
        assert reads_heads_together(cache.store) is (P <= 256)
        for kv_dtype, cls in (("int8", nk.PagedQuantized), ("int8_g32", nk.PagedGrouped)):
            cache = gqakv.PagedKVCache(2, 2, 1100, 64, "bfloat16", backend="numba",
                                       page_size=P, kv_dtype=kv_dtype)  # limit 64
            k, v = kernel_layout(cache.store)
            assert isinstance(k, cls) and k.shift == shift
            assert k.together is v.together is (True if P <= 64 else None)


def test_paged_plans_cover_every_kv_head_of_their_keys(monkeypatch):
    """On paged storage (pages hold every KV head, heads-major) the planner cuts a row's
    keys before its heads (``_plan``'s ``keys_first``): each item covers all KV heads of
    its key range, so the kernels read its pages whole, in address order
    (``numba_kernels.heads_per_pass``); contiguous rows are still cut by heads (no merge)."""
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs 2 numba threads (one worker splits nothing)")
    monkeypatch.setenv("GQAKV_NUM_THREADS", "2")
    backend = gqakv.get_backend("numba")
    B, hkv, G, d, L = 1, 8, 4, 16, 4096
    params = AttentionParams(scale=0.25)
    x = np.zeros((B, hkv, L, d), np.float32)
    q = np.zeros((B, hkv * G, 1, d), np.float32)
    heads = {}
    for kind, cache in (("paged", gqakv.PagedKVCache(B, hkv, L, d, "float32", backend=backend,
                                                      page_size=16)),
                        ("contiguous", gqakv.KVCache(B, hkv, L, d, "float32", backend=backend))):
        cache.append(x, x, [L])
        inputs = validate_attention(cache, q, [1], params=params)
        work = backend.plan_attention(cache.store, inputs, params, q.shape)
        assert len(work.items) >= 2  # both threads have work
        heads[kind] = {(int(h0), int(h1)) for h0, h1 in work.items[:, 1:3]}
    assert heads["paged"] == {(0, hkv)}
    assert all(h1 - h0 < hkv for h0, h1 in heads["contiguous"])


# -- quantized -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3fn"])
def test_decode_of_codes_is_exact_for_every_pattern(kv_dtype):
    """The kernels' decode of every code: int8 values, and e4m3fn bits (zeros,
    subnormals, normals, both NaN patterns) to exactly ml_dtypes' float32."""
    codes = np.arange(256, dtype=np.uint8)
    if kv_dtype == "int8":
        codes = codes.view(np.int8)
        want = codes.astype(np.float32)
    else:
        want = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    got = np.empty(256, np.float32)
    nk.convert_bits(codes, got)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3fn"])
def test_quantized_matches_reference_on_dequantized_values(kv_dtype, variant, kernel_calls):
    """Hard tokens (an outlier channel, all-zero, huge and tiny tokens), ragged rows,
    chunked prefill then decode, dead slots NaN, float32 and bfloat16 queries."""
    rng = np.random.default_rng(len(variant) + len(kv_dtype))
    B, hkv, G, d, S = 3, 2, 3, 64, 400
    calls = 0
    for dtype in ("float32", "bfloat16"):
        cache = gqakv.KVCache(B, hkv, S, d, dtype, backend="numba", kv_dtype=kv_dtype)
        cache.store.fill(np.nan)
        model = ([np.zeros((hkv, 0, d))] * B, [np.zeros((hkv, 0, d))] * B)
        model = (list(model[0]), list(model[1]))
        _grow(rng, cache, model, [[300, 0, 37], [13, 0, 16]], dtype, hard=True)
        for n_new, T in (([KERNEL_MAX_QUERIES, 4, 0], KERNEL_MAX_QUERIES), ([1, 1, 1], 1)):
            _grow(rng, cache, model, [n_new], dtype, hard=True)
            _attend_both_ways(rng, cache, model, n_new, T, G, VARIANTS[variant], dtype)
            calls += 1
    assert kernel_calls == ["Quantized", "Quantized"] * calls


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3fn"])
def test_paged_quantized_matches_reference(kv_dtype, page_size, kernel_calls):
    """Quantized pages (codes and scales paged through one table): hard tokens, a fork
    sharing pages, chunked prefill then decode with every variant, unused pages NaN."""
    rng = np.random.default_rng(page_size + len(kv_dtype))
    B, hkv, G, d, S = 3, 2, 3, 32, 300
    cache = gqakv.PagedKVCache(B, hkv, S, d, "bfloat16", backend="numba", page_size=page_size,
                               kv_dtype=kv_dtype)
    cache.store.fill(np.nan)
    model = ([np.zeros((hkv, 0, d))] * B, [np.zeros((hkv, 0, d))] * B)
    model = (list(model[0]), list(model[1]))
    _grow(rng, cache, model, [[200, 0, 37], [13, 0, 16]], "bfloat16", hard=True)
    cache.fork(0, [1])
    for m in model:
        m[1] = m[0].copy()
    calls = 0
    for variant in VARIANTS.values():
        for n_new, T in (([KERNEL_MAX_QUERIES, 4, 0], KERNEL_MAX_QUERIES), ([1, 1, 1], 1)):
            _grow(rng, cache, model, [n_new], "bfloat16", hard=True)
            _attend_both_ways(rng, cache, model, n_new, T, G, variant, "bfloat16")
            calls += 1
    assert cache.store.page_table.audit(cache.host_lens) == []
    assert kernel_calls == ["PagedQuantized", "PagedQuantized"] * calls


# -- routing -------------------------------------------------------------------------------------

def test_route_of_each_storage_kind():
    """Paged and quantized stores take the kernel; float64 pools and long chunks keep the
    NumPy paths, with the reason."""
    b = NumbaBackend()
    q1 = np.zeros((1, 4, 1, 8), np.float32)
    for cache in (gqakv.PagedKVCache(1, 2, 64, 8, "bfloat16", backend="numba", page_size=16),
                  gqakv.KVCache(1, 2, 64, 8, "float32", backend="numba", kv_dtype="int8"),
                  gqakv.KVCache(1, 2, 64, 8, "bfloat16", backend="numba",
                                kv_dtype="float8_e4m3fn"),
                  gqakv.PagedKVCache(1, 2, 64, 8, "float32", backend="numba", page_size=4,
                                     kv_dtype="int8")):
        s = cache.store
        assert b.attention_route(q1, s.k, s.v, s) == ("numba kernel", "")
        route, why = b.attention_route(np.zeros((1, 4, 17, 8), np.float32), s.k, s.v, s)
        assert route == "numpy BLAS" and "T=17" in why
    s = gqakv.PagedKVCache(1, 2, 64, 8, "float64", backend="numba").store
    route, why = b.attention_route(q1, s.k, s.v, s)
    assert route == "numpy BLAS" and "dtype=float64" in why


def test_long_chunks_over_paged_and_quantized_take_the_numpy_paths(monkeypatch, kernel_calls):
    """A 20-query chunk over 150 keys (rows longer than ``KERNEL_SHORT_ROW_KEYS``, whose
    chunks the kernels take at any length) over paged, 8-bit or paged 8-bit storage goes
    to the NumPy item kernel (BLAS) through the store's reader (pages, the 8-bit reader
    over rows or over pages), not the kernel."""
    from gqakv_backends import numpy_readers

    used = []
    real = numpy_readers.reader_of

    def spy(store, rows, *args):
        reader = real(store, rows, *args)
        used.append((type(reader).__name__, type(reader.base).__name__))
        return reader

    monkeypatch.setattr(numpy_readers, "reader_of", spy)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 1, 150, 8)).astype(np.float32)
    q = rng.standard_normal((1, 2, 20, 8)).astype(np.float32)
    for cache in (gqakv.PagedKVCache(1, 1, 160, 8, backend="numba", page_size=4),
                  gqakv.KVCache(1, 1, 160, 8, backend="numba", kv_dtype="int8"),
                  gqakv.PagedKVCache(1, 1, 160, 8, backend="numba", page_size=4, kv_dtype="int8")):
        cache.append(x, x, [150])  # the chunk: its last 20 tokens
        out = gqakv.gqa_attention(q, cache, [20])
        kx = held(x, {"kv_dtype": "int8"} if cache.store.quantized else {})
        want, _ = reference_on_buffers(q, kx, kx, [150], [20], 1 / math.sqrt(8))
        np.testing.assert_allclose(out, want, atol=1e-5)
    assert used == [("Plain", "Pages"), ("Coded", "Rows"), ("Coded", "Pages")]
    assert kernel_calls == []


# -- writes and row copies (numba_kernels.write_tokens / copy_rows) ----------------------------

BITS = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def _bits(a):
    a = np.asarray(a)
    return a.view(BITS[a.itemsize])


def _spy(monkeypatch, name):
    """Count calls of kernel ``name`` (the backend looks it up on the module at each call)."""
    calls = []
    real = getattr(nk, name)

    def spy(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(nk, name, spy)
    return calls


def _twin(make, dtype):
    """The same cache on numba and on numpy (the reference path), every slot NaN first,
    so a write outside the live tokens shows."""
    caches = [make(backend) for backend in ("numba", "numpy")]
    for c in caches:
        c.store.fill(np.nan)
    return caches


def _same_storage(a, b):
    assert np.array_equal(a.host_lens, b.host_lens)
    for x, y in ((a.store.k, b.store.k), (a.store.v, b.store.v)):
        assert np.array_equal(_bits(x), _bits(y))  # bit for bit, NaN slots included


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_append_kernel_writes_what_the_numpy_path_writes(dtype, monkeypatch):
    """Ragged appends (a row of 0), ``rows=``, a strided k_new (one run per token) and a
    k_new whose last axis is strided (the NumPy path): bit-identical buffers."""
    calls = _spy(monkeypatch, "write_tokens")
    rng = np.random.default_rng(0)
    caches = _twin(lambda b: gqakv.KVCache(4, 2, 24, 8, dtype=dtype, backend=b), dtype)
    x = rng.standard_normal((3, 2, 12, 8)).astype(NP.get(dtype, dtype))
    y = rng.standard_normal((3, 2, 8, 12)).astype(NP.get(dtype, dtype)).transpose(0, 1, 3, 2)
    for c in caches:
        c.append(x[:, :, :6], x[:, :, 6:], [6, 0, 3], rows=[0, 1, 2])
        c.append(x[:, :, ::2], x[:, :, 1::2], [2, 6, 1], rows=[3, 0, 1])
        c.append(y, y, [1, 2, 3], rows=[2, 1, 0])  # last axis strided
    _same_storage(*caches)
    assert len(calls) == 2  # the strided-last-axis append took the NumPy path


def test_append_kernel_leaves_paged_and_quantized_storage_to_the_numpy_path(monkeypatch):
    calls = _spy(monkeypatch, "write_tokens")
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 2, 5, 8)).astype(np.float32)
    for kwargs in (dict(storage="paged", page_size=4), dict(kv_dtype="int8")):
        a, b = (gqakv.KVCache(2, 2, 16, 8, backend=be, **kwargs) for be in ("numba", "numpy"))
        for c in (a, b):
            c.append(x, x, [5, 2])
        for row in range(2):
            for u, w in zip(a.live_kv(row), b.live_kv(row)):
                assert np.array_equal(np.asarray(u), np.asarray(w))
    assert calls == []


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_row_copy_kernel_copies_what_the_numpy_path_copies(dtype, monkeypatch):
    """fork, reorder with a cycle (through the one-row temporary) and duplicates, on a
    KVCache and on a ModelKVCache (every layer): bit-identical buffers and lengths."""
    calls = _spy(monkeypatch, "copy_rows")
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 2, 9, 8)).astype(NP[dtype])
    caches = _twin(lambda b: gqakv.KVCache(5, 2, 20, 8, dtype=dtype, backend=b), dtype)
    for c in caches:
        c.append(x, x * 2, [9, 4, 0, 7], rows=[0, 1, 2, 3])
        c.fork(0, [4])
        c.reorder([1, 3, 0, 3, 2])  # a cycle 0 <- 1 <- 3 ... and a duplicate
    _same_storage(*caches)
    models = _twin(lambda b: gqakv.ModelKVCache(3, 4, 2, 20, 8, dtype=dtype, backend=b), dtype)
    for m in models:
        with m.step([9, 4, 0, 7]) as step:
            for layer in range(3):
                step.write(layer, x + layer, x - layer)
        m.reorder([2, 0, 1, 0])
        m.fork(1, [3])
    _same_storage(*models)
    assert len(calls) >= 4


def test_paged_page_copies_run_through_the_row_copy_kernel(monkeypatch):
    """A fork shares a partly filled last page; the next append copies it first (a pool
    page copy, ``paged.reserve``): through the kernel, with the NumPy path's result."""
    calls = _spy(monkeypatch, "copy_rows")
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 2, 6, 8)).astype(np.float32)
    caches = [gqakv.PagedKVCache(3, 2, 24, 8, backend=b, page_size=4) for b in ("numba", "numpy")]
    for c in caches:
        c.append(x, x, [6, 0, 0])  # row 0: a full page and a half-filled one
        c.fork(0, [1, 2])
        c.append(x[:, :, :2], x[:, :, 2:4], [1, 2, 1])  # each row writes into the shared page
    assert calls, "the shared last page was not copied through the kernel"
    for row in range(3):
        for u, w in zip(caches[0].live_kv(row), caches[1].live_kv(row)):
            assert np.array_equal(np.asarray(u), np.asarray(w))
    assert caches[0].pages_used == caches[1].pages_used
