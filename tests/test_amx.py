"""bfloat16 prefill on AMX tiles or AVX-512 BF16 dot products (``backends/amx.py``,
``backends/avx512_bf16.py``, ``backends/amx_prefill.py``).

What runs anywhere: the kernel's IR verifies, the layout steps and the softmax step's
bfloat16 split against NumPy, and ``amx.matmul``'s refusals. What needs a CPU with AMX
or AVX-512 BF16 (skipped elsewhere, with the reason): each engine's product against
float64, and bfloat16 prefill through the public API reaching the product items (spied)
and matching both the float64 reference and the float32 path it replaces
(``GQAKV_AMX=0``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import gqakv

numba = pytest.importorskip("numba")
ml_dtypes = pytest.importorskip("ml_dtypes")

from gqakv_backends import amx, amx_prefill  # noqa: E402
from gqakv_backends import numba_kernels as nk  # noqa: E402

from gqakv.core.semantics import AttentionParams  # noqa: E402

from .support.blas import openblas_pthreads_or_skip  # noqa: E402
from .support.reference import reference_on_buffers  # noqa: E402

BF16 = ml_dtypes.bfloat16
needs_amx = pytest.mark.skipif(amx.why_not() is not None,
                               reason=f"no bfloat16 products here: {amx.why_not()}")


def _pairs(b):
    """B ``[h, K, N]`` as AMX reads it in rows: ``[h, K / 2, N, 2]``."""
    h, K, N = b.shape
    return np.ascontiguousarray(b.reshape(h, K // 2, 2, N).transpose(0, 1, 3, 2))


def test_the_kernel_ir_verifies():
    import llvmlite.binding as llvm

    from gqakv_backends import avx512_bf16

    llvm.parse_assembly(amx.kernel_ir()).verify()
    llvm.parse_assembly(avx512_bf16.kernel_ir("gqakv_test_bf16")).verify()


def _engines_here() -> list:
    """The product's engines this machine runs: AMX where ``amx.engine`` chose it, and the
    AVX-512 BF16 dot products wherever the CPU declares them (a CPU with AMX has those
    too, so both are tested there)."""
    engines = [amx.AMX_ENGINE] if amx.engine() == amx.AMX_ENGINE else []
    if amx.why_not() is None and "avx512_bf16" in amx._cpu_flags():
        engines.append(amx.DOT_ENGINE)
    return engines


def test_matmul_refuses_shapes_it_cannot_tile():
    a = np.zeros((1, 48, 32), np.uint16)  # 48 rows: not a multiple of 32
    with pytest.raises(ValueError, match=r"a \(1, 48, 32\)"):
        amx.matmul(a, np.zeros((1, 16, 32, 2), np.uint16), np.zeros((1, 48, 32), np.float32))
    a = np.zeros((1, 32, 64), np.uint16)[:, :, ::2]  # strided rows
    with pytest.raises(ValueError, match="contiguous"):
        amx.matmul(a, np.zeros((1, 16, 32, 2), np.uint16), np.zeros((1, 32, 32), np.float32))
    with pytest.raises(ValueError, match="float32"):
        amx.matmul(np.zeros((1, 32, 32), np.uint16), np.zeros((1, 16, 32, 2), np.uint16),
                   np.zeros((1, 32, 32), np.float64))


def test_amx_switch_names_itself(monkeypatch):
    monkeypatch.setenv(amx.ENV_AMX, "0")
    assert amx.why_not() == "GQAKV_AMX=0"


@pytest.mark.parametrize("engine_name", [amx.AMX_ENGINE, amx.DOT_ENGINE])
@pytest.mark.parametrize("heads, M, K, N, two, accumulate",
                         [(1, 32, 32, 32, False, False), (3, 64, 96, 64, True, True),
                          (2, 160, 512, 128, True, False), (1, 96, 128, 544, False, True)])
def test_matmul_matches_float64(heads, M, K, N, two, accumulate, engine_name):
    """Each product of bfloat16 values is exact in float32, so the only error is float32
    accumulation: at most (K + 1) float32 ulps of the sum of absolute terms. Rows padded
    past their length (the prefill's pitched buffers) and C accumulated into. Each engine
    the CPU has (AMX tiles, AVX-512 BF16 dot products)."""
    if engine_name not in _engines_here():
        pytest.skip(f"no {engine_name} here: {amx.why_not() or 'the CPU does not declare it'}")
    rng = np.random.default_rng(heads * M + K + N)
    a1 = np.zeros((heads, M, K + 16), BF16)[..., :K]
    a1[...] = rng.standard_normal((heads, M, K))
    a2 = None
    if two:
        a2 = np.zeros((heads, M, K + 16), BF16)[..., :K]
        a2[...] = rng.standard_normal((heads, M, K)) * 2.0 ** -9
    b = rng.standard_normal((heads, K, N)).astype(BF16)
    c0 = rng.standard_normal((heads, M, N)).astype(np.float32)
    c = np.zeros((heads, M, N + 16), np.float32)[..., :N]
    c[...] = c0
    amx.matmul(a1, _pairs(b), c, a2=a2, accumulate=accumulate, engine_name=engine_name)
    terms = [(a1, b)] + ([(a2, b)] if two else [])
    want = sum(x.astype(np.float64) @ y.astype(np.float64) for x, y in terms)
    size = sum(np.abs(x.astype(np.float64)) @ np.abs(y.astype(np.float64)) for x, y in terms)
    if accumulate:
        want, size = want + c0, size + np.abs(c0)
    assert np.all(np.abs(c - want) <= (len(terms) * K + 2) * 2.0 ** -24 * size)


@pytest.mark.parametrize("K", [0, 5, 32, 77])
def test_layout_steps_match_numpy(K):
    rng = np.random.default_rng(K)
    hh, d = 2, 64
    Kp = -(-K // 32) * 32
    k = rng.integers(0, 2 ** 16, (hh, K, d), dtype=np.uint16)
    v = rng.integers(0, 2 ** 16, (hh, K, d), dtype=np.uint16)
    kt = np.full((hh, d // 2, Kp + 8, 2), 7, np.uint16)[:, :, :Kp]
    amx_prefill.keys_as_pairs(k.view(np.uint32), kt.view(np.uint32)[..., 0])
    k_padded = np.zeros((hh, Kp, d), np.uint16)
    k_padded[:, :K] = k
    np.testing.assert_array_equal(kt, k_padded.reshape(hh, Kp, d // 2, 2).transpose(0, 2, 1, 3))
    vv = np.full((hh, Kp // 2, d + 8, 2), 7, np.uint16)[:, :, :d]
    amx_prefill.values_as_pairs(v, vv)
    v_padded = np.zeros((hh, Kp, d), np.uint16)
    v_padded[:, :K] = v
    np.testing.assert_array_equal(vv, _pairs(v_padded.view(BF16)).view(np.uint16))


@pytest.mark.parametrize("window", [0, 6])
def test_softmax_step_scales_and_splits_p_into_bfloat16_parts(window):
    """``scale``: m is the scaled max, p = exp(scale * s - m) (within exp's 2 ulp of
    float64, the argument formed as the kernel forms it, one rounding). ``p_hi``/``p_lo``:
    the step writes p's parts instead of p, p_hi = p's top 16 bits and p_lo = (p - p_hi)'s
    (m and alpha bit for bit as without them, l within its summation bound), so p_hi +
    p_lo is within 2^-14 of p and not above it. Columns past ``keys`` (padding) and
    masked keys are zero in both parts."""
    rng = np.random.default_rng(window)
    nq, G, K, keys, scale, pos0 = 7, 3, 64, 45, np.float32(0.37), 30
    R = nq * G
    s = (rng.standard_normal((R, K)) * 6).astype(np.float32)
    m0 = np.full(R, -np.inf, np.float32)
    l0 = np.zeros(R, np.float32)
    none = np.empty((0, 0), np.uint16)
    p = s.copy()
    m, l, alpha = m0.copy(), l0.copy(), np.empty(R, np.float32)
    nk.softmax_block(p, m, l, alpha, nq, pos0, window, scale, keys, none, none)
    for r in range(R):  # against the definition
        end = pos0 + r % nq + 1
        hi = min(keys, end)
        lo = 0 if window <= 0 else min(hi, max(0, end - window))
        assert m[r] == np.float32(s[r, lo:hi].max() * scale)
        arg = (s[r, lo:hi].astype(np.float64) * np.float64(scale) - m[r]).astype(np.float32)
        np.testing.assert_allclose(p[r, lo:hi], np.exp(arg.astype(np.float64)), rtol=2.4e-7, atol=0)
        assert not p[r, :lo].any() and not p[r, hi:].any()
    hi, lo = np.full((R, K), 9, np.uint16), np.full((R, K), 9, np.uint16)
    m2, l2, alpha2 = m0.copy(), l0.copy(), np.empty(R, np.float32)
    nk.softmax_block(s.copy(), m2, l2, alpha2, nq, pos0, window, scale, keys, hi, lo)
    np.testing.assert_array_equal(m, m2)
    np.testing.assert_array_equal(alpha, alpha2)
    np.testing.assert_allclose(l, l2, rtol=K * 2.0 ** -24, atol=0)  # vectorized in another order
    bits = p.view(np.uint32)
    np.testing.assert_array_equal(hi, (bits >> 16).astype(np.uint16))
    rest = p - (bits & np.uint32(0xFFFF0000)).view(np.float32)
    np.testing.assert_array_equal(lo, (rest.view(np.uint32) >> 16).astype(np.uint16))
    parts = hi.view(BF16).astype(np.float64) + lo.view(BF16).astype(np.float64)
    assert np.all(parts <= p) and np.all(parts >= p * (1 - 2.0 ** -14))
    assert not hi[:, keys:].any() and not lo[:, keys:].any()
    assert (p[:, :keys] > 0).sum() < R * keys  # some keys masked (zero in both)


def _spy_items(monkeypatch):
    calls = []
    real = amx_prefill.attend_item

    def spy(*args, **kwargs):
        state = real(*args, **kwargs)
        if state is not None:  # ran here (None: declined to the float32 path)
            calls.append(kwargs["tiles"].shape)
        return state

    monkeypatch.setattr(amx_prefill, "attend_item", spy)
    return calls


def _prefill(rng, storage, lens, n_new, hkv, G, d, variant, dtype=BF16):
    """A cache filled to ``lens`` and bfloat16 queries for the last ``n_new`` of each row;
    returns (cache, q, k, v, params) with k, v [B, hkv, max_len, d] as stored."""
    B, max_len = len(lens), max(lens) + 3
    k = np.zeros((B, hkv, max_len, d), dtype)
    v = np.zeros((B, hkv, max_len, d), dtype)
    for b, L in enumerate(lens):
        k[b, :, :L] = rng.standard_normal((hkv, L, d))
        v[b, :, :L] = rng.standard_normal((hkv, L, d))
    q = (2 * rng.standard_normal((B, hkv * G, max(max(n_new), 1), d))).astype(dtype)
    kw = dict(page_size=16) if storage == "paged" else {}
    cls = gqakv.PagedKVCache if storage == "paged" else gqakv.KVCache
    dtype_name = gqakv.core.dtypes.canonical_name(np.dtype(dtype))
    cache = cls(B, hkv, max_len, d, dtype=dtype_name, backend="numba", **kw)
    cache.append(k[:, :, :max(lens)], v[:, :, :max(lens)], lens)
    return cache, q, k, v, AttentionParams(scale=1.0 / math.sqrt(d), **variant)


@needs_amx
@pytest.mark.parametrize("storage", ["contiguous", "paged"])
@pytest.mark.parametrize("seed", range(4))
def test_bfloat16_prefill_runs_on_amx_and_matches(monkeypatch, storage, seed):
    """Ragged rows (one empty, one decoding beside long chunks), G = 2..7, d = 32..128,
    rows and keys off multiples of 32, and the variants the AMX items take (window,
    soft-cap, sinks): the items ran on AMX, the output is within twice bfloat16's rounding
    of the float64 reference, and within one bfloat16 ulp of the float32 path it replaces
    (where an output cancels to near zero, within P's split bound; lse within float32
    noise)."""
    rng = np.random.default_rng(3000 + seed)
    hkv, G, d = [(2, 4, 64), (1, 7, 32), (3, 3, 128), (2, 2, 96)][seed]
    lens = [int(rng.integers(300, 700)), 0, int(rng.integers(20, 90)), 41]
    n_new = [int(rng.integers(20, 300)), 0, lens[2], 1]
    variant = [{}, {"window": int(rng.integers(20, 200))}, {"softcap": 7.5},
               {"sinks": tuple(float(x) for x in rng.standard_normal(hkv * G))}][seed]
    cache, q, k, v, params = _prefill(rng, storage, lens, n_new, hkv, G, d, variant)
    calls = _spy_items(monkeypatch)
    out, lse = gqakv.gqa_attention(q, cache, n_new, params=params, return_lse=True)
    assert calls, "no item ran on AMX"
    want, want_lse = reference_on_buffers(q.astype(np.float64), k.astype(np.float64),
                                          v.astype(np.float64), lens, n_new, params.scale, **variant)
    got = out.astype(np.float64)
    rounding = np.abs(want.astype(BF16).astype(np.float64) - want).max()
    assert np.abs(got - want).max() <= 2 * rounding + 1e-6
    for b, n in enumerate(n_new):  # padded queries are exactly 0
        assert not out[b, :, n:].astype(np.float64).any()
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    fin = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[fin], want_lse[fin], rtol=1e-6, atol=2e-5)
    if storage == "paged":  # laid out from the pool's pages: the gathered blocks' bits
        monkeypatch.setattr(amx_prefill, "_pools_in_place", lambda *args: None)
        gathered, gathered_lse = gqakv.gqa_attention(q, cache, n_new, params=params,
                                                     return_lse=True)
        np.testing.assert_array_equal(gathered, out)
        np.testing.assert_array_equal(gathered_lse, lse)
        monkeypatch.undo()
        calls = _spy_items(monkeypatch)
    monkeypatch.setenv(amx.ENV_AMX, "0")
    calls.clear()
    out32, lse32 = gqakv.gqa_attention(q, cache, n_new, params=params, return_lse=True)
    assert not calls
    a, b = got, out32.astype(np.float64)
    # one bfloat16 ulp, plus P's split bound (2^-14 of sum p |v| / l <= max |v|) where
    # an output cancels to near zero
    slack = 2.0 ** -14 * np.abs(v.astype(np.float64)).max()
    assert np.all(np.abs(a - b) <= 2.0 ** -7 * np.maximum(np.abs(a), np.abs(b)) + slack)
    np.testing.assert_allclose(lse[fin], lse32[fin], rtol=1e-6, atol=1e-5)


@needs_amx
@pytest.mark.parametrize("why", ["alibi", "float16", "d80", "switch", "small"])
def test_calls_the_amx_items_decline_take_the_float32_path(monkeypatch, why):
    """ALiBi (a position-dependent score hook), float16, d off multiples of 32,
    ``GQAKV_AMX=0`` and items below ``MIN_ITEM_WORK``: the float32 path, still right."""
    rng = np.random.default_rng(7)
    hkv, G, d = 2, 2, 80 if why == "d80" else 64
    variant = {"alibi_slopes": (0.5, 0.25, 0.125, 0.0625)} if why == "alibi" else {}
    dtype = np.float16 if why == "float16" else BF16
    # rows past numba's KERNEL_SHORT_ROW_KEYS (shorter ones take the kernels, not this path)
    lens, n_new = ([140, 20], [12, 20]) if why == "small" else ([150, 60], [40, 60])
    cache, q, k, v, params = _prefill(rng, "contiguous", lens, n_new, hkv, G, d, variant, dtype)
    if why == "switch":
        monkeypatch.setenv(amx.ENV_AMX, "0")
    calls = _spy_items(monkeypatch)
    out = gqakv.gqa_attention(q, cache, n_new, params=params)
    assert not calls
    want, _ = reference_on_buffers(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                                   lens, n_new, params.scale, **variant)
    rounding = np.abs(want.astype(dtype).astype(np.float64) - want).max()
    assert np.abs(out.astype(np.float64) - want).max() <= 2 * rounding + 1e-6


@needs_amx
@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_selftest_long_prefill_line_reaches_the_tiles(kv_dtype):
    """``gqakv selftest --backend numba``'s long-prefill lines (plain and int8 storage) run
    bfloat16 items on the tiles where the CPU has them (the note counts them, through
    ``served_counts``), and no float32 item (the tiles take bfloat16 queries only)."""
    from gqakv.tools import selftest

    backend = gqakv.get_backend("numba")
    name = selftest.LONG_PREFILL_INT8 if kv_dtype else selftest.LONG_PREFILL
    lines = {}
    for dtype in ("bfloat16", "float32"):
        checks = {f: selftest.Check(f, dtype) for f in selftest.FAMILIES[1:]}
        before = amx_prefill.items_served()
        selftest._long_prefill(backend, dtype, np.random.default_rng(0), True, checks, kv_dtype)
        lines[dtype] = (checks[name], amx_prefill.items_served() - before)
    line, served = lines["bfloat16"]
    assert line.passed and line.cases > 0 and served > 0
    assert line.note == f"items on bf16 products: {served}"
    line, served = lines["float32"]
    assert line.passed and line.cases > 0 and served == 0 and line.note == "items on bf16 products: 0"


def test_served_counts_read_zero_without_loading_the_tiles_module():
    """The base Backend counts nothing; numba's count reads 0 in a fresh process without
    importing ``amx_prefill`` (which would compile its kernels)."""
    import subprocess
    import sys

    from gqakv.dispatch.backend import Backend

    assert Backend.served_counts(gqakv.get_backend("numpy")) == {}
    code = ("import sys, gqakv; b = gqakv.get_backend('numba'); "
            "print(b.served_counts(), 'gqakv_backends.amx_prefill' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "{'items on bf16 products': 0} False", out.stdout + out.stderr


def test_float32_queries_holding_bfloat16_values_are_taken_others_named():
    """The items take bfloat16 queries and float32 queries whose values are bfloat16 (a
    caller's widened queries, as the shared-prefix plan's parts: the tiles multiply them
    exactly); a float32 query off bfloat16 by one ulp, or float16 queries, are declined
    with the reason (the float32 path runs them: never rounded to fit)."""
    from gqakv_backends.numpy_readers import Plain, Rows

    rng = np.random.default_rng(41)
    k = rng.standard_normal((2, 2, 40, 64)).astype(BF16)
    reader = Plain(Rows((k, k.copy()), np.arange(2)))
    params = AttentionParams(scale=0.125)
    q = rng.standard_normal((2, 8, 3, 64)).astype(BF16)
    q32 = q.astype(np.float32)
    assert amx_prefill.holds_bfloat16(q32) and not amx_prefill.holds_bfloat16(q)
    assert amx_prefill.declines(q, reader, params, None) == amx.why_not()
    assert amx_prefill.declines(q32, reader, params, None) == amx.why_not()
    off = q32.copy()
    off[1, 3, 2, 5] = np.nextafter(off[1, 3, 2, 5], np.float32(np.inf))
    assert not amx_prefill.holds_bfloat16(off)
    for bad in (off, q.astype(np.float16), off[:, 1::2]):  # a strided view too
        assert "bfloat16 queries" in amx_prefill.declines(bad, reader, params, None)
    f16_cache = Plain(Rows((k.astype(np.float16), k.astype(np.float16)), np.arange(2)))
    assert amx_prefill.declines(q, f16_cache, params, None).startswith(
        "bf16-product items need a plain bfloat16 cache")


@needs_amx
def test_a_bfloat16_shared_prefix_call_runs_on_amx(monkeypatch):
    """Rows forked from one bfloat16 prompt, decoding one token each: the shared-prefix
    plan's shared call (its G x rows tile past the kernels' rows, so the BLAS path's
    items) runs on the tiles though the plan widens its queries to float32, and the
    result is the float64 reference's within bfloat16's rounding."""
    rng = np.random.default_rng(43)
    from gqakv.ops.shared_prefix import min_saved_tokens
    from gqakv.storage.store import StorageSpec

    rows, hkv, G, d = 20, 2, 4, 128
    least = min_saved_tokens(gqakv.get_backend("numba"), StorageSpec.of("bfloat16"), d)
    prefix = -(-least // (rows - 1) // 16) * 16  # whole pages saving enough reads for a group
    cache = gqakv.PagedKVCache(rows, hkv, prefix + 8, d, dtype="bfloat16", backend="numba",
                               page_size=16)
    pk = rng.standard_normal((1, hkv, prefix, d)).astype(BF16)
    pv = rng.standard_normal((1, hkv, prefix, d)).astype(BF16)
    cache.append(pk, pv, [prefix], rows=[0])
    cache.fork(0, list(range(1, rows)))
    kn = rng.standard_normal((rows, hkv, 1, d)).astype(BF16)
    vn = rng.standard_normal((rows, hkv, 1, d)).astype(BF16)
    cache.append(kn, vn, [1] * rows)
    q = rng.standard_normal((rows, hkv * G, 1, d)).astype(BF16)
    plan = gqakv.plan_attention(cache, [1] * rows, q_heads=hkv * G)
    assert plan.shared_prefix.used, plan.shared_prefix.reason
    calls = _spy_items(monkeypatch)
    out = plan.run(q, cache)
    assert calls and all(shape[1] == G * rows for shape in calls), calls
    k = np.concatenate([np.broadcast_to(pk, (rows,) + pk.shape[1:]), kn], axis=2)
    v = np.concatenate([np.broadcast_to(pv, (rows,) + pv.shape[1:]), vn], axis=2)
    want, _ = reference_on_buffers(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                                   [prefix + 1] * rows, [1] * rows, 1.0 / math.sqrt(d))
    rounding = np.abs(want.astype(BF16).astype(np.float64) - want).max()
    assert np.abs(out.astype(np.float64) - want).max() <= 2 * rounding + 1e-6


@needs_amx
@pytest.mark.parametrize("storage", ["contiguous", "paged"])
@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3fn"])
def test_8bit_codes_run_on_amx_and_match(monkeypatch, storage, kv_dtype):
    """bfloat16 queries over int8 / e4m3 codes with per-token scales: the items run on the
    tiles (codes as bfloat16, exactly; each key's scale on its score column, each value's
    on its p), within twice bfloat16's rounding of the float64 reference over the
    dequantized values, and within one bfloat16 ulp plus P's split bound of the float32
    path (``GQAKV_AMX=0``); a soft-capped, windowed call as well."""
    from gqakv.storage.quantize import dequantize

    rng = np.random.default_rng(59 if kv_dtype == "int8" else 61)
    hkv, G, d = 2, 4, 64
    lens, n_new = [420, 0, 260], [150, 0, 260]
    B, max_len = len(lens), max(lens) + 3
    x = [rng.standard_normal((B, hkv, max(lens), d)).astype(BF16) for _ in range(2)]
    kw = dict(page_size=16) if storage == "paged" else {}
    cls = gqakv.PagedKVCache if storage == "paged" else gqakv.KVCache
    cache = cls(B, hkv, max_len, d, dtype="bfloat16", backend="numba", kv_dtype=kv_dtype, **kw)
    cache.append(x[0], x[1], lens)
    held = []  # the values the cache holds: its codes times their scales (live slots only read)
    for codes, scales in ((cache.store.k, cache.store.k_scale), (cache.store.v, cache.store.v_scale)):
        if storage == "paged":
            codes = np.stack([codes[cache.store.page_table.entries[b, :max_len // 16 + 1]]
                              .transpose(1, 0, 2, 3).reshape(hkv, -1, d)[:, :max_len] for b in range(B)])
            scales = np.stack([scales[cache.store.page_table.entries[b, :max_len // 16 + 1]]
                               .transpose(1, 0, 2).reshape(hkv, -1)[:, :max_len] for b in range(B)])
        with np.errstate(over="ignore", invalid="ignore"):  # unwritten slots hold anything
            held.append(np.asarray(dequantize(np, codes[:, :, :max_len], scales[:, :, :max_len],
                                              kv_dtype), np.float64))
    q = (2 * rng.standard_normal((B, hkv * G, max(n_new), d))).astype(BF16)
    for variant in ({}, {"softcap": 9.0, "window": 100}):
        params = AttentionParams(scale=1.0 / math.sqrt(d), **variant)
        calls = _spy_items(monkeypatch)
        out, lse = gqakv.gqa_attention(q, cache, n_new, params=params, return_lse=True)
        assert calls, "no item ran on AMX"
        want, want_lse = reference_on_buffers(q.astype(np.float64), held[0], held[1], lens, n_new,
                                              params.scale, **variant)
        got = out.astype(np.float64)
        rounding = np.abs(want.astype(BF16).astype(np.float64) - want).max()
        assert np.abs(got - want).max() <= 2 * rounding + 1e-6
        fin = np.isfinite(want_lse)
        np.testing.assert_allclose(lse[fin], want_lse[fin], rtol=1e-6, atol=2e-5)
        monkeypatch.setenv(amx.ENV_AMX, "0")
        calls.clear()
        out32 = gqakv.gqa_attention(q, cache, n_new, params=params).astype(np.float64)
        assert not calls
        live_v = max(np.abs(held[1][b, :, :L]).max(initial=0.0) for b, L in enumerate(lens))
        slack = 2.0 ** -14 * live_v  # P's split bound (the module docstring)
        assert np.all(np.abs(got - out32) <= 2.0 ** -7 * np.maximum(np.abs(got), np.abs(out32)) + slack)
        monkeypatch.undo()


@needs_amx
@pytest.mark.parametrize("planned", [False, True], ids=["call", "plan"])
def test_items_on_the_products_keep_two_workers_where_blas_spins(monkeypatch, planned):
    """Where OpenBLAS spins, a BLAS-path call below ``SPINNING_BLAS_ONE_WORKER_MACS`` runs
    on one worker and leaves its matmuls to BLAS's threads; items on the bfloat16 products
    use no BLAS thread, so a call they take keeps two workers (its items run on the pool's
    threads, planned per call or by ``gqakv.plan_attention``), while the same call on the
    float32 path (``GQAKV_AMX=0``) runs on the calling thread."""
    import threading

    from gqakv_backends import numpy_attention as na
    from gqakv_backends.cpu_plan import OPENBLAS_TIMEOUT_ENV

    threadpoolctl = openblas_pthreads_or_skip()
    monkeypatch.delenv(na.ENV_THREADS, raising=False)
    monkeypatch.delenv(OPENBLAS_TIMEOUT_ENV, raising=False)
    rng = np.random.default_rng(44)
    lens = n_new = [320, 256]
    cache, q, k, v, params = _prefill(rng, "contiguous", lens, n_new, 2, 4, 64, {})
    assert 4 * 2 * sum(n * n for n in n_new) // 2 * 64 < na.SPINNING_BLAS_ONE_WORKER_MACS
    threads = []
    real_item, real_attend = amx_prefill.attend_item, na._attend_item

    def item_spy(*args, **kwargs):
        threads.append(threading.get_ident())
        return real_item(*args, **kwargs)

    def float32_spy(*args, **kwargs):
        threads.append(threading.get_ident())
        return real_attend(*args, **kwargs)

    monkeypatch.setattr(amx_prefill, "attend_item", item_spy)
    monkeypatch.setattr(na, "_attend_item", float32_spy)

    def run():
        threads.clear()
        if planned:
            return gqakv.plan_attention(cache, n_new, q_heads=q.shape[1]).run(q, cache)
        return gqakv.gqa_attention(q, cache, n_new, params=params)

    with threadpoolctl.threadpool_limits(2, user_api="blas"):
        out = run()
        assert len(threads) > 1 and threading.get_ident() not in threads, threads
        monkeypatch.setenv(amx.ENV_AMX, "0")
        out32 = run()
        assert threads and set(threads) == {threading.get_ident()}, threads
    want, _ = reference_on_buffers(q.astype(np.float64), k.astype(np.float64),
                                   v.astype(np.float64), lens, n_new, params.scale)
    rounding = np.abs(want.astype(BF16).astype(np.float64) - want).max()
    for got in (out, out32):
        assert np.abs(got.astype(np.float64) - want).max() <= 2 * rounding + 1e-6
